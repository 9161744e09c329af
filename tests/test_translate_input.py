"""What the Translator and ``translate`` do with input the model cannot read as it is: empty
sources, characters or pieces outside the vocabulary (character and SentencePiece tokenizers),
and search sizes the vocabulary or the memory cannot hold. One rule for the API and the command
line: by default an empty source has the empty translation and an unknown piece is the unknown
token (one warning naming it); ``strict=True`` / ``--strict`` makes both an error naming them."""

from __future__ import annotations

import io
import logging
import subprocess
import sys

import pytest
import torch
from helpers import DEMO_DIR

from transformer_ext.checkpoint import save_model
from transformer_ext.config import TransformerConfig
from transformer_ext.model import Transformer
from transformer_ext.translate import TranslationError, Translator, main

pytest.importorskip("sentencepiece")

from transformer_ext.spm_tokenizer import SentencePieceTokenizer  # noqa: E402

SPM_VOCAB = 32
SPM_SOURCES = [
    f"the {w} man saw {n} sheep in the field"
    for w in ("old", "young", "tall", "wise")
    for n in ("two", "three", "seven", "many")
]
UNKNOWN = "the man 😀 東京"  # two pieces SentencePiece never saw


@pytest.fixture(scope="module")
def spm_dir(tmp_path_factory):
    """A tiny random-weight model folder with a shared SentencePiece tokenizer."""
    folder = tmp_path_factory.mktemp("spm_model")
    torch.manual_seed(0)
    config = TransformerConfig.preset("tiny", src_vocab_size=SPM_VOCAB, tgt_vocab_size=SPM_VOCAB, dropout=0.0)
    save_model(Transformer(config).eval(), folder)
    SentencePieceTokenizer.train(SPM_SOURCES, SPM_SOURCES, vocab_size=SPM_VOCAB, shared=True).save(folder)
    return folder


@pytest.fixture(scope="module")
def spm_translator(spm_dir):
    return Translator.from_model_dir(spm_dir)


@pytest.fixture(scope="module")
def demo():
    return Translator.from_model_dir(None)


def test_sentencepiece_unknown_pieces_are_an_error_when_strict(spm_translator):
    with pytest.raises(TranslationError) as info:
        spm_translator.translate(["the man", UNKNOWN], strict=True)
    message = str(info.value)
    assert message.startswith("source 1:") and "\n" not in message
    assert "'😀'" in message and "'東京'" in message, message


def test_sentencepiece_unknown_pieces_warn_by_default(spm_translator, caplog):
    with caplog.at_level(logging.WARNING):
        out = spm_translator.translate(["the man", UNKNOWN])
    assert len(out) == 2 and all(isinstance(t, str) for t in out)
    warnings = [r.getMessage() for r in caplog.records if "outside the vocabulary" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "1 input lines" in warnings[0] and "'😀'" in warnings[0] and "'東京'" in warnings[0]
    # what the warning promises holds: strict makes it an error
    assert "strict=True / --strict makes this an error" in warnings[0]
    with pytest.raises(TranslationError):
        spm_translator.translate([UNKNOWN], strict=True)


def test_cli_strict_refuses_sentencepiece_unknown_pieces(spm_dir, capsys, caplog):
    code = main(["--model", str(spm_dir), "--strict", UNKNOWN])
    out, err = capsys.readouterr()
    assert code == 1 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m transformer_ext.translate: error: argument 1:")
    assert "'😀'" in lines[0] and "'東京'" in lines[0]
    with caplog.at_level(logging.WARNING):
        code = main(["--model", str(spm_dir), UNKNOWN])
    out, _ = capsys.readouterr()
    assert code == 0 and len(out.splitlines()) == 1
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "'😀'" in warned and "--strict makes this an error" in warned


def test_character_tokenizer_strict_and_default_agree_with_the_warning(demo, caplog):
    with pytest.raises(TranslationError, match="'!'"):
        demo.translate(["forty-two!"], strict=True)
    with caplog.at_level(logging.WARNING):
        (out,) = demo.translate(["forty-two!"])
    assert isinstance(out, str)
    warnings = [r.getMessage() for r in caplog.records if "outside the vocabulary" in r.getMessage()]
    assert len(warnings) == 1 and "'!'" in warnings[0] and "strict=True" in warnings[0]


@pytest.mark.parametrize("empty", ["", "   ", "\t"])
def test_an_empty_source_has_the_empty_translation_in_the_api_as_on_the_command_line(demo, empty, capsys):
    out = demo.translate(["forty-two", empty, "seven"])
    assert [str(t) for t in out] == [str(demo.translate(["forty-two"])[0]), "", "sieben"]
    assert out[1].source == empty and out[1].hypotheses[0].tokens == []
    assert demo.translate_text([empty]) == [""]
    with pytest.raises(TranslationError, match="source 1: empty source"):
        demo.translate(["forty-two", empty], strict=True)
    # the command line: the same rule
    assert main(["-"], stdin=io.StringIO(f"forty-two\n{empty}\nseven\n")) == 0
    lines = capsys.readouterr().out.split("\n")
    assert lines[1] == "" and lines[2] == "sieben"


def test_beam_and_hypotheses_are_bounded_by_the_vocabulary(demo):
    vocab = demo.info.tgt_vocab_size
    with pytest.raises(TranslationError, match=f"beam size {vocab + 1} .*{vocab} tokens"):
        demo.translate(["one"], beam_size=vocab + 1)
    with pytest.raises(TranslationError, match=f"n_best {vocab + 1} .*{vocab} tokens"):
        demo.translate(["one"], sampling_topk=0, n_best=vocab + 1)
    assert len(demo.translate(["one"], beam_size=vocab, n_best=2)[0].texts) == 2


def test_a_batch_too_large_for_memory_is_refused_before_decoding(demo, monkeypatch):
    import transformer_ext.translator as translator_module

    def no_decoding(*args, **kwargs):
        raise AssertionError("the runner was asked to encode a batch that cannot fit")

    monkeypatch.setattr(translator_module, "_memory_headroom", lambda: 1 << 20)
    monkeypatch.setattr(demo.runner, "encode", no_decoding)
    with pytest.raises(TranslationError) as info:
        demo.translate(["one", "two hundred and six"] * 20, beam_size=20)
    message = str(info.value)
    assert "GiB" in message and "beam_size" in message and "batch_size" in message, message
    monkeypatch.undo()
    assert demo.translate(["one"], beam_size=2) == ["eins"]


def test_cli_huge_beam_under_an_address_space_limit_is_one_line():
    import resource

    def limit():  # room for torch, not for a search over ten million beams
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "transformer_ext.translate",
            "--model",
            str(DEMO_DIR),
            "--beam-size",
            "10000000",
            "one",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=limit,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and proc.stdout == "", proc.stderr
    assert len(lines) == 1 and lines[0].startswith("python -m transformer_ext.translate: error:"), lines
    assert "beam size 10000000" in lines[0]
