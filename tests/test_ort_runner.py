"""transformer_ext.runtimes.OrtRunner: the runner protocol on ONNX Runtime, in-place caches, no torch, bad folders."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import FLAVOURS, exported_dir, with_cross_per_row

from export import InvalidGraphError, ManifestError
from transformer_ext import decoding, reference
from transformer_ext.checkpoint import load_model
from transformer_ext.export_format import DECODER_FILE, ENCODER_FILE, MANIFEST_NAME, graph_specs
from transformer_ext.runtimes import EagerRunner, OrtRunner

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session", params=FLAVOURS)
def exported(request, tmp_path_factory) -> Path:
    return exported_dir(tmp_path_factory, request.param)


@pytest.fixture(scope="session")
def exported_portable(tmp_path_factory) -> Path:
    return exported_dir(tmp_path_factory, "portable")


def sources(runner: OrtRunner, batch: int = 3, src_len: int = 7, seed: int = 0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(4, runner.info.src_vocab_size, size=(batch, src_len)).astype(np.int64)
    lengths = np.array(
        [src_len] + [int(x) for x in rng.integers(1, src_len + 1, size=batch - 1)], dtype=np.int64
    )
    for row, n in enumerate(lengths):
        ids[row, n:] = runner.info.pad_id
    return ids, lengths


def copy_folder(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def eager_model(export_dir: Path):
    manifest = json.loads((export_dir / MANIFEST_NAME).read_text())
    return load_model(manifest["export"]["source_model_dir"])


# ------------------------------------------------------------------------------------------
# decoding
# ------------------------------------------------------------------------------------------


def test_greedy_and_beam_match_eager(exported):
    runner = OrtRunner(exported, intra_op_num_threads=1)
    eager = EagerRunner(eager_model(exported), "cpu")
    ids, lengths = sources(runner, batch=5)
    common = dict(bos_id=runner.info.bos_id, eos_id=runner.info.eos_id, max_decoding_length=15)
    assert runner.greedy(ids, lengths, max_decoding_length=15) == decoding.greedy_decode(
        eager, ids, lengths, **common
    )
    ours = runner.beam_search(ids, lengths, beam_size=4, num_hypotheses=2, max_decoding_length=15)
    theirs = decoding.beam_search(eager, ids, lengths, beam_size=4, num_hypotheses=2, **common)
    assert [[h.tokens for h in row] for row in ours] == [[h.tokens for h in row] for row in theirs]
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose([h.score for h in a], [h.score for h in b], rtol=0, atol=1e-4)


def test_step_logits_match_eager_with_min_new_tokens(exported):
    runner = OrtRunner(exported)
    eager = EagerRunner(eager_model(exported), "cpu")
    ids, lengths = sources(runner, batch=2)
    s1, s2 = runner.encode(ids, lengths, cache_len=6), eager.encode(ids, lengths, 6)
    tokens = np.array([runner.info.bos_id] * 2)
    for _ in range(6):
        a, b = runner.step(s1, tokens), eager.step(s2, tokens)
        assert a.dtype == np.float32 and a.shape == (2, runner.info.tgt_vocab_size)
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)
        tokens = a.argmax(-1)
    with pytest.raises(IndexError, match="position 6"):
        runner.step(s1, tokens)  # the cache is full: refused before the graph could be misled


# ------------------------------------------------------------------------------------------
# the caches: allocated once, zero-filled, written in place, nothing cache-sized per step
# ------------------------------------------------------------------------------------------


def test_caches_are_bound_buffers_written_in_place(exported):
    runner = OrtRunner(exported, grow_cache=False)
    ids, lengths = sources(runner, batch=4)
    state = runner.encode(ids, lengths, cache_len=40, beam_size=2)
    N, L = 8, 40
    assert state.self_keys[0].shape == (N, runner.info.n_heads, L, runner.info.d_k)
    assert all(not c.any() for c in state.self_keys + state.self_values)  # zero-filled once
    buffers = [(id(c), c.ctypes.data) for c in state.self_keys + state.self_values]
    tokens = np.full(N, runner.info.bos_id)
    for _ in range(5):
        runner.step(state, tokens)
        tokens = (tokens + 1) % runner.info.tgt_vocab_size
    assert [(id(c), c.ctypes.data) for c in state.self_keys + state.self_values] == buffers
    for cache in state.self_keys + state.self_values:
        assert not cache[:, :, 5:].any()  # nothing written past the position
        assert (np.abs(cache[:, :, :5]).sum(axis=(0, 1, 3)) > 0).all()


def test_step_allocates_nothing_cache_sized(exported):
    runner = OrtRunner(exported, intra_op_num_threads=1, grow_cache=False)
    ids, lengths = sources(runner, batch=8)
    state = runner.encode(ids, lengths, cache_len=64)
    cache_bytes = state.self_keys[0].nbytes
    tokens = np.full(8, runner.info.bos_id)
    runner.step(state, tokens)  # first run: ORT's own arenas get allocated
    tracemalloc.start()
    try:
        for _ in range(3):
            runner.step(state, tokens)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < cache_bytes / 4, (peak, cache_bytes)  # the logits copy and small arrays only


@pytest.mark.parametrize("cache_len", [37, 32])
def test_growing_caches_give_the_logits_of_a_full_size_cache(exported, cache_len):
    """A growing cache (the default) against one allocated at cache_len (the oracle): the same
    logits up to float rounding at every step, through growths, a beam reorder and a select (ONNX
    Runtime's one-row products round differently at different capacities); its capacity is
    always cache_len - 16k, and it is full at cache_len as the other is."""
    grow, fixed = OrtRunner(exported, intra_op_num_threads=1), OrtRunner(exported, grow_cache=False)
    ids, lengths = sources(grow, batch=4, src_len=9, seed=3)
    states = [r.encode(ids, lengths, cache_len=cache_len, beam_size=2) for r in (grow, fixed)]
    assert states[0].cache.capacity == cache_len - 16 * ((cache_len - 1) // 16)
    assert states[1].cache.capacity == cache_len == states[0].cache_len == states[1].cache_len
    rng = np.random.default_rng(cache_len)
    capacities = set()
    for p in range(cache_len):
        if p == 10:
            index = rng.integers(0, 8, size=8)
            for r, s in zip((grow, fixed), states):
                r.reorder(s, index)
        if p == 20:
            for r, s in zip((grow, fixed), states):
                r.select(s, np.array([0, 3, 6, 7]))
        tokens = rng.integers(3, grow.info.tgt_vocab_size, size=states[0].num_rows)
        got, want = grow.step(states[0], tokens), fixed.step(states[1], tokens)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
        capacities.add(states[0].cache.capacity)
        assert (cache_len - states[0].cache.capacity) % 16 == 0 and states[0].cache.capacity > p
        valid = [c[:, :, : p + 1] for c in states[0].self_keys + states[0].self_values]
        for a, b in zip(valid, [c[:, :, : p + 1] for c in states[1].self_keys + states[1].self_values]):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    assert len(capacities) == len(range(cache_len - 16 * ((cache_len - 1) // 16), cache_len + 1, 16))
    for r, s in zip((grow, fixed), states):
        with pytest.raises(IndexError, match=f"holds {cache_len} positions"):
            r.step(s, np.full(s.num_rows, r.info.bos_id))


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_reused_buffers_give_the_same_logits_and_live_states_never_share_memory(tmp_path_factory, flavour):
    """reuse_buffers (the default) against fresh allocations: bit-identical logits through growths,
    a reorder and a select, for two states of one runner stepped in turn (their buffers must be
    disjoint), and later decodes take the memory the finished ones left instead of new."""
    exported = exported_dir(tmp_path_factory, flavour)
    pooled = OrtRunner(exported, intra_op_num_threads=1)
    fresh = OrtRunner(exported, intra_op_num_threads=1, reuse_buffers=False)
    assert fresh._pool is None
    rng = np.random.default_rng(5)

    def arrays(state):
        return state.self_keys + state.self_values + state.cross_keys + state.cross_values

    def run_pair(steps):
        inputs = [sources(pooled, batch=4, src_len=9, seed=s) for s in (1, 2)]
        ours = [pooled.encode(i, n, cache_len=steps, beam_size=2) for i, n in inputs]
        theirs = [fresh.encode(i, n, cache_len=steps, beam_size=2) for i, n in inputs]
        for p in range(steps):
            for a, b in zip(ours, theirs):
                if p == 5:
                    index = rng.integers(0, a.num_rows, size=a.num_rows)
                    pooled.reorder(a, index)
                    fresh.reorder(b, index)
                if p == 19:
                    keep = np.array([0, 2, 3, 7][: a.num_rows])
                    pooled.select(a, keep)
                    fresh.select(b, keep)
                tokens = rng.integers(3, pooled.info.tgt_vocab_size, size=a.num_rows)
                np.testing.assert_array_equal(pooled.step(a, tokens), fresh.step(b, tokens))
            for x in arrays(ours[0]):
                assert not any(np.shares_memory(x, y) for y in arrays(ours[1]))

    held = []
    for _ in range(4):
        run_pair(37)
        held.append(pooled._pool.nbytes)
    assert held[2] == held[3]  # after a few decodes of these sizes, none needs new memory


def test_grow_cache_must_be_a_bool(exported_portable):
    with pytest.raises(TypeError, match="grow_cache must be a bool"):
        OrtRunner(exported_portable, grow_cache=1)
    with pytest.raises(TypeError, match="reuse_buffers must be a bool"):
        OrtRunner(exported_portable, reuse_buffers="yes")


def test_tensorscatter_updates_the_bound_cache_in_place(tmp_path_factory, capfd):
    runner = OrtRunner(exported_dir(tmp_path_factory, "tensorscatter"))
    ids, lengths = sources(runner, batch=2)
    state = runner.encode(ids, lengths, cache_len=6)
    capfd.readouterr()
    runner.step(state, np.array([runner.info.bos_id] * 2))
    assert "in-place optimization not activated" not in capfd.readouterr().err
    assert state.self_keys[0][:, :, 0].any() and not state.self_keys[0][:, :, 1:].any()
    # Control: the same graph without IO binding copies the cache, and ONNX Runtime says so.
    feeds = {"input_ids": state.input_ids, "positions": state.positions, "src_lengths": state.src_lengths}
    for i in range(runner.info.n_layers):
        feeds.update(
            {
                f"self_key.{i}": state.self_keys[i],
                f"self_value.{i}": state.self_values[i],
                f"cross_key.{i}": state.cross_keys[i],
                f"cross_value.{i}": state.cross_values[i],
            }
        )
    runner.decoder.run(None, feeds)
    assert "in-place optimization not activated" in capfd.readouterr().err


def test_reorder_moves_the_valid_prefix(exported_portable):
    runner = OrtRunner(exported_portable)
    ids, lengths = sources(runner, batch=2)
    state = runner.encode(ids, lengths, cache_len=8, beam_size=2)
    rng = np.random.default_rng(0)
    for _ in range(3):
        runner.step(state, rng.integers(4, runner.info.tgt_vocab_size, size=4))
    index = np.array([1, 1, 3, 2])
    expected = [torch.from_numpy(c.copy()) for c in state.self_keys]
    for e in expected:
        reference.kv_cache_reorder_(e, torch.from_numpy(index), 3)
    runner.reorder(state, index)
    for e, c in zip(expected, state.self_keys):
        np.testing.assert_array_equal(e.numpy(), c)
    with pytest.raises(IndexError):
        runner.reorder(state, np.array([0, 1, 2, 4]))
    with pytest.raises(ValueError):
        runner.reorder(state, np.array([0, 1]))


def test_num_beams_repeats_rows_row_major(exported_portable, tmp_path):
    runner = OrtRunner(exported_portable)
    ids, lengths = sources(runner, batch=2)
    state = runner.encode(ids, lengths, cache_len=4, beam_size=3)
    np.testing.assert_array_equal(state.src_lengths, np.repeat(lengths, 3))
    # the step takes the cross-attention K/V once per source: the encoder's, not repeated
    assert runner.cross_per_source and state.beams == 3
    enc = runner.encoder.run(["cross_key.0"], {"input_ids": ids, "src_lengths": lengths})[0]
    np.testing.assert_array_equal(state.cross_keys[0], enc)
    # an export of format version 3 takes them once per row: repeated per beam
    old = OrtRunner(with_cross_per_row(copy_folder(exported_portable, tmp_path / "v3")))
    state = old.encode(ids, lengths, cache_len=4, beam_size=3)
    assert not old.cross_per_source and state.beams == 1
    np.testing.assert_array_equal(state.cross_keys[0], np.repeat(enc, 3, axis=0))


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_cross_kv_once_per_source_gives_the_logits_of_one_per_row(tmp_path_factory, tmp_path, flavour):
    """The step fed one cross-attention row per source (its beams as the rows of one product)
    against the same graph fed one per row (a version-3 folder): the same logits through beam
    reorders within sources, a select of whole sources (which keeps them per source) and a
    select that splits a source (after which every row gets its own)."""
    exported = exported_dir(tmp_path_factory, flavour)
    shared = OrtRunner(exported, intra_op_num_threads=1)
    per_row = OrtRunner(with_cross_per_row(copy_folder(exported, tmp_path / "v3")), intra_op_num_threads=1)
    K = 3
    ids, lengths = sources(shared, batch=4, src_len=9, seed=3)
    a = shared.encode(ids, lengths, cache_len=20, beam_size=K)
    b = per_row.encode(ids, lengths, cache_len=20, beam_size=K)
    assert a.cross_keys[0].shape[0] == 4 and b.cross_keys[0].shape[0] == 12
    rng = np.random.default_rng(7)
    for p in range(20):
        if p in (3, 9):  # beams move within their source only
            index = (np.arange(a.num_rows) // K) * K + rng.integers(0, K, size=a.num_rows)
            shared.reorder(a, index)
            per_row.reorder(b, index)
        if p == 6:  # sources 0 and 2 finished: sources 1 and 3 kept, beams reordered
            keep = np.array([5, 3, 4, 9, 9, 11])
            shared.select(a, keep)
            per_row.select(b, keep)
            assert a.beams == K and a.cross_keys[0].shape[0] == 2
            np.testing.assert_array_equal(np.repeat(a.cross_keys[1], K, axis=0), b.cross_keys[1])
        if p == 12:  # rows of one source split: from now on one cross-attention row per row
            keep = np.array([0, 1, 4, 3])
            shared.select(a, keep)
            per_row.select(b, keep)
            assert a.beams == 1 and a.cross_keys[0].shape[0] == 4
            np.testing.assert_array_equal(a.cross_values[0], b.cross_values[0])
        tokens = rng.integers(3, shared.info.tgt_vocab_size, size=a.num_rows)
        np.testing.assert_allclose(shared.step(a, tokens), per_row.step(b, tokens), rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------------
# options and bad inputs
# ------------------------------------------------------------------------------------------


def test_session_options(exported_portable):
    runner = OrtRunner(
        exported_portable,
        providers=["CPUExecutionProvider"],
        intra_op_num_threads=1,
        graph_optimization_level="basic",
    )
    assert runner.decoder.get_providers() == ["CPUExecutionProvider"]
    assert runner.decoder.get_session_options().intra_op_num_threads == 1
    with pytest.raises(ValueError, match="graph_optimization_level"):
        OrtRunner(exported_portable, graph_optimization_level="max")


def test_bad_encode_and_step_arguments(exported_portable):
    runner = OrtRunner(exported_portable)
    ids, lengths = sources(runner)
    with pytest.raises(ValueError, match="cache_len"):
        runner.encode(ids, lengths, cache_len=runner.info.max_positions + 1)
    with pytest.raises(ValueError, match="src_lengths"):
        runner.encode(ids, np.array([0, 1, 1]), cache_len=4)
    with pytest.raises(ValueError, match="max_len"):
        runner.encode(
            np.full((1, runner.info.max_positions + 1), 5),
            np.array([runner.info.max_positions + 1]),
            cache_len=4,
        )
    with pytest.raises(ValueError, match="input_ids"):
        runner.encode(ids + 10_000, lengths, cache_len=4)
    with pytest.raises(TypeError):
        runner.encode(ids.astype(np.float32), lengths, cache_len=4)
    state = runner.encode(ids, lengths, cache_len=4)
    with pytest.raises(ValueError, match="tokens"):
        runner.step(state, np.array([1, 1]))


def copy_export(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_missing_folder_or_manifest(tmp_path, exported_portable):
    with pytest.raises(ManifestError, match="not found"):
        OrtRunner(tmp_path / "nowhere")
    broken = copy_export(exported_portable, tmp_path / "no_manifest")
    (broken / MANIFEST_NAME).unlink()
    with pytest.raises(ManifestError, match="manifest.json"):
        OrtRunner(broken)
    bad_json = copy_export(exported_portable, tmp_path / "bad_json")
    (bad_json / MANIFEST_NAME).write_text("{ not json")
    with pytest.raises(ManifestError, match="JSON"):
        OrtRunner(bad_json)


def test_corrupt_or_missing_onnx(tmp_path, exported_portable):
    corrupt = copy_export(exported_portable, tmp_path / "corrupt")
    data = (corrupt / DECODER_FILE).read_bytes()
    (corrupt / DECODER_FILE).write_bytes(data[: len(data) // 3])
    with pytest.raises(InvalidGraphError, match=DECODER_FILE):
        OrtRunner(corrupt)
    missing = copy_export(exported_portable, tmp_path / "missing")
    (missing / ENCODER_FILE).unlink()
    with pytest.raises(InvalidGraphError, match="not found"):
        OrtRunner(missing)


def test_manifest_that_does_not_match_the_graphs(tmp_path, exported_portable):
    # Internally consistent, but for another model size: the graphs contradict it.
    other = copy_export(exported_portable, tmp_path / "other_model")
    manifest = json.loads((other / MANIFEST_NAME).read_text())
    manifest["model_config"]["tgt_vocab_size"] += 1
    manifest["graphs"] = graph_specs(manifest["model_config"], manifest["flavour"])
    (other / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match="logits"):
        OrtRunner(other)
    # A flavour that the graphs were not exported with.
    flavour = copy_export(exported_portable, tmp_path / "flavour")
    manifest = json.loads((flavour / MANIFEST_NAME).read_text())
    manifest["flavour"] = "tensorscatter"
    manifest["graphs"] = graph_specs(manifest["model_config"], "tensorscatter")
    (flavour / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match="present_key"):
        OrtRunner(flavour)
    # Graph lists edited by hand, no longer following from the config.
    edited = copy_export(exported_portable, tmp_path / "edited")
    manifest = json.loads((edited / MANIFEST_NAME).read_text())
    manifest["graphs"]["decoder_step"]["outputs"][0]["name"] = "scores"
    (edited / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match="do not follow"):
        OrtRunner(edited)


# ------------------------------------------------------------------------------------------
# numpy + onnxruntime only
# ------------------------------------------------------------------------------------------


def test_runs_without_torch(exported):
    code = f"""
import sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
sys.modules["onnx"] = None  # nor the onnx package (the search head's graph is built without it)
import numpy as np
from transformer_ext.runtimes import OrtRunner
runner = OrtRunner({str(exported)!r}, intra_op_num_threads=1)
out = runner.greedy(np.array([[5, 6, 7, 8]]), np.array([4]), max_new_tokens=5)
hyps = runner.beam_search(np.array([[5, 6, 7, 8]]), np.array([4]), beam_size=2, max_new_tokens=5)
assert "torch" not in {{m.split(".")[0] for m in sys.modules if sys.modules[m] is not None}}
print(out[0], hyps[0][0].tokens)
"""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()


# ------------------------------------------------------------------------------------------
# token ids: one shared check in every runner
# ------------------------------------------------------------------------------------------


def _device_runner(kind: str, export_dir: Path):
    """The ONNX Runtime CUDA runner (CPU provider, same bindings) or the TensorRT runner over
    stand-in engines: both are DeviceRunners, checked like every other runner."""
    if kind == "ort_cuda":
        from transformer_ext.runtimes import OrtCudaRunner

        return OrtCudaRunner(export_dir, device="cpu", intra_op_num_threads=1)
    from fake_tensorrt import fake_engines

    from transformer_ext.runtimes import TensorRTRunner

    model = eager_model(export_dir)
    enc, dec = fake_engines(model, "portable", torch.device("cpu"), [])
    return TensorRTRunner(
        enc, dec, max_positions=model.config.max_len, src_vocab_size=model.config.src_vocab_size, device="cpu"
    )


@pytest.mark.parametrize("kind", ["ort", "ort_cuda", "tensorrt"])
def test_runners_check_token_ids(exported_portable, kind):
    """Token -1 used to wrap to the last vocabulary row in OrtRunner.step; every runner now
    refuses it (and any id >= vocab) through decoding.check_step_tokens, naming row and value;
    source ids are checked at encode the same way."""
    runner = OrtRunner(exported_portable) if kind == "ort" else _device_runner(kind, exported_portable)
    cfg = eager_model(exported_portable).config
    ids, lengths = sources(runner if kind == "ort" else OrtRunner(exported_portable))
    state = runner.encode(ids, lengths, cache_len=4)
    for bad, row in ((-1, 0), (cfg.tgt_vocab_size, 2)):
        tokens = np.full(3, cfg.bos_id, dtype=np.int64)
        tokens[row] = bad
        with pytest.raises(
            ValueError, match=rf"tokens\[{row}\] = {bad} \(row {row}\) is not a target token id"
        ):
            runner.step(state, tokens)
    assert state.position == 0
    bad_src = ids.copy()
    bad_src[1, 0] = cfg.src_vocab_size + 3
    with pytest.raises(
        ValueError,
        match=rf"input_ids\[1, 0\] = {cfg.src_vocab_size + 3} \(row 1\) is not a source "
        rf"token id: the source vocabulary has ids 0 \.\. {cfg.src_vocab_size - 1}",
    ):
        runner.encode(bad_src, lengths, cache_len=4)


def test_ort_runner_reorder_names_row_and_value(exported_portable):
    runner = OrtRunner(exported_portable)
    ids, lengths = sources(runner)
    state = runner.encode(ids, lengths, cache_len=4, beam_size=2)
    runner.step(state, np.full(6, runner.info.bos_id, dtype=np.int64))
    with pytest.raises(IndexError, match=r"^beam_index\[5\] = 6 is not a row"):
        runner.reorder(state, np.array([0, 1, 2, 3, 4, 6]))


# ------------------------------------------------------------------------------------------
# source checks: one shared check (decoding.check_encode_args) in every runner
# ------------------------------------------------------------------------------------------


def _any_runner(kind: str, export_dir: Path):
    if kind == "ort":
        return OrtRunner(export_dir)
    if kind in ("eager", "catcache"):
        from transformer_ext.runtimes import CatCacheRunner

        return (EagerRunner if kind == "eager" else CatCacheRunner)(eager_model(export_dir))
    return _device_runner(kind, export_dir)


@pytest.mark.parametrize("kind", ["eager", "catcache", "ort", "ort_cuda", "tensorrt"])
def test_every_runner_makes_the_same_source_checks(exported_portable, kind):
    """The same bad encode arguments give the same error, word for word, from every runner
    (the eager runners used to skip the source-length checks, each runner had its own wording)."""
    runner = _any_runner(kind, exported_portable)
    max_len = eager_model(exported_portable).config.max_len
    ids = np.full((3, 7), 5, np.int64)
    lengths = np.array([7, 2, 3])
    too_long = np.full((1, max_len + 1), 5, np.int64)
    cases = [
        (
            (ids[0], lengths[:1], 4, 1),
            ValueError,
            "input_ids must be a non-empty [batch, src_len] array, got shape (7,)",
        ),
        (
            (ids.astype(np.float64), lengths, 4, 1),
            TypeError,
            "input_ids must hold integer token ids, got dtype float64",
        ),
        ((ids, lengths[:2], 4, 1), ValueError, "src_lengths must have shape (3,), got (2,)"),
        (
            (ids, np.array([7, 0, 3]), 4, 1),
            ValueError,
            "src_lengths must be in [1, 7] (the padded source length), got [7, 0, 3]",
        ),
        (
            (ids, np.array([7, 8, 3]), 4, 1),
            ValueError,
            "src_lengths must be in [1, 7] (the padded source length), got [7, 8, 3]",
        ),
        (
            (ids, lengths.astype(np.float32), 4, 1),
            TypeError,
            "src_lengths must be integers, got dtype float32",
        ),
        (
            (too_long, np.array([max_len + 1]), 4, 1),
            ValueError,
            f"source length {max_len + 1} exceeds the model's max_len = {max_len}",
        ),
        ((ids, lengths, 0, 1), ValueError, "cache_len must be a positive int, got 0"),
        ((ids, lengths, 2.0, 1), ValueError, "cache_len must be a positive int, got 2.0"),
        (
            (ids, lengths, max_len + 1, 1),
            ValueError,
            f"cache_len = {max_len + 1} exceeds the model's max_len = {max_len} (positions past it have no positional "
            "encoding); generate fewer tokens",
        ),
        ((ids, lengths, 4, 0), ValueError, "beam_size must be a positive int, got 0"),
    ]
    for args, exc, message in cases:
        with pytest.raises(exc) as info:
            runner.encode(*args)
        assert str(info.value) == message, (kind, args[2:])
    state = runner.encode(ids, lengths, 4, 2)  # and good arguments still work
    assert runner.step(state, np.ones(6, np.int64)).shape[0] == 6


# ------------------------------------------------------------------------------------------
# denormals flushed to zero while the graphs run
# ------------------------------------------------------------------------------------------


def test_flush_denormals_is_a_bool_and_sets_the_sessions_pool(exported_portable):
    with pytest.raises(TypeError, match="flush_denormals must be a bool"):
        OrtRunner(exported_portable, flush_denormals=1)
    flushed = OrtRunner(exported_portable, intra_op_num_threads=1)
    assert flushed.flush_denormals is True
    # ONNX Runtime sets FTZ on the thread that makes such a session: the runner gives it back
    assert np.float32(1e-30) * np.float32(1e-10) > 0
    for session in (flushed.encoder, flushed.decoder):
        assert session.get_session_options().get_session_config_entry("session.set_denormal_as_zero") == "1"
    plain = OrtRunner(exported_portable, intra_op_num_threads=1, flush_denormals=False)
    with pytest.raises(RuntimeError, match="does not have configuration"):
        plain.encoder.get_session_options().get_session_config_entry("session.set_denormal_as_zero")


def test_spinning_stops_after_each_run_unless_asked_not_to(exported_portable):
    """``stop_spinning_after_run`` (default True) sets ONNX Runtime's ``session.force_spinning_stop``
    on both sessions; False leaves the entry out (ONNX Runtime's own behaviour); not a bool: a
    TypeError naming it. The decodes are the same either way."""
    from transformer_ext.runtimes.ort import FORCE_SPINNING_STOP

    with pytest.raises(TypeError, match="stop_spinning_after_run must be a bool"):
        OrtRunner(exported_portable, stop_spinning_after_run="no")
    stopping = OrtRunner(exported_portable, intra_op_num_threads=2)
    spinning = OrtRunner(exported_portable, intra_op_num_threads=2, stop_spinning_after_run=False)
    for session in (stopping.encoder, stopping.decoder):
        assert session.get_session_options().get_session_config_entry(FORCE_SPINNING_STOP) == "1"
    for session in (spinning.encoder, spinning.decoder):
        with pytest.raises(RuntimeError, match="does not have configuration"):
            session.get_session_options().get_session_config_entry(FORCE_SPINNING_STOP)
    ids, lengths = sources(stopping, batch=3)
    got, want = (
        [[h.tokens for h in row] for row in r.beam_search(ids, lengths, beam_size=3, max_decoding_length=8)]
        for r in (stopping, spinning)
    )
    assert got == want


def test_flushed_runs_give_the_logits_and_tokens_of_plain_ones_on_padded_batches(exported_portable):
    from transformer_ext.runtimes import denormals

    runners = [OrtRunner(exported_portable, intra_op_num_threads=1, flush_denormals=f) for f in (False, True)]
    ids, lengths = sources(runners[0], batch=6, src_len=11, seed=3)  # ragged: padded rows
    assert lengths.min() < lengths.max()
    logits = []
    for runner in runners:
        state = runner.encode(ids, lengths, cache_len=8)
        tokens = np.full(len(ids), runner.info.bos_id, dtype=np.int64)
        steps = []
        for _ in range(4):
            out = runner.step(state, tokens)
            steps.append(out)
            tokens = out.argmax(-1)
        logits.append(np.stack(steps))
    # a flushed value is below 1.2e-38: the logits agree far below the export tolerance
    np.testing.assert_allclose(logits[0], logits[1], rtol=0, atol=1e-6)
    plain, flushed = (r.beam_search(ids, lengths, beam_size=3, max_decoding_length=6) for r in runners)
    assert [[h.tokens for h in x] for x in plain] == [[h.tokens for h in x] for x in flushed]
    if denormals.AVAILABLE:  # the caller's thread is as it was
        assert (np.float32(1e-30) * np.float32(1e-10)) > 0
