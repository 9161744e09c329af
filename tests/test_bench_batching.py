"""benchmarks/bench_batching.py at tiny size: it runs, writes its JSON, both paths agree."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_batching  # noqa: E402


def test_bench_batching_tiny(tmp_path):
    out = tmp_path / "bench.json"
    args = ["--lines", "6", "--repeats", "1", "--window", "4", "--max-batch-tokens", "60", "--out", str(out)]
    bench_batching.main(args)
    payload = json.loads(out.read_text())
    assert payload["lines"] == 6
    assert payload["outputs_equal"] == 6  # greedy tokens do not depend on the batching here
    for name in ("sentence_batches", "token_batches"):
        r = payload["results"][name]
        assert r["seconds"] > 0 and r["first_result_seconds"] <= r["seconds"]
