"""The per-step host work of a decode, counted (not timed): Python function calls and C calls
(numpy, ONNX Runtime bindings) per decoding step, through the ONNX Runtime runner.

    python -m benchmarks.probes.count_step_calls                        # the demo model, greedy and beam 4
    python -m benchmarks.probes.count_step_calls --model-dir DIR --batch-sizes 1,16,64 --top 30

The model folder (default: the bundled demo model) is exported once to a temporary folder
(``export.onnx``, no validation); the decode is greedy (``return_scores``, as the translator
asks) or beam 4 over random sources of length 12, exactly ``--new-tokens`` tokens (EOS
suppressed until then). One warm-up decode, then one decode under ``sys.setprofile``: every
``call`` (a Python function) and ``c_call`` (a builtin or extension function) is counted, per
function, and divided by the steps (the once-per-decode work, encode and results, is spread
over them). Counts do not depend on the machine's load, so this runs
anywhere; they say where the host loop does work per step and whether that work grows with the
rows (a per-row Python loop) or not.

Writes JSON (``--out``, default ``benchmarks/results/count_step_calls.json``) and prints a table.
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (results/ lives here)

from benchmarks.common import environment, write_json

logger = logging.getLogger("count_step_calls")

SRC_LEN = 12
BEAM = 4


def _decode(runner, mode: str, src: np.ndarray, lengths: np.ndarray, n_tokens: int):
    from transformer_ext.decoding import beam_search, greedy_decode

    bos, eos = runner.info.bos_id, runner.info.eos_id
    kw = dict(bos_id=bos, eos_id=eos, max_decoding_length=n_tokens, min_decoding_length=n_tokens)
    if mode == "greedy":
        return greedy_decode(runner, src, lengths, return_scores=True, **kw)
    return beam_search(runner, src, lengths, beam_size=BEAM, length_penalty_type="none", **kw)


def count_calls(runner, mode: str, batch: int, n_tokens: int, top: int) -> dict:
    """Calls per step of one decode (after a warm-up decode), in total and per function."""
    rng = np.random.default_rng(0)
    src = rng.integers(4, runner.info.src_vocab_size, size=(batch, SRC_LEN))
    lengths = np.full(batch, SRC_LEN)
    _decode(runner, mode, src, lengths, n_tokens)  # warm-up
    calls: collections.Counter = collections.Counter()

    def profile(frame, event, arg):
        if event == "call":
            code = frame.f_code
            calls[f"{os.path.basename(code.co_filename)}:{code.co_name}"] += 1
        elif event == "c_call":
            calls[f"C:{getattr(arg, '__qualname__', None) or getattr(arg, '__name__', repr(arg))}"] += 1

    sys.setprofile(profile)
    try:
        _decode(runner, mode, src, lengths, n_tokens)
    finally:
        sys.setprofile(None)
    python = sum(v for k, v in calls.items() if not k.startswith("C:"))
    return {
        "mode": mode,
        "batch": batch,
        "steps": n_tokens,
        "calls_per_step": sum(calls.values()) / n_tokens,
        "python_calls_per_step": python / n_tokens,
        "top": {k: v / n_tokens for k, v in calls.most_common(top)},
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default=None, help="a model folder (default: the bundled demo model)")
    p.add_argument("--export", default=None, help="an export folder to run instead (no export step)")
    p.add_argument("--modes", default="greedy,beam4", help="comma-separated subset of greedy,beam4")
    p.add_argument("--batch-sizes", default="1,16,64", help="comma-separated batch sizes (default: 1,16,64)")
    p.add_argument("--new-tokens", type=int, default=20, help="tokens generated per sequence (default: 20)")
    p.add_argument("--top", type=int, default=15, help="functions listed per case (default: 15)")
    p.add_argument("--out", default=os.path.join(HERE, "results", "count_step_calls.json"), help="JSON path")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    modes = args.modes.split(",")
    if set(modes) - {"greedy", "beam4"}:
        p.error(f"--modes takes greedy and beam4, got {args.modes!r}")
    try:
        batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError as exc:
        p.error(f"--batch-sizes takes comma-separated integers ({exc})")
    if min(batch_sizes) < 1 or args.new_tokens < 1 or args.top < 0:
        p.error("--batch-sizes and --new-tokens must be >= 1, --top >= 0")

    from export.onnx import export_onnx
    from transformer_ext.demo import DEMO_MODEL_DIR
    from transformer_ext.runtimes.ort import OrtRunner

    if args.export and args.model_dir:
        p.error("give --model-dir or --export, not both")
    model_dir = args.model_dir or str(DEMO_MODEL_DIR)
    results: dict = {
        "environment": environment(),
        "model_dir": None if args.export else model_dir,
        "export_dir": args.export,
        "src_len": SRC_LEN,
        "cases": [],
    }
    with tempfile.TemporaryDirectory(prefix="count_step_calls_") as tmp:
        export_dir = args.export
        if export_dir is None:
            export_dir = os.path.join(tmp, "onnx")
            export_onnx(model_dir, export_dir, validate=False, cache_len=args.new_tokens)
        runner = OrtRunner(export_dir, intra_op_num_threads=1)
        for mode in modes:
            for batch in batch_sizes:
                case = count_calls(runner, mode, batch, args.new_tokens, args.top)
                results["cases"].append(case)
                print(
                    f"{mode} batch {batch}: {case['calls_per_step']:.1f} calls per step "
                    f"({case['python_calls_per_step']:.1f} Python functions)"
                )
                for name, n in case["top"].items():
                    print(f"  {n:8.2f}  {name}")
    write_json(args.out, results)
    logger.info("wrote %s", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
