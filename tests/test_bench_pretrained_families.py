"""bench_pretrained.py at the T5 and mBART-50 sizes, through the same code path at tiny size: the
checkpoint written by transformers, converted and exported by ours (and, with the peers'
environment, by CTranslate2 and Optimum), float32 tokens equal to transformers' generate() before
anything is timed, each int8 engine against its own float32 engine, the quality gate's absence
recorded; the T5 decode targets scored on t5-base JSONs only. Speed is never asserted."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("matplotlib")
pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

from benchmarks.decode import bench_pretrained, pretrained_families, targets

ENGINES = ["transformers", "onnxrt", "onnxrt_int8"]


def _check_cases(saved: dict, size: str, engines: list[str]) -> None:
    cases = saved["models"][size]["cases"]
    assert {(c["mode"], c["batch"], c["threads"]) for c in cases} == {(m, 2, 1) for m in ("greedy", "beam4")}
    for case in cases:
        assert case["reference_engine"] == "transformers" and case["float32_tokens_agree"] is True
        assert set(case["engines"]) == set(engines)
        for name, entry in case["engines"].items():
            if entry["dtype"] == "float32":
                assert entry["tokens_match"] is True, (name, case["mode"])
            assert entry["tokens_per_second"] > 0
        own = case["engines"]["onnxrt_int8"]["agreement_with_own_float32"]
        assert own["engine"] == "onnxrt" and 0.0 <= own["mean_common_prefix"] <= 1.0
        assert own["within_tolerance"] == (own["mean_common_prefix"] >= own["tolerance"])


@pytest.mark.parametrize("size", ["t5-tiny", "mbart-tiny"])
def test_family_tiny_size_gives_transformers_tokens(tmp_path, size):
    """T5 v1.1 and mBART-50 at tiny size: ours float32 gives transformers' generate() tokens,
    greedy and beam 4; the JSON records the family, the int8 gate's absence and the tolerance."""
    out = str(tmp_path / f"{size}.json")
    results = bench_pretrained.run(
        size,
        out,
        engine_names=ENGINES,
        batch_sizes=(2,),
        threads_list=(1,),
        rounds=1,
        scratch=str(tmp_path),
    )
    assert results["float32_tokens_agree"] is True
    with open(out) as f:
        saved = json.load(f)
    assert saved["size"] == size and saved["family"] == size.split("-")[0]
    assert "gate off" in saved["int8_quality_gate"] and "mean common prefix" in saved["int8_tolerance"]
    assert "nothing banned" in saved["decoding"]
    _check_cases(saved, size, ENGINES)
    # the compared tokens vary (a constant output would prove little)
    assert all(c["reference_distinct_tokens"] > 1 for c in saved["models"][size]["cases"])
    assert os.path.getsize(os.path.splitext(out)[0] + ".png") > 0


def test_sources_follow_each_familys_tokenizer():
    """T5: pieces then ``</s>`` (1); mBART-50: ``en_XX`` first, pieces (never a language code or a
    special), ``</s>`` (2) last; the vocabulary sizes of the real models."""
    t5 = bench_pretrained.SIZES["t5-base"]
    src, lengths = bench_pretrained.specials(t5).sources(3, 24)
    assert src.shape == (3, 24) and list(lengths) == [24] * 3
    assert (src[:, -1] == 1).all() and (src[:, :-1] >= 3).all() and (src < 32128).all()
    mbart = bench_pretrained.SIZES["mbart-large-50"]
    sp = bench_pretrained.specials(mbart)
    src, _ = sp.sources(3, 24)
    assert pretrained_families.mbart_pieces(mbart) == 250000  # mBART-50's SentencePiece model
    assert (src[:, 0] == 250000 + 1 + 3).all()  # en_XX, the fourth language code
    assert (src[:, -1] == 2).all() and (src[:, 1:-1] >= 4).all() and (src[:, 1:-1] <= 250000).all()
    assert pretrained_families.mbart_pieces(bench_pretrained.SIZES["mbart-large-50-vocab32k"]) == 32000
    with pytest.raises(ValueError, match="no room"):
        sp.sources(1, 2)


def test_int8_agreement_against_a_plain_count():
    a = [[5, 6, 7, 8], [1, 2, 3, 4]]
    b = [[5, 6, 0, 8], [1, 2, 3, 4]]
    got = bench_pretrained.int8_agreement(a, b, 4)
    assert got["rows_equal"] == pytest.approx(0.5)
    assert got["mean_common_prefix"] == pytest.approx((2 / 4 + 4 / 4) / 2)
    assert got["within_tolerance"] is (got["mean_common_prefix"] >= bench_pretrained.INT8_TOLERANCE)
    assert bench_pretrained.int8_agreement([[9, 9]], [[1, 9]], 2)["within_tolerance"] is False


def test_t5_targets_score_t5_base_runs_only(tmp_path):
    """The t5-base decode targets (1.2x CTranslate2 float32, 1.3x int8, best against best) read a
    t5-base JSON; the opus-mt targets do not, and a t5-base target does not read an opus-mt JSON."""

    def payload(size, value):
        rows = [
            {"ours": o, "peer": p, "mode": m, "batch": b, "threads": "best", "ratio": value}
            for o, p in (("onnxrt", "ctranslate2"), ("onnxrt_int8", "ctranslate2_int8"))
            for m in ("greedy", "beam4")
            for b in (1, 16)
        ]
        return {"size": size, "machine": {"model_name": "CPU A", "l3": "32 MiB", "simd": []}, "ratios": rows}

    t5 = tmp_path / "t5.json"
    t5.write_text(json.dumps(payload("t5-base", 1.25)))
    by = {t["target"]: t for t in targets.score([str(t5)])["machines"][0]["targets"]}
    f32 = by["t5-base float32 at least 1.2x CTranslate2 float32, each at its best setting"]
    i8 = by["t5-base int8 at least 1.3x CTranslate2 int8, each at its best setting"]
    assert len(f32["cells"]) == 4 and f32["met_everywhere"] is True
    assert len(i8["cells"]) == 4 and all(c["met_runs"] == 0 for c in i8["cells"])
    assert not by["opus-mt float32 at least 1.2x CTranslate2 float32, each at its best setting"]["measured"]
    opus = tmp_path / "opus.json"
    opus.write_text(json.dumps(payload("opus-mt-en-de", 1.5)))
    by = {t["target"]: t for t in targets.score([str(opus)])["machines"][0]["targets"]}
    assert not by["t5-base float32 at least 1.2x CTranslate2 float32, each at its best setting"]["measured"]
    assert by["opus-mt int8 at least 1.3x CTranslate2 int8, each at its best setting"]["met_everywhere"]


def test_cli_refuses_an_unknown_size(capsys):
    with pytest.raises(SystemExit) as exc:
        bench_pretrained.main(["--size", "t5-huge"])
    assert exc.value.code == 2 and "--size" in capsys.readouterr().err


def _peers_python():
    python = os.environ.get("BENCH_OPTIMUM_PYTHON")
    if not python or not os.access(python, os.X_OK):
        pytest.skip("BENCH_OPTIMUM_PYTHON (a python with requirements/optimum.txt and ctranslate2) not set")
    return python


@pytest.mark.parametrize("size", ["t5-tiny", "mbart-tiny"])
def test_family_tiny_size_with_optimum_and_ctranslate2(tmp_path, size):
    """With the peers' environment: CTranslate2's converter and Optimum's exporter read the same
    checkpoint, and their float32 decodes give transformers' tokens; CTranslate2 int8 is compared
    against CTranslate2 float32."""
    python = _peers_python()
    engines = ["transformers", "optimum", "ctranslate2", "ctranslate2_int8", "onnxrt", "onnxrt_int8"]
    out = str(tmp_path / "peers.json")
    results = bench_pretrained.run(
        size,
        out,
        engine_names=engines,
        batch_sizes=(2,),
        threads_list=(1,),
        rounds=1,
        optimum_python=python,
        ct2_python=python,
        scratch=str(tmp_path),
    )
    assert results["skipped_engines"] == {}
    with open(out) as f:
        saved = json.load(f)
    _check_cases(saved, size, engines)
    for case in saved["models"][size]["cases"]:
        own = case["engines"]["ctranslate2_int8"]["agreement_with_own_float32"]
        assert own["engine"] == "ctranslate2"
