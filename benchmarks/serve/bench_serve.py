"""The translation server under load: every target of the serving work measured and scored in one run.

Each server runs in a process of its own (``python -m transformer_ext.serve``, one per setting,
started, measured and stopped one after another), and so do the baselines; this process only
builds the model (untimed) and drives the servers with asynchronous HTTP clients (httpx), each
client sending single sentences (``POST /v1/translate``), one request at a time. Every 200 answer
is compared with the offline translation of its sentence.

Cells (``--clients``, default 1, 8, 32; every client count sends ``--requests`` sentences per
client, except 1 client, which sends ``--latency-sentences``):

* ``continuous``, ``static``, ``none``: the server's ``--batching``;
* ``ctranslate2 WxT``: a CTranslate2 server written the way its users write one
  (``benchmarks/serve/ct2_server.py``: FastAPI, one ``translate_batch`` per request) on a
  conversion of the same weights, for every ``--ct2-settings`` ``inter_threads x intra_threads``;
* the baselines, in a process of their own loading the same folder with the same threads:
  offline ``Translator.translate_iterable`` over the sentences of the 32-client cell (the best
  of ``--offline-runs``), and a direct ``Translator.translate([sentence])`` per sentence of the 1-client cell;
* overload: a ``continuous`` server with ``--max-queue`` ``--overload-queue`` (below the client
  count) under ``--overload-clients`` clients, each client sending again ``--overload-backoff``
  seconds after a 429; the server's RSS sampled every 0.2 s. A warm-up first (as every cell has an
  untimed round first): until ``--overload-warmup`` requests were answered 200 (at most
  ``WARMUP_LIMIT`` times ``--overload-seconds``), the running batch grows to ``--max-batch-rows``
  rows and its caches to the lengths of the sentences in flight, and RSS with them, which takes
  about one turnover of the batch's rows; then ``--overload-seconds`` measured. The warm-up's
  samples are kept (``rss_warmup_samples``, its peak) but the flatness is scored over the
  measured seconds. Statuses and answers count over the whole run;
* SIGTERM: after its cells, the ``continuous`` server gets SIGTERM ``--sigterm-after`` seconds into a
  32-client run (fresh connections, so no request meets a closed keep-alive connection); each
  client sends at most one request after the signal. Every request is recorded: 200 (with its
  text checked), 503, a refused connection once the server has closed its socket, or anything
  else (unclear: a reset, a 500, a client timeout = a hang); and the server's exit code and time.

Targets (scored from this run, printed as a table, in the JSON under ``targets``):

* at 32 clients, ``continuous`` >= 0.85x offline ``translate_iterable``, >= 3x ``none`` and
  >= 1.5x the best CTranslate2 setting, in sentences/s;
* at 1 client, p50 latency <= 1.1x the direct call's p50 + 5 ms;
* overload: no error but 429 (and at least one 429: otherwise the overload was not reached),
  RSS flat after the overload's warm-up (the median of the last third of the samples at most
  max(5 %, 16 MiB) above the median of the first third), every 200 answer correct;
* SIGTERM: every 200 correct, every other request 503 or refused, none unclear, the server exits
  0 within ``--drain-timeout`` + 15 s.

The model (``--model``): ``base`` (the default): the ``base`` preset (6+6 layers, d_model 512,
8000-token vocabularies) with random weights (seed 0) as ``benchmarks.decode.bench_decode`` builds
it, exported to ONNX (float32; the server, the baselines: ONNX Runtime, no torch) with a
character tokenizer of 7996 CJK ideographs, and converted for CTranslate2 as bench_decode converts
it. Its sentences are random ideographs of lognormal lengths (median 28 tokens, 4 to 96), and each
source generates ``floor(1.2 n + 2)`` tokens (the export's generation config; random weights
rarely emit EOS). It is the default because batching across requests pays where a decoder step
costs what it costs in a real model; a tiny model's step is all host overhead. ``demo`` (``--quick``):
the bundled demo model, eager, its number words. A model folder: exported and converted the same
way, with ``--input`` sentences.

    python -m benchmarks bench_serve                    # the full run (sized for <= 8 min on 2 quiet cores)
    python -m benchmarks bench_serve --quick            # demo model, a few requests: a smoke run

Output: JSON (``--out``: the cells, the baselines, the targets, the machine, ``provenance``) and a
plot beside it (sentences/s and p50 / p95 latency against clients, per setting). A run on a
loaded machine (load average above half the cores before it) is marked ``loaded`` and measures
nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.common import lscpu, save_figure, write_json

REPO = Path(__file__).resolve().parents[2]
MODES = ("continuous", "static", "none", "ctranslate2")
THROUGHPUT_CLIENTS = 32
CLIENT_TIMEOUT = 300.0  # seconds a client waits for one answer (more: a hang)
RANDOM_BUDGET = {"max_len_a": 1.2, "max_len_b": 2.0}  # the random-weights export's generation budget
RSS_FLAT_FRACTION, RSS_FLAT_BYTES = 0.05, 16 << 20
WARMUP_LIMIT = 3  # the overload's warm-up ends after this many times --overload-seconds at the latest
QUICK = dict(
    model="demo",
    lines=32,
    requests=1,
    clients="1,32",
    latency_sentences=4,
    modes="continuous,none,ctranslate2",
    ct2_settings="1x1",
    overload_seconds=1.0,
    overload_warmup=4,
    sigterm_after=0.3,
    offline_runs=1,
    threads=1,  # torch's threads on a busy machine: one is robust
)
FULL = dict(
    model="base",
    lines=256,
    requests=8,
    clients="1,8,32",
    latency_sentences=32,
    modes="continuous,static,none,ctranslate2",
    ct2_settings=None,  # 1x1, 1xT and Tx1 for --threads T
    overload_seconds=20.0,
    overload_warmup=128,
    sigterm_after=2.0,
    offline_runs=2,
    threads=os.cpu_count(),
)


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def _rss(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _torch_loaded(pid: int) -> bool | None:
    """Whether process ``pid`` has libtorch mapped (None: cannot tell)."""
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return None


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("PYTHONWARNINGS", None)
    return env


class ServerProcess:
    """A server command in a child process; ``url`` once its log says where it listens, and ready."""

    def __init__(self, cmd: list[str], name: str):
        self.name = name
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env(), cwd=REPO
        )
        self.url = ""
        self.log: list[str] = []
        found = threading.Event()

        def read():
            for line in self.proc.stderr:
                self.log.append(line)
                m = re.search(r"(?:serving .* on|listening on) (http://[\d.]+:\d+)", line)
                if m:
                    self.url = m.group(1)
                    found.set()
            found.set()

        threading.Thread(target=read, daemon=True).start()
        if not found.wait(300) or not self.url:
            self.stop()
            raise RuntimeError(f"{name}: the server did not start:\n" + "".join(self.log[-20:]))
        import httpx

        deadline = time.monotonic() + 300
        with httpx.Client(timeout=60) as client:
            while True:
                try:
                    if client.get(self.url + "/readyz").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"{name}: the server never became ready:\n" + "".join(self.log[-20:]))
                time.sleep(0.1)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def errors(self) -> list[str]:
        """The server's log lines that report an error or a traceback (the first 20)."""
        return [line.rstrip() for line in self.log if re.search(r"ERROR|Traceback|Exception", line)][:20]

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


# ------------------------------------------------------------------------------------------
# the model and the sentences (built untimed, in this process)
# ------------------------------------------------------------------------------------------


def random_sentences(alphabet: list[str], n: int, seed: int = 0) -> list[str]:
    """``n`` distinct sentences of random characters of ``alphabet``, lognormal lengths (median 28, 4..96)."""
    rng = random.Random(seed)
    out: dict[str, None] = {}
    while len(out) < n:
        length = min(96, max(4, round(rng.lognormvariate(math.log(28), 0.45))))
        out["".join(rng.choice(alphabet) for _ in range(length))] = None
    return list(out)


def _ct2_supported(config) -> str | None:
    """Why the CTranslate2 conversion of bench_decode cannot hold ``config`` (None: it can)."""
    checks = {
        "activation": "relu",
        "norm": "layer",
        "positions": "sinusoidal",
        "relative_attention_buckets": 0,
        "embedding_norm": False,
    }
    for name, want in checks.items():
        if getattr(config, name, want) != want:
            return (
                f"the CTranslate2 conversion needs {name}={want!r}; this model has {getattr(config, name)!r}"
            )
    if (config.pad_id, config.bos_id, config.eos_id) != (0, 1, 2):
        return "the CTranslate2 conversion assumes pad/bos/eos ids 0/1/2"
    return None


def _convert_ct2(model, path: str) -> None:
    from benchmarks.decode.bench_decode import _ct2_spec

    spec = _ct2_spec(model)
    spec.validate()
    spec.optimize(quantization="float32")
    os.makedirs(path)
    spec.save(path)


PREPARED = "prepared.json"  # what prepare() built in an --artifacts folder, for a later run to reuse


def _prepared_key(args) -> dict:
    return {"model": args.model, "input": args.input, "lines": args.lines, "ct2": "ctranslate2" in args.modes}


def prepare(args, scratch: str) -> dict:
    """The served folder, the tokenizer folder, the CTranslate2 model (or why none) and the sentences.

    An ``--artifacts`` folder keeps them, with a record (``prepared.json``) that a later run with the
    same ``--model``, ``--input`` and ``--lines`` reuses."""
    record = os.path.join(scratch, PREPARED)
    if os.path.isfile(record):
        saved = json.loads(Path(record).read_text(encoding="utf-8"))
        if saved.get("key") == _prepared_key(args):
            print(f"reusing the model, export and conversion in {scratch}", file=sys.stderr, flush=True)
            return saved["info"]
        raise SystemExit(
            f"bench_serve: error: --artifacts {scratch} holds what a run with other --model / --input / "
            "--lines / --modes built; give a new folder"
        )
    info = _build(args, scratch)
    from transformer_ext.fsutil import atomic_write_json

    atomic_write_json(record, {"key": _prepared_key(args), "info": info})
    return info


def _build(args, scratch: str) -> dict:
    import importlib.util

    import torch

    from transformer_ext.checkpoint import load_model, save_model
    from transformer_ext.demo import DEMO_MODEL_DIR

    info: dict = {"ct2": None, "ct2_skip": None}
    if args.model == "demo":
        from benchmarks.decode.bench_batching import demo_lines

        info.update(serve=None, tokenizer=str(DEMO_MODEL_DIR), kind="demo model folder (eager PyTorch)")
        model = load_model(DEMO_MODEL_DIR)
        lines = _read_input(args) or _distinct(demo_lines(args.lines * 4, 0), args.lines)
    else:
        from export.onnx import export_onnx
        from transformer_ext.tokenizer import SPECIAL_TOKENS, CharTokenizer

        model_dir = os.path.join(scratch, "model")
        if args.model == "base":
            from transformer_ext.config import TransformerConfig
            from transformer_ext.model import Transformer

            torch.manual_seed(0)
            model = Transformer(TransformerConfig.preset("base")).eval()
            save_model(model, model_dir)
            c = model.config
            src = [chr(0x4E00 + i) for i in range(c.src_vocab_size - len(SPECIAL_TOKENS))]
            tgt = [chr(0x4E00 + i) for i in range(c.tgt_vocab_size - len(SPECIAL_TOKENS))]
            CharTokenizer(list(SPECIAL_TOKENS) + src, list(SPECIAL_TOKENS) + tgt).save(model_dir)
            lines = _read_input(args) or random_sentences(src, args.lines)
            generation = dict(RANDOM_BUDGET)
            kind = "base preset, random weights (seed 0), ONNX float32"
        else:
            shutil.copytree(args.model, model_dir)
            model = load_model(model_dir)
            lines = _read_input(args)
            if not lines:
                raise SystemExit("bench_serve: error: --input: a model folder needs sentences (--input FILE)")
            generation = None
            kind = f"{args.model}, ONNX float32"
        export_dir = os.path.join(scratch, "onnx")
        cache = min(model.config.max_len, 128 if args.model == "base" else model.config.max_len)
        print(f"exporting {args.model} to ONNX (untimed) ...", file=sys.stderr, flush=True)
        export_onnx(model_dir, export_dir, validate=False, cache_len=cache, generation=generation)
        info.update(serve=export_dir, tokenizer=export_dir, kind=kind)
    if "ctranslate2" in args.modes:
        if importlib.util.find_spec("ctranslate2") is None:
            info["ct2_skip"] = "ctranslate2 is not installed (pip install -r requirements/bench.txt)"
        else:
            info["ct2_skip"] = _ct2_supported(model.config)
            if info["ct2_skip"] is None:
                info["ct2"] = os.path.join(scratch, "ct2")
                _convert_ct2(model, info["ct2"])
    info["lines"] = lines
    return info


def _distinct(lines: list[str], n: int) -> list[str]:
    return list(dict.fromkeys(lines))[:n]


def _read_input(args) -> list[str]:
    if not args.input:
        return []
    text = Path(args.input).read_text(encoding="utf-8").splitlines()
    lines = _distinct([" ".join(line.split()) for line in text if line.strip()], args.lines)
    if not lines:
        raise SystemExit(f"bench_serve: error: --input {args.input}: no sentences")
    return lines


# ------------------------------------------------------------------------------------------
# the baselines, in a process of their own
# ------------------------------------------------------------------------------------------


def baseline_worker(job_path: str) -> int:
    """Offline ``translate_iterable`` and direct ``translate`` of a job file (JSON), written back to it."""
    import numpy as np

    from benchmarks.decode.bench_batching import load_translator

    job = json.loads(Path(job_path).read_text(encoding="utf-8"))
    translator = load_translator(job["model"], job["threads"])
    out: dict = {"torch_imported": None}
    if job.get("solo"):
        out["solo"] = [str(translator.translate([s])[0]) for s in job["solo"]]
    else:
        lines = job["lines"]
        translator.translate(lines[:4])  # warm-up
        runs = []
        for _ in range(job["offline_runs"]):
            start = time.perf_counter()
            offline = list(translator.translate_iterable(lines))
            runs.append(time.perf_counter() - start)
        out["offline_runs_s"] = runs
        out["texts"] = [str(t) for t in offline]
        out["tokens"] = [len(t.tokens) for t in offline]
        for s in job["latency_lines"][:2]:  # warm-up
            translator.translate([s])
        latencies, direct = [], []
        for s in job["latency_lines"]:
            start = time.perf_counter()
            direct.append(str(translator.translate([s])[0]))
            latencies.append(time.perf_counter() - start)
        out["direct_latencies_s"] = latencies
        out["direct_texts"] = direct
        options = translator.resolve_options()
        out["budget"] = {
            "max_len_a": options["max_len_a"],
            "max_len_b": options["max_len_b"],
            # the budget of a source as long as any: the runner's and the generation config's cap
            "max_decoding_length": int(translator.max_decoding_length(np.array([0]), 0.0, float(1 << 40))[0]),
        }
        out["beam_size"] = options["beam_size"]
    out["torch_imported"] = "torch" in sys.modules
    Path(job_path).write_text(json.dumps(out), encoding="utf-8")
    return 0


def run_baseline(args, served: str | None, job: dict, scratch: str) -> dict:
    path = os.path.join(scratch, f"baseline_{time.monotonic_ns()}.json")
    Path(path).write_text(json.dumps({"model": served, "threads": args.threads, **job}), encoding="utf-8")
    cmd = [sys.executable, "-m", "benchmarks.serve.bench_serve", "--baseline-worker", path]
    res = subprocess.run(cmd, env=_env(), cwd=REPO, capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise RuntimeError("the baseline process failed:\n" + res.stderr[-3000:])
    return json.loads(Path(path).read_text(encoding="utf-8"))


# ------------------------------------------------------------------------------------------
# the load
# ------------------------------------------------------------------------------------------


def _status(answer) -> str:
    return str(answer.status_code)


def _text_of(answer) -> str | None:
    try:
        return answer.json()["translations"][0]["text"]
    except (ValueError, KeyError, IndexError, TypeError):
        return None


async def _cell(url: str, plan: list[list[str]], expected: dict, tokens: dict) -> dict:
    """Every client sends its sentences one at a time; throughput, latency and answers."""
    import httpx

    latencies: list[float] = []
    statuses: dict[str, int] = {}
    errors: dict[str, list[str]] = {}
    wrong: list[str] = []
    done_tokens = [0]
    clients = len(plan)
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=CLIENT_TIMEOUT, limits=limits) as client:

        async def one_client(sentences: list[str]) -> None:
            for line in sentences:
                start = time.perf_counter()
                try:
                    answer = await client.post("/v1/translate", json={"text": line})
                    status = _status(answer)
                except httpx.HTTPError as exc:
                    status, answer = type(exc).__name__, None
                    _note(errors, status, exc)
                latencies.append(time.perf_counter() - start)
                statuses[status] = statuses.get(status, 0) + 1
                if status == "200":
                    if _text_of(answer) != expected[line]:
                        wrong.append(line)
                    else:
                        done_tokens[0] += tokens[line]

        start = time.perf_counter()
        await asyncio.gather(*(one_client(p) for p in plan))
        elapsed = time.perf_counter() - start
    ok = statuses.get("200", 0)
    return {
        "clients": clients,
        "requests": sum(len(p) for p in plan),
        "seconds": elapsed,
        "sentences_per_s": ok / elapsed,
        "tokens_per_s": done_tokens[0] / elapsed,
        "latency_p50_s": _percentile(latencies, 0.50),
        "latency_p95_s": _percentile(latencies, 0.95),
        "latency_p99_s": _percentile(latencies, 0.99),
        "statuses": statuses,
        "transport_errors": errors,
        "wrong_200_answers": len(wrong),
        "wrong_lines": wrong[:5],
    }


def _note(errors: dict, status: str, exc: Exception) -> None:
    """The first messages of each kind of failed request (what the client saw)."""
    seen = errors.setdefault(status, [])
    if len(seen) < 5:
        seen.append(str(exc) or repr(exc))


async def _overload(url: str, pid: int, lines: list[str], expected: dict, args) -> dict:
    """``--overload-clients`` clients, each sending again after a 429: a warm-up of
    ``--overload-warmup`` 200 answers (at most ``WARMUP_LIMIT`` times ``--overload-seconds``),
    then ``--overload-seconds`` measured."""
    import httpx

    clients, seconds = args.overload_clients, args.overload_seconds
    warm_answers = [0]
    statuses: dict[str, int] = {}
    errors: dict[str, list[str]] = {}
    wrong: list[str] = []
    rss: list[tuple[float, int]] = []
    running = [clients]
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    start = time.perf_counter()
    # the measured run starts at the warm-up's last answer (or its time limit): [start, end]
    span = [start + WARMUP_LIMIT * seconds if args.overload_warmup else start]
    span.append(span[0] + seconds)

    def warmed() -> None:
        warm_answers[0] += 1
        now = time.perf_counter()
        if warm_answers[0] == args.overload_warmup and now < span[0]:
            span[:] = [now, now + seconds]

    async def sample() -> None:  # until the last client's last answer
        while running[0]:
            value = _rss(pid)
            if value is not None:
                rss.append((time.perf_counter() - start, value))
            await asyncio.sleep(0.2)

    async with httpx.AsyncClient(base_url=url, timeout=CLIENT_TIMEOUT, limits=limits) as client:

        async def one_client(c: int) -> None:
            k = c
            while time.perf_counter() < span[1]:
                line = lines[k % len(lines)]
                k += clients
                try:
                    answer = await client.post("/v1/translate", json={"text": line})
                    status = _status(answer)
                except httpx.HTTPError as exc:
                    status, answer = type(exc).__name__, None
                    _note(errors, status, exc)
                statuses[status] = statuses.get(status, 0) + 1
                if status == "200" and _text_of(answer) != expected[line]:
                    wrong.append(line)
                if status == "200" and time.perf_counter() < span[0]:
                    warmed()
                elif status == "429":
                    await asyncio.sleep(args.overload_backoff)
            running[0] -= 1

        await asyncio.gather(sample(), *(one_client(c) for c in range(clients)))
    elapsed = time.perf_counter() - start
    warmup = span[0] - start
    return {
        "clients": clients,
        "max_queue": args.overload_queue,
        "seconds": elapsed - warmup,
        "warmup_answers": min(warm_answers[0], args.overload_warmup),
        "statuses": statuses,
        "transport_errors": errors,
        "sentences_per_s": statuses.get("200", 0) / elapsed,
        "wrong_200_answers": len(wrong),
        "wrong_lines": wrong[:5],
        **rss_summary(rss, warmup),
    }


def rss_summary(rss: list[tuple[float, int]], warmup: float) -> dict:
    """The overload's RSS record from its ``(seconds into the run, bytes)`` samples: those of the
    first ``warmup`` seconds apart (and their peak), the medians of the first and last third of
    the others, their growth and the flat limit."""
    warm = [(t, v) for t, v in rss if t < warmup]
    measured = [(t, v) for t, v in rss if t >= warmup] or rss[-1:]
    values = [v for _, v in measured]
    third = max(1, len(values) // 3)
    first, last = statistics.median(values[:third]), statistics.median(values[-third:])
    return {
        "warmup_seconds": warmup,
        "rss_warmup_samples": warm,
        "rss_warmup_peak_bytes": max((v for _, v in warm), default=None),
        "rss_samples": measured,
        "rss_peak_bytes": max(values),
        "rss_first_third_median_bytes": first,
        "rss_last_third_median_bytes": last,
        "rss_growth_bytes": last - first,
        "rss_flat_limit_bytes": max(RSS_FLAT_FRACTION * first, RSS_FLAT_BYTES),
    }


async def _sigterm(server: ServerProcess, lines: list[str], expected: dict, args) -> dict:
    """SIGTERM into a 32-client run; every request's outcome, and the server's exit."""
    import httpx

    clients = THROUGHPUT_CLIENTS
    records: list[dict] = []
    signalled: dict = {}
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=0)  # a fresh connection each
    start = time.perf_counter()

    async def send_signal() -> None:
        await asyncio.sleep(args.sigterm_after)
        signalled["t"] = time.perf_counter() - start
        server.proc.send_signal(signal.SIGTERM)

    async with httpx.AsyncClient(base_url=server.url, timeout=CLIENT_TIMEOUT, limits=limits) as client:

        async def one_client(c: int) -> None:
            k = c
            while True:
                t0 = time.perf_counter() - start
                after = "t" in signalled
                line = lines[k % len(lines)]
                k += clients
                record = {"start": t0, "after_signal": after}
                try:
                    answer = await client.post("/v1/translate", json={"text": line})
                    record["status"] = _status(answer)
                    if answer.status_code == 200:
                        record["correct"] = _text_of(answer) == expected[line]
                    else:
                        try:
                            record["error"] = answer.json().get("error")
                        except ValueError:
                            record["error"] = None
                except httpx.HTTPError as exc:
                    record["status"] = type(exc).__name__
                    record["error"] = str(exc) or repr(exc)
                record["end"] = time.perf_counter() - start
                records.append(record)
                if after or record["status"] not in ("200",):
                    return

        await asyncio.gather(send_signal(), *(one_client(c) for c in range(clients)))
    try:
        code = server.proc.wait(args.drain_timeout + 15)
    except subprocess.TimeoutExpired:
        code = None
        server.proc.kill()
        server.proc.wait()
    exited = time.perf_counter() - start
    t_sig = signalled["t"]
    counts: dict[str, int] = {}
    for r in records:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    in_flight = [r for r in records if r["start"] < t_sig < r["end"]]
    unclear = [r for r in records if _unclear(r)]
    return {
        "clients": clients,
        "signal_after_s": t_sig,
        "requests": len(records),
        "statuses": counts,
        "in_flight_at_signal": len(in_flight),
        "in_flight_answered_200": sum(1 for r in in_flight if r["status"] == "200"),
        # what each answer that was not a 200 said, counted: a 503 "accepts no new work" came before
        # the request was accepted; a drain timeout's or a shutdown's would mean accepted work lost
        "other_answers": dict(
            collections.Counter(f"{r['status']}: {r.get('error')}" for r in records if r["status"] != "200")
        ),
        "wrong_200_answers": sum(1 for r in records if r["status"] == "200" and not r.get("correct")),
        "unclear": unclear[:10],
        "unclear_count": len(unclear),
        "exit_code": code,
        "exit_after_signal_s": exited - t_sig if code is not None else None,
        "log_errors": server.errors(),
    }


# A request sent after the signal that meets the closed server: refused, or its connection closed
# before the server read it (accepted in the last moment before the socket closed); never served.
CLOSED = ("ConnectError", "RemoteProtocolError", "ReadError")


def _unclear(record: dict) -> bool:
    """Not a clear outcome: anything but a 200, a 503 with its error, or (for a request sent after
    the signal) a connection the closed server refused or closed unanswered."""
    status = record["status"]
    if status == "200":
        return False
    if status == "503":
        return not record.get("error")
    return not (record["after_signal"] and status in CLOSED)


# ------------------------------------------------------------------------------------------
# the run
# ------------------------------------------------------------------------------------------


def _server_cmd(mode: str, args, served: str | None, max_queue: int) -> list[str]:
    cmd = [sys.executable, "-m", "transformer_ext.serve", "--port", "0", "--batching", mode]
    cmd += ["--max-queue", str(max_queue), "--max-sources", str(min(64, max_queue))]  # 64: the default
    cmd += ["--threads", str(args.threads)]
    cmd += ["--drain-timeout", str(args.drain_timeout), "--log-level", "info"]
    return cmd + (["--model", served] if served else [])


def _ct2_cmd(setting: tuple[int, int], info: dict, budget: dict) -> list[str]:
    inter, intra = setting
    return [
        sys.executable,
        "-m",
        "benchmarks.serve.ct2_server",
        "--ct2-model",
        info["ct2"],
        "--tokenizer",
        info["tokenizer"],
        "--inter-threads",
        str(inter),
        "--intra-threads",
        str(intra),
        "--max-len-a",
        str(budget["max_len_a"]),
        "--max-len-b",
        str(budget["max_len_b"]),
        "--max-decoding-length",
        str(budget["max_decoding_length"]),
    ]


def _plan(lines: list[str], clients: int, per_client: int) -> list[list[str]]:
    """Client ``c``'s sentences: lines ``c * per_client`` on (cycling through ``lines``)."""
    return [[lines[(c * per_client + r) % len(lines)] for r in range(per_client)] for c in range(clients)]


def _warm(url: str, lines: list[str], clients: int) -> None:
    """One untimed round: ``clients`` concurrent requests (the runner's buffers reach their size)."""
    asyncio.run(_cell(url, [[lines[c % len(lines)]] for c in range(clients)], _AnyText(), _Zero()))


class _AnyText(dict):
    def __missing__(self, key):
        return None


class _Zero(dict):
    def __missing__(self, key):
        return 0


def _server_record(server: ServerProcess) -> dict:
    return {
        "pid": server.pid,
        "torch_loaded": _torch_loaded(server.pid),
        "rss_bytes": _rss(server.pid),
        "log_errors": server.errors(),
    }


def _run_cells(name: str, server: ServerProcess, args, lines, expected, tokens, payload) -> list[dict]:
    rows = []
    _warm(server.url, lines, max(args.clients))
    for clients in args.clients:
        per = args.latency_sentences if clients == 1 else args.requests
        rss_before = _rss(server.pid)
        row = asyncio.run(_cell(server.url, _plan(lines, clients, per), expected, tokens))
        row["rss_before_bytes"], row["rss_after_bytes"] = rss_before, _rss(server.pid)
        rows.append(row)
        print(
            f"{name:16s} clients {clients:4d}: {row['sentences_per_s']:8.2f} sentences/s  "
            f"p50 {row['latency_p50_s'] * 1000:8.1f} ms  p99 {row['latency_p99_s'] * 1000:8.1f} ms  "
            f"statuses {row['statuses']}  wrong {row['wrong_200_answers']}",
            file=sys.stderr,
            flush=True,
        )
    payload["servers"][name] = _server_record(server)
    return rows


def run(args) -> dict:
    started = time.perf_counter()
    scratch = args.artifacts or tempfile.mkdtemp(prefix="bench_serve_")
    try:
        return _run(args, scratch, started)
    finally:
        if not args.artifacts:
            shutil.rmtree(scratch, ignore_errors=True)


def _payload(args, info: dict, base: dict, load_before) -> dict:
    """The run's record before any server is measured: the baselines and the machine."""
    lines = info["lines"]
    latency_lines = lines[: args.latency_sentences]
    throughput_lines = [s for p in _plan(lines, THROUGHPUT_CLIENTS, args.requests) for s in p]
    expected = dict(zip(lines, base["texts"]))
    offline_s = min(base["offline_runs_s"])
    # the 32-client cell sends exactly these sentences when --requests * 32 covers --lines once
    same = sorted(throughput_lines) == sorted(lines)
    return {
        "benchmark": "bench_serve",
        "model": args.model,
        "model_kind": info["kind"],
        "threads": args.threads,
        "lines": len(lines),
        "mean_source_chars": statistics.mean(len(s) for s in lines),
        "mean_target_tokens": statistics.mean(base["tokens"]),
        "budget": base["budget"],
        "beam_size": base["beam_size"],
        "offline_translate_iterable": {
            "seconds": offline_s,
            "runs_s": base["offline_runs_s"],
            "sentences_per_s": len(lines) / offline_s,
            "tokens_per_s": sum(base["tokens"]) / offline_s,
            "same_sentences_as_32_clients": same,
            "torch_imported": base["torch_imported"],
        },
        "direct_translate": {
            "sentences": len(latency_lines),
            "latency_p50_s": _percentile(base["direct_latencies_s"], 0.5),
            "latency_p95_s": _percentile(base["direct_latencies_s"], 0.95),
            "latencies_s": base["direct_latencies_s"],
            "equal_to_offline": sum(a == expected[s] for a, s in zip(base["direct_texts"], latency_lines)),
        },
        "machine": {**lscpu(), "load_average_before": load_before, "os_cpu_count": os.cpu_count()},
        "modes": {},
        "skipped": {},
        "servers": {},
    }


def _run_ctranslate2(args, info: dict, base: dict, expected: dict, tokens: dict, payload: dict) -> None:
    """The CTranslate2 per-request server at each of its settings; its best at 32 clients."""
    if info["ct2"] is None:
        print(f"ctranslate2: skipped ({info['ct2_skip']})", file=sys.stderr)
        return
    settings = payload["ctranslate2_settings"] = {}
    for setting in args.ct2_settings:
        name = f"ctranslate2 {setting[0]}x{setting[1]}"
        server = ServerProcess(_ct2_cmd(setting, info, base["budget"]), name)
        try:
            settings[name.split()[1]] = _run_cells(
                name, server, args, info["lines"], expected, tokens, payload
            )
        finally:
            server.stop()
    # "ctranslate2": its best setting at 32 clients (else at the most clients measured)
    best = max(settings, key=lambda k: (settings[k][-1]["clients"], settings[k][-1]["sentences_per_s"]))
    payload["modes"]["ctranslate2"] = [dict(r, setting=best) for r in settings[best]]


def _run_ours(mode: str, args, info: dict, expected: dict, tokens: dict, payload: dict) -> None:
    """One batching mode of our server; for ``continuous`` also the SIGTERM and overload runs."""
    lines = info["lines"]
    server = ServerProcess(_server_cmd(mode, args, info["serve"], args.max_queue), mode)
    try:
        payload["modes"][mode] = _run_cells(mode, server, args, lines, expected, tokens, payload)
        if mode == "continuous":
            print("continuous: SIGTERM during a 32-client run ...", file=sys.stderr, flush=True)
            payload["sigterm"] = asyncio.run(_sigterm(server, lines, expected, args))
            print(
                f"  {payload['sigterm']['statuses']}, exit {payload['sigterm']['exit_code']}",
                file=sys.stderr,
            )
    finally:
        server.stop()
    if mode != "continuous":
        return
    name = f"continuous --max-queue {args.overload_queue}"
    server = ServerProcess(_server_cmd(mode, args, info["serve"], args.overload_queue), name)
    try:
        _warm(server.url, lines, args.overload_clients)
        print(f"{name}: {args.overload_clients} clients ...", file=sys.stderr, flush=True)
        payload["overload"] = asyncio.run(_overload(server.url, server.pid, lines, expected, args))
        payload["servers"][name] = _server_record(server)
        print(f"  {payload['overload']['statuses']}", file=sys.stderr)
    finally:
        server.stop()


def _run(args, scratch: str, started: float) -> dict:
    load_before = os.getloadavg()
    info = prepare(args, scratch)
    lines = info["lines"]
    print(f"baselines ({info['kind']}) ...", file=sys.stderr, flush=True)
    job = {
        "lines": lines,
        "latency_lines": lines[: args.latency_sentences],
        "offline_runs": args.offline_runs,
    }
    base = run_baseline(args, info["serve"], job, scratch)
    expected = dict(zip(lines, base["texts"]))
    tokens = dict(zip(lines, base["tokens"]))
    payload = _payload(args, info, base, load_before)
    if info["ct2_skip"]:
        payload["skipped"]["ctranslate2"] = info["ct2_skip"]
    for mode in args.modes:
        if mode == "ctranslate2":
            _run_ctranslate2(args, info, base, expected, tokens, payload)
            continue
        reason = _skip_reason(mode)
        if reason is not None:
            payload["skipped"][mode] = reason
            print(f"{mode}: skipped ({reason})", file=sys.stderr)
            continue
        _run_ours(mode, args, info, expected, tokens, payload)
    _second_opinion(args, info, payload, scratch)
    payload["machine"]["load_average_after"] = os.getloadavg()
    payload["loaded"] = load_before[0] > 0.5 * (os.cpu_count() or 1)
    payload["targets"] = score(payload)
    payload["seconds_total"] = time.perf_counter() - started
    return payload


def _second_opinion(args, info: dict, payload: dict, scratch: str) -> None:
    """Lines whose 200 answer differed from the offline batch: their translation alone, for the record
    (a float32 near-tie may pick another token in another batch composition)."""
    wrong = set(payload.get("overload", {}).get("wrong_lines", []))
    for rows in payload["modes"].values():
        for row in rows:
            wrong.update(row["wrong_lines"])
    if wrong:
        solo = run_baseline(args, info["serve"], {"solo": sorted(wrong)}, scratch)["solo"]
        payload["wrong_lines_translated_alone"] = dict(zip(sorted(wrong), solo))


def _skip_reason(mode: str) -> str | None:
    if mode == "continuous":
        from transformer_ext.serve.continuous import StepwiseUnavailable, stepwise_api

        try:
            stepwise_api()
        except StepwiseUnavailable as exc:
            return str(exc)
    return None


# ------------------------------------------------------------------------------------------
# scoring
# ------------------------------------------------------------------------------------------


def _row(payload: dict, mode: str, clients: int) -> dict | None:
    for row in payload["modes"].get(mode, []):
        if row["clients"] == clients:
            return row
    return None


def _target(name: str, measured: str, threshold: str, met: bool | None, why: str = "") -> dict:
    status = "not measured" if met is None else ("met" if met else "missed")
    return {
        "target": name,
        "measured": measured if met is not None else why,
        "threshold": threshold,
        "status": status,
    }


def _score_throughput(payload: dict, out: list) -> None:
    """The 32-client throughput targets: against offline, none and CTranslate2."""
    c32 = _row(payload, "continuous", THROUGHPUT_CLIENTS)
    n = THROUGHPUT_CLIENTS
    offline = payload["offline_translate_iterable"]["sentences_per_s"]
    if c32 is None:
        why = payload["skipped"].get("continuous", f"no continuous cell at {n} clients")
        for name, threshold in (
            ("vs offline translate_iterable", ">= 0.85x"),
            ("vs --batching none", ">= 3x"),
            ("vs CTranslate2 per request", ">= 1.5x"),
        ):
            out.append(_target(f"{n} clients: continuous {name}", "", threshold, None, why))
    else:
        ours = c32["sentences_per_s"]
        ratio = ours / offline
        out.append(
            _target(
                f"{n} clients: continuous vs offline translate_iterable",
                f"{ratio:.2f}x ({ours:.2f} vs {offline:.2f} sentences/s)",
                ">= 0.85x",
                ratio >= 0.85,
            )
        )
        none = _row(payload, "none", n)
        if none is None:
            out.append(
                _target(f"{n} clients: continuous vs --batching none", "", ">= 3x", None, "none not run")
            )
        else:
            r = ours / none["sentences_per_s"] if none["sentences_per_s"] else float("inf")
            out.append(
                _target(
                    f"{n} clients: continuous vs --batching none",
                    f"{r:.2f}x ({ours:.2f} vs {none['sentences_per_s']:.2f} sentences/s)",
                    ">= 3x",
                    r >= 3,
                )
            )
        row = _row(payload, "ctranslate2", n)
        if row is None:
            why = payload["skipped"].get("ctranslate2", "ctranslate2 not run")
            out.append(
                _target(f"{n} clients: continuous vs CTranslate2 per request", "", ">= 1.5x", None, why)
            )
        else:
            r = ours / row["sentences_per_s"] if row["sentences_per_s"] else float("inf")
            out.append(
                _target(
                    f"{n} clients: continuous vs CTranslate2 per request (best: {row['setting']})",
                    f"{r:.2f}x ({ours:.2f} vs {row['sentences_per_s']:.2f} sentences/s)",
                    ">= 1.5x",
                    r >= 1.5,
                )
            )


def _score_latency(payload: dict, out: list) -> None:
    """The 1-client latency target."""
    c1 = _row(payload, "continuous", 1)
    direct = payload["direct_translate"]["latency_p50_s"]
    if c1 is None:
        out.append(
            _target(
                "1 client: continuous p50 vs direct Translator.translate",
                "",
                "<= 1.1x + 5 ms",
                None,
                "no 1-client cell",
            )
        )
    else:
        limit = 1.1 * direct + 0.005
        out.append(
            _target(
                "1 client: continuous p50 vs direct Translator.translate",
                f"{c1['latency_p50_s'] * 1000:.1f} ms vs {direct * 1000:.1f} ms (limit {limit * 1000:.1f} ms)",
                "<= 1.1x + 5 ms",
                c1["latency_p50_s"] <= limit,
            )
        )


def _score_overload(payload: dict, out: list) -> None:
    """The overload targets: 429s only, flat RSS, correct answers."""
    over = payload.get("overload")
    clients = over["clients"] if over else "?"
    head = f"{clients} clients, --max-queue {over['max_queue'] if over else '?'}"
    if over is None:
        for name, threshold in (("errors", "429 only"), ("RSS", "flat"), ("200 answers", "all correct")):
            out.append(_target(f"{head}: {name}", "", threshold, None, "continuous not run"))
    else:
        st = over["statuses"]
        other = {k: v for k, v in st.items() if k not in ("200", "429")}
        if not st.get("429"):
            out.append(
                _target(
                    f"{head}: errors",
                    "",
                    "429 only",
                    None,
                    "no 429: the queue never filled (lower --overload-queue)",
                )
            )
        else:
            out.append(
                _target(f"{head}: errors", f"429: {st['429']}, others: {other or 0}", "429 only", not other)
            )
        growth, limit = over["rss_growth_bytes"], over["rss_flat_limit_bytes"]
        out.append(
            _target(
                f"{head}: RSS over {over['seconds']:.0f} s after a warm-up of {over.get('warmup_answers', 0)} answers",
                f"{growth / 2**20:+.1f} MiB (median of the first third {over['rss_first_third_median_bytes'] / 2**20:.0f} MiB, "
                f"{len(over['rss_samples'])} samples)",
                f"flat: last-third median <= first-third + max(5 %, 16 MiB) = {limit / 2**20:.1f} MiB",
                growth <= limit,
            )
        )
        ok = st.get("200", 0)
        out.append(
            _target(
                f"{head}: 200 answers",
                f"{over['wrong_200_answers']} wrong of {ok}",
                "all correct",
                over["wrong_200_answers"] == 0 if ok else None,
                "no 200 answer",
            )
        )


def _score_sigterm(payload: dict, out: list) -> None:
    """The SIGTERM drain target."""
    sig = payload.get("sigterm")
    if sig is None:
        out.append(
            _target(
                "SIGTERM during 32 clients",
                "",
                "200s full, others clear, no hang",
                None,
                "continuous not run",
            )
        )
    else:
        met = (
            sig["wrong_200_answers"] == 0
            and sig["unclear_count"] == 0
            and sig["exit_code"] == 0
            and sig["in_flight_at_signal"] > 0
        )
        out.append(
            _target(
                "SIGTERM during 32 clients",
                f"statuses {sig['statuses']}; in flight at the signal {sig['in_flight_at_signal']} "
                f"({sig['in_flight_answered_200']} answered 200); wrong 200s {sig['wrong_200_answers']}; "
                f"unclear {sig['unclear_count']}; exit {sig['exit_code']} after "
                f"{sig['exit_after_signal_s'] if sig['exit_after_signal_s'] is None else round(sig['exit_after_signal_s'], 2)} s",
                "every 200 full, others 503 / refused, exit 0, no hang",
                met,
            )
        )


def score(payload: dict) -> list[dict]:
    """Every target of the run: measured value, threshold, met / missed / not measured."""
    out: list = []
    for part in (_score_throughput, _score_latency, _score_overload, _score_sigterm):
        part(payload, out)
    return out


def table(targets: list[dict]) -> str:
    rows = [("target", "measured", "threshold", "result")] + [
        (t["target"], t["measured"], t["threshold"], t["status"]) for t in targets
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = []
    for r in rows:
        lines.append("  ".join(r[i].ljust(widths[i]) for i in range(3)) + "  " + r[3])
    return "\n".join(lines)


def plot(payload: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    series = {m: rows for m, rows in payload["modes"].items() if m != "ctranslate2"}
    series.update({f"ctranslate2 {k}": v for k, v in payload.get("ctranslate2_settings", {}).items()})
    for mode, rows in series.items():
        xs = [r["clients"] for r in rows]
        (line,) = left.plot(xs, [r["sentences_per_s"] for r in rows], marker="o", label=mode)
        right.plot(
            xs,
            [r["latency_p50_s"] * 1000 for r in rows],
            marker="o",
            color=line.get_color(),
            label=f"{mode} p50",
        )
        right.plot(xs, [r["latency_p95_s"] * 1000 for r in rows], linestyle=":", color=line.get_color())
    offline = payload["offline_translate_iterable"]["sentences_per_s"]
    left.axhline(offline, color="grey", linestyle="--", label="offline translate_iterable")
    right.axhline(
        payload["direct_translate"]["latency_p50_s"] * 1000,
        color="grey",
        linestyle="--",
        label="direct translate p50",
    )
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.legend(fontsize=8)
    left.set_ylabel("sentences / s")
    right.set_ylabel("latency (ms; dotted: p95)")
    right.set_yscale("log")
    loaded = " (LOADED MACHINE: not a measurement)" if payload.get("loaded") else ""
    fig.suptitle(f"bench_serve: {payload['model_kind']}{loaded}", fontsize=10)
    fig.tight_layout()
    save_figure(fig, path)


# ------------------------------------------------------------------------------------------
# the command line
# ------------------------------------------------------------------------------------------


def _settings(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        m = re.fullmatch(r"(\d+)x(\d+)", part.strip())
        if not m or min(int(m.group(1)), int(m.group(2))) < 1:
            raise ValueError(part)
        out.append((int(m.group(1)), int(m.group(2))))
    return out


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="the demo model, a few requests per cell: a smoke run"
    )
    parser.add_argument("--model", help="base (random weights; default), demo (--quick's), or a model folder")
    parser.add_argument(
        "--input", help="sentences, one per line (default: the model's own, see the module docstring)"
    )
    parser.add_argument("--lines", type=int, help="distinct sentences (default 256; --quick 32)")
    parser.add_argument(
        "--clients", help="comma-separated client counts of the cells (default 1,8,32; --quick 1,32)"
    )
    parser.add_argument("--requests", type=int, help="sentences per client of a cell (default 8; --quick 1)")
    parser.add_argument(
        "--latency-sentences", type=int, help="sentences of the 1-client cell (default 32; --quick 4)"
    )
    parser.add_argument("--modes", help=f"comma-separated, of {MODES} (default all; --quick without static)")
    parser.add_argument(
        "--ct2-settings",
        help="CTranslate2 inter_threads x intra_threads (default 1x1,1xT,Tx1 for --threads T; --quick 1x1)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        help="our server's and the baselines' --threads (default: the cores; --quick 1)",
    )
    parser.add_argument("--max-queue", type=int, default=256, help="the server's --max-queue in the cells")
    parser.add_argument("--overload-clients", type=int, default=128, help="clients of the overload run")
    parser.add_argument(
        "--overload-queue", type=int, default=16, help="the server's --max-queue in the overload run"
    )
    parser.add_argument(
        "--overload-seconds", type=float, help="length of the overload run (default 20; --quick 1)"
    )
    parser.add_argument(
        "--overload-warmup",
        type=int,
        help="200 answers of the overload load before its measured run (default 128; --quick 4; 0: none)",
    )
    parser.add_argument(
        "--overload-backoff", type=float, default=0.05, help="seconds a client waits after a 429"
    )
    parser.add_argument(
        "--sigterm-after", type=float, help="seconds into the SIGTERM run (default 2; --quick 0.3)"
    )
    parser.add_argument("--drain-timeout", type=float, default=30.0, help="the server's --drain-timeout")
    parser.add_argument(
        "--artifacts",
        help="a folder for the model, export and conversion, kept and reused by a later run (default: temporary)",
    )
    parser.add_argument(
        "--out", default="benchmarks/results/bench_serve.json", help="the JSON (the plot: .png beside it)"
    )
    parser.add_argument(
        "--offline-runs", type=int, help="runs of the offline baseline, the best kept (default 2; --quick 1)"
    )
    parser.add_argument("--baseline-worker", help=argparse.SUPPRESS)
    return parser


def _check(parser: argparse.ArgumentParser, args) -> None:
    """The defaults of --quick or a full run filled in, every value checked (exit 2 on a bad one)."""
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    try:
        args.clients = sorted({int(c) for c in args.clients.split(",")})
    except ValueError:
        parser.error(f"--clients: expected comma-separated integers, got {args.clients!r}")
    if args.threads is None or args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    if args.ct2_settings is None:
        args.ct2_settings = ",".join(dict.fromkeys(["1x1", f"1x{args.threads}", f"{args.threads}x1"]))
    try:
        args.ct2_settings = _settings(args.ct2_settings)
    except ValueError as exc:
        parser.error(f"--ct2-settings: expected comma-separated WxT (e.g. 2x1), got {exc}")
    args.modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(args.modes) - set(MODES))
    if unknown:
        parser.error(f"--modes: unknown {unknown}; the modes are {list(MODES)}")
    positive = dict(
        clients=min(args.clients),
        requests=args.requests,
        lines=args.lines,
        threads=args.threads,
        latency_sentences=args.latency_sentences,
        offline_runs=args.offline_runs,
        max_queue=args.max_queue,
        overload_queue=args.overload_queue,
    )
    for key, value in positive.items():
        if value is None or value < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1, got {value}")
    if args.overload_queue >= args.overload_clients:
        parser.error(
            "--overload-queue must be below --overload-clients (the overload run needs a full queue)"
        )
    if args.overload_warmup < 0:
        parser.error(f"--overload-warmup must be >= 0 answers, got {args.overload_warmup}")
    for key in ("overload_seconds", "overload_backoff", "sigterm_after", "drain_timeout"):
        value = getattr(args, key)
        if not (math.isfinite(value) and value >= 0) or (key != "overload_backoff" and value <= 0):
            parser.error(f"--{key.replace('_', '-')}: expected a positive number of seconds, got {value}")
    if args.model not in ("base", "demo") and not os.path.isfile(os.path.join(args.model, "config.json")):
        parser.error(f"--model {args.model}: expected base, demo or a model folder (config.json)")
    if args.input and not os.path.isfile(args.input):
        parser.error(f"--input {args.input}: no such file")
    if args.artifacts and os.path.exists(args.artifacts):
        if not os.path.isdir(args.artifacts):
            parser.error(f"--artifacts {args.artifacts}: not a folder")
        if os.listdir(args.artifacts) and not os.path.isfile(os.path.join(args.artifacts, PREPARED)):
            parser.error(
                f"--artifacts {args.artifacts}: holds files that are not an earlier bench_serve run's"
            )


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.baseline_worker:
        return baseline_worker(args.baseline_worker)
    _check(parser, args)
    if args.artifacts:
        os.makedirs(args.artifacts, exist_ok=True)
    payload = run(args)
    write_json(args.out, payload)
    plot(payload, os.path.splitext(args.out)[0] + ".png")
    print("\n" + table(payload["targets"]), file=sys.stderr)
    if payload["loaded"]:
        print(
            f"\nthe load average was {payload['machine']['load_average_before'][0]:.1f} on "
            f"{os.cpu_count()} cores before the run: a smoke run, not a measurement",
            file=sys.stderr,
        )
    print(f"wrote {args.out} ({payload['seconds_total']:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
