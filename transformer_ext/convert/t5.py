"""The T5 family (``model_type`` ``t5``, ``mt5``, ``umt5``; MADLAD-400 is a ``t5``) read from a
transformers checkpoint folder, in this package's terms (used by :mod:`transformer_ext.convert.hf`).

How the family maps onto :class:`~transformer_ext.config.TransformerConfig` (checked against
transformers' ``modeling_t5.py`` / ``modeling_umt5.py`` by the parity tests):

* Pre-LN with RMSNorm (``norm="rms"``: scale only, no mean, no shift; ``layer_norm_epsilon``) and
  final norms in both stacks; no bias in any linear; unscaled attention scores
  (``scale_attention=False``); the head width ``d_kv`` is its own field; no absolute positions
  (``positions="none"``) and unscaled embeddings.
* The relative position bias: ``relative_attention_num_buckets`` and
  ``relative_attention_max_distance``, bidirectional in the encoder, causal in the decoder
  self-attention, none in the cross-attention; one table per stack held by its first layer
  (t5, mt5) or one per layer (umt5: ``relative_attention_per_layer``).
* ``feed_forward_proj``: ``relu`` (``DenseReluDense.wi`` / ``wo``) or ``gated-gelu``
  (``wi_0`` through the tanh GELU times ``wi_1``, then ``wo``: ``gated_ffn``, ``gelu_tanh``).
* One embedding (``shared``) for encoder and decoder. The output projection is that embedding
  unless the weights hold an ``lm_head.weight`` that differs from it (T5 v1.1, mT5, MADLAD); the
  decoder output is multiplied by d_model^-0.5 before the projection where transformers does it:
  t5 / umt5 with ``scale_decoder_outputs`` (or, in configs without it, ``tie_word_embeddings`` not
  false), never mt5.
* Decoder start ``decoder_start_token_id`` (``<pad>``, 0), EOS 1.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional

from ..cli import UserError
from ..config import TransformerConfig
from ..pretrained_tokenizers import T5Tokenizer
from .hf import ConversionError, _Fields, _read_bytes, _take

__all__ = ["MODEL_TYPES", "t5_config", "t5_weights", "t5_tokenizer", "retie"]

MODEL_TYPES = {
    "t5": ("T5ForConditionalGeneration",),
    "mt5": ("MT5ForConditionalGeneration",),
    "umt5": ("UMT5ForConditionalGeneration",),
}
FEED_FORWARD = {"relu": ("relu", False), "gated-gelu": ("gelu_tanh", True)}
_ACT_FN = {"relu": "relu", "gated-gelu": "gelu_new"}  # transformers' dense_act_fn of each
DEFAULT_MAX_LEN = 512  # the longest source or target, where the config gives no n_positions


def t5_config(f: _Fields, model_type: str) -> tuple[dict, dict]:
    """Our config values (and extras for the weight mapping) from a T5-family config.json."""
    proj = f.get("feed_forward_proj", str, "relu")
    if proj not in FEED_FORWARD:
        raise ConversionError(
            f"{f.source}: unsupported architecture option feed_forward_proj = {json.dumps(proj)} "
            f"(supported: {', '.join(json.dumps(k) for k in FEED_FORWARD)})"
        )
    f.require("dense_act_fn", (_ACT_FN[proj],))
    f.require("is_gated_act", (FEED_FORWARD[proj][1],))
    f.require("is_encoder_decoder", (True,))
    activation, gated = FEED_FORWARD[proj]
    layers = f.get("num_layers", int)
    decoder_layers = f.get("num_decoder_layers", int, None, allow_none=True) or layers
    pad = f.get("pad_token_id", int, 0)
    if model_type == "mt5":
        scale_output = False
    elif "scale_decoder_outputs" in f.data:
        scale_output = f.get("scale_decoder_outputs", bool)
    else:
        scale_output = f.get("tie_word_embeddings", bool, True) is not False
    vocab = f.get("vocab_size", int)
    values = dict(
        shared_vocab=True,
        tie_target_embeddings=True,
        src_vocab_size=vocab,
        tgt_vocab_size=vocab,
        d_model=f.get("d_model", int),
        n_heads=f.get("num_heads", int),
        d_kv=f.get("d_kv", int),
        n_encoder_layers=layers,
        n_decoder_layers=decoder_layers,
        d_ff=f.get("d_ff", int),
        dropout=f.get("dropout_rate", float, 0.1),
        max_len=f.get("n_positions", int, DEFAULT_MAX_LEN),
        norm_first=True,
        norm="rms",
        layer_norm_eps=f.get("layer_norm_epsilon", float, 1e-6),
        bias=False,
        scale_attention=False,
        relative_attention_buckets=f.get("relative_attention_num_buckets", int, 32),
        relative_attention_max_distance=f.get("relative_attention_max_distance", int, 128),
        relative_attention_per_layer=model_type == "umt5",
        positions="none",
        scale_embeddings=False,
        activation=activation,
        gated_ffn=gated,
        scale_decoder_output=scale_output,
        output_bias=False,
        pad_id=pad,
        bos_id=f.get("decoder_start_token_id", int, pad),
        eos_id=f.get("eos_token_id", int, 1),
    )
    return values, {}


def untied(hf: dict) -> bool:
    """True when the weights hold an output projection of their own (not a copy of ``shared``)."""
    import torch

    head, shared = hf.get("lm_head.weight"), hf.get("shared.weight")
    if head is None or shared is None:
        return False
    return head.shape != shared.shape or not torch.equal(head.float(), shared.float())


def _stack_map(config: TransformerConfig, stack: str, n_layers: int) -> dict[str, str]:
    names: dict[str, str] = {}
    decoder = stack == "decoder"
    ffn_index = 2 if decoder else 1
    for i in range(n_layers):
        ours, theirs = f"{stack}.layers.{i}.", f"{stack}.block.{i}.layer."
        for h, o in zip("qkvo", ("W_Q", "W_K", "W_V", "W_O")):
            names[f"{ours}self_attn.{o}.weight"] = f"{theirs}0.SelfAttention.{h}.weight"
            if decoder:
                names[f"{ours}src_attn.{o}.weight"] = f"{theirs}1.EncDecAttention.{h}.weight"
        names[f"{ours}sublayer.0.norm.weight"] = f"{theirs}0.layer_norm.weight"
        if decoder:
            names[f"{ours}sublayer.1.norm.weight"] = f"{theirs}1.layer_norm.weight"
        ff = f"{theirs}{ffn_index}.DenseReluDense."
        if config.gated_ffn:
            names[f"{ours}feed_forward.w_1.weight"] = f"{ff}wi_0.weight"
            names[f"{ours}feed_forward.w_3.weight"] = f"{ff}wi_1.weight"
        else:
            names[f"{ours}feed_forward.w_1.weight"] = f"{ff}wi.weight"
        names[f"{ours}feed_forward.w_2.weight"] = f"{ff}wo.weight"
        names[f"{ours}sublayer.{ffn_index}.norm.weight"] = f"{theirs}{ffn_index}.layer_norm.weight"
        if config.relative_attention_per_layer:
            names[f"{ours}relative_bias.relative_attention_bias.weight"] = (
                f"{theirs}0.SelfAttention.relative_attention_bias.weight"
            )
    if not config.relative_attention_per_layer:
        names[f"{stack}.relative_bias.relative_attention_bias.weight"] = (
            f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
        )
    names[f"{stack}.norm.weight"] = f"{stack}.final_layer_norm.weight"
    return names


# Stored by some checkpoints, never used by transformers (its loader ignores it too).
_IGNORED = ("decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight",)


def t5_weights(
    model_type: str, hf: dict, config: TransformerConfig, folder: Path, extra: dict
) -> tuple[dict, Optional[str]]:
    """Our state dict (float32) from a T5-family checkpoint's tensors, every shape checked."""
    import torch

    used = {name for name in _IGNORED if name in hf}
    names = {
        **_stack_map(config, "encoder", config.n_encoder_layers),
        **_stack_map(config, "decoder", config.n_decoder_layers),
    }
    missing = sorted(t for t in names.values() if t not in hf)
    if missing:
        raise ConversionError(
            f"{folder}: missing tensors {missing[:8]}{' ...' if len(missing) > 8 else ''} "
            f"({len(missing)} in all) for a {model_type} model with this config"
        )
    from ..model import Transformer

    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in Transformer(config).state_dict().items()}
    out: dict = {}
    for ours, theirs in names.items():
        tensor = hf[theirs]
        if tuple(tensor.shape) != shapes[ours]:
            what = (
                f"[relative_attention_num_buckets, num_heads] = {list(shapes[ours])}"
                if "relative_attention_bias" in theirs
                else f"{list(shapes[ours])} for this config"
            )
            raise ConversionError(
                f"{folder}: tensor {theirs} has shape {list(tensor.shape)}, expected {what}"
            )
        out[ours] = tensor
        used.add(theirs)
    aliases = ["shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight"]
    if config.tie_target_embeddings:
        emb = _take(hf, aliases + ["lm_head.weight"], "shared embedding", folder, used)
        out["src_embed.lut.weight"] = emb
    else:
        emb = _take(hf, aliases, "shared embedding", folder, used)
        out["src_embed.lut.weight"] = emb
        out["tgt_embed.lut.weight"] = emb.clone()
        out["generator.proj.weight"] = _take(hf, ["lm_head.weight"], "output projection", folder, used)
    for name in ("src_embed.lut.weight", "generator.proj.weight"):
        if name in out and tuple(out[name].shape) != shapes[name]:
            raise ConversionError(
                f"{folder}: the {'embedding' if 'embed' in name else 'lm_head'} has shape "
                f"{list(out[name].shape)}, expected {list(shapes[name])} (vocab_size, d_model)"
            )
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
    upcast = next(
        (str(d).replace("torch.", "") for d in (torch.float16, torch.bfloat16) if d in dtypes), None
    )
    return {k: v.to(torch.float32).contiguous() for k, v in out.items()}, upcast


def t5_tokenizer(folder: Path, config: TransformerConfig, files: list[Path]) -> T5Tokenizer:
    path = folder / "spiece.model"
    blob = _read_bytes(
        path, "a T5, mT5, UMT5 or MADLAD-400 checkpoint ships its SentencePiece model spiece.model"
    )
    files.append(path)
    try:
        return T5Tokenizer(blob, config.tgt_vocab_size)
    except UserError as exc:
        raise ConversionError(f"{folder}: the tokenizer files do not make a T5 tokenizer: {exc}") from None


def retie(config: TransformerConfig, hf: dict) -> TransformerConfig:
    """The config with the output projection the weights show: one embedding for encoder and
    decoder and a tied projection, or (an ``lm_head`` of its own) the embedding copied to both
    stacks and a separate projection."""
    if untied(hf):
        return dataclasses.replace(config, shared_vocab=False, tie_target_embeddings=False)
    return config
