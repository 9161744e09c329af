"""``python -m export.onnx``: export a model folder to ONNX and prove the graphs match eager PyTorch.

Command line::

    python -m export.onnx                              # the bundled demo model -> ./onnx_export/
    python -m export.onnx --model runs/base --output-dir out/base_onnx
    python -m export.onnx --flavour tensorscatter      # cache update inside the graph (opset 24)
    python -m export.onnx --flavour ort                # ONNX Runtime's GroupQueryAttention (CPU)
    python -m export.onnx --flavour custom-op          # transformer_ext.DecodeAttention (csrc/ort/, CPU)
    python -m export.onnx --quantize int8              # int8 weights, for ONNX Runtime (export.quantize)
    python -m export.onnx --quantize int4              # 4-bit block-wise weights (MatMulNBits), ONNX Runtime
    python -m export.onnx --help

Python::

    from export.onnx import export_onnx
    result = export_onnx("path/to/model_dir", "path/to/output_dir")
    result.validation.max_abs_diff        # per output

The output folder (docs/DESIGN.md section 3) holds ``encoder.onnx``, ``decoder_step.onnx``,
``manifest.json``, the model's tokenizer files and ``generation.json`` (how a deployment decodes:
beam size, length penalty, maximum-length rule, special ids; ``--beam-size``, ``--length-penalty``... set
it, :class:`transformer_ext.export_format.GenerationConfig`), so that a deployment needs nothing
but the folder. Both graphs are traced with
``torch.onnx.export(dynamo=True)`` from the model's own ``encode`` and ``decode_step`` (the code
eager decoding runs); the custom ops are lowered to standard ONNX ops by :mod:`export.lowering`.

Files. Every argument and the model folder (config, weights, tokenizer, the special token ids
of config and tokenizer) are checked before anything is written. The folder is built in a
temporary sibling (:class:`transformer_ext.fsutil.StagedDir`), checked and validated there, and
only then swapped into place; a failed or interrupted export (an error, SIGINT, SIGTERM) leaves
no partial folder and never replaces a good one, and the temporary folder of a killed earlier
run is removed by the next one. An existing output folder is replaced only when it is empty or
an export of this package holding nothing but the files its manifest lists
(:func:`export.manifest.check_replaceable`); a symlinked output folder stays a symlink.
"""

from __future__ import annotations

if __name__ == "__main__":  # before the imports: one line, not a traceback, where they are missing
    from transformer_ext.commands import require

    require("export.onnx")

import argparse
import contextlib
import io
import logging
import math
import operator
import os
import shlex
import shutil
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import torch

from transformer_ext.cli import DefaultsHelpFormatter, UsageError, add_debug_flag, add_option, run_cli
from transformer_ext.convert.generation import GENERATION_DEFAULTS_FILE
from transformer_ext.export_format import (
    ATTENTION_OUTPUT,
    CUSTOM_OP_DOMAIN,
    CUSTOM_OP_FLAVOUR,
    CUSTOM_OP_TYPE,
    CUSTOM_OPS_LIBRARY,
    DECODER_FILE,
    ENCODER_FILE,
    FLAVOURS,
    FORMAT,
    FORMAT_VERSION,
    GENERATION_FILE,
    MANIFEST_NAME,
    TOKENIZER_FILE,
    GenerationConfig,
    file_sha256,
    graph_specs,
    manifest_quantization,
    read_generation_config,
    tokenizer_files,
)
from transformer_ext.fsutil import StagedDir, check_output_path
from transformer_ext.search_flags import add_decoding_flags, check_decoding_flags, decoding_values
from transformer_ext.training.run_folder import managed_dirs

from . import ExportError, GraphContractError, ModelDirectoryError
from .manifest import (
    check_replaceable,
    folder_files,
    make_parents,
    named_write_error,
    remove_made_parents,
    write_generation_config,
    write_manifest,
)
from .weights import share_weights

PROVENANCE_FILE = "provenance.json"  # written by transformer_ext.corpora, copied by train into model folders

logger = logging.getLogger(__name__)
TOKENIZER_NAME = "tokenizer.json"

__all__ = [
    "DEFAULT_OUTPUT_DIR",
    "DEFAULT_OPSETS",
    "DEFAULT_TOLERANCE",
    "IR_VERSION",
    "ExportResult",
    "EncoderGraph",
    "DecoderStepGraph",
    "export_onnx",
    "main",
]

DEFAULT_OUTPUT_DIR = "onnx_export"
DEFAULT_OPSETS = {"portable": 18, "tensorscatter": 24, "ort": 18, CUSTOM_OP_FLAVOUR: 18}
OPSET_RANGES = {
    "portable": range(17, 22),
    "tensorscatter": range(24, 25),
    "ort": range(17, 22),
    CUSTOM_OP_FLAVOUR: range(17, 22),
}
# The custom-op flavour's operator library as csrc/ort/build.sh writes it (the environment
# variable names another build of it).
CUSTOM_OPS_LIBRARY_ENV = "TRANSFORMER_EXT_ORT_LIBRARY"
BUILT_CUSTOM_OPS_LIBRARY = Path(__file__).resolve().parents[1] / "build" / "ort" / CUSTOM_OPS_LIBRARY
DEFAULT_TOLERANCE = 1e-4  # max absolute difference per output (float32 logits and K/V)
# onnxruntime-gpu 1.31 accepts IR <= 13, TensorRT 10.15's parser IR <= 10 safely; torch writes 10.
IR_VERSION = 10
# Export dummies: deliberately unlike the validation shapes (batch 1, 3, 8), none equal to 0 or 1
# (torch.export specialises those) and all different from each other.
DUMMY_BATCH, DUMMY_SRC_LEN, DUMMY_CACHE_LEN = 2, 5, 7
TRANSLATION_EXAMPLES = 5


@dataclass
class ExportResult:
    """What :func:`export_onnx` produced."""

    output_dir: Path
    encoder_path: Path
    decoder_path: Path
    manifest_path: Path
    manifest: dict
    validation: Optional[Any]  # export.validate.ValidationReport, None with validate=False
    seconds: float


# ------------------------------------------------------------------------------------------
# The traced modules: thin wrappers over the model's own encode / decode_step
# ------------------------------------------------------------------------------------------


class EncoderGraph(torch.nn.Module):
    """``(input_ids, src_lengths) -> (encoder_out, cross_key.0, cross_value.0, ...)`` via ``model.encode``."""

    def __init__(self, model):
        super().__init__()
        from .position_bias import bucket_index

        self.model = model
        # T5's relative bias: the buckets of every distance, one constant (export.position_bias)
        self.register_buffer("relative_buckets", bucket_index(model, bidirectional=True), persistent=False)

    def forward(self, input_ids, src_lengths):
        from .position_bias import tabled_relative_bias

        with tabled_relative_bias(self.model, self.relative_buckets, bidirectional=True):
            encoder_out, cross_keys, cross_values = self.model.encode(input_ids, src_lengths)
        outputs = [encoder_out]
        for k, v in zip(cross_keys, cross_values):
            outputs += [k, v]
        return tuple(outputs)


class DecoderStepGraph(torch.nn.Module):
    """One decoder step via ``model.decode_step``, with flat inputs in the order of the contract.

    ``forward(input_ids, positions, src_lengths, *kv)`` where ``kv`` is ``self_key.0, self_value.0,
    ..., cross_key.0, cross_value.0, ...``. Portable flavour: returns ``(logits, new_key.0,
    new_value.0, ...)``. ``tensorscatter``: traces the same ``decode_step`` under
    :func:`export.lowering.in_graph_cache_update` and returns ``(logits, present_key.0,
    present_value.0, ...)``; ``ort`` the same under :func:`export.lowering.in_graph_gqa`;
    ``custom-op`` the portable outputs under :func:`export.lowering.in_graph_custom_attention`. ``attention``: the step's head-averaged cross-attention of the last
    decoder layer (``decode_step(return_attention=True)``) as one more output, last.
    """

    def __init__(self, model, flavour: str = "portable", attention: bool = False):
        super().__init__()
        if flavour not in FLAVOURS:
            raise ValueError(f"flavour must be one of {FLAVOURS}, got {flavour!r}")
        from .position_bias import bucket_index

        self.model = model
        self.flavour = flavour
        self.attention = bool(attention)
        self.n_layers = model.config.n_decoder_layers
        self.register_buffer("relative_buckets", bucket_index(model, bidirectional=False), persistent=False)

    def forward(self, input_ids, positions, src_lengths, *kv):
        from .lowering import position_bias_in_graph
        from .position_bias import tabled_relative_bias

        with (
            tabled_relative_bias(self.model, self.relative_buckets, bidirectional=False),
            position_bias_in_graph(),
        ):
            return self._step(input_ids, positions, src_lengths, *kv)

    def _step(self, input_ids, positions, src_lengths, *kv):
        n = self.n_layers
        self_keys, self_values = list(kv[0 : 2 * n : 2]), list(kv[1 : 2 * n : 2])
        cross_keys, cross_values = list(kv[2 * n :: 2]), list(kv[2 * n + 1 :: 2])
        extra = {"cross_per_source": True}
        if self.attention:
            extra["return_attention"] = True
        if self.flavour == "portable":
            logits, new_keys, new_values, *attention = self.model.decode_step(
                input_ids, positions, src_lengths, self_keys, self_values, cross_keys, cross_values, **extra
            )
        elif self.flavour == CUSTOM_OP_FLAVOUR:
            from . import lowering

            with lowering.in_graph_custom_attention() as trace:
                # the cross-attention lengths of each source: its first row's (a source's rows share them)
                trace.source_lengths = src_lengths.view(cross_keys[0].shape[0], -1)[:, 0]
                logits, new_keys, new_values, *attention = self.model.decode_step(
                    input_ids,
                    positions,
                    src_lengths,
                    self_keys,
                    self_values,
                    cross_keys,
                    cross_values,
                    **extra,
                )
            if trace.nodes != 2 * n:
                raise GraphContractError(
                    f"expected {2 * n} decoder attentions (self and cross per layer) while tracing, got "
                    f"{trace.nodes}: decode_step must call ops.decode_attention with k_new/v_new and the "
                    "per-source cross-attention once per layer"
                )
        else:
            from . import lowering

            in_graph = lowering.in_graph_gqa if self.flavour == "ort" else lowering.in_graph_cache_update
            with in_graph() as (new_keys, new_values):
                logits, _, _, *attention = self.model.decode_step(
                    input_ids,
                    positions,
                    src_lengths,
                    self_keys,
                    self_values,
                    cross_keys,
                    cross_values,
                    **extra,
                )
            if len(new_keys) != n:
                raise GraphContractError(
                    f"expected {n} self-attention cache updates while tracing, got {len(new_keys)}: "
                    "decode_step must call ops.decode_attention with k_new/v_new once per layer"
                )
        outputs = [logits]
        for k, v in zip(new_keys, new_values):
            outputs += [k, v]
        return tuple(outputs + attention)


@contextlib.contextmanager
def folded_query_scale(model):
    """While inside, every decoder layer's query projections (self- and cross-attention) are
    multiplied by the attention scale ``1/sqrt(d_k)`` and the layers attend with scale 1.

    The same function: ``(x W_Q + b_Q) k * s == (x (s W_Q) + s b_Q) k``. Traced this way, the
    decoder step has no score ``Mul`` and ONNX Runtime's ``MatMulScaleFusion`` has nothing to fold
    into a ``FusedMatMul`` alpha, so the one-row ``q kT`` products keep MLAS's no-packing path
    (taken only with alpha 1). Where ``d_k`` is a power of 4 the scale is a power of two and the
    products are bit-identical; otherwise they differ by float rounding. The parameters are new
    tensors swapped in for the trace: the model's own are put back untouched on exit, and the
    encoder (its cross-attention keys and values) does not read the query projections.
    """
    saved = []
    try:
        with torch.no_grad():
            for layer in model.decoder.layers:
                for attn in (layer.self_attn, layer.src_attn):
                    proj = attn.W_Q
                    saved.append((attn, attn.scale, proj, proj.weight, proj.bias))
                    proj.weight = torch.nn.Parameter(proj.weight * attn.scale, requires_grad=False)
                    if proj.bias is not None:
                        proj.bias = torch.nn.Parameter(proj.bias * attn.scale, requires_grad=False)
                    attn.scale = 1.0
        yield model
    finally:
        for attn, scale, proj, weight, bias in reversed(saved):
            proj.weight = weight
            if bias is not None:
                proj.bias = bias
            attn.scale = scale


# ------------------------------------------------------------------------------------------
# Loading the model folder
# ------------------------------------------------------------------------------------------


def demo_model_dir() -> Path:
    """The bundled demo model folder (it may be absent in a source checkout without it)."""
    from transformer_ext.demo import DEMO_MODEL_DIR

    return Path(DEMO_MODEL_DIR)


def load_model_dir(model_dir: Optional[str | os.PathLike]):
    """``(model in eval mode on CPU, model_dir Path, tokenizer file names)``.

    Raises:
        ModelDirectoryError: the folder, its config or weights are missing or cannot be loaded.
        transformer_ext.tokenizer.TokenizerError: ``tokenizer.json`` is corrupt, or disagrees with
            the config (see :func:`check_tokenizer`).
    """
    return _load_model_folder(model_dir)[:3]


def _load_model_only(model_dir: Optional[str | os.PathLike]):
    """``(model in eval mode on CPU, model_dir Path)``; raises ModelDirectoryError."""
    from transformer_ext.checkpoint import CONFIG_NAME, WEIGHTS_NAME, load_model

    path = Path(model_dir) if model_dir is not None else demo_model_dir()
    if not path.exists():
        hint = " (the bundled demo model is not installed; pass --model)" if model_dir is None else ""
        raise ModelDirectoryError(f"model folder not found: {path}{hint}")
    if not path.is_dir():
        raise ModelDirectoryError(f"not a model folder (expected a directory): {path}")
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        if not (path / name).is_file():
            raise ModelDirectoryError(
                f"{path} is not a model folder: {name} is missing (a model folder holds "
                f"{CONFIG_NAME}, {WEIGHTS_NAME} and the tokenizer files)"
            )
    try:
        model = load_model(path, device="cpu")
    except (FileNotFoundError, ValueError, TypeError) as exc:
        raise ModelDirectoryError(f"cannot load the model in {path}: {exc}") from exc
    model.eval()
    return model, path


def _check_flavour(path: Path, config, flavour: str, attention: bool = False) -> None:
    """What the graph ``flavour`` cannot express of the model (:func:`export.position_bias.flavour_problems`)."""
    from .position_bias import flavour_problems

    problems = flavour_problems(config, flavour)
    if flavour == CUSTOM_OP_FLAVOUR and attention:
        problems.append(
            "its DecodeAttention nodes output no attention probabilities: export without --attention"
        )
    if problems:
        raise ExportError(f"{path}: the {flavour} flavour cannot export this model ({'; '.join(problems)})")


def custom_ops_library_source() -> Path:
    """The operator library a custom-op export copies into its folder: ``$TRANSFORMER_EXT_ORT_LIBRARY``
    or ``build/ort/libtransformer_ext_ort.so`` of the source tree (``csrc/ort/build.sh`` writes it).

    Raises ExportError, one line saying how to build it, when it is not there."""
    named = os.environ.get(CUSTOM_OPS_LIBRARY_ENV)
    path = Path(named) if named else BUILT_CUSTOM_OPS_LIBRARY
    if not path.is_file():
        where = f"${CUSTOM_OPS_LIBRARY_ENV} = {path}" if named else str(path)
        raise ExportError(
            f"the custom-op flavour needs the operator library {where}, which is not there: build it with "
            "scripts/fetch_ort_headers.sh && csrc/ort/build.sh"
        )
    return path


def _copy_custom_ops_library(tmp_dir: Path, library: Path) -> dict:
    """Copy the operator library into the export; the manifest's ``custom_ops`` section."""
    shutil.copyfile(library, tmp_dir / CUSTOM_OPS_LIBRARY)
    return {
        "library": CUSTOM_OPS_LIBRARY,
        "sha256": file_sha256(tmp_dir / CUSTOM_OPS_LIBRARY),
        "domain": CUSTOM_OP_DOMAIN,
        "ops": [CUSTOM_OP_TYPE],
        "source": str(library),
    }


def _load_model_folder(model_dir):
    """``(model, model_dir Path, tokenizer file names, special token ids)``, checked as in :func:`load_model_dir`."""
    model, path = _load_model_only(model_dir)
    files, special = check_tokenizer(path, model.config)
    return model, path, files, special


def check_tokenizer(model_path: Path, config) -> tuple[list[str], dict[str, int]]:
    """``(tokenizer files to copy, special token ids)`` of a model folder, checked.

    ``tokenizer.json`` is read with :func:`transformer_ext.tokenizer.load_tokenizer` (whatever
    kind it describes; a corrupt file is an error naming it), every file the tokenizer needs
    (:attr:`Tokenizer.files`) must be there, and its pad/bos/eos ids and vocabulary sizes must
    agree with ``config.json``; the returned ids (unk included) are the ones the manifest records. A folder without a tokenizer (models for
    benchmarks) exports with a warning: the ids are then the config's, and the export can decode
    token ids but not translate text.

    Raises:
        transformer_ext.tokenizer.TokenizerError: ``tokenizer.json`` is corrupt or invalid, or an id
            or a vocabulary size differs from the config's (naming both files:
            :func:`transformer_ext.tokenizer.check_model_config`).
    """
    from transformer_ext.checkpoint import CONFIG_NAME
    from transformer_ext.tokenizer import check_model_config, load_tokenizer

    special = {"pad": int(config.pad_id), "bos": int(config.bos_id), "eos": int(config.eos_id)}
    path = Path(model_path) / TOKENIZER_FILE
    if not path.exists():
        logger.warning(
            "%s has no %s: exporting without a tokenizer (the export can decode token ids, "
            "not translate text)",
            model_path,
            TOKENIZER_FILE,
        )
        return [], special
    if not path.is_file():
        raise ModelDirectoryError(
            f"{path} is not a file (a model folder's tokenizer is the file {TOKENIZER_FILE})"
        )
    tokenizer = load_tokenizer(path)
    check_model_config(
        tokenizer,
        config,
        tokenizer_file=os.fspath(path),
        config_file=os.fspath(Path(model_path) / CONFIG_NAME),
    )
    files = list(tokenizer.files)
    for name in files:
        if not (Path(model_path) / name).is_file():
            raise ModelDirectoryError(
                f"{Path(model_path) / name} is missing: the tokenizer described by {path} "
                f"needs the files {files}"
            )
    special["unk"] = int(tokenizer.unk_id)
    return files, special


# ------------------------------------------------------------------------------------------
# Export of one graph
# ------------------------------------------------------------------------------------------


def imported_generation(model_path: Path, cache_len: int) -> dict:
    """The export's generation-config defaults for a model converted from transformers (its
    ``generation_defaults.json``): ``num_beams``, transformers' length penalty ("hf" with its
    exponent) and one budget for every source, ``max_length - 1`` new tokens (at most
    ``cache_len``: ``max_len_a`` 0, ``max_len_b`` and ``max_new_tokens`` that budget), EOS
    suppressed before its least number of new tokens; {} for other models."""
    from transformer_ext.convert.generation import read_generation_defaults

    defaults = read_generation_defaults(model_path)
    if defaults is None:
        return {}
    budget = min(defaults.max_length - 1, cache_len)
    return dict(
        beam_size=defaults.num_beams,
        length_penalty="hf",
        alpha=defaults.length_penalty,
        max_len_a=0.0,
        max_len_b=float(budget),
        max_new_tokens=budget,
        min_new_tokens=min(defaults.min_new_tokens, budget),
    )


def _dummy_inputs(model, flavour: str):
    """Example inputs for tracing: 2 sources of length 5 (capped by max_len); the decoder step
    with 2 rows per source (4 rows: ``batch`` and ``sources`` differ, so neither is specialised)
    and cache length 7 (capped by max_len)."""
    c = model.config
    gen = torch.Generator().manual_seed(0)
    B = DUMMY_BATCH
    S = max(2, min(DUMMY_SRC_LEN, c.max_len))
    L = max(2, min(DUMMY_CACHE_LEN, c.max_len))
    if L == S:
        L = S + 1 if S + 1 <= c.max_len else S - 1
    src = torch.randint(4 if c.src_vocab_size > 4 else 0, c.src_vocab_size, (B, S), generator=gen)
    src_lengths = torch.tensor([S, max(1, S - 2)], dtype=torch.int64)
    encoder_args = (src, src_lengths)
    rows = 2 * B  # each source's K/V serves two rows (beams)
    shape_self = (rows, c.n_heads, L, c.d_k)
    shape_cross = (B, c.n_heads, S, c.d_k)
    kv = [torch.randn(shape_self, generator=gen) for _ in range(2 * c.n_decoder_layers)]
    kv += [torch.randn(shape_cross, generator=gen) for _ in range(2 * c.n_decoder_layers)]
    decoder_args = (
        torch.full((rows, 1), c.bos_id, dtype=torch.int64),
        torch.tensor([L - 1, 1, L - 2, 2], dtype=torch.int64),
        src_lengths.repeat_interleave(2),
        *kv,
    )
    return encoder_args, decoder_args, {"batch": B, "decoder_rows": rows, "src_len": S, "cache_len": L}


def _dynamic_shapes(spec: dict, n_positional: int):
    """``torch.onnx.export`` dynamic_shapes from a graph spec: named axes -> axis names.

    The first ``n_positional`` inputs are separate arguments, the rest the ``*kv`` tuple.
    """
    per_input = [
        {axis: dim for axis, dim in enumerate(t["shape"]) if isinstance(dim, str)} for t in spec["inputs"]
    ]
    if len(per_input) == n_positional:
        return tuple(per_input)
    return tuple(per_input[:n_positional]) + (tuple(per_input[n_positional:]),)


@contextlib.contextmanager
def _quiet_exporter():
    """Keep the exporter's progress prints and known warnings out of stdout (they go to the log)."""
    buf = io.StringIO()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*axis name.*will not be used.*")
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        # e.g. "torchvision is not installed", one INFO line per de-duplicated constant
        quiet = [logging.getLogger(name) for name in ("torch.onnx", "onnx_ir", "onnxscript")]
        levels = [q.level for q in quiet]
        for q in quiet:
            q.setLevel(logging.ERROR)
        try:
            with contextlib.redirect_stdout(buf):
                yield
        finally:
            for q, level in zip(quiet, levels):
                q.setLevel(level)
            for line in buf.getvalue().splitlines():
                if line.strip():
                    logger.debug("exporter: %s", line)


def _export_graph(
    module,
    args,
    spec: dict,
    n_positional: int,
    opset: int,
    flavour: str,
    path: Path,
    fuse_matmuls: bool = True,
    flatten_rows: bool = False,
):
    """Trace ``module`` with the dynamo exporter, fix the IR version, optionally merge the MatMuls
    that share an input (:func:`export.lowering.fuse_shared_input_matmuls`), make the per-layer
    shape reads of equally declared inputs share one (:func:`export.lowering.share_shape_reads`),
    with ``flatten_rows`` run its per-row ops on ``[rows, F]`` (:func:`export.lowering.flatten_rows`),
    check, save ``path``."""
    import onnx

    from . import lowering

    module.eval()
    t0 = time.perf_counter()
    with _quiet_exporter(), torch.no_grad():
        program = torch.onnx.export(
            module,
            args,
            dynamo=True,
            input_names=[t["name"] for t in spec["inputs"]],
            output_names=[t["name"] for t in spec["outputs"]],
            dynamic_shapes=_dynamic_shapes(spec, n_positional),
            opset_version=opset,
            custom_translation_table=lowering.translation_table(flavour),
            optimize=True,
            verbose=False,
        )
    proto = program.model_proto
    if fuse_matmuls:
        lowering.fuse_shared_input_matmuls(proto)
    lowering.share_shape_reads(proto)
    if flatten_rows:
        lowering.flatten_rows(proto)
    if proto.ir_version > IR_VERSION:
        proto.ir_version = IR_VERSION
    proto.producer_name = "transformer_ext export.onnx"
    onnx.checker.check_model(proto, full_check=True)
    if proto.ByteSize() >= 2**31 - 1:  # protobuf limit: weights go to one external file
        onnx.save_model(
            proto,
            path,
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=path.name + ".data",
        )
    else:
        onnx.save_model(proto, path)
    logger.info(
        "exported %s in %.1f s (%d nodes, %d initializers)",
        path.name,
        time.perf_counter() - t0,
        len(proto.graph.node),
        len(proto.graph.initializer),
    )
    return proto


# ------------------------------------------------------------------------------------------
# The library function
# ------------------------------------------------------------------------------------------


def _versions() -> dict:
    import onnx
    import onnxscript

    import transformer_ext

    versions = {
        "torch": torch.__version__,
        "onnx": onnx.__version__,
        "onnxscript": onnxscript.__version__,
        "transformer_ext": transformer_ext.__version__,
    }
    try:
        import onnxruntime

        versions["onnxruntime"] = onnxruntime.__version__
    except ImportError:  # pragma: no cover - onnxruntime is needed for validation only
        pass
    return versions


def _as_int(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise UsageError(f"{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise UsageError(f"{name} must be an integer, got {value!r}") from None


def _check_arguments(
    flavour: str, opset: Optional[int], cache_len: Optional[int], tolerance: float, seed: int
) -> tuple[int, Optional[int], float]:
    """``(opset, cache_len, tolerance)`` checked (cache_len against max_len later); touches nothing."""
    if flavour not in FLAVOURS:
        raise UsageError(f"flavour must be one of {FLAVOURS}, got {flavour!r}")
    opset = DEFAULT_OPSETS[flavour] if opset is None else _as_int("opset", opset)
    allowed = OPSET_RANGES[flavour]
    if opset not in allowed:
        raise UsageError(
            f"opset {opset} is not supported for the {flavour} flavour (use {allowed.start}..{allowed.stop - 1})"
        )
    if cache_len is not None:
        cache_len = _as_int("cache_len", cache_len)
        if cache_len < 1:
            raise UsageError(f"cache_len must be >= 1, got {cache_len}")
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)):
        raise UsageError(f"tolerance must be a number, got {tolerance!r}")
    if not (math.isfinite(tolerance) and tolerance > 0):
        raise UsageError(f"tolerance must be a positive finite number, got {tolerance}")
    _as_int("seed", seed)
    return opset, cache_len, float(tolerance)


def _check_quantize_options(
    quantize: Optional[str], quantize_options: Optional[Mapping[str, Any]], max_bleu_drop, gate_data
) -> Optional[float]:
    """The quantization options of :func:`export_onnx` checked before anything is read; the BLEU
    drop with the scheme's default."""
    if quantize is not None:
        from .quantize import check_quantize_arguments

        return check_quantize_arguments(quantize, quantize_options, None, max_bleu_drop)[2]
    if gate_data is not None:
        raise UsageError(
            "a BLEU gate (--gate-src / --gate-ref) checks quantized graphs: it needs --quantize int8, int4 "
            "or int8-nbits"
        )
    if quantize_options:
        raise UsageError(
            f"quantize_options {dict(quantize_options)} need --quantize (int4 or int8-nbits; few_rows: int8)"
        )
    return max_bleu_drop


def _check_quantized_model(quantize, quantize_options, max_bleu_drop, config) -> None:
    """The block size against the model's matrices (:func:`export.quantize.check_quantize_arguments`)."""
    from .quantize import check_quantize_arguments

    check_quantize_arguments(quantize, quantize_options, None, max_bleu_drop, config.to_dict())


def _check_gate(model_path: Path, tokenizer_names, config, gate_data) -> None:
    """The quality gate can run on this model and fail (gate data given where the model is not of
    the demo task, its languages and line lengths): :func:`export.quantize.check_gate_inputs`."""
    from transformer_ext.tokenizer import load_tokenizer

    from .quantize import check_gate_inputs

    tokenizer = load_tokenizer(model_path) if tokenizer_names else None
    check_gate_inputs(tokenizer, config.max_len, gate_data, model_path)


@dataclass(frozen=True)
class _Source:
    """The model folder an export reads, checked (:func:`_load_model_folder`)."""

    model: Any
    path: Path
    tokenizer_names: list[str]
    special_tokens: dict


@dataclass(frozen=True)
class _GraphOptions:
    """:func:`export_onnx`'s options of the graphs written and their validation, checked."""

    opset: int
    cache_len: int
    flavour: str
    tolerance: float
    validate: bool
    seed: int
    fuse_matmuls: bool
    fold_query_scale: bool
    flatten_rows: bool


@dataclass(frozen=True)
class _Quantization:
    """:func:`export_onnx`'s quantization options, checked; ``scheme`` None: float32."""

    scheme: Optional[str]
    gate_data: Any
    max_bleu_drop: Optional[float]
    options: Optional[Mapping[str, Any]]


def export_onnx(
    model_dir: Optional[str | os.PathLike] = None,
    output_dir: str | os.PathLike = DEFAULT_OUTPUT_DIR,
    *,
    opset: Optional[int] = None,
    cache_len: Optional[int] = None,
    flavour: str = "portable",
    tolerance: float = DEFAULT_TOLERANCE,
    validate: bool = True,
    seed: int = 0,
    fuse_matmuls: bool = True,
    fold_query_scale: bool = True,
    flatten_rows: bool = True,
    generation: Optional[Mapping[str, Any]] = None,
    quantize: Optional[str] = None,
    gate_data: Any = None,
    max_bleu_drop: Optional[float] = None,
    quantize_options: Optional[Mapping[str, Any]] = None,
    attention: bool = False,
) -> ExportResult:
    """Export ``model_dir`` (a model folder; ``None``: the bundled demo model) to ``encoder.onnx``
    + ``decoder_step.onnx`` + ``manifest.json`` + tokenizer files + ``generation.json`` in
    ``output_dir`` (created, or replaced if it holds a previous export). The options are the
    command line's of the same names (``python -m export.onnx --help``):

    * ``opset``: default 18 for ``portable`` and ``ort`` (17..21 allowed), 24 for ``tensorscatter``;
      ``cache_len``: the largest self-attention cache a runtime may allocate (the manifest's
      ``max_cache_len``; default and maximum: the model's ``max_len``).
    * ``flavour``: ``"portable"`` (the runner appends the new K/V), ``"tensorscatter"`` (the cache
      update in the graph, opset-24 ``TensorScatter``) or ``"ort"`` (each decoder self-attention
      one ``com.microsoft.GroupQueryAttention``, ONNX Runtime's CPU provider only:
      :func:`export.lowering.in_graph_gqa`) or ``"custom-op"`` (the portable I/O, each decoder
      attention one ``transformer_ext.DecodeAttention`` of the operator library built by
      ``csrc/ort/build.sh``, copied into the folder: :func:`export.lowering.in_graph_custom_attention`).
    * ``validate``: the parity validation in ONNX Runtime, inputs seeded by ``seed``, within
      ``tolerance`` of eager float64 (:func:`export.validate.allowed_difference`), before the
      folder is moved into place (structural checks always run).
    * ``fuse_matmuls``, ``fold_query_scale``, ``flatten_rows``: the graph passes
      (:func:`export.lowering.fuse_shared_input_matmuls`, :func:`folded_query_scale`,
      :func:`export.lowering.flatten_rows`); validation runs on the final graphs.
    * ``generation``: fields of the generation config to set, the others
      :meth:`GenerationConfig.defaults_for`'s.
    * ``quantize``: ``None`` (float32) or a scheme of :data:`export.quantize.SCHEMES`: the float32
      graphs are validated, then quantized and, with ``validate``, gated on the demo held-out set
      (:func:`export.quantize.quality_gate`), or with ``gate_data`` (an
      :class:`export.quantize.GateData`) on a BLEU drop of at most ``max_bleu_drop``
      (:data:`export.quantize.DEFAULT_MAX_DROPS`); ``quantize_options``: ``block_size``,
      ``accuracy_level``, ``symmetric`` (int4, int8-nbits) or ``few_rows`` (int8).
    * ``attention``: the decoder step also outputs ``attention`` ``[batch, src_len]``, the last
      decoder layer's cross-attention averaged over its heads (for ``return_attention``).

    Raises:
        ValueError: a bad option. ModelDirectoryError: ``model_dir`` is not a model folder.
        transformer_ext.tokenizer.TokenizerError: a corrupt ``tokenizer.json``, or one that
            disagrees with the config. OutputFolderError: ``output_dir`` is a file, or a folder
            neither empty nor an export holding only the files its manifest lists.
        GenerationConfigError, GraphContractError, ParityError, export.quantize.QuantizationError,
        export.quantize.QualityGateError: a bad ``generation`` field, a graph breaking the
        contract, an output beyond ``tolerance``, a bad scheme or block size, a failed gate.
        OSError: the output cannot be written, naming ``output_dir``.

    Everything but the graphs is checked before anything is written; on any failure or
    interruption the temporary folder is removed and an existing ``output_dir`` is left as it was.
    """
    t_start = time.perf_counter()
    opset, cache_len, tolerance = _check_arguments(flavour, opset, cache_len, tolerance, seed)
    max_bleu_drop = _check_quantize_options(quantize, quantize_options, max_bleu_drop, gate_data)
    output_dir = Path(output_dir).absolute()
    source, cache_len = _read_source(model_dir, output_dir, cache_len)
    config = source.model.config
    _check_flavour(source.path, config, flavour, attention)
    if flavour == CUSTOM_OP_FLAVOUR:
        custom_ops_library_source()  # built, before anything is traced
    if quantize is not None:  # the block size against the model's matrices, the gate's inputs, before tracing
        _check_quantized_model(quantize, quantize_options, max_bleu_drop, config)
        if validate:
            _check_gate(source.path, source.tokenizer_names, config, gate_data)
    generation_config = _generation_config(source, cache_len, generation)
    from . import validate as validation

    _check_switches(attention=attention, fold_query_scale=fold_query_scale, flatten_rows=flatten_rows)
    specs = graph_specs(config.to_dict(), flavour, attention)
    options = _GraphOptions(
        opset, cache_len, flavour, tolerance, validate, seed, fuse_matmuls, fold_query_scale, flatten_rows
    )
    quantization = _Quantization(quantize, gate_data, max_bleu_drop, quantize_options)
    manifest, report = _stage_export(
        output_dir, source, specs, generation_config, options, quantization, validation
    )
    seconds = time.perf_counter() - t_start
    logger.info("exported %s to %s in %.1f s", source.path, output_dir, seconds)
    return ExportResult(
        output_dir=output_dir,
        encoder_path=output_dir / ENCODER_FILE,
        decoder_path=output_dir / DECODER_FILE,
        manifest_path=output_dir / MANIFEST_NAME,
        manifest=manifest,
        validation=report,
        seconds=seconds,
    )


def _read_source(
    model_dir: Optional[str | os.PathLike], output_dir: Path, cache_len: Optional[int]
) -> tuple[_Source, int]:
    """The model folder read and checked once ``output_dir`` is known not to overlap it, and the
    cache length checked against the model (default: its ``max_len``)."""
    # None: the bundled demo model. A training run's best/, last/ and checkpoints/ are the trainer's.
    inputs = [] if model_dir is None else [("the model folder --model", model_dir)]
    check_output_path(output_dir, inputs=inputs, managed_dirs=managed_dirs(output_dir), what="--output-dir")
    check_replaceable(output_dir)
    source = _Source(*_load_model_folder(model_dir))
    config = source.model.config
    if config.max_len < 4:
        raise ExportError(
            f"max_len = {config.max_len} is too small to export (the tracing dummies need 4 positions)"
        )
    if cache_len is None:
        cache_len = config.max_len
    if not 1 <= cache_len <= config.max_len:
        raise UsageError(f"cache_len must be in [1, max_len = {config.max_len}], got {cache_len}")
    return source, cache_len


def _generation_config(
    source: _Source, cache_len: int, generation: Optional[Mapping[str, Any]]
) -> GenerationConfig:
    """The export's generation config: the defaults for the folder, then an imported model's
    (:func:`imported_generation`), then ``generation``'s fields."""
    config = source.model.config
    return GenerationConfig.defaults_for(
        {
            "special_tokens": source.special_tokens,
            "max_cache_len": cache_len,
            "model_config": config.to_dict(),
        },
        **{**imported_generation(source.path, cache_len), **dict(generation or {})},
    )


def _check_switches(**switches: Any) -> None:
    for name, value in switches.items():
        if not isinstance(value, bool):
            raise UsageError(f"{name} must be True or False, got {value!r}")


def _stage_export(
    output_dir: Path,
    source: _Source,
    specs: dict,
    generation_config: GenerationConfig,
    options: _GraphOptions,
    quantization: _Quantization,
    validation,
) -> tuple[dict, Any]:
    """Write the export in a temporary sibling of ``output_dir``, quantize it if asked, and move it
    into place; ``(manifest, validation report)``. On any failure the temporary folder and the
    parent folders made for it are removed and the error names ``output_dir``."""
    made: list[Path] = []
    try:
        make_parents(output_dir, made)
        with StagedDir(output_dir) as stage:
            manifest, report = _write_export(
                stage.path, source, specs, generation_config, options, validation=validation
            )
            if quantization.scheme is not None:
                from .quantize import quantize_folder

                manifest = quantize_folder(
                    stage.path,
                    quantization.scheme,
                    gate=options.validate,
                    gate_data=quantization.gate_data,
                    max_bleu_drop=quantization.max_bleu_drop,
                    options=quantization.options,
                )
            check_replaceable(output_dir)  # nothing of someone else's appeared there meanwhile
            stage.commit()
    except BaseException as exc:
        remove_made_parents(made)
        named = named_write_error(exc, output_dir)
        if named is not None:
            raise named from exc
        raise
    return manifest, report


def _copy_model_files(
    model_path: Path, tmp_dir: Path, tokenizer_names: list[str], generation_config: GenerationConfig
) -> Optional[str]:
    """Copy the tokenizer files, the provenance record and an imported model's generation defaults
    into the export, write its generation config; the provenance file's name, or None."""
    for name in tokenizer_names:
        shutil.copy2(model_path / name, tmp_dir / name)
    # Where the training data came from (corpus, editions, licence): every export carries it.
    provenance = PROVENANCE_FILE if (model_path / PROVENANCE_FILE).is_file() else None
    if provenance:
        shutil.copy2(model_path / provenance, tmp_dir / provenance)
    write_generation_config(tmp_dir, generation_config, GENERATION_FILE)
    # An imported model's generation defaults (banned tokens, the forced target language, the
    # forced EOS; transformer_ext.convert) travel with the export.
    if (model_path / GENERATION_DEFAULTS_FILE).is_file():
        shutil.copy2(model_path / GENERATION_DEFAULTS_FILE, tmp_dir / GENERATION_DEFAULTS_FILE)
    return provenance


def _write_export(
    tmp_dir: Path,
    source: _Source,
    specs: dict,
    generation_config: GenerationConfig,
    options: _GraphOptions,
    *,
    validation,
) -> tuple[dict, Any]:
    """Write and validate the export in the (temporary) folder ``tmp_dir``; ``(manifest, report)``."""
    model, model_path, tokenizer_names = source.model, source.path, source.tokenizer_names
    opset, cache_len, flavour = options.opset, options.cache_len, options.flavour
    fuse_matmuls, flatten_rows = options.fuse_matmuls, options.flatten_rows
    config = model.config
    attention = specs["decoder_step"]["outputs"][-1]["name"] == ATTENTION_OUTPUT
    encoder_args, decoder_args, dummy = _dummy_inputs(model, flavour)
    encoder_proto = _export_graph(
        EncoderGraph(model),
        encoder_args,
        specs["encoder"],
        2,
        opset,
        flavour,
        tmp_dir / ENCODER_FILE,
        fuse_matmuls=fuse_matmuls,
        flatten_rows=flatten_rows,
    )
    with folded_query_scale(model) if options.fold_query_scale else contextlib.nullcontext():
        decoder_proto = _export_graph(
            DecoderStepGraph(model, flavour, attention=attention),
            decoder_args,
            specs["decoder_step"],
            3,
            opset,
            flavour,
            tmp_dir / DECODER_FILE,
            fuse_matmuls=fuse_matmuls,
            flatten_rows=flatten_rows,
        )
    structure = validation.check_graphs(
        encoder_proto, decoder_proto, config, flavour, specs, tensors=validation.model_tensors(model)
    )
    weights = share_weights(tmp_dir, [ENCODER_FILE, DECODER_FILE])
    provenance = _copy_model_files(model_path, tmp_dir, tokenizer_names, generation_config)
    custom_ops = (
        _copy_custom_ops_library(tmp_dir, custom_ops_library_source())
        if flavour == CUSTOM_OP_FLAVOUR
        else None
    )
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "flavour": flavour,
        "attention": attention,
        "opset": opset,
        "ir_version": int(decoder_proto.ir_version),
        "files": folder_files(tmp_dir),
        "tokenizer_files": list(tokenizer_names),
        "generation_config": GENERATION_FILE,
        "provenance": provenance,
        "model_config": config.to_dict(),
        "special_tokens": dict(source.special_tokens),
        "max_positions": config.max_len,
        "max_cache_len": cache_len,
        "graphs": specs,
        "weights": weights,
        "versions": _versions(),
        "export": {
            "source_model_dir": str(model_path),
            "exporter": "torch.onnx.export(dynamo=True)",
            "dummy_shapes": dummy,
            "graph_passes": (["folded_query_scale"] if options.fold_query_scale else [])
            + (["fuse_shared_input_matmuls"] if fuse_matmuls else [])
            + ["share_shape_reads"]
            + (["flatten_rows"] if flatten_rows else []),
            "structure": structure,
        },
        "validation": None,
    }
    if custom_ops is not None:
        manifest["custom_ops"] = custom_ops
    write_manifest(tmp_dir, manifest)

    report = None
    if options.validate:
        report = validation.validate_export(
            tmp_dir, model, tolerance=options.tolerance, seed=options.seed, max_cache_len=cache_len
        )
        manifest["validation"] = report.to_dict()
    manifest["files"] = folder_files(tmp_dir)  # validation writes nothing there; the list stays exact
    write_manifest(tmp_dir, manifest)
    return manifest, report


# ------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m export.onnx",
        description=(
            "Export a transformer_ext model folder to ONNX (encoder.onnx, decoder_step.onnx, manifest.json), "
            "validate it in ONNX Runtime against eager PyTorch, print a parity table and a few translations "
            "decoded by ONNX Runtime. With no arguments: the bundled demo model into ./onnx_export/."
        ),
        formatter_class=DefaultsHelpFormatter,
    )
    _add_graph_arguments(p)
    _add_pass_arguments(p)
    _add_quantize_arguments(p)
    _add_generation_arguments(p)
    p.add_argument(
        "--examples",
        type=int,
        default=TRANSLATION_EXAMPLES,
        help="example sources to translate with ONNX Runtime at the end: the BLEU gate's parallel text, "
        "or the demo task's held-out numbers for the bundled demo model; other models record none (0: none)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log progress (INFO) to stderr")
    add_debug_flag(p)
    return p


def _add_graph_arguments(p: argparse.ArgumentParser) -> None:
    """The folders, the flavour and the shapes of the graphs."""
    add_option(
        p,
        "--model",
        deprecated=("--model-dir",),
        default=None,
        help="model folder (config.json, model.safetensors, tokenizer.json); default: the bundled demo model",
    )
    p.add_argument(
        "--output-dir",
        default=DEFAULT_OUTPUT_DIR,
        help="folder to write; an existing one is replaced atomically only when it is empty or an export "
        "holding nothing but the files its manifest lists, and refused otherwise",
    )
    p.add_argument(
        "--flavour",
        choices=FLAVOURS,
        default="portable",
        help="portable: standard ops only, the step outputs the new token's K/V and the runtime appends them "
        "to its cache; tensorscatter: the cache update is inside the graph (opset-24 TensorScatter), "
        "the step outputs the updated caches, bound in place by the runtime; ort: each decoder "
        "self-attention is ONNX Runtime's contrib GroupQueryAttention (appends in place and attends in one "
        "node; faster on CPUs measured in README's benchmarks; ONNX Runtime's CPU provider only, not "
        "TensorRT or Triton); custom-op: the portable step's inputs and outputs, each decoder self- and "
        "cross-attention one transformer_ext.DecodeAttention node of the operator library csrc/ort/build.sh "
        "builds, copied into the folder (ONNX Runtime's CPU provider only)",
    )
    p.add_argument(
        "--opset",
        type=int,
        default=None,
        help="ONNX opset (default: 18 for portable, ort and custom-op, allowed 17..21; 24 for tensorscatter)",
    )
    p.add_argument(
        "--attention",
        action="store_true",
        help="the decoder step also outputs 'attention' [batch, src_len] (the last decoder layer's "
        "cross-attention averaged over its heads), for translations with return_attention on ONNX Runtime",
    )
    p.add_argument(
        "--cache-len",
        type=int,
        default=None,
        help="largest self-attention cache capacity a runtime may allocate (the cache_len axis is "
        "dynamic; recorded as max_cache_len in the manifest); default: the model's max_len",
    )
    p.add_argument(
        "--tolerance",
        type=float,
        default=DEFAULT_TOLERANCE,
        help="largest difference allowed from float64 eager PyTorch (or 8x eager float32's own, if larger)",
    )


def _add_pass_arguments(p: argparse.ArgumentParser) -> None:
    """The validation and the graph passes, each on by default."""
    p.add_argument(
        "--no-validate",
        dest="validate",
        action="store_false",
        help="skip the parity validation in ONNX Runtime (structural checks still run)",
    )
    p.add_argument(
        "--no-fuse-matmuls",
        dest="fuse_matmuls",
        action="store_false",
        help="keep the traced graphs as they are instead of merging the matrix products that read the "
        "same input (Q/K/V projections) into one MatMul + Split",
    )
    p.add_argument(
        "--no-fold-query-scale",
        dest="fold_query_scale",
        action="store_false",
        help="keep the attention scale 1/sqrt(d_k) as a Mul on the decoder step's scores instead of "
        "folding it into the query projections' weights",
    )
    p.add_argument(
        "--no-flatten-rows",
        dest="flatten_rows",
        action="store_false",
        help="keep the per-row ops (projections, feed-forward, layer norms) on [batch, length, d_model] "
        "instead of [rows, d_model], where ONNX Runtime fuses each projection and its bias into a Gemm",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random validation inputs")


def _add_quantize_arguments(p: argparse.ArgumentParser) -> None:
    """``--quantize`` and its gate and MatMulNBits options (:mod:`export.quantize`)."""
    p.add_argument(
        "--quantize",
        default=None,
        metavar="SCHEME",
        help="write quantized graphs, for ONNX Runtime only, every MatMul/Gemm incl. the output projection: "
        "int8 (dynamic quantization, per-output-channel int8 weights with reduce_range), int4 (4-bit "
        "block-wise weights, com.microsoft MatMulNBits; see --quant-block-size, --quant-accuracy-level) or "
        "int8-nbits (the same with 8-bit weights); validated by a quality gate (greedy exact match on the "
        "demo held-out set at most 0.2 points below float32, or with --gate-src/--gate-ref a BLEU gate: "
        "0.5 points for int8, 1.0 for int4) instead of a logit tolerance",
    )
    from .quantize import add_gate_arguments, add_nbits_arguments

    add_gate_arguments(p)
    add_nbits_arguments(p)


# The SearchOptions fields export.onnx writes to the generation config: (field, old spellings,
# metavar), and the generation.json field each is stored under (that file keeps its format).
GENERATION_FLAGS = (
    ("beam_size", (), "N"),
    ("length_penalty", ("--alpha",), "A"),
    ("length_penalty_type", (), None),
    ("max_len_a", (), "A"),
    ("max_len_b", (), "B"),
    ("min_decoding_length", ("--min-new-tokens",), "N"),
    ("max_decoding_length", ("--max-new-tokens",), "N"),
)
_GENERATION_FIELDS = {
    "beam_size": "beam_size",
    "length_penalty": "alpha",
    "length_penalty_type": "length_penalty",
    "max_len_a": "max_len_a",
    "max_len_b": "max_len_b",
    "min_decoding_length": "min_new_tokens",
    "max_decoding_length": "max_new_tokens",
}


def _add_generation_arguments(p: argparse.ArgumentParser) -> None:
    """The fields of the export's generation config, as the decoding commands spell them."""
    g = p.add_argument_group(
        "generation config",
        f"how a deployment decodes with the export, written to {GENERATION_FILE} "
        "(defaults: the translator's)",
    )
    add_decoding_flags(
        g,
        GENERATION_FLAGS,
        source="the translator's",
        shown_defaults={"max_decoding_length": "the translator's; at most --cache-len"},
    )


def generation_from_args(args: argparse.Namespace) -> dict:
    """The generation-config fields the command line gave, under generation.json's names."""
    values = decoding_values(args, GENERATION_FLAGS)
    return {_GENERATION_FIELDS[name]: v for name, v in values.items() if v is not None}


def summary_text(result: ExportResult) -> str:
    """What was exported, and the parity table when it was validated."""
    m = result.manifest
    s = m["export"]["structure"]
    lines = [
        f"exported {m['export']['source_model_dir']} -> {result.output_dir}",
        f"  flavour {m['flavour']}, opset {m['opset']}, IR version {m['ir_version']}, "
        f"max_cache_len {m['max_cache_len']}, {result.seconds:.1f} s",
        f"  {ENCODER_FILE}: {s['encoder']['nodes']} nodes, {s['encoder']['initializer_bytes'] / 2**20:.1f} MiB "
        f"of weights; {DECODER_FILE}: {s['decoder_step']['nodes']} nodes, "
        f"{s['decoder_step']['initializer_bytes'] / 2**20:.1f} MiB of weights",
    ]
    if result.validation is None:
        lines.append("validation skipped (--no-validate)")
    else:
        lines += ["", result.validation.table()]
    return "\n".join(lines)


def translate_examples(
    result: ExportResult, n: int = TRANSLATION_EXAMPLES, examples: Optional[Sequence[tuple[str, str]]] = None
) -> list[tuple[str, str, Optional[str]]]:
    """``(source, ONNX Runtime translation, reference or None)`` for ``n`` example sources,
    decoded from the export folder alone (its graphs, tokenizer and generation config):
    ``examples`` (``(source, reference)`` pairs, e.g. the BLEU gate's parallel text) or the demo
    task's (:func:`transformer_ext.demo.heldout_examples`); empty without a tokenizer, and
    without the sources the tokenizer cannot encode."""
    import numpy as np

    from transformer_ext.decoding import max_decoding_length_for
    from transformer_ext.demo import heldout_examples
    from transformer_ext.runtimes import OrtRunner
    from transformer_ext.tokenizer import TokenizerError, load_tokenizer

    if n <= 0 or not tokenizer_files(result.manifest):
        return []
    tokenizer = load_tokenizer(result.output_dir)
    pairs, ids = [], []
    for source, reference in heldout_examples(n) if examples is None else list(examples)[:n]:
        try:
            encoded = tokenizer.encode_source(source)
        except TokenizerError:  # characters this model's tokenizer does not know: not its task
            continue
        if encoded:
            ids.append(encoded)
            pairs.append((source, reference))
    if not pairs:
        return []
    gen = read_generation_config(result.output_dir, result.manifest)
    lengths = np.array([len(x) for x in ids], dtype=np.int64)
    batch = np.full((len(ids), int(lengths.max())), tokenizer.pad_id, dtype=np.int64)
    for row, x in enumerate(ids):
        batch[row, : len(x)] = x
    runner = OrtRunner(result.output_dir, intra_op_num_threads=2)
    budget = max_decoding_length_for(lengths, gen.max_len_a, gen.max_len_b, cap=gen.max_new_tokens)
    common = dict(max_decoding_length=budget, min_decoding_length=gen.min_new_tokens)
    if gen.beam_size == 1:
        outputs = runner.greedy(batch, lengths, **common)
    else:
        hyps = runner.beam_search(
            batch,
            lengths,
            beam_size=gen.beam_size,
            length_penalty_type=gen.length_penalty,
            length_penalty=gen.alpha,
            **common,
        )
        outputs = [row[0].tokens for row in hyps]
    return [(s, tokenizer.decode_target(out), r) for (s, r), out in zip(pairs, outputs)]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line: exit code 0, 1 for an error (one line on stderr; ``--debug`` shows the
    traceback), 2 for a bad option, 130 / 143 when interrupted by SIGINT / SIGTERM."""
    parser = _parser()
    args = parser.parse_args(argv)
    check_decoding_flags(parser, args, GENERATION_FLAGS)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    return run_cli(parser.prog, lambda: _run(args), debug=args.debug)


def _run(args) -> int:
    if args.examples < 0:
        raise UsageError(f"--examples must be >= 0, got {args.examples}")
    generation = generation_from_args(args)
    from .quantize import gate_data_from_args, nbits_options_from_args

    if args.quantize is None and (args.gate_src is not None or args.gate_ref is not None):
        raise UsageError(
            "--gate-src / --gate-ref check quantized graphs: they need --quantize int8, int4 or int8-nbits"
        )
    quantize_options = nbits_options_from_args(args)
    if args.quantize is None and quantize_options.pop("few_rows", None) is not None:
        raise UsageError("--no-few-rows-graph sets what --quantize int8 writes: it needs --quantize int8")
    if args.quantize is None and quantize_options:
        raise UsageError(
            "--quant-block-size / --quant-accuracy-level / --quant-symmetric set a MatMulNBits scheme: "
            "they need --quantize int4 or int8-nbits"
        )
    gate_data = gate_data_from_args(args)  # read and checked before anything is exported
    result = export_onnx(
        args.model,
        args.output_dir,
        opset=args.opset,
        cache_len=args.cache_len,
        flavour=args.flavour,
        tolerance=args.tolerance,
        validate=args.validate,
        seed=args.seed,
        fuse_matmuls=args.fuse_matmuls,
        fold_query_scale=args.fold_query_scale,
        flatten_rows=args.flatten_rows,
        attention=args.attention,
        generation=generation,
        quantize=args.quantize,
        gate_data=gate_data,
        max_bleu_drop=args.max_bleu_drop,
        quantize_options=quantize_options,
    )
    print(summary_text(result))
    if result.manifest.get("quantization"):
        from .quantize import quantization_summary

        print(quantization_summary(result.manifest))
    gate_pairs = None if gate_data is None else list(zip(gate_data.sources, gate_data.references))
    print()
    print(examples_text(result, args.examples, gate_pairs))
    print()
    print(verdict_text(result))
    return 0


def examples_text(
    result: ExportResult, n: int, gate_pairs: Optional[Sequence[tuple[str, str]]] = None
) -> str:
    """The example translations, labelled with where their sources come from: the BLEU gate's
    parallel text, the demo task's held-out numbers (only for the bundled demo model), or none
    (a model folder records no example pairs of its own)."""
    if n <= 0:
        return "example translations: none (--examples 0)"
    if gate_pairs is not None:
        what = "BLEU gate's parallel text (--gate-src / --gate-ref)"
    elif _is_demo_export(result):
        what = "held-out numbers of the demo task (never trained on)"
    else:
        return (
            "example translations: none (the model folder records no example pairs; "
            "translate some with the command below)"
        )
    examples = translate_examples(result, n, gate_pairs)
    if not examples:
        return f"example translations: none (the tokenizer encodes none of the {what})"
    beam = read_generation_config(result.output_dir, result.manifest).beam_size
    lines = [
        f"translations decoded by ONNX Runtime ({'greedy' if beam == 1 else f'beam {beam}'}, "
        f"as {GENERATION_FILE} says), of the {what}:"
    ]
    for source, text, reference in examples:
        mark = (
            ""
            if reference is None
            else ("  (correct)" if text == reference else f"  (reference: {reference})")
        )
        lines.append(f"  {source!r} -> {text!r}{mark}")
    return "\n".join(lines)


def _is_demo_export(result: ExportResult) -> bool:
    """Whether the export is a model of the demo task: its tokenizer is the bundled demo model's
    (the English and German number-word characters)."""
    ours, demo = result.output_dir / TOKENIZER_NAME, demo_model_dir() / TOKENIZER_NAME
    try:
        return ours.read_bytes() == demo.read_bytes()
    except OSError:
        return False


def verdict_text(result: ExportResult) -> str:
    """The last lines of the command's output: the verdict, and the command to run next."""
    validation = result.validation
    if validation is None:
        verdict = "exported, not validated (--no-validate): run without it to check parity with PyTorch"
    else:
        if callable(getattr(validation, "parity_text", None)):  # export.validate.ValidationReport
            parity = validation.parity_text()
        else:
            parity = (
                f"within {validation.tolerance:.0e} of PyTorch (worst {validation.worst:.1e}), greedy and beam "
                "tokens identical"
            )
        quantized = manifest_quantization(result.manifest)
        if quantized is not None:
            # the tolerance was checked on the float32 graphs; the written quantized graphs passed the gate
            verdict = (
                f"export OK: the float32 graphs {parity}; the {quantized['scheme']} graphs written passed "
                "the quality gate above (tokens and BLEU against float32), not that tolerance"
            )
        else:
            verdict = f"export OK: every output {parity}"
    out = shlex.quote(str(result.output_dir))
    return f'{verdict}\nnext: python -m transformer_ext.translate --model {out} "SOURCE TEXT"'


if __name__ == "__main__":
    sys.exit(main())
