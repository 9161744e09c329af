"""Smoke test of benchmarks/decode/bench_pretrained.py: it runs at tiny size with the engines of this
environment, compares their tokens, skips the engines of environments it was not given (saying
why) and writes JSON + PNG. Speed is never asserted (benchmarks/ measures it)."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("matplotlib")
pytest.importorskip("transformers")

HERE = os.path.dirname(os.path.abspath(__file__))
from benchmarks.decode import bench_pretrained

MAIN_ENGINES = ["transformers", "eager", "onnxrt", "onnxrt_int8"]


def test_bench_pretrained_tiny_with_this_environments_engines(tmp_path):
    """Every engine of this environment in its own process, greedy and beam 4 at batch 2: float32
    tokens equal to transformers' generate (token for token), int8 agreement recorded, Optimum and
    CTranslate2 skipped with the reason, the machine recorded, JSON + PNG written."""
    out = str(tmp_path / "pretrained.json")
    missing = str(tmp_path / "no-such-venv" / "python")
    results = bench_pretrained.run(
        "tiny",
        out,
        batch_sizes=(2,),
        threads_list=(1,),
        rounds=1,
        optimum_python=missing,
        ct2_python=None,
        scratch=str(tmp_path),
    )
    assert os.path.getsize(os.path.splitext(out)[0] + ".png") > 0
    with open(out) as f:
        saved = json.load(f)
    assert [e["name"] for e in saved["engines"]] == MAIN_ENGINES
    skipped = saved["skipped_engines"]
    assert set(skipped) == {"optimum", "ctranslate2", "ctranslate2_int8"}
    assert "no such executable" in skipped["optimum"] and "--ct2-python" in skipped["ctranslate2"]
    assert saved["machine"]["read_bandwidth_bytes_per_s"]["1"] > 0 and "load_average_end" in saved
    cases = saved["models"]["tiny"]["cases"]
    assert {(c["mode"], c["batch"], c["threads"]) for c in cases} == {(m, 2, 1) for m in ("greedy", "beam4")}
    for case in cases:
        assert case["reference_engine"] == "transformers" and case["float32_tokens_agree"] is True
        assert case["new_tokens"] == bench_pretrained.SIZES["tiny"]["new_tokens"]
        for name, entry in case["engines"].items():
            if entry["dtype"] == "float32":
                assert entry["tokens_match"] is True, (name, case["mode"], case["batch"])
            else:
                assert 0.0 <= entry["rows_equal_to_float32"] <= 1.0
            assert len(entry["samples"]) == 1 and entry["tokens_per_second"] > 0
    workers = saved["models"]["tiny"]["workers"]
    assert workers["onnxrt/1"]["torch_imported"] is False and workers["transformers/1"]["torch_imported"]
    pairs = {(r["ours"], r["peer"]) for r in saved["ratios"]}
    assert pairs == {("onnxrt", "transformers"), ("eager", "transformers")}
    assert [p for p in os.listdir(tmp_path) if p.startswith("bench_pretrained_")] == []  # scratch removed
    assert results["float32_tokens_agree"] is True


def test_split_setting_runs_the_splittable_engines_with_the_same_tokens(tmp_path):
    """``2x1``: only ours (OrtRunners split over workers) runs, batch 1 included (a setting a user
    may pick even where there is nothing to split); the split decode gives transformers' tokens of the one-worker cell, and the best-vs-best ratio
    may pick the split setting."""
    out = str(tmp_path / "split.json")
    results = bench_pretrained.run(
        "tiny",
        out,
        engine_names=["transformers", "onnxrt", "onnxrt_int8"],
        modes=("greedy",),
        batch_sizes=(1, 3),
        threads_list=(1, "2x1"),
        rounds=1,
        scratch=str(tmp_path),
    )
    cases = {(c["batch"], c["threads"]): c for c in results["models"]["tiny"]["cases"]}
    assert set(cases) == {(1, 1), (3, 1), (1, "2x1"), (3, "2x1")}
    assert cases[(1, "2x1")]["reference_tokens_sha1"] == cases[(1, 1)]["reference_tokens_sha1"]
    split = cases[(3, "2x1")]
    assert set(split["engines"]) == {"onnxrt", "onnxrt_int8"} and split["reference_engine"] == "onnxrt"
    assert results["models"]["tiny"]["workers"]["onnxrt/2x1"]["workers"] == 2
    assert results["float32_tokens_agree"] is True
    # the split decode gave transformers' tokens of the same sources (the one-worker cell)
    assert cases[(3, 1)]["reference_engine"] == "transformers"
    assert split["reference_tokens_sha1"] == cases[(3, 1)]["reference_tokens_sha1"]
    assert cases[(1, 1)]["reference_tokens_sha1"] != split["reference_tokens_sha1"]
    with open(out) as f:
        saved = json.load(f)
    assert saved["threads"] == [1, "2x1"] and saved["machine"]["read_bandwidth_bytes_per_s"].keys() == {
        "1",
        "2",
    }
    best = [r for r in saved["ratios"] if r["threads"] == "best" and r["batch"] == 3]
    assert best and all(r["ours_threads"] in (1, "2x1") for r in best)


def test_keep_artifacts_prepare_only_builds_the_models_and_times_nothing(tmp_path, monkeypatch):
    """--keep-artifacts DIR --prepare-only: the engines' models in a new folder, left there; an
    existing folder, or --prepare-only alone, is refused before anything is built; a failed
    build leaves nothing."""
    out = tmp_path / "x.json"
    arts = tmp_path / "arts"
    result = bench_pretrained.run(
        "tiny", str(out), engine_names=["onnxrt_int8"], keep_artifacts=str(arts), prepare_only=True
    )
    assert set(result["artifacts"]) == {"hf", "model", "onnx", "onnx_int8"}
    q = json.loads((arts / "onnx_int8" / "manifest.json").read_text())["quantization"]
    assert q["scheme"] == "int8" and not out.exists()
    with pytest.raises(ValueError, match="it exists"):
        bench_pretrained.run("tiny", str(out), keep_artifacts=str(arts), prepare_only=True)
    with pytest.raises(ValueError, match="--prepare-only needs --keep-artifacts"):
        bench_pretrained.run("tiny", str(out), prepare_only=True)

    def broken(*args, **kwargs):
        raise RuntimeError("conversion failed")

    monkeypatch.setattr(bench_pretrained, "prepare", broken)
    with pytest.raises(RuntimeError, match="conversion failed"):
        bench_pretrained.run("tiny", str(out), keep_artifacts=str(tmp_path / "a" / "new"), prepare_only=True)
    assert not (tmp_path / "a").exists()


def test_cli_names_a_bad_thread_setting(capsys):
    with pytest.raises(SystemExit) as exc:
        bench_pretrained.main(["--size", "tiny", "--threads", "1,2x0"])
    assert exc.value.code == 2 and "--threads" in capsys.readouterr().err


def test_ratios_at_equal_and_at_best_threads():
    """The ratio rows against a plain computation: equal threads per cell, and each engine at its own
    best thread count per (mode, batch); a disagreeing engine's rows say so."""

    def case(threads, ours, peer, match=True):
        return {
            "mode": "greedy",
            "batch": 1,
            "threads": threads,
            "engines": {
                "onnxrt": {"tokens_per_second": ours, "tokens_match": match},
                "optimum": {"tokens_per_second": peer},
            },
        }

    rows = bench_pretrained.ratios([case(1, 30.0, 10.0), case(2, 50.0, 40.0, match=False)])
    by = {r["threads"]: r for r in rows}
    assert by[1]["ratio"] == pytest.approx(3.0) and by[1]["tokens_agree"] is True
    assert by[2]["ratio"] == pytest.approx(50.0 / 40.0) and by[2]["tokens_agree"] is False
    best = by["best"]
    assert (best["ours_threads"], best["peer_threads"]) == (2, 2) and best["ratio"] == pytest.approx(1.25)


def test_unknown_engine_is_named(tmp_path):
    with pytest.raises(ValueError, match="unknown engines \\['nope'\\]"):
        bench_pretrained.run("tiny", str(tmp_path / "x.json"), engine_names=["nope"])
    assert not os.path.exists(tmp_path / "x.json")


@pytest.mark.skipif(
    not os.environ.get("BENCH_OPTIMUM_PYTHON"),
    reason="BENCH_OPTIMUM_PYTHON (a python with requirements/optimum.txt and ctranslate2) not set",
)
def test_bench_pretrained_tiny_with_optimum_and_ctranslate2(tmp_path):
    """With the peers' environment: Optimum and CTranslate2 float32 give transformers' tokens."""
    python = os.environ["BENCH_OPTIMUM_PYTHON"]
    out = str(tmp_path / "peers.json")
    results = bench_pretrained.run(
        "tiny",
        out,
        engine_names=["transformers", "optimum", "ctranslate2", "ctranslate2_int8", "onnxrt"],
        batch_sizes=(2,),
        threads_list=(1,),
        rounds=1,
        optimum_python=python,
        ct2_python=python,
    )
    assert results["skipped_engines"] == {}
    for c in results["models"]["tiny"]["cases"]:
        for name in ("optimum", "ctranslate2", "onnxrt"):
            assert c["engines"][name]["tokens_match"] is True, (name, c["mode"])
        assert 0.0 <= c["engines"]["ctranslate2_int8"]["rows_equal_to_float32"] <= 1.0
