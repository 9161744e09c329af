"""The translation server as a real process on a free port, talked to with a real HTTP client.

Each server is ``python -m transformer_ext.serve --port 0`` (the port it chose is read from its
log); the oracle of every translation is :meth:`Translator.translate` of the same source alone,
in this process. Tests that need a failing runner start the app in-process under uvicorn (still
over a socket).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from transformer_ext.translator import Translator

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT = 120  # seconds for a server to load its model and listen (a busy 2-core machine)
DEMO_SOURCES = ["forty-two", "one thousand and one", "seven", "three hundred and twelve"]


class Server:
    """``python -m transformer_ext.serve ARGS --port 0`` in a child process; ``url`` once it listens."""

    def __init__(self, *args: str, python_prelude: str = ""):
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop("PYTHONWARNINGS", None)
        if python_prelude:
            cmd = [
                sys.executable,
                "-c",
                python_prelude
                + "\nimport sys\nfrom transformer_ext.serve.cli import main\nsys.exit(main(sys.argv[1:]))",
            ]
        else:
            cmd = [sys.executable, "-m", "transformer_ext.serve"]
        self.proc = subprocess.Popen(
            [*cmd, "--port", "0", "--log-level", "info", *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=REPO,
            # a test run started with SIGINT ignored must not pass that on: the server drains on it
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        self.log: list[str] = []
        self._port = threading.Event()
        self.url = ""
        threading.Thread(target=self._read, daemon=True).start()
        if not self._port.wait(START_TIMEOUT):
            self.stop()
            raise AssertionError("the server did not start:\n" + "".join(self.log[-30:]))
        self.client = httpx.Client(base_url=self.url, timeout=120)
        deadline = time.monotonic() + START_TIMEOUT
        try:
            while self.client.get("/readyz").status_code != 200:
                assert time.monotonic() < deadline, "the server never became ready"
                time.sleep(0.05)
        except BaseException:
            self.stop()
            raise

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.log.append(line)
            found = re.search(r"serving .* on (http://[\d.]+:\d+)", line)
            if found:
                self.url = found.group(1)
                self._port.set()
        self._port.set()

    def metric(self, name: str, **labels: str) -> float:
        """The value of one sample of ``/metrics`` (0 when absent)."""
        text = self.client.get("/metrics").text
        want = ",".join(f'{k}="{v}"' for k, v in labels.items())
        pattern = re.escape(name) + (r"\{" + re.escape(want) + r"\}" if want else "") + r" ([0-9.e+-]+)$"
        for line in text.splitlines():
            found = re.match(pattern, line)
            if found:
                return float(found.group(1))
        return 0.0

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="module")
def demo_translator() -> Translator:
    return Translator.from_model_dir(None)


@pytest.fixture(scope="module")
def solo(demo_translator):
    """The oracle: ``Translator.translate`` of one source alone (each computed once)."""
    cache: dict = {}

    def translate(text: str, **options):
        key = (text, tuple(sorted(options.items())))
        if key not in cache:
            cache[key] = demo_translator.translate([text], **options)[0]
        return cache[key]

    return translate


@pytest.fixture(scope="module")
def static_server():
    server = Server("--batching", "static", "--languages", "en-de", "--max-sources", "8")
    yield server
    assert server.stop() == 0, "".join(server.log[-20:])


# ------------------------------------------------------------------------------------------
# the native API
# ------------------------------------------------------------------------------------------


def test_translate_list_and_one_string(static_server, solo):
    answer = static_server.client.post("/v1/translate", json={"text": DEMO_SOURCES})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["model"] == "demo"
    assert [t["text"] for t in body["translations"]] == [str(solo(s)) for s in DEMO_SOURCES]
    one = static_server.client.post("/v1/translate", json={"text": "forty-two"}).json()
    assert one["translations"] == [{"text": "zweiundvierzig"}]


def test_translate_beam_n_best_and_scores(static_server, solo):
    answer = static_server.client.post(
        "/v1/translate", json={"text": "seven", "beam_size": 4, "num_hypotheses": 3, "return_scores": True}
    )
    assert answer.status_code == 200, answer.text
    (item,) = answer.json()["translations"]
    expected = solo("seven", beam_size=4, n_best=3)
    assert [h["text"] for h in item["hypotheses"]] == expected.texts
    assert [h["score"] for h in item["hypotheses"]] == pytest.approx(
        [h.score for h in expected.hypotheses], abs=1e-5
    )
    assert item["text"] == expected.texts[0] and item["score"] == pytest.approx(expected.score, abs=1e-5)


def test_stream_is_one_ndjson_line_per_source_then_done(static_server, solo):
    with static_server.client.stream("POST", "/v1/translate/stream", json={"text": DEMO_SOURCES}) as answer:
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in answer.iter_lines() if line]
    assert lines[-1] == {"done": True, "model": "demo"}
    got = {line["index"]: line["text"] for line in lines[:-1]}
    assert got == {i: str(solo(s)) for i, s in enumerate(DEMO_SOURCES)}


def test_models_lists_the_model_and_its_defaults(static_server):
    body = static_server.client.get("/v1/models").json()
    (model,) = body["models"]
    assert model["name"] == "demo" and model["kind"] == "model" and model["pair"] == ["en", "de"]
    assert model["defaults"]["beam_size"] == 1 and model["batching"] == "static"
    assert static_server.client.get("/openapi.json").json()["paths"]["/v1/translate"]["post"]


# ------------------------------------------------------------------------------------------
# LibreTranslate
# ------------------------------------------------------------------------------------------


def test_libretranslate_json_form_and_list(static_server, solo):
    client = static_server.client
    answer = client.post(
        "/translate", json={"q": "forty-two", "source": "en", "target": "de", "format": "text"}
    )
    assert answer.status_code == 200 and answer.json() == {"translatedText": "zweiundvierzig"}
    form = client.post("/translate", data={"q": "seven", "source": "en", "target": "de"})
    assert form.status_code == 200 and form.json() == {"translatedText": str(solo("seven"))}
    many = client.post("/translate", json={"q": DEMO_SOURCES[:2], "source": "en", "target": "de"}).json()
    assert many == {"translatedText": [str(solo(s)) for s in DEMO_SOURCES[:2]]}
    auto = client.post("/translate", json={"q": "seven", "source": "auto", "target": "de"}).json()
    assert auto["detectedLanguage"]["language"] == "en"
    alts = client.post(
        "/translate", json={"q": "seven", "source": "en", "target": "de", "alternatives": 2}
    ).json()
    expected = solo("seven", beam_size=3, n_best=3)
    assert alts == {"translatedText": expected.texts[0], "alternatives": expected.texts[1:]}


def test_an_existing_libretranslate_client_works_unchanged(static_server, solo):
    libretranslatepy = pytest.importorskip("libretranslatepy")
    client = libretranslatepy.LibreTranslateAPI(static_server.url)
    assert client.translate("forty-two", "en", "de") == "zweiundvierzig"
    assert client.translate("seven", "en", "de") == str(solo("seven"))
    assert client.languages() == [{"code": "en", "name": "en", "targets": ["de"]}]


def test_libretranslate_languages_and_errors(static_server):
    client = static_server.client
    assert client.get("/languages").json() == [{"code": "en", "name": "en", "targets": ["de"]}]
    wrong = client.post("/translate", json={"q": "seven", "source": "fr", "target": "de"})
    assert (
        wrong.status_code == 400 and "source" in wrong.json()["error"] and "en to de" in wrong.json()["error"]
    )
    missing = client.post("/translate", json={"source": "en", "target": "de"})
    assert missing.status_code == 400 and missing.json()["error"] == "Invalid request: missing q parameter"
    html = client.post("/translate", json={"q": "seven", "source": "en", "target": "de", "format": "html"})
    assert html.status_code == 400 and "format" in html.json()["error"]


# ------------------------------------------------------------------------------------------
# bad input
# ------------------------------------------------------------------------------------------

BAD_BODIES = [  # (raw body, the field the error must name)
    (b'{"text": "fo', "body"),
    (b"[1, 2]", "body"),
    (b'{"text": 5}', "text"),
    (b'{"text": ["seven", 5]}', "text[1]"),
    (b'{"text": []}', "text"),
    (b'{"text": "seven", "model": "nope"}', "model"),
    (b'{"text": "seven", "beam_size": 0}', "beam_size"),
    (b'{"text": "seven", "beam_size": "4"}', "beam_size"),
    (b'{"text": "seven", "sampling_temperature": -1}', "sampling_temperature"),
    (b'{"text": "seven", "beam_size": 2, "num_hypotheses": 3}', "num_hypotheses"),
    (b'{"text": "seven", "bogus": 1}', "bogus"),
    (b'{"text": ["seven", "x\\u00e9"]}', "text[1]"),
    (b'{"text": "' + b"seven " * 20 + b'"}', "text"),
    (b'{"text": ""}', "text"),
    (b'{"text": ["seven"], "target_prefix": ["a", "b"]}', "target_prefix"),
    (b'{"text": ' + json.dumps(["seven"] * 9).encode() + b"}", "text"),
    (b'{"text": "seven", "tokens": true, "beam_size": 2}', "tokens"),
]


@pytest.mark.parametrize("route", ["/v1/translate", "/v1/translate/stream"])
@pytest.mark.parametrize("raw, field", BAD_BODIES)
def test_bad_input_is_a_400_naming_the_field(static_server, route, raw, field):
    answer = static_server.client.post(route, content=raw, headers={"content-type": "application/json"})
    assert answer.status_code == 400, answer.text
    body = answer.json()
    assert body["field"] == field and body["error"].startswith(field), body
    assert "Traceback" not in answer.text


def test_a_10_mb_body_is_413_and_unknown_routes_404(static_server):
    big = b'{"text": "' + b"a" * (10 << 20) + b'"}'
    answer = static_server.client.post("/v1/translate", content=big)
    assert answer.status_code == 413 and answer.json()["field"] == "body"
    assert static_server.client.get("/nope").status_code == 404
    assert static_server.client.get("/v1/translate").status_code == 405


def test_good_requests_work_after_1000_bad_ones(static_server):
    bodies = [raw for raw, _ in BAD_BODIES]
    with ThreadPoolExecutor(8) as pool:
        statuses = list(
            pool.map(
                lambda i: (
                    static_server.client.post("/v1/translate", content=bodies[i % len(bodies)]).status_code
                ),
                range(1000),
            )
        )
    assert set(statuses) == {400}
    good = static_server.client.post("/v1/translate", json={"text": "forty-two"})
    assert good.status_code == 200 and good.json()["translations"] == [{"text": "zweiundvierzig"}]
    assert static_server.metric("translate_request_errors_total", route="/v1/translate", status="400") >= 1000


def test_metrics(static_server):
    client = static_server.client
    before = static_server.metric("translate_generated_tokens_total", model="demo")
    assert client.post("/v1/translate", json={"text": "forty-two"}).status_code == 200
    assert static_server.metric("translate_generated_tokens_total", model="demo") >= before + len(
        "zweiundvierzig"
    )
    assert static_server.metric("translate_requests_total", route="/v1/translate", status="200") >= 1
    assert static_server.metric("translate_batch_rows_count", model="demo") >= 1
    assert static_server.metric("translate_request_duration_seconds_count", route="/v1/translate") >= 1
    text = client.get("/metrics").text
    assert 'translate_queue_depth{model="demo"}' in text and "translate_requests_in_flight" in text
    assert client.get("/healthz").json() == {"status": "ok"}


# ------------------------------------------------------------------------------------------
# limits and faults
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def held_server():
    """Static batching that holds each batch open for 2 s (requests wait there deterministically)
    with a 1 s request timeout."""
    server = Server("--batching", "static", "--batch-wait", "2", "--request-timeout", "1")
    yield server
    assert server.stop() == 0, "".join(server.log[-20:])


def _wait_for(predicate, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.02)


def test_request_timeout_answers_504_and_its_source_is_not_run(held_server):
    before = held_server.metric("translate_batch_sources_sum", model="demo")
    cancelled = held_server.metric("translate_cancelled_sources_total", model="demo", reason="timeout")
    answer = held_server.client.post("/v1/translate", json={"text": "seven"})
    assert answer.status_code == 504 and "timeout" in answer.json()["error"]
    _wait_for(
        lambda: (
            held_server.metric("translate_cancelled_sources_total", model="demo", reason="timeout")
            == cancelled + 1
        ),
        "the timed-out source leaves",
    )
    assert held_server.metric("translate_batch_sources_sum", model="demo") == before  # nothing was run for it


def test_client_disconnect_cancels_its_work(held_server):
    before = held_server.metric("translate_batch_sources_sum", model="demo")
    cancelled = held_server.metric("translate_cancelled_sources_total", model="demo", reason="disconnect")
    with pytest.raises(httpx.ReadTimeout):
        held_server.client.post("/v1/translate", json={"text": "seven"}, timeout=0.3)
    _wait_for(
        lambda: held_server.metric("translate_requests_total", route="/v1/translate", status="499") >= 1,
        "the disconnect is recorded",
    )
    _wait_for(
        lambda: (
            held_server.metric("translate_cancelled_sources_total", model="demo", reason="disconnect")
            == cancelled + 1
        ),
        "the source of the client that left leaves",
    )
    assert held_server.metric("translate_batch_sources_sum", model="demo") == before  # nothing was run for it


def test_a_stream_whose_client_leaves_cancels_its_work(held_server):
    before = held_server.metric("translate_batch_sources_sum", model="demo")
    cancelled = held_server.metric("translate_cancelled_sources_total", model="demo", reason="disconnect")
    with httpx.Client(base_url=held_server.url, timeout=30) as client:
        with client.stream("POST", "/v1/translate/stream", json={"text": ["seven", "eight"]}) as answer:
            assert answer.status_code == 200  # the headers came; the client leaves before any line
    _wait_for(
        lambda: (
            held_server.metric("translate_cancelled_sources_total", model="demo", reason="disconnect")
            == cancelled + 2
        ),
        "the stream's sources leave",
    )
    assert held_server.metric("translate_batch_sources_sum", model="demo") == before


def test_a_full_queue_answers_429_with_retry_after(demo_translator):
    server = Server("--batching", "none", "--max-queue", "1", "--max-sources", "1")
    try:
        body = {"text": "three hundred and seventy-seven", "beam_size": 8}
        with ThreadPoolExecutor(12) as pool:
            answers = list(pool.map(lambda _: server.client.post("/v1/translate", json=body), range(12)))
        statuses = [a.status_code for a in answers]
        assert set(statuses) <= {200, 429} and 429 in statuses and 200 in statuses, statuses
        expected = str(demo_translator.translate([body["text"]], beam_size=8)[0])
        for answer in answers:
            if answer.status_code == 429:
                assert int(answer.headers["retry-after"]) >= 1 and "queue is full" in answer.json()["error"]
            else:
                assert answer.json()["translations"] == [{"text": expected}]
    finally:
        assert server.stop() == 0


SLOW_STARTUP = """
import time
from transformer_ext.serve import server as _server
_startup = _server.DrainingServer.startup
async def _slow_startup(self, sockets=None):
    time.sleep(2)
    await _startup(self, sockets)
_server.DrainingServer.startup = _slow_startup
"""


def test_the_logged_address_accepts_connections_while_the_server_still_starts():
    """A client (a load balancer's probe) that connects as soon as the "serving ... on" line is
    logged is queued, not refused, even when the server's startup takes a while; ``Server``
    requests /readyz at once."""
    server = Server(python_prelude=SLOW_STARTUP)
    try:
        assert server.client.get("/readyz").status_code == 200
    finally:
        assert server.stop() == 0


def test_sigterm_drains_accepted_work_and_exits_0_without_torch(tmp_path_factory):
    """An export folder served with torch unimportable; SIGTERM while a request waits: readyz
    503, new work 503, the accepted request answered in full, exit code 0."""
    from helpers import exported_dir

    export = exported_dir(tmp_path_factory, "portable")
    oracle = Translator.from_export_dir(export)
    sources = ["hello world", "abc"]
    server = Server(
        "--model",
        f"tiny={export}",
        "--batching",
        "static",
        "--batch-wait",
        "4",
        python_prelude="import sys; sys.modules['torch'] = None",
    )
    try:
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(server.client.post, "/v1/translate", json={"text": sources})
            _wait_for(lambda: server.metric("translate_requests_in_flight") == 1, "the request is accepted")
            server.proc.send_signal(signal.SIGTERM)
            _wait_for(lambda: server.client.get("/readyz").status_code == 503, "readyz says draining")
            late = server.client.post("/v1/translate", json={"text": "abc"})
            assert late.status_code == 503 and "Retry-After" in late.headers
            answer = pending.result(timeout=120)
        assert answer.status_code == 200, answer.text
        assert [t["text"] for t in answer.json()["translations"]] == [
            str(oracle.translate([s])[0]) for s in sources
        ]
        assert server.proc.wait(60) == 0, "".join(server.log[-30:])
        assert not any("Traceback" in line for line in server.log), "".join(server.log)
    finally:
        server.stop()


def test_an_idle_keep_alive_connection_outlives_client_pool_expiry():
    """A pooled connection idle for 6 s is still open: clients reuse theirs for at least 5 s
    (httpx's pool expiry; requests keeps them until they close), and a server that closes an idle
    connection first races such a client's next request, which meets a reset instead of an answer."""
    import http.client
    from urllib.parse import urlsplit

    server = Server()
    url = urlsplit(server.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    try:
        body, headers = json.dumps({"text": "seven"}), {"Content-Type": "application/json"}
        conn.request("POST", "/v1/translate", body, headers)
        assert conn.getresponse().read()
        sock = conn.sock
        time.sleep(6)
        conn.request("POST", "/v1/translate", body, headers)  # on the same connection
        answer = conn.getresponse()
        assert conn.sock is sock and answer.status == 200, answer.status
        assert json.loads(answer.read())["translations"] == [{"text": "sieben"}]
    finally:
        conn.close()
        assert server.stop() == 0


def test_work_left_at_the_drain_timeout_answers_503_and_the_server_exits_0():
    server = Server("--batching", "static", "--batch-wait", "5", "--drain-timeout", "0.5")
    try:
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(server.client.post, "/v1/translate", json={"text": "seven"})
            _wait_for(lambda: server.metric("translate_requests_in_flight") == 1, "the request is accepted")
            server.proc.send_signal(signal.SIGTERM)
            answer = pending.result(timeout=120)
        assert answer.status_code == 503 and "drain timeout" in answer.json()["error"], answer.text
        assert server.proc.wait(60) == 0, "".join(server.log[-30:])
    finally:
        server.stop()


class _PoisonedRunner:
    """A runner that fails on any batch holding the token ``poison`` (a model run that raises)."""

    def __init__(self, runner, poison: int):
        self._runner = runner
        self._poison = poison

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def encode(self, input_ids, *args, **kwargs):
        import numpy as np

        if (np.asarray(input_ids) == self._poison).any():
            raise RuntimeError("the model run failed")
        return self._runner.encode(input_ids, *args, **kwargs)


def test_a_failing_model_run_answers_500_for_its_batch_only(demo_translator):
    import socket

    import uvicorn

    from transformer_ext.serve import ServeConfig, ServedModel, create_app

    base = demo_translator
    poison = base.tokenizer.encode_source("z")[0]
    translator = Translator(base.tokenizer, _PoisonedRunner(base.runner, poison))
    model = ServedModel("demo", Path("."), translator, "model")
    app = create_app([model], ServeConfig(batching="none"))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        url = "http://127.0.0.1:%d" % sock.getsockname()[1]
        with httpx.Client(base_url=url, timeout=120) as client:
            _wait_for(
                lambda: client.get("/healthz").status_code == 200 if server.started else False, "started"
            )
            with ThreadPoolExecutor(4) as pool:
                bodies = [{"text": "zero"}, {"text": "forty-two"}, {"text": "zero"}, {"text": "seven"}]
                answers = list(pool.map(lambda b: client.post("/v1/translate", json=b), bodies))
            assert [a.status_code for a in answers] == [500, 200, 500, 200]
            assert "the model failed" in answers[0].json()["error"] and "Traceback" not in answers[0].text
            assert answers[1].json()["translations"] == [{"text": "zweiundvierzig"}]
            after = client.post("/translate", json={"q": "forty-two", "source": "en", "target": "de"})
            assert after.json() == {"translatedText": "zweiundvierzig"}
    finally:
        server.should_exit = True
        thread.join(30)


# ------------------------------------------------------------------------------------------
# continuous batching: the scheduler against the step-wise search state's contract
# ------------------------------------------------------------------------------------------


class _ContractState:
    """A search state with the step-wise contract's interface (admit / step / cancel / partial /
    num_rows / num_sources / empty) whose sources produce, one token a step, the hypotheses
    ``Translator.translate`` gives each alone: the scheduler's routing, admission bounds,
    leaving and token streaming are what is tested here, not the search. The requests carry the
    decoding package's real ``SearchOptions`` (their fields and checks)."""

    log: list = []

    def __init__(self, runner, *, solo, **model_ids):
        self.solo = solo
        self.open: dict = {}
        _ContractState.log.append(("new", model_ids))

    def admit(self, requests):
        for r in requests:
            hyps = self.solo(tuple(int(t) for t in r.input_ids), r.options, r.target_prefix)
            self.open[r.key] = [hyps, 0, r.options.beam_size]
        _ContractState.log.append(("admit", len(requests), self.num_rows))

    def step(self):
        done = []
        for key, entry in list(self.open.items()):
            entry[1] += 1
            if entry[1] > len(entry[0][0].tokens):  # its EOS step
                done.append((key, entry[0]))
                del self.open[key]
        _ContractState.log.append(("step", self.num_rows + sum(1 for _ in done)))
        return done

    def cancel(self, key):
        self.open.pop(key, None)
        _ContractState.log.append(("cancel", key))

    def partial(self, key):
        hyps, progress, _ = self.open[key]
        return hyps[0].tokens[:progress]

    @property
    def num_rows(self):
        return sum(e[2] for e in self.open.values())

    @property
    def num_sources(self):
        return len(self.open)

    @property
    def empty(self):
        return not self.open


def _contract_api(translator):
    from dataclasses import dataclass
    from typing import Any

    from transformer_ext.decoding import SearchOptions as Options  # the real options record

    @dataclass
    class Request:
        input_ids: Any
        options: Options
        target_prefix: Any
        key: Any
        index: int

    texts = {}

    def solo(ids, options, prefix):
        text = texts[ids]
        return translator.translate([text], beam_size=options.beam_size, n_best=options.num_hypotheses)[
            0
        ].hypotheses

    def state(runner, **kwargs):
        return _ContractState(runner, solo=solo, **kwargs)

    return (Options, state, Request), texts


def test_continuous_scheduler_admits_between_steps_within_the_row_limit(solo, demo_translator):
    import socket

    import uvicorn

    from transformer_ext.serve import ServeConfig, ServedModel, create_app
    from transformer_ext.serve.continuous import ContinuousScheduler

    sources = DEMO_SOURCES + ["eight hundred and five", "ninety-nine"]
    api, texts = _contract_api(demo_translator)
    for s in sources:
        texts[tuple(demo_translator.tokenizer.encode_source(s))] = s
    model = ServedModel("demo", Path("."), demo_translator, "model")
    config = ServeConfig(batching="continuous", max_batch_rows=3)

    def factory(m, c, metrics):
        return ContinuousScheduler(
            m,
            api=api,
            max_queue=c.max_queue,
            max_batch_rows=c.max_batch_rows,
            max_batch_tokens=c.max_batch_tokens,
            metrics=metrics,
        )

    app = create_app([model], config, scheduler_factory=factory)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    _ContractState.log.clear()
    try:
        url = "http://127.0.0.1:%d" % sock.getsockname()[1]
        with httpx.Client(base_url=url, timeout=120) as client:
            _wait_for(lambda: server.started, "started")
            bodies = [{"text": s} for s in sources] + [{"text": "seven", "beam_size": 2, "num_hypotheses": 2}]
            with ThreadPoolExecutor(len(bodies)) as pool:
                answers = list(pool.map(lambda b: client.post("/v1/translate", json=b), bodies))
            for body, answer in zip(bodies, answers):
                assert answer.status_code == 200, answer.text
                expected = demo_translator.translate(
                    [body["text"]], beam_size=body.get("beam_size", 1), n_best=body.get("num_hypotheses", 1)
                )[0]
                got = answer.json()["translations"][0]
                assert got["text"] == expected.texts[0]
                if "num_hypotheses" in body:
                    assert [h["text"] for h in got["hypotheses"]] == expected.texts
            with client.stream(
                "POST", "/v1/translate/stream", json={"text": "one thousand and one", "tokens": True}
            ) as answer:
                events = [json.loads(line) for line in answer.iter_lines() if line]
        admits = [e for e in _ContractState.log if e[0] == "admit"]
        steps = [e for e in _ContractState.log if e[0] == "step"]
        assert all(rows <= 3 for _, _, rows in admits) and all(rows <= 3 for _, rows in steps)
        joined = [
            i
            for i, e in enumerate(_ContractState.log)
            if e[0] == "admit" and i > 0 and _ContractState.log[i - 1][0] == "step"
        ]
        assert joined, "no source joined a running batch"
        tokens = [e["tokens"] for e in events if "tokens" in e]
        final = [e for e in events if "text" in e and "tokens" not in e]
        expected = solo("one thousand and one")
        assert (
            tokens
            and all(a == b[: len(a)] for a, b in zip(tokens, tokens[1:]))
            and tokens[-1] == expected.tokens[: len(tokens[-1])]
        )
        assert final == [{"index": 0, "text": str(expected)}] and events[-1]["done"]
    finally:
        server.should_exit = True
        thread.join(30)


def test_continuous_scheduler_admits_every_waiting_job_that_fits_in_one_admission(demo_translator):
    """Jobs waiting between two steps join in one admission (one encoder run for the sources
    of one search setting), up to the row limit; the rest wait for the next step."""
    import asyncio

    from transformer_ext.serve import ServedModel
    from transformer_ext.serve.continuous import ContinuousScheduler
    from transformer_ext.serve.scheduler import Job

    api, texts = _contract_api(demo_translator)
    encoded = {s: demo_translator.tokenizer.encode_source(s) for s in DEMO_SOURCES}
    for s, ids in encoded.items():
        texts[tuple(ids)] = s
    model = ServedModel("demo", Path("."), demo_translator, "model")
    scheduler = ContinuousScheduler(model, api=api, max_queue=64, max_batch_rows=3, max_batch_tokens=10_000)
    loop = asyncio.new_event_loop()
    try:
        for s in DEMO_SOURCES:
            scheduler.submit(Job(demo_translator, [s], {}, [None], [len(encoded[s])], loop, lambda *a: None))
        _ContractState.log.clear()
        scheduler._admit()
        assert [e for e in _ContractState.log if e[0] == "admit"] == [("admit", 3, 3)]
        assert scheduler.waiting == 1
        scheduler._admit()  # the fourth does not fit while the three are open
        assert [e for e in _ContractState.log if e[0] == "admit"] == [("admit", 3, 3)]
    finally:
        loop.close()


# ------------------------------------------------------------------------------------------
# a multilingual model: each request names its pair
# ------------------------------------------------------------------------------------------


def test_m2m100_requests_of_different_target_languages(tmp_path_factory):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from hf_checkpoints import sample_lines, write_m2m100

    from transformer_ext.convert import convert_transformers

    root = tmp_path_factory.mktemp("serve_m2m100")
    folder = convert_transformers(write_m2m100(root / "hf", seed=3), root / "m2m100")
    sources = sample_lines(3, seed=11)
    targets = ["de", "fr", "es"]
    oracle = {t: Translator.from_model_dir(folder, source_lang="en", target_lang=t) for t in targets}
    server = Server("--model", f"m2m={folder}", "--batching", "static")
    try:
        bodies = [{"text": s, "source_lang": "en", "target_lang": t} for s in sources for t in targets]
        with ThreadPoolExecutor(len(bodies)) as pool:
            answers = list(pool.map(lambda b: server.client.post("/v1/translate", json=b), bodies))
        for body, answer in zip(bodies, answers):
            assert answer.status_code == 200, answer.text
            expected = oracle[body["target_lang"]].translate([body["text"]])[0]
            assert answer.json()["translations"] == [{"text": str(expected)}]
        libre = server.client.post("/translate", json={"q": sources[0], "source": "en", "target": "fr"})
        assert libre.json() == {"translatedText": str(oracle["fr"].translate([sources[0]])[0])}
        unknown = server.client.post("/v1/translate", json={"text": sources[0], "target_lang": "xx"})
        assert unknown.status_code == 400 and unknown.json()["field"] == "target_lang"
        assert "'xx'" in unknown.json()["error"] and "de" in unknown.json()["error"]
        models = server.client.get("/v1/models").json()["models"][0]
        assert "fr" in models["languages"] and models["pair"] is None
        languages = {entry["code"]: entry["targets"] for entry in server.client.get("/languages").json()}
        assert "fr" in languages["en"] and "en" not in languages["en"]
    finally:
        assert server.stop() == 0


# ------------------------------------------------------------------------------------------
# the command line
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-sources", "10", "--max-queue", "5"], "--max-sources (10) cannot exceed --max-queue (5)"),
        (["--model", "a=b=c"], "no such folder"),
        (["--languages", "english"], "expected SRC-TGT"),
        (["--port", "70000"], "0-65535"),
    ],
)
def test_command_line_errors_are_one_line(args, message):
    answer = subprocess.run(
        [sys.executable, "-m", "transformer_ext.serve", *args],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        cwd=REPO,
        timeout=120,
    )
    assert answer.returncode in (1, 2) and message in answer.stderr, answer.stderr
    assert "Traceback" not in answer.stderr


# ------------------------------------------------------------------------------------------
# continuous batching on the real step-wise search state
# ------------------------------------------------------------------------------------------


def _require_stepwise():
    from transformer_ext.serve.continuous import StepwiseUnavailable, stepwise_api

    try:
        stepwise_api()
    except StepwiseUnavailable as exc:
        pytest.skip(str(exc))


def test_continuous_batching_gives_each_source_its_solo_result(solo, tmp_path_factory):
    """Sources of concurrent requests with different options share the running batch (at most
    6 rows: later ones join between steps); each result is its translation alone."""
    _require_stepwise()
    server = Server("--batching", "continuous", "--max-batch-rows", "6")
    try:
        cases = [
            ({"text": s}, {}) for s in DEMO_SOURCES + ["eight hundred and five", "ninety-nine", "twelve"]
        ] + [
            ({"text": "seven", "beam_size": 4, "num_hypotheses": 2}, {"beam_size": 4, "n_best": 2}),
            ({"text": "forty-two", "beam_size": 3}, {"beam_size": 3}),
            (
                {"text": "one thousand and one", "sampling_topk": 5, "seed": 7},
                {"sampling_topk": 5, "seed": 7},
            ),
            ({"text": "six", "target_prefix": "sech"}, {"target_prefix": "sech"}),
        ]
        with ThreadPoolExecutor(len(cases)) as pool:
            answers = list(pool.map(lambda c: server.client.post("/v1/translate", json=c[0]), cases))
        for (body, options), answer in zip(cases, answers):
            assert answer.status_code == 200, answer.text
            expected = solo(body["text"], **options)
            got = answer.json()["translations"][0]
            assert got["text"] == expected.texts[0], body
            if "num_hypotheses" in body:
                assert [h["text"] for h in got["hypotheses"]] == expected.texts
        assert server.metric("translate_batch_rows_count", model="demo") >= 1
    finally:
        assert server.stop() == 0


def test_continuous_batching_mixes_m2m100_language_pairs(tmp_path_factory):
    _require_stepwise()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from hf_checkpoints import sample_lines, write_m2m100

    from transformer_ext.convert import convert_transformers

    root = tmp_path_factory.mktemp("serve_m2m100_continuous")
    folder = convert_transformers(write_m2m100(root / "hf", seed=3), root / "m2m100")
    sources = sample_lines(3, seed=11)
    targets = ["de", "fr", "es"]
    oracle = {t: Translator.from_model_dir(folder, source_lang="en", target_lang=t) for t in targets}
    server = Server("--model", f"m2m={folder}", "--batching", "continuous")
    try:
        bodies = [{"text": s, "source_lang": "en", "target_lang": t} for s in sources for t in targets]
        with ThreadPoolExecutor(len(bodies)) as pool:
            answers = list(pool.map(lambda b: server.client.post("/v1/translate", json=b), bodies))
        for body, answer in zip(bodies, answers):
            assert answer.status_code == 200, answer.text
            assert answer.json()["translations"] == [
                {"text": str(oracle[body["target_lang"]].translate([body["text"]])[0])}
            ]
    finally:
        assert server.stop() == 0


# ------------------------------------------------------------------------------------------
# the benchmark's smoke run
# ------------------------------------------------------------------------------------------


def test_bench_serve_smoke_run_writes_json_and_plot(tmp_path):
    out = tmp_path / "bench_serve.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks",
            "bench_serve",
            "--quick",
            "--latency-sentences",
            "2",
            "--clients",
            "1,2",
            "--requests",
            "2",
            "--lines",
            "4",
            "--modes",
            "none,ctranslate2",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        cwd=REPO,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    payload = json.loads(out.read_text())
    rows = payload["modes"]["none"]
    assert [r["clients"] for r in rows] == [1, 2] and [r["requests"] for r in rows] == [2, 4]
    assert all(r["statuses"] == {"200": r["requests"]} and r["wrong_200_answers"] == 0 for r in rows)
    assert (
        payload["offline_translate_iterable"]["sentences_per_s"] > 0
        and "load_average_before" in payload["machine"]
    )
    assert "ctranslate2" in payload["modes"] or "ctranslate2" in payload["skipped"]
    assert (tmp_path / "bench_serve.png").stat().st_size > 0
