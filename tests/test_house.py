"""What a newcomer relies on finding: ``benchmarks/README.md`` indexes the shared benchmark code and
every results file (and names no file that is gone), and the product's text speaks of features,
never of the tickets or work rounds that produced them."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"
INDEX = BENCHMARKS / "README.md"

# Built from pieces so that this file does not match itself.
_ISSUE = "iss" + "ue"
PROCESS_WORDS = [
    re.compile(rf"\b{_ISSUE}s?\s*#?\s*\d+", re.IGNORECASE),  # "issue 39", "issue #4"
    re.compile(rf"#\d+\s+{_ISSUE}", re.IGNORECASE),
    re.compile(
        rf"\bthe (import|reliability|serving|decode-speed|speed|house|structure|restructuring) {_ISSUE}\b",
        re.IGNORECASE,
    ),
    re.compile(r"\b(round|iteration) (one|two|three|four|five|six)\b", re.IGNORECASE),
    re.compile(r"\b(last|previous|next|this) round\b", re.IGNORECASE),
]
PRODUCT = (
    "README.md",
    "CHANGELOG.md",
    "mkdocs.yml",
    "docs",
    "transformer_ext",
    "export",
    "tests",
    "benchmarks",
    "recipes",
    "scripts",
)
TEXT = (".py", ".md", ".yml", ".yaml", ".sh", ".txt", ".toml", ".cfg")


def _tracked(*paths: str) -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "--", *paths], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    return [REPO / p for p in out]


def _index_text() -> str:
    return INDEX.read_text(encoding="utf-8")


def test_the_benchmarks_index_names_the_shared_code():
    """The shared modules beside the script folders (``test_benchmarks_index`` checks the scripts)."""
    text = _index_text()
    missing = []
    for path in sorted(BENCHMARKS.glob("*.py")):
        if "results" in path.parts or path.name == "__init__.py":
            continue
        if f"`{path.stem}`" not in text and f"`{path.name}`" not in text:
            missing.append(path.relative_to(REPO).as_posix())
    assert missing == [], f"benchmarks/README.md does not list: {missing}"


def test_the_benchmarks_index_names_every_results_file_and_no_missing_one():
    text = _index_text()
    present = {p.name for p in (BENCHMARKS / "results").iterdir() if p.is_file()}
    unlisted = sorted(name for name in present if f"`{name}`" not in text)
    assert unlisted == [], f"benchmarks/README.md does not index these results: {unlisted}"
    named = set(re.findall(r"`([\w.-]+\.(?:json|png|md))`", text.split("## results/", 1)[-1]))
    gone = sorted(named - present)
    assert gone == [], f"benchmarks/README.md indexes results that do not exist: {gone}"


def test_the_results_named_in_readme_and_docs_exist():
    present = {p.name for p in (BENCHMARKS / "results").iterdir()}
    dangling = []
    for path in _tracked("README.md", "docs"):
        if path.suffix != ".md":
            continue
        for line in path.read_text(encoding="utf-8").splitlines():
            for name in re.findall(r"benchmarks/results/([\w.-]+\.(?:json|png|md))\b", line):
                if name not in present and "default" not in line:  # a script's default output
                    dangling.append(f"{path.relative_to(REPO)}: {name}")
    assert dangling == []


def test_the_product_names_no_ticket_or_work_round():
    found = []
    for path in _tracked(*PRODUCT):
        if path.suffix not in TEXT or path == Path(__file__).resolve() or "results" in path.parts:
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if any(p.search(line) for p in PROCESS_WORDS):
                found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()[:100]}")
    assert found == [], "the product speaks of its process:\n" + "\n".join(found)


def test_the_process_check_finds_what_it_looks_for():
    for text in (f"as {_ISSUE} 39 asked", f"{_ISSUE} #4's targets", f"the import {_ISSUE}", "in round two"):
        assert any(p.search(text) for p in PROCESS_WORDS), text
    for text in ("an ONNX Runtime session", "rounds 7", "round-robin", "Please file an issue"):
        assert not any(p.search(text) for p in PROCESS_WORDS), text
