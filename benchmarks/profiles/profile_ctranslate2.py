"""Where CTranslate2's decode spends its time on an Intel CPU: every oneMKL call it makes, with
``MKL_VERBOSE=1``, grouped by routine and shape, beside the decode's wall time without it.

    python -m benchmarks.profiles.profile_ctranslate2 --model A/base/ct2_int8 --mode beam4 --batch 16
    python -m benchmarks.profiles.profile_ctranslate2 --model A/base/ct2 --mode greedy --batch 64 --threads 1

``A`` is a ``bench_decode.py --artifacts`` folder (``A/base/ct2`` float32, ``A/base/ct2_int8`` int8).
The decode is bench_decode's: random sources of length 24 (seed 0), exactly ``--new-tokens``
tokens, beam search without length penalty, run by ``decode_worker.py`` in a process of its own.
CTranslate2's x86 wheels do their matrix products in oneMKL (``GEMM_S8U8S32*`` for int8
weights, ``SGEMM*`` for float32, ``SGEMM_BATCH_STRIDED`` for the attention products), and oneMKL
logs each call with its duration when ``MKL_VERBOSE=1``: the profile is that log, summed. Two
worker processes: one with the log (one decode), one without (the wall time, median of
``--repeats``). Logging adds a cost per call, so the logged sum is an upper bound of the time in
oneMKL; the rest of the wall time (layer norms, softmax, the search, the cache) is outside it.

Categories: ``weights`` (a product with a weight matrix, row count = the step's rows),
``output projection`` (the weight's rows = the target vocabulary), ``attention`` (the batched
products), ``once per source`` (the encoder and the cross-attention K/V projections: row count
other than the step's), ``packing`` (weight packing at load time, left out of the sums).

The output for ONNX Runtime's side is ``profile_decode.py`` (per operator type); the two tables
side by side say which part of a step each engine does faster. Writes JSON (``--out``) and
prints a table. Needs ``ctranslate2`` (not a dependency of the package).
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import pickle
import re
import statistics
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import numpy as np

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (results/ lives here)

from benchmarks.common import environment, machine_info, write_json

SRC_LEN = 24
BEAM = 4
WORKER = os.path.join(HERE, "decode", "decode_worker.py")

# ``MKL_VERBOSE NAME(args) 12.3us CNR:...``: one call, its arguments and its duration.
_LINE = re.compile(
    r"^MKL_VERBOSE (?P<name>[A-Z0-9_]+)\((?P<args>[^)]*)\) (?P<time>[0-9.]+)(?P<unit>ns|us|ms|s)\b"
)
_UNIT_MS = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}


@dataclass(frozen=True)
class Call:
    """One logged oneMKL call: the routine, the product's ``m, n, k`` (as oneMKL names them: the
    output is ``m x n``), the batch count (1 unless batched) and the milliseconds it took."""

    name: str
    m: int
    n: int
    k: int
    batch: int
    ms: float

    @property
    def ops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.batch


def _ints(fields: Sequence[str], at: Sequence[int]) -> Optional[list]:
    try:
        return [int(fields[i]) for i in at]
    except (IndexError, ValueError):
        return None


def parse_line(line: str) -> Optional[Call]:
    """The :class:`Call` of one ``MKL_VERBOSE`` line, or None for a line that is not a matrix
    product (another routine, the banner, anything else). Recognised: ``SGEMM`` / ``GEMM_S8U8S32``
    (``transa, transb, [offsetc,] m, n, k, ...``), their ``_COMPUTE`` forms (packed operands, same
    layout), ``SGEMM_BATCH_STRIDED`` (``transa, transb, m, n, k, ..., batch`` last), and the
    ``*_PACK`` calls (kept with ``m = n = k = 0``: load-time packing)."""
    match = _LINE.match(line.strip())
    if not match:
        return None
    name, fields = match.group("name"), [f.strip() for f in match.group("args").split(",")]
    ms = float(match.group("time")) * _UNIT_MS[match.group("unit")]
    if name.endswith("_PACK") or name.endswith("_PACK_GET_SIZE"):
        return Call(name, 0, 0, 0, 1, ms)
    if name == "SGEMM_BATCH_STRIDED":
        dims = _ints(fields, (2, 3, 4))
        batch = _ints(fields, (len(fields) - 1,))
        return None if dims is None or batch is None else Call(name, *dims, batch[0], ms)
    if name in ("SGEMM", "SGEMM_COMPUTE"):
        dims = _ints(fields, (2, 3, 4))
    elif name in ("GEMM_S8U8S32", "GEMM_S8U8S32_COMPUTE"):
        dims = _ints(fields, (3, 4, 5))
    else:
        return None
    return None if dims is None else Call(name, *dims, 1, ms)


def category(call: Call, rows: int, vocab: int) -> str:
    """``packing``, ``attention``, ``output projection``, ``weights`` or ``once per source`` (see
    the module docstring); ``rows`` is the number of rows a decoder step runs on."""
    if call.m == 0:
        return "packing"
    if call.name == "SGEMM_BATCH_STRIDED":
        return "attention"
    # CTranslate2 multiplies weight x activations^T: m = the weight's output features, n = rows.
    if call.m == vocab and call.n == rows:
        return "output projection"
    if call.n == rows:
        return "weights"
    return "once per source"


def summarise(calls: Iterable[Call], rows: int, vocab: int, steps: int) -> dict:
    """Per category and per (routine, m, n, k, batch): calls, total ms, ms per decoder step,
    median GOP/s."""
    groups: dict = collections.defaultdict(list)
    for c in calls:
        groups[(category(c, rows, vocab), c.name, c.m, c.n, c.k, c.batch)].append(c)
    table, totals = [], collections.Counter()
    for (cat, name, m, n, k, batch), cs in sorted(groups.items(), key=lambda kv: -sum(c.ms for c in kv[1])):
        total = sum(c.ms for c in cs)
        totals[cat] += total
        rates = [c.ops / (c.ms * 1e6) for c in cs if c.ms > 0 and c.ops > 0]
        table.append(
            {
                "category": cat,
                "routine": name,
                "m": m,
                "n": n,
                "k": k,
                "batch": batch,
                "calls": len(cs),
                "total_ms": total,
                "ms_per_step": total / steps,
                "median_gops": statistics.median(rates) if rates else None,
            }
        )
    return {
        "by_category_ms": dict(totals),
        "by_category_ms_per_step": {c: v / steps for c, v in totals.items()},
        "groups": table,
    }


class _Worker:
    """decode_worker.py for CTranslate2, with or without the oneMKL log (captured from stderr)."""

    def __init__(self, spec: dict, verbose: bool):
        env = dict(os.environ)
        env.pop("MKL_VERBOSE", None)
        if verbose:
            env["MKL_VERBOSE"] = "1"
        self.proc = subprocess.Popen(
            [sys.executable, WORKER, json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE if verbose else subprocess.DEVNULL,
            env=env,
        )
        self._reader = None
        if verbose:
            self.lines: list[str] = []
            self._reader = threading.Thread(target=self._read_stderr, daemon=True)
            self._reader.start()
        kind, payload = pickle.load(self.proc.stdout)
        if kind != "ready":
            raise RuntimeError(f"the CTranslate2 worker failed to start:\n{payload}")

    def _read_stderr(self) -> None:
        for raw in self.proc.stderr:
            self.lines.append(raw.decode("utf-8", "replace"))

    def decode(self, mode, src, lengths, n) -> tuple[list, float]:
        pickle.dump(("decode", mode, src, lengths, n), self.proc.stdin)
        self.proc.stdin.flush()
        kind, payload = pickle.load(self.proc.stdout)
        if kind != "done":
            raise RuntimeError(f"the CTranslate2 worker failed:\n{payload}")
        return payload

    def close(self) -> None:
        try:
            pickle.dump(("stop",), self.proc.stdin)
            self.proc.stdin.flush()
            self.proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass
        self.proc.wait(timeout=60)
        if self._reader is not None:
            self._reader.join(timeout=10)


def _model_config(model: str) -> dict:
    """The vocabulary sizes of a CTranslate2 model folder (from its vocabulary files)."""
    sizes = {}
    for side in ("source", "target"):
        path = os.path.join(model, f"{side}_vocabulary.json")
        if not os.path.isfile(path):
            raise SystemExit(
                f"error: --model {model}: no {side}_vocabulary.json (a CTranslate2 model folder?)"
            )
        with open(path, encoding="utf-8") as f:
            sizes[side] = len(json.load(f))
    return sizes


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", required=True, help="a CTranslate2 model folder (bench_decode's A/base/ct2*)")
    p.add_argument("--mode", choices=("greedy", "beam4"), default="beam4")
    p.add_argument("--batch", type=int, default=16, help="sources per decode (default 16)")
    p.add_argument(
        "--compute-type",
        choices=("default", "float32", "int8", "int8_float32"),
        default="default",
        help="CTranslate2's compute_type (default: the type the model was converted with)",
    )
    p.add_argument("--threads", type=int, default=2, help="intra_threads (default 2)")
    p.add_argument("--new-tokens", type=int, default=48, help="tokens generated per source (default 48)")
    p.add_argument("--repeats", type=int, default=3, help="decodes timed without the log (default 3)")
    p.add_argument("--out", default=None, help="JSON path (default: print only)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = _parser().parse_args(argv)
    for name in ("batch", "threads", "new_tokens", "repeats"):
        if getattr(args, name) < 1:
            raise SystemExit(f"error: --{name.replace('_', '-')} must be at least 1")
    if not os.path.isdir(args.model):
        raise SystemExit(f"error: --model {args.model}: not a folder")
    try:
        import ctranslate2  # noqa: F401
    except ImportError:
        raise SystemExit("error: ctranslate2 is not installed (pip install ctranslate2==4.8.5)") from None
    sizes = _model_config(args.model)
    compute_type = args.compute_type
    spec = {
        "engine": "ctranslate2",
        "model": os.path.abspath(args.model),
        "threads": args.threads,
        "compute_type": compute_type,
        "forbid_torch": True,
        "bos": 1,
        "eos": 2,
    }
    rng = np.random.default_rng(0)
    src = rng.integers(4, sizes["source"], size=(args.batch, SRC_LEN), dtype=np.int64)
    lengths = np.full(args.batch, SRC_LEN, dtype=np.int64)
    rows = args.batch * (BEAM if args.mode == "beam4" else 1)

    plain = _Worker(spec, verbose=False)
    try:
        plain.decode(args.mode, src, lengths, args.new_tokens)  # warm-up
        seconds = [plain.decode(args.mode, src, lengths, args.new_tokens)[1] for _ in range(args.repeats)]
    finally:
        plain.close()
    logged = _Worker(spec, verbose=True)
    try:
        start = len(logged.lines)
        _, logged_seconds = logged.decode(args.mode, src, lengths, args.new_tokens)
    finally:
        logged.close()
    calls = [c for c in map(parse_line, logged.lines[start:]) if c is not None]
    if not calls:
        raise SystemExit(
            "error: oneMKL logged no matrix product: this CTranslate2 build does not use oneMKL here"
        )
    summary = summarise(calls, rows, sizes["target"], args.new_tokens)
    wall_ms = statistics.median(seconds) * 1e3
    result = {
        "machine": machine_info(threads=(args.threads,)),
        "environment": environment(),
        "load_average_start": list(os.getloadavg()),
        "model": os.path.abspath(args.model),
        "compute_type": compute_type,
        "mode": args.mode,
        "batch": args.batch,
        "rows_per_step": rows,
        "threads": args.threads,
        "new_tokens": args.new_tokens,
        "wall_ms": wall_ms,
        "wall_ms_per_step": wall_ms / args.new_tokens,
        "logged_decode_ms": logged_seconds * 1e3,
        **summary,
    }
    print(
        f"CTranslate2 {compute_type} {args.mode} batch {args.batch} ({rows} rows), {args.threads} threads: "
        f"{wall_ms:.1f} ms = {wall_ms / args.new_tokens:.2f} ms/step without the log "
        f"({logged_seconds * 1e3:.1f} ms with it)"
    )
    for cat, ms in sorted(summary["by_category_ms_per_step"].items(), key=lambda kv: -kv[1]):
        print(f"  {cat:<18} {ms:8.3f} ms/step (logged)")
    print(
        f"  {'routine':<22} {'m':>6} {'n':>5} {'k':>5} {'batch':>5} {'calls':>6} {'ms/step':>8} {'GOP/s':>6}"
    )
    for g in summary["groups"][:12]:
        gops = "" if g["median_gops"] is None else f"{g['median_gops']:.0f}"
        print(
            f"  {g['routine']:<22} {g['m']:>6} {g['n']:>5} {g['k']:>5} {g['batch']:>5} {g['calls']:>6} "
            f"{g['ms_per_step']:>8.3f} {gops:>6}"
        )
    if args.out:
        write_json(args.out, result)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
