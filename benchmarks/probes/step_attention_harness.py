"""What the decoder-step attention probes share (``probe_step_attention``, the standard forms
ONNX Runtime runs, and ``probe_custom_attention``, our own operator against them): the random
step data, the float64 references, sessions with every tensor bound by pointer, the check of
every form against float64 before it is timed, the side-by-side timing, the command-line
options and the loop over thread counts, row counts, cache capacities and beams.

Nothing here is a probe of its own: each probe builds its forms (``{name: (run, outputs, cache)}``,
or an error message for a form ONNX Runtime refuses) and hands them to :func:`check` and
:func:`timed`.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Callable, Optional

import numpy as np

from benchmarks.common import time_side_by_side, write_json
from transformer_ext.cli import add_option

NEG_INF = float("-inf")
RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")


# ------------------------------------------------------------------------------------------
# step data and float64 references
# ------------------------------------------------------------------------------------------


def self_data(rng, layers: int, R: int, H: int, L: int, D: int) -> dict:
    """A self-attention step's random tensors per layer: the projected ``q`` (scale folded in),
    the new ``k`` / ``v`` ``[R, H, D]`` and the caches ``kc`` / ``vc`` ``[R, H, L, D]``, random
    and finite past the prefix too (every form must leave those positions out)."""
    return {
        "q": [rng.standard_normal((R, H, D), dtype=np.float32) * 0.125 for _ in range(layers)],
        "k": [rng.standard_normal((R, H, D), dtype=np.float32) for _ in range(layers)],
        "v": [rng.standard_normal((R, H, D), dtype=np.float32) for _ in range(layers)],
        "kc": [rng.standard_normal((R, H, L, D), dtype=np.float32) for _ in range(layers)],
        "vc": [rng.standard_normal((R, H, L, D), dtype=np.float32) for _ in range(layers)],
    }


def cross_data(rng, layers: int, B: int, K: int, H: int, S: int, D: int) -> dict:
    """A cross-attention step's random tensors: ragged source ``lengths`` (the first full), per
    layer ``q [B*K, H, D]`` and K/V once per source ``[B, H, S, D]``."""
    lengths = rng.integers(max(1, S // 2), S + 1, size=B)
    lengths[0] = S
    return {
        "lengths": lengths,
        "q": [rng.standard_normal((B * K, H, D), dtype=np.float32) * 0.125 for _ in range(layers)],
        "k": [rng.standard_normal((B, H, S, D), dtype=np.float32) for _ in range(layers)],
        "v": [rng.standard_normal((B, H, S, D), dtype=np.float32) for _ in range(layers)],
    }


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def self_reference(q, k_new, v_new, kc, vc, p: int, source_row: np.ndarray) -> np.ndarray:
    """``[R, H, D]`` float64: row ``r`` attends to cache position ``j < p`` of row
    ``source_row[r, j]`` and to its own new K/V. ``q``/``k_new``/``v_new`` ``[R, H, D]``."""
    j = np.arange(p)[None, :]
    keys = kc[source_row[:, :p], :, j].astype(np.float64)  # [R, p, H, D]
    values = vc[source_row[:, :p], :, j].astype(np.float64)
    q64 = q.astype(np.float64)
    scores = np.concatenate(
        [np.einsum("rhd,rjhd->rhj", q64, keys), np.einsum("rhd,rhd->rh", q64, k_new)[..., None]], axis=-1
    )
    probs = _softmax(scores)
    return np.einsum("rhj,rjhd->rhd", probs[..., :p], values) + probs[..., p:] * v_new.astype(np.float64)


def cross_reference(q, k, v, lengths: np.ndarray, K: int) -> np.ndarray:
    """``[R, H, D]`` float64: row ``r`` attends to source ``r // K``'s first ``lengths`` positions."""
    src = np.arange(q.shape[0]) // K
    scores = np.einsum("rhd,rhsd->rhs", q.astype(np.float64), k[src].astype(np.float64))
    keep = np.arange(k.shape[2])[None, :] < lengths[src][:, None]  # [R, S]
    scores = np.where(keep[:, None, :], scores, NEG_INF)
    return np.einsum("rhs,rhsd->rhd", _softmax(scores), v[src].astype(np.float64))


def own_rows(R: int, L: int) -> np.ndarray:
    """The ``source_row`` of :func:`self_reference` where every row reads its own cache."""
    return np.repeat(np.arange(R)[:, None], L, axis=1)


def cache_write_check(data: dict, layers: int, p: int) -> Callable:
    """``check(cache) -> max abs error`` of a self-attention form's cache after its step: the new
    K/V at position ``p``, the prefix untouched (:func:`self_data`'s tensors)."""

    def check_cache(cache) -> float:
        err = 0.0
        for i in range(layers):
            for buf, new, old in ((cache.key_layers[i], "k", "kc"), (cache.value_layers[i], "v", "vc")):
                err = max(err, float(np.max(np.abs(buf[:, :, p] - data[new][i]))))
                err = max(err, float(np.max(np.abs(buf[:, :, :p] - data[old][i][:, :, :p]))))
        return err

    return check_cache


# ------------------------------------------------------------------------------------------
# sessions and binding
# ------------------------------------------------------------------------------------------


class Bound:
    """One session with every input and output bound by pointer (the arrays are kept alive),
    made with ``OrtRunner``'s default session options; ``library``: a custom-operator library
    registered with them."""

    def __init__(self, model: bytes, threads: int, library: Optional[str] = None):
        import onnxruntime as ort

        from transformer_ext.runtimes import denormals
        from transformer_ext.runtimes.ort import DISABLED_OPTIMIZERS, FORCE_SPINNING_STOP

        so = ort.SessionOptions()  # OrtRunner's options (its defaults)
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.add_session_config_entry(FORCE_SPINNING_STOP, "1")
        for key, value in denormals.session_config().items():
            so.add_session_config_entry(key, value)
        if library is not None:
            so.register_custom_ops_library(library)
        self.session = ort.InferenceSession(
            model, so, providers=["CPUExecutionProvider"], disabled_optimizers=list(DISABLED_OPTIMIZERS)
        )
        self.binding = self.session.io_binding()
        self._call = denormals.call
        self.kept: list[np.ndarray] = []

    def bind_in(self, name: str, a: np.ndarray, shape=None) -> np.ndarray:
        if not a.flags.c_contiguous:
            raise ValueError(f"{name}: a bound array must be contiguous")
        self.kept.append(a)
        self.binding.bind_input(name, "cpu", 0, a.dtype, list(shape or a.shape), a.ctypes.data)
        return a

    def bind_out(self, name: str, a: np.ndarray, shape=None) -> np.ndarray:
        self.kept.append(a)
        self.binding.bind_output(name, "cpu", 0, a.dtype, list(shape or a.shape), a.ctypes.data)
        return a

    def run(self) -> None:
        self._call(self.session.run_with_iobinding, self.binding)


def caches(data: dict, layers: int, R: int, H: int, L: int, D: int, staging: bool):
    """A ``HostKVCache`` (the runner's) holding ``data``'s cache contents, ``length = L - 1``."""
    from transformer_ext.runtimes.kv_cache import HostKVCache

    cache = HostKVCache(layers, R, H, L, D, staging=staging)
    for i in range(layers):
        cache.key_layers[i][...] = data["kc"][i]
        cache.value_layers[i][...] = data["vc"][i]
    cache.set_length(L - 1)
    return cache


def build(forms: dict, name: str, fn: Callable) -> None:
    """``forms[name] = fn()``, or the first line of the error where ONNX Runtime refuses the form."""
    try:
        forms[name] = fn()
    except Exception as exc:  # ORT raises its own Fail / NotImplemented / InvalidGraph types
        forms[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"


# ------------------------------------------------------------------------------------------
# one case: check, then time
# ------------------------------------------------------------------------------------------


def check(args, forms: dict, want: list, cache_check) -> tuple[dict, dict, dict]:
    """Run every form once against its reference -> ``(errors, refused, runs of the valid forms)``."""
    errors, refused, valid = {}, {}, {}
    for name, form in forms.items():
        if isinstance(form, str):
            refused[name] = form
            continue
        run, outs, cache = form
        try:
            run()
        except Exception as exc:  # a kernel that fails at run time is reported like a refusal
            refused[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            continue
        R = want[0].shape[0]
        err = max(float(np.max(np.abs(o.reshape(R, -1) - w.reshape(R, -1)))) for o, w in zip(outs, want))
        rec = {"output": err}
        if cache is not None and cache_check is not None:
            rec["cache_write"] = cache_check(cache)
        errors[name] = rec
        if max(rec.values()) <= args.tolerance:
            valid[name] = run
    return errors, refused, valid


def timed(args, fns: dict, errors: dict, refused: dict) -> dict:
    """The valid forms ``fns`` timed side by side (medians, ``args.clock``), with the check's record."""
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    seconds = (
        time_side_by_side(fns, "cpu", repeats=args.runs, min_time=args.min_time, clock=clock) if fns else {}
    )
    return {
        "milliseconds": {k: t * 1e3 for k, t in seconds.items()},
        "max_abs_error": errors,
        "refused": refused,
        "invalid": sorted(k for k, e in errors.items() if max(e.values()) > args.tolerance),
    }


def print_case(rec: dict) -> None:
    what = f"cache {rec['cache_len']}" if rec["block"] == "self" else f"{rec['beams']} row(s)/source"
    ms = rec["milliseconds"]
    times = ", ".join(f"{k} {v:.3f}" for k, v in sorted(ms.items(), key=lambda kv: kv[1]))
    errs = ", ".join(f"{k} {max(e.values()):.1e}" for k, e in rec["max_abs_error"].items())
    print(
        f"{rec['block']:5s} {rec['rows']:4d} rows, {what}, {rec['threads']} thread(s): ms {times}", flush=True
    )
    print(
        f"      max abs error: {errs}" + (f"; refused: {rec['refused']}" if rec["refused"] else ""),
        flush=True,
    )


# ------------------------------------------------------------------------------------------
# command line and the loop over cases
# ------------------------------------------------------------------------------------------


def add_arguments(
    p: argparse.ArgumentParser,
    *,
    name: str,
    beams_help: str,
    cache_lens: str,
    threads: str,
    win_help: str,
    quick_help: str,
) -> None:
    """The options both probes take (their own defaults where they differ); ``--out`` defaults to
    ``benchmarks/results/<name>.json``."""
    p.add_argument("--rows", default="4,16,64,256", help="comma-separated decoder rows (sources x beams)")
    add_option(p, "--beam-size", deprecated=("--beams",), dest="beams", type=int, default=4, help=beams_help)
    p.add_argument("--layers", type=int, default=6, help="decoder layers per graph (each its own tensors)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument(
        "--cache-lens", default=cache_lens, help="self-attention cache capacities (new token last)"
    )
    p.add_argument("--src-len", type=int, default=24)
    p.add_argument("--threads", default=threads, help="comma-separated intra-op thread counts")
    p.add_argument("--runs", type=int, default=15, help="interleaved timed rounds per case (median)")
    p.add_argument("--min-time", type=float, default=0.005, help="seconds each timing lasts at least")
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall time (default), or this process's CPU time: at 1 thread a direction on a loaded machine",
    )
    p.add_argument("--tolerance", type=float, default=1e-4, help="max abs error against float64")
    p.add_argument("--win", type=float, default=1.15, help=win_help)
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument("--out", default=os.path.join(RESULTS, f"{name}.json"), help="JSON path (PNG beside it)")


def ints(p: argparse.ArgumentParser, text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        p.error(f"{flag}: expected comma-separated integers, got {text!r}")
    if not values or min(values) < 1:
        p.error(f"{flag}: expected positive integers, got {text!r}")
    return values


def checked_lists(p: argparse.ArgumentParser, args) -> tuple[list[int], list[int], list[int]]:
    """``(rows, threads, cache_lens)`` of :func:`add_arguments`'s options, every option checked
    (``p.error`` for a bad one)."""
    rows = ints(p, args.rows, "--rows")
    threads = ints(p, args.threads, "--threads")
    cache_lens = ints(p, args.cache_lens, "--cache-lens")
    for flag in ("beams", "layers", "heads", "head_size", "src_len", "runs"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1")
    if min(cache_lens) < 2:
        p.error("--cache-lens: every capacity must be at least 2 (one cached token and the new one)")
    if not (args.tolerance > 0 and args.win > 0 and args.min_time >= 0):
        p.error("--tolerance and --win must be positive, --min-time not negative")
    if not args.out.endswith(".json"):
        p.error(f"--out: expected a .json path, got {args.out!r}")
    return rows, threads, cache_lens


def header(args, cache_lens: list[int]) -> dict:
    """The start of a probe's JSON: ONNX Runtime's version, the shapes and the timing settings."""
    import onnxruntime as ort

    return {
        "onnxruntime": ort.__version__,
        "layers": args.layers,
        "heads": args.heads,
        "head_size": args.head_size,
        "cache_lens": cache_lens,
        "src_len": args.src_len,
        "beams": args.beams,
        "runs": args.runs,
        "tolerance": args.tolerance,
        "clock": args.clock,
    }


def run_cases(args, rows, threads, cache_lens, self_case: Callable, cross_case: Callable) -> list[dict]:
    """Every case, each printed as it is done: per thread count and row count ``R`` the
    self-attention at each cache capacity (``self_case(args, R, L, threads, rng)``), then the
    cross-attention at 1 and ``--beam-size`` rows per source where they divide ``R``
    (``cross_case(args, sources, K, threads, rng)``); one generator seeded 0 for all."""
    rng = np.random.default_rng(0)
    results = []
    for n in threads:
        for R in rows:
            for L in cache_lens:
                results.append(self_case(args, R, L, n, rng))
                print_case(results[-1])
            for K in sorted({1, args.beams}):
                if R % K:
                    continue
                results.append(cross_case(args, R // K, K, n, rng))
                print_case(results[-1])
    return results


def finish(out: dict, path: str, summary: dict, plot: Optional[Callable]) -> None:
    """``out`` with the load average after and ``summary`` written to ``path``, the plot
    (``plot(out, png)``; None: none) beside it, the verdicts printed."""
    out["load_average_after"] = list(os.getloadavg())
    out["summary"] = summary
    write_json(path, out)
    if plot is not None:
        plot(out, path[: -len(".json")] + ".png")
    for key, verdict in summary["verdicts"].items():
        print(f"{key}: {verdict}")
    print(f"wrote {path}")
