"""Random sampling of one token per row (top-k, top-p, temperature) with an inverse-CDF draw, so
that the same seed and the same logits give the same tokens on every runner.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import numpy as np

from .numerics import (
    _check_finite_logits,
    _row_top_k,
)
from .options import (
    _check_real,
)


class _Sampler:
    """Random sampling of one token per row: the ``sampling_topk`` most likely tokens (0: all),
    scaled by ``1 / sampling_temperature``, then the smallest set of them, most likely first, whose
    probability reaches ``sampling_topp``.

    Each source draws from a stream of its own (:meth:`streams_for`), a numpy Generator seeded
    with ``SeedSequence([seed, index])``, ``index`` the source's index in the caller's input: one
    draw per row of the source and step, so a source's samples do not depend on the other sources
    of its batch, on the batch size, on the order of the batches or on when it was admitted
    (``seed=None``: each stream from fresh entropy).

    The draw is an inverse-CDF pick over the kept tokens in id order (the first token whose
    cumulative probability exceeds ``u * total`` for ``u = rng.random()``), so the same seed and
    the same logits give the same tokens on every runner.
    """

    def __init__(
        self, sampling_topk: int, sampling_topp: float, sampling_temperature: float, seed: int | None
    ):
        self.sampling_topk, self.sampling_topp = sampling_topk, sampling_topp
        self.sampling_temperature = sampling_temperature
        self.seed = seed
        self.streams: list[np.random.Generator] = []  # one per source: streams_for
        self.rows_per_source = 1

    def streams_for(
        self,
        source_index: Sequence[int],
        rows_per_source: int,
        seeds: Sequence[int | None] | None = None,
    ) -> _Sampler:
        """This sampler with one stream per source, the source's ``rows_per_source`` rows
        consecutive: source ``b``'s stream is seeded with ``SeedSequence([seeds[b],
        source_index[b]])`` (``seeds`` default: this sampler's seed for every source; a seed of
        None: fresh entropy)."""
        new = copy.copy(self)
        new.rows_per_source = int(rows_per_source)
        if seeds is None:
            seeds = [self.seed] * len(source_index)
        new.streams = [
            np.random.default_rng()
            if seed is None
            else np.random.default_rng(np.random.SeedSequence([int(seed), int(i)]))
            for seed, i in zip(seeds, source_index, strict=True)
        ]
        return new

    def draw(self, y: np.ndarray, step: int, rows: np.ndarray | None = None, total: int = 0) -> np.ndarray:
        """One token per row of ``y``; ``rows`` (with ``total``, the search's number of rows):
        the search's row of each row of ``y``, when finished rows were dropped. Every source's
        stream draws for all its rows at every step, so what a row draws at a step does not
        depend on which rows are still open."""
        N, V = y.shape
        n = self.rows_per_source
        if not self.streams:
            raise RuntimeError("_Sampler.draw needs its streams: call streams_for first")
        # one draw per row and step from its source's stream, finished rows included
        u = np.concatenate([g.random(n) for g in self.streams])
        if rows is not None and total and u.shape[0] != total:
            raise RuntimeError(f"the sampler has streams for {u.shape[0]} rows, the search {total}")
        if rows is not None:
            u = u[rows]
        rows = np.arange(N)[:, None]
        k = V if self.sampling_topk == 0 else min(self.sampling_topk, V)
        if k < V:
            cols, row_max = _row_top_k(y, k)
            cols = np.sort(cols, axis=1)
            z = y[rows, cols].astype(np.float64)
        else:
            cols = None
            row_max = y.max(axis=1)
            z = y.astype(np.float64)
        _check_finite_logits(row_max, step, rows)
        m = np.where(np.isfinite(row_max), row_max, 0.0).astype(np.float64)
        p = np.exp((z - m[:, None]) / self.sampling_temperature)
        if self.sampling_topp < 1.0:
            order = np.argsort(-p, axis=1, kind="stable")
            ranked = np.take_along_axis(p, order, axis=1)
            cum = np.cumsum(ranked, axis=1)
            before = np.concatenate([np.zeros((N, 1)), cum[:, :-1]], axis=1)
            keep_ranked = before < self.sampling_topp * cum[:, -1:]
            keep = np.empty_like(keep_ranked)
            np.put_along_axis(keep, order, keep_ranked, axis=1)
            p = np.where(keep, p, 0.0)
        cum = np.cumsum(p, axis=1)
        pick = (cum <= (u * cum[:, -1])[:, None]).sum(axis=1)
        last_positive = p.shape[1] - 1 - np.argmax(p[:, ::-1] > 0, axis=1)
        pick = np.minimum(pick, last_positive)
        chosen = cols[np.arange(N), pick] if cols is not None else pick
        impossible = ~(cum[:, -1] > 0)  # every token banned: the first, as greedy decoding picks
        if impossible.any():
            chosen = np.where(impossible, np.argmax(y, axis=1), chosen)
        return chosen.astype(np.int64)


def _check_sampling(
    sampling_topk: Any, sampling_topp: Any, sampling_temperature: Any, seed: Any
) -> _Sampler | None:
    """The sampler the options ask for; ``None`` for plain greedy decoding (``sampling_topk=1``)."""
    k = sampling_topk
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
        raise ValueError(
            f"sampling_topk must be an int >= 0 (1 = greedy, 0 = the whole vocabulary), got {k!r}"
        )
    p = _check_real("sampling_topp", sampling_topp)
    if not 0.0 < p <= 1.0:
        raise ValueError(f"sampling_topp must be in (0, 1], got {p}")
    t = _check_real("sampling_temperature", sampling_temperature)
    if t <= 0:
        raise ValueError(f"sampling_temperature must be > 0, got {t}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0):
        raise ValueError(f"seed must be an int >= 0 or None, got {seed!r}")
    if k == 1:
        given = [
            n
            for n, v, d in (
                ("sampling_topp", p, 1.0),
                ("sampling_temperature", t, 1.0),
            )
            if v != d
        ]
        if given:
            raise ValueError(
                f"{' and '.join(given)} apply to random sampling, which sampling_topk = 1 (greedy) turns off: "
                "give sampling_topk = 0 (the whole vocabulary) or k > 1"
            )
        return None
    return _Sampler(int(k), p, t, None if seed is None else int(seed))
