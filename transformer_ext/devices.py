"""The one ``--device`` parser of every command (train, translate, evaluate).

:func:`check_device_name` checks the spelling without torch (a command calls it with its other
option checks, before anything is loaded; a deployment without torch can call it too);
:func:`parse_device` also asks torch whether the device is there. A name that is not a device
(``foo``) or one the package does not run on (``meta``, ``mps``) is a usage error (exit code 2);
``cuda`` on a machine where torch sees no GPU, or ``cuda:N`` past the GPUs it sees, is an error
naming the device (exit code 1), never a raw torch RuntimeError.
"""

from __future__ import annotations

import re
from typing import Any

from .cli import UsageError, UserError

__all__ = ["DeviceError", "DeviceUsageError", "DEVICE_HELP", "check_device_name", "parse_device"]

DEVICE_HELP = "cpu or cuda (or cuda:N)"
_NAME = re.compile(r"^(cpu|cuda(:\d+)?)$")
# Device types torch knows and this package does not run on.
_OTHER_TORCH_TYPES = (
    "meta",
    "mps",
    "xpu",
    "xla",
    "hip",
    "hpu",
    "ipu",
    "mtia",
    "maia",
    "privateuseone",
    "vulkan",
)


class DeviceError(UserError, ValueError):
    """A device that is not on this machine (no CUDA GPU, a GPU index past the last)."""


class DeviceUsageError(DeviceError, UsageError):
    """A ``--device`` value that is not a device name, or one the package does not run on."""


def check_device_name(name: Any, option: str = "--device") -> str:
    """``name`` as a device name (``cpu``, ``cuda``, ``cuda:N``; case and surrounding spaces
    ignored), checked without torch; DeviceUsageError naming ``option`` otherwise."""
    text = name.strip().lower() if isinstance(name, str) else None
    if text is not None and _NAME.match(text):
        return text
    if text is not None and text.split(":")[0] in _OTHER_TORCH_TYPES:
        raise DeviceUsageError(f"unsupported device {name!r} for {option}: use {DEVICE_HELP}")
    raise DeviceUsageError(f"{option} {name!r} is not a device name; use {DEVICE_HELP}")


def parse_device(name: Any, option: str = "--device"):
    """The ``torch.device`` of a checked ``name`` that is on this machine (see the module docstring)."""
    import torch

    device = torch.device(check_device_name(name, option))
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device {name!r} was requested but no CUDA GPU is available; use {option} cpu")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise DeviceError(
                f"{option} {name!r}: torch sees {count} CUDA GPU{'s' if count != 1 else ''} "
                f"(cuda:0 .. cuda:{count - 1})"
            )
    return device
