"""benchmarks/decode/bench_batching.py at tiny size: it runs, writes its JSON, both paths agree, and its
work counts are those of a plain computation from the translations."""

from __future__ import annotations

import json

from benchmarks.decode import bench_batching
from transformer_ext.translator import Translator  # noqa: E402


def _steps(translation, budget: int) -> int:
    """Decoder steps a row takes: its tokens and the EOS, or its whole budget without one."""
    h = translation.hypotheses[0]
    return len(h.tokens) + 1 if h.finished else budget


def test_bench_batching_tiny(tmp_path):
    out = tmp_path / "bench.json"
    args = ["--lines", "6", "--repeats", "1", "--window", "4", "--max-batch-tokens", "60", "--out", str(out)]
    bench_batching.main(args)
    payload = json.loads(out.read_text())
    assert payload["lines"] == 6
    assert payload["outputs_equal"] == 6  # greedy tokens do not depend on the batching here
    for name in ("sentence_batches", "token_batches"):
        r = payload["results"][name]
        assert r["seconds"] > 0 and r["first_result_seconds"] <= r["seconds"]

    # sentence batches of 64: the 6 lines are one batch, which steps until its longest row ends
    lines = bench_batching.demo_lines(6, 0)
    translator = Translator.from_model_dir(None)
    encoded = translator.encode(lines)
    budgets = [int(b) for b in translator.max_decoding_length([len(x) for x in encoded], 1.5, 10)]
    row_steps = [_steps(t, b) for t, b in zip(translator.translate(lines), budgets)]
    work = payload["results"]["sentence_batches"]["work"]
    assert work["batches"] == 1 and work["runner_calls"] == max(row_steps)
    # the eager runner drops finished rows (select): each row steps until its own end
    assert translator.runner.select is not None
    assert work["rows_x_steps"] == sum(row_steps)
    assert work["padded_source_tokens"] == 6 * max(len(x) for x in encoded)


def test_bench_batching_work_only_times_nothing(tmp_path):
    out = tmp_path / "bench.json"
    bench_batching.main(["--lines", "5", "--work-only", "--out", str(out)])
    payload = json.loads(out.read_text())
    for name in ("sentence_batches", "token_batches"):
        assert set(payload["results"][name]) == {"work"}
    assert payload["token_over_sentence_throughput"] is None
    # the defaults read 5 lines as one window and one token batch: the same work as one sentence batch
    assert payload["results"]["token_batches"]["work"] == payload["results"]["sentence_batches"]["work"]
