"""What the export commands do with the user's folders, bad input and interruptions.

export.onnx, export.triton and export.tensorrt replace only folders they wrote (a format marker
and the list of their files), never a folder that overlaps their input; they check every
argument before writing; a full disk, a read-only folder or a corrupt input end in one line on
stderr and exit code 1 with nothing left behind and the old output intact; SIGINT / SIGTERM
remove the temporary folder (exit 130 / 143) and a later run removes what a SIGKILL left.

Faults are injected (a patched ``os.replace`` / ``os.mkdir`` / ``os.open`` / ``os.rename``
raising ENOSPC or EROFS): everything runs as root here, so permissions prove nothing. The
interrupted runs are real subprocesses that stop at a known point of the write (they print a
line and wait on stdin) before the signal is sent, so no test waits on a clock.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from fake_tensorrt import fake_tensorrt
from helpers import make_model_dir, with_cross_per_row

from export import GraphContractError, OutputFolderError
from export import onnx as export_mod
from export import tensorrt as trtb
from export import triton as triton_export
from export.onnx import export_onnx
from export.triton import MARKER_FILE, export_triton
from transformer_ext.export_format import DECODER_FILE, ENCODER_FILE, MANIFEST_NAME, read_manifest
from transformer_ext.tokenizer import TokenizerError

ROOT = Path(__file__).resolve().parents[1]
TEMP_MARKS = (".tmp-", ".old-")


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file below ``folder`` with its bytes."""
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def temporaries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if any(m in p.name for m in TEMP_MARKS))


def one_error_line(err: str, *needles: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if ": error: " in line]
    assert len(errors) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    return errors[0]


def fail_on(monkeypatch, name: str, code: int, when, module=os):
    """Patch ``module.name`` to raise OSError(code) for the calls where ``when(*args)`` is true."""
    real = getattr(module, name)

    def fake(*args, **kwargs):
        if when(*args):
            raise OSError(code, os.strerror(code), os.fspath(args[0]))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, fake)


def under(folder: Path):
    folder = os.fspath(folder)
    return lambda path, *rest: os.fspath(path).startswith(folder)


@pytest.fixture
def model_dir(tmp_path) -> Path:
    return make_model_dir(tmp_path / "model")


def v1_folder(export: Path, dst: Path) -> Path:
    """``export`` rewritten as a version-1 folder (no file list) with the files the version-1
    TensorRT builder added."""
    shutil.copytree(export, dst)
    with_cross_per_row(dst)
    import onnx

    onnx.save(onnx.load(dst / ENCODER_FILE), dst / ENCODER_FILE)  # version 1: weights inside the graphs
    (dst / "weights.data").unlink()
    manifest = json.loads((dst / MANIFEST_NAME).read_text())
    manifest.pop("weights")
    (dst / manifest.pop("generation_config")).unlink()  # version 1 had no generation config
    manifest["format_version"] = 1
    manifest.pop("sha256")  # written since version 3
    manifest["files"] = {
        "encoder": ENCODER_FILE,
        "decoder_step": DECODER_FILE,
        "tokenizer": manifest.pop("tokenizer_files"),
    }
    manifest["tensorrt"] = {"engines": {"fp16": {"engines": {"encoder": {"file": "encoder.fp16.engine"}}}}}
    (dst / MANIFEST_NAME).write_text(json.dumps(manifest))
    for name in (
        "encoder.fp16.engine",
        "decoder_step.fp16.engine",
        "decoder_step.fp16.onnx",
        "tensorrt.timing.cache",
    ):
        (dst / name).write_bytes(b"old builder output")
    return dst


# ------------------------------------------------------------------------------------------
# 1. export.onnx replaces only a folder whose manifest it wrote and that holds only its files
# ------------------------------------------------------------------------------------------


def test_foreign_manifest_and_its_neighbours_are_kept(tmp_path, model_dir, fast_export, capsys):
    out = tmp_path / "d"
    out.mkdir()
    (out / MANIFEST_NAME).write_text('{"name": "app"}')
    (out / "notes.txt").write_text("x")
    before = snapshot(out)
    assert export_mod.main(["--model", str(model_dir), "--output-dir", str(out), "--no-validate"]) == 1
    one_error_line(capsys.readouterr().err, str(out), "not written by this package", "notes.txt")
    assert snapshot(out) == before and fast_export == []  # refused before any work


def test_an_export_with_a_file_of_the_users_is_refused(tmp_path, model_dir, fast_export):
    out = tmp_path / "out"
    export_onnx(model_dir, out, validate=False)
    assert read_manifest(out)["files"] == sorted(os.listdir(out))
    (out / "notes.txt").write_text("mine")
    (out / "results").mkdir()
    before = snapshot(out)
    with pytest.raises(OutputFolderError, match=r"did not write there: notes.txt, results\. Refusing"):
        export_onnx(model_dir, out, validate=False)
    assert snapshot(out) == before
    (out / "notes.txt").unlink()
    (out / "results").rmdir()
    export_onnx(model_dir, out, validate=False)  # only its own files again: replaced
    assert temporaries(tmp_path) == []


def test_version_1_folders_are_recognised_by_their_file_set(
    tmp_path, model_dir, fast_export, exported_portable
):
    old = v1_folder(exported_portable, tmp_path / "old")
    export_onnx(model_dir, old, validate=False)
    assert read_manifest(old)["format_version"] == 4
    assert not (old / "encoder.fp16.engine").exists()  # the old engines were the old export's
    other = v1_folder(exported_portable, tmp_path / "other")
    (other / "encoder.fp16.engine.backup").write_text("not a name the old tools wrote")
    before = snapshot(other)
    with pytest.raises(OutputFolderError, match="encoder.fp16.engine.backup"):
        export_onnx(model_dir, other, validate=False)
    assert snapshot(other) == before


def test_empty_folder_is_used_and_a_file_is_refused(tmp_path, model_dir, fast_export):
    empty = tmp_path / "empty"
    empty.mkdir()
    export_onnx(model_dir, empty, validate=False)
    assert (empty / ENCODER_FILE).is_file()
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputFolderError, match="exists and is not a folder"):
        export_onnx(model_dir, tmp_path / "file", validate=False)
    with pytest.raises(OutputFolderError, match="is a file, not a folder"):
        export_onnx(model_dir, tmp_path / "file" / "sub" / "out", validate=False)
    assert (tmp_path / "file").read_text() == "x"


def test_tensorrt_lists_its_files_so_the_folder_stays_replaceable(
    tmp_path, model_dir, fast_export, monkeypatch
):
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt([]))
    out = tmp_path / "out"
    export_onnx(model_dir, out, validate=False)
    trtb.build_engines(out, trtb.BuildOptions(precision="fp16"))
    manifest = read_manifest(out)
    assert manifest["files"] == sorted(os.listdir(out))
    assert {
        "encoder.fp16.engine",
        "decoder_step.fp16.engine",
        "decoder_step.fp16.onnx",
        "tensorrt.timing.cache",
    } <= set(manifest["files"])
    engines = tmp_path / "engines"  # a separate engine folder lists its own files
    trtb.build_engines(out, trtb.BuildOptions(precision="fp32", output_dir=engines))
    assert read_manifest(engines)["files"] == sorted(os.listdir(engines))
    export_onnx(model_dir, out, validate=False)  # replaced: nothing in it but listed files
    assert not (out / "encoder.fp16.engine").exists()
    export_onnx(model_dir, engines, validate=False)


def test_tensorrt_writes_only_into_folders_of_ours(tmp_path, exported_portable, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt([]))
    export = tmp_path / "export"
    shutil.copytree(exported_portable, export)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(OutputFolderError, match="holds no engine manifest of this package"):
        trtb.build_engines(export, trtb.BuildOptions(output_dir=mine))
    assert sorted(os.listdir(mine)) == ["notes.txt"]
    other = tmp_path / "other"  # another export: its manifest must not start describing this one's engines
    shutil.copytree(exported_portable, other)
    before = snapshot(other)
    with pytest.raises(OutputFolderError, match="holds the graphs of another export"):
        trtb.build_engines(export, trtb.BuildOptions(output_dir=other))
    assert snapshot(other) == before
    engines = tmp_path / "engines"
    trtb.build_engines(other, trtb.BuildOptions(output_dir=engines))
    with pytest.raises(OutputFolderError, match="holds the engines of the export ../other"):
        trtb.build_engines(export, trtb.BuildOptions(output_dir=engines))
    (export / "encoder.fp32.engine").write_bytes(b"an engine of the user's")
    with pytest.raises(OutputFolderError, match="encoder.fp32.engine, which its manifest does not list"):
        trtb.build_engines(export)
    assert (export / "encoder.fp32.engine").read_bytes() == b"an engine of the user's"


# ------------------------------------------------------------------------------------------
# 2. export.triton: --output-dir never overlaps the export; --force replaces only its own repository
# ------------------------------------------------------------------------------------------


def test_triton_out_overlapping_the_export_is_refused(tmp_path, exported_portable, capsys):
    project = tmp_path / "P"
    export = project / "onnx"
    shutil.copytree(exported_portable, export)
    (tmp_path / "link").symlink_to(export)
    before = snapshot(project)
    for out, relation in (
        (project, "contains"),
        (export, "is"),
        (export / "repo", "is inside"),
        (tmp_path / "link", "is"),
    ):
        code = triton_export.main(["--model", str(export), "--output-dir", str(out), "--force"])
        assert code == 1
        one_error_line(capsys.readouterr().err, f"{relation} the export folder")
    assert snapshot(project) == before
    assert temporaries(tmp_path) == temporaries(project) == []


def test_triton_force_replaces_only_its_own_files(tmp_path, exported_portable):
    repo = export_triton(exported_portable, tmp_path / "repo").repo_dir
    marker = json.loads((repo / MARKER_FILE).read_text())
    assert marker["format"] == "transformer_ext.triton_repository" and MARKER_FILE in marker["files"]
    assert sorted(marker["files"]) == sorted(
        p.relative_to(repo).as_posix() for p in repo.rglob("*") if p.is_file()
    )
    pycache = repo / "translator" / "1" / "__pycache__"  # what Triton's Python backend leaves
    pycache.mkdir()
    (pycache / "model.cpython-311.pyc").write_bytes(b"bytecode")
    export_triton(exported_portable, repo, force=True)
    (repo / "encoder" / "2").mkdir()
    (repo / "encoder" / "2" / "model.onnx").write_bytes(b"a version of the user's")
    before = snapshot(repo)
    with pytest.raises(OutputFolderError, match="encoder/2/model.onnx"):
        export_triton(exported_portable, repo, force=True)
    assert snapshot(repo) == before
    # a repository of the version before the marker: recognised by its exact files (its graphs
    # held their weights: no shared weights file beside them)
    shutil.rmtree(repo / "encoder" / "2")
    (repo / MARKER_FILE).unlink()
    for shared in repo.glob("*/1/weights.data"):
        shared.unlink()
    vendor = repo / "translator" / "1" / "_vendor" / "transformer_ext"  # that version vendored one module
    shutil.rmtree(vendor / "decoding")
    (vendor / "decoding.py").write_text("# the decoding module of that version\n")
    export_triton(exported_portable, repo, force=True)
    assert (repo / MARKER_FILE).is_file() and temporaries(tmp_path) == []


# ------------------------------------------------------------------------------------------
# 4. interruptions: SIGTERM / SIGINT clean up, SIGKILL leftovers go at the next run
# ------------------------------------------------------------------------------------------

# Runs the real main() of a module in a subprocess, with one function wrapped so that the
# process prints "READY" and waits on stdin at a known point inside the staged write.
CHILD = r"""
import importlib, os, signal, sys
# a test sends this process SIGINT: deliverable even when the test run was started with it ignored
signal.signal(signal.SIGINT, signal.default_int_handler)
module, attr, src = sys.argv[1], sys.argv[2], sys.argv[3]
mod = importlib.import_module(module)
real = getattr(mod, attr)

def fast_export_graph(module_, args, spec, n_positional, opset, flavour, path, **kwargs):
    import onnx
    proto = onnx.load(os.path.join(src, path.name))
    onnx.save(proto, path)
    return proto

def stop_here(*args, **kwargs):
    result = (fast_export_graph if attr == "_export_graph" else real)(*args, **kwargs)
    if attr != "_export_graph" or args[6].name == "decoder_step.onnx":
        print("READY", flush=True)
        sys.stdin.readline()
    return result

setattr(mod, attr, stop_here)
sys.exit(mod.main(sys.argv[4:]))
"""


def start_child(module: str, attr: str, src: Path, argv: list[str]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, module, attr, str(src), *argv],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    if line.strip() != "READY":
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"the child stopped before the write: {line!r}\n{err}")
    return proc


@pytest.mark.parametrize(
    "sig, code, word", [(signal.SIGTERM, 143, "terminated"), (signal.SIGINT, 130, "interrupted")]
)
def test_export_onnx_interrupted_leaves_no_temporary_and_keeps_the_old_export(
    tmp_path, model_dir, exported_portable, fast_export, sig, code, word
):
    out = tmp_path / "out"
    export_onnx(model_dir, out, validate=False)
    before = snapshot(out)
    proc = start_child(
        "export.onnx",
        "_export_graph",
        exported_portable,
        ["--model", str(model_dir), "--output-dir", str(out), "--no-validate"],
    )
    assert len(temporaries(tmp_path)) == 1  # the staged folder exists while it writes
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    assert f"python -m export.onnx: {word}" in err and "Traceback" not in err
    assert temporaries(tmp_path) == [] and snapshot(out) == before


def test_export_onnx_killed_leaves_a_temporary_that_the_next_run_removes(
    tmp_path, model_dir, exported_portable, fast_export, caplog
):
    out = tmp_path / "out"
    proc = start_child(
        "export.onnx",
        "_export_graph",
        exported_portable,
        ["--model", str(model_dir), "--output-dir", str(out), "--no-validate"],
    )
    proc.kill()
    proc.communicate(timeout=120)
    [left] = temporaries(tmp_path)
    assert left.startswith(".out.tmp-") and f"-{proc.pid}-" in left
    with caplog.at_level(logging.WARNING, logger="transformer_ext.fsutil"):
        export_onnx(model_dir, out, validate=False)
    assert temporaries(tmp_path) == []
    assert any(left in r.getMessage() and f"process {proc.pid}" in r.getMessage() for r in caplog.records)


def test_export_triton_terminated_leaves_no_temporary(tmp_path, exported_portable):
    repo = export_triton(exported_portable, tmp_path / "repo").repo_dir
    before = snapshot(repo)
    proc = start_child(
        "export.triton",
        "_write_translator",
        exported_portable,
        ["--model", str(exported_portable), "--output-dir", str(repo), "--force"],
    )
    assert len(temporaries(tmp_path)) == 1
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143 and "python -m export.triton: terminated" in err, err
    assert temporaries(tmp_path) == [] and snapshot(repo) == before


def test_tensorrt_interrupted_while_renaming_puts_the_folder_back(tmp_path, exported_portable, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt([]))
    folder = tmp_path / "e"
    shutil.copytree(exported_portable, folder)
    trtb.build_engines(folder, trtb.BuildOptions(precision="fp16"))
    before = snapshot(folder)
    real_rename = os.rename
    renames = []

    def interrupted_rename(src, dst):
        renames.append(dst)
        if os.fspath(dst).endswith(MANIFEST_NAME) and ".tmp-" in os.fspath(src):
            raise KeyboardInterrupt  # the engines are in place, the manifest comes last
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", interrupted_rename)
    with pytest.raises(KeyboardInterrupt):
        trtb.build_engines(folder, trtb.BuildOptions(precision="fp16"))
    monkeypatch.setattr(os, "rename", real_rename)
    assert any(os.fspath(d).endswith("decoder_step.fp16.engine") for d in renames)
    assert snapshot(folder) == before and temporaries(folder) == []


# ------------------------------------------------------------------------------------------
# 9. the tokenizer is checked at export, and its ids against the config
# ------------------------------------------------------------------------------------------


def test_corrupt_tokenizer_fails_the_export(tmp_path, model_dir, fast_export, capsys):
    (model_dir / "tokenizer.json").write_text('{"format": "transformer_ext.CharTokenizer", "vers')
    out = tmp_path / "out"
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        export_onnx(model_dir, out, validate=False)
    assert export_mod.main(["--model", str(model_dir), "--output-dir", str(out), "--no-validate"]) == 1
    one_error_line(capsys.readouterr().err, str(model_dir / "tokenizer.json"))
    assert not out.exists() and fast_export == []


def test_special_ids_of_config_and_tokenizer_must_agree(tmp_path, fast_export):
    model_dir = make_model_dir(tmp_path / "model", bos_id=4)
    with pytest.raises(
        TokenizerError, match=r"model/config.json has bos_id = 4 but .*model/tokenizer.json has bos = 1"
    ):
        export_onnx(model_dir, tmp_path / "out", validate=False)
    small = make_model_dir(tmp_path / "small")
    from transformer_ext.tokenizer import SPECIAL_TOKENS, CharTokenizer

    CharTokenizer(list(SPECIAL_TOKENS) + list("abc"), list(SPECIAL_TOKENS) + list("xyz")).save(small)
    with pytest.raises(
        TokenizerError,
        match=r"small/tokenizer.json has a source vocabulary of 7 tokens but "
        r".*small/config.json has src_vocab_size = 48",
    ):
        export_onnx(small, tmp_path / "out", validate=False)
    assert not (tmp_path / "out").exists()


def test_model_folder_without_tokenizer_exports_with_a_warning(tmp_path, model_dir, fast_export, caplog):
    (model_dir / "tokenizer.json").unlink()
    with caplog.at_level(logging.WARNING, logger="export.onnx"):
        result = export_onnx(model_dir, tmp_path / "out", validate=False)
    assert any("no tokenizer.json" in r.getMessage() for r in caplog.records)
    assert result.manifest["tokenizer_files"] == [] and "tokenizer.json" not in os.listdir(result.output_dir)
    assert result.manifest["special_tokens"] == {"pad": 0, "bos": 1, "eos": 2}


def test_the_provenance_of_the_training_data_travels_with_the_export(tmp_path, model_dir, fast_export):
    provenance = {"corpus": "test", "licence": "public domain"}
    (model_dir / "provenance.json").write_text(json.dumps(provenance))
    result = export_onnx(model_dir, tmp_path / "out", validate=False)
    assert (
        result.manifest["provenance"] == "provenance.json" and "provenance.json" in result.manifest["files"]
    )
    assert json.loads((Path(result.output_dir) / "provenance.json").read_text()) == provenance
    (model_dir / "provenance.json").unlink()
    assert export_onnx(model_dir, tmp_path / "out2", validate=False).manifest["provenance"] is None


def test_manifest_ids_are_those_of_config_and_tokenizer(tmp_path, model_dir, fast_export):
    from transformer_ext.checkpoint import load_model
    from transformer_ext.tokenizer import CharTokenizer

    manifest = export_onnx(model_dir, tmp_path / "out", validate=False).manifest
    config = load_model(model_dir).config
    tokenizer = CharTokenizer.load(model_dir)
    assert manifest["special_tokens"] == {
        "pad": config.pad_id,
        "bos": config.bos_id,
        "eos": config.eos_id,
        "unk": tokenizer.unk_id,
    }
    assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id) == (
        config.pad_id,
        config.bos_id,
        config.eos_id,
    )


# ------------------------------------------------------------------------------------------
# 16. full disk, read-only folder, corrupt input: one line, exit 1, nothing left, old output intact
# ------------------------------------------------------------------------------------------


def test_export_onnx_full_disk_and_read_only_folder(tmp_path, model_dir, fast_export, monkeypatch, capsys):
    out = tmp_path / "out"
    export_onnx(model_dir, out, validate=False)
    before = snapshot(out)
    argv = ["--model", str(model_dir), "--output-dir", str(out), "--no-validate", "--examples", "0"]
    with monkeypatch.context() as m:
        fail_on(m, "replace", errno.ENOSPC, under(tmp_path))
        assert export_mod.main(argv) == 1
        one_error_line(capsys.readouterr().err, "no space left", str(out))
        with pytest.raises(OSError) as info:  # --debug: the traceback, not the one line
            export_mod.main(argv + ["--debug"])
        assert info.value.errno == errno.ENOSPC
    with monkeypatch.context() as m:
        fail_on(m, "mkdir", errno.EROFS, under(tmp_path))
        assert export_mod.main(argv) == 1
        one_error_line(capsys.readouterr().err, "read-only", str(out))
    assert snapshot(out) == before and temporaries(tmp_path) == []


def test_export_triton_corrupt_graph_full_disk_and_read_only(
    tmp_path, exported_portable, monkeypatch, capsys
):
    export = tmp_path / "export"
    shutil.copytree(exported_portable, export)
    repo = export_triton(export, tmp_path / "repo").repo_dir
    before = snapshot(repo)
    argv = ["--model", str(export), "--output-dir", str(repo), "--force"]
    good = (export / ENCODER_FILE).read_bytes()
    (export / ENCODER_FILE).write_bytes(good[: len(good) // 3])  # truncated
    assert triton_export.main(argv) == 1
    one_error_line(
        capsys.readouterr().err,
        str(export / ENCODER_FILE),
        "is not a valid ONNX graph",
        "export the folder again",
    )
    (export / ENCODER_FILE).write_bytes(good)
    with monkeypatch.context() as m:
        fail_on(m, "replace", errno.ENOSPC, under(tmp_path))
        assert triton_export.main(argv) == 1
        one_error_line(capsys.readouterr().err, "no space left", str(repo))
        with pytest.raises(OSError):
            triton_export.main(argv + ["--debug"])
    with monkeypatch.context() as m:
        fail_on(m, "mkdir", errno.EROFS, under(tmp_path))
        assert (
            triton_export.main(["--model", str(export), "--output-dir", str(tmp_path / "new" / "repo")]) == 1
        )
        one_error_line(capsys.readouterr().err, "read-only", str(tmp_path / "new" / "repo"))
    assert snapshot(repo) == before and temporaries(tmp_path) == [] and not (tmp_path / "new").exists()


def test_export_tensorrt_full_disk_and_read_only(tmp_path, exported_portable, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt([]))
    folder = tmp_path / "e"
    shutil.copytree(exported_portable, folder)
    assert trtb.main([str(folder), "--precision", "fp16"]) == 0
    capsys.readouterr()
    before = snapshot(folder)
    opened = []

    def second_new_file(path, flags, *rest):
        if flags & os.O_CREAT and under(folder)(path):
            opened.append(path)
            return len(opened) == 2
        return False

    with monkeypatch.context() as m:
        fail_on(m, "open", errno.ENOSPC, second_new_file)
        assert trtb.main([str(folder), "--precision", "fp16"]) == 1
        one_error_line(capsys.readouterr().err, "no space left", str(folder))
    assert snapshot(folder) == before and temporaries(folder) == []
    new = tmp_path / "engines"
    with monkeypatch.context() as m:
        fail_on(m, "mkdir", errno.EROFS, under(tmp_path))
        assert trtb.main([str(folder), "--output-dir", str(new)]) == 1
        one_error_line(capsys.readouterr().err, "read-only", str(new))
        with pytest.raises(OSError):
            trtb.main([str(folder), "--output-dir", str(new), "--debug"])
    assert not new.exists() and temporaries(tmp_path) == [] and snapshot(folder) == before


# ------------------------------------------------------------------------------------------
# smaller: symlinked output folders, every argument checked before the disk is touched
# ------------------------------------------------------------------------------------------


def test_symlinked_output_folder_stays_a_symlink(tmp_path, model_dir, fast_export):
    real = tmp_path / "releases" / "v1"
    real.parent.mkdir()
    export_onnx(model_dir, real, validate=False)
    old_manifest = (real / MANIFEST_NAME).read_bytes()
    link = tmp_path / "current"
    link.symlink_to(real)
    export_onnx(model_dir, link, validate=False, cache_len=32)
    assert link.is_symlink() and Path(os.readlink(link)) == real
    assert (real / MANIFEST_NAME).read_bytes() != old_manifest  # the folder it points to was replaced
    assert temporaries(tmp_path) == temporaries(real.parent) == []


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(opset=18.7), "opset must be an integer"),
        (dict(opset=True), "opset must be an integer"),
        (dict(cache_len=0), "cache_len must be >= 1"),
        (dict(cache_len=2.5), "cache_len must be an integer"),
        (dict(tolerance=float("inf")), "positive finite"),
        (dict(tolerance=float("nan")), "positive finite"),
        (dict(flavour="merged"), "flavour"),
    ],
)
def test_bad_arguments_touch_nothing(tmp_path, model_dir, fast_export, kwargs, match):
    with pytest.raises(ValueError, match=match):
        export_onnx(model_dir, tmp_path / "a" / "b" / "out", **kwargs)
    assert not (tmp_path / "a").exists() and fast_export == []


def test_failed_export_removes_the_parents_it_made(tmp_path, model_dir, fast_export, monkeypatch):
    from export import ParityError
    from export import validate as validation

    def broken(*args, **kwargs):
        raise ParityError("decoder_step/logits", None, 1.0, 1e-4, "injected")

    monkeypatch.setattr(validation, "validate_export", broken)
    with pytest.raises(ParityError):
        export_onnx(model_dir, tmp_path / "a" / "b" / "out")
    assert sorted(os.listdir(tmp_path)) == ["model"]


def test_triton_bad_gpu_list_is_an_option_error(tmp_path, exported_portable, capsys):
    with pytest.raises(SystemExit) as info:
        triton_export.main(
            ["--model", str(exported_portable), "--output-dir", str(tmp_path / "r"), "--gpus", "0,x"]
        )
    assert info.value.code == 2 and "comma-separated GPU ids" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


# ------------------------------------------------------------------------------------------
# 5. exit codes, outputs inside the model folder, the tied projection found by tracing
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "option, value, match",
    [
        ("--cache-len", "0", "cache_len must be >= 1"),
        ("--tolerance", "-1", "tolerance must be a positive finite number"),
        ("--opset", "30", "opset 30 is not supported"),
    ],
)
def test_export_onnx_values_out_of_range_exit_2(
    tmp_path, model_dir, fast_export, capsys, option, value, match
):
    out = tmp_path / "out"
    code = export_mod.main(["--model", str(model_dir), "--output-dir", str(out), option, value])
    assert code == 2
    one_error_line(capsys.readouterr().err, match)
    assert not out.exists() and fast_export == []


def test_export_onnx_output_inside_the_model_folder_is_refused(tmp_path, model_dir, fast_export, capsys):
    before = snapshot(model_dir)
    out = model_dir / "onnx"
    assert export_mod.main(["--model", str(model_dir), "--output-dir", str(out)]) == 1
    one_error_line(capsys.readouterr().err, f"--output-dir {out} lies inside the model folder --model")
    assert snapshot(model_dir) == before and fast_export == []


@pytest.mark.parametrize("managed", ["best", "last", "checkpoints/step-40"])
def test_export_onnx_output_inside_a_training_runs_managed_folders_is_refused(
    tmp_path, model_dir, fast_export, capsys, managed
):
    run = tmp_path / "run"
    run.mkdir()
    # the marker a training run folder carries (written by hand here: only its format field matters)
    (run / "run.json").write_text(json.dumps({"format": "transformer_ext.train-run", "version": 1}))
    out = run / managed / "onnx"
    assert export_mod.main(["--model", str(model_dir), "--output-dir", str(out)]) == 1
    top = managed.split("/")[0]
    one_error_line(capsys.readouterr().err, f"the {top}/ folder of the training run")
    assert not out.exists() and fast_export == []


def _tied_model_dir(directory: Path) -> Path:
    """A tiny tied model whose 64 x 32 embedding has the size of other weights (d_ff x d_model, max_len)."""
    from transformer_ext.checkpoint import save_model
    from transformer_ext.config import TransformerConfig
    from transformer_ext.model import Transformer
    from transformer_ext.tokenizer import SPECIAL_TOKENS, CharTokenizer

    torch.manual_seed(0)
    config = TransformerConfig.preset(
        "tiny", dropout=0.0, src_vocab_size=64, tgt_vocab_size=64, shared_vocab=True
    )
    assert config.d_model == 32 and config.d_ff * config.d_model == 64 * 32 and config.max_len == 64
    save_model(Transformer(config).eval(), directory)
    vocab = list(SPECIAL_TOKENS) + [chr(0x100 + i) for i in range(64 - len(SPECIAL_TOKENS))]
    CharTokenizer(vocab, shared=True).save(directory)
    return directory


def test_a_tied_model_with_other_weights_of_the_embeddings_size_exports(tmp_path):
    from export import validate as validation

    model = _tied_model_dir(tmp_path / "model")
    result = export_onnx(model, tmp_path / "out", validate=False)
    decoder = onnx.load(result.output_dir / DECODER_FILE)
    size = 64 * 32
    same_size = [t.name for t in decoder.graph.initializer if int(np.prod(t.dims)) == size]
    assert len(same_size) > 1  # what the check by shape tripped over
    validation._check_tied_projection(decoder.graph)
    # a graph whose projection reads a copy of the table is refused, naming both initializers
    gemm = next(n for n in decoder.graph.node if "logits" in n.output)
    table = next(t for t in decoder.graph.initializer if t.name == gemm.input[1])
    copy = onnx.TensorProto()
    copy.CopyFrom(table)
    copy.name = "projection_copy"
    decoder.graph.initializer.append(copy)
    gemm.input[1] = "projection_copy"
    with pytest.raises(
        GraphContractError,
        match=rf"embedding table is {table.name.removesuffix('.product')} but .* reads projection_copy",
    ):
        validation._check_tied_projection(decoder.graph)
