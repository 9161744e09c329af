"""CharTokenizer: vocabularies, round trips, special ids, persistence and its errors; the Tokenizer
protocol and load_tokenizer's dispatch on the file's type."""

import json

import pytest

from transformer_ext.tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    SPECIAL_TOKENS,
    TOKENIZER_TYPES,
    UNK_ID,
    CharTokenizer,
    Tokenizer,
    TokenizerError,
    UnknownCharacterError,
    check_model_config,
    load_tokenizer,
)

SOURCES = ["three hundred and forty-two", "one thousand, two hundred", "zero"]
TARGETS = ["dreihundertzweiundvierzig", "eintausendzweihundert", "null", "zwölf"]


@pytest.fixture
def tok():
    return CharTokenizer.build(SOURCES, TARGETS, lowercase=True)


def test_special_ids():
    assert (PAD_ID, BOS_ID, EOS_ID, UNK_ID) == (0, 1, 2, 3)
    assert SPECIAL_TOKENS == ("<pad>", "<s>", "</s>", "<unk>")


def test_vocab_is_sorted_characters_after_specials(tok):
    assert tok.source_vocab[:4] == list(SPECIAL_TOKENS)
    assert tok.source_vocab[4:] == sorted(set("".join(SOURCES)))
    assert tok.target_vocab[4:] == sorted(set("".join(TARGETS)))
    assert tok.src_vocab_size == 4 + len(set("".join(SOURCES)))
    assert tok.tgt_vocab_size == 4 + len(set("".join(TARGETS)))
    # the order of the training text does not matter
    assert CharTokenizer.build(SOURCES[::-1], TARGETS[::-1], lowercase=True) == tok


@pytest.mark.parametrize("text", SOURCES)
def test_source_round_trip(tok, text):
    ids = tok.encode_source(text)
    assert len(ids) == len(text)
    assert all(i >= 4 for i in ids)
    assert tok.decode_source(ids) == text


@pytest.mark.parametrize("text", TARGETS)
def test_target_round_trip(tok, text):
    ids = tok.encode_target(text)
    assert BOS_ID not in ids and EOS_ID not in ids
    assert tok.decode_target(ids) == text
    assert tok.decode_target([BOS_ID] + ids + [EOS_ID]) == text


def test_decode_target_stops_at_eos_and_skips_specials(tok):
    ids = tok.encode_target("null")
    assert tok.decode_target([BOS_ID, ids[0], PAD_ID, UNK_ID] + ids[1:] + [EOS_ID] + ids) == "null"
    assert tok.decode_target([EOS_ID] + ids) == ""
    assert tok.decode_target([tok.tgt_vocab_size + 5] + ids) == "null"  # out of range: skipped


def test_lowercase_source(tok):
    assert tok.encode_source("Forty-Two") == tok.encode_source("forty-two")
    plain = CharTokenizer.build(SOURCES, TARGETS)
    with pytest.raises(UnknownCharacterError):
        plain.encode_source("Zero")


def test_unknown_characters_raise_with_a_clear_message(tok):
    with pytest.raises(UnknownCharacterError) as info:
        tok.encode_source("forty-two!?")
    message = str(info.value)
    assert "'!' at 9" in message and "'?' at 10" in message and "source vocabulary" in message
    assert info.value.unknown == [(9, "!"), (10, "?")]
    assert isinstance(info.value, ValueError)
    with pytest.raises(UnknownCharacterError, match="target vocabulary"):
        tok.encode_target("dreiß€")


def test_unknown_characters_to_unk_on_request(tok):
    ids = tok.encode_source("two!", unknown="unk")
    assert ids[-1] == UNK_ID and ids[:-1] == tok.encode_source("two")
    with pytest.raises(ValueError, match="unknown must be"):
        tok.encode_source("two", unknown="ignore")


def test_shared_vocabulary():
    shared = CharTokenizer.build(SOURCES, TARGETS, shared=True)
    assert shared.shared
    assert shared.source_vocab == shared.target_vocab
    assert shared.src_vocab_size == shared.tgt_vocab_size == 4 + len(set("".join(SOURCES + TARGETS)))
    assert shared.decode_target(shared.encode_source("zero")) == "zero"


@pytest.mark.parametrize("shared", [False, True])
def test_save_load_round_trip(tmp_path, tok, shared):
    tok = CharTokenizer.build(SOURCES, TARGETS, shared=shared, lowercase=True)
    path = tok.save(tmp_path / "model")
    assert path.endswith("tokenizer.json")
    loaded = CharTokenizer.load(tmp_path / "model")
    assert loaded == tok
    assert loaded.shared == shared and loaded.lowercase
    assert loaded.encode_source("Zero") == tok.encode_source("zero")
    assert CharTokenizer.load(path) == tok  # the file path works too
    data = json.loads((tmp_path / "model" / "tokenizer.json").read_text(encoding="utf-8"))
    assert data["special_tokens"] == {"pad": 0, "bos": 1, "eos": 2, "unk": 3}


def test_load_missing_directory_and_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        CharTokenizer.load(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        CharTokenizer.load(tmp_path / "empty")


@pytest.mark.parametrize(
    "content, match",
    [
        ("{not json", "corrupt tokenizer file"),
        ("\xff\xfe", "corrupt tokenizer file"),
        ('{"format": "something else"}', "format"),
        ("[1, 2, 3]", "expected a JSON object, got list"),
    ],
)
def test_load_corrupt_file(tmp_path, content, match):
    (tmp_path / "tokenizer.json").write_text(content, encoding="latin-1")
    with pytest.raises(TokenizerError, match=match):
        CharTokenizer.load(tmp_path)


def test_load_rejects_inconsistent_content(tmp_path, tok):
    good = tok.to_dict()
    cases = [
        (dict(good, version=99), "version"),
        (dict(good, special_tokens={"pad": 1, "bos": 0, "eos": 2, "unk": 3}), "special token ids"),
        (dict(good, source_vocab=["a", "b"]), "special tokens"),
        (dict(good, target_vocab=list(SPECIAL_TOKENS) + ["a", "a"]), "duplicate"),
        (dict(good, target_vocab=list(SPECIAL_TOKENS) + ["ab"]), "single characters"),
        ({k: v for k, v in good.items() if k != "source_vocab"}, "source_vocab"),
    ]
    for data, match in cases:
        (tmp_path / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
        with pytest.raises(TokenizerError, match=match):
            CharTokenizer.load(tmp_path)


def test_encode_rejects_non_strings(tok):
    with pytest.raises(TypeError):
        tok.encode_source(42)


def test_unknown_character_in_a_huge_line_gives_a_short_message(tok):
    """One bad character in a 100k-character line: the message shows the character, its position
    and a short excerpt, not the whole line (it used to echo all of it)."""
    text = "one " * 25_000 + "!" + " two" * 10
    with pytest.raises(UnknownCharacterError) as info:
        tok.encode_source(text)
    message = str(info.value)
    assert len(message) < 400, len(message)
    assert "'!' at 100000" in message and "1 character outside the source vocabulary" in message
    assert "near '...one one one one one ! two two two two two...'" in message  # 20 characters each side
    assert info.value.unknown == [(100_000, "!")]
    many = "".join("!?#" for _ in range(1000))
    message = str(pytest.raises(UnknownCharacterError, tok.encode_source, many).value)
    assert len(message) < 400 and "(and 2995 more)" in message


def _write(tmp_path, data) -> None:
    text = data if isinstance(data, str) else json.dumps(data)
    (tmp_path / "tokenizer.json").write_text(text, encoding="utf-8")


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(shared="false"), "field 'shared' must be a boolean"),
        (dict(lowercase=1), "field 'lowercase' must be a boolean"),
        (dict(version=True), "unsupported tokenizer format version True"),
        (dict(type="bpe"), "field 'type' must be 'char'"),
        (dict(extra=1), r"unknown fields \['extra'\]"),
        (dict(special_tokens=[0, 1, 2, 3]), "field 'special_tokens' must be a JSON object"),
        (dict(source_vocab="abc"), "field 'source_vocab' must be a JSON list"),
        (dict(shared=True), "'shared' is true but 'source_vocab' and 'target_vocab' differ"),
    ],
)
def test_load_rejects_a_wrong_schema_naming_the_file_and_field(tmp_path, tok, change, match):
    _write(tmp_path, {**tok.to_dict(), **change})
    with pytest.raises(TokenizerError, match=match) as info:
        CharTokenizer.load(tmp_path)
    assert str(tmp_path / "tokenizer.json") in str(info.value)


@pytest.mark.parametrize("field", ["type", "shared", "lowercase", "target_vocab"])
def test_load_rejects_a_missing_field(tmp_path, tok, field):
    _write(tmp_path, {k: v for k, v in tok.to_dict().items() if k != field})
    with pytest.raises(
        TokenizerError, match=rf"invalid tokenizer file .*tokenizer.json: missing fields \['{field}'\]"
    ):
        CharTokenizer.load(tmp_path)


def test_load_truncated_or_empty_file(tmp_path, tok):
    full = json.dumps(tok.to_dict(), indent=1)
    _write(tmp_path, full[: len(full) // 2])
    with pytest.raises(
        TokenizerError, match=r"corrupt tokenizer file .*tokenizer.json: not valid JSON \(truncated\?\)"
    ):
        CharTokenizer.load(tmp_path)
    _write(tmp_path, "  \n")
    with pytest.raises(TokenizerError, match="corrupt tokenizer file .*: the file is empty"):
        CharTokenizer.load(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes(b'{"format": "\xff"}')
    with pytest.raises(TokenizerError, match="not UTF-8 text"):
        CharTokenizer.load(tmp_path)


def test_save_is_atomic(tmp_path, tok, monkeypatch):
    """A failed write (full disk at the rename) keeps the old file and leaves no temporary."""
    import errno
    import os

    path = tok.save(tmp_path)
    before = (tmp_path / "tokenizer.json").read_bytes()
    other = CharTokenizer.build(["xyz"], ["abc"])

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(OSError):
        other.save(tmp_path)
    assert (tmp_path / "tokenizer.json").read_bytes() == before
    assert os.listdir(tmp_path) == ["tokenizer.json"]
    monkeypatch.undo()
    assert CharTokenizer.load(path) == tok


class _Config:
    def __init__(self, **kw):
        base = dict(src_vocab_size=0, tgt_vocab_size=0, pad_id=0, bos_id=1, eos_id=2)
        self.__dict__.update({**base, **kw})


def test_check_model_config_names_both_files_and_the_id(tok):
    sizes = dict(src_vocab_size=tok.src_vocab_size, tgt_vocab_size=tok.tgt_vocab_size)
    check_model_config(tok, _Config(**sizes))
    check_model_config(tok, {**sizes, "pad_id": 0, "bos_id": 1, "eos_id": 2})  # a manifest's model_config
    files = dict(tokenizer_file="m/tokenizer.json", config_file="m/config.json")
    with pytest.raises(
        TokenizerError,
        match=r"special id mismatch: m/config.json has eos_id = 5 but "
        r"m/tokenizer.json has eos = 2",
    ):
        check_model_config(tok, _Config(**sizes, eos_id=5), **files)
    with pytest.raises(
        TokenizerError,
        match=r"m/tokenizer.json has a target vocabulary of \d+ tokens but "
        r"m/config.json has tgt_vocab_size = 999",
    ):
        check_model_config(tok, _Config(**{**sizes, "tgt_vocab_size": 999}), **files)


# ---------------------------------------------------------------------- the protocol


def test_char_tokenizer_implements_the_protocol(tmp_path, tok):
    assert isinstance(tok, Tokenizer)
    assert tok.type == "char" and TOKENIZER_TYPES[tok.type] is CharTokenizer
    assert tok.files == ("tokenizer.json",)
    path = tok.save(tmp_path / "model")
    assert sorted(p.name for p in (tmp_path / "model").iterdir()) == sorted(tok.files)
    assert path == str(tmp_path / "model" / tok.files[0])
    assert json.loads((tmp_path / "model" / "tokenizer.json").read_text(encoding="utf-8"))["type"] == tok.type


def test_load_tokenizer_dispatches_on_the_type(tmp_path, tok, monkeypatch):
    tok.save(tmp_path / "char")
    loaded = load_tokenizer(tmp_path / "char")
    assert type(loaded) is CharTokenizer and loaded == tok
    assert load_tokenizer(tmp_path / "char" / "tokenizer.json") == tok

    class Pieces:  # a second kind registered beside the character tokenizer
        @classmethod
        def load(cls, path):
            made = cls()
            made.data = json.loads(open(path, encoding="utf-8").read())
            made.path = path
            return made

    monkeypatch.setitem(TOKENIZER_TYPES, "pieces", Pieces)
    (tmp_path / "pieces").mkdir()
    description = {"format": "transformer_ext.Pieces", "type": "pieces", "model": "spm.model"}
    (tmp_path / "pieces" / "tokenizer.json").write_text(json.dumps(description), encoding="utf-8")
    other = load_tokenizer(tmp_path / "pieces")
    assert isinstance(other, Pieces) and other.data == description
    assert other.path == str(
        tmp_path / "pieces" / "tokenizer.json"
    )  # its own files are read from that folder
    monkeypatch.setitem(TOKENIZER_TYPES, "pieces", f"{__name__}:_LazyKind")  # imported on first use
    assert isinstance(load_tokenizer(tmp_path / "pieces"), _LazyKind)


class _LazyKind:
    @classmethod
    def load(cls, path):
        return cls()


@pytest.mark.parametrize(
    "description, match",
    [
        (
            {"format": "transformer_ext.Future", "type": "bpe-9"},
            r"tokenizer.json: unknown tokenizer type 'bpe-9' \(this version reads 'char', 'fairseq', 'marian', 'sentencepiece', 't5'\)",
        ),
        ({"format": "transformer_ext.CharTokenizer"}, "unknown tokenizer type None"),
        (
            {"version": "1.0", "model": {"type": "BPE"}, "added_tokens": []},  # a Hugging Face tokenizer.json
            "not a transformer_ext tokenizer description",
        ),
        ([1, 2], "not a transformer_ext tokenizer description"),
        ({"format": "transformer_ext.CharTokenizer", "type": "char", "version": 1}, "missing fields"),
    ],
)
def test_load_tokenizer_refuses_foreign_and_unknown_files(tmp_path, description, match):
    (tmp_path / "tokenizer.json").write_text(json.dumps(description), encoding="utf-8")
    with pytest.raises(TokenizerError, match=match) as info:
        load_tokenizer(tmp_path)
    assert str(tmp_path / "tokenizer.json") in str(info.value)


def test_load_tokenizer_missing_and_corrupt_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        load_tokenizer(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="tokenizer file not found"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text(
        '{"format": "transformer_ext.CharTokenizer", "ty', encoding="utf-8"
    )
    with pytest.raises(TokenizerError, match=r"corrupt tokenizer file .*tokenizer.json: not valid JSON"):
        load_tokenizer(tmp_path)


def test_load_tokenizer_reads_a_sentencepiece_folder(tmp_path):
    pytest.importorskip("sentencepiece")
    from transformer_ext.spm_tokenizer import SentencePieceTokenizer

    words = [
        "one",
        "two",
        "three",
        "four",
        "five",
        "six",
        "seven",
        "eight",
        "nine",
        "ten",
        "twenty",
        "hundred",
    ]
    german = [
        "eins",
        "zwei",
        "drei",
        "vier",
        "fünf",
        "sechs",
        "sieben",
        "acht",
        "neun",
        "zehn",
        "zwanzig",
        "hundert",
    ]
    sources = [f"{a} {b}" for a in words for b in words]
    targets = [f"{a}{b}" for a in german for b in german]
    tok = SentencePieceTokenizer.train(sources, targets, vocab_size=40)
    tok.save(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert type(loaded) is SentencePieceTokenizer and loaded == tok and isinstance(loaded, Tokenizer)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(loaded.files)
