"""Read a local Hugging Face checkpoint folder (MarianMT, M2M100, NLLB) without transformers.

What is read: ``config.json``; the weights (``model.safetensors``, a sharded
``model.safetensors.index.json``, or ``pytorch_model.bin`` through ``torch.load(weights_only=True)``);
``generation_config.json`` (else the generation fields of ``config.json``); the tokenizer files
(Marian: ``source.spm``, ``target.spm``, ``vocab.json`` [+ ``target_vocab.json``]; M2M100:
``sentencepiece.bpe.model`` + ``vocab.json``; NLLB: ``sentencepiece.bpe.model`` and the language
codes of ``tokenizer_config.json`` or ``tokenizer.json``). Every field that changes what the model
computes is checked: a value this package cannot reproduce is an error naming the field and value.

How each family maps onto :class:`~transformer_ext.config.TransformerConfig` (each checked against
transformers' modeling code by the parity tests):

* ``marian``: Post-LN, no final LayerNorms, ``activation_function`` (swish in opus-mt), embeddings
  times sqrt(d_model) when ``scale_embedding``, sinusoidal positions from 0 with the paper's
  frequencies in sin | cos halves (``pos_layout="halves"``: the layout is a config option rather
  than a permutation of weights, because the positions are added to the embeddings before the first
  projection and a permutation would have to reorder every d_model-sized weight of the model),
  ``final_logits_bias`` as ``output_bias``, decoder start ``<pad>``.
* ``m2m_100``: Pre-LN with final encoder and decoder LayerNorms, ReLU, scaled embeddings, fairseq's
  frequencies in halves with the position of token ``t`` at row ``pad + 1 + t``
  (``pos_offset = pad_token_id + 1``); transformers' padding-aware position ids give exactly these
  rows for right-padded sources and for generated tokens, the only inputs our runners make.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from ..cli import UserError
from ..config import TransformerConfig
from ..pretrained_tokenizers import (
    M2M100_LANGUAGE_CODES,
    WMT21_LANGUAGE_CODES,
    FairseqTokenizer,
    MarianTokenizer,
)
from .generation import (
    DEFAULT_NEW_TOKENS,
    KNOWN_FIELDS,
    REFUSED_FIELDS,
    GenerationDefaults,
    refused_value,
)

logger = logging.getLogger(__name__)

__all__ = ["ConversionError", "SUPPORTED_MODEL_TYPES", "Checkpoint", "read_checkpoint"]

SUPPORTED_MODEL_TYPES = ("marian", "m2m_100")
ARCHITECTURES = {"marian": ("MarianMTModel",), "m2m_100": ("M2M100ForConditionalGeneration",)}
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "swish": "swish", "silu": "swish"}


class ConversionError(UserError, ValueError):
    """A checkpoint folder that cannot be converted (the message names the file, field or tensor)."""


@dataclass
class Checkpoint:
    """Everything read from a Hugging Face folder, in this package's terms."""

    source: Path
    model_type: str
    architecture: str
    config: TransformerConfig
    tensors: dict  # our parameter name -> float32 tensor
    tokenizer: Any
    generation: GenerationDefaults
    upcast_from: Optional[str]  # "float16" / "bfloat16" when the weights were stored so
    files: dict  # file name -> SHA-256 of every file read
    notes: list = field(default_factory=list)


# ------------------------------------------------------------------------------------------
# files
# ------------------------------------------------------------------------------------------


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _confined(path: Path, root: Optional[Path] = None) -> Path:
    """``path``, refused when it resolves (symlinks followed) outside the checkpoint folder ``root``
    (default: ``path``'s folder): a downloaded checkpoint is untrusted input, and a name such as
    ``../../x.safetensors`` in its shard index, or a symlink to a file elsewhere, must not make the
    converter read (and copy into the model folder) a file of the user's. The one exception is the
    layout of the Hugging Face cache, where ``REPO/snapshots/REV/NAME`` is a symlink into
    ``REPO/blobs/``: inside a folder named ``snapshots/REV`` the repository's ``blobs/`` counts as
    part of the checkpoint."""
    root = Path(os.path.abspath(root if root is not None else path.parent))
    real_root = Path(os.path.realpath(root))
    allowed = [real_root]
    if root.parent.name == "snapshots":
        allowed.append(Path(os.path.realpath(root.parent.parent / "blobs")))
    real = Path(os.path.realpath(os.path.abspath(path)))
    if not any(real == a or a in real.parents for a in allowed):
        raise ConversionError(
            f"{path} resolves to {real}, outside the checkpoint folder {root}; refusing to read it "
            "(every file of a checkpoint must lie inside its folder)"
        )
    return path


def _json_kind(value: Any) -> str:
    kinds = {list: "list", str: "string", bool: "boolean", int: "number", float: "number", dict: "object"}
    return kinds.get(type(value), "null")


def _read_json(path: Path, root: Optional[Path] = None) -> Any:
    try:
        with open(_confined(path, root), encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise ConversionError(f"{path} not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConversionError(f"{path} is not valid JSON: {exc}") from None


def _read_bytes(path: Path, why: str) -> bytes:
    if not path.is_file():
        raise ConversionError(f"{path} not found: {why}")
    return _confined(path).read_bytes()


class _Fields:
    """Typed reads of config.json fields, each error naming the file and the field."""

    def __init__(self, data: dict, source: Path):
        self.data, self.source = data, source

    def get(self, key: str, kind: type, default: Any = ..., *, allow_none: bool = False) -> Any:
        if key not in self.data:
            if default is ...:
                raise ConversionError(f"{self.source}: missing field {key!r}")
            return default
        value = self.data[key]
        if value is None and allow_none:
            return None
        ok = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            ok, value = True, float(value)
        if not ok:
            raise ConversionError(
                f"{self.source}: field {key!r} must be {kind.__name__}, got {value!r}"[:300]
            )
        return value

    def require(self, key: str, allowed: tuple, default: Any = ...) -> None:
        """The field is absent or holds one of ``allowed`` (a feature this package does not have)."""
        if key in self.data and self.data[key] not in allowed:
            raise ConversionError(
                f"{self.source}: unsupported architecture option {key} = {json.dumps(self.data[key])} "
                f"(supported: {', '.join(json.dumps(a) for a in allowed)})"
            )

    def same(self, a: str, b: str) -> Any:
        va, vb = self.get(a, int), self.get(b, int)
        if va != vb:
            raise ConversionError(
                f"{self.source}: {a} = {va} and {b} = {vb} differ; this package's encoder and decoder "
                "share one value"
            )
        return va


_GLOBAL = re.compile(r"GLOBAL ([A-Za-z_][\w.]*)")


def _pickle_refusal(path: Path, exc: Exception) -> str:
    """One complete line for a ``pytorch_model.bin`` that ``torch.load(weights_only=True)`` refuses.

    torch's own text runs over several lines and advises loading with ``weights_only=False``,
    which would run whatever code the file holds: the message names the callable the pickle asks
    for instead, or the first line of torch's reason for a file that is not a pickle at all."""
    text = str(exc)
    called = _GLOBAL.search(text)
    if called is not None:
        return (
            f"{path}: refused: the pickle calls {called.group(1)}, which a state dict of tensors never does "
            "(loading it would run code from the file); use the checkpoint's model.safetensors, or a "
            "pytorch_model.bin that holds tensors only"
        )
    boilerplate = ("Weights only load failed", "Please file an issue", "Check the documentation")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    reasons = [line for line in lines if not line.startswith(boilerplate)]
    reason = (reasons or lines or [type(exc).__name__])[0]
    if len(reason) > 300:
        reason = reason[:300].rsplit(" ", 1)[0] + " ..."
    if "Weights only load failed" in text:
        return (
            f"{path}: refused: the pickle holds more than tensors ({reason}), and loading it would run code "
            "from the file; use the checkpoint's model.safetensors, or a pytorch_model.bin that holds "
            "tensors only"
        )
    return f"{path} is not a readable torch state dict: {reason}"


def _load_weights(folder: Path) -> tuple[dict, str, list[Path]]:
    """``(tensors by name, file kind, files read)`` from the first weight file present."""
    import torch

    present = [name for name in WEIGHT_FILES if (folder / name).is_file()]
    if not present:
        raise ConversionError(
            f"{folder} holds no weights: expected one of {', '.join(WEIGHT_FILES)} "
            "(a transformers checkpoint "
            "folder, as save_pretrained writes it)"
        )
    name = present[0]
    if name.endswith(".index.json"):
        index_path = folder / name
        index = _read_json(index_path)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConversionError(
                f"{index_path}: no weight_map (expected a JSON object with a field weight_map that maps "
                "tensor names to shard file names)"
            )
        bad = next(((k, v) for k, v in weight_map.items() if not isinstance(v, str) or not v), None)
        if bad is not None:
            raise ConversionError(
                f"{index_path}: weight_map[{json.dumps(bad[0])[:100]}] must be a shard file name, got "
                f"{json.dumps(bad[1])[:100]}"
            )
        shards = sorted(set(weight_map.values()))
        files = [_confined(folder / s, folder) for s in shards]
    else:
        files = [_confined(folder / name, folder)]
    tensors: dict = {}
    for path in files:
        if not path.is_file():
            raise ConversionError(f"{path} not found (named by {name})")
        if path.name.endswith(".safetensors"):
            from safetensors import SafetensorError
            from safetensors.torch import load_file

            try:
                part = load_file(str(path), device="cpu")
            except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
                raise ConversionError(f"{path} is not a readable safetensors file: {exc}") from None
        else:
            try:
                part = torch.load(str(path), map_location="cpu", weights_only=True)
            except Exception as exc:  # pickle errors of many kinds: all mean "not a plain state dict"
                raise ConversionError(_pickle_refusal(path, exc)) from None
            if not isinstance(part, dict) or not all(isinstance(v, torch.Tensor) for v in part.values()):
                raise ConversionError(f"{path} does not hold a flat dict of tensors")
        overlap = set(part) & set(tensors)
        if overlap:
            raise ConversionError(f"{path}: tensors {sorted(overlap)[:5]} also appear in another shard")
        tensors.update(part)
    return tensors, name, files


# ------------------------------------------------------------------------------------------
# weight names
# ------------------------------------------------------------------------------------------

_ATTN = {"q_proj": "W_Q", "k_proj": "W_K", "v_proj": "W_V", "out_proj": "W_O"}


def _layer_map(config: TransformerConfig) -> dict[str, str]:
    """Our parameter name -> transformers' name, for the layers (shared by both families)."""
    names: dict[str, str] = {}
    for i in range(config.n_encoder_layers):
        ours, theirs = f"encoder.layers.{i}.", f"model.encoder.layers.{i}."
        for h, o in _ATTN.items():
            for p in ("weight", "bias"):
                names[f"{ours}self_attn.{o}.{p}"] = f"{theirs}self_attn.{h}.{p}"
        for p in ("weight", "bias"):
            names[f"{ours}sublayer.0.norm.{p}"] = f"{theirs}self_attn_layer_norm.{p}"
            names[f"{ours}feed_forward.w_1.{p}"] = f"{theirs}fc1.{p}"
            names[f"{ours}feed_forward.w_2.{p}"] = f"{theirs}fc2.{p}"
            names[f"{ours}sublayer.1.norm.{p}"] = f"{theirs}final_layer_norm.{p}"
    for i in range(config.n_decoder_layers):
        ours, theirs = f"decoder.layers.{i}.", f"model.decoder.layers.{i}."
        for h, o in _ATTN.items():
            for p in ("weight", "bias"):
                names[f"{ours}self_attn.{o}.{p}"] = f"{theirs}self_attn.{h}.{p}"
                names[f"{ours}src_attn.{o}.{p}"] = f"{theirs}encoder_attn.{h}.{p}"
        for p in ("weight", "bias"):
            names[f"{ours}sublayer.0.norm.{p}"] = f"{theirs}self_attn_layer_norm.{p}"
            names[f"{ours}sublayer.1.norm.{p}"] = f"{theirs}encoder_attn_layer_norm.{p}"
            names[f"{ours}feed_forward.w_1.{p}"] = f"{theirs}fc1.{p}"
            names[f"{ours}feed_forward.w_2.{p}"] = f"{theirs}fc2.{p}"
            names[f"{ours}sublayer.2.norm.{p}"] = f"{theirs}final_layer_norm.{p}"
    if config.norm_first:
        for p in ("weight", "bias"):
            names[f"encoder.norm.{p}"] = f"model.encoder.layer_norm.{p}"
            names[f"decoder.norm.{p}"] = f"model.decoder.layer_norm.{p}"
    return names


# Names transformers may store and that hold nothing we need: the sinusoidal tables (never
# trained; recomputed from the config, as transformers does).
_IGNORED = ("model.encoder.embed_positions.weight", "model.decoder.embed_positions.weight")


def _check_positions(table, config: TransformerConfig, name: str, folder: Path) -> None:
    from ..model import sinusoid_table

    rows = min(int(table.shape[0]), config.max_len) if table.dim() == 2 else 0
    ours = sinusoid_table(config.d_model, rows, config.pos_layout, config.pos_frequency, config.pos_offset)
    if (
        table.dim() != 2
        or table.shape[1] != config.d_model
        or not bool((table[:rows].float() - ours).abs().max() <= 1e-3)
    ):
        raise ConversionError(
            f"{folder}: {name} is not the sinusoidal table of this model family (the converter recomputes "
            "positions from the config, as transformers does; learned positions are not supported)"
        )


def _take(tensors: dict, aliases: list[str], what: str, folder: Path, used: set) -> Any:
    """The tensor stored under the first present name of ``aliases``; every other present alias
    (a tied copy) must be equal to it."""
    import torch

    found = [a for a in aliases if a in tensors]
    if not found:
        raise ConversionError(
            f"{folder}: the weights have no {what} (looked for {', '.join(aliases)}): missing tensors"
        )
    first = tensors[found[0]]
    for other in found[1:]:
        if tensors[other].shape != first.shape or not torch.equal(tensors[other].float(), first.float()):
            raise ConversionError(
                f"{folder}: {other} differs from {found[0]}, but the config ties them (tie_word_embeddings / "
                "share_encoder_decoder_embeddings)"
            )
    used.update(found)
    return first


def _map_weights(
    model_type: str, hf: dict, config: TransformerConfig, folder: Path, tied: dict
) -> tuple[dict, Optional[str]]:
    """Our state dict (float32) from transformers' tensors; names missing and unexpected tensors."""
    import torch

    used: set = set()
    for name in _IGNORED:  # a stored sinusoid table must be the one the config gives
        if name in hf:
            _check_positions(hf[name], config, name, folder)
            used.add(name)
    out: dict = {}
    layer_names = _layer_map(config)
    missing = sorted(t for t in layer_names.values() if t not in hf)
    if missing:
        raise ConversionError(
            f"{folder}: missing tensors {missing[:8]}{' ...' if len(missing) > 8 else ''} "
            f"({len(missing)} in all)"
        )
    for ours, theirs in layer_names.items():
        out[ours] = hf[theirs]
        used.add(theirs)
    shared = ["model.shared.weight", "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight"]
    if config.shared_vocab:
        out["src_embed.lut.weight"] = _take(hf, shared + ["lm_head.weight"], "shared embedding", folder, used)
    else:
        out["src_embed.lut.weight"] = _take(
            hf, ["model.encoder.embed_tokens.weight"], "source embedding", folder, used
        )
        tgt = ["model.decoder.embed_tokens.weight"] + (
            ["lm_head.weight"] if config.tie_target_embeddings else []
        )
        out["tgt_embed.lut.weight"] = _take(hf, tgt, "target embedding", folder, used)
        if not config.tie_target_embeddings:
            out["generator.proj.weight"] = _take(hf, ["lm_head.weight"], "output projection", folder, used)
    if model_type == "marian":
        bias = _take(hf, ["final_logits_bias"], "final_logits_bias", folder, used)
        if bias.dim() != 2 or bias.shape[0] != 1:
            raise ConversionError(
                f"{folder}: final_logits_bias has shape {tuple(bias.shape)}, expected [1, vocab]"
            )
        out["generator.proj.bias"] = bias[0]
    elif not config.tie_target_embeddings:
        out["generator.proj.bias"] = torch.zeros(config.tgt_vocab_size)  # transformers' lm_head has no bias
    unexpected = sorted(set(hf) - used)
    if unexpected:
        raise ConversionError(
            f"{folder}: unexpected tensors {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''} "
            f"({len(unexpected)} in all) for a {model_type} model with this config"
        )
    dtypes = {t.dtype for t in out.values()}
    bad = [d for d in dtypes if d not in (torch.float32, torch.float16, torch.bfloat16)]
    if bad:
        raise ConversionError(f"{folder}: weights of dtype {bad[0]} (expected float32, float16 or bfloat16)")
    upcast = None
    for d in (torch.float16, torch.bfloat16):
        if d in dtypes:
            upcast = str(d).replace("torch.", "")
    return {k: v.to(torch.float32).contiguous() for k, v in out.items()}, upcast


# ------------------------------------------------------------------------------------------
# families
# ------------------------------------------------------------------------------------------


# The most positions a converted model may have: the position table (float32 ``[positions, d_model]``,
# 256 MiB at d_model 1024) is the one tensor the converter allocates that the weights do not bound.
# The same limit as train's --max-len; released checkpoints have 512 (opus-mt) or 1024 (M2M100, NLLB).
MAX_POSITIONS = 65536


def _positions(f: _Fields) -> int:
    value = f.get("max_position_embeddings", int)
    if not 1 <= value <= MAX_POSITIONS:
        raise ConversionError(
            f"{f.source}: field 'max_position_embeddings' must be an integer in [1, {MAX_POSITIONS}], "
            f"got {value}"
        )
    return value


def _common(f: _Fields) -> dict:
    act = f.get("activation_function", str)
    if act not in ACTIVATIONS:
        raise ConversionError(
            f"{f.source}: unsupported architecture option activation_function = {json.dumps(act)} "
            f"(supported: {', '.join(ACTIVATIONS)})"
        )
    d_model = f.get("d_model", int)
    heads = f.same("encoder_attention_heads", "decoder_attention_heads")
    d_ff = f.same("encoder_ffn_dim", "decoder_ffn_dim")
    f.require("is_encoder_decoder", (True,))
    return dict(
        d_model=d_model,
        n_heads=heads,
        d_ff=d_ff,
        n_encoder_layers=f.get("encoder_layers", int),
        n_decoder_layers=f.get("decoder_layers", int),
        dropout=f.get("dropout", float, 0.1),
        max_len=_positions(f),
        activation=ACTIVATIONS[act],
        scale_embeddings=f.get("scale_embedding", bool),
        layer_norm_eps=1e-5,
        bias=True,
    )


def _marian_config(f: _Fields) -> tuple[dict, dict]:
    # BART-era fields of older Marian configs: only the values Marian uses are supported.
    f.require("normalize_before", (False,))
    f.require("add_final_layer_norm", (False,))
    f.require("normalize_embedding", (False,))
    f.require("static_position_embeddings", (True,))
    f.require("add_bias_logits", (False,))
    f.require("layernorm_embedding", (False,))
    vocab = f.get("vocab_size", int)
    shared = f.get("share_encoder_decoder_embeddings", bool, True)
    tied = f.get("tie_word_embeddings", bool, True)
    tgt_vocab = f.get("decoder_vocab_size", int, None, allow_none=True) or vocab
    if shared and tgt_vocab != vocab:
        raise ConversionError(
            f"{f.source}: share_encoder_decoder_embeddings is true but decoder_vocab_size = {tgt_vocab} "
            f"differs from vocab_size = {vocab}"
        )
    if shared and not tied:
        raise ConversionError(
            f"{f.source}: unsupported architecture option tie_word_embeddings = false with shared "
            "embeddings (share_encoder_decoder_embeddings = true)"
        )
    pad = f.get("pad_token_id", int)
    start = f.get("decoder_start_token_id", int, pad)
    values = dict(
        _common(f),
        src_vocab_size=vocab,
        tgt_vocab_size=tgt_vocab,
        shared_vocab=shared,
        tie_target_embeddings=tied,
        norm_first=False,
        pos_layout="halves",
        pos_frequency="paper",
        pos_offset=0,
        output_bias=tied,
        pad_id=pad,
        bos_id=start,
        eos_id=f.get("eos_token_id", int),
    )
    return values, dict(shared=shared)


def _m2m_config(f: _Fields) -> tuple[dict, dict]:
    vocab = f.get("vocab_size", int)
    tied = f.get("tie_word_embeddings", bool, True)
    if not tied:
        raise ConversionError(f"{f.source}: unsupported architecture option tie_word_embeddings = false")
    pad = f.get("pad_token_id", int)
    values = dict(
        _common(f),
        src_vocab_size=vocab,
        tgt_vocab_size=vocab,
        shared_vocab=True,
        tie_target_embeddings=True,
        norm_first=True,
        pos_layout="halves",
        pos_frequency="fairseq",
        pos_offset=pad + 1,
        output_bias=False,
        pad_id=pad,
        bos_id=f.get("decoder_start_token_id", int),
        eos_id=f.get("eos_token_id", int),
    )
    return values, {}


def _marian_tokenizer(folder: Path, config: TransformerConfig, files: list[Path]) -> MarianTokenizer:
    names = ["source.spm", "target.spm", "vocab.json"]
    separate = (folder / "target_vocab.json").is_file()
    tok_cfg_path = folder / "tokenizer_config.json"
    if tok_cfg_path.is_file():
        tok_cfg = _read_json(tok_cfg_path)
        files.append(tok_cfg_path)
        if isinstance(tok_cfg, dict) and "separate_vocabs" in tok_cfg:
            if bool(tok_cfg["separate_vocabs"]) != separate:
                raise ConversionError(
                    f"{tok_cfg_path}: separate_vocabs = {json.dumps(tok_cfg['separate_vocabs'])} but "
                    f"target_vocab.json is {'present' if separate else 'missing'}"
                )
    if separate:
        names.append("target_vocab.json")
    if config.shared_vocab and separate:
        raise ConversionError(
            f"{folder}: target_vocab.json is present but the config shares one vocabulary "
            "(share_encoder_decoder_embeddings = true)"
        )
    if not config.shared_vocab and not separate and config.src_vocab_size != config.tgt_vocab_size:
        raise ConversionError(
            f"{folder}: the model has separate vocabularies but there is no target_vocab.json"
        )
    blobs = {}
    for name in names:
        blobs[name] = _read_bytes(
            folder / name, "a Marian checkpoint ships source.spm, target.spm and vocab.json"
        )
        files.append(folder / name)
    try:
        tok = MarianTokenizer(
            blobs["source.spm"], blobs["target.spm"], blobs["vocab.json"], blobs.get("target_vocab.json")
        )
    except UserError as exc:
        raise ConversionError(
            f"{folder}: the tokenizer files do not make a Marian tokenizer: {exc}"
        ) from None
    return tok


def _m2m_tokenizer(folder: Path, config: TransformerConfig, files: list[Path]) -> FairseqTokenizer:
    tok_cfg_path = folder / "tokenizer_config.json"
    tok_cfg = _read_json(tok_cfg_path) if tok_cfg_path.is_file() else {}
    if tok_cfg_path.is_file():
        files.append(tok_cfg_path)
    if not isinstance(tok_cfg, dict):
        raise ConversionError(f"{tok_cfg_path}: expected a JSON object")
    cls = str(tok_cfg.get("tokenizer_class") or "")
    spm_path = folder / "sentencepiece.bpe.model"
    spm = _read_bytes(spm_path, "an M2M100 or NLLB checkpoint ships its SentencePiece model")
    files.append(spm_path)
    src, tgt = tok_cfg.get("src_lang"), tok_cfg.get("tgt_lang")
    if cls.startswith("Nllb"):
        import sentencepiece

        sp = sentencepiece.SentencePieceProcessor()
        sp.LoadFromSerializedProto(spm)
        base = int(sp.get_piece_size()) + 1  # fairseq offset 1; the languages follow the pieces
        codes = tok_cfg.get("extra_special_tokens") or tok_cfg.get("additional_special_tokens")
        languages: dict = {}
        if isinstance(codes, list) and codes:
            languages = {str(c): base + i for i, c in enumerate(codes)}
        tok_json = folder / "tokenizer.json"
        if tok_json.is_file():  # its added tokens give the ids explicitly: they must agree
            data = _read_json(tok_json)
            files.append(tok_json)
            if not isinstance(data, dict):
                raise ConversionError(
                    f"{tok_json}: expected a JSON object (a tokenizers file with a field added_tokens), got "
                    f"a JSON {_json_kind(data)}"
                )
            tokens = data.get("added_tokens") or []
            if not isinstance(tokens, list):
                raise ConversionError(f"{tok_json}: field 'added_tokens' must be a list of token objects")
            added = {t.get("content"): t.get("id") for t in tokens if isinstance(t, dict)}
            from_json = {c: i for c, i in added.items() if isinstance(c, str) and len(c) == 8 and c[3] == "_"}
            if languages and any(added.get(c) not in (None, i) for c, i in languages.items()):
                raise ConversionError(f"{tok_json}: language token ids differ from {tok_cfg_path}'s order")
            languages = languages or from_json
        if not languages:
            raise ConversionError(
                f"{folder}: no NLLB language codes found (tokenizer_config.json additional_special_tokens / "
                "extra_special_tokens, or tokenizer.json added_tokens)"
            )
        legacy = tok_cfg.get("legacy_behaviour", False)
        if not isinstance(legacy, bool):
            raise ConversionError(f"{tok_cfg_path}: legacy_behaviour must be true or false, got {legacy!r}")
        try:
            return FairseqTokenizer(
                "nllb", spm, languages, config.tgt_vocab_size, legacy=legacy, source_lang=src, target_lang=tgt
            )
        except UserError as exc:
            raise ConversionError(
                f"{folder}: the tokenizer files do not make an NLLB tokenizer: {exc}"
            ) from None
    if cls and not cls.startswith("M2M100"):
        raise ConversionError(
            f"{tok_cfg_path}: tokenizer_class {cls!r} is not supported for m2m_100 "
            "(supported: M2M100Tokenizer, "
            "NllbTokenizer)"
        )
    vocab_path = folder / "vocab.json"
    vocab = _read_bytes(vocab_path, "an M2M100 checkpoint ships vocab.json")
    files.append(vocab_path)
    lists = {"m2m100": M2M100_LANGUAGE_CODES, "wmt21": WMT21_LANGUAGE_CODES}
    which = tok_cfg.get("language_codes", "m2m100")
    if which not in lists:
        raise ConversionError(f"{tok_cfg_path}: language_codes {which!r} is not one of {sorted(lists)}")
    try:
        n_vocab = len(json.loads(vocab.decode("utf-8")))
    except (UnicodeDecodeError, json.JSONDecodeError, TypeError) as exc:
        raise ConversionError(f"{vocab_path} is not a JSON vocabulary: {exc}") from None
    languages = {c: n_vocab + i for i, c in enumerate(lists[which])}
    try:
        return FairseqTokenizer(
            "m2m100", spm, languages, config.tgt_vocab_size, vocab=vocab, source_lang=src, target_lang=tgt
        )
    except UserError as exc:
        raise ConversionError(
            f"{folder}: the tokenizer files do not make an M2M100 tokenizer: {exc}"
        ) from None


_FAMILIES: dict[str, tuple[Callable, Callable]] = {
    "marian": (_marian_config, _marian_tokenizer),
    "m2m_100": (_m2m_config, _m2m_tokenizer),
}
# Families with a module of their own (convert/t5.py, convert/mbart.py) register here at the end
# of this module: their weight mapping, and a config fix-up from the weights (e.g. untied heads).
_WEIGHT_MAPS: dict[str, Callable] = {}
_FROM_WEIGHTS: dict[str, Callable] = {}


class _GenerationFields(_Fields):
    """Typed reads of the generation fields of a checkpoint, each error naming the file and the
    field; ``vocab_size`` bounds the token ids."""

    def __init__(self, data: dict, source: Path, vocab_size: int):
        super().__init__(data, source)
        self.vocab_size = vocab_size

    def refuse(self, key: str, why: str) -> ConversionError:
        return ConversionError(
            f"{self.source}: unsupported generation option {key} = {json.dumps(self.data[key])[:200]} ({why})"
        )

    def integer(self, key: str, low: int) -> Optional[int]:
        value = self.get(key, int, None, allow_none=True)
        if value is not None and value < low:
            raise ConversionError(f"{self.source}: field {key!r} must be an integer >= {low}, got {value}")
        return value

    def number(self, key: str, default: float, *, positive: bool = False) -> float:
        value = self.get(key, float, None, allow_none=True)
        if value is None:
            return default
        if not math.isfinite(value) or (positive and value <= 0):
            wanted = "a finite number > 0" if positive else "a finite number"
            raise ConversionError(f"{self.source}: field {key!r} must be {wanted}, got {value}")
        return value

    def token(self, key: str) -> Optional[int]:
        value = self.get(key, int, None, allow_none=True)
        if value is not None and not 0 <= value < self.vocab_size:
            raise ConversionError(
                f"{self.source}: field {key!r} = {value} is not a target token id "
                f"(the vocabulary has ids 0 .. {self.vocab_size - 1})"
            )
        return value


def _generation_fields(
    folder: Path, cfg: dict, config: TransformerConfig, files: list[Path]
) -> _GenerationFields:
    """The generation fields of the checkpoint: ``generation_config.json`` (no unknown field), else
    the generation fields of ``config.json``; the fields whose values change ``generate()`` in a way
    this package does not reproduce are refused."""
    path = folder / "generation_config.json"
    if path.is_file():
        gen = _read_json(path)
        files.append(path)
        if not isinstance(gen, dict):
            raise ConversionError(f"{path}: expected a JSON object")
        unknown = sorted(k for k in gen if k not in KNOWN_FIELDS)
        if unknown:
            raise ConversionError(
                f"{path}: unknown generation option {unknown[0]} = {json.dumps(gen[unknown[0]])[:200]} "
                "(this package cannot tell whether it changes generate()'s output)"
            )
        source = path
    else:  # transformers' GenerationConfig.from_model_config: the known fields of config.json
        gen = {k: v for k, v in cfg.items() if k in KNOWN_FIELDS and v is not None}
        source = folder / "config.json"
    f = _GenerationFields(gen, source, config.tgt_vocab_size)
    for key in REFUSED_FIELDS:
        if key in f.data and refused_value(key, f.data[key]):
            raise f.refuse(key, "it changes generate()'s output and this package does not reproduce it")
    if f.get("do_sample", bool, False, allow_none=True):
        raise f.refuse("do_sample", "sampling by default; translate samples with --sampling-topk")
    return f


def _search_lengths(f: _GenerationFields, config: TransformerConfig) -> dict[str, int]:
    """``num_beams``, ``max_length`` (the decoder start token included), ``min_new_tokens`` and
    ``num_return_sequences`` as ``generate()`` resolves them."""
    num_beams = f.integer("num_beams", 1) or 1
    max_new = f.integer("max_new_tokens", 1)
    max_length = f.integer("max_length", 2)
    if max_new is not None:  # generate(): max_new_tokens wins, uncapped
        max_length = max_new + 1
    elif max_length is None:  # generate(): 20 new tokens, within max_position_embeddings
        max_length = min(DEFAULT_NEW_TOKENS + 1, config.max_len)
    min_new = f.integer("min_new_tokens", 0)
    if min_new is None:  # min_length counts the decoder start token
        min_new = max(0, (f.integer("min_length", 0) or 0) - 1)
    n_return = f.integer("num_return_sequences", 1) or 1
    if n_return > num_beams:  # generate() refuses it too
        raise f.refuse("num_return_sequences", f"more than num_beams = {num_beams}")
    return {
        "num_beams": num_beams,
        "max_length": max_length,
        "min_new_tokens": min_new,
        "num_return_sequences": n_return,
    }


def _banned_ids(f: _GenerationFields, config: TransformerConfig) -> tuple[int, ...]:
    """The single tokens of ``bad_words_ids``, without the EOS, sorted."""
    bad = f.data.get("bad_words_ids")
    if bad is None:
        return ()
    source = f.source
    if not isinstance(bad, list) or any(not isinstance(b, list) for b in bad):
        raise ConversionError(
            f"{source}: field 'bad_words_ids' must be a list of token-id lists, got {json.dumps(bad)[:200]}"
        )
    for b in bad:
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in b):
            raise ConversionError(
                f"{source}: field 'bad_words_ids' must hold token ids (integers >= 0), "
                f"got {json.dumps(b)[:200]}"
            )
        if len(b) != 1:
            raise f.refuse("bad_words_ids", "only single tokens can be banned")
    # generate() never bans the EOS this way (NoBadWordsLogitsProcessor drops it)
    return tuple(sorted({b[0] for b in bad} - {config.eos_id}))


def _special_tokens(f: _GenerationFields, config: TransformerConfig, model_type: str) -> dict[str, Any]:
    """The special ids of the generation fields checked against the model's (EOS, padding,
    decoder start); ``force_eos_at_max_length``, ``forced_first_token`` and ``early_stopping``."""
    source = f.source
    for key, ours in (("eos_token_id", config.eos_id), ("pad_token_id", config.pad_id)):
        value = f.data.get(key)
        if value not in (None, ours, [ours]):
            raise ConversionError(
                f"{source}: {key} = {json.dumps(value)[:100]} differs from config.json's {ours}"
            )
    forced_eos = f.token("forced_eos_token_id")
    if forced_eos not in (None, config.eos_id):
        raise ConversionError(
            f"{source}: forced_eos_token_id = {forced_eos} is not the eos id {config.eos_id}"
        )
    forced_bos = f.token("forced_bos_token_id")
    if forced_bos is not None and model_type in ("m2m_100", "mbart"):
        raise f.refuse(
            "forced_bos_token_id",
            "the first token of an M2M100 / NLLB / mBART-50 translation is the target language's, "
            "chosen with --target-lang",
        )
    early = f.data.get("early_stopping", False)
    if early is None:
        early = False
    if not (isinstance(early, bool) or early == "never"):
        raise ConversionError(
            f"{source}: field 'early_stopping' must be true, false or \"never\", got {json.dumps(early)[:100]}"
        )
    start = f.data.get("decoder_start_token_id")
    if start is not None and start != config.bos_id:
        raise ConversionError(
            f"{source}: decoder_start_token_id = {json.dumps(start)[:100]} differs from config.json's "
            f"{config.bos_id}"
        )
    return {
        "force_eos_at_max_length": forced_eos is not None,
        "forced_first_token": forced_bos,
        "early_stopping": early,
    }


def _generation(
    folder: Path, cfg: dict, config: TransformerConfig, model_type: str, files: list[Path]
) -> GenerationDefaults:
    """The generation defaults of the checkpoint: every field of ``generation_config.json`` (else
    the generation fields of ``config.json``, as transformers reads them) either reproduced, of
    no effect on the tokens, or refused naming it (:data:`~.generation.REPRODUCED_FIELDS`,
    :data:`~.generation.NO_EFFECT_FIELDS`, :data:`~.generation.REFUSED_FIELDS`); each value
    checked, so that no folder is written that translation would refuse."""
    f = _generation_fields(folder, cfg, config, files)
    lengths = _search_lengths(f, config)
    length_penalty = f.number("length_penalty", 1.0)
    repetition_penalty = f.number("repetition_penalty", 1.0, positive=True)
    ngram = f.integer("no_repeat_ngram_size", 0) or 0
    banned = _banned_ids(f, config)
    special = _special_tokens(f, config, model_type)
    return GenerationDefaults(
        **lengths,
        **special,
        length_penalty=length_penalty,
        banned_ids=banned,
        force_target_language=model_type in ("m2m_100", "mbart"),
        repetition_penalty=repetition_penalty,
        no_repeat_ngram_size=ngram,
        renormalize_logits=f.get("renormalize_logits", bool, False, allow_none=True) or False,
    )


def read_checkpoint(folder: str | os.PathLike) -> Checkpoint:
    """Read and check a transformers checkpoint folder (see the module docstring); writes nothing."""
    folder = Path(folder)
    if not folder.exists():
        raise ConversionError(f"checkpoint folder not found: {folder}")
    if not folder.is_dir():
        raise ConversionError(f"{folder} is not a folder (expected a transformers checkpoint folder)")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ConversionError(f"{folder} is not a transformers checkpoint folder: it has no config.json")
    cfg = _read_json(config_path)
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        raise ConversionError(f"{config_path} is not a transformers model config (no model_type field)")
    model_type = cfg["model_type"]
    if model_type not in _FAMILIES:
        raise ConversionError(
            f"{config_path}: model type {model_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    archs = cfg.get("architectures") or list(ARCHITECTURES[model_type][:1])
    if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in ARCHITECTURES[model_type]:
        raise ConversionError(
            f"{config_path}: architectures = {json.dumps(archs)}; a {model_type} translation model is "
            f"{' or '.join(ARCHITECTURES[model_type])}"
        )
    make_config, make_tokenizer = _FAMILIES[model_type]
    fields = _Fields(cfg, config_path)
    values, extra = make_config(fields)
    try:
        config = TransformerConfig(**values)
    except (TypeError, ValueError) as exc:
        raise ConversionError(
            f"{config_path}: the model cannot be expressed as a transformer_ext config: {exc}"
        ) from None
    files: list[Path] = [config_path]
    hf_tensors, kind, weight_files = _load_weights(folder)
    files.extend(weight_files)
    config = _FROM_WEIGHTS.get(model_type, lambda c, t: c)(config, hf_tensors)
    tensors, upcast = _WEIGHT_MAPS.get(model_type, _map_weights)(
        model_type, hf_tensors, config, folder, extra
    )
    tokenizer = make_tokenizer(folder, config, files)
    for key, ours in (
        ("vocab_size (source)", tokenizer.src_vocab_size),
        ("vocab_size (target)", tokenizer.tgt_vocab_size),
    ):
        theirs = config.src_vocab_size if "source" in key else config.tgt_vocab_size
        if ours != theirs:
            raise ConversionError(
                f"{folder}: the tokenizer has a vocabulary of {ours} tokens but config.json's "
                f"{key} is {theirs}"
            )
    for key in ("pad", "bos", "eos"):
        ours, theirs = getattr(tokenizer, f"{key}_id"), getattr(config, f"{key}_id")
        if ours != theirs:
            what = {"bos": "decoder_start_token_id"}.get(key, f"{key}_token_id")
            raise ConversionError(
                f"{folder}: the tokenizer's {key} id is {ours} but config.json's {what} is {theirs}"
            )
    generation = _generation(folder, cfg, config, model_type, files)
    for i in generation.banned_ids:
        if not 0 <= i < config.tgt_vocab_size:
            raise ConversionError(
                f"{folder}: banned token {i} is outside the vocabulary [0, {config.tgt_vocab_size})"
            )
    notes = []
    for key in ("attention_dropout", "activation_dropout"):
        if fields.data.get(key) not in (None, 0, 0.0, config.dropout):
            notes.append(
                f"{key} = {fields.data[key]} is not reproduced in training: this package applies dropout = "
                f"{config.dropout} to attention probabilities and sublayer outputs alike"
            )
    for key in ("encoder_layerdrop", "decoder_layerdrop"):
        if fields.data.get(key) not in (None, 0, 0.0):
            notes.append(f"{key} = {fields.data[key]} (LayerDrop) is not used in fine-tuning")
    return Checkpoint(
        source=folder.resolve(),
        model_type=model_type,
        architecture=archs[0],
        config=config,
        tensors=tensors,
        tokenizer=tokenizer,
        generation=generation,
        upcast_from=upcast,
        files={str(p.relative_to(folder)): _sha256_file(p) for p in dict.fromkeys(files)},
        notes=notes,
    )


def _register_families() -> None:
    from functools import partial

    from . import mbart, t5

    _FAMILIES["mbart"] = (mbart.mbart_config, mbart.mbart_tokenizer)
    _WEIGHT_MAPS["mbart"] = mbart.mbart_weights
    ARCHITECTURES.update(mbart.MODEL_TYPES)
    for model_type, archs in t5.MODEL_TYPES.items():
        _FAMILIES[model_type] = (partial(t5.t5_config, model_type=model_type), t5.t5_tokenizer)
        _WEIGHT_MAPS[model_type] = t5.t5_weights
        _FROM_WEIGHTS[model_type] = t5.retie
        ARCHITECTURES[model_type] = archs
    global SUPPORTED_MODEL_TYPES
    SUPPORTED_MODEL_TYPES = tuple(_FAMILIES)


_register_families()
