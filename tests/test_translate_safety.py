"""The Translator on inputs at their edges: target prefixes of imported multilingual models, with
transformers' generate() as the oracle."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

from hf_checkpoints import sample_lines, write_m2m100  # noqa: E402

from transformer_ext.convert import convert_transformers  # noqa: E402
from transformer_ext.translate import Translator  # noqa: E402

LANGS = {"m2m100": ("fr", "es"), "nllb": ("eng_Latn", "deu_Latn")}


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """name -> (transformers folder, converted model folder) for a tiny M2M100 and NLLB."""
    root = tmp_path_factory.mktemp("imported")
    out = {}
    for name, seed in (("m2m100", 3), ("nllb", 4)):
        hf = write_m2m100(root / f"{name}_hf", nllb=name == "nllb", seed=seed)
        out[name] = (hf, convert_transformers(hf, root / f"{name}_ours"))
    return out


def _fairseq_ids(hf_dir, name, src, tgt, texts, prefix):
    """(source ids per text, target prefix ids): transformers' M2M100Tokenizer; for NLLB (whose
    transformers 5 tokenizer cannot read a SentencePiece file here) fairseq's rule written out with
    sentencepiece: piece id + 1, <unk> 3, languages after the pieces in the listed order."""
    if name == "m2m100":
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(hf_dir, src_lang=src, tgt_lang=tgt)
        forced = tokenizer(text_target=prefix)["input_ids"]
        assert forced[0] == tokenizer.get_lang_id(tgt) and forced[-1] == tokenizer.eos_token_id
        return [tokenizer(t)["input_ids"] for t in texts], forced[:-1]
    import sentencepiece as spm
    from hf_checkpoints import NLLB_TEST_CODES

    sp = spm.SentencePieceProcessor(model_file=str(hf_dir / "sentencepiece.bpe.model"))
    lang = {c: sp.get_piece_size() + 1 + i for i, c in enumerate(NLLB_TEST_CODES)}

    def body(text):
        return [p + 1 if p > 2 else 3 for p in sp.encode(text)]

    return [[lang[src]] + body(t) + [2] for t in texts], [lang[tgt]] + body(prefix)


def _generate_with_prefix(hf_dir, name, src, tgt, texts, prefix, **kwargs) -> list[list[int]]:
    """generate() from ``decoder_input_ids = [decoder start, tgt_lang, prefix pieces]`` (how a
    transformers user forces a prefix): the ids after the decoder start, up to EOS."""
    from transformers import AutoModelForSeq2SeqLM

    model = AutoModelForSeq2SeqLM.from_pretrained(hf_dir).eval()
    start, eos = model.config.decoder_start_token_id, model.config.eos_token_id
    sources, forced = _fairseq_ids(hf_dir, name, src, tgt, texts, prefix)
    rows = []
    for ids in sources:  # one source at a time: no padding in the decoder input
        with torch.no_grad():
            out = model.generate(
                input_ids=torch.tensor([ids]), decoder_input_ids=torch.tensor([[start] + forced]), **kwargs
            )
        row = out[0, 1:].tolist()
        rows.append(row[: row.index(eos)] if eos in row else row)
    return rows


@pytest.mark.parametrize("name", sorted(LANGS))
@pytest.mark.parametrize("beam", [1, 4])
def test_target_prefix_equals_generate_with_decoder_input_ids(imported, name, beam):
    """The target language token once, then the prefix's pieces, then what generate() continues."""
    hf, ours = imported[name]
    src, tgt = LANGS[name]
    texts = sample_lines(4, seed=8)
    expected = _generate_with_prefix(hf, name, src, tgt, texts, "house", num_beams=beam)
    translator = Translator.from_model_dir(ours, source_lang=src, target_lang=tgt)
    got = [
        t.hypotheses[0].tokens
        for t in translator.translate_detailed(texts, target_prefix="house", beam_size=beam)
    ]
    assert got == expected


def _translate_cli(args, stdin_text):
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "transformer_ext.translate", *args],
        input=stdin_text,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_default_model_is_named_on_stderr():
    """Without --model the bundled demo model translates; stderr says so, stdout holds only the text."""
    run = _translate_cli([], "forty-two\n")
    assert run.returncode == 0, run.stderr
    assert run.stdout == "zweiundvierzig\n"
    assert "no --model given" in run.stderr and "demo_model" in run.stderr


def test_a_given_model_is_not_announced():
    from transformer_ext.demo import DEMO_MODEL_DIR

    run = _translate_cli(["--model", str(DEMO_MODEL_DIR)], "forty-two\n")
    assert run.returncode == 0, run.stderr
    assert "no --model given" not in run.stderr
