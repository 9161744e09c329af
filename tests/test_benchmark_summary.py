"""benchmarks/summary.py: README's performance block and docs/benchmarks/index.md are exactly what
the listed benchmark JSONs give, and the ratios it prints are the JSONs' numbers."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _summary():
    spec = importlib.util.spec_from_file_location("bench_summary", REPO / "benchmarks" / "summary.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_and_page_are_generated_from_the_jsons():
    assert _summary().main(["--check"]) == 0


def test_a_ratio_is_ours_best_over_the_peers_best(tmp_path, monkeypatch):
    summary = _summary()
    machine = {"model_name": "CPU X", "cpus": "2", "l3": "32 MiB (1 instance)", "simd": ["avx2"]}

    def record(engine, batch, by):
        return {
            "model": "base",
            "engine": engine,
            "mode": "greedy",
            "batch": batch,
            "tokens_per_second_by_threads": by,
        }

    payload = {
        "machine": machine,
        "best_threads": [
            record("onnxrt", 16, {"1": 100.0, "2": 300.0}),
            record("ctranslate2", 16, {"1": 150.0, "2": 120.0}),  # no 2x1: flagged
            record("onnxrt_int8", 16, {"1": 400.0, "2x1": 500.0}),
            record("ctranslate2_int8", 16, {"1": 100.0, "2x1": 1000.0}),
        ],
    }
    (tmp_path / "run.json").write_text(json.dumps(payload))
    monkeypatch.setattr(summary, "RESULTS", tmp_path)
    cells = summary.decode_cells(["run.json"])
    (name,) = cells
    assert "CPU X" in name and "AVX2" in name
    f32 = cells[name][("float32", "greedy", 16)]
    assert f32["ratios"] == [pytest.approx(2.0)] and f32["unsplit"]
    int8 = cells[name][("int8", "greedy", 16)]
    assert int8["ratios"] == [pytest.approx(0.5)] and not int8["unsplit"]
    block = summary.readme_block(cells)
    assert "| greedy batch 16 | 2.00x † | 0.50x |" in block


def test_a_listed_file_that_is_missing_is_an_error(tmp_path, monkeypatch):
    summary = _summary()
    monkeypatch.setattr(summary, "RESULTS", tmp_path)
    with pytest.raises(summary.SummaryError, match="missing.json"):
        summary.decode_cells(["missing.json"])
