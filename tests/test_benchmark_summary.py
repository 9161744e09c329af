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
    # README leaves out a machine where CTranslate2 missed its split in any cell; the page marks it
    assert "CPU X" not in summary.readme_block(cells)
    assert "| float32 | greedy batch 16 | 300 (2) | 150 (1) | 2.00x † |" in summary.page(cells, {})
    for r in payload["best_threads"]:
        r["tokens_per_second_by_threads"].setdefault("2x1", 1.0)
    (tmp_path / "run.json").write_text(json.dumps(payload))
    block = summary.readme_block(summary.decode_cells(["run.json"]))
    assert "| greedy batch 16 | 2.00x | 0.50x |" in block


def test_batch_1_without_the_peers_split_is_marked(tmp_path, monkeypatch):
    summary = _summary()
    machine = {"model_name": "CPU Y", "cpus": "2", "l3": "32 MiB (1 instance)", "simd": ["avx2"]}
    payload = {
        "machine": machine,
        "best_threads": [
            {"model": "base", "engine": e, "mode": "greedy", "batch": 1, "tokens_per_second_by_threads": by}
            for e, by in (("onnxrt", {"1": 10.0, "2x1": 9.0}), ("ctranslate2", {"1": 5.0, "2": 4.0}))
        ],
    }
    (tmp_path / "run.json").write_text(json.dumps(payload))
    monkeypatch.setattr(summary, "RESULTS", tmp_path)
    cells = summary.decode_cells(["run.json"])
    assert next(iter(cells.values()))[("float32", "greedy", 1)]["unsplit"]


def test_a_listed_file_that_is_missing_is_an_error(tmp_path, monkeypatch):
    summary = _summary()
    monkeypatch.setattr(summary, "RESULTS", tmp_path)
    with pytest.raises(summary.SummaryError, match="missing.json"):
        summary.decode_cells(["missing.json"])
