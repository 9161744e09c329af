"""An independent plain-PyTorch Transformer: the oracle of tests/test_model.py.

Written from the paper, not from transformer_ext/model.py: its own positional-encoding formula
(a float64 double loop over ``pos / 10000^(2i/d_model)``), attention with additive float
masks and ``F.softmax``, LayerNorm spelled out, everything in float64. It shares nothing with
the model but the weights, which :func:`weights_from_state_dict` maps from the model's
``state_dict`` names into plain per-layer dicts.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

DTYPE = torch.float64


@dataclass
class RefHyper:
    d_model: int
    n_heads: int
    n_enc: int
    n_dec: int
    eps: float
    pre_ln: bool


def sinusoid_table(n_pos: int, d_model: int) -> torch.Tensor:
    """``PE[pos, 2i] = sin(pos / 10000^(2i/d))``, ``PE[pos, 2i+1] = cos(pos / 10000^(2i/d))``."""
    return _sinusoid_table(n_pos, d_model).clone()


@functools.lru_cache(maxsize=8)
def _sinusoid_table(n_pos: int, d_model: int) -> torch.Tensor:
    table = torch.zeros(n_pos, d_model, dtype=DTYPE)
    for pos in range(n_pos):
        for i in range(d_model // 2):
            angle = pos / (10000.0 ** (2 * i / d_model))
            table[pos, 2 * i] = math.sin(angle)
            table[pos, 2 * i + 1] = math.cos(angle)
    return table


def weights_from_state_dict(sd: dict, n_enc: int, n_dec: int) -> dict:
    """Map the model's state-dict names to the reference's own layout (float64 copies)."""

    def get(name):
        t = sd.get(name)
        return None if t is None else t.detach().to(DTYPE).clone()

    def linear(prefix):
        return {"w": get(prefix + ".weight"), "b": get(prefix + ".bias")}

    def norm(prefix):
        return {"g": get(prefix + ".weight"), "b": get(prefix + ".bias")}

    def attention(prefix):
        return {k: linear(f"{prefix}.W_{k.upper()}") for k in ("q", "k", "v", "o")}

    def ffn(prefix):
        return {"in": linear(prefix + ".w_1"), "out": linear(prefix + ".w_2")}

    W = {
        "src_emb": get("src_embed.lut.weight"),
        "tgt_emb": get("tgt_embed.lut.weight"),
        "proj": linear("generator.proj"),
        "enc_final": norm("encoder.norm") if "encoder.norm.weight" in sd else None,
        "dec_final": norm("decoder.norm") if "decoder.norm.weight" in sd else None,
        "enc": [],
        "dec": [],
    }
    if W["proj"]["w"] is None:  # tied output projection
        W["proj"]["w"] = W["tgt_emb"]
    for i in range(n_enc):
        p = f"encoder.layers.{i}"
        W["enc"].append(
            {
                "attn": attention(p + ".self_attn"),
                "ffn": ffn(p + ".feed_forward"),
                "ln1": norm(p + ".sublayer.0.norm"),
                "ln2": norm(p + ".sublayer.1.norm"),
            }
        )
    for i in range(n_dec):
        p = f"decoder.layers.{i}"
        W["dec"].append(
            {
                "self": attention(p + ".self_attn"),
                "cross": attention(p + ".src_attn"),
                "ffn": ffn(p + ".feed_forward"),
                "ln1": norm(p + ".sublayer.0.norm"),
                "ln2": norm(p + ".sublayer.1.norm"),
                "ln3": norm(p + ".sublayer.2.norm"),
            }
        )
    return W


def _linear(x, p):
    y = x @ p["w"].T
    return y if p["b"] is None else y + p["b"]


def _layer_norm(x, p, eps):
    mean = x.mean(dim=-1, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=-1, keepdim=True)  # biased variance, as nn.LayerNorm
    return (x - mean) / torch.sqrt(var + eps) * p["g"] + p["b"]


def _attention(x_q, x_kv, p, n_heads, additive_mask):
    """additive_mask: float ``[B, 1, Tq, Tk]`` with 0 (attend) or -inf (blocked)."""
    B, Tq, D = x_q.shape
    Tk = x_kv.shape[1]
    dk = D // n_heads

    def heads(t, T):
        return t.view(B, T, n_heads, dk).permute(0, 2, 1, 3)

    q = heads(_linear(x_q, p["q"]), Tq)
    k = heads(_linear(x_kv, p["k"]), Tk)
    v = heads(_linear(x_kv, p["v"]), Tk)
    scores = q @ k.transpose(-1, -2) / math.sqrt(dk) + additive_mask
    out = F.softmax(scores, dim=-1) @ v  # [B, H, Tq, dk]
    return _linear(out.permute(0, 2, 1, 3).reshape(B, Tq, D), p["o"])


def _ffn(x, p):
    return _linear(torch.clamp(_linear(x, p["in"]), min=0.0), p["out"])


def _sublayer(x, fn, ln, hp):
    if hp.pre_ln:
        return x + fn(_layer_norm(x, ln, hp.eps))
    return _layer_norm(x + fn(x), ln, hp.eps)


class ReferenceTransformer:
    """Eval-mode (no dropout) float64 forward pass of the paper's Transformer."""

    def __init__(self, config, state_dict):
        self.hp = RefHyper(
            config.d_model,
            config.n_heads,
            config.n_encoder_layers,
            config.n_decoder_layers,
            config.layer_norm_eps,
            config.norm_first,
        )
        self.W = weights_from_state_dict(state_dict, self.hp.n_enc, self.hp.n_dec)
        self.pe = sinusoid_table(config.max_len, config.d_model)

    def _embed(self, ids, table):
        T = ids.shape[1]
        return table[ids] * math.sqrt(self.hp.d_model) + self.pe[:T]

    def encode(self, src_ids, src_lengths):
        hp, W = self.hp, self.W
        B, S = src_ids.shape
        keep = torch.arange(S)[None, :] < src_lengths[:, None]  # [B, S]
        src_add = torch.zeros(B, 1, 1, S, dtype=DTYPE).masked_fill(~keep[:, None, None, :], float("-inf"))
        x = self._embed(src_ids, W["src_emb"])
        for L in W["enc"]:
            x = _sublayer(x, lambda h: _attention(h, h, L["attn"], hp.n_heads, src_add), L["ln1"], hp)
            x = _sublayer(x, lambda h: _ffn(h, L["ffn"]), L["ln2"], hp)
        if W["enc_final"] is not None:
            x = _layer_norm(x, W["enc_final"], hp.eps)
        return x, src_add

    def forward(self, src_ids, src_lengths, tgt_in):
        """Logits ``[B, T, V]`` (float64) under teacher forcing."""
        hp, W = self.hp, self.W
        memory, src_add = self.encode(src_ids, src_lengths)
        T = tgt_in.shape[1]
        future = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
        causal_add = torch.zeros(1, 1, T, T, dtype=DTYPE).masked_fill(future, float("-inf"))
        y = self._embed(tgt_in, W["tgt_emb"])
        for L in W["dec"]:
            y = _sublayer(y, lambda h: _attention(h, h, L["self"], hp.n_heads, causal_add), L["ln1"], hp)
            y = _sublayer(y, lambda h: _attention(h, memory, L["cross"], hp.n_heads, src_add), L["ln2"], hp)
            y = _sublayer(y, lambda h: _ffn(h, L["ffn"]), L["ln3"], hp)
        if W["dec_final"] is not None:
            y = _layer_norm(y, W["dec_final"], hp.eps)
        return _linear(y, W["proj"])

    __call__ = forward
