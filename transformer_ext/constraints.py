"""Token constraints of imported models' generation configs, applied to any runner's logits.

:class:`ConstrainedRunner` wraps a runner of the decoding protocol (docs/DESIGN.md section 1) and edits
the logits each step returns before the search sees them: at step ``t < len(forced_prefix)`` every
token but ``forced_prefix[t]`` is ``-inf`` and the forced one 0 (transformers'
``forced_bos_token_id``: an M2M100/NLLB translation starts with its target-language token), and
at every step the ``banned_ids`` are ``-inf`` (transformers' single-token ``bad_words_ids``: Marian
never generates ``<pad>``). Greedy and beam search are unchanged and do not know about it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

__all__ = ["ConstrainedRunner"]


@dataclass
class ConstrainedState:
    inner: Any  # the wrapped runner's state
    t: int = 0  # steps taken


class ConstrainedRunner:
    """``runner`` with forced first tokens and banned tokens (see the module docstring); every other
    attribute (``bos_id``, ``eos_id``, ``greedy`` ...) is the wrapped runner's."""

    def __init__(self, runner: Any, forced_prefix: Sequence[int] = (), banned_ids: Sequence[int] = ()):
        self.runner = runner
        self.forced_prefix = [int(i) for i in forced_prefix]
        self.banned_ids = np.array(sorted({int(i) for i in banned_ids}), dtype=np.int64)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["runner"], name)

    def encode(
        self, input_ids: Any, src_lengths: Any, cache_len: int, num_beams: int = 1
    ) -> ConstrainedState:
        return ConstrainedState(self.runner.encode(input_ids, src_lengths, cache_len, num_beams))

    def step(self, state: ConstrainedState, tokens: Any) -> np.ndarray:
        logits = np.asarray(self.runner.step(state.inner, tokens))
        t = state.t
        state.t += 1
        if t >= len(self.forced_prefix) and not self.banned_ids.size:
            return logits
        logits = np.array(logits, dtype=np.float32, copy=True)
        if t < len(self.forced_prefix):
            forced = self.forced_prefix[t]
            logits[:] = -np.inf
            logits[:, forced] = 0.0
        elif self.banned_ids.size:
            logits[:, self.banned_ids] = -np.inf
        return logits

    def reorder(self, state: ConstrainedState, beam_index: Any) -> None:
        self.runner.reorder(state.inner, beam_index)
