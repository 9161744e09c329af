"""The search's host work with and without the search head, over fixed logits: where
``runner.step_top_k`` pays (the thresholds ``transformer_ext.decoding.HEAD_MIN_ENTRIES``).

    python -m benchmarks.decode.bench_search_head                       # V 25 .. 58,101, 1 .. 256 rows
    python -m benchmarks.decode.bench_search_head --vocab 8000 --batch-sizes 1,16 --repeats 3

No model: a numpy runner returns the same random float32 logits ``[rows, V]`` at every step (a
copy, as ``OrtRunner.step`` returns), and its twin adds ``step_top_k``, the search head
(``runtimes/search_head.py``, an ONNX Runtime session of ``--threads`` threads, default 1) over those
logits in place.
Both run the same search, ``--steps`` steps (EOS suppressed until then, one banned id, as
bench_decode and bench_pretrained decode): beam 4 (``length_penalty_type="none"``) and greedy with
scores (as the translator asks). The thresholds are set to 0 for the head runner, so every step
after the first goes through it. Per cell the median of ``--repeats`` interleaved decodes, in
microseconds per step, and the ratio host / head (above 1: the head is faster).

Writes JSON (``--out``, default ``benchmarks/results/bench_search_head.json``: the machine, the
load average before and after, every sample) and a PNG beside it.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (results/ lives here)

from benchmarks.common import environment, machine_info, save_figure, write_json

logger = logging.getLogger("bench_search_head")

BEAM = 4
EOS, BOS, BANNED = 2, 1, 7


class FixedLogits:
    """A runner whose every step returns a copy of the same random logits."""

    def __init__(self, vocab: int, seed: int = 0):
        self.V = vocab
        self.seed = seed
        self.logits = np.zeros((0, vocab), dtype=np.float32)

    def encode(self, input_ids, src_lengths, cache_len, beam_size=1):
        rows = input_ids.shape[0] * beam_size
        rng = np.random.default_rng(self.seed)
        self.logits = (3 * rng.standard_normal((rows, self.V))).astype(np.float32)
        return None

    def step(self, state, tokens):
        return self.logits[: tokens.shape[0]].copy()

    def reorder(self, state, beam_index):
        pass


class FixedLogitsHead(FixedLogits):
    """:class:`FixedLogits` with ``step_top_k`` through the search head."""

    def __init__(self, vocab: int, seed: int = 0, threads: int = 1):
        super().__init__(vocab, seed)
        from transformer_ext.runtimes.search_head import SearchHead

        self.head = SearchHead(threads)

    def step_top_k(self, state, tokens, k, columns):
        logits = self.logits[: tokens.shape[0]]
        return (*self.head(logits, min(k, self.V), columns), logits)


def _decode(runner, mode: str, batch: int, steps: int):
    from transformer_ext import decoding

    ids = np.full((batch, 8), 5, dtype=np.int64)
    lengths = np.full(batch, 8, dtype=np.int64)
    common = dict(
        bos_id=BOS,
        eos_id=EOS,
        max_decoding_length=steps,
        min_decoding_length=steps,
        banned_ids=[BANNED],
        remove_finished=False,
    )
    if mode == "beam4":
        return decoding.beam_search(
            runner, ids, lengths, beam_size=BEAM, length_penalty_type="none", **common
        )
    return decoding.greedy_decode(runner, ids, lengths, return_scores=True, **common)


def _positive_ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--vocab", type=_positive_ints, default=[25, 1000, 8000, 58101], help="vocabulary sizes")
    p.add_argument(
        "--batch-sizes",
        type=_positive_ints,
        default=[1, 4, 16, 64],
        help="sources per decode (beam: x4 rows)",
    )
    p.add_argument("--modes", default="beam4,greedy", help="comma-separated subset of beam4,greedy")
    p.add_argument("--steps", type=int, default=32, help="steps per decode (default 32)")
    p.add_argument("--repeats", type=int, default=5, help="interleaved decodes per cell (default 5)")
    p.add_argument("--threads", type=int, default=1, help="the search head's threads (default 1)")
    p.add_argument("--out", default=os.path.join(HERE, "results", "bench_search_head.json"))
    return p


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = build_parser().parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = sorted(set(modes) - {"beam4", "greedy"})
    if bad or not modes:
        print(f"error: --modes must name beam4 and/or greedy, got {args.modes!r}", file=sys.stderr)
        return 2
    if args.steps < 2 or args.repeats < 1 or args.threads < 1:
        print("error: --steps must be >= 2, --repeats and --threads >= 1", file=sys.stderr)
        return 2
    from transformer_ext import decoding

    load_start = os.getloadavg()
    cells = []
    saved = dict(decoding.HEAD_MIN_ENTRIES)
    decoding.HEAD_MIN_ENTRIES.update(beam=0, greedy_scores=0)  # (the host runner has no step_top_k)
    try:
        for mode in modes:
            for V in args.vocab:
                for batch in args.batch_sizes:
                    runners = {"host": FixedLogits(V), "head": FixedLogitsHead(V, threads=args.threads)}
                    samples: dict[str, list[float]] = {name: [] for name in runners}
                    for runner in runners.values():  # warm-up
                        _decode(runner, mode, batch, args.steps)
                    for r in range(args.repeats):
                        order = list(runners) if r % 2 == 0 else list(runners)[::-1]
                        for name in order:
                            start = time.perf_counter()
                            _decode(runners[name], mode, batch, args.steps)
                            samples[name].append((time.perf_counter() - start) / args.steps * 1e6)
                    host, head = (statistics.median(samples[n]) for n in ("host", "head"))
                    rows = batch * (BEAM if mode == "beam4" else 1)
                    cells.append(
                        dict(mode=mode, vocab=V, batch=batch, rows=rows, entries=rows * V,
                             host_us_per_step=host, head_us_per_step=head, host_over_head=host / head,
                             samples_us_per_step=samples)
                    )  # fmt: skip
                    logger.info(
                        "%-6s V %6d rows %4d  host %8.0f us  head %8.0f us  host/head %.2f",
                        mode, V, rows, host, head, host / head,
                    )  # fmt: skip
    finally:
        decoding.HEAD_MIN_ENTRIES.update(saved)
    payload = dict(
        machine=machine_info(threads=(1,)),
        environment=environment(),
        steps=args.steps,
        repeats=args.repeats,
        head_threads=args.threads,
        thresholds=saved,
        load_average_start=load_start,
        cells=cells,
        load_average_end=os.getloadavg(),
    )
    write_json(args.out, payload)
    _plot(cells, os.path.splitext(args.out)[0] + ".png")
    logger.info("wrote %s", args.out)
    return 0


def _plot(cells: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, marker in (("beam4", "o"), ("greedy", "s")):
        pts = sorted((c["entries"], c["host_over_head"]) for c in cells if c["mode"] == mode)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker, label=mode)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("rows x vocabulary per step")
    ax.set_ylabel("host search time / head search time")
    ax.set_title("Search over fixed logits: where the search head pays")
    ax.legend()
    save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
