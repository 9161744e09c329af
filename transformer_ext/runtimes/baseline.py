"""Plain-PyTorch baselines on a :class:`~transformer_ext.model.Transformer`'s weights.

* :class:`CatCacheRunner`: a cached decoder (``torch.cat``-grown self-attention cache, cross
  K/V cached once, eager masked softmax): the benchmark baseline that corresponds to the seed's
  KV-cache decoder; a runner of :mod:`transformer_ext.decoding` like the others.
* :func:`greedy_decode_uncached`: the seed's re-decode loop (the full decoder over the whole
  prefix at every step, no cache), the reference the cached decoders are checked against.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import torch

from transformer_ext import decoding
from transformer_ext.decoding.renamed import renamed_keywords
from transformer_ext.model import Transformer, padding_mask

from .eager import Device, _encode_sources, _to_device, model_info

logger = logging.getLogger(__name__)

__all__ = ["CatCacheRunner", "CatCacheState", "greedy_decode_uncached"]


@dataclass
class CatCacheState:
    """Decoding state of :class:`CatCacheRunner`."""

    src_mask: torch.Tensor  # [N, 1, 1, S] bool, True = real source token
    cross_keys: list[torch.Tensor]  # per layer [N, H, S, d_k]
    cross_values: list[torch.Tensor]
    self_keys: list[Optional[torch.Tensor]]  # per layer [N, H, position, d_k], None before step 0
    self_values: list[Optional[torch.Tensor]]
    position: int
    cache_len: int


class CatCacheRunner:
    """The seed's KV-cache decoder in plain PyTorch, batched, on a :class:`Transformer`'s weights.

    The encoder (``model.encode``) is shared with
    :class:`~transformer_ext.runtimes.eager.EagerRunner`; every decoder step is plain PyTorch:
    the self-attention cache grows with ``torch.cat`` and attention is
    ``(scores * scale).masked_fill(~mask, -inf).softmax(-1)``.
    """

    def __init__(self, model: Transformer, device: Optional[Device] = None):
        if device is None:
            device = next(model.parameters()).device
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.info = model_info(self.model)

    @renamed_keywords({"num_beams": "beam_size"}, formula=False)
    def encode(
        self, input_ids: np.ndarray, src_lengths: np.ndarray, cache_len: int, beam_size: int = 1
    ) -> CatCacheState:
        lengths, cross_keys, cross_values, src_len, cache_len, _ = _encode_sources(
            self.model, self.device, input_ids, src_lengths, cache_len, beam_size
        )
        with torch.inference_mode():
            src_mask = padding_mask(lengths, src_len)
        n = self.info.n_layers
        return CatCacheState(src_mask, cross_keys, cross_values, [None] * n, [None] * n, 0, cache_len)

    @staticmethod
    def _attend(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        scores = torch.matmul(q, k.transpose(-2, -1)) * scale  # [N, H, 1, K]
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return torch.matmul(scores.softmax(-1), v)  # [N, H, 1, d_k]

    def step(self, state: CatCacheState, tokens: np.ndarray) -> np.ndarray:
        N = state.src_mask.shape[0]
        ids = _to_device(
            decoding.check_step_tokens(
                state.position, state.cache_len, self.info.max_positions, tokens, N, self.info.tgt_vocab_size
            ),
            self.device,
        )
        model = self.model
        with torch.inference_mode():
            x = model.tgt_embed(ids.view(N, 1)) + model.tgt_pe.pe[state.position]  # [N, 1, d_model]
            for i, layer in enumerate(model.decoder.layers):
                attn = layer.self_attn
                h = layer.sublayer[0].sublayer_input(x)
                q = attn.split_heads(attn.W_Q(h))
                k = attn.split_heads(attn.W_K(h))
                v = attn.split_heads(attn.W_V(h))
                if state.self_keys[i] is not None:
                    k = torch.cat([state.self_keys[i], k], dim=2)
                    v = torch.cat([state.self_values[i], v], dim=2)
                state.self_keys[i], state.self_values[i] = k, v
                out = self._attend(q, k, v, attn.scale)
                x = layer.sublayer[0].residual(x, attn.W_O(attn.merge_heads(out)))

                src_attn = layer.src_attn
                h = layer.sublayer[1].sublayer_input(x)
                q = src_attn.split_heads(src_attn.W_Q(h))
                out = self._attend(
                    q, state.cross_keys[i], state.cross_values[i], src_attn.scale, state.src_mask
                )
                x = layer.sublayer[1].residual(x, src_attn.W_O(src_attn.merge_heads(out)))

                x = layer.sublayer[2](x, layer.feed_forward)
            logits = model.generator(model.decoder.norm(x)[:, 0]).float()
        state.position += 1
        return logits.cpu().numpy()

    def reorder(self, state: CatCacheState, beam_index: np.ndarray) -> None:
        index = _to_device(decoding.check_beam_index(beam_index, int(state.src_mask.shape[0])), self.device)
        with torch.inference_mode():
            for i in range(len(state.self_keys)):
                if state.self_keys[i] is not None:
                    state.self_keys[i] = state.self_keys[i].index_select(0, index)
                    state.self_values[i] = state.self_values[i].index_select(0, index)

    def select(self, state: CatCacheState, index: np.ndarray) -> None:
        """Keep the rows ``index`` (row ``r`` becomes old row ``index[r]``): caches, cross K/V, mask."""
        rows = _to_device(decoding.check_select_index(index, int(state.src_mask.shape[0])), self.device)
        with torch.inference_mode():
            for name in ("self_keys", "self_values", "cross_keys", "cross_values"):
                setattr(
                    state,
                    name,
                    [None if t is None else t.index_select(0, rows) for t in getattr(state, name)],
                )
            state.src_mask = state.src_mask.index_select(0, rows)


# ------------------------------------------------------------------------------------------
# The seed's uncached greedy loop
# ------------------------------------------------------------------------------------------


@renamed_keywords()
def greedy_decode_uncached(
    model: Transformer,
    src_ids: torch.Tensor,
    src_lengths: torch.Tensor,
    *,
    bos_id: int,
    eos_id: int,
    max_decoding_length: Union[int, np.ndarray],
    min_decoding_length: Union[int, np.ndarray] = 0,
    return_logits: bool = False,
) -> Union[list[list[int]], tuple[list[list[int]], list[np.ndarray]]]:
    """Greedy decoding by re-running the full decoder on the whole prefix at every step.

    The seed tutorial's loop, batched: the same stopping rules as
    :func:`transformer_ext.decoding.greedy_decode` (EOS excluded, per-row budgets, EOS suppressed
    before ``min_decoding_length``). With ``return_logits`` it also returns the float32 logits
    ``[B, V]`` of every step (before EOS suppression).
    """
    B = src_ids.shape[0]
    max_new = np.broadcast_to(np.asarray(max_decoding_length, dtype=np.int64), (B,))
    min_new = np.broadcast_to(np.asarray(min_decoding_length, dtype=np.int64), (B,))
    steps = int(max_new.max()) if B else 0
    outputs: list[list[int]] = [[] for _ in range(B)]
    step_logits: list[np.ndarray] = []
    finished = max_new == 0
    model.eval()
    with torch.inference_mode():
        memory, _, _ = model.encode(src_ids, src_lengths)
        src_mask = padding_mask(src_lengths, src_ids.shape[1])
        ys = torch.full((B, 1), bos_id, dtype=torch.int64, device=src_ids.device)
        for t in range(steps):
            if finished.all():
                break
            hidden = model.decoder(model.embed_target(ys), memory, src_mask)  # [B, t+1, d_model]
            logits = model.generator(hidden[:, -1]).float().cpu().numpy()  # [B, V], last position only
            if return_logits:
                step_logits.append(logits.copy())
            logits = logits.copy()
            logits[t < min_new, eos_id] = -np.inf
            next_tokens = logits.argmax(-1)
            fed = decoding.greedy_advance(
                outputs, finished, next_tokens, eos_id=eos_id, max_decoding_length=max_new
            )
            ys = torch.cat([ys, torch.from_numpy(fed).view(B, 1).to(ys.device)], dim=1)
    if return_logits:
        return outputs, step_logits
    return outputs
