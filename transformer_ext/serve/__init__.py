"""The translation server: FastAPI + uvicorn over the package's :class:`~transformer_ext.translator.Translator`.

``python -m transformer_ext.serve --model DIR`` (:mod:`.cli`) serves export folders (ONNX
Runtime, no torch needed) and model folders (eager PyTorch) with

* ``POST /v1/translate`` and ``POST /v1/translate/stream`` (NDJSON), ``GET /v1/models``;
* LibreTranslate's ``POST /translate`` and ``GET /languages``;
* ``GET /healthz``, ``GET /readyz`` (503 while loading or draining), ``GET /metrics`` (Prometheus);

batching requests across clients (:mod:`.scheduler`, :mod:`.continuous`), bounded by body size,
sources per request, tokens per source and queue length, and draining on SIGTERM
(:mod:`.server`). docs/serving.md is the user's guide. Needs the ``serve`` extra (fastapi,
uvicorn, prometheus-client).
"""

__all__ = ["ServeConfig", "ServedModel", "create_app", "load_model"]


def __getattr__(name: str):
    # imported on first use: ``python -m transformer_ext.serve`` checks that fastapi is installed first
    if name in ("ServeConfig", "create_app"):
        from . import app

        return getattr(app, name)
    if name in ("ServedModel", "load_model"):
        from . import models

        return getattr(models, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
