"""The encoder-decoder Transformer of "Attention Is All You Need" on the compiled ops.

Names follow the paper and the harvardnlp annotated transformer: ``Embeddings``,
``PositionalEncoding``, ``MultiHeadAttention``, ``PositionwiseFeedForward``,
``SublayerConnection``, ``EncoderLayer``, ``DecoderLayer``, ``Encoder``, ``Decoder``,
``Generator`` and ``Transformer``.

Two paths through the decoder:

* training / teacher forcing (:meth:`Transformer.forward`) and encoding: whole sequences,
  attention through the fused ``ops.attention`` (source lengths for the encoder self-attention
  and the cross-attention, ``causal=True`` for the decoder self-attention, attention dropout
  inside the kernel); when exporting, the three steps with ``ops.masked_softmax`` and a bool
  padding mask, whose lowering is standard ONNX ops;
* incremental decoding (:meth:`Transformer.encode` once, then :meth:`Transformer.decode_step`
  per token): one new token per row, attention through the fused ``ops.decode_attention``
  over a preallocated self-attention cache and the cross-attention K/V computed once.
  ``decode_step`` is a pure function of its inputs and is what the ONNX exporter traces
  (docs/DESIGN.md section 3). It is written with functional ops over each layer's parameters (a
  batch-1 step is ~20 small ops per layer, where module calls cost a fifth of the step); in
  inference it projects Q/K/V with one fused matrix and runs the projections through
  ``ops.linear``, and when exporting it uses the standard ops only.
"""

from __future__ import annotations

import logging
import math
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import ops, reference
from .config import TransformerConfig

logger = logging.getLogger(__name__)

__all__ = [
    "Embeddings",
    "PositionalEncoding",
    "MultiHeadAttention",
    "PositionwiseFeedForward",
    "SublayerConnection",
    "EncoderLayer",
    "DecoderLayer",
    "Encoder",
    "Decoder",
    "Generator",
    "Transformer",
    "padding_mask",
    "RMSNorm",
    "RelativePositionBias",
    "LearnedPositionalEmbedding",
    "relative_position_bucket",
]


def _is_tracing() -> bool:
    """True while torch.jit / dynamo / torch.export trace the model: skip host-side checks."""
    if torch.jit.is_tracing():
        return True
    compiler = getattr(torch, "compiler", None)
    if compiler is not None:
        if getattr(compiler, "is_compiling", lambda: False)():
            return True
        if getattr(compiler, "is_exporting", lambda: False)():
            return True
    return False


def _is_exporting() -> bool:
    """True while a graph is traced for export (torch.jit / torch.onnx / torch.export)."""
    if torch.jit.is_tracing():
        return True
    compiler = getattr(torch, "compiler", None)
    return compiler is not None and getattr(compiler, "is_exporting", lambda: False)()


def inference_kernels(module: nn.Module) -> bool:
    """True where inference-only kernels (``ops.linear``) may replace the standard ops: eval
    mode, no autograd recording, not exporting (``torch.compile`` is fine: the op has a fake
    kernel; an exported graph must contain only the standard ops)."""
    return not (module.training or torch.is_grad_enabled() or _is_exporting())


def padding_mask(lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    """Bool ``[B, 1, 1, max_len]``: True at key positions ``< lengths[b]`` (may be attended)."""
    positions = torch.arange(max_len, device=lengths.device)
    return positions.view(1, 1, 1, max_len) < lengths.view(-1, 1, 1, 1)


# ------------------------------------------------------------------------------------------
# Embeddings and positions
# ------------------------------------------------------------------------------------------


class Embeddings(nn.Module):
    """Token embedding multiplied by sqrt(d_model) (paper section 3.4), or unscaled (``scale=False``)."""

    def __init__(self, vocab_size: int, d_model: int, scale: bool = True):
        super().__init__()
        self.lut = nn.Embedding(vocab_size, d_model)
        self.scale = math.sqrt(d_model) if scale else 1.0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.lut(ids)  # [B, T] -> [B, T, d_model]
        return x * self.scale if self.scale != 1.0 else x


def sinusoid_table(
    d_model: int, max_len: int, layout: str = "interleaved", frequency: str = "paper", offset: int = 0
) -> torch.Tensor:
    """The positional-encoding table ``[max_len, d_model]`` float32: row ``t`` encodes position
    ``t + offset``.

    * ``frequency="paper"``: ``w_i = 10000^(-2i/d_model)``; ``"fairseq"``: ``w_i =
      exp(-i * ln(10000) / (d_model/2 - 1))`` (tensor2tensor's, used by fairseq and M2M100/NLLB).
    * ``layout="interleaved"``: ``PE[p, 2i] = sin(p w_i)``, ``PE[p, 2i+1] = cos(p w_i)`` (the
      paper); ``"halves"``: ``PE[p, i] = sin(p w_i)``, ``PE[p, d/2 + i] = cos(p w_i)`` (Marian,
      fairseq).

    Each family's table is computed the way its reference implementation computes it: ours and
    fairseq's in float32, Marian's (halves with the paper's frequencies) in float64, then rounded.
    """
    half = d_model // 2
    if layout == "interleaved" and frequency == "paper" and offset == 0:  # the paper's, as always built
        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0, max_len, dtype=torch.float32).unsqueeze(1)  # [max_len, 1]
        div_term = torch.exp(
            torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model)
        )  # [d_model / 2]
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        return pe
    if frequency == "fairseq":
        step = math.log(10000) / (half - 1)
        freq = torch.exp(torch.arange(half, dtype=torch.int64).float() * -step)  # [half] float32
        angle = torch.arange(offset, offset + max_len, dtype=torch.int64).float().unsqueeze(1) * freq
        sin, cos = torch.sin(angle), torch.cos(angle)  # [max_len, half] float32
    else:
        i = torch.arange(half, dtype=torch.float64)
        pos = torch.arange(offset, offset + max_len, dtype=torch.float64).unsqueeze(1)
        angle = pos / torch.pow(torch.tensor(10000.0, dtype=torch.float64), 2 * i / d_model)
        sin, cos = torch.sin(angle), torch.cos(angle)  # [max_len, half] float64
    if layout == "halves":
        pe = torch.cat([sin, cos], dim=1)
    else:
        pe = torch.stack([sin, cos], dim=2).reshape(max_len, d_model)
    return pe.to(torch.float32).contiguous()


class PositionalEncoding(nn.Module):
    """Sinusoidal positions (paper section 3.5), added to the embeddings, then dropout.

    By default ``PE(pos, 2i) = sin(pos / 10000^(2i/d_model))``, ``PE(pos, 2i+1) = cos(...)``,
    interleaved, ``pos`` from 0; the layout, the frequencies and the offset of the first
    position are options (:func:`sinusoid_table`), for imported model families. The table has
    ``max_len`` rows (row ``t``: the ``t``-th token) and is a non-persistent buffer: it is
    rebuilt from the config, never saved in a checkpoint.
    """

    pe: torch.Tensor

    def __init__(
        self,
        d_model: int,
        max_len: int,
        dropout: float,
        layout: str = "interleaved",
        frequency: str = "paper",
        offset: int = 0,
        norm: Optional[nn.Module] = None,
    ):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.max_len = max_len
        pe = sinusoid_table(d_model, max_len, layout, frequency, offset)
        self.register_buffer("pe", pe, persistent=False)  # [max_len, d_model]
        if norm is not None:
            self.norm = norm  # the embedding norm (mBART's layernorm_embedding), before dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, T, d_model]`` (positions 0..T-1) -> dropout(x + PE[:T])."""
        T = x.shape[1]
        h = x + self.pe[:T].unsqueeze(0).to(x.dtype)
        return self.dropout(self.norm(h) if "norm" in self._modules else h)

    def at(self, positions: torch.Tensor) -> torch.Tensor:
        """Rows of the table for int64 ``positions [B]`` -> ``[B, d_model]`` (a gather, no sin/cos)."""
        return self.pe[positions]

    def add_at(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One token per row: ``x [B, 1, d_model]`` at ``positions [B]`` -> ``x + PE[positions]``
        (then the embedding norm, if any), in eval mode (no dropout)."""
        h = x + self.at(positions).unsqueeze(1).to(x.dtype)
        return self.norm(h) if "norm" in self._modules else h


class LearnedPositionalEmbedding(nn.Module):
    """Learned absolute positions (mBART): row ``t + offset`` of a trained table is added to the
    ``t``-th token's embedding (mBART's offset is 2), then the embedding norm, then dropout. With
    ``learned=False`` no position is added at all (T5: positions enter through the relative
    attention bias), the embedding norm and dropout remain."""

    def __init__(
        self,
        d_model: int,
        max_len: int,
        dropout: float,
        offset: int = 0,
        norm: Optional[nn.Module] = None,
        learned: bool = True,
    ):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.max_len = max_len
        self.offset = offset
        if learned:
            self.table = nn.Embedding(max_len + offset, d_model)
        if norm is not None:
            self.norm = norm

    def _finish(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h) if "norm" in self._modules else h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "table" in self._modules:
            T = x.shape[1]
            x = x + self.table.weight[self.offset : self.offset + T].unsqueeze(0).to(x.dtype)
        return self.dropout(self._finish(x))

    def add_at(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if "table" in self._modules:
            x = x + self.table.weight[positions + self.offset].unsqueeze(1).to(x.dtype)
        return self._finish(x)


def relative_position_bucket(
    relative_position: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int
) -> torch.Tensor:
    """T5's bucket of each ``relative_position`` (key position minus query position), int64.

    Bidirectional (the encoder): half of the buckets for keys after the query, half for the
    others. Causal (the decoder): only distances to earlier keys, a later key counts as 0. Of the
    buckets of one direction, the first half are the exact distances 0, 1, ..., the second half
    cover distances up to ``max_distance`` logarithmically (float32 arithmetic, truncated), and
    every farther distance shares the last bucket.
    """
    n = num_buckets
    bucket = torch.zeros_like(relative_position)
    if bidirectional:
        n //= 2
        bucket = (relative_position > 0).to(torch.int64) * n
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp_min(0)
    exact = n // 2
    is_small = distance < exact
    # distance 0 gives log(0) = -inf here; such entries are exact ones and taken from `distance`
    far = exact + (torch.log(distance.float() / exact) / math.log(max_distance / exact) * (n - exact)).to(
        torch.int64
    )
    far = torch.clamp(far, max=n - 1)
    return bucket + torch.where(is_small, distance, far)


class RelativePositionBias(nn.Module):
    """T5's learned relative position bias: one scalar per head and bucket of the distance from a
    query to a key (:func:`relative_position_bucket`), added to the attention scores."""

    def __init__(self, num_buckets: int, max_distance: int, n_heads: int, bidirectional: bool):
        super().__init__()
        self.num_buckets, self.max_distance = num_buckets, max_distance
        self.bidirectional = bidirectional
        self.relative_attention_bias = nn.Embedding(num_buckets, n_heads)  # [buckets, H]

    def _lookup(self, relative: torch.Tensor) -> torch.Tensor:
        buckets = relative_position_bucket(relative, self.bidirectional, self.num_buckets, self.max_distance)
        return self.relative_attention_bias(buckets)  # [..., H]

    def forward(self, q_len: int, k_len: int, device=None) -> torch.Tensor:
        """The bias of queries ``0 .. q_len-1`` over keys ``0 .. k_len-1``: ``[1, H, q_len, k_len]``
        (with ``q_len < k_len`` the queries are the last ones, as the causal mask aligns them)."""
        device = device if device is not None else self.relative_attention_bias.weight.device
        i = torch.arange(q_len, device=device).view(q_len, 1) + (k_len - q_len)
        j = torch.arange(k_len, device=device).view(1, k_len)
        return self._lookup(j - i).permute(2, 0, 1).unsqueeze(0)

    def step(self, positions: torch.Tensor, cache_len: int) -> torch.Tensor:
        """The bias of one query per row at ``positions [B]`` over cache entries ``0 ..
        cache_len-1`` and the new key (at the query's own position): ``[B, H, 1, cache_len + 1]``."""
        j = torch.arange(cache_len + 1, device=positions.device).view(1, -1)
        relative = j - positions.view(-1, 1)
        relative = torch.cat([relative[:, :cache_len], torch.zeros_like(relative[:, :1])], 1)
        return self._lookup(relative).permute(0, 2, 1).unsqueeze(2)


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight``: no mean, no shift (T5's layer norm); float32 math."""

    def __init__(self, d_model: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d_model))
        self.eps = eps
        self.normalized_shape = (d_model,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:class:`RMSNorm`'s computation: the mean square in float32 (whatever the dtype of ``x``).

    While exporting it is written ``x / sqrt(mean + eps)`` (``Pow``, ``ReduceMean``, ``Add``,
    ``Sqrt``, ``Div``, ``Mul``): the form ONNX Runtime fuses into one
    ``SimplifiedLayerNormalization`` when it loads the graph (``x * rsqrt(...)`` exports as
    ``Reciprocal`` + ``Mul``, which it leaves as six nodes per norm); the same value up to float
    rounding."""
    variance = x.float().pow(2).mean(-1, keepdim=True)
    if _is_exporting():
        return weight * (x / torch.sqrt(variance + eps)).to(x.dtype)
    return weight * (x * torch.rsqrt(variance + eps)).to(x.dtype)


def make_norm(kind: str, d_model: int, eps: float) -> nn.Module:
    """A LayerNorm (``kind="layer"``) or an :class:`RMSNorm` (``"rms"``)."""
    return RMSNorm(d_model, eps) if kind == "rms" else nn.LayerNorm(d_model, eps=eps)


# ------------------------------------------------------------------------------------------
# Attention and feed-forward
# ------------------------------------------------------------------------------------------


class MultiHeadAttention(nn.Module):
    """``MultiHead(Q, K, V) = Concat(head_1..head_h) W_O``, ``head_i = Attention(Q W_Q_i, K W_K_i, V W_V_i)``."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        dropout: float,
        bias: bool = True,
        d_k: Optional[int] = None,
        scaled: bool = True,
    ):
        super().__init__()
        self.d_model = d_model
        self.n_heads = n_heads
        self.d_k = d_k if d_k else d_model // n_heads
        self.inner = n_heads * self.d_k  # width of the concatenated heads
        self.scale = 1.0 / math.sqrt(self.d_k) if scaled else 1.0
        self.W_Q = nn.Linear(d_model, self.inner, bias=bias)
        self.W_K = nn.Linear(d_model, self.inner, bias=bias)
        self.W_V = nn.Linear(d_model, self.inner, bias=bias)
        self.W_O = nn.Linear(self.inner, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)  # on the attention probabilities

    def fused_qkv(self) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """A new copy of ``[W_Q; W_K; W_V]`` (``[3*d_model, d_model]``) and of the biases (or None),
        for one-GEMM projections of a decoder step. A snapshot: it does not follow later updates
        of the parameters (optimizers such as fused Adam do not even bump version counters), so
        its user makes one per decode (see :meth:`Transformer.fused_qkv`)."""
        with torch.no_grad():
            weight = torch.cat([self.W_Q.weight, self.W_K.weight, self.W_V.weight], 0)
            bias = (
                torch.cat([self.W_Q.bias, self.W_K.bias, self.W_V.bias], 0)
                if self.W_Q.bias is not None
                else None
            )
        return weight, bias

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, d_model]`` -> ``[B, H, T, d_k]``."""
        B, T, _ = x.shape
        return x.reshape(B, T, self.n_heads, self.d_k).transpose(1, 2)

    def merge_heads(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, H, T, d_k]`` -> ``[B, T, d_model]``."""
        B, _, T, _ = x.shape
        return x.transpose(1, 2).reshape(B, T, self.inner)

    def project_kv(self, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``memory [B, S, d_model]``, each ``[B, H, S, d_k]`` contiguous."""
        k = self.split_heads(self.W_K(memory)).contiguous()
        v = self.split_heads(self.W_V(memory)).contiguous()
        return k, v

    # Whole-sequence attention through the fused ops.attention (scores, softmax, dropout and the
    # weighted sum in one kernel with its own backward), and decoder steps through the fused
    # ops.decode_attention. Class-level so that one instance can run the standard-op compositions
    # instead (False: the three-step path, and transformer_ext.reference.decode_attention in
    # DecoderLayer.step): a test compares the two, export validation measures the float32
    # rounding of the compositions an exported graph computes.
    fused_attention: bool = True

    def forward(
        self,
        query: torch.Tensor,  # [B, Tq, d_model]
        key: torch.Tensor,  # [B, Tk, d_model]
        value: torch.Tensor,  # [B, Tk, d_model]
        mask: Optional[torch.Tensor] = None,  # bool, broadcastable to [B, H, Tq, Tk]
        causal: bool = False,
        key_lengths: Optional[torch.Tensor] = None,  # [B] int64: the padding `mask` as lengths
        position_bias: Optional[torch.Tensor] = None,  # additive, broadcastable to [B, H, Tq, Tk]
    ) -> torch.Tensor:
        """Attention of ``query`` over ``key``/``value``. With ``key_lengths`` (the same padding as
        ``mask``) or without a mask, it runs the fused ``ops.attention``; an explicit mask alone,
        and export (whose graphs keep the standard-op lowering of ``masked_softmax``), run the
        three steps: scores, ``ops.masked_softmax``, dropout, the weighted sum."""
        B, Tq, _ = query.shape
        q = self.split_heads(self.W_Q(query))  # [B, H, Tq, d_k]
        k = self.split_heads(self.W_K(key))  # [B, H, Tk, d_k]
        v = self.split_heads(self.W_V(value))  # [B, H, Tk, d_k]
        if self.fused_attention and (key_lengths is not None or mask is None) and not _is_exporting():
            p = self.dropout.p if self.training else 0.0
            out = ops.attention(
                q,
                k,
                v,
                key_lengths=key_lengths,
                scale=self.scale,
                causal=causal,
                dropout_p=p,
                position_bias=position_bias,
            )
            return self.W_O(
                out.transpose(1, 2).reshape(B, Tq, self.inner)
            )  # a view: out is [B, Tq, H, d_k] in memory
        scores = torch.matmul(q, k.transpose(-2, -1))  # [B, H, Tq, Tk]
        if position_bias is not None:
            if mask is None and key_lengths is not None:
                mask = padding_mask(key_lengths, k.shape[2])
            p_attn = ops.masked_softmax(
                scores * self.scale + position_bias.to(scores.dtype), mask, 1.0, causal
            )
            if self.training:
                p_attn = self.dropout(p_attn)
            return self.W_O(self.merge_heads(torch.matmul(p_attn, v)))
        if key_lengths is not None and mask is not None and not causal and _is_exporting():
            # The exported encoder: key_lengths >= 1 is the graphs' contract (docs/DESIGN.md 3.3),
            # so every row has a key and no masked_softmax zeroing is needed. The padding becomes
            # an additive bias [B, 1, 1, Tk], the same subgraph in every layer (ONNX Runtime
            # computes it once per run), added to the scores instead of a Where over them.
            bias = torch.where(mask, 0.0, float("-inf"))
            p_attn = torch.softmax(scores.float() * self.scale + bias, dim=-1).to(scores.dtype)
            return self.W_O(self.merge_heads(torch.matmul(p_attn, v)))
        p_attn = ops.masked_softmax(scores, mask, self.scale, causal)
        if self.training:
            p_attn = self.dropout(p_attn)
        return self.W_O(self.merge_heads(torch.matmul(p_attn, v)))  # [B, Tq, d_model]


def activate(x: torch.Tensor, activation: str) -> torch.Tensor:
    """The FFN nonlinearity ``activation`` (:data:`~transformer_ext.config.ACTIVATIONS`).

    ``relu``: ``max(0, x)``; ``gelu``: ``x * Phi(x)`` in its exact (erf) form; ``swish``:
    ``x * sigmoid(x)`` (SiLU); ``gelu_tanh``: gelu's tanh approximation (T5's ``gelu_new``).
    While exporting, they are written out in the standard ops every opset has (``Erf``,
    ``Sigmoid``, ``Tanh``, ``Mul``), so the portable graphs need no newer opset.
    """
    if activation == "relu":
        return F.relu(x)
    if activation == "swish":
        return x * torch.sigmoid(x) if _is_exporting() else F.silu(x)
    if activation == "gelu":
        return x * 0.5 * (1.0 + torch.erf(x * 0.7071067811865476)) if _is_exporting() else F.gelu(x)
    if activation == "gelu_tanh":
        if _is_exporting():  # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))): Tanh, Mul, Add
            return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * (x * x * x))))
        return F.gelu(x, approximate="tanh")
    raise ValueError(f"unknown activation {activation!r}")


class PositionwiseFeedForward(nn.Module):
    """``FFN(x) = max(0, x W_1 + b_1) W_2 + b_2`` (paper section 3.3); the nonlinearity is an option."""

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        dropout: float,
        bias: bool = True,
        activation: str = "relu",
        gated: bool = False,
    ):
        super().__init__()
        self.w_1 = nn.Linear(d_model, d_ff, bias=bias)
        self.w_2 = nn.Linear(d_ff, d_model, bias=bias)
        if gated:  # FFN(x) = (act(x W_1) * x W_3) W_2
            self.w_3 = nn.Linear(d_model, d_ff, bias=bias)
        self.dropout = nn.Dropout(dropout)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = activate(self.w_1(x), self.activation)
        if "w_3" in self._modules:
            h = h * self.w_3(x)
        return self.w_2(self.dropout(h) if self.training else h)


class SublayerConnection(nn.Module):
    """Residual connection and LayerNorm around one sublayer, in either placement.

    Post-LN (the paper): ``x = LayerNorm(x + Dropout(Sublayer(x)))``.
    Pre-LN: ``x = x + Dropout(Sublayer(LayerNorm(x)))`` (the stack then ends with a LayerNorm).
    """

    def __init__(self, d_model: int, dropout: float, eps: float, norm_first: bool, norm: str = "layer"):
        super().__init__()
        self.norm = make_norm(norm, d_model, eps)
        self.dropout = nn.Dropout(dropout)
        self.norm_first = norm_first

    def sublayer_input(self, x: torch.Tensor) -> torch.Tensor:
        """What the sublayer sees: ``LayerNorm(x)`` for Pre-LN, ``x`` for Post-LN."""
        return self.norm(x) if self.norm_first else x

    def residual(self, x: torch.Tensor, sublayer_out: torch.Tensor) -> torch.Tensor:
        """Add the (dropped-out) sublayer output to the residual stream ``x``."""
        if self.training:  # (an identity in eval mode: skipped, one module call fewer per sublayer)
            sublayer_out = self.dropout(sublayer_out)
        if self.norm_first:
            return x + sublayer_out
        return self.norm(x + sublayer_out)

    def forward(self, x: torch.Tensor, sublayer: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        return self.residual(x, sublayer(self.sublayer_input(x)))


# ------------------------------------------------------------------------------------------
# Layers and stacks
# ------------------------------------------------------------------------------------------


class EncoderLayer(nn.Module):
    """Self-attention, then feed-forward, each wrapped in a :class:`SublayerConnection`."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        c = config
        self.self_attn = _attention(c)
        self.feed_forward = _feed_forward(c)
        self.sublayer = nn.ModuleList([_sublayer(c) for _ in range(2)])
        if c.relative_attention_buckets and c.relative_attention_per_layer:
            self.relative_bias = _relative_bias(c, bidirectional=True)

    def forward(
        self,
        x: torch.Tensor,
        src_mask: torch.Tensor,
        src_lengths: Optional[torch.Tensor] = None,
        position_bias: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``x [B, S, d_model]``, ``src_mask`` bool ``[B, 1, 1, S]``, optionally the same padding as
        ``src_lengths [B]`` (then attention runs the fused op); ``position_bias [1, H, S, S]``."""
        x = self.sublayer[0](
            x,
            lambda h: self.self_attn(h, h, h, src_mask, key_lengths=src_lengths, position_bias=position_bias),
        )
        return self.sublayer[1](x, self.feed_forward)


class DecoderLayer(nn.Module):
    """Masked self-attention, cross-attention over the encoder output, feed-forward."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        c = config
        self.self_attn = _attention(c)
        self.src_attn = _attention(c)
        self.feed_forward = _feed_forward(c)
        self.sublayer = nn.ModuleList([_sublayer(c) for _ in range(3)])
        if c.relative_attention_buckets and c.relative_attention_per_layer:
            self.relative_bias = _relative_bias(c, bidirectional=False)

    def forward(
        self,
        x: torch.Tensor,
        memory: torch.Tensor,
        src_mask: torch.Tensor,
        src_lengths: Optional[torch.Tensor] = None,
        position_bias: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Teacher forcing: ``x [B, T, d_model]``, ``memory [B, S, d_model]``, ``src_mask [B, 1, 1, S]``
        (optionally also as ``src_lengths [B]``); ``position_bias [1, H, T, T]`` of the
        self-attention (the cross-attention has none)."""
        x = self.sublayer[0](
            x, lambda h: self.self_attn(h, h, h, None, causal=True, position_bias=position_bias)
        )
        x = self.sublayer[1](x, lambda h: self.src_attn(h, memory, memory, src_mask, key_lengths=src_lengths))
        return self.sublayer[2](x, self.feed_forward)

    def step_weights(self, fused_qkv: Optional[tuple] = None) -> "DecoderStepWeights":
        """This layer's parameters as a flat tuple for :meth:`step`, read afresh at every call (so
        in-place updates, ``.to()`` and replaced parameters are always seen), through the module
        dicts rather than attribute lookups: this runs at every decoder step. ``fused_qkv``: this
        layer's ``(W_QKV, b_QKV)`` from :meth:`MultiHeadAttention.fused_qkv`, or None."""
        m = self._modules
        a, x, ff = m["self_attn"], m["src_attn"]._modules, m["feed_forward"]._modules
        n0, n1, n2 = (sub._modules["norm"]._parameters for sub in m["sublayer"]._modules.values())
        f3 = ff["w_3"]._parameters if "w_3" in ff else {"weight": None, "bias": None}
        qkv = fused_qkv if fused_qkv is not None else (None, None)
        aq, ak, av, ao = (a._modules[k]._parameters for k in ("W_Q", "W_K", "W_V", "W_O"))
        xq, xo, f1, f2 = (
            x["W_Q"]._parameters,
            x["W_O"]._parameters,
            ff["w_1"]._parameters,
            ff["w_2"]._parameters,
        )
        return DecoderStepWeights(
            qkv[0],
            qkv[1],
            aq["weight"],
            aq["bias"],
            ak["weight"],
            ak["bias"],
            av["weight"],
            av["bias"],
            ao["weight"],
            ao["bias"],
            n0["weight"],
            n0.get("bias"),
            xq["weight"],
            xq["bias"],
            xo["weight"],
            xo["bias"],
            n1["weight"],
            n1.get("bias"),
            f1["weight"],
            f1["bias"],
            f2["weight"],
            f2["bias"],
            n2["weight"],
            n2.get("bias"),
            f3["weight"],
            f3["bias"],
        )

    def step(
        self,
        x: torch.Tensor,  # [B, 1, d_model] the new token
        positions: torch.Tensor,  # [B] int64 tokens already in the cache
        src_lengths: torch.Tensor,  # [B] int64
        self_key: torch.Tensor,  # [B, H, L, d_k]
        self_value: torch.Tensor,  # [B, H, L, d_k]
        cross_key: torch.Tensor,  # [B, H, S, d_k]
        cross_value: torch.Tensor,  # [B, H, S, d_k]
        fused_qkv: Optional[tuple] = None,  # (W_QKV, b_QKV): one GEMM for Q/K/V (inference only)
        kernel_linear: bool = False,  # ops.linear instead of F.linear (inference only)
        attention: Optional[list] = None,  # given: the head-averaged cross-attention is appended
        cross_bias: Optional[torch.Tensor] = None,  # [B_src, 1, K, S]: cross K/V once per source
        position_bias: Optional[torch.Tensor] = None,  # [B, H, 1, L + 1]: relative bias of the self-attention
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One decoding step -> ``(x [B, 1, d_model], new_key, new_value [B, H, 1, d_k])``.

        ``attention``: a list, to which the step appends its cross-attention probabilities
        averaged over the heads, float32 ``[B, S]`` (zero at padded source positions).

        ``cross_bias``: given, ``cross_key`` / ``cross_value`` hold one row per source
        (``[B_src, H, S, d_k]``, ``B = B_src * K``, the ``K`` rows of a source consecutive) and
        ``cross_bias`` is the additive source mask (0 or -inf) ``[B_src, 1, K, S]``: a source's
        rows are the query rows of one product with its keys, so the keys and values are read
        once per source instead of once per row. Otherwise they hold one row per row.

        The same computation as :meth:`forward` for one new token (eval mode: no dropout),
        written with functional ops over :meth:`step_weights`: a decoder step is ~40 small ops
        per layer at batch 1, and the module calls of the :meth:`forward` path add about a fifth
        to a step (``base`` on a CPU: 4.6 ms instead of 3.5 ms).
        """
        w = self.step_weights(fused_qkv)
        a = self._modules["self_attn"]
        self_decode = ops.decode_attention if a.fused_attention else reference.decode_attention
        cross_decode = (
            ops.decode_attention if self._modules["src_attn"].fused_attention else reference.decode_attention
        )
        B, D, H, d_k, scale = x.shape[0], a.inner, a.n_heads, a.d_k, a.scale
        first = self._modules["sublayer"]._modules["0"]
        norm, pre = first._modules["norm"], first.norm_first
        shape, eps = norm.normalized_shape, norm.eps
        act = self._modules["feed_forward"].activation
        normalize = _functional_norm(isinstance(norm, RMSNorm), shape, eps)

        def sublayer(x: torch.Tensor, fn, gamma, beta) -> torch.Tensor:
            if pre:  # Pre-LN: x + f(LN(x))
                return x + fn(normalize(x, gamma, beta))
            return normalize(x + fn(x), gamma, beta)  # Post-LN

        new_kv: list[torch.Tensor] = []
        # Inference: our matrix-vector kernel for these few-row products (ops.linear); exported
        # or with autograd: F.linear, the op every exporter knows.
        linear = ops.linear if kernel_linear else F.linear

        def self_attention(h: torch.Tensor) -> torch.Tensor:
            # With one token per row, [B, 1, d_model] and [B, H, 1, d_k] share a memory layout:
            # splitting and merging heads are views.
            if w.qkv_weight is not None:
                q, k, v = linear(h, w.qkv_weight, w.qkv_bias).view(B, 3, H, 1, d_k).unbind(1)
            else:
                q = linear(h, w.q_weight, w.q_bias).view(B, H, 1, d_k)
                k = linear(h, w.k_weight, w.k_bias).view(B, H, 1, d_k)
                v = linear(h, w.v_weight, w.v_bias).view(B, H, 1, d_k)
            new_kv.extend((k, v))
            bias = () if position_bias is None else (position_bias,)  # the export lowerings' signature
            out = self_decode(q, self_key, self_value, positions, scale, k, v, *bias)
            return linear(out.reshape(B, 1, D), w.o_weight, w.o_bias)

        def cross_attention(h: torch.Tensor) -> torch.Tensor:
            q = linear(h, w.cross_q_weight, w.cross_q_bias).view(B, H, 1, d_k)
            if cross_bias is not None:
                out = _cross_attention_per_source(q, cross_key, cross_value, cross_bias, scale, attention)
                return linear(out, w.cross_o_weight, w.cross_o_bias)
            if attention is not None:  # the probabilities decode_attention uses, made visible
                S = cross_key.shape[2]
                keep = torch.arange(S, device=src_lengths.device)[None, :] < src_lengths[:, None]  # [B, S]
                scores = torch.matmul(q, cross_key.transpose(-2, -1))  # [B, H, 1, S]
                probs = ops.masked_softmax(scores, keep[:, None, None, :], scale, False)
                attention.append(probs.float().mean(dim=1)[:, 0])  # [B, S]
            out = cross_decode(q, cross_key, cross_value, src_lengths, scale)
            return linear(out.reshape(B, 1, D), w.cross_o_weight, w.cross_o_bias)

        def feed_forward(h: torch.Tensor) -> torch.Tensor:
            inner = activate(linear(h, w.ff1_weight, w.ff1_bias), act)
            if w.ff3_weight is not None:
                inner = inner * linear(h, w.ff3_weight, w.ff3_bias)
            return linear(inner, w.ff2_weight, w.ff2_bias)

        x = sublayer(x, self_attention, w.norm0_weight, w.norm0_bias)
        x = sublayer(x, cross_attention, w.norm1_weight, w.norm1_bias)
        x = sublayer(x, feed_forward, w.norm2_weight, w.norm2_bias)
        return x, new_kv[0], new_kv[1]


def _cross_attention_per_source(
    q: torch.Tensor,  # [B, H, 1, d_k], laid out as [B_src, K, H, d_k]
    cross_key: torch.Tensor,  # [B_src, H, S, d_k]
    cross_value: torch.Tensor,  # [B_src, H, S, d_k]
    cross_bias: torch.Tensor,  # [B_src, 1, K, S]
    scale: float,
    attention: Optional[list],
) -> torch.Tensor:
    """A decoder step's cross-attention with K/V once per source -> ``[B, 1, H * d_k]``: a source's
    rows are the query rows of one product over its keys (:meth:`DecoderLayer.step`)."""
    B, H, _, d_k = q.shape
    q = q.view(cross_key.shape[0], -1, H, d_k).transpose(1, 2)  # [B_src, H, K, d_k]
    scores = torch.matmul(q, cross_key.transpose(-2, -1)).float()  # [B_src, H, K, S]
    if scale != 1.0:
        scores = scores * scale
    probs = torch.softmax(scores + cross_bias, dim=-1)
    if attention is not None:
        attention.append(probs.mean(dim=1).reshape(B, cross_key.shape[2]))  # [B, S]
    out = torch.matmul(probs.to(q.dtype), cross_value)  # [B_src, H, K, d_k]
    return out.transpose(1, 2).reshape(B, 1, H * d_k)


def _functional_norm(rms: bool, shape, eps: float) -> Callable:
    """``normalize(x, gamma, beta)``: the functional form of the layer's norm (RMSNorm ignores beta)."""
    if rms:
        return lambda x, gamma, beta: rms_norm(x, gamma, eps)
    return lambda x, gamma, beta: F.layer_norm(x, shape, gamma, beta, eps)


class DecoderStepWeights(NamedTuple):
    """One decoder layer's tensors for :meth:`DecoderLayer.step` (``qkv_*`` None: unfused)."""

    qkv_weight: Optional[torch.Tensor]
    qkv_bias: Optional[torch.Tensor]
    q_weight: torch.Tensor
    q_bias: Optional[torch.Tensor]
    k_weight: torch.Tensor
    k_bias: Optional[torch.Tensor]
    v_weight: torch.Tensor
    v_bias: Optional[torch.Tensor]
    o_weight: torch.Tensor
    o_bias: Optional[torch.Tensor]
    norm0_weight: torch.Tensor
    norm0_bias: Optional[torch.Tensor]
    cross_q_weight: torch.Tensor
    cross_q_bias: Optional[torch.Tensor]
    cross_o_weight: torch.Tensor
    cross_o_bias: Optional[torch.Tensor]
    norm1_weight: torch.Tensor
    norm1_bias: Optional[torch.Tensor]
    ff1_weight: torch.Tensor
    ff1_bias: Optional[torch.Tensor]
    ff2_weight: torch.Tensor
    ff2_bias: Optional[torch.Tensor]
    norm2_weight: torch.Tensor
    norm2_bias: Optional[torch.Tensor]
    ff3_weight: Optional[torch.Tensor] = None  # the gated FFN's second input projection
    ff3_bias: Optional[torch.Tensor] = None


class Encoder(nn.Module):
    """A stack of ``n_encoder_layers`` :class:`EncoderLayer` (+ a final LayerNorm for Pre-LN)."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.layers = nn.ModuleList([EncoderLayer(config) for _ in range(config.n_encoder_layers)])
        self.norm = _final_norm(config)
        if config.relative_attention_buckets and not config.relative_attention_per_layer:
            self.relative_bias = _relative_bias(config, bidirectional=True)  # shared by every layer

    def forward(
        self, x: torch.Tensor, src_mask: torch.Tensor, src_lengths: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        S = x.shape[1]
        bias = self.relative_bias(S, S, x.device) if "relative_bias" in self._modules else None
        for layer in self.layers:
            if "relative_bias" in layer._modules:
                bias = layer.relative_bias(S, S, x.device)
            x = layer(x, src_mask, src_lengths, bias)
        return self.norm(x)


class Decoder(nn.Module):
    """A stack of ``n_decoder_layers`` :class:`DecoderLayer` (+ a final LayerNorm for Pre-LN)."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.layers = nn.ModuleList([DecoderLayer(config) for _ in range(config.n_decoder_layers)])
        self.norm = _final_norm(config)
        if config.relative_attention_buckets and not config.relative_attention_per_layer:
            self.relative_bias = _relative_bias(config, bidirectional=False)  # shared by every layer

    def forward(
        self,
        x: torch.Tensor,
        memory: torch.Tensor,
        src_mask: torch.Tensor,
        src_lengths: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        T = x.shape[1]
        bias = self.relative_bias(T, T, x.device) if "relative_bias" in self._modules else None
        for layer in self.layers:
            if "relative_bias" in layer._modules:
                bias = layer.relative_bias(T, T, x.device)
            x = layer(x, memory, src_mask, src_lengths, bias)
        return self.norm(x)

    def step_biases(self, positions: torch.Tensor, cache_len: int) -> list[Optional[torch.Tensor]]:
        """Per layer the self-attention's relative bias of one decoder step ``[B, H, 1, cache_len +
        1]`` (see :meth:`RelativePositionBias.step`), or None without a relative bias."""
        if "relative_bias" in self._modules:
            return [self.relative_bias.step(positions, cache_len)] * len(self.layers)
        return [
            layer.relative_bias.step(positions, cache_len) if "relative_bias" in layer._modules else None
            for layer in self.layers
        ]


def _attention(c: TransformerConfig) -> MultiHeadAttention:
    return MultiHeadAttention(c.d_model, c.n_heads, c.dropout, c.bias, c.d_k, c.scale_attention)


def _feed_forward(c: TransformerConfig) -> PositionwiseFeedForward:
    return PositionwiseFeedForward(c.d_model, c.d_ff, c.dropout, c.bias, c.activation, c.gated_ffn)


def _sublayer(c: TransformerConfig) -> SublayerConnection:
    return SublayerConnection(c.d_model, c.dropout, c.layer_norm_eps, c.norm_first, c.norm)


def _final_norm(c: TransformerConfig) -> nn.Module:
    return make_norm(c.norm, c.d_model, c.layer_norm_eps) if c.norm_first else nn.Identity()


def _relative_bias(c: TransformerConfig, bidirectional: bool) -> RelativePositionBias:
    return RelativePositionBias(
        c.relative_attention_buckets, c.relative_attention_max_distance, c.n_heads, bidirectional
    )


class Generator(nn.Module):
    """The final linear projection to target-vocabulary logits (softmax is left to the caller);
    ``scale``: the decoder output is first multiplied by it (T5's d_model^-0.5 of tied weights)."""

    def __init__(self, d_model: int, vocab_size: int, bias: bool, scale: float = 1.0):
        super().__init__()
        self.proj = nn.Linear(d_model, vocab_size, bias=bias)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x * self.scale if self.scale != 1.0 else x)


def _positions(c: TransformerConfig) -> nn.Module:
    """The absolute positions of a stack's input (and its embedding norm), per the config."""
    norm = make_norm(c.norm, c.d_model, c.layer_norm_eps) if c.embedding_norm else None
    if c.positions == "sinusoidal":
        return PositionalEncoding(
            c.d_model, c.max_len, c.dropout, c.pos_layout, c.pos_frequency, c.pos_offset, norm
        )
    return LearnedPositionalEmbedding(
        c.d_model, c.max_len, c.dropout, c.pos_offset, norm, learned=c.positions == "learned"
    )


# ------------------------------------------------------------------------------------------
# The model
# ------------------------------------------------------------------------------------------


class Transformer(nn.Module):
    """Encoder-decoder Transformer; see the module docstring for the two decoding paths.

    Weight tying: with ``tie_target_embeddings`` the output projection *is* the target embedding
    matrix (no projection bias, unless ``output_bias`` adds one: Marian's ``final_logits_bias``);
    with ``shared_vocab`` the source embedding is that same matrix.
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        if not isinstance(config, TransformerConfig):
            raise TypeError(f"config must be a TransformerConfig, got {type(config).__name__}")
        config.validate()
        self.config = config
        c = config
        self.src_embed = Embeddings(c.src_vocab_size, c.d_model, c.scale_embeddings)
        self.tgt_embed = Embeddings(c.tgt_vocab_size, c.d_model, c.scale_embeddings)
        self.src_pe = _positions(c)
        self.tgt_pe = _positions(c)
        self.encoder = Encoder(c)
        self.decoder = Decoder(c)
        self.generator = Generator(
            c.d_model,
            c.tgt_vocab_size,
            bias=(c.bias and not c.tie_target_embeddings) or c.output_bias,
            scale=c.d_model**-0.5 if c.scale_decoder_output else 1.0,
        )
        self.tie_weights()
        self._init_weights()

    # ---------------------------------------------------------------- construction helpers

    def tie_weights(self) -> None:
        """Share the embedding / projection matrices the config asks to tie."""
        if self.config.tie_target_embeddings:
            self.generator.proj.weight = self.tgt_embed.lut.weight
        if self.config.shared_vocab:
            self.src_embed.lut.weight = self.tgt_embed.lut.weight

    def _init_weights(self) -> None:
        """Xavier-uniform for every matrix (as the annotated transformer); biases and LayerNorms keep torch's init."""
        for p in self.parameters():  # tied parameters are listed (and initialised) once
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)
        if self.config.output_bias:  # a logits bias next to tied weights starts at zero
            nn.init.zeros_(self.generator.proj.bias)

    # ---------------------------------------------------------------- input validation

    def _check_ids(self, name: str, ids: torch.Tensor, vocab_size: int, batch: Optional[int]) -> None:
        if not isinstance(ids, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(ids).__name__}")
        if ids.dtype != torch.int64:
            raise TypeError(f"{name} must be int64 token ids, got {ids.dtype}")
        if ids.dim() != 2:
            raise ValueError(f"{name} must have shape [batch, length], got {tuple(ids.shape)}")
        B, T = ids.shape
        if B < 1 or T < 1:
            raise ValueError(f"{name} must not be empty, got shape {tuple(ids.shape)}")
        if batch is not None and B != batch:
            raise ValueError(f"{name} has batch size {B}, but src_ids has {batch}")
        if T > self.config.max_len:
            raise ValueError(
                f"{name} has length {T} > max_len = {self.config.max_len} (positional-encoding "
                "rows); truncate the input or build the model with a larger max_len"
            )
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"{name} contains token id {bad}, outside the vocabulary [0, {vocab_size})")

    def _check_src(self, src_ids: torch.Tensor, src_lengths: torch.Tensor) -> None:
        self._check_ids("src_ids", src_ids, self.config.src_vocab_size, None)
        B, S = src_ids.shape
        if not isinstance(src_lengths, torch.Tensor):
            raise TypeError(f"src_lengths must be a torch.Tensor, got {type(src_lengths).__name__}")
        if src_lengths.dtype != torch.int64:
            raise TypeError(f"src_lengths must be int64, got {src_lengths.dtype}")
        if src_lengths.shape != (B,):
            raise ValueError(
                f"src_lengths must have shape [{B}] (one per source), got {tuple(src_lengths.shape)}"
            )
        if src_lengths.device != src_ids.device:
            raise ValueError(f"src_lengths is on {src_lengths.device} but src_ids on {src_ids.device}")
        lo, hi = int(src_lengths.min()), int(src_lengths.max())
        if lo < 1:
            raise ValueError(f"src_lengths must be >= 1 (empty sources are not supported), got {lo}")
        if hi > S:
            raise ValueError(f"src_lengths contains {hi} > src_ids length {S}")

    # ---------------------------------------------------------------- training path

    def embed_source(self, src_ids: torch.Tensor) -> torch.Tensor:
        return self.src_pe(self.src_embed(src_ids))  # [B, S, d_model]

    def embed_target(self, tgt_ids: torch.Tensor) -> torch.Tensor:
        return self.tgt_pe(self.tgt_embed(tgt_ids))  # [B, T, d_model]

    def decode(
        self, encoder_out: torch.Tensor, src_lengths: torch.Tensor, tgt_in: torch.Tensor
    ) -> torch.Tensor:
        """Teacher-forced decoder over the whole prefix ``tgt_in [B, T]`` -> logits ``[B, T, V]``."""
        src_mask = padding_mask(src_lengths, encoder_out.shape[1])
        return self.generator(self.decoder(self.embed_target(tgt_in), encoder_out, src_mask, src_lengths))

    def forward(self, src_ids: torch.Tensor, src_lengths: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        """Teacher forcing: ``src_ids [B, S]`` right-padded, ``src_lengths [B]``, ``tgt_in [B, T]``
        (BOS + target, shifted right) -> logits ``[B, T, tgt_vocab_size]``.

        Target padding at the end needs no mask: the causal mask keeps it out of real positions
        and the loss ignores the padded positions themselves.
        """
        if not _is_tracing():
            self._check_src(src_ids, src_lengths)
            self._check_ids("tgt_in", tgt_in, self.config.tgt_vocab_size, src_ids.shape[0])
        src_mask = padding_mask(src_lengths, src_ids.shape[1])
        memory = self.encoder(self.embed_source(src_ids), src_mask, src_lengths)
        return self.generator(self.decoder(self.embed_target(tgt_in), memory, src_mask, src_lengths))

    # ---------------------------------------------------------------- incremental decoding

    def encode(
        self, src_ids: torch.Tensor, src_lengths: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """Run the encoder once -> ``(encoder_out [B, S, d_model], cross_keys, cross_values)``.

        ``cross_keys[i]`` / ``cross_values[i]`` are decoder layer ``i``'s cross-attention keys and
        values ``[B, H, S, d_k]`` (contiguous), computed here once per source.
        """
        if not _is_tracing():
            self._check_src(src_ids, src_lengths)
        src_mask = padding_mask(src_lengths, src_ids.shape[1])
        encoder_out = self.encoder(self.embed_source(src_ids), src_mask, src_lengths)
        cross_keys, cross_values = [], []
        for layer in self.decoder.layers:
            k, v = layer.src_attn.project_kv(encoder_out)
            cross_keys.append(k)
            cross_values.append(v)
        return encoder_out, cross_keys, cross_values

    def fused_qkv(self) -> list[tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """Per decoder layer a new copy of its self-attention ``[W_Q; W_K; W_V]`` and biases, for
        :meth:`decode_step`: one Q/K/V GEMM per layer. A snapshot of the current parameters,
        ``3 * d_model**2`` elements per layer; make a new one after any update (the runners make
        one per decode, in ``encode``)."""
        return [layer.self_attn.fused_qkv() for layer in self.decoder.layers]

    def decode_step(
        self,
        input_ids: torch.Tensor,  # [B, 1] int64, the newest token of each row
        positions: torch.Tensor,  # [B] int64, its position = tokens already in the cache
        src_lengths: torch.Tensor,  # [B] int64, >= 1
        self_keys: list[torch.Tensor],  # per layer [B, H, L, d_k], finite (zero-filled) buffers
        self_values: list[torch.Tensor],  # per layer [B, H, L, d_k]
        cross_keys: list[torch.Tensor],  # per layer [B, H, S, d_k]
        cross_values: list[torch.Tensor],  # per layer [B, H, S, d_k]
        fused_qkv: Optional[list[tuple]] = None,  # from fused_qkv(): one Q/K/V GEMM per layer
        return_attention: bool = False,
        cross_per_source: bool = False,
    ) -> tuple:
        """One decoder step for one new token per row; a pure function (writes nothing).

        The token at ``positions[b]`` attends to self-attention cache entries
        ``0 .. positions[b]-1`` and to itself, and to source positions ``0 .. src_lengths[b]-1``.

        Returns ``(logits [B, V] float32, new_keys, new_values)`` with one ``[B, H, 1, d_k]`` tensor
        per layer: the new token's K/V, which the caller writes into its cache at ``positions``
        (``ops.kv_cache_append_``). The caller guarantees
        ``0 <= positions[b] < min(L, max_len)``; nothing here checks it (this is the exported
        graph: no host sync, no data-dependent control flow, no in-place op). Inference only:
        call it in eval mode, where the dropout modules are identities.

        ``fused_qkv`` (the output of :meth:`fused_qkv`, made after the last parameter update) lets
        inference project Q/K/V with one GEMM per layer; it is ignored with autograd on, in
        training mode and when exporting, where the separate projections run.

        ``return_attention``: a fourth result, the cross-attention probabilities of the last
        decoder layer averaged over its heads, float32 ``[B, S]`` (each row sums to 1 over the
        source's ``src_lengths[b]`` positions, zeros after), as CTranslate2's
        ``return_attention``.

        ``cross_per_source``: ``cross_keys`` / ``cross_values`` hold one row per source,
        ``[B_src, H, S, d_k]`` with ``B`` a multiple of ``B_src``: rows ``j*K .. (j+1)*K - 1``
        (``K = B / B_src``, a source's beams) all attend to source ``j``, whose keys and values
        are then read once for its ``K`` rows (plain ``matmul`` / ``softmax``, the form the ONNX
        export traces; ``K = 1`` is one row per row). The rows of a source must have equal
        ``src_lengths``. Otherwise (default) they hold one row per row and the fused
        ``decode_attention`` runs.
        """
        if isinstance(self.tgt_pe, PositionalEncoding) and "norm" not in self.tgt_pe._modules:
            x = self.tgt_embed(input_ids) + self.tgt_pe.at(positions).unsqueeze(1).to(
                self.tgt_embed.lut.weight.dtype
            )
        else:
            x = self.tgt_pe.add_at(self.tgt_embed(input_ids), positions)
        position_biases = self.decoder.step_biases(positions, self_keys[0].shape[2])
        new_keys: list[torch.Tensor] = []
        new_values: list[torch.Tensor] = []
        kernel_linear = inference_kernels(self)
        if not kernel_linear:
            fused_qkv = None
        attention: list[torch.Tensor] = []
        cross_bias = None
        if cross_per_source:  # the source mask as an additive bias [B_src, 1, K, S], shared by every layer
            S = cross_keys[0].shape[2]
            keep = torch.arange(S, device=src_lengths.device)[None, :] < src_lengths[:, None]  # [B, S]
            bias = torch.where(keep, 0.0, float("-inf"))  # float32: one Where in the exported graph
            cross_bias = bias.view(cross_keys[0].shape[0], 1, -1, S)
        last = len(self.decoder.layers) - 1
        for i, layer in enumerate(self.decoder.layers):
            x, k_new, v_new = layer.step(
                x,
                positions,
                src_lengths,
                self_keys[i],
                self_values[i],
                cross_keys[i],
                cross_values[i],
                None if fused_qkv is None else fused_qkv[i],
                kernel_linear,
                attention if return_attention and i == last else None,
                cross_bias,
                position_biases[i],
            )
            new_keys.append(k_new)
            new_values.append(v_new)
        x = self.decoder.norm(x)  # [B, 1, d_model]
        if self.generator.scale != 1.0:
            x = x * self.generator.scale
        if kernel_linear:
            proj = self.generator.proj
            logits = ops.linear(x[:, 0], proj.weight, proj.bias).float()  # [B, V]
        else:
            logits = self.generator.proj(x[:, 0]).float()  # [B, V] (scaled above)
        if return_attention:
            return logits, new_keys, new_values, attention[0]
        return logits, new_keys, new_values
