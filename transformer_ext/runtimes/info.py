"""What a runner runs and what it accepts: one description record per runner, :class:`RunnerInfo`.

Every runner of :mod:`transformer_ext.runtimes` exposes it as ``runner.info``: the model's sizes
and special ids, the limits of this runner (the model's positions, an export's cache capacity,
an engine profile's batch and source ranges), its precision and, for the export runners, the
graph flavour. The translator reads its limits and special ids from it and checks a tokenizer
against it; the runners size their buffers and check their arguments from it. Imports only the
standard library.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, Mapping, Optional

__all__ = ["RunnerInfo", "PRECISION_NAMES"]

# torch / numpy dtype names -> the precision names the package uses (fp32, fp16, bf16).
PRECISION_NAMES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def _opt_int(value: Any) -> Optional[int]:
    return None if value is None else int(value)


def _runner_info(values: dict) -> "RunnerInfo":
    """A pickled :class:`RunnerInfo` made again."""
    return RunnerInfo(**values)


def _min(*values: Optional[int]) -> Optional[int]:
    given = [int(v) for v in values if v is not None]
    return min(given) if given else None


@dataclass(frozen=True)
class RunnerInfo:
    """The description of one runner (read-only).

    Sizes are those of the model; ``None`` means "not known to this runner, not checked"
    (a TensorRT runner built from bare engines knows no vocabulary of the source side).
    """

    runtime: str  # "eager" (PyTorch), "onnxruntime" or "tensorrt"
    n_layers: int  # decoder layers (one self-attention cache each)
    n_heads: int
    d_k: int  # head width, d_model / n_heads
    d_model: int
    tgt_vocab_size: int  # logits per step
    src_vocab_size: Optional[int] = None  # source ids must be below it
    pad_id: Optional[int] = None
    bos_id: Optional[int] = None
    eos_id: Optional[int] = None
    max_positions: Optional[int] = None  # the model's max_len: positions and source lengths below it
    max_src_len: Optional[int] = None  # longest padded source the runner accepts (engine profile)
    min_src_len: int = 1
    max_cache_len: Optional[int] = None  # largest self-attention cache of one decoding
    min_cache_len: int = 1
    static_cache_len: Optional[int] = None  # a fixed cache capacity (TensorRT tensorscatter engines)
    max_sources: Optional[int] = None  # sources per encode call (encoder profile's batch)
    max_rows: Optional[int] = None  # sources x beams per step (decoder profile's batch)
    precision: str = "fp32"  # fp32, fp16, bf16, or int8 (a quantized export)
    flavour: Optional[str] = None  # an export's graph flavour: "portable", "tensorscatter" or "ort"
    # The model config as recorded (a model folder's config.json, a manifest's "model_config"),
    # read-only; None for a runner built without one. Where it was read from, for messages.
    config: Optional[Mapping[str, Any]] = field(default=None, compare=False, repr=False)
    config_file: Optional[str] = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.config is not None and not isinstance(self.config, MappingProxyType):
            object.__setattr__(self, "config", MappingProxyType(dict(self.config)))

    def __reduce__(self):
        """Pickled with the config as a plain dict (a read-only mapping does not pickle): a
        worker process sends its runner's record to its parent."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        if values["config"] is not None:
            values["config"] = dict(values["config"])
        return _runner_info, (values,)

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any], *, runtime: str, config_file: Optional[str] = None, **fields: Any
    ) -> "RunnerInfo":
        """The record of a runner of the model ``config`` (a model config's ``to_dict()`` or a
        manifest's ``model_config``); ``fields`` set or override the others (limits, precision...)."""
        heads = int(config["n_heads"])
        values: dict[str, Any] = dict(
            n_layers=int(config["n_decoder_layers"]),
            n_heads=heads,
            d_k=int(config["d_model"]) // heads,
            d_model=int(config["d_model"]),
            tgt_vocab_size=int(config["tgt_vocab_size"]),
            src_vocab_size=_opt_int(config.get("src_vocab_size")),
            pad_id=_opt_int(config.get("pad_id")),
            bos_id=_opt_int(config.get("bos_id")),
            eos_id=_opt_int(config.get("eos_id")),
            max_positions=_opt_int(config.get("max_len")),
        )
        values.update(fields)
        return cls(runtime=runtime, config=config, config_file=config_file, **values)

    # ------------------------------------------------------------------ what a caller may ask for

    @property
    def source_limit(self) -> Optional[int]:
        """The most tokens of one source: the model's positions and the runner's profile."""
        return _min(self.max_positions, self.max_src_len)

    @property
    def generation_limit(self) -> Optional[int]:
        """The most tokens one decoding may feed: the model's positions and the cache capacity."""
        return _min(self.max_positions, self.max_cache_len, self.static_cache_len)
