import os

import pytest
import torch

# Two cores on CI: keep intra-op threads bounded so parallel kernels are exercised but not oversubscribed.
torch.set_num_threads(min(2, os.cpu_count() or 1))

HAS_CUDA = torch.cuda.is_available()


def cuda_built() -> bool:
    from transformer_ext import ops

    return ops.cuda_kernels_built()


def device_params():
    """CPU always; CUDA as a skipped case with a reason when it cannot run here."""
    return [
        "cpu",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU visible on this machine"),
        ),
    ]
