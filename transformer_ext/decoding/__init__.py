"""Greedy, sampling and beam search, written once against a small runner protocol.

This module imports only numpy: the ONNX Runtime runner must work without torch. A backend
(eager PyTorch, ONNX Runtime, TensorRT, a test double) implements :class:`Runner`; the search
never knows which one it drives. :func:`generate` is the one entry point for every setting
(greedy, sampling, beam search; always :class:`Hypothesis` lists); :func:`greedy_decode` and
:func:`beam_search` are the two searches behind it; :func:`score` is forced decoding (the
log-probabilities of given targets).


Package layout (every public name is importable from ``transformer_ext.decoding``):

* :mod:`.protocol`: the runner contract (:class:`Runner`), :class:`Hypothesis`, and the checks
  every runner makes on its arguments (sources, step tokens, beam and select indices).
* :mod:`.options`: :class:`SearchOptions`, the one record of every search option (default,
  help text and range in its field metadata), and the checks of the searches' arguments.
* :mod:`.processors`: the logit processors (the order below) and the requests of a step
  through a runner's ``step_top_k``.
* :mod:`.numerics`: log-softmax, log-sum-exp, row top-k, the checked step of a runner.
* :mod:`.sampling`: random sampling of one token per row.
* :mod:`.greedy`: greedy decoding and sampling (:func:`greedy_decode`).
* :mod:`.beam`: beam search (:func:`beam_search`).
* :mod:`.stepwise`: :class:`SearchState`, the step-wise search (admit, step, cancel, partial)
  that the greedy and beam searches loop over, and :class:`SourceRequest`.
* :mod:`.api`: :func:`generate`, :func:`score` and :class:`SearchMethods`.

Conventions:

* The decoder is fed the start token first: ``decoder_start_id``, which defaults to
  ``bos_id`` (Marian starts with ``<pad>``, M2M100 / NLLB with ``</s>``). Every returned token
  list excludes the start token and the EOS; it includes the ``target_prefix`` tokens.
* ``max_decoding_length`` counts generated tokens, EOS included (a row that emits EOS as its
  ``max_decoding_length``-th token has ``max_decoding_length - 1`` tokens). It may be an int or one value
  per source (e.g. from :func:`max_decoding_length_for`). Prefix tokens count as generated tokens.
* Logit processors, applied at every step in this order to every search (the step's
  distribution before the choice): ``repetition_penalty`` (the logit ``l`` of a token already
  in the row's sequence, start token included, becomes ``l * p`` if ``l < 0``, else ``l / p``),
  ``no_repeat_ngram_size`` n (a token that would complete an n-gram already in the sequence is
  banned), ``banned_ids`` (never generated), ``min_decoding_length`` (EOS banned while fewer tokens
  than that have been generated), then the forced tokens: ``target_prefix`` (row b's first
  ``len(target_prefix[b])`` tokens are given), and with ``force_eos_at_budget`` the EOS as the
  last token a row's budget allows. A banned token's logit is -inf *before* the softmax, so
  the other tokens' probabilities are renormalised (as CTranslate2 does); a forced token keeps
  the log-probability the model gives it (so that :func:`score` of a result gives its log-prob).
  With ``length_penalty_type="hf"`` the beam search follows transformers' ``generate()`` instead
  (the processors act on the log-probabilities, nothing is renormalised, a forced token scores
  0: see :func:`beam_search`).
* Length penalties (:func:`length_penalty_factor`) divide a hypothesis' log-probability by a
  function of its length, which counts the generated tokens with the EOS (when it has one).
* The runner's self-attention cache must hold every fed token: the decoder feeds the start
  token and then all generated tokens but the last, so ``cache_len`` defaults to
  ``max(max_decoding_length)``.

The checks every runner makes on its arguments live here, once, so that every backend refuses
the same input with the same message (naming the argument, and for ids the row and value):
:func:`check_encode_args` (sources via :func:`check_sources`, ``cache_len``, ``beam_size``) at
encode, :func:`check_step_tokens` at a step, :func:`check_beam_index` at a reorder. A runner
checks limits of its own (an export's, an engine profile's) after them.
"""

from __future__ import annotations

# Beside the public names: the tunables and internals the translator, benchmarks and tests
# reach through the package (``name as name``: re-exported).
from .api import (
    SearchMethods,
    generate,
    score,
)
from .beam import (
    _BeamState as _BeamState,
)
from .beam import (
    beam_search,
)
from .greedy import (
    GREEDY_DROP_DIVISOR as GREEDY_DROP_DIVISOR,
)
from .greedy import (
    greedy_advance,
    greedy_decode,
)
from .numerics import (
    _TOPK_GROUP as _TOPK_GROUP,
)
from .numerics import (
    _row_top_k as _row_top_k,
)
from .numerics import (
    log_softmax,
)
from .options import (
    EARLY_STOPPING,
    LENGTH_PENALTIES,
    SearchOptions,
    expected_value,
    length_penalty_factor,
    max_decoding_length_for,
    max_new_tokens_for,
)
from .options import (
    _check_int_list as _check_int_list,
)
from .options import (
    _check_options as _check_options,
)
from .options import (
    _check_real as _check_real,
)
from .options import (
    _check_token_id as _check_token_id,
)
from .processors import (
    HEAD_MIN_ENTRIES as HEAD_MIN_ENTRIES,
)
from .protocol import (
    Hypothesis,
    Runner,
    as_int64,
    check_attention_runner,
    check_beam_index,
    check_encode_args,
    check_select_index,
    check_sources,
    check_step_tokens,
    check_token_ids,
)
from .protocol import (
    IntOrArray as IntOrArray,
)
from .protocol import (
    _check_sources as _check_sources,
)
from .sampling import (
    _check_sampling as _check_sampling,
)
from .stepwise import (
    SearchState,
    SourceRequest,
)

__all__ = [
    "Runner",
    "SearchMethods",
    "SearchOptions",
    "SearchState",
    "SourceRequest",
    "Hypothesis",
    "generate",
    "greedy_decode",
    "greedy_advance",
    "beam_search",
    "check_attention_runner",
    "score",
    "max_decoding_length_for",
    "max_new_tokens_for",
    "expected_value",
    "length_penalty_factor",
    "log_softmax",
    "check_sources",
    "check_encode_args",
    "check_token_ids",
    "check_step_tokens",
    "check_beam_index",
    "check_select_index",
    "as_int64",
    "LENGTH_PENALTIES",
    "EARLY_STOPPING",
]
