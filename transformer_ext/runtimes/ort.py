"""ONNX Runtime runner for an export folder: the runner protocol of :mod:`transformer_ext.decoding`.

Needs only numpy and onnxruntime (docs/DESIGN.md section 6): no torch import, cache writes by numpy
indexing. Greedy and beam search are the project's own (:mod:`transformer_ext.decoding`, which
imports only numpy); :meth:`OrtRunner.greedy` and :meth:`OrtRunner.beam_search` are thin
conveniences over them.

Memory traffic per step: every buffer the decoder reads or writes (token ids, positions, source
lengths, self- and cross-attention K/V, logits and the new K/V) is a numpy array allocated
by :meth:`OrtRunner.encode` and bound by pointer through ONNX Runtime's IO binding, so a step
allocates and copies no cache-sized tensor (but for the growth of a growing cache, every
:data:`CACHE_GROWTH` steps: below):

* ``portable`` flavour: the graph outputs the new token's K/V (``[N, H, 1, d_k]``) into bound
  buffers; the runner writes them into the caches in place (``cache[:, :, p] = new[:, :, 0]``).
  Caches and those buffers are a :class:`~transformer_ext.runtimes.kv_cache.HostKVCache`: every
  layer's K in one stacked array (V in another), bound per layer through views, so the write is
  one assignment per buffer for all layers.
* ``tensorscatter`` and ``ort`` flavours: each cache buffer is bound both as the input
  ``self_key.{i}`` and as the output ``present_key.{i}``; the graph's ``TensorScatter`` (or
  ``ort``: ``GroupQueryAttention``) writes the new row in place. The ``ort`` flavour runs on the
  CPU provider only (the runner refuses others).

Caches are zero-filled at allocation (the contract requires finite values past the prefix).
The zero-copy property holds for the CPU execution provider; other providers receive host
buffers, which ONNX Runtime copies to the device.

Growing caches (``grow_cache=True``, the default): a step's attention reads the whole bound
cache, masked past the prefix, so a cache sized for the longest output makes every early step
pay for it (about 30% of the demo model's step time with a 64-position cache). The caches start
with room for a few tokens and grow by :data:`CACHE_GROWTH` positions whenever the next token
would not fit (a new allocation, the prefix copied, the buffers bound again): their capacity
is always ``cache_len - CACHE_GROWTH * k``. The logits of ONNX Runtime's CPU kernels depend on
the capacity of that axis in their last bits (its one-row products round differently at some
capacities), so a grown cache's logits equal a full-size cache's up to float rounding, not bit
for bit: within 1e-6 on the tiny test models, and tests/test_ort_runner.py checks 1e-5 on every
flavour. ``grow_cache=False`` allocates ``cache_len`` positions once, at :meth:`OrtRunner.encode`.
A state laid out by :meth:`OrtRunner.batch_invariant` has capacities that are multiples of
:data:`SOURCE_ALIGN` instead (at most the export's ``max_cache_len``).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import sys
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import onnxruntime as ort

from transformer_ext import decoding
from transformer_ext.decoding.renamed import renamed_keywords
from transformer_ext.export_format import (
    ATTENTION_OUTPUT,
    CUSTOM_OP_FLAVOUR,
    DECODER_FILE,
    ENCODER_FILE,
    FEW_ROWS_DECODER_FILE,
    HASHES_KEY,
    MANIFEST_NAME,
    NEW_KV_FLAVOURS,
    InvalidGraphError,
    check_io,
    cross_per_source,
    custom_ops_library,
    dtype_from_ort,
    file_sha256,
    manifest_few_rows,
    manifest_max_cache_len,
    manifest_quantization,
    quantization_cpu_warning,
    read_manifest,
    verify_weights,
)

from . import denormals
from .info import RunnerInfo
from .kv_cache import CacheStateViews, HostBufferPool, HostKVCache
from .search_head import SearchHead

logger = logging.getLogger(__name__)
# The session options a custom-op export's operator library is registered with (every build of it
# registers the one domain transformer_ext, which ONNX Runtime takes once per options object).
_REGISTERED_OPTIONS: "weakref.WeakSet[ort.SessionOptions]" = weakref.WeakSet()

__all__ = [
    "OrtRunner",
    "OrtState",
    "GRAPH_OPTIMIZATION_LEVELS",
    "DISABLED_OPTIMIZERS",
    "CACHE_GROWTH",
    "FORCE_SPINNING_STOP",
    "FEW_ROWS_MODES",
]

CACHE_GROWTH = 16  # positions a growing cache gains at a time (the module docstring says why 16)

# ONNX Runtime's session option that stops the intra-op threads' spinning when a run returns
# (OrtRunner's ``stop_spinning_after_run``, default on). With 2 intra-op threads on 2 cores the
# decoder's pool threads otherwise spin on after a step returns and take a core from what follows
# it: the search head (a session of its own, whose threads sleep) and the host's search. Measured
# with benchmarks/probes/ab_exports.py on a 2-core Xeon with AMX, 2 threads, 48 tokens, spinning on
# against stopped (benchmarks/results/ab_spinning_stop_*_2t_xeon.json): opus-mt dimensions int8
# beam 4 batch 16 1.28x (its search head runs over 64 x 58,101 logits after every step), batch 1
# 1.04x, greedy batch 1 1.09x, batch 16 1.01x; float32 1.08 / 1.02 / 1.05 / 1.01x; `base` int8
# beam 4 batch 64 / 16 1.03 / 1.05x, greedy batch 16 / 1 1.18 / 1.10x; the same tokens. Threads
# still spin within a run, where a sleeping thread's wake-up would cost each operator.
FORCE_SPINNING_STOP = "session.force_spinning_stop"
DISABLE_PREPACKING = "session.disable_prepacking"  # OrtRunner(pack_weights=False)
# Whether the runner's sessions allocate through ONNX Runtime's CPU arena (its default). Off: the
# arena keeps every block it was once given, and a session's load frees much of what it allocates
# (the buffers it packs weights through, an int8 few-row step's folded weights), which the arena
# then holds for the session's life. Measured at opus-mt-en-de size, int8, 2 threads (each
# stage's RSS from /proc/self/status, docs/footprint.md): the runner held 160 MiB after loading
# against 189.5 with the arena, 169.5 against 198.8 after its first translation, and peaked at
# 259 MiB against 299 once it had also run a batch of 4 (the dynamic step opened). The graphs'
# intermediate tensors then come from malloc (the mmap threshold _heap_for_loading sets leaves
# blocks of up to 32 MiB on its heap).
CPU_ARENA = False

# OrtRunner's ``few_rows`` choices (the class docstring).
FEW_ROWS_MODES = ("auto", "never", "always")


def _call(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``: a runner's graph call without :func:`denormals.call`."""
    return fn(*args, **kwargs)


GRAPH_OPTIMIZATION_LEVELS = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}

# Graph optimizers the runner's sessions leave out. SkipLayerNormFusion replaces each residual
# ``Add`` + ``LayerNormalization`` with the contrib ``SkipLayerNormalization``, whose CPU kernel
# (ONNX Runtime 1.32, 2 threads) took 2.5x (4 rows) to 10x (256 rows) the time of the two nodes
# it replaces on [rows, 1, 512] floats: 18 of them per step of a 6-layer decoder. Applied when
# every provider is the CPU one.
DISABLED_OPTIMIZERS = ("SkipLayerNormFusion",)


@dataclass
class OrtState(CacheStateViews):
    """Decoding state of :class:`OrtRunner` for N = batch * beam_size rows."""

    binding: Any  # ort.IOBinding of ``session``, bound to the buffers below (OrtRunner._bind)
    input_ids: np.ndarray  # [N, 1] int64, refilled every step
    positions: np.ndarray  # [N] int64, refilled every step
    src_lengths: np.ndarray  # [N] int64
    # Per layer [N / beams, H, S, d_k]: one row per source, serving its ``beams`` consecutive
    # rows (an export whose step takes them so), else one per row (``beams`` 1).
    cross_keys: list[np.ndarray]
    cross_values: list[np.ndarray]
    # The self-attention caches, stacked over layers and zero-filled at allocation, with the
    # stacked buffers the portable graph writes the new K/V into.
    cache: HostKVCache
    logits: np.ndarray  # [N, V] float32, written by every step
    attention: Optional[np.ndarray] = None  # [N, S] float32, an export with the attention output
    # encode's cache_len: the positions the state holds; a growing cache (``cache``) holds
    # ``max_cache_len - CACHE_GROWTH * k`` of them at a time (the module docstring)
    max_cache_len: int = 0
    beams: int = 1  # rows per cross-attention row
    session: Any = None  # the decoder step session that runs this state's steps (``binding``'s)
    # the longest source's length: the columns of the attention output a step returns (a
    # batch-invariant state's cross K/V hold zero columns after it, OrtRunner.batch_invariant)
    src_width: int = 0
    # OrtRunner.batch_invariant: cache capacities are multiples of SOURCE_ALIGN
    aligned: bool = False

    @property
    def cache_len(self) -> int:
        """The capacity the state was encoded for (a growing cache grows up to it)."""
        return self.max_cache_len


# A batch-invariant state (OrtRunner.batch_invariant) holds its cross-attention K/V padded with
# zero source positions (masked like any padding) to a multiple of SOURCE_ALIGN, and caches of
# such capacities. ONNX Runtime's CPU kernels sum the attention over
# the source positions in blocks of 4 and then the rest: padded to such a multiple, a row gets
# the same cross-attention (to the bit) however long the other sources of its batch are, which
# it does not otherwise (measured on the tiny test model: source lengths 1 to 40, padded widths
# up to 64). So a source's result does not depend on its batch (decoding.SearchState). 16 also
# covers kernels that work in blocks of 8 or 16 floats; the extra positions cost a few
# multiply-adds per row and layer.
SOURCE_ALIGN = 16


def _glibc_functions() -> tuple[Optional[Any], Optional[Any]]:
    """glibc's ``malloc_trim`` and ``mallopt`` (None elsewhere: musl, macOS, Windows)."""
    if not sys.platform.startswith("linux"):
        return None, None
    try:
        libc = ctypes.CDLL(None)
        trim, mallopt = libc.malloc_trim, libc.mallopt
    except (OSError, AttributeError):
        return None, None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return trim, mallopt


_MALLOC_TRIM, _MALLOPT = _glibc_functions()
# mallopt parameters (glibc's malloc.h) and the settings of a load (_heap_for_loading)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
LOAD_MMAP_THRESHOLD = 128 << 10  # glibc's initial threshold, held fixed while sessions are made
RUN_MMAP_THRESHOLD = 32 << 20  # afterwards: the most glibc's own adjustment raises it to (64-bit)
RUN_TRIM_THRESHOLD = 64 << 20  # and twice that for the top of the heap, as glibc's adjustment sets it


def _release_free_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc ``malloc_trim(0)``; nothing where
    it is not available). Frees nothing in use."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _malloc_configured() -> bool:
    """Whether this process's glibc malloc was configured through its environment (the
    ``MALLOC_*_`` variables or ``glibc.malloc`` tunables), which the runner then leaves alone."""
    return any(k.startswith("MALLOC_") and k.endswith("_") for k in os.environ) or (
        "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", "")
    )


@contextlib.contextmanager
def _heap_for_loading():
    """Make sessions with memory they free going back to the system at once.

    Making a session maps the weights it packs, packs them and (an int8 few-row step) folds
    the weights it builds from shared bytes, freeing the sources as it goes; glibc keeps freed
    blocks of up to its (self-adjusting) mmap threshold on its heap, where the next allocations
    of a session do not always fit, so RSS peaks over what the sessions keep. Inside this
    block the threshold is glibc's initial 128 KiB, held fixed: every large block is a mapping of
    its own, returned when freed. On leaving, the threshold becomes 32 MiB and the heap's trim
    threshold 64 MiB, the values glibc's own adjustment tends to (so the decoding's buffers come
    from the heap, as they would have). The free heap is handed back before (what was freed
    before the load) and after. Measured at opus-mt size (docs/footprint.md): an int8 runner's
    peak after its first translation 185 MiB where it was 190-204 MiB. Nothing is changed where
    glibc is not the allocator or the process configured malloc through its environment."""
    if _MALLOPT is None or _malloc_configured():
        yield
        return
    _release_free_heap()
    _MALLOPT(M_MMAP_THRESHOLD, LOAD_MMAP_THRESHOLD)
    try:
        yield
    finally:
        _MALLOPT(M_MMAP_THRESHOLD, RUN_MMAP_THRESHOLD)
        _MALLOPT(M_TRIM_THRESHOLD, RUN_TRIM_THRESHOLD)
        _release_free_heap()


def _aligned(width: int) -> int:
    return -(-int(width) // SOURCE_ALIGN) * SOURCE_ALIGN


def _io(values) -> list[dict]:
    return [
        {
            "name": v.name,
            "dtype": dtype_from_ort(v.type),
            "shape": [d if isinstance(d, int) else str(d) for d in v.shape],
        }
        for v in values
    ]


def _check_bools(**flags: Any) -> None:
    for name, value in flags.items():
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{name} must be a bool, got {value!r}")


class OrtRunner(decoding.SearchMethods):
    """Runs ``encoder.onnx`` / ``decoder_step.onnx`` of an export folder with ONNX Runtime.

    Args:
        export_dir: a folder written by ``python -m export.onnx``.
        providers: ONNX Runtime execution providers (default ``["CPUExecutionProvider"]``).
        intra_op_num_threads: threads of one operator (default: ONNX Runtime's choice).
        graph_optimization_level: ``"disable"``, ``"basic"``, ``"extended"`` or ``"all"`` (default).
        allow_spinning: whether idle intra-op threads spin (ONNX Runtime's default, lowest latency
            on an idle machine) or sleep (far better when the cores are shared with other work);
            ``None`` keeps ONNX Runtime's default.
        stop_spinning_after_run: stop the spinning of the intra-op threads as soon as each graph
            run returns (default; ONNX Runtime's ``session.force_spinning_stop``): they still spin
            inside a run, between its operators, but not into the host work and the search head
            that follow it, whose cores they would otherwise take (the comment at
            :data:`FORCE_SPINNING_STOP`).
            False keeps ONNX Runtime's behaviour (threads spin on for a while after a run).
        session_options: a ready ``ort.SessionOptions``; overrides the four options above.
        grow_cache: start the self-attention caches small and grow them as tokens arrive
            (default; the same logits up to rounding, see the module docstring), or allocate
            ``cache_len`` positions once at encode (False).
        reuse_buffers: take the caches and the per-beam cross-attention K/V from a pool of
            buffers kept across decodes (default: no new pages, and no page faults, once the
            first decode of a size has run; the runner then holds about the largest decode's
            memory until it is closed), or allocate them afresh for every decode (False).
        flush_denormals: run every graph with denormal floats flushed to zero (default), on the
            calling thread for the duration of the run and on the session's pool threads
            (:mod:`~transformer_ext.runtimes.denormals`: the padding's ``-inf`` otherwise makes
            every padded softmax several times slower); False leaves the CPU's setting alone.
            With ``session_options`` given, the pool threads keep what those options say
            (``session.set_denormal_as_zero``). Ignored on platforms where the module does not
            apply (``denormals.AVAILABLE``).
        manifest: the folder's manifest, when the caller has read it already
            (:func:`transformer_ext.runtimes.open_export_dir` does); else it is read here.
        few_rows: when an int8 export's few-row decoder step (``decoder_step_few_rows.onnx``, its
            weight products as 8-bit ``MatMulNBits``; the manifest's ``quantization.few_rows``)
            runs instead of ``decoder_step.onnx``: ``"auto"`` (default) for steps of at most its
            ``max_rows`` rows when the runner has at least its ``min_threads`` intra-op threads,
            runs on the CPU provider only and this CPU has the int8-kernel flags the exporting
            CPU had; ``"never"``; ``"always"`` every step, at any row count (the quality gate
            checks the graph so; an export without one is then a ValueError). Both graphs take
            the same buffers, so a decode's rows may move from one to the other when finished
            sources are removed.
        pack_weights: let ONNX Runtime pack the weight products into memory of the session's own
            at load (default: its fastest kernels), or leave them reading ``weights.data``'s
            mapping (False: ``session.disable_prepacking``; several processes on one folder then
            share the weights' pages, at a speed cost: ``runtimes.procpool`` has numbers).
            Ignored with ``session_options``.
        preload_steps: open every decoder step session the runner may run when it is made
            (True), or (default, False) open an int8 export's dynamic step (``decoder_step.onnx``)
            at its first step of more rows than the few-row step runs, when the runner uses a
            few-row step and the manifest records the dynamic step's SHA-256 (checked at load:
            a changed or missing graph is still refused there). A runner whose steps all fit the
            few-row step then never holds the dynamic step's packed weights (about a third of an
            int8 runner's memory); the first larger step pays for opening it (a fraction of a
            second at opus-mt size). Folders without recorded hashes open every step at load.

    ``info`` (:class:`~transformer_ext.runtimes.info.RunnerInfo`) describes the model, the
    export's cache capacity, its precision and flavour.

    Raises:
        ManifestError: the folder has no valid ``manifest.json``, or a graph does not match it.
        InvalidGraphError: an ``.onnx`` file is missing or cannot be loaded (corrupt).
    """

    def __init__(
        self,
        export_dir: str | os.PathLike,
        *,
        providers: Optional[Sequence[Any]] = None,
        intra_op_num_threads: Optional[int] = None,
        graph_optimization_level: str = "all",
        allow_spinning: Optional[bool] = None,
        stop_spinning_after_run: bool = True,
        session_options: Optional[ort.SessionOptions] = None,
        manifest: Optional[Mapping[str, Any]] = None,
        grow_cache: bool = True,
        reuse_buffers: bool = True,
        flush_denormals: bool = True,
        few_rows: str = "auto",
        pack_weights: bool = True,
        preload_steps: bool = False,
    ):
        if few_rows not in FEW_ROWS_MODES:
            raise ValueError(f"few_rows must be one of {list(FEW_ROWS_MODES)}, got {few_rows!r}")
        _check_bools(
            grow_cache=grow_cache,
            reuse_buffers=reuse_buffers,
            flush_denormals=flush_denormals,
            stop_spinning_after_run=stop_spinning_after_run,
            pack_weights=pack_weights,
            preload_steps=preload_steps,
        )
        self.grow_cache = bool(grow_cache)
        self.pack_weights = bool(pack_weights)
        # Graph runs with denormals flushed to zero (runtimes.denormals: the padding's -inf made
        # every padded softmax several times slower), on this thread and on the session's pool.
        self.flush_denormals = bool(flush_denormals)
        self._call = denormals.call if self.flush_denormals else _call
        # The caches and the per-beam cross K/V of every decode (HostBufferPool says why).
        self._pool = HostBufferPool() if reuse_buffers else None
        self.export_dir = os.fspath(export_dir)
        self.manifest = dict(read_manifest(self.export_dir) if manifest is None else manifest)
        # The shared weights file is there and of its size before anything else is read (its
        # SHA-256, a read of the whole file, is checked by _load before the first session).
        verify_weights(self.export_dir, self.manifest, sha256=False)
        cpu_warning = quantization_cpu_warning(self.manifest, self.export_dir)
        if cpu_warning:
            logger.warning("%s", cpu_warning)
        quantization = manifest_quantization(self.manifest)
        self.info = RunnerInfo.from_config(
            self.manifest["model_config"],
            runtime="onnxruntime",
            config_file=os.path.join(self.export_dir, MANIFEST_NAME),
            max_cache_len=manifest_max_cache_len(self.manifest),
            precision=quantization["scheme"] if quantization else "fp32",
            flavour=self.manifest["flavour"],
        )

        if session_options is None:
            session_options = self._default_session_options(
                intra_op_num_threads, graph_optimization_level, allow_spinning, stop_spinning_after_run
            )
        self._session_options = session_options
        self._head: Optional[SearchHead] = None  # the search head's session, made at first use
        self.providers = list(providers) if providers else ["CPUExecutionProvider"]
        if self.info.flavour == "ort" and not self._cpu_only():
            raise ValueError(
                f"{self.export_dir} is an export of the ort flavour (ONNX Runtime's CPU contrib operator "
                f"GroupQueryAttention, float32), which runs on the CPUExecutionProvider only, not on "
                f"{self.providers}; export with --flavour portable or tensorscatter for other providers"
            )
        self._register_custom_ops(session_options)
        graphs = self.manifest["graphs"]
        self._few_max_rows = self._few_rows_max_rows(few_rows, session_options)
        # The dynamic step opens at its first use (the ``decoder`` property) when the few-row step
        # may run instead and the graph is the one the manifest records (preload_steps says why).
        defer = not preload_steps and self._few_max_rows > 0 and self._graph_checked(DECODER_FILE)
        self._decoder: Optional[ort.InferenceSession] = None
        self._decoder_lock = threading.Lock()
        # The few-row step first: the weights it folds and packs at load are the largest
        # transient of a load: made first, it rises over the least memory.
        files = [FEW_ROWS_DECODER_FILE] if self._few_max_rows else []
        files.append(ENCODER_FILE)
        if not defer:
            files.append(DECODER_FILE)
        sessions = self._load(files, session_options)
        self.encoder = sessions[ENCODER_FILE]
        self._few: Optional[ort.InferenceSession] = sessions.get(FEW_ROWS_DECODER_FILE)
        self._decoder = sessions.get(DECODER_FILE)
        self._encoder_outputs = [o["name"] for o in graphs["encoder"]["outputs"]]
        # The step takes the cross-attention K/V once per source (format version 4 on)
        self.cross_per_source = cross_per_source(graphs)
        # An export made with --attention: the decoder step's optional output "attention"
        self.has_attention = any(o["name"] == ATTENTION_OUTPUT for o in graphs["decoder_step"]["outputs"])
        self._log_loaded(defer)

    def _log_loaded(self, deferred: bool) -> None:
        if any(p != "CPUExecutionProvider" for p in self.encoder.get_providers()):
            logger.warning(
                "providers %s: the runner's buffers live in host memory, so ONNX Runtime copies them "
                "to the device at every step",
                self.encoder.get_providers(),
            )
        logger.info(
            "ONNX Runtime runner on %s (%s flavour, providers %s%s)",
            self.export_dir,
            self.info.flavour,
            self.encoder.get_providers(),
            f"; {DECODER_FILE} opens at its first step of more than {self._few_max_rows} rows"
            if deferred
            else "",
        )

    def _load(self, files: Sequence[str], options: ort.SessionOptions) -> dict[str, ort.InferenceSession]:
        """The sessions of ``files`` in that order, each checked against the manifest's graph,
        once the shared weights file is the one the manifest records (its SHA-256: nothing is
        loaded from a changed file).

        Peak memory: the sessions are made inside :func:`_heap_for_loading` (what they free
        while they are made goes back to the system at once)."""
        verify_weights(self.export_dir, self.manifest)
        with _heap_for_loading():
            # Made inside self._call: ONNX Runtime sets FTZ / DAZ on the thread that makes a
            # session with "session.set_denormal_as_zero" (as well as on the session's pool
            # threads), and denormals.call gives this thread its own setting back.
            return {filename: self._call(self._open_graph, filename, options) for filename in files}

    def _open_graph(self, filename: str, options: ort.SessionOptions) -> ort.InferenceSession:
        """A session of the graph ``filename``, its inputs and outputs checked against the
        manifest's (the decoder step's for the few-row step, which takes the same)."""
        session = self._session(filename, options)
        graph = "encoder" if filename == ENCODER_FILE else "decoder_step"
        check_io(
            filename,
            self.manifest["graphs"][graph],
            _io(session.get_inputs()),
            _io(session.get_outputs()),
        )
        return session

    def _graph_checked(self, filename: str) -> bool:
        """Whether the manifest records ``filename``'s SHA-256 and the file has it (False: none
        recorded). Raises InvalidGraphError when the file is missing or differs."""
        expected = (self.manifest.get(HASHES_KEY) or {}).get(filename)
        if not isinstance(expected, str):
            return False
        path = os.path.join(self.export_dir, filename)
        if not os.path.isfile(path):
            raise InvalidGraphError(f"{path} not found (the export folder is incomplete; export it again)")
        if file_sha256(path) != expected:
            raise InvalidGraphError(
                f"{path} is not the graph this export was written with (its SHA-256 differs from the one "
                f"{MANIFEST_NAME} records): copy the whole export folder again, or export the model again"
            )
        return True

    @property
    def decoder(self) -> ort.InferenceSession:
        """The session of ``decoder_step.onnx``; opened here at first use when the runner deferred
        it (``preload_steps``, the class docstring)."""
        if self._decoder is None:
            with self._decoder_lock:
                if self._decoder is None:
                    logger.info("%s: opening %s", self.export_dir, DECODER_FILE)
                    with _heap_for_loading():
                        self._decoder = self._call(self._open_graph, DECODER_FILE, self._session_options)
        return self._decoder

    def _default_session_options(
        self,
        intra_op_num_threads: Optional[int],
        graph_optimization_level: str,
        allow_spinning: Optional[bool],
        stop_spinning_after_run: bool,
    ) -> ort.SessionOptions:
        """The session options of the constructor's arguments (the class docstring)."""
        options = ort.SessionOptions()
        if intra_op_num_threads is not None:
            options.intra_op_num_threads = int(intra_op_num_threads)
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        # Without the session's CPU arena (CPU_ARENA says why): what a session allocates while it
        # packs its weights goes back to the system once freed.
        options.enable_cpu_mem_arena = CPU_ARENA
        if graph_optimization_level not in GRAPH_OPTIMIZATION_LEVELS:
            raise ValueError(
                f"graph_optimization_level must be one of {sorted(GRAPH_OPTIMIZATION_LEVELS)}, "
                f"got {graph_optimization_level!r}"
            )
        options.graph_optimization_level = GRAPH_OPTIMIZATION_LEVELS[graph_optimization_level]
        if allow_spinning is not None:
            options.add_session_config_entry(
                "session.intra_op.allow_spinning", "1" if allow_spinning else "0"
            )
        if stop_spinning_after_run:
            options.add_session_config_entry(FORCE_SPINNING_STOP, "1")
        if not self.pack_weights:
            options.add_session_config_entry(DISABLE_PREPACKING, "1")
        if self.flush_denormals:
            for key, value in denormals.session_config().items():
                options.add_session_config_entry(key, value)
        return options

    def _few_rows_max_rows(self, mode: str, options: ort.SessionOptions) -> int:
        """The most rows the few-row decoder step runs (``sys.maxsize``: every step), or 0 when
        the runner does not use one (``few_rows``, the class docstring)."""
        entry = manifest_few_rows(self.manifest)
        if entry is None or mode == "never":
            if mode == "always":
                raise ValueError(
                    f"few_rows='always': {self.export_dir} has no few-row decoder step "
                    f"({FEW_ROWS_DECODER_FILE}; python -m export.onnx --quantize int8 writes one)"
                )
            return 0
        if mode == "auto":
            threads = options.intra_op_num_threads or os.cpu_count() or 1  # 0: ONNX Runtime's default
            if not self._cpu_only():
                reason = f"providers {self.providers} (it is for the CPU provider)"
            elif threads < entry["min_threads"]:
                reason = f"{threads} intra-op thread(s), fewer than its {entry['min_threads']}"
            elif quantization_cpu_warning(self.manifest):
                reason = "this CPU lacks int8-kernel flags the exporting CPU had"
            else:
                reason = None
            if reason:
                logger.info("%s: few-row decoder step not used: %s", self.export_dir, reason)
                return 0
        return entry["max_rows"] if mode == "auto" else sys.maxsize

    @property
    def step_sessions(self) -> dict[str, ort.InferenceSession]:
        """The decoder step sessions this runner may run, by file: ``decoder_step.onnx`` and,
        when the runner uses one, the few-row step's."""
        sessions = {DECODER_FILE: self.decoder}
        if self._few is not None:
            sessions[FEW_ROWS_DECODER_FILE] = self._few
        return sessions

    def _decoder_for(self, rows: int) -> ort.InferenceSession:
        """The decoder step session for steps of ``rows`` rows."""
        return self._few if rows <= self._few_max_rows else self.decoder

    def _register_custom_ops(self, options: ort.SessionOptions) -> None:
        """A custom-op export's operator library (checked against the manifest's SHA-256)
        registered with the session options before any session is made."""
        library = custom_ops_library(self.export_dir, self.manifest)
        if library is None:
            return
        if not self._cpu_only():
            raise ValueError(
                f"{self.export_dir} is an export of the {CUSTOM_OP_FLAVOUR} flavour (a CPU operator of its "
                f"own library, {os.path.basename(library)}), which runs on the CPUExecutionProvider only, not on "
                f"{self.providers}; export with --flavour portable for other providers"
            )
        if options in _REGISTERED_OPTIONS:  # a second registration in one options object fails
            return
        try:
            options.register_custom_ops_library(library)
        except Exception as exc:  # onnxruntime raises its own Fail / RuntimeError types
            raise InvalidGraphError(
                f"{library}: ONNX Runtime cannot load this operator library ({exc})"
            ) from exc
        _REGISTERED_OPTIONS.add(options)

    def _cpu_only(self) -> bool:
        """Whether every provider asked for is the CPU one (``DISABLED_OPTIMIZERS`` is about its kernels)."""
        names = [p[0] if isinstance(p, (tuple, list)) else p for p in self.providers]
        return all(name == "CPUExecutionProvider" for name in names)

    def _session(self, filename: str, options: ort.SessionOptions) -> ort.InferenceSession:
        path = os.path.join(self.export_dir, filename)
        if not os.path.isfile(path):
            raise InvalidGraphError(f"{path} not found (the export folder is incomplete; export it again)")
        try:
            return ort.InferenceSession(
                path,
                sess_options=options,
                providers=self.providers,
                disabled_optimizers=list(DISABLED_OPTIMIZERS) if self._cpu_only() else None,
            )
        except Exception as exc:  # ORT raises its own Fail / InvalidProtobuf / InvalidGraph types
            raise InvalidGraphError(f"ONNX Runtime cannot load {path}: {exc}") from exc

    # ------------------------------------------------------------------ runner protocol

    @renamed_keywords({"num_beams": "beam_size"}, formula=False)
    def encode(self, input_ids: Any, src_lengths: Any, cache_len: int, beam_size: int = 1) -> OrtState:
        """Encode ``input_ids [B, S]`` once; repeat each row ``beam_size`` times; allocate and bind."""
        info = self.info
        ids, lengths, cache_len, K = decoding.check_encode_args(
            input_ids,
            src_lengths,
            cache_len,
            beam_size,
            src_vocab_size=info.src_vocab_size,
            max_positions=info.max_positions,
        )
        if info.max_cache_len is not None and cache_len > info.max_cache_len:
            raise ValueError(
                f"cache_len = {cache_len} exceeds what this export supports (max_cache_len = {info.max_cache_len}, "
                "the largest cache capacity it was exported for); generate fewer tokens or export with a larger "
                "--cache-len"
            )
        B, S = ids.shape

        outs = dict(
            zip(
                self._encoder_outputs,
                self._call(
                    self.encoder.run, self._encoder_outputs, {"input_ids": ids, "src_lengths": lengths}
                ),
            )
        )
        N = B * K

        def rows(a: np.ndarray) -> np.ndarray:  # each source row repeated K times, contiguous
            if K == 1:
                return np.ascontiguousarray(a)
            out = self._empty((a.shape[0] * K, *a.shape[1:]), a.dtype)
            out.reshape(a.shape[0], K, *a.shape[1:])[...] = a[:, None]
            return out

        # Once per source when the step takes them so (its beams read them as one product)
        cross = (lambda a: np.ascontiguousarray(a)) if self.cross_per_source else rows
        cross_keys = [cross(outs[f"cross_key.{i}"]) for i in range(info.n_layers)]
        cross_values = [cross(outs[f"cross_value.{i}"]) for i in range(info.n_layers)]
        state = OrtState(
            binding=None,  # made by _bind
            input_ids=np.zeros((N, 1), dtype=np.int64),
            positions=np.zeros(N, dtype=np.int64),
            src_lengths=rows(lengths),
            cross_keys=cross_keys,
            cross_values=cross_values,
            cache=HostKVCache(
                info.n_layers,
                N,
                info.n_heads,
                cache_len - CACHE_GROWTH * ((cache_len - 1) // CACHE_GROWTH)
                if self.grow_cache
                else cache_len,
                info.d_k,
                dtype=np.float32,
                staging=info.flavour in NEW_KV_FLAVOURS,
                pool=self._pool,
            ),
            logits=np.zeros((N, info.tgt_vocab_size), dtype=np.float32),
            attention=np.zeros((N, S), dtype=np.float32) if self.has_attention else None,
            max_cache_len=cache_len,
            beams=K if self.cross_per_source else 1,
            src_width=S,
        )
        self._bind(state)
        return state

    def _bind(self, state: OrtState) -> None:
        """A new IO binding of the session for ``state``'s row count, bound to its buffers."""
        state.session = self._decoder_for(state.num_rows)
        b = state.binding = state.session.io_binding()

        def bind_in(name: str, arr: np.ndarray) -> None:
            b.bind_input(name, "cpu", 0, arr.dtype, list(arr.shape), arr.ctypes.data)

        def bind_out(name: str, arr: np.ndarray) -> None:
            b.bind_output(name, "cpu", 0, arr.dtype, list(arr.shape), arr.ctypes.data)

        bind_in("input_ids", state.input_ids)
        bind_in("positions", state.positions)
        bind_in("src_lengths", state.src_lengths)
        bind_out("logits", state.logits)
        if state.attention is not None:
            bind_out(ATTENTION_OUTPUT, state.attention)
        portable = self.info.flavour in NEW_KV_FLAVOURS
        for i in range(self.info.n_layers):
            bind_in(f"self_key.{i}", state.self_keys[i])
            bind_in(f"self_value.{i}", state.self_values[i])
            bind_in(f"cross_key.{i}", state.cross_keys[i])
            bind_in(f"cross_value.{i}", state.cross_values[i])
            if portable:
                bind_out(f"new_key.{i}", state.new_keys[i])
                bind_out(f"new_value.{i}", state.new_values[i])
            else:  # one buffer as input and output: TensorScatter updates it in place
                bind_out(f"present_key.{i}", state.self_keys[i])
                bind_out(f"present_value.{i}", state.self_values[i])

    def step(self, state: OrtState, tokens: Any) -> np.ndarray:
        """Feed one token per row at the current position; returns float32 logits ``[N, V]``."""
        self._run_step(state, tokens)
        return state.logits.copy()

    def step_top_k(
        self, state: OrtState, tokens: Any, k: int, columns: Any
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`step`, then the search head (:mod:`~transformer_ext.runtimes.search_head`) on its
        logits: ``(top_log_probs [N, min(k, V)], top_ids, column_log_probs [N, M], logits)``, the
        log-probabilities of each row's best ``k`` tokens and of the int64 ``columns [N, M]`` (token
        ids), and the logits ``[N, V]`` (the state's buffer: valid until the next step). The
        runner protocol's optional method (:class:`transformer_ext.decoding.Runner`)."""
        V = self.info.tgt_vocab_size
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(f"k must be an int >= 1, got {k!r}")
        cols = np.ascontiguousarray(columns)
        if cols.dtype != np.int64 or cols.ndim != 2 or cols.shape[0] != state.num_rows or cols.shape[1] < 1:
            raise ValueError(
                f"columns must be int64 [{state.num_rows}, M >= 1] token ids, got {cols.dtype} {list(cols.shape)}"
            )
        if cols.size and (cols.min() < 0 or cols.max() >= V):
            raise ValueError(
                f"columns must hold target token ids 0 .. {V - 1}, got {int(cols.min())} .. {int(cols.max())}"
            )
        self._run_step(state, tokens)
        if self._head is None:
            self._head = self._call(
                SearchHead, self._session_options.intra_op_num_threads, self.flush_denormals
            )
        top, ids, picked = self._call(self._head, state.logits, min(int(k), V), cols)
        return top, ids, picked, state.logits

    def _run_step(self, state: OrtState, tokens: Any) -> None:
        """The decoder step into ``state``'s buffers (logits, caches)."""
        cache = state.cache
        p = cache.length
        tok = decoding.check_step_tokens(
            p, state.cache_len, self.info.max_positions, tokens, state.num_rows, self.info.tgt_vocab_size
        )
        if p >= cache.capacity:  # a growing cache that is full: CACHE_GROWTH positions more
            cache = self._grow(state)
        state.input_ids[:, 0] = tok
        if cache.uniform:
            state.positions.fill(p)
        else:  # rows appended to a running decoding: each at its own position
            state.positions[:] = cache.row_lengths
        self._call(state.session.run_with_iobinding, state.binding)
        if self.info.flavour in NEW_KV_FLAVOURS:
            cache.append_()  # every layer's new K/V at position p: one copy per buffer
        cache.end_step()

    def _capacity_limit(self, state: OrtState) -> int:
        """The largest capacity ``state``'s caches get: its ``cache_len`` (aligned for a
        batch-invariant state), at most the export's ``max_cache_len``."""
        limit = _aligned(state.cache_len) if state.aligned else state.cache_len
        if self.info.max_cache_len is not None:
            limit = min(limit, int(self.info.max_cache_len))
        return max(limit, state.cache_len)

    def _grow(self, state: OrtState, capacity: Optional[int] = None) -> HostKVCache:
        """``state``'s caches with :data:`CACHE_GROWTH` more positions (at most
        :meth:`_capacity_limit`), or ``capacity``: new zero-filled buffers holding the prefix,
        bound in place of the old (from the buffer pool, except for a batch-invariant state:
        :meth:`_pool_for`)."""
        old = state.cache
        p = old.length
        if capacity is None:
            capacity = min(self._capacity_limit(state), old.capacity + CACHE_GROWTH)
        cache = HostKVCache(
            old.n_layers,
            old.rows,
            self.info.n_heads,
            capacity,
            self.info.d_k,
            dtype=old.dtype,
            staging=old.new_keys is not None,
            pool=self._pool_for(state),
        )
        cache.keys[:, :, :p] = old.keys[:, :, :p]
        cache.values[:, :, :p] = old.values[:, :, :p]
        cache._set_row_lengths(old.row_lengths)
        state.cache = cache
        self._bind(state)
        return cache

    @property
    def attention_unavailable(self) -> Optional[str]:
        """Why :meth:`step_with_attention` cannot run (an export without the attention output), or None."""
        if self.has_attention:
            return None
        return (
            f"the export {self.export_dir} has no attention output: export it with "
            "`python -m export.onnx --attention` (export_onnx(..., attention=True))"
        )

    def step_with_attention(self, state: OrtState, tokens: Any) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`step` that also returns the graph's ``attention`` output ``[N, S]`` (the last
        decoder layer's cross-attention averaged over its heads); an export without it is a
        ValueError naming the flag that adds it."""
        reason = self.attention_unavailable
        if reason:
            raise ValueError(reason)
        logits = self.step(state, tokens)
        return logits, state.attention[:, : state.src_width].copy()

    def _empty(self, shape, dtype, pooled: bool = True) -> np.ndarray:
        pool = self._pool if pooled else None
        return np.empty(shape, dtype) if pool is None else pool.empty(shape, dtype)

    def _pool_for(self, state: OrtState) -> Optional[HostBufferPool]:
        """The buffer pool for ``state``'s long-lived buffers: None for a batch-invariant state
        (a running batch of continuous batching, which lives on while its caches grow, shrink
        and gain rows: pooled buffers of every size it ever had would stay with the pool, and
        a pooled small array would hold a cache-sized buffer while it lives), else the pool."""
        return None if state.aligned else self._pool

    def _pad_sources(self, a: np.ndarray, width: int, pooled: bool = True) -> np.ndarray:
        """Cross-attention K/V ``[rows, H, S, d_k]`` with zero source positions up to ``width``,
        in a pooled array (``pooled``; ``a`` itself when it is that wide and contiguous)."""
        if a.shape[2] == width and a.flags.c_contiguous:
            return a
        out = self._empty((a.shape[0], a.shape[1], width, a.shape[3]), a.dtype, pooled)
        out[:, :, : a.shape[2]] = a
        out[:, :, a.shape[2] :] = 0
        return out

    def _gather_rows(self, a: np.ndarray, index: np.ndarray, pooled: bool = True) -> np.ndarray:
        """``a[index]`` into a pooled array (``pooled``; ``index`` already checked: ``mode="clip"``
        lets numpy write into ``out`` directly instead of through a temporary)."""
        out = self._empty((index.shape[0], *a.shape[1:]), a.dtype, pooled)
        np.take(a, index, axis=0, out=out, mode="clip")
        return out

    def append(self, state: OrtState, other: OrtState) -> None:
        """Append ``other``'s rows (a state this runner encoded, usually at position 0) after
        ``state``'s, each row keeping its position: sources joining a running decoding
        (:class:`transformer_ext.decoding.SearchState`). The caches move into buffers of both
        row counts and the larger capacity (:meth:`HostKVCache.extend`); the cross-attention
        K/V are padded to the longer source (aligned for batch-invariant states) and
        concatenated, kept once per source when both states hold them so for the same number of
        beams, else one per row; the step's buffers are made for the new row count and bound."""
        if not isinstance(other, OrtState) or not isinstance(state, OrtState):
            raise TypeError(
                f"append takes two OrtState, got {type(state).__name__} and {type(other).__name__}"
            )
        width = max(state.cross_keys[0].shape[2], other.cross_keys[0].shape[2])
        aligned = state.aligned and other.aligned
        if aligned:
            width = _aligned(width)
        K = state.beams if state.beams == other.beams else 1

        def cross(a: np.ndarray, beams: int) -> np.ndarray:
            return self._pad_sources(a if beams == K else np.repeat(a, beams, axis=0), width)

        state.cross_keys = [
            np.concatenate([cross(a, state.beams), cross(b, other.beams)])
            for a, b in zip(state.cross_keys, other.cross_keys)
        ]
        state.cross_values = [
            np.concatenate([cross(a, state.beams), cross(b, other.beams)])
            for a, b in zip(state.cross_values, other.cross_values)
        ]
        state.cache = state.cache.extend(other.cache, pool=self._pool)
        state.src_lengths = np.concatenate([state.src_lengths, other.src_lengths])
        N = state.num_rows
        state.input_ids = np.zeros((N, 1), dtype=np.int64)
        state.positions = np.zeros(N, dtype=np.int64)
        state.logits = np.zeros((N, self.info.tgt_vocab_size), dtype=np.float32)
        if state.attention is not None:
            state.attention = np.zeros((N, width), dtype=np.float32)
        state.max_cache_len = max(state.max_cache_len, other.max_cache_len)
        state.beams, state.aligned = K, aligned
        state.src_width = max(state.src_width, other.src_width)
        self._bind(state)

    def insert(self, state: OrtState, other: OrtState, rows: Any) -> None:
        """Put ``other``'s rows (a state this runner encoded; both laid out by
        :meth:`batch_invariant`) into ``state``'s rows ``rows``, one per row of ``other``: rows
        released by :meth:`release` (sources that left), or new rows at the end (``rows`` then
        names ``num_rows``, ``num_rows + 1``, ... as well). Each row keeps its position
        (:class:`transformer_ext.decoding.SearchState` admits sources into row slots so).

        In place when ``state`` has the rows, the source width and the cache positions: only
        the inserted rows are written (their caches, cross-attention K/V and source lengths).
        Otherwise its buffers are made anew for the larger size first (the rows copied once)
        and bound again."""
        if not isinstance(other, OrtState) or not isinstance(state, OrtState):
            raise TypeError(
                f"insert takes two OrtState, got {type(state).__name__} and {type(other).__name__}"
            )
        if state.beams != 1 or other.beams != 1 or not (state.aligned and other.aligned):
            raise ValueError(
                "insert takes states laid out by batch_invariant (one cross-attention row per row)"
            )
        index = decoding.as_int64("rows", rows)
        N, M = state.num_rows, other.num_rows
        if index.shape != (M,) or np.unique(index).shape[0] != M or (M and index.min() < 0):
            raise ValueError(
                f"rows must name {M} distinct rows >= 0 (one per row of other), got {index.tolist()}"
            )
        grown = np.sort(index[index >= N])
        if not np.array_equal(grown, np.arange(N, N + grown.shape[0])):
            raise ValueError(
                f"rows past the state's {N} rows must be {N}, {N + 1}, ..., got {index.tolist()}"
            )
        width = max(state.cross_keys[0].shape[2], other.cross_keys[0].shape[2])
        capacity = max(state.cache.capacity, other.cache.length)
        if grown.shape[0] or width > state.cross_keys[0].shape[2] or capacity > state.cache.capacity:
            self._resize(state, N + int(grown.shape[0]), width, capacity)
        state.cache.insert_(other.cache, index)
        w = other.cross_keys[0].shape[2]
        for dst, src in ((state.cross_keys, other.cross_keys), (state.cross_values, other.cross_values)):
            for a, b in zip(dst, src):
                a[index, :, :w] = b
                a[index, :, w:] = 0
        state.src_lengths[index] = other.src_lengths
        state.max_cache_len = max(state.max_cache_len, other.max_cache_len)
        state.src_width = max(state.src_width, other.src_width)

    def _resize(self, state: OrtState, rows: int, width: int, capacity: int) -> None:
        """``state``'s buffers for ``rows`` rows (its rows first; the new ones empty), cross
        K/V of ``width`` source positions and caches of ``capacity`` positions, bound."""
        N = state.num_rows

        def grown(a: np.ndarray, fill: int = 0) -> np.ndarray:
            out = np.full((rows, *a.shape[1:]), fill, dtype=a.dtype)
            out[:N] = a
            return out

        def cross(a: np.ndarray) -> np.ndarray:
            # Not from the buffer pool: these live as long as the running state, and a pooled
            # array would hold a (possibly cache-sized) pooled buffer all that time.
            out = np.zeros((rows, a.shape[1], width, a.shape[3]), a.dtype)
            out[:N, :, : a.shape[2]] = a
            return out

        state.cross_keys = [cross(a) for a in state.cross_keys]
        state.cross_values = [cross(a) for a in state.cross_values]
        state.cache = state.cache.with_rows(rows, capacity, pool=self._pool_for(state))
        state.src_lengths = grown(state.src_lengths, 1)
        state.input_ids = np.zeros((rows, 1), dtype=np.int64)
        state.positions = np.zeros(rows, dtype=np.int64)
        state.logits = np.zeros((rows, self.info.tgt_vocab_size), dtype=np.float32)
        if state.attention is not None:
            state.attention = np.zeros((rows, width), dtype=np.float32)
        self._bind(state)

    def release(self, state: OrtState, rows: Any) -> None:
        """Rows ``rows`` of ``state`` hold no source any more (:meth:`insert` may reuse them):
        their caches count as empty, so they no longer decide how many positions a step
        reads. A step still runs them (at position 0; the caller ignores their outputs). When
        the sources left hold far fewer positions than the caches' capacity (two
        :data:`CACHE_GROWTH` steps), the caches shrink to what they hold plus one growth step."""
        state.cache.release_(rows)
        cache = state.cache
        if state.aligned and cache.capacity >= _aligned(cache.length + 1) + 2 * CACHE_GROWTH:
            self._grow(state, _aligned(cache.length + 1) + CACHE_GROWTH)

    def batch_invariant(self, state: OrtState) -> None:
        """Lay ``state`` out so that each row's logits do not depend on the other rows: its
        cross-attention K/V once per row (``beams`` 1, as a state that rows of other beam counts
        joined holds them) and its caches' capacity a multiple of :data:`SOURCE_ALIGN` (growing by
        :data:`CACHE_GROWTH`, also a multiple), its cross-attention K/V padded with zero (masked)
        source positions to such a multiple. ONNX Runtime's attention over K/V shared by a
        source's rows, and over a cache whose capacity is not such a multiple, rounds
        differently from a lone row's. :class:`transformer_ext.decoding.SearchState` lays out
        every state so, giving a source the same numbers alone and in any batch."""
        if state.beams > 1:
            K = state.beams
            state.cross_keys = [
                self._gather_rows(k, np.repeat(np.arange(k.shape[0]), K), False) for k in state.cross_keys
            ]
            state.cross_values = [
                self._gather_rows(v, np.repeat(np.arange(v.shape[0]), K), False) for v in state.cross_values
            ]
            state.beams = 1
        if not state.aligned:
            state.aligned = True
            width = _aligned(state.cross_keys[0].shape[2])
            state.cross_keys = [self._pad_sources(k, width, False) for k in state.cross_keys]
            state.cross_values = [self._pad_sources(v, width, False) for v in state.cross_values]
            if state.attention is not None:
                state.attention = np.zeros((state.num_rows, width), dtype=np.float32)
            capacity = min(_aligned(state.cache.capacity), self._capacity_limit(state))
            if capacity != state.cache.capacity:
                self._grow(state, capacity)
        self._bind(state)

    def reorder(self, state: OrtState, beam_index: Any) -> None:
        """Row ``r`` of every self-attention cache becomes old row ``beam_index[r]`` (valid prefix only)."""
        state.cache.reorder_(beam_index)

    def select(self, state: OrtState, index: Any) -> None:
        """Keep the rows ``index`` (row ``r`` becomes old row ``index[r]``; see
        :class:`transformer_ext.decoding.Runner`): the caches in place
        (:meth:`HostKVCache.select_`), the cross K/V and source lengths gathered into smaller
        arrays, the step's buffers as views of their first rows, all bound again.

        Cross K/V kept once per source stay so when ``index`` keeps whole sources (each run of
        ``beams`` consecutive new rows comes from one old source, as a beam search's does): the
        kept sources' rows are gathered. Any other selection gets one cross-attention row per
        row from then on (``beams`` 1), which the step graph takes as well."""
        index = decoding.check_select_index(index, state.num_rows)
        M = int(index.shape[0])
        state.cache.select_(index)
        state.src_lengths = np.ascontiguousarray(state.src_lengths[index])
        K = state.beams
        sources = index // K  # the cross-attention row of every kept row
        if K > 1 and (M % K or np.any(sources.reshape(-1, K) != sources[::K, None])):
            K = 1  # not whole sources: one cross-attention row per row
        state.beams = K
        cross_index = sources if K == 1 else sources[::K]
        pooled = self._pool_for(state) is not None
        state.cross_keys = [self._gather_rows(k, cross_index, pooled) for k in state.cross_keys]
        state.cross_values = [self._gather_rows(v, cross_index, pooled) for v in state.cross_values]
        state.input_ids, state.positions = state.input_ids[:M], state.positions[:M]
        state.logits = state.logits[:M]
        if state.attention is not None:
            state.attention = state.attention[:M]
        self._bind(state)
