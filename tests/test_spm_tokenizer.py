"""SentencePiece tokenizer: round trips, special ids, save/load, bad vocabularies and files."""

import json

import pytest

pytest.importorskip("sentencepiece")

from transformer_ext.spm_tokenizer import (
    SHARED_MODEL_FILE,
    SOURCE_MODEL_FILE,
    TARGET_MODEL_FILE,
    SentencePieceTokenizer,
    load_any_tokenizer,
)
from transformer_ext.tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    TOKENIZER_FILE,
    UNK_ID,
    CharTokenizer,
    TokenizerError,
)

SOURCES = [
    f"the {w} man saw {n} sheep in the field of {c}."
    for w in ("old", "young", "tall", "wise")
    for n in ("two", "three", "seven", "many")
    for c in ("Moab", "Judah", "Egypt")
]
TARGETS = [
    f"der {w} Mann sah {n} Schafe auf dem Feld von {c}."
    for w in ("alte", "junge", "große", "weise")
    for n in ("zwei", "drei", "sieben", "viele")
    for c in ("Moab", "Juda", "Ägypten")
]


@pytest.fixture(scope="module")
def shared():
    return SentencePieceTokenizer.train(SOURCES, TARGETS, vocab_size=60, shared=True)


@pytest.mark.parametrize("model_type", ["unigram", "bpe"])
def test_round_trip_and_special_ids(model_type):
    tok = SentencePieceTokenizer.train(SOURCES, TARGETS, vocab_size=36, model_type=model_type, shared=False)
    assert (
        (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id) == (PAD_ID, BOS_ID, EOS_ID, UNK_ID) == (0, 1, 2, 3)
    )
    # the ids SentencePiece itself assigns to the special pieces are the model's (no remapping)
    for sp in (tok._src, tok._tgt):
        assert [sp.id_to_piece(i) for i in range(4)] == ["<pad>", "<s>", "</s>", "<unk>"]
    assert tok.src_vocab_size == tok.tgt_vocab_size == 36
    for text in TARGETS[:5]:
        ids = tok.encode_target(text)
        assert all(i >= 4 for i in ids)
        assert tok.decode_target(ids + [EOS_ID, 7, 8]) == text  # decoding stops at eos
    for text in SOURCES[:5]:
        assert tok.decode_source(tok.encode_source(text)) == text


def test_decode_skips_specials(shared):
    ids = shared.encode_target(TARGETS[0])
    assert shared.decode_target([BOS_ID, PAD_ID] + ids + [EOS_ID] + ids) == TARGETS[0]
    assert shared.decode_target([UNK_ID] + ids + [10**6]) == TARGETS[0]  # unk and out-of-range ids skipped


def test_whitespace_normalised(shared):
    assert shared.encode_source("  the  old man ") == shared.encode_source("the old man")


def test_save_load(tmp_path, shared):
    shared.save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([TOKENIZER_FILE, SHARED_MODEL_FILE])
    assert shared.files == (TOKENIZER_FILE, SHARED_MODEL_FILE)
    again = SentencePieceTokenizer.load(tmp_path)
    assert again == shared
    assert again.encode_source(SOURCES[3]) == shared.encode_source(SOURCES[3])
    assert json.loads((tmp_path / TOKENIZER_FILE).read_text())["type"] == "sentencepiece"
    assert isinstance(load_any_tokenizer(tmp_path), SentencePieceTokenizer)


def test_save_load_separate(tmp_path):
    tok = SentencePieceTokenizer.train(SOURCES, TARGETS, vocab_size=36, shared=False)
    tok.save(tmp_path)
    assert set(tok.files) == {TOKENIZER_FILE, SOURCE_MODEL_FILE, TARGET_MODEL_FILE}
    assert SentencePieceTokenizer.load(tmp_path) == tok


def test_char_tokenizer_still_loads(tmp_path):
    CharTokenizer.build(["ab"], ["cd"]).save(tmp_path)
    assert isinstance(load_any_tokenizer(tmp_path), CharTokenizer)


def test_vocab_too_large_is_rephrased():
    with pytest.raises(
        TokenizerError, match=r"--vocab-size 5000 is more than .* at most \d+ pieces.*lower --vocab-size"
    ):
        SentencePieceTokenizer.train(SOURCES[:3], TARGETS[:3], vocab_size=5000)


def test_vocab_too_small():
    with pytest.raises(
        TokenizerError, match=r"--vocab-size 20 is too small .* characters alone need \d+ pieces"
    ):
        SentencePieceTokenizer.train(SOURCES, TARGETS, vocab_size=20)
    with pytest.raises(TokenizerError, match="--vocab-size must be an integer >= 8"):
        SentencePieceTokenizer.train(SOURCES, TARGETS, vocab_size=3)


def test_model_file_swapped_is_detected(tmp_path, shared):
    other = SentencePieceTokenizer.train(SOURCES, TARGETS, vocab_size=50)
    shared.save(tmp_path / "a")
    other.save(tmp_path / "b")
    (tmp_path / "a" / SHARED_MODEL_FILE).write_bytes((tmp_path / "b" / SHARED_MODEL_FILE).read_bytes())
    with pytest.raises(TokenizerError, match="does not match tokenizer.json"):
        SentencePieceTokenizer.load(tmp_path / "a")


def test_missing_model_file(tmp_path, shared):
    shared.save(tmp_path)
    (tmp_path / SHARED_MODEL_FILE).unlink()
    with pytest.raises(FileNotFoundError, match="spm.model"):
        SentencePieceTokenizer.load(tmp_path)


def test_special_id_collision_in_description(tmp_path, shared):
    shared.save(tmp_path)
    data = json.loads((tmp_path / TOKENIZER_FILE).read_text())
    data["special_tokens"]["eos"] = 1  # collides with bos
    (tmp_path / TOKENIZER_FILE).write_text(json.dumps(data))
    with pytest.raises(TokenizerError, match="special token ids"):
        SentencePieceTokenizer.load(tmp_path)


def test_foreign_sentencepiece_model_with_other_ids_is_refused():
    import io

    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(SOURCES), model_writer=buf, vocab_size=30, minloglevel=2
    )  # SentencePiece's defaults: unk 0, bos 1, eos 2, no pad
    with pytest.raises(TokenizerError, match="special ids"):
        SentencePieceTokenizer(buf.getvalue())


def test_unknown_field_refused(tmp_path, shared):
    shared.save(tmp_path)
    data = json.loads((tmp_path / TOKENIZER_FILE).read_text())
    data["extra"] = 1
    (tmp_path / TOKENIZER_FILE).write_text(json.dumps(data))
    with pytest.raises(TokenizerError, match="unknown fields"):
        SentencePieceTokenizer.load(tmp_path)
