"""Smoke tests of the benchmark scripts: they run, compare tokens, and write JSON + PNG.

Speed is never asserted here (benchmarks/ measures it); these only keep the scripts working.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

pytest.importorskip("matplotlib")

HERE = os.path.dirname(os.path.abspath(__file__))
from benchmarks.decode import bench_decode
from transformer_ext.cpu_features import bf16_support  # noqa: E402

HAS_CT2 = importlib.util.find_spec("ctranslate2") is not None


TINY_ENGINES = (
    ["onnxrt", "eager", "onnxrt_int8"]
    + (["ctranslate2", "ctranslate2_int8"] if HAS_CT2 else [])
    + (["eager_bf16"] if bf16_support().native else [])  # run() leaves it out elsewhere
)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """The benchmark once on the tiny model: every engine, both modes, batch 1 and 2, 1 and 2 threads."""
    out = str(tmp_path_factory.mktemp("bench") / "decode.json")
    results = bench_decode.run(["tiny"], TINY_ENGINES, [1, 2], threads_list=(1, 2), repeats=1, out=out)
    return out, results


def test_bench_decode_tiny(tiny_run):
    """Every engine in its own process, both modes, 1 and 2 threads: tokens compared, JSON + PNG."""
    out, results = tiny_run
    assert os.path.getsize(os.path.splitext(out)[0] + ".png") > 0
    with open(out) as f:
        saved = json.load(f)
    assert saved["machine"]["read_bandwidth_bytes_per_s"]["1"] > 0 and saved["machine"]["os_cpu_count"] >= 1
    model = saved["models"]["tiny"]
    assert {(c["mode"], c["batch"], c["threads"]) for c in model["cases"]} == {
        (m, b, t) for m in ("greedy", "beam4") for b in (1, 2) for t in (1, 2)
    }
    for case in model["cases"]:
        assert set(case["engines"]) == set(TINY_ENGINES)
        for name, entry in case["engines"].items():
            if entry["dtype"] == "float32":
                assert entry["tokens_match"] is True, (name, case["mode"])
            else:
                assert 0.0 <= entry["rows_equal_to_float32"] <= 1.0
            assert len(entry["samples"]) == 1 and entry["tokens_per_second"] > 0
    # each engine's quantization, as its export's manifest says
    assert model["quantization"]["onnxrt"] is None and model["quantization"]["eager"] is None
    assert model["quantization"]["onnxrt_int8"]["scheme"] == "int8"
    floors = model["bandwidth_floor_batch1"]
    # int8 weights occupy fewer bytes than float32 ones (the output projection included)
    assert floors["onnxrt_int8"]["weight_bytes_per_token"] < floors["onnxrt"]["weight_bytes_per_token"]
    if HAS_CT2:
        assert (
            floors["ctranslate2_int8"]["weight_bytes_per_token"]
            < floors["ctranslate2"]["weight_bytes_per_token"]
        )
        assert {r["engine"] for r in results["ratios"]} >= {"onnxrt", "onnxrt_int8"}
    if "eager_bf16" in TINY_ENGINES:  # compared with our float32 eager decode, never with CTranslate2
        assert {r["peer"] for r in results["ratios"] if r["engine"] == "eager_bf16"} == {"eager"}


def test_bench_decode_reports_best_threads_and_int8_speedups(tiny_run):
    """Each engine's faster thread count and the quantized-over-float32 speed-ups of both
    runtimes, recomputed here from the saved per-case tokens/s."""
    out, _ = tiny_run
    with open(out) as f:
        saved = json.load(f)
    tps = {
        (c["mode"], c["batch"], c["threads"], name): e["tokens_per_second"]
        for c in saved["models"]["tiny"]["cases"]
        for name, e in c["engines"].items()
    }
    best = {(r["engine"], r["mode"], r["batch"]): r for r in saved["best_threads"]}
    assert len(best) == len(saved["best_threads"]) == len(TINY_ENGINES) * 2 * 2
    for (name, mode, batch), r in best.items():
        by_threads = {t: tps[(mode, batch, t, name)] for t in (1, 2)}
        assert r["tokens_per_second"] == max(by_threads.values())
        assert by_threads[r["best_threads"]] == r["tokens_per_second"]
    pairs = {("onnxrt_int8", "onnxrt")} | ({("ctranslate2_int8", "ctranslate2")} if HAS_CT2 else set())
    rows = saved["quantized_speedups"]
    assert {(r["engine"], r["float32_engine"]) for r in rows} == pairs
    for r in rows:
        key = (r["engine"], r["mode"], r["batch"])
        if r["threads"] == "best":
            want = (
                best[key]["tokens_per_second"]
                / best[(r["float32_engine"], r["mode"], r["batch"])]["tokens_per_second"]
            )
        else:
            want = (
                tps[(r["mode"], r["batch"], r["threads"], r["engine"])]
                / tps[(r["mode"], r["batch"], r["threads"], r["float32_engine"])]
            )
        assert r["speedup"] == pytest.approx(want, rel=1e-12)
    assert len(rows) == len(pairs) * 2 * 2 * 3  # 2 modes x 2 batches x (1, 2 threads and best)
    table = bench_decode.summary_table(saved)
    assert "faster thread count" in table and "quantized over float32" in table


def test_workers_of_ctranslate2_and_onnxruntime_import_no_torch(tiny_run):
    """The fairness rule: only the eager worker loads torch (checked in the worker and recorded)."""
    workers = tiny_run[1]["models"]["tiny"]["workers"]
    for threads in (1, 2):
        assert workers[f"onnxrt/{threads}"]["torch_imported"] is False
        assert workers[f"onnxrt_int8/{threads}"]["modules"] == ["onnxruntime"]
        assert workers[f"eager/{threads}"]["torch_imported"] is True
    if not HAS_CT2:
        pytest.skip("ctranslate2 is not installed (pip install -r requirements/bench.txt)")
    for threads in (1, 2):
        assert workers[f"ctranslate2/{threads}"]["modules"] == ["ctranslate2"]
        assert workers[f"ctranslate2_int8/{threads}"]["torch_imported"] is False


def test_worker_that_must_not_import_torch_refuses_it(tmp_path):
    """A worker that must not import torch fails, naming the engine, when it does."""
    import dataclasses

    engine = dataclasses.replace(next(e for e in bench_decode.ENGINES if e.name == "onnxrt"), worker="eager")
    model_dir = tmp_path / "m"
    from helpers import make_model_dir

    make_model_dir(model_dir)
    cfg = {"bos_id": 1, "eos_id": 2}
    with pytest.raises(RuntimeError, match="(?s)engine onnxrt.*imported torch"):
        bench_decode.EngineProcess(engine, str(model_dir), 1, cfg)


def test_bench_decode_runs_the_matmulnbits_engines_at_tiny_size(tmp_path):
    """The int4 and int8-nbits engines (export.quantize, MatMulNBits) decode in their own
    ONNX Runtime workers: no torch, exactly 48 tokens, their agreement with float32 recorded,
    and their decoder steps read fewer weight bytes than float32's (int4 fewest)."""
    engines = ["onnxrt", "onnxrt_int4", "onnxrt_int8_nbits"]
    out = str(tmp_path / "decode.json")
    results = bench_decode.run(["tiny"], engines, [1], modes=["greedy"], threads_list=[1], repeats=1, out=out)
    model = results["models"]["tiny"]
    (case,) = model["cases"]
    assert set(case["engines"]) == set(engines)
    for name in ("onnxrt_int4", "onnxrt_int8_nbits"):
        assert 0.0 <= case["engines"][name]["rows_equal_to_float32"] <= 1.0
        assert model["workers"][f"{name}/1"]["modules"] == ["onnxruntime"]
    dtypes = {e["name"]: e["dtype"] for e in results["engines"]}
    assert dtypes == {"onnxrt": "float32", "onnxrt_int4": "int4", "onnxrt_int8_nbits": "int8"}
    floors = model["bandwidth_floor_batch1"]
    nbytes = {name: floors[name]["weight_bytes_per_token"] for name in engines}
    assert nbytes["onnxrt_int4"] < nbytes["onnxrt_int8_nbits"] < nbytes["onnxrt"]


def test_bench_decode_unknown_engine_is_named(tmp_path):
    with pytest.raises(ValueError, match="no_such_engine"):
        bench_decode.run(["tiny"], ["no_such_engine"], [1], repeats=1, out=str(tmp_path / "x.json"))


def test_bench_decode_worker_failure_is_reported(tmp_path):
    """An engine that fails in its worker process surfaces as an error naming the engine."""
    engine = next(e for e in bench_decode.ENGINES if e.name == "onnxrt")
    with pytest.raises(RuntimeError, match="engine onnxrt"):
        bench_decode.EngineProcess(engine, str(tmp_path / "missing_export"), 1, {"bos_id": 1, "eos_id": 2})


def test_bench_linear_quick(tmp_path):
    from benchmarks.ops import bench_linear

    out = str(tmp_path / "linear.json")
    results = bench_linear.run([1], repeats=1, threads=1, quick=True, out=out)
    assert os.path.getsize(tmp_path / "linear.png") > 0
    (step,) = results["step"]
    assert step["rows"] == 1 and set(step["seconds"]) == {"ops.linear", "F.linear"}
    assert len(results["shape"]) == len(set(bench_linear.decoder_step_shapes(128, 512, 2, 1000)))


def test_profile_decode_splits_the_time_and_counts_operators(tmp_path, tmp_path_factory, monkeypatch):
    """profile_decode on the tiny export: the split adds up to the total (beam search through
    the search head, whose time is a part of its own), the profiler saw MatMuls."""
    from helpers import exported_dir

    from benchmarks.profiles import profile_decode
    from transformer_ext import decoding

    monkeypatch.setitem(decoding.HEAD_MIN_ENTRIES, "beam", 0)
    export = exported_dir(tmp_path_factory, "portable")
    out = tmp_path / "profile.json"
    assert (
        profile_decode.main(
            [
                "--export",
                str(export),
                "--batch-sizes",
                "2",
                "--new-tokens",
                "4",
                "--repeats",
                "1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    results = json.loads(out.read_text())
    assert [(c["mode"], c["batch"]) for c in results["cases"]] == [("greedy", 2), ("beam4", 2)]
    for case in results["cases"]:
        s = case["split_ms"]
        parts = s["encode"] + s["step"] + s["head"] + s["reorder"] + s["search"]
        assert s["total"] == pytest.approx(parts, abs=0.01)
        assert (s["head"] > 0) == (case["mode"] == "beam4") and s["step"] > 0
        assert "MatMul" in case["operators"]["ops"] and case["operators"]["nodes_per_step"] > 0
    with pytest.raises(SystemExit):
        profile_decode.main(["--export", str(tmp_path), "--out", str(out)])  # not an export folder


def test_count_step_calls_counts_per_step_and_per_function(tmp_path, tmp_path_factory):
    """count_step_calls on the tiny export: every case counted, the runner's step among the
    functions called once per step."""
    from helpers import exported_dir

    from benchmarks.probes import count_step_calls

    export = exported_dir(tmp_path_factory, "portable")
    out = tmp_path / "count.json"
    argv = [
        "--export",
        str(export),
        "--batch-sizes",
        "1,3",
        "--new-tokens",
        "4",
        "--top",
        "200",
        "--out",
        str(out),
    ]
    assert count_step_calls.main(argv) == 0
    saved = json.loads(out.read_text())
    assert [(c["mode"], c["batch"]) for c in saved["cases"]] == [
        (m, b) for m in ("greedy", "beam4") for b in (1, 3)
    ]
    for case in saved["cases"]:
        assert case["steps"] == 4 and case["calls_per_step"] > case["python_calls_per_step"] > 0
        assert case["top"]["ort.py:_run_step"] == 1.0  # one decoder run per decoding step


def test_bench_search_head_times_both_searches(tmp_path):
    """bench_search_head on two small cells: both searches timed per cell, the JSON and plot
    written, the thresholds put back."""
    from benchmarks.decode import bench_search_head
    from transformer_ext import decoding

    before = dict(decoding.HEAD_MIN_ENTRIES)
    out = tmp_path / "head.json"
    argv = ["--vocab", "30,900", "--batch-sizes", "2", "--steps", "3", "--repeats", "1", "--out", str(out)]
    assert bench_search_head.main(argv) == 0
    assert decoding.HEAD_MIN_ENTRIES == before
    saved = json.loads(out.read_text())
    assert [(c["mode"], c["vocab"], c["rows"]) for c in saved["cells"]] == [
        ("beam4", 30, 8),
        ("beam4", 900, 8),
        ("greedy", 30, 2),
        ("greedy", 900, 2),
    ]
    for cell in saved["cells"]:
        assert cell["host_us_per_step"] > 0 and cell["head_us_per_step"] > 0
    assert (tmp_path / "head.png").is_file()
    assert bench_search_head.main(["--modes", "sampling", "--out", str(out)]) == 2


def test_ab_exports_times_folders_and_runner_options(tmp_path, tmp_path_factory):
    """ab_exports on the tiny export: a runner option as one variant, every case timed for each,
    the baseline at 1.0x, the tokens of equal graphs equal; bad variants are refused."""
    from helpers import exported_dir

    from benchmarks.probes import ab_exports

    export = str(exported_dir(tmp_path_factory, "portable"))
    out = tmp_path / "ab.json"
    argv = ["--variant", f"fresh={export}:reuse_buffers=0", "--variant", f"pooled={export}"]
    argv += ["--rounds", "1", "--new-tokens", "3", "--cases", "greedy:1,beam4:2", "--out", str(out)]
    assert ab_exports.main(argv) == 0
    saved = json.loads(out.read_text())
    assert saved["variants"]["fresh"]["options"] == {"reuse_buffers": False}
    assert [(r["mode"], r["batch"]) for r in saved["results"]] == [("greedy", 1), ("beam4", 2)]
    for r in saved["results"]:
        assert r["speedup_vs_baseline"]["fresh"] == 1.0 and r["seconds"]["pooled"] > 0
        assert r["same_tokens_as_baseline"]["pooled"] == f"{r['batch']}/{r['batch']}"
    for bad in (
        [f"only={export}"],
        [f"a={export}:no_such=1", f"b={export}"],
        [f"a={tmp_path}", f"b={export}"],
        [f"a={export}", f"a={export}"],
    ):
        with pytest.raises(SystemExit):
            ab_exports.main([x for v in bad for x in ("--variant", v)] + ["--out", str(out)])


def test_probe_score_products_agree_and_are_timed(tmp_path):
    from benchmarks.probes import probe_score_products

    out = tmp_path / "scores.json"
    assert probe_score_products.main(["--threads", "1", "--runs", "2", "--out", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert len(saved["results"]) == len(probe_score_products.SHAPES)
    assert all(
        r["microseconds"]["matmul"] > 0 and r["mul_reducesum_over_matmul"] > 0 for r in saved["results"]
    )


def test_probe_cross_sharing_layouts_agree_and_are_timed(tmp_path):
    """The per-source graph gives the per-beam graph's outputs (checked inside), both are timed."""
    from benchmarks.probes import probe_cross_sharing

    out = tmp_path / "cross.json"
    argv = ["--batch-sizes", "1,3", "--layers", "2", "--heads", "2", "--src-len", "5", "--head-size", "8"]
    argv += ["--threads", "1", "--runs", "2", "--out", str(out)]
    assert probe_cross_sharing.main(argv) == 0
    saved = json.loads(out.read_text())
    assert [r["rows"] for r in saved["results"]] == [4, 12]
    assert all(set(r["milliseconds"]) == {"per_beam", "per_source"} for r in saved["results"])
    with pytest.raises(SystemExit):
        probe_cross_sharing.main(["--beams", "0", "--out", str(out)])


def test_probe_contrib_attention_forms_agree_and_are_timed(tmp_path):
    """The contrib operators give the portable ops' outputs (checked inside: GroupQueryAttention
    with its cache bound in place, MultiHeadAttention with the beams as the query sequence)."""
    from benchmarks.probes import probe_contrib_attention

    out = tmp_path / "contrib.json"
    argv = ["--rows", "1,4", "--layers", "2", "--heads", "2", "--head-size", "8", "--cache-len", "6"]
    argv += ["--position", "3", "--src-len", "5", "--beams", "2", "--threads", "1", "--runs", "2"]
    assert probe_contrib_attention.main([*argv, "--out", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert [(r["block"], r["rows"]) for r in saved["results"]] == [
        ("self", 1),
        ("cross", 2),
        ("self", 4),
        ("cross", 4),
    ]
    assert all(r["ops_over_contrib"] > 0 for r in saved["results"])
    with pytest.raises(SystemExit):
        probe_contrib_attention.main(["--position", "6", "--cache-len", "6", "--out", str(out)])


def test_bench_decode_split_settings(tmp_path):
    """``WxT``: the engines that can split a batch run it over W workers (ours under
    worker processes, CTranslate2 with inter_threads), with tokens still equal to the float32
    reference, batch 1 included (a setting a user may pick); the others are skipped; best
    settings may be split."""
    assert bench_decode.parse_setting("2") == 2 and bench_decode.parse_setting(" 2x1") == "2x1"
    for bad in ("0", "1x2", "2x0", "x", "two"):
        with pytest.raises(ValueError):
            bench_decode.parse_setting(bad)
    assert bench_decode.setting_threads("2x2") == 4 and bench_decode.setting_workers("2x2") == 2
    engines = ["onnxrt", "eager"] + (["ctranslate2"] if HAS_CT2 else [])
    out = str(tmp_path / "split.json")
    results = bench_decode.run(
        ["tiny"], engines, [1, 2], modes=["greedy"], threads_list=[1, "2x1"], repeats=1, out=out
    )
    cases = {(c["batch"], c["threads"]): c for c in results["models"]["tiny"]["cases"]}
    assert set(cases) == {(1, 1), (2, 1), (1, "2x1"), (2, "2x1")}
    assert all(e["tokens_match"] for e in cases[(1, "2x1")]["engines"].values())
    assert set(cases[(2, "2x1")]["engines"]) == set(engines) - {"eager"}
    assert all(e["tokens_match"] for e in cases[(2, "2x1")]["engines"].values())
    best = {(r["engine"], r["batch"]): r for r in results["best_threads"]}
    assert best[("onnxrt", 2)]["best_threads"] in (1, "2x1")
    assert set(best[("onnxrt", 2)]["tokens_per_second_by_threads"]) == {"1", "2x1"}
    assert set(best[("eager", 2)]["tokens_per_second_by_threads"]) == {"1"}
    with open(out) as f:
        assert json.load(f)["complete"] is True


def test_ab_drop_finished_times_each_divisor_and_restores_the_default(tmp_path):
    """ab_drop_finished on 40 demo lines, one round: every divisor timed, the first at 1.0x, the
    module's divisor restored; bad arguments are refused before any work."""
    from benchmarks.probes import ab_drop_finished
    from transformer_ext import decoding

    out = tmp_path / "drop.json"
    default = decoding.GREEDY_DROP_DIVISOR
    argv = ["--lines", "40", "--divisors", "1000,4", "--rounds", "1", "--out", str(out)]
    assert ab_drop_finished.main(argv) == 0
    saved = json.loads(out.read_text())
    assert saved["speedup_over_first"]["1000"] == 1.0
    assert len(saved["cpu_seconds"]["4"]["samples"]) == 1 and saved["cpu_seconds"]["4"]["median"] > 0
    assert decoding.GREEDY_DROP_DIVISOR == default
    for bad in (["--divisors", "0,4"], ["--divisors", "a"], ["--rounds", "0"], ["--export", str(tmp_path)]):
        with pytest.raises(SystemExit):
            ab_drop_finished.main(bad + ["--out", str(tmp_path / "bad.json")])
    assert not (tmp_path / "bad.json").exists()


def test_ab_file_translation_times_each_variant_and_refuses_bad_ones(tmp_path):
    """ab_file_translation on 20 demo lines, one round: the demo export with a runner option off
    and on, both timed, the first at 1.0x, the translations equal (checked inside)."""
    from benchmarks.probes import ab_file_translation

    out = tmp_path / "ft.json"
    argv = ["--variant", "plain=demo:flush_denormals=0", "--variant", "flushed=demo"]
    argv += ["--lines", "20", "--rounds", "1", "--out", str(out)]
    assert ab_file_translation.main(argv) == 0
    saved = json.loads(out.read_text())
    assert saved["settings"]["variants"]["plain"]["options"] == {"flush_denormals": False}
    assert saved["speedup_over_first"]["plain"] == 1.0
    assert len(saved["cpu_seconds"]["flushed"]["samples"]) == 1
    for bad in (
        ["only=demo"],
        ["a=demo:nope=1", "b=demo"],
        [f"a={tmp_path}", "b=demo"],
        ["a=demo", "a=demo"],
    ):
        with pytest.raises(SystemExit):
            ab_file_translation.main(
                [x for v in bad for x in ("--variant", v)] + ["--out", str(tmp_path / "b.json")]
            )
    assert not (tmp_path / "b.json").exists()


def test_ab_encoder_times_each_variant_on_a_padded_batch(tmp_path, tmp_path_factory):
    from helpers import exported_dir

    from benchmarks.probes import ab_encoder

    export = str(exported_dir(tmp_path_factory, "portable"))
    out = tmp_path / "enc.json"
    argv = ["--variant", f"plain={export}:flush_denormals=0", "--variant", f"flushed={export}"]
    argv += ["--batch", "5", "--src-len", "7", "--repeats", "2", "--out", str(out)]
    assert ab_encoder.main(argv) == 0
    saved = json.loads(out.read_text())
    assert saved["speedup_over_first"]["plain"] == 1.0 and saved["milliseconds"]["flushed"] > 0
    assert saved["settings"]["lengths"]["min"] < saved["settings"]["lengths"]["max"] == 7  # padded rows
    assert saved["max_abs_difference_from_first"]["flushed"] < 1e-6


def test_probe_denormals_times_the_softmax_variants(tmp_path):
    from benchmarks.probes import probe_denormals
    from transformer_ext.runtimes import denormals

    out = tmp_path / "den.json"
    argv = ["--batch", "2", "--heads", "2", "--src-len", "8", "--repeats", "2", "--out", str(out)]
    if not denormals.AVAILABLE:
        assert probe_denormals.main(argv) == 1
        return
    assert probe_denormals.main(argv) == 0
    saved = json.loads(out.read_text())["softmax"]
    assert set(saved["milliseconds"]) == {"random", "random_flushed", "padded", "padded_flushed"}
    assert saved["max_abs_difference_flushed"]["random"] == 0.0
    assert saved["max_abs_difference_flushed"]["padded"] < 1e-30  # only denormal values can differ
    with pytest.raises(SystemExit):
        probe_denormals.main(["--padded", "1.5", "--out", str(tmp_path / "bad.json")])


def test_probe_int8_products_checks_every_kernel_and_times_it(tmp_path, monkeypatch):
    """Every int8 variant runs the kernel it is meant to, agrees with float64 within its bound, and
    is timed; a variant past its bound fails the probe."""
    from benchmarks.probes import probe_int8_products

    monkeypatch.setattr(probe_int8_products, "machine_info", lambda threads: {})
    out = tmp_path / "int8.json"
    argv = ["--d-model", "128", "--d-ff", "256", "--vocab", "96", "--layers", "1", "--rows", "1,5"]
    argv += ["--threads", "1", "--rounds", "1", "--calibration", "16", "--nbits-block", "64"]
    argv += ["--heads", "2", "--head-size", "8", "--cache-len", "6"]
    assert probe_int8_products.main([*argv, "--out", str(out)]) == 0
    saved = json.loads(out.read_text())
    kernels = saved["weight_products"]["kernels"]
    assert "MatMulIntegerToFloat" in kernels["dynamic"] or "DynamicQuantizeMatMul" in kernels["dynamic"]
    assert "QLinearMatMul" in kernels["static_qdq"] and "QLinearMatMul" in kernels["static_qoperator"]
    assert kernels["nbits8"] == {"MatMulNBits": 7} and kernels["int4"] == {"MatMulNBits": 7}
    assert "DynamicQuantizeLinear" in saved["attention_products"]["kernels"]["dynamic_both"]
    cases = saved["weight_products"]["cases"]
    assert [c["rows"] for c in cases] == [1, 5]
    for c in cases:
        assert set(c["ms"]) == set(probe_int8_products.WEIGHT_VARIANTS)
        assert c["error"]["float32"]["max"] < 1e-5 < c["error"]["dynamic"]["max"] < 0.1
    assert saved["wrong"] == []
    monkeypatch.setattr(probe_int8_products, "ERROR_BOUNDS", {"float32": 1e-4, "int4": 1e-6})
    assert probe_int8_products.main([*argv, "--no-attention", "--out", str(out)]) == 1
    assert json.loads(out.read_text())["wrong"] == [
        "weights int4, 1 rows, 1 thread(s)",
        "weights int4, 5 rows, 1 thread(s)",
    ]
    with pytest.raises(SystemExit):
        probe_int8_products.main(["--rows", "0", "--out", str(out)])


def _decode_json(path, machine, tokens, floors=None):
    """A bench_decode-shaped JSON: ``tokens`` maps (engine, mode, batch) to {threads: tokens/s}."""
    best = []
    for (engine, mode, batch), by_threads in tokens.items():
        top = max(by_threads, key=by_threads.get)
        best.append(
            {
                "model": "base",
                "engine": engine,
                "mode": mode,
                "batch": batch,
                "best_threads": top,
                "tokens_per_second": by_threads[top],
                "tokens_per_second_by_threads": by_threads,
            }
        )
    payload = {
        "machine": machine,
        "best_threads": best,
        "models": {"base": {"bandwidth_floor_batch1": floors or {}}},
    }
    path.write_text(json.dumps(payload))
    return str(path)


def test_targets_scores_each_cell_per_machine(tmp_path, capsys):
    """Ratios, bounds (inclusive), equal-thread cells, the L3 rule of the floor and the CPU-time
    target, on hand-made JSONs whose expected scores are worked out here."""
    from benchmarks.decode import targets

    small_l3 = {"model_name": "CPU A", "l3": "32 MiB (1 instance)", "simd": ["avx2"]}
    big_l3 = {"model_name": "CPU B", "l3": "105 MiB (1 instance)", "simd": ["avx2"]}
    floor = {
        "onnxrt": {"weight_bytes_per_token": 105_000_000, "by_threads": {"2": {"fraction_of_floor": 0.95}}}
    }
    tokens = {
        ("onnxrt_int8", "greedy", 1): {"1": 90.0, "2": 130.0},
        ("ctranslate2_int8", "greedy", 1): {"1": 100.0, "2": 100.0},
        ("onnxrt_int8", "beam4", 1): {"1": 129.0},
        ("ctranslate2_int8", "beam4", 1): {"1": 100.0, "2x1": 80.0},
    }
    run_a = _decode_json(tmp_path / "a.json", small_l3, tokens, floor)
    run_b = _decode_json(tmp_path / "b.json", big_l3, tokens, floor)
    small = tmp_path / "small.json"
    small.write_text(
        json.dumps(
            {
                "benchmark": "bench_small_model",
                "machine": {"lscpu": small_l3},
                "results": {"onnxrt": {"cpu_seconds": 10.0}, "ctranslate2": {"cpu_seconds": 8.0}},
            }
        )
    )
    out = tmp_path / "scores.json"
    assert targets.main([run_a, run_b, str(small), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [m["runs"] for m in result["machines"]] == [["a.json", "small.json"], ["b.json"]]
    by_name = {t["target"]: t for t in result["machines"][0]["targets"]}
    int8 = {c["cell"]: c for c in by_name[targets.TARGETS[0].name]["cells"]}
    assert int8["greedy b1"]["low"] == pytest.approx(1.3) and int8["greedy b1"]["met_runs"] == 1
    assert int8["beam4 b1"]["low"] == pytest.approx(1.29) and int8["beam4 b1"]["met_runs"] == 0
    assert set(int8) == {"greedy b1", "beam4 b1"}  # cells the run did not measure are left out
    same = {c["cell"]: c for c in by_name[targets.TARGETS[5].name]["cells"]}
    assert same["greedy b1 1t"]["low"] == pytest.approx(0.9) and same["greedy b1 1t"]["met_runs"] == 0
    assert same["greedy b1 2t"]["low"] == pytest.approx(1.3) and same["greedy b1 2t"]["met_runs"] == 1
    assert "beam4 b1 2t" not in same  # ours has no 2-thread figure there
    assert by_name[targets.TARGETS[2].name]["met_everywhere"] is True  # 105 MB > 32 MiB: a real floor
    cpu = by_name[targets.TARGETS[6].name]["cells"][0]
    assert cpu["low"] == pytest.approx(1.25) and cpu["met_runs"] == 0
    on_b = {t["target"]: t for t in result["machines"][1]["targets"]}
    floor_b = on_b[targets.TARGETS[2].name]["cells"][0]
    assert floor_b["met_runs"] == 0 and "fit the 105 MiB L3" in floor_b["runs"][0]["not_a_floor"]
    assert on_b[targets.TARGETS[6].name]["measured"] is False
    assert targets.main([run_a, "--markdown"]) == 0
    assert "| int8 at least 1.3x" in capsys.readouterr().out


def test_targets_scores_the_pretrained_benchmark(tmp_path):
    """The pretrained-model targets read bench_pretrained's ratios at 2 threads or at the best settings."""
    from benchmarks.decode import targets

    def ratio(ours, peer, mode, threads, value):
        return {"ours": ours, "peer": peer, "mode": mode, "batch": 1, "threads": threads, "ratio": value}

    payload = {
        "size": "opus-mt-en-de",
        "machine": {"model_name": "CPU A", "l3": "32 MiB", "simd": []},
        "ratios": [
            ratio("onnxrt", "optimum", "greedy", 2, 3.0),
            ratio("onnxrt", "optimum", "beam4", 2, 2.99),
            ratio("onnxrt", "optimum", "greedy", 1, 9.0),  # 1 thread: not the target's cell
            ratio("onnxrt_int8", "ctranslate2_int8", "greedy", "best", 1.31),
        ],
    }
    path = tmp_path / "pretrained.json"
    path.write_text(json.dumps(payload))
    result = targets.score([str(path)])
    by_name = {t["target"]: t for t in result["machines"][0]["targets"]}
    optimum = {c["cell"]: c for c in by_name[targets.PRETRAINED_TARGETS[0].name]["cells"]}
    assert set(optimum) == {"greedy b1 2t", "beam4 b1 2t"}
    assert optimum["greedy b1 2t"]["met_runs"] == 1 and optimum["beam4 b1 2t"]["met_runs"] == 0
    int8 = by_name[targets.PRETRAINED_TARGETS[3].name]
    assert [(c["cell"], c["met_runs"]) for c in int8["cells"]] == [("greedy b1", 1)]
    assert not by_name[targets.TARGETS[0].name]["measured"]  # a decode target: not from this file


def test_targets_names_a_file_it_cannot_score(tmp_path, capsys):
    from benchmarks.decode import targets

    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert targets.main([str(bad)]) == 1
    assert "bad.json: cannot read a JSON file" in capsys.readouterr().err
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"machine": {}, "results": []}))
    assert targets.main([str(other)]) == 1
    assert (
        "not a bench_decode.py, bench_pretrained.py or bench_small_model.py JSON" in capsys.readouterr().err
    )
    run = _decode_json(tmp_path / "run.json", {"model_name": "CPU A"}, {})  # a valid input
    before = (tmp_path / "run.json").read_text()
    assert targets.main([run, "--out", run]) == 1  # the output would replace an input
    assert "--out" in capsys.readouterr().err and (tmp_path / "run.json").read_text() == before


def test_probe_split_workers_times_one_worker_against_the_split(tmp_path, tmp_path_factory):
    """Our 2x1 split and one 1-thread worker on half the batch, timed in a process of their own;
    the split's first half decodes to the single worker's tokens."""
    sys.path.insert(0, HERE)
    from helpers import quantized_dir

    from benchmarks.probes import probe_split_workers

    artifacts = tmp_path / "A"
    (artifacts / "base").mkdir(parents=True)
    (artifacts / "base" / "onnx_int8").symlink_to(quantized_dir(tmp_path_factory, "int8"))
    out = tmp_path / "split.json"
    argv = ["--artifacts", str(artifacts), "--engines", "onnxrt", "--batch", "4", "--new-tokens", "3"]
    argv += ["--rounds", "1", "--src-vocab", "20", "--memory", "--out", str(out)]
    assert probe_split_workers.main(argv) == 0
    whole = json.loads(out.read_text())
    saved = whole["engines"]["onnxrt"]
    assert set(saved) == {"greedy", "beam4"}
    for r in saved.values():
        assert r["half_ms"] > 0 and r["split_ms"] > 0 and r["half_tokens_equal_split"] is True
        # the split in worker processes (split_ms) and in threads, with the same tokens
        pools = r["by_pool"]
        assert set(pools) == {"processes", "threads"} and pools["processes"]["split_ms"] == r["split_ms"]
        assert all(b["half_tokens_equal_split"] for b in pools.values()) and r["processes_over_threads"] > 0
    assert set(whole["round_trip_ms"]) == {"processes", "threads"}
    memory = whole["memory"]
    settings = ("inprocess1", "threads2", "processes1", "processes2")
    assert [len(memory[s]["workers"]) for s in settings] == [0, 0, 1, 2]
    assert all(m["total_pss_kib"] > 0 for m in memory.values())
    with pytest.raises(SystemExit):
        probe_split_workers.main(["--artifacts", str(artifacts), "--batch", "3", "--out", str(out)])
    with pytest.raises(SystemExit):  # no CTranslate2 model in the folder
        probe_split_workers.main(["--artifacts", str(artifacts), "--out", str(out)])
