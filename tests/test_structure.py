"""The house rules a reader relies on: no function over 100 lines, no ``nonlocal`` closures.

``KNOWN`` may list a function allowed over the limit with its length, never to grow (it lists
none); ``KNOWN_NONLOCAL`` the same for ``nonlocal`` statements per file.
"""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FOLDERS = ("transformer_ext", "export", "benchmarks")
LIMIT = 100
# (file, function): its length, never to grow
KNOWN: dict[tuple[str, str], int] = {}
KNOWN_NONLOCAL: dict[str, int] = {}


def _modules():
    for folder in FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            if "results" not in path.parts:
                yield path.relative_to(REPO).as_posix(), ast.parse(path.read_text(encoding="utf-8"))


def test_no_function_over_100_lines():
    too_long = []
    for name, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > KNOWN.get((name, node.name), LIMIT):
                    too_long.append(f"{name}:{node.lineno} {node.name} ({length} lines)")
    assert too_long == [], "split these functions (at most 100 lines each): " + ", ".join(too_long)


def test_no_nonlocal():
    found = {}
    for name, tree in _modules():
        count = sum(isinstance(node, ast.Nonlocal) for node in ast.walk(tree))
        if count > KNOWN_NONLOCAL.get(name, 0):
            found[name] = count
    assert found == {}, f"nonlocal closures (use a small class or return values): {found}"
