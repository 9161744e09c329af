"""transformer_ext.fsutil and transformer_ext.cli: atomic writes, staged folders, stale temporaries, CLI errors."""

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from transformer_ext import cli, fsutil


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_atomic_write_replaces_and_leaves_nothing(tmp_path):
    target = tmp_path / "f.json"
    fsutil.atomic_write_json(target, {"a": 1})
    fsutil.atomic_write_json(target, {"a": 2})
    assert json.loads(target.read_text()) == {"a": 2}
    assert _names(tmp_path) == ["f.json"]


def test_atomic_write_failure_keeps_old_file(tmp_path, monkeypatch):
    target = tmp_path / "f.txt"
    target.write_text("old")

    def full_disk(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device", str(dst))

    monkeypatch.setattr(fsutil.os, "replace", full_disk)
    with pytest.raises(OSError) as info:
        fsutil.atomic_write_text(target, "new")
    assert info.value.errno == errno.ENOSPC
    assert target.read_text() == "old"
    assert _names(tmp_path) == ["f.txt"]


def test_atomic_write_refuses_nan(tmp_path):
    with pytest.raises(ValueError):
        fsutil.atomic_write_json(tmp_path / "x.json", {"a": float("nan")})
    assert _names(tmp_path) == []


def test_atomic_write_respects_umask(tmp_path):
    old = os.umask(0o022)
    try:
        fsutil.atomic_write_text(tmp_path / "f", "x")
        with fsutil.StagedDir(tmp_path / "d") as stage:
            (stage.path / "g").write_text("y")
            stage.commit()
    finally:
        os.umask(old)
    assert (tmp_path / "f").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "d").stat().st_mode & 0o777 == 0o755


def test_staged_dir_commit_replaces_and_exception_cleans_up(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(RuntimeError):
        with fsutil.StagedDir(out) as stage:
            (stage.path / "new.txt").write_text("half")
            raise RuntimeError("boom")
    assert _names(out) == ["old.txt"]
    assert _names(tmp_path) == ["out"]
    with fsutil.StagedDir(out) as stage:
        (stage.path / "new.txt").write_text("new")
        stage.commit()
    assert _names(out) == ["new.txt"]
    assert _names(tmp_path) == ["out"]


def test_staged_dir_keeps_a_symlink(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (real / "a").write_text("a")
    link = tmp_path / "link"
    link.symlink_to(real)
    with fsutil.StagedDir(link) as stage:
        (stage.path / "b").write_text("b")
        stage.commit()
    assert link.is_symlink() and _names(link) == ["b"]
    assert _names(tmp_path) == ["link", "real"]


def test_staged_dir_missing_parent_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing"):
        with fsutil.StagedDir(tmp_path / "missing" / "out"):
            pass


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_temporaries_of_dead_processes_are_removed(tmp_path, caplog):
    out = tmp_path / "out"
    dead = _dead_pid()
    name = fsutil.temporary_name(out)  # this process's name; rewrite the pid to a dead one
    host = name.split(".tmp-", 1)[1].rsplit("-", 2)[0]
    stale = tmp_path / f".out.tmp-{host}-{dead}-0123abcd"
    stale.mkdir()
    (stale / "partial.onnx").write_text("x")
    alive = tmp_path / f".out.tmp-{host}-{os.getppid()}-0123abcd"  # a running process: kept
    alive.mkdir()
    other_host = tmp_path / f".out.tmp-otherhost-{dead}-0123abcd"  # another machine's: kept
    other_host.mkdir()
    unrelated = tmp_path / ".out.tmp-mine"  # not our naming scheme: kept
    unrelated.mkdir()
    with caplog.at_level("WARNING"):
        removed = fsutil.remove_stale_temporaries(out)
    assert removed == [stale]
    assert not stale.exists() and alive.exists() and other_host.exists() and unrelated.exists()
    assert str(dead) in caplog.text


def test_sigterm_under_run_cli_cleans_up(tmp_path):
    """A process killed with SIGTERM while writing a staged folder leaves nothing behind."""
    script = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from transformer_ext import cli, fsutil

        def work():
            with fsutil.StagedDir(Path({str(tmp_path / "out")!r})) as stage:
                (stage.path / "partial").write_text("x")
                print("ready", flush=True)
                time.sleep(60)
                stage.commit()
            return 0

        sys.exit(cli.run_cli("prog", work))
    """)
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == cli.EXIT_SIGTERM
    assert err.strip() == "prog: terminated"
    assert _names(tmp_path) == []


def test_run_cli_errors(capsys):
    def disk_full():
        raise OSError(errno.ENOSPC, "No space left on device", "/x/y")

    assert cli.run_cli("p", disk_full) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no space left" in err and "/x/y" in err
    with pytest.raises(OSError):
        cli.run_cli("p", disk_full, debug=True)

    def interrupted():
        raise KeyboardInterrupt

    assert cli.run_cli("p", interrupted, interrupted_hint="resume with --resume") == cli.EXIT_SIGINT
    assert capsys.readouterr().err == "p: interrupted; resume with --resume\n"

    def long_message():
        raise ValueError("x" * 100_000)

    assert cli.run_cli("p", long_message) == cli.EXIT_ERROR
    assert len(capsys.readouterr().err) < 1200

    def bug():
        raise ZeroDivisionError  # not an expected error: the traceback must show

    with pytest.raises(ZeroDivisionError):
        cli.run_cli("p", bug)


def test_run_cli_hint_may_be_decided_at_the_interruption(capsys):
    state = {"checkpoint": False}

    def interrupted():
        raise KeyboardInterrupt

    hint = lambda: "resume with --resume" if state["checkpoint"] else ""  # noqa: E731
    assert cli.run_cli("p", interrupted, interrupted_hint=hint) == cli.EXIT_SIGINT
    assert capsys.readouterr().err == "p: interrupted\n"
    state["checkpoint"] = True
    assert cli.run_cli("p", interrupted, interrupted_hint=hint) == cli.EXIT_SIGINT
    assert capsys.readouterr().err == "p: interrupted; resume with --resume\n"


# ---------------------------------------------------------------------- outputs overlapping inputs
def test_check_output_path_refuses_an_output_that_is_the_input(tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("x")
    with pytest.raises(fsutil.OutputConflictError, match=rf"--output {src} is --input {src}"):
        fsutil.check_output_path(src, inputs=[("--input", src)])
    link = tmp_path / "link.txt"
    link.symlink_to(src)
    with pytest.raises(cli.UserError, match="is --input"):
        fsutil.check_output_path(link, inputs=[("--input", src)])
    hard = tmp_path / "hard.txt"
    os.link(src, hard)
    with pytest.raises(cli.UserError, match="is --input"):
        fsutil.check_output_path(hard, inputs=[("--input", src)])


def test_check_output_path_refuses_a_file_inside_the_model_folder(tmp_path):
    model = tmp_path / "exp"
    model.mkdir()
    (model / "encoder.onnx").write_bytes(b"graph")
    out = model / "encoder.onnx"
    with pytest.raises(cli.UserError, match=rf"--output {out} lies inside the export folder --model {model}"):
        fsutil.check_output_path(out, inputs=[("the export folder --model", model)])
    # through a symlinked parent folder too
    alias = tmp_path / "alias"
    alias.symlink_to(model)
    with pytest.raises(cli.UserError, match="lies inside"):
        fsutil.check_output_path(alias / "new.txt", inputs=[("the export folder --model", model)])
    assert (model / "encoder.onnx").read_bytes() == b"graph"


def test_check_output_path_refuses_an_output_folder_holding_the_input(tmp_path):
    model = tmp_path / "runs" / "m"
    model.mkdir(parents=True)
    with pytest.raises(cli.UserError, match="--output-dir .* contains --model"):
        fsutil.check_output_path(tmp_path / "runs", inputs=[("--model", model)], what="--output-dir")


def test_check_output_path_refuses_managed_folders(tmp_path):
    run = tmp_path / "run"
    (run / "last").mkdir(parents=True)
    for out in (run / "last", run / "last" / "avg"):
        with pytest.raises(
            cli.UserError, match=r"--out .* lies inside the run's folder .*last, which the program"
        ):
            fsutil.check_output_path(out, managed_dirs=[("the run's folder", run / "last")], what="--out")
    with pytest.raises(cli.UserError, match="contains the run's folder"):
        fsutil.check_output_path(run, managed_dirs=[("the run's folder", run / "last")], what="--out")


def test_check_output_path_accepts_a_sibling_and_returns_it_resolved(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model-x").mkdir()  # a name prefix is not containment
    out = fsutil.check_output_path(
        tmp_path / "model-x" / "out.txt", inputs=[tmp_path / "model"], managed_dirs=[tmp_path / "m2"]
    )
    assert out == Path(os.path.realpath(tmp_path)) / "model-x" / "out.txt"


# ---------------------------------------------------------------------- exit codes
def test_a_value_out_of_range_exits_2_like_argparse(capsys):
    def work():
        raise cli.UsageError("--beam must be >= 1, got 0")

    assert cli.run_cli("prog", work) == cli.EXIT_USAGE == 2
    assert capsys.readouterr().err == "prog: error: --beam must be >= 1, got 0\n"
    assert isinstance(cli.UsageError("x"), ValueError)  # the Python API keeps raising ValueError

    def bad_file():
        raise cli.UserError("a.txt: not UTF-8")

    assert cli.run_cli("prog", bad_file) == 1


# ---------------------------------------------------------------------- folder swaps cut short
_KILL_BETWEEN_RENAMES = """
import os, signal, sys
from pathlib import Path
from transformer_ext import fsutil

target = Path(sys.argv[1])
fsutil.exchange_paths = lambda a, b: False  # the file system without an atomic exchange
real_rename, calls = os.rename, []

def rename(src, dst):
    calls.append(src)
    if len(calls) == 2:  # the target is at its backup name, the new folder not yet in
        os.kill(os.getpid(), signal.SIGKILL)
    real_rename(src, dst)

fsutil.os.rename = rename
with fsutil.StagedDir(target) as stage:
    (stage.path / "data.txt").write_text("new")
    stage.commit()
"""


def _old_folder(tmp_path: Path) -> Path:
    target = tmp_path / "out"
    target.mkdir()
    (target / "data.txt").write_text("old")
    return target


def test_a_kill_between_the_two_renames_leaves_the_old_folder_for_the_next_write(tmp_path):
    target = _old_folder(tmp_path)
    proc = subprocess.run([sys.executable, "-c", _KILL_BETWEEN_RENAMES, str(target)])
    assert proc.returncode == -signal.SIGKILL
    assert not target.exists()  # the window the kill hit
    backups = [p for p in tmp_path.iterdir() if p.name.startswith(".out.old-")]
    assert len(backups) == 1 and (backups[0] / "data.txt").read_text() == "old"
    # the next command writing the same output fails too: the old folder must survive it
    with pytest.raises(RuntimeError):
        with fsutil.StagedDir(target) as stage:
            (stage.path / "data.txt").write_text("half")
            raise RuntimeError("the next command fails before committing")
    assert (target / "data.txt").read_text() == "old"
    assert _names(tmp_path) == ["out"]
    with fsutil.StagedDir(target) as stage:
        (stage.path / "data.txt").write_text("newer")
        stage.commit()
    assert (target / "data.txt").read_text() == "newer" and _names(tmp_path) == ["out"]


def test_replace_dir_exchanges_atomically_where_the_file_system_can(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "f").write_text("a")
    (b / "f").write_text("b")
    if not fsutil.exchange_paths(a, b):
        pytest.skip("this file system has no renameat2(RENAME_EXCHANGE)")
    assert (a / "f").read_text() == "b" and (b / "f").read_text() == "a"
    target = _old_folder(tmp_path / "b")
    renames = []
    real_rename = os.rename

    def rename(src, dst):  # the exchange needs no rename: a kill can never find the target missing
        renames.append((src, dst))
        real_rename(src, dst)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fsutil.os, "rename", rename)
        with fsutil.StagedDir(target) as stage:
            (stage.path / "data.txt").write_text("new")
            stage.commit()
    assert renames == []
    assert (target / "data.txt").read_text() == "new" and _names(tmp_path / "b") == ["f", "out"]


def test_nested_scratch_temporaries_are_removed_by_the_same_rule(tmp_path):
    out = tmp_path / "out"
    dead = _dead_pid()
    host = fsutil._HOST
    staged = tmp_path / f".out.tmp-{host}-{dead}-0123abcd"
    scratch = tmp_path / f"..out.tmp-{host}-{dead}-0123abcd.quantize.tmp-{host}-{dead}-89abcdef"
    other = tmp_path / f"..other.tmp-{host}-{dead}-0123abcd.quantize.tmp-{host}-{dead}-89abcdef"
    for folder in (staged, scratch, other):
        folder.mkdir()
        (folder / "encoder.onnx").write_bytes(b"x")
    info = fsutil.parse_temporary_name(scratch.name)
    assert (info.root, info.target, info.kind, info.pid) == ("out", staged.name + ".quantize", "tmp", dead)
    removed = fsutil.remove_stale_temporaries(out)
    assert sorted(removed) == sorted([staged, scratch])
    assert _names(tmp_path) == [other.name]  # another output's temporaries are its own business


@pytest.mark.parametrize("kernel", ["renameat2", "fallback"])
@pytest.mark.parametrize("occupant", ["empty_dir", "dir", "file"])
def test_staged_dir_without_replace_keeps_what_appeared(tmp_path, monkeypatch, kernel, occupant):
    """StagedDir(replace=False): whatever appears at the target before the commit is kept and the
    commit raises FileExistsError; the staging folder is removed. Where renameat2 is missing the
    fallback checks and then renames (an empty folder created between the two is the one thing
    it could replace; here every occupant is there before the check)."""
    if kernel == "fallback":
        monkeypatch.setattr(fsutil, "_renameat2", lambda: None)
    target = tmp_path / "out"
    with pytest.raises(FileExistsError) as info:
        with fsutil.StagedDir(target, replace=False) as stage:
            (stage.path / "model.bin").write_text("new")
            if occupant == "file":
                target.write_text("mine")
            else:
                target.mkdir()
                if occupant == "dir":
                    (target / "notes.txt").write_text("mine")
            stage.commit()
    assert info.value.filename == str(target)
    if occupant == "file":
        assert target.read_text() == "mine"
    else:
        assert os.listdir(target) == (["notes.txt"] if occupant == "dir" else [])
    assert sorted(os.listdir(tmp_path)) == ["out"]


@pytest.mark.parametrize("kernel", ["renameat2", "fallback"])
def test_staged_dir_without_replace_commits_to_a_free_target(tmp_path, monkeypatch, kernel):
    if kernel == "fallback":
        monkeypatch.setattr(fsutil, "_renameat2", lambda: None)
    target = tmp_path / "out"
    with fsutil.StagedDir(target, replace=False) as stage:
        (stage.path / "model.bin").write_text("new")
        stage.commit()
    assert (target / "model.bin").read_text() == "new" and os.listdir(tmp_path) == ["out"]


def test_disk_errors_name_the_output_and_the_file_as_the_user_knows_them(tmp_path):
    staged = tmp_path / fsutil.temporary_name(tmp_path / "out")
    with pytest.raises(fsutil.UserError) as info:
        with fsutil.disk_errors("--out", tmp_path / "out"):
            raise OSError(errno.ENOSPC, "No space left on device", str(staged / "model.safetensors"))
    assert str(info.value) == (
        f"--out {tmp_path / 'out'}: no space left on the device; free some space and run the command "
        f"again (writing {tmp_path / 'out' / 'model.safetensors'})"
    )


def test_a_failed_write_names_the_file(tmp_path, monkeypatch):
    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")  # as write() and fsync() raise it

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError) as info:
        fsutil.atomic_write_bytes(tmp_path / "a.json", b"{}")
    assert info.value.filename == str(tmp_path / "a.json") and os.listdir(tmp_path) == []
