"""``python -m transformer_ext.serve`` (console script ``transformer-ext-serve``): the command line.

::

    python -m transformer_ext.serve --model en-de-onnx --port 8000
    python -m transformer_ext.serve --model en=models/en-de --model fr=fr-onnx --batching static
    python -m transformer_ext.serve                      # the bundled demo model (eager PyTorch)

Usage errors (an option out of range, a malformed ``--model`` or ``--languages``) exit with 2,
a model folder that does not load or a port that cannot be bound with 1, each with one line
``transformer-ext-serve: error: ...`` on stderr. Once serving, SIGTERM / SIGINT drain the server
and it exits 0 (:mod:`transformer_ext.serve.server`).
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from typing import Optional, Sequence

from ..cli import DefaultsHelpFormatter, UsageError, add_debug_flag, run_cli
from .app import ServeConfig
from .scheduler import BATCHING, DEFAULT_BATCH_WAIT
from .server import DEFAULT_KEEP_ALIVE

logger = logging.getLogger("transformer_ext.serve")

PROG = "python -m transformer_ext.serve"
_DEFAULTS = ServeConfig()
SOCKET_BACKLOG = 2048  # uvicorn's default


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive finite number of seconds, got {text}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be 0-65535 (0: any free port), got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Serve translations over HTTP: a native JSON API (/v1/translate, streaming NDJSON), "
        "LibreTranslate's /translate and /languages, /healthz, /readyz and Prometheus /metrics. "
        "See docs/serving.md.",
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument(
        "--model",
        action="append",
        metavar="[NAME=]DIR",
        help="an export folder (ONNX Runtime, no torch needed) or a model folder (eager PyTorch); repeat "
        "for several models (the first is the default); default: the bundled demo model",
    )
    parser.add_argument(
        "--languages",
        action="append",
        metavar="[NAME=]SRC-TGT",
        help="the language pair of a model without language codes (the demo model, models trained here), "
        "for the LibreTranslate API; without it such a model accepts any source / target",
    )
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    parser.add_argument("--port", type=_port, default=8000, help="the port (0: any free port, logged)")
    parser.add_argument("--threads", type=_positive_int, help="intra-op threads of each runner")
    parser.add_argument(
        "--workers",
        type=_positive_int,
        default=1,
        help="runners per export folder, each decoding a part of a batch (for more processes, run several "
        "servers or Ray Serve replicas)",
    )
    parser.add_argument(
        "--batching",
        choices=BATCHING,
        help="continuous: sources join and leave the running batch between decoder steps (the default "
        "where the decoding package has its step-wise search state, else static); static: requests "
        "collected for --batch-wait, each batch run to its end; none: each request alone",
    )
    parser.add_argument(
        "--max-batch-tokens",
        type=_positive_int,
        default=_DEFAULTS.max_batch_tokens,
        help="padded source tokens a batch admits",
    )
    parser.add_argument(
        "--max-batch-rows",
        type=_positive_int,
        default=_DEFAULTS.max_batch_rows,
        help="decoder rows (sources x beam) a batch admits",
    )
    parser.add_argument(
        "--max-queue",
        type=_positive_int,
        default=_DEFAULTS.max_queue,
        help="sources waiting per model; more answer 429",
    )
    parser.add_argument(
        "--request-timeout",
        type=_seconds,
        default=_DEFAULTS.request_timeout,
        help="seconds per request; past it 504",
    )
    parser.add_argument(
        "--drain-timeout",
        type=_seconds,
        default=_DEFAULTS.drain_timeout,
        help="seconds accepted work has after SIGTERM",
    )
    parser.add_argument(
        "--keep-alive-timeout",
        type=_seconds,
        default=DEFAULT_KEEP_ALIVE,
        help="seconds an idle keep-alive connection stays open (longer than clients and proxies keep theirs)",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=_positive_int,
        default=_DEFAULTS.max_body_bytes,
        help="request body size; more answer 413",
    )
    parser.add_argument(
        "--max-sources", type=_positive_int, default=_DEFAULTS.max_sources, help="sources per request"
    )
    parser.add_argument(
        "--max-source-tokens", type=_positive_int, help="tokens per source (default: the model's positions)"
    )
    parser.add_argument(
        "--batch-wait",
        type=float,
        default=DEFAULT_BATCH_WAIT,
        help="static batching: seconds a batch waits for more requests after its first",
    )
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    add_debug_flag(parser)
    return parser


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        # listening from here on: a client that connects while the models load or the server
        # starts waits in the backlog instead of being refused
        sock.listen(SOCKET_BACKLOG)
    except OSError as exc:
        sock.close()
        raise OSError(
            exc.errno, f"--host {host} --port {port}: cannot listen there ({exc.strerror})"
        ) from None
    sock.set_inheritable(True)
    return sock


def _run(args: argparse.Namespace) -> int:
    from .app import create_app
    from .models import demo_spec, load_model, parse_languages, parse_model_spec
    from .server import serve

    batching = args.batching
    if batching is None:
        from .continuous import StepwiseUnavailable, stepwise_api

        try:
            stepwise_api()
            batching = "continuous"
        except StepwiseUnavailable:
            batching = "static"
    config = ServeConfig(
        batching=batching,
        max_batch_tokens=args.max_batch_tokens,
        max_batch_rows=args.max_batch_rows,
        max_queue=args.max_queue,
        request_timeout=args.request_timeout,
        max_body_bytes=args.max_body_bytes,
        max_sources=args.max_sources,
        max_source_tokens=args.max_source_tokens,
        drain_timeout=args.drain_timeout,
        batch_wait=args.batch_wait,
    )
    try:
        config.check()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    specs = [parse_model_spec(text) for text in args.model] if args.model else [demo_spec()]
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise UsageError(
            f"--model: two models named {sorted({n for n in names if names.count(n) > 1})}; name them NAME=DIR"
        )
    pairs: dict[Optional[str], tuple[str, str]] = {}
    for text in args.languages or ():
        name, pair = parse_languages(text)
        if name is not None and name not in names:
            raise UsageError(
                f"--languages {text!r}: no model named {name!r} (the models are {', '.join(names)})"
            )
        pairs[name] = pair
    if None in pairs and len(specs) > 1:
        raise UsageError("--languages without NAME= applies to one model; with several, write NAME=SRC-TGT")
    sock = _bind(args.host, args.port)
    try:
        models = [
            load_model(
                spec, threads=args.threads, workers=args.workers, pair=pairs.get(spec.name, pairs.get(None))
            )
            for spec in specs
        ]
        for model in models:
            warm_up(model)
        try:
            app = create_app(models, config)
        except ValueError as exc:  # a model that cannot be batched this way
            raise UsageError(str(exc)) from None
        host, port = sock.getsockname()[:2]
        logger.info("serving %s on http://%s:%d (batching %s)", ", ".join(names), host, port, config.batching)
        return serve(app, log_level=args.log_level, sock=sock, keep_alive=args.keep_alive_timeout)
    finally:
        sock.close()


def warm_up(model) -> None:
    """One short translation, so that the first request does not pay for the runner's first call."""
    from ..translator import TranslationError

    try:
        model.translator.translate(["one"], strict=False, max_decoding_length=2)
    except (
        TranslationError
    ) as exc:  # a model that cannot encode the warm-up text: it warms on its first request
        logger.info("model %s: no warm-up (%s)", model.name, exc)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    return run_cli(PROG, lambda: _run(args), debug=args.debug)
