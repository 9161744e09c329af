"""transformer_ext.runtimes.denormals: FTZ / DAZ on the calling thread for one call, restored after."""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import pytest

from transformer_ext.runtimes import denormals

needs_flush = pytest.mark.skipif(
    not denormals.AVAILABLE, reason="denormals.AVAILABLE is False: not Linux on x86-64 (nothing to flush)"
)


def _mxcsr() -> int:
    env = denormals._Env()
    assert denormals._FUNCTIONS[0](ctypes.byref(env)) == 0
    return env.mxcsr


def _denormal_product() -> np.float32:
    # 1e-30 * 1e-10 = 1e-40, below float32's smallest normal (about 1.18e-38): IEEE gives a
    # denormal, a thread with FTZ gives 0
    return np.float32(1e-30) * np.float32(1e-10)


def test_available_where_it_applies():
    import platform

    expected = platform.system() == "Linux" and platform.machine().lower() in ("x86_64", "amd64")
    assert denormals.AVAILABLE == expected
    assert denormals.session_config() == {"session.set_denormal_as_zero": "1"}


@needs_flush
def test_call_sets_both_bits_for_the_call_and_restores_the_environment():
    before = _mxcsr()
    assert before & denormals.FLUSH_BITS == 0  # the process default: IEEE denormals
    inside = denormals.call(_mxcsr)
    assert inside & denormals.FLUSH_BITS == denormals.FLUSH_BITS
    control = ~(denormals.FLUSH_BITS | 0x3F)  # the exception masks and the rounding mode
    assert inside & control == before & control
    assert _mxcsr() & ~0x3F == before & ~0x3F  # as before, the exception flags (bits 0-5) aside


@needs_flush
def test_denormal_results_are_zero_inside_and_denormal_outside():
    outside = _denormal_product()
    assert 0 < outside < np.finfo(np.float32).tiny
    assert denormals.call(_denormal_product) == 0
    assert _denormal_product() == outside


@needs_flush
def test_arguments_results_and_exceptions_pass_through():
    assert denormals.call(lambda a, b=0: a + b, 2, b=3) == 5
    before = _mxcsr() & ~0x3F

    def fails():
        raise KeyError("inside")

    with pytest.raises(KeyError, match="inside"):
        denormals.call(fails)
    assert _mxcsr() & ~0x3F == before  # restored on the way out


@needs_flush
def test_nested_calls_leave_the_outer_setting_alone():
    def outer():
        inner = denormals.call(_mxcsr)
        return inner, _mxcsr()

    inner, after_inner = denormals.call(outer)
    assert inner & denormals.FLUSH_BITS == denormals.FLUSH_BITS
    assert after_inner & denormals.FLUSH_BITS == denormals.FLUSH_BITS  # the inner call did not undo it
    assert _mxcsr() & denormals.FLUSH_BITS == 0


@needs_flush
def test_other_threads_keep_their_own_setting():
    # The other thread exists before the call (a thread created during one inherits its
    # creator's environment, as POSIX threads do) and computes while the call runs.
    go, done, seen = threading.Event(), threading.Event(), {}

    def other():
        go.wait(30)
        seen["product"] = _denormal_product()
        done.set()

    t = threading.Thread(target=other)
    t.start()

    def inside():
        go.set()
        assert done.wait(30)
        return _denormal_product()

    try:
        assert denormals.call(inside) == 0
    finally:
        go.set()
        t.join(30)
    assert seen["product"] > 0  # the other thread computed IEEE denormals meanwhile
