"""The int8 forms of a tied output projection ``logits = x @ table^T`` (and of the embedding
lookup that reads the same table) that ONNX Runtime's CPU provider runs, checked against float64
and timed side by side at 1-256 rows.

    python -m benchmarks probe_int8_head                       # opus-mt (V 58,101) and base (V 8,000), K 512
    python -m benchmarks probe_int8_head --quick               # a smoke run of a few seconds
    python -m benchmarks probe_int8_head --clock cpu           # a direction on a loaded machine

A tied output projection and the embedding lookup of an int8 export read one stored int8 table,
so each form below is a way of storing that table *and* of running both readers on it. One graph
per form holds the product of ``x [rows, K]`` with a random ``[V, K]`` table (``--vocab``,
``--k``); every tensor is bound by pointer (IO binding), outputs preallocated, as ``OrtRunner``
runs a step.

**Products** (``--variants``; the table as each form stores it):

* ``float32``: ``Gemm(x, table, transB=1)``, the float32 export's projection (for scale).
* ``nbits8_b{B}_acc{L}``: ``com.microsoft.MatMulNBits`` bits 8 over the table as 8-bit blocks of
  ``B`` (a scale and a zero point per block), ``accuracy_level`` ``L`` (4: activations quantized
  to int8 per block, 1: the weights dequantized to float32); ``nbits8_b32_acc4`` is the int8
  export's tied projection before the per-row table, its lookup a ``GatherBlockQuantized``.
* ``kn_dqmm``: the table stored ``[K, V]`` int8 with a scale per vocabulary entry,
  ``com.microsoft.DynamicQuantizeMatMul`` (what ONNX Runtime fuses ``quantize_dynamic``'s products
  into); ``kn_matmulinteger``: the same as standard ``DynamicQuantizeLinear`` + ``MatMulInteger`` +
  ``Cast`` + ``Mul``. Their lookup reads columns (``Gather`` axis 1 + ``Transpose``).
* ``vk_qgemm``: the table in its own ``[V, K]`` layout, int8 with a scale per row (the
  embedding's layout: the lookup reads rows), ``DynamicQuantizeLinear`` then
  ``com.microsoft.QGemm`` with ``transB=1`` and a per-column scale (ONNX Runtime packs a constant
  ``B`` transposed, so the product runs the same u8 x s8 kernels as ``kn_dqmm``).
* ``vk_matmulinteger_s8s8``: the ``[V, K]`` table as the left operand: ``MatMulInteger(table,
  x_q^T)`` with ``x`` quantized symmetric int8 in the graph (``ReduceMax`` of ``Abs``,
  ``QuantizeLinear``), then transposed back; ``vk_matmulinteger_u8u8`` the same with the table
  stored uint8 (zero point 128) and ``x`` from ``DynamicQuantizeLinear`` (u8 x u8 kernels).
* ``vk_nbits8_b{B}``: ``MatMulNBits`` bits 8, ``accuracy_level`` 4, over the per-row int8 table
  (its bytes with the sign bit flipped, the per-row scale repeated in every block): what a few-row
  step reads when the table is per-row int8.

ONNX Runtime 1.32's other CPU contrib products with int8 weights do not fit a float32 step:
``MatMulIntegerToFloat`` is what ``kn_matmulinteger`` fuses to (``kernels`` records it),
``QLinearMatMul`` quantizes its output, ``MatMulBnb4`` and ``MatMulNBits`` bits 4 are 4-bit.

The per-row int8 forms use the ``int8`` export scheme's ``reduce_range`` (values in ``-63..63``,
:func:`export.quantize.quantize_blocks` with 7 bits and one block per row): ONNX Runtime's u8 x s8
kernels without VNNI add pairs of products in 16 bits, which 8-bit weights can saturate.

**Lookups** of ``n`` ids (``--lookups``: a step's rows, and 1,536 for an encoder batch of 64 x 24):
``gbq_b32`` (``GatherBlockQuantized`` over the 8-bit blocks of 32), ``rows`` (``Gather`` of int8 rows
+ ``Cast`` + ``Mul`` by the gathered row scales, for the ``vk_*`` forms), ``cols`` (``Gather`` axis 1
of the ``[K, V]`` table + ``Transpose`` + ``Cast`` + ``Mul``, for the ``kn_*`` forms), and
``float32`` (``Gather``).

Every product is first checked against the float64 product of ``x`` with that form's own
dequantized table (``max_abs_error``; the int8-activation forms differ by the activations'
rounding, a few parts in a thousand of the logits' range; a form above ``--tolerance`` times the
largest logit is listed in ``wrong`` and not timed), every lookup against the float64 dequantized
rows (float32 rounding). Then all are timed in one process, rounds interleaved after a warm-up
(``common.time_side_by_side``, medians), per table, row count and intra-op thread count
(``--threads``, default 1). ``stored_bytes`` says what each form's table costs in an export folder
(bytes, scales and zero points); ``kernels`` the operators each session ran after ONNX Runtime's
optimisations. JSON at ``--out``, a PNG beside it (milliseconds against rows, per table).

Finding (``benchmarks/results/probe_int8_head_cpu_clock_t1.json``: ONNX Runtime 1.32, the 2-core
Sapphire Rapids-class Xeon, 1 intra-op thread, ``python -m benchmarks probe_int8_head --rounds 5
--clock cpu`` while other sessions loaded the machine to a load average of 6-12: a direction).
Milliseconds per product, ``nbits8_b32_acc4`` (the blocks of 32 the tables had) against
``vk_qgemm``:

| rows | opus-mt V 58,101 | base V 8,000 |
| --- | --- | --- |
| 1 | 3.42 / 1.72 | 0.246 / 0.201 |
| 4 | 5.49 / 2.69 | 0.366 / 0.207 |
| 16 | 10.0 / 2.79 | 1.05 / 0.264 |
| 64 | 29.1 / 7.90 | 3.99 / 0.615 |
| 256 | 107 / 19.7 | 15.2 / 2.14 |

``vk_qgemm`` is as fast as ``kn_dqmm`` (the dynamic int8 product, 20.7 ms at 256 rows of opus-mt)
at every row count and faster at 1-4 rows; larger ``MatMulNBits`` blocks gain at most 1.5x (blocks
of 256: 71.9 ms at 256 rows), ``accuracy_level`` 1 is 100x slower, and the ``MatMulInteger`` forms
with the table as left operand 5-25x. Of the lookups, gathering int8 rows (``rows``: 0.039 ms
for 256 ids of opus-mt) beats ``GatherBlockQuantized`` (0.092 ms), while the ``[K, V]`` layout's
column gather costs 4.6 ms (15 ms for an encoder batch of 1,536 ids), which rules ``kn_*`` out.
Errors: ``vk_qgemm`` at most 1.2% of the largest logit against the float64 product of its own
dequantized table (the activations' uint8 rounding), blocks of 32 at most 0.8%. So the int8
export stores its tables as per-row int8 and runs the tied projection as ``vk_qgemm``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (results/ lives here)

from benchmarks.common import lscpu, machine_info, save_figure, time_side_by_side, write_json
from benchmarks.probes.probe_int8_products import BoundRun, kernel_counts, open_session

log = logging.getLogger("probe_int8_head")

TABLES = {"opus-mt": 58101, "base": 8000}
PRODUCT_VARIANTS = (
    "float32",
    "nbits8_b32_acc4",
    "nbits8_b32_acc1",
    "nbits8_b64_acc4",
    "nbits8_b128_acc4",
    "nbits8_b256_acc4",
    "kn_dqmm",
    "kn_matmulinteger",
    "vk_qgemm",
    "vk_matmulinteger_s8s8",
    "vk_matmulinteger_u8u8",
    "vk_nbits8_b32",
    "vk_nbits8_b256",
)
LOOKUP_VARIANTS = ("float32", "gbq_b32", "rows", "cols")
TODAY = "nbits8_b32_acc4"  # the int8 export's tied projection with GatherBlockQuantized lookups
ROW_BITS = 7  # the int8 scheme's reduce_range


def _nbits_parts(name: str) -> tuple[int, int]:
    """``(block, accuracy_level)`` of ``nbits8_b{B}_acc{L}``."""
    block, acc = name[len("nbits8_b") :].split("_acc")
    return int(block), int(acc)


class Table:
    """One random ``[V, K]`` table and every stored form of it (built lazily, each once)."""

    def __init__(self, vocab: int, k: int, seed: int):
        rng = np.random.default_rng(seed)
        # embedding-like rows: normal values with a spread of row norms
        norms = rng.uniform(0.5, 1.5, size=(vocab, 1)).astype(np.float32)
        self.w = (rng.standard_normal((vocab, k)).astype(np.float32) * norms / np.sqrt(k)).astype(np.float32)
        self.vocab, self.k = vocab, k
        self._blocks: dict[int, tuple] = {}
        self._rows = None

    def blocks(self, block: int):
        """8-bit asymmetric blocks (MatMulNBits / GatherBlockQuantized): packed, scales, zero points,
        the float64 dequantized table."""
        from export.quantize import quantize_blocks

        if block not in self._blocks:
            packed, scales, zero = quantize_blocks(self.w, 8, block, symmetric=False)
            deq = (packed.astype(np.float64) - zero[..., None]) * scales[..., None]
            self._blocks[block] = (packed, scales, zero, deq.reshape(self.vocab, self.k))
        return self._blocks[block]

    def rows(self):
        """Per-row symmetric int8 in ``-63..63`` (reduce_range): int8 ``[V, K]``, scale ``[V]``,
        the float64 dequantized table."""
        from export.quantize import quantize_blocks

        if self._rows is None:
            q, scale, _ = quantize_blocks(self.w, ROW_BITS, self.k, symmetric=True)
            q8 = (q.reshape(self.vocab, self.k).astype(np.int16) - (1 << (ROW_BITS - 1))).astype(np.int8)
            scale = scale.reshape(self.vocab).astype(np.float32)
            self._rows = (q8, scale, q8.astype(np.float64) * scale[:, None].astype(np.float64))
        return self._rows


def _model(nodes, inputs, outputs, inits, opset: int = 21):
    from onnx import helper

    graph = helper.make_graph(nodes, "head", inputs, outputs, inits)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = 10
    return model


def product_graph(variant: str, table: Table):
    """``(model, dequantized float64 table [V, K], stored bytes)`` of one product form."""
    from onnx import TensorProto, helper
    from onnx import numpy_helper as nh

    v, k = table.vocab, table.k
    x = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", k])]
    y = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["rows", v])]
    node = helper.make_node
    if variant == "float32":
        inits = [nh.from_array(table.w, "table")]
        return (
            _model([node("Gemm", ["x", "table"], ["logits"], transB=1)], x, y, inits),
            table.w.astype(np.float64),
            table.w.nbytes,
        )
    if variant.startswith("nbits8_b"):
        block, acc = _nbits_parts(variant)
        packed, scales, zero, deq = table.blocks(block)
        inits = [nh.from_array(packed, "B"), nh.from_array(scales, "S"), nh.from_array(zero, "Z")]
        n = node(
            "MatMulNBits", ["x", "B", "S", "Z"], ["logits"], domain="com.microsoft",
            K=k, N=v, bits=8, block_size=block, accuracy_level=acc,
        )  # fmt: skip
        return _model([n], x, y, inits), deq, packed.nbytes + scales.nbytes + zero.nbytes
    q8, scale, deq = table.rows()
    stored = q8.nbytes + scale.nbytes
    zeros = np.zeros(v, np.int8)
    if variant in ("kn_dqmm", "kn_matmulinteger"):
        inits = [
            nh.from_array(np.ascontiguousarray(q8.T), "B"),
            nh.from_array(scale, "S"),
            nh.from_array(zeros, "Z"),
        ]
        if variant == "kn_dqmm":
            nodes = [node("DynamicQuantizeMatMul", ["x", "B", "S", "Z"], ["logits"], domain="com.microsoft")]
        else:
            nodes = [
                node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"]),
                node("MatMulInteger", ["xq", "B", "xz", "Z"], ["acc"]),
                node("Cast", ["acc"], ["accf"], to=TensorProto.FLOAT),
                node("Mul", ["xs", "S"], ["s"]),
                node("Mul", ["accf", "s"], ["logits"]),
            ]
        return _model(nodes, x, y, inits), deq, stored
    if variant == "vk_qgemm":
        inits = [nh.from_array(q8, "B"), nh.from_array(scale, "S"), nh.from_array(zeros, "Z")]
        nodes = [
            node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"]),
            node("QGemm", ["xq", "xs", "xz", "B", "S", "Z"], ["logits"], domain="com.microsoft", transB=1),
        ]
        return _model(nodes, x, y, inits), deq, stored
    if variant == "vk_matmulinteger_s8s8":
        inits = [
            nh.from_array(q8, "A"),
            nh.from_array(scale, "S"),
            nh.from_array(np.array(127.0, np.float32), "qmax"),
            nh.from_array(np.array(0, np.int8), "zp8"),
        ]
        nodes = [
            node("Abs", ["x"], ["ax"]),
            node("ReduceMax", ["ax"], ["amax"], keepdims=0),
            node("Div", ["amax", "qmax"], ["xs"]),
            node("QuantizeLinear", ["x", "xs", "zp8"], ["xq"]),
            node("Transpose", ["xq"], ["xqt"], perm=[1, 0]),
            node("MatMulInteger", ["A", "xqt"], ["acc_t"]),
            node("Transpose", ["acc_t"], ["acc"], perm=[1, 0]),
            node("Cast", ["acc"], ["accf"], to=TensorProto.FLOAT),
            node("Mul", ["xs", "S"], ["s"]),
            node("Mul", ["accf", "s"], ["logits"]),
        ]
        return _model(nodes, x, y, inits), deq, stored
    if variant == "vk_matmulinteger_u8u8":
        inits = [
            nh.from_array((q8.view(np.uint8) ^ np.uint8(128)), "A"),
            nh.from_array(scale, "S"),
            nh.from_array(np.array(128, np.uint8), "azp"),
        ]
        nodes = [
            node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"]),
            node("Transpose", ["xq"], ["xqt"], perm=[1, 0]),
            node("MatMulInteger", ["A", "xqt", "azp", "xz"], ["acc_t"]),
            node("Transpose", ["acc_t"], ["acc"], perm=[1, 0]),
            node("Cast", ["acc"], ["accf"], to=TensorProto.FLOAT),
            node("Mul", ["xs", "S"], ["s"]),
            node("Mul", ["accf", "s"], ["logits"]),
        ]
        return _model(nodes, x, y, inits), deq, stored
    if variant.startswith("vk_nbits8_b"):
        block = int(variant[len("vk_nbits8_b") :])
        packed = (q8.view(np.uint8) ^ np.uint8(128)).reshape(v, k // block, block)
        scales = np.ascontiguousarray(np.repeat(scale[:, None], k // block, axis=1))
        inits = [nh.from_array(packed, "B"), nh.from_array(scales, "S")]
        n = node(
            "MatMulNBits", ["x", "B", "S"], ["logits"], domain="com.microsoft",
            K=k, N=v, bits=8, block_size=block, accuracy_level=4,
        )  # fmt: skip
        return _model([n], x, y, inits), deq, stored
    raise ValueError(f"unknown product variant {variant!r}")


def lookup_graph(variant: str, table: Table):
    """``(model, dequantized float64 table [V, K])`` of one lookup form (ids ``[n]`` -> ``[n, K]``)."""
    from onnx import TensorProto, helper
    from onnx import numpy_helper as nh

    v, k = table.vocab, table.k
    ids = [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"])]
    y = [helper.make_tensor_value_info("rows", TensorProto.FLOAT, ["n", k])]
    node = helper.make_node
    if variant == "float32":
        return _model([node("Gather", ["T", "ids"], ["rows"])], ids, y, [nh.from_array(table.w, "T")]), (
            table.w.astype(np.float64)
        )
    if variant == "gbq_b32":
        packed, scales, zero, deq = table.blocks(32)
        inits = [
            nh.from_array(packed.reshape(v, k), "T"),
            nh.from_array(scales, "S"),
            nh.from_array(zero, "Z"),
        ]
        n = node(
            "GatherBlockQuantized", ["T", "ids", "S", "Z"], ["rows"], domain="com.microsoft",
            gather_axis=0, quantize_axis=1, block_size=32, bits=8,
        )  # fmt: skip
        return _model([n], ids, y, inits), deq
    q8, scale, deq = table.rows()
    scale_col = nh.from_array(scale.reshape(v, 1), "S")
    if variant == "rows":
        nodes = [
            node("Gather", ["T", "ids"], ["q"]),
            node("Cast", ["q"], ["qf"], to=TensorProto.FLOAT),
            node("Gather", ["S", "ids"], ["s"]),
            node("Mul", ["qf", "s"], ["rows"]),
        ]
        return _model(nodes, ids, y, [nh.from_array(q8, "T"), scale_col]), deq
    if variant == "cols":
        nodes = [
            node("Gather", ["T", "ids"], ["q_kn"], axis=1),
            node("Transpose", ["q_kn"], ["q"], perm=[1, 0]),
            node("Cast", ["q"], ["qf"], to=TensorProto.FLOAT),
            node("Gather", ["S", "ids"], ["s"]),
            node("Mul", ["qf", "s"], ["rows"]),
        ]
        return _model(nodes, ids, y, [nh.from_array(np.ascontiguousarray(q8.T), "T"), scale_col]), deq
    raise ValueError(f"unknown lookup variant {variant!r}")


def _sessions(graphs: dict, threads: int, folder: Path, tag: str):
    """``{variant: (session, kernels)}``; a graph ONNX Runtime refuses is ``(None, reason)``."""
    out = {}
    for variant, model in graphs.items():
        path = folder / f"{tag}_{variant}.onnx"
        optimized = folder / f"{tag}_{variant}.t{threads}.optimized.onnx"
        import onnx

        onnx.save(model, os.fspath(path))
        try:
            session = open_session(os.fspath(path), threads, optimized)
        except Exception as exc:  # a kernel ONNX Runtime does not have on this CPU: reported, not timed
            out[variant] = (None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
            continue
        out[variant] = (session, kernel_counts(optimized))
        path.unlink()
        optimized.unlink(missing_ok=True)
    return out


def probe_table(name: str, vocab: int, args, folder: Path, out: dict) -> None:
    table = Table(vocab, args.k, args.seed)
    rng = np.random.default_rng(args.seed + 1)
    products, deqs, stored = {}, {}, {}
    for variant in args.variants:
        products[variant], deqs[variant], stored[variant] = product_graph(variant, table)
    lookups, lookup_deqs = {}, {}
    for variant in args.lookup_variants:
        lookups[variant], lookup_deqs[variant] = lookup_graph(variant, table)
    record = {
        "table": name,
        "vocab": vocab,
        "k": args.k,
        "stored_bytes": stored,
        "kernels": {},
        "refused": {},
        "products": [],
        "lookups": [],
    }
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    for threads in args.threads:
        sessions = _sessions(products, threads, folder, f"{name}_product")
        for variant, (session, kernels) in sessions.items():
            if session is None:
                record["refused"][variant] = kernels
            else:
                record["kernels"].setdefault(variant, kernels)
        for rows in args.rows:
            x = rng.standard_normal((rows, args.k)).astype(np.float32)
            fns, errors = {}, {}
            for variant, (session, _) in sessions.items():
                if session is None:
                    continue
                ref = x.astype(np.float64) @ deqs[variant].T
                run = BoundRun(session, {"x": x}, {"logits": ref.shape})
                run()
                err = float(np.abs(run.outputs["logits"].astype(np.float64) - ref).max())
                errors[variant] = {"max_abs_error": err, "relative": err / float(np.abs(ref).max())}
                if not errors[variant]["relative"] <= args.tolerance:
                    out["wrong"].append(
                        f"{name} {variant}, {rows} rows, {threads} thread(s): {errors[variant]}"
                    )
                    continue
                fns[variant] = run
            seconds = time_side_by_side(fns, "cpu", repeats=args.rounds, min_time=args.min_time, clock=clock)
            ms = {k: 1e3 * s for k, s in seconds.items()}
            rec = {"threads": threads, "rows": rows, "ms": ms, "error": errors}
            if TODAY in ms:
                rec["speedup_over_today"] = {k: ms[TODAY] / v for k, v in ms.items()}
            record["products"].append(rec)
            log.info(
                "%-7s product %3d rows, %d thread(s): %s",
                name,
                rows,
                threads,
                "  ".join(f"{k} {v:.3f}" for k, v in sorted(ms.items(), key=lambda kv: kv[1])),
            )
        del sessions
        lsessions = _sessions(lookups, threads, folder, f"{name}_lookup")
        for variant, (session, kernels) in lsessions.items():
            if session is None:
                record["refused"][f"lookup {variant}"] = kernels
        for n in args.lookups:
            ids = rng.integers(0, vocab, size=n).astype(np.int64)
            fns, errors = {}, {}
            for variant, (session, _) in lsessions.items():
                if session is None:
                    continue
                ref = lookup_deqs[variant][ids]
                run = BoundRun(session, {"ids": ids}, {"rows": ref.shape})
                run()
                err = float(np.abs(run.outputs["rows"].astype(np.float64) - ref).max())
                errors[variant] = err
                if not err <= 1e-6 * float(np.abs(ref).max()):
                    out["wrong"].append(f"{name} lookup {variant}, {n} ids, {threads} thread(s): {err}")
                    continue
                fns[variant] = run
            seconds = time_side_by_side(fns, "cpu", repeats=args.rounds, min_time=args.min_time, clock=clock)
            ms = {k: 1e3 * s for k, s in seconds.items()}
            record["lookups"].append({"threads": threads, "ids": n, "ms": ms, "max_abs_error": errors})
            log.info(
                "%-7s lookup %4d ids, %d thread(s): %s",
                name,
                n,
                threads,
                "  ".join(f"{k} {v:.4f}" for k, v in sorted(ms.items(), key=lambda kv: kv[1])),
            )
    out["tables"].append(record)


def plot(out: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(t, th) for t in out["tables"] for th in sorted({r["threads"] for r in t["products"]})]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, (t, threads) in zip(axes.flat, panels):
        recs = [r for r in t["products"] if r["threads"] == threads]
        for variant in sorted({k for r in recs for k in r["ms"]}):
            pts = [(r["rows"], r["ms"][variant]) for r in recs if variant in r["ms"]]
            style = "-" if variant in (TODAY, "vk_qgemm", "kn_dqmm") else ":"
            ax.plot(*zip(*pts), style, marker="o", lw=1.2, label=variant)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set(
            title=f"{t['table']}: V {t['vocab']}, K {t['k']}, {threads} thread(s)", xlabel="rows", ylabel="ms"
        )
        ax.legend(fontsize=6)
    fig.suptitle(
        f"x @ table^T, int8 forms, ONNX Runtime {out['onnxruntime']}, {out['clock']} clock", fontsize=9
    )
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def _ints(p, text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        p.error(f"{flag}: expected comma-separated integers, got {text!r}")
    if not values or min(values) < 1:
        p.error(f"{flag}: expected integers of at least 1, got {text!r}")
    return values


def _names(p, text: str, flag: str, known: tuple) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [n for n in names if n not in known]
    if not names or unknown:
        p.error(f"{flag}: expected names from {list(known)}, got {text!r}")
    return names


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tables", default="opus-mt,base", help=f"comma-separated, of {list(TABLES)}")
    p.add_argument("--vocab", type=int, default=None, help="one table of this many rows instead of --tables")
    p.add_argument("--k", type=int, default=512, help="d_model (the table's columns)")
    p.add_argument("--rows", default="1,4,16,64,256", help="comma-separated rows of x")
    p.add_argument("--lookups", default="16,256,1536", help="comma-separated id counts of the lookups")
    p.add_argument("--threads", default="1", help="comma-separated intra-op thread counts")
    p.add_argument("--variants", default=",".join(PRODUCT_VARIANTS), help="product forms to run")
    p.add_argument("--lookup-variants", default=",".join(LOOKUP_VARIANTS), help="lookup forms to run")
    p.add_argument("--rounds", type=int, default=7, help="interleaved timed rounds (median)")
    p.add_argument("--min-time", type=float, default=0.05, help="seconds each timing lasts at least")
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall time (default), or this process's CPU time: a direction on a loaded machine",
    )
    p.add_argument(
        "--tolerance",
        type=float,
        default=0.02,
        help="largest error allowed, over the largest |logit| (int8 activations round a few parts in 1,000)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a smoke run: base, rows 1,16, 3 rounds, no waiting")
    p.add_argument(
        "--out",
        default=os.path.join(HERE, "results", "probe_int8_head.json"),
        help="JSON path (PNG beside it)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.tables, args.rows, args.lookups, args.rounds, args.min_time = "base", "1,16", "16", 3, 0.0
    args.rows = _ints(p, args.rows, "--rows")
    args.lookups = _ints(p, args.lookups, "--lookups")
    args.threads = _ints(p, args.threads, "--threads")
    args.variants = _names(p, args.variants, "--variants", PRODUCT_VARIANTS)
    args.lookup_variants = _names(p, args.lookup_variants, "--lookup-variants", LOOKUP_VARIANTS)
    if args.vocab is not None:
        if args.vocab < 1:
            p.error(f"--vocab: expected at least 1, got {args.vocab}")
        tables = {f"V{args.vocab}": args.vocab}
    else:
        tables = {n: TABLES[n] for n in _names(p, args.tables, "--tables", tuple(TABLES))}
    blocks = {_nbits_parts(v)[0] for v in args.variants if v.startswith("nbits8_b")} | {
        int(v[len("vk_nbits8_b") :]) for v in args.variants if v.startswith("vk_nbits8_b")
    }
    if "gbq_b32" in args.lookup_variants:
        blocks.add(32)
    if args.k < 16 or any(args.k % b for b in blocks):
        p.error(
            f"--k: expected a multiple of every block size of the chosen forms ({sorted(blocks)}), got {args.k}"
        )
    if args.rounds < 1 or args.min_time < 0 or not args.tolerance > 0:
        p.error("--rounds must be at least 1, --min-time not negative, --tolerance positive")
    if not args.out.endswith(".json"):
        p.error(f"--out: expected a .json path, got {args.out!r}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import onnxruntime

    out = {
        "command": " ".join(["probe_int8_head"] + (sys.argv[1:] if argv is None else list(argv))),
        "onnxruntime": onnxruntime.__version__,
        "clock": args.clock,
        "rounds": args.rounds,
        "min_time": args.min_time,
        "tolerance": args.tolerance,
        "row_bits": ROW_BITS,
        "machine": machine_info(tuple(args.threads)) if not args.quick else lscpu(),
        "load_average_before": list(os.getloadavg()),
        "wrong": [],
        "tables": [],
    }
    with tempfile.TemporaryDirectory(prefix="probe_int8_head_") as tmp:
        for name, vocab in tables.items():
            probe_table(name, vocab, args, Path(tmp), out)
    out["load_average_after"] = list(os.getloadavg())
    write_json(args.out, out)
    plot(out, args.out[: -len(".json")] + ".png")
    log.info("wrote %s", args.out)
    for what in out["wrong"]:
        log.error("above the tolerance: %s", what)
    return 1 if out["wrong"] else 0


if __name__ == "__main__":
    sys.exit(main())
