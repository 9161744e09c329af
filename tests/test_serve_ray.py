"""Ray Serve: two replicas of the demo model on a local Ray instance, through Ray Serve's proxy.

Skipped where ray is not installed (it is not in requirements/dev.txt: the ``ray`` extra is
about 370 MB and two minutes to install). Run it with an environment that has it::

    python -m venv /tmp/ray-venv && /tmp/ray-venv/bin/pip install 'ray[serve]==2.60.0'
    echo "$PWD/.venv/lib/python3.11/site-packages" > /tmp/ray-venv/lib/python3.11/site-packages/zz.pth
    PYTHONPATH=$PWD /tmp/ray-venv/bin/python -m pytest tests/test_serve_ray.py -q
"""

from __future__ import annotations

import socket
import time

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_app():
    from transformer_ext.serve.ray import build_app

    port = _free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(
        build_app(num_replicas=2, languages=["en-de"], batching="static"), route_prefix="/", name="translate"
    )
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)
    deadline = time.monotonic() + 300
    while True:
        try:
            if client.get("/readyz").status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the deployment never became ready"
        time.sleep(0.2)
    yield client
    serve.shutdown()
    ray.shutdown()


def test_two_replicas_serve_both_apis(ray_app):
    from transformer_ext.translator import Translator

    oracle = Translator.from_model_dir(None)
    sources = ["forty-two", "seven", "one thousand and one", "three hundred and twelve"]
    status = serve.status().applications["translate"]
    (deployment,) = status.deployments.values()
    assert sum(deployment.replica_states.values()) == 2 and deployment.replica_states.get("RUNNING") == 2
    for source in sources:
        answer = ray_app.post("/v1/translate", json={"text": source})
        assert answer.status_code == 200, answer.text
        assert answer.json()["translations"] == [{"text": str(oracle.translate([source])[0])}]
    libre = ray_app.post("/translate", json={"q": sources[:2], "source": "en", "target": "de"})
    assert libre.json() == {"translatedText": [str(oracle.translate([s])[0]) for s in sources[:2]]}
    with ray_app.stream("POST", "/v1/translate/stream", json={"text": sources}) as answer:
        lines = [line for line in answer.iter_lines() if line]
    assert lines[-1] == '{"done": true, "model": "demo"}' and len(lines) == len(sources) + 1
    bad = ray_app.post("/v1/translate", json={"text": "seven", "beam_size": 0})
    assert bad.status_code == 400 and bad.json()["field"] == "beam_size"
    assert "translate_requests_total" in ray_app.get("/metrics").text
