"""Whether this CPU computes bfloat16 matrix products natively, and why (not).

Every bfloat16 path on the CPU asks :func:`bf16_support` first (``train --amp bf16``,
``EagerRunner(..., dtype="bfloat16")``, ``translate --dtype bfloat16``) and refuses through
:func:`require_native_bf16` where the answer is no; the benchmarks record
:meth:`Bf16Support.as_dict` with the machine.

Native means the instruction set has bfloat16 dot products, which oneDNN and MKL use for
``torch.matmul`` in bfloat16:

* x86: ``avx512_bf16`` (AVX-512 BF16: Intel Cooper Lake, Sapphire Rapids and newer; AMD Zen 4
  and newer) or ``amx_bf16`` (Intel AMX: Sapphire Rapids and newer), read from the ``flags``
  line of ``/proc/cpuinfo``;
* AArch64: ``bf16`` (Armv8.6 BFDOT/BFMMLA: Neoverse V1/N2/V2, AWS Graviton 3 and newer), from the
  ``Features`` line of ``/proc/cpuinfo``, or ``hw.optional.arm.FEAT_BF16`` on macOS.

Without them a bfloat16 matrix product is emulated: on a 2-core AVX2-only AMD EPYC (torch
2.14.1) about 100x slower than float32. ``torch.backends.cpu.get_cpu_capability()`` names only
the vector width (``AVX512``, ``AVX2``, ``SVE256``...), not bfloat16, so it is recorded but does
not decide.

This module imports no torch at import time (the ONNX Runtime and CTranslate2 benchmark workers
record the machine without it); :func:`matmul_rates` imports torch when called.
"""

from __future__ import annotations

import functools
import logging
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Iterable, Optional, Sequence

from .cli import UserError

logger = logging.getLogger(__name__)

__all__ = [
    "X86_BF16_FLAGS",
    "ARM_BF16_FLAGS",
    "NON_NATIVE_SLOWDOWN",
    "Bf16Support",
    "CpuFlags",
    "NotNativeError",
    "bf16_support",
    "cpu_flags",
    "matmul_rates",
    "parse_cpuinfo",
    "refuse_cpu_float16",
    "require_native_bf16",
]

# Either of these makes bfloat16 products native on x86; both are named when both are missing.
X86_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
ARM_BF16_FLAGS = ("bf16",)
# What emulated bfloat16 costs, as measured where it was found (README "bfloat16 on CPUs that have it").
NON_NATIVE_SLOWDOWN = "about 100x slower than float32 on a 2-core AVX2-only AMD EPYC"

_CPUINFO = "/proc/cpuinfo"


@dataclass(frozen=True)
class CpuFlags:
    """What was read about the CPU: its architecture family, model name and ISA flags."""

    arch: str  # "x86", "arm" or the platform's machine name
    model: str  # e.g. "Intel(R) Xeon(R) Platinum 8480+", "" when unknown
    flags: frozenset  # lower-case ISA flags; empty when they could not be read
    source: str  # where the flags came from ("/proc/cpuinfo", "sysctl") or why there are none


@dataclass(frozen=True)
class Bf16Support:
    """The answer of :func:`bf16_support`."""

    native: bool  # bfloat16 matrix products run on bfloat16 instructions
    present: tuple  # the bfloat16 instructions found
    missing: tuple  # the bfloat16 instructions looked for and not found (empty when native)
    arch: str
    model: str
    source: str
    torch_capability: Optional[str]  # torch.backends.cpu.get_cpu_capability(), when torch is loaded
    reason: str  # one sentence saying why the products are (not) native

    def as_dict(self) -> dict:
        """The record written into benchmark JSON (lists, not tuples)."""
        d = asdict(self)
        d["present"], d["missing"] = list(self.present), list(self.missing)
        return d


class NotNativeError(UserError, RuntimeError):
    """A bfloat16 path was asked for on a CPU without native bfloat16 matrix products."""


def _arch_family(machine: str) -> str:
    m = machine.lower()
    if m in ("x86_64", "amd64", "i386", "i686", "x86"):
        return "x86"
    if m in ("aarch64", "arm64") or m.startswith("armv8") or m.startswith("armv9"):
        return "arm"
    return m or "unknown"


def parse_cpuinfo(text: str, machine: str) -> CpuFlags:
    """The flags and model name in the text of ``/proc/cpuinfo`` (first processor block)."""
    flags: set[str] = set()
    model = ""
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key = key.strip().lower()
        if key in ("flags", "features") and not flags:
            flags = {f.lower() for f in value.split()}
        elif key in ("model name", "cpu model") and not model:
            model = value.strip()
    return CpuFlags(_arch_family(machine), model, frozenset(flags), _CPUINFO)


def _macos_flags(machine: str) -> CpuFlags:
    def sysctl(name: str) -> str:
        out = subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else ""

    try:
        model = sysctl("machdep.cpu.brand_string")
        flags = {"bf16"} if sysctl("hw.optional.arm.FEAT_BF16") == "1" else set()
    except (OSError, subprocess.SubprocessError) as exc:
        return CpuFlags(_arch_family(machine), "", frozenset(), f"sysctl failed: {exc}")
    return CpuFlags(_arch_family(machine), model, frozenset(flags), "sysctl")


@functools.lru_cache(maxsize=1)
def cpu_flags() -> CpuFlags:
    """This machine's CPU flags (read once per process)."""
    machine = platform.machine()
    if sys.platform == "darwin":
        return _macos_flags(machine)
    try:
        with open(_CPUINFO, encoding="utf-8", errors="replace") as f:
            return parse_cpuinfo(f.read(), machine)
    except OSError as exc:
        return CpuFlags(
            _arch_family(machine), "", frozenset(), f"cannot read {_CPUINFO}: {exc.strerror or exc}"
        )


def _torch_capability() -> Optional[str]:
    torch = sys.modules.get("torch")  # recorded only where torch is already loaded
    try:
        return str(torch.backends.cpu.get_cpu_capability()) if torch is not None else None
    except Exception:  # noqa: BLE001 - an old torch without the query: nothing to record
        return None


def bf16_support(flags: Optional[CpuFlags] = None) -> Bf16Support:
    """Whether bfloat16 matrix products are native on this CPU (``flags``: another CPU's, for tests).

    Native: any of :data:`X86_BF16_FLAGS` on x86, :data:`ARM_BF16_FLAGS` on AArch64. Flags that
    cannot be read count as not native (the reason says so)."""
    cpu = cpu_flags() if flags is None else flags
    capability = _torch_capability()
    wanted: Sequence[str] = {"x86": X86_BF16_FLAGS, "arm": ARM_BF16_FLAGS}.get(cpu.arch, ())
    present = tuple(f for f in wanted if f in cpu.flags)
    name = cpu.model or f"this {cpu.arch} CPU"
    if not wanted:
        missing: tuple = X86_BF16_FLAGS + ARM_BF16_FLAGS
        reason = f"{name}: no known bfloat16 instructions on architecture {cpu.arch!r}"
    elif not cpu.flags:
        missing = tuple(wanted)
        reason = (
            f"{name}: the CPU flags could not be read ({cpu.source}), so {' / '.join(wanted)} are unknown"
        )
    elif present:
        missing = ()
        reason = f"{name} has {' and '.join(present)} ({cpu.source})"
    else:
        missing = tuple(wanted)
        reason = f"{name} lacks {' and '.join(wanted)} ({cpu.source})"
    if capability is not None:
        reason += f"; torch CPU capability {capability}"
    return Bf16Support(bool(present), present, missing, cpu.arch, cpu.model, cpu.source, capability, reason)


def matmul_rates(
    dtypes: Iterable[str] = ("float32", "bfloat16"), n: int = 256, min_time: float = 0.05
) -> dict:
    """GFLOP/s of an ``n x n`` by ``n x n`` ``torch.matmul`` per dtype name on one thread,
    measured now (best of three timings of at least ``min_time`` seconds each, or of one product
    where a single one takes longer). For messages and benchmark records, never for decisions."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core's rate: on a loaded machine a thread team waits on its slowest
    try:
        return {name: _matmul_rate(torch, getattr(torch, name), n, min_time) for name in dtypes}
    finally:
        torch.set_num_threads(threads)


def _matmul_rate(torch, dtype, n: int, min_time: float) -> float:
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    torch.matmul(a, b)  # warm-up (oneDNN's first call creates its kernels)
    best = float("inf")
    for _ in range(3):
        calls, t0 = 0, time.perf_counter()
        while True:
            torch.matmul(a, b)
            calls += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= min_time:
                break
        best = min(best, elapsed / calls)
    return 2.0 * n**3 / best / 1e9


def _measured_slowdown(dtype: str) -> str:
    try:
        rates = matmul_rates(("float32", dtype))
    except Exception as exc:  # noqa: BLE001 - the message must still be written
        logger.debug("matmul rate probe failed: %s", exc)
        return NON_NATIVE_SLOWDOWN
    low, f32 = rates[dtype], rates["float32"]
    ratio = f"{f32 / low:.0f}x slower" if low < f32 else f"{low / f32:.1f}x faster"
    return f"measured here: a 256x256 {dtype} matmul at {low:.1f} GFLOP/s vs {f32:.1f} in float32 ({ratio})"


def require_native_bf16(what: str, remedy: str, support: Optional[Bf16Support] = None) -> Bf16Support:
    """Raise :class:`NotNativeError` unless bfloat16 products are native here; return the support.

    ``what`` names the option asked for (``"--amp bf16"``), ``remedy`` what to do instead. The
    one-line message names the missing instructions and the slowdown measured on this machine."""
    support = bf16_support() if support is None else support
    if support.native:
        return support
    raise NotNativeError(
        f"{what} needs a CPU with native bfloat16 matrix products ({' or '.join(support.missing)}); "
        f"{support.reason}; {_measured_slowdown('bfloat16')}: {remedy}"
    )


def refuse_cpu_float16(what: str, remedy: str) -> NotNativeError:
    """The error for float16 compute on a CPU, which no CPU path of the project runs (most CPUs
    emulate it: about 1 GFLOP/s on an AVX-512 BF16 AMD EPYC): one line with the rate measured here."""
    return NotNativeError(f"{what} is CUDA only ({_measured_slowdown('float16')}): {remedy}")
