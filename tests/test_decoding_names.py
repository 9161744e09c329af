"""One name per search quantity in every layer: the parameters, dataclass fields and keyword
arguments of the searches (``transformer_ext.decoding``), of every runner (``transformer_ext.runtimes``),
of the Triton translator and of the decoding flags are CTranslate2's names (``beam_size``,
``num_hypotheses``, ``length_penalty`` the exponent, ``length_penalty_type`` the formula,
``max_decoding_length``, ``min_decoding_length``, ``sampling_topk``, ``sampling_topp``,
``sampling_temperature``). The older spellings live only in the documented deprecation shims,
which accept them with a warning (``decoding.renamed``, ``decoding.max_new_tokens_for``)."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
import warnings

import numpy as np
import pytest

import transformer_ext.decoding as decoding
import transformer_ext.runtimes as runtimes
from transformer_ext import translator_options

# an older spelling -> the name to use
FORBIDDEN = {
    "n_best": "num_hypotheses",
    "nbest": "num_hypotheses",
    "num_return_sequences": "num_hypotheses",
    "alpha": "length_penalty",
    "max_new_tokens": "max_decoding_length",
    "min_new_tokens": "min_decoding_length",
    "max_new": "max_decoding_length",
    "min_new": "min_decoding_length",
    "max_length": "max_decoding_length",
    "min_length": "min_decoding_length",
    "num_beams": "beam_size",
    "topk": "sampling_topk",
    "top_k": "sampling_topk",
    "topp": "sampling_topp",
    "top_p": "sampling_topp",
    "temperature": "sampling_temperature",
}
# the deprecation shims: functions that exist to accept an older spelling
SHIMS = {"transformer_ext.decoding.options.max_new_tokens_for"}


def _modules():
    names = [decoding.__name__]
    names += [m.name for m in pkgutil.walk_packages(decoding.__path__, decoding.__name__ + ".")]
    names += [m.name for m in pkgutil.iter_modules(runtimes.__path__, runtimes.__name__ + ".")]
    names += ["export.triton", "export.triton_models.translator.model", "transformer_ext.search_flags"]
    out = []
    for name in names:
        try:
            out.append(importlib.import_module(name))
        except ImportError as exc:  # an optional backend (TensorRT, CUDA) not installed here
            if name.endswith((".trt", ".ort_cuda")):
                continue
            raise AssertionError(f"{name} does not import: {exc}") from exc
    return out


def _callables(module):
    """``(qualified name, object)`` of every function, method and class defined in ``module``."""
    for name, obj in vars(module).items():
        if getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(obj):
            yield f"{module.__name__}.{name}", obj
        elif inspect.isclass(obj):
            yield f"{module.__name__}.{name}", obj
            for attr, member in vars(obj).items():
                member = member.__func__ if isinstance(member, (classmethod, staticmethod)) else member
                if isinstance(member, property):
                    member = member.fget
                if inspect.isfunction(member):
                    yield f"{module.__name__}.{name}.{attr}", member


def _names_of(obj):
    """The parameter names of a function (its signature as callers see it), the field names of
    a dataclass."""
    if inspect.isclass(obj):
        return [f.name for f in dataclasses.fields(obj)] if dataclasses.is_dataclass(obj) else []
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return []
    out = []
    for p in signature.parameters.values():
        out.append(p.name)
        # the formula under the exponent's name (the exponent is a number)
        if p.name == "length_penalty" and p.annotation in (str, "str"):
            out.append("length_penalty: str")
    return out


def older_spellings():
    """Every parameter or field of the search layers that uses an older spelling."""
    found = []
    for module in _modules():
        for qualname, obj in _callables(module):
            if qualname in SHIMS:
                continue
            for name in _names_of(obj):
                if name in FORBIDDEN:
                    found.append(f"{qualname}: {name} (use {FORBIDDEN[name]})")
                elif name == "length_penalty: str":
                    found.append(f"{qualname}: length_penalty as the formula (use length_penalty_type)")
    return found


def test_the_search_layers_use_one_name_per_quantity():
    assert older_spellings() == []


def test_the_walk_sees_the_searches_runners_and_the_triton_translator():
    seen = {q for m in _modules() for q, _ in _callables(m)}
    for name in (
        "transformer_ext.decoding.beam.beam_search",
        "transformer_ext.decoding.greedy.greedy_decode",
        "transformer_ext.decoding.api.generate",
        "transformer_ext.decoding.api.SearchMethods.beam_search",
        "transformer_ext.decoding.beam._BeamState",
        "transformer_ext.decoding.sampling._Sampler.__init__",
        "transformer_ext.runtimes.eager.EagerRunner.encode",
        "transformer_ext.runtimes.ort.OrtRunner.encode",
        "export.triton_models.translator.model.Settings",
    ):
        assert name in seen, name
    # a function with an older spelling is found (the check itself can fail)
    assert _names_of(lambda n_best, length_penalty: None)[0] in FORBIDDEN


@pytest.fixture
def fresh(monkeypatch):
    """A process in which no older name has warned yet."""
    monkeypatch.setattr(translator_options, "_WARNED", set())


class _Uniform:
    """A runner whose every step gives the same logits (token 3 best, then EOS)."""

    def encode(self, input_ids, src_lengths, cache_len, beam_size=1):
        return {"rows": len(input_ids) * beam_size}

    def step(self, state, tokens):
        logits = np.zeros((len(tokens), 6), dtype=np.float32)
        logits[:, 3], logits[:, 2] = 2.0, 1.0
        return logits

    def reorder(self, state, index):
        pass


OLD_CALLS = [
    (
        "beam_search",
        dict(beam_size=2, n_best=2, alpha=1.0, length_penalty="average", max_new_tokens=4, min_new_tokens=1),
        dict(
            beam_size=2,
            num_hypotheses=2,
            length_penalty=1.0,
            length_penalty_type="average",
            max_decoding_length=4,
            min_decoding_length=1,
        ),
    ),
    (
        "greedy_decode",
        dict(max_new_tokens=3, min_new_tokens=2),
        dict(max_decoding_length=3, min_decoding_length=2),
    ),
    (
        "generate",
        dict(beam_size=2, alpha=0.5, max_new_tokens=3),
        dict(beam_size=2, length_penalty=0.5, max_decoding_length=3),
    ),
]


@pytest.mark.parametrize("function, old, new", OLD_CALLS, ids=[c[0] for c in OLD_CALLS])
def test_the_older_keyword_names_work_with_one_warning_each(fresh, function, old, new):
    search = getattr(decoding, function)
    ids, lengths = np.array([[4, 5], [5, 0]]), np.array([2, 1])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = search(_Uniform(), ids, lengths, bos_id=1, eos_id=2, **old)
        again = search(_Uniform(), ids, lengths, bos_id=1, eos_id=2, **old)
    want = search(_Uniform(), ids, lengths, bos_id=1, eos_id=2, **new)
    assert got == again == want
    messages = [str(w.message) for w in seen if issubclass(w.category, FutureWarning)]
    older = [k for k in old if k not in new or (k == "length_penalty" and isinstance(old[k], str))]
    assert len(messages) == len(older), messages
    assert all(w.filename == __file__ for w in seen)  # the caller's line


def test_an_older_and_a_newer_name_together_are_an_error_naming_both(fresh):
    ids, lengths = np.array([[4, 5]]), np.array([2])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with pytest.raises(TypeError, match="n_best and num_hypotheses"):
            decoding.beam_search(
                _Uniform(), ids, lengths, bos_id=1, eos_id=2, beam_size=2, n_best=1, num_hypotheses=1,
                max_decoding_length=3,
            )  # fmt: skip
        with pytest.raises(TypeError, match="length_penalty='hf'.*length_penalty_type"):
            decoding.generate(
                _Uniform(), ids, lengths, bos_id=1, eos_id=2, beam_size=2, length_penalty="hf",
                length_penalty_type="hf", max_decoding_length=3,
            )  # fmt: skip


def test_the_older_budget_function_warns_and_agrees(fresh):
    with pytest.warns(FutureWarning, match="max_new_tokens_for is deprecated; use max_decoding_length_for"):
        old = decoding.max_new_tokens_for([1, 10], 1.5, 10, cap=20)
    np.testing.assert_array_equal(old, decoding.max_decoding_length_for([1, 10], 1.5, 10, cap=20))


def test_the_runners_encode_takes_the_older_num_beams_with_one_warning(fresh):
    """``runner.encode(..., num_beams=)`` (the protocol's older keyword) warns once and encodes
    the same rows as ``beam_size=``; both together are an error naming both."""
    from helpers import make_model

    from transformer_ext.runtimes import CatCacheRunner, EagerRunner

    model = make_model(False)
    ids, lengths = np.array([[4, 5, 6], [5, 6, 0]]), np.array([3, 2])
    for runner in (EagerRunner(model), CatCacheRunner(model)):
        tokens = np.array([1] * 6)
        want = runner.step(runner.encode(ids, lengths, 8, beam_size=3), tokens)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            got = runner.step(runner.encode(ids, lengths, 8, num_beams=3), tokens)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        with pytest.raises(TypeError, match="num_beams and beam_size"):
            runner.encode(ids, lengths, 8, num_beams=3, beam_size=3)
    messages = [str(w.message) for w in seen if issubclass(w.category, FutureWarning)]
    assert len(messages) <= 1 and all("num_beams is deprecated; use beam_size" in m for m in messages)
    translator_options._WARNED.clear()
    with pytest.warns(FutureWarning, match="num_beams is deprecated; use beam_size"):
        EagerRunner(model).encode(ids, lengths, 8, num_beams=2)


def test_the_translators_older_budget_method_warns_and_agrees(fresh, tmp_path):
    from transformer_ext.translator import Translator

    translator = Translator.from_model_dir(None)  # the bundled demo model
    lengths = np.array([1, 10])
    with pytest.warns(FutureWarning, match=r"Translator.max_new_tokens\(\) is deprecated"):
        old = translator.max_new_tokens(lengths, 1.5, 10)
    np.testing.assert_array_equal(old, translator.max_decoding_length(lengths, 1.5, 10))
