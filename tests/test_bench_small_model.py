"""benchmarks/decode/bench_small_model.py at tiny size: it runs, writes JSON + PNG, says when CTranslate2
is missing, and (where CTranslate2 is installed) its tokens equal ours on the demo model."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")
from test_deploy import demo_export_dir  # noqa: E402

from benchmarks.decode import bench_small_model
from transformer_ext.translator import Translator  # noqa: E402

HAS_CT2 = importlib.util.find_spec("ctranslate2") is not None


@pytest.fixture(scope="module")
def demo_export(tmp_path_factory) -> Path:
    return demo_export_dir(tmp_path_factory)


def test_bench_small_model_ours_only(tmp_path, demo_export):
    """Ours alone: one timed round in a worker that imports no torch, JSON + PNG written."""
    out = tmp_path / "small.json"
    payload = bench_small_model.run(
        lines_n=6, repeats=1, engines=["onnxrt"], export=str(demo_export), out=str(out)
    )
    saved = json.loads(out.read_text())
    assert (tmp_path / "small.png").stat().st_size > 0
    assert set(saved["results"]) == {"onnxrt"} and saved["agreement"] is None
    r = saved["results"]["onnxrt"]
    assert len(r["samples"]) == 1 and r["cpu_seconds"] > 0 and r["wall_seconds"] > 0
    assert r["worker"]["modules"] == ["onnxruntime"]
    assert len(saved["load_average"]["before"]) == 3 and saved["lines"] == 6
    assert payload["ctranslate2_missing"] is None
    # the worker's streaming translation equals an in-process one in sentence batches
    want = Translator.from_export_dir(demo_export, threads=1).translate(bench_small_model.demo_lines(6, 0))
    assert [(list(t), s) for t, s in payload["outputs"]["onnxrt"]] == [(w.tokens, str(w)) for w in want]


def test_bench_small_model_says_ctranslate2_is_missing(tmp_path, demo_export, monkeypatch):
    monkeypatch.setattr(bench_small_model, "has_ctranslate2", lambda: False)
    out = tmp_path / "small.json"
    payload = bench_small_model.run(
        lines_n=3, repeats=1, export=str(demo_export), out=str(out), plot_png=False
    )
    assert payload["ctranslate2_missing"] == bench_small_model.CT2_MISSING
    assert "ctranslate2 is not installed" in payload["ctranslate2_missing"]
    assert set(payload["results"]) == {"onnxrt"} and payload["onnxrt_over_ctranslate2_cpu"] is None


@pytest.mark.skipif(
    not HAS_CT2, reason="ctranslate2 is not installed (pip install -r requirements/bench.txt)"
)
def test_bench_small_model_ctranslate2_agrees(tmp_path, demo_export):
    """CTranslate2 on the converted weights is the oracle: its greedy tokens equal ours, and
    ours (the worker's translate_iterable) equal an in-process Translator.translate."""
    out = tmp_path / "small.json"
    payload = bench_small_model.run(
        lines_n=12, repeats=1, export=str(demo_export), out=str(out), plot_png=False
    )
    a = payload["agreement"]
    assert a == {"lines_equal": 12, "lines": 12, "mismatches": []}
    assert payload["results"]["ctranslate2"]["worker"]["modules"] == ["ctranslate2"]
    assert payload["onnxrt_over_ctranslate2_cpu"] > 0


def test_bench_small_model_max_new_tokens_caps_both_engines(tmp_path, demo_export):
    """--max-new-tokens 1: the encoder and one step per line; ours stops where an in-process
    Translator with max_length=1 stops, and CTranslate2 (where installed) agrees."""
    engines = ["onnxrt", "ctranslate2"] if HAS_CT2 else ["onnxrt"]
    payload = bench_small_model.run(
        lines_n=6,
        repeats=1,
        engines=engines,
        export=str(demo_export),
        out=str(tmp_path / "small.json"),
        plot_png=False,
        max_new_tokens=1,
    )
    assert payload["settings"]["max_new_tokens"] == 1
    ours = payload["outputs"]["onnxrt"]
    assert all(len(t) <= 1 for t, _ in ours) and any(len(t) == 1 for t, _ in ours)
    want = Translator.from_export_dir(demo_export, threads=1).translate(
        bench_small_model.demo_lines(6, 0), max_length=1
    )
    assert [list(t) for t, _ in ours] == [w.tokens for w in want]
    if HAS_CT2:
        assert payload["results"]["ctranslate2"]["options"]["max_decoding_length"] == 1
        assert payload["agreement"]["lines_equal"] == 6
    with pytest.raises(SystemExit):
        bench_small_model.main(["--max-new-tokens", "0", "--out", str(tmp_path / "x.json")])


def test_bench_small_model_rejects_bad_arguments(tmp_path):
    with pytest.raises(SystemExit):
        bench_small_model.main(["--export", str(tmp_path), "--out", str(tmp_path / "x.json")])
    with pytest.raises(SystemExit):
        bench_small_model.main(["--lines", "0", "--out", str(tmp_path / "x.json")])
    with pytest.raises(ValueError, match="no_such"):
        bench_small_model.run(lines_n=1, engines=["no_such"], out=str(tmp_path / "x.json"))
    assert not (tmp_path / "x.json").exists()


def test_bench_small_model_ort_flavour_engine(tmp_path, demo_export):
    """``onnxrt_gqa``: the demo model exported in the ort flavour by the benchmark itself; its
    translations equal the portable export's, translated in this process (an independent path)."""
    payload = bench_small_model.run(
        lines_n=6, repeats=1, engines=["onnxrt_gqa"], out=str(tmp_path / "small.json"), plot_png=False
    )
    assert set(payload["results"]) == {"onnxrt_gqa"}
    assert payload["results"]["onnxrt_gqa"]["worker"]["modules"] == ["onnxruntime"]
    assert payload["over_ctranslate2_cpu"] == {} and payload["onnxrt_over_ctranslate2_cpu"] is None
    want = Translator.from_export_dir(demo_export, threads=1).translate(bench_small_model.demo_lines(6, 0))
    assert [(list(t), s) for t, s in payload["outputs"]["onnxrt_gqa"]] == [(w.tokens, str(w)) for w in want]
    with pytest.raises(SystemExit):
        bench_small_model.main(["--export-gqa", str(tmp_path), "--out", str(tmp_path / "x.json")])


def test_bench_small_model_split_counts_the_graph_calls(tmp_path, demo_export):
    """``split``: each of our samples splits into encoder graph, step graph and host CPU time; the
    calls it counts are the decode's own: 6 short lines are one token batch (one encoder call),
    and greedy search steps until its longest output's EOS (or its budget)."""
    payload = bench_small_model.run(
        lines_n=6,
        repeats=2,
        engines=["onnxrt"],
        export=str(demo_export),
        out=str(tmp_path / "s.json"),
        split=True,
    )
    saved = json.loads((tmp_path / "s.json").read_text())
    assert saved["settings"]["split"] is True
    r = saved["results"]["onnxrt"]
    assert len(r["samples"]) == 2 and all("split" in s for s in r["samples"])
    sp = r["split"]
    assert sp["encoder_calls"] == 1
    longest = max(len(t) for t, _ in payload["outputs"]["onnxrt"])
    assert sp["step_calls"] in (longest, longest + 1)
    assert sp["encoder_graph_cpu_seconds"] > 0 and sp["step_graph_cpu_seconds"] > 0
    assert sp["host_cpu_seconds"] > 0
