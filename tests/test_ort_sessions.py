"""Which ONNX Runtime sessions an ``OrtRunner`` makes, and when: an int8 runner that uses the
few-row decoder step opens the dynamic step (``decoder_step.onnx``) at its first step of more
rows than the few-row step runs, not at load (``preload_steps``); the tokens are those of a
runner that opened every step at load; a changed or missing dynamic step is still refused at
load; folders without recorded hashes open every step at load. The memory this saves is
measured by benchmarks/deploy/bench_footprint.py (docs/footprint.md), not asserted here.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
from helpers import quantized_dir

from export import InvalidGraphError
from transformer_ext.export_format import (
    DECODER_FILE,
    ENCODER_FILE,
    FEW_ROWS_DECODER_FILE,
    HASHES_KEY,
    read_manifest,
)
from transformer_ext.runtimes import OrtRunner


@pytest.fixture(scope="module")
def tiny_int8(tmp_path_factory) -> Path:
    return quantized_dir(tmp_path_factory, "int8")


@pytest.fixture
def opened(monkeypatch) -> list[str]:
    """The graph files of every ONNX Runtime session made from a file while the test runs, in
    order (the search head's session, made from bytes, is not one)."""
    made: list[str] = []
    real = onnxruntime.InferenceSession

    def recording(path, *args, **kwargs):
        if isinstance(path, (str, os.PathLike)):
            made.append(os.path.basename(os.fspath(path)))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(onnxruntime, "InferenceSession", recording)
    return made


def _sources(runner, rows: int):
    rng = np.random.default_rng(rows)
    ids = rng.integers(4, runner.info.src_vocab_size, size=(rows, 6)).astype(np.int64)
    return ids, np.full(rows, 6, dtype=np.int64)


def _tokens(rows) -> list[list[int]]:
    return [list(map(int, r)) for r in rows]


def test_the_dynamic_step_opens_at_the_first_step_the_few_row_step_does_not_run(tiny_int8, opened):
    lazy = OrtRunner(tiny_int8, intra_op_num_threads=2)
    assert opened == [FEW_ROWS_DECODER_FILE, ENCODER_FILE]
    one = lazy.greedy(*_sources(lazy, 1), max_decoding_length=6)
    two = lazy.greedy(*_sources(lazy, 2), max_decoding_length=6)  # max_rows rows: still the few-row step
    assert opened == [FEW_ROWS_DECODER_FILE, ENCODER_FILE]
    three = lazy.greedy(*_sources(lazy, 3), max_decoding_length=6)  # more rows: the dynamic step opens
    assert opened == [FEW_ROWS_DECODER_FILE, ENCODER_FILE, DECODER_FILE]
    lazy.greedy(*_sources(lazy, 3), max_decoding_length=6)
    assert opened.count(DECODER_FILE) == 1  # opened once

    del opened[:]
    eager = OrtRunner(tiny_int8, intra_op_num_threads=2, preload_steps=True)
    assert sorted(opened) == sorted([FEW_ROWS_DECODER_FILE, ENCODER_FILE, DECODER_FILE])
    for rows, got in ((1, one), (2, two), (3, three)):
        assert _tokens(got) == _tokens(eager.greedy(*_sources(eager, rows), max_decoding_length=6)), rows
    # a beam search's three rows run on the dynamic step, which opens at its first step
    beams = OrtRunner(tiny_int8, intra_op_num_threads=2)
    assert opened.count(DECODER_FILE) == 1  # the eager runner's
    got = beams.beam_search(*_sources(beams, 1), beam_size=3, max_decoding_length=5)
    want = eager.beam_search(*_sources(eager, 1), beam_size=3, max_decoding_length=5)
    assert [[h.tokens for h in n] for n in got] == [[h.tokens for h in n] for n in want]
    assert opened.count(DECODER_FILE) == 2


def test_every_step_opens_at_load_where_no_few_row_step_runs(tiny_int8, opened):
    OrtRunner(tiny_int8, intra_op_num_threads=1)  # fewer threads than the few-row step's minimum
    assert opened == [ENCODER_FILE, DECODER_FILE]
    del opened[:]
    OrtRunner(tiny_int8, intra_op_num_threads=2, few_rows="never")
    assert opened == [ENCODER_FILE, DECODER_FILE]
    del opened[:]
    always = OrtRunner(tiny_int8, intra_op_num_threads=1, few_rows="always")
    always.greedy(*_sources(always, 4), max_decoding_length=4)
    assert opened == [FEW_ROWS_DECODER_FILE, ENCODER_FILE]  # every step is the few-row step's
    # the sessions a profiler reads: both, the dynamic step opened for it
    assert list(always.step_sessions) == [DECODER_FILE, FEW_ROWS_DECODER_FILE]
    assert opened[-1] == DECODER_FILE


def test_a_folder_without_the_steps_hash_opens_it_at_load(tiny_int8, opened):
    manifest = read_manifest(tiny_int8)
    manifest[HASHES_KEY] = {k: v for k, v in manifest[HASHES_KEY].items() if k != DECODER_FILE}
    OrtRunner(tiny_int8, intra_op_num_threads=2, manifest=manifest)
    assert sorted(opened) == sorted([FEW_ROWS_DECODER_FILE, ENCODER_FILE, DECODER_FILE])


@pytest.mark.parametrize("how", ["truncated", "changed", "missing"])
def test_a_damaged_dynamic_step_is_refused_at_load(tiny_int8, tmp_path, opened, how):
    folder = tmp_path / "copy"
    shutil.copytree(tiny_int8, folder)
    path = folder / DECODER_FILE
    if how == "missing":
        path.unlink()
    elif how == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])
    else:  # a graph of the same size that ONNX Runtime would still load: another producer name
        data = path.read_bytes()
        producer = onnx.load(path, load_external_data=False).producer_name.encode()
        assert producer and data.count(producer) >= 1
        path.write_bytes(data.replace(producer, producer.upper(), 1))
    match = "not found" if how == "missing" else "not the graph this export was written with"
    with pytest.raises(InvalidGraphError, match=f"{path}.*{match}|{match}.*{path}"):
        OrtRunner(folder, intra_op_num_threads=2)
    assert DECODER_FILE not in opened


def test_preload_steps_must_be_a_bool(tiny_int8):
    with pytest.raises(TypeError, match="preload_steps must be a bool"):
        OrtRunner(tiny_int8, preload_steps="yes")


def test_sessions_are_made_with_large_blocks_mapped_unless_malloc_is_configured(tiny_int8, monkeypatch):
    """The sessions are made with glibc's mmap threshold held at 128 KiB (what they free goes
    back to the system at once) and the thresholds set for decoding afterwards; a process that
    configured malloc through its environment is left alone."""
    from transformer_ext.runtimes import ort as ort_runner

    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(ort_runner, "_MALLOPT", lambda param, value: calls.append((param, value)) or 1)
    for key in [k for k in os.environ if k.startswith("MALLOC_") or k == "GLIBC_TUNABLES"]:
        monkeypatch.delenv(key)
    runner = OrtRunner(tiny_int8, intra_op_num_threads=2)
    load = [
        (ort_runner.M_MMAP_THRESHOLD, 128 << 10),
        (ort_runner.M_MMAP_THRESHOLD, 32 << 20),
        (ort_runner.M_TRIM_THRESHOLD, 64 << 20),
    ]
    assert calls == load
    runner.greedy(*_sources(runner, 3), max_decoding_length=2)  # opens the dynamic step: the same again
    assert calls == load * 2
    del calls[:]
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    OrtRunner(tiny_int8, intra_op_num_threads=2)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=1000000")
    OrtRunner(tiny_int8, intra_op_num_threads=2)
    assert calls == []


def test_the_runners_sessions_are_made_without_the_cpu_arena(tiny_int8, monkeypatch):
    """The runner's own session options leave ONNX Runtime's CPU arena off (the arena would keep
    what a session frees while it packs its weights: ``ort.CPU_ARENA`` has the numbers); options
    a caller gives are used as given."""
    options_seen: list = []
    real = onnxruntime.InferenceSession

    def recording(path, *args, **kwargs):
        if isinstance(path, (str, os.PathLike)):
            options_seen.append(kwargs.get("sess_options"))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(onnxruntime, "InferenceSession", recording)
    runner = OrtRunner(tiny_int8, intra_op_num_threads=2)
    runner.greedy(*_sources(runner, 3), max_new_tokens=2)  # opens the dynamic step too
    assert len(options_seen) == 3
    assert [o.enable_cpu_mem_arena for o in options_seen] == [False] * 3

    del options_seen[:]
    given = onnxruntime.SessionOptions()
    assert given.enable_cpu_mem_arena  # ONNX Runtime's default
    OrtRunner(tiny_int8, session_options=given, preload_steps=True)
    assert options_seen and all(o is given and o.enable_cpu_mem_arena for o in options_seen)


def test_a_translator_builds_its_tokenizer_after_the_sessions(tiny_int8, tmp_path, opened, monkeypatch):
    """Translator.from_export_dir makes the runner's sessions before it builds the tokenizer (whose
    tables would otherwise be held under the peak of a session's load), and still refuses a folder
    that lacks a tokenizer file before any session is made."""
    from transformer_ext import translator as translator_module
    from transformer_ext.translator import TranslationError, Translator

    sessions_when_built: list[list[str]] = []
    real = translator_module.load_tokenizer
    monkeypatch.setattr(
        translator_module,
        "load_tokenizer",
        lambda *a, **k: sessions_when_built.append(list(opened)) or real(*a, **k),
    )
    translator = Translator.from_export_dir(tiny_int8, threads=2)
    assert translator.tokenizer is not None
    assert sessions_when_built == [[FEW_ROWS_DECODER_FILE, ENCODER_FILE]]

    del opened[:]
    folder = tmp_path / "copy"
    shutil.copytree(tiny_int8, folder)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(TranslationError, match="tokenizer.json is missing"):
        Translator.from_export_dir(folder, threads=2)
    assert opened == []
