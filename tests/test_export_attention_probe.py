"""The step-attention probe: every form it times is first checked against float64 numpy.

Speed is never asserted here (benchmarks/ measures it); this keeps the probe working and its
check honest.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

pytest.importorskip("matplotlib")
pytest.importorskip("onnxruntime")

from benchmarks.probes import probe_step_attention as probe  # noqa: E402
from benchmarks.probes import step_attention_harness as harness  # noqa: E402


def test_quick_run_checks_and_times_every_form(tmp_path):
    out = tmp_path / "step_attention.json"
    assert probe.main(["--quick", "--out", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert (tmp_path / "step_attention.png").stat().st_size > 0
    assert {"commit", "machine", "load_average"} <= set(saved["provenance"])
    blocks = [(r["block"], r["rows"], r.get("beams")) for r in saved["results"]]
    assert blocks == [
        ("self", 4, None),
        ("cross", 4, 1),
        ("cross", 4, 4),
        ("self", 16, None),
        ("cross", 16, 1),
        ("cross", 16, 4),
    ]
    for rec in saved["results"]:
        forms = probe.SELF_FORMS if rec["block"] == "self" else probe.CROSS_FORMS
        # every form was checked; only a contrib operator may be refused (an ONNX Runtime without
        # its kernel), never a graph of standard ops
        assert set(rec["max_abs_error"]) | set(rec["refused"]) >= set(forms) - {"dmmha_beams"}
        assert set(rec["refused"]) <= {"gqa", "dmmha", "dmmha_beams", "mha"}, rec["refused"]
        # the export's own lowering agrees with float64 and is timed; only checked forms are timed
        assert rec["max_abs_error"]["ops"]["output"] < 1e-4
        assert rec["milliseconds"]["ops"] > 0
        timed = set(rec["milliseconds"]) - {"host_reorder"}
        assert timed.isdisjoint(rec["invalid"]) and timed <= set(rec["max_abs_error"])
        if rec["block"] == "self":
            assert rec["max_abs_error"]["ops"]["cache_write"] == 0.0  # the runner's append
            assert "host_reorder" in rec["milliseconds"]  # 4 beams per source divide 4 and 16 rows
            assert rec["moved_rows"] == round(0.25 * rec["rows"])  # --moved-rows 0.25 by default
    assert set(saved["summary"]) == {"by_rows", "verdicts", "attention_part"}
    assert all(p["fastest_over_portable"] >= 1.0 for p in saved["summary"]["attention_part"])


def test_a_wrong_form_is_reported_and_not_timed():
    """The check is not the form's own output: a form off by a little is caught."""
    rng = np.random.default_rng(1)
    R, H, L, D = 3, 2, 5, 4
    q, k, v = (rng.standard_normal((R, H, D)).astype(np.float32) for _ in range(3))
    kc, vc = (rng.standard_normal((R, H, L, D)).astype(np.float32) for _ in range(2))
    own = np.repeat(np.arange(R)[:, None], L, axis=1)
    want = probe.self_reference(q, k, v, kc, vc, L - 1, own)
    # an independent loop over rows and heads
    for r in range(R):
        for h in range(H):
            keys = np.concatenate([kc[r, h, : L - 1], k[r, h][None]]).astype(np.float64)
            values = np.concatenate([vc[r, h, : L - 1], v[r, h][None]]).astype(np.float64)
            s = keys @ q[r, h].astype(np.float64)
            w = np.exp(s - s.max())
            np.testing.assert_allclose(want[r, h], (w / w.sum()) @ values, rtol=1e-12, atol=1e-12)
    good = [want.astype(np.float32)]
    bad = [want.astype(np.float32) + np.float32(1e-3)]
    args = argparse.Namespace(tolerance=1e-4)
    forms = {
        "good": (lambda: None, good, None),
        "bad": (lambda: None, bad, None),
        "refused": "Fail: no kernel",
    }
    errors, refused, valid = harness.check(args, forms, [want], None)
    assert set(valid) == {"good"} and refused == {"refused": "Fail: no kernel"}
    assert errors["bad"]["output"] == pytest.approx(1e-3, rel=1e-3)


def test_cross_reference_masks_the_padding():
    rng = np.random.default_rng(2)
    B, K, H, S, D = 2, 2, 1, 4, 3
    q = rng.standard_normal((B * K, H, D))
    k, v = rng.standard_normal((B, H, S, D)), rng.standard_normal((B, H, S, D))
    lengths = np.array([4, 1])
    out = probe.cross_reference(q, k, v, lengths, K)
    np.testing.assert_allclose(out[2:, 0], np.repeat(v[1, 0, :1], 2, axis=0))  # one key: its value


@pytest.mark.parametrize(
    "argv",
    [
        ["--rows", "0"],
        ["--threads", "x"],
        ["--cache-lens", "1"],
        ["--beams", "0"],
        ["--moved-rows", "2"],
        ["--out", "x.txt"],
    ],
)
def test_bad_arguments_are_refused(argv, tmp_path):
    with pytest.raises(SystemExit):
        probe.main([*argv] + ([] if "--out" in argv else ["--out", str(tmp_path / "x.json")]))


def test_moved_rows_are_counted_on_the_demo_model():
    pytest.importorskip("torch")
    counted = probe.demo_moved_rows(sources=4, beams=4, new_tokens=6)
    assert counted["steps"] >= 1
    assert 0.0 <= counted["moved_bytes"] <= 1.0 and 0.0 <= counted["moved_rows"] <= 1.0
