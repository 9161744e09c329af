"""The design document cited by the code: every "DESIGN.md section N" (or "sections N and M",
"§N") in the repository names docs/DESIGN.md and a section that exists there."""

from __future__ import annotations

import os
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DESIGN = REPO / "docs" / "DESIGN.md"
TEXT_SUFFIXES = {".py", ".h", ".cpp", ".cu", ".cuh", ".md", ".txt", ".toml", ".sh", ".ini", ".cfg", ".pbtxt"}
SKIP_DIRS = {".git", ".venv", "build", "dist", "__pycache__", ".pytest_cache", ".hypothesis", "results"}
# A citation: the file name, then (across comment line breaks: //, #, *) "section(s)" or "§" and
# numbers such as 3, 3.3, "1 and 3", "2, 3".
NUMBER = r"\d+(?:\.\d+)?"
CITATION = re.compile(
    rf"(?P<path>[\w./-]*)DESIGN\.md(?:\s|//|#|\*)*(?:sections?|§)\s*(?P<numbers>{NUMBER}"
    rf"(?:\s*(?:,|and|&)\s*{NUMBER})*)"
)
MENTION = re.compile(r"(?P<path>[\w./-]*)DESIGN\.md")


def _text_files():
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [
            d
            for d in dirs
            if d not in SKIP_DIRS and not d.endswith(".egg-info") and not d.startswith(".venv")
        ]
        for name in files:
            path = Path(root) / name
            if path == Path(__file__).resolve():
                continue  # this test spells the pattern in its own examples
            if path.suffix in TEXT_SUFFIXES or (path.parent.name == ".ci" and not path.suffix):
                yield path


def _sections() -> set[str]:
    """The numbers of docs/DESIGN.md's sections ("## 3. ...") and subsections ("### 3.1 ...")."""
    return set(re.findall(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", DESIGN.read_text(encoding="utf-8"), re.M))


def _citations(text: str) -> list[tuple[str, list[str]]]:
    return [(m.group("path"), re.findall(NUMBER, m.group("numbers"))) for m in CITATION.finditer(text)]


def test_sections_are_numbered_one_to_seven():
    top = [int(n) for n in re.findall(r"^## (\d+)\. ", DESIGN.read_text(encoding="utf-8"), re.M)]
    assert top == list(range(1, 8))


def test_the_citation_pattern_reads_every_form():
    text = (
        "x (docs/DESIGN.md section 3), y docs/DESIGN.md sections 1 and 3, z docs/DESIGN.md §5,\n"
        "// wrapped (docs/DESIGN.md\n// section 2). w docs/DESIGN.md section 3.3"
    )
    assert _citations(text) == [
        ("docs/", ["3"]),
        ("docs/", ["1", "3"]),
        ("docs/", ["5"]),
        ("docs/", ["2"]),
        ("docs/", ["3.3"]),
    ]
    assert _citations("see DESIGN.md for more") == []


def test_every_citation_names_an_existing_section_of_docs_design():
    sections = _sections()
    problems, count = [], 0
    for path in _text_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        where = path.relative_to(REPO)
        for m in MENTION.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            # a page inside docs/ links to it as DESIGN.md (a relative link of the site)
            in_docs = path.parent == DESIGN.parent and m.group("path") in ("", "./")
            if path != DESIGN and not in_docs and not m.group("path").endswith("docs/"):
                problems.append(f"{where}:{line}: {m.group(0)!r} is not docs/DESIGN.md")
        for prefix, numbers in _citations(text):
            count += 1
            for n in numbers:
                if n not in sections:
                    problems.append(f"{where}: cites {prefix}DESIGN.md section {n}, which does not exist")
    assert not problems, "\n".join(problems)
    assert count >= 40  # the code does cite it (a broken pattern would find nothing)
