"""The translation server under load: throughput and latency against concurrent clients.

Starts the real server (``python -m transformer_ext.serve``) once per batching mode and drives
it with ``--clients`` asynchronous HTTP clients (httpx), each sending single sentences of the
input, one request at a time, ``--requests`` each. Per mode and client count it records
sentences/s, generated tokens/s (the server's ``translate_generated_tokens_total``), p50 / p95 /
p99 latency, the answers by status, whether every 200 answer equals the offline translation
of its sentence, and the server's RSS before and after; the offline baseline is
``Translator.translate_iterable`` over the same sentences in this process. The modes:

* ``continuous``, ``static``, ``none``: the server's ``--batching`` (``continuous`` is skipped,
  with the reason recorded, where the decoding package has no step-wise search state);
* ``ctranslate2``: the same FastAPI route written the way its users write one, calling
  ``ctranslate2.Translator.translate_batch`` per request (``--ct2-model``, a converted model whose
  tokens are ``s<id>`` / ``t<id>`` as ``benchmarks.decode.bench_decode`` converts ours; skipped when ctranslate2
  is not installed).

Output: JSON (``--out``) with the machine (lscpu, load average), and a throughput-against-p50-
latency plot next to it. A run on a shared or loaded machine is a smoke test, not a measurement.

    python -m benchmarks bench_serve --model onnx_export --input bible.en --out benchmarks/results/bench_serve.json
    python -m benchmarks bench_serve --clients 1,8 --requests 4 --modes static,none   # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks.common import lscpu, save_figure, write_json

REPO = Path(__file__).resolve().parents[2]
MODES = ("continuous", "static", "none", "ctranslate2")


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


class ServerProcess:
    """A server command in a child process; ``url`` once its log says where it listens."""

    def __init__(self, cmd: list[str]):
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO
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
            raise RuntimeError("the server did not start:\n" + "".join(self.log[-20:]))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _generated_tokens(client, url: str) -> float:
    text = client.get(url + "/metrics").text
    return sum(
        float(m.group(1))
        for m in re.finditer(r"^translate_generated_tokens_total\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    )


async def _load(url: str, lines: list[str], clients: int, requests: int, expected: dict[str, str]) -> dict:
    import httpx

    latencies: list[float] = []
    statuses: dict[str, int] = {}
    wrong = {"count": 0}
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:

        async def one_client(c: int) -> None:
            for r in range(requests):
                line = lines[(c * requests + r) % len(lines)]
                start = time.perf_counter()
                try:
                    answer = await client.post("/v1/translate", json={"text": line})
                    status = str(answer.status_code)
                except httpx.HTTPError as exc:
                    status = type(exc).__name__
                    answer = None
                latencies.append(time.perf_counter() - start)
                statuses[status] = statuses.get(status, 0) + 1
                if answer is not None and answer.status_code == 200:
                    if answer.json()["translations"][0]["text"] != expected[line]:
                        wrong["count"] += 1

        start = time.perf_counter()
        await asyncio.gather(*(one_client(c) for c in range(clients)))
        elapsed = time.perf_counter() - start
    ok = statuses.get("200", 0)
    return {
        "clients": clients,
        "requests": clients * requests,
        "seconds": elapsed,
        "sentences_per_s": ok / elapsed,
        "latency_p50_s": _percentile(latencies, 0.50),
        "latency_p95_s": _percentile(latencies, 0.95),
        "latency_p99_s": _percentile(latencies, 0.99),
        "statuses": statuses,
        "wrong_200_answers": wrong["count"],
    }


def _server_cmd(mode: str, args) -> list[str]:
    if mode == "ctranslate2":
        return [
            sys.executable,
            "-m",
            "benchmarks.serve.bench_serve",
            "--ct2-server",
            args.ct2_model,
            "--tokenizer",
            args.model,
            "--intra-threads",
            str(args.threads or 1),
            "--inter-threads",
            str(args.ct2_inter_threads),
        ]
    cmd = [
        sys.executable,
        "-m",
        "transformer_ext.serve",
        "--port",
        "0",
        "--batching",
        mode,
        "--max-queue",
        str(args.max_queue),
    ]
    if args.model:
        cmd += ["--model", args.model]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    return cmd


def _skip_reason(mode: str, args) -> str | None:
    if mode == "continuous":
        from transformer_ext.serve.continuous import StepwiseUnavailable, stepwise_api

        try:
            stepwise_api()
        except StepwiseUnavailable as exc:
            return str(exc)
    if mode == "ctranslate2":
        import importlib.util

        if importlib.util.find_spec("ctranslate2") is None:
            return "ctranslate2 is not installed (pip install -r requirements/bench.txt)"
        if not args.ct2_model:
            return "no --ct2-model (a CTranslate2 conversion of the same weights)"
    return None


def run(args) -> dict:
    import httpx

    from transformer_ext.translator import Translator, is_export_dir

    lines = _read_lines(args)
    if args.model and is_export_dir(args.model):
        translator = Translator.from_export_dir(args.model, threads=args.threads)
    else:
        translator = Translator.from_model_dir(args.model)
    start = time.perf_counter()
    offline = [str(t) for t in translator.translate_iterable(lines)]
    offline_seconds = time.perf_counter() - start
    expected = dict(zip(lines, offline))
    payload: dict = {
        "benchmark": "bench_serve",
        "model": args.model or "demo",
        "lines": len(lines),
        "offline_translate_iterable": {
            "seconds": offline_seconds,
            "sentences_per_s": len(lines) / offline_seconds,
        },
        "machine": {**lscpu(), "load_average_before": os.getloadavg(), "os_cpu_count": os.cpu_count()},
        "modes": {},
        "skipped": {},
    }
    for mode in args.modes:
        reason = _skip_reason(mode, args)
        if reason is not None:
            payload["skipped"][mode] = reason
            print(f"{mode}: skipped ({reason})", file=sys.stderr)
            continue
        server = ServerProcess(_server_cmd(mode, args))
        try:
            with httpx.Client(timeout=60) as client:
                deadline = time.monotonic() + 300
                while client.get(server.url + "/readyz").status_code != 200:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{mode}: the server never became ready")
                    time.sleep(0.1)
                rows = []
                for clients in args.clients:
                    tokens_before = _generated_tokens(client, server.url) if mode != "ctranslate2" else 0.0
                    rss_before = _rss(server.proc.pid)
                    row = asyncio.run(_load(server.url, lines, clients, args.requests, expected))
                    if mode != "ctranslate2":
                        row["tokens_per_s"] = (_generated_tokens(client, server.url) - tokens_before) / row[
                            "seconds"
                        ]
                    row["rss_before_bytes"], row["rss_after_bytes"] = rss_before, _rss(server.proc.pid)
                    rows.append(row)
                    print(
                        f"{mode:12s} clients {clients:4d}: {row['sentences_per_s']:8.1f} sentences/s  "
                        f"p50 {row['latency_p50_s'] * 1000:8.1f} ms  p99 {row['latency_p99_s'] * 1000:8.1f} ms  "
                        f"statuses {row['statuses']}  wrong {row['wrong_200_answers']}",
                        file=sys.stderr,
                    )
        finally:
            server.stop()
        payload["modes"][mode] = rows
    payload["machine"]["load_average_after"] = os.getloadavg()
    return payload


def _read_lines(args) -> list[str]:
    if args.input:
        text = Path(args.input).read_text(encoding="utf-8").splitlines()
        lines = [line.strip() for line in text if line.strip()][: args.lines]
    else:
        from benchmarks.decode.bench_batching import demo_lines

        lines = demo_lines(args.lines, 0)
    if not lines:
        raise SystemExit("bench_serve: error: no input lines")
    return lines


def plot(payload: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for mode, rows in payload["modes"].items():
        xs = [r["latency_p50_s"] * 1000 for r in rows]
        ys = [r["sentences_per_s"] for r in rows]
        ax.plot(xs, ys, marker="o", label=mode)
        for r, x, y in zip(rows, xs, ys):
            ax.annotate(str(r["clients"]), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    offline = payload["offline_translate_iterable"]["sentences_per_s"]
    ax.axhline(offline, color="grey", linestyle="--", label="offline translate_iterable")
    ax.set_xlabel("p50 latency (ms)")
    ax.set_ylabel("sentences / s")
    ax.set_xscale("log")
    ax.set_title("bench_serve: throughput against latency (labels: concurrent clients)")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path)


# ------------------------------------------------------------------------------------------
# the CTranslate2 baseline server: the same route, translate_batch per request
# ------------------------------------------------------------------------------------------


def ct2_server(args) -> int:
    import ctranslate2
    import uvicorn
    from fastapi import FastAPI
    from fastapi.concurrency import run_in_threadpool

    from transformer_ext.text import normalize_text
    from transformer_ext.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer)
    translator = ctranslate2.Translator(
        args.ct2_server, device="cpu", inter_threads=args.inter_threads, intra_threads=args.intra_threads
    )
    specials = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}  # bench_decode's conversion
    app = FastAPI()

    def translate(texts: list[str]) -> list[str]:
        source = [[f"s{i}" for i in tokenizer.encode_source(normalize_text(t))] for t in texts]
        results = translator.translate_batch(source, beam_size=1)
        return [
            tokenizer.decode_target([specials.get(t) or int(t[1:]) for t in r.hypotheses[0]]) for r in results
        ]

    @app.post("/v1/translate")
    async def route(body: dict):
        texts = body["text"] if isinstance(body["text"], list) else [body["text"]]
        return {"translations": [{"text": t} for t in await run_in_threadpool(translate, texts)]}

    @app.get("/readyz")
    async def ready():
        return {"status": "ready"}

    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    print(f"listening on http://127.0.0.1:{sock.getsockname()[1]}", file=sys.stderr, flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="export folder or model folder (default: the demo model)")
    parser.add_argument("--input", help="sentences, one per line (default: demo number words)")
    parser.add_argument("--lines", type=int, default=256, help="sentences used")
    parser.add_argument("--clients", default="1,8,32,128", help="comma-separated concurrent client counts")
    parser.add_argument("--requests", type=int, default=16, help="requests per client")
    parser.add_argument(
        "--modes", default="continuous,static,none,ctranslate2", help=f"comma-separated, of {MODES}"
    )
    parser.add_argument("--max-queue", type=int, default=256, help="the server's --max-queue")
    parser.add_argument("--threads", type=int, help="the server's --threads (CTranslate2: intra_threads)")
    parser.add_argument("--ct2-model", help="the CTranslate2 conversion of the same weights")
    parser.add_argument("--ct2-inter-threads", type=int, default=1, help="CTranslate2's inter_threads")
    parser.add_argument(
        "--out", default="benchmarks/results/bench_serve.json", help="the JSON (the plot: .png beside it)"
    )
    parser.add_argument("--ct2-server", help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", help=argparse.SUPPRESS)
    parser.add_argument("--intra-threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--inter-threads", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.ct2_server:
        return ct2_server(args)
    try:
        args.clients = [int(c) for c in args.clients.split(",")]
    except ValueError:
        parser.error(f"--clients: expected comma-separated integers, got {args.clients!r}")
    args.modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(args.modes) - set(MODES))
    if unknown or any(c < 1 for c in args.clients) or args.requests < 1 or args.lines < 1:
        parser.error(f"--modes must be of {MODES}; --clients, --requests and --lines positive")
    payload = run(args)
    write_json(args.out, payload)
    plot(payload, os.path.splitext(args.out)[0] + ".png")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
