"""benchmarks/profiles/profile_ctranslate2.py's log reading: oneMKL's ``MKL_VERBOSE`` lines in, calls and
per-category sums out. The lines are written here by hand in oneMKL's format (routine, the
arguments in the order of its C interface, the duration); the expected shapes and sums are
worked out by hand from them. The CTranslate2 run itself is a measurement (not run in CI)."""

from __future__ import annotations

import pytest

from benchmarks.profiles import profile_ctranslate2 as prof

INT8 = (
    "MKL_VERBOSE GEMM_S8U8S32_COMPUTE(P,N,C,2048,64,512,0x7f0,0x7f1,512,0x7f2,0x7f3,512,0x7f4,0x7f5,"
    "0x7f6,2048,0x55e) 500.0us CNR:OFF Dyn:1 FastMM:1 TID:0  NThr:2"
)
OUT_PROJ = (
    "MKL_VERBOSE GEMM_S8U8S32(T,N,C,8000,64,512,0x1,0x2,512,0x3,0x4,512,0x5,0x6,0x7,8000,0x8) 2.5ms CNR:OFF"
)
ATTN = (
    "MKL_VERBOSE SGEMM_BATCH_STRIDED(T,N,24,4,64,0x1,0x2,64,1536,0x3,64,256,0x4,0x5,24,96,128) "
    "40.0us CNR:OFF Dyn:1"
)
ENCODER = "MKL_VERBOSE SGEMM_COMPUTE(P,N,1536,384,512,0x1,512,0x2,512,0x3,0x4,1536) 1.5ms CNR:OFF"
PACK = "MKL_VERBOSE GEMM_S8U8S32_PACK(A,T,1536,1,512,0x1,512,0x2) 619.75us CNR:OFF Dyn:1"


def test_each_routine_is_read_with_its_shape_and_duration():
    c = prof.parse_line(INT8)
    assert (c.name, c.m, c.n, c.k, c.batch) == ("GEMM_S8U8S32_COMPUTE", 2048, 64, 512, 1)
    assert c.ms == pytest.approx(0.5)
    assert c.ops == 2 * 2048 * 64 * 512
    a = prof.parse_line(ATTN)
    assert (a.name, a.m, a.n, a.k, a.batch) == ("SGEMM_BATCH_STRIDED", 24, 4, 64, 128)
    assert a.ms == pytest.approx(0.04)
    e = prof.parse_line(ENCODER)
    assert (e.m, e.n, e.k, e.ms) == (1536, 384, 512, pytest.approx(1.5))
    assert prof.parse_line(OUT_PROJ).ms == pytest.approx(2.5)
    assert prof.parse_line(PACK).m == 0


@pytest.mark.parametrize(
    "line",
    [
        "MKL_VERBOSE oneMKL 2025 Update 3 Product build 20251007 for Intel(R) 64 architecture",
        "MKL_VERBOSE SAXPBY(196608,0x7f,0x7f,1,0x7f,0x7f,1) 56.74us CNR:OFF",
        "a line of the engine's own output",
        "MKL_VERBOSE SGEMM(T,N,x,16,512) 1.0ms",  # a field that is not a number
        "",
    ],
)
def test_lines_that_are_not_matrix_products_are_skipped(line):
    assert prof.parse_line(line) is None


def test_categories_and_per_step_sums():
    calls = [prof.parse_line(x) for x in (INT8, INT8, OUT_PROJ, ATTN, ENCODER, PACK)]
    s = prof.summarise(calls, rows=64, vocab=8000, steps=2)
    by = s["by_category_ms"]
    assert by["weights"] == pytest.approx(1.0)
    assert by["output projection"] == pytest.approx(2.5)
    assert by["attention"] == pytest.approx(0.04)
    assert by["once per source"] == pytest.approx(1.5)
    assert by["packing"] == pytest.approx(0.61975)
    assert s["by_category_ms_per_step"]["weights"] == pytest.approx(0.5)
    (weights,) = [g for g in s["groups"] if g["category"] == "weights"]
    assert weights["calls"] == 2
    # 2 * 2048 * 64 * 512 operations in 0.5 ms
    assert weights["median_gops"] == pytest.approx(2 * 2048 * 64 * 512 / 0.5e6)
    assert s["groups"][0]["category"] == "output projection"  # sorted by total time


def test_bad_arguments_are_one_line_errors(tmp_path):
    with pytest.raises(SystemExit, match="--batch must be at least 1"):
        prof.main(["--model", str(tmp_path), "--batch", "0"])
    with pytest.raises(SystemExit, match="not a folder"):
        prof.main(["--model", str(tmp_path / "missing")])
