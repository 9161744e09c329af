"""The self-attention KV cache of a decoding: one object for every runner that keeps one.

A decoding of N rows (sources x beams) through a decoder of ``n_layers`` layers keeps, per layer,
the keys and values of every token fed so far (docs/DESIGN.md section 1). Both classes here hold them
the same way:

* **Stacked buffers.** All layers' keys live in ONE zero-filled buffer ``keys
  [n_layers * N, H, L, d_k]`` (layer i = rows ``i*N .. (i+1)*N - 1``), the values in another;
  ``key_layers[i]`` / ``value_layers[i]`` are per-layer views ``[N, H, L, d_k]``, contiguous, so a
  graph input can be bound to them by pointer. Zero-filled once: a graph reads the whole buffer,
  and the contract requires finite values past the prefix (docs/DESIGN.md section 3).
* **In-place append.** A step's new keys and values of every layer are written with one call
  each, at the cache's ``length`` (the same for every row): 2 writes per step instead of
  ``2 * n_layers``. Runners whose graph outputs the new K/V into bound buffers ask for staging
  buffers (``staging=True``), stacked the same way (``new_keys [n_layers * N, H, 1, d_k]`` and
  per-layer views), so the append reads them with no concatenation.
* **In-place reorder** of the valid prefix for beam search (:class:`KVCache`: one call per
  buffer; :class:`HostKVCache`: the rows that change only): the caller's
  ``beam_index`` (checked by :func:`transformer_ext.decoding.check_beam_index`, so an error names
  the caller's row and value) is turned into the stacked index on the host.
* **Fewer rows.** ``select_(index)`` keeps ``len(index)`` rows, row ``r`` becoming old row
  ``index[r]`` (a search dropping finished sources, with the beam reorder of the same step):
  the gather is done in place, every layer's kept rows moved to the front of the same buffers
  (one ``kv_cache_reorder_`` per stacked buffer, or one gather per buffer on the host; only the
  rows that move), and the cache's arrays become views of those first rows. Nothing is
  allocated; a runner binds the views again.
* A step is ``begin_step()`` (write positions), the graph or model, ``append_(...)``, the
  caller's synchronisation (it needs the logits on the host anyway), ``end_step()`` (advance).

:class:`KVCache` (torch tensors; :class:`~transformer_ext.runtimes.eager.EagerRunner` and the GPU
runners, :class:`~transformer_ext.runtimes.device.DeviceRunner`) writes with the compiled ops
``kv_cache_append_`` / ``kv_cache_reorder_``. On CUDA the append gets a device error flag
instead of checking positions on the host (which would sync every step): ``append_`` enqueues a
copy of the flag into pinned host memory behind the writes, and ``end_step`` reads that copy,
which is complete once the caller has synchronised for the logits, so reading it costs no extra
sync; a set flag (a row the kernel skipped because it did not fit) is a RuntimeError naming the
position and the capacity. Positions are checked on the host before every step
(:func:`transformer_ext.decoding.check_step_tokens`), so the flag guards a broken invariant
only. On CPU the op itself raises before writing anything, and there is no flag.

:class:`HostKVCache` (numpy arrays; :class:`~transformer_ext.runtimes.ort.OrtRunner`) writes by
array indexing: it needs neither torch nor the compiled ops. This module imports numpy only;
:class:`KVCache` imports torch and the compiled ops when it allocates.
"""

from __future__ import annotations

import sys
import threading
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

import numpy as np

from transformer_ext import decoding

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["KVCache", "HostKVCache", "CacheOverflowError", "CacheStateViews"]


class CacheStateViews:
    """What every runner's decoding state exposes of its self-attention cache (``self.cache``, a
    :class:`KVCache` or :class:`HostKVCache`) and of its rows (``self.src_lengths``)."""

    @property
    def num_rows(self) -> int:
        return int(self.src_lengths.shape[0])

    @property
    def self_keys(self) -> list:
        """Per layer ``[N, H, cache_len, d_k]``: views into the stacked cache."""
        return self.cache.key_layers

    @property
    def self_values(self) -> list:
        return self.cache.value_layers

    @property
    def new_keys(self) -> list:
        """Staging buffers (portable flavour): per layer ``[N, H, 1, d_k]`` views the graph
        writes; empty without staging."""
        return self.cache.new_key_layers

    @property
    def new_values(self) -> list:
        return self.cache.new_value_layers

    @property
    def position(self) -> int:
        """Tokens already in the caches (the most of any row: every row holds as many unless rows
        were appended to a running decoding)."""
        return self.cache.length

    @property
    def cache_len(self) -> int:
        """The allocated capacity."""
        return self.cache.capacity


class CacheOverflowError(RuntimeError):
    """The device's error flag says ``kv_cache_append_`` skipped a row: it did not fit the cache."""


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


class _Layout:
    """What both caches share: the sizes and the valid lengths.

    ``row_lengths`` (int64 ``[rows]``) holds the tokens in each row's cache, which is also the
    position its next token is written at; ``length`` is the largest (the valid prefix that a
    reorder or select moves). Every row holds the same number of tokens (``uniform``) unless rows
    were appended to a running cache (:meth:`KVCache.extend`, :meth:`HostKVCache.extend`)."""

    n_layers: int
    rows: int
    capacity: int
    row_lengths: np.ndarray
    _length: int

    def _init_layout(self, n_layers: int, rows: int, capacity: int) -> None:
        self.n_layers = _positive_int("n_layers", n_layers)
        self.rows = _positive_int("rows", rows)
        self.capacity = _positive_int("capacity", capacity)
        self.set_length(0)

    @property
    def length(self) -> int:
        """The most tokens a row's cache holds (all rows' count unless rows were appended)."""
        return self._length

    @length.setter
    def length(self, length: int) -> None:
        self.set_length(length)

    def set_length(self, length: int) -> None:
        """Every row holds ``length`` tokens."""
        self.row_lengths = np.full(self.rows, int(length), dtype=np.int64)
        self._length = int(length)
        self.uniform = True

    def _set_row_lengths(self, row_lengths: np.ndarray) -> None:
        self.row_lengths = np.ascontiguousarray(row_lengths, dtype=np.int64)
        self._length = int(self.row_lengths.max(initial=0))
        self.uniform = bool(self.row_lengths.size == 0 or (self.row_lengths == self._length).all())

    def end_step(self) -> None:
        """One token more in every row's cache (after its K/V were appended, or written by the graph)."""
        self.row_lengths += 1
        self._length += 1


def _check_extend(cache: Any, other: Any) -> None:
    """``other`` can be appended to ``cache``: the same kind, layers, heads, head size and dtype."""
    if type(other) is not type(cache):
        raise TypeError(f"cannot append a {type(other).__name__} to a {type(cache).__name__}")
    a, b = cache.keys.shape, other.keys.shape
    if cache.n_layers != other.n_layers or a[1] != b[1] or a[3] != b[3] or cache.dtype != other.dtype:
        raise ValueError(
            f"cannot append a cache of {other.n_layers} layers, {b[1]} heads of size {b[3]} ({other.dtype}) to one "
            f"of {cache.n_layers} layers, {a[1]} heads of size {a[3]} ({cache.dtype})"
        )


def _views(buffer: Any, rows: int, n_layers: int) -> list:
    return [buffer[i * rows : (i + 1) * rows] for i in range(n_layers)]


def _stacked_select_index(index: np.ndarray, rows: int, n_layers: int) -> np.ndarray:
    """The stacked-row gather of a ``select_(index)`` over ``n_layers * rows`` stacked rows:
    entry ``j`` is the old stacked row that new stacked row ``j`` copies (layer ``i``'s row
    ``r`` of the kept ``M`` rows is new stacked row ``i * M + r``, old stacked row
    ``i * rows + index[r]``); the rows past ``n_layers * M`` keep themselves."""
    M = index.shape[0]
    full = np.arange(n_layers * rows, dtype=np.int64)
    offsets = (np.arange(n_layers, dtype=np.int64) * rows).reshape(-1, 1)
    full[: n_layers * M] = (index.reshape(1, -1) + offsets).reshape(-1)
    return full


class KVCache(_Layout):
    """Stacked self-attention caches in torch tensors, written by the compiled in-place ops.

    Build one with :meth:`allocate`. Attributes: ``keys`` / ``values`` (stacked, ``[n_layers *
    N, H, L, d_k]``), ``key_layers`` / ``value_layers`` (per-layer views), ``positions`` (int64
    ``[n_layers * N]``, the write position of every stacked row; ``step_positions`` = its first N
    entries, the decoder step's ``positions`` input), ``new_keys`` / ``new_values`` and their
    ``new_key_layers`` / ``new_value_layers`` views (staging, ``[n_layers * N, H, 1, d_k]``, or
    ``None`` and empty lists), ``error_flag`` (int32 ``[1]`` on the device, or ``None``) with its
    host copy ``error_flag_host``, ``length`` and ``capacity``.

    ``append_`` and ``reorder_`` must run under ``torch.inference_mode()`` (the buffers are
    inference tensors), on the stream the caller computes on.
    """

    def __init__(
        self,
        keys: "torch.Tensor",
        values: "torch.Tensor",
        n_layers: int,
        *,
        positions: "torch.Tensor",
        new_keys: Optional["torch.Tensor"] = None,
        new_values: Optional["torch.Tensor"] = None,
        error_flag: Optional["torch.Tensor"] = None,
        error_flag_host: Optional["torch.Tensor"] = None,
        append_op: Optional[Callable[..., None]] = None,
        reorder_op: Optional[Callable[..., None]] = None,
    ):
        """The cache over existing buffers (zero-filled, inference tensors); :meth:`allocate` makes them."""
        n_layers = _positive_int("n_layers", n_layers)
        if keys.dim() != 4 or keys.shape != values.shape or keys.shape[0] % n_layers:
            raise ValueError(
                f"keys and values must be [n_layers * N, H, L, d_k] of one shape, got "
                f"{tuple(keys.shape)} and {tuple(values.shape)} for {n_layers} layers"
            )
        self._init_layout(n_layers, keys.shape[0] // n_layers, keys.shape[2])
        if tuple(positions.shape) != (keys.shape[0],):
            raise ValueError(f"positions must have shape ({keys.shape[0]},), got {tuple(positions.shape)}")
        if (new_keys is None) != (new_values is None):
            raise ValueError("give both new_keys and new_values, or neither")
        if error_flag is not None and error_flag_host is None:
            raise ValueError("an error_flag needs its host copy error_flag_host")
        import torch  # noqa: PLC0415 - torch only for the torch-backed cache

        if append_op is None or reorder_op is None:
            from transformer_ext import ops  # noqa: PLC0415 - the compiled library

            append_op = append_op or ops.kv_cache_append_
            reorder_op = reorder_op or ops.kv_cache_reorder_
        self._torch = torch
        self.keys, self.values = keys, values
        self.positions = positions
        self.new_keys, self.new_values = new_keys, new_values
        self.error_flag, self.error_flag_host = error_flag, error_flag_host
        self._append, self._reorder = append_op, reorder_op
        self._set_rows(self.rows)

    def _set_rows(self, rows: int) -> None:
        """The cache over the first ``n_layers * rows`` stacked rows of its buffers (views)."""
        n = self.n_layers * rows
        self.rows = rows
        self.keys, self.values, self.positions = self.keys[:n], self.values[:n], self.positions[:n]
        self.key_layers = _views(self.keys, rows, self.n_layers)
        self.value_layers = _views(self.values, rows, self.n_layers)
        self.step_positions = self.positions[:rows]
        self.new_key_layers, self.new_value_layers = [], []
        if self.new_keys is not None:
            self.new_keys, self.new_values = self.new_keys[:n], self.new_values[:n]
            self.new_key_layers = _views(self.new_keys, rows, self.n_layers)
            self.new_value_layers = _views(self.new_values, rows, self.n_layers)
        # Row offsets of the layers in the stacked buffers, for the stacked beam index.
        self._layer_offsets = (np.arange(self.n_layers, dtype=np.int64) * rows).reshape(-1, 1)

    @classmethod
    def allocate(
        cls,
        n_layers: int,
        rows: int,
        n_heads: int,
        capacity: int,
        d_k: int,
        *,
        dtype: Any,
        device: Union[str, "torch.device"],
        staging: bool = False,
        error_flag: Optional[bool] = None,
        append_op: Optional[Callable[..., None]] = None,
        reorder_op: Optional[Callable[..., None]] = None,
    ) -> "KVCache":
        """Zero-filled stacked caches for ``rows`` rows of ``n_layers`` layers, capacity ``capacity``.

        ``staging``: also the stacked buffers a graph writes the new token's K/V into.
        ``error_flag``: pass the device error flag to the append (default: on CUDA devices; on a
        CPU device the op ignores it and raises instead, which tests use). ``append_op`` /
        ``reorder_op``: stand-ins of ``ops.kv_cache_append_`` / ``kv_cache_reorder_`` with their
        signatures (tests that observe the writes).
        """
        import torch  # noqa: PLC0415

        device = torch.device(device)
        if error_flag is None:
            error_flag = device.type == "cuda"
        stacked = (
            _positive_int("n_layers", n_layers) * _positive_int("rows", rows),
            _positive_int("n_heads", n_heads),
            _positive_int("capacity", capacity),
            _positive_int("d_k", d_k),
        )
        with torch.inference_mode():
            keys = torch.zeros(stacked, dtype=dtype, device=device)
            values = torch.zeros(stacked, dtype=dtype, device=device)
            positions = torch.zeros(stacked[0], dtype=torch.int64, device=device)
            new_keys = new_values = None
            if staging:
                new_keys = torch.zeros((stacked[0], stacked[1], 1, stacked[3]), dtype=dtype, device=device)
                new_values = torch.zeros_like(new_keys)
            flag = flag_host = None
            if error_flag:
                flag = torch.zeros(1, dtype=torch.int32, device=device)
                flag_host = torch.zeros(1, dtype=torch.int32, pin_memory=device.type == "cuda")
        return cls(
            keys,
            values,
            n_layers,
            positions=positions,
            new_keys=new_keys,
            new_values=new_values,
            error_flag=flag,
            error_flag_host=flag_host,
            append_op=append_op,
            reorder_op=reorder_op,
        )

    @property
    def dtype(self) -> "torch.dtype":
        return self.keys.dtype

    @property
    def device(self) -> "torch.device":
        return self.keys.device

    def begin_step(self) -> "torch.Tensor":
        """Write positions for the next token (every stacked row at its row's length: one fill
        when they are all equal); returns ``step_positions`` (``[N]``, the decoder step's
        ``positions``)."""
        if self.uniform:
            self.positions.fill_(self.length)
        else:
            stacked = np.tile(self.row_lengths, self.n_layers)
            self.positions.copy_(self._torch.from_numpy(stacked).to(self.positions.device))
        return self.step_positions

    def append_(
        self,
        new_keys: Union[None, "torch.Tensor", Sequence["torch.Tensor"]] = None,
        new_values: Union[None, "torch.Tensor", Sequence["torch.Tensor"]] = None,
    ) -> None:
        """Write one step's new K/V of every layer at the positions :meth:`begin_step` wrote.

        ``new_keys`` / ``new_values``: stacked ``[n_layers * N, H, T, d_k]`` tensors, per-layer
        sequences of ``[N, H, T, d_k]`` (concatenated first: one allocation), or ``None`` for the
        staging buffers. One ``kv_cache_append_`` per buffer; with an error flag, a copy of it
        to the host is enqueued behind them (read by :meth:`end_step`).
        """
        if new_keys is None and new_values is None:
            if self.new_keys is None:
                raise ValueError(
                    "append_() without new K/V needs the staging buffers (allocate with staging=True)"
                )
            new_keys, new_values = self.new_keys, self.new_values
        elif new_keys is None or new_values is None:
            raise ValueError("append_() takes both new_keys and new_values, or neither (the staging buffers)")
        if not isinstance(new_keys, self._torch.Tensor):
            new_keys = self._torch.cat(list(new_keys))
        if not isinstance(new_values, self._torch.Tensor):
            new_values = self._torch.cat(list(new_values))
        flag = self.error_flag
        if flag is None:
            self._append(self.keys, new_keys, self.positions)
            self._append(self.values, new_values, self.positions)
        else:
            self._append(self.keys, new_keys, self.positions, flag)
            self._append(self.values, new_values, self.positions, flag)
            self.error_flag_host.copy_(flag, non_blocking=True)

    def end_step(self) -> None:
        """After the caller synchronised (for the logits): raise :class:`CacheOverflowError`
        if the device flag reports a skipped row, else count the token. Costs no sync."""
        host = self.error_flag_host
        if host is not None and int(host[0]) != 0:
            raise CacheOverflowError(
                f"kv_cache_append_ skipped rows whose position {self.length} + 1 exceeds the cache capacity "
                f"{self.capacity} (reported by the CUDA kernel's error flag); the decoding state is invalid"
            )
        super().end_step()

    def reorder_(self, beam_index: Any) -> None:
        """Row ``r`` of every layer becomes old row ``beam_index[r]`` over the valid prefix, in
        place (one ``kv_cache_reorder_`` per buffer). An out-of-range index is an IndexError
        naming the caller's row and value, and nothing is moved."""
        index = decoding.check_beam_index(beam_index, self.rows)
        if self.length == 0:
            return
        # Layer i's row r becomes layer i's row index[r]: the stacked index [n_layers * N].
        stacked = self._torch.from_numpy((index.reshape(1, -1) + self._layer_offsets).reshape(-1)).to(
            self.keys.device
        )
        self._reorder(self.keys, stacked, self.length)
        self._reorder(self.values, stacked, self.length)
        if not self.uniform:
            self._set_row_lengths(self.row_lengths[index])

    def select_(self, index: Any) -> None:
        """Keep ``len(index)`` rows: row ``r`` of every layer becomes old row ``index[r]`` over
        the valid prefix (:func:`transformer_ext.decoding.check_select_index`: errors name the
        caller's position and value, and nothing is moved). In place: one ``kv_cache_reorder_``
        per stacked buffer moves the kept rows of every layer to the front (only rows that
        move are copied), and every attribute becomes a view of those rows."""
        index = decoding.check_select_index(index, self.rows)
        if self.length > 0:
            stacked = _stacked_select_index(index, self.rows, self.n_layers)
            if not np.array_equal(stacked, np.arange(stacked.shape[0])):
                stacked_t = self._torch.from_numpy(stacked).to(self.keys.device)
                self._reorder(self.keys, stacked_t, self.length)
                self._reorder(self.values, stacked_t, self.length)
        lengths = self.row_lengths[index]
        self._set_rows(int(index.shape[0]))
        self._set_row_lengths(lengths)

    def extend(self, other: "KVCache") -> "KVCache":
        """A cache holding this cache's rows, then ``other``'s (of the same layers, heads, head
        size, dtype and device), each row keeping its tokens and its length: what a runner makes
        when sources join a running decoding. New buffers of ``rows + other.rows`` rows and the
        larger capacity; each cache's valid prefix is copied once (the stacked layout puts every
        layer's rows together, so the rows cannot grow in place)."""
        _check_extend(self, other)
        new = KVCache.allocate(
            self.n_layers,
            self.rows + other.rows,
            self.keys.shape[1],
            max(self.capacity, other.capacity),
            self.keys.shape[3],
            dtype=self.dtype,
            device=self.device,
            staging=self.new_keys is not None,
            error_flag=self.error_flag is not None,
            append_op=self._append,
            reorder_op=self._reorder,
        )
        nl, N = self.n_layers, self.rows
        with self._torch.inference_mode():
            for dst, a, b in ((new.keys, self.keys, other.keys), (new.values, self.values, other.values)):
                view = dst.view(nl, new.rows, *dst.shape[1:])
                view[:, :N, :, : self.length] = a.view(nl, N, *a.shape[1:])[:, :, :, : self.length]
                view[:, N:, :, : other.length] = b.view(nl, other.rows, *b.shape[1:])[:, :, :, : other.length]
        new._set_row_lengths(np.concatenate([self.row_lengths, other.row_lengths]))
        return new


class HostBufferPool:
    """Host arrays carved from reused flat buffers: a decode's large allocations (its caches, and
    the same caches again each time they grow; the cross-attention K/V repeated per beam) come
    from memory an earlier decode already touched instead of new pages.

    A fresh large numpy allocation is new pages from the kernel, and the first write to each
    page is a page fault, which in a virtual machine can cost far more than the copy itself
    (benchmarks/probes/ab_exports.py measures whole decodes with and without the pool,
    ``OrtRunner(reuse_buffers=False)``). The pool keeps
    every flat buffer it made; an array it hands out is a view of one, and numpy makes every view
    hold a reference to its flat buffer, so a buffer is free again exactly when no array of its
    memory is alive (its reference count is back to the pool's own). :meth:`empty` takes the
    smallest free buffer that is large enough, or makes a new one; making one first drops the
    free buffers too small for it, and more than ``max_buffers`` free ones, so the pool holds
    about what the largest decodes in use need. Thread-safe.
    """

    def __init__(self, max_buffers: int = 8):
        self.max_buffers = _positive_int("max_buffers", max_buffers)
        self._buffers: list[np.ndarray] = []  # flat uint8 arrays
        self._lock = threading.Lock()
        self._buffers.append(np.empty(1, np.uint8))
        self._free_refs = self._refs(0)  # the count of a buffer only the pool holds
        self._buffers.clear()

    def _refs(self, i: int) -> int:
        return sys.getrefcount(self._buffers[i])

    def _is_free(self, i: int) -> bool:
        return self._refs(i) <= self._free_refs

    @property
    def nbytes(self) -> int:
        """Bytes of every buffer the pool holds, in use or free."""
        with self._lock:
            return sum(b.nbytes for b in self._buffers)

    def empty(self, shape: Sequence[int], dtype: Any = np.float32) -> np.ndarray:
        """A C-contiguous array of ``shape`` and ``dtype`` (contents undefined), a view of a pooled buffer."""
        dtype = np.dtype(dtype)
        shape = tuple(int(d) for d in shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        with self._lock:
            sizes = [b.nbytes for b in self._buffers]  # by index: no loop variable holds a buffer
            fits = [i for i in range(len(sizes)) if sizes[i] >= nbytes and self._is_free(i)]
            if fits:
                best = min(fits, key=sizes.__getitem__)
            else:
                free = [i for i in range(len(sizes)) if self._is_free(i)]
                drop = {i for i in free if sizes[i] < nbytes}
                kept = sorted((i for i in free if i not in drop), key=sizes.__getitem__)
                drop.update(kept[: max(0, len(kept) + 1 - self.max_buffers)])  # the smallest go first
                self._buffers = [self._buffers[i] for i in range(len(sizes)) if i not in drop]
                self._buffers.append(np.empty(max(nbytes, 1), np.uint8))
                best = len(self._buffers) - 1
            return self._buffers[best][:nbytes].view(dtype).reshape(shape)

    def zeros(self, shape: Sequence[int], dtype: Any = np.float32) -> np.ndarray:
        """:meth:`empty`, zero-filled."""
        out = self.empty(shape, dtype)
        out.fill(0)
        return out


class HostKVCache(_Layout):
    """Stacked self-attention caches in numpy arrays, written by indexing (no torch).

    The attributes of :class:`KVCache` that a host runner needs: ``keys`` / ``values``,
    ``key_layers`` / ``value_layers``, ``new_keys`` / ``new_values`` and their views (staging),
    ``length``, ``capacity``; there are no positions (the runner's graph input) and no flag.
    """

    # Below this many bytes moved per buffer a reorder is one fancy-indexed copy per buffer
    # (its Python overhead is lower than that of a copy per row and layer).
    _SMALL_MOVE_BYTES = 1 << 18
    # Below this many bytes per row and layer (a small model, a short prefix) it is one
    # fancy-indexed copy per buffer at any size: a copy per row and layer costs about a
    # microsecond of Python, more than moving such a slice twice (about 10 kB per microsecond).
    _SMALL_SLICE_BYTES = 1 << 14

    def __init__(
        self,
        n_layers: int,
        rows: int,
        n_heads: int,
        capacity: int,
        d_k: int,
        *,
        dtype: Any = np.float32,
        staging: bool = False,
        pool: Optional[HostBufferPool] = None,
    ):
        self._init_layout(n_layers, rows, capacity)
        shape5 = (
            self.n_layers,
            self.rows,
            _positive_int("n_heads", n_heads),
            self.capacity,
            _positive_int("d_k", d_k),
        )
        stacked = (self.n_layers * self.rows, *shape5[2:])
        zeros = np.zeros if pool is None else pool.zeros
        self.keys = zeros(stacked, dtype=dtype)  # [n_layers * N, H, L, d_k]
        self.values = zeros(stacked, dtype=dtype)
        self.new_keys = self.new_values = None
        if staging:
            self.new_keys = np.zeros((stacked[0], stacked[1], 1, stacked[3]), dtype=dtype)
            self.new_values = np.zeros_like(self.new_keys)
        self._set_rows(self.rows)

    def _set_rows(self, rows: int) -> None:
        """The cache over the first ``n_layers * rows`` stacked rows of its buffers (views):
        ``_keys5`` / ``_values5`` ``[n_layers, N, H, L, d_k]`` and the per-layer views."""
        nl = self.n_layers
        n = nl * rows
        self.rows = rows
        self.keys, self.values = self.keys[:n], self.values[:n]
        self._keys5 = self.keys.reshape(nl, rows, *self.keys.shape[1:])
        self._values5 = self.values.reshape(nl, rows, *self.values.shape[1:])
        self.key_layers = list(self._keys5)
        self.value_layers = list(self._values5)
        self._new_keys5 = self._new_values5 = None
        self.new_key_layers: list[np.ndarray] = []
        self.new_value_layers: list[np.ndarray] = []
        if self.new_keys is not None:
            self.new_keys, self.new_values = self.new_keys[:n], self.new_values[:n]
            self._new_keys5 = self.new_keys.reshape(nl, rows, *self.new_keys.shape[1:])
            self._new_values5 = self.new_values.reshape(nl, rows, *self.new_values.shape[1:])
            self.new_key_layers = list(self._new_keys5)
            self.new_value_layers = list(self._new_values5)

    @property
    def dtype(self) -> np.dtype:
        return self.keys.dtype

    def append_(self) -> None:
        """Copy the staging buffers' new K/V into every layer at position ``length``: one
        assignment per buffer. Raises IndexError when the cache is full (nothing written)."""
        if self._new_keys5 is None:
            raise ValueError("append_() needs the staging buffers (HostKVCache(..., staging=True))")
        p = self.length
        if p >= self.capacity:
            raise IndexError(f"cannot append at position {p}: the cache holds {self.capacity} positions")
        if self.uniform:
            self._keys5[:, :, :, p] = self._new_keys5[:, :, :, 0]
            self._values5[:, :, :, p] = self._new_values5[:, :, :, 0]
            return
        # every row at its own position: one gather-scatter per buffer ([N, n_layers, H, d_k])
        rows = np.arange(self.rows)
        q = self.row_lengths
        self._keys5[:, rows, :, q] = np.swapaxes(self._new_keys5[:, :, :, 0], 0, 1)
        self._values5[:, rows, :, q] = np.swapaxes(self._new_values5[:, :, :, 0], 0, 1)

    def reorder_(self, beam_index: Any) -> None:
        """Row ``r`` of every layer becomes old row ``beam_index[r]`` over the valid prefix, in
        place; errors as :class:`KVCache`'s (nothing is moved). See :meth:`_reorder_rows`."""
        index = decoding.check_beam_index(beam_index, self.rows)
        self._reorder_rows(index)
        if not self.uniform:
            self._set_row_lengths(self.row_lengths[index])

    def _reorder_rows(self, index: np.ndarray) -> None:
        """The moves of :meth:`reorder_` (``index`` checked).

        Only the rows that change are written (in beam search most beams keep their own row).
        A small move, or one of small slices (a row of one layer under ``_SMALL_SLICE_BYTES``),
        is one gather-and-scatter per buffer (numpy gathers into a temporary, so a
        source that is itself overwritten is read before it is). A large one is one slice copy
        per row, layer and buffer, which numpy makes directly because the slices do not
        overlap: it reads and writes the moved rows once instead of twice; sources that are
        themselves overwritten are copied aside first.
        """
        p = self.length
        if p == 0:
            return
        is_moved = index != np.arange(self.rows)
        moved = np.flatnonzero(is_moved)
        if moved.size == 0:
            return
        sources = index[moved]
        row_bytes = self._keys5[:, 0, :, :p].nbytes
        slice_bytes = row_bytes // self.n_layers
        if moved.size * row_bytes <= self._SMALL_MOVE_BYTES or slice_bytes < self._SMALL_SLICE_BYTES:
            for buf5 in (self._keys5, self._values5):
                buf5[:, moved, :, :p] = buf5[:, sources, :, :p]
            return
        clobbered = np.unique(sources[is_moved[sources]])
        saved_at = {int(s): j for j, s in enumerate(clobbered.tolist())}
        pairs = [(r, old, saved_at.get(old)) for r, old in zip(moved.tolist(), sources.tolist())]
        for buf5 in (self._keys5, self._values5):
            saved = buf5[:, clobbered, :, :p].copy() if clobbered.size else None
            for layer, layer_buf in enumerate(buf5):
                for r, old, j in pairs:
                    layer_buf[r, :, :p] = layer_buf[old, :, :p] if j is None else saved[layer, j]

    def select_(self, index: Any) -> None:
        """Keep ``len(index)`` rows: row ``r`` of every layer becomes old row ``index[r]`` over
        the valid prefix; errors as :class:`KVCache`'s (nothing is moved). In place: one
        gather per buffer moves the kept rows of every layer to the front (only the rows that
        move; numpy gathers into a temporary first), and every attribute becomes a view of
        those rows."""
        index = decoding.check_select_index(index, self.rows)
        p = self.length
        if p > 0:
            stacked = _stacked_select_index(index, self.rows, self.n_layers)
            moved = np.flatnonzero(stacked != np.arange(stacked.shape[0]))
            if moved.size:
                sources = stacked[moved]
                for buf in (self.keys, self.values):
                    buf[moved, :, :p] = buf[sources, :, :p]
        lengths = self.row_lengths[index]
        self._set_rows(int(index.shape[0]))
        self._set_row_lengths(lengths)

    def insert_(self, other: "HostKVCache", rows: Any) -> None:
        """Rows ``rows`` (distinct rows of this cache, one per row of ``other``) become
        ``other``'s rows, each keeping its tokens and its length: sources taking the row slots
        of sources that left a running decoding. In place: those rows are zero-filled and
        ``other``'s valid prefix is copied into them; no other row is touched. ``other`` must be
        of the same layers, heads, head size and dtype (TypeError / ValueError), hold no more
        positions than this cache's capacity and as many rows as ``rows`` names (ValueError)."""
        _check_extend(self, other)
        index = decoding.as_int64("rows", rows)
        if index.shape != (other.rows,) or np.unique(index).shape[0] != other.rows:
            raise ValueError(f"rows must name {other.rows} distinct rows, got {index.tolist()}")
        if index.min() < 0 or index.max() >= self.rows:
            raise IndexError(f"rows must be rows of the cache (0 .. {self.rows - 1}), got {index.tolist()}")
        p = other.length
        if p > self.capacity:
            raise ValueError(f"cannot insert rows of {p} tokens into a cache of {self.capacity} positions")
        for dst, src in ((self._keys5, other._keys5), (self._values5, other._values5)):
            dst[:, index] = 0
            if p:
                dst[:, index, :, :p] = src[:, :, :, :p]
        lengths = self.row_lengths.copy()
        lengths[index] = other.row_lengths
        self._set_row_lengths(lengths)

    def release_(self, rows: Any) -> None:
        """Rows ``rows`` hold no tokens any more (their length is 0): row slots no source holds,
        which a step still feeds (it writes their K/V at position 0) and which no longer count
        for ``length``. Their buffers are left as they are."""
        index = decoding.as_int64("rows", rows)
        if index.size and (index.min() < 0 or index.max() >= self.rows):
            raise IndexError(f"rows must be rows of the cache (0 .. {self.rows - 1}), got {index.tolist()}")
        lengths = self.row_lengths.copy()
        lengths[index] = 0
        self._set_row_lengths(lengths)

    def with_rows(self, rows: int, capacity: int, pool: Optional[HostBufferPool] = None) -> "HostKVCache":
        """A cache of ``rows`` rows (at least this cache's) and capacity ``capacity`` (at least
        ``length``): this cache's rows first, each keeping its tokens and length, the new rows
        empty; new zero-filled buffers (from ``pool`` when given)."""
        if rows < self.rows or capacity < self.length:
            raise ValueError(
                f"with_rows({rows}, {capacity}): a cache of {self.rows} rows holding {self.length} tokens "
                "needs at least as many rows and positions"
            )
        new = HostKVCache(
            self.n_layers,
            rows,
            self.keys.shape[1],
            capacity,
            self.keys.shape[3],
            dtype=self.dtype,
            staging=self.new_keys is not None,
            pool=pool,
        )
        N, p = self.rows, self.length
        if p:
            new._keys5[:, :N, :, :p] = self._keys5[:, :, :, :p]
            new._values5[:, :N, :, :p] = self._values5[:, :, :, :p]
        new._set_row_lengths(np.concatenate([self.row_lengths, np.zeros(rows - N, dtype=np.int64)]))
        return new

    def extend(self, other: "HostKVCache", pool: Optional[HostBufferPool] = None) -> "HostKVCache":
        """A cache holding this cache's rows, then ``other``'s, each row keeping its tokens and
        length (as :meth:`KVCache.extend`): new buffers (from ``pool`` when given) of the larger
        capacity, each cache's valid prefix copied once."""
        _check_extend(self, other)
        new = HostKVCache(
            self.n_layers,
            self.rows + other.rows,
            self.keys.shape[1],
            max(self.capacity, other.capacity),
            self.keys.shape[3],
            dtype=self.dtype,
            staging=self.new_keys is not None,
            pool=pool,
        )
        N = self.rows
        for dst, a, b in (
            (new._keys5, self._keys5, other._keys5),
            (new._values5, self._values5, other._values5),
        ):
            dst[:, :N, :, : self.length] = a[:, :, :, : self.length]
            dst[:, N:, :, : other.length] = b[:, :, :, : other.length]
        new._set_row_lengths(np.concatenate([self.row_lengths, other.row_lengths]))
        return new
