"""Denormal floats flushed to zero on the calling thread while ONNX Runtime runs a graph.

A float32 below 2^-126 in magnitude (a denormal) costs x86 cores a microcode assist in every
instruction that reads or produces one, about a hundred cycles instead of one. ONNX Runtime's
CPU exponential (the one inside ``Softmax``, ``LogSoftmax`` and ``Exp``) passes through a
denormal for every input below about -87 relative to its row's maximum, and the exported graphs
make such inputs on purpose: a padded source position or an unwritten cache position gets the
additive bias ``-inf``. Measured on the 2-core Xeon with AMX (ONNX Runtime 1.32, 1 thread):
``Softmax`` over ``[104, 4, 40, 40]`` float32 took 0.66 ms on random scores and 4.9 ms with the
last quarter of every row at ``-inf``; 0.78 ms with the flags below set
(``benchmarks/probes/probe_denormals.py``).

Two bits of the SSE control register (MXCSR) make the core treat denormals as zero: FTZ (results
that would be denormal are written as zero) and DAZ (denormal inputs are read as zero). ONNX
Runtime's session option ``session.set_denormal_as_zero`` (:func:`session_config`) sets them on
the threads of the session's pool, and also, for good, on the thread that makes the session; the
thread that calls ``run`` does all the work at 1 thread and its share at more, with whatever
setting it has then. :func:`call` sets both bits on the calling thread for one call, through C's
``fegetenv`` / ``fesetenv``, and restores the saved environment afterwards (exception flags
raised meanwhile included), so the caller's own numpy or Python arithmetic never sees the
change. ``OrtRunner`` makes its sessions with that option inside :func:`call` (their pool threads
keep the bits, the caller's thread gets its own setting back) and runs every graph inside it.

What it changes in results: a value that would be denormal becomes zero, a change below 1.2e-38
in absolute terms, in values that are probabilities of padded or negligible positions.

Where: Linux on x86-64, where glibc and musl lay ``fenv_t`` out as 32 bytes with the MXCSR in the
last four (checked at import: the field must read back as a valid MXCSR and take the two bits).
Elsewhere :data:`AVAILABLE` is False and :func:`call` just calls.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform
import threading
from typing import Any, Callable, TypeVar

logger = logging.getLogger(__name__)

__all__ = ["AVAILABLE", "FLUSH_BITS", "call", "session_config"]

T = TypeVar("T")

FLUSH_BITS = 0x8040  # MXCSR bit 15 (FTZ, flush to zero) and bit 6 (DAZ, denormals are zero)
_MXCSR_RESERVED = 0xFFFF0000  # reserved bits: an MXCSR with any of them set is not one


class _Env(ctypes.Structure):
    """x86-64 Linux ``fenv_t``: the x87 environment (28 bytes), then the MXCSR."""

    _fields_ = [("x87", ctypes.c_ushort * 14), ("mxcsr", ctypes.c_uint32)]


def _load() -> tuple[Any, Any] | None:
    """``(fegetenv, fesetenv)`` of the C library, or None where this module does not apply."""
    if platform.system() != "Linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    if ctypes.sizeof(_Env) != 32:
        return None
    try:
        libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
        get, put = libm.fegetenv, libm.fesetenv
    except (OSError, AttributeError):
        return None
    for fn in (get, put):
        fn.argtypes = [ctypes.POINTER(_Env)]
        fn.restype = ctypes.c_int
    saved = _Env()
    if get(ctypes.byref(saved)) != 0 or saved.mxcsr & _MXCSR_RESERVED:
        return None
    flushed = _Env.from_buffer_copy(saved)
    flushed.mxcsr |= FLUSH_BITS
    probe = _Env()
    try:
        ok = put(ctypes.byref(flushed)) == 0 and get(ctypes.byref(probe)) == 0
        ok = ok and probe.mxcsr & FLUSH_BITS == FLUSH_BITS
    finally:
        put(ctypes.byref(saved))
    return (get, put) if ok else None


_FUNCTIONS = _load()
AVAILABLE = _FUNCTIONS is not None
_local = threading.local()  # per thread: the saved and the flushed environment, reused


def call(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` with FTZ and DAZ set on this thread (:data:`AVAILABLE`), the
    thread's floating-point environment restored afterwards, also when ``fn`` raises. Costs a
    few microseconds a call (ctypes and the two environment writes)."""
    if _FUNCTIONS is None:
        return fn(*args, **kwargs)
    get, put = _FUNCTIONS
    buffers = getattr(_local, "buffers", None)
    if buffers is None:
        saved, flushed = _Env(), _Env()
        buffers = _local.buffers = (saved, flushed, ctypes.pointer(saved), ctypes.pointer(flushed))
    saved, flushed, saved_ptr, flushed_ptr = buffers
    # Read into ``flushed`` first: a call nested in ``fn`` must not overwrite the ``saved`` of
    # the call around it. Then a second read into ``saved`` (cheaper than a ctypes copy).
    if get(flushed_ptr) != 0 or flushed.mxcsr & FLUSH_BITS == FLUSH_BITS:  # set already (outer call)
        return fn(*args, **kwargs)
    get(saved_ptr)
    flushed.mxcsr |= FLUSH_BITS
    put(flushed_ptr)
    try:
        return fn(*args, **kwargs)
    finally:
        put(saved_ptr)


def session_config() -> dict[str, str]:
    """The ONNX Runtime session config entries that set the same bits on its pool threads."""
    return {"session.set_denormal_as_zero": "1"}
