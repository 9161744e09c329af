"""The single source of hyper-parameters of the Transformer, and the config.json contract.

``TransformerConfig`` is a plain dataclass (no torch import) so that it can be read by the
ONNX Runtime runner, the exporter's manifest writer and the checkpoint loader alike. It is
validated on construction: an inconsistent configuration raises ``ValueError`` (or
``TypeError`` for a value of the wrong type) before any model is built.

A config.json (and the ``model_config`` of an export manifest) is versioned: ``format_version``
(:data:`CONFIG_FORMAT_VERSION`, now 1) and then every field, all of them required, because
tensor shapes and the semantics depend on each (docs/DESIGN.md section 5). A missing key, an unknown
key or a value of the wrong JSON type is a :class:`ConfigError` that names the key and the file;
files without ``format_version`` (the form written before versioning) are migrated explicitly by
:func:`migrate_config`, never completed with defaults. The dataclass defaults serve code that
builds a config in Python (``TransformerConfig(d_model=256)``, :meth:`TransformerConfig.preset`).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import math
import os
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from .cli import UserError

logger = logging.getLogger(__name__)

__all__ = [
    "TransformerConfig",
    "PRESETS",
    "ConfigError",
    "CONFIG_FORMAT_VERSION",
    "V1_FIELDS",
    "V2_FIELDS",
    "ACTIVATIONS",
    "POS_LAYOUTS",
    "POS_FREQUENCIES",
    "NORMS",
    "POSITIONS",
    "V3_FIELDS",
    "migrate_config",
]

# Version of the config.json form (and of a manifest's model_config); see migrate_config.
CONFIG_FORMAT_VERSION = 3

# Values of the string-valued fields (checked strictly, like every field).
# FFN nonlinearity; gelu is the exact (erf) form, gelu_tanh its tanh approximation (T5's gelu_new)
ACTIVATIONS = ("relu", "gelu", "swish", "gelu_tanh")
NORMS = ("layer", "rms")  # LayerNorm (mean, variance, scale and shift) or RMSNorm (T5: scale only)
POSITIONS = ("sinusoidal", "learned", "none")  # absolute positions added to the embeddings
POS_LAYOUTS = ("interleaved", "halves")  # sin/cos in alternating dimensions, or sin | cos halves
POS_FREQUENCIES = ("paper", "fairseq")  # 10000^(-2i/d_model), or exp(-i * ln(10000) / (d_model/2 - 1))


# Named starting points; ``TransformerConfig.preset(name, **overrides)`` builds one.
PRESETS: dict[str, dict[str, Any]] = {
    # The paper's base model ("Attention Is All You Need", Table 3), with the 8000-token source
    # and target vocabularies used by the decode benchmarks (docs/DESIGN.md section 4).
    "base": dict(
        src_vocab_size=8000,
        tgt_vocab_size=8000,
        d_model=512,
        n_heads=8,
        n_encoder_layers=6,
        n_decoder_layers=6,
        d_ff=2048,
        dropout=0.1,
    ),
    # A small model of the size of a demo: trains on a laptop, still has every component.
    "small": dict(
        src_vocab_size=8000,
        tgt_vocab_size=8000,
        d_model=256,
        n_heads=4,
        n_encoder_layers=3,
        n_decoder_layers=3,
        d_ff=1024,
        dropout=0.1,
    ),
    # The bundled demo translator (python -m transformer_ext.train's default): Post-LN as in the
    # paper, 3+3 layers, small enough to train on one CPU core in minutes. No dropout: the task is
    # noise-free, every training example is exact, and on the CPU dropout's random numbers cost a
    # quarter to a third of a training step.
    "demo": dict(
        src_vocab_size=8000,
        tgt_vocab_size=8000,
        d_model=64,
        n_heads=4,
        n_encoder_layers=3,
        n_decoder_layers=3,
        d_ff=256,
        dropout=0.0,
        max_len=64,
        norm_first=False,
    ),
    # For tests: every code path, milliseconds per forward pass.
    "tiny": dict(
        src_vocab_size=48,
        tgt_vocab_size=40,
        d_model=32,
        n_heads=4,
        n_encoder_layers=2,
        n_decoder_layers=2,
        d_ff=64,
        dropout=0.1,
        max_len=64,
    ),
}


@dataclass
class TransformerConfig:
    """Hyper-parameters of the encoder-decoder Transformer (defaults: the paper's base model)."""

    src_vocab_size: int = 8000  # rows of the source embedding (tokenizer's source vocabulary)
    tgt_vocab_size: int = 8000  # rows of the target embedding and width of the output logits
    d_model: int = 512  # width of every residual stream (paper: 512)
    n_heads: int = 8  # attention heads; d_k = d_model / n_heads (paper: 8, so d_k = 64)
    n_encoder_layers: int = 6  # encoder stack depth N (paper: 6)
    n_decoder_layers: int = 6  # decoder stack depth N (paper: 6)
    d_ff: int = 2048  # inner width of the position-wise feed-forward network (paper: 2048)
    dropout: float = 0.1  # P_drop on sublayer outputs, embeddings+positions, attention probs
    max_len: int = 256  # positional-encoding rows: the longest source or target, in tokens
    norm_first: bool = False  # False: Post-LN as in the paper; True: Pre-LN + final LayerNorms
    layer_norm_eps: float = 1e-5  # epsilon of every LayerNorm (torch's default)
    bias: bool = True  # biases in the attention projections and feed-forward layers (paper: yes)
    tie_target_embeddings: bool = True  # output projection weight = target embedding (paper 3.4)
    shared_vocab: bool = False  # one vocabulary: source emb, target emb and projection all tied
    pad_id: int = 0  # padding token of sources and targets (ignored by the loss)
    bos_id: int = 1  # first decoder input of every target ("shifted right"): the decoder start id
    eos_id: int = 2  # ends a target; decoding stops when it is generated
    activation: str = "relu"  # FFN nonlinearity (ACTIVATIONS): relu (paper), gelu, swish (opus-mt)
    scale_embeddings: bool = True  # token embeddings times sqrt(d_model) (paper 3.4)
    pos_layout: str = "interleaved"  # POS_LAYOUTS: interleaved (paper) or halves (Marian, fairseq)
    pos_frequency: str = "paper"  # POS_FREQUENCIES: the paper's (and Marian's) or fairseq's (M2M100)
    pos_offset: int = 0  # positional-table row of position 0 (fairseq: 2, its padding offset)
    output_bias: bool = False  # a bias on the logits of a tied projection (Marian's final_logits_bias)
    norm: str = "layer"  # NORMS: LayerNorm, or RMSNorm without mean or shift (T5)
    scale_attention: bool = True  # scores times 1/sqrt(d_kv) (paper); False: unscaled (T5)
    d_kv: int = 0  # width of one attention head; 0: d_model / n_heads (T5 sets its own)
    relative_attention_buckets: int = 0  # T5's relative position bias: bucket count (0: none)
    relative_attention_max_distance: int = 128  # distances from here on share the last bucket
    relative_attention_per_layer: bool = False  # one bias table per layer (UMT5) or one per stack (T5)
    positions: str = "sinusoidal"  # POSITIONS: sinusoidal table, learned table (mBART), none (T5)
    gated_ffn: bool = False  # FFN(x) = (act(x W_1) * x W_3) W_2 (T5 v1.1 gated GELU)
    scale_decoder_output: bool = False  # decoder output times d_model^-0.5 before the projection (T5)
    embedding_norm: bool = False  # a norm after embeddings + positions, before dropout (mBART)

    _INT_FIELDS: ClassVar[tuple[str, ...]] = (
        "src_vocab_size",
        "tgt_vocab_size",
        "d_model",
        "n_heads",
        "n_encoder_layers",
        "n_decoder_layers",
        "d_ff",
        "max_len",
        "pad_id",
        "bos_id",
        "eos_id",
        "pos_offset",
        "d_kv",
        "relative_attention_buckets",
        "relative_attention_max_distance",
    )
    _FLOAT_FIELDS: ClassVar[tuple[str, ...]] = ("dropout", "layer_norm_eps")
    _BOOL_FIELDS: ClassVar[tuple[str, ...]] = (
        "norm_first",
        "bias",
        "tie_target_embeddings",
        "shared_vocab",
        "scale_embeddings",
        "output_bias",
        "scale_attention",
        "relative_attention_per_layer",
        "gated_ffn",
        "scale_decoder_output",
        "embedding_norm",
    )
    # field -> its allowed values
    _STR_FIELDS: ClassVar[dict[str, tuple[str, ...]]] = {
        "activation": ACTIVATIONS,
        "pos_layout": POS_LAYOUTS,
        "pos_frequency": POS_FREQUENCIES,
        "norm": NORMS,
        "positions": POSITIONS,
    }

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ derived values

    @property
    def d_k(self) -> int:
        """Width of one attention head: ``d_kv``, or the paper's d_k = d_v = d_model / h when it is 0."""
        return self.d_kv if self.d_kv else self.d_model // self.n_heads

    @property
    def d_attention(self) -> int:
        """Width of the concatenated heads (the rows of W_Q, W_K, W_V): ``n_heads * d_k``."""
        return self.n_heads * self.d_k

    # ------------------------------------------------------------------ validation

    def validate(self) -> None:
        """Raise ``TypeError``/``ValueError`` with a clear message if the config is inconsistent."""
        for name in self._INT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"TransformerConfig.{name} must be an int, got {value!r}")
        for name in self._FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"TransformerConfig.{name} must be a float, got {value!r}")
            setattr(self, name, float(value))
        for name in self._BOOL_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"TransformerConfig.{name} must be a bool, got {value!r}")
        for name, allowed in self._STR_FIELDS.items():
            value = getattr(self, name)
            if not isinstance(value, str):
                raise TypeError(f"TransformerConfig.{name} must be a string, got {value!r}")
            if value not in allowed:
                raise ValueError(f"TransformerConfig.{name} must be one of {list(allowed)}, got {value!r}")
        if self.pos_offset < 0:
            raise ValueError(f"pos_offset must be >= 0, got {self.pos_offset}")
        if self.pos_frequency == "fairseq" and self.positions == "sinusoidal" and self.d_model < 4:
            raise ValueError(
                f"pos_frequency 'fairseq' divides by d_model/2 - 1: it needs d_model >= 4, got {self.d_model}"
            )
        if self.output_bias and not self.tie_target_embeddings:
            raise ValueError(
                "output_bias=True adds a bias to the tied output projection; an untied projection has "
                "its own bias (the 'bias' field): set tie_target_embeddings=True or output_bias=False"
            )

        for name in (
            "src_vocab_size",
            "tgt_vocab_size",
            "d_model",
            "n_heads",
            "n_encoder_layers",
            "n_decoder_layers",
            "d_ff",
            "max_len",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"TransformerConfig.{name} must be positive, got {getattr(self, name)}")
        self._validate_architecture()
        if self.d_kv == 0 and self.d_model % self.n_heads != 0:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads}); "
                f"e.g. n_heads={_divisor_hint(self.d_model, self.n_heads)}"
            )
        if self.positions == "sinusoidal" and self.d_model % 2 != 0:
            raise ValueError(
                f"d_model must be even (sin/cos pairs of the positional encoding), got {self.d_model}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if not (self.layer_norm_eps > 0.0 and math.isfinite(self.layer_norm_eps)):
            raise ValueError(f"layer_norm_eps must be a positive finite number, got {self.layer_norm_eps}")

        for name in ("pad_id", "bos_id", "eos_id"):
            value = getattr(self, name)
            if not 0 <= value < self.tgt_vocab_size:
                raise ValueError(
                    f"{name} = {value} is outside the target vocabulary [0, {self.tgt_vocab_size})"
                )
        if not 0 <= self.pad_id < self.src_vocab_size:
            raise ValueError(
                f"pad_id = {self.pad_id} is outside the source vocabulary [0, {self.src_vocab_size}) "
                "(sources are right-padded with it)"
            )
        # bos_id is the decoder's first input. It may be the padding token (Marian starts from
        # <pad>) or the end token (fairseq models start from </s>), but pad and eos must differ.
        if self.pad_id == self.eos_id:
            raise ValueError(
                "pad_id and eos_id must be distinct, got "
                f"pad_id={self.pad_id}, bos_id={self.bos_id}, eos_id={self.eos_id}"
            )
        if self.shared_vocab:
            if self.src_vocab_size != self.tgt_vocab_size:
                raise ValueError(
                    "shared_vocab=True ties the source and target embeddings, so src_vocab_size "
                    f"({self.src_vocab_size}) must equal tgt_vocab_size ({self.tgt_vocab_size})"
                )
            if not self.tie_target_embeddings:
                raise ValueError(
                    "shared_vocab=True ties source embedding, target embedding and output "
                    "projection; it requires tie_target_embeddings=True"
                )

    def _validate_architecture(self) -> None:
        """The head width and the relative position bias (the T5 options)."""
        if self.d_kv < 0:
            raise ValueError(f"d_kv must be >= 0 (0: d_model / n_heads), got {self.d_kv}")
        if self.relative_attention_buckets < 0:
            raise ValueError(
                f"relative_attention_buckets must be >= 0 (0: no relative bias), got {self.relative_attention_buckets}"
            )
        if self.relative_attention_buckets:
            if self.relative_attention_buckets < 4 or self.relative_attention_buckets % 2:
                raise ValueError(
                    "relative_attention_buckets must be an even number >= 4 (half of them per direction in the "
                    f"encoder, half of those exact), got {self.relative_attention_buckets}"
                )
            if self.relative_attention_max_distance <= self.relative_attention_buckets // 4:
                raise ValueError(
                    f"relative_attention_max_distance ({self.relative_attention_max_distance}) must exceed "
                    f"relative_attention_buckets / 4 ({self.relative_attention_buckets // 4}), the exact buckets"
                )
        elif self.relative_attention_per_layer:
            raise ValueError("relative_attention_per_layer=True needs relative_attention_buckets > 0")

    # ------------------------------------------------------------------ (de)serialisation

    def to_dict(self) -> dict[str, Any]:
        """The content of config.json: ``format_version`` first, then every field.

        Export manifests embed this dict as their ``model_config``, so it carries the version too.
        """
        return {"format_version": CONFIG_FORMAT_VERSION, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, data: Any, source: str = "the model config") -> "TransformerConfig":
        """Build a config from a dict in the config.json form (see :func:`migrate_config`).

        Every field is required, unknown keys and values of the wrong JSON type are errors
        (:class:`ConfigError`, naming the key and ``source``, e.g. the file the dict came from).
        A dict without ``format_version`` is the form written before versioning and is migrated.
        """
        data = migrate_config(data, source)
        values = {name: data[name] for name in _field_names()}
        try:
            return cls(**values)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{source}: {exc}") from exc

    def save_json(self, path: str | os.PathLike) -> None:
        """Write the config as indented JSON, atomically (see :mod:`transformer_ext.fsutil`)."""
        from .fsutil import atomic_write_json

        atomic_write_json(path, self.to_dict())

    @classmethod
    def load_json(cls, path: str | os.PathLike) -> "TransformerConfig":
        """Read a config.json; every error (unreadable, not UTF-8, not JSON, a bad key) names the file."""
        path = os.fspath(path)
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, "config file not found", path) from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"{path} is not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); "
                "a config.json is UTF-8 JSON"
            ) from None
        try:
            data = json.loads(text, object_pairs_hook=_no_duplicate_keys)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path} is not valid JSON: {exc}") from None
        except _DuplicateKey as exc:
            raise ConfigError(f"{path}: key {exc.args[0]!r} appears more than once") from None
        return cls.from_dict(data, source=path)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "TransformerConfig":
        """A named configuration from :data:`PRESETS`, with keyword overrides (the other fields: defaults)."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; available: {sorted(PRESETS)}")
        unknown = sorted(set(overrides) - set(_field_names()))
        if unknown:
            raise ValueError(
                f"unknown TransformerConfig fields {unknown}; the fields are {list(_field_names())}"
            )
        return cls(**{**PRESETS[name], **overrides})


# ---------------------------------------------------------------------- the config.json contract
class ConfigError(UserError, ValueError):
    """A model config (a config.json, or a manifest's ``model_config``) that cannot be read as one."""


class _DuplicateKey(Exception):
    pass


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise _DuplicateKey(key)
        seen[key] = value
    return seen


def _field_names() -> tuple[str, ...]:
    return tuple(f.name for f in fields(TransformerConfig))


# The fields of format_version 1, in the order config.json lists them. A later version that adds a
# field appends it to its own tuple, bumps CONFIG_FORMAT_VERSION and adds a migration step below.
V1_FIELDS: tuple[str, ...] = (
    "src_vocab_size",
    "tgt_vocab_size",
    "d_model",
    "n_heads",
    "n_encoder_layers",
    "n_decoder_layers",
    "d_ff",
    "dropout",
    "max_len",
    "norm_first",
    "layer_norm_eps",
    "bias",
    "tie_target_embeddings",
    "shared_vocab",
    "pad_id",
    "bos_id",
    "eos_id",
)
# format_version 2 adds what imported model families need (docs/DESIGN.md section 7). A version-1 file
# was written when each of them was fixed at the value V1_IMPLIED lists: migration sets exactly that.
V1_IMPLIED: dict[str, Any] = {
    "activation": "relu",
    "scale_embeddings": True,
    "pos_layout": "interleaved",
    "pos_frequency": "paper",
    "pos_offset": 0,
    "output_bias": False,
}
V2_FIELDS: tuple[str, ...] = V1_FIELDS + tuple(V1_IMPLIED)
# format_version 3 adds the T5 and mBART architecture options; a version-2 (or older) file was written
# when each was fixed at the value V2_IMPLIED lists (the dataclass defaults).
V2_IMPLIED: dict[str, Any] = {
    "norm": "layer",
    "scale_attention": True,
    "d_kv": 0,
    "relative_attention_buckets": 0,
    "relative_attention_max_distance": 128,
    "relative_attention_per_layer": False,
    "positions": "sinusoidal",
    "gated_ffn": False,
    "scale_decoder_output": False,
    "embedding_norm": False,
}
V3_FIELDS: tuple[str, ...] = V2_FIELDS + tuple(V2_IMPLIED)
# What the writer before format_version always wrote (dataclasses.asdict of the config of that
# time): the same seventeen fields, without the version key.
UNVERSIONED_FIELDS: tuple[str, ...] = V1_FIELDS

_JSON_TYPES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _field_type(name: str) -> type:
    if name in TransformerConfig._INT_FIELDS:
        return int
    if name in TransformerConfig._FLOAT_FIELDS:
        return float
    if name in TransformerConfig._STR_FIELDS:
        return str
    return bool


def _check_keys(data: dict, required: tuple[str, ...], source: str, form: str) -> None:
    missing = [k for k in required if k not in data]
    if missing:
        keys = ", ".join(repr(k) for k in missing)
        raise ConfigError(
            f"{source}: missing key{'s' if len(missing) > 1 else ''} {keys}; {form} must hold every field: "
            f"{', '.join(required)}"
        )
    unknown = sorted(k for k in data if k not in required and k != "format_version")
    if unknown:
        keys = ", ".join(repr(k) for k in unknown)
        raise ConfigError(
            f"{source}: unknown key{'s' if len(unknown) > 1 else ''} {keys}; {form} has the keys "
            f"{', '.join(required)}"
        )


def _check_types(data: dict, names: tuple[str, ...], source: str) -> None:
    for name in names:
        value, kind = data[name], _field_type(name)
        if kind is str:
            ok = isinstance(value, str)
        elif kind is bool:
            ok = isinstance(value, bool)
        elif kind is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        else:  # a JSON number; an integer such as 0 is exact
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok:
            raise ConfigError(
                f"{source}: key {name!r} must be {_JSON_TYPES[kind]}, got {json.dumps(value)} "
                f"({type(value).__name__})"
            )


def migrate_config(data: Any, source: str = "the model config") -> dict[str, Any]:
    """``data`` (a config dict of any supported version) in the current form, checked.

    * ``format_version`` 3 (the current one): every field of :data:`V3_FIELDS` required, no
      other key, integers as JSON integers (``true`` or ``32.0`` is not an integer), floats as
      JSON numbers, booleans as ``true``/``false``, strings as strings.
    * ``format_version`` 2: the fields of :data:`V2_FIELDS`, checked the same way; the fields
      version 3 added get the values version 2 implied (:data:`V2_IMPLIED`).
    * ``format_version`` 1: the fields of :data:`V1_FIELDS`, checked the same way; the fields
      versions 2 and 3 added get the values version 1 implied (:data:`V1_IMPLIED`, :data:`V2_IMPLIED`).
    * No ``format_version``: the form written before versioning (config.json files, and the
      ``model_config`` of export manifests, of earlier transformer_ext versions). That writer
      always wrote every field of :data:`UNVERSIONED_FIELDS`, so the same fields are required
      (a missing one is an error, not a default); it is then read as version 1.
    * Any other version: an error (a newer version says to upgrade transformer_ext).

    Errors are :class:`ConfigError` naming the key and ``source``. Only keys and types are
    checked here; value ranges are checked by :class:`TransformerConfig` itself.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: a model config is a JSON object, got {type(data).__name__}")
    if "format_version" not in data:
        _check_keys(
            data, UNVERSIONED_FIELDS, source, "a config without format_version (written before versioning)"
        )
        data = {"format_version": 1, **{k: data[k] for k in UNVERSIONED_FIELDS}}
    version = data["format_version"]
    if isinstance(version, bool) or not isinstance(version, int):
        raise ConfigError(f"{source}: key 'format_version' must be an integer, got {json.dumps(version)}")
    if version > CONFIG_FORMAT_VERSION:
        raise ConfigError(
            f"{source}: format_version {version} was written by a newer transformer_ext; this version reads "
            f"format_version {CONFIG_FORMAT_VERSION} and older: upgrade transformer_ext"
        )
    if version < 1:
        raise ConfigError(
            f"{source}: unsupported format_version {version} (supported: 1..{CONFIG_FORMAT_VERSION})"
        )
    if version == 1:
        _check_keys(data, V1_FIELDS, source, "a config of format_version 1")
        _check_types(data, V1_FIELDS, source)
        data = {**{k: data[k] for k in V1_FIELDS}, **V1_IMPLIED, **V2_IMPLIED}
    elif version == 2:
        _check_keys(data, V2_FIELDS, source, "a config of format_version 2")
        _check_types(data, V2_FIELDS, source)
        data = {**{k: data[k] for k in V2_FIELDS}, **V2_IMPLIED}
    else:
        _check_keys(data, V3_FIELDS, source, "a config of format_version 3")
        _check_types(data, V3_FIELDS, source)
    return {"format_version": CONFIG_FORMAT_VERSION, **{k: data[k] for k in V3_FIELDS}}


def _divisor_hint(d_model: int, n_heads: int) -> int:
    """The divisor of d_model closest to n_heads, for the error message."""
    divisors = [h for h in range(1, d_model + 1) if d_model % h == 0]
    return min(divisors, key=lambda h: (abs(h - n_heads), h))
