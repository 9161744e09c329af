"""Running an app under uvicorn with a graceful drain on SIGTERM / SIGINT.

The first SIGTERM or SIGINT starts the drain: ``/readyz`` answers 503 and new translation
requests 503 (with ``Retry-After``) while the listening socket stays open, so a load balancer
sees the server leave; every request already accepted runs to its answer. When none is left, or
after ``drain_timeout`` seconds (the rest answer 503), uvicorn shuts down and :func:`serve`
returns: the process exits 0. A second signal during the drain exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading
from typing import Optional

import uvicorn
from fastapi import FastAPI

from .scheduler import JobError

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_KEEP_ALIVE", "DrainingServer", "serve"]


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose exit signals drain the app first (module docstring)."""

    def __init__(self, config: uvicorn.Config, app: FastAPI):
        super().__init__(config)
        self.serve_state = app.state.serve
        self._drain_task: Optional[asyncio.Task] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame) -> None:  # called in the main thread by the signal
        if self._loop is None or self.serve_state.draining or self.should_exit:
            logger.warning("second exit signal: stopping now")
            self.should_exit = True
            self.force_exit = True
            return
        self.serve_state.draining = True
        logger.info("signal %d: draining (no new work; accepted work finishes)", sig)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        state = self.serve_state
        timeout = state.config.drain_timeout
        try:
            if state.idle is not None:
                await asyncio.wait_for(state.idle.wait(), timeout)
        except asyncio.TimeoutError:
            logger.warning("drain timeout (%g s): %d requests end with 503", timeout, len(state.jobs))
            for job in list(state.jobs):
                job.cancel_status = 503
                for scheduler in state.schedulers.values():
                    scheduler.cancel(job)
                job.finish(JobError(503, "the server shut down before this request finished (drain timeout)"))
            try:  # their handlers answer; uvicorn's shutdown then waits for those answers to go out
                await asyncio.wait_for(state.idle.wait(), 10.0)
            except asyncio.TimeoutError:
                logger.warning("%d requests still unanswered at shutdown", len(state.jobs))
        logger.info("drained")
        self.should_exit = True


# Seconds an idle keep-alive connection stays open. Longer than the idle time after which clients
# and proxies stop reusing theirs (httpx 5 s, aiohttp 15 s, a load balancer's 60 s; requests and
# urllib3 keep them until they close): a server that closes first races a client's next request on
# that connection, which then meets a reset instead of an answer.
DEFAULT_KEEP_ALIVE = 75.0


def serve(
    app: FastAPI,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    log_level: str = "info",
    sock: Optional[socket.socket] = None,
    keep_alive: float = DEFAULT_KEEP_ALIVE,
) -> int:
    """Serve ``app`` until a signal drains it (module docstring); returns the exit code (0).
    ``keep_alive``: seconds an idle keep-alive connection stays open (:data:`DEFAULT_KEEP_ALIVE`)."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        lifespan="on",
        timeout_graceful_shutdown=10,
        timeout_keep_alive=keep_alive,
        access_log=False,
    )
    server = DrainingServer(config, app)
    # SIGINT may have been ignored by whoever started us (a background shell): the drain needs it
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)
    server.run(sockets=[sock] if sock is not None else None)
    return 0
