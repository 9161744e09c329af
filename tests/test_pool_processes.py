"""transformer_ext.runtimes.procpool: the parts of a batch decoded in worker processes."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pool_workers
import pytest
from helpers import exported_dir

from transformer_ext import decoding
from transformer_ext.export_format import ManifestError
from transformer_ext.runtimes import (
    OrtRunner,
    ProcessSourceParallel,
    SourceParallel,
    WorkerError,
    open_source_parallel,
    split_sources,
)
from transformer_ext.runtimes.procpool import process_memory

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def _sources(info, batch: int, src_len: int = 9, seed: int = 0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(4, info.src_vocab_size, size=(batch, src_len)).astype(np.int64)
    lengths = rng.integers(1, src_len + 1, size=batch).astype(np.int64)
    lengths[0] = src_len
    for row, n in enumerate(lengths):
        ids[row, n:] = info.pad_id
    return ids, lengths


def _ended(pid: int) -> bool:
    """Whether process ``pid`` is gone (or a zombie: exited, not yet reaped by its new parent)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def _steps(log_dir: Path) -> int:
    return sum(p.stat().st_size for p in log_dir.iterdir())


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    return exported_dir(tmp_path_factory, "portable")


@pytest.fixture(scope="module")
def ort_pool(export):
    with ProcessSourceParallel(functools.partial(OrtRunner, export, intra_op_num_threads=1), 2) as pool:
        yield pool


@pytest.fixture(scope="module")
def step_log(tmp_path_factory):
    return tmp_path_factory.mktemp("steps")


@pytest.fixture(scope="module")
def step_pool(step_log):
    make = functools.partial(pool_workers.StepRunner, delay=0.01, log_dir=str(step_log))
    with ProcessSourceParallel(make, 2) as pool:
        yield pool


def test_a_split_sample_in_processes_is_the_unsplit_one(ort_pool, export):
    """Random sampling in the worker processes (same seed) gives every source the tokens and
    scores of one runner on the whole batch: each worker samples its sources' streams."""
    runner = OrtRunner(export, intra_op_num_threads=1)
    info = runner.info
    ids, lengths = _sources(info, batch=5, seed=4)
    options = dict(
        bos_id=info.bos_id,
        eos_id=info.eos_id,
        max_decoding_length=np.array([6, 9, 4, 12, 7]),
        sampling_topk=0,
        sampling_temperature=1.5,
        num_hypotheses=2,
        seed=11,
    )

    def samples(rows):
        return [[(list(h.tokens), round(h.score, 4)) for h in row] for row in rows]

    whole = samples(decoding.generate(runner, ids, lengths, **options))
    assert len({str(row) for row in whole}) == 5  # the sources were sampled differently
    assert samples(ort_pool.generate(ids, lengths, **options)) == whole


@pytest.mark.parametrize("beam_size", [1, 3])
def test_processes_decode_as_threads_and_as_one_runner(ort_pool, export, beam_size):
    """Hypotheses (tokens and scores) equal the thread pool's and those of one runner part by
    part; float32 tokens equal one runner's over the whole batch; per-source budgets are sliced."""
    runners = [OrtRunner(export, intra_op_num_threads=1) for _ in range(2)]
    info = runners[0].info
    assert ort_pool.info == info and dict(ort_pool.info.config) == dict(info.config)  # (pickled back)
    ids, lengths = _sources(info, batch=7)
    budgets = np.array([5, 9, 3, 12, 7, 4, 10])
    options = dict(
        bos_id=info.bos_id,
        eos_id=info.eos_id,
        max_decoding_length=budgets,
        beam_size=beam_size,
        num_hypotheses=min(beam_size, 2),
    )
    got = ort_pool.generate(ids, lengths, **options)
    with SourceParallel(runners) as threads:
        by_threads = threads.generate(ids, lengths, **options)
    by_parts = []
    for sl in split_sources(7, 2):
        by_parts += decoding.generate(
            runners[0], ids[sl], lengths[sl], **{**options, "max_decoding_length": budgets[sl]}
        )
    whole = decoding.generate(runners[0], ids, lengths, **options)

    def tokens(rows):
        return [[list(h.tokens) for h in row] for row in rows]

    assert tokens(got) == tokens(by_threads) == tokens(by_parts) == tokens(whole)
    assert [[h.score for h in row] for row in got] == [[h.score for h in row] for row in by_parts]
    assert all(len(row[0].tokens) <= b for row, b in zip(got, budgets))


def test_workers_are_processes_of_their_own_without_torch(ort_pool):
    src, lengths = np.ones((4, 3), dtype=np.int64), np.full(4, 3, dtype=np.int64)
    about = ort_pool.run(pool_workers.about_worker, src, lengths)
    pids = [a["pid"] for a in about]
    assert pids == [ort_pool.worker_pids[0]] * 2 + [ort_pool.worker_pids[1]] * 2
    assert os.getpid() not in pids and len(set(pids)) == 2
    assert not any(a["torch"] for a in about) and ort_pool.workers_torch_imported == [False, False]
    assert "torch" in sys.modules  # (this process has it: the workers did not inherit it)
    memory = ort_pool.memory()
    assert len(memory) == 2 and all(0 < m["pss"] <= m["rss"] and m["mapped_regions"] >= 0 for m in memory)
    assert process_memory(os.getpid())["rss"] > 0


def test_workers_with_unpacked_weights_decode_the_same(ort_pool, export):
    """OrtRunner(pack_weights=False) (ONNX Runtime's prepacking off, the weight products read
    from the mapped weights file) in the workers: the same float32 tokens as packed workers."""
    from transformer_ext.runtimes.ort import DISABLE_PREPACKING

    unpacked = OrtRunner(export, intra_op_num_threads=1, pack_weights=False)
    assert unpacked._session_options.get_session_config_entry(DISABLE_PREPACKING) == "1"
    with pytest.raises(TypeError, match="pack_weights must be a bool"):
        OrtRunner(export, pack_weights="no")
    info = ort_pool.info
    ids, lengths = _sources(info, batch=5, seed=3)
    options = dict(bos_id=info.bos_id, eos_id=info.eos_id, max_decoding_length=8, beam_size=2)
    make = functools.partial(OrtRunner, export, intra_op_num_threads=1, pack_weights=False)
    with ProcessSourceParallel(make, 2) as shared:
        got = shared.generate(ids, lengths, **options)
    want = ort_pool.generate(ids, lengths, **options)
    assert [[h.tokens for h in row] for row in got] == [[h.tokens for h in row] for row in want]


def test_bad_uses_are_refused(step_pool):
    src, lengths = np.ones((4, 3), dtype=np.int64), np.full(4, 3, dtype=np.int64)
    make = pool_workers.StepRunner
    with pytest.raises(ValueError, match="workers must be a positive int"):
        ProcessSourceParallel(make, 0)
    with pytest.raises(ValueError, match="start_method must be one of"):
        ProcessSourceParallel(make, 2, start_method="fork")
    with pytest.raises(ValueError, match="cancel_timeout must be a positive number"):
        ProcessSourceParallel(make, 2, cancel_timeout=0)
    with pytest.raises(TypeError, match="make_runner must pickle"):
        ProcessSourceParallel(lambda: make(), 2)
    with pytest.raises(ValueError, match="pool must be one of"):
        open_source_parallel(make, 2, pool="fibers")
    with pytest.raises(TypeError, match="the search and its options must pickle"):
        step_pool.run(lambda r, s, ln: [], src, lengths)
    with pytest.raises(TypeError, match="one entry per source"):
        step_pool.run(pool_workers.too_few, src, lengths)
    with pytest.raises(TypeError, match="cannot be sent back from the worker"):
        step_pool.run(pool_workers.unpicklable_result, src, lengths)
    assert step_pool.run(pool_workers.short_greedy, src, lengths) == pool_workers.expected_short(src)


def test_forkserver_workers_decode_too():
    src = np.array([[4, 5, 6], [10, 11, 12], [13, 14, 15], [20, 21, 22]], dtype=np.int64)  # no markers
    lengths = np.full(4, 3, dtype=np.int64)
    with ProcessSourceParallel(pool_workers.StepRunner, 2, start_method="forkserver") as pool:
        pids = pool.worker_pids
        assert pool.run(pool_workers.short_greedy, src, lengths) == pool_workers.expected_short(src)
    assert all(map(_ended, pids))


def test_a_runner_that_cannot_be_made_is_its_own_error(tmp_path):
    """What make_runner raises in a worker is raised by the constructor, its worker named."""
    with pytest.raises(ManifestError, match="manifest.json not found") as caught:
        ProcessSourceParallel(functools.partial(OrtRunner, tmp_path), 1, start_timeout=120)
    assert any("making its runner" in note for note in caught.value.__notes__)


def test_the_thread_pool_from_the_same_factory(export):
    with open_source_parallel(
        functools.partial(OrtRunner, export, intra_op_num_threads=1), 2, pool="threads"
    ) as p:
        assert isinstance(p, SourceParallel) and len(p.runners) == 2


@pytest.mark.parametrize(
    "marker, error", [(pool_workers.FAIL, RuntimeError), (pool_workers.INTERRUPT, KeyboardInterrupt)]
)
def test_a_failing_part_stops_the_others_within_a_step(step_pool, step_log, marker, error):
    """The first part fails at its 3rd step: the other stops at its next step (not after 400
    steps of 10 ms), run() raises the part's error, naming its worker, once both have stopped;
    the pool decodes on afterwards."""
    src, lengths = np.full((4, 3), 5, dtype=np.int64), np.full(4, 3, dtype=np.int64)
    src[0, 1] = marker
    before = _steps(step_log)
    with pytest.raises(error, match="stopped by the test") as caught:
        step_pool.run(pool_workers.long_greedy, src, lengths)
    assert any(
        f"worker 0 (pid {step_pool.worker_pids[0]}) on sources 0-1 of 4" in n for n in caught.value.__notes__
    )
    assert "RuntimeError" in str(caught.value.__cause__) or error is KeyboardInterrupt
    made = _steps(step_log) - before
    assert made < 100, made
    time.sleep(0.2)
    assert _steps(step_log) - before == made  # nothing runs on after run() returned
    src[0, 1] = 5
    assert step_pool.run(pool_workers.short_greedy, src, lengths) == pool_workers.expected_short(src)


def test_ctrl_c_stops_every_worker_and_the_workers_ignore_it(tmp_path):
    """SIGINT to the parent and to every worker (a terminal's Ctrl-C reaches the whole process
    group) while run() waits: the parent raises KeyboardInterrupt, the workers stop at their next
    step, stay alive, and the pool decodes on. The parent's handler is Python's default before
    the pool starts, so the workers start with it too (a background shell starts processes with
    SIGINT ignored): ignoring it is the workers' own doing."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        make = functools.partial(pool_workers.StepRunner, delay=0.01, log_dir=str(tmp_path))
        with ProcessSourceParallel(make, 2) as pool:
            src, lengths = np.full((4, 3), 5, dtype=np.int64), np.full(4, 3, dtype=np.int64)
            about = pool.run(pool_workers.about_worker, src, lengths)
            assert all(a["sigint_ignored"] for a in about)
            pids = pool.worker_pids

            def ctrl_c():
                for pid in [*pids, os.getpid()]:
                    os.kill(pid, signal.SIGINT)

            timer = threading.Timer(0.3, ctrl_c)
            timer.start()
            try:
                with pytest.raises(KeyboardInterrupt):
                    pool.run(pool_workers.long_greedy, src, lengths)
            finally:
                timer.cancel()
            made = _steps(tmp_path)
            assert made < 2 * 200, made
            time.sleep(0.2)
            assert _steps(tmp_path) == made
            assert pool.worker_pids == pids and not any(map(_ended, pids))
            assert pool.run(pool_workers.short_greedy, src, lengths) == pool_workers.expected_short(src)
        assert all(map(_ended, pids))
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_worker_that_dies_is_named_and_nothing_hangs():
    """A worker killed in a step: run() raises WorkerError naming it, how it ended and its
    sources; the pool is closed and its other worker gone. A worker killed while idle: the next
    run() says so."""
    make = functools.partial(pool_workers.StepRunner, delay=0.01)
    src, lengths = np.full((4, 3), 5, dtype=np.int64), np.full(4, 3, dtype=np.int64)
    src[3, 0] = pool_workers.DIE
    pool = ProcessSourceParallel(make, 2)
    pids = pool.worker_pids
    with pytest.raises(
        WorkerError,
        match=rf"worker 1 \(pid {pids[1]}\) on sources 2-3 of 4: the worker was killed by SIGKILL",
    ):
        pool.run(pool_workers.long_greedy, src, lengths)
    assert all(map(_ended, pids)) and pool.worker_pids == []
    with pytest.raises(RuntimeError, match="is closed .*worker 1.*killed by SIGKILL.*open a new one"):
        pool.run(pool_workers.short_greedy, src, lengths)

    with ProcessSourceParallel(make, 2) as pool:
        os.kill(pool.worker_pids[0], signal.SIGKILL)
        time.sleep(0.2)
        with pytest.raises(
            WorkerError, match=rf"worker 0 \(pid {pool.worker_pids[0]}\) was killed by SIGKILL"
        ):
            pool.run(pool_workers.short_greedy, src, lengths)


ORPHAN_SCRIPT = textwrap.dedent(
    """
    import functools, sys
    import numpy as np
    import pool_workers
    from transformer_ext.runtimes import ProcessSourceParallel

    if __name__ == "__main__":
        pool = ProcessSourceParallel(functools.partial(pool_workers.StepRunner, delay=0.05), 2)
        print(*pool.worker_pids, flush=True)
        if sys.argv[1] == "decode":
            src, lengths = np.full((4, 3), 5, dtype=np.int64), np.full(4, 3, dtype=np.int64)
            pool.run(pool_workers.long_greedy, src, lengths)
        # "exit": ends without closing the pool
    """
)


@pytest.mark.parametrize("how", ["exit", "killed"])
def test_no_orphan_workers(tmp_path, how):
    """A parent that exits without close() (atexit), or is killed with SIGKILL in the middle of
    a decode (of 20 s): its workers end too, within 10 s (found by pid)."""
    script = tmp_path / "parent.py"
    script.write_text(ORPHAN_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS)]))
    proc = subprocess.Popen(
        [sys.executable, str(script), "decode" if how == "killed" else "exit"],
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2
        if how == "killed":
            time.sleep(0.3)  # inside the decode
            proc.kill()
        proc.wait(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    while not all(map(_ended, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(map(_ended, pids)), [p for p in pids if not _ended(p)]
