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
import dataclasses
import errno
import logging
import signal
import sys
import threading
import weakref
from typing import Any, Callable, Optional, Sequence, Union

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


# add_option's renamed spellings: the option string given first for each dest, per namespace being
# parsed (keyed by id, since a Namespace is unhashable; the entry goes with the namespace)
_SPELLINGS_SEEN: dict[int, dict[str, str]] = {}


def _spellings_seen(namespace: argparse.Namespace) -> dict[str, str]:
    key = id(namespace)
    if key not in _SPELLINGS_SEEN:
        _SPELLINGS_SEEN[key] = {}
        weakref.finalize(namespace, _SPELLINGS_SEEN.pop, key, None)
    return _SPELLINGS_SEEN[key]


def spelling_given(namespace: argparse.Namespace, dest: str) -> Optional[str]:
    """The option string a parsed command line gave for ``dest``, an :func:`add_option` option
    with old spellings (an old one or the new one); None when it gave none."""
    return _SPELLINGS_SEEN.get(id(namespace), {}).get(dest)


def add_option(
    parser: Union[argparse.ArgumentParser, argparse._ActionsContainer],
    *flags: str,
    deprecated: Sequence[str] = (),
    **kwargs: Any,
) -> argparse.Action:
    """``parser.add_argument(*flags, **kwargs)``, also accepting the old spellings ``deprecated``.

    ``flags[0]`` is the option's one spelling; its ``dest`` is the value's name. An old spelling
    works as the new one and prints one line ``PROG: warning: --old is deprecated; use --new`` on
    stderr. An old and the new spelling in one command line are a usage error (exit 2) naming
    both, since which of the two values was meant is not known. ``parser`` may be an argument
    group. A parser whose attribute ``quiet_renamed`` is true parses without the warning (a second
    parse of the same command line, to see which options it gives).
    """
    old = tuple(deprecated)
    if not old:
        return parser.add_argument(*flags, **kwargs)
    if not flags or not flags[0].startswith("--"):
        raise ValueError(f"add_option: the first flag must be a --long option, got {flags!r}")
    canonical = flags[0]
    base = parser._registry_get("action", kwargs.pop("action", None), None)
    if not (isinstance(base, type) and issubclass(base, argparse.Action)):
        raise ValueError(f"add_option: unknown action for {canonical}")
    kwargs.setdefault("dest", canonical[2:].replace("-", "_"))
    if kwargs.get("help") not in (None, argparse.SUPPRESS):
        kwargs["help"] = f"{kwargs['help']} ({', '.join(old)}: deprecated spelling)"

    class Renamed(base):  # type: ignore[misc, valid-type]
        def __call__(self, parser, namespace, values, option_string=None):
            seen = _spellings_seen(namespace)
            given = seen.setdefault(self.dest, option_string)
            if (given in old) != (option_string in old):
                parser.error(f"{given} and {option_string} are one option (give only {canonical})")
            if option_string in old and not getattr(parser, "quiet_renamed", False):
                print(
                    f"{parser.prog}: warning: {option_string} is deprecated; use {canonical}", file=sys.stderr
                )
            super().__call__(parser, namespace, values, option_string)

    return parser.add_argument(*flags, *old, action=Renamed, **kwargs)


def take_positional_spelling(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    positional: str,
    flag: str,
    *,
    metavar: str,
    default: Any = None,
    required: bool = False,
) -> None:
    """Resolve the option ``flag`` whose old spelling is the positional argument ``positional``
    (its dest; added with ``nargs="?"``, ``default=None`` and ``help=argparse.SUPPRESS``, beside
    ``flag`` with ``default=None``), after parsing. The positional works as the option and prints
    one line ``PROG: warning: the positional METAVAR is deprecated; use FLAG METAVAR`` on stderr;
    both in one command line are a usage error (exit 2) naming both; neither gives ``default``, or
    the usage error that ``flag`` is required. The positional's dest is removed from ``args``."""
    old = vars(args).pop(positional, None)
    dest = flag[2:].replace("-", "_")
    value = getattr(args, dest, None)
    if old is not None and value is not None:
        parser.error(f"{metavar} and {flag} are one option (give only {flag} {metavar})")
    if old is not None:
        print(
            f"{parser.prog}: warning: the positional {metavar} is deprecated; use {flag} {metavar}",
            file=sys.stderr,
        )
        value = old
    if value is None:
        if required:
            parser.error(f"the following arguments are required: {flag}")
        value = default
    setattr(args, dest, value)


def option(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    flag: Optional[str] = None,
    group: Optional[str] = None,
    deprecated: Sequence[str] = (),
    cli: bool = True,
    **argparse_kwargs: Any,
) -> Any:
    """A dataclass field that also declares its command-line option (see :func:`add_options`).

    ``flag`` defaults to the field's name with dashes (``max_tokens``: ``--max-tokens``);
    ``deprecated`` lists old spellings (:func:`add_option`); ``group`` names the ``--help``
    section; ``cli=False`` keeps the field off the command line (library callers only);
    ``argparse_kwargs`` go to ``add_argument`` (``type``, ``choices``, ``metavar``, ``nargs``,
    ``action``, ...). The help text is the field's documentation in the API reference too.
    """
    meta = {"help": help, "flag": flag, "group": group, "deprecated": tuple(deprecated), "cli": cli}
    meta["argparse"] = argparse_kwargs
    return dataclasses.field(default=default, metadata=meta)


def option_flag(cls: type, name: str) -> str:
    """The command-line spelling of the field ``name`` of the options dataclass ``cls``."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f.metadata.get("flag") or "--" + name.replace("_", "-")
    raise KeyError(name)


def add_options(
    parser: argparse.ArgumentParser, cls: type, groups: Sequence[tuple[str, str]]
) -> dict[str, argparse._ArgumentGroup]:
    """Add an option for every command-line field of the dataclass ``cls`` (declared with
    :func:`option`), in field order, each in its ``--help`` group. ``groups`` lists ``(key,
    title)`` in the order ``--help`` shows them; the groups made are returned by key, so a command
    can add options of its own to them. A field's default is the option's default."""
    made = {key: parser.add_argument_group(title) for key, title in groups}
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if not meta.get("cli"):
            continue
        if meta["group"] not in made:
            raise ValueError(f"add_options: field {f.name} names the unknown group {meta['group']!r}")
        kwargs = dict(meta["argparse"])
        kwargs.setdefault("dest", f.name)
        if "default" not in kwargs and kwargs.get("action") not in ("store_true", "store_false"):
            kwargs["default"] = f.default
        add_option(
            made[meta["group"]],
            option_flag(cls, f.name),
            deprecated=meta["deprecated"],
            help=meta["help"],
            **kwargs,
        )
    return made


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


def _quiet_exit_hooks() -> None:
    """After an interruption nothing but the one line may follow. torch's logger is set to WARNING
    by torch's own logging setup at the end of its import; an import cut short leaves it unset,
    so torch's exit hooks (the fake-tensor cache statistics) would log at the CLI's INFO level."""
    torch_logger = logging.getLogger("torch")
    if torch_logger.level == logging.NOTSET:
        torch_logger.setLevel(logging.WARNING)


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
        _quiet_exit_hooks()
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
