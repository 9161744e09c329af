"""``python -m benchmarks``: list the benchmark scripts; ``python -m benchmarks NAME [ARGS]``: run one.

The one entry point of ``benchmarks/``: every script is a module of this package, run with the
repository root on ``sys.path`` (which ``python -m`` from the root gives), so no script edits
``sys.path`` itself.
"""

from __future__ import annotations

import ast
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
GROUPS = ("decode", "train", "ops", "probes", "profiles", "serve", "deploy")


def scripts() -> dict[str, tuple[str, str]]:
    """``{name: (module, first docstring line)}`` of every script under the groups' folders."""
    found = {}
    for group in GROUPS:
        for path in sorted((HERE / group).glob("*.py")):
            if path.name == "__init__.py":
                continue
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
            found[path.stem] = (f"benchmarks.{group}.{path.stem}", doc.split("\n")[0])
    return found


def main(argv: list[str]) -> int:
    known = scripts()
    if not argv or argv[0] in ("-h", "--help", "list"):
        print("usage: python -m benchmarks NAME [ARGS]   (from the repository root)\n")
        width = max(len(name) for name in known)
        for name, (module, line) in known.items():
            print(f"  {name:<{width}}  {module.split('.')[1]:<8}  {line}")
        return 0
    name = argv[0].removesuffix(".py").split("/")[-1]
    if name not in known:
        print(
            f"python -m benchmarks: error: no benchmark named {argv[0]!r} (python -m benchmarks lists them)",
            file=sys.stderr,
        )
        return 2
    sys.argv = [known[name][0]] + argv[1:]
    runpy.run_module(known[name][0], run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
