"""Timing helpers shared by the benchmarks: interleaved repeats, medians, JSON output."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from typing import Callable, Dict, Optional

import numpy as np

# torch is imported where it is used: the benchmark workers of engines other than torch's import
# this module's machine helpers without it.


def sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def time_side_by_side(
    fns: Dict[str, Callable[[], object]],
    device: str,
    repeats: int = 7,
    min_time: float = 0.02,
    samples: Optional[Dict[str, list]] = None,
    clock: Callable[[], float] = time.perf_counter,
) -> Dict[str, float]:
    """Median seconds per call of every function, measured interleaved in one run.

    Each repeat times every function once (in a rotating order) over a number of calls
    calibrated so that one timing lasts at least ``min_time`` (``min_time`` 0: one call, no
    calibration; for calls that take long anyway); the medians over repeats are returned.
    Interleaving keeps machine drift from favouring one engine. ``samples``: a dict that receives
    every function's list of per-call seconds. ``clock``: wall time by default; ``time.process_time``
    counts the CPU time of this process instead (for calls that run on the calling thread, it is
    not inflated by other processes taking the cores, though their cache traffic still counts).
    """
    names = list(fns)
    calls = {}
    for name in names:  # warm-up and calibration
        fns[name]()
        sync(device)
        n, elapsed = 1, 0.0
        while min_time > 0:
            t0 = clock()
            for _ in range(n):
                fns[name]()
            sync(device)
            elapsed = clock() - t0
            if elapsed >= min_time or n >= 1 << 16:
                break
            n *= 2
        calls[name] = n
    if samples is None:
        samples = {}
    samples.update({name: [] for name in names})
    for r in range(repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            n = calls[name]
            sync(device)
            t0 = clock()
            for _ in range(n):
                fns[name]()
            sync(device)
            samples[name].append((clock() - t0) / n)
    return {name: statistics.median(samples[name]) for name in names}


def environment() -> dict:
    import torch

    info = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "bf16": bf16_record(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def bf16_record() -> dict:
    """Whether this CPU runs bfloat16 matrix products natively, the flags that say so and the
    reason (:func:`transformer_ext.cpu_features.bf16_support`): every benchmark's JSON holds it."""
    from transformer_ext.cpu_features import bf16_support

    return bf16_support().as_dict()


def _json_safe(value):
    """``value`` with every NaN or infinite float replaced by None (JSON has no such numbers)."""
    if isinstance(value, float) and not np.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _git(*args: str) -> Optional[str]:
    try:
        res = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def provenance() -> dict:
    """What produced a result: the commit (``git rev-parse HEAD``, and whether the working tree
    had uncommitted changes to tracked files), the command line, the machine (``lscpu``'s model,
    cores and caches) and the load average when the result was written."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "commit": _git("rev-parse", "HEAD"),
        "dirty": None if status is None else bool(status),
        "argv": [os.path.basename(sys.executable)] + list(sys.argv),
        "machine": lscpu(),
        "load_average": list(os.getloadavg()),
        "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def write_json(path: str, payload: dict) -> None:
    """``payload`` as indented JSON at ``path``, written atomically (:mod:`transformer_ext.fsutil`),
    with its :func:`provenance` under ``"provenance"``; a NaN or infinite number (a case that could
    not be measured) becomes ``null``."""
    from transformer_ext.fsutil import atomic_write_json

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_write_json(path, _json_safe({**payload, "provenance": payload.get("provenance") or provenance()}))


def save_figure(fig, path: str, dpi: int = 110) -> None:
    """A matplotlib figure as a PNG at ``path``, written atomically."""
    import io

    from transformer_ext.fsutil import atomic_write_bytes

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    atomic_write_bytes(path, buf.getvalue())


def lscpu() -> dict:
    """CPU model, sockets, cores, threads per core and cache sizes as ``lscpu`` reports them."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    keys = {
        "Model name": "model_name",
        "CPU(s)": "cpus",
        "Thread(s) per core": "threads_per_core",
        "Core(s) per socket": "cores_per_socket",
        "Socket(s)": "sockets",
        "L1d cache": "l1d",
        "L2 cache": "l2",
        "L3 cache": "l3",
        "Flags": "flags",
    }
    info = {new: fields[old] for old, new in keys.items() if old in fields}
    flags = info.pop("flags", "").split()
    info["simd"] = [
        f
        for f in (
            "avx2",
            "fma",
            "avx512f",
            "avx512_vnni",
            "avx_vnni",
            "avx512_bf16",
            "avx512_fp16",
            "amx_bf16",
            "amx_int8",
        )
        if f in flags
    ]
    return info


def _parallel_seconds(work: Callable[[int], None], threads: int) -> float:
    barrier = threading.Barrier(threads + 1)
    done = threading.Barrier(threads + 1)

    def body(i):
        barrier.wait()
        work(i)
        done.wait()

    pool = [threading.Thread(target=body, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    done.wait()
    seconds = time.perf_counter() - t0
    for t in pool:
        t.join()
    return seconds


def memory_bandwidth(nbytes: int = 256 * 2**20, threads: int = 1, repeats: int = 5) -> dict:
    """Measured bytes/s: ``read`` (a sum over ``nbytes`` of float32, numpy releases the GIL so
    ``threads`` threads each read their share) and ``copy`` (STREAM-style, read + write bytes)."""
    a = np.ones(nbytes // 4, dtype=np.float32)
    b = np.empty_like(a)
    parts_a, parts_b = np.array_split(a, threads), np.array_split(b, threads)
    np.copyto(b, a)
    read, copy = [], []
    for _ in range(repeats):
        read.append(_parallel_seconds(lambda i: parts_a[i].sum(), threads))
        copy.append(_parallel_seconds(lambda i: np.copyto(parts_b[i], parts_a[i]), threads))
    return {"read": a.nbytes / statistics.median(read), "copy": 2 * a.nbytes / statistics.median(copy)}


def machine_info(threads=(1, 2)) -> dict:
    """lscpu facts, native bfloat16 (:func:`bf16_record`) and the measured read and copy
    bandwidth at each thread count."""
    info = lscpu()
    info["bf16"] = bf16_record()
    info["os_cpu_count"] = os.cpu_count()
    info["read_bandwidth_bytes_per_s"], info["copy_bandwidth_bytes_per_s"] = {}, {}
    for n in threads:
        bw = memory_bandwidth(threads=n)
        info["read_bandwidth_bytes_per_s"][str(n)] = bw["read"]
        info["copy_bandwidth_bytes_per_s"][str(n)] = bw["copy"]
    info["bandwidth_method"] = (
        "numpy float32 sum (read) and copyto (copy, read + write bytes) over 256 MiB, "
        "median of 5, threads splitting the array"
    )
    return info
