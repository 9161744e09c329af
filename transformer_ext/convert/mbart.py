"""mBART-50 (``model_type`` ``mbart``, ``MBartForConditionalGeneration``) read from a transformers
checkpoint folder, in this package's terms (used by :mod:`transformer_ext.convert.hf`).

How it maps onto :class:`~transformer_ext.config.TransformerConfig` (checked against transformers'
``modeling_mbart.py`` by the parity tests): Pre-LN with final encoder and decoder LayerNorms, a
LayerNorm after embeddings + positions (``layernorm_embedding``: ``embedding_norm``), learned
positions whose row of token ``t`` is ``t + 2`` (``positions="learned"``, ``pos_offset=2``),
``activation_function`` (GELU), embeddings times sqrt(d_model) when ``scale_embedding``, one
embedding for encoder, decoder and the output projection, ``final_logits_bias`` as
``output_bias``. The decoder starts from ``</s>`` and the target language is forced as the first
generated token (``forced_bos_token_id``).

The tokenizer is mBART-50's (``MBart50Tokenizer``): ``sentencepiece.bpe.model`` with fairseq's ids
(``<s>`` 0, ``<pad>`` 1, ``</s>`` 2, ``<unk>`` 3, SentencePiece's id + 1), the 52 language codes
after the pieces, then ``<mask>``; a source is ``[src_lang] pieces </s>``. mbart-large-cc25's
tokenizer (``MBartTokenizer``: the language code after ``</s>``, a language code as decoder start)
is not supported.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from ..cli import UserError
from ..config import TransformerConfig
from ..pretrained_tokenizers import FairseqTokenizer
from .hf import ConversionError, _common, _Fields, _layer_map, _read_bytes, _read_json, _take

__all__ = ["MODEL_TYPES", "MBART50_LANGUAGE_CODES", "mbart_config", "mbart_weights", "mbart_tokenizer"]

MODEL_TYPES = {"mbart": ("MBartForConditionalGeneration",)}
POSITION_OFFSET = 2  # MBartLearnedPositionalEmbedding's offset

# mBART-50's language codes; their order gives the ids (after the SentencePiece pieces).
MBART50_LANGUAGE_CODES = tuple(
    "ar_AR cs_CZ de_DE en_XX es_XX et_EE fi_FI fr_XX gu_IN hi_IN it_IT ja_XX kk_KZ ko_KR lt_LT lv_LV my_MM "
    "ne_NP nl_XX ro_RO ru_RU si_LK tr_TR vi_VN zh_CN af_ZA az_AZ bn_IN fa_IR he_IL hr_HR id_ID ka_GE km_KH "
    "mk_MK ml_IN mn_MN mr_IN pl_PL ps_AF pt_XX sv_SE sw_KE ta_IN te_IN th_TH tl_XX uk_UA ur_PK xh_ZA gl_ES "
    "sl_SI".split()
)


def mbart_config(f: _Fields) -> tuple[dict, dict]:
    f.require("add_bias_logits", (False,))
    f.require("normalize_before", (True,))
    f.require("add_final_layer_norm", (True,))
    tied = f.get("tie_word_embeddings", bool, True)
    if not tied:
        raise ConversionError(f"{f.source}: unsupported architecture option tie_word_embeddings = false")
    vocab = f.get("vocab_size", int)
    pad = f.get("pad_token_id", int)
    values = dict(
        _common(f),
        src_vocab_size=vocab,
        tgt_vocab_size=vocab,
        shared_vocab=True,
        tie_target_embeddings=True,
        norm_first=True,
        positions="learned",
        pos_offset=POSITION_OFFSET,
        embedding_norm=True,
        output_bias=True,
        pad_id=pad,
        bos_id=f.get("decoder_start_token_id", int),
        eos_id=f.get("eos_token_id", int),
    )
    return values, {}


def mbart_weights(
    model_type: str, hf: dict, config: TransformerConfig, folder: Path, extra: dict
) -> tuple[dict, Optional[str]]:
    """Our state dict (float32) from an mBART checkpoint's tensors, every shape checked."""
    import torch

    from ..model import Transformer

    names = dict(_layer_map(config))
    for ours, theirs in (("src_pe", "model.encoder"), ("tgt_pe", "model.decoder")):
        names[f"{ours}.table.weight"] = f"{theirs}.embed_positions.weight"
        for p in ("weight", "bias"):
            names[f"{ours}.norm.{p}"] = f"{theirs}.layernorm_embedding.{p}"
    missing = sorted(t for t in names.values() if t not in hf)
    if missing:
        raise ConversionError(
            f"{folder}: missing tensors {missing[:8]}{' ...' if len(missing) > 8 else ''} "
            f"({len(missing)} in all) for an mbart model with this config"
        )
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in Transformer(config).state_dict().items()}
    used: set = set()
    out: dict = {}
    for ours, theirs in names.items():
        if tuple(hf[theirs].shape) != shapes[ours]:
            raise ConversionError(
                f"{folder}: tensor {theirs} has shape {list(hf[theirs].shape)}, expected {list(shapes[ours])}"
            )
        out[ours] = hf[theirs]
        used.add(theirs)
    shared = ["model.shared.weight", "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight"]
    out["src_embed.lut.weight"] = _take(hf, shared + ["lm_head.weight"], "shared embedding", folder, used)
    bias = _take(hf, ["final_logits_bias"], "final_logits_bias", folder, used)
    if bias.dim() != 2 or bias.shape[0] != 1 or bias.shape[1] != config.tgt_vocab_size:
        raise ConversionError(
            f"{folder}: final_logits_bias has shape {list(bias.shape)}, expected [1, {config.tgt_vocab_size}]"
        )
    out["generator.proj.bias"] = bias[0]
    if tuple(out["src_embed.lut.weight"].shape) != shapes["src_embed.lut.weight"]:
        raise ConversionError(
            f"{folder}: the shared embedding has shape {list(out['src_embed.lut.weight'].shape)}, expected "
            f"{list(shapes['src_embed.lut.weight'])} (vocab_size, d_model)"
        )
    unexpected = sorted(set(hf) - used)
    if unexpected:
        raise ConversionError(
            f"{folder}: unexpected tensors {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''} "
            f"({len(unexpected)} in all) for an mbart model with this config"
        )
    dtypes = {t.dtype for t in out.values()}
    bad = [d for d in dtypes if d not in (torch.float32, torch.float16, torch.bfloat16)]
    if bad:
        raise ConversionError(f"{folder}: weights of dtype {bad[0]} (expected float32, float16 or bfloat16)")
    upcast = next(
        (str(d).replace("torch.", "") for d in (torch.float16, torch.bfloat16) if d in dtypes), None
    )
    return {k: v.to(torch.float32).contiguous() for k, v in out.items()}, upcast


def mbart_tokenizer(folder: Path, config: TransformerConfig, files: list[Path]) -> FairseqTokenizer:
    tok_cfg_path = folder / "tokenizer_config.json"
    tok_cfg = _read_json(tok_cfg_path) if tok_cfg_path.is_file() else {}
    if tok_cfg_path.is_file():
        files.append(tok_cfg_path)
    if not isinstance(tok_cfg, dict):
        raise ConversionError(f"{tok_cfg_path}: expected a JSON object")
    cls = str(tok_cfg.get("tokenizer_class") or "MBart50Tokenizer")
    if not cls.startswith("MBart50"):
        raise ConversionError(
            f"{tok_cfg_path}: unsupported tokenizer tokenizer_class = {json.dumps(cls)} (supported: "
            '"MBart50Tokenizer", mBART-50\'s)'
        )
    spm_path = folder / "sentencepiece.bpe.model"
    spm = _read_bytes(spm_path, "an mBART-50 checkpoint ships its SentencePiece model")
    files.append(spm_path)
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor()
    try:
        sp.LoadFromSerializedProto(spm)
    except (RuntimeError, OSError, TypeError) as exc:
        raise ConversionError(f"{spm_path} is not a SentencePiece model: {exc}") from None
    base = int(sp.get_piece_size()) + 1  # fairseq offset 1; the languages follow the pieces
    languages = {code: base + i for i, code in enumerate(MBART50_LANGUAGE_CODES)}
    try:
        # mBART-50's ids are the NLLB scheme (SentencePiece id + 1, languages after the pieces,
        # the source language first): the fairseq tokenizer's "nllb" flavour
        return FairseqTokenizer(
            "nllb",
            spm,
            languages,
            config.tgt_vocab_size,
            legacy=False,
            source_lang=tok_cfg.get("src_lang"),
            target_lang=tok_cfg.get("tgt_lang"),
        )
    except UserError as exc:
        raise ConversionError(
            f"{folder}: the tokenizer files do not make an mBART-50 tokenizer: {exc}"
        ) from None
