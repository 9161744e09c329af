"""Loading TensorRT's Python package, for the engine builder (``python -m export.tensorrt``) and
the TensorRT runner (:class:`transformer_ext.runtimes.TensorRTRunner`): the version check, an
error that says what to install, and TensorRT's log routed through :mod:`logging`.
"""

from __future__ import annotations

import logging

from .export_format import ExportError

logger = logging.getLogger(__name__)

__all__ = [
    "MIN_TENSORRT_VERSION",
    "INSTALL_HINT",
    "TensorRTNotAvailableError",
    "import_tensorrt",
    "TrtLogger",
]

MIN_TENSORRT_VERSION = "10.15"
INSTALL_HINT = (
    "install TensorRT's Python package on a machine with an NVIDIA GPU: `pip install tensorrt-cu13` "
    "(CUDA 13; `tensorrt-cu12` for CUDA 12) or the extra `pip install 'transformer_ext[tensorrt]'`; "
    "`python -m export.tensorrt --check-only` checks the graphs without TensorRT"
)


class TensorRTNotAvailableError(ExportError, ImportError):
    """TensorRT's Python package is missing or too old."""


def import_tensorrt(min_version: str = MIN_TENSORRT_VERSION):
    """``import tensorrt``, or a :class:`TensorRTNotAvailableError` that says how to install it."""
    try:
        import tensorrt as trt  # noqa: PLC0415 - gated import, TensorRT is optional
    except ImportError as exc:
        raise TensorRTNotAvailableError(f"TensorRT is not installed ({exc}); {INSTALL_HINT}") from exc
    from packaging.version import Version

    version = getattr(trt, "__version__", "0")
    if Version(version) < Version(min_version):
        raise TensorRTNotAvailableError(
            f"TensorRT {version} is too old: the exported graphs need TensorRT >= {min_version} "
            f"(ONNX opsets up to 24, TensorScatter); {INSTALL_HINT}"
        )
    return trt


class TrtLogger:
    """Route TensorRT's log through :mod:`logging`."""

    @staticmethod
    def create(trt):
        class Logger(trt.ILogger):
            def __init__(self):
                trt.ILogger.__init__(self)

            def log(self, severity, msg):
                level = {
                    trt.ILogger.Severity.INTERNAL_ERROR: logging.CRITICAL,
                    trt.ILogger.Severity.ERROR: logging.ERROR,
                    trt.ILogger.Severity.WARNING: logging.WARNING,
                    trt.ILogger.Severity.INFO: logging.DEBUG,
                    trt.ILogger.Severity.VERBOSE: logging.DEBUG,
                }.get(severity, logging.INFO)
                logger.log(level, "[TensorRT] %s", msg)

        return Logger()
