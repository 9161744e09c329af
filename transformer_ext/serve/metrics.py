"""The server's Prometheus metrics (prometheus-client), one registry per app.

=========================================  =========  ==========================================
name                                       type       labels, meaning
=========================================  =========  ==========================================
``translate_requests_total``               counter    ``route``, ``status``: every answered request
``translate_request_errors_total``         counter    ``route``, ``status``: answers of status >= 400
``translate_request_duration_seconds``     histogram  ``route``: time to the whole answer
``translate_requests_in_flight``           gauge      translation requests accepted and not yet answered
``translate_queue_depth``                  gauge      ``model``: sources waiting for the scheduler
``translate_batch_rows``                   histogram  ``model``: decoder rows per step (continuous)
                                                      or per batch (static, none)
``translate_batch_sources``                histogram  ``model``: sources per step or batch
``translate_generated_tokens_total``       counter    ``model``: tokens generated
``translate_sources_total``                counter    ``model``: sources translated
=========================================  =========  ==========================================
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

__all__ = ["CONTENT_TYPE_LATEST", "Metrics"]

_ROWS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    """The counters, gauges and histograms of one app (their own registry, so several apps in one
    process do not share them); :meth:`render` is the ``/metrics`` body."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("translate_requests", "Requests answered", ["route", "status"], registry=r)
        self.errors = Counter(
            "translate_request_errors",
            "Requests answered with a status >= 400",
            ["route", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "translate_request_duration_seconds",
            "Time from a request's arrival to its whole answer",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            "translate_requests_in_flight", "Translation requests accepted, not answered", registry=r
        )
        self.queue_depth = Gauge(
            "translate_queue_depth", "Sources waiting for the scheduler", ["model"], registry=r
        )
        self.rows = Histogram(
            "translate_batch_rows",
            "Decoder rows per step or batch",
            ["model"],
            buckets=_ROWS_BUCKETS,
            registry=r,
        )
        self.batch_sources = Histogram(
            "translate_batch_sources",
            "Sources per step or batch",
            ["model"],
            buckets=_ROWS_BUCKETS,
            registry=r,
        )
        self.generated = Counter("translate_generated_tokens", "Tokens generated", ["model"], registry=r)
        self.cancelled_sources = Counter(
            "translate_cancelled_sources",
            "Sources that left before they were translated (reason: timeout, disconnect, shutdown)",
            ["model", "reason"],
            registry=r,
        )
        self.sources = Counter("translate_sources", "Sources translated", ["model"], registry=r)

    # the schedulers' calls (any thread: prometheus-client's metrics are thread-safe)
    def batch(self, model: str, rows: int, sources: int) -> None:
        self.rows.labels(model).observe(rows)
        self.batch_sources.labels(model).observe(sources)

    def tokens(self, model: str, n: int) -> None:
        self.generated.labels(model).inc(n)

    def translated(self, model: str, n: int) -> None:
        self.sources.labels(model).inc(n)

    def cancelled(self, model: str, n: int, reason: str) -> None:
        self.cancelled_sources.labels(model, reason).inc(n)

    def queue(self, model: str, depth: int) -> None:
        self.queue_depth.labels(model).set(depth)

    # the HTTP layer's
    def answered(self, route: str, status: int, seconds: float) -> None:
        self.requests.labels(route, str(status)).inc()
        if status >= 400:
            self.errors.labels(route, str(status)).inc()
        self.latency.labels(route).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
