"""Runners and searches that tests/test_pool_processes.py sends to worker processes.

A worker imports this module to unpickle them, so it imports numpy and transformer_ext.decoding
only: never torch, never tests/helpers.py (which imports torch).
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np

from transformer_ext import decoding

V = 50
FAIL, INTERRUPT, DIE = 7, 8, 9  # a source holding one of these ids makes its part fail at step 3


class StepRunner:
    """A numpy runner whose next token is a function of (the source's first id, the step).

    Every step sleeps ``delay`` s and appends one byte to ``<log_dir>/<pid>`` (the steps this
    process made, read by the tests); at its 3rd step a part whose sources hold :data:`FAIL`
    raises RuntimeError, :data:`INTERRUPT` KeyboardInterrupt, and :data:`DIE` kills its process
    with SIGKILL.
    """

    info = "step runner"

    def __init__(self, delay: float = 0.0, log_dir: str | None = None):
        self.delay, self.log_dir = delay, log_dir

    def encode(self, input_ids, src_lengths, cache_len, beam_size=1):
        ids = np.asarray(input_ids)
        return {
            "first": np.repeat(ids[:, 0], beam_size),
            "t": 0,
            "marker": next((m for m in (FAIL, INTERRUPT, DIE) if (ids == m).any()), None),
        }

    def step(self, state, tokens):
        state["t"] += 1
        if self.log_dir is not None:
            with open(os.path.join(self.log_dir, str(os.getpid())), "ab") as f:
                f.write(b".")
        if state["t"] == 3 and state["marker"] == FAIL:
            raise RuntimeError("stopped by the test")
        if state["t"] == 3 and state["marker"] == INTERRUPT:
            raise KeyboardInterrupt("stopped by the test")
        if state["t"] == 3 and state["marker"] == DIE:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(self.delay)
        out = np.full((len(tokens), V), -20.0, dtype=np.float32)
        out[np.arange(len(tokens)), 3 + (state["first"] + state["t"]) % (V - 3)] = 0.0
        return out

    def reorder(self, state, beam_index):
        state["first"] = state["first"][np.asarray(beam_index)]

    def select(self, state, index):
        state["first"] = state["first"][decoding.check_select_index(index, len(state["first"]))]


def long_greedy(runner, src, lengths):
    """400 greedy steps (4 s at 10 ms a step): long enough to be stopped."""
    return decoding.greedy_decode(
        runner, src, lengths, bos_id=1, eos_id=2, max_decoding_length=400, min_decoding_length=400
    )


def short_greedy(runner, src, lengths):
    return decoding.greedy_decode(
        runner, src, lengths, bos_id=1, eos_id=2, max_decoding_length=5, min_decoding_length=5
    )


def expected_short(src) -> list[list[int]]:
    """What :func:`short_greedy` decodes with a :class:`StepRunner` (written out, not run)."""
    return [[3 + (int(row[0]) + t) % (V - 3) for t in range(1, 6)] for row in np.asarray(src)]


def about_worker(runner, src, lengths):
    """What the worker process is: its pid, whether torch is loaded, its SIGINT handler."""
    handler = signal.getsignal(signal.SIGINT)
    about = {"pid": os.getpid(), "torch": "torch" in sys.modules, "sigint_ignored": handler == signal.SIG_IGN}
    return [about] * len(src)


def unpicklable_result(runner, src, lengths):
    return [lambda: None] * len(src)


def too_few(runner, src, lengths):
    """A search that returns no result for its sources."""
    return []
