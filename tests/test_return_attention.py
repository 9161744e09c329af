"""return_attention: each hypothesis' cross-attention rows (the last decoder layer's
probabilities averaged over its heads), from the eager runner and from ONNX Runtime on an
export made with ``--attention``, through greedy decoding and beam search.

The oracle is the independent float64 reference Transformer of tests/reference_model.py run
with teacher forcing on the final hypothesis, its last layer's cross-attention averaged over
the heads in the test."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import TOLERANCE, make_model_dir
from reference_model import DTYPE, ReferenceTransformer, _attention, _ffn, _layer_norm, _linear, _sublayer

from transformer_ext import decoding
from transformer_ext.checkpoint import load_model
from transformer_ext.translator import TranslationError, Translator

SOURCES = ["hello world", "abc", "a quick test of attention", "x y z"]
SEARCHES = [dict(beam_size=1), dict(beam_size=3, num_hypotheses=2)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("attn") / "model", seed=3)


@pytest.fixture(scope="module")
def attention_export(model_dir, tmp_path_factory):
    from export.onnx import export_onnx

    out = tmp_path_factory.mktemp("attn_export") / "export"
    export_onnx(model_dir, out, attention=True, tolerance=TOLERANCE)
    return out


def reference_attention(model, src_ids: list[int], tokens: list[int], start_id: int) -> np.ndarray:
    """The last decoder layer's cross-attention under teacher forcing (float64, the reference
    model), averaged over the heads: ``[len(tokens), len(src_ids)]``, row t the query that fed
    the token before ``tokens[t]`` (the start token for t = 0)."""
    ref = ReferenceTransformer(model.config, model.state_dict())
    hp, W = ref.hp, ref.W
    src = torch.tensor([src_ids])
    memory, src_add = ref.encode(src, torch.tensor([len(src_ids)]))
    tgt_in = torch.tensor([[start_id] + tokens[:-1]]) if tokens else torch.tensor([[start_id]])
    T = tgt_in.shape[1]
    future = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
    causal_add = torch.zeros(1, 1, T, T, dtype=DTYPE).masked_fill(future, float("-inf"))
    y = ref._embed(tgt_in, W["tgt_emb"])
    for i, L in enumerate(W["dec"]):
        y = _sublayer(y, lambda h, L=L: _attention(h, h, L["self"], hp.n_heads, causal_add), L["ln1"], hp)
        if i == len(W["dec"]) - 1:  # the probabilities of this layer's cross-attention, by hand
            h = _layer_norm(y, L["ln2"], hp.eps) if hp.pre_ln else y
            dk = hp.d_model // hp.n_heads
            q = _linear(h, L["cross"]["q"]).view(1, T, hp.n_heads, dk).permute(0, 2, 1, 3)
            k = _linear(memory, L["cross"]["k"]).view(1, -1, hp.n_heads, dk).permute(0, 2, 1, 3)
            probs = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(dk) + src_add, dim=-1)
            return probs[0].mean(dim=0)[: len(tokens)].numpy()
        y = _sublayer(y, lambda h, L=L: _attention(h, memory, L["cross"], hp.n_heads, src_add), L["ln2"], hp)
        y = _sublayer(y, lambda h, L=L: _ffn(h, L["ffn"]), L["ln3"], hp)
    raise AssertionError("no decoder layer")


@pytest.mark.parametrize("search", SEARCHES, ids=["greedy", "beam"])
def test_attention_rows_match_the_reference_and_onnx_runtime(model_dir, attention_export, search):
    eager = Translator.from_model_dir(model_dir)
    ort = Translator.from_export_dir(attention_export)
    model = load_model(model_dir, "cpu")
    opts = dict(max_len_a=0.0, max_len_b=6.0, **search)
    a = eager.translate(SOURCES, return_attention=True, **opts)
    b = ort.translate(SOURCES, return_attention=True, **opts)
    encoded = eager.encode(SOURCES)
    checked = 0
    for ids, ta, tb in zip(encoded, a, b):
        assert len(ta.hypotheses) == search.get("num_hypotheses", 1)
        for ha, hb in zip(ta.hypotheses, tb.hypotheses):
            assert ha.tokens == hb.tokens
            wa, wb = np.array(ha.attention), np.array(hb.attention)
            assert wa.shape == (len(ha.tokens), len(ids)) == wb.shape
            np.testing.assert_allclose(wa.sum(axis=1), 1.0, atol=1e-5)
            np.testing.assert_allclose(wa, wb, atol=1e-5)
            expected = reference_attention(model, ids, ha.tokens, eager.bos_id)
            np.testing.assert_allclose(wa, expected, atol=1e-5)
            checked += len(ha.tokens)
    assert checked > 0
    # a translation without return_attention carries none, and the same tokens
    plain = eager.translate(SOURCES, **opts)
    assert [t.tokens for t in plain] == [t.tokens for t in a]
    assert all(h.attention is None for t in plain for h in t.hypotheses)


def test_beam_attention_follows_the_reordered_beams(model_dir):
    """A beam's rows are those of its own prefix: every hypothesis of the n-best (beams that
    were reordered during the search) matches the reference on its own tokens."""
    eager = Translator.from_model_dir(model_dir)
    model = load_model(model_dir, "cpu")
    out = eager.translate(SOURCES[2:3], return_attention=True, beam_size=4, n_best=4, max_len_b=8.0)
    (ids,) = eager.encode(SOURCES[2:3])
    hyps = out[0].hypotheses
    assert len({tuple(h.tokens) for h in hyps}) == 4
    for h in hyps:
        np.testing.assert_allclose(
            np.array(h.attention), reference_attention(model, ids, h.tokens, eager.bos_id), atol=1e-5
        )


def test_padded_positions_get_no_weight(model_dir):
    """A short source decoded in a batch with a long one: its rows have its own length and sum to 1."""
    eager = Translator.from_model_dir(model_dir)
    runner = eager.runner
    src = eager.encode(["ab", "a much longer source"])
    lengths = np.array([len(x) for x in src])
    ids = np.full((2, lengths.max()), eager.pad_id, dtype=np.int64)
    for r, x in enumerate(src):
        ids[r, : len(x)] = x
    state = runner.encode(ids, lengths, 4, 1)
    _, weights = runner.step_with_attention(state, np.full(2, eager.bos_id))
    assert weights.shape == (2, lengths.max())
    assert np.all(weights[0, lengths[0] :] == 0)
    np.testing.assert_allclose(weights.sum(axis=1), 1.0, atol=1e-6)


def test_an_export_without_the_output_refuses_return_attention(exported_portable):
    ort = Translator.from_export_dir(exported_portable)
    with pytest.raises(
        TranslationError, match=r"no attention output: export it with `python -m export.onnx --attention`"
    ):
        ort.translate(["abc"], return_attention=True)
    assert ort.translate(["abc"])  # the export itself still translates


def test_a_runner_without_attention_is_refused_in_one_line():
    class StepOnly:
        def encode(self, *a):
            raise AssertionError("not reached")

        step = reorder = encode

    with pytest.raises(ValueError, match=r"the StepOnly runner cannot return attention weights") as exc:
        decoding.check_attention_runner(StepOnly())
    assert "\n" not in str(exc.value)


def test_translate_iterable_carries_the_attention_too(model_dir):
    eager = Translator.from_model_dir(model_dir)
    opts = dict(max_len_a=0.0, max_len_b=5.0, return_attention=True)
    streamed = list(eager.translate_iterable(iter(SOURCES), max_batch_tokens=16, window=3, **opts))
    whole = eager.translate(SOURCES, **opts)
    for a, b in zip(streamed, whole, strict=True):
        assert a.tokens == b.tokens
        np.testing.assert_allclose(np.array(a.attention), np.array(b.attention), atol=1e-6)
