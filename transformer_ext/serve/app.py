"""The HTTP API (FastAPI): the native ``/v1`` routes, the LibreTranslate-compatible ones, health,
readiness and metrics; :func:`create_app` builds it over loaded :class:`ServedModel` objects.

Every error answer is JSON ``{"error": "message"}`` (LibreTranslate's shape), with ``"field"``
naming the request field where one is at fault; no answer carries a traceback. Statuses: 400 bad
input (malformed JSON, a wrong type, an unknown model or language, a source too long, invalid
options), 404 / 405 unknown routes, 413 a body over ``max_body_bytes``, 429 a full queue (with
``Retry-After``), 500 a model run that failed (that batch only), 503 while draining (with
``Retry-After``), 504 past the request timeout.

This module imports no torch.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import urllib.parse
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..translator import TranslationError, Translator
from .metrics import CONTENT_TYPE_LATEST, Metrics
from .models import LanguageError, ServedModel
from .scheduler import (
    BATCHING,
    DEFAULT_BATCH_WAIT,
    Job,
    JobError,
    QueueFull,
    Scheduler,
    SoloScheduler,
    StaticScheduler,
)

logger = logging.getLogger(__name__)

__all__ = ["ServeConfig", "ApiError", "create_app", "TranslateRequest", "LibreTranslateRequest"]

NDJSON = "application/x-ndjson"
ROUTES = (
    "/v1/translate",
    "/v1/translate/stream",
    "/v1/models",
    "/translate",
    "/languages",
    "/healthz",
    "/readyz",
    "/metrics",
    "/docs",
    "/openapi.json",
)


@dataclass
class ServeConfig:
    """The server's limits and batching (the command line's options, same names)."""

    batching: str = "static"
    max_batch_tokens: int = 4096  # padded source tokens a batch (or the running batch) admits
    max_batch_rows: int = 64  # decoder rows (sources x beam) a batch admits
    max_queue: int = 256  # sources waiting per model; more answer 429
    request_timeout: float = 60.0  # seconds from arrival to the whole answer; past it 504
    max_body_bytes: int = 1 << 20  # request body size; more answer 413
    max_sources: int = 64  # sources per request
    max_source_tokens: Optional[int] = None  # tokens per source (None: the model's positions)
    drain_timeout: float = 30.0  # seconds the accepted work has to finish after SIGTERM
    batch_wait: float = DEFAULT_BATCH_WAIT  # static batching: seconds to wait for more requests
    retry_after: int = 1  # the Retry-After of 429 and 503 answers, seconds

    def check(self) -> "ServeConfig":
        """Each value in range (ValueError naming the option)."""
        if self.batching not in BATCHING:
            raise ValueError(f"--batching must be one of {BATCHING}, got {self.batching!r}")
        for name in ("max_batch_tokens", "max_batch_rows", "max_queue", "max_body_bytes", "max_sources"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.max_source_tokens is not None and (
            isinstance(self.max_source_tokens, bool)
            or not isinstance(self.max_source_tokens, int)
            or self.max_source_tokens < 1
        ):
            raise ValueError(
                f"--max-source-tokens must be a positive integer, got {self.max_source_tokens!r}"
            )
        for name in ("request_timeout", "drain_timeout"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be a positive number of seconds, got {value!r}"
                )
        if (
            not isinstance(self.batch_wait, (int, float))
            or not math.isfinite(self.batch_wait)
            or self.batch_wait < 0
        ):
            raise ValueError(f"--batch-wait must be >= 0 seconds, got {self.batch_wait!r}")
        if self.max_sources > self.max_queue:
            raise ValueError(
                f"--max-sources ({self.max_sources}) cannot exceed --max-queue ({self.max_queue}): such a request "
                "would never fit the queue"
            )
        return self


class ApiError(Exception):
    """An error answer: ``status``, the message, the request field at fault, extra headers."""

    def __init__(
        self, status: int, message: str, field: Optional[str] = None, headers: Optional[dict] = None
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.field = field
        self.headers = headers or {}


def _error_response(status: int, message: str, field: Optional[str] = None, headers: Optional[dict] = None):
    body: dict[str, Any] = {"error": message}
    if field is not None:
        body["field"] = field
    return JSONResponse(body, status_code=status, headers=headers)


# ---------------------------------------------------------------------------------- request bodies


class TranslateRequest(BaseModel):
    """``POST /v1/translate`` and ``/v1/translate/stream``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    text: Union[str, list[str]] = Field(description="one source, or a list of sources")
    model: Optional[str] = Field(None, description="the model's name (GET /v1/models); default: the first")
    source_lang: Optional[str] = Field(None, description="source language code of a multilingual model")
    target_lang: Optional[str] = Field(None, description="target language code of a multilingual model")
    beam_size: Optional[int] = Field(
        None, ge=1, description="1: greedy search or sampling; more: beam search"
    )
    num_hypotheses: Optional[int] = Field(None, ge=1, description="hypotheses per source, at most beam_size")
    max_decoding_length: Optional[int] = Field(None, ge=1, description="most tokens generated per source")
    sampling_topk: Optional[int] = Field(None, ge=0, description="sample from the k best (0: all; 1: greedy)")
    sampling_temperature: Optional[float] = Field(None, gt=0, description="sampling temperature")
    seed: Optional[int] = Field(None, ge=0, description="the random seed of sampling")
    return_scores: bool = Field(False, description="each hypothesis with its score")
    target_prefix: Union[None, str, list[Optional[str]]] = Field(
        None, description="forced first words of the translation: one text, or one per source"
    )
    tokens: bool = Field(False, description="stream route: one event per generated token (greedy search)")


class LibreTranslateRequest(BaseModel):
    """LibreTranslate's ``POST /translate`` (JSON or form-encoded)."""

    model_config = ConfigDict(extra="ignore")

    q: Union[str, list[str]]
    source: str = "auto"
    target: Optional[str] = None
    format: str = "text"
    alternatives: int = Field(0, ge=0)
    api_key: Optional[str] = None
    model: Optional[str] = None


def _field_of(loc: tuple) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query")]
    out = ""
    for p in parts:
        if p.isdigit():
            out += f"[{p}]"
        elif p in ("str", "list[str]", "list[union[str,none]]", "none", "int", "float", "bool"):
            continue  # pydantic's name of the union member tried
        else:
            out += ("." if out else "") + p
    return out or "body"


def _validation_message(errors: list[dict]) -> tuple[str, Optional[str]]:
    """One message naming the first bad field of pydantic's error list."""
    if not errors:
        return "invalid request", None
    first = max(errors, key=lambda e: len(e.get("loc", ())))  # a list's bad element over "not a string"
    if first.get("type") == "json_invalid":
        return f"body: malformed JSON ({first.get('ctx', {}).get('error', 'parse error')})", "body"
    loc = tuple(first.get("loc", ()))
    field = _field_of(loc)
    msg = first.get("msg", "invalid value")
    if first.get("type") == "extra_forbidden":
        msg = "unknown field"
    if first.get("type") == "model_attributes_type":
        return "body: expected a JSON object", "body"
    return f"{field}: {msg}", field


# ---------------------------------------------------------------------------------- the app state

_OPTION_FIELDS = {  # Translator's option name -> the request field
    "beam size": "beam_size",
    "beam_size": "beam_size",
    "num_hypotheses": "num_hypotheses",
    "max_decoding_length": "max_decoding_length",
    "sampling_topk": "sampling_topk",
    "sampling_temperature": "sampling_temperature",
    "seed": "seed",
    "return_scores": "return_scores",
}


class _Handle:
    """The event loop's side of a job: its results, its event queue, its end."""

    def __init__(self, n: int, loop: asyncio.AbstractEventLoop):
        self.results: list[Any] = [None] * n
        self.events: asyncio.Queue = asyncio.Queue()
        self.end: asyncio.Future = loop.create_future()

    def on_event(self, kind: str, *args: Any) -> None:
        if kind == "result":
            index, translation = args
            self.results[index] = translation
        elif kind == "end" and not self.end.done():
            self.end.set_result(args[0])
        self.events.put_nowait((kind, *args))


class ServeState:
    """What the routes share: the models, their schedulers, the metrics, drain and readiness."""

    def __init__(
        self, models: list[ServedModel], config: ServeConfig, metrics: Metrics, scheduler_factory=None
    ):
        if not models:
            raise ValueError("a server needs at least one model")
        self.config = config
        self.metrics = metrics
        self.models = {m.name: m for m in models}
        if len(self.models) != len(models):
            raise ValueError("two --model arguments have the same name; name them NAME=DIR")
        self.default = models[0].name
        factory = scheduler_factory or make_scheduler
        self.schedulers: dict[str, Scheduler] = {m.name: factory(m, config, metrics) for m in models}
        self.ready = False
        self.draining = False
        self.in_flight = 0
        self.jobs: set[Job] = set()
        self.idle: Optional[asyncio.Event] = None

    # ------------------------------------------------------------------ models and validation
    def model(self, name: Optional[str], field: str = "model") -> ServedModel:
        if name is None:
            return self.models[self.default]
        if name not in self.models:
            raise ApiError(
                400, f"{field}: unknown model {name!r}; this server serves {', '.join(self.models)}", field
            )
        return self.models[name]

    def source_limit(self, translator: Translator) -> int:
        limit = int(translator.info.source_limit)
        if self.config.max_source_tokens is not None:
            limit = min(limit, self.config.max_source_tokens)
        return limit

    def check_sources(self, texts: Any, field: str) -> list[str]:
        if isinstance(texts, str):
            texts = [texts]
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise ApiError(400, f"{field}: expected a string or a list of strings", field)
        if not texts:
            raise ApiError(400, f"{field}: an empty list; give at least one source", field)
        if len(texts) > self.config.max_sources:
            raise ApiError(
                400,
                f"{field}: {len(texts)} sources, more than the {self.config.max_sources} a request may hold",
                field,
            )
        return texts

    def encode(self, translator: Translator, texts: list[str], field: str, single: bool) -> list[int]:
        """Each source's token count; ApiError naming the source for an empty one, unknown
        characters or too many tokens."""
        try:
            encoded = translator.encode(texts, strict=True)
        except TranslationError as exc:
            where = field if single or exc.index is None else f"{field}[{exc.index}]"
            raise ApiError(400, f"{where}: {exc.detail}", where) from None
        limit = self.source_limit(translator)
        for i, ids in enumerate(encoded):
            if len(ids) > limit:
                where = field if single else f"{field}[{i}]"
                raise ApiError(
                    400, f"{where}: {len(ids)} tokens, more than the {limit} a source may have", where
                )
        return [len(ids) for ids in encoded]

    def options(self, translator: Translator, body: TranslateRequest) -> dict:
        opts = dict(
            beam_size=body.beam_size,
            num_hypotheses=body.num_hypotheses,
            max_decoding_length=body.max_decoding_length,
            sampling_topk=body.sampling_topk,
            sampling_temperature=body.sampling_temperature,
            seed=body.seed,
            return_scores=body.return_scores or None,
        )
        opts = {k: v for k, v in opts.items() if v is not None}
        try:
            settings = translator.resolve_options(**opts)
        except TranslationError as exc:
            text = str(exc)
            field = next((f for name, f in _OPTION_FIELDS.items() if text.startswith(name)), None)
            if field is None:
                field = next((f for name, f in _OPTION_FIELDS.items() if name in text), "options")
            raise ApiError(400, f"{field}: {text}", field) from None
        if body.tokens and (settings["beam_size"] != 1 or settings["sampling"] is not None):
            raise ApiError(
                400, "tokens: token events are streamed for greedy search only (beam_size 1)", "tokens"
            )
        return opts

    def prefixes(self, translator: Translator, prefix: Any, n: int) -> list[Optional[str]]:
        if prefix is None:
            return [None] * n
        if isinstance(prefix, str):
            prefixes = [prefix] * n
        else:
            prefixes = list(prefix)
            if len(prefixes) != n:
                raise ApiError(
                    400,
                    f"target_prefix: {len(prefixes)} prefixes for {n} sources (one text, or one per source)",
                    "target_prefix",
                )
        try:
            translator.encode_targets([p for p in prefixes if p is not None], "target_prefix")
        except TranslationError as exc:
            raise ApiError(400, f"target_prefix: {exc.detail}", "target_prefix") from None
        return prefixes

    # ------------------------------------------------------------------ running a job
    def accepting(self) -> None:
        if self.draining:
            raise ApiError(
                503,
                "the server is shutting down and accepts no new work",
                headers={"Retry-After": str(self.config.retry_after)},
            )
        if not self.ready:
            raise ApiError(
                503, "the models are not loaded yet", headers={"Retry-After": str(self.config.retry_after)}
            )

    def submit(self, model: ServedModel, job: Job) -> None:
        try:
            self.schedulers[model.name].submit(job)
        except QueueFull as exc:
            raise ApiError(429, str(exc), headers={"Retry-After": str(self.config.retry_after)}) from None
        except JobError as exc:
            raise ApiError(exc.status, exc.message) from None
        self.in_flight += 1
        self.metrics.in_flight.set(self.in_flight)
        self.jobs.add(job)
        if self.idle is not None:
            self.idle.clear()

    def done(self, job: Job) -> None:
        if job in self.jobs:
            self.jobs.discard(job)
            self.in_flight -= 1
            self.metrics.in_flight.set(self.in_flight)
            if self.in_flight == 0 and self.idle is not None:
                self.idle.set()

    def cancel(self, model: ServedModel, job: Job, error: JobError) -> None:
        if job.cancel_status is None:
            job.cancel_status = error.status
        self.schedulers[model.name].cancel(job)
        job.finish(error)


def make_scheduler(model: ServedModel, config: ServeConfig, metrics: Metrics) -> Scheduler:
    """The scheduler ``config.batching`` names for ``model``."""
    common = dict(
        max_queue=config.max_queue,
        max_batch_rows=config.max_batch_rows,
        max_batch_tokens=config.max_batch_tokens,
        metrics=metrics,
    )
    if config.batching == "none":
        return SoloScheduler(model.name, **common)
    if config.batching == "static":
        return StaticScheduler(model.name, batch_wait=config.batch_wait, **common)
    from .continuous import ContinuousScheduler, check_continuous

    problem = check_continuous(model)
    if problem is not None:
        raise ValueError(problem)
    return ContinuousScheduler(model, **common)


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body has been read: the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _hypotheses(translation: Any, scores: bool) -> list[dict]:
    out = []
    for text, hyp in zip(translation.texts, translation.hypotheses):
        item: dict[str, Any] = {"text": text}
        if scores:
            item["score"] = hyp.score
        out.append(item)
    return out


def _result(translation: Any, body: TranslateRequest) -> dict:
    item: dict[str, Any] = {"text": str(translation)}
    if body.return_scores:
        item["score"] = translation.score
    if (body.num_hypotheses or 1) > 1:
        item["hypotheses"] = _hypotheses(translation, body.return_scores)
    return item


# ---------------------------------------------------------------------------------- the app


class _Guard:
    """ASGI middleware: request bodies bounded (413), every answer counted in the metrics."""

    def __init__(self, app, state: ServeState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.monotonic()
        path = scope.get("path", "")
        route = path if path in ROUTES else "other"
        status = {"code": 500}

        async def counting_send(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        limit = self.state.config.max_body_bytes
        try:
            length = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), None)
            too_big = False
            if length is not None:
                try:
                    too_big = int(length) > limit
                except ValueError:
                    too_big = False
            body = b""
            if not too_big and scope.get("method") in ("POST", "PUT", "PATCH"):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        status["code"] = 499  # the client left while sending its body
                        return
                    body += message.get("body", b"")
                    if len(body) > limit:
                        too_big = True
                        break
                    if not message.get("more_body", False):
                        break
            if too_big:
                response = _error_response(413, f"body: more than {limit} bytes", "body")
                await response(scope, receive, counting_send)
                return
            replayed = {"done": False}

            async def replay():
                if not replayed["done"]:
                    replayed["done"] = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()

            await self.app(scope, replay, counting_send)
        finally:
            self.state.metrics.answered(route, status["code"], time.monotonic() - start)


def _json_body(schema: type[BaseModel], *kinds: str) -> dict:
    """``openapi_extra`` documenting a body the route reads itself."""
    content = {kind: {"schema": schema.model_json_schema()} for kind in (kinds or ("application/json",))}
    return {"requestBody": {"content": content, "required": True}}


def _libre_data(raw: bytes, content_type: str) -> dict:
    """LibreTranslate's fields from a JSON or form-encoded body (ApiError when malformed)."""
    kind = content_type.split(";")[0].strip().lower()
    if kind == "application/x-www-form-urlencoded":
        try:
            pairs = urllib.parse.parse_qs(raw.decode("utf-8"), keep_blank_values=True, strict_parsing=False)
        except UnicodeDecodeError:
            raise ApiError(400, "Invalid request: the form is not UTF-8", "body") from None
        data: Any = {k: (v if k == "q" and len(v) > 1 else v[0]) for k, v in pairs.items()}
        if "alternatives" in data:
            try:
                data["alternatives"] = int(data["alternatives"])
            except ValueError:
                raise ApiError(
                    400, "Invalid request: alternatives must be an integer", "alternatives"
                ) from None
    else:
        try:
            data = json.loads(raw.decode("utf-8")) if raw else {}
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ApiError(400, f"Invalid request: malformed JSON ({exc})", "body") from None
    if not isinstance(data, dict):
        raise ApiError(400, "Invalid request: expected a JSON object", "body")
    for name in ("q", "target"):
        if data.get(name) in (None, ""):
            raise ApiError(400, f"Invalid request: missing {name} parameter", name)
    return data


class _Routes:
    """The route handlers over one :class:`ServeState` (:meth:`register` adds them to an app)."""

    def __init__(self, state: ServeState):
        self.state = state
        self.config = state.config
        self.metrics = state.metrics

    def register(self, app: FastAPI) -> None:
        add = app.add_api_route
        add(
            "/v1/translate",
            self.translate,
            methods=["POST"],
            summary="Translate one source or a list of sources",
            openapi_extra=_json_body(TranslateRequest),
        )
        add(
            "/v1/translate/stream",
            self.translate_stream,
            methods=["POST"],
            summary="Translate, streaming NDJSON: one line per finished source (and per token where asked)",
            response_class=StreamingResponse,
            openapi_extra=_json_body(TranslateRequest),
        )
        add(
            "/v1/models",
            self.list_models,
            methods=["GET"],
            summary="The served models, their languages and defaults",
        )
        add(
            "/translate",
            self.libre_translate,
            methods=["POST"],
            summary="LibreTranslate's translate: q (a string or a list), source, target, format",
            openapi_extra=_json_body(
                LibreTranslateRequest, "application/json", "application/x-www-form-urlencoded"
            ),
        )
        add(
            "/languages",
            self.languages,
            methods=["GET"],
            summary="LibreTranslate's languages: codes and their targets",
        )
        add("/healthz", self.healthz, methods=["GET"], summary="Alive")
        add(
            "/readyz", self.readyz, methods=["GET"], summary="Models loaded and warmed up; 503 while draining"
        )
        add("/metrics", self.prometheus, methods=["GET"], summary="Prometheus metrics")

    # ------------------------------------------------------------------ running a job
    def _timeout_message(self) -> str:
        return f"the request took longer than the request timeout ({self.config.request_timeout:g} s)"

    def start_job(
        self, model, translator, texts, opts, prefixes, lengths, tokens=False
    ) -> tuple[Job, _Handle]:
        loop = asyncio.get_running_loop()
        handle = _Handle(len(texts), loop)
        job = Job(
            translator=translator,
            sources=texts,
            options=opts,
            target_prefix=prefixes,
            lengths=lengths,
            loop=loop,
            on_event=handle.on_event,
            stream_tokens=tokens,
            deadline=time.monotonic() + self.config.request_timeout,
        )
        self.state.submit(model, job)
        return job, handle

    async def wait_job(self, request: Request, model: ServedModel, job: Job, handle: _Handle) -> list:
        """The job's translations; ApiError for its failure, a timeout (504) or the client leaving (499)."""
        state = self.state
        gone = asyncio.ensure_future(_wait_disconnect(request))
        try:
            left = max(0.0, job.deadline - time.monotonic())
            done, _ = await asyncio.wait(
                {handle.end, gone}, timeout=left, return_when=asyncio.FIRST_COMPLETED
            )
            if handle.end in done:
                error = handle.end.result()
                if error is not None:
                    raise ApiError(error.status, error.message)
                self.metrics.translated(model.name, len(handle.results))
                return handle.results
            if gone in done:
                state.cancel(model, job, JobError(499, "the client disconnected"))
                raise ApiError(499, "the client disconnected")
            state.cancel(model, job, JobError(504, "timed out"))
            raise ApiError(504, self._timeout_message())
        finally:
            gone.cancel()
            state.done(job)

    async def read_body(self, request: Request) -> TranslateRequest:
        """The JSON body (whatever the content type says), checked against the request schema."""
        raw = await request.body()
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ApiError(400, f"body: malformed JSON ({exc})", "body") from None
        if not isinstance(data, dict):
            raise ApiError(400, "body: expected a JSON object", "body")
        try:
            return TranslateRequest.model_validate(data)
        except ValidationError as exc:
            message, field = _validation_message(list(exc.errors()))
            raise ApiError(400, message, field) from None

    def prepare(self, body: TranslateRequest):
        """Everything checked before the job is queued: the model, languages, sources, options."""
        state = self.state
        state.accepting()
        model = state.model(body.model)
        try:
            translator = model.translator_for(body.source_lang, body.target_lang)
        except LanguageError as exc:
            raise ApiError(400, str(exc), exc.field) from None
        single = isinstance(body.text, str)
        texts = state.check_sources(body.text, "text")
        opts = state.options(translator, body)
        lengths = state.encode(translator, texts, "text", single)
        prefixes = state.prefixes(translator, body.target_prefix, len(texts))
        return model, translator, texts, opts, prefixes, lengths

    # ------------------------------------------------------------------ the native API
    async def translate(self, request: Request):
        body = await self.read_body(request)
        model, translator, texts, opts, prefixes, lengths = self.prepare(body)
        job, handle = self.start_job(model, translator, texts, opts, prefixes, lengths)
        results = await self.wait_job(request, model, job, handle)
        return {"model": model.name, "translations": [_result(t, body) for t in results]}

    async def translate_stream(self, request: Request):
        body = await self.read_body(request)
        model, translator, texts, opts, prefixes, lengths = self.prepare(body)
        job, handle = self.start_job(model, translator, texts, opts, prefixes, lengths, tokens=body.tokens)
        return StreamingResponse(self._lines(model, translator, body, job, handle), media_type=NDJSON)

    async def _lines(
        self, model: ServedModel, translator: Translator, body: TranslateRequest, job: Job, handle: _Handle
    ):
        """The NDJSON lines of a stream (docs/serving.md); a client that leaves cancels the job."""
        state = self.state
        finished = False
        try:
            while True:
                left = job.deadline - time.monotonic()
                try:
                    event = await asyncio.wait_for(handle.events.get(), timeout=max(0.0, left))
                except asyncio.TimeoutError:
                    state.cancel(model, job, JobError(504, "timed out"))
                    finished = True
                    yield _line({"error": self._timeout_message(), "status": 504})
                    return
                if event[0] == "result":
                    yield _line({"index": event[1], **_result(event[2], body)})
                elif event[0] == "token":
                    text = translator.tokenizer.decode_target(event[2])
                    yield _line({"index": event[1], "tokens": event[2], "text": text})
                else:
                    finished = True
                    error = event[1]
                    if error is not None:
                        yield _line({"error": error.message, "status": error.status})
                    else:
                        self.metrics.translated(model.name, len(job.sources))
                        yield _line({"done": True, "model": model.name})
                    return
        finally:
            if not finished:  # the client went away (the generator was cancelled)
                state.cancel(model, job, JobError(499, "the client disconnected"))
            state.done(job)

    async def list_models(self):
        out = []
        for m in self.state.models.values():
            t = m.translator
            settings = t.resolve_options()
            out.append(
                {
                    "name": m.name,
                    "kind": m.kind,
                    "default": m.name == self.state.default,
                    "languages": list(m.codes),
                    "pair": list(m.pair) if m.pair else None,
                    "batching": self.config.batching,
                    "max_source_tokens": self.state.source_limit(t),
                    "defaults": {
                        "beam_size": settings["beam_size"],
                        "num_hypotheses": settings["num_hypotheses"],
                        "length_penalty": settings["length_penalty"],
                        "length_penalty_type": settings["length_penalty_type"],
                        "max_len_a": settings["max_len_a"],
                        "max_len_b": settings["max_len_b"],
                    },
                }
            )
        return {"models": out}

    # ------------------------------------------------------------------ LibreTranslate
    async def libre_translate(self, request: Request):
        state = self.state
        state.accepting()
        data = _libre_data(await request.body(), request.headers.get("content-type", ""))
        try:
            body = LibreTranslateRequest.model_validate(data)
        except ValidationError as exc:
            message, field = _validation_message(list(exc.errors()))
            raise ApiError(400, f"Invalid request: {message}", field) from None
        if body.format not in ("text", "html"):
            raise ApiError(
                400, f"Invalid request: format must be 'text' or 'html', got {body.format!r}", "format"
            )
        if body.format == "html":
            raise ApiError(
                400, "Invalid request: this server translates plain text (format 'text')", "format"
            )
        model = self._libre_model(body)
        try:
            translator = model.translator_for(body.source, body.target, fields=("source", "target"))
        except LanguageError as exc:
            raise ApiError(400, str(exc), exc.field) from None
        single = isinstance(body.q, str)
        texts = state.check_sources(body.q, "q")
        n = body.alternatives + 1
        opts: dict[str, Any] = {}
        if n > 1:
            opts = dict(beam_size=max(n, translator.resolve_options()["beam_size"]), num_hypotheses=n)
            try:
                translator.resolve_options(**opts)
            except TranslationError as exc:
                raise ApiError(400, f"alternatives: {exc}", "alternatives") from None
        lengths = state.encode(translator, texts, "q", single)
        job, handle = self.start_job(model, translator, texts, opts, [None] * len(texts), lengths)
        results = await self.wait_job(request, model, job, handle)
        answer: dict[str, Any] = {"translatedText": str(results[0]) if single else [str(t) for t in results]}
        if n > 1:
            alts = [list(t.texts[1:]) for t in results]
            answer["alternatives"] = alts[0] if single else alts
        if body.source == "auto" and model.pair is not None:
            answer["detectedLanguage"] = {"language": model.pair[0], "confidence": 100.0}
        return answer

    def _libre_model(self, body: LibreTranslateRequest) -> ServedModel:
        state = self.state
        if body.model is not None:
            return state.model(body.model)
        for m in state.models.values():  # the first model that knows the pair
            if m.multilingual:
                if body.target in m.codes and (body.source == "auto" or m.marian or body.source in m.codes):
                    return m
            elif m.pair is None or (body.target == m.pair[1] and body.source in ("auto", m.pair[0])):
                return m
        return state.models[state.default]  # its check names what it translates

    async def languages(self):
        merged: dict[str, set] = {}
        for m in self.state.models.values():
            for entry in m.languages():
                merged.setdefault(entry["code"], set()).update(entry["targets"])
        return [{"code": code, "name": code, "targets": sorted(targets)} for code, targets in merged.items()]

    # ------------------------------------------------------------------ health and metrics
    async def healthz(self):
        return {"status": "ok"}

    async def readyz(self):
        if self.state.draining:
            return _error_response(503, "draining", headers={"Retry-After": str(self.config.retry_after)})
        if not self.state.ready:
            return _error_response(503, "loading")
        return {"status": "ready", "models": list(self.state.models)}

    async def prometheus(self):
        for name, scheduler in self.state.schedulers.items():
            self.metrics.queue(name, scheduler.waiting)
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as ``{"error": ...}`` JSON (docs/serving.md); never a traceback."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return _error_response(exc.status, exc.message, exc.field, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        message, field = _validation_message(list(exc.errors()))
        return _error_response(400, message, field)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return _error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        logger.exception("unexpected error answering %s", request.url.path)
        return _error_response(500, f"internal error ({type(exc).__name__}); the server log has the details")


def create_app(
    models: list[ServedModel], config: Optional[ServeConfig] = None, *, scheduler_factory=None
) -> FastAPI:
    """The FastAPI app serving ``models`` (the first is the default) with ``config``'s limits and
    batching. Its schedulers start with the app's lifespan and stop with it; ``app.state.serve``
    is the :class:`ServeState` (the drain of :mod:`transformer_ext.serve.server` sets its
    ``draining``). ``scheduler_factory(model, config, metrics)`` replaces :func:`make_scheduler`."""
    config = (config or ServeConfig()).check()
    state = ServeState(models, config, Metrics(), scheduler_factory)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.idle = asyncio.Event()
        state.idle.set()
        for scheduler in state.schedulers.values():
            scheduler.start()
        state.ready = True
        try:
            yield
        finally:
            state.ready = False
            for scheduler in state.schedulers.values():
                scheduler.stop()

    app = FastAPI(
        title="transformer_ext translation server",
        version=__version__,
        summary="Translations over HTTP: a native API, LibreTranslate's, health and Prometheus metrics",
        lifespan=lifespan,
    )
    app.state.serve = state
    app.add_middleware(_Guard, state=state)
    _add_error_handlers(app)
    _Routes(state).register(app)
    return app


def _line(obj: dict) -> bytes:
    return (json.dumps(obj, ensure_ascii=False) + "\n").encode("utf-8")
