"""Hub ids as converter input (transformer_ext.convert.hub), offline, against a hub cache folder
laid out as huggingface_hub lays it out (models--ORG--NAME/{blobs,refs,snapshots}), holding a
checkpoint that transformers itself wrote (tests/hf_checkpoints.py). No test reaches a network:
HF_ENDPOINT points at a closed local port in every subprocess.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")
huggingface_hub = pytest.importorskip("huggingface_hub")

from hf_checkpoints import write_marian  # noqa: E402
from safetensors import safe_open  # noqa: E402

from transformer_ext.convert import PROVENANCE_FILE, convert_transformers  # noqa: E402
from transformer_ext.convert.hub import HubError, looks_like_hub_id, resolve  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
REPO_ID = "test-org/tiny-marian"
OLD_COMMIT = hashlib.sha1(b"an older commit").hexdigest()
COMMIT = hashlib.sha1(b"the commit refs/main names").hexdigest()
CLOSED_ENDPOINT = "http://127.0.0.1:9"  # the discard port: nothing listens, connections fail at once


def _lay_out_cache(checkpoint: Path, cache: Path, repo_id: str) -> None:
    """The cache huggingface_hub writes: each file once under blobs/ (named by its hash), the
    snapshot of each commit as relative symlinks into blobs/, refs/main naming the newest."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    for commit in (OLD_COMMIT, COMMIT):
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True)
        for f in sorted(checkpoint.iterdir()):
            digest = hashlib.sha256(f.read_bytes()).hexdigest()
            blob = repo / "blobs" / digest
            if not blob.exists():
                blob.write_bytes(f.read_bytes())
            os.symlink(os.path.join("..", "..", "blobs", digest), snapshot / f.name)
    (repo / "refs" / "main").write_text(COMMIT)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """(HF_HOME folder, the checkpoint folder transformers wrote, our conversion of that folder)."""
    root = tmp_path_factory.mktemp("hub")
    checkpoint = write_marian(root / "checkpoint")
    home = root / "hf_home"
    _lay_out_cache(checkpoint, home / "hub", REPO_ID)
    local = convert_transformers(checkpoint, root / "converted_from_folder")
    return home, checkpoint, local


def _convert(args, tmp_path, **env_vars):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_") and k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(REPO), HF_ENDPOINT=CLOSED_ENDPOINT, HF_HUB_DISABLE_TELEMETRY="1", **env_vars)
    return subprocess.run(
        [sys.executable, "-m", "transformer_ext.convert", "transformers", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )


def test_the_cache_is_laid_out_as_huggingface_hub_reads_it(hub):
    home, _, _ = hub
    (repo,) = huggingface_hub.scan_cache_dir(home / "hub").repos
    assert repo.repo_id == REPO_ID and repo.repo_type == "model"
    assert {r.commit_hash for r in repo.revisions} == {OLD_COMMIT, COMMIT}
    assert [r.refs for r in repo.revisions if r.commit_hash == COMMIT] == [frozenset({"main"})]


@pytest.mark.parametrize("cache_var", ["HF_HUB_CACHE", "HF_HOME"])
def test_a_hub_id_converts_offline_from_the_cache(hub, tmp_path, cache_var):
    home, checkpoint, local = hub
    cache = {"HF_HUB_CACHE": home / "hub", "HF_HOME": home}[cache_var]
    out = tmp_path / "converted"
    got = _convert(
        ["--model", REPO_ID, "--output-dir", str(out)],
        tmp_path,
        HF_HUB_OFFLINE="1",
        **{cache_var: str(cache)},
    )
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == str(out)
    provenance = json.loads((out / PROVENANCE_FILE).read_text(encoding="utf-8"))
    assert provenance["hub"] == {"repo_id": REPO_ID, "revision": COMMIT, "requested_revision": "main"}
    assert Path(provenance["source"]).name == COMMIT
    # the files read are the ones transformers wrote, and the model is the folder's own conversion
    for name, digest in provenance["files"].items():
        assert hashlib.sha256((checkpoint / name).read_bytes()).hexdigest() == digest, name
    for name in ("config.json", "tokenizer.json", "generation_defaults.json"):
        assert (out / name).read_bytes() == (local / name).read_bytes(), name
    with (
        safe_open(out / "model.safetensors", "pt") as got_w,
        safe_open(local / "model.safetensors", "pt") as want,
    ):
        assert got_w.metadata() == want.metadata() and sorted(got_w.keys()) == sorted(want.keys())
        for key in want.keys():
            assert torch.equal(got_w.get_tensor(key), want.get_tensor(key)), key
    assert "hub" not in json.loads((local / PROVENANCE_FILE).read_text(encoding="utf-8"))


def test_a_hub_id_not_in_the_offline_cache_is_one_line(hub, tmp_path):
    home, _, _ = hub
    out = tmp_path / "converted"
    got = _convert(
        ["--model", "test-org/not-cached", "--output-dir", str(out)],
        tmp_path,
        HF_HUB_OFFLINE="1",
        HF_HOME=str(home),
    )
    assert got.returncode == 1 and got.stdout == ""
    (line,) = got.stderr.strip().splitlines()
    assert line.startswith("transformer-ext-convert: error: ")
    assert "'test-org/not-cached'" in line and "HF_HUB_OFFLINE=1" in line and str(home / "hub") in line
    assert not out.exists()


def test_an_unreachable_hub_is_one_line(hub, tmp_path):
    home, _, _ = hub
    out = tmp_path / "converted"
    got = _convert(["--model", "test-org/not-cached", "--output-dir", str(out)], tmp_path, HF_HOME=str(home))
    assert got.returncode == 1 and got.stdout == ""
    (line,) = got.stderr.strip().splitlines()
    assert "could not be reached" in line and "'test-org/not-cached'" in line and "HF_HUB_OFFLINE" in line
    assert not out.exists()


def test_without_huggingface_hub_the_error_names_it_and_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(HubError, match=r"'org/name' is not a local folder.*huggingface_hub.*\[hub\]"):
        resolve("org/name")
    with pytest.raises(HubError, match="huggingface_hub"):
        convert_transformers("org/name", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_local_paths_are_not_hub_ids(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # resolve() must not need it
    folder = tmp_path / "org" / "name"
    folder.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve("org/name") is None  # exists: the local folder wins
    for path in ("./missing", "/abs/missing", "a/b/c", "../up", "dir/", "bad--name", "-x/y"):
        assert not looks_like_hub_id(path), path
        assert resolve(path) is None, path
    for hub_id in ("Helsinki-NLP/opus-mt-en-de", "facebook/nllb-200-distilled-600M", "t5-small"):
        assert looks_like_hub_id(hub_id), hub_id
