"""What every command line entry point of the package shares: ``--debug``, ``--version``, one-line
errors, signals.

A CLI's ``main()`` parses its arguments and hands the work to :func:`run_cli`::

    def main(argv=None):
        parser = build_parser()          # add_debug_flag(parser) inside
        args = parser.parse_args(argv)
        return run_cli(parser.prog, lambda: _run(args), debug=args.debug)

:func:`run_cli` turns SIGTERM (what ``timeout``, ``docker stop`` and Kubernetes send) into a
:class:`Terminated` exception, so the ``finally`` blocks and ``with`` blocks that remove temporary
files run exactly as on Ctrl-C. Expected failures (bad input, a bad file, a full disk) print one
line ``PROG: error: ...`` on stderr and return exit code 1; ``--debug`` shows the traceback
instead. Interruptions return 130 (SIGINT) or 143 (SIGTERM) after printing one line.
"""

from __future__ import annotations

import argparse
import errno
import signal
import sys
import threading
from typing import Callable, Optional, Union

from . import __version__

EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_SIGINT = 130
EXIT_SIGTERM = 143


class Terminated(KeyboardInterrupt):
    """Raised in the main thread when the process receives SIGTERM (under :func:`run_cli`)."""


class UserError(Exception):
    """Base of the package's errors that describe a problem with the user's input, files or options.

    Message only, no traceback, when it reaches a CLI.
    """


class UsageError(UserError, ValueError):
    """An option value out of its range, or options that exclude each other: exit code 2 in a CLI."""


def add_version_flag(parser) -> None:
    """``--version``: print ``PROG VERSION`` (the package's ``__version__``) and exit 0.

    ``parser`` is a parser or an argument group; nothing is added where ``--version`` exists."""
    if "--version" in parser._option_string_actions:
        return
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {__version__}", help="print the version and exit"
    )


def add_debug_flag(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--debug`` (tracebacks instead of one-line errors) and ``--version``, which every command
    line of the package has."""
    parser.add_argument(
        "--debug",
        action="store_true",
        help="show the full traceback of an error instead of a one-line message",
    )
    add_version_flag(parser)
    return parser


def _expected_errors() -> tuple[type[BaseException], ...]:
    """Exception types that describe bad input or a failing disk, not a bug of ours."""
    errors: list[type[BaseException]] = [UserError, OSError, ValueError, UnicodeError]
    try:  # a corrupt .onnx file or protobuf text
        from google.protobuf.message import DecodeError

        errors.append(DecodeError)
    except ImportError:
        pass
    try:
        from safetensors import SafetensorError

        errors.append(SafetensorError)
    except ImportError:
        pass
    return tuple(errors)


def describe_error(exc: BaseException) -> str:
    """One line for ``exc``: its message, with what to do for the common disk errors."""
    if isinstance(exc, OSError) and exc.errno is not None:
        where = f": {exc.filename}" if exc.filename else ""
        hints = {
            errno.ENOSPC: "no space left on the device; free some space and run the command again",
            errno.EROFS: "the file system is read-only; choose an output folder you can write to",
            errno.EACCES: "permission denied",
            errno.EDQUOT: "disk quota exceeded",
        }
        if exc.errno in hints:
            return f"{hints[exc.errno]}{where}"
        return f"{exc.strerror or exc}{where}"
    text = str(exc).strip() or type(exc).__name__
    if len(text) > 1000:  # a message must never echo a whole input file
        text = f"{text[:1000]}... ({len(text) - 1000} more characters)"
    return text


def _raise_terminated(signum, frame):
    raise Terminated()


def run_cli(
    prog: str,
    work: Callable[[], int],
    *,
    debug: bool = False,
    interrupted_hint: Union[str, Callable[[], str]] = "",
    expected: Optional[tuple[type[BaseException], ...]] = None,
) -> int:
    """Run ``work()`` and return its exit code, or one for the failure (see the module docstring).

    ``interrupted_hint`` is appended to the "interrupted" line (``"resume with --resume"``); a
    callable is asked at the moment of the interruption (an empty string adds nothing);
    ``expected`` adds exception types to the ones reported without a traceback.
    """
    expected_types = _expected_errors() + tuple(expected or ())
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        return work()
    except KeyboardInterrupt as exc:  # SIGINT, or SIGTERM as Terminated
        if debug:
            raise
        hint = interrupted_hint() if callable(interrupted_hint) else interrupted_hint
        what = "terminated" if isinstance(exc, Terminated) else "interrupted"
        print(f"{prog}: {what}{'; ' + hint if hint else ''}", file=sys.stderr)
        return EXIT_SIGTERM if isinstance(exc, Terminated) else EXIT_SIGINT
    except expected_types as exc:
        if debug:
            raise
        print(f"{prog}: error: {describe_error(exc)}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, UsageError) else EXIT_ERROR
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """``--help`` with an option's default appended as ``(default: X)`` only where it says
    something: not for a default of ``None`` (the option is simply off or taken from elsewhere,
    which its help says), not for flags (``store_true`` / ``store_false``), not for
    suppressed defaults, and not when the help text already names its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            action.default is None
            or action.default is argparse.SUPPRESS
            or isinstance(action.default, bool)
            or action.nargs == 0
            or "default" in text
            or not action.option_strings
        ):
            return text
        return f"{text} (default: %(default)s)"
