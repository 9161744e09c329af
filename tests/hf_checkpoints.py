"""Checkpoint folders written by transformers itself, for the parity tests of transformer_ext.convert.

Each builder trains small SentencePiece models on sample text, writes the tokenizer files the way
transformers' tokenizers (or the real checkpoints) lay them out, builds a model from a config with
the real checkpoints' field values (scaled down) and random weights (``init_std`` 0.5 so that greedy
outputs vary), and calls ``save_pretrained``. Nothing here uses transformer_ext.
"""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import sentencepiece as spm
import torch

WORDS = (
    "the a house river cat dog number seven twelve green blue light night day über straße café "
    "naïve façade ünïcödé Ελλάδα мир 東京 año niño crème brûlée déjà vu 42 1999 3.14 -7 x2 "
    "hello world translation model small test sentence piece token"
).split()


def sample_lines(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        k = rng.randint(1, 10)
        words = [rng.choice(WORDS) for _ in range(k)]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 10000)))
        if rng.random() < 0.2:
            words.append(rng.choice(".,!?"))
        lines.append(" ".join(words))
    return lines


def train_spm(lines: list[str], vocab_size: int, model_type: str = "unigram", **kwargs) -> bytes:
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=out,
        vocab_size=vocab_size,
        model_type=model_type,
        character_coverage=1.0,
        minloglevel=2,
        **kwargs,
    )
    return out.getvalue()


def _pieces(model: bytes) -> list[str]:
    sp = spm.SentencePieceProcessor()
    sp.LoadFromSerializedProto(model)
    return [sp.id_to_piece(i) for i in range(sp.get_piece_size())]


def marian_vocab(model: bytes, languages: tuple[str, ...] = ()) -> dict[str, int]:
    """A Marian vocabulary: </s> 0, <unk> 1, language codes, the pieces, <pad> last."""
    vocab = {"</s>": 0, "<unk>": 1}
    for code in languages:
        vocab[f">>{code}<<"] = len(vocab)
    for p in _pieces(model):
        if p not in vocab and p not in ("<s>", "</s>", "<unk>"):
            vocab[p] = len(vocab)
    vocab["<pad>"] = len(vocab)
    return vocab


def _random_weights(model: torch.nn.Module, seed: int, std: float, gain: float = 1.0) -> None:
    """Embeddings and biases drawn at ``std``, weight matrices at ``gain/sqrt(fan_in)`` (activations
    of order one in every layer: the float32 rounding of the oracle itself stays far below the
    tests' 1e-4), LayerNorm gains around 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed_positions" in name:  # the sinusoid table, never trained
                continue
            noise = torch.randn(p.shape, generator=g)
            if "layer_norm" in name:
                p.copy_(1.0 + 0.2 * noise if name.endswith("weight") else 0.2 * noise)
            elif p.dim() == 2 and "embed" not in name and "shared" not in name:
                p.copy_(gain * noise / p.shape[1] ** 0.5)
            else:
                p.copy_(std * noise)


def write_marian(
    folder: Path,
    *,
    separate: bool = False,
    languages: tuple[str, ...] = (),
    d_model: int = 32,
    layers: int = 2,
    heads: int = 4,
    d_ff: int = 64,
    max_positions: int = 64,
    vocab_size: int = 120,
    seed: int = 0,
    std: float = 0.3,
    dtype: torch.dtype = torch.float32,
    num_beams: int = 4,
    max_length: int = 16,
    weights: str = "safetensors",
    gain: float = 2.0,
) -> Path:
    from transformers import GenerationConfig, MarianConfig, MarianMTModel

    folder.mkdir(parents=True, exist_ok=True)
    src_lines, tgt_lines = sample_lines(400, seed), sample_lines(400, seed + 1)
    src_spm = train_spm(src_lines, vocab_size)
    tgt_spm = train_spm(tgt_lines, vocab_size - 20) if separate else src_spm
    (folder / "source.spm").write_bytes(src_spm)
    (folder / "target.spm").write_bytes(tgt_spm)
    src_vocab = marian_vocab(src_spm, languages)
    if separate:
        tgt_vocab = marian_vocab(tgt_spm)
        assert len(tgt_vocab) < len(src_vocab)
        (folder / "target_vocab.json").write_text(json.dumps(tgt_vocab, ensure_ascii=False, indent=2))
    else:
        tgt_vocab = src_vocab
    (folder / "vocab.json").write_text(json.dumps(src_vocab, ensure_ascii=False, indent=2))
    pad = tgt_vocab["<pad>"]
    tok_cfg = {
        "tokenizer_class": "MarianTokenizer",
        "separate_vocabs": separate,
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "model_max_length": 512,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    config = MarianConfig(
        vocab_size=len(src_vocab),
        decoder_vocab_size=len(tgt_vocab),
        share_encoder_decoder_embeddings=not separate,
        d_model=d_model,
        encoder_layers=layers,
        decoder_layers=layers,
        encoder_attention_heads=heads,
        decoder_attention_heads=heads,
        encoder_ffn_dim=d_ff,
        decoder_ffn_dim=d_ff,
        max_position_embeddings=max_positions,
        activation_function="swish",
        scale_embedding=True,
        pad_token_id=pad,
        decoder_start_token_id=pad,
        eos_token_id=0,
        forced_eos_token_id=0,
        dropout=0.1,
        attention_dropout=0.0,
        init_std=std,
    )
    torch.manual_seed(seed)
    model = MarianMTModel(config)
    _random_weights(model, seed, std, gain)
    with torch.no_grad():
        model.final_logits_bias.copy_(0.5 * torch.randn(model.final_logits_bias.shape))
        model.get_input_embeddings().weight[pad].zero_()
        if separate:
            model.model.decoder.embed_tokens.weight[pad].zero_()
    model.tie_weights()
    model.generation_config = GenerationConfig(
        bad_words_ids=[[pad]],
        num_beams=num_beams,
        max_length=max_length,
        decoder_start_token_id=pad,
        pad_token_id=pad,
        eos_token_id=0,
        forced_eos_token_id=0,
        bos_token_id=None,
    )
    model = model.to(dtype)
    model.save_pretrained(folder)
    if weights == "bin":  # the layout of older checkpoints: a torch pickle of the state dict
        (folder / "model.safetensors").unlink()
        torch.save(model.state_dict(), folder / "pytorch_model.bin")
    return folder


def fairseq_vocab(model: bytes) -> dict[str, int]:
    """M2M100's vocab.json: fairseq's <s> 0, <pad> 1, </s> 2, <unk> 3, then the pieces."""
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    for p in _pieces(model):
        if p not in vocab:
            vocab[p] = len(vocab)
    return vocab


NLLB_TEST_CODES = ("eng_Latn", "fra_Latn", "deu_Latn", "spa_Latn", "zho_Hans", "rus_Cyrl")


def write_m2m100(
    folder: Path,
    *,
    nllb: bool = False,
    legacy: bool = False,
    d_model: int = 32,
    layers: int = 2,
    heads: int = 4,
    d_ff: int = 64,
    max_positions: int = 64,
    spm_size: int = 100,
    seed: int = 0,
    std: float = 0.2,
    num_beams: int = 4,
    max_length: int = 16,
    gain: float = 3.0,
) -> Path:
    """An M2M100 (``nllb=False``: vocab.json + the 100 m2m100 language codes) or NLLB
    (SentencePiece id + 1, a few FLORES codes listed in tokenizer_config.json) checkpoint."""
    from transformers import GenerationConfig, M2M100Config, M2M100ForConditionalGeneration

    folder.mkdir(parents=True, exist_ok=True)
    lines = sample_lines(500, seed)
    model_bytes = train_spm(lines, spm_size, model_type="bpe" if nllb else "unigram")
    (folder / "sentencepiece.bpe.model").write_bytes(model_bytes)
    if nllb:
        n_pieces = len(_pieces(model_bytes))
        codes = list(NLLB_TEST_CODES)
        vocab_size = n_pieces + 1 + len(codes) + 1 + 3  # pieces, languages, <mask>, padding rows
        tok_cfg = {
            "tokenizer_class": "NllbTokenizer",
            "src_lang": "eng_Latn",
            "tgt_lang": "fra_Latn",
            "legacy_behaviour": legacy,
            "additional_special_tokens": codes,
        }
    else:
        vocab = fairseq_vocab(model_bytes)
        (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False, indent=2))
        vocab_size = len(vocab) + 100 + 8  # + the m2m100 languages + 8 made-up words
        tok_cfg = {
            "tokenizer_class": "M2M100Tokenizer",
            "src_lang": "en",
            "tgt_lang": "de",
            "language_codes": "m2m100",
            "num_madeup_words": 8,
        }
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    config = M2M100Config(
        vocab_size=vocab_size,
        d_model=d_model,
        encoder_layers=layers,
        decoder_layers=layers,
        encoder_attention_heads=heads,
        decoder_attention_heads=heads,
        encoder_ffn_dim=d_ff,
        decoder_ffn_dim=d_ff,
        max_position_embeddings=max_positions,
        activation_function="relu",
        scale_embedding=True,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
        dropout=0.1,
        attention_dropout=0.1,
        encoder_layerdrop=0.0,
        decoder_layerdrop=0.0,
        init_std=std,
    )
    torch.manual_seed(seed)
    model = M2M100ForConditionalGeneration(config)
    _random_weights(model, seed, std, gain)
    with torch.no_grad():
        model.model.shared.weight[1].zero_()
    model.tie_weights()
    model.generation_config = GenerationConfig(
        num_beams=num_beams,
        max_length=max_length,
        decoder_start_token_id=2,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
    )
    model.save_pretrained(folder)
    return folder


MADLAD_TEST_CODES = ("de", "fr", "es", "zh")


def write_t5(
    folder: Path,
    *,
    variant: str = "t5",
    madlad: bool = False,
    d_model: int = 32,
    d_kv: int = 12,
    layers: int = 2,
    heads: int = 4,
    d_ff: int = 64,
    buckets: int = 8,
    max_distance: int = 20,
    spm_size: int = 100,
    extra_ids: int = 10,
    seed: int = 0,
    std: float = 0.5,
    num_beams: int = 4,
    max_length: int = 16,
    gain: float = 2.0,
) -> Path:
    """A T5-family checkpoint with the real models' field values (scaled down):

    * ``variant="t5"``: T5 v1.0 (``feed_forward_proj`` relu, tied output scaled by d_model^-0.5);
    * ``"t5_v1_1"``: T5 v1.1 (gated-gelu, an lm_head of its own, ``tie_word_embeddings`` false in
      config.json as the real files have it); ``madlad=True`` adds ``<2xx>`` pieces (MADLAD-400);
    * ``"mt5"``, ``"umt5"``: the same as v1.1 with their own model types (UMT5: a relative bias
      table in every layer).

    ``d_kv`` (12) differs from d_model / heads (8), as in t5-11b and MADLAD."""
    import transformers
    from safetensors.torch import load_file, save_file
    from transformers import GenerationConfig

    classes = {
        "t5": ("T5Config", "T5ForConditionalGeneration"),
        "t5_v1_1": ("T5Config", "T5ForConditionalGeneration"),
        "mt5": ("MT5Config", "MT5ForConditionalGeneration"),
        "umt5": ("UMT5Config", "UMT5ForConditionalGeneration"),
    }
    config_cls, model_cls = (getattr(transformers, n) for n in classes[variant])
    folder.mkdir(parents=True, exist_ok=True)
    lines = sample_lines(500, seed)
    symbols = [f"<2{c}>" for c in MADLAD_TEST_CODES] if madlad else []
    spm_model = train_spm(
        lines, spm_size, pad_id=0, eos_id=1, unk_id=2, bos_id=-1, user_defined_symbols=symbols
    )
    (folder / "spiece.model").write_bytes(spm_model)
    n_pieces = len(_pieces(spm_model))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {"tokenizer_class": "T5Tokenizer", "extra_ids": extra_ids, "model_max_length": 512}, indent=2
        )
    )
    v1_0 = variant == "t5"
    config = config_cls(
        vocab_size=n_pieces + extra_ids + 6,  # the real models round the vocabulary up too
        d_model=d_model,
        d_kv=d_kv,
        d_ff=d_ff,
        num_layers=layers,
        num_decoder_layers=layers,
        num_heads=heads,
        relative_attention_num_buckets=buckets,
        relative_attention_max_distance=max_distance,
        dropout_rate=0.1,
        layer_norm_epsilon=1e-6,
        feed_forward_proj="relu" if v1_0 else "gated-gelu",
        tie_word_embeddings=v1_0,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    torch.manual_seed(seed)
    model = model_cls(config)
    _random_weights(model, seed, std, gain)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "relative_attention_bias" in name:  # biases of order one: they change the outputs
                p.copy_(torch.randn(p.shape, generator=g))
    model.generation_config = GenerationConfig(
        num_beams=num_beams,
        max_length=max_length,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    model.save_pretrained(folder)
    if not v1_0:
        # transformers 5 ties lm_head to the embedding in memory and writes one tensor; the real
        # v1.1 / mT5 / UMT5 / MADLAD files hold an lm_head of their own and tie_word_embeddings false
        tensors = load_file(str(folder / "model.safetensors"))
        tensors["lm_head.weight"] = std * torch.randn(tensors["shared.weight"].shape, generator=g)
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        data = json.loads((folder / "config.json").read_text())
        data.pop("scale_decoder_outputs", None)
        data["tie_word_embeddings"] = False
        (folder / "config.json").write_text(json.dumps(data, indent=2))
    return folder


def write_mbart50(
    folder: Path,
    *,
    d_model: int = 32,
    layers: int = 2,
    heads: int = 4,
    d_ff: int = 64,
    max_positions: int = 64,
    spm_size: int = 100,
    seed: int = 0,
    std: float = 0.3,
    num_beams: int = 4,
    max_length: int = 16,
    gain: float = 2.0,
) -> Path:
    """An mBART-50 checkpoint (mbart-large-50-many-to-many-mmt's field values, scaled down):
    Pre-LN with layernorm_embedding, learned positions (offset 2), GELU, scaled embeddings,
    ``final_logits_bias``; the tokenizer files of MBart50Tokenizer (a unigram SentencePiece model:
    transformers reads it with a Unigram model)."""
    from transformers import GenerationConfig, MBartConfig, MBartForConditionalGeneration
    from transformers.models.mbart50.tokenization_mbart50 import FAIRSEQ_LANGUAGE_CODES

    folder.mkdir(parents=True, exist_ok=True)
    model_bytes = train_spm(sample_lines(500, seed), spm_size)
    (folder / "sentencepiece.bpe.model").write_bytes(model_bytes)
    n_pieces = len(_pieces(model_bytes))
    tok_cfg = {"tokenizer_class": "MBart50Tokenizer", "src_lang": "en_XX", "tgt_lang": "de_DE"}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    config = MBartConfig(
        vocab_size=n_pieces + 1 + len(FAIRSEQ_LANGUAGE_CODES) + 1,  # pieces, languages, <mask>
        d_model=d_model,
        encoder_layers=layers,
        decoder_layers=layers,
        encoder_attention_heads=heads,
        decoder_attention_heads=heads,
        encoder_ffn_dim=d_ff,
        decoder_ffn_dim=d_ff,
        max_position_embeddings=max_positions,
        activation_function="gelu",
        scale_embedding=True,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
        forced_eos_token_id=2,
        dropout=0.1,
        attention_dropout=0.1,
        init_std=std,
    )
    torch.manual_seed(seed)
    model = MBartForConditionalGeneration(config)
    _random_weights(model, seed, std, gain)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm_embedding" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.2 * torch.randn(p.shape, generator=g))
            elif "embed_positions" in name:  # learned: trained values
                p.copy_(std * torch.randn(p.shape, generator=g))
        model.model.shared.weight[1].zero_()
        model.final_logits_bias.copy_(0.5 * torch.randn(model.final_logits_bias.shape, generator=g))
    model.tie_weights()
    model.generation_config = GenerationConfig(
        num_beams=num_beams,
        max_length=max_length,
        decoder_start_token_id=2,
        forced_eos_token_id=2,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
    )
    model.save_pretrained(folder)
    return folder


def transformers_t5_tokenizer(folder: Path):
    """transformers' T5Tokenizer of a :func:`write_t5` folder. Its own reading of spiece.model goes
    through protobuf, which this environment's protobuf runtime refuses, so it is built from the
    model's pieces and scores (its own Unigram, pre-tokenizer, sentinels and ``</s>`` template;
    without SentencePiece's NFKC character map, which leaves the sample lines unchanged)."""
    from transformers import T5Tokenizer

    sp = spm.SentencePieceProcessor(model_file=str(folder / "spiece.model"))
    vocab = [(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())]
    extra = json.loads((folder / "tokenizer_config.json").read_text())["extra_ids"]
    return T5Tokenizer(vocab=vocab, extra_ids=extra)


def transformers_mbart50_tokenizer(folder: Path, src_lang: str, tgt_lang: str):
    """transformers' MBart50Tokenizer of a :func:`write_mbart50` folder, built from the SentencePiece
    model's pieces and scores (as :func:`transformers_t5_tokenizer`, for the same reason)."""
    from transformers import MBart50Tokenizer

    sp = spm.SentencePieceProcessor(model_file=str(folder / "sentencepiece.bpe.model"))
    vocab = [(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())]
    return MBart50Tokenizer(vocab=vocab, src_lang=src_lang, tgt_lang=tgt_lang)
