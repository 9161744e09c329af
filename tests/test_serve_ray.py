"""Ray Serve: two replicas of the demo model's export on a local Ray instance, through Ray Serve's proxy.

``bash scripts/test_ray.sh`` runs this module (CI does, .ci/run): it builds the torch-free Ray
environment ``.venv-ray`` (requirements/ray-test.txt; Ray needs a newer protobuf than
requirements/dev.txt pins), exports the demo model with the development environment and names
the export in ``TRANSFORMER_EXT_RAY_EXPORT``. With that variable set nothing here is skipped.
Without it (the development environment, which has no ray) the module is skipped where ray is
not installed, and exports the demo model itself where it is.
"""

from __future__ import annotations

import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

EXPORT_ENV = "TRANSFORMER_EXT_RAY_EXPORT"

if os.environ.get(EXPORT_ENV):  # scripts/test_ray.sh: a missing package fails, never skips
    import httpx
    import ray
    from ray import serve
else:
    ray = pytest.importorskip("ray")
    serve = pytest.importorskip("ray.serve")
    httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.slow

APP = "translate"
SOURCES = [
    "forty-two",
    "seven",
    "one thousand and one",
    "three hundred and twelve",
    "ninety-nine",
    "eighteen",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _processes_under(root: int) -> dict[int, tuple[str, str]]:
    """``pid -> (start time, command line)`` of every live process descending from ``root`` (Linux
    /proc; Ray names its worker processes ``ray::...`` in their command lines)."""
    parent: dict[int, int] = {}
    info: dict[int, tuple[str, str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] == "Z":  # exited, not yet reaped
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
        except OSError:
            continue
        parent[int(entry)] = int(fields[1])
        info[int(entry)] = (fields[19], command)
    found: dict[int, tuple[str, str]] = {}
    frontier = [root]
    while frontier:
        pid = frontier.pop()
        for child, ppid in parent.items():
            if ppid == pid and child not in found:
                found[child] = info[child]
                frontier.append(child)
    return found


def _still_running(processes: dict[int, tuple[str, str]]) -> dict[int, str]:
    """Those of ``processes`` that still run (the same pid with the same start time)."""
    alive = {}
    for pid, (start, command) in processes.items():
        try:
            with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z" and fields[19] == start:
            alive[pid] = command
    return alive


@pytest.fixture(scope="module")
def demo_export(tmp_path_factory) -> Path:
    """The demo model's ONNX export: scripts/test_ray.sh's, else exported here (needs torch)."""
    named = os.environ.get(EXPORT_ENV)
    if named:
        return Path(named)
    pytest.importorskip("torch")
    from export.onnx import export_onnx

    out = tmp_path_factory.mktemp("ray") / "demo-onnx"
    export_onnx(None, out, validate=False)
    return out


class Cluster:
    """The local Ray instance, its Serve application and an HTTP client to Ray Serve's proxy."""

    def __init__(self, export: Path):
        from transformer_ext.serve.ray import app_builder

        self.port = _free_port()
        # address="local": a Ray instance of its own, never one that runs on this machine already
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": self.port})
        # app_builder: what `serve run transformer_ext.serve.ray:app_builder KEY=VALUE...` calls
        args = {"models": f"demo={export}", "num_replicas": "2", "languages": "en-de", "threads": "1"}
        serve.run(app_builder(args), route_prefix="/", name=APP)
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=120)
        deadline = time.monotonic() + 300
        while True:
            try:
                if self.client.get("/readyz").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the deployment never became ready"
            time.sleep(0.2)

    def shutdown(self) -> None:
        """Serve's applications and the Ray instance stopped (again: nothing happens)."""
        self.client.close()
        if ray.is_initialized():
            try:
                serve.shutdown()
            finally:
                ray.shutdown()


@pytest.fixture(scope="module")
def cluster(demo_export):
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    started = None
    try:
        started = Cluster(demo_export)
        yield started
    finally:
        if started is not None:
            started.shutdown()
        elif ray.is_initialized():
            ray.shutdown()


@pytest.fixture(scope="module")
def oracle(demo_export):
    """The torch-free Translator on the same export, in this process (no Ray)."""
    from transformer_ext.translator import Translator

    translator = Translator.from_export_dir(demo_export)
    return {source: str(translator.translate([source])[0]) for source in SOURCES}


def test_two_replicas_answer_with_the_translators_translations(cluster, oracle):
    status = serve.status().applications[APP]
    (deployment,) = status.deployments.values()
    assert deployment.replica_states.get("RUNNING") == 2, deployment.replica_states
    # the demo model's own answers (scripts/check_wheel.sh), so that the oracle is not vacuous
    assert oracle["forty-two"] == "zweiundvierzig" and oracle["one thousand and one"] == "eintausendeins"

    def ask(source):
        answer = cluster.client.post("/v1/translate", json={"text": source})
        return source, answer

    replicas = set()
    with ThreadPoolExecutor(4) as pool:
        for source, answer in pool.map(ask, SOURCES * 4):
            assert answer.status_code == 200, answer.text
            assert answer.json() == {"model": "demo", "translations": [{"text": oracle[source]}]}
            replicas.add(answer.headers["x-serve-replica"])
    assert len(replicas) == 2, f"every answer came from {replicas}: the proxy used one replica"


def test_the_server_api_through_the_proxy(cluster, oracle):
    ready = cluster.client.get("/readyz")
    assert ready.status_code == 200 and ready.json() == {"status": "ready", "models": ["demo"]}
    assert cluster.client.get("/healthz").json() == {"status": "ok"}
    (model,) = cluster.client.get("/v1/models").json()["models"]
    # the server's default batching (python -m transformer_ext.serve without --batching)
    assert model["name"] == "demo" and model["kind"] == "export" and model["batching"] == "continuous", model
    with cluster.client.stream("POST", "/v1/translate/stream", json={"text": SOURCES[:3]}) as answer:
        lines = [line for line in answer.iter_lines() if line]
    assert answer.status_code == 200
    assert lines[-1] == '{"done": true, "model": "demo"}' and len(lines) == 4
    bad = cluster.client.post("/v1/translate", json={"text": "seven", "beam_size": 0})
    assert bad.status_code == 400 and bad.json()["field"] == "beam_size"
    assert "translate_requests_total" in cluster.client.get("/metrics").text


def test_libretranslate_api_through_the_proxy(cluster, oracle):
    libre = cluster.client.post("/translate", json={"q": SOURCES[:2], "source": "en", "target": "de"})
    assert libre.status_code == 200, libre.text
    assert libre.json() == {"translatedText": [oracle[s] for s in SOURCES[:2]]}
    one = cluster.client.post("/translate", json={"q": "seven", "source": "en", "target": "de"})
    assert one.json() == {"translatedText": oracle["seven"]}
    assert cluster.client.get("/languages").json() == [{"code": "en", "name": "en", "targets": ["de"]}]
    wrong = cluster.client.post("/translate", json={"q": "seven", "source": "fr", "target": "de"})
    assert wrong.status_code == 400 and "error" in wrong.json()


def test_shutdown_stops_every_ray_process(cluster):
    """serve.shutdown() then ray.shutdown(): no raylet, replica or other Ray process stays behind."""
    started = _processes_under(os.getpid())
    commands = [command for _, command in started.values()]
    assert any(os.path.basename(command.split(" ")[0]) == "raylet" for command in commands), commands
    assert sum("ServeReplica" in command for command in commands) == 2, commands
    cluster.shutdown()
    assert not ray.is_initialized()
    deadline = time.monotonic() + 60
    while (left := _still_running(started)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"Ray processes still running after ray.shutdown(): {left}"
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{cluster.port}/readyz", timeout=5)


@pytest.mark.parametrize(
    "args, message",
    [
        ({"num_replicas": "0"}, "num_replicas must be a positive integer"),
        ({"num_replicas": "two"}, "num_replicas='two'"),
        ({"max_queue": "many"}, "max_queue='many': expected a number"),
        ({"max_qeue": "8"}, "unknown option max_qeue"),
        ({"num_replicas": 2, "autoscaling_config": {"max_replicas": 4}}, "exclude each other"),
        ({"autoscaling_config": "4"}, "autoscaling_config='4': expected a mapping"),
        ({"languages": "en"}, "expected SRC-TGT"),
        ({"models": ["demo", 3]}, "expected comma-separated text or a list of strings"),
    ],
)
def test_app_builder_checks_its_arguments_before_deploying(args, message):
    from transformer_ext.cli import UsageError
    from transformer_ext.serve.ray import app_builder

    with pytest.raises(UsageError, match=message):
        app_builder(args)


def test_app_builder_names_a_missing_model_folder(tmp_path):
    from transformer_ext.serve.ray import app_builder

    with pytest.raises(FileNotFoundError, match="missing"):
        app_builder({"models": f"x={tmp_path / 'missing'}"})


def test_the_documented_serve_config_is_one_ray_serve_accepts(demo_export):
    """docs/serving.md's Serve config file: valid for Ray Serve, and its args build the app."""
    import re

    import yaml
    from ray.serve.schema import ServeDeploySchema

    from transformer_ext.serve.ray import app_builder

    text = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text(encoding="utf-8")
    (block,) = re.findall(r"```yaml\n(.*?)```", text, re.S)
    config = yaml.safe_load(block)
    ServeDeploySchema.model_validate(config)
    (application,) = config["applications"]
    assert application["import_path"] == "transformer_ext.serve.ray:app_builder"
    args = dict(application["args"], models=[f"demo={demo_export}"])
    app_builder(args)  # Ray Serve's deployment options (autoscaling, actor options) accepted
