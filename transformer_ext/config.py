"""The single source of hyper-parameters of the Transformer.

``TransformerConfig`` is a plain dataclass (no torch import) so that it can be read by the
ONNX Runtime runner, the exporter's manifest writer and the checkpoint loader alike. It is
validated on construction: an inconsistent configuration raises ``ValueError`` (or
``TypeError`` for a value of the wrong type) before any model is built.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from dataclasses import dataclass, fields
from typing import Any, ClassVar

logger = logging.getLogger(__name__)

__all__ = ["TransformerConfig", "PRESETS"]


# Named starting points; ``TransformerConfig.preset(name, **overrides)`` builds one.
PRESETS: dict[str, dict[str, Any]] = {
    # The paper's base model ("Attention Is All You Need", Table 3), with the 8000-token source
    # and target vocabularies used by the decode benchmarks (DESIGN.md section 4).
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
    bos_id: int = 1  # first decoder input of every target ("shifted right")
    eos_id: int = 2  # ends a target; decoding stops when it is generated

    _INT_FIELDS: ClassVar[tuple[str, ...]] = (
        "src_vocab_size", "tgt_vocab_size", "d_model", "n_heads", "n_encoder_layers",
        "n_decoder_layers", "d_ff", "max_len", "pad_id", "bos_id", "eos_id",
    )
    _FLOAT_FIELDS: ClassVar[tuple[str, ...]] = ("dropout", "layer_norm_eps")
    _BOOL_FIELDS: ClassVar[tuple[str, ...]] = (
        "norm_first", "bias", "tie_target_embeddings", "shared_vocab",
    )

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ derived values

    @property
    def d_k(self) -> int:
        """Width of one attention head (the paper's d_k = d_v = d_model / h)."""
        return self.d_model // self.n_heads

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

        for name in ("src_vocab_size", "tgt_vocab_size", "d_model", "n_heads",
                     "n_encoder_layers", "n_decoder_layers", "d_ff", "max_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"TransformerConfig.{name} must be positive, got {getattr(self, name)}")
        if self.d_model % self.n_heads != 0:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads}); "
                f"e.g. n_heads={_divisor_hint(self.d_model, self.n_heads)}"
            )
        if self.d_model % 2 != 0:
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
        if len({self.pad_id, self.bos_id, self.eos_id}) != 3:
            raise ValueError(
                "pad_id, bos_id and eos_id must be distinct, got "
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

    # ------------------------------------------------------------------ (de)serialisation

    def to_dict(self) -> dict[str, Any]:
        """Every field as a JSON-compatible dict (the content of config.json)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TransformerConfig":
        """Build a config from ``data``; unknown keys are an error (a typo must not pass silently)."""
        if not isinstance(data, dict):
            raise TypeError(f"a config must be a dict, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"unknown TransformerConfig keys {unknown}; known keys are {sorted(known)}"
            )
        return cls(**data)

    def save_json(self, path: str | os.PathLike) -> None:
        """Write the config as indented JSON (atomically: temp file, then rename)."""
        path = os.fspath(path)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)

    @classmethod
    def load_json(cls, path: str | os.PathLike) -> "TransformerConfig":
        """Read a config written by :meth:`save_json`; errors name the file."""
        path = os.fspath(path)
        try:
            with open(path, "r", encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"config file not found: {path}") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON: {exc}") from exc
        try:
            return cls.from_dict(data)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"invalid model config in {path}: {exc}") from exc

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "TransformerConfig":
        """A named configuration from :data:`PRESETS`, with keyword overrides."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; available: {sorted(PRESETS)}")
        return cls.from_dict({**PRESETS[name], **overrides})


def _divisor_hint(d_model: int, n_heads: int) -> int:
    """The divisor of d_model closest to n_heads, for the error message."""
    divisors = [h for h in range(1, d_model + 1) if d_model % h == 0]
    return min(divisors, key=lambda h: (abs(h - n_heads), h))
