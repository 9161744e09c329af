"""bfloat16 on the CPU: the matrix-vector kernel of ``ops.linear``, eager decoding with bfloat16
weights, and mixed-precision training (``--amp bf16``).

Oracles: float64 (the same computation in double precision) and the plain PyTorch version run
in bfloat16; the kernel's error against float64 is at most twice that of plain PyTorch. Paths
that refuse where bfloat16 is not native are tested with the detection monkeypatched, both ways,
so the suite runs (and tests correctness on tiny shapes) on any CPU.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from transformer_ext import ops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (rows, in_features, out_features): 1..4 rows take the matrix-vector kernel, 5 at::linear;
# in_features with and without a tail after the vector width, out_features with a partial block.
LINEAR_SHAPES = [(1, 37, 13), (2, 64, 24), (3, 512, 40), (4, 100, 9), (5, 48, 16), (1, 16, 8000)]


def _max_err(y: torch.Tensor, want: torch.Tensor) -> float:
    return (y.double() - want).abs().max().item()


@pytest.mark.parametrize("rows, k, n", LINEAR_SHAPES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_linear_bfloat16_matches_float64(rows, k, n, with_bias):
    g = torch.Generator().manual_seed(rows * 1000 + k + n)
    x = torch.randn(rows, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if with_bias else None
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    with torch.inference_mode():
        y = ops.linear(x, w, b)
        plain = F.linear(x, w, b)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
    err, plain_err = _max_err(y, want), _max_err(plain, want)
    assert plain_err > 0  # the bfloat16 output rounding is always there
    assert err <= 2 * plain_err, (err, plain_err)


def test_linear_bfloat16_keeps_leading_dimensions():
    x = torch.randn(2, 1, 40).bfloat16()
    w = torch.randn(24, 40).bfloat16()
    with torch.inference_mode():
        y = ops.linear(x, w)
    want = F.linear(x.double(), w.double())
    assert y.shape == (2, 1, 24)
    assert _max_err(y, want) <= 2 * _max_err(F.linear(x, w), want)


def test_linear_bfloat16_strided_and_one_dimensional_inputs():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 64, generator=g).bfloat16()
    b = torch.randn(40, generator=g).bfloat16()
    for x in (torch.randn(64, generator=g).bfloat16(), torch.randn(64, 3, generator=g).bfloat16().t()):
        want = F.linear(x.double(), w.double(), b.double())
        with torch.inference_mode():
            y = ops.linear(x, w, b)
        assert y.shape == want.shape
        assert _max_err(y, want) <= 2 * _max_err(F.linear(x, w, b), want)


def test_linear_bfloat16_widening_kernel_without_the_dot_product_instruction():
    """TRANSFORMER_EXT_CPU_BF16_DOT=0: the kernels that widen bfloat16 to float32 (what a CPU without
    AVX-512 BF16 runs), against float64 with the same rule, in a fresh process."""
    code = (
        "import torch, torch.nn.functional as F\n"
        "from transformer_ext import ops\n"
        "g = torch.Generator().manual_seed(1)\n"
        "for rows, k, n in [(1, 37, 13), (3, 512, 40), (4, 100, 9)]:\n"
        "    x = torch.randn(rows, k, generator=g).bfloat16(); w = torch.randn(n, k, generator=g).bfloat16()\n"
        "    b = torch.randn(n, generator=g).bfloat16()\n"
        "    want = F.linear(x.double(), w.double(), b.double())\n"
        "    with torch.inference_mode():\n"
        "        err = (ops.linear(x, w, b).double() - want).abs().max().item()\n"
        "        plain = (F.linear(x, w, b).double() - want).abs().max().item()\n"
        "    assert 0 < plain and err <= 2 * plain, (rows, k, n, err, plain)\n"
        "print('ok')\n"
    )
    env = {**os.environ, "TRANSFORMER_EXT_CPU_BF16_DOT": "0", "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr
