"""Timing helpers shared by the benchmarks: interleaved repeats, medians, JSON output."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from typing import Callable, Dict

import torch


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_side_by_side(
    fns: Dict[str, Callable[[], object]], device: str, repeats: int = 7, min_time: float = 0.02
) -> Dict[str, float]:
    """Median seconds per call of every function, measured interleaved in one run.

    Each repeat times every function once (in a rotating order) over a number of calls
    calibrated so that one timing lasts at least ``min_time``; the medians over repeats are
    returned. Interleaving keeps machine drift from favouring one engine.
    """
    names = list(fns)
    calls = {}
    for name in names:  # warm-up and calibration
        fns[name]()
        sync(device)
        n, elapsed = 1, 0.0
        while True:
            t0 = time.perf_counter()
            for _ in range(n):
                fns[name]()
            sync(device)
            elapsed = time.perf_counter() - t0
            if elapsed >= min_time or n >= 1 << 16:
                break
            n *= 2
        calls[name] = n
    samples: Dict[str, list] = {name: [] for name in names}
    for r in range(repeats):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            n = calls[name]
            sync(device)
            t0 = time.perf_counter()
            for _ in range(n):
                fns[name]()
            sync(device)
            samples[name].append((time.perf_counter() - t0) / n)
    return {name: statistics.median(v) for name, v in samples.items()}


def environment() -> dict:
    info = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def write_json(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=2)
    os.replace(tmp, path)
