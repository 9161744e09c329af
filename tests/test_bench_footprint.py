"""benchmarks/deploy/bench_footprint.py: its worker measures a real load and translation, the earlier
layout it compares against holds no shared weights file, and the table names what was skipped."""

from __future__ import annotations

import json

import pytest

from benchmarks.deploy import bench_footprint


def test_worker_loads_translates_and_reads_its_memory(exported_portable):
    record = bench_footprint.worker("ours", str(exported_portable), 1)
    assert record["tokens"] > 0
    for stage in ("after_import", "after_load", "after_first_translation", "after_batch_translation"):
        assert record[stage]["rss"] > 0 and record[stage]["peak_rss"] >= record[stage]["rss"]
        assert 0 < record[stage]["rss_anon"] <= record[stage]["rss"]
        assert 0 <= record[stage]["rss_file"] <= record[stage]["rss"]
    assert record["after_first_translation"]["peak_rss"] >= record["after_import"]["peak_rss"]
    assert record["after_batch_translation"]["peak_rss"] >= record["after_first_translation"]["peak_rss"]
    assert 0 < record["load_seconds"] <= record["first_translation_seconds"]
    assert record["batch_translation_seconds"] > 0


def test_inline_layout_has_no_shared_weights_file_and_decodes_the_same(exported_portable, tmp_path):
    import numpy as np

    from transformer_ext.export_format import WEIGHTS_FILE, read_manifest
    from transformer_ext.runtimes import OrtRunner

    inline = tmp_path / "inline"
    bench_footprint.inline_weights(exported_portable, inline)
    manifest = read_manifest(inline, verify=True)
    assert "weights" not in manifest and not (inline / WEIGHTS_FILE).exists()
    assert manifest["files"] == sorted(p.name for p in inline.iterdir())
    ids, lengths = np.array([[5, 9, 12, 7, 2]]), np.array([5])
    assert [list(r) for r in OrtRunner(inline).greedy(ids, lengths, max_decoding_length=6)] == [
        list(r) for r in OrtRunner(exported_portable).greedy(ids, lengths, max_decoding_length=6)
    ]


def test_table_shows_ratios_and_skipped_engines():
    results = {
        "threads": 2,
        "load_average_before": [1.0, 1.0, 1.0],
        "load_average_after": [2.0, 1.0, 1.0],
        "models": {
            "m": {
                "reference_bytes": 2_000_000,
                "engines": {
                    "ours float32": {
                        "folder_bytes": 2_100_000,
                        "ratio_to_reference": 1.05,
                        "peak_rss_after_load": 5e6,
                        "peak_rss_after_first_translation": 6e6,
                        "load_seconds": 0.5,
                        "first_translation_seconds": 0.75,
                        "peak_rss_after_batch_translation": 7e6,
                        "repeats": 3,
                    },
                    "ctranslate2 int8": {"skipped": "ctranslate2 is not importable here"},
                },
            }
        },
    }
    table = bench_footprint.summary_table(json.loads(json.dumps(results)))
    assert "| m | ours float32 | 2.1 | 1.050 | 5.0 | 6.0 | 0.50 | 0.75 |" in table
    assert "| m | ours float32 | 2.1 | 1.050 | 5.0 | 6.0 | 0.50 | 0.75 | 7.0 |" in table
    assert "| m | ctranslate2 int8 | skipped: ctranslate2 is not importable here |" in table
    assert "median of 3 runs" in table


def test_bad_arguments_are_usage_errors(capsys):
    with pytest.raises(SystemExit) as exc:
        bench_footprint.main(["--models", "huge"])
    assert exc.value.code == 2 and "--models" in capsys.readouterr().err


def test_each_engine_of_ours_is_set_beside_ctranslate2_at_its_precision():
    def engine(folder, peak, first):
        return {
            "folder_bytes": folder,
            "ratio_to_reference": folder / 4e6,
            "peak_rss_after_load": peak,
            "peak_rss_after_first_translation": peak,
            "load_seconds": first / 2,
            "first_translation_seconds": first,
            "repeats": 1,
        }

    results = {
        "threads": 1,
        "load_average_before": [1.0, 1.0, 1.0],
        "load_average_after": [1.0, 1.0, 1.0],
        "models": {
            "m": {
                "reference_bytes": 4_000_000,
                "engines": {
                    "ours float32": engine(4_000_000, 9e6, 3.0),
                    "ours int8": engine(1_100_000, 4e6, 1.0),
                    "ours int4": engine(600_000, 3e6, 0.5),
                    "ctranslate2 float32": engine(4_000_000, 6e6, 2.0),
                    "ctranslate2 int8": engine(1_000_000, 2e6, 2.0),
                },
            }
        },
    }
    table = bench_footprint.summary_table(results)
    assert "| m | ours float32 | ctranslate2 float32 | 4.000 | 1.50 | 1.50 |" in table
    assert "| m | ours int8 | ctranslate2 int8 | 1.100 | 2.00 | 0.50 |" in table
    assert "| m | ours int4 | ctranslate2 int8 | 0.600 | 1.50 | 0.25 |" in table
    del results["models"]["m"]["engines"]["ctranslate2 int8"]  # not measured: no such row
    assert "ours int8 | ctranslate2 int8" not in bench_footprint.summary_table(results)


def test_base_is_a_transformers_checkpoint_of_the_base_presets_dimensions():
    """So that CTranslate2 converts the same checkpoint for ``base`` as for opus-mt-en-de."""
    base, opus = bench_footprint.checkpoint_size("base"), bench_footprint.checkpoint_size("opus-mt-en-de")
    assert (base["d_model"], base["heads"], base["layers"], base["d_ff"], base["vocab_size"]) == (
        512,
        8,
        6,
        2048,
        8000,
    )
    assert base.get("family", "marian") == "marian" and opus["vocab_size"] == 58101
