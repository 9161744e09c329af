"""The T5 and mBART-50 checkpoints of ``bench_pretrained.py``, and what each family's decode needs.

Each checkpoint is written by transformers from a config with the real model's field values and
random weights (``save_pretrained``), with SentencePiece tokenizer files of the right size, so that
our converter, CTranslate2's ``ct2-transformers-converter`` and Optimum's exporter read it as they
read the real model. Nothing here uses transformer_ext.

* ``t5`` (``--size t5-base``): google/t5-v1_1-base's shape (T5 v1.1, MADLAD-400's architecture):
  12+12 layers, d_model 768, d_kv 64, 12 heads, d_ff 2048 gated GELU (``gelu_new``), RMS norms, no
  biases, unscaled attention, a relative position bias (32 buckets, max distance 128) computed in
  the first layer and shared, an ``lm_head`` of its own (``tie_word_embeddings`` false), vocabulary
  32,128, decoder start ``<pad>`` (0), ``</s>`` 1. The SentencePiece model is small and
  ``extra_ids`` 0: the rows past it are the vocabulary's sentinel rows (CTranslate2 names them
  ``<extra_id_N>``, each once).
* ``mbart`` (``--size mbart-large-50``): facebook/mbart-large-50-many-to-many-mmt's shape: 12+12
  layers, d_model 1024, 16 heads, d_ff 4096, GELU, Pre-LN with ``layernorm_embedding``, learned
  positions (offset 2), scaled embeddings, tied output with ``final_logits_bias``, vocabulary
  250,054 (SentencePiece pieces + 1 fairseq offset + 52 language codes + ``<mask>``), decoder start
  ``</s>`` (2). The SentencePiece model reaches its 250,000 pieces with filler symbols
  (``user_defined_symbols``) beside the pieces learned from sample text.
"""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Specials:
    """What a decode of one checkpoint needs: the decoder start, ``</s>``, the ids never generated
    (the checkpoint's generation config's ``bad_words_ids``), and the ids a random source draws
    from, with the tokens it starts and ends with."""

    decoder_start: int
    eos: int
    banned: tuple[int, ...]
    source_ids: tuple[int, int]  # [low, high)
    source_prefix: tuple[int, ...] = ()
    source_suffix: tuple[int, ...] = ()

    def sources(self, batch: int, src_len: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """``batch`` sources of ``src_len`` ids: the prefix, random ids, the suffix."""
        rng = random.Random(seed)
        inner = src_len - len(self.source_prefix) - len(self.source_suffix)
        if inner < 1:
            raise ValueError(f"src_len {src_len} leaves no room between the source's special tokens")
        low, high = self.source_ids
        rows = [
            list(self.source_prefix)
            + [rng.randrange(low, high) for _ in range(inner)]
            + list(self.source_suffix)
            for _ in range(batch)
        ]
        return np.array(rows, dtype=np.int64), np.full(batch, src_len, dtype=np.int64)


def _tests_helpers():
    sys.path.insert(0, str(REPO / "tests"))
    import hf_checkpoints

    return hf_checkpoints


# ------------------------------------------------------------------------------------------
# T5 (v1.1)
# ------------------------------------------------------------------------------------------

T5_PAD, T5_EOS = 0, 1


def t5_specials(size: dict) -> Specials:
    """T5: decoder start ``<pad>``, nothing banned (its generation config bans nothing), sources of
    any id but the three specials, ``</s>`` last (as the tokenizer ends a source)."""
    return Specials(
        decoder_start=T5_PAD,
        eos=T5_EOS,
        banned=(),
        source_ids=(3, size["vocab_size"]),
        source_suffix=(T5_EOS,),
    )


def write_t5(folder: Path, size: dict) -> None:
    """A T5 v1.1 checkpoint of ``size`` written by transformers, random weights."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import GenerationConfig, T5Config, T5ForConditionalGeneration

    h = _tests_helpers()
    folder.mkdir(parents=True, exist_ok=True)
    spm = h.train_spm(h.sample_lines(500, 0), 100, pad_id=0, eos_id=1, unk_id=2, bos_id=-1)
    (folder / "spiece.model").write_bytes(spm)
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "T5Tokenizer", "extra_ids": 0, "model_max_length": 512}, indent=2)
    )
    config = T5Config(
        vocab_size=size["vocab_size"],
        d_model=size["d_model"],
        d_kv=size["d_kv"],
        d_ff=size["d_ff"],
        num_layers=size["layers"],
        num_decoder_layers=size["layers"],
        num_heads=size["heads"],
        relative_attention_num_buckets=size["buckets"],
        relative_attention_max_distance=size["max_distance"],
        dropout_rate=0.1,
        layer_norm_epsilon=1e-6,
        feed_forward_proj="gated-gelu",
        tie_word_embeddings=False,
        pad_token_id=T5_PAD,
        eos_token_id=T5_EOS,
        decoder_start_token_id=T5_PAD,
    )
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(config)
    # Random weights drawn as the parity tests' checkpoints draw them; the queries scaled by
    # d_kv^-0.5 (T5 does not scale its attention scores: its own initialisation puts the scale in
    # the query weights; unscaled, 64-wide heads give scores so sharp that float32 rounding decides
    # the attention and every engine decodes other tokens); relative biases of order one (they
    # change the outputs) and an lm_head whose logits spread widely (near-ties that float32
    # engines would break differently are rare).
    h._random_weights(model, 0, std=size["embed_std"], gain=size["gain"])
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "relative_attention_bias" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith(".q.weight"):
                p.mul_(size["d_kv"] ** -0.5)
    model.generation_config = GenerationConfig(
        num_beams=4, max_length=512, decoder_start_token_id=T5_PAD, pad_token_id=T5_PAD, eos_token_id=T5_EOS
    )
    model.save_pretrained(folder)
    # T5 v1.1 files hold an lm_head of their own and tie_word_embeddings false (transformers may
    # tie it to the embedding in memory and write one tensor)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["lm_head.weight"] = size["lm_std"] * torch.randn(tensors["shared.weight"].shape, generator=g)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    data = json.loads((folder / "config.json").read_text())
    data.pop("scale_decoder_outputs", None)
    data["tie_word_embeddings"] = False
    (folder / "config.json").write_text(json.dumps(data, indent=2))


# ------------------------------------------------------------------------------------------
# mBART-50
# ------------------------------------------------------------------------------------------

MBART_BOS, MBART_PAD, MBART_EOS = 0, 1, 2


def _mbart_codes() -> list[str]:
    from transformers.models.mbart50.tokenization_mbart50 import FAIRSEQ_LANGUAGE_CODES

    return list(FAIRSEQ_LANGUAGE_CODES)


def mbart_pieces(size: dict) -> int:
    """The SentencePiece model's size for ``size``'s vocabulary: pieces + the fairseq offset 1 +
    the language codes + ``<mask>``."""
    return size["vocab_size"] - 1 - len(_mbart_codes()) - 1


def mbart_specials(size: dict) -> Specials:
    """mBART-50: decoder start ``</s>``, nothing banned, sources ``en_XX`` + pieces + ``</s>`` (as
    MBart50Tokenizer writes them; the target language is not forced: every engine decodes freely
    from ``</s>``)."""
    first_code = mbart_pieces(size) + 1
    en = first_code + _mbart_codes().index("en_XX")
    return Specials(
        decoder_start=MBART_EOS,
        eos=MBART_EOS,
        banned=(),
        source_ids=(4, first_code),
        source_prefix=(en,),
        source_suffix=(MBART_EOS,),
    )


def write_mbart(folder: Path, size: dict) -> None:
    """An mBART-50 checkpoint of ``size`` written by transformers, random weights."""
    import torch
    from transformers import GenerationConfig, MBartConfig, MBartForConditionalGeneration

    h = _tests_helpers()
    folder.mkdir(parents=True, exist_ok=True)
    learned = 100
    n_pieces = mbart_pieces(size)
    fillers = [f"\u2581filler{i}" for i in range(max(0, n_pieces - learned))]
    spm = h.train_spm(
        h.sample_lines(500, 0), n_pieces, user_defined_symbols=fillers, hard_vocab_limit=not fillers
    )
    got = len(h._pieces(spm))
    if got != n_pieces:  # the vocabulary must match the embedding for every converter
        raise RuntimeError(f"the SentencePiece model has {got} pieces, expected {n_pieces}")
    (folder / "sentencepiece.bpe.model").write_bytes(spm)
    tok_cfg = {
        "tokenizer_class": "MBart50Tokenizer",
        "src_lang": "en_XX",
        "tgt_lang": "de_DE",
        # the special tokens as the real tokenizer_config.json names them (CTranslate2 reads them)
        "bos_token": "<s>",
        "eos_token": "</s>",
        "sep_token": "</s>",
        "cls_token": "<s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "mask_token": "<mask>",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    config = MBartConfig(
        vocab_size=size["vocab_size"],
        d_model=size["d_model"],
        encoder_layers=size["layers"],
        decoder_layers=size["layers"],
        encoder_attention_heads=size["heads"],
        decoder_attention_heads=size["heads"],
        encoder_ffn_dim=size["d_ff"],
        decoder_ffn_dim=size["d_ff"],
        max_position_embeddings=size["max_positions"],
        activation_function="gelu",
        scale_embedding=True,
        pad_token_id=MBART_PAD,
        bos_token_id=MBART_BOS,
        eos_token_id=MBART_EOS,
        decoder_start_token_id=MBART_EOS,
        forced_eos_token_id=MBART_EOS,
        tokenizer_class="MBart50Tokenizer",  # as the real config.json: CTranslate2 reads it
        # fields of the real config.json that transformers does not use and CTranslate2 reads
        normalize_before=True,
        normalize_embedding=True,
        add_final_layer_norm=True,
        add_bias_logits=False,
        static_position_embeddings=False,
        dropout=0.1,
        attention_dropout=0.1,
    )
    torch.manual_seed(0)
    model = MBartForConditionalGeneration(config)
    h._random_weights(model, 0, std=size["embed_std"], gain=size["gain"])
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm_embedding" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.2 * torch.randn(p.shape, generator=g))
            elif "embed_positions" in name:  # learned: trained values
                p.copy_(size["embed_std"] * torch.randn(p.shape, generator=g))
        model.model.shared.weight[MBART_PAD].zero_()
        model.final_logits_bias.copy_(0.5 * torch.randn(model.final_logits_bias.shape, generator=g))
    model.tie_weights()
    model.generation_config = GenerationConfig(
        num_beams=5,
        max_length=200,
        decoder_start_token_id=MBART_EOS,
        forced_eos_token_id=MBART_EOS,
        pad_token_id=MBART_PAD,
        bos_token_id=MBART_BOS,
        eos_token_id=MBART_EOS,
    )
    model.save_pretrained(folder)
