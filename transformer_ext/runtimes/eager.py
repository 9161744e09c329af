"""The eager PyTorch runner of :mod:`transformer_ext.decoding`: the project's data path.

:class:`EagerRunner` (docs/DESIGN.md section 1): ``model.encode`` once, cross-attention K/V repeated
per beam once, zero-filled preallocated self-attention caches (one stacked
:class:`~transformer_ext.runtimes.kv_cache.KVCache`), ``model.decode_step`` per token, new K/V
written in place with ``ops.kv_cache_append_``, beams reordered in place with
``ops.kv_cache_reorder_``. The plain-PyTorch baselines on the same weights are in
:mod:`transformer_ext.runtimes.baseline`.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import torch

from transformer_ext import decoding
from transformer_ext.cli import UserError
from transformer_ext.decoding.renamed import renamed_keywords
from transformer_ext.model import Transformer

from .info import PRECISION_NAMES, RunnerInfo
from .kv_cache import CacheStateViews, KVCache

logger = logging.getLogger(__name__)

__all__ = ["CompileError", "DTYPES", "EagerRunner", "EagerState", "check_dtype", "model_info"]

Device = Union[str, torch.device]


class CompileError(RuntimeError, UserError):
    """``torch.compile`` of the decoder step failed (on CPU, usually a missing C++ compiler)."""


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A checked int64 numpy array (see :mod:`transformer_ext.decoding`'s checks) on ``device``."""
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(device)


def model_info(model: Transformer) -> RunnerInfo:
    """The description of a runner of ``model`` in PyTorch: its config, positions as the only
    limit, the precision of its weights."""
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    return RunnerInfo.from_config(
        model.config.to_dict(), runtime="eager", precision=PRECISION_NAMES.get(dtype, dtype)
    )


def _encode_sources(
    model: Transformer,
    device: torch.device,
    input_ids: np.ndarray,
    src_lengths: np.ndarray,
    cache_len: int,
    beam_size: int,
):
    """The shared encode prologue of the PyTorch runners: the checks every runner makes
    (:func:`transformer_ext.decoding.check_encode_args`), ``model.encode`` once, and the
    cross-attention K/V and source lengths repeated per beam (row ``b * beam_size + k``).

    Returns ``(src_lengths [N], cross_keys, cross_values, source length S, cache_len, beam_size)``,
    N = batch * beams.
    """
    c = model.config
    ids, lengths, cache_len, beam_size = decoding.check_encode_args(
        input_ids, src_lengths, cache_len, beam_size, src_vocab_size=c.src_vocab_size, max_positions=c.max_len
    )
    src = _to_device(ids, device)
    lengths = _to_device(lengths, device)
    with torch.inference_mode():
        _, cross_keys, cross_values = model.encode(src, lengths)
        if beam_size > 1:
            cross_keys = [k.repeat_interleave(beam_size, dim=0) for k in cross_keys]
            cross_values = [v.repeat_interleave(beam_size, dim=0) for v in cross_values]
            lengths = lengths.repeat_interleave(beam_size, dim=0)
    return lengths, cross_keys, cross_values, int(src.shape[1]), cache_len, beam_size


@dataclass
class EagerState(CacheStateViews):
    """Decoding state of :class:`EagerRunner` (N = batch * beam_size rows)."""

    src_lengths: torch.Tensor  # [N] int64
    cross_keys: list[torch.Tensor]  # per layer [N, H, S, d_k]
    cross_values: list[torch.Tensor]
    # Every layer's self-attention cache, stacked ([n_layers * N, H, cache_len, d_k] for K and
    # for V, per-layer views): a step appends all layers' K (and V) in one op call and a beam
    # reorder is one call per buffer too, 2 instead of 2 * n_layers kernel calls (launches on CUDA).
    cache: KVCache
    # Per layer (W_QKV, b_QKV), copied from the parameters at encode (model.fused_qkv()): one
    # Q/K/V GEMM per layer per step; a decode never sees a later parameter update.
    fused_qkv: Optional[list] = None


# The weight dtypes a runner decodes with: name -> torch dtype.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def check_dtype(dtype, device: torch.device, what: str = "dtype") -> Optional[torch.dtype]:
    """``dtype`` (a name of :data:`DTYPES`, a torch dtype or None) as a torch dtype, checked for
    ``device``: bfloat16 on a CPU only where it is native
    (:func:`transformer_ext.cpu_features.require_native_bf16`, whose one-line error names the
    missing instructions). ``what`` names the argument in messages (``"--dtype"`` for the CLI)."""
    if dtype is None:
        return None
    names = {v: k for k, v in DTYPES.items()}
    if isinstance(dtype, torch.dtype) and dtype in names:
        dtype = names[dtype]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ValueError(f"{what} must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if dtype == "bfloat16" and device.type == "cpu":
        from transformer_ext import cpu_features

        cpu_features.require_native_bf16(
            f"{what} bfloat16" if what.startswith("--") else f"{what}='bfloat16'",
            "decode in float32, or on CUDA",
        )
    return DTYPES[dtype]


class EagerRunner:
    """Runs a :class:`Transformer` through ``encode`` / ``decode_step`` and the in-place cache ops."""

    def __init__(
        self,
        model: Transformer,
        device: Optional[Device] = None,
        compile: bool = False,
        dtype: Union[str, torch.dtype, None] = None,
    ):
        """``compile=True`` runs ``model.decode_step`` through ``torch.compile`` (fullgraph, static
        shapes): the preallocated cache gives every step of a decode the same shapes, so one
        graph serves all of them, with the Python-level module overhead gone. The first step of
        each new shape (rows, cache length, source length) compiles (seconds; cached on disk by
        Inductor); Inductor on CPU needs a C++ compiler.

        ``dtype``: ``"bfloat16"`` decodes with a bfloat16 copy of the model (``model`` itself is
        left as it is): weights, caches and activations in bfloat16, every kernel accumulating in
        float32 (the products, the softmax of the attention ops, LayerNorm's statistics), logits
        returned in float32; half the weight bytes per step. On a CPU only where bfloat16 is
        native (:func:`check_dtype` raises :class:`~transformer_ext.cpu_features.NotNativeError`
        otherwise). ``"float32"`` likewise converts a model of another dtype; None (default): the
        model's own dtype.

        ``info`` (:class:`~transformer_ext.runtimes.info.RunnerInfo`) describes the model (its
        config, positions, special ids, the precision of its weights)."""
        if device is None:
            device = next(model.parameters()).device
        self.device = torch.device(device)
        want = check_dtype(dtype, self.device)
        if want is not None and next(model.parameters()).dtype != want:
            model = copy.deepcopy(model).to(dtype=want)
        self.model = model.to(self.device).eval()
        self.dtype = next(self.model.parameters()).dtype
        self.info = model_info(self.model)
        self.compiled = bool(compile)
        self._decode_step = (
            torch.compile(model.decode_step, fullgraph=True, dynamic=False)
            if self.compiled
            else model.decode_step
        )

    def _run_decode_step(self, *args):
        if not self.compiled:
            return self._decode_step(*args)
        try:
            return self._decode_step(*args)
        except Exception as exc:  # compile errors surface at the first call of each shape
            raise CompileError(
                f"torch.compile of decode_step failed ({type(exc).__name__}: {exc}); on CPU Inductor needs a "
                "working C++ compiler. Run without compile (EagerRunner(..., compile=False), no --compile)"
            ) from exc

    @renamed_keywords({"num_beams": "beam_size"}, formula=False)
    def encode(
        self, input_ids: np.ndarray, src_lengths: np.ndarray, cache_len: int, beam_size: int = 1
    ) -> EagerState:
        lengths, cross_keys, cross_values, _, cache_len, _ = _encode_sources(
            self.model, self.device, input_ids, src_lengths, cache_len, beam_size
        )
        c = self.model.config
        cache = KVCache.allocate(
            c.n_decoder_layers,
            int(lengths.shape[0]),
            c.n_heads,
            cache_len,
            c.d_k,
            dtype=cross_keys[0].dtype,
            device=self.device,
        )
        with torch.inference_mode():
            fused_qkv = self.model.fused_qkv()
        return EagerState(lengths, cross_keys, cross_values, cache, fused_qkv)

    def step(self, state: EagerState, tokens: np.ndarray) -> np.ndarray:
        return self._step(state, tokens, False)[0]

    def step_with_attention(self, state: EagerState, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`step` that also returns the step's cross-attention, float32 ``[N, S]``: the
        last decoder layer's probabilities averaged over its heads (``return_attention``)."""
        return self._step(state, tokens, True)

    def _step(self, state: EagerState, tokens: np.ndarray, attention: bool):
        N = state.num_rows
        cache = state.cache
        ids = _to_device(
            decoding.check_step_tokens(
                cache.length, cache.capacity, self.info.max_positions, tokens, N, self.info.tgt_vocab_size
            ),
            self.device,
        )
        with torch.inference_mode():
            positions = cache.begin_step()  # every row (and layer) at its row's position
            outputs = self._run_decode_step(
                ids.view(N, 1),
                positions,
                state.src_lengths,
                cache.key_layers,
                cache.value_layers,
                state.cross_keys,
                state.cross_values,
                state.fused_qkv,
                *((True,) if attention else ()),
            )
            logits, new_keys, new_values = outputs[:3]
            cache.append_(new_keys, new_values)
            out = logits.cpu().numpy()  # synchronises: the cache's error flag is then on the host
            weights = outputs[3].cpu().numpy() if attention else None
        cache.end_step()
        return out, weights

    def append(self, state: EagerState, other: EagerState) -> None:
        """Append ``other``'s rows (a state this runner encoded, usually at position 0) after
        ``state``'s, each row keeping its position: sources joining a running decoding
        (:class:`transformer_ext.decoding.SearchState`). The self-attention caches move into
        buffers of both row counts and the larger capacity (:meth:`KVCache.extend`); the
        cross-attention K/V are padded to the longer source and concatenated. Later steps feed
        every row at its own position. Not with ``compile=True`` (a new row count compiles again)."""
        if self.compiled:
            raise ValueError(
                "append: a runner made with compile=True has static shapes; decode without compile"
            )
        if not isinstance(other, EagerState) or not isinstance(state, EagerState):
            raise TypeError(
                f"append takes two EagerState, got {type(state).__name__} and {type(other).__name__}"
            )
        S = max(int(state.cross_keys[0].shape[2]), int(other.cross_keys[0].shape[2]))

        def pad(t: torch.Tensor) -> torch.Tensor:  # zeros at the new source positions (masked)
            return torch.nn.functional.pad(t, (0, 0, 0, S - int(t.shape[2])))

        with torch.inference_mode():
            state.cache = state.cache.extend(other.cache)
            state.cross_keys = [
                torch.cat([pad(a), pad(b)]) for a, b in zip(state.cross_keys, other.cross_keys)
            ]
            state.cross_values = [
                torch.cat([pad(a), pad(b)]) for a, b in zip(state.cross_values, other.cross_values)
            ]
            state.src_lengths = torch.cat([state.src_lengths, other.src_lengths])

    def reorder(self, state: EagerState, beam_index: np.ndarray) -> None:
        with torch.inference_mode():
            state.cache.reorder_(beam_index)  # errors name the caller's row and value

    @property
    def select(self):
        """The runner's ``select(state, index)`` (see :class:`transformer_ext.decoding.Runner`):
        None with ``compile=True``, whose static-shape step graph would compile again for every
        new number of rows (the searches then feed finished rows instead of dropping them)."""
        return None if self.compiled else self._select

    def _select(self, state: EagerState, index: np.ndarray) -> None:
        """Keep the rows ``index``: row ``r`` becomes old row ``index[r]`` in the self-attention
        cache (in place, :meth:`KVCache.select_`), the cross-attention K/V and source lengths
        (gathered once into smaller tensors)."""
        index = decoding.check_select_index(index, state.num_rows)
        rows = _to_device(index, self.device)
        with torch.inference_mode():
            state.cache.select_(index)
            state.src_lengths = state.src_lengths.index_select(0, rows)
            state.cross_keys = [k.index_select(0, rows) for k in state.cross_keys]
            state.cross_values = [v.index_select(0, rows) for v in state.cross_values]
