"""transformer_ext.runtimes.kv_cache: the stacked self-attention cache of the eager, GPU and
ONNX Runtime runners, checked against plain per-layer indexing (an independent numpy oracle)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import device_params

from transformer_ext.runtimes.kv_cache import CacheOverflowError, HostKVCache, KVCache

BACKENDS = ["torch", "host"]
SHAPES = [(1, 1, 1, 3, 2), (3, 4, 2, 6, 4)]  # (n_layers, rows, heads, capacity, d_k)


def _make(backend, n_layers, rows, heads, capacity, d_k, device="cpu"):
    if backend == "torch":
        return KVCache.allocate(
            n_layers, rows, heads, capacity, d_k, dtype=torch.float32, device=device, staging=True
        )
    return HostKVCache(n_layers, rows, heads, capacity, d_k, dtype=np.float32, staging=True)


def _np(x):
    return x.cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def _append(cache, backend, new_k, new_v):
    """One step through the public API: new K/V per layer ([N, H, 1, d_k] numpy arrays)."""
    if backend == "torch":
        with torch.inference_mode():
            cache.begin_step()
            for view, value in zip(cache.new_key_layers + cache.new_value_layers, new_k + new_v):
                view.copy_(torch.from_numpy(value))
            cache.append_()
    else:
        for view, value in zip(cache.new_key_layers + cache.new_value_layers, new_k + new_v):
            view[...] = value
        cache.append_()
    cache.end_step()


def _reorder(cache, backend, index):
    if backend == "torch":
        with torch.inference_mode():
            cache.reorder_(index)
    else:
        cache.reorder_(index)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("backend", BACKENDS + ["host-row-copies"])
def test_append_and_reorder_match_plain_indexing(backend, shape, monkeypatch):
    """Random appends and beam reorders, compared after every operation with separate per-layer
    arrays updated by plain indexing; past the valid prefix everything stays zero.
    ``host-row-copies``: the host cache's copy-per-row path (taken for large moves)."""
    if backend == "host-row-copies":
        monkeypatch.setattr(HostKVCache, "_SMALL_MOVE_BYTES", 0)
        monkeypatch.setattr(HostKVCache, "_SMALL_SLICE_BYTES", 0)
        backend = "host"
    n_layers, N, H, L, D = shape
    rng = np.random.default_rng(0)
    cache = _make(backend, *shape)
    oracle_k = [np.zeros((N, H, L, D), np.float32) for _ in range(n_layers)]
    oracle_v = [np.zeros((N, H, L, D), np.float32) for _ in range(n_layers)]
    for p in range(L):
        new_k = [rng.standard_normal((N, H, 1, D)).astype(np.float32) for _ in range(n_layers)]
        new_v = [rng.standard_normal((N, H, 1, D)).astype(np.float32) for _ in range(n_layers)]
        _append(cache, backend, new_k, new_v)
        for i in range(n_layers):
            oracle_k[i][:, :, p] = new_k[i][:, :, 0]
            oracle_v[i][:, :, p] = new_v[i][:, :, 0]
        assert cache.length == p + 1
        index = rng.integers(0, N, size=N)
        _reorder(cache, backend, index)
        for i in range(n_layers):
            old_k, old_v = oracle_k[i].copy(), oracle_v[i].copy()
            for r in range(N):
                oracle_k[i][r, :, : p + 1] = old_k[index[r], :, : p + 1]
                oracle_v[i][r, :, : p + 1] = old_v[index[r], :, : p + 1]
        for i in range(n_layers):
            np.testing.assert_array_equal(_np(cache.key_layers[i]), oracle_k[i])
            np.testing.assert_array_equal(_np(cache.value_layers[i]), oracle_v[i])
    # the stacked buffers are the layers one after the other
    np.testing.assert_array_equal(_np(cache.keys), np.concatenate(oracle_k))
    np.testing.assert_array_equal(_np(cache.values), np.concatenate(oracle_v))


@pytest.mark.parametrize("backend", BACKENDS)
def test_layer_views_alias_the_stacked_buffers(backend):
    """One buffer per K / V for all layers: the per-layer views are contiguous slices of it
    (bindable by pointer), and the staging buffers are stacked the same way."""
    n_layers, N, H, L, D = 3, 2, 2, 5, 4
    cache = _make(backend, n_layers, N, H, L, D)
    assert tuple(cache.keys.shape) == (n_layers * N, H, L, D) and tuple(cache.new_keys.shape) == (
        n_layers * N,
        H,
        1,
        D,
    )
    assert not _np(cache.keys).any() and not _np(cache.values).any()  # zero-filled
    for stacked, views, per in (
        (cache.keys, cache.key_layers, L),
        (cache.values, cache.value_layers, L),
        (cache.new_keys, cache.new_key_layers, 1),
        (cache.new_values, cache.new_value_layers, 1),
    ):
        assert len(views) == n_layers
        for i, view in enumerate(views):
            assert tuple(view.shape) == (N, H, per, D)
            if backend == "torch":
                assert view.is_contiguous() and view.data_ptr() == stacked.data_ptr() + i * view.nbytes
            else:
                assert view.flags.c_contiguous and view.ctypes.data == stacked.ctypes.data + i * view.nbytes
    with torch.inference_mode():  # the buffers are inference tensors
        cache.key_layers[2][1, 0, 3, 2] = 7.0  # written through a view, seen in the stacked buffer
    assert _np(cache.keys)[2 * N + 1, 0, 3, 2] == 7.0


def test_torch_append_takes_stacked_or_per_layer_updates():
    """``append_`` with a stacked tensor, with per-layer lists, or from the staging buffers writes
    the same; the write positions of every stacked row are the cache's length."""
    n_layers, N, H, L, D = 2, 3, 2, 4, 2
    rng = torch.Generator().manual_seed(1)
    new_k = [torch.randn((N, H, 1, D), generator=rng) for _ in range(n_layers)]
    new_v = [torch.randn((N, H, 1, D), generator=rng) for _ in range(n_layers)]
    caches = [
        KVCache.allocate(n_layers, N, H, L, D, dtype=torch.float32, device="cpu", staging=s)
        for s in (False, False, True)
    ]
    with torch.inference_mode():
        for form, cache in enumerate(caches):
            cache.end_step()  # write at position 1
            step_positions = cache.begin_step()
            assert step_positions.tolist() == [1] * N and cache.positions.tolist() == [1] * (n_layers * N)
            if form == 0:
                cache.append_(torch.cat(new_k), torch.cat(new_v))
            elif form == 1:
                cache.append_(new_k, new_v)
            else:
                cache.new_keys.copy_(torch.cat(new_k))
                cache.new_values.copy_(torch.cat(new_v))
                cache.append_()
    for cache in caches:
        for i in range(n_layers):
            assert torch.equal(cache.key_layers[i][:, :, 1:2], new_k[i])
            assert torch.equal(cache.value_layers[i][:, :, 1:2], new_v[i])
            assert not cache.key_layers[i][:, :, [0, 2, 3]].any()
    with pytest.raises(ValueError, match="staging buffers"):
        caches[0].append_()
    with pytest.raises(ValueError, match="both new_keys and new_values"):
        caches[0].append_(new_k, None)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_beam_index_names_the_callers_row_and_moves_nothing(backend):
    cache = _make(backend, 2, 3, 1, 4, 2)
    rng = np.random.default_rng(2)
    _append(
        cache,
        backend,
        [rng.standard_normal((3, 1, 1, 2)).astype(np.float32) for _ in range(2)],
        [rng.standard_normal((3, 1, 1, 2)).astype(np.float32) for _ in range(2)],
    )
    before = _np(cache.keys).copy()
    # row 2 of the caller's index, not a row of the stacked buffer (which has 6 rows)
    with pytest.raises(
        IndexError, match=r"^beam_index\[2\] = 3 is not a row of the decoding state: rows are 0 \.\. 2$"
    ):
        _reorder(cache, backend, np.array([0, 1, 3]))
    with pytest.raises(ValueError, match=r"beam_index must have shape \(3,\)"):
        _reorder(cache, backend, np.array([0, 1]))
    np.testing.assert_array_equal(_np(cache.keys), before)


def test_empty_cache_reorder_is_checked_but_moves_nothing():
    calls = []
    cache = KVCache.allocate(
        1, 2, 1, 3, 1, dtype=torch.float32, device="cpu", reorder_op=lambda *a: calls.append(a)
    )
    cache.reorder_(np.array([1, 0]))
    assert calls == []
    with pytest.raises(IndexError, match=r"beam_index\[0\] = -1"):
        cache.reorder_(np.array([-1, 0]))


def test_cpu_append_past_the_capacity_raises_before_writing():
    """On CPU the op checks positions itself (no flag): nothing is written."""
    cache = KVCache.allocate(2, 2, 1, 2, 2, dtype=torch.float32, device="cpu")
    assert cache.error_flag is None and cache.error_flag_host is None
    ones = torch.ones((4, 1, 1, 2))
    with torch.inference_mode():
        for _ in range(2):
            cache.begin_step()
            cache.append_(ones, ones)
            cache.end_step()
        before = cache.keys.clone()
        cache.begin_step()  # position 2 == capacity
        with pytest.raises(
            RuntimeError,
            match=r"positions\[0\] = 2 leaves no room for T = 1 new token in a cache "
            r"of capacity L = 2",
        ):
            cache.append_(2 * ones, 2 * ones)
    assert torch.equal(cache.keys, before) and cache.length == 2


def test_host_cache_full_raises_before_writing():
    cache = HostKVCache(1, 1, 1, 1, 1, staging=True)
    cache.append_()
    cache.end_step()
    before = cache.keys.copy()
    with pytest.raises(IndexError, match="cannot append at position 1: the cache holds 1 positions"):
        cache.append_()
    np.testing.assert_array_equal(cache.keys, before)
    with pytest.raises(ValueError, match="staging buffers"):
        HostKVCache(1, 1, 1, 1, 1).append_()


def test_error_flag_is_read_from_its_host_copy_at_end_step():
    """With a flag, the append passes it to the op and enqueues a copy to the host behind the
    writes; ``end_step`` (after the caller's sync) reads only that copy: a flag the kernel set
    during this step's appends is a CacheOverflowError naming position and capacity, and the
    length does not advance. A stand-in op sets the flag as the CUDA kernel does for a row that
    does not fit (the CPU kernel raises instead)."""
    seen = []

    def skipping_append(cache_buffer, update, positions, *flag):
        seen.append(len(flag))
        flag[0].fill_(1)

    cache = KVCache.allocate(
        2,
        2,
        1,
        4,
        2,
        dtype=torch.float32,
        device="cpu",
        staging=True,
        error_flag=True,
        append_op=skipping_append,
    )
    assert cache.error_flag.dtype == torch.int32 and cache.error_flag.device.type == "cpu"
    with torch.inference_mode():
        cache.begin_step()
        cache.append_()
    assert seen == [1, 1]  # both appends got the flag
    assert int(cache.error_flag_host[0]) == 1  # copied behind the writes
    with pytest.raises(CacheOverflowError, match=r"position 0 \+ 1 exceeds the cache capacity 4"):
        cache.end_step()
    assert cache.length == 0

    ok = KVCache.allocate(1, 1, 1, 4, 1, dtype=torch.float32, device="cpu", staging=True, error_flag=True)
    with torch.inference_mode():
        ok.begin_step()
        ok.append_()  # the real op, in range: the flag stays 0
        ok.error_flag.fill_(1)  # set after the copy: end_step reads the copy, not the device
    ok.end_step()
    assert ok.length == 1


@pytest.mark.parametrize("device", device_params())
def test_device_default_flag(device):
    """A flag by default exactly on CUDA (pinned host copy there); on CUDA an append past the
    capacity is skipped on the device and reported at end_step."""
    cache = KVCache.allocate(2, 2, 1, 1, 2, dtype=torch.float32, device=device, staging=True)
    if device == "cpu":
        assert cache.error_flag is None
        return
    assert cache.error_flag is not None and cache.error_flag_host.is_pinned()
    with torch.inference_mode():
        cache.begin_step()
        cache.append_()
        torch.cuda.synchronize()
        cache.end_step()
        cache.new_keys.fill_(3.0)
        cache.begin_step()  # position 1 == capacity
        cache.append_()
        torch.cuda.synchronize()
    with pytest.raises(CacheOverflowError, match="exceeds the cache capacity 1"):
        cache.end_step()
    assert not (cache.keys == 3.0).any()


@pytest.mark.parametrize(
    "args, fragment",
    [
        ((0, 1, 1, 1, 1), "n_layers must be a positive int, got 0"),
        ((1, 1, 1, True, 1), "capacity must be a positive int, got True"),
        ((1, 1, 1, 1, 1.5), "d_k must be a positive int, got 1.5"),
    ],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_sizes_are_checked(backend, args, fragment):
    with pytest.raises(ValueError, match=fragment):
        if backend == "torch":
            KVCache.allocate(*args, dtype=torch.float32, device="cpu")
        else:
            HostKVCache(*args)


def test_runner_states_keep_one_stacked_cache(tiny_model_and_batch):
    """EagerRunner and OrtRunner-like states hold their layers as views of one buffer per K / V."""
    from transformer_ext.runtimes import EagerRunner

    model, src, lengths = tiny_model_and_batch
    runner = EagerRunner(model)
    state = runner.encode(src, lengths, 4, 2)
    N = state.num_rows
    assert isinstance(state.cache, KVCache) and state.position == 0 and state.cache_len == 4
    for i, view in enumerate(state.self_keys):
        assert view.data_ptr() == state.cache.keys.data_ptr() + i * view.nbytes and view.shape[0] == N
    runner.step(state, np.ones(N, np.int64))
    assert (
        state.position == 1
        and state.cache.key_layers[1][:, :, 0].any()
        and not state.cache.keys[:, :, 1:].any()
    )


@pytest.fixture
def tiny_model_and_batch():
    from transformer_ext.config import TransformerConfig
    from transformer_ext.model import Transformer

    torch.manual_seed(0)
    cfg = TransformerConfig(
        src_vocab_size=11,
        tgt_vocab_size=13,
        d_model=16,
        n_heads=2,
        d_ff=32,
        n_encoder_layers=1,
        n_decoder_layers=2,
        max_len=16,
        dropout=0.0,
    )
    model = Transformer(cfg).eval()
    return model, np.array([[3, 4, 5], [6, 7, 0]], np.int64), np.array([3, 2], np.int64)


def _select(cache, backend, index):
    if backend == "torch":
        with torch.inference_mode():
            cache.select_(index)
    else:
        cache.select_(index)


@pytest.mark.parametrize("backend", BACKENDS)
def test_select_keeps_rows_like_plain_indexing(backend):
    """Appends, then selects of fewer rows (reordered, repeated), then appends again: after every
    operation equal to per-layer arrays indexed by plain numpy; the layer views stay
    contiguous slices of the stacked buffers, and past the valid prefix everything is zero."""
    n_layers, N, H, L, D = 3, 6, 2, 7, 4
    rng = np.random.default_rng(5)
    cache = _make(backend, n_layers, N, H, L, D)
    oracle_k = [np.zeros((N, H, L, D), np.float32) for _ in range(n_layers)]
    oracle_v = [np.zeros((N, H, L, D), np.float32) for _ in range(n_layers)]
    selects = {1: np.array([5, 0, 2, 2]), 3: np.array([3, 1, 0]), 4: np.array([2]), 5: np.array([0])}
    for p in range(L):
        rows = oracle_k[0].shape[0]
        new_k = [rng.standard_normal((rows, H, 1, D)).astype(np.float32) for _ in range(n_layers)]
        new_v = [rng.standard_normal((rows, H, 1, D)).astype(np.float32) for _ in range(n_layers)]
        _append(cache, backend, new_k, new_v)
        for i in range(n_layers):
            oracle_k[i][:, :, p] = new_k[i][:, :, 0]
            oracle_v[i][:, :, p] = new_v[i][:, :, 0]
        if p in selects:
            index = selects[p]
            _select(cache, backend, index)
            oracle_k = [k[index] for k in oracle_k]
            oracle_v = [v[index] for v in oracle_v]
        M = oracle_k[0].shape[0]
        assert cache.rows == M and len(cache.key_layers) == n_layers
        assert tuple(cache.keys.shape) == (n_layers * M, H, L, D)
        assert tuple(cache.new_keys.shape) == (n_layers * M, H, 1, D)
        for i in range(n_layers):
            np.testing.assert_array_equal(_np(cache.key_layers[i]), oracle_k[i])
            np.testing.assert_array_equal(_np(cache.value_layers[i]), oracle_v[i])
        np.testing.assert_array_equal(_np(cache.keys), np.concatenate(oracle_k))
        view = cache.key_layers[-1]
        if backend == "torch":
            assert (
                view.is_contiguous()
                and view.data_ptr() == cache.keys.data_ptr() + (n_layers - 1) * view.nbytes
            )
            assert tuple(cache.step_positions.shape) == (M,)
        else:
            assert (
                view.flags.c_contiguous
                and view.ctypes.data == cache.keys.ctypes.data + (n_layers - 1) * view.nbytes
            )


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_select_index_names_its_position_and_moves_nothing(backend):
    cache = _make(backend, 2, 3, 1, 4, 2)
    rng = np.random.default_rng(4)
    _append(
        cache,
        backend,
        [rng.standard_normal((3, 1, 1, 2)).astype(np.float32) for _ in range(2)],
        [rng.standard_normal((3, 1, 1, 2)).astype(np.float32) for _ in range(2)],
    )
    before = _np(cache.keys).copy()
    with pytest.raises(
        IndexError, match=r"^index\[1\] = 3 is not a row of the decoding state: rows are 0 \.\. 2$"
    ):
        _select(cache, backend, np.array([0, 3]))
    for bad in (np.array([], dtype=np.int64), np.array([0, 1, 2, 0]), np.zeros((1, 1), dtype=np.int64)):
        with pytest.raises(ValueError, match=r"index must have shape \(M,\) with 1 <= M <= 3"):
            _select(cache, backend, bad)
    with pytest.raises(TypeError, match="index must hold integers"):
        _select(cache, backend, np.array([0.0]))
    assert cache.rows == 3
    np.testing.assert_array_equal(_np(cache.keys), before)


# ------------------------------------------------------------------------------------------
# HostBufferPool
# ------------------------------------------------------------------------------------------


def test_buffer_pool_never_hands_out_memory_a_live_array_uses():
    """Random takes and drops: every array the pool hands out is disjoint from every live one,
    and a dropped array's memory is reused (the pool stops growing)."""
    from transformer_ext.runtimes.kv_cache import HostBufferPool

    pool = HostBufferPool(max_buffers=4)
    rng = np.random.default_rng(0)
    live: list[np.ndarray] = []
    for i in range(400):
        if live and rng.random() < 0.5:
            live.pop(int(rng.integers(len(live))))
        shape = tuple(int(d) for d in rng.integers(1, 9, size=int(rng.integers(1, 4))))
        dtype = [np.float32, np.int64, np.uint8][i % 3]
        a = pool.empty(shape, dtype)
        assert a.shape == shape and a.dtype == dtype and a.flags.c_contiguous
        assert not any(np.shares_memory(a, b) for b in live)
        if rng.random() < 0.3:  # a view outlives its array: the buffer stays taken
            a = a.reshape(-1)[1:] if a.size > 1 else a
        live.append(a)
    before = pool.nbytes
    live.clear()
    for _ in range(20):
        pool.zeros((8, 8), np.float32)
    assert pool.nbytes <= before


def test_buffer_pool_zeros_reused_memory_and_bounds_what_it_keeps():
    from transformer_ext.runtimes.kv_cache import HostBufferPool

    pool = HostBufferPool(max_buffers=2)
    a = pool.empty((4, 4), np.float32)
    a.fill(7)
    del a
    z = pool.zeros((4, 4), np.float32)
    assert not z.any() and pool.nbytes == 64  # the same buffer, zeroed
    del z
    small = [pool.empty((k,), np.uint8) for k in (1, 2, 3)]
    del small
    big = pool.empty((1000,), np.uint8)  # the free buffers too small for it are dropped
    assert pool.nbytes == 1000
    del big
    with pytest.raises(ValueError, match="max_buffers"):
        HostBufferPool(max_buffers=0)


def test_host_cache_row_slots_match_plain_indexing():
    """Row slots of a running decoding (HostKVCache.release_ / insert_ / with_rows), every row at
    its own position: after every operation equal to a per-row numpy oracle; append_ writes each
    row's new K/V at that row's own length, a released row's at position 0."""
    nl, H, L, D = 2, 3, 7, 2
    rng = np.random.default_rng(11)

    def step(cache, ok, ov, lengths):
        rows = cache.rows
        new_k = rng.standard_normal((nl, rows, H, 1, D)).astype(np.float32)
        new_v = rng.standard_normal((nl, rows, H, 1, D)).astype(np.float32)
        for i in range(nl):
            cache.new_key_layers[i][...] = new_k[i]
            cache.new_value_layers[i][...] = new_v[i]
        cache.append_()
        cache.end_step()
        for r in range(rows):
            ok[:, r, :, lengths[r]] = new_k[:, r, :, 0]
            ov[:, r, :, lengths[r]] = new_v[:, r, :, 0]
        lengths += 1

    def fresh(rows, tokens):
        cache = HostKVCache(nl, rows, H, L, D, dtype=np.float32, staging=True)
        ok, ov = np.zeros((2, nl, rows, H, L, D), np.float32)
        lengths = np.zeros(rows, dtype=np.int64)
        for _ in range(tokens):
            step(cache, ok, ov, lengths)
        return cache, ok, ov, lengths

    def check(cache, ok, ov, lengths):
        assert cache.rows == ok.shape[1] and cache.row_lengths.tolist() == lengths.tolist()
        assert cache.length == lengths.max()
        for i in range(nl):
            np.testing.assert_array_equal(cache.key_layers[i], ok[i])
            np.testing.assert_array_equal(cache.value_layers[i], ov[i])
            assert cache.key_layers[i].flags.c_contiguous

    cache, ok, ov, lengths = fresh(3, 2)
    step(cache, ok, ov, lengths)
    cache.release_([1])  # its buffers stay, its length is 0
    lengths[1] = 0
    check(cache, ok, ov, lengths)
    step(cache, ok, ov, lengths)  # rows at positions 3, 0, 3
    check(cache, ok, ov, lengths)
    other, ok2, ov2, lengths2 = fresh(1, 2)
    cache.insert_(other, [1])
    ok[:, 1], ov[:, 1], lengths[1] = ok2[:, 0], ov2[:, 0], lengths2[0]
    check(cache, ok, ov, lengths)
    step(cache, ok, ov, lengths)
    check(cache, ok, ov, lengths)
    grown = cache.with_rows(5, L)
    zeros = np.zeros((nl, 2, H, L, D), np.float32)
    ok, ov = np.concatenate([ok, zeros], axis=1), np.concatenate([ov, zeros], axis=1)
    lengths = np.concatenate([lengths, [0, 0]])
    check(grown, ok, ov, lengths)
    other, ok2, ov2, lengths2 = fresh(2, 1)
    grown.insert_(other, [4, 0])  # a released row and a new one, in that order
    for r, o in ((4, 0), (0, 1)):
        ok[:, r], ov[:, r], lengths[r] = ok2[:, o], ov2[:, o], lengths2[o]
    check(grown, ok, ov, lengths)
    for _ in range(2):
        step(grown, ok, ov, lengths)
        check(grown, ok, ov, lengths)
    with pytest.raises(ValueError, match="must name 2 distinct rows"):
        grown.insert_(other, [1, 1])
    with pytest.raises(IndexError, match=r"rows of the cache \(0 .. 4\)"):
        grown.insert_(other, [1, 5])
    with pytest.raises(ValueError, match="at least as many rows"):
        grown.with_rows(4, L)
    check(grown, ok, ov, lengths)  # nothing was written
