"""The old import paths of the runners, kept as aliases that warn (``export.ort_runner``,
``export.ort_cuda_runner``, ``export.trt_runner``, ``transformer_ext.runner``)."""

from __future__ import annotations

import warnings
from types import ModuleType
from typing import Any, MutableMapping


def alias_module(old: str, namespace: MutableMapping[str, Any], *modules: ModuleType) -> None:
    """Make the module ``old`` (whose globals are ``namespace``) re-export every name of
    ``modules``: the same objects, so ``isinstance`` and identity hold across both paths.

    Warns with a :class:`DeprecationWarning` attributed to the line that imported ``old``.
    """
    new = " / ".join(m.__name__ for m in modules)
    warnings.warn(
        f"{old} is deprecated and will be removed: import from transformer_ext.runtimes instead ({new})",
        DeprecationWarning,
        stacklevel=3,  # this function, the alias module, then the importer (import machinery skipped)
    )
    public: list[str] = []
    for module in modules:
        namespace.update(
            {k: v for k, v in vars(module).items() if not (k.startswith("__") and k.endswith("__"))}
        )
        public += list(getattr(module, "__all__", ()))
    namespace["__all__"] = public
