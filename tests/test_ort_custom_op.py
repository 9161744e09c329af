"""The custom ONNX Runtime operator ``transformer_ext.DecodeAttention`` (csrc/ort/) against a
float64 numpy reference written here, on ragged shapes: head sizes and cache lengths off the
kernel's 8-lane blocks, per-row and per-source lengths (0 included), beams sharing a source's
K/V, an additive bias with ``-inf`` entries, NaN rows, and bad inputs.

The library is found at build/ort/libtransformer_ext_ort.so, or built there with
csrc/ort/build.sh when its sources are newer; the headers come from scripts/fetch_ort_headers.sh
(Debian's libonnxruntime-dev), and where they cannot be fetched (no network to the mirror) the
tests that need the library skip, saying so."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SOURCES = [
    REPO / "csrc" / "ort" / n
    for n in ("custom_op.cc", "decode_attention_kernel.cc", "decode_attention_kernel.h", "build.sh")
]
LIBRARY = REPO / "build" / "ort" / "libtransformer_ext_ort.so"
HEADERS = REPO / "build" / "ort-headers" / "include"


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


@pytest.fixture(scope="module")
def library() -> str:
    newest = max(p.stat().st_mtime for p in SOURCES)
    if LIBRARY.is_file() and LIBRARY.stat().st_mtime >= newest:
        return str(LIBRARY)
    if not (HEADERS / "onnxruntime_cxx_api.h").is_file():
        res = subprocess.run(
            ["bash", str(REPO / "scripts" / "fetch_ort_headers.sh")],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if res.returncode != 0:
            pytest.skip(f"ONNX Runtime's C/C++ headers could not be fetched: {_last_line(res.stderr)}")
    res = subprocess.run(
        ["bash", str(REPO / "csrc" / "ort" / "build.sh")], capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0, f"csrc/ort/build.sh failed with the headers present:\n{res.stderr[-3000:]}"
    return str(LIBRARY)


def _model(with_new: bool, with_bias: bool, scale: float | None, present: bool = False) -> bytes:
    f = TensorProto.FLOAT
    names = ["q", "k_cache", "v_cache", "lengths"]
    inputs = [helper.make_tensor_value_info(n, f, None) for n in names[:3]]
    inputs.append(helper.make_tensor_value_info("lengths", TensorProto.INT64, None))
    node_inputs = list(names)
    if with_new:
        inputs += [helper.make_tensor_value_info(n, f, None) for n in ("k_new", "v_new")]
        node_inputs += ["k_new", "v_new"]
    if with_bias:
        inputs.append(helper.make_tensor_value_info("bias", f, None))
        node_inputs += ([] if with_new else ["", ""]) + ["bias"]
    attrs = {} if scale is None else {"scale": scale}
    outs = ["out", "present_k", "present_v"] if present else ["out"]
    node = helper.make_node("DecodeAttention", node_inputs, outs, domain="transformer_ext", **attrs)
    graph = helper.make_graph(
        [node], "decode_attention", inputs, [helper.make_tensor_value_info(n, f, None) for n in outs]
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("transformer_ext", 1)]
    )
    model.ir_version = 9
    return model.SerializeToString()


def _session(library: str, feeds: dict, scale: float | None = None, present: bool = False, threads: int = 1):
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.register_custom_ops_library(library)
    model = _model("k_new" in feeds, "bias" in feeds, scale, present)
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def _run(library: str, feeds: dict, scale: float | None = None) -> np.ndarray:
    return _session(library, feeds, scale).run(["out"], feeds)[0]


def reference(q, k_cache, v_cache, lengths, k_new=None, v_new=None, bias=None, scale=1.0) -> np.ndarray:
    """float64 ``[R, H*D]``: row ``r`` attends to cache row ``r // (R // B)``'s first ``lengths``
    positions and, given ``k_new``, its own new key last (bias index ``L``)."""
    q = q.reshape(q.shape[0], q.shape[1], -1).astype(np.float64)
    R, H, D = q.shape
    B, _, L, _ = k_cache.shape
    per = R // B
    out = np.zeros((R, H, D))
    for r in range(R):
        b = r // per
        n = int(lengths[b])
        for h in range(H):
            keys = k_cache[b, h, :n].astype(np.float64)
            values = v_cache[b, h, :n].astype(np.float64)
            index = list(range(n))
            if k_new is not None:
                keys = np.vstack([keys, k_new.reshape(R, H, D)[r, h]])
                values = np.vstack([values, v_new.reshape(R, H, D)[r, h]])
                index.append(L)
            if not index:
                continue  # nothing to attend: zeros
            s = scale * (keys @ q[r, h])
            if bias is not None:
                rows = bias.reshape(bias.shape[0], H, -1)
                s = s + rows[r if rows.shape[0] > 1 else 0, h, index]
            w = np.exp(s - s.max())
            out[r, h] = (w / w.sum()) @ values
    return out.reshape(R, H * D)


def _feeds(rng, R, B, H, L, D, lengths, new=False, q_rank4=False):
    q = (rng.standard_normal((R, H, 1, D) if q_rank4 else (R, H, D)) * 0.4).astype(np.float32)
    feeds = {
        "q": q,
        "k_cache": rng.standard_normal((B, H, L, D)).astype(np.float32),
        "v_cache": rng.standard_normal((B, H, L, D)).astype(np.float32),
        "lengths": np.asarray(lengths, np.int64),
    }
    if new:
        feeds["k_new"] = rng.standard_normal((R, H, 1, D)).astype(np.float32)
        feeds["v_new"] = rng.standard_normal((R, H, D)).astype(np.float32)
    return feeds


@pytest.mark.parametrize(
    "R,H,L,D,lengths,scale",
    [
        (
            5,
            3,
            13,
            20,
            [0, 1, 7, 12, 13],
            0.37,
        ),  # D and L off the 8-lane blocks, a row with only the new token
        (9, 2, 40, 64, [39, 17, 0, 8, 16, 33, 40, 1, 24], None),  # the base head size, default scale
        (3, 1, 9, 72, [9, 3, 8], 0.125),  # a 64-column block plus an 8-column one
    ],
)
def test_self_attention_matches_float64(library, R, H, L, D, lengths, scale):
    rng = np.random.default_rng(R * 100 + D)
    feeds = _feeds(rng, R, R, H, L, D, lengths, new=True)
    got = _run(library, feeds, scale)
    want = reference(**feeds, scale=1.0 if scale is None else scale)
    assert got.shape == (R, H * D) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)


@pytest.mark.parametrize(
    "B,K,H,S,D,lengths",
    [
        (3, 4, 3, 11, 24, [11, 0, 5]),  # beams share their source's K/V; a source with no position: zeros
        (2, 1, 8, 17, 64, [17, 9]),  # greedy
        (4, 2, 2, 24, 13, [24, 23, 16, 1]),
    ],
)
def test_cross_attention_per_source_matches_float64(library, B, K, H, S, D, lengths):
    rng = np.random.default_rng(B * 10 + K)
    feeds = _feeds(rng, B * K, B, H, S, D, lengths, q_rank4=K == 2)
    got = _run(library, feeds, 0.5)
    np.testing.assert_allclose(got, reference(**feeds, scale=0.5), rtol=0, atol=2e-5)
    empty = [b for b, n in enumerate(lengths) if n == 0]
    for b in empty:
        assert np.all(got[b * K : (b + 1) * K] == 0.0)


def test_bias_per_row_and_broadcast(library):
    rng = np.random.default_rng(7)
    R, H, L, D = 6, 2, 19, 16
    feeds = _feeds(rng, R, R, H, L, D, [19, 4, 0, 11, 18, 7], new=True)
    bias = rng.standard_normal((R, H, L + 1)).astype(np.float32)
    bias[1, 0, 2] = -np.inf  # a masked key
    bias[3, 1, L] = -np.inf  # the new token masked
    feeds["bias"] = bias
    np.testing.assert_allclose(_run(library, feeds, 0.3), reference(**feeds, scale=0.3), rtol=0, atol=2e-5)

    B, K = 3, 2  # cross-attention, one bias [1, H, 1, S] for every row
    feeds = _feeds(rng, B * K, B, H, L, D, [19, 10, 3])
    feeds["bias"] = rng.standard_normal((1, H, 1, L)).astype(np.float32)
    np.testing.assert_allclose(_run(library, feeds), reference(**feeds), rtol=0, atol=2e-5)


def test_two_threads_split_the_cache_rows(library):
    """With two intra-op threads the cache rows run in parallel: the same result."""
    rng = np.random.default_rng(9)
    feeds = _feeds(rng, 7, 7, 3, 15, 24, [15, 0, 3, 9, 14, 1, 7], new=True)
    got = _session(library, feeds, 0.7, threads=2).run(["out"], feeds)[0]
    np.testing.assert_allclose(got, reference(**feeds, scale=0.7), rtol=0, atol=2e-5)
    feeds = _feeds(rng, 10, 5, 2, 12, 16, [12, 5, 0, 8, 11])
    got = _session(library, feeds, threads=2).run(["out"], feeds)[0]
    np.testing.assert_allclose(got, reference(**feeds), rtol=0, atol=2e-5)


def test_nan_stays_in_its_row(library):
    rng = np.random.default_rng(3)
    R, H, L, D = 4, 3, 10, 16
    feeds = _feeds(rng, R, R, H, L, D, [10, 5, 9, 2], new=True)
    feeds["q"][1, 2, 5] = np.nan
    got = _run(library, feeds).reshape(R, H, D)
    assert np.isnan(got[1, 2]).all()
    finite = np.ones((R, H), bool)
    finite[1, 2] = False
    assert np.isfinite(got[finite]).all()
    want = reference(**{**feeds, "q": np.nan_to_num(feeds["q"])}).reshape(R, H, D)
    np.testing.assert_allclose(got[finite], want[finite], rtol=0, atol=2e-5)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"lengths": np.array([4, 14, 0], np.int64)}, "lengths[1] = 14 is outside [0, 13]"),
        ({"lengths": np.array([4, 1], np.int64)}, "lengths: expected int64 [3]"),
        ({"v_cache": np.zeros((3, 2, 12, 8), np.float32)}, "v_cache: expected the shape of k_cache"),
        ({"q": np.zeros((4, 2, 8), np.float32)}, "must be a multiple of the cache rows"),
        (
            {"k_cache": np.zeros((3, 2, 13, 4), np.float32), "v_cache": np.zeros((3, 2, 13, 4), np.float32)},
            "heads and head_size",
        ),
        ({"q": np.zeros((3, 2, 2, 8), np.float32)}, "q: expected [rows, heads, head_size]"),
    ],
)
def test_bad_inputs_name_the_input(library, change, message):
    rng = np.random.default_rng(0)
    feeds = {**_feeds(rng, 3, 3, 2, 13, 8, [4, 5, 6]), **change}
    with pytest.raises(Exception) as info:
        _run(library, feeds)
    assert message in str(info.value) and "transformer_ext.DecodeAttention" in str(info.value)


def test_new_key_without_new_value_is_refused(library):
    rng = np.random.default_rng(1)
    feeds = _feeds(rng, 2, 2, 1, 5, 8, [3, 5], new=True)
    feeds["v_new"] = feeds["v_new"][:, :, :4]
    with pytest.raises(Exception, match=r"v_new: expected q's \[2, 1, 8\]"):
        _run(library, feeds)


def _written(cache, new, lengths):
    """``cache`` with row ``r``'s new K/V at position ``lengths[r]`` (numpy)."""
    want = cache.copy()
    R, H = new.shape[:2]
    for r in range(R):
        want[r, :, lengths[r]] = new.reshape(R, H, -1)[r]
    return want


def test_present_outputs_write_the_new_token(library):
    """Unbound, present_k / present_v are fresh copies of the caches with the new rows written."""
    rng = np.random.default_rng(5)
    R, H, L, D = 4, 3, 11, 20
    feeds = _feeds(rng, R, R, H, L, D, [0, 10, 4, 7], new=True)
    before = {n: feeds[n].copy() for n in ("k_cache", "v_cache")}
    out, pk, pv = _session(library, feeds, 0.5, present=True).run(None, feeds)
    np.testing.assert_allclose(out, reference(**feeds, scale=0.5), rtol=0, atol=2e-5)
    np.testing.assert_array_equal(pk, _written(before["k_cache"], feeds["k_new"], feeds["lengths"]))
    np.testing.assert_array_equal(pv, _written(before["v_cache"], feeds["v_new"], feeds["lengths"]))
    for n in before:  # the inputs untouched
        np.testing.assert_array_equal(feeds[n], before[n])


def test_present_outputs_bound_to_the_caches_update_in_place(library):
    """IO binding of present_k / present_v to the cache buffers: two steps, the second attending
    to the token the first wrote."""
    rng = np.random.default_rng(6)
    R, H, L, D = 3, 2, 9, 16
    feeds = _feeds(rng, R, R, H, L, D, [2, 0, 5], new=True)
    session = _session(library, feeds, present=True)
    kc, vc = feeds["k_cache"], feeds["v_cache"]
    for step in range(2):
        lengths = feeds["lengths"] + step
        k_new = rng.standard_normal((R, H, 1, D)).astype(np.float32)
        v_new = rng.standard_normal((R, H, D)).astype(np.float32)
        q = rng.standard_normal((R, H, D)).astype(np.float32)
        want_out = reference(q, kc, vc, lengths, k_new, v_new)
        want_k, want_v = _written(kc, k_new, lengths), _written(vc, v_new, lengths)
        out = np.empty((R, H * D), np.float32)
        binding = session.io_binding()
        bound_in = (
            ("q", q),
            ("k_cache", kc),
            ("v_cache", vc),
            ("lengths", lengths),
            ("k_new", k_new),
            ("v_new", v_new),
        )
        for name, a in bound_in:
            binding.bind_input(name, "cpu", 0, a.dtype, list(a.shape), a.ctypes.data)
        for name, a in (("out", out), ("present_k", kc), ("present_v", vc)):
            binding.bind_output(name, "cpu", 0, a.dtype, list(a.shape), a.ctypes.data)
        session.run_with_iobinding(binding)
        np.testing.assert_allclose(out, want_out, rtol=0, atol=2e-5)
        np.testing.assert_array_equal(kc, want_k)
        np.testing.assert_array_equal(vc, want_v)


def test_present_outputs_refuse_a_full_cache(library):
    rng = np.random.default_rng(8)
    feeds = _feeds(rng, 2, 2, 1, 6, 8, [3, 6], new=True)
    with pytest.raises(Exception, match=r"lengths\[1\] = 6 leaves no position for the new token"):
        _session(library, feeds, present=True).run(None, feeds)
    del feeds["k_new"], feeds["v_new"]
    with pytest.raises(Exception, match="present_k / present_v need k_new and v_new"):
        _session(library, feeds, present=True).run(None, feeds)


def test_probe_names_a_missing_library_in_one_line(tmp_path):
    missing = tmp_path / "libtransformer_ext_ort.so"
    res = subprocess.run(
        [sys.executable, "-m", "benchmarks", "probe_custom_attention", "--library", str(missing), "--quick",
         "--out", str(tmp_path / "p.json")],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert res.returncode == 1, res.stderr
    assert res.stderr.count("\n") == 1 and str(missing) in res.stderr and "csrc/ort/build.sh" in res.stderr
    assert not (tmp_path / "p.json").exists()


def test_portable_build_matches_float64(library, tmp_path):
    """``build.sh --portable`` (the kernel as plain C++, for CPUs without AVX2) computes the same."""
    res = subprocess.run(
        ["bash", str(REPO / "csrc" / "ort" / "build.sh"), "--portable", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert "kernel ISA: baseline" in res.stdout
    portable = str(tmp_path / "libtransformer_ext_ort.so")
    rng = np.random.default_rng(11)
    feeds = _feeds(rng, 5, 5, 2, 13, 20, [13, 0, 6, 12, 1], new=True)
    feeds["bias"] = rng.standard_normal((5, 2, 14)).astype(np.float32)
    np.testing.assert_allclose(_run(portable, feeds, 0.3), reference(**feeds, scale=0.3), rtol=0, atol=2e-5)
    feeds = _feeds(rng, 6, 2, 3, 11, 24, [11, 4])
    np.testing.assert_allclose(_run(portable, feeds), reference(**feeds), rtol=0, atol=2e-5)
