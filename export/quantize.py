"""Quantized export folders: ``python -m export.onnx --quantize SCHEME`` and ``python -m export.quantize``.

A quantized export is a complete, standalone export folder with the same file names as a float32
one (``encoder.onnx``, ``decoder_step.onnx``, ``manifest.json``, tokenizer files,
``generation.json``) and the same graph inputs and outputs, so :class:`OrtRunner`, the
translator and the Triton export load it unchanged. Its manifest carries a ``"quantization"``
section (:func:`transformer_ext.export_format.manifest_quantization`) saying how it was made.

Scheme ``int8`` (:data:`SCHEMES`): ONNX Runtime's dynamic quantization
(``onnxruntime.quantization.quantize_dynamic``) of every ``MatMul`` and ``Gemm`` whose weight
is an initializer, the output projection included: weights int8, symmetric, one scale per
output channel (``per_channel``); activations quantized to uint8 per tensor at run time
(``DynamicQuantizeLinear``); the products run as standard-ONNX ``MatMulInteger``. Weights are
quantized with ``reduce_range`` (7-bit): ONNX Runtime's u8 x s8 kernels on CPUs without VNNI
add pairs of products in 16 bits (``VPMADDUBSW``), which saturates with full-range int8 weights
(measured on the demo model: see :data:`SCHEMES`). Embedding tables are int8 rows with one
scale per row in the same range (:func:`quantize_row_tables`, :data:`ROW_TABLES`): the lookups
``Gather`` rows and scale them, and the tied output projection is a ``com.microsoft`` ``QGemm``
(``transB``) over the same rows, the u8 x s8 kernels of the other products, so the lookups of
every graph and the projection are one region of the shared weights file; attention products
over the caches, layer norms and softmax stay float32. int8 graphs are for ONNX
Runtime: the TensorRT builder and its readiness check refuse them. An int8 folder also holds a
few-row decoder step (``decoder_step_few_rows.onnx``, :func:`few_rows_graph`): the float32 step
with its layer weight products as 8-bit ``MatMulNBits`` and its tables and tied projection as the
int8 step's, which ``OrtRunner`` runs for steps of few rows (:data:`FEW_ROWS`); it passes the
same gate as the other graphs, every step through it.

Schemes ``int4`` and ``int8-nbits``: weight-only, block-wise quantization written here
(:func:`quantize_blocks`, :func:`_quantize_nbits_one`): every ``MatMul`` and ``Gemm`` whose weight
is a 2-D initializer becomes ONNX Runtime's ``com.microsoft`` ``MatMulNBits`` (4 or 8 bits, a
float32 scale and, unless ``symmetric``, a zero point per block of ``block_size`` weights along
the input dimension of one output column), the output projection included; the embedding
tables are 8-bit ``GatherBlockQuantized`` lookups, the tied output projection an 8-bit
``MatMulNBits`` over the same bytes (:func:`lookup_settings`). A block size
must divide every input dimension (``d_model``, ``d_ff``): checked on the model config before
anything is traced or written (:func:`check_block_dimensions`). ``accuracy_level`` 4 lets the
kernel quantize the activations to int8 per block (VNNI / AVX-512 int8 dot products); ONNX
Runtime falls back to float32 where it has no int8 kernel for the bits and block size, so the
manifest records what the kernel computed in on the exporting CPU (:func:`kernel_compute`) and
that CPU's instruction-set extensions (:func:`cpu_description`).

Validation. The float32 graphs are validated against eager PyTorch first (the logit tolerance
of a float32 export); the quantized graphs then pass a quality gate instead of a tolerance:
greedy decodes of the demo task's held-out set (:func:`transformer_ext.demo.heldout_examples`,
:mod:`transformer_ext.data`'s split) by the float32 and the quantized graphs, exact match against
the references; the quantized exact match may be at most :data:`DEFAULT_MAX_EM_DROP` points
below the float32 one. A failing gate raises :class:`QualityGateError` saying by how much, and
nothing is written. A model of real data gets a BLEU gate instead (``--gate-src FILE --gate-ref
FILE``, :class:`GateData`): both folders translate the source file greedily (the translator,
ONNX Runtime), sacrebleu scores them against the reference file, and the quantized BLEU may be
at most the scheme's :data:`DEFAULT_MAX_DROPS` points below float32's (0.5 for the int8 schemes,
1.0 for int4). Without gate files, a model whose tokenizer cannot encode the demo task has no
held-out set: the gate cannot run and the export is refused unless validation is turned off
(``--no-validate``, recorded as ``"gate": null`` in the manifest). ``export.quantize`` takes
translate's search flags for both gates (:data:`GATE_FLAGS`, generated from
:class:`transformer_ext.decoding.SearchOptions`: ``--beam-size``, ``--length-penalty``, ...):
both precisions then decode with them instead of greedily (the record's ``"search"``).

Files. :func:`quantize_export` converts an existing float32 export folder into a new folder
(every argument checked first, the folder built in a temporary sibling and swapped in;
:class:`transformer_ext.fsutil.StagedDir`); an already quantized folder is refused.
"""

from __future__ import annotations

if __name__ == "__main__":  # before the imports: one line, not a traceback, where they are missing
    from transformer_ext.commands import require

    require("export.quantize")

import argparse
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from transformer_ext.cli import UsageError, add_debug_flag, add_option, run_cli
from transformer_ext.export_format import (
    DECODER_FILE,
    ENCODER_FILE,
    FEW_ROWS_DECODER_FILE,
    QUANTIZATION_SCHEMES,
    WEIGHTS_FILE,
    ExportError,
    manifest_quantization,
    read_manifest,
    tokenizer_files,
)
from transformer_ext.fsutil import StagedDir, check_output_path
from transformer_ext.search_flags import add_decoding_flags, check_decoding_flags, decoding_values

from .manifest import (
    check_replaceable,
    folder_files,
    make_parents,
    named_write_error,
    remove_made_parents,
    write_manifest,
)
from .weights import PRODUCT_SUFFIX, is_product_view, share_weights

logger = logging.getLogger(__name__)

__all__ = [
    "SCHEMES",
    "DEFAULT_MAX_EM_DROP",
    "DEFAULT_MAX_BLEU_DROP",
    "GateData",
    "bleu_gate",
    "INT8_OP_TYPES",
    "QuantizationError",
    "QuantizationUsageError",
    "QualityGateError",
    "check_scheme",
    "quantize_graphs",
    "quality_gate",
    "quantize_folder",
    "quantize_export",
    "main",
    "NBITS_SCHEMES",
    "NBITS_OPTIONS",
    "BLOCK_SIZES",
    "ACCURACY_LEVELS",
    "DEFAULT_MAX_DROPS",
    "ISA_FLAGS",
    "default_max_drops",
    "resolve_settings",
    "default_block_size",
    "NARROW_BLOCK_SIZE",
    "check_block_dimensions",
    "check_quantize_arguments",
    "quantize_blocks",
    "quantize_lookups",
    "quantize_row_tables",
    "row_table",
    "ROW_TABLES",
    "ROW_TABLE_BITS",
    "lookup_settings",
    "kernel_compute",
    "cpu_description",
    "add_gate_arguments",
    "add_nbits_arguments",
    "gate_data_from_args",
    "nbits_options_from_args",
    "quantization_summary",
    "TABLE_BITS",
    "TABLE_4BIT_MIN_SHARE",
    "table_share",
    "default_table_bits",
]

# How each scheme is made; recorded in the manifest's "quantization" section.
# Measured on the demo model (greedy exact match on its 500 held-out examples, ONNX Runtime 1.32,
# AMD EPYC without VNNI; float32 99.8%): per-channel int8 with reduce_range 99.8% (every decode
# equal to float32's), full-range int8 or uint8 weights 99.6% (one decode differs). reduce_range
# keeps the u8 x s8 kernels from saturating.
# int4 blocks of 128 (`base`, greedy batch 1, a 2-core Zen 4): 1.30x / 1.11x as fast as blocks of
# 32 at 1 / 2 threads, side by side in one process (benchmarks/results/ab_int4_b32_vs_b128_t1.json,
# _t2.json), fewer scales and zero points read per weight; the Bible recipe's BLEU gate
# (recipes/bible-en-de/gates/int4_blocks.txt) lost 0.12 points at 128 and 0.22 at 32.
_NBITS_METHOD = (
    "MatMulNBits (ONNX Runtime contrib operator, com.microsoft), weight-only, written by export.quantize"
)
_NBITS_ACTIVATIONS = "float32; with accuracy_level 4 the kernel quantizes them to int8 per block at run time"
SCHEMES: dict[str, dict[str, Any]] = {
    "int8": {
        "method": "onnxruntime.quantization.quantize_dynamic",
        "weights": "int8, symmetric, one scale per output channel",
        "weight_type": "int8",
        "per_channel": True,
        "reduce_range": True,
        "activations": "uint8, one scale per tensor, computed at run time (DynamicQuantizeLinear)",
        "op_types": ["MatMul", "Gemm"],
    },
    "int4": {
        "method": _NBITS_METHOD,
        "bits": 4,
        "block_size": 128,  # or the largest size below that fits the model (default_block_size)
        "accuracy_level": 4,
        "symmetric": False,
        "activations": _NBITS_ACTIVATIONS,
        "op_types": ["MatMul", "Gemm"],
    },
    "int8-nbits": {
        "method": _NBITS_METHOD,
        "bits": 8,
        "block_size": 32,
        "accuracy_level": 4,
        "symmetric": False,
        "activations": _NBITS_ACTIVATIONS,
        "op_types": ["MatMul", "Gemm"],
    },
}
assert tuple(SCHEMES) == QUANTIZATION_SCHEMES
# The block-wise weight-only schemes, their options (with the command-line flag of each) and ranges.
NBITS_SCHEMES = ("int4", "int8-nbits")
NBITS_OPTIONS = {
    "block_size": "--quant-block-size",
    "accuracy_level": "--quant-accuracy-level",
    "symmetric": "--quant-symmetric",
}
BLOCK_SIZES = (16, 32, 64, 128, 256)
ACCURACY_LEVELS = {
    0: "unset (float32 on CPU)",
    1: "float32",
    2: "float16 (float32 on x86)",
    3: "bfloat16 (float32 on x86)",
    4: "int8 activations (VNNI / AVX-512 / AVX2 / ARM dot products)",
}
DEFAULT_MAX_EM_DROP = 0.2  # points of exact match (percent) the int8 graphs may lose against float32
# The SearchOptions fields the quality gate's search takes on export.quantize's command line (the
# names and old spellings of translate's flags): (field, old spellings, metavar). Without them
# both precisions decode greedily.
GATE_FLAGS = (
    ("beam_size", ("--beam",), "N"),
    ("length_penalty", ("--alpha",), "A"),
    ("length_penalty_type", (), None),
    ("max_decoding_length", ("--max-length",), "N"),
    ("min_decoding_length", ("--min-length",), "N"),
    ("max_len_a", (), "A"),
    ("max_len_b", (), "B"),
    ("repetition_penalty", (), "P"),
    ("no_repeat_ngram_size", (), "N"),
)
DEFAULT_MAX_BLEU_DROP = 0.5  # BLEU points the int8 graphs may lose against float32 on --gate-src/--gate-ref
# Each scheme's defaults of both gates: (exact-match points on the demo, BLEU points on --gate-src).
DEFAULT_MAX_DROPS: dict[str, tuple[float, float]] = {
    "int8": (DEFAULT_MAX_EM_DROP, DEFAULT_MAX_BLEU_DROP),
    "int4": (DEFAULT_MAX_EM_DROP, 1.0),
    "int8-nbits": (DEFAULT_MAX_EM_DROP, DEFAULT_MAX_BLEU_DROP),
}
# Ops of quantized graphs (what the TensorRT readiness check refuses).
INT8_OP_TYPES = (
    "MatMulInteger",
    "DynamicQuantizeLinear",
    "QLinearMatMul",
    "ConvInteger",
    "DynamicQuantizeMatMul",
    "MatMulIntegerToFloat",
    "QGemm",
    "QuantizeLinear",
    "DequantizeLinear",
)


class QuantizationError(ExportError):
    """A folder cannot be quantized (unknown scheme, already quantized, not an export)."""


class QuantizationUsageError(QuantizationError, UsageError):
    """A quantization option out of its range, or options that exclude each other (exit code 2):
    an unknown scheme or option, a block size that does not divide the model's matrices, a gate
    threshold that is not a finite number >= 0, half of a BLEU gate's pair of files."""


class QualityGateError(QuantizationError):
    """The quantized graphs decode too differently from float32 (or the gate cannot run)."""


def check_scheme(scheme: Any) -> str:
    """``scheme`` if it is one of :data:`SCHEMES`; raises :class:`QuantizationError` naming the choices."""
    if not isinstance(scheme, str) or scheme not in SCHEMES:
        raise QuantizationUsageError(
            f"unknown quantization scheme {scheme!r}: expected one of {list(SCHEMES)}"
        )
    return scheme


class GateData:
    """The parallel text of a BLEU gate: ``sources`` and ``references`` (one line each), read and
    checked when made, so a bad file is refused before anything is written. ``source_lang`` /
    ``target_lang``: the language codes a multilingual model translates the sources with
    (Marian's ``>>xx<<`` target token; M2M100 / NLLB's source and target tokens), as
    ``translate --source-lang / --target-lang``; checked against the model by
    :func:`check_gate_inputs`.

    Raises :class:`QuantizationError` naming ``--gate-src`` / ``--gate-ref`` for a missing,
    non-UTF-8 or empty file, line counts that differ, or a blank source line.
    """

    def __init__(
        self,
        src: str | os.PathLike,
        ref: str | os.PathLike,
        *,
        source_lang: Optional[str] = None,
        target_lang: Optional[str] = None,
    ):
        from transformer_ext.data import DataError, read_lines

        for flag, value in (("--source-lang", source_lang), ("--target-lang", target_lang)):
            if value is not None and not (isinstance(value, str) and value):
                raise QuantizationUsageError(
                    f"{flag} of the BLEU gate must be a language code, got {value!r}"
                )
        self.src, self.ref = Path(src), Path(ref)
        self.source_lang, self.target_lang = source_lang, target_lang
        try:
            self.sources, self.references = read_lines(self.src), read_lines(self.ref)
        except DataError as exc:
            raise QuantizationError(f"BLEU gate (--gate-src / --gate-ref): {exc}") from None
        if not self.sources:
            raise QuantizationError(f"--gate-src {self.src} has no lines")
        if len(self.sources) != len(self.references):
            raise QuantizationError(
                f"--gate-src {self.src} has {len(self.sources)} lines but --gate-ref {self.ref} "
                f"has {len(self.references)}: one reference per source line"
            )
        blank = next((i for i, line in enumerate(self.sources) if not line.strip()), None)
        if blank is not None:
            raise QuantizationError(
                f"--gate-src {self.src}, line {blank + 1} is empty: every gate source must have text"
            )


def _check_max_drop(value: Any, name: str = "max_em_drop") -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not (np.isfinite(value) and value >= 0)
    ):
        what = "points of exact match" if name == "max_em_drop" else "BLEU points"
        raise QuantizationUsageError(f"{name} must be a finite number >= 0 ({what}), got {value!r}")
    return float(value)


# ------------------------------------------------------------------------------------------
# The graphs
# ------------------------------------------------------------------------------------------


def _tied_products(model) -> dict[str, str]:
    """``{node name: weight name}`` of the weight products of ``model`` that read a lookup table
    under its second name (the tied output projection, :func:`export.weights.split_lookup_readers`)."""
    inits = {t.name: t for t in model.graph.initializer}
    tied = {}
    for node in model.graph.node:
        product = _weight_product(node, inits)
        if product and product[0].endswith(PRODUCT_SUFFIX) and node.name:
            table = product[0][: -len(PRODUCT_SUFFIX)]
            if is_product_view(model.graph, product[0], table):
                tied[node.name] = product[0]
    return tied


def _quantize_one(src: Path, dst: Path, settings: dict, lookups: Optional[Mapping[str, Any]] = None) -> dict:
    """Quantize the graph ``src`` into ``dst``; ``{"quantized_nodes", "op_counts", "initializer_bytes",
    "tensors"}``. With ``lookups`` (:data:`ROW_TABLES`), the embedding tables become int8 rows and
    a tied output projection a ``QGemm`` over them (:func:`quantize_row_tables`); every other
    weight product ``MatMulInteger`` (``quantize_dynamic``)."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    weight_type = {"int8": QuantType.QInt8, "uint8": QuantType.QUInt8}[settings["weight_type"]]
    before = onnx.load(os.fspath(src))
    tensors: dict[str, str] = {}
    source = src
    if lookups is not None:
        tensors.update(quantize_row_tables(before, src.name, lookups.get("width")))
        if tensors:  # quantize_dynamic reads a file: the graph with its tables done, beside dst
            source = dst.with_name(f"{dst.name}.tables.onnx")
            onnx.save(before, os.fspath(source))
    names = {t.name for t in before.graph.initializer}
    products = [
        n.input[1]
        for n in before.graph.node
        if n.op_type in settings["op_types"] and len(n.input) > 1 and n.input[1] in names
    ]
    candidates = len(products)
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # quantize_dynamic warns on the root logger about pre-processing
    try:
        quantize_dynamic(
            os.fspath(source),
            os.fspath(dst),
            op_types_to_quantize=list(settings["op_types"]),
            per_channel=settings["per_channel"],
            reduce_range=settings["reduce_range"],
            weight_type=weight_type,
        )
    finally:
        root.setLevel(level)
        if source != src:
            Path(source).unlink(missing_ok=True)
    model = onnx.load(os.fspath(dst))
    tensors.update({w: "MatMulInteger int8, one scale per output channel" for w in products})
    counts: dict[str, int] = {}
    for n in model.graph.node:
        counts[n.op_type] = counts.get(n.op_type, 0) + 1
    quantized = counts.get("MatMulInteger", 0)
    left = sum(
        1
        for n in model.graph.node
        if n.op_type in settings["op_types"]
        and len(n.input) > 1
        and n.input[1] in {t.name for t in model.graph.initializer}
    )
    if quantized != candidates or left:
        raise QuantizationError(
            f"{src.name}: {quantized} of {candidates} weight products were quantized "
            f"({left} float32 ones left): the graph is not what this quantizer expects"
        )
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, os.fspath(dst))
    return {
        "quantized_nodes": quantized,
        "op_counts": dict(sorted(counts.items())),
        "initializer_bytes": _initializer_bytes(model.graph),
        "tensors": dict(sorted(tensors.items())),
    }


def quantize_graphs(
    src_dir: Path,
    dst_dir: Path,
    scheme: str,
    options: Optional[Mapping[str, Any]] = None,
    model_config: Optional[Mapping[str, Any]] = None,
) -> dict:
    """Quantize ``src_dir``'s two graphs into ``dst_dir`` (same file names); the manifest section:
    the scheme's settings (``options`` applied for the model of ``model_config``,
    :func:`resolve_settings`), the ONNX Runtime
    version, the CPU (:func:`cpu_description`) and, for MatMulNBits, what its kernel computes in
    on this CPU (``"kernel_compute"``, :func:`kernel_compute`), the per-graph counts."""
    import onnxruntime

    settings = resolve_settings(scheme, options, model_config)
    want_few_rows = settings.pop("few_rows", False)
    lookups = lookup_settings(scheme, settings, model_config)
    graphs = {}
    for key, name in (("encoder", ENCODER_FILE), ("decoder_step", DECODER_FILE)):
        if "bits" in settings:
            graphs[key] = _quantize_nbits_one(Path(src_dir) / name, Path(dst_dir) / name, settings, lookups)
        else:
            graphs[key] = _quantize_one(Path(src_dir) / name, Path(dst_dir) / name, settings, lookups)
    section = {"scheme": scheme, **settings, "onnxruntime": onnxruntime.__version__}
    section["lookups"] = (
        {
            k: lookups[k]
            for k in ("method", "bits", "block_size", "symmetric", "per_row", "weights", "projection")
            if k in lookups
        }
        if lookups is not None
        else None
    )
    if "bits" in settings:
        section["kernel_compute"] = kernel_compute(
            settings["bits"], settings["block_size"], settings["accuracy_level"]
        )
    if scheme == "int8":
        section["few_rows"] = (
            few_rows_graph(Path(src_dir), Path(dst_dir), model_config, lookups)
            if want_few_rows and model_config is not None
            else None
        )
    section.update(cpu=cpu_description(), graphs=graphs, gate=None)
    return section


# int4's embedding tables (and the tied output projection over their bytes): 4 bits where the
# tables hold at least TABLE_4BIT_MIN_SHARE of the model's weights, 8 bits elsewhere
# (default_table_bits). Where the tables are that large they decide the folder's size (opus-mt-en-de:
# 40% of the weights, the 8-bit table 31 of the int4 folder's 59 MB); where they are small 8 bits
# cost little (`base`: 8%; the demo model: under 2%, whose 4-bit tables lose 0.8 to 1.0 points of
# exact match, blocks of 32 or 16, where the gate allows 0.2). Either way the export's gate decides.
TABLE_BITS = (4, 8)
TABLE_BITS_FLAG = "--quant-table-bits"
TABLE_4BIT_MIN_SHARE = 0.25


def table_share(model_config: Mapping[str, Any]) -> float:
    """The embedding tables' share of the weights of the model of ``model_config`` (tables and
    weight matrices, counted from the dimensions; a tied output projection is its table)."""
    d, d_ff = int(model_config["d_model"]), int(model_config["d_ff"])
    src, tgt = int(model_config["src_vocab_size"]), int(model_config["tgt_vocab_size"])
    tables = tgt * d + (0 if model_config.get("shared_vocab") else src * d)
    ffn = (3 if model_config.get("gated_ffn") else 2) * d * d_ff
    layers = int(model_config["n_encoder_layers"]) * (4 * d * d + ffn) + int(
        model_config["n_decoder_layers"]
    ) * (8 * d * d + ffn)
    untied = 0 if model_config.get("tie_target_embeddings", True) else tgt * d
    return tables / (tables + layers + untied)


def default_table_bits(model_config: Mapping[str, Any]) -> int:
    """The bits of an ``int4`` export's embedding tables when ``table_bits`` is not given: 4 where
    :func:`table_share` is at least :data:`TABLE_4BIT_MIN_SHARE`, else 8 (and 8 for a partial
    config without the sizes the share is counted from)."""
    sizes = ("d_model", "d_ff", "src_vocab_size", "tgt_vocab_size", "n_encoder_layers", "n_decoder_layers")
    if not all(key in model_config for key in sizes):
        return 8
    return 4 if table_share(model_config) >= TABLE_4BIT_MIN_SHARE else 8


_LOOKUP_METHOD = (
    "GatherBlockQuantized (ONNX Runtime contrib operator, com.microsoft), written by export.quantize"
)

# The embedding tables of an int8 export: int8 rows with one scale per row, in the scheme's
# reduce_range (ROW_TABLE_BITS: values in -63..63), read by the lookups as Gather + Cast + Mul
# and by the tied output projection as com.microsoft QGemm (transB) over the same bytes
# (quantize_row_tables). ONNX Runtime packs a constant QGemm weight for its u8 x s8 kernels, the
# ones the dynamic int8 products run, so the projection's time grows with the rows like theirs;
# 8-bit MatMulNBits blocks of 32 (the layout before) took 3.28 ms at 64 rows where a dynamic int8
# product of the same size took 0.30 ms (benchmarks/probes/probe_int8_head.py has the forms
# side by side). One scale per row instead of a scale and a zero point per block of 32 also
# stores 4.6 MB less at opus-mt-en-de size.
ROW_TABLE_BITS = 7
ROW_TABLES = {
    "method": "Gather of int8 rows, Cast, Mul by the row's scale (standard ONNX), written by export.quantize",
    "bits": 8,
    "block_size": None,
    "symmetric": True,
    "per_row": True,
    "weights": f"int8, symmetric, one scale per row, {ROW_TABLE_BITS}-bit range (reduce_range: -63..63), "
    "rounded to nearest within the range of least squared error per row",
    "projection": "com.microsoft QGemm (transB) over the same int8 rows, their scales one per output "
    "column; activations uint8, one scale per tensor, computed at run time (DynamicQuantizeLinear)",
}


def lookup_settings(
    scheme: str, settings: Mapping[str, Any], model_config: Optional[Mapping[str, Any]]
) -> Optional[dict]:
    """How the embedding tables of a ``scheme`` export are quantized: ``int8``, int8 rows with a
    scale per row, the tied output projection a ``QGemm`` over them (:data:`ROW_TABLES`,
    :func:`quantize_row_tables`); ``int8-nbits`` with its own settings and ``int4`` to
    ``table_bits`` (4 or 8, :func:`default_table_bits`), its other settings its own, as
    ``GatherBlockQuantized`` lookups and a tied output projection an ``MatMulNBits`` over the same
    bytes (:func:`quantize_lookups`). With ``model_config``, ``int8``'s entry names the rows'
    width (``d_model``): only tables of that width are embeddings (a T5 position-bias table,
    ``[buckets, heads]``, stays float32)."""
    if settings.get("bits") == 8:
        return {**settings, "method": _LOOKUP_METHOD}
    if "bits" in settings:  # int4: tables in table_bits (default_table_bits), its other settings
        table = {k: v for k, v in settings.items() if k != "table_bits"}
        return {**table, "bits": int(settings.get("table_bits", 8)), "method": _LOOKUP_METHOD}
    rows = dict(ROW_TABLES)
    if model_config is not None and "d_model" in model_config:
        rows["width"] = int(model_config["d_model"])  # what an embedding row holds
    return rows


# ------------------------------------------------------------------------------------------
# The few-row decoder step of int8 exports
# ------------------------------------------------------------------------------------------

# When an int8 export's few-row decoder step (FEW_ROWS_DECODER_FILE: its weight products as 8-bit
# MatMulNBits, accuracy_level 4) runs instead of the dynamic int8 one: steps of at most
# "max_rows" rows on a runner with at least "min_threads" intra-op threads; its blocks are the
# largest of BLOCK_SIZES that divides d_model and d_ff. Measured on `base` (6+6 x 512, 48
# tokens) with benchmarks/probes/ab_exports.py, the two graphs side by side in one process
# (benchmarks/results/ab_few_rows_*_xeon.json, a 2-core Xeon with AVX-512 VNNI and AMX; the
# README's int8 paragraph has the numbers): with 2 threads the few-row step decodes 1 and 2 rows
# faster than the dynamic int8 one and 3 or more rows no faster; with 1 thread it is no faster
# at any row count. ONNX Runtime's dynamic int8 product gains little from a second thread at one
# row, where the MatMulNBits kernel splits its columns over both.
FEW_ROWS = {"max_rows": 2, "min_threads": 2}
FEW_ROWS_FLAG = "--no-few-rows-graph"
FEW_ROWS_BLOCK_SIZE = 256  # blocks of 256 read the fewest scales and zero points (see above)


def few_rows_block_size(model_config: Mapping[str, Any]) -> Optional[int]:
    """The few-row step's block size: the largest of :data:`BLOCK_SIZES` up to
    :data:`FEW_ROWS_BLOCK_SIZE` that divides ``d_model`` and ``d_ff``; None when none does."""
    dims = tuple(product_inputs(model_config).values())
    fits = [b for b in BLOCK_SIZES if b <= FEW_ROWS_BLOCK_SIZE and all(d % b == 0 for d in dims)]
    return max(fits) if fits else None


def few_rows_graph(
    src_dir: Path,
    dst_dir: Path,
    model_config: Mapping[str, Any],
    lookups: Optional[Mapping[str, Any]] = None,
    int8_step: Optional[Path] = None,
) -> Optional[dict]:
    """Write ``dst_dir / FEW_ROWS_DECODER_FILE``, the float32 decoder step of ``src_dir`` with its
    weight products as 8-bit ``MatMulNBits`` over the int8 decoder step's own weight bytes
    (``int8_step``, by default ``dst_dir / DECODER_FILE``: :func:`_shared_nbits_products`), so
    the shared weights file stores them once; returns the manifest's ``quantization.few_rows``
    entry (:func:`transformer_ext.export_format.manifest_few_rows`), or None, writing nothing,
    when no block size fits the model, ONNX Runtime has no int8 ``MatMulNBits`` kernel on this
    CPU (its float32 fallback is several times slower than the dynamic int8 step), or the float32
    step keeps its weights in an external ``.data`` file (a model over 2 GiB)."""
    if (Path(src_dir) / (DECODER_FILE + ".data")).exists():
        logger.info(
            "no few-row decoder step: the float32 step keeps its weights in %s.data (over 2 GiB), "
            "and the few-row step is written as one file",
            DECODER_FILE,
        )
        return None
    block = few_rows_block_size(model_config)
    if block is None:
        logger.info("no few-row decoder step: no MatMulNBits block size divides d_model and d_ff")
        return None
    settings = resolve_settings("int8-nbits", {"block_size": block}, model_config)
    compute = kernel_compute(settings["bits"], block, settings["accuracy_level"])
    if compute != "int8":
        logger.info(
            "no few-row decoder step: ONNX Runtime has no int8 MatMulNBits kernel on this CPU "
            "(it would compute in float32, slower than the dynamic int8 step)"
        )
        return None
    step = Path(int8_step) if int8_step is not None else Path(dst_dir) / DECODER_FILE
    if not step.is_file():
        raise QuantizationError(
            f"the few-row decoder step reads the weights of the int8 decoder step, and {step} does not exist"
        )
    settings = {**settings, "symmetric": True}
    graph = _quantize_nbits_one(
        Path(src_dir) / DECODER_FILE,
        Path(dst_dir) / FEW_ROWS_DECODER_FILE,
        settings,
        lookups=lookups,
        int8_step=step,
    )
    settings["weights"] = (
        "the int8 decoder step's weights (int8, symmetric, one scale per output channel, the "
        f"same bytes in {WEIGHTS_FILE}) read as 8-bit blocks of {block}: the graph transposes them "
        "and moves them to MatMulNBits' unsigned range (Transpose, BitwiseXor), which ONNX "
        "Runtime folds when it loads the graph"
    )
    return {
        "file": FEW_ROWS_DECODER_FILE,
        **FEW_ROWS,
        "scheme": "int8-nbits",
        **{
            k: settings[k] for k in ("method", "bits", "block_size", "accuracy_level", "symmetric", "weights")
        },
        "kernel_compute": compute,
        "graph": graph,
        "gate": None,
    }


# ------------------------------------------------------------------------------------------
# Block-wise weight-only schemes (MatMulNBits)
# ------------------------------------------------------------------------------------------


# The block size of a model that the scheme's default block size does not fit: on the demo model
# (d_model 64) int4 blocks of 32 keep every held-out greedy decode equal to float32's, blocks of
# 64 lose one of 500 (tests/test_quantize_nbits.py).
NARROW_BLOCK_SIZE = 32


def default_block_size(model_config: Mapping[str, Any], preferred: int) -> int:
    """The block size a MatMulNBits scheme takes when none is given: ``preferred`` (the scheme's
    default) where it divides ``d_model`` and ``d_ff``, else the largest of :data:`BLOCK_SIZES`
    up to :data:`NARROW_BLOCK_SIZE` that does (``preferred`` itself when none does:
    :func:`check_block_dimensions` then names the matrices)."""
    dims = tuple(product_inputs(model_config).values())
    if all(d % preferred == 0 for d in dims):
        return preferred
    cap = min(preferred, NARROW_BLOCK_SIZE)
    fits = [b for b in BLOCK_SIZES if b <= cap and all(d % b == 0 for d in dims)]
    return max(fits) if fits else preferred


def resolve_settings(
    scheme: str, options: Optional[Mapping[str, Any]] = None, model_config: Optional[Mapping[str, Any]] = None
) -> dict:
    """The settings of ``scheme`` with ``options`` (``block_size``, ``accuracy_level``,
    ``symmetric`` of the MatMulNBits schemes, ``few_rows`` of ``int8``: whether to write the
    few-row decoder step, default True; ``table_bits`` of ``int4``: the bits of its embedding
    tables; ``None`` values keep the scheme's default) applied and checked. With ``model_config``
    and no ``block_size`` given, the block size is :func:`default_block_size`, and ``int4``'s
    ``table_bits`` :func:`default_table_bits`.

    Raises :class:`QuantizationError` naming the option and its allowed values, or saying that
    the scheme has no such option (``int8`` is dynamic quantization: no blocks).
    """
    settings = dict(SCHEMES[check_scheme(scheme)])
    given = {k: v for k, v in dict(options or {}).items() if v is not None}
    unknown = sorted(set(given) - set(NBITS_OPTIONS) - {"few_rows", "table_bits"})
    if unknown:
        raise QuantizationUsageError(
            f"unknown quantization option(s) {unknown}: expected {[*NBITS_OPTIONS, 'few_rows', 'table_bits']}"
        )
    if "table_bits" in given:
        if scheme != "int4":
            raise QuantizationUsageError(
                f"{TABLE_BITS_FLAG} applies to --quantize int4 (its embedding tables); --quantize {scheme} "
                "stores them at 8 bits"
            )
        value = given["table_bits"]
        if isinstance(value, bool) or value not in TABLE_BITS:
            raise QuantizationUsageError(
                f"{TABLE_BITS_FLAG} must be one of {list(TABLE_BITS)}, got {value!r}"
            )
    if "few_rows" in given:
        if scheme != "int8":
            raise QuantizationUsageError(
                f"{FEW_ROWS_FLAG} applies to --quantize int8 (its few-row decoder step); --quantize "
                f"{scheme} writes one decoder step"
            )
        if not isinstance(given["few_rows"], (bool, np.bool_)):
            raise QuantizationUsageError(f"few_rows must be true or false, got {given['few_rows']!r}")
    if "bits" not in settings:
        nbits = sorted(set(given) - {"few_rows", "table_bits"})
        if nbits:
            flags = ", ".join(NBITS_OPTIONS[k] for k in nbits)
            raise QuantizationUsageError(
                f"{flags} set the blocks of a MatMulNBits scheme ({', '.join(NBITS_SCHEMES)}); "
                f"--quantize {scheme} is dynamic quantization with one scale per output channel"
            )
        settings["few_rows"] = bool(given.get("few_rows", True))
        return settings
    if "block_size" in given:
        value = given["block_size"]
        if isinstance(value, bool) or not isinstance(value, int) or value not in BLOCK_SIZES:
            raise QuantizationUsageError(
                f"{NBITS_OPTIONS['block_size']} must be one of {list(BLOCK_SIZES)} (a power of two, the "
                f"sizes ONNX Runtime's MatMulNBits kernels take), got {value!r}"
            )
        settings["block_size"] = value
    elif model_config is not None:
        settings["block_size"] = default_block_size(model_config, settings["block_size"])
    if "accuracy_level" in given:
        value = given["accuracy_level"]
        if isinstance(value, bool) or not isinstance(value, int) or value not in ACCURACY_LEVELS:
            raise QuantizationUsageError(
                f"{NBITS_OPTIONS['accuracy_level']} must be one of {list(ACCURACY_LEVELS)} (MatMulNBits: "
                f"{'; '.join(f'{k} {v}' for k, v in ACCURACY_LEVELS.items())}), got {value!r}"
            )
        settings["accuracy_level"] = value
    if "symmetric" in given:
        if not isinstance(given["symmetric"], bool):
            raise QuantizationUsageError(
                f"{NBITS_OPTIONS['symmetric']} must be true or false, got {given['symmetric']!r}"
            )
        settings["symmetric"] = given["symmetric"]
    if scheme == "int4":
        if "table_bits" in given:
            settings["table_bits"] = int(given["table_bits"])
        elif model_config is not None:
            settings["table_bits"] = default_table_bits(model_config)
    settings["weights"] = _weights_text(settings)
    return settings


def _weights_text(settings: Mapping[str, Any]) -> str:
    bits, block = settings["bits"], settings["block_size"]
    if settings["symmetric"]:
        how = f"symmetric (a float32 scale per block, zero point {1 << (bits - 1)} implied)"
    else:
        how = f"asymmetric (a float32 scale and a {bits}-bit zero point per block)"
    return (
        f"{bits}-bit, block-wise along the input dimension K (blocks of {block} weights of one output "
        f"column), {how}, rounded to nearest within the range of least squared error per block"
    )


def product_inputs(model_config: Mapping[str, Any]) -> dict[str, int]:
    """The input dimensions K of the model's weight products, by name: ``d_model``, ``d_ff`` and,
    where the heads' width differs from ``d_model`` (T5's ``d_kv``), ``n_heads * d_kv``, the
    input of the attention output projections."""
    from transformer_ext.export_format import head_width

    dims = {"d_model": int(model_config["d_model"]), "d_ff": int(model_config["d_ff"])}
    if "n_heads" in model_config:  # (a partial config names only the two widths)
        heads = int(model_config["n_heads"]) * head_width(model_config)
        if heads != dims["d_model"]:
            dims["n_heads * d_kv"] = heads
    return dims


def check_block_dimensions(model_config: Mapping[str, Any], settings: Mapping[str, Any]) -> None:
    """Refuse a block size that does not divide the input dimension of a weight matrix, naming
    the matrices; ``d_model`` is the input of every attention projection, of the first
    feed-forward matrix and of the output projection, ``d_ff`` the input of the second.
    Checked on the model config, before any graph is traced or read."""
    if "bits" not in settings:
        return
    block = settings["block_size"]
    dims = product_inputs(model_config)
    what = {
        "d_model": "the attention projections (d_model x d_model), the first feed-forward matrix "
        "(d_model x d_ff) and the output projection (d_model x vocab)",
        "d_ff": "the second feed-forward matrix (d_ff x d_model) of every layer",
        "n_heads * d_kv": "every attention output projection (n_heads * d_kv x d_model)",
    }
    for name, value in dims.items():
        if value % block:
            fits = [b for b in BLOCK_SIZES if all(v % b == 0 for v in dims.values())]
            hint = f"block sizes that fit this model: {fits}" if fits else "no MatMulNBits block size fits it"
            raise QuantizationUsageError(
                f"{NBITS_OPTIONS['block_size']} {block} does not divide {name} = {value}, the input "
                f"dimension K of {what[name]}: every block must be whole ({hint})"
            )


# Range factors tried per block by quantize_blocks (1.0 first: plain rounding to nearest).
RANGE_FACTORS = tuple(np.round(np.linspace(1.0, 0.5, 26), 4))


_BLOCKS_CACHE: dict[
    tuple, tuple
] = {}  # one table, quantized once per process (the lookups and the projection)
_BLOCKS_CACHE_MIN = 1 << 20  # only matrices of at least this many weights are kept


def _cached_blocks(weight_nk: np.ndarray, bits: int, block_size: int, symmetric: bool):
    """:func:`quantize_blocks`, remembered for large matrices: an embedding table is quantized for
    the lookups and the projection of every graph with the same settings, to the same bytes."""
    import hashlib

    weight_nk = np.ascontiguousarray(weight_nk, dtype=np.float32)
    if weight_nk.size < _BLOCKS_CACHE_MIN:
        return quantize_blocks(weight_nk, bits, block_size, symmetric)
    key = (hashlib.sha256(weight_nk.data).hexdigest(), weight_nk.shape, bits, block_size, bool(symmetric))
    if key not in _BLOCKS_CACHE:
        if len(_BLOCKS_CACHE) >= 4:
            _BLOCKS_CACHE.pop(next(iter(_BLOCKS_CACHE)))
        _BLOCKS_CACHE[key] = quantize_blocks(weight_nk, bits, block_size, symmetric)
    return _BLOCKS_CACHE[key]


def quantize_blocks(weight_nk: np.ndarray, bits: int, block_size: int, symmetric: bool):
    """``weight_nk`` ``[N, K]`` (one row per output column, ``K % block_size == 0``) in
    MatMulNBits' layout: ``(packed [N, K / block_size, block_size * bits / 8] uint8, scales
    [N, K / block_size] float32, zero_points [N, ceil(K / block_size * bits / 8)] uint8 or None)``.

    Per block, values are rounded to nearest on a grid covering a range: asymmetric, ``f *
    [min(v, 0), max(v, 0)]`` mapped onto ``0 .. 2^bits - 1`` (scale ``f * (max - min) / (2^bits -
    1)``, zero point ``round(-f * min / scale)``); symmetric, ``f * [-absmax, absmax]`` onto ``1 ..
    2^bits - 1`` around the implied zero point ``2^(bits-1)``. Of the factors ``f`` in
    :data:`RANGE_FACTORS` each block keeps the one with the smallest squared error (a narrower
    range clips a few large weights and rounds the others finer: on the demo model, block size
    32, this keeps every int4 greedy decode equal to float32's where the full range loses 1.6
    points of exact match). 4-bit values are packed two per byte, the first in the low nibble.
    A block of zeros gets scale 1.
    """
    n, k = weight_nk.shape
    blocks = k // block_size
    v = np.asarray(weight_nk, dtype=np.float32).reshape(n, blocks, block_size)
    top = (1 << bits) - 1
    mid = 1 << (bits - 1)
    if symmetric:
        full_low, full_high = None, np.abs(v).max(axis=2)
    else:
        full_low, full_high = np.minimum(v.min(axis=2), 0.0), np.maximum(v.max(axis=2), 0.0)
    best = None
    for f in RANGE_FACTORS:
        if symmetric:
            scale = (full_high * np.float32(f) / (mid - 1)).astype(np.float32)
            scale = np.where(scale > 0, scale, np.float32(1.0))
            zero = np.full(scale.shape, mid, dtype=np.float32)
            q = np.clip(np.rint(v / scale[..., None]), 1 - mid, mid - 1) + mid
        else:
            scale = ((full_high - full_low) * np.float32(f) / top).astype(np.float32)
            scale = np.where(scale > 0, scale, np.float32(1.0))
            zero = np.clip(np.rint(-full_low * np.float32(f) / scale), 0, top)
            q = np.clip(np.rint(v / scale[..., None]) + zero[..., None], 0, top)
        err = np.square((q - zero[..., None]) * scale[..., None] - v).sum(axis=2)
        if best is None:
            best = [err, q, scale, zero]
            continue
        better = err < best[0]
        best = [
            np.where(better, err, best[0]),
            np.where(better[..., None], q, best[1]),
            np.where(better, scale, best[2]),
            np.where(better, zero, best[3]),
        ]
    _, q, scale, zero = best
    q = q.astype(np.uint8)
    packed = q[..., 0::2] | (q[..., 1::2] << 4) if bits == 4 else q
    zero_points = None
    if not symmetric:
        zero = zero.astype(np.uint8)
        if bits == 4:
            if blocks % 2:
                zero = np.concatenate([zero, np.zeros((n, 1), np.uint8)], axis=1)
            zero = zero[:, 0::2] | (zero[:, 1::2] << 4)
        zero_points = np.ascontiguousarray(zero)
    return np.ascontiguousarray(packed), np.ascontiguousarray(scale.astype(np.float32)), zero_points


def _attribute(node, name: str, default: Any) -> Any:
    import onnx

    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _weight_product(node, inits: Mapping[str, Any]):
    """``(weight name, transposed, bias name)`` when ``node`` multiplies by a 2-D float32
    initializer (``MatMul`` x ``[K, N]``, or a plain ``Gemm``), else ``None``; a ``Gemm`` this
    quantizer cannot express (``alpha``/``beta`` not 1, ``transA``) raises."""
    import onnx

    if node.op_type not in ("MatMul", "Gemm") or len(node.input) < 2 or node.input[1] not in inits:
        return None
    w = inits[node.input[1]]
    if len(w.dims) != 2 or w.data_type != onnx.TensorProto.FLOAT:
        return None
    if node.op_type == "MatMul":
        return node.input[1], False, None
    bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
    plain = (
        _attribute(node, "alpha", 1.0) == 1.0
        and _attribute(node, "beta", 1.0) == 1.0
        and _attribute(node, "transA", 0) == 0
        and (
            bias is None
            or (
                bias in inits
                and list(inits[bias].dims) == [w.dims[0 if _attribute(node, "transB", 0) else 1]]
            )
        )
    )
    if not plain:
        raise QuantizationError(
            f"Gemm {node.name!r}: only alpha = beta = 1, transA = 0 and a 1-D bias initializer can become "
            "MatMulNBits (the graph is not what this quantizer expects)"
        )
    return node.input[1], bool(_attribute(node, "transB", 0)), bias


def _nbits_products(
    model, settings: Mapping[str, Any], where: str, only: Optional[set] = None
) -> dict[str, str]:
    """Every weight product of ``model`` (``only``: those whose weight is named there) as a
    ``com.microsoft`` ``MatMulNBits``, in place; ``{weight name: what it became}``."""
    import onnx
    from onnx import numpy_helper

    bits, block, symmetric = settings["bits"], settings["block_size"], settings["symmetric"]
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    done: dict[tuple[str, bool], tuple[list[str], int, int]] = {}
    new_nodes, added = [], []
    for node in graph.node:
        product = _weight_product(node, inits)
        if product is None or (only is not None and product[0] not in only):
            new_nodes.append(node)
            continue
        name, transposed, bias = product
        if (name, transposed) not in done:
            w = numpy_helper.to_array(inits[name])
            w_nk = w if transposed else w.T
            n, k = w_nk.shape
            if k % block:
                raise QuantizationError(
                    f"{where}: {NBITS_OPTIONS['block_size']} {block} does not divide K = {k} of the "
                    f"weight {name!r} [{w.shape[0]} x {w.shape[1]}] of {node.op_type} {node.name!r}"
                )
            packed, scales, zero_points = _cached_blocks(w_nk, bits, block, symmetric)
            stem = f"{name}.q{bits}" + ("t" if transposed else "")
            names = [f"{stem}.weight", f"{stem}.scales"]
            added += [numpy_helper.from_array(packed, names[0]), numpy_helper.from_array(scales, names[1])]
            if zero_points is not None:
                names.append(f"{stem}.zero_points")
                added.append(numpy_helper.from_array(zero_points, names[2]))
            done[(name, transposed)] = (names, k, n)
        names, k, n = done[(name, transposed)]
        inputs = [node.input[0], names[0], names[1], names[2] if len(names) > 2 else ""]
        if bias is not None:
            inputs += ["", bias]  # no g_idx
        while inputs and not inputs[-1]:
            inputs.pop()
        new_nodes.append(
            onnx.helper.make_node(
                "MatMulNBits",
                inputs,
                list(node.output),
                name=f"{node.name}_Q{bits}" if node.name else "",
                domain="com.microsoft",
                K=k,
                N=n,
                bits=bits,
                block_size=block,
                accuracy_level=settings["accuracy_level"],
            )
        )
    del graph.node[:]
    graph.node.extend(new_nodes)
    _drop_unused(graph, added)
    _com_microsoft(model)
    return {name: f"MatMulNBits {bits}-bit, blocks of {block}" for name, _ in done}


# The opset of BitwiseXor, which moves int8 weights to MatMulNBits' unsigned range in the graph.
_BITWISE_OPSET = 18


def _int8_step_weights(int8_step: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{float weight name: (int8 [K, N], scale [N])}`` of the ``MatMulInteger`` products of the
    int8 scheme's graph ``int8_step`` whose weights are symmetric (zero point 0) with one scale per
    output channel: the weights ``quantize_dynamic`` wrote as ``<name>_quantized``, ``<name>_scale``
    and ``<name>_zero_point``."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(os.fspath(int8_step))
    inits = {t.name: t for t in model.graph.initializer}
    found = {}
    for node in model.graph.node:
        if node.op_type != "MatMulInteger" or len(node.input) < 2 or node.input[1] not in inits:
            continue
        q = inits[node.input[1]]
        stem = node.input[1][: -len("_quantized")] if node.input[1].endswith("_quantized") else None
        if stem is None or q.data_type != onnx.TensorProto.INT8 or len(q.dims) != 2:
            continue
        scale, zero = inits.get(stem + "_scale"), inits.get(stem + "_zero_point")
        if scale is None or zero is None:
            continue
        scale, zero = numpy_helper.to_array(scale), numpy_helper.to_array(zero)
        if scale.shape != (q.dims[1],) or zero.shape != (q.dims[1],) or zero.any():
            continue
        found[stem] = (numpy_helper.to_array(q), scale.astype(np.float32))
    return found


def _shared_nbits_products(model, int8_step: Path, settings: Mapping[str, Any], where: str) -> dict[str, str]:
    """The weight products of ``model`` (a float32 decoder step) whose weight the int8 step
    ``int8_step`` holds as per-channel int8 (:func:`_int8_step_weights`) as 8-bit ``MatMulNBits``
    over those bytes, in place; ``{weight name: what it became}``.

    ``MatMulInteger`` reads its weight ``[K, N]`` as int8, ``MatMulNBits`` ``[N, K / block,
    block]`` as uint8 with the zero point 128. The graph declares the int8 bytes as a uint8
    ``[K / block, block, N]`` (the same bytes, so :func:`export.weights.share_weights` stores them
    once) and turns them into MatMulNBits' input with a ``Transpose`` (perm 2, 0, 1) and a
    ``BitwiseXor`` with 128 (which maps each two's-complement byte ``v`` to ``v + 128``); both
    inputs are constant, so ONNX Runtime folds the two nodes when it loads the graph and packs the
    result like any other MatMulNBits weight (two nodes, not three with a ``Cast``: each folded
    node holds a copy of the weights while the session is made). The scales are the per-channel ones, the same in
    every block of a column. A weight the check below does not find (a ``Gemm``, another
    dtype, an opset before BitwiseXor's) is left to :func:`_nbits_products`."""
    from onnx import helper, numpy_helper

    opset = next((op.version for op in model.opset_import if op.domain in ("", "ai.onnx")), 0)
    if opset < _BITWISE_OPSET:
        logger.info(
            "%s: opset %d has no BitwiseXor (opset %d): the few-row step's weights are blocks of their own",
            where,
            opset,
            _BITWISE_OPSET,
        )
        return {}
    int8 = _int8_step_weights(int8_step)
    block = settings["block_size"]
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    done: dict[str, tuple[str, str, int, int]] = {}
    new_nodes, added = [], []
    flip = "few_rows.uint8_offset"  # 128: int8 bytes to MatMulNBits' uint8 with its zero point
    for node in graph.node:
        product = _weight_product(node, inits)
        if product is None or product[1] or product[2] is not None or product[0] not in int8:
            new_nodes.append(node)
            continue
        name = product[0]
        q, scale = int8[name]
        k, n = q.shape
        if list(inits[name].dims) != [k, n] or k % block:
            new_nodes.append(node)
            continue
        if name not in done:
            stem = f"{name}.q8s"
            # the int8 bytes declared uint8 (the same bytes: two's complement read unsigned)
            added.append(
                numpy_helper.from_array(q.reshape(k // block, block, n).view(np.uint8), f"{stem}.kn")
            )
            added.append(
                numpy_helper.from_array(
                    np.ascontiguousarray(np.repeat(scale[:, None], k // block, axis=1)), f"{stem}.scales"
                )
            )
            if not done:
                added.append(numpy_helper.from_array(np.array(128, dtype=np.uint8), flip))
            new_nodes += [
                helper.make_node("Transpose", [f"{stem}.kn"], [f"{stem}.nk"], perm=[2, 0, 1]),
                helper.make_node("BitwiseXor", [f"{stem}.nk", flip], [f"{stem}.weight"]),
            ]
            done[name] = (f"{stem}.weight", f"{stem}.scales", k, n)
        weight, scales, k, n = done[name]
        new_nodes.append(
            helper.make_node(
                "MatMulNBits",
                [node.input[0], weight, scales],
                list(node.output),
                name=f"{node.name}_Q8" if node.name else "",
                domain="com.microsoft",
                K=k,
                N=n,
                bits=8,
                block_size=block,
                accuracy_level=settings["accuracy_level"],
            )
        )
    if not done:
        return {}
    del graph.node[:]
    graph.node.extend(new_nodes)
    _drop_unused(graph, added)
    _com_microsoft(model)
    return {
        name: f"MatMulNBits 8-bit, blocks of {block}, on the int8 step's MatMulInteger weights "
        "(one scale per output channel; transposed when loaded)"
        for name in done
    }


def _drop_unused(graph, added=()) -> None:
    used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    kept = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept + list(added))


def _com_microsoft(model) -> None:
    import onnx

    if not any(op.domain == "com.microsoft" for op in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))


def quantize_lookups(model, bits: int, block_size: int, symmetric: bool) -> dict[str, str]:
    """Every embedding lookup of ``model`` (a ``Gather`` of rows of a 2-D float32 initializer
    whose rows ``block_size`` divides) as a ``com.microsoft`` ``GatherBlockQuantized`` over the
    table quantized by :func:`quantize_blocks`, in place; ``{table name: what it became}``.

    The table's bytes, scales and zero points are exactly those of a ``MatMulNBits`` weight of the
    same table with the same settings (``MatMulNBits`` stores its weight by output row, the
    embedding's own layout), so a tied lookup and output projection are one region of the
    weights file (:func:`export.weights.share_weights` stores equal bytes once), and the few-row
    decoder step's lookup and projection are the same bytes again."""
    import onnx
    from onnx import numpy_helper

    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    done: dict[str, list[str]] = {}
    added = []
    for node in graph.node:
        if node.op_type != "Gather" or node.input[0] not in inits or _attribute(node, "axis", 0) != 0:
            continue
        table = inits[node.input[0]]
        if len(table.dims) != 2 or table.data_type != onnx.TensorProto.FLOAT or table.dims[1] % block_size:
            continue
        name = table.name
        if name not in done:
            w = numpy_helper.to_array(table)
            packed, scales, zero_points = _cached_blocks(w, bits, block_size, symmetric)
            stem = f"{name}.q{bits}"
            names = [f"{stem}.table", f"{stem}.table_scales"]
            added += [
                numpy_helper.from_array(packed.reshape(w.shape[0], -1), names[0]),
                numpy_helper.from_array(scales, names[1]),
            ]
            if zero_points is not None:
                names.append(f"{stem}.table_zero_points")
                added.append(numpy_helper.from_array(zero_points, names[2]))
            done[name] = names
        names = done[name]
        node.CopyFrom(
            onnx.helper.make_node(
                "GatherBlockQuantized",
                [names[0], node.input[1], *names[1:]],
                list(node.output),
                name=node.name,
                domain="com.microsoft",
                gather_axis=0,
                quantize_axis=1,
                block_size=block_size,
                bits=bits,
            )
        )
    if done:
        _drop_unused(graph, added)
        _com_microsoft(model)
    return {name: f"GatherBlockQuantized {bits}-bit, blocks of {block_size}" for name in done}


def row_table(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``weight`` ``[V, K]`` as int8 rows: ``(q [V, K] int8 in -63..63, scale [V] float32)``, the
    row ``v`` standing for ``q[v] * scale[v]`` (:func:`quantize_blocks` with one symmetric block
    per row of :data:`ROW_TABLE_BITS` bits: the scheme's ``reduce_range``), the same bytes for
    every graph that reads the table."""
    v, k = weight.shape
    q, scale, _ = _cached_blocks(weight, ROW_TABLE_BITS, k, True)
    mid = 1 << (ROW_TABLE_BITS - 1)
    rows = (q.reshape(v, k).astype(np.int16) - mid).astype(np.int8)
    return rows, np.ascontiguousarray(scale.reshape(v), dtype=np.float32)


def _row_lookup_nodes(node, rows: str, scales: str) -> list:
    """A table lookup ``node`` over int8 rows: Gather the rows, Cast, Mul by the gathered row scales."""
    from onnx import TensorProto, helper

    out, stem = node.output[0], node.name or node.output[0]
    return [
        helper.make_node("Gather", [rows, node.input[1]], [f"{out}.q8r"], name=f"{stem}_rows"),
        helper.make_node("Cast", [f"{out}.q8r"], [f"{out}.q8r_f"], name=f"{stem}_cast", to=TensorProto.FLOAT),
        helper.make_node("Gather", [scales, node.input[1]], [f"{out}.q8r_s"], name=f"{stem}_scales"),
        helper.make_node("Mul", [f"{out}.q8r_f", f"{out}.q8r_s"], [out], name=f"{stem}_dequantize"),
    ]


def _row_qgemm_nodes(node, rows: str, columns: tuple[str, str], bias: Optional[str]) -> list:
    """The tied projection ``node`` as DynamicQuantizeLinear of its input and a ``com.microsoft``
    QGemm (transB) over the int8 rows (``columns``: the per-column scales and zero points), plus
    an Add of ``bias`` where it has one."""
    from onnx import helper

    stem, x, out = node.name, node.input[0], node.output[0]
    product = f"{out}.q8r_product" if bias else out
    nodes = [
        helper.make_node(
            "DynamicQuantizeLinear", [x], [f"{stem}.x_q8", f"{stem}.x_scale", f"{stem}.x_zero_point"],
            name=f"{stem}_QuantizeInput",
        ),
        helper.make_node(
            "QGemm",
            [f"{stem}.x_q8", f"{stem}.x_scale", f"{stem}.x_zero_point", rows, *columns],
            [product],
            name=f"{stem}_QGemm",
            domain="com.microsoft",
            transB=1,
        ),
    ]  # fmt: skip
    if bias:
        nodes.append(helper.make_node("Add", [product, bias], [out], name=f"{stem}_bias"))
    return nodes


def quantize_row_tables(model, where: str, width: Optional[int] = None) -> dict[str, str]:
    """Every embedding table of ``model`` (a 2-D float32 initializer that a ``Gather`` along axis
    0 reads; with ``width``, only those of rows that wide) as int8 rows with one scale per row
    (:func:`row_table`, :data:`ROW_TABLES`), in place; ``{float name: what it became}`` (the
    tied projection under the table's second name).

    Each lookup becomes ``Gather`` of the int8 rows, ``Cast`` to float32, ``Mul`` by the
    ``Gather`` ed row scales (standard ONNX). Each weight product that reads a table under its
    second name (the tied output projection, :func:`export.weights.split_lookup_readers`: a
    ``Gemm`` with ``transB``) becomes ``DynamicQuantizeLinear`` of its input and a
    ``com.microsoft`` ``QGemm`` (``transB=1``) over the same int8 rows, the row scales its
    per-column scales (zero points 0), plus an ``Add`` of its bias where it has one: the lookups and
    the projection read one tensor, which :func:`export.weights.share_weights` stores once."""
    from onnx import TensorProto, numpy_helper

    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    tied = _tied_products(model)
    tables = {
        n.input[0]
        for n in graph.node
        if n.op_type == "Gather"
        and n.input[0] in inits
        and _attribute(n, "axis", 0) == 0
        and len(inits[n.input[0]].dims) == 2
        and inits[n.input[0]].data_type == TensorProto.FLOAT
        and (width is None or inits[n.input[0]].dims[1] == width)
    }
    stored: dict[str, tuple[str, str]] = {}  # table -> (int8 rows, row scales [V, 1])
    row_scales: dict[str, np.ndarray] = {}
    added = []

    def rows_of(table: str) -> tuple[str, str]:
        if table not in stored:
            q, scale = row_table(numpy_helper.to_array(inits[table]))
            names = (f"{table}.q8r.rows", f"{table}.q8r.row_scales")
            added.extend(
                [
                    numpy_helper.from_array(q, names[0]),
                    numpy_helper.from_array(scale.reshape(-1, 1), names[1]),
                ]
            )
            stored[table], row_scales[table] = names, scale
        return stored[table]

    new_nodes, tensors, flat = [], {}, {}
    for node in graph.node:
        if node.op_type == "Gather" and node.input[0] in tables and _attribute(node, "axis", 0) == 0:
            new_nodes += _row_lookup_nodes(node, *rows_of(node.input[0]))
            tensors[node.input[0]] = (
                f"int8 rows ({ROW_TABLE_BITS}-bit range), one scale per row: Gather + Cast + Mul"
            )
            continue
        if node.name not in tied:
            new_nodes.append(node)
            continue
        weight, transposed, bias = _weight_product(node, inits)
        table = weight[: -len(PRODUCT_SUFFIX)]
        if not transposed or table not in tables:
            raise QuantizationError(
                f"{where}: the tied output projection {node.name!r} must be a Gemm with transB = 1 over the "
                f"table {table!r} that a lookup reads (the graph is not what this quantizer expects)"
            )
        rows, _ = rows_of(table)
        if table not in flat:  # QGemm's per-column scales (the row scales' bytes) and zero points: [V]
            scale = row_scales[table]
            flat[table] = (f"{table}.q8r.column_scales", f"{table}.q8r.column_zero_points")
            added.extend(
                [
                    numpy_helper.from_array(scale, flat[table][0]),
                    numpy_helper.from_array(np.zeros(scale.shape, np.int8), flat[table][1]),
                ]
            )
        new_nodes += _row_qgemm_nodes(node, rows, flat[table], bias)
        tensors[weight] = (
            "QGemm int8 (transB) over the lookup's int8 rows, one scale per output column; "
            "activations uint8 per tensor at run time"
        )
    if not stored:
        return {}
    del graph.node[:]
    graph.node.extend(new_nodes)
    _drop_unused(graph, added)
    _com_microsoft(model)
    return tensors


def _quantize_nbits_one(
    src: Path,
    dst: Path,
    settings: Mapping[str, Any],
    lookups: Optional[Mapping[str, Any]] = None,
    int8_step: Optional[Path] = None,
) -> dict:
    """Every weight product of the graph ``src`` as a ``com.microsoft`` ``MatMulNBits`` in ``dst``,
    and (``lookups``: ``bits``, ``block_size``, ``symmetric``) every embedding lookup as a
    ``GatherBlockQuantized`` (:func:`quantize_lookups`). With ``int8_step`` (the int8 scheme's
    decoder step made from ``src``), the products whose int8 weights that graph holds read those
    bytes (:func:`_shared_nbits_products`); the others get blocks of their own."""
    import onnx

    model = onnx.load(os.fspath(src))
    graph = model.graph
    tensors = {}
    rows = lookups is not None and bool(lookups.get("per_row"))
    if rows:  # the int8 scheme's tables: int8 rows, the tied projection a QGemm over them
        tensors.update(quantize_row_tables(model, src.name, lookups.get("width")))
    tied = set(_tied_products(model).values()) if lookups is not None and not rows else set()
    if tied:  # the tied output projection in the lookup's bits and blocks: the same bytes
        tensors.update(_nbits_products(model, lookups, src.name, only=tied))
    if int8_step is not None:
        tensors.update(_shared_nbits_products(model, int8_step, settings, src.name))
    tensors.update(_nbits_products(model, settings, src.name))
    if not tensors:
        raise QuantizationError(f"{src.name}: no weight product to quantize (the graph is not an export's)")
    if lookups is not None and not rows:
        tensors.update(quantize_lookups(model, lookups["bits"], lookups["block_size"], lookups["symmetric"]))
    onnx.checker.check_model(model)
    left = [n.name for n in graph.node if _weight_product(n, {t.name: t for t in graph.initializer})]
    if left:
        raise QuantizationError(f"{src.name}: float32 weight products left after quantization: {left[:3]}")
    onnx.save(model, os.fspath(dst))
    counts: dict[str, int] = {}
    for n in graph.node:
        counts[n.op_type] = counts.get(n.op_type, 0) + 1
    return {
        "quantized_nodes": counts.get("MatMulNBits", 0),
        "quantized_weights": sum(1 for v in tensors.values() if v.startswith("MatMulNBits")),
        "op_counts": dict(sorted(counts.items())),
        "initializer_bytes": _initializer_bytes(graph),
        "tensors": dict(sorted(tensors.items())),
    }


def _initializer_bytes(graph) -> int:
    import onnx

    return int(
        sum(
            int(np.prod(t.dims, dtype=np.int64)) * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
            for t in graph.initializer
        )
    )


def kernel_compute(bits: int, block_size: int, accuracy_level: int) -> str:
    """What ONNX Runtime's MatMulNBits kernel computes in on this CPU: ``"int8"`` (activations
    quantized per block, int8 dot products) or ``"float32"`` (the weights dequantized).

    ONNX Runtime falls back to float32 without a word when it has no int8 kernel for ``bits``
    and ``block_size`` on this CPU; the two differ measurably, so one small product tells them
    apart: float32 stays within 1e-5 (relative) of the float64 product of the dequantized
    weights, int8 activations move it by about 1e-2."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    if accuracy_level != 4:
        return "float32"
    k, n = 4 * block_size, 32
    rng = np.random.default_rng(0)
    w = rng.standard_normal((n, k)).astype(np.float32)
    a = rng.standard_normal((4, k)).astype(np.float32)
    packed, scales, _ = quantize_blocks(w, bits, block_size, symmetric=True)
    node = helper.make_node(
        "MatMulNBits",
        ["A", "B", "S"],
        ["Y"],
        domain="com.microsoft",
        K=k,
        N=n,
        bits=bits,
        block_size=block_size,
        accuracy_level=accuracy_level,
    )
    graph = helper.make_graph(
        [node],
        "probe",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, [4, k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [4, n])],
        [numpy_helper.from_array(packed, "B"), numpy_helper.from_array(scales, "S")],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    )
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    y = session.run(None, {"A": a})[0].astype(np.float64)
    mid = 1 << (bits - 1)
    q = np.stack([packed & 15, packed >> 4], axis=-1) if bits == 4 else packed
    deq = (q.reshape(n, -1, block_size).astype(np.float64) - mid) * scales[..., None]
    ref = a.astype(np.float64) @ deq.reshape(n, k).T
    return "int8" if np.abs(y - ref).max() > 1e-4 * np.abs(ref).max() else "float32"


# The instruction-set extensions that decide which quantized kernels ONNX Runtime runs (x86:
# AVX2 / AVX-512 / VNNI / AMX; ARM: dot products, int8 matrix multiply, SVE).
ISA_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
    "asimd",
    "asimddp",
    "i8mm",
    "sve",
)


def cpu_description() -> dict:
    """The CPU a quantized export was made on (:func:`transformer_ext.cpu_features.cpu_flags`):
    model name, architecture and which of :data:`ISA_FLAGS` it has (``"isa"``)."""
    from transformer_ext.cpu_features import cpu_flags

    cpu = cpu_flags()
    return {
        "model": cpu.model or None,
        "arch": cpu.arch,
        "isa": [f for f in ISA_FLAGS if f in cpu.flags],
        "flags_source": cpu.source,
    }


# ------------------------------------------------------------------------------------------
# The quality gate
# ------------------------------------------------------------------------------------------


# The exact-match gate's data is the demo task: it gates only a model of that task, one with this
# package's character tokenizer whose float32 graphs get at least this share of the held-out set
# right (the bundled demo model: 99.8%). Any other model would score 0% in both precisions, a
# gate that cannot fail: it needs a BLEU gate on its own data (--gate-src / --gate-ref).
DEMO_GATE_MIN_EM = 50.0
DEMO_GATE_TOKENIZER = "char"
_GIVE_GATE_DATA = (
    "pass --gate-src FILE --gate-ref FILE (held-out sentences of the model's languages and their "
    "references) for a BLEU gate, or --no-validate to skip the gate"
)


def _encode_gate_source(tokenizer, text: str) -> list[int]:
    """The source ids of ``text``, after checking that the tokenizer has the target-language token
    a multilingual model forces (M2M100 / NLLB), as a translation needs."""
    ids = tokenizer.encode_source(text)
    if callable(getattr(tokenizer, "forced_target_prefix", None)):
        tokenizer.forced_target_prefix()
    return ids


def check_gate_inputs(
    tokenizer, max_len: int, gate_data: Optional[GateData], where: str | os.PathLike = "this model"
) -> None:
    """Check, before anything is quantized, that the gate can run on the model of ``tokenizer``
    (``where``: its model or export folder, named in messages) and measure something that can fail.

    Without ``gate_data`` (the exact-match gate on the demo task): the model must have this
    package's character tokenizer (:data:`DEMO_GATE_TOKENIZER`); a model converted from
    transformers or with a SentencePiece tokenizer was not trained on the demo task and is
    refused, saying to give gate data. With ``gate_data`` (the BLEU gate): its languages are
    applied (:attr:`GateData.source_lang` / ``target_lang``) and every source line must encode
    in at most ``max_len`` tokens, the line named otherwise.

    Raises :class:`QualityGateError` (exit 1), or :class:`QuantizationUsageError` (exit 2) for a
    missing, unknown or unwanted language code of the BLEU gate.
    """
    from transformer_ext.tokenizer import TokenizerError

    if gate_data is None:
        if tokenizer is None:
            raise QualityGateError(
                f"{where} has no tokenizer, so the quality gate (the demo task's held-out set) cannot run; "
                "pass --no-validate to skip it"
            )
        kind = getattr(tokenizer, "type", None)
        if kind != DEMO_GATE_TOKENIZER:
            raise QualityGateError(
                f"the quality gate needs gate data for {where}: without --gate-src it decodes the "
                f"demo task (English number words into German), which a model with a {kind} tokenizer was not "
                f"trained on (both precisions would score 0%, a gate that cannot fail); {_GIVE_GATE_DATA}"
            )
        return
    flags = [
        f"{flag} {value!r}"
        for flag, value in (
            ("--source-lang", gate_data.source_lang),
            ("--target-lang", gate_data.target_lang),
        )
        if value is not None
    ]
    gate = f"the BLEU gate (--gate-src {gate_data.src})"
    if tokenizer is None:
        raise QualityGateError(f"{where} has no tokenizer, so {gate} cannot translate its sources")
    if flags:
        if not callable(getattr(tokenizer, "with_languages", None)):
            raise QuantizationUsageError(
                f"{', '.join(flags)}: {where} has no language codes (only a multilingual model, Marian "
                ">>xx<< or M2M100 / NLLB, takes --source-lang / --target-lang)"
            )
        try:
            tokenizer = tokenizer.with_languages(gate_data.source_lang, gate_data.target_lang)
        except TokenizerError as exc:
            raise QuantizationUsageError(f"{gate}: {exc}") from None
    for number, text in enumerate(gate_data.sources, 1):
        try:
            ids = _encode_gate_source(tokenizer, text)
        except TokenizerError as exc:
            if number == 1:  # the first line fails for the model, not for its text: a missing language
                raise QuantizationUsageError(f"{gate}: {exc}") from None
            raise QualityGateError(f"{gate}, line {number}: {exc}") from None
        if len(ids) > max_len:
            raise QualityGateError(
                f"{gate}, line {number}: the source is {len(ids)} tokens long, more than the model's "
                f"max_len = {max_len}; the gate translates every line whole: shorten or split that line"
            )


def check_export_gate(
    folder: Path, manifest: Mapping[str, Any], gate_data: Optional[GateData], where: Any = "this model"
) -> None:
    """:func:`check_gate_inputs` for the float32 export ``folder`` (its tokenizer and max_len)."""
    from transformer_ext.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(folder) if tokenizer_files(manifest) else None
    check_gate_inputs(tokenizer, int(manifest["model_config"]["max_len"]), gate_data, where)


def _heldout_batch(folder: Path):
    """``(ids [N, S], lengths [N], references)`` of the demo held-out set as the folder's
    tokenizer encodes it; raises :class:`QualityGateError` when there is no such set."""
    from transformer_ext import data
    from transformer_ext.tokenizer import TokenizerError, load_tokenizer

    manifest = read_manifest(folder)
    if not tokenizer_files(manifest):
        raise QualityGateError(
            f"{folder}: the export has no tokenizer, so the int8 quality gate (the demo task's "
            "held-out set) cannot run; pass --no-validate to skip it"
        )
    tokenizer = load_tokenizer(folder)
    check_gate_inputs(tokenizer, int(manifest["model_config"]["max_len"]), None)
    sources, references = [], []
    try:
        for number in data.split_numbers().heldout:
            ids = tokenizer.encode_source(data.source_text(number))
            sources.append(ids)
            references.append(tokenizer.encode_target(data.target_text(number)))
    except (TokenizerError, ImportError) as exc:
        raise QualityGateError(
            f"{folder}: the int8 quality gate decodes the demo task's held-out set, which this "
            f"model's tokenizer cannot encode ({exc}); {_GIVE_GATE_DATA}"
        ) from exc
    max_len = int(manifest["model_config"]["max_len"])
    longest = max(len(s) for s in sources)
    if longest > max_len:
        raise QualityGateError(
            f"the quality gate needs gate data for this model: it decodes the demo task's held-out set, whose "
            f"longest source is {longest} tokens for this model, more than its max_len = {max_len}: not a model "
            f"of the demo task; {_GIVE_GATE_DATA}"
        )
    lengths = np.array([len(s) for s in sources], dtype=np.int64)
    ids = np.full((len(sources), int(lengths.max())), tokenizer.pad_id, dtype=np.int64)
    for row, s in enumerate(sources):
        ids[row, : len(s)] = s
    return ids, lengths, references


def _greedy_all(
    folder: Path,
    ids: np.ndarray,
    lengths: np.ndarray,
    batch: int = 64,
    few_rows: str = "never",
    search: Optional[Mapping[str, Any]] = None,
) -> list[list[int]]:
    """Each source's tokens: greedy search with the export's budget, or with ``search`` (search
    options laid over the export's generation config, beam size 1 unless given) its best
    hypothesis."""
    from transformer_ext import decoding
    from transformer_ext.export_format import read_generation_config
    from transformer_ext.runtimes import OrtRunner

    runner = OrtRunner(folder, intra_op_num_threads=2, few_rows=few_rows)
    gen = read_generation_config(folder, runner.manifest)
    opts = None
    if search:
        opts = decoding.SearchOptions.from_mapping(dict({"beam_size": 1}, **search), gen.to_search_options())
    out: list[list[int]] = []
    for start in range(0, len(ids), batch):
        rows = slice(start, start + batch)
        width = int(lengths[rows].max())
        if opts is None:
            budget = decoding.max_decoding_length_for(
                lengths[rows], gen.max_len_a, gen.max_len_b, cap=gen.max_new_tokens
            )
            out += runner.greedy(ids[rows, :width], lengths[rows], max_decoding_length=budget)
            continue
        info = runner.info
        hyps = decoding.generate(
            runner,
            ids[rows, :width],
            lengths[rows],
            bos_id=info.bos_id,
            eos_id=info.eos_id,
            max_decoding_length=opts.budget(lengths[rows]),
            **opts.generate_kwargs(),
        )
        out += [list(row[0].tokens) for row in hyps]
    return out


def _strip_eos(tokens: list[int], eos: int) -> list[int]:
    return list(tokens[: tokens.index(eos)]) if eos in tokens else list(tokens)


def _label(scheme: str) -> str:
    """What a gate record calls the quantized graphs: ``"int4"`` or ``"int8"`` (its key names)."""
    return "int4" if scheme == "int4" else "int8"


def default_max_drops(scheme: str) -> tuple[float, float]:
    """The default ``(max_em_drop, max_bleu_drop)`` of ``scheme``'s gates (:data:`DEFAULT_MAX_DROPS`)."""
    return DEFAULT_MAX_DROPS[check_scheme(scheme)]


def _gated_graphs(scheme: str, few_rows: bool) -> str:
    """How a gate's error names the graphs it refused."""
    if few_rows:
        return f"{scheme} few-row decoder step ({FEW_ROWS_DECODER_FILE}, 8-bit MatMulNBits; {FEW_ROWS_FLAG} exports without it)"
    return f"{scheme} graphs"


def quality_gate(
    float_dir: Path,
    int8_dir: Path,
    max_em_drop: float = DEFAULT_MAX_EM_DROP,
    *,
    scheme: str = "int8",
    few_rows: bool = False,
    search: Optional[Mapping[str, Any]] = None,
) -> dict:
    """Greedy exact match of both folders on the demo held-out set; raises :class:`QualityGateError`
    when the quantized one (``int8_dir``, made by ``scheme``) is more than ``max_em_drop`` points
    below float32. Returns the gate's record (keys named after :func:`_label`). ``few_rows``: the
    quantized decodes run every step through the folder's few-row decoder step instead
    (``OrtRunner(few_rows="always")``), which gates that graph at every row count. ``search``:
    both decode with these search options (:class:`~transformer_ext.decoding.SearchOptions`
    names, over the export's generation config; beam size 1 unless given) instead of greedy
    search, recorded as the record's ``"search"``."""
    max_em_drop = _check_max_drop(max_em_drop)
    label = _label(check_scheme(scheme))
    t0 = time.perf_counter()
    ids, lengths, references = _heldout_batch(Path(float_dir))
    eos = int(read_manifest(float_dir)["model_config"]["eos_id"])
    f32 = [_strip_eos(t, eos) for t in _greedy_all(Path(float_dir), ids, lengths, search=search)]
    n = len(references)
    em_f32 = 100.0 * sum(a == r for a, r in zip(f32, references, strict=True)) / n
    if em_f32 < DEMO_GATE_MIN_EM:
        raise QualityGateError(
            "the quality gate needs gate data for this model: its float32 graphs get "
            f"{em_f32:.2f}% of the demo task's {n} held-out examples right (a model of the demo task at least "
            f"{DEMO_GATE_MIN_EM:g}%), so it was not trained on that task and the gate could not fail; "
            f"{_GIVE_GATE_DATA}; nothing was written"
        )
    qnt = [
        _strip_eos(t, eos)
        for t in _greedy_all(
            Path(int8_dir), ids, lengths, few_rows="always" if few_rows else "never", search=search
        )
    ]
    em_q = 100.0 * sum(a == r for a, r in zip(qnt, references, strict=True)) / n
    agree = 100.0 * sum(a == b for a, b in zip(f32, qnt, strict=True)) / n
    record = {
        "data": "demo held-out set (transformer_ext.data.split_numbers().heldout), greedy",
        "examples": n,
        "exact_match_float32": round(em_f32, 4),
        f"exact_match_{label}": round(em_q, 4),
        "drop_points": round(em_f32 - em_q, 4),
        "max_drop_points": max_em_drop,
        f"{label}_equal_to_float32": round(agree, 4),
        "seconds": round(time.perf_counter() - t0, 2),
    }
    if few_rows:
        record["graph"] = FEW_ROWS_DECODER_FILE
    if search:
        record.update(
            data=record["data"].replace(", greedy", ", the search options of 'search'"), search=dict(search)
        )
    logger.info("%s quality gate: %s", scheme, record)
    if em_f32 - em_q > max_em_drop + 1e-9:
        raise QualityGateError(
            f"the {_gated_graphs(scheme, few_rows)} fail the quality gate: exact match {em_q:.2f}% vs {em_f32:.2f}% for "
            f"float32 on {n} held-out examples, {em_f32 - em_q:.2f} points lower (at most {max_em_drop:g} "
            "allowed); nothing was written"
        )
    return record


def bleu_gate(
    float_dir: Path,
    int8_dir: Path,
    data: GateData,
    max_bleu_drop: float = DEFAULT_MAX_BLEU_DROP,
    *,
    scheme: str = "int8",
    few_rows: bool = False,
    search: Optional[Mapping[str, Any]] = None,
) -> dict:
    """Greedy translations of ``data.sources`` by both folders, BLEU against ``data.references``
    (sacrebleu); raises :class:`QualityGateError` when the quantized BLEU (``int8_dir``, made by
    ``scheme``) is more than ``max_bleu_drop`` points below float32's. Returns the gate's record.
    ``few_rows``: every quantized step through the folder's few-row decoder step (as for
    :func:`quality_gate`); ``search``: the translations' search options instead of greedy
    search (as for :func:`quality_gate`)."""
    from transformer_ext.evaluate import score_texts
    from transformer_ext.runtimes import OrtRunner
    from transformer_ext.translate import Translator

    max_bleu_drop = _check_max_drop(max_bleu_drop, "max_bleu_drop")
    label = _label(check_scheme(scheme))
    t0 = time.perf_counter()
    hyps = {}
    for name, folder in (("float32", float_dir), (label, int8_dir)):
        translator = Translator.from_export_dir(
            folder, threads=2, source_lang=data.source_lang, target_lang=data.target_lang
        )
        if few_rows and name == label:
            translator.runner = OrtRunner(folder, intra_op_num_threads=2, few_rows="always")
        hyps[name] = translator.translate(
            data.sources, progress=True, **dict({"beam_size": 1}, **(search or {}))
        )
    scores = {name: score_texts(h, data.references) for name, h in hyps.items()}
    b32, bq = scores["float32"]["bleu"], scores[label]["bleu"]
    n = len(data.sources)
    agree = 100.0 * sum(a == b for a, b in zip(hyps["float32"], hyps[label], strict=True)) / n
    record = {
        "data": f"{data.src.name} -> {data.ref.name}, greedy",
        "examples": n,
        "bleu_float32": round(b32, 2),
        f"bleu_{label}": round(bq, 2),
        "drop_points": round(b32 - bq, 2),
        "max_drop_points": max_bleu_drop,
        "bleu_signature": scores["float32"]["bleu_signature"],
        f"{label}_equal_to_float32": round(agree, 4),
        "seconds": round(time.perf_counter() - t0, 2),
    }
    if few_rows:
        record["graph"] = FEW_ROWS_DECODER_FILE
    if search:
        record.update(
            data=record["data"].replace(", greedy", ", the search options of 'search'"), search=dict(search)
        )
    logger.info("%s BLEU gate: %s", scheme, record)
    if b32 - bq > max_bleu_drop + 1e-9:
        raise QualityGateError(
            f"the {_gated_graphs(scheme, few_rows)} fail the BLEU gate: BLEU {bq:.2f} vs {b32:.2f} for float32 on {n} "
            f"sentences of {data.src}, {b32 - bq:.2f} points lower (at most {max_bleu_drop:g} allowed); "
            "nothing was written"
        )
    return record


# ------------------------------------------------------------------------------------------
# Folders
# ------------------------------------------------------------------------------------------


def check_quantize_arguments(
    scheme: Any,
    options: Optional[Mapping[str, Any]] = None,
    max_em_drop: Optional[float] = None,
    max_bleu_drop: Optional[float] = None,
    model_config: Optional[Mapping[str, Any]] = None,
) -> tuple[dict, float, float]:
    """Every quantization argument checked, before anything is written: ``(settings, max_em_drop,
    max_bleu_drop)`` with the scheme's defaults (:data:`DEFAULT_MAX_DROPS`) for ``None``; with
    ``model_config``, the block size against the model's dimensions (:func:`check_block_dimensions`)."""
    settings = resolve_settings(scheme, options, model_config)
    em_default, bleu_default = default_max_drops(scheme)
    max_em_drop = _check_max_drop(em_default if max_em_drop is None else max_em_drop)
    max_bleu_drop = _check_max_drop(bleu_default if max_bleu_drop is None else max_bleu_drop, "max_bleu_drop")
    if model_config is not None:
        check_block_dimensions(model_config, settings)
    return settings, max_em_drop, max_bleu_drop


def _check_gate_search(search: Optional[Mapping[str, Any]]) -> None:
    """The gate's search options: SearchOptions names with values in their ranges (a
    :class:`QuantizationUsageError` naming the option otherwise)."""
    if not search:
        return
    from transformer_ext.decoding import SearchOptions

    try:
        SearchOptions.from_mapping(dict({"beam_size": 1}, **search))
    except (TypeError, ValueError) as exc:
        raise QuantizationUsageError(f"the quality gate's search: {exc}") from None


def _refuse_quantized(folder: Path, manifest: Mapping[str, Any]) -> None:
    q = manifest_quantization(manifest)
    if q is not None:
        raise QuantizationError(
            f"{folder} is already quantized ({q.get('scheme')}): quantize a float32 export"
        )


def quantize_folder(
    folder: Path,
    scheme: str,
    *,
    gate: bool = True,
    max_em_drop: Optional[float] = None,
    gate_data: Optional[GateData] = None,
    max_bleu_drop: Optional[float] = None,
    options: Optional[Mapping[str, Any]] = None,
    gate_search: Optional[Mapping[str, Any]] = None,
) -> dict:
    """Quantize the float32 export in ``folder`` (a staged folder of this process) in place: the
    quantized graphs are written beside it, gated against the float32 ones (:func:`bleu_gate` on
    ``gate_data`` when given, else :func:`quality_gate` on the demo task), then moved over them
    and the manifest updated. ``options``: ``block_size``, ``accuracy_level``, ``symmetric`` of a
    MatMulNBits scheme (:func:`resolve_settings`); a ``None`` drop takes the scheme's default;
    ``gate_search``: the gate's search options (:func:`quality_gate`'s ``search``; default greedy).
    Returns the new manifest. On any failure ``folder`` is as it was."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    _refuse_quantized(folder, manifest)
    _, max_em_drop, max_bleu_drop = check_quantize_arguments(
        scheme, options, max_em_drop, max_bleu_drop, manifest["model_config"]
    )
    if gate:
        check_export_gate(folder, manifest, gate_data)
    # A scratch sibling of the folder (not inside it, so its files list stays exact), never
    # committed: removed on any exit. ``folder`` is a temporary of the output (``.OUT.tmp-...``),
    # so the scratch is a temporary of a temporary (``..OUT.tmp-....quantize.tmp-...``), which
    # fsutil's one rule (parse_temporary_name) traces to OUT: after a SIGKILL the next write of
    # OUT on this host removes it with the staged folder.
    with StagedDir(folder.with_name(f"{folder.name}.quantize")) as scratch:
        tmp_dir = scratch.path
        for name in folder_files(folder):
            shutil.copy2(folder / name, tmp_dir / name)
        section = quantize_graphs(folder, tmp_dir, scheme, options, manifest["model_config"])
        few_rows = section.get("few_rows")
        graph_files = [ENCODER_FILE, DECODER_FILE, *([FEW_ROWS_DECODER_FILE] if few_rows else [])]
        weights = share_weights(tmp_dir, graph_files)
        quantized_manifest = dict(manifest, quantization=section, weights=weights)
        quantized_manifest["files"] = folder_files(tmp_dir)
        write_manifest(tmp_dir, quantized_manifest)

        def run_gate(graph: bool) -> dict:  # graph: the few-row step's gate (every step through it)
            common = dict(scheme=scheme, few_rows=graph, search=gate_search)
            if gate_data is not None:
                return bleu_gate(folder, tmp_dir, gate_data, max_bleu_drop, **common)
            return quality_gate(folder, tmp_dir, max_em_drop, **common)

        if gate:
            try:
                section["gate"] = run_gate(False)
            except QualityGateError as exc:
                if section.get("table_bits") != 4:
                    raise
                raise QualityGateError(
                    f"{exc} (the embedding tables were 4-bit: {TABLE_BITS_FLAG} 8 keeps them at 8 bits)"
                ) from None
            if few_rows:
                few_rows["gate"] = run_gate(True)
        else:
            logger.warning("%s quality gate skipped (validation off)", scheme)
        for name in (*graph_files, WEIGHTS_FILE):
            os.replace(tmp_dir / name, folder / name)
    quantized_manifest["quantization"] = section
    quantized_manifest["files"] = folder_files(folder)
    write_manifest(folder, quantized_manifest)
    return quantized_manifest


def quantize_export(
    export_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    scheme: str = "int8",
    *,
    gate: bool = True,
    max_em_drop: Optional[float] = None,
    gate_data: Optional[GateData] = None,
    max_bleu_drop: Optional[float] = None,
    options: Optional[Mapping[str, Any]] = None,
    gate_search: Optional[Mapping[str, Any]] = None,
) -> dict:
    """Write a quantized copy of the float32 export ``export_dir`` to ``output_dir`` (a new folder,
    or one this package wrote); returns its manifest. Everything is checked before the disk is touched.

    ``scheme``: one of :data:`SCHEMES`; ``options``: ``block_size``, ``accuracy_level``,
    ``symmetric`` of ``int4`` / ``int8-nbits`` (:func:`resolve_settings`). ``max_em_drop`` /
    ``max_bleu_drop`` ``None``: the scheme's default (:data:`DEFAULT_MAX_DROPS`). ``gate_search``:
    the gate's search options (:class:`~transformer_ext.decoding.SearchOptions` names; default
    greedy search), checked before anything is read.

    Raises:
        QuantizationError: unknown scheme or option, a block size that does not divide a weight
            matrix, ``export_dir`` already quantized, the same folder twice.
        QualityGateError: the quantized decodes lose more than ``max_em_drop`` points of exact match
            (or, with ``gate_data``, more than ``max_bleu_drop`` BLEU points).
        ManifestError: ``export_dir`` is not an export folder.
        OutputFolderError: ``output_dir`` holds files this package did not write.
        transformer_ext.fsutil.OutputConflictError: ``output_dir`` lies inside ``export_dir`` or
            contains it.
    """
    check_quantize_arguments(scheme, options, max_em_drop, max_bleu_drop)
    _check_gate_search(gate_search)
    src = Path(export_dir).absolute()
    out = Path(output_dir).absolute()
    manifest = read_manifest(src)
    _refuse_quantized(src, manifest)
    check_quantize_arguments(scheme, options, max_em_drop, max_bleu_drop, manifest["model_config"])
    if gate:
        check_export_gate(src, manifest, gate_data, where=src)
    if out.exists() and out.resolve() == src.resolve():
        raise QuantizationError(
            f"--output-dir must differ from the export folder {src} (it is replaced atomically "
            "from a float32 source that must stay readable)"
        )
    # an output inside the export it reads (or holding it) would be copied into itself
    check_output_path(out, inputs=[("the export folder --model", src)], what="--output-dir")
    check_replaceable(out)
    made: list[Path] = []
    try:
        make_parents(out, made)
        with StagedDir(out) as stage:
            for name in folder_files(src):
                shutil.copy2(src / name, stage.path / name)
            result = quantize_folder(
                stage.path,
                scheme,
                gate=gate,
                max_em_drop=max_em_drop,
                gate_data=gate_data,
                max_bleu_drop=max_bleu_drop,
                options=options,
                gate_search=gate_search,
            )
            check_replaceable(out)
            stage.commit()
    except BaseException as exc:
        remove_made_parents(made)
        named = named_write_error(exc, out)
        if named is not None:
            raise named from exc
        raise
    return result


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m export.quantize",
        description="Write a quantized copy of a float32 export folder (python -m export.onnx), gated on the "
        "demo task's held-out set or, with --gate-src/--gate-ref, on BLEU of a parallel text; "
        "python -m export.onnx --quantize SCHEME does the same in one step.",
    )
    add_option(
        p,
        "--model",
        deprecated=("--export-dir",),
        required=True,
        help="the float32 export folder to quantize",
    )
    p.add_argument(
        "--output-dir", required=True, help="the folder to write (new, or an export of this package)"
    )
    p.add_argument("--scheme", default="int8", help=f"quantization scheme, one of {list(SCHEMES)}")
    p.add_argument(
        "--max-em-drop",
        type=float,
        default=None,
        help="points of exact match the quantized decodes may lose against float32 "
        f"(default {DEFAULT_MAX_EM_DROP:g})",
    )
    add_gate_arguments(p)
    add_decoding_flags(
        p.add_argument_group("the quality gate's search (translate's flags)"),
        GATE_FLAGS,
        source="the export's generation config",
        shown_defaults={"beam_size": "1, greedy search, whatever the generation config says"},
    )
    add_nbits_arguments(p)
    p.add_argument("--no-validate", dest="validate", action="store_false", help="skip the quality gate")
    add_debug_flag(p)
    return p


def add_gate_arguments(p: argparse.ArgumentParser) -> None:
    """``--gate-src``, ``--gate-ref``, ``--max-bleu-drop``: the BLEU gate of a real-data model."""
    p.add_argument(
        "--gate-src",
        default=None,
        metavar="FILE",
        help="BLEU gate instead of the demo task's exact-match gate: source sentences, one per line "
        "(e.g. a held-out test set); needs --gate-ref and sacrebleu. A model that is not of the demo task "
        "(converted from transformers, a SentencePiece tokenizer) must be given one",
    )
    p.add_argument(
        "--gate-ref", default=None, metavar="FILE", help="the references of --gate-src, one per line"
    )
    p.add_argument(
        "--source-lang",
        default=None,
        metavar="CODE",
        help="the BLEU gate of a multilingual model (M2M100 / NLLB): the language of --gate-src, as for translate",
    )
    p.add_argument(
        "--target-lang",
        default=None,
        metavar="CODE",
        help="the BLEU gate of a multilingual model (Marian >>xx<<, M2M100 / NLLB): the language of --gate-ref, "
        "as for translate",
    )
    p.add_argument(
        "--max-bleu-drop",
        type=float,
        default=None,
        help="BLEU points the quantized greedy translations of --gate-src may lose against float32 "
        "(default: " + ", ".join(f"{s} {d[1]:g}" for s, d in DEFAULT_MAX_DROPS.items()) + ")",
    )


def add_nbits_arguments(p: argparse.ArgumentParser) -> None:
    """``--quant-block-size``, ``--quant-accuracy-level``, ``--quant-symmetric``: the options of
    the MatMulNBits schemes (int4, int8-nbits)."""
    d = SCHEMES["int4"]
    p.add_argument(
        NBITS_OPTIONS["block_size"],
        dest="quant_block_size",
        type=int,
        default=None,
        metavar="N",
        help=f"int4 / int8-nbits: weights per quantization block along the input dimension, one of "
        f"{list(BLOCK_SIZES)}; it must divide d_model and d_ff (default: int4 {d['block_size']}, int8-nbits "
        f"{SCHEMES['int8-nbits']['block_size']}; where that does not divide both, the largest size up to "
        f"{NARROW_BLOCK_SIZE} that does)",
    )
    p.add_argument(
        NBITS_OPTIONS["accuracy_level"],
        dest="quant_accuracy_level",
        type=int,
        default=None,
        metavar="L",
        help="int4 / int8-nbits: MatMulNBits accuracy_level, what the kernel computes in: "
        + "; ".join(f"{k} {v}" for k, v in ACCURACY_LEVELS.items())
        + f" (default {d['accuracy_level']}; without an int8 kernel ONNX Runtime uses float32)",
    )
    p.add_argument(
        FEW_ROWS_FLAG,
        dest="few_rows_graph",
        action="store_const",
        const=False,
        default=None,
        help=f"int8: write no few-row decoder step ({FEW_ROWS_DECODER_FILE}: 8-bit MatMulNBits weights, "
        f"which ONNX Runtime runs faster than the dynamic int8 step at steps of at most "
        f"{FEW_ROWS['max_rows']} rows with {FEW_ROWS['min_threads']} or more threads; written by default "
        "where this CPU has an int8 MatMulNBits kernel, gated like the other graphs)",
    )
    p.add_argument(
        TABLE_BITS_FLAG,
        dest="quant_table_bits",
        type=int,
        default=None,
        metavar="BITS",
        help=f"int4: bits of the embedding tables and of the tied output projection, which reads their "
        f"bytes, one of {list(TABLE_BITS)} (default: 4 where the tables hold at least "
        f"{TABLE_4BIT_MIN_SHARE:.0%}% of the model's weights, as a large vocabulary's do, else 8)",
    )
    p.add_argument(
        NBITS_OPTIONS["symmetric"],
        dest="quant_symmetric",
        action="store_const",
        const=True,
        default=None,
        help="int4 / int8-nbits: symmetric blocks (a scale, no zero point) instead of a scale and a zero "
        "point per block",
    )


def nbits_options_from_args(args: argparse.Namespace) -> dict:
    """The ``options`` of :func:`quantize_export` / :func:`export.onnx.export_onnx` from the flags of
    :func:`add_nbits_arguments` (only those given)."""
    values = {
        "block_size": args.quant_block_size,
        "accuracy_level": args.quant_accuracy_level,
        "symmetric": args.quant_symmetric,
        "few_rows": getattr(args, "few_rows_graph", None),
        "table_bits": getattr(args, "quant_table_bits", None),
    }
    return {k: v for k, v in values.items() if v is not None}


def gate_data_from_args(args: argparse.Namespace) -> Optional[GateData]:
    """The :class:`GateData` of ``--gate-src`` / ``--gate-ref`` (both or neither), read and checked."""
    if (args.gate_src is None) != (args.gate_ref is None):
        raise QuantizationUsageError(
            "--gate-src and --gate-ref go together (the sources and their references)"
        )
    languages = [
        flag
        for flag, value in (("--source-lang", args.source_lang), ("--target-lang", args.target_lang))
        if value
    ]
    if args.gate_src is None:
        if languages:
            raise QuantizationUsageError(
                f"{' / '.join(languages)} set the languages of the BLEU gate's translations: "
                "they need --gate-src and --gate-ref"
            )
        return None
    return GateData(args.gate_src, args.gate_ref, source_lang=args.source_lang, target_lang=args.target_lang)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    check_decoding_flags(parser, args, GATE_FLAGS)
    gate_search = {k: v for k, v in decoding_values(args, GATE_FLAGS).items() if v is not None}
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    def work() -> int:
        options = nbits_options_from_args(args)
        check_quantize_arguments(args.scheme, options, args.max_em_drop, args.max_bleu_drop)
        m = quantize_export(
            args.model,
            args.output_dir,
            args.scheme,
            gate=args.validate,
            max_em_drop=args.max_em_drop,
            gate_data=gate_data_from_args(args),
            max_bleu_drop=args.max_bleu_drop,
            options=options,
            gate_search=gate_search or None,
        )
        print(quantization_summary(m))
        return 0

    return run_cli(parser.prog, work, debug=args.debug)


def quantization_summary(manifest: dict) -> str:
    q = manifest_quantization(manifest) or {}
    g = q.get("graphs", {})
    scheme = q.get("scheme")
    label = _label(scheme) if scheme in SCHEMES else "int8"
    if "bits" in q:
        head = (
            f"quantized ({scheme}: {q['bits']}-bit weights, MatMulNBits, block size {q.get('block_size')}, "
            f"accuracy_level {q.get('accuracy_level')} ({q.get('kernel_compute', '?')} compute on this CPU), "
            f"{'symmetric' if q.get('symmetric') else 'asymmetric'}): "
        )
        op = "MatMulNBits"
    else:
        head = (
            f"quantized ({scheme}, per-channel {q.get('per_channel')}, reduce_range {q.get('reduce_range')}, "
            f"weights {q.get('weight_type')}): "
        )
        op = "MatMulInteger"
    lines = [
        head
        + ", ".join(
            f"{k} {v['quantized_nodes']} {op}, {v['initializer_bytes'] / 2**20:.1f} MiB" for k, v in g.items()
        )
    ]
    few = q.get("few_rows")
    if few:
        line = (
            f"few-row decoder step {few['file']}: 8-bit MatMulNBits, blocks of {few['block_size']}, "
            f"{few['graph']['initializer_bytes'] / 2**20:.1f} MiB; runs steps of at most {few['max_rows']} rows "
            f"with {few['min_threads']}+ threads"
        )
        few_gate = few.get("gate")
        if few_gate and f"bleu_{label}" in few_gate:
            line += f" (gate: BLEU {few_gate[f'bleu_{label}']:.2f})"
        elif few_gate:
            line += f" (gate: exact match {few_gate[f'exact_match_{label}']:.2f}%)"
        lines.append(line)
    gate = q.get("gate")
    if gate and f"bleu_{label}" in gate:
        lines.append(
            f"BLEU gate: {label} {gate[f'bleu_{label}']:.2f} vs float32 {gate['bleu_float32']:.2f} on "
            f"{gate['examples']} sentences ({gate['data']}; drop {gate['drop_points']:.2f} points, at most "
            f"{gate['max_drop_points']:g}; {gate['bleu_signature']})"
        )
    elif gate:
        lines.append(
            f"quality gate: exact match {label} {gate[f'exact_match_{label}']:.2f}% vs float32 "
            f"{gate['exact_match_float32']:.2f}% on {gate['examples']} held-out examples "
            f"(drop {gate['drop_points']:.2f} points, at most {gate['max_drop_points']:g})"
        )
    else:
        lines.append("quality gate skipped")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
