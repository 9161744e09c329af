"""bench_serve: its quick run measures and scores every serving target; its scoring applies the thresholds.

The quick run starts every server as a real process (the demo model), as the full run does; its
timings mean nothing on a test machine, so only what must hold anywhere is asserted: every target
has a row, every 200 answer (ours and CTranslate2's) equals the offline translation, the overload
run answers nothing but 200 and 429, and the SIGTERM run ends every request clearly.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.serve import bench_serve

REPO = Path(__file__).resolve().parents[1]
TARGETS = (
    "32 clients: continuous vs offline translate_iterable",
    "32 clients: continuous vs --batching none",
    "32 clients: continuous vs CTranslate2 per request",
    "1 client: continuous p50 vs direct Translator.translate",
    "128 clients, --max-queue 16: errors",
    "128 clients, --max-queue 16: RSS over",
    "128 clients, --max-queue 16: 200 answers",
    "SIGTERM during 32 clients",
)


def test_quick_run_measures_and_scores_every_target(tmp_path):
    out = tmp_path / "serve.json"
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks", "bench_serve", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        cwd=REPO,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    payload = json.loads(out.read_text())
    targets = payload["targets"]
    assert len(targets) == len(TARGETS)
    for target, name in zip(targets, TARGETS):
        assert target["target"].startswith(name), (target, name)
        assert target["status"] in ("met", "missed", "not measured")
        assert target["status"] in run.stderr and target["measured"] in run.stderr  # the printed table
    have_ct2 = importlib.util.find_spec("ctranslate2") is not None
    measured = [t["status"] != "not measured" for t in targets]
    assert measured[:2] == [True, True] and measured[2] == have_ct2 and measured[3]
    # what holds on any machine
    for mode, rows in payload["modes"].items():
        for row in rows:
            assert row["statuses"] == {"200": row["requests"]}, (mode, row)
            assert row["wrong_200_answers"] == 0, (mode, row["wrong_lines"])
    assert set(payload["modes"]) == {"continuous", "none"} | ({"ctranslate2"} if have_ct2 else set())
    assert payload["offline_translate_iterable"]["same_sentences_as_32_clients"]
    assert payload["direct_translate"]["equal_to_offline"] == payload["direct_translate"]["sentences"]
    overload = payload["overload"]
    assert set(overload["statuses"]) <= {"200", "429"} and overload["statuses"].get("200")
    assert overload["wrong_200_answers"] == 0 and len(overload["rss_samples"]) >= 2
    assert targets[4]["status"] in ("met", "not measured") and targets[6]["status"] == "met"
    sigterm = payload["sigterm"]
    assert targets[7]["status"] == "met", sigterm
    assert sigterm["in_flight_at_signal"] > 0 and sigterm["exit_code"] == 0
    assert "provenance" in payload and (tmp_path / "serve.png").stat().st_size > 0


def _payload(
    ours=10.0, offline=11.0, none=3.0, ct2=6.0, p50=0.1, direct=0.09, statuses=None, growth=0, sig=None
):
    def row(clients, sps, p50=0.2, **extra):
        return {"clients": clients, "sentences_per_s": sps, "latency_p50_s": p50, **extra}

    sigterm = dict(wrong_200_answers=0, unclear_count=0, exit_code=0, in_flight_at_signal=5)
    sigterm.update(statuses={"200": 37, "503": 32}, in_flight_answered_200=5, exit_after_signal_s=0.4)
    return {
        "modes": {
            "continuous": [row(1, 8.0, p50), row(32, ours)],
            "none": [row(32, none)],
            "ctranslate2": [row(32, ct2, setting="2x1")],
        },
        "skipped": {},
        "offline_translate_iterable": {"sentences_per_s": offline},
        "direct_translate": {"latency_p50_s": direct},
        "overload": {
            "clients": 128,
            "max_queue": 16,
            "seconds": 20.0,
            "statuses": statuses if statuses is not None else {"200": 300, "429": 900},
            "wrong_200_answers": 0,
            "rss_samples": [[0.2 * i, 300 << 20] for i in range(100)],
            "rss_first_third_median_bytes": 300 << 20,
            "rss_growth_bytes": growth,
            "rss_flat_limit_bytes": 16 << 20,
        },
        "sigterm": {**sigterm, **(sig or {})},
    }


def _statuses(payload) -> list[str]:
    return [t["status"] for t in bench_serve.score(payload)]


def test_score_applies_each_threshold_at_its_boundary():
    assert (
        _statuses(_payload(ours=9.0, offline=10.0, none=3.0, ct2=6.0, p50=0.1039, direct=0.09)) == ["met"] * 8
    )
    assert _statuses(_payload(ours=8.5, offline=10.0))[0] == "met"
    assert _statuses(_payload(ours=8.49, offline=10.0))[0] == "missed"
    assert _statuses(_payload(ours=8.99, none=3.0))[1] == "missed"
    assert _statuses(_payload(ours=8.99, ct2=6.0))[2] == "missed"
    assert _statuses(_payload(p50=0.1041, direct=0.09))[3] == "missed"  # the limit: 1.1 * 90 ms + 5 ms
    assert "best: 2x1" in bench_serve.score(_payload())[2]["target"]


def test_overload_rss_is_scored_after_its_warm_up():
    """The overload's warm-up samples (the batch growing to its rows) are kept apart: the growth
    is measured over the samples after it, and a growth after the warm-up still counts."""
    mib = 1 << 20
    ramp = [(0.2 * i, (500 + 40 * i) * mib) for i in range(10)]  # 2 s of warm-up: 500 -> 860 MiB
    flat = [(2.0 + 0.2 * i, 880 * mib) for i in range(30)]
    out = bench_serve.rss_summary(ramp + flat, 2.0)
    assert out["rss_warmup_samples"] == ramp and out["rss_samples"] == flat
    assert out["rss_growth_bytes"] == 0 and out["rss_warmup_peak_bytes"] == 860 * mib
    growing = [(t, v + int(t * 20 * mib)) for t, v in flat]  # 20 MiB more every second
    out = bench_serve.rss_summary(ramp + growing, 2.0)
    assert out["rss_growth_bytes"] > out["rss_flat_limit_bytes"]
    assert bench_serve.rss_summary(ramp + flat, 0.0)["rss_growth_bytes"] > 100 * mib  # no warm-up


def test_score_overload_and_sigterm():
    assert _statuses(_payload(statuses={"200": 10, "429": 5, "500": 1}))[4] == "missed"
    assert _statuses(_payload(statuses={"200": 10, "429": 5, "ReadTimeout": 1}))[4] == "missed"
    assert _statuses(_payload(statuses={"200": 10}))[4] == "not measured"  # the queue never filled
    assert _statuses(_payload(growth=(16 << 20) + 1))[5] == "missed"
    assert _statuses(_payload(growth=16 << 20))[5] == "met"
    for bad in ({"unclear_count": 1}, {"exit_code": None}, {"exit_code": 1}, {"wrong_200_answers": 1}):
        assert _statuses(_payload(sig=bad))[7] == "missed", bad
    assert _statuses(_payload(sig={"in_flight_at_signal": 0}))[7] == "missed"  # the signal hit no work
    partial = _payload()
    del partial["modes"]["ctranslate2"], partial["overload"], partial["sigterm"]
    partial["skipped"]["ctranslate2"] = "ctranslate2 is not installed"
    scored = bench_serve.score(partial)
    assert [t["status"] for t in scored] == ["met", "met"] + ["not measured"] + ["met"] + ["not measured"] * 4
    assert scored[2]["measured"] == "ctranslate2 is not installed"


@pytest.mark.parametrize(
    "record, unclear",
    [
        ({"status": "200", "after_signal": False}, False),
        ({"status": "503", "error": "the server is draining", "after_signal": True}, False),
        ({"status": "503", "error": None, "after_signal": True}, True),
        ({"status": "ConnectError", "after_signal": True}, False),
        ({"status": "RemoteProtocolError", "after_signal": True}, False),
        ({"status": "RemoteProtocolError", "after_signal": False}, True),  # accepted work lost
        ({"status": "500", "after_signal": True}, True),
        ({"status": "ReadTimeout", "after_signal": True}, True),  # a hang
    ],
)
def test_sigterm_outcomes_are_classified(record, unclear):
    assert bench_serve._unclear(record) is unclear


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--overload-queue", "128"], "--overload-queue"),
        (["--clients", "1,x"], "--clients"),
        (["--modes", "continuous,fast"], "--modes"),
        (["--ct2-settings", "2x0"], "--ct2-settings"),
        (["--requests", "0"], "--requests"),
        (["--sigterm-after", "nan"], "--sigterm-after"),
        (["--model", "/nonexistent/folder"], "--model"),
        (["--overload-warmup", "-1"], "--overload-warmup"),
    ],
)
def test_bad_arguments_are_usage_errors(argv, message, tmp_path, capsys):
    out = tmp_path / "never.json"
    with pytest.raises(SystemExit) as exc:
        bench_serve.main([*argv, "--out", str(out)])
    assert exc.value.code == 2 and message in capsys.readouterr().err
    assert not out.exists()
