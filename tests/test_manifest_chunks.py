"""The shared weights file's SHA-256 per chunk (the manifest's ``weights.chunks``): written by
every export, checked by a runner on a thread pool before any session is made; a changed chunk
is one line naming the file and nothing is loaded; folders that record only the whole file's
SHA-256 still load, and are still checked. The digests are compared with hashlib over the
file's bytes read here."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import onnxruntime
import pytest

from export import ManifestError
from export.manifest import write_manifest
from transformer_ext import export_format as ef
from transformer_ext import translate
from transformer_ext.export_format import HASHES_KEY, MANIFEST_NAME, WEIGHTS_FILE, chunk_hashes, read_manifest
from transformer_ext.runtimes import OrtRunner

SMALL_CHUNK = 4096  # so that the tiny model's weights file has many chunks


def _manifest(folder: Path) -> dict:
    return json.loads((folder / MANIFEST_NAME).read_text())


@pytest.fixture
def folder(exported_portable, tmp_path, monkeypatch) -> Path:
    """A copy of the tiny portable export whose manifest records chunks of :data:`SMALL_CHUNK` bytes."""
    dst = tmp_path / "export"
    shutil.copytree(exported_portable, dst)
    monkeypatch.setattr(ef, "WEIGHTS_CHUNK_BYTES", SMALL_CHUNK)
    write_manifest(dst, _manifest(dst))
    monkeypatch.undo()
    return dst


@pytest.fixture
def sessions(monkeypatch) -> list:
    made: list = []
    real = onnxruntime.InferenceSession
    monkeypatch.setattr(onnxruntime, "InferenceSession", lambda *a, **k: made.append(a) or real(*a, **k))
    return made


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _sources():
    return np.array([[5, 9, 12, 7, 2], [6, 8, 2, 0, 0]], dtype=np.int64), np.array([5, 3], dtype=np.int64)


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, 3 * 4096 + 17])
def test_chunk_hashes_are_the_sha256_of_each_slice(tmp_path, size):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    expected = [hashlib.sha256(data[i : i + 4096]).hexdigest() for i in range(0, size, 4096)]
    assert chunk_hashes(path, 4096) == expected
    with pytest.raises(ValueError, match="chunk_bytes"):
        chunk_hashes(path, 0)


def test_an_export_records_the_weights_file_per_chunk(exported_portable):
    manifest = _manifest(exported_portable)
    data = (exported_portable / WEIGHTS_FILE).read_bytes()
    chunks = manifest["weights"]["chunks"]
    step = chunks["bytes"]
    assert step == ef.WEIGHTS_CHUNK_BYTES
    assert chunks["sha256"] == [
        hashlib.sha256(data[i : i + step]).hexdigest() for i in range(0, len(data), step)
    ]
    assert manifest[HASHES_KEY][WEIGHTS_FILE] == hashlib.sha256(data).hexdigest()  # the whole file's too


def test_a_folder_with_many_chunks_loads_and_decodes_as_the_original(exported_portable, folder):
    assert len(_manifest(folder)["weights"]["chunks"]["sha256"]) > 4
    src, lengths = _sources()
    expected = OrtRunner(exported_portable).greedy(src, lengths, max_new_tokens=6)
    assert [list(r) for r in OrtRunner(folder).greedy(src, lengths, max_new_tokens=6)] == [
        list(r) for r in expected
    ]


@pytest.mark.parametrize("where", ["first", "last"])
def test_one_flipped_byte_in_a_chunk_is_one_line_naming_the_file_and_nothing_loads(
    folder, sessions, capsys, where
):
    path = folder / WEIGHTS_FILE
    size = path.stat().st_size
    _flip(path, 0 if where == "first" else size - 1)
    count = -(-size // SMALL_CHUNK)
    chunk = 1 if where == "first" else count
    with pytest.raises(ManifestError, match=f"{path}.*chunk {chunk} of {count}"):
        OrtRunner(folder)
    assert sessions == []  # no graph was loaded
    code = translate.main(["hello", "--model", str(folder)])
    err = capsys.readouterr().err
    assert code == 1 and str(path) in err and len(err.strip().splitlines()) == 1, err
    assert sessions == []


def test_a_folder_with_only_the_whole_file_sha256_loads_and_is_still_checked(
    exported_portable, tmp_path, sessions
):
    old = tmp_path / "old"
    shutil.copytree(exported_portable, old)
    manifest = _manifest(old)
    del manifest["weights"]["chunks"]
    (old / MANIFEST_NAME).write_text(json.dumps(manifest))  # as written before the chunks were recorded
    src, lengths = _sources()
    expected = OrtRunner(exported_portable).greedy(src, lengths, max_new_tokens=6)
    assert [list(r) for r in OrtRunner(old).greedy(src, lengths, max_new_tokens=6)] == [
        list(r) for r in expected
    ]
    sessions.clear()
    path = old / WEIGHTS_FILE
    _flip(path, path.stat().st_size - 1)
    with pytest.raises(
        ManifestError, match=f"{path} is not the file this export was written with: its SHA-256"
    ):
        OrtRunner(old)
    assert sessions == []


@pytest.mark.parametrize(
    "edit",
    [
        lambda c: c.update(bytes=0),
        lambda c: c.update(bytes=True),
        lambda c: c["sha256"].pop(),
        lambda c: c["sha256"].append("0" * 64),
        lambda c: c["sha256"].__setitem__(0, "not a digest"),
        lambda c: c.update(sha256="0" * 64),
    ],
)
def test_a_malformed_chunk_list_is_refused_naming_the_key(folder, edit):
    manifest = _manifest(folder)
    edit(manifest["weights"]["chunks"])
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match="weights.chunks"):
        read_manifest(folder)
