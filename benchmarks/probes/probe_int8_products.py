"""The int8 matrix products ONNX Runtime offers on this CPU, priced on a decoder step's weights and
attention, before any of them becomes an export scheme.

    python -m benchmarks.probes.probe_int8_products                 # base: d_model 512, d_ff 2048, V 8,000
    python -m benchmarks.probes.probe_int8_products --d-model 512 --d-ff 2048 --vocab 58101   # opus-mt

**Weight products.** One graph holds every weight product of a decoder step of ``--layers``
layers (per layer the fused Q/K/V projection ``d x 3d``, the self-attention output ``d x d``, the
cross-attention query and output ``d x d`` each, the feed-forward ``d x d_ff`` and ``d_ff x d``),
plus the output projection ``d x V``, each with its own weights and a bias and its own input
``[rows, K]`` (as in a step, where each product reads another activation). The same float32 graph is rewritten each way:

* ``float32``: ``MatMul`` / ``Gemm`` as exported.
* ``dynamic``: the ``int8`` export scheme (``onnxruntime.quantization.quantize_dynamic``, int8
  weights per output channel, ``reduce_range``), which ONNX Runtime fuses into
  ``DynamicQuantizeMatMul``: each product quantizes its activations at run time.
* ``dynamic_full_range``: the same without ``reduce_range`` (8-bit instead of 7-bit weights).
* ``static_qdq``: ``quantize_static`` in the QDQ format (uint8 activations with fixed scales
  calibrated on ``--calibration`` draws, int8 weights per channel), which ONNX Runtime fuses into
  ``MatMulIntegerToFloat`` with a ``QuantizeLinear``: the dequantize fused into the product, no
  run-time range.
* ``static_qoperator``: ``quantize_static`` in the operator format: ``QLinearMatMul`` (or
  ``QGemm``) with quantized outputs and a ``DequantizeLinear`` after each.
* ``nbits8``: 8-bit ``MatMulNBits`` with ``accuracy_level`` 4 (the int8 export's few-row step),
  blocks of ``--nbits-block``; ``int4``: 4-bit ``MatMulNBits``, blocks of 128.

**Attention products** (``--attention``): a step's score product ``q k^T`` over the caches,
``[rows, heads, 1, d_k] x [rows, heads, d_k, T]`` for ``--layers`` layers, in float32 and with both
operands quantized at run time (``DynamicQuantizeLinear`` on the query and on the cache,
``MatMulInteger``, the scales multiplied back): what quantizing the attention products would cost.

Every variant is checked against float64 products of the same inputs (``error``: the largest
absolute error over the largest absolute value of each output, median and maximum over the
outputs), then all are timed in rounds interleaved after a warm-up (``common.time_side_by_side``,
medians), per row count and thread count, with IO binding and preallocated outputs as
``OrtRunner`` runs a step. The graph each session ran after ONNX Runtime's optimisations is
recorded by operator type (``kernels``), so the JSON says which kernel a variant used. The
activations are synthetic (layer-norm-like normal values, ReLU outputs for the second
feed-forward product), so ``error`` prices a scheme's rounding, not a trained model's outliers;
the export's quality gate judges that. A variant whose error exceeds its bound (:data:`ERROR_BOUNDS`)
is listed in the JSON's ``wrong`` and makes the exit status 1. JSON at ``--out``.
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (results/ lives here)

from benchmarks.common import lscpu, machine_info, time_side_by_side, write_json

log = logging.getLogger("probe_int8_products")

WEIGHT_VARIANTS = (
    "float32",
    "dynamic",
    "dynamic_full_range",
    "static_qdq",
    "static_qoperator",
    "nbits8",
    "int4",
)
ATTENTION_VARIANTS = ("float32", "dynamic_both")
# Largest relative error (see ``relative_errors``) a variant may show before the probe calls its
# kernel wrong and exits 1: float32 rounding; 8-bit and 4-bit rounding of unit-scale products; the
# static schemes also clip activations outside their calibrated ranges (more rows, more clipped).
ERROR_BOUNDS = {"float32": 1e-4, "int4": 0.3, "static_qdq": 0.5, "static_qoperator": 0.5}
DEFAULT_ERROR_BOUND = 0.1


def step_products(d_model: int, d_ff: int, vocab: int, layers: int) -> list[tuple[str, int, int]]:
    """(name, K, N) of every weight product of a decoder step."""
    shapes = []
    for i in range(layers):
        shapes += [
            (f"l{i}.qkv", d_model, 3 * d_model),
            (f"l{i}.self_out", d_model, d_model),
            (f"l{i}.cross_q", d_model, d_model),
            (f"l{i}.cross_out", d_model, d_model),
            (f"l{i}.ffn1", d_model, d_ff),
            (f"l{i}.ffn2", d_ff, d_model),
        ]
    shapes.append(("out_proj", d_model, vocab))
    return shapes


def weights_graph(shapes, d_model: int, d_ff: int, seed: int):
    """The float32 graph: one input ``NAME.in [rows, K]`` and one output per product (each product
    of a step reads an activation of its own, which the dynamic scheme quantizes for it)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    nodes, inits, outputs, weights = [], [], [], {}
    for name, k, n in shapes:
        w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
        b = (0.02 * rng.standard_normal(n)).astype(np.float32)
        weights[name] = (w, b)
        inits += [numpy_helper.from_array(w, f"{name}.weight"), numpy_helper.from_array(b, f"{name}.bias")]
        nodes += [
            helper.make_node(
                "MatMul", [f"{name}.in", f"{name}.weight"], [f"{name}.mm"], name=f"{name}_MatMul"
            ),
            helper.make_node("Add", [f"{name}.mm", f"{name}.bias"], [name], name=f"{name}_Add"),
        ]
        outputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, ["rows", n]))
    graph = helper.make_graph(
        nodes,
        "step_products",
        [
            helper.make_tensor_value_info(f"{name}.in", TensorProto.FLOAT, ["rows", k])
            for name, k, _ in shapes
        ],
        outputs,
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model, weights


def activations(shapes, rows: int, d_model: int, rng) -> dict:
    """Every product's input: layer-norm-like normal values, a ReLU output for ``K != d_model``."""
    feeds = {}
    for name, k, _ in shapes:
        x = rng.standard_normal((rows, k)).astype(np.float32)
        feeds[f"{name}.in"] = x if k == d_model else np.maximum(x, 0)
    return feeds


class _Reader:
    """A ``CalibrationDataReader`` over a list of feeds."""

    def __init__(self, feeds):
        self._it = iter(feeds)

    def get_next(self):
        return next(self._it, None)

    def rewind(self):  # called by some versions of onnxruntime.quantization
        pass


def _quiet_root(fn, *args, **kwargs):
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # the quantizers warn on the root logger about pre-processing
    try:
        return fn(*args, **kwargs)
    finally:
        root.setLevel(level)


def write_weight_variants(model, shapes, folder: Path, args) -> dict[str, Path]:
    """Every weight-product variant as an ``.onnx`` file in ``folder``."""
    import onnx
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_dynamic, quantize_static

    from export import quantize as q

    paths = {name: folder / f"{name}.onnx" for name in WEIGHT_VARIANTS}
    onnx.save(model, os.fspath(paths["float32"]))
    src = os.fspath(paths["float32"])
    for name, reduce_range in (("dynamic", True), ("dynamic_full_range", False)):
        _quiet_root(
            quantize_dynamic,
            src,
            os.fspath(paths[name]),
            op_types_to_quantize=["MatMul", "Gemm"],
            per_channel=True,
            reduce_range=reduce_range,
            weight_type=QuantType.QInt8,
        )
    rng = np.random.default_rng(args.seed + 1)
    for name, fmt in (("static_qdq", QuantFormat.QDQ), ("static_qoperator", QuantFormat.QOperator)):
        feeds = [activations(shapes, 8, args.d_model, rng) for _ in range(args.calibration)]
        _quiet_root(
            quantize_static,
            src,
            os.fspath(paths[name]),
            _Reader(feeds),
            quant_format=fmt,
            op_types_to_quantize=["MatMul", "Gemm"],
            per_channel=True,
            reduce_range=False,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
        )
    for name, bits, block in (("nbits8", 8, args.nbits_block), ("int4", 4, 128)):
        settings = {"bits": bits, "block_size": block, "symmetric": False, "accuracy_level": 4}
        q._quantize_nbits_one(paths["float32"], paths[name], settings)
    return paths


def attention_graph(layers: int, variant: str):
    """``q [rows, H, 1, d_k]`` and ``k [rows, H, T, d_k]`` per layer into scores ``[rows, H, 1, T]``."""
    from onnx import TensorProto, helper

    nodes, inputs, outputs = [], [], []
    for i in range(layers):
        qn, kn, out = f"q{i}", f"k{i}", f"scores{i}"
        inputs += [
            helper.make_tensor_value_info(qn, TensorProto.FLOAT, ["rows", "heads", 1, "d_k"]),
            helper.make_tensor_value_info(kn, TensorProto.FLOAT, ["rows", "heads", "T", "d_k"]),
        ]
        outputs.append(helper.make_tensor_value_info(out, TensorProto.FLOAT, ["rows", "heads", 1, "T"]))
        if variant == "float32":
            nodes += [
                helper.make_node("Transpose", [kn], [f"kt{i}"], perm=[0, 1, 3, 2]),
                helper.make_node("MatMul", [qn, f"kt{i}"], [out]),
            ]
        else:
            nodes += [
                helper.make_node("DynamicQuantizeLinear", [qn], [f"qq{i}", f"qs{i}", f"qz{i}"]),
                helper.make_node("DynamicQuantizeLinear", [kn], [f"kq{i}", f"ks{i}", f"kz{i}"]),
                helper.make_node("Transpose", [f"kq{i}"], [f"kqt{i}"], perm=[0, 1, 3, 2]),
                helper.make_node("MatMulInteger", [f"qq{i}", f"kqt{i}", f"qz{i}", f"kz{i}"], [f"acc{i}"]),
                helper.make_node("Cast", [f"acc{i}"], [f"accf{i}"], to=TensorProto.FLOAT),
                helper.make_node("Mul", [f"qs{i}", f"ks{i}"], [f"s{i}"]),
                helper.make_node("Mul", [f"accf{i}", f"s{i}"], [out]),
            ]
    graph = helper.make_graph(nodes, f"attention_{variant}", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def open_session(path_or_bytes, threads: int, optimized_path: Path | None = None):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.add_session_config_entry("session.force_spinning_stop", "1")
    so.log_severity_level = 3  # not the warning that an optimised model is hardware-specific
    if optimized_path is not None:
        so.optimized_model_filepath = os.fspath(optimized_path)
    return ort.InferenceSession(path_or_bytes, so, providers=["CPUExecutionProvider"])


def kernel_counts(optimized_path: Path) -> dict[str, int]:
    """Operator types of the graph a session ran (its optimised model)."""
    import onnx

    model = onnx.load(os.fspath(optimized_path), load_external_data=False)
    return dict(sorted(collections.Counter(n.op_type for n in model.graph.node).items()))


class BoundRun:
    """One session with its inputs and preallocated float32 outputs (``shapes``: name -> shape)
    bound, as ``OrtRunner`` runs a step."""

    def __init__(self, session, feeds: dict, shapes: dict):
        import onnxruntime as ort

        self.session = session
        self.binding = session.io_binding()
        for name, value in feeds.items():
            self.binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(value))
        self.outputs = {name: np.empty(shape, np.float32) for name, shape in shapes.items()}
        for name, buf in self.outputs.items():
            self.binding.bind_ortvalue_output(name, ort.OrtValue.ortvalue_from_numpy(buf))

    def __call__(self):
        self.session.run_with_iobinding(self.binding)


def out_of_bounds(errors: dict) -> list[str]:
    """The variants whose largest error exceeds their :data:`ERROR_BOUNDS`."""
    return [v for v, e in errors.items() if not e["max"] <= ERROR_BOUNDS.get(v, DEFAULT_ERROR_BOUND)]


def relative_errors(outputs: dict, reference: dict) -> dict:
    errs = []
    for name, ref in reference.items():
        scale = float(np.abs(ref).max()) or 1.0
        errs.append(float(np.abs(outputs[name].astype(np.float64) - ref).max()) / scale)
    return {"median": statistics.median(errs), "max": max(errs)}


RECORDS = {"weights": "weight_products", "attention": "attention_products"}  # the JSON's sections


def check_and_time(graphs, feeds, reference, threads: int, rounds: int, folder: Path, out: dict, what: str):
    """Every graph of ``graphs`` (variant -> path or bytes) run once on ``feeds`` and checked
    against ``reference`` (float64 outputs), its optimised kernels recorded in
    ``out[RECORDS[what]]["kernels"]``, then all timed side by side over ``rounds``. Returns
    ``(seconds, errors)``; a variant past its bound is added to ``out["wrong"]``."""
    record = out[RECORDS[what]]
    fns, errors = {}, {}
    for variant, graph in graphs.items():
        optimized = folder / f"{what}_{variant}.t{threads}.optimized.onnx"
        session = open_session(graph, threads, optimized)
        record["kernels"].setdefault(variant, kernel_counts(optimized))
        run = BoundRun(session, feeds, {name: ref.shape for name, ref in reference.items()})
        run()
        errors[variant] = relative_errors(run.outputs, reference)
        fns[variant] = run
    rows = next(iter(feeds.values())).shape[0]
    out["wrong"] += [f"{what} {v}, {rows} rows, {threads} thread(s)" for v in out_of_bounds(errors)]
    seconds = time_side_by_side(fns, "cpu", repeats=rounds, min_time=0.05)
    log.info(
        "%s %d thread(s), %3d rows: %s",
        what,
        threads,
        rows,
        "  ".join(f"{k} {1e3 * v:.2f} ms" for k, v in seconds.items()),
    )
    return seconds, errors


def probe_weights(args, folder: Path, out: dict) -> None:
    shapes = step_products(args.d_model, args.d_ff, args.vocab, args.layers)
    model, weights = weights_graph(shapes, args.d_model, args.d_ff, args.seed)
    paths = write_weight_variants(model, shapes, folder, args)
    out["weight_products"] = {
        "products": [{"name": n, "K": k, "N": nn} for n, k, nn in shapes],
        "float32_weight_bytes": int(sum(4 * k * n for _, k, n in shapes)),
        "file_bytes": {name: paths[name].stat().st_size for name in WEIGHT_VARIANTS},
        "kernels": {},
        "cases": [],
    }
    rng = np.random.default_rng(args.seed + 2)
    for threads in args.threads:
        for rows in args.rows:
            feeds = activations(shapes, rows, args.d_model, rng)
            reference = {}
            for name, _, _ in shapes:
                w, b = weights[name]
                reference[name] = feeds[f"{name}.in"].astype(np.float64) @ w.astype(np.float64) + b
            graphs = {v: os.fspath(paths[v]) for v in WEIGHT_VARIANTS}
            seconds, errors = check_and_time(
                graphs, feeds, reference, threads, args.rounds, folder, out, "weights"
            )
            out["weight_products"]["cases"].append(
                {
                    "threads": threads,
                    "rows": rows,
                    "ms": {k: 1e3 * v for k, v in seconds.items()},
                    "speedup_over_dynamic": {k: seconds["dynamic"] / v for k, v in seconds.items()},
                    "error": errors,
                }
            )


def probe_attention(args, folder: Path, out: dict) -> None:
    out["attention_products"] = {"cache_len": args.cache_len, "heads": args.heads, "cases": [], "kernels": {}}
    rng = np.random.default_rng(args.seed + 3)
    models = {v: attention_graph(args.layers, v).SerializeToString() for v in ATTENTION_VARIANTS}
    for threads in args.threads:
        for rows in args.rows:
            feeds = {}
            for i in range(args.layers):
                feeds[f"q{i}"] = rng.standard_normal((rows, args.heads, 1, args.head_size)).astype(np.float32)
                feeds[f"k{i}"] = rng.standard_normal(
                    (rows, args.heads, args.cache_len, args.head_size)
                ).astype(np.float32)
            reference = {
                f"scores{i}": feeds[f"q{i}"].astype(np.float64)
                @ feeds[f"k{i}"].astype(np.float64).swapaxes(-1, -2)
                for i in range(args.layers)
            }
            seconds, errors = check_and_time(
                models, feeds, reference, threads, args.rounds, folder, out, "attention"
            )
            out["attention_products"]["cases"].append(
                {
                    "threads": threads,
                    "rows": rows,
                    "ms": {k: 1e3 * v for k, v in seconds.items()},
                    "speedup_over_float32": {k: seconds["float32"] / v for k, v in seconds.items()},
                    "error": errors,
                }
            )


def _positive_ints(text: str, what: str, p) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        p.error(f"{what}: expected comma-separated integers, got {text!r}")
    if not values or min(values) < 1:
        p.error(f"{what}: expected integers of at least 1, got {text!r}")
    return values


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--d-ff", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=8000, help="output projection columns")
    p.add_argument("--layers", type=int, default=6, help="decoder layers")
    p.add_argument("--heads", type=int, default=8, help="attention heads (--attention)")
    p.add_argument("--head-size", type=int, default=64, help="d_k (--attention)")
    p.add_argument("--cache-len", type=int, default=48, help="cached positions T (--attention)")
    p.add_argument("--rows", default="1,4,16,64,256", help="comma-separated decoder rows")
    p.add_argument("--threads", default="1,2", help="comma-separated intra-op thread counts")
    p.add_argument("--rounds", type=int, default=7, help="interleaved timed rounds (median)")
    p.add_argument("--calibration", type=int, default=16, help="calibration draws of 8 rows (static)")
    p.add_argument("--nbits-block", type=int, default=256, help="block size of the nbits8 variant")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-weights", action="store_true", help="skip the weight products")
    p.add_argument("--no-attention", action="store_true", help="skip the attention products")
    p.add_argument(
        "--out", default=os.path.join(HERE, "results", "probe_int8_products.json"), help="JSON path"
    )
    args = p.parse_args(argv)
    args.rows = _positive_ints(args.rows, "--rows", p)
    args.threads = _positive_ints(args.threads, "--threads", p)
    for name in (
        "d_model",
        "d_ff",
        "vocab",
        "layers",
        "heads",
        "head_size",
        "cache_len",
        "rounds",
        "calibration",
    ):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected at least 1, got {getattr(args, name)}")
    if args.nbits_block not in (16, 32, 64, 128, 256) or args.d_model % args.nbits_block or args.d_ff % 128:
        p.error("--nbits-block: a power of two from 16 to 256 dividing --d-model (and 128 dividing --d-ff)")
    if args.d_model % 128:
        p.error("--d-model: the int4 variant's blocks of 128 must divide it")
    if args.no_weights and args.no_attention:
        p.error("--no-weights and --no-attention leave nothing to measure")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import onnxruntime

    out = {
        "command": " ".join([os.path.basename(sys.argv[0])] + (sys.argv[1:] if argv is None else list(argv))),
        "onnxruntime": onnxruntime.__version__,
        "dims": {"d_model": args.d_model, "d_ff": args.d_ff, "vocab": args.vocab, "layers": args.layers},
        "rounds": args.rounds,
        "machine": machine_info(tuple(args.threads)),
        "load_average_before": os.getloadavg(),
        "error_bounds": {"default": DEFAULT_ERROR_BOUND, **ERROR_BOUNDS},
        "wrong": [],
    }
    out["machine"].update({k: v for k, v in lscpu().items() if k not in out["machine"]})
    with tempfile.TemporaryDirectory(prefix="probe_int8_") as tmp:
        folder = Path(tmp)
        if not args.no_weights:
            probe_weights(args, folder, out)
        if not args.no_attention:
            probe_attention(args, folder, out)
    out["load_average_after"] = os.getloadavg()
    write_json(args.out, out)
    log.info("wrote %s", args.out)
    for what in out["wrong"]:
        log.error("%s: error above its bound (%s)", what, out["error_bounds"])
    return 1 if out["wrong"] else 0


if __name__ == "__main__":
    sys.exit(main())
