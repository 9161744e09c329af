"""transformer_ext.convert on untrusted and unlucky input: files outside the checkpoint folder, malformed
files, a pickle that would run code, a failing disk, an output folder that appears while the
converter runs, Ctrl-C. Each refusal is one line naming the file or field, and nothing is written.

The checkpoints are written by transformers itself from tiny configs (tests/hf_checkpoints.py) and
then spoiled by hand."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

from hf_checkpoints import write_m2m100, write_marian  # noqa: E402

from transformer_ext.checkpoint import load_model  # noqa: E402
from transformer_ext.convert import ConversionError, convert_transformers  # noqa: E402
from transformer_ext.convert.__main__ import main  # noqa: E402

PROG = "transformer-ext-convert"
SMALL = dict(layers=1, d_model=16, heads=4, d_ff=16)


@pytest.fixture(scope="module")
def marian(tmp_path_factory):
    return write_marian(tmp_path_factory.mktemp("safety") / "hf", **SMALL)


@pytest.fixture(scope="module")
def nllb(tmp_path_factory):
    return write_m2m100(tmp_path_factory.mktemp("safety_nllb") / "hf", nllb=True, **SMALL)


def _copy(src: Path, tmp_path: Path) -> Path:
    hf = tmp_path / "hf"
    shutil.copytree(src, hf)
    return hf


def _edit_json(path: Path, **changes):
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def _refused(hf: Path, tmp_path: Path, capsys, message: str) -> str:
    """The library raises ConversionError with ``message`` (one line), the CLI prints one line
    ``PROG: error: ...`` and exits 1, and nothing is written under the output's parent."""
    out = tmp_path / "out" / "model"
    with pytest.raises(ConversionError) as info:
        convert_transformers(hf, out)
    text = str(info.value)
    assert message in text and "\n" not in text, text
    capsys.readouterr()
    assert main(["transformers", "--model", str(hf), "--output-dir", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"{PROG}: error: ") and message in err, err
    assert not out.exists() and (not out.parent.exists() or not os.listdir(out.parent))
    return text


# ------------------------------------------------------------------------------------------
# files outside the checkpoint folder
# ------------------------------------------------------------------------------------------


def _sharded(hf: Path, shard: str) -> None:
    """Replace model.safetensors by an index whose every tensor lives in the file ``shard``."""
    from safetensors.torch import load_file

    names = sorted(load_file(hf / "model.safetensors"))
    (hf / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": {name: shard for name in names}}
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))


def test_a_shard_index_pointing_outside_the_folder_is_refused(marian, tmp_path, capsys):
    hf = _copy(marian, tmp_path)
    shutil.copy(hf / "model.safetensors", tmp_path / "elsewhere.safetensors")  # a readable model file
    _sharded(hf, "../elsewhere.safetensors")
    text = _refused(hf, tmp_path, capsys, "outside the checkpoint folder")
    assert "elsewhere.safetensors" in text


def test_a_weight_symlink_to_a_file_outside_the_folder_is_refused(marian, tmp_path, capsys):
    hf = _copy(marian, tmp_path)
    os.replace(hf / "model.safetensors", tmp_path / "elsewhere.safetensors")
    (hf / "model.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    text = _refused(hf, tmp_path, capsys, "outside the checkpoint folder")
    assert "model.safetensors" in text


def test_a_tokenizer_symlink_to_a_file_outside_the_folder_is_refused(marian, tmp_path, capsys):
    hf = _copy(marian, tmp_path)
    os.replace(hf / "source.spm", tmp_path / "private.spm")
    (hf / "source.spm").symlink_to(tmp_path / "private.spm")
    assert "source.spm" in _refused(hf, tmp_path, capsys, "outside the checkpoint folder")


def test_a_shard_inside_the_folder_converts(marian, tmp_path):
    hf = _copy(marian, tmp_path)
    (hf / "shards").mkdir()
    shutil.move(hf / "model.safetensors", hf / "shards" / "part-1.safetensors")
    _sharded_path = hf / "shards" / "part-1.safetensors"
    from safetensors.torch import load_file

    names = sorted(load_file(_sharded_path))
    (hf / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {n: "shards/part-1.safetensors" for n in names}})
    )
    ours = convert_transformers(hf, tmp_path / "ours")
    assert load_model(ours).config.d_model == 16


def test_the_hugging_face_cache_layout_converts(marian, tmp_path):
    """In the hub cache every file of ``REPO/snapshots/REV/`` is a symlink into ``REPO/blobs/``."""
    repo = tmp_path / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / "0123abcd", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, f in enumerate(sorted(marian.iterdir())):
        shutil.copy(f, blobs / f"blob{i}")
        (snapshot / f.name).symlink_to(Path("..", "..", "blobs", f"blob{i}"))
    ours = convert_transformers(snapshot, tmp_path / "ours")
    assert load_model(ours).config.d_model == 16


# ------------------------------------------------------------------------------------------
# malformed files
# ------------------------------------------------------------------------------------------


def test_a_shard_index_mapping_to_a_number_is_one_line(marian, tmp_path, capsys):
    hf = _copy(marian, tmp_path)
    (hf / "model.safetensors").unlink()
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": 5}}))
    _refused(
        hf, tmp_path, capsys, 'model.safetensors.index.json: weight_map["x"] must be a shard file name, got 5'
    )


def test_a_shard_index_without_weight_map_is_one_line(marian, tmp_path, capsys):
    hf = _copy(marian, tmp_path)
    (hf / "model.safetensors").unlink()
    (hf / "model.safetensors.index.json").write_text(json.dumps({"x": 5}))
    _refused(hf, tmp_path, capsys, "model.safetensors.index.json: no weight_map")


def test_huge_max_position_embeddings_is_refused_before_allocating(marian, tmp_path, capsys):
    hf = _copy(marian, tmp_path)
    _edit_json(hf / "config.json", max_position_embeddings=10**12)
    _refused(
        hf,
        tmp_path,
        capsys,
        "config.json: field 'max_position_embeddings' must be an integer in [1, 65536], got 1000000000000",
    )


def test_config_sizes_that_disagree_with_the_weights_are_refused_before_allocating(marian, tmp_path, capsys):
    hf = _copy(marian, tmp_path)
    _edit_json(hf / "config.json", encoder_ffn_dim=10**9, decoder_ffn_dim=10**9)  # 64 GB if built
    _refused(hf, tmp_path, capsys, "tensors disagree with config.json")


def test_nllb_tokenizer_json_that_is_a_list_is_one_line(nllb, tmp_path, capsys):
    hf = _copy(nllb, tmp_path)
    (hf / "tokenizer.json").write_text("[1, 2, 3]")
    _refused(hf, tmp_path, capsys, "tokenizer.json: expected a JSON object")


def test_pickle_that_calls_a_function_is_refused_in_one_sentence(marian, tmp_path, capsys):
    """A pytorch_model.bin whose pickle calls os.system: refused before anything runs, in one
    complete line that names the callable and says what to use instead."""
    import pickle
    import zipfile

    import torch

    hf = _copy(marian, tmp_path)
    (hf / "model.safetensors").unlink()
    marker = tmp_path / "ran"
    bin_path = hf / "pytorch_model.bin"
    torch.save({"x": torch.zeros(1)}, bin_path)

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    with zipfile.ZipFile(bin_path) as z:
        entries = {n: z.read(n) for n in z.namelist()}
    pkl = next(n for n in entries if n.endswith("data.pkl"))
    entries[pkl] = pickle.dumps(Payload(), protocol=2)
    with zipfile.ZipFile(bin_path, "w") as z:
        for n, data in entries.items():
            z.writestr(n, data)
    text = _refused(hf, tmp_path, capsys, "pytorch_model.bin: refused: the pickle calls ")
    assert f"calls {os.system.__module__}.system" in text
    assert text.endswith(
        "use the checkpoint's model.safetensors, or a pytorch_model.bin that holds tensors only"
    )
    assert "weights_only` set to `False`" not in text  # torch's advice would run the payload
    assert not marker.exists()


def test_a_pickle_that_is_not_a_state_dict_names_the_reason(marian, tmp_path, capsys):
    hf = _copy(marian, tmp_path)
    (hf / "model.safetensors").unlink()
    (hf / "pytorch_model.bin").write_bytes(b"not a pickle at all " * 10)
    text = _refused(hf, tmp_path, capsys, "pytorch_model.bin")
    assert "weights_only` set to `False`" not in text and len(text) < 600


# ------------------------------------------------------------------------------------------
# a failing disk names --output-dir and the file, never a temporary
# ------------------------------------------------------------------------------------------


def _no_temporaries(folder: Path) -> None:
    assert [n for n in os.listdir(folder) if ".tmp-" in n or ".old-" in n] == []


def test_a_read_only_out_names_out(marian, tmp_path, capsys, monkeypatch):
    parent = tmp_path / "ro"
    parent.mkdir()
    real_mkdir = os.mkdir

    def mkdir(path, *args, **kwargs):  # what the kernel does on a read-only file system
        if os.path.lexists(path):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), os.fspath(path))
        if Path(path).parent == parent:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    out = parent / "model"
    assert main(["transformers", "--model", str(marian), "--output-dir", str(out)]) == 1
    err = capsys.readouterr().err
    assert err == (
        f"{PROG}: error: --output-dir {out}: the file system is read-only; choose a folder you can write to "
        f"(writing {out})\n"
    )
    assert os.listdir(parent) == []


def test_a_full_disk_names_out_and_the_file(marian, tmp_path, capsys, monkeypatch):
    """write() / fsync() fail with ENOSPC and no file name; the message names the file being written
    as it would be in the model folder, and nothing is left behind."""
    calls = []
    real_fsync = os.fsync

    def fsync(fd):
        calls.append(fd)
        if len(calls) == 2:  # the second file of the folder
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    out = tmp_path / "model"
    assert main(["transformers", "--model", str(marian), "--output-dir", str(out)]) == 1
    err = capsys.readouterr().err
    prefix = f"{PROG}: error: --output-dir {out}: no space left on the device; free some space and run the command again"
    assert (
        err.startswith(prefix + f" (writing {out}{os.sep}") and err.endswith(")\n") and err.count("\n") == 1
    ), err
    assert ".tmp-" not in err
    assert not out.exists()
    _no_temporaries(tmp_path)


# ------------------------------------------------------------------------------------------
# an output that appears while the converter runs is never replaced
# ------------------------------------------------------------------------------------------


def _while_converting(monkeypatch, action):
    """Run ``action()`` while the converter writes its staging folder (after --output-dir was checked)."""
    import transformer_ext.checkpoint as checkpoint

    real = checkpoint.save_model
    done = []

    def save_model(model, directory):
        if not done:
            done.append(True)
            action()
        return real(model, directory)

    monkeypatch.setattr(checkpoint, "save_model", save_model)


@pytest.mark.parametrize("content", ["notes", "empty"])
def test_a_folder_that_appears_at_out_is_kept(marian, tmp_path, capsys, monkeypatch, content):
    out = tmp_path / "model"

    def appear():
        out.mkdir()
        if content == "notes":
            (out / "notes.txt").write_text("mine")

    _while_converting(monkeypatch, appear)
    assert main(["transformers", "--model", str(marian), "--output-dir", str(out)]) == 1
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1
        and f"--output-dir {out} appeared while the checkpoint was being converted" in err
    )
    assert os.listdir(out) == (["notes.txt"] if content == "notes" else [])
    if content == "notes":
        assert (out / "notes.txt").read_text() == "mine"
    _no_temporaries(tmp_path)


def test_two_conversions_to_one_out_one_wins_and_its_model_is_kept(marian, tmp_path, capsys, monkeypatch):
    """A second conversion to the same --output-dir finishes while the first one is still writing: the
    second succeeds, the first exits 1 with one line, and the folder is the second's, complete."""
    out = tmp_path / "model"
    _while_converting(monkeypatch, lambda: convert_transformers(marian, out))
    assert main(["transformers", "--model", str(marian), "--output-dir", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "appeared while the checkpoint was being converted" in err
    assert load_model(out).config.d_model == 16
    assert sorted(os.listdir(out)) == sorted(os.listdir(convert_transformers(marian, tmp_path / "alone")))
    _no_temporaries(tmp_path)


def test_two_concurrent_convert_commands(marian, tmp_path):
    """Two processes convert to one --output-dir at once: exactly one succeeds, the other exits 1 with one
    line, and the folder holds a complete model."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "model"
    cmd = [
        sys.executable,
        "-m",
        "transformer_ext.convert",
        "transformers",
        "--model",
        str(marian),
        "--output-dir",
        str(out),
    ]
    procs = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in "ab"
    ]
    results = [(p.wait(timeout=300), p.stdout.read(), p.stderr.read()) for p in procs]
    for p in procs:
        p.stdout.close()
        p.stderr.close()
    codes = sorted(rc for rc, _, _ in results)
    assert codes == [0, 1], results
    _, _, err = next(r for r in results if r[0] == 1)
    assert err.startswith(f"{PROG}: error: --output-dir {out}") and err.count("\n") == 1, err
    assert "already exists" in err or "appeared while" in err
    assert load_model(out).config.d_model == 16
    _no_temporaries(tmp_path)


# ------------------------------------------------------------------------------------------
# Ctrl-C
# ------------------------------------------------------------------------------------------


def test_ctrl_c_just_after_the_commit_reports_the_complete_folder(
    marian, tmp_path, capsys, caplog, monkeypatch
):
    import signal

    from transformer_ext import fsutil

    real_commit = fsutil.StagedDir.commit

    def commit(self):
        result = real_commit(self)
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C the moment the folder is in place
        for _ in range(1000):  # the signal is handled between two bytecodes
            pass
        return result

    monkeypatch.setattr(fsutil.StagedDir, "commit", commit)
    out = tmp_path / "model"
    sigint, sigterm = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    assert main(["transformers", "--model", str(marian), "--output-dir", str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.out == f"{out}\n"
    assert f"SIGINT arrived after the conversion finished: the model folder {out} is complete" in caplog.text
    assert "interrupted" not in captured.err
    assert load_model(out).config.d_model == 16
    assert (
        signal.getsignal(signal.SIGINT) is sigint and signal.getsignal(signal.SIGTERM) is sigterm
    )  # restored


_INTERRUPT_TORCH_IMPORT = """
import importlib.abc, os, signal, sys

class CtrlC(importlib.abc.MetaPathFinder):
    # Ctrl-C in the middle of torch's import, once torch's fake-tensor module (which logs its
    # cache statistics at exit) is in
    fired = False

    def find_spec(self, name, path, target=None):
        fake = sys.modules.get("torch._subclasses.fake_tensor")
        if not CtrlC.fired and name.startswith("torch.") and hasattr(fake, "dump_cache_stats"):
            CtrlC.fired = True
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, CtrlC())
signal.signal(signal.SIGINT, signal.default_int_handler)  # a background job inherits SIGINT ignored
from transformer_ext.convert.__main__ import main
code = main(sys.argv[1:])
assert CtrlC.fired, "torch was imported before the command ran"
sys.exit(code)
"""


def test_ctrl_c_during_torch_import_prints_one_line(marian, tmp_path):
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "model"
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _INTERRUPT_TORCH_IMPORT,
            "transformers",
            "--model",
            str(marian),
            "--output-dir",
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr == f"{PROG}: interrupted\n" and proc.stdout == ""
    assert not out.exists()


def test_the_old_spellings_still_convert_with_one_warning_each(marian, tmp_path, capsys):
    """``convert transformers HF_DIR --out MODEL_DIR`` (the positional checkpoint, ``--out``) still
    converts; each old spelling prints one warning naming the new one."""
    old, new = tmp_path / "old", tmp_path / "new"
    assert main(["transformers", str(marian), "--out", str(old)]) == 0
    captured = capsys.readouterr()
    assert captured.out == f"{old}\n"
    assert sorted(captured.err.splitlines()) == [
        f"{PROG} transformers: warning: --out is deprecated; use --output-dir",
        f"{PROG}: warning: the positional HF_DIR is deprecated; use --model HF_DIR",
    ]
    assert main(["transformers", "--model", str(marian), "--output-dir", str(new)]) == 0
    assert "warning" not in capsys.readouterr().err
    assert sorted(p.name for p in old.iterdir()) == sorted(p.name for p in new.iterdir())
    old_weights, new_weights = load_model(old).state_dict(), load_model(new).state_dict()
    assert old_weights.keys() == new_weights.keys()
    assert all(old_weights[k].equal(new_weights[k]) for k in old_weights)
