"""The beam search as first written: a Python loop over sources per step, float64 log-softmax
over ``[rows, vocab]``. Kept as an independent oracle for the vectorised search in
``transformer_ext.decoding`` (tests/test_beam_vectorised.py compares the two on random runners).
It must stay a separate implementation: do not make it call the search it checks.

It also implements every option of the search in plain loops (:func:`row_log_probs`: the logit
processors of one row, transformers' variant on log-probabilities, forced tokens), so the tests
check them against it too, and greedy decoding, sampling and forced decoding one source and one
token at a time (:func:`loop_greedy`, :func:`loop_sample`, :func:`loop_score`)."""

from __future__ import annotations

import math

import numpy as np

from transformer_ext.decoding import Hypothesis, length_penalty_factor, log_softmax

EOS = 2  # the special ids of the loops below (and of the tests' random runners)
BOS = 1


def row_log_probs(
    logits,
    sequence,
    t,
    *,
    eos_id,
    prefix=(),
    max_new,
    min_new=0,
    banned_ids=(),
    repetition_penalty=1.0,
    no_repeat_ngram_size=0,
    force_eos_at_budget=False,
    hf=False,
    renormalize_logits=False,
):
    """The log-probabilities one row chooses from at step ``t`` (``sequence``: its fed tokens,
    start token first), in float64, one token at a time."""
    x = np.asarray(logits, dtype=np.float64).copy()
    V = len(x)
    forced = None
    if t < len(prefix):
        forced = int(prefix[t])
    elif force_eos_at_budget and t == max_new - 1:
        forced = eos_id
    if forced is not None:
        out = np.full(V, -np.inf)
        out[forced] = 0.0 if hf else log_softmax(x)[forced]
        return out
    if hf:
        x = log_softmax(x)
    if repetition_penalty != 1.0:
        for tok in set(sequence):
            x[tok] = x[tok] * repetition_penalty if x[tok] < 0 else x[tok] / repetition_penalty
    n = no_repeat_ngram_size
    if n > 0:
        seq = list(sequence)
        tail = seq[len(seq) - n + 1 :] if n > 1 else []
        for i in range(len(seq) - n + 1):
            if seq[i : i + n - 1] == tail:
                x[seq[i + n - 1]] = -np.inf
    for tok in banned_ids:
        x[tok] = -np.inf
    if t < min_new:
        x[eos_id] = -np.inf
    if hf:
        return log_softmax(x) if renormalize_logits else x
    return log_softmax(x)


def loop_beam_search(
    runner,
    input_ids,
    src_lengths,
    *,
    bos_id: int,
    eos_id: int,
    beam_size: int,
    num_hypotheses: int = 1,
    max_decoding_length,
    min_decoding_length=0,
    length_penalty_type: str = "gnmt",
    length_penalty: float = 0.6,
    cache_len=None,
    decoder_start_id=None,
    target_prefix=None,
    banned_ids=(),
    repetition_penalty=1.0,
    no_repeat_ngram_size=0,
    force_eos_at_budget=False,
    early_stopping=None,
    renormalize_logits=False,
):
    # The tests call it with valid arguments only: no argument checks here.
    ids, lengths = np.asarray(input_ids, dtype=np.int64), np.asarray(src_lengths, dtype=np.int64)
    B, K = ids.shape[0], int(beam_size)
    max_new = np.broadcast_to(np.asarray(max_decoding_length, dtype=np.int64), (B,))
    min_new = np.broadcast_to(np.asarray(min_decoding_length, dtype=np.int64), (B,))
    hf = length_penalty_type == "hf"
    early_stopping = False if early_stopping is None else early_stopping
    start = bos_id if decoder_start_id is None else decoder_start_id
    prefixes = [[] for _ in range(B)] if target_prefix is None else [list(p) for p in target_prefix]
    keep = K if hf else num_hypotheses
    steps = int(max_new.max())
    results = [[] for _ in range(B)]
    if steps == 0:
        return [[Hypothesis([], 0.0, 0.0, False, [])] for _ in range(B)]
    cache_len = steps if cache_len is None else cache_len

    def penalty(length: int) -> float:
        return length_penalty_factor(length, length_penalty_type, length_penalty)

    N = B * K
    state = runner.encode(ids, lengths, cache_len, K)
    # Cumulative log-probabilities of the open beams; only beam 0 is live at the start (all
    # beams of a source are identical then, expanding them all would give K copies).
    beam_scores = np.full((B, K), -np.inf, dtype=np.float64)
    beam_scores[:, 0] = 0.0
    history = np.zeros((N, 0), dtype=np.int64)  # generated tokens of every open beam
    history_lp = np.zeros((N, 0))  # and their log-probabilities
    finished: list[list[Hypothesis]] = [[] for _ in range(B)]
    done = max_new == 0
    for b in np.flatnonzero(done):
        results[b] = [Hypothesis([], 0.0, 0.0, False, [])]
    tokens = np.full(N, start, dtype=np.int64)
    identity = np.arange(N, dtype=np.int64)

    for t in range(steps):
        logits = np.asarray(runner.step(state, tokens))
        if logits.ndim != 2 or logits.shape[0] != N:
            raise RuntimeError(f"runner.step returned logits of shape {logits.shape}, expected ({N}, V)")
        V = logits.shape[1]
        logp = np.stack(
            [
                row_log_probs(
                    logits[r],
                    [start] + history[r].tolist(),
                    t,
                    eos_id=eos_id,
                    prefix=prefixes[r // K],
                    max_new=int(max_new[r // K]),
                    min_new=int(min_new[r // K]),
                    banned_ids=banned_ids,
                    repetition_penalty=repetition_penalty,
                    no_repeat_ngram_size=no_repeat_ngram_size,
                    force_eos_at_budget=force_eos_at_budget,
                    hf=hf,
                    renormalize_logits=renormalize_logits,
                )
                for r in range(N)
            ]
        ).reshape(B, K, V)
        cand = (beam_scores[:, :, None] + logp).reshape(B, K * V)  # [B, K*V]
        n_cand = min(2 * K, K * V)
        top = np.argpartition(-cand, n_cand - 1, axis=1)[:, :n_cand]  # [B, 2K], unordered

        beam_index = identity.copy()
        new_tokens = np.full(N, eos_id, dtype=np.int64)
        new_lp = np.zeros(N)
        new_scores = np.full((B, K), -np.inf, dtype=np.float64)
        length = t + 1  # generated tokens after this step, the candidate included
        for b in range(B):
            if done[b]:
                continue
            order = top[b][np.argsort(-cand[b, top[b]], kind="stable")]
            n_open = 0
            for rank, flat in enumerate(order):
                score = cand[b, flat]
                beam, tok = divmod(int(flat), V)
                row = b * K + beam
                token_lp = float(logp[b, beam, tok])
                if tok == eos_id:
                    if rank < K and np.isfinite(score):
                        finished[b].append(
                            Hypothesis(
                                history[row].tolist(),
                                float(score) / penalty(length),
                                float(score),
                                True,
                                history_lp[row].tolist() + [token_lp],
                            )
                        )
                    continue
                if n_open < K:
                    beam_index[b * K + n_open] = row
                    new_tokens[b * K + n_open] = tok
                    new_lp[b * K + n_open] = token_lp
                    new_scores[b, n_open] = score
                    n_open += 1
                if n_open == K and rank >= K:
                    break
            # Done? At this source's budget, or when no open beam can beat the n-th best.
            at_budget = length >= max_new[b]
            finished[b].sort(key=lambda h: h.score, reverse=True)
            best_open = np.max(new_scores[b])
            if not at_budget and len(finished[b]) >= keep:
                if hf and early_stopping is True:
                    done[b] = True
                else:
                    if hf:
                        horizon = (
                            int(max_new[b]) if early_stopping == "never" and length_penalty > 0 else length
                        )
                        divisor = float(horizon) ** length_penalty
                    else:
                        divisor = penalty(int(max_new[b]))
                    bound = best_open / divisor if np.isfinite(best_open) else -np.inf
                    if bound <= finished[b][keep - 1].score:
                        done[b] = True
            if not np.isfinite(best_open) and finished[b]:
                done[b] = True  # every continuation is impossible (-inf)
            if at_budget:
                for k in range(K):
                    if np.isfinite(new_scores[b, k]):
                        row = beam_index[b * K + k]
                        toks = history[row].tolist() + [int(new_tokens[b * K + k])]
                        lps = history_lp[row].tolist() + [float(new_lp[b * K + k])]
                        s = float(new_scores[b, k])
                        finished[b].append(Hypothesis(toks, s / penalty(length), s, False, lps))
                done[b] = True
            if done[b]:
                finished[b].sort(key=lambda h: h.score, reverse=True)
                results[b] = finished[b][:num_hypotheses]
                new_scores[b, :] = -np.inf
                beam_index[b * K : (b + 1) * K] = identity[b * K : (b + 1) * K]
                new_tokens[b * K : (b + 1) * K] = eos_id
        if done.all():
            break
        beam_scores = new_scores
        history = np.concatenate([history[beam_index], new_tokens[:, None]], axis=1)
        history_lp = np.concatenate([history_lp[beam_index], new_lp[:, None]], axis=1)
        if not np.array_equal(beam_index, identity):
            runner.reorder(state, beam_index)
        tokens = new_tokens

    for b in range(B):
        if not results[b]:  # only reachable if every candidate was -inf throughout
            finished[b].sort(key=lambda h: h.score, reverse=True)
            results[b] = finished[b][:num_hypotheses] or [Hypothesis([], -math.inf, -math.inf, False, [])]
    return results


# ------------------------------------------------------------------------------------------
# greedy decoding, sampling and forced decoding as plain loops (over fn(source, prefix) -> logits)
# ------------------------------------------------------------------------------------------


def processor_kwargs(options, b, max_new, min_new):
    prefix = options.get("target_prefix")
    return dict(
        eos_id=EOS,
        prefix=() if prefix is None else prefix[b],
        max_new=int(max_new[b]),
        min_new=int(min_new[b]),
        banned_ids=options.get("banned_ids", ()),
        repetition_penalty=options.get("repetition_penalty", 1.0),
        no_repeat_ngram_size=options.get("no_repeat_ngram_size", 0),
        force_eos_at_budget=options.get("force_eos_at_budget", False),
    )


def forced_token(options, b, t, max_new):
    prefix = options.get("target_prefix")
    if prefix is not None and t < len(prefix[b]):
        return int(prefix[b][t])
    if options.get("force_eos_at_budget") and t == int(max_new[b]) - 1:
        return EOS
    return None


def loop_greedy(fn, B, max_new, min_new, options):
    """One source at a time, one token at a time: (tokens, token log-probs, finished)."""
    start = options.get("decoder_start_id")
    start = BOS if start is None else start
    out = []
    for b in range(B):
        generated, lps, finished = [], [], False
        for t in range(int(max_new[b])):
            logits = np.float32(fn(b, tuple(generated)))
            lp = row_log_probs(
                logits, [start] + generated, t, **processor_kwargs(options, b, max_new, min_new)
            )
            tok = forced_token(options, b, t, max_new)
            tok = int(np.argmax(lp)) if tok is None else tok
            lps.append(float(lp[tok]))
            if tok == EOS:
                finished = True
                break
            generated.append(tok)
        out.append((generated, lps, finished))
    return out


def loop_sample(fn, B, n, max_new, min_new, options, topk, topp, temperature, seed, source_index=None):
    """Sampling as specified: source b draws from a numpy Generator of its own, seeded with
    ``SeedSequence([seed, index])`` (``index``: ``source_index[b]``, default b), ``n`` values
    (one per row of the source, in order) at every step while any row of the batch is open; row
    r's token: the top-k tokens by processed logit, probabilities ``exp((l - max) / T)``, top-p
    over them (most likely first), then the first token in id order whose cumulative probability
    exceeds ``u * total``."""
    index = list(range(B)) if source_index is None else [int(i) for i in source_index]
    streams = [np.random.default_rng(np.random.SeedSequence([seed, index[b]])) for b in range(B)]
    start = options.get("decoder_start_id")
    start = BOS if start is None else start
    N = B * n
    rows = [dict(gen=[], lps=[], open=int(max_new[r // n]) > 0) for r in range(N)]
    t = 0
    while any(row["open"] for row in rows):
        u = [value for g in streams for value in g.random(n)]
        for r, row in enumerate(rows):
            if not row["open"]:
                continue
            b = r // n
            logits = np.float32(fn(b, tuple(row["gen"])))
            lp = row_log_probs(
                logits, [start] + row["gen"], t, **processor_kwargs(options, b, max_new, min_new)
            )
            z = lp  # the processed logits up to a constant per row
            V = len(z)
            k = V if topk == 0 else min(topk, V)
            cand = sorted(np.argsort(-z, kind="stable")[:k].tolist())
            finite = [z[c] for c in cand if np.isfinite(z[c])]
            m = max(finite) if finite else 0.0
            p = {c: math.exp((z[c] - m) / temperature) if np.isfinite(z[c]) else 0.0 for c in cand}
            if topp < 1.0:
                ranked = sorted(cand, key=lambda c: -p[c])  # stable: ties by id
                total = sum(p[c] for c in ranked)
                kept, before = set(), 0.0
                for c in ranked:
                    if before < topp * total:
                        kept.add(c)
                    before += p[c]
                p = {c: (p[c] if c in kept else 0.0) for c in cand}
            total = sum(p[c] for c in cand)
            acc, tok = 0.0, None
            for c in cand:
                acc += p[c]
                if acc > u[r] * total:
                    tok = c
                    break
            if tok is None:  # every probability is 0: the first token, as greedy decoding picks
                tok = int(np.argmax(lp))
            forced = forced_token(options, b, t, max_new)
            tok = tok if forced is None else forced
            row["lps"].append(float(lp[tok]))
            if tok == EOS:
                row["open"], row["finished"] = False, True
                continue
            row["gen"].append(tok)
            if len(row["gen"]) >= int(max_new[b]):
                row["open"], row["finished"] = False, False
        t += 1
    return rows


def loop_score(fn, targets, include_eos=True):
    out = []
    for b, target in enumerate(targets):
        wanted = list(target) + ([EOS] if include_eos else [])
        lps = []
        for t, tok in enumerate(wanted):
            lp = log_softmax(np.float32(fn(b, tuple(target[:t]))))
            lps.append(float(lp[tok]))
        out.append(lps)
    return out
