"""Ray Serve: the same app, scheduler and HTTP API in each replica of a Ray Serve deployment.

Needs the ``ray`` extra (``pip install '.[serve,ray]'``). From Python::

    import ray
    from ray import serve
    from transformer_ext.serve.ray import build_app

    ray.init()
    serve.run(build_app(models=["en-de-onnx"], num_replicas=2), route_prefix="/")

or ``serve run transformer_ext.serve.ray:app_builder models=en-de-onnx num_replicas=2`` (the
arguments of :func:`app_builder`). Each replica loads the models itself (the folders must be
readable at the same path on every node) and runs :func:`transformer_ext.serve.create_app`'s app
with its schedulers; Ray Serve's proxy spreads the requests over the replicas.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from ..cli import UsageError
from .app import ServeConfig, create_app
from .models import ModelSpec, load_model, parse_languages, parse_model_spec

__all__ = ["DEPLOYMENT_NAME", "app_builder", "build_app"]

DEPLOYMENT_NAME = "transformer_ext_translate"


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
    return create_app(models, config)


class TranslationReplica:
    """One replica of the deployment; its HTTP API is the ingress app built on the replica."""


def build_app(
    models: Sequence[str] = (),
    *,
    languages: Sequence[str] = (),
    num_replicas: Any = 1,
    autoscaling_config: Optional[dict] = None,
    ray_actor_options: Optional[dict] = None,
    threads: Optional[int] = None,
    workers: int = 1,
    name: str = DEPLOYMENT_NAME,
    **config: Any,
):
    """A Ray Serve application serving ``models`` (``"DIR"`` or ``"NAME=DIR"``, as ``--model``;
    none: the demo model) with ``num_replicas`` replicas (``"auto"`` with ``autoscaling_config``
    for Ray Serve's autoscaling). ``config``: the :class:`ServeConfig` fields (``batching``,
    ``max_queue``, ``request_timeout``...). Arguments are checked here, before anything is
    deployed (UsageError / ValueError naming them)."""
    from ray import serve

    from .models import demo_spec

    specs = [parse_model_spec(m) for m in models] if models else [demo_spec()]
    for spec in specs:
        if not spec.path.is_dir():
            raise FileNotFoundError(f"models: {spec.path} is not a folder")
    pairs: dict = {}
    for text in languages:
        model_name, pair = parse_languages(text)
        pairs[model_name] = pair
    settings = ServeConfig(**config).check()
    if settings.batching == "continuous":
        from .continuous import stepwise_api

        stepwise_api()  # a clear error here rather than in every replica
    options: dict[str, Any] = {"num_replicas": num_replicas}
    if autoscaling_config is not None:
        options["autoscaling_config"] = autoscaling_config
    if ray_actor_options is not None:
        options["ray_actor_options"] = ray_actor_options

    def builder():  # evaluated on each replica (Ray Serve takes a function of no arguments as an app builder)
        return _replica_app(specs, pairs, settings, threads, workers)

    deployment = serve.deployment(serve.ingress(builder)(TranslationReplica), name=name, **options)
    return deployment.bind()


def app_builder(args: dict):
    """``serve run transformer_ext.serve.ray:app_builder KEY=VALUE ...``: ``models`` (comma-separated
    ``[NAME=]DIR``), ``languages`` (comma-separated ``[NAME=]SRC-TGT``), ``num_replicas`` (a number or
    ``auto``), ``batching``, ``max_queue``, ``max_batch_rows``, ``max_batch_tokens``,
    ``request_timeout``, ``threads``, ``workers``."""
    args = dict(args)
    models = [m for m in str(args.pop("models", "")).split(",") if m]
    languages = [p for p in str(args.pop("languages", "")).split(",") if p]
    replicas = args.pop("num_replicas", "1")
    num_replicas: Any = replicas if replicas == "auto" else int(replicas)
    ints = (
        "max_queue",
        "max_batch_rows",
        "max_batch_tokens",
        "max_sources",
        "max_body_bytes",
        "threads",
        "workers",
    )
    floats = ("request_timeout", "drain_timeout", "batch_wait")
    kwargs: dict[str, Any] = {}
    for key, value in args.items():
        try:
            kwargs[key] = int(value) if key in ints else float(value) if key in floats else value
        except ValueError:
            raise UsageError(f"{key}={value!r}: expected a number") from None
    return build_app(models, languages=languages, num_replicas=num_replicas, **kwargs)
