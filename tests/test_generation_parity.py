"""Every field of a checkpoint's generation config decodes as transformers' generate() does, or is refused.

transformers is the oracle: a checkpoint written by ``save_pretrained`` (tests/hf_checkpoints.py)
gets one field of ``generation_config.json`` changed; the folder is converted with our converter
and decoded with our ``Translator`` (its defaults only); ``generate()`` decodes the same source
ids with the same folder's generation config, as ``from_pretrained`` loads it. A case whose field
would not change generate()'s output on these sources is a broken case, so each reproduced field
is also checked to change the oracle's tokens. A field this package does not reproduce is refused
by ``convert``: exit 1, one line naming generation_config.json and the field, nothing written.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

from hf_checkpoints import sample_lines, write_m2m100, write_marian  # noqa: E402

from transformer_ext.convert import convert_transformers  # noqa: E402
from transformer_ext.translator import Translator  # noqa: E402

N_SOURCES = 12
MAX_POS = 64


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Small models decode faster on one thread than on a shared machine's several."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def marian(tmp_path_factory):
    """A Marian checkpoint as transformers writes it (num_beams 4, max_length 16, bad_words_ids
    [[pad]], forced_eos_token_id), with its transformers model and the source ids. The EOS logit
    is raised so that some sources end early and others run to the budget (the length fields
    have something to change)."""
    from transformers import MarianMTModel

    root = tmp_path_factory.mktemp("generation_parity")
    hf = write_marian(root / "marian", max_positions=MAX_POS, seed=11)
    model = MarianMTModel.from_pretrained(hf)
    with torch.no_grad():
        model.final_logits_bias[0, model.config.eos_token_id] = 5.5
    model.save_pretrained(hf)
    return _family(hf, convert_transformers(hf, root / "marian_ours"), {}, {})


@pytest.fixture(scope="module")
def m2m100(tmp_path_factory):
    root = tmp_path_factory.mktemp("generation_parity_m2m")
    hf = write_m2m100(root / "m2m100", max_positions=MAX_POS, seed=12)
    languages = dict(source_lang="en", target_lang="de")
    return _family(hf, convert_transformers(hf, root / "m2m100_ours"), languages, None)


def _family(hf: Path, ours: Path, languages: dict, hf_kwargs) -> dict:
    from transformers import AutoModelForSeq2SeqLM

    translator = Translator.from_model_dir(ours, **languages)
    tok = translator.tokenizer
    texts = sample_lines(N_SOURCES, seed=5)
    if hf_kwargs is None:  # M2M100: the target language is forced, as a transformers user does
        hf_kwargs = {"forced_bos_token_id": tok.forced_target_prefix()[0]}
    return dict(
        hf=hf,
        ours=ours,
        model=AutoModelForSeq2SeqLM.from_pretrained(hf).eval(),
        languages=languages,
        hf_kwargs=hf_kwargs,
        texts=texts,
        sources=[tok.encode_source(t) for t in texts],
        pad=tok.pad_id,
        eos=tok.eos_id,
        start=tok.bos_id,
    )


def _variant(fam: dict, tmp_path: Path, edit) -> Path:
    """A copy of the family's checkpoint with ``edit(generation_config dict)`` applied (None:
    no generation_config.json at all)."""
    hf = tmp_path / "hf"
    hf.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(fam["hf"], hf)
    path = hf / "generation_config.json"
    config = json.loads(path.read_text())
    edited = edit(config)
    if edited is None:
        path.unlink()
    else:
        path.write_text(json.dumps(edited, indent=2))
    return hf


def _generate(fam: dict, hf: Path) -> list[list[int]]:
    """transformers' tokens for the family's sources, with ``hf``'s generation config (what
    from_pretrained(hf) loads), without the decoder start, the EOS and padding."""
    from transformers import GenerationConfig

    model = fam["model"]
    if (hf / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(hf)
    else:
        model.generation_config = GenerationConfig.from_model_config(model.config)
    sources = fam["sources"]
    S = max(len(s) for s in sources)
    ids = torch.full((len(sources), S), fam["pad"], dtype=torch.int64)
    mask = torch.zeros((len(sources), S), dtype=torch.int64)
    for i, s in enumerate(sources):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, **fam["hf_kwargs"])
    if not isinstance(out, torch.Tensor):  # return_dict_in_generate
        out = out.sequences
    result = []
    for row in out.tolist():
        assert row[0] == fam["start"]
        row = row[1:]
        row = row[: row.index(fam["eos"])] if fam["eos"] in row else row
        result.append([t for t in row if t != fam["pad"]])
    return result


def _ours(fam: dict, hf: Path, tmp_path: Path) -> list[list[int]]:
    ours = convert_transformers(hf, tmp_path / "ours")
    translator = Translator.from_model_dir(ours, **fam["languages"])
    return [t.hypotheses[0].tokens for t in translator.translate(fam["texts"])]


@pytest.fixture(scope="module")
def marian_base(marian):
    """generate()'s tokens with the checkpoint's own generation config."""
    return _generate(marian, marian["hf"])


def _frequent_token(tokens: list[list[int]]) -> int:
    counts: dict[int, int] = {}
    for row in tokens:
        for t in row:
            counts[t] = counts.get(t, 0) + 1
    return max(counts, key=counts.get)


def _drop(*keys):
    return lambda c: {k: v for k, v in c.items() if k not in keys}


def _set(**values):
    return lambda c: {**c, **values}


def _with(base, field=None):
    """``base`` (an edit), then ``field`` (an edit) on top of it."""
    return lambda c: (field or (lambda x: x))(base(c)) if base(c) is not None else None


KEEP = lambda c: c  # noqa: E731
# (case id, the control's edit of generation_config.json, the field's edit on top of it): the
# field must change generate()'s tokens against the control (None: the case is the control).
MARIAN_CASES = [
    ("as_written", KEEP, None),
    ("max_new_tokens", KEEP, _set(max_new_tokens=5)),
    ("max_new_tokens_beyond_max_length", KEEP, _set(max_new_tokens=30)),
    ("no_max_length", KEEP, _drop("max_length")),  # what transformers 5 writes: 20 new tokens
    ("no_generation_config", KEEP, lambda c: None),  # config.json's fields: greedy, 20 new tokens
    ("greedy", KEEP, _set(num_beams=1)),
    ("length_penalty", _set(max_length=24), _set(length_penalty=-2.0)),
    ("early_stopping_true", _set(length_penalty=2.0, max_length=24), _set(early_stopping=True)),
    ("early_stopping_never", _set(length_penalty=2.0, max_length=24), _set(early_stopping="never")),
    ("min_length", KEEP, _set(min_length=14)),
    ("min_new_tokens", _set(max_length=24), _set(min_new_tokens=12)),
    ("min_new_tokens_over_min_length", _set(max_length=24, min_length=20), _set(min_new_tokens=5)),
    ("repetition_penalty", KEEP, _set(repetition_penalty=1.5)),
    ("repetition_penalty_greedy", _set(num_beams=1), _set(repetition_penalty=3.0)),
    ("no_repeat_ngram_size", KEEP, _set(no_repeat_ngram_size=1)),
    ("no_forced_eos", KEEP, _drop("forced_eos_token_id")),
    (
        "renormalize_logits",
        _set(no_repeat_ngram_size=2, length_penalty=2.0, max_length=24),
        _set(renormalize_logits=True),
    ),
    ("renormalize_logits_greedy", _set(num_beams=1, repetition_penalty=1.5), _set(renormalize_logits=True)),
    ("eos_in_bad_words", KEEP, lambda c: {**c, "bad_words_ids": c["bad_words_ids"] + [[c["eos_token_id"]]]}),
    (
        "no_effect_fields",
        KEEP,
        _set(
            temperature=0.3,
            top_k=3,
            top_p=0.5,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            use_cache=True,
            num_return_sequences=1,
        ),
    ),
]
NO_CHANGE = {"as_written", "eos_in_bad_words", "no_effect_fields", "renormalize_logits_greedy"}


def _check_case(fam, tmp_path, case, control, field):
    hf = _variant(fam, tmp_path / "case", _with(control, field))
    expected = _generate(fam, hf)
    if field is not None:
        before = _generate(fam, _variant(fam, tmp_path / "control", control))
        if case in NO_CHANGE:
            assert expected == before, f"{case}: generate()'s output changes"
        else:
            assert expected != before, f"{case}: the field does not change generate()'s output here"
    got = _ours(fam, hf, tmp_path)
    mismatched = [i for i in range(N_SOURCES) if got[i] != expected[i]]
    assert not mismatched, (
        f"{case}: sources {mismatched} differ, e.g. {got[mismatched[0]]} vs {expected[mismatched[0]]}"
    )


@pytest.mark.parametrize("case, control, field", MARIAN_CASES, ids=[c[0] for c in MARIAN_CASES])
def test_marian_field_decodes_as_generate(marian, tmp_path, case, control, field):
    _check_case(marian, tmp_path, case, control, field)


def test_marian_num_return_sequences_are_the_n_best(marian, tmp_path):
    """generate()'s num_return_sequences sequences per source, best first, are our n-best."""
    hf = _variant(marian, tmp_path, _set(num_return_sequences=3))
    flat = _generate(marian, hf)
    expected = [flat[3 * i : 3 * i + 3] for i in range(N_SOURCES)]
    ours = convert_transformers(hf, tmp_path / "ours")
    got = [
        [h.tokens for h in t.hypotheses] for t in Translator.from_model_dir(ours).translate(marian["texts"])
    ]
    assert got == expected
    # an explicit beam of 1 (greedy) returns one hypothesis, not an error
    assert len(Translator.from_model_dir(ours).translate(marian["texts"][:1], beam_size=1)[0].hypotheses) == 1


def test_marian_banned_and_forced_first_tokens_decode_as_generate(marian, marian_base, tmp_path):
    """bad_words_ids of single tokens (one the model likes) and forced_bos_token_id."""
    frequent = _frequent_token(marian_base)
    for i, edit in enumerate(
        (
            lambda c: {**c, "bad_words_ids": c["bad_words_ids"] + [[frequent]]},
            _set(forced_bos_token_id=frequent),
        )
    ):
        hf = _variant(marian, tmp_path / str(i), edit)
        expected = _generate(marian, hf)
        assert expected != marian_base
        assert _ours(marian, hf, tmp_path / str(i)) == expected


M2M_CASES = [
    ("as_written", KEEP, None),
    ("no_max_length", KEEP, _drop("max_length")),
    ("repetition_penalty", _set(max_length=24), _set(repetition_penalty=1.5)),
    ("max_new_tokens_greedy", _set(num_beams=1), _set(max_new_tokens=4)),
]


@pytest.mark.parametrize("case, control, field", M2M_CASES, ids=[c[0] for c in M2M_CASES])
def test_m2m100_field_decodes_as_generate(m2m100, tmp_path, case, control, field):
    _check_case(m2m100, tmp_path, case, control, field)


# ------------------------------------------------------------------------------------------
# refused fields and values
# ------------------------------------------------------------------------------------------

REFUSED = [
    (_set(suppress_tokens=[5]), "suppress_tokens"),
    (_set(begin_suppress_tokens=[5]), "begin_suppress_tokens"),
    (_set(sequence_bias=[[[5], -2.0]]), "sequence_bias"),
    (_set(num_beam_groups=2, diversity_penalty=0.5), "diversity_penalty"),
    (_set(stop_strings=["the"]), "stop_strings"),
    (_set(exponential_decay_length_penalty=[5, 1.5]), "exponential_decay_length_penalty"),
    (_set(encoder_repetition_penalty=1.3), "encoder_repetition_penalty"),
    (_set(encoder_no_repeat_ngram_size=2), "encoder_no_repeat_ngram_size"),
    (_set(remove_invalid_values=True), "remove_invalid_values"),
    (_set(do_sample=True), "do_sample"),
    (_set(num_return_sequences=5), "num_return_sequences"),
    (_set(num_return_sequences=2, num_beams=1), "num_return_sequences"),
    (_set(bad_words_ids=[[5, 6]]), "bad_words_ids"),
    (_set(some_future_option=3), "some_future_option"),
    (_set(eos_token_id=[0, 5]), "eos_token_id"),
    (_set(decoder_start_token_id=5), "decoder_start_token_id"),
    # values its own reader would refuse later: checked at conversion
    (_set(num_beams=0), "'num_beams'"),
    (_set(max_length=0), "'max_length'"),
    (_set(max_new_tokens=0), "'max_new_tokens'"),
    (_set(min_length=-1), "'min_length'"),
    (_set(repetition_penalty=0.0), "'repetition_penalty'"),
    (_set(no_repeat_ngram_size=-1), "'no_repeat_ngram_size'"),
    (_set(length_penalty=math.nan), "'length_penalty'"),
    (_set(length_penalty=math.inf), "'length_penalty'"),
    (_set(bad_words_ids=[["x"]]), "'bad_words_ids'"),
    (_set(bad_words_ids=[[10_000]]), "10000"),
    (_set(early_stopping="sometimes"), "'early_stopping'"),
    (_set(forced_bos_token_id=10_000), "'forced_bos_token_id'"),
]


@pytest.mark.parametrize(
    "edit, field", REFUSED, ids=[r[1].strip("'") + str(i) for i, r in enumerate(REFUSED)]
)
def test_a_field_not_reproduced_is_refused_naming_it(marian, tmp_path, capsys, edit, field):
    from transformer_ext.convert.__main__ import main

    hf = _variant(marian, tmp_path, edit)
    out = tmp_path / "out" / "model"
    assert main(["transformers", "--model", str(hf), "--output-dir", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("transformer-ext-convert: error: "), err
    assert field in err and ("generation_config.json" in err or "vocabulary" in err), err
    assert not out.exists() and (not out.parent.exists() or not os.listdir(out.parent))


def test_neutral_values_of_refused_fields_are_accepted(marian, marian_base, tmp_path):
    """Older checkpoints list every field with its default (off): those decode as before."""
    edit = _set(
        suppress_tokens=None,
        num_beam_groups=1,
        diversity_penalty=0.0,
        renormalize_logits=False,
        encoder_repetition_penalty=1.0,
        remove_invalid_values=False,
        repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        min_length=0,
    )
    hf = _variant(marian, tmp_path, edit)
    assert _generate(marian, hf) == marian_base
    assert _ours(marian, hf, tmp_path) == marian_base


def test_m2m100_forced_bos_in_the_config_is_refused(m2m100, tmp_path, capsys):
    from transformer_ext.convert.__main__ import main

    hf = _variant(m2m100, tmp_path, _set(forced_bos_token_id=5))
    assert main(["transformers", "--model", str(hf), "--output-dir", str(tmp_path / "o")]) == 1
    assert "forced_bos_token_id" in capsys.readouterr().err and not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------------------
# sampling, the export's budget rule
# ------------------------------------------------------------------------------------------


def test_sampling_a_converted_model_implies_beam_1_unless_a_beam_is_given(marian):
    """The checkpoint's num_beams (4) is the default of beam search, not of sampling."""
    from transformer_ext.translator import TranslationError

    translator = Translator.from_model_dir(marian["ours"])
    assert translator.resolve_options()["beam_size"] == 4
    sampled = translator.translate(marian["texts"], sampling_topk=0, seed=7)
    explicit = translator.translate(marian["texts"], sampling_topk=0, seed=7, beam_size=1)
    assert [t.hypotheses[0].tokens for t in sampled] == [t.hypotheses[0].tokens for t in explicit]
    assert Translator.from_model_dir(marian["ours"], sampling_topk=5).resolve_options()["beam_size"] == 1
    with pytest.raises(TranslationError, match="needs beam size 1, got 4"):
        translator.translate(marian["texts"], sampling_topk=0, beam_size=4)


def test_export_keeps_one_budget_rule_and_decodes_as_generate(marian, tmp_path, capsys):
    """The generation config an export of a converted model gets (generation.json: what
    export.onnx writes) states the checkpoint's budget in one form (max_len_a 0, max_len_b =
    max_new_tokens = max_length - 1) and keeps a negative length penalty; a translator with it
    (as from_export_dir builds one, here over the eager runner: tracing an export costs a minute)
    decodes as generate(); evaluate prints the budget in that form."""
    from export.onnx import imported_generation
    from transformer_ext.evaluate import main as evaluate
    from transformer_ext.export_format import GenerationConfig

    hf = _variant(marian, tmp_path, _set(length_penalty=-2.0, max_length=24))
    expected = _generate(marian, hf)
    ours = convert_transformers(hf, tmp_path / "ours")
    eager = Translator.from_model_dir(ours)
    manifest = {"max_cache_len": MAX_POS, "model_config": eager.runner.model.config.to_dict()}
    generation = GenerationConfig.defaults_for(manifest, **imported_generation(ours, MAX_POS)).to_dict()
    assert (generation["max_len_a"], generation["max_len_b"], generation["max_new_tokens"]) == (0, 23, 23)
    assert (generation["length_penalty"], generation["alpha"]) == ("hf", -2.0)
    translator = Translator(
        eager.tokenizer,
        eager.runner,
        generation=GenerationConfig.from_dict(generation),
        pretrained=eager.pretrained,
        source_dir=ours,
    )
    assert [t.hypotheses[0].tokens for t in translator.translate(marian["texts"])] == expected
    src = tmp_path / "src.txt"
    src.write_text("".join(t + "\n" for t in marian["texts"]))
    capsys.readouterr()
    assert evaluate(["--model", str(ours), "--src", str(src), "--ref", str(src), "--beam", "4"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "at most 23 tokens" in first and "source length" not in first, first


def test_triton_refuses_generation_defaults_its_translator_does_not_apply():
    from export.triton import TritonExportError, _pretrained_parameters
    from transformer_ext.convert import GenerationDefaults

    assert _pretrained_parameters(GenerationDefaults(max_length=16))["max_len_b"] == 15.0
    for values, name in (
        (dict(repetition_penalty=1.5), "repetition_penalty"),
        (dict(no_repeat_ngram_size=2), "no_repeat_ngram_size"),
        (dict(forced_first_token=5), "forced_first_token"),
        (dict(renormalize_logits=True), "renormalize_logits"),
    ):
        with pytest.raises(TritonExportError, match=name):
            _pretrained_parameters(GenerationDefaults(**values))


def test_generation_defaults_and_the_export_config_as_search_options_decode_as_generate(marian, tmp_path):
    """GenerationDefaults (generation_defaults.json) and GenerationConfig (generation.json) each
    give a SearchOptions; layered package defaults < export config < checkpoint defaults, it
    drives decoding.generate() to generate()'s tokens."""
    from export.onnx import imported_generation
    from transformer_ext.convert import read_generation_defaults
    from transformer_ext.decoding import SearchOptions, generate
    from transformer_ext.export_format import GenerationConfig

    hf = _variant(
        marian,
        tmp_path,
        _set(repetition_penalty=1.5, min_length=6, renormalize_logits=True, num_return_sequences=2),
    )
    flat = _generate(marian, hf)
    ours = convert_transformers(hf, tmp_path / "ours")
    defaults = read_generation_defaults(ours)
    eager = Translator.from_model_dir(ours)
    manifest = {"max_cache_len": MAX_POS, "model_config": eager.runner.model.config.to_dict()}
    export = GenerationConfig.defaults_for(manifest, **imported_generation(ours, MAX_POS))
    layered = defaults.to_search_options(export.to_search_options(SearchOptions()))
    assert (layered.beam_size, layered.num_hypotheses, layered.max_decoding_length) == (4, 2, 15)
    assert (layered.min_decoding_length, layered.repetition_penalty, layered.renormalize_logits) == (
        5,
        1.5,
        True,
    )
    tok = eager.tokenizer
    sources = marian["sources"]
    ids = np.full((len(sources), max(map(len, sources))), tok.pad_id, dtype=np.int64)
    for i, src in enumerate(sources):
        ids[i, : len(src)] = src
    lengths = np.array([len(src) for src in sources], dtype=np.int64)
    hyps = generate(
        eager.runner,
        ids,
        lengths,
        bos_id=tok.bos_id,
        eos_id=tok.eos_id,
        max_decoding_length=layered.budget(lengths),
        **layered.generate_kwargs(),
    )
    assert [h.tokens for row in hyps for h in row] == flat
    plain = GenerationConfig.defaults_for(manifest).to_search_options()
    assert (plain.max_len_a, plain.max_len_b, plain.length_penalty_type) == (1.5, 10.0, "gnmt")
