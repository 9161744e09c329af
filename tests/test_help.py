"""Every command's --help renders, and reads: no "(default: None)", no default of a
flag ("(default: True)"), no default given twice (``(default 0.6) (default: None)``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
COMMANDS = [
    "transformer_ext.train",
    "transformer_ext.translate",
    "transformer_ext.evaluate",
    "transformer_ext.average",
    "transformer_ext.corpora",
    "transformer_ext.convert",
    "export.onnx",
    "export.quantize",
    "export.tensorrt",
    "export.triton",
]
UNREADABLE = [
    (re.compile(r"\(default: None\)"), "a default of None"),
    (re.compile(r"\(default: (True|False)\)"), "the default of a flag"),
    (re.compile(r"\(default:? [^()]*(\([^()]*\)[^()]*)*\)\s*\(default"), "a default given twice"),
]


@pytest.mark.parametrize("command", COMMANDS)
def test_help_renders_and_reads(command):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-m", command, "--help"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    text = " ".join(proc.stdout.split())  # argparse wraps lines anywhere
    assert text.startswith("usage:"), text[:200]
    for pattern, what in UNREADABLE:
        found = pattern.search(text)
        assert found is None, (
            f"{command} --help shows {what}: ...{text[max(0, found.start() - 80) : found.end()]}"
        )


def test_the_check_finds_what_it_looks_for():
    """The patterns catch help texts that read badly (examples of each kind)."""
    quoted = [
        "--no-validate skip the parity check (default: True)",
        "--alpha A length penalty exponent (default 0.6) (default: None)",
        "--cache-len N cache capacity (default: None)",
    ]
    for text in quoted:
        assert any(p.search(text) for p, _ in UNREADABLE), text
    assert not any(p.search("--beam N beam size (default: 4)") for p, _ in UNREADABLE)
