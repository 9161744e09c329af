"""Smoke tests of the benchmark scripts: they run, compare tokens, and write JSON + PNG.

Speed is never asserted here (benchmarks/ measures it); these only keep the scripts working.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

pytest.importorskip("matplotlib")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks"))

import bench_decode  # noqa: E402


@pytest.mark.parametrize("isolate", [True, False], ids=["process_per_engine", "same_process"])
def test_bench_decode_tiny(tmp_path, isolate):
    out = str(tmp_path / "decode.json")
    results = bench_decode.run(["tiny"], ["eager_ops", "torch_cat"], [1], repeats=2, out=out, isolate=isolate)
    assert os.path.getsize(tmp_path / "decode.png") > 0
    with open(out) as f:
        saved = json.load(f)
    assert saved["engine_processes"] == ("one per engine" if isolate else "shared")
    (case,) = saved["models"]["tiny"]["cases"]
    assert set(case["engines"]) == {"eager_ops", "torch_cat"}
    for entry in case["engines"].values():
        assert entry["tokens_match"] is True
        assert len(entry["samples"]) == 2 and entry["tokens_per_second"] > 0
    assert results["models"]["tiny"]["bandwidth_floor"]["weight_bytes_per_token"] > 0


def test_bench_decode_unknown_engine_is_named(tmp_path):
    with pytest.raises(ValueError, match="no_such_engine"):
        bench_decode.run(["tiny"], ["no_such_engine"], [1], repeats=1, out=str(tmp_path / "x.json"))


def test_bench_decode_worker_failure_is_reported(tmp_path, monkeypatch):
    """An engine that fails in its worker process surfaces as an error naming the engine."""
    with pytest.raises(RuntimeError, match="engine eager_ops"):
        bench_decode._EngineProcess("eager_ops", str(tmp_path / "missing_model"), "cpu", 1)


def test_bench_linear_quick(tmp_path):
    import bench_linear

    out = str(tmp_path / "linear.json")
    results = bench_linear.run([1], repeats=1, threads=1, quick=True, out=out)
    assert os.path.getsize(tmp_path / "linear.png") > 0
    (step,) = results["step"]
    assert step["rows"] == 1 and set(step["seconds"]) == {"ops.linear", "F.linear"}
    assert len(results["shape"]) == len(set(bench_linear.decoder_step_shapes(128, 512, 2, 1000)))
