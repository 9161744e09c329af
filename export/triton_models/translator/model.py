"""Triton Python-backend (BLS) model ``translator``: token ids in, translated token ids out.

Copied by ``python -m export.triton`` into ``<repo>/translator/1/model.py``, next to
``_vendor/transformer_ext/decoding/``: the project's :mod:`transformer_ext.decoding` package, byte
for byte (it needs only numpy, so the Triton image needs nothing else). The decoding loop and the
checks every runner makes (source ids, step tokens, beam indices) are that package's, driven
through a runner (the runner protocol of docs/DESIGN.md section 1) whose ``encode`` / ``step`` are
BLS calls to the ``encoder`` and ``decoder_step`` models of the same repository:

* :class:`StatelessRunner` (``decoder_step``, dynamic batcher): the self-attention caches live in
  this process and travel with every step request (``self_key.{i}``/``self_value.{i}`` in; the
  new token's ``new_*`` (portable) or the updated ``present_*`` caches (tensorscatter) out).
  Serves beam search (beams are reordered here) and greedy search of the portable flavour.
* :class:`StatefulRunner` (``decoder_step_stateful``, tensorscatter flavour): one Triton
  sequence per cache row; the caches are Triton implicit state (``present_*`` of step t becomes
  ``self_*`` of step t+1 inside the server) and never cross the BLS boundary. Serves greedy search.
  The sequence batcher (``oldest`` strategy) merges the rows' concurrent step requests into one
  execution, which is why each step sends all rows at once (``async_exec``).

Both runners take an injected ``infer`` callable (a list of :class:`Call` -> a list of output
dicts), so the decoding logic runs and is tested without Triton. :class:`TritonPythonModel` is
the thin adapter that implements ``infer`` with ``pb_utils.InferenceRequest(...).async_exec()``.

Request (all int64): ``input_ids [batch, src_len]`` (right-padded with pad_id), optional
``src_lengths [batch]`` (default: up to the last non-pad token), and the search options of
:data:`REQUEST_OPTIONS`, named as :class:`transformer_ext.decoding.SearchOptions` names them and
checked by the same checks: ``max_decoding_length [1]`` (default
``floor(max_len_a * src_len + max_len_b)`` per source, capped by the generation config's
``max_new_tokens`` and the cache capacity), ``min_decoding_length [1]``, ``beam_size [1]`` (1:
greedy); the older ``max_new_tokens`` / ``min_new_tokens`` still work, with one warning;
``target_prefix [batch or 1, P]`` (tokens forced first, rows right-padded with pad_id; required by a
model that forces its target language, M2M100 / NLLB); the defaults are the export folder's
generation config (``generation.json``) and, for a model converted from transformers, its
``generation_defaults.json`` (banned tokens such as Marian's ``<pad>``, the forced target language,
EOS forced at the budget, the early-stopping rule, ``max_length - 1`` new tokens per source), which
``python -m export.triton`` writes into the translator's parameters. Response: ``output_ids [batch, max_len]`` (pad-filled, no BOS/EOS),
``output_lengths [batch]``, ``scores [batch]`` float32 (beam: the length-penalised score of the
best hypothesis; greedy: NaN).
"""

# No `from __future__ import annotations`: Triton may load this file without registering it in
# sys.modules, and dataclasses resolve string annotations through sys.modules.
import asyncio
import json
import logging
import os
import sys
import uuid
from dataclasses import MISSING, dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

_VENDOR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_vendor")
if os.path.isdir(_VENDOR) and _VENDOR not in sys.path:  # inside a model repository
    sys.path.insert(0, _VENDOR)

from transformer_ext import decoding  # noqa: E402  (the shared greedy / beam search)

try:  # present only inside Triton's Python backend
    import triton_python_backend_utils as pb_utils
except ImportError:  # pragma: no cover - the runners and Translator work without it
    pb_utils = None

logger = logging.getLogger(__name__)

# TRITONSERVER_REQUEST_FLAG_SEQUENCE_START / _END (tritonserver.h)
SEQUENCE_START = 1
SEQUENCE_END = 2

_NP_DTYPES = {"float32": np.float32, "float16": np.float16}


class TranslationRequestError(ValueError):
    """The client's request is invalid (shapes, values, limits); its message goes back to the client."""


# the older names of the translator's parameters -> their names (SearchOptions')
_OLDER_PARAMETERS = {
    "min_new_tokens": "min_decoding_length",
    "max_new_tokens": "max_decoding_length",
    "length_penalty": "length_penalty_type",
    "alpha": "length_penalty",
}


@dataclass(frozen=True)
class Call:
    """One BLS inference request: ``outputs`` of ``model`` for ``inputs`` (full shapes, batch first)."""

    model: str
    inputs: Mapping[str, np.ndarray]
    outputs: Sequence[str]
    correlation_id: int = 0
    flags: int = 0


Infer = Callable[[Sequence[Call]], list]  # runs the calls concurrently -> [{output name: array}, ...]


@dataclass(frozen=True)
class Settings:
    """The translator's ``parameters`` in config.pbtxt, typed."""

    encoder_model: str
    decoder_model: str
    stateful_decoder_model: str
    flavour: str
    n_layers: int
    n_heads: int
    d_k: int
    src_vocab_size: int
    tgt_vocab_size: int
    max_positions: int  # the model's max_len: a step's position stays below it
    bos_id: int
    eos_id: int
    pad_id: int
    max_src_len: int
    max_cache_len: int
    fixed_cache_len: int  # the engine's static cache_len (TensorRT tensorscatter), 0 if dynamic
    state_cache_len: int  # capacity of every stateful sequence, 0 without a stateful decoder
    cache_dtype: str
    encoder_max_batch_size: int
    decoder_max_batch_size: int
    stateful_max_sequences: int  # sequences this instance may hold open at once
    beam_size: int  # default of a request without beam_size (the generation config's)
    max_len_a: float
    max_len_b: float
    min_decoding_length: int  # default of a request without min_decoding_length
    max_decoding_length: int  # the largest default budget
    max_beam_size: int
    length_penalty_type: str
    length_penalty: float
    # A model converted from transformers (its generation_defaults.json; repositories written
    # before these parameters existed lack them and get the defaults):
    banned_ids: str = ""  # comma-separated ids never generated (Marian's <pad>)
    force_eos_at_budget: int = 0  # 1: EOS is the token at the budget (forced_eos_token_id)
    early_stopping: str = ""  # beam search's rule: "true", "false", "never"; "": the search's default
    forced_target_prefix: int = 0  # 1: every request must send target_prefix (M2M100 / NLLB language)

    @classmethod
    def from_parameters(cls, params: Mapping[str, Any]) -> "Settings":
        """From ``{key: "value"}`` or Triton's ``{key: {"string_value": "value"}}`` (a repository
        written with the older parameter names, :data:`_OLDER_PARAMETERS`, is read under the new)."""
        if "length_penalty_type" not in params and "alpha" in params:
            params = {_OLDER_PARAMETERS.get(k, k): v for k, v in params.items()}
        values = {}
        for f in cls.__dataclass_fields__.values():
            if f.name not in params:
                if f.default is not MISSING:
                    continue
                raise ValueError(f"the translator's config.pbtxt lacks the parameter {f.name!r}")
            raw = params[f.name]
            raw = raw.get("string_value", "") if isinstance(raw, Mapping) else raw
            kind = f.type if isinstance(f.type, str) else f.type.__name__
            values[f.name] = int(raw) if kind == "int" else float(raw) if kind == "float" else str(raw)
        return cls(**values)

    @property
    def banned(self) -> list[int]:
        return [int(t) for t in self.banned_ids.split(",") if t.strip()]

    @property
    def early_stopping_rule(self) -> Any:
        rules = {"": None, "true": True, "false": False, "never": "never"}
        if self.early_stopping not in rules:
            raise ValueError(f"early_stopping must be one of {sorted(rules)}, got {self.early_stopping!r}")
        return rules[self.early_stopping]

    @property
    def np_cache_dtype(self):
        if self.cache_dtype not in _NP_DTYPES:
            raise ValueError(f"cache dtype {self.cache_dtype!r} is not supported by the translator")
        return _NP_DTYPES[self.cache_dtype]


def _chunks(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, max(1, size))]


# ------------------------------------------------------------------------------------------
# Runners (the runner protocol of transformer_ext.decoding over BLS calls)
# ------------------------------------------------------------------------------------------


@dataclass
class _State:
    src_lengths: np.ndarray  # [N] int64
    cross: dict[str, np.ndarray]  # cross_key.{i} / cross_value.{i}: [N, H, S, d_k]
    cache_len: int  # capacity allocated (stateless) or requested (stateful)
    position: int = 0
    self_cache: dict[str, np.ndarray] = field(default_factory=dict)  # stateless: self_key.{i}: [N, H, L, d_k]
    correlation_ids: list[int] = field(default_factory=list)  # stateful: one sequence per row
    open: bool = False  # stateful: sequences started and not ended yet

    @property
    def num_rows(self) -> int:
        return int(self.src_lengths.shape[0])


class _RunnerBase:
    def __init__(self, settings: Settings, infer: Infer):
        self.s = settings
        self.infer = infer
        self.cross_names = [f"cross_{k}.{i}" for i in range(settings.n_layers) for k in ("key", "value")]
        self.self_names = [f"self_{k}.{i}" for i in range(settings.n_layers) for k in ("key", "value")]

    def _encode(
        self, input_ids: np.ndarray, src_lengths: np.ndarray, beam_size: int
    ) -> tuple[np.ndarray, dict]:
        ids = np.ascontiguousarray(input_ids, dtype=np.int64)
        lengths = np.ascontiguousarray(src_lengths, dtype=np.int64)
        B = ids.shape[0]
        calls = [
            Call(
                self.s.encoder_model,
                {"input_ids": ids[sl], "src_lengths": lengths[sl, None]},
                self.cross_names,
            )
            for sl in _chunks(B, self.s.encoder_max_batch_size)
        ]
        outs = self.infer(calls)
        cross = {}
        for name in self.cross_names:
            parts = [np.asarray(o[name]) for o in outs]
            arr = np.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]
            cross[name] = np.ascontiguousarray(np.repeat(arr, beam_size, axis=0) if beam_size > 1 else arr)
        rows = np.repeat(lengths, beam_size) if beam_size > 1 else lengths
        return rows, cross

    def _check_step(self, state: _State, tokens: np.ndarray) -> np.ndarray:
        return decoding.check_step_tokens(
            state.position,
            state.cache_len,
            self.s.max_positions,
            tokens,
            state.num_rows,
            self.s.tgt_vocab_size,
        )


class StatelessRunner(_RunnerBase):
    """Caches held here and sent with every ``decoder_step`` request (chunks of at most
    ``decoder_max_batch_size`` rows, issued concurrently)."""

    def encode(self, input_ids, src_lengths, cache_len, beam_size=1) -> _State:
        rows, cross = self._encode(input_ids, src_lengths, int(beam_size))
        capacity = self.s.fixed_cache_len or int(cache_len)  # a static engine axis wins (larger is harmless)
        if capacity < int(cache_len) or capacity > self.s.max_cache_len:
            raise TranslationRequestError(
                f"{cache_len} decoding steps do not fit the decoder's cache capacity "
                f"({self.s.fixed_cache_len or self.s.max_cache_len}); ask for a smaller max_decoding_length"
            )
        N = rows.shape[0]
        shape = (N, self.s.n_heads, capacity, self.s.d_k)
        caches = {name: np.zeros(shape, dtype=self.s.np_cache_dtype) for name in self.self_names}
        return _State(src_lengths=rows, cross=cross, cache_len=capacity, self_cache=caches)

    def step(self, state: _State, tokens) -> np.ndarray:
        tok = self._check_step(state, tokens)
        p = state.position
        N = state.num_rows
        portable = self.s.flavour == "portable"
        out_names = ["logits"] + [
            n.replace("self_", "new_" if portable else "present_") for n in self.self_names
        ]
        positions = np.full((N, 1), p, dtype=np.int64)
        calls = []
        slices = _chunks(N, self.s.decoder_max_batch_size)
        for sl in slices:
            inputs = {
                "input_ids": tok[sl, None],
                "positions": positions[sl],
                "src_lengths": state.src_lengths[sl, None],
            }
            inputs.update({n: state.self_cache[n][sl] for n in self.self_names})
            inputs.update({n: state.cross[n][sl] for n in self.cross_names})
            calls.append(Call(self.s.decoder_model, inputs, out_names))
        outs = self.infer(calls)
        for sl, out in zip(slices, outs):
            for name in self.self_names:
                if portable:  # the new token's K/V [n, H, 1, d_k] -> cache row p
                    state.self_cache[name][sl, :, p] = np.asarray(out[name.replace("self_", "new_")])[:, :, 0]
                else:  # the updated caches came back whole
                    state.self_cache[name][sl] = np.asarray(out[name.replace("self_", "present_")])
        state.position = p + 1
        logits = [np.asarray(o["logits"], dtype=np.float32) for o in outs]
        return np.concatenate(logits, axis=0) if len(logits) > 1 else logits[0]

    def reorder(self, state: _State, beam_index) -> None:
        index = decoding.check_beam_index(beam_index, state.num_rows)
        p = state.position
        if p == 0:
            return
        for cache in state.self_cache.values():
            cache[:, :, :p] = cache[index, :, :p]

    def close(self, state: _State) -> None:
        state.self_cache.clear()


class StatefulRunner(_RunnerBase):
    """One Triton sequence per row on ``decoder_step_stateful``: the caches are implicit state.

    The first step carries ``SEQUENCE_START`` (Triton zero-fills the state), the step at the
    last position the cache was sized for carries ``SEQUENCE_END``; when decoding stops earlier,
    :meth:`close` ends the open sequences with one more step (BOS rewritten at position 0, its
    output discarded). Beam search cannot run here: the state of a sequence cannot be reordered
    from outside the server.
    """

    def __init__(
        self, settings: Settings, infer: Infer, new_correlation_id: Optional[Callable[[], int]] = None
    ):
        super().__init__(settings, infer)
        self.new_correlation_id = new_correlation_id or (lambda: (uuid.uuid4().int >> 65) or 1)

    def encode(self, input_ids, src_lengths, cache_len, beam_size=1) -> _State:
        if int(beam_size) != 1:
            raise ValueError(
                "the stateful decoder serves greedy search only (beams cannot be reordered in Triton's state)"
            )
        if int(cache_len) > self.s.state_cache_len:
            raise TranslationRequestError(
                f"{cache_len} decoding steps do not fit the stateful decoder's cache capacity "
                f"({self.s.state_cache_len}); ask for a smaller max_decoding_length"
            )
        rows, cross = self._encode(input_ids, src_lengths, 1)
        if rows.shape[0] > self.s.stateful_max_sequences:
            raise ValueError(
                f"{rows.shape[0]} rows exceed the {self.s.stateful_max_sequences} sequences this instance may hold"
            )
        ids = [self.new_correlation_id() for _ in range(rows.shape[0])]
        return _State(src_lengths=rows, cross=cross, cache_len=int(cache_len), correlation_ids=ids)

    def _calls(self, state: _State, tok: np.ndarray, position: int, flags: int) -> list[Call]:
        calls = []
        for r, corr in enumerate(state.correlation_ids):
            inputs = {
                "input_ids": tok[r : r + 1, None],
                "positions": np.full((1, 1), position, dtype=np.int64),
                "src_lengths": state.src_lengths[r : r + 1, None],
            }
            inputs.update({n: state.cross[n][r : r + 1] for n in self.cross_names})
            calls.append(
                Call(self.s.stateful_decoder_model, inputs, ["logits"], correlation_id=corr, flags=flags)
            )
        return calls

    def step(self, state: _State, tokens) -> np.ndarray:
        tok = self._check_step(state, tokens)
        p = state.position
        flags = (SEQUENCE_START if p == 0 else 0) | (SEQUENCE_END if p == state.cache_len - 1 else 0)
        state.open = True
        outs = self.infer(self._calls(state, tok, p, flags))
        state.open = not flags & SEQUENCE_END
        state.position = p + 1
        return np.concatenate([np.asarray(o["logits"], dtype=np.float32) for o in outs], axis=0)

    def reorder(self, state: _State, beam_index) -> None:
        raise NotImplementedError("the stateful decoder cannot reorder beams; beam search uses decoder_step")

    def close(self, state: _State) -> None:
        """End the sequences still open (frees their slots and state in Triton)."""
        if not state.open:
            return
        state.open = False
        bos = np.full(state.num_rows, self.s.bos_id, dtype=np.int64)
        self.infer(self._calls(state, bos, 0, SEQUENCE_END))


# ------------------------------------------------------------------------------------------
# The translation logic (no Triton types)
# ------------------------------------------------------------------------------------------


# The request's optional search options, each one int64: (SearchOptions field, older input
# names). A value is checked by its field's own check (decoding.expected_value), an older name
# works as the field's with one warning per process, and both in one request are an error;
# export.triton declares every name of them in the translator's config.pbtxt.
REQUEST_OPTIONS = (
    ("beam_size", ()),
    ("max_decoding_length", ("max_new_tokens",)),
    ("min_decoding_length", ("min_new_tokens",)),
)
_WARNED_OLD_INPUTS: set = set()


def _request_option(arrays: Mapping[str, Any], name: str, old: Sequence[str]) -> Optional[tuple[int, str]]:
    """``(value, the input name the request used)`` of the option ``name``, or None if not sent."""
    sent = [n for n in (name, *old) if arrays.get(n) is not None]
    if not sent:
        return None
    if len(sent) > 1:
        raise TranslationRequestError(f"{sent[1]} and {sent[0]} are one option (send only {name})")
    spelled = sent[0]
    if spelled != name and spelled not in _WARNED_OLD_INPUTS:
        _WARNED_OLD_INPUTS.add(spelled)
        logger.warning("request input %s is deprecated; send %s", spelled, name)
    arr = np.asarray(arrays[spelled])
    if arr.size != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise TranslationRequestError(
            f"{spelled} must be one integer, got shape {arr.shape} dtype {arr.dtype}"
        )
    value = int(arr.reshape(-1)[0])
    expected = decoding.expected_value(name, value)
    if expected is not None:
        raise TranslationRequestError(f"{spelled} must be {expected}, got {value}")
    return value, spelled


class Translator:
    """Turns a request's arrays into output arrays with greedy or beam search over BLS calls."""

    def __init__(self, settings: Settings):
        self.s = settings

    def _sources(self, arrays: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray]:
        """The request's sources, checked by the checks of every runner and both searches
        (:func:`transformer_ext.decoding.check_sources`: shapes, dtypes, lengths, source ids)
        before any budget is computed."""
        ids = np.asarray(arrays.get("input_ids"))
        lengths = arrays.get("src_lengths")
        if lengths is None and ids.ndim == 2 and ids.size:  # right-padded: up to the last non-pad token
            nonpad = ids != self.s.pad_id
            lengths = np.where(nonpad.any(axis=1), ids.shape[1] - np.argmax(nonpad[:, ::-1], axis=1), 1)
        try:
            ids, lengths = decoding.check_sources(
                ids,
                np.asarray(lengths).reshape(-1) if lengths is not None else None,
                src_vocab_size=self.s.src_vocab_size or None,
            )
        except (TypeError, ValueError) as exc:
            raise TranslationRequestError(str(exc)) from None
        if ids.shape[1] > self.s.max_src_len:
            raise TranslationRequestError(
                f"source length {ids.shape[1]} exceeds the served maximum {self.s.max_src_len}"
            )
        return ids, lengths

    def _target_prefix(self, arrays: Mapping[str, Any], batch: int) -> Optional[list[list[int]]]:
        """The request's ``target_prefix`` ([batch, P] or [1, P] for every source, rows right-padded
        with pad_id) as one list per source; required when the model forces its first tokens (the
        target language of M2M100 / NLLB)."""
        value = arrays.get("target_prefix")
        if value is None:
            if self.s.forced_target_prefix:
                raise TranslationRequestError(
                    "this model forces the target-language token first: send target_prefix "
                    "([batch, P] int64, e.g. the id of __de__)"
                )
            return None
        arr = np.asarray(value)
        if arr.ndim != 2 or arr.shape[0] not in (1, batch) or not np.issubdtype(arr.dtype, np.integer):
            raise TranslationRequestError(
                f"target_prefix must be int64 [{batch}, P] or [1, P], got {arr.dtype} {list(arr.shape)}"
            )
        rows = [[int(t) for t in row if int(t) != self.s.pad_id] for row in arr]
        return rows * batch if len(rows) == 1 and batch != 1 else rows

    def translate(
        self, arrays: Mapping[str, Any], infer: Infer, new_correlation_id: Optional[Callable[[], int]] = None
    ) -> dict[str, np.ndarray]:
        ids, lengths = self._sources(arrays)
        B = ids.shape[0]
        prefix = self._target_prefix(arrays, B)
        # what every search takes from the model's generation defaults (and the request's prefix)
        search = dict(banned_ids=self.s.banned, force_eos_at_budget=bool(self.s.force_eos_at_budget))
        sent = {name: _request_option(arrays, name, old) for name, old in REQUEST_OPTIONS}
        beam = sent["beam_size"][0] if sent["beam_size"] else self.s.beam_size
        if beam > self.s.max_beam_size:
            raise TranslationRequestError(f"beam_size must be at most {self.s.max_beam_size}, got {beam}")
        stateful = beam == 1 and bool(self.s.stateful_decoder_model)
        capacity = self.s.state_cache_len if stateful else (self.s.fixed_cache_len or self.s.max_cache_len)
        min_new = (
            sent["min_decoding_length"][0] if sent["min_decoding_length"] else self.s.min_decoding_length
        )
        if sent["max_decoding_length"]:
            value, spelled = sent["max_decoding_length"]
            max_new = np.full(B, value, dtype=np.int64)
            if value > capacity:
                raise TranslationRequestError(
                    f"{spelled} must be at most {capacity} (the decoder's cache capacity)"
                )
        else:
            max_new = decoding.max_decoding_length_for(
                lengths, self.s.max_len_a, self.s.max_len_b, cap=min(capacity, self.s.max_decoding_length)
            )

        tokens: list[list[int]] = []
        scores = np.full(B, np.nan, dtype=np.float32)
        if beam == 1:
            # Stateful: every row of a chunk holds a sequence slot until the chunk ends.
            size = self.s.stateful_max_sequences if stateful else B
            for sl in _chunks(B, size):
                runner = (
                    StatefulRunner(self.s, infer, new_correlation_id)
                    if stateful
                    else StatelessRunner(self.s, infer)
                )
                tokens += _run(
                    runner,
                    decoding.greedy_decode,
                    ids[sl],
                    lengths[sl],
                    bos_id=self.s.bos_id,
                    eos_id=self.s.eos_id,
                    max_decoding_length=max_new[sl],
                    min_decoding_length=min_new,
                    target_prefix=None if prefix is None else prefix[sl],
                    **search,
                )
        else:
            hyps = _run(
                StatelessRunner(self.s, infer),
                decoding.beam_search,
                ids,
                lengths,
                bos_id=self.s.bos_id,
                eos_id=self.s.eos_id,
                beam_size=beam,
                num_hypotheses=1,
                max_decoding_length=max_new,
                min_decoding_length=min_new,
                length_penalty_type=self.s.length_penalty_type,
                length_penalty=self.s.length_penalty,
                early_stopping=self.s.early_stopping_rule,
                target_prefix=prefix,
                **search,
            )
            tokens = [h[0].tokens for h in hyps]
            scores = np.array([h[0].score for h in hyps], dtype=np.float32)
        width = max(1, max(len(t) for t in tokens))
        out = np.full((B, width), self.s.pad_id, dtype=np.int64)
        for row, t in enumerate(tokens):
            out[row, : len(t)] = t
        return {
            "output_ids": out,
            "output_lengths": np.array([len(t) for t in tokens], dtype=np.int64),
            "scores": scores,
        }


class _Closing:
    """Wraps a runner and remembers its states, so that :meth:`close` can end them when decoding
    leaves (greedy_decode / beam_search know nothing of closing; Triton's sequences need it)."""

    def __init__(self, runner):
        self.runner = runner
        self.states: list = []

    def encode(self, *args, **kwargs):
        state = self.runner.encode(*args, **kwargs)
        self.states.append(state)
        return state

    def step(self, state, tokens):
        return self.runner.step(state, tokens)

    def reorder(self, state, beam_index):
        self.runner.reorder(state, beam_index)

    def close(self, failing: bool = False) -> None:
        while self.states:
            state = self.states.pop()
            try:
                self.runner.close(state)
            except Exception:  # noqa: BLE001
                if not failing:
                    raise
                # the original error is what the client must see; Triton frees idle sequences itself
                logger.warning("could not end the decoding sequences after an error", exc_info=True)


def _run(runner, search, *args, **kwargs):
    """``search(runner, ...)`` with every state the runner opened closed afterwards."""
    closing = _Closing(runner)
    try:
        result = search(closing, *args, **kwargs)
    except BaseException:
        closing.close(failing=True)
        raise
    closing.close()
    return result


# ------------------------------------------------------------------------------------------
# Triton adapter
# ------------------------------------------------------------------------------------------

_INPUTS = ("input_ids", "src_lengths", "target_prefix") + tuple(
    n for name, old in REQUEST_OPTIONS for n in (name, *old)
)


class TritonPythonModel:
    """The Triton entry point: parses the request, runs :class:`Translator` in a worker thread and
    serves its BLS calls from the event loop with ``async_exec`` (so all rows of a step are in
    flight together and the batchers can merge them)."""

    def initialize(self, args: Mapping[str, str]) -> None:
        config = json.loads(args["model_config"])
        self.settings = Settings.from_parameters(config.get("parameters", {}))
        self.translator = Translator(self.settings)
        logger.info("translator: %s", self.settings)

    def _infer_factory(self, loop: asyncio.AbstractEventLoop) -> Infer:
        async def run_all(calls: Sequence[Call]) -> list:
            requests = [
                pb_utils.InferenceRequest(
                    model_name=c.model,
                    requested_output_names=list(c.outputs),
                    inputs=[
                        pb_utils.Tensor(name, np.ascontiguousarray(arr)) for name, arr in c.inputs.items()
                    ],
                    correlation_id=int(c.correlation_id),
                    flags=int(c.flags),
                )
                for c in calls
            ]
            responses = await asyncio.gather(*(r.async_exec() for r in requests))
            outputs = []
            for c, response in zip(calls, responses):
                if response.has_error():
                    raise RuntimeError(f"{c.model}: {response.error().message()}")
                # copy out of the response's shared memory before it is released
                outputs.append(
                    {
                        n: np.array(pb_utils.get_output_tensor_by_name(response, n).as_numpy())
                        for n in c.outputs
                    }
                )
            return outputs

        def infer(calls: Sequence[Call]) -> list:  # called from the decoding thread
            return asyncio.run_coroutine_threadsafe(run_all(calls), loop).result()

        return infer

    async def execute(self, requests):
        loop = asyncio.get_running_loop()
        infer = self._infer_factory(loop)
        responses = []
        for request in requests:
            try:
                arrays = {}
                for name in _INPUTS:
                    tensor = pb_utils.get_input_tensor_by_name(request, name)
                    if tensor is not None:
                        arrays[name] = np.array(tensor.as_numpy())
                result = await loop.run_in_executor(None, self.translator.translate, arrays, infer)
                responses.append(
                    pb_utils.InferenceResponse(
                        output_tensors=[pb_utils.Tensor(name, arr) for name, arr in result.items()]
                    )
                )
            except Exception as exc:  # noqa: BLE001 - every failure becomes this request's error
                logger.warning("translator request failed: %s", exc)
                responses.append(
                    pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(exc)))
                )
        return responses

    def finalize(self) -> None:
        logger.info("translator unloaded")
