"""The beam search as first written: a Python loop over sources per step, float64 log-softmax
over ``[rows, vocab]``. Kept as an independent oracle for the vectorised search in
``transformer_ext.decoding`` (tests/test_beam_vectorised.py compares the two on random runners).
It must stay a separate implementation: do not make it call the search it checks."""

from __future__ import annotations

import math

import numpy as np

from transformer_ext.decoding import Hypothesis, length_penalty_factor, log_softmax


def loop_beam_search(
    runner,
    input_ids,
    src_lengths,
    *,
    bos_id: int,
    eos_id: int,
    beam_size: int,
    n_best: int = 1,
    max_new_tokens,
    min_new_tokens=0,
    length_penalty: str = "gnmt",
    alpha: float = 0.6,
    cache_len=None,
):
    # The tests call it with valid arguments only: no argument checks here.
    ids, lengths = np.asarray(input_ids, dtype=np.int64), np.asarray(src_lengths, dtype=np.int64)
    B, K = ids.shape[0], int(beam_size)
    max_new = np.broadcast_to(np.asarray(max_new_tokens, dtype=np.int64), (B,))
    min_new = np.broadcast_to(np.asarray(min_new_tokens, dtype=np.int64), (B,))
    steps = int(max_new.max())
    results = [[] for _ in range(B)]
    if steps == 0:
        return [[Hypothesis([], 0.0, 0.0, False)] for _ in range(B)]
    cache_len = steps if cache_len is None else cache_len

    def penalty(length: int) -> float:
        return length_penalty_factor(length, length_penalty, alpha)

    N = B * K
    state = runner.encode(ids, lengths, cache_len, K)
    # Cumulative log-probabilities of the open beams; only beam 0 is live at the start (all
    # beams of a source are identical then, expanding them all would give K copies).
    beam_scores = np.full((B, K), -np.inf, dtype=np.float64)
    beam_scores[:, 0] = 0.0
    history = np.zeros((N, 0), dtype=np.int64)  # generated tokens of every open beam
    finished: list[list[Hypothesis]] = [[] for _ in range(B)]
    done = max_new == 0
    for b in np.flatnonzero(done):
        results[b] = [Hypothesis([], 0.0, 0.0, False)]
    tokens = np.full(N, bos_id, dtype=np.int64)
    identity = np.arange(N, dtype=np.int64)

    for t in range(steps):
        logits = np.asarray(runner.step(state, tokens))
        if logits.ndim != 2 or logits.shape[0] != N:
            raise RuntimeError(f"runner.step returned logits of shape {logits.shape}, expected ({N}, V)")
        V = logits.shape[1]
        suppress = t < min_new  # [B]: EOS masked before the softmax, the rest renormalised
        if suppress.any():
            logits = np.array(logits, dtype=np.float32, copy=True).reshape(B, K, V)
            logits[suppress, :, eos_id] = -np.inf
            logits = logits.reshape(N, V)
        logp = log_softmax(logits).reshape(B, K, V)
        cand = (beam_scores[:, :, None] + logp).reshape(B, K * V)  # [B, K*V]
        n_cand = min(2 * K, K * V)
        top = np.argpartition(-cand, n_cand - 1, axis=1)[:, :n_cand]  # [B, 2K], unordered

        beam_index = identity.copy()
        new_tokens = np.full(N, eos_id, dtype=np.int64)
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
                if tok == eos_id:
                    if rank < K and np.isfinite(score):
                        finished[b].append(
                            Hypothesis(
                                history[row].tolist(), float(score) / penalty(length), float(score), True
                            )
                        )
                    continue
                if n_open < K:
                    beam_index[b * K + n_open] = row
                    new_tokens[b * K + n_open] = tok
                    new_scores[b, n_open] = score
                    n_open += 1
                if n_open == K and rank >= K:
                    break
            # Done? At this source's budget, or when no open beam can beat the n-th best.
            at_budget = length >= max_new[b]
            finished[b].sort(key=lambda h: h.score, reverse=True)
            best_open = np.max(new_scores[b])
            if not at_budget and len(finished[b]) >= n_best:
                bound = best_open / penalty(int(max_new[b])) if np.isfinite(best_open) else -np.inf
                if bound <= finished[b][n_best - 1].score:
                    done[b] = True
            if not np.isfinite(best_open) and finished[b]:
                done[b] = True  # every continuation is impossible (-inf)
            if at_budget:
                for k in range(K):
                    if np.isfinite(new_scores[b, k]):
                        row = beam_index[b * K + k]
                        toks = history[row].tolist() + [int(new_tokens[b * K + k])]
                        s = float(new_scores[b, k])
                        finished[b].append(Hypothesis(toks, s / penalty(length), s, False))
                done[b] = True
            if done[b]:
                finished[b].sort(key=lambda h: h.score, reverse=True)
                results[b] = finished[b][:n_best]
                new_scores[b, :] = -np.inf
                beam_index[b * K : (b + 1) * K] = identity[b * K : (b + 1) * K]
                new_tokens[b * K : (b + 1) * K] = eos_id
        if done.all():
            break
        beam_scores = new_scores
        history = np.concatenate([history[beam_index], new_tokens[:, None]], axis=1)
        if not np.array_equal(beam_index, identity):
            runner.reorder(state, beam_index)
        tokens = new_tokens

    for b in range(B):
        if not results[b]:  # only reachable if every candidate was -inf throughout
            finished[b].sort(key=lambda h: h.score, reverse=True)
            results[b] = finished[b][:n_best] or [Hypothesis([], -math.inf, -math.inf, False)]
    return results
