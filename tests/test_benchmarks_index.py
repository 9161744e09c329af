"""benchmarks/ is navigable: its README indexes every script, and no script edits sys.path."""

import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"


def _scripts() -> list[Path]:
    return sorted(p for p in BENCH.glob("*/*.py") if p.name != "__init__.py" and p.parent.name != "results")


def test_readme_indexes_every_script():
    text = (BENCH / "README.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"^\| `([a-z0-9_]+)` \|", text, flags=re.M))
    names = {p.stem for p in _scripts()}
    assert names - listed == set(), f"scripts missing from benchmarks/README.md: {sorted(names - listed)}"
    assert listed - names == set(), (
        f"benchmarks/README.md lists scripts that do not exist: {sorted(listed - names)}"
    )


def test_no_script_edits_sys_path():
    """Scripts run as modules of the package; only the peer engines' worker (run by other
    interpreters) adds the repository, and bench_pretrained the tests' checkpoint writer."""
    offenders = [
        f"{p.relative_to(REPO)}: {line.strip()}"
        for p in _scripts() + [BENCH / "common.py"]
        for line in p.read_text(encoding="utf-8").splitlines()
        if "sys.path.insert" in line and p.name != "decode_worker.py" and '"tests"' not in line
    ]
    assert offenders == []


def test_entry_point_lists_and_refuses_unknown_names():
    res = subprocess.run(
        [sys.executable, "-m", "benchmarks"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0 and "bench_decode" in res.stdout and "profile_decode" in res.stdout
    res = subprocess.run(
        [sys.executable, "-m", "benchmarks", "bench_nothing"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "bench_nothing" in res.stderr


def test_results_record_their_provenance(tmp_path, monkeypatch):
    from benchmarks import common

    monkeypatch.setattr(sys, "argv", ["bench_x.py", "--quick"])
    common.write_json(str(tmp_path / "r.json"), {"cases": []})
    record = json.loads((tmp_path / "r.json").read_text())["provenance"]
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    assert record["commit"] == (head or None) and isinstance(record["dirty"], (bool, type(None)))
    assert record["argv"][1:] == ["bench_x.py", "--quick"] and len(record["load_average"]) == 3
