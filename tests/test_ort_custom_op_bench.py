"""The decode benchmark's engines of the ``custom-op`` export flavour (``bench_decode.py``:
``onnxrt_op``, ``onnxrt_op_int8``): exported by the benchmark itself, decoded in torch-free
ONNX Runtime workers beside the portable export, their float32 tokens required to equal the
portable export's (the benchmark's own token check, an independent oracle: standard-op
attention), the JSON's schema kept.

Speed is never asserted here. The test skips, saying why, where the operator library cannot be
built (no ONNX Runtime headers): the fixture of tests/test_ort_custom_op.py.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("matplotlib")
pytest.importorskip("onnxruntime")

from test_ort_custom_op import library  # noqa: E402, F401  (the fixture: built, or the test skips)

from benchmarks.decode import bench_decode  # noqa: E402
from transformer_ext.export_format import CUSTOM_OPS_LIBRARY, read_manifest  # noqa: E402


def test_custom_op_engines_decode_beside_the_portable_export(tmp_path, library):  # noqa: F811
    engines = ["onnxrt", "onnxrt_op", "onnxrt_op_int8"]
    out, artifacts = tmp_path / "decode.json", tmp_path / "artifacts"
    results = bench_decode.run(
        ["tiny"], engines, [2], threads_list=[1], repeats=1, out=str(out), artifacts=str(artifacts)
    )
    model = results["models"]["tiny"]
    assert {(c["mode"], c["batch"]) for c in model["cases"]} == {("greedy", 2), ("beam4", 2)}
    for case in model["cases"]:
        assert case["reference_engine"] == "onnxrt"
        assert case["engines"]["onnxrt_op"]["tokens_match"] is True, case["mode"]
        assert 0.0 <= case["engines"]["onnxrt_op_int8"]["rows_equal_to_float32"] <= 1.0
        assert all(case["engines"][name]["tokens_per_second"] > 0 for name in engines)
    for name, artifact in (("onnxrt_op", "onnx_op"), ("onnxrt_op_int8", "onnx_op_int8")):
        assert model["workers"][f"{name}/1"]["modules"] == ["onnxruntime"]  # no torch in the worker
        manifest = read_manifest(artifacts / "tiny" / artifact)
        assert (
            manifest["flavour"] == "custom-op"
            and (artifacts / "tiny" / artifact / CUSTOM_OPS_LIBRARY).is_file()
        )
    assert model["quantization"]["onnxrt_op"] is None
    assert model["quantization"]["onnxrt_op_int8"]["scheme"] == "int8"
    speedups = {(r["engine"], r["float32_engine"]) for r in results["quantized_speedups"]}
    assert ("onnxrt_op_int8", "onnxrt_op") in speedups
    saved = json.loads(out.read_text())
    assert [e["name"] for e in saved["engines"]] == engines and saved["complete"] is True
