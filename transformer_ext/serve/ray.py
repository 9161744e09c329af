"""Ray Serve: the same app, scheduler and HTTP API in each replica of a Ray Serve deployment.

Needs the ``ray`` extra (``pip install '.[serve,ray]'``). From Python::

    import ray
    from ray import serve
    from transformer_ext.serve.ray import build_app

    ray.init()
    serve.run(build_app(models=["en-de-onnx"], num_replicas=2), route_prefix="/")

or ``serve run transformer_ext.serve.ray:app_builder models=en-de-onnx num_replicas=2`` (the
arguments of :func:`app_builder`; a Serve config file passes the same ones as its ``args``). Each
replica loads the models itself (the folders must be readable at the same path on every node)
and runs :func:`transformer_ext.serve.create_app`'s app with its schedulers; Ray Serve's proxy
spreads the requests over the replicas. Every answer names the replica that gave it in its
``X-Serve-Replica`` header.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

from ..cli import UsageError
from .app import ServeConfig, create_app
from .models import ModelSpec, load_model, parse_languages, parse_model_spec

__all__ = ["DEPLOYMENT_NAME", "REPLICA_HEADER", "app_builder", "build_app"]

DEPLOYMENT_NAME = "transformer_ext_translate"
REPLICA_HEADER = "x-serve-replica"

_INT_ARGS = (
    "max_queue",
    "max_batch_rows",
    "max_batch_tokens",
    "max_sources",
    "max_source_tokens",
    "max_body_bytes",
    "retry_after",
    "threads",
    "workers",
)
_FLOAT_ARGS = ("request_timeout", "drain_timeout", "batch_wait")
_DICT_ARGS = ("autoscaling_config", "ray_actor_options")


def _replica_name() -> str:
    """The Ray Serve replica this process runs (its id), or the process id outside a replica."""
    from ray import serve
    from ray.serve.exceptions import RayServeException

    try:
        context = serve.get_replica_context()
    except RayServeException:  # not in a replica
        context = None
    replica = getattr(context, "replica_id", None)
    if replica is None:
        return f"pid-{os.getpid()}"
    return str(getattr(replica, "unique_id", replica))


class _ReplicaHeader:
    """ASGI middleware: each HTTP answer carries ``X-Serve-Replica`` (streamed answers too)."""

    def __init__(self, app):
        self.app = app
        self.replica = _replica_name().encode("latin-1", "replace")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_named(message):
            if message["type"] == "http.response.start":
                message = {
                    **message,
                    "headers": [*message.get("headers", ()), (REPLICA_HEADER.encode(), self.replica)],
                }
            await send(message)

        await self.app(scope, receive, send_named)


def _replica_app(
    specs: Sequence[ModelSpec],
    pairs: dict,
    config: ServeConfig,
    threads: Optional[int],
    workers: int,
):
    """The app of one replica: its own models and schedulers (called on the replica)."""
    from .cli import warm_up

    models = [
        load_model(spec, threads=threads, workers=workers, pair=pairs.get(spec.name, pairs.get(None)))
        for spec in specs
    ]
    for model in models:
        warm_up(model)
    app = create_app(models, config)
    app.add_middleware(_ReplicaHeader)
    return app


def _default_batching() -> str:
    """What ``python -m transformer_ext.serve`` uses without ``--batching``: continuous where the
    decoding package has its step-wise search state, else static."""
    from .continuous import StepwiseUnavailable, stepwise_api

    try:
        stepwise_api()
    except StepwiseUnavailable:
        return "static"
    return "continuous"


class TranslationReplica:
    """One replica of the deployment; its HTTP API is the ingress app built on the replica."""


def build_app(
    models: Sequence[str] = (),
    *,
    languages: Sequence[str] = (),
    num_replicas: Any = None,
    autoscaling_config: Optional[dict] = None,
    ray_actor_options: Optional[dict] = None,
    threads: Optional[int] = None,
    workers: int = 1,
    name: str = DEPLOYMENT_NAME,
    **config: Any,
):
    """A Ray Serve application serving ``models`` (``"DIR"`` or ``"NAME=DIR"``, as ``--model``;
    none: the demo model) with ``num_replicas`` replicas (default 1), or scaled by Ray Serve's
    autoscaling: ``autoscaling_config`` (``min_replicas``, ``max_replicas``,
    ``target_ongoing_requests``...; ``num_replicas`` then None or ``"auto"``), or
    ``num_replicas="auto"`` alone for Ray Serve's default autoscaling. ``ray_actor_options``:
    Ray's per-replica resources (``num_cpus``...). ``config``: the :class:`ServeConfig` fields
    (``batching``, ``max_queue``, ``request_timeout``...); ``batching`` defaults to the
    server's default (continuous where available). Arguments are checked here, before anything
    is deployed (UsageError / ValueError / FileNotFoundError naming them)."""
    from ray import serve

    from .models import demo_spec

    if isinstance(models, str) or isinstance(languages, str):
        raise UsageError("models and languages are lists of strings (app_builder takes comma-separated text)")
    # absolute paths: a replica's working folder is Ray's, on another node too
    specs = [parse_model_spec(m) for m in models] if models else [demo_spec()]
    specs = [ModelSpec(spec.name, spec.path.resolve()) for spec in specs]
    for spec in specs:
        if not spec.path.is_dir():
            raise FileNotFoundError(f"models: {spec.path} is not a folder")
    pairs: dict = {}
    for text in languages:
        model_name, pair = parse_languages(text)
        pairs[model_name] = pair
    unknown = sorted(set(config) - set(ServeConfig.__dataclass_fields__))
    if unknown:
        known = ", ".join(sorted(ServeConfig.__dataclass_fields__))
        raise UsageError(f"unknown option {', '.join(unknown)}; the server's options are {known}")
    config.setdefault("batching", None)
    if config["batching"] is None:
        config["batching"] = _default_batching()
    settings = ServeConfig(**config).check()
    if settings.batching == "continuous":
        from .continuous import stepwise_api

        stepwise_api()  # a clear error here rather than in every replica
    if (
        num_replicas is not None
        and num_replicas != "auto"
        and (isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1)
    ):
        raise UsageError(f"num_replicas must be a positive integer or 'auto', got {num_replicas!r}")
    options: dict[str, Any] = {}
    if autoscaling_config is not None:
        if num_replicas not in (None, "auto"):
            raise UsageError(
                f"num_replicas={num_replicas!r} and autoscaling_config exclude each other: "
                "give min_replicas / max_replicas in autoscaling_config"
            )
        if not isinstance(autoscaling_config, dict):
            raise UsageError(f"autoscaling_config must be a mapping, got {autoscaling_config!r}")
        options["autoscaling_config"] = autoscaling_config
        if num_replicas == "auto":
            options["num_replicas"] = "auto"
    else:
        options["num_replicas"] = 1 if num_replicas is None else num_replicas
    if ray_actor_options is not None:
        options["ray_actor_options"] = ray_actor_options

    def builder():  # evaluated on each replica (Ray Serve takes a function of no arguments as an app builder)
        return _replica_app(specs, pairs, settings, threads, workers)

    deployment = serve.deployment(serve.ingress(builder)(TranslationReplica), name=name, **options)
    return deployment.bind()


def _text_list(key: str, value: Any) -> list[str]:
    """``a,b`` (``serve run``'s KEY=VALUE) or a list of strings (a Serve config file's ``args``)."""
    if isinstance(value, str):
        return [item for item in value.split(",") if item]
    if isinstance(value, (list, tuple)) and all(isinstance(item, str) for item in value):
        return list(value)
    raise UsageError(f"{key}={value!r}: expected comma-separated text or a list of strings")


def app_builder(args: dict):
    """``serve run transformer_ext.serve.ray:app_builder KEY=VALUE ...``, or a Serve config file's
    ``import_path`` with these as its ``args``: ``models`` (comma-separated ``[NAME=]DIR``, or a
    list), ``languages`` (comma-separated ``[NAME=]SRC-TGT``, or a list), ``num_replicas`` (a
    number or ``auto``), ``autoscaling_config`` and ``ray_actor_options`` (mappings, from a config
    file), ``batching``, ``max_queue``, ``max_batch_rows``, ``max_batch_tokens``, ``max_sources``,
    ``max_source_tokens``, ``max_body_bytes``, ``request_timeout``, ``drain_timeout``,
    ``batch_wait``, ``retry_after``, ``threads``, ``workers``."""
    args = dict(args)
    models = _text_list("models", args.pop("models", ""))
    languages = _text_list("languages", args.pop("languages", ""))
    replicas = args.pop("num_replicas", None)
    if replicas is None or replicas == "auto":
        num_replicas: Any = replicas
    else:
        try:
            num_replicas = int(replicas)
        except (TypeError, ValueError):
            raise UsageError(f"num_replicas={replicas!r}: expected a positive integer or 'auto'") from None
    kwargs: dict[str, Any] = {}
    for key, value in args.items():
        if key in _DICT_ARGS:
            if not isinstance(value, dict):
                raise UsageError(f"{key}={value!r}: expected a mapping (a Serve config file's args)")
            kwargs[key] = value
            continue
        try:
            kwargs[key] = int(value) if key in _INT_ARGS else float(value) if key in _FLOAT_ARGS else value
        except (TypeError, ValueError):
            raise UsageError(f"{key}={value!r}: expected a number") from None
    return build_app(models, languages=languages, num_replicas=num_replicas, **kwargs)
