"""Every weight once per export folder: the graphs of one export read their initializers from one
shared weights file (docs/DESIGN.md section 3, "Weights").

:func:`share_weights` moves every initializer of at least :data:`MIN_EXTERNAL_BYTES` of the
folder's graphs into :data:`transformer_ext.export_format.WEIGHTS_FILE` as ONNX external data
(``location`` / ``offset`` / ``length``), several graphs pointing into the one file. Equal bytes
are stored once: a tied embedding read by the encoder's lookup, the decoder's lookup and its
output projection, and the tensors the few-row decoder step has in common with the decoder step,
are one region of the file. Each region of at least :data:`PAGE_ALIGNED_BYTES` starts at a
multiple of :data:`ALIGNMENT` (a page), so that ONNX Runtime can map it into memory instead of
copying it; smaller ones at a multiple of :data:`SMALL_ALIGNMENT`. Initializers under
:data:`MIN_EXTERNAL_BYTES` (shapes, scalars, small biases) stay inside their graph.

Imports onnx: a writer's module (readers use :mod:`transformer_ext.export_format`).
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Optional, Sequence

from transformer_ext.export_format import WEIGHTS_FILE
from transformer_ext.fsutil import temporary_name

logger = logging.getLogger(__name__)

__all__ = [
    "ALIGNMENT",
    "MIN_EXTERNAL_BYTES",
    "PAGE_ALIGNED_BYTES",
    "PRODUCT_SUFFIX",
    "is_product_view",
    "share_weights",
    "split_lookup_readers",
    "tensor_bytes",
]

ALIGNMENT = 4096  # a region of at least PAGE_ALIGNED_BYTES starts on a page boundary (mmap)
PAGE_ALIGNED_BYTES = 65536  # smaller regions are read, not mapped: SMALL_ALIGNMENT spares the padding
SMALL_ALIGNMENT = 64
MIN_EXTERNAL_BYTES = 1024  # smaller initializers stay inside their graph


def tensor_bytes(t) -> bytes:
    """The little-endian bytes of an (inline) ONNX tensor, whichever field holds them."""
    import onnx

    if t.HasField("raw_data"):
        return bytes(t.raw_data)
    return onnx.numpy_helper.to_array(t).tobytes()


def _external(t, offset: int, length: int):
    import onnx

    out = onnx.TensorProto()
    out.name = t.name
    out.data_type = t.data_type
    out.dims.extend(t.dims)
    if t.doc_string:
        out.doc_string = t.doc_string
    out.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", WEIGHTS_FILE), ("offset", str(offset)), ("length", str(length))):
        entry = out.external_data.add()
        entry.key, entry.value = key, value
    return out


PRODUCT_SUFFIX = ".product"  # the second name of a table read by a lookup and by a weight product


def split_lookup_readers(proto) -> dict[str, str]:
    """Give the weight products of ``proto`` that read a table a ``Gather`` also reads (a tied
    embedding: the lookup and the output projection) a second initializer with the same bytes,
    ``<table>.product``; returns ``{second name: table}``.

    Both names become one region of the weights file (:func:`share_weights` stores equal bytes
    once), so the lookup and the projection still read one tensor. ONNX Runtime packs a product's
    constant weight into a buffer of its own and then releases the initializer when nothing else
    reads it; a table under one name stays mapped whole after packing, under two names only the
    rows the lookup touches do (at opus-mt-en-de size 113 MiB less resident memory, float32)."""
    import onnx

    inits = {t.name: t for t in proto.graph.initializer}
    looked_up = {n.input[0] for n in proto.graph.node if n.op_type == "Gather" and n.input[0] in inits}
    views: dict[str, str] = {}
    for node in proto.graph.node:
        if node.op_type == "Gather":
            continue
        for i, name in enumerate(node.input):
            if name in looked_up:
                second = name + PRODUCT_SUFFIX
                if second not in views:
                    copy = onnx.TensorProto()
                    copy.CopyFrom(inits[name])
                    copy.name = second
                    proto.graph.initializer.append(copy)
                    views[second] = name
                node.input[i] = second
    return views


def _region(t) -> Optional[tuple]:
    import onnx

    if t.data_location != onnx.TensorProto.EXTERNAL:
        return None
    info = {e.key: e.value for e in t.external_data}
    return info.get("location"), info.get("offset"), info.get("length"), t.data_type, tuple(t.dims)


def is_product_view(graph, name: str, table: str) -> bool:
    """Whether the initializer ``name`` of ``graph`` is the second name :func:`split_lookup_readers`
    gave the table ``table``: ``<table>.product``, the same region of the same weights file, of
    the same dtype and shape (one tensor under two names). A graph read with its external data
    loaded holds the bytes themselves: equal bytes, which the weights file stores once."""
    if name != table + PRODUCT_SUFFIX:
        return False
    inits = {t.name: t for t in graph.initializer}
    if name not in inits or table not in inits:
        return False
    a, b = inits[name], inits[table]
    if (a.data_type, list(a.dims)) != (b.data_type, list(b.dims)):
        return False
    if _region(a) is not None or _region(b) is not None:
        return _region(a) == _region(b)
    return tensor_bytes(a) == tensor_bytes(b)  # read into memory: the weights file stores them once


def share_weights(directory: str | os.PathLike, graph_files: Sequence[str]) -> dict:
    """Rewrite the graphs ``graph_files`` of ``directory`` so that they read their large
    initializers from ``directory / WEIGHTS_FILE``, each distinct byte string stored once.

    The graphs are read whole first (their current external data included, a previous weights
    file or a ``<graph>.data`` of a model over 2 GiB), then the new weights file is written under
    a temporary name and renamed, the graphs saved, and the ``<graph>.data`` files the exporter
    writes for large graphs removed. Returns the manifest's ``"weights"`` section:
    ``{"file", "bytes", "alignment", "tensors", "initializers", "graphs": {file: bytes read},
    "product_views": {file: {second name: table}}}`` (:func:`split_lookup_readers`).
    """
    import onnx

    directory = Path(directory)
    protos = {name: onnx.load(os.fspath(directory / name)) for name in graph_files}
    views = {name: split_lookup_readers(proto) for name, proto in protos.items()}
    regions: dict[str, tuple[int, int]] = {}  # SHA-256 of the bytes -> (offset, length)
    target = directory / WEIGHTS_FILE
    tmp = directory / temporary_name(target)
    moved, per_graph = 0, {}
    try:
        with open(tmp, "wb") as f:
            end = 0
            for name, proto in protos.items():
                read = 0
                for i, t in enumerate(proto.graph.initializer):
                    data = tensor_bytes(t)
                    if len(data) < MIN_EXTERNAL_BYTES:
                        if t.data_location == onnx.TensorProto.EXTERNAL:  # came from a file: inline again
                            inline = onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(t), t.name)
                            proto.graph.initializer[i].CopyFrom(inline)
                        continue
                    digest = hashlib.sha256(data).hexdigest()
                    if digest not in regions:
                        align = ALIGNMENT if len(data) >= PAGE_ALIGNED_BYTES else SMALL_ALIGNMENT
                        start = -(-end // align) * align
                        f.write(b"\0" * (start - end))
                        f.write(data)
                        end = start + len(data)
                        regions[digest] = (start, len(data))
                    offset, length = regions[digest]
                    proto.graph.initializer[i].CopyFrom(_external(t, offset, length))
                    read += length
                    moved += 1
                per_graph[name] = read
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    for name, proto in protos.items():
        onnx.save_model(proto, os.fspath(directory / name))
        stale = directory / (name + ".data")
        stale.unlink(missing_ok=True)
    size = target.stat().st_size
    logger.info(
        "%s: %d initializers of %d graphs in %d regions, %.1f MiB",
        WEIGHTS_FILE,
        moved,
        len(protos),
        len(regions),
        size / 2**20,
    )
    return {
        "file": WEIGHTS_FILE,
        "bytes": size,
        "alignment": ALIGNMENT,
        "tensors": len(regions),
        "initializers": moved,
        "graphs": per_graph,
        "product_views": {name: v for name, v in views.items() if v},
    }
