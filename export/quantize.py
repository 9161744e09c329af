"""int8 export folders: ``python -m export.onnx --quantize int8`` and ``python -m export.quantize``.

An int8 export is a complete, standalone export folder with the same file names as a float32
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
(measured on the demo model: see :data:`SCHEMES`). Embedding lookups (``Gather``), attention
products over the caches, layer norms and softmax stay float32. int8 graphs are for ONNX
Runtime: the TensorRT builder and its readiness check refuse them.

Validation. The float32 graphs are validated against eager PyTorch first (the logit tolerance
of a float32 export); the int8 graphs then pass a quality gate instead of a tolerance: greedy
decodes of the demo task's held-out set (:func:`transformer_ext.demo.heldout_examples`,
:mod:`transformer_ext.data`'s split) by the float32 and the int8 graphs, exact match against the
references; the int8 exact match may be at most :data:`DEFAULT_MAX_EM_DROP` points below the
float32 one. A failing gate raises :class:`QualityGateError` saying by how much, and nothing is
written. A model of real data gets a BLEU gate instead (``--gate-src FILE --gate-ref FILE``,
:class:`GateData`): both folders translate the source file greedily (the translator, ONNX
Runtime), sacrebleu scores them against the reference file, and the int8 BLEU may be at most
:data:`DEFAULT_MAX_BLEU_DROP` points below float32's. Without gate files, a model whose
tokenizer cannot encode the demo task has no held-out set: the gate cannot run and the export
is refused unless validation is turned off (``--no-validate``, recorded as ``"gate": null`` in
the manifest).

Files. :func:`quantize_export` converts an existing float32 export folder into a new folder
(every argument checked first, the folder built in a temporary sibling and swapped in;
:class:`transformer_ext.fsutil.StagedDir`); an already quantized folder is refused.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from transformer_ext.cli import add_debug_flag, run_cli
from transformer_ext.export_format import (
    DECODER_FILE,
    ENCODER_FILE,
    QUANTIZATION_SCHEMES,
    ExportError,
    manifest_quantization,
    read_manifest,
    tokenizer_files,
)
from transformer_ext.fsutil import StagedDir

from .manifest import (
    check_replaceable,
    folder_files,
    make_parents,
    named_write_error,
    remove_made_parents,
    write_manifest,
)

logger = logging.getLogger(__name__)

__all__ = [
    "SCHEMES",
    "DEFAULT_MAX_EM_DROP",
    "DEFAULT_MAX_BLEU_DROP",
    "GateData",
    "bleu_gate",
    "INT8_OP_TYPES",
    "QuantizationError",
    "QualityGateError",
    "check_scheme",
    "quantize_graphs",
    "quality_gate",
    "quantize_folder",
    "quantize_export",
    "main",
]

# How each scheme is made; recorded in the manifest's "quantization" section.
# Measured on the demo model (greedy exact match on its 500 held-out examples, ONNX Runtime 1.32,
# AMD EPYC without VNNI; float32 99.8%): per-channel int8 with reduce_range 99.8% (every decode
# equal to float32's), full-range int8 or uint8 weights 99.6% (one decode differs). reduce_range
# keeps the u8 x s8 kernels from saturating.
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
}
assert tuple(SCHEMES) == QUANTIZATION_SCHEMES
DEFAULT_MAX_EM_DROP = 0.2  # points of exact match (percent) the int8 graphs may lose against float32
DEFAULT_MAX_BLEU_DROP = 0.5  # BLEU points the int8 graphs may lose against float32 on --gate-src/--gate-ref
# Ops of quantized graphs (what the TensorRT readiness check refuses).
INT8_OP_TYPES = (
    "MatMulInteger",
    "DynamicQuantizeLinear",
    "QLinearMatMul",
    "ConvInteger",
    "DynamicQuantizeMatMul",
    "MatMulIntegerToFloat",
    "QuantizeLinear",
    "DequantizeLinear",
)


class QuantizationError(ExportError):
    """A folder cannot be quantized (unknown scheme, already quantized, not an export)."""


class QualityGateError(QuantizationError):
    """The quantized graphs decode too differently from float32 (or the gate cannot run)."""


def check_scheme(scheme: Any) -> str:
    """``scheme`` if it is one of :data:`SCHEMES`; raises :class:`QuantizationError` naming the choices."""
    if not isinstance(scheme, str) or scheme not in SCHEMES:
        raise QuantizationError(f"unknown quantization scheme {scheme!r}: expected one of {list(SCHEMES)}")
    return scheme


class GateData:
    """The parallel text of a BLEU gate: ``sources`` and ``references`` (one line each), read and
    checked when made, so a bad file is refused before anything is written.

    Raises :class:`QuantizationError` naming ``--gate-src`` / ``--gate-ref`` for a missing,
    non-UTF-8 or empty file, line counts that differ, or a blank source line.
    """

    def __init__(self, src: str | os.PathLike, ref: str | os.PathLike):
        from transformer_ext.data import DataError, read_lines

        self.src, self.ref = Path(src), Path(ref)
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
        raise ValueError(f"{name} must be a finite number >= 0 ({what}), got {value!r}")
    return float(value)


# ------------------------------------------------------------------------------------------
# The graphs
# ------------------------------------------------------------------------------------------


def _quantize_one(src: Path, dst: Path, settings: dict) -> dict:
    """Quantize the graph ``src`` into ``dst``; ``{"quantized_nodes", "op_counts", "initializer_bytes"}``."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    weight_type = {"int8": QuantType.QInt8, "uint8": QuantType.QUInt8}[settings["weight_type"]]
    before = onnx.load(os.fspath(src))
    candidates = sum(
        1
        for n in before.graph.node
        if n.op_type in settings["op_types"]
        and len(n.input) > 1
        and n.input[1] in {t.name for t in before.graph.initializer}
    )
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # quantize_dynamic warns on the root logger about pre-processing
    try:
        quantize_dynamic(
            os.fspath(src),
            os.fspath(dst),
            op_types_to_quantize=list(settings["op_types"]),
            per_channel=settings["per_channel"],
            reduce_range=settings["reduce_range"],
            weight_type=weight_type,
        )
    finally:
        root.setLevel(level)
    model = onnx.load(os.fspath(dst))
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
    nbytes = sum(
        int(np.prod(t.dims, dtype=np.int64)) * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
        for t in model.graph.initializer
    )
    return {
        "quantized_nodes": quantized,
        "op_counts": dict(sorted(counts.items())),
        "initializer_bytes": int(nbytes),
    }


def quantize_graphs(src_dir: Path, dst_dir: Path, scheme: str) -> dict:
    """Quantize ``src_dir``'s two graphs into ``dst_dir`` (same file names); the manifest section."""
    import onnxruntime

    settings = SCHEMES[check_scheme(scheme)]
    graphs = {}
    for key, name in (("encoder", ENCODER_FILE), ("decoder_step", DECODER_FILE)):
        graphs[key] = _quantize_one(Path(src_dir) / name, Path(dst_dir) / name, settings)
    return {
        "scheme": scheme,
        **settings,
        "onnxruntime": onnxruntime.__version__,
        "graphs": graphs,
        "gate": None,
    }


# ------------------------------------------------------------------------------------------
# The quality gate
# ------------------------------------------------------------------------------------------


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
    sources, references = [], []
    try:
        for number in data.split_numbers().heldout:
            ids = tokenizer.encode_source(data.source_text(number))
            sources.append(ids)
            references.append(tokenizer.encode_target(data.target_text(number)))
    except (TokenizerError, ImportError) as exc:
        raise QualityGateError(
            f"{folder}: the int8 quality gate decodes the demo task's held-out set, which this "
            f"model's tokenizer cannot encode ({exc}); pass --no-validate to skip the gate"
        ) from exc
    lengths = np.array([len(s) for s in sources], dtype=np.int64)
    ids = np.full((len(sources), int(lengths.max())), tokenizer.pad_id, dtype=np.int64)
    for row, s in enumerate(sources):
        ids[row, : len(s)] = s
    return ids, lengths, references


def _greedy_all(folder: Path, ids: np.ndarray, lengths: np.ndarray, batch: int = 64) -> list[list[int]]:
    from transformer_ext.decoding import max_new_tokens_for
    from transformer_ext.export_format import read_generation_config
    from transformer_ext.runtimes import OrtRunner

    runner = OrtRunner(folder, intra_op_num_threads=2)
    gen = read_generation_config(folder, runner.manifest)
    out: list[list[int]] = []
    for start in range(0, len(ids), batch):
        rows = slice(start, start + batch)
        width = int(lengths[rows].max())
        budget = max_new_tokens_for(lengths[rows], gen.max_len_a, gen.max_len_b, cap=gen.max_new_tokens)
        out += runner.greedy(ids[rows, :width], lengths[rows], max_new_tokens=budget)
    return out


def _strip_eos(tokens: list[int], eos: int) -> list[int]:
    return list(tokens[: tokens.index(eos)]) if eos in tokens else list(tokens)


def quality_gate(float_dir: Path, int8_dir: Path, max_em_drop: float = DEFAULT_MAX_EM_DROP) -> dict:
    """Greedy exact match of both folders on the demo held-out set; raises :class:`QualityGateError`
    when the int8 one is more than ``max_em_drop`` points below float32. Returns the gate's record."""
    max_em_drop = _check_max_drop(max_em_drop)
    t0 = time.perf_counter()
    ids, lengths, references = _heldout_batch(Path(float_dir))
    eos = int(read_manifest(float_dir)["model_config"]["eos_id"])
    f32 = [_strip_eos(t, eos) for t in _greedy_all(Path(float_dir), ids, lengths)]
    i8 = [_strip_eos(t, eos) for t in _greedy_all(Path(int8_dir), ids, lengths)]
    n = len(references)
    em_f32 = 100.0 * sum(a == r for a, r in zip(f32, references)) / n
    em_i8 = 100.0 * sum(a == r for a, r in zip(i8, references)) / n
    agree = 100.0 * sum(a == b for a, b in zip(f32, i8)) / n
    record = {
        "data": "demo held-out set (transformer_ext.data.split_numbers().heldout), greedy",
        "examples": n,
        "exact_match_float32": round(em_f32, 4),
        "exact_match_int8": round(em_i8, 4),
        "drop_points": round(em_f32 - em_i8, 4),
        "max_drop_points": max_em_drop,
        "int8_equal_to_float32": round(agree, 4),
        "seconds": round(time.perf_counter() - t0, 2),
    }
    logger.info("int8 quality gate: %s", record)
    if em_f32 - em_i8 > max_em_drop + 1e-9:
        raise QualityGateError(
            f"the int8 graphs fail the quality gate: exact match {em_i8:.2f}% vs {em_f32:.2f}% for float32 on "
            f"{n} held-out examples, {em_f32 - em_i8:.2f} points lower (at most {max_em_drop:g} allowed); "
            "nothing was written"
        )
    return record


def bleu_gate(
    float_dir: Path, int8_dir: Path, data: GateData, max_bleu_drop: float = DEFAULT_MAX_BLEU_DROP
) -> dict:
    """Greedy translations of ``data.sources`` by both folders, BLEU against ``data.references``
    (sacrebleu); raises :class:`QualityGateError` when the int8 BLEU is more than
    ``max_bleu_drop`` points below float32's. Returns the gate's record."""
    from transformer_ext.evaluate import score_texts
    from transformer_ext.translate import Translator

    max_bleu_drop = _check_max_drop(max_bleu_drop, "max_bleu_drop")
    t0 = time.perf_counter()
    hyps = {}
    for name, folder in (("float32", float_dir), ("int8", int8_dir)):
        translator = Translator.from_export_dir(folder, threads=2)
        hyps[name] = translator.translate(data.sources, beam_size=1, progress=True)
    scores = {name: score_texts(h, data.references) for name, h in hyps.items()}
    b32, b8 = scores["float32"]["bleu"], scores["int8"]["bleu"]
    n = len(data.sources)
    agree = 100.0 * sum(a == b for a, b in zip(hyps["float32"], hyps["int8"])) / n
    record = {
        "data": f"{data.src.name} -> {data.ref.name}, greedy",
        "examples": n,
        "bleu_float32": round(b32, 2),
        "bleu_int8": round(b8, 2),
        "drop_points": round(b32 - b8, 2),
        "max_drop_points": max_bleu_drop,
        "bleu_signature": scores["float32"]["bleu_signature"],
        "int8_equal_to_float32": round(agree, 4),
        "seconds": round(time.perf_counter() - t0, 2),
    }
    logger.info("int8 BLEU gate: %s", record)
    if b32 - b8 > max_bleu_drop + 1e-9:
        raise QualityGateError(
            f"the int8 graphs fail the BLEU gate: BLEU {b8:.2f} vs {b32:.2f} for float32 on {n} sentences of "
            f"{data.src}, {b32 - b8:.2f} points lower (at most {max_bleu_drop:g} allowed); nothing was written"
        )
    return record


# ------------------------------------------------------------------------------------------
# Folders
# ------------------------------------------------------------------------------------------


def quantize_folder(
    folder: Path,
    scheme: str,
    *,
    gate: bool = True,
    max_em_drop: float = DEFAULT_MAX_EM_DROP,
    gate_data: Optional[GateData] = None,
    max_bleu_drop: float = DEFAULT_MAX_BLEU_DROP,
) -> dict:
    """Quantize the float32 export in ``folder`` (a staged folder of this process) in place: the
    int8 graphs are written beside it, gated against the float32 ones (:func:`bleu_gate` on
    ``gate_data`` when given, else :func:`quality_gate` on the demo task), then moved over them
    and the manifest updated. Returns the new manifest. On any failure ``folder`` is as it was."""
    check_scheme(scheme)
    max_em_drop = _check_max_drop(max_em_drop)
    max_bleu_drop = _check_max_drop(max_bleu_drop, "max_bleu_drop")
    folder = Path(folder)
    manifest = read_manifest(folder)
    if manifest_quantization(manifest) is not None:
        raise QuantizationError(
            f"{folder} is already quantized ({manifest_quantization(manifest).get('scheme')}): "
            "quantize a float32 export"
        )
    # A scratch sibling of the folder (not inside it, so its files list stays exact), never
    # committed: removed on any exit, and by the next run on this host if this one is killed.
    with StagedDir(folder.with_name(f"{folder.name}.quantize")) as scratch:
        tmp_dir = scratch.path
        for name in folder_files(folder):
            shutil.copy2(folder / name, tmp_dir / name)
        section = quantize_graphs(folder, tmp_dir, scheme)
        int8_manifest = dict(manifest, quantization=section)
        int8_manifest["files"] = folder_files(tmp_dir)
        write_manifest(tmp_dir, int8_manifest)
        if gate and gate_data is not None:
            section["gate"] = bleu_gate(folder, tmp_dir, gate_data, max_bleu_drop)
        elif gate:
            section["gate"] = quality_gate(folder, tmp_dir, max_em_drop)
        else:
            logger.warning("int8 quality gate skipped (validation off)")
        for name in (ENCODER_FILE, DECODER_FILE):
            os.replace(tmp_dir / name, folder / name)
    int8_manifest["quantization"] = section
    int8_manifest["files"] = folder_files(folder)
    write_manifest(folder, int8_manifest)
    return int8_manifest


def quantize_export(
    export_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    scheme: str = "int8",
    *,
    gate: bool = True,
    max_em_drop: float = DEFAULT_MAX_EM_DROP,
    gate_data: Optional[GateData] = None,
    max_bleu_drop: float = DEFAULT_MAX_BLEU_DROP,
) -> dict:
    """Write an int8 copy of the float32 export ``export_dir`` to ``output_dir`` (a new folder, or
    one this package wrote); returns its manifest. Everything is checked before the disk is touched.

    Raises:
        QuantizationError: unknown scheme, ``export_dir`` already quantized, the same folder twice.
        QualityGateError: the int8 decodes lose more than ``max_em_drop`` points of exact match
            (or, with ``gate_data``, more than ``max_bleu_drop`` BLEU points).
        ManifestError: ``export_dir`` is not an export folder.
        OutputFolderError: ``output_dir`` holds files this package did not write.
    """
    check_scheme(scheme)
    max_em_drop = _check_max_drop(max_em_drop)
    max_bleu_drop = _check_max_drop(max_bleu_drop, "max_bleu_drop")
    src = Path(export_dir).absolute()
    out = Path(output_dir).absolute()
    manifest = read_manifest(src)
    if manifest_quantization(manifest) is not None:
        raise QuantizationError(
            f"{src} is already quantized ({manifest_quantization(manifest).get('scheme')}): "
            "quantize a float32 export"
        )
    if out.exists() and out.resolve() == src.resolve():
        raise QuantizationError(
            f"--output-dir must differ from the export folder {src} (it is replaced atomically "
            "from a float32 source that must stay readable)"
        )
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
        description="Write an int8 copy of a float32 export folder (python -m export.onnx), gated on the demo "
        "task's held-out set or, with --gate-src/--gate-ref, on BLEU of a parallel text; "
        "python -m export.onnx --quantize int8 does the same in one step.",
    )
    p.add_argument("--export-dir", required=True, help="the float32 export folder to quantize")
    p.add_argument(
        "--output-dir", required=True, help="the folder to write (new, or an export of this package)"
    )
    p.add_argument("--scheme", default="int8", help=f"quantization scheme, one of {list(SCHEMES)}")
    p.add_argument(
        "--max-em-drop",
        type=float,
        default=DEFAULT_MAX_EM_DROP,
        help="points of exact match the int8 decodes may lose against float32",
    )
    add_gate_arguments(p)
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
        "(e.g. a held-out test set); needs --gate-ref and sacrebleu",
    )
    p.add_argument(
        "--gate-ref", default=None, metavar="FILE", help="the references of --gate-src, one per line"
    )
    p.add_argument(
        "--max-bleu-drop",
        type=float,
        default=DEFAULT_MAX_BLEU_DROP,
        help="BLEU points the int8 greedy translations of --gate-src may lose against float32",
    )


def gate_data_from_args(args: argparse.Namespace) -> Optional[GateData]:
    """The :class:`GateData` of ``--gate-src`` / ``--gate-ref`` (both or neither), read and checked."""
    if (args.gate_src is None) != (args.gate_ref is None):
        raise QuantizationError("--gate-src and --gate-ref go together (the sources and their references)")
    if args.gate_src is None:
        return None
    return GateData(args.gate_src, args.gate_ref)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    def work() -> int:
        m = quantize_export(
            args.export_dir,
            args.output_dir,
            args.scheme,
            gate=args.validate,
            max_em_drop=args.max_em_drop,
            gate_data=gate_data_from_args(args),
            max_bleu_drop=args.max_bleu_drop,
        )
        print(quantization_summary(m))
        return 0

    return run_cli(parser.prog, work, debug=args.debug)


def quantization_summary(manifest: dict) -> str:
    q = manifest_quantization(manifest) or {}
    g = q.get("graphs", {})
    lines = [
        f"quantized ({q.get('scheme')}, per-channel {q.get('per_channel')}, reduce_range {q.get('reduce_range')}, "
        f"weights {q.get('weight_type')}): "
        + ", ".join(
            f"{k} {v['quantized_nodes']} MatMulInteger, {v['initializer_bytes'] / 2**20:.1f} MiB"
            for k, v in g.items()
        )
    ]
    gate = q.get("gate")
    if gate and "bleu_int8" in gate:
        lines.append(
            f"BLEU gate: int8 {gate['bleu_int8']:.2f} vs float32 {gate['bleu_float32']:.2f} on "
            f"{gate['examples']} sentences ({gate['data']}; drop {gate['drop_points']:.2f} points, at most "
            f"{gate['max_drop_points']:g}; {gate['bleu_signature']})"
        )
    elif gate:
        lines.append(
            f"quality gate: exact match int8 {gate['exact_match_int8']:.2f}% vs float32 "
            f"{gate['exact_match_float32']:.2f}% on {gate['examples']} held-out examples "
            f"(drop {gate['drop_points']:.2f} points, at most {gate['max_drop_points']:g})"
        )
    else:
        lines.append("quality gate skipped")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
