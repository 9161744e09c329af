"""T5's relative position bias of one decoder step in ONNX Runtime: the bucket function computed in
the graph from ``positions``, against a bucket table read per step (what the export does,
``export/position_bias.py``).

    python -m benchmarks.probes.probe_position_bias      # t5-base: 12 heads, 32 buckets, max distance 128

Both graphs are exported with ``torch.onnx.export(dynamo=True)`` from the same bias module:

* ``in_graph``: the eager ``RelativePositionBias.step`` traced as it is: ``Range``, ``Sub``, the
  bucket function (``Log``, ``Div``, ``Mul``, ``Cast``, ``Min``, ``Where``...) over ``[B, L + 1]``,
  then a ``Gather`` of the ``[buckets, H]`` weight;
* ``table``: what the export does (``export.position_bias.StepBias`` read as
  ``export.lowering.decode_attention_tabled`` reads it): ``Range(L) - positions + offset``, one
  ``Gather`` from a ``[2 * max_len - 1, H]`` table (the buckets computed beforehand by PyTorch).

Each is timed (medians of interleaved runs) at every batch size and cache length, and both are
compared with the eager bias on queries at every position ``0 .. L - 1``: the number of entries
that differ says whether ONNX Runtime's ``Log`` puts a distance into another bucket than
PyTorch's. JSON at ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (results/ lives here)

from benchmarks.common import lscpu, time_side_by_side, write_json


def _modules(heads: int, buckets: int, max_distance: int, max_len: int):
    import torch

    from export.position_bias import relative_buckets, tabled_relative_bias
    from transformer_ext.model import RelativePositionBias

    torch.manual_seed(0)
    bias = RelativePositionBias(buckets, max_distance, heads, bidirectional=False)
    torch.nn.init.normal_(bias.relative_attention_bias.weight)

    class Step(torch.nn.Module):
        def __init__(self, tabled: bool):
            super().__init__()
            self.bias = bias
            self.tabled = tabled
            self.config = type("Config", (), {"max_len": max_len})  # what tabled_relative_bias reads
            self.register_buffer("buckets", relative_buckets(bias, max_len), persistent=False)

        def forward(self, positions, cache):  # cache [B, H, L, 1]: its length only
            if not self.tabled:
                return self.bias.step(positions, cache.shape[2])
            with tabled_relative_bias(self, self.buckets, bidirectional=False):  # a StepBias
                step = self.bias.step(positions, cache.shape[2])
            # what export.lowering.decode_attention_tabled emits: the index, one Gather
            L = cache.shape[2]
            index = torch.arange(L).view(1, L) - positions.view(-1, 1) + step.offset
            index = torch.cat([index, torch.full_like(index[:, :1], step.offset)], 1)
            return step.table()[index].permute(0, 2, 1).unsqueeze(2)

    return bias, Step


def _export(module, path: str, heads: int) -> None:
    import torch

    B, L = torch.export.Dim("batch", min=2), torch.export.Dim("cache_len", min=2)
    torch.onnx.export(
        module.eval(),
        (torch.tensor([3, 1, 4]), torch.zeros(3, heads, 6, 1)),
        path,
        dynamo=True,
        input_names=["positions", "cache"],
        output_names=["bias"],
        dynamic_shapes=({0: B}, {0: B, 2: L}),
        opset_version=18,
        optimize=True,
        verbose=False,
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", default="1,16,64", help="comma-separated decoder rows")
    p.add_argument("--cache-lens", default="64,256,512", help="comma-separated cache lengths")
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--buckets", type=int, default=32)
    p.add_argument("--max-distance", type=int, default=128)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--threads", type=int, default=2, help="intra-op threads")
    p.add_argument("--runs", type=int, default=50, help="timed runs per graph (median)")
    p.add_argument(
        "--out", default=os.path.join(HERE, "results", "probe_position_bias.json"), help="JSON path"
    )
    args = p.parse_args(argv)
    try:
        batches = [int(b) for b in args.batch_sizes.split(",") if b]
        lengths = [int(t) for t in args.cache_lens.split(",") if t]
    except ValueError:
        p.error("--batch-sizes and --cache-lens take comma-separated integers")
    if not batches or not lengths or min(batches + lengths) < 1 or max(lengths) > args.max_len:
        p.error("batch sizes and cache lengths must be at least 1, cache lengths at most --max-len")

    import onnx
    import onnxruntime as ort
    import torch

    bias, Step = _modules(args.heads, args.buckets, args.max_distance, args.max_len)
    so = ort.SessionOptions()
    so.intra_op_num_threads = args.threads
    sessions, ops = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, tabled in (("in_graph", False), ("table", True)):
            path = os.path.join(tmp, f"{name}.onnx")
            _export(Step(tabled), path, args.heads)
            ops[name] = sorted({n.op_type for n in onnx.load(path).graph.node})
            sessions[name] = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    out = {
        "machine": lscpu(),
        "heads": args.heads,
        "buckets": args.buckets,
        "max_distance": args.max_distance,
        "max_len": args.max_len,
        "threads": args.threads,
        "runs": args.runs,
        "ops": ops,
        "load_average_before": os.getloadavg(),
        "exactness": {},
        "results": [],
    }
    # exactness: queries at every position of the longest cache, against the eager bias
    L = max(lengths)
    positions = np.arange(L, dtype=np.int64)
    feeds = {"positions": positions, "cache": np.zeros((L, args.heads, L, 1), np.float32)}
    with torch.no_grad():
        eager = bias.step(torch.from_numpy(positions), L).numpy()
    keys = np.arange(L + 1)[None, :]
    keep = (keys <= positions[:, None]) | (keys == L)  # the prefix (the query itself) and the new key
    keep = np.broadcast_to(keep[:, None, None, :], eager.shape)
    for name, s in sessions.items():
        got = s.run(None, feeds)[0]
        wrong = int(np.count_nonzero((got != eager) & keep))
        out["exactness"][name] = {"entries_compared": int(keep.sum()), "entries_differing": wrong}
        print(f"{name}: {wrong} of {int(keep.sum())} bias entries differ from PyTorch's; ops {ops[name]}")
    rng = np.random.default_rng(0)
    for B in batches:
        for L in lengths:
            feeds = {
                "positions": rng.integers(0, L, size=B).astype(np.int64),
                "cache": np.zeros((B, args.heads, L, 1), np.float32),
            }
            fns = {name: functools.partial(s.run, None, feeds) for name, s in sessions.items()}
            us = {
                k: t * 1e6 for k, t in time_side_by_side(fns, "cpu", repeats=args.runs, min_time=0.0).items()
            }
            rec = {
                "batch": B,
                "cache_len": L,
                "microseconds": us,
                "in_graph_over_table": us["in_graph"] / us["table"],
            }
            out["results"].append(rec)
            print(
                f"batch {B:3d} cache {L:4d}: in-graph buckets {us['in_graph']:8.1f} us, table "
                f"{us['table']:8.1f} us ({rec['in_graph_over_table']:.2f}x)",
                flush=True,
            )
    out["load_average_after"] = os.getloadavg()
    write_json(args.out, out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
