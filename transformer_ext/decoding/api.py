"""The high-level entry points: :func:`generate` (every setting, always :class:`Hypothesis`
lists), :func:`score` (forced decoding) and :class:`SearchMethods` (the searches as runner
methods).
"""

from __future__ import annotations

import sys
from typing import Any, Optional, Sequence, Union

import numpy as np

from .numerics import (
    _check_finite_logits,
    _log_sum_exp,
)
from .options import (
    LENGTH_PENALTIES,
    _check_in_vocab,
    _check_int_list,
    _check_real,
    _check_token_id,
)
from .protocol import (
    Hypothesis,
    IntOrArray,
    Runner,
    check_sources,
)
from .renamed import renamed_keywords


def _package() -> Any:
    """The ``transformer_ext.decoding`` package: :func:`generate` and :class:`SearchMethods` call
    the searches through it, so that a wrapper installed there (``decoding.beam_search = ...``, as
    a test or a profiler does) sees every search."""
    return sys.modules[__package__]


@renamed_keywords()
def generate(
    runner: Runner,
    input_ids: np.ndarray,
    src_lengths: np.ndarray,
    *,
    bos_id: int,
    eos_id: int,
    max_decoding_length: IntOrArray,
    beam_size: int = 1,
    num_hypotheses: int = 1,
    length_penalty_type: str = "gnmt",
    length_penalty: float = 0.6,
    early_stopping: Union[bool, str, None] = None,
    renormalize_logits: bool = False,
    sampling_topk: int = 1,
    sampling_topp: float = 1.0,
    sampling_temperature: float = 1.0,
    seed: Optional[int] = None,
    return_attention: bool = False,
    source_index: Optional[IntOrArray] = None,
    **options: Any,
) -> list[list[Hypothesis]]:
    """For every source its ``num_hypotheses`` hypotheses, best first, whatever the search:
    beam search (:func:`beam_search`) when ``beam_size > 1``,
    else greedy decoding or sampling (:func:`greedy_decode` with ``return_scores``).

    ``options``: the processor options both searches take (``min_decoding_length``, ``cache_len``,
    ``decoder_start_id``, ``target_prefix``, ``banned_ids``, ``repetition_penalty``,
    ``no_repeat_ngram_size``, ``force_eos_at_budget``). Sampling with ``beam_size > 1`` is an
    error (beam sampling is not defined here). The beam-search options (``length_penalty_type``,
    ``length_penalty``, ``early_stopping``, ``renormalize_logits``) do not apply to greedy decoding, whose
    hypotheses have no length penalty (its tokens are transformers' greedy tokens either way).
    ``source_index``: each source's index in the caller's whole input, which with ``seed`` picks
    its sampling stream (:func:`greedy_decode`; default ``0 .. B-1``); beam search draws nothing.
    """
    if not isinstance(beam_size, (int, np.integer)) or isinstance(beam_size, bool) or beam_size < 1:
        raise ValueError(f"beam_size must be a positive int, got {beam_size!r}")
    sampling = sampling_topk != 1 or sampling_topp != 1.0 or sampling_temperature != 1.0
    if beam_size > 1:
        if sampling:
            raise ValueError(
                f"random sampling (sampling_topk / sampling_topp / sampling_temperature) needs beam_size = 1, "
                f"got beam_size = {beam_size}"
            )
        if seed is not None:
            raise ValueError("seed applies to random sampling, which needs beam_size = 1")
        return _package().beam_search(
            runner,
            input_ids,
            src_lengths,
            bos_id=bos_id,
            eos_id=eos_id,
            beam_size=beam_size,
            num_hypotheses=num_hypotheses,
            max_decoding_length=max_decoding_length,
            length_penalty_type=length_penalty_type,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            renormalize_logits=renormalize_logits,
            return_attention=return_attention,
            **options,
        )
    if length_penalty_type not in LENGTH_PENALTIES:
        raise ValueError(
            f"length_penalty_type must be one of {LENGTH_PENALTIES}, got {length_penalty_type!r}"
        )
    _check_real("length_penalty", length_penalty)
    return _package().greedy_decode(
        runner,
        input_ids,
        src_lengths,
        bos_id=bos_id,
        eos_id=eos_id,
        max_decoding_length=max_decoding_length,
        num_hypotheses=num_hypotheses,
        sampling_topk=sampling_topk,
        sampling_topp=sampling_topp,
        sampling_temperature=sampling_temperature,
        seed=seed,
        return_scores=True,
        return_attention=return_attention,
        source_index=source_index,
        **options,
    )


def score(
    runner: Runner,
    input_ids: np.ndarray,
    src_lengths: np.ndarray,
    targets: Sequence[Sequence[int]],
    *,
    bos_id: int,
    eos_id: int,
    decoder_start_id: Optional[int] = None,
    include_eos: bool = True,
) -> list[Hypothesis]:
    """Forced decoding: the log-probability the model gives each source's target.

    ``targets``: one list of target token ids per source (ragged, without start token and EOS;
    empty allowed). Returns one :class:`Hypothesis` per source: its ``tokens``, the
    ``token_log_probs`` of each token under the model's raw distribution (no processors), then
    the EOS's when ``include_eos``, and their sum as ``log_prob`` and ``score`` (CTranslate2's
    ``score_batch``). One batched step per target position; rows whose target ended are fed EOS.
    """
    _check_token_id("bos_id", bos_id)
    eos_id = _check_token_id("eos_id", eos_id)
    start = _check_token_id(
        "decoder_start_id" if decoder_start_id is not None else "bos_id",
        bos_id if decoder_start_id is None else decoder_start_id,
    )
    ids, lengths = check_sources(input_ids, src_lengths)
    B = ids.shape[0]
    if isinstance(targets, (str, bytes)) or not hasattr(targets, "__len__"):
        raise TypeError(f"targets must be a list holding one list of token ids per source, got {targets!r}")
    if len(targets) != B:
        raise ValueError(f"targets must hold one token list per source ({B}), got {len(targets)}")
    rows = [_check_int_list(f"targets[{b}]", t) for b, t in enumerate(targets)]
    n_tok = np.array([len(r) for r in rows], dtype=np.int64)
    wanted = n_tok + (1 if include_eos else 0)  # scored positions per row
    steps = int(wanted.max())
    token_lps: list[list[float]] = [[] for _ in range(B)]
    if steps > 0:
        table = np.full((B, steps), eos_id, dtype=np.int64)  # the token scored at each step
        for b, r in enumerate(rows):
            table[b, : len(r)] = r
        state = runner.encode(ids, lengths, steps, 1)
        fed = np.full(B, start, dtype=np.int64)
        all_rows = np.arange(B)
        for t in range(steps):
            logits = np.asarray(runner.step(state, fed))
            if logits.ndim != 2 or logits.shape[0] != B:
                raise RuntimeError(f"runner.step returned logits of shape {logits.shape}, expected ({B}, V)")
            if t == 0:
                for b, r in enumerate(rows):
                    _check_in_vocab(f"targets[{b}]", r, logits.shape[1])
            x = logits if logits.dtype == np.float32 else logits.astype(np.float32)
            row_max = x.max(axis=1)
            _check_finite_logits(row_max, t)
            lp = x[all_rows, table[:, t]].astype(np.float64) - _log_sum_exp(x, row_max)
            for b in np.flatnonzero(t < wanted).tolist():
                token_lps[b].append(float(lp[b]))
            fed = table[:, t]
    out = []
    for b in range(B):
        total = float(sum(token_lps[b]))
        out.append(Hypothesis(rows[b].tolist(), total, total, True, token_lps[b]))
    return out


class SearchMethods:
    """``runner.greedy(...)``, ``runner.beam_search(...)``, ``runner.generate(...)`` and
    ``runner.score(...)`` for any runner class that mixes this in.

    ``bos_id`` / ``eos_id`` default to those of the runner's description record ``info``
    (:class:`transformer_ext.runtimes.info.RunnerInfo`; the ONNX Runtime runners read them from
    the export manifest); a runner that does not know them needs them passed.
    """

    def _search_kwargs(self, kwargs: dict) -> dict:
        for name in ("bos_id", "eos_id"):
            if kwargs.get(name) is None:
                value = getattr(getattr(self, "info", None), name, None)
                if value is None:
                    raise TypeError(f"{type(self).__name__} does not know the model's {name}: pass {name}=")
                kwargs[name] = int(value)
        return kwargs

    @renamed_keywords()
    def greedy(self, input_ids, src_lengths, *, max_decoding_length: IntOrArray, **kwargs):
        """:func:`greedy_decode` with this runner (keyword arguments as there)."""
        return _package().greedy_decode(
            self,
            input_ids,
            src_lengths,
            max_decoding_length=max_decoding_length,
            **self._search_kwargs(kwargs),
        )

    @renamed_keywords()
    def beam_search(
        self, input_ids, src_lengths, *, beam_size: int, max_decoding_length: IntOrArray, **kwargs
    ) -> list[list[Hypothesis]]:
        """:func:`beam_search` with this runner (keyword arguments as there)."""
        return _package().beam_search(
            self,
            input_ids,
            src_lengths,
            beam_size=beam_size,
            max_decoding_length=max_decoding_length,
            **self._search_kwargs(kwargs),
        )

    @renamed_keywords()
    def generate(
        self, input_ids, src_lengths, *, max_decoding_length: IntOrArray, **kwargs
    ) -> list[list[Hypothesis]]:
        """:func:`generate` with this runner (keyword arguments as there)."""
        return generate(
            self,
            input_ids,
            src_lengths,
            max_decoding_length=max_decoding_length,
            **self._search_kwargs(kwargs),
        )

    def score(self, input_ids, src_lengths, targets, **kwargs) -> list[Hypothesis]:
        """:func:`score` (forced decoding) with this runner (keyword arguments as there)."""
        return score(self, input_ids, src_lengths, targets, **self._search_kwargs(kwargs))
