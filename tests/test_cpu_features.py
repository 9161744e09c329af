"""Detection of native bfloat16 matrix products (transformer_ext.cpu_features)."""

import math
import os
import subprocess
import sys

import pytest

from transformer_ext import cpu_features
from transformer_ext.cpu_features import CpuFlags, NotNativeError, bf16_support, parse_cpuinfo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Abridged /proc/cpuinfo blocks of real machines (two processors each: only the first counts).
SAPPHIRE_RAPIDS = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx2 fma avx512f avx512bw avx512_bf16 avx512_vnni amx_bf16 amx_tile amx_int8

processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx2
"""
ZEN4 = """processor\t: 0
model name\t: AMD EPYC 9R14 96-Core Processor
flags\t\t: fpu sse2 avx2 fma avx512f avx512bw avx512_bf16 avx512_vnni
"""
AMX_ONLY = """processor\t: 0
model name\t: a CPU with AMX and no AVX-512 BF16
flags\t\t: fpu avx2 amx_tile amx_bf16
"""
ZEN2 = """processor\t: 0
model name\t: AMD EPYC 7B12
flags\t\t: fpu sse2 avx avx2 fma f16c
"""
GRAVITON3 = """processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm bf16 i8mm sve
"""
GRAVITON2 = """processor\t: 0
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm
"""

CASES = [
    # (cpuinfo text, machine, native, present, missing)
    (SAPPHIRE_RAPIDS, "x86_64", True, ("avx512_bf16", "amx_bf16"), ()),
    (ZEN4, "x86_64", True, ("avx512_bf16",), ()),
    (AMX_ONLY, "x86_64", True, ("amx_bf16",), ()),
    (ZEN2, "x86_64", False, (), ("avx512_bf16", "amx_bf16")),
    (GRAVITON3, "aarch64", True, ("bf16",), ()),
    (GRAVITON2, "aarch64", False, (), ("bf16",)),
]


@pytest.mark.parametrize("text, machine, native, present, missing", CASES)
def test_flag_sets_give_the_right_answer(text, machine, native, present, missing):
    support = bf16_support(parse_cpuinfo(text, machine))
    assert support.native is native
    assert support.present == present
    assert support.missing == missing
    for flag in missing:
        assert flag in support.reason
    record = support.as_dict()
    assert record["native"] is native and record["missing"] == list(missing)


def test_only_the_first_processor_block_counts():
    flags = parse_cpuinfo(SAPPHIRE_RAPIDS, "x86_64")
    assert flags.model == "Intel(R) Xeon(R) Platinum 8480+"
    assert "amx_bf16" in flags.flags


def test_unreadable_flags_and_unknown_architectures_are_not_native():
    unread = bf16_support(CpuFlags("x86", "", frozenset(), "cannot read /proc/cpuinfo: Permission denied"))
    assert not unread.native
    assert "could not be read" in unread.reason and "Permission denied" in unread.reason
    riscv = bf16_support(CpuFlags("riscv64", "", frozenset({"rv64imafdc"}), "/proc/cpuinfo"))
    assert not riscv.native and "riscv64" in riscv.reason
    assert "avx512_bf16" in riscv.missing


def test_refusal_names_the_missing_instructions_and_the_measured_slowdown(monkeypatch):
    monkeypatch.setattr(
        cpu_features, "matmul_rates", lambda dtypes, **kw: {"float32": 150.0, "bfloat16": 1.5}
    )
    support = bf16_support(parse_cpuinfo(ZEN2, "x86_64"))
    with pytest.raises(NotNativeError) as info:
        cpu_features.require_native_bf16("--amp bf16", "train in float32", support)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("--amp bf16 needs")
    assert "avx512_bf16" in message and "amx_bf16" in message and "AMD EPYC 7B12" in message
    assert "1.5 GFLOP/s vs 150.0" in message and f"{150.0 / 1.5:.0f}x slower" in message
    assert message.endswith("train in float32")


def test_refusal_without_a_measurement_quotes_the_recorded_one(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no torch")

    monkeypatch.setattr(cpu_features, "matmul_rates", broken)
    with pytest.raises(NotNativeError, match="about 100x slower"):
        cpu_features.require_native_bf16(
            "--dtype bfloat16", "use float32", bf16_support(parse_cpuinfo(ZEN2, "x86_64"))
        )


def test_native_support_passes_through():
    support = bf16_support(parse_cpuinfo(ZEN4, "x86_64"))
    assert cpu_features.require_native_bf16("--amp bf16", "-", support) is support


def test_float16_refusal_names_the_measured_rates(monkeypatch):
    monkeypatch.setattr(cpu_features, "matmul_rates", lambda dtypes, **kw: {"float32": 171.0, "float16": 1.0})
    message = str(cpu_features.refuse_cpu_float16("--amp fp16", "use --amp bf16"))
    assert message.startswith("--amp fp16 is CUDA only") and "1.0 GFLOP/s vs 171.0" in message
    assert "171x slower" in message and "\n" not in message


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo"), reason="no /proc/cpuinfo on this system")
def test_this_machine_matches_its_cpuinfo():
    with open("/proc/cpuinfo") as f:
        first = f.read().split("\n\n")[0]
    words = set()
    for line in first.splitlines():
        if line.split(":")[0].strip().lower() in ("flags", "features"):
            words = set(line.split(":", 1)[1].split())
    support = bf16_support()
    expected = any(f in words for f in ("avx512_bf16", "amx_bf16", "bf16"))
    assert support.native is expected


def test_matmul_rates_are_positive():
    rates = cpu_features.matmul_rates(("float32",), n=32, min_time=0.001)
    assert set(rates) == {"float32"} and math.isfinite(rates["float32"]) and rates["float32"] > 0


def test_importing_the_module_loads_no_torch():
    code = (
        "import sys, transformer_ext.cpu_features as c; c.bf16_support(); assert 'torch' not in sys.modules"
    )
    env = dict(os.environ, PYTHONPATH=ROOT)
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=ROOT, timeout=120)
