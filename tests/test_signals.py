"""SIGINT in the test suite and in commands started with SIGINT ignored (``nohup``, background jobs)."""

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from transformer_ext import cli

ROOT = Path(__file__).resolve().parents[1]

# A command under run_cli that sends itself SIGINT (Ctrl-C) and then finishes its work.
COMMAND = textwrap.dedent("""
    import os, signal, sys
    from transformer_ext import cli

    def work():
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):  # the signal is delivered between two bytecodes
            pass
        print("finished")
        return 0

    sys.exit(cli.run_cli("prog", work))
""")


def _env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))


def _ignore_sigint():
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_sigint_interrupts_a_command_in_the_test_process(capsys):
    def work():
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):
            pass
        return 0

    assert cli.run_cli("prog", work) == cli.EXIT_SIGINT
    assert capsys.readouterr().err == "prog: interrupted\n"


def test_sigint_interrupts_a_child_command():
    proc = subprocess.run(
        [sys.executable, "-c", COMMAND], env=_env(), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 130 and proc.stderr == "prog: interrupted\n" and proc.stdout == ""


def test_a_command_started_with_sigint_ignored_keeps_ignoring_it():
    proc = subprocess.run(
        [sys.executable, "-c", COMMAND],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=_ignore_sigint,
    )
    assert proc.returncode == 0 and proc.stdout == "finished\n" and proc.stderr == ""


@pytest.mark.skipif(os.environ.get("TRANSFORMER_EXT_NESTED_PYTEST") == "1", reason="already the nested run")
def test_signal_tests_pass_when_pytest_starts_with_sigint_ignored():
    # the SIGINT tests of the suite (tests/test_train.py, tests/test_export_safety.py) rely on the same
    # conftest fixture as the ones run here; those here are the cheap ones
    tests = [
        "tests/test_signals.py",
        "tests/test_fsutil.py::test_sigterm_under_run_cli_cleans_up",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
        cwd=ROOT,
        env=dict(_env(), TRANSFORMER_EXT_NESTED_PYTEST="1"),
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=_ignore_sigint,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout
