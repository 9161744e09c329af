"""The search with ``length_penalty="hf"`` against transformers' own ``generate()``: the same
model (a tiny MarianMTModel with random weights) behind both, through a runner that re-runs
transformers' decoder on each row's fed tokens, so that only the searches differ. Tokens must be
equal and scores within float32 noise, for transformers' generation options as our options:
``num_beams``, ``length_penalty``, ``early_stopping``, ``max_length``, ``min_length``,
``bad_words_ids``, ``forced_bos_token_id``, ``forced_eos_token_id``, ``no_repeat_ngram_size``,
``repetition_penalty``, ``renormalize_logits``, ``decoder_start_token_id``. Skipped without
transformers (a test dependency, requirements/dev.txt)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from transformer_ext.decoding import beam_search, greedy_decode

transformers = pytest.importorskip("transformers")

V = 48
EOS = 0
PAD = V - 1  # Marian: the decoder starts with <pad>, the last id
N_SOURCES = 16
MAX_LENGTH = 14  # transformers' max_length: the decoder start token included


@pytest.fixture(scope="module")
def model():
    """A MarianMTModel with random weights whose EOS logit is raised or lowered by the last fed
    token (a random bias per token): the outputs end at varied lengths, so that the length
    penalty and the stopping rules matter. transformers' generate() and our runner call the
    same forward."""

    class EosAfterTokens(transformers.MarianMTModel):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits[..., EOS] += self.eos_bias[kwargs["decoder_input_ids"]]
            return out

    config = transformers.MarianConfig(
        vocab_size=V,
        d_model=32,
        encoder_layers=1,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=64,
        pad_token_id=PAD,
        eos_token_id=EOS,
        decoder_start_token_id=PAD,
        forced_eos_token_id=None,
        init_std=0.6,  # larger than the default, so that the tokens vary between steps
        activation_function="swish",
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    m = EosAfterTokens(config).eval()
    m.eos_bias = torch.randn(V, generator=torch.Generator().manual_seed(3)) * 3.0
    m.eos_bias[PAD] = -5.0
    return m


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(1)
    lengths = rng.integers(2, 9, size=N_SOURCES).astype(np.int64)
    ids = np.full((N_SOURCES, int(lengths.max())), PAD, dtype=np.int64)
    for b, n in enumerate(lengths):
        ids[b, : n - 1] = rng.integers(1, PAD, size=n - 1)
        ids[b, n - 1] = EOS  # Marian sources end with </s>
    return ids, lengths


class TransformersRunner:
    """The runner protocol over a transformers seq2seq model: the encoder once, then at every
    step the decoder over each row's fed tokens (no cache: what ``generate(use_cache=False)``
    computes)."""

    def __init__(self, model):
        self.model = model

    def encode(self, input_ids, src_lengths, cache_len, beam_size=1):
        ids = torch.from_numpy(input_ids)
        mask = torch.arange(ids.shape[1])[None, :] < torch.from_numpy(src_lengths)[:, None]
        with torch.no_grad():
            hidden = self.model.get_encoder()(input_ids=ids, attention_mask=mask.long()).last_hidden_state
        return dict(
            hidden=hidden.repeat_interleave(beam_size, 0),
            mask=mask.long().repeat_interleave(beam_size, 0),
            fed=np.zeros((hidden.shape[0] * beam_size, 0), dtype=np.int64),
        )

    def step(self, state, tokens):
        state["fed"] = np.concatenate([state["fed"], tokens[:, None]], axis=1)
        with torch.no_grad():
            out = self.model(
                encoder_outputs=(state["hidden"],),
                attention_mask=state["mask"],
                decoder_input_ids=torch.from_numpy(state["fed"]),
                use_cache=False,
            )
        return out.logits[:, -1].float().numpy()

    def reorder(self, state, beam_index):
        state["fed"] = state["fed"][beam_index]


def transformers_generate(model, ids, lengths, **kwargs):
    mask = (np.arange(ids.shape[1])[None, :] < lengths[:, None]).astype(np.int64)
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.from_numpy(ids),
            attention_mask=torch.from_numpy(mask),
            max_length=MAX_LENGTH,
            do_sample=False,
            use_cache=False,
            output_scores=True,
            return_dict_in_generate=True,
            **kwargs,
        )
    tokens = []
    beam_indices = getattr(out, "beam_indices", None)
    for i, row in enumerate(out.sequences.tolist()):
        row = row[1:]  # the decoder start token
        if beam_indices is not None:  # beam search: the generated length (the rest is padding)
            row = row[: int((beam_indices[i] >= 0).sum())]
        tokens.append(row[: row.index(EOS)] if EOS in row else row)  # greedy pads only after an EOS
    scores = out.sequences_scores.numpy() if getattr(out, "sequences_scores", None) is not None else None
    return tokens, scores


def our_options(hf_kwargs, n_sources):
    """transformers' generation options as ours."""
    ours = dict(max_decoding_length=MAX_LENGTH - 1, decoder_start_id=PAD)
    if "min_length" in hf_kwargs:
        ours["min_decoding_length"] = hf_kwargs["min_length"] - 1  # transformers counts the start token
    if "bad_words_ids" in hf_kwargs:
        ours["banned_ids"] = [ids[0] for ids in hf_kwargs["bad_words_ids"]]
    if "forced_bos_token_id" in hf_kwargs:
        ours["target_prefix"] = [[hf_kwargs["forced_bos_token_id"]]] * n_sources
    if "forced_eos_token_id" in hf_kwargs:
        ours["force_eos_at_budget"] = True
    for name in ("no_repeat_ngram_size", "repetition_penalty"):
        if name in hf_kwargs:
            ours[name] = hf_kwargs[name]
    return ours


MARIAN_LIKE = dict(bad_words_ids=[[PAD]], forced_eos_token_id=EOS)
BEAM_CASES = [
    dict(num_beams=4, length_penalty=1.0, early_stopping=False, **MARIAN_LIKE),
    dict(num_beams=4, length_penalty=1.0, early_stopping=True, num_return_sequences=3),
    dict(num_beams=3, length_penalty=1.5, early_stopping="never", num_return_sequences=2, **MARIAN_LIKE),
    dict(num_beams=5, length_penalty=-0.7, early_stopping=False),
    dict(num_beams=4, length_penalty=0.6, min_length=6, no_repeat_ngram_size=2, forced_bos_token_id=7),
    dict(num_beams=4, length_penalty=1.0, repetition_penalty=1.4, renormalize_logits=True, **MARIAN_LIKE),
    dict(num_beams=2, length_penalty=1.0, repetition_penalty=0.8, no_repeat_ngram_size=1, min_length=3),
]


@pytest.mark.parametrize("hf_kwargs", BEAM_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_hf_beam_search_equals_transformers_generate(model, batch, hf_kwargs):
    ids, lengths = batch
    want, want_scores = transformers_generate(model, ids, lengths, **hf_kwargs)
    n = hf_kwargs.get("num_return_sequences", 1)
    hyps = beam_search(
        TransformersRunner(model),
        ids,
        lengths,
        bos_id=EOS,
        eos_id=EOS,
        beam_size=hf_kwargs["num_beams"],
        num_hypotheses=n,
        length_penalty_type="hf",
        length_penalty=hf_kwargs["length_penalty"],
        early_stopping=hf_kwargs["early_stopping"] if "early_stopping" in hf_kwargs else None,
        renormalize_logits=hf_kwargs.get("renormalize_logits", False),
        **our_options(hf_kwargs, len(ids)),
    )
    got = [h.tokens for row in hyps for h in row]
    assert got == want
    np.testing.assert_allclose([h.score for row in hyps for h in row], want_scores, rtol=1e-4, atol=1e-4)
    assert len({tuple(t) for t in got}) > 1  # the model does not give every source one output


GREEDY_CASES = [
    dict(**MARIAN_LIKE),
    dict(min_length=5, no_repeat_ngram_size=2, repetition_penalty=1.3, forced_bos_token_id=9),
    dict(repetition_penalty=0.7, no_repeat_ngram_size=1, **MARIAN_LIKE),
]


@pytest.mark.parametrize("hf_kwargs", GREEDY_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_greedy_equals_transformers_generate(model, batch, hf_kwargs):
    ids, lengths = batch
    want, _ = transformers_generate(model, ids, lengths, num_beams=1, **hf_kwargs)
    got = greedy_decode(
        TransformersRunner(model), ids, lengths, bos_id=EOS, eos_id=EOS, **our_options(hf_kwargs, len(ids))
    )
    assert got == want


def test_our_rules_give_other_tokens(model, batch):
    """The negative control: the comparison above can fail. Our "average" kind has the same
    divisor (length ** alpha) but our rules (bans renormalised, a forced token's model
    log-probability, our stop bound): it gives other tokens than transformers on this model."""
    ids, lengths = batch
    hf_kwargs = dict(num_beams=4, length_penalty=1.0, early_stopping=False, **MARIAN_LIKE)
    want, _ = transformers_generate(model, ids, lengths, **hf_kwargs)
    hyps = beam_search(
        TransformersRunner(model),
        ids,
        lengths,
        bos_id=EOS,
        eos_id=EOS,
        beam_size=4,
        length_penalty_type="average",
        length_penalty=1.0,
        **our_options(hf_kwargs, len(ids)),
    )
    assert [row[0].tokens for row in hyps] != want
