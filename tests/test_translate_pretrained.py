"""The Translator and the translate / evaluate CLIs on models converted from transformers.

transformers is the oracle: a tiny M2M100 and a tiny multilingual Marian checkpoint written by
``save_pretrained`` (tests/hf_checkpoints.py) are converted with our converter; the Translator
(eager and ONNX Runtime, one export per model) with ``source_lang`` / ``target_lang`` and nothing
else gives the tokens of transformers' tokenizer + ``generate()`` with the model's own generation
config (its beam size, length penalty, ``max_length``, banned ``<pad>``, forced target language).
The CLIs' language errors are one line listing the model's codes.
"""

from __future__ import annotations

import functools
import io
import logging
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

from hf_checkpoints import sample_lines, write_m2m100, write_marian  # noqa: E402

from transformer_ext.convert import convert_transformers  # noqa: E402
from transformer_ext.translate import TranslationError, Translator  # noqa: E402
from transformer_ext.translate import main as translate_main  # noqa: E402

MAX_POS = 64  # max_position_embeddings of the test configs
N_SOURCES = 12
CASES = {  # name -> (checkpoint writer, --source-lang, --target-lang)
    "m2m100": (lambda p: write_m2m100(p, seed=3), "fr", "es"),
    "marian_multilingual": (lambda p: write_marian(p, languages=("fra", "deu", "spa"), seed=2), None, "spa"),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (transformers folder, converted model folder, export folder)."""
    from export.onnx import export_onnx

    root = tmp_path_factory.mktemp("pretrained")
    out = {}
    for name, (make, _, _) in CASES.items():
        hf = make(root / f"{name}_hf")
        ours = convert_transformers(hf, root / f"{name}_ours")
        export = export_onnx(ours, root / f"{name}_export", cache_len=MAX_POS, validate=False).output_dir
        out[name] = (hf, ours, Path(export))
    return out


@functools.lru_cache(maxsize=None)
def _hf_model(hf_dir: str):
    from transformers import AutoModelForSeq2SeqLM

    return AutoModelForSeq2SeqLM.from_pretrained(hf_dir).eval()


def _hf_tokens(hf_dir, src, tgt, texts, **kwargs) -> list[list[int]]:
    """transformers' tokenizer + generate() (the model's generation config, the target language
    as a transformers user selects it): the generated ids without the decoder start, EOS, padding."""
    from transformers import AutoTokenizer

    if src is not None:
        tokenizer = AutoTokenizer.from_pretrained(hf_dir, src_lang=src, tgt_lang=tgt)
        kwargs["forced_bos_token_id"] = tokenizer.get_lang_id(tgt)
    else:
        tokenizer = AutoTokenizer.from_pretrained(hf_dir)
        texts = [f">>{tgt}<< {t}" for t in texts]
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = _hf_model(str(hf_dir)).generate(**enc, **kwargs)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    rows = []
    for row in out[:, 1:].tolist():
        row = row[: row.index(eos)] if eos in row else row
        rows.append([t for t in row if t != pad])
    return rows


@pytest.mark.parametrize("name", sorted(CASES))
def test_translator_tokens_equal_generate(models, name):
    """Beam search (the model's num_beams 4, transformers' length penalty and early stopping) and
    greedy: the same tokens as generate(), through eager and ONNX Runtime."""
    hf, ours, export = models[name]
    _, src, tgt = CASES[name]
    texts = sample_lines(N_SOURCES, seed=31)
    beam = _hf_tokens(hf, src, tgt, texts)
    greedy = _hf_tokens(hf, src, tgt, texts, num_beams=1)
    assert len({tuple(t) for t in greedy}) >= N_SOURCES // 4  # the outputs vary
    for translator in (
        Translator.from_model_dir(ours, source_lang=src, target_lang=tgt),
        Translator.from_export_dir(export, source_lang=src, target_lang=tgt),
    ):
        assert translator.resolve_options()["beam_size"] == 4  # the checkpoint's generation config
        for expected, options in ((beam, {}), (greedy, {"beam_size": 1})):
            got = [t.hypotheses[0].tokens for t in translator.translate_detailed(texts, **options)]
            mismatched = [i for i in range(N_SOURCES) if got[i] != expected[i]]
            assert not mismatched, f"{name} {translator.source_dir.name} {options}: sources {mismatched}"


def test_marian_never_generates_pad_and_m2m100_starts_with_the_language(models):
    """The banned <pad> and the forced first token, read from the converted folder (and the export)."""
    from transformers import AutoTokenizer

    hf, ours, export = models["m2m100"]
    es = AutoTokenizer.from_pretrained(hf).get_lang_id("es")
    texts = sample_lines(6, seed=5)
    for translator in (
        Translator.from_model_dir(ours, source_lang="fr", target_lang="es"),
        Translator.from_export_dir(export, source_lang="fr", target_lang="es"),
    ):
        assert all(t.hypotheses[0].tokens[0] == es for t in translator.translate_detailed(texts))
    hf, ours, _ = models["marian_multilingual"]
    pad = AutoTokenizer.from_pretrained(hf).pad_token_id
    translator = Translator.from_model_dir(ours, target_lang="deu")
    for t in translator.translate_detailed(texts, beam_size=1):
        assert pad not in t.hypotheses[0].tokens


def _one_line_error(main, args, capsys, *needles):
    code = main(args) if main.__module__.endswith("evaluate") else main(args, stdin=io.StringIO("un deux\n"))
    out, err = capsys.readouterr()
    assert code == 1, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_cli_language_errors_are_one_line(models, tmp_path, capsys):
    from transformer_ext.evaluate import main as evaluate_main
    from transformer_ext.translate import main as translate_main

    _, m2m, m2m_export = models["m2m100"]
    _, marian, _ = models["marian_multilingual"]
    src, ref = tmp_path / "src.txt", tmp_path / "ref.txt"
    src.write_text("un deux\n", encoding="utf-8")
    ref.write_text("eins zwei\n", encoding="utf-8")
    # M2M100's tokenizer_config.json names default languages (en -> de); unknown ones are errors
    for model in (m2m, m2m_export):
        base = ["--model", str(model), "-"]
        _one_line_error(
            translate_main, base + ["--source-lang", "fr", "--target-lang", "xx"], capsys, "'xx'", "de"
        )
        ev = ["--model", str(model), "--src", str(src), "--ref", str(ref)]
        _one_line_error(
            evaluate_main, ev + ["--source-lang", "zz", "--target-lang", "de"], capsys, "'zz'", "fr"
        )
    _one_line_error(
        translate_main, ["--model", str(marian), "--target-lang", "ita", "-"], capsys, "ita", "spa"
    )
    _one_line_error(translate_main, ["--model", str(marian), "--source-lang", "fr", "-"], capsys, "source")
    # a multilingual Marian source without >>xx<< and no --target-lang: the codes are listed
    _one_line_error(translate_main, ["--model", str(marian), "-"], capsys, "--target-lang", "deu", "fra")
    # the bundled demo model has no languages
    _one_line_error(translate_main, ["--target-lang", "de", "-"], capsys, "--target-lang 'de'", "no language")


def test_translator_language_errors(models):
    _, m2m, _ = models["m2m100"]
    with pytest.raises(TranslationError, match="knows"):
        Translator.from_model_dir(m2m, source_lang="fr", target_lang="xx")
    with pytest.raises(TranslationError, match="no language codes"):
        Translator.from_model_dir(None, target_lang="de")


def _language_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "tokenizer_config.json" in r.getMessage()]


def test_missing_languages_use_the_checkpoint_defaults_and_say_so(models, caplog, capsys):
    """M2M100 without --source-lang / --target-lang: the defaults of its tokenizer_config.json
    (en -> de, what transformers' tokenizer uses when given none), named in one warning."""
    _, m2m, export = models["m2m100"]
    texts = sample_lines(4, seed=8)
    chosen = Translator.from_model_dir(m2m, source_lang="en", target_lang="de")
    for load, folder in ((Translator.from_model_dir, m2m), (Translator.from_export_dir, export)):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            translator = load(folder)
        (warning,) = _language_warnings(caplog)
        assert "source language 'en'" in warning and "target language 'de'" in warning, warning
        assert "--source-lang" in warning and "--target-lang" in warning
        assert translator.translate(texts, beam_size=1) == chosen.translate(texts, beam_size=1)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        Translator.from_model_dir(m2m, source_lang="fr")
    (warning,) = _language_warnings(caplog)
    assert "target language 'de'" in warning and "source language" not in warning
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        Translator.from_model_dir(m2m, source_lang="fr", target_lang="es")
    assert not _language_warnings(caplog)
    # the command line: the translation, and the warning on stderr
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        code = translate_main(["--model", str(m2m), "-"], stdin=io.StringIO(texts[0] + "\n"))
    out, _ = capsys.readouterr()
    assert code == 0 and out == chosen.translate(texts[:1], beam_size=None)[0] + "\n"
    assert len(_language_warnings(caplog)) == 1
