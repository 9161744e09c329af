"""transformer_ext.export_format: the one manifest reader, the generation config, the dtype table,
the error classes; old export folders; the self-contained folder (export.onnx, export.tensorrt).

Export folders come from the session export (``exported_portable``, conftest.py) or from
``fast_export`` (the real exporter around copies of those graphs), so these tests take seconds.
"""

from __future__ import annotations

import ast
import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from fake_tensorrt import fake_tensorrt
from helpers import make_model_dir, rehash_export, with_cross_per_row
from onnx import helper

import export
from export import OutputFolderError, trt_readiness
from export import manifest as export_manifest
from export import tensorrt as trtb
from export.contract import onnx_dtype_name
from export.onnx import export_onnx, main
from transformer_ext import export_format as ef
from transformer_ext.cli import UserError
from transformer_ext.export_format import (
    DTYPES,
    GenerationConfig,
    GenerationConfigError,
    ManifestError,
    read_generation_config,
    read_manifest,
)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def model_dir(tmp_path) -> Path:
    return make_model_dir(tmp_path / "model")


def copy_export(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def rewrite(folder: Path, **changes) -> dict:
    """Edit the folder's manifest.json (a value of None removes the key); returns the new manifest."""
    manifest = json.loads((folder / "manifest.json").read_text())
    for key, value in changes.items():
        if value is None:
            manifest.pop(key, None)
        else:
            manifest[key] = value
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return manifest


def as_version_2(export_dir: Path, dst: Path) -> Path:
    """``export_dir`` as the version-2 exporter wrote it: without a generation config, the
    decoder step declaring one cross-attention row per row."""
    folder = with_cross_per_row(copy_export(export_dir, dst))
    (folder / "generation.json").unlink()
    manifest = json.loads((folder / "manifest.json").read_text())
    rewrite(
        folder,
        format_version=2,
        generation_config=None,
        sha256=None,  # the hashes came with version 3's writers
        files=[f for f in manifest["files"] if f != "generation.json"],
    )
    return folder


# ------------------------------------------------------------------------------------------
# the module and its errors
# ------------------------------------------------------------------------------------------


def test_reading_an_export_folder_imports_no_numpy_torch_or_onnx():
    code = (
        "import sys, transformer_ext.export_format, export.manifest; "
        "print(sorted(m for m in ('numpy', 'torch', 'onnx', 'onnxruntime') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_what_runners_need_of_the_format_imports_nothing_of_export():
    """Imports run one way (docs/DESIGN.md section 1): export/ uses these modules, never the reverse."""
    code = (
        "import sys, transformer_ext.export_format, transformer_ext.precision, transformer_ext.tensorrt_support, "
        "transformer_ext.demo; print(sorted(m for m in sys.modules if m == 'export' or m.startswith('export.')))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    from transformer_ext import precision, tensorrt_support

    assert (
        trtb.convert_precision is precision.convert_precision and trtb.CACHE_DTYPES is precision.CACHE_DTYPES
    )
    assert trtb.import_tensorrt is tensorrt_support.import_tensorrt
    assert trtb.TensorRTNotAvailableError is tensorrt_support.TensorRTNotAvailableError


def test_export_errors_are_the_formats_and_every_tensorrt_error_is_an_export_error():
    assert export.ManifestError is ef.ManifestError and export.ExportError is ef.ExportError
    assert export.InvalidGraphError is ef.InvalidGraphError
    assert issubclass(GenerationConfigError, ManifestError) and issubclass(ManifestError, UserError)
    # derived from ExportError, and still what existing `except` clauses catch
    for cls, old_base in (
        (trtb.TensorRTNotAvailableError, ImportError),
        (trtb.TensorRTParseError, RuntimeError),
        (trtb.TensorRTBuildError, RuntimeError),
        (trtb.PrecisionConversionError, ValueError),
        (trt_readiness.TensorRTReadinessError, RuntimeError),
    ):
        assert issubclass(cls, export.ExportError) and issubclass(cls, old_base), cls
    from transformer_ext.runtimes.device import BindingError  # the TensorRT runner's

    assert issubclass(BindingError, export.ExportError) and issubclass(BindingError, RuntimeError)


def test_the_format_names_have_one_import_path():
    """The readers' names are imported from transformer_ext.export_format only: export.manifest holds
    the writer's functions, defined there, and passes on none of the format's names."""
    assert not [name for name in ef.__all__ if hasattr(export_manifest, name)]
    for name in export_manifest.__all__:
        assert getattr(export_manifest, name).__module__ == "export.manifest", name


# ------------------------------------------------------------------------------------------
# the dtype table
# ------------------------------------------------------------------------------------------


def test_dtype_table_agrees_with_onnx_and_onnxruntime():
    for d in DTYPES.values():
        assert onnx_dtype_name(d.onnx) == d.name  # onnx.helper's name of the element type
        assert ef.dtype_from_onnx(d.onnx) == d.name
        assert np.dtype(helper.tensor_dtype_to_np_dtype(d.onnx)).itemsize == d.itemsize
        # what ONNX Runtime calls a graph input of that type
        graph = helper.make_graph(
            [helper.make_node("Identity", ["x"], ["y"])],
            "g",
            [helper.make_tensor_value_info("x", d.onnx, [2])],
            [helper.make_tensor_value_info("y", d.onnx, [2])],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
        model.ir_version = 10
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        assert session.get_inputs()[0].type == d.ort
        assert ef.dtype_from_ort(d.ort) == d.name
        if d.tensorrt:
            assert ef.dtype_from_tensorrt(d.tensorrt) == d.name
    model_config_pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2")
    assert all(d.triton in model_config_pb2.DataType.keys() for d in DTYPES.values())


def test_io_comparator_names_every_difference():
    spec = {
        "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 4]}],
        "outputs": [{"name": "y", "dtype": "float32", "shape": ["batch", 4]}],
    }
    same = (
        [{"name": "x", "dtype": "float16", "shape": ["batch", 4]}],
        [{"name": "y", "dtype": "float32", "shape": ["batch", 4]}],
    )
    assert ef.io_problems(spec, *same) == ["input x: dtype float16 != float32"]
    assert ef.io_problems(spec, *same, compare_dtypes=False) == []  # a converted graph
    other = (
        [{"name": "x", "dtype": "float32", "shape": ["batch", None]}],
        [{"name": "z", "dtype": "float32", "shape": [1]}],
    )
    assert ef.io_problems(spec, *other) == [
        "input x: shape ['batch', None] != ['batch', 4]",
        "output names differ (missing ['y'], unexpected ['z'])",
    ]
    with pytest.raises(ManifestError, match="^decoder does not match the manifest: input x: dtype"):
        ef.check_io("decoder", spec, *same)


# ------------------------------------------------------------------------------------------
# the manifest reader
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(format_version=5), r"version=5\); it was written by a newer transformer_ext: upgrade it"),
        (dict(format_version=True), "version=True"),
        (dict(format="someone.else"), "is not a transformer_ext.onnx_export manifest"),
        (dict(generation_config=None), "generation_config must name the generation config file"),
        (dict(generation_config="../generation.json"), "generation_config must name"),
        (
            dict(files=["encoder.onnx", "decoder_step.onnx", "manifest.json", "tokenizer.json"]),
            r"\['generation.json'\] are named by the manifest but not in its files list",
        ),
        (dict(tokenizer_files=["../tokenizer.json"]), "tokenizer_files must list"),
        (dict(model_config={"d_model": 32}), "model_config must hold at least"),
    ],
)
def test_manifest_reader_refuses_what_it_cannot_rely_on(exported_portable, tmp_path, changes, match):
    folder = copy_export(exported_portable, tmp_path / "e")
    rewrite(folder, **changes)
    with pytest.raises(ManifestError, match=match) as info:
        read_manifest(folder)
    assert str(folder / "manifest.json") in str(info.value)


def test_version_2_folders_still_load_with_the_default_generation_config(
    exported_portable, tmp_path, model_dir, fast_export
):
    old = as_version_2(exported_portable, tmp_path / "v2")
    manifest = read_manifest(old)
    assert manifest["format_version"] == 2
    config = read_generation_config(old)
    assert config == GenerationConfig(
        special_tokens={"pad": 0, "bos": 1, "eos": 2, "unk": 3}, max_new_tokens=manifest["max_cache_len"]
    )
    assert (
        config.beam_size,
        config.length_penalty,
        config.alpha,
        config.max_len_a,
        config.max_len_b,
        config.min_new_tokens,
    ) == (1, "gnmt", 0.6, 1.5, 10.0, 0)
    # a generation.json in a version-2 folder is not one the exporter wrote there: kept
    (old / "generation.json").write_text("{}")
    with pytest.raises(OutputFolderError, match="did not write there: generation.json"):
        export_onnx(model_dir, old, validate=False)
    (old / "generation.json").unlink()
    export_onnx(model_dir, old, validate=False)  # only its own files: replaced by a version-4 folder
    assert read_manifest(old)["format_version"] == 4 and read_generation_config(old).max_new_tokens == 64


# ------------------------------------------------------------------------------------------
# the generation config
# ------------------------------------------------------------------------------------------


def _write_generation(folder: Path, text: str) -> Path:
    path = folder / "generation.json"
    path.write_text(text)
    rehash_export(folder)  # a config the manifest knows of: what is tested is its validation
    return path


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("beam_size", 0, "beam_size must be >= 1, got 0"),
        ("beam_size", "4", 'beam_size must be an integer, got "4"'),
        ("beam_size", True, "beam_size must be an integer, got true"),
        (
            "length_penalty",
            "wu",
            r"length_penalty must be one of \['gnmt', 'seed', 'average', 'none', 'hf'\], got \"wu\"",
        ),
        ("alpha", -0.5, "alpha must be a finite number >= 0, got -0.5"),
        ("alpha", "NaN", "alpha must be a finite number >= 0, got nan"),
        ("max_len_a", "Infinity", "max_len_a must be a finite number >= 0, got inf"),
        ("max_len_b", None, "max_len_b must be a finite number >= 0, got null"),
        ("min_new_tokens", -1, "min_new_tokens must be >= 0, got -1"),
        ("min_new_tokens", 10, r"min_new_tokens \(10\) must be <= max_new_tokens \(5\)"),
        ("max_new_tokens", 0, "max_new_tokens must be >= 1, got 0"),
        ("max_new_tokens", 65, "max_new_tokens 65 exceeds the export's cache capacity max_cache_len = 64"),
        ("special_tokens", {"pad": 0, "bos": 1}, "special_tokens must map"),
        ("special_tokens", {"pad": 0, "bos": 1, "eos": 2, "unk": 3, "mask": 4}, "special_tokens must map"),
        ("special_tokens", {"pad": 0, "bos": 1, "eos": 3, "unk": 2}, "differ from the manifest's"),
        ("colour", "blue", r"unknown fields \['colour'\]"),
        ("format_version", 2, "unsupported format_version 2"),
        ("format", "other", "format must be 'transformer_ext.generation_config'"),
    ],
)
def test_generation_config_is_validated_on_read(exported_portable, tmp_path, field, value, match):
    folder = copy_export(exported_portable, tmp_path / "e")
    data = json.loads((folder / "generation.json").read_text())
    data["max_new_tokens"] = 5
    if isinstance(value, str) and value in ("NaN", "Infinity"):
        text = json.dumps({**data, field: 0.0}).replace(f'"{field}": 0.0', f'"{field}": {value}')
    else:
        text = json.dumps({**data, field: value})
    path = _write_generation(folder, text)
    with pytest.raises(GenerationConfigError, match=match) as info:
        read_generation_config(folder)
    assert str(info.value).startswith(f"{path}: ")


def test_generation_config_file_missing_corrupt_or_incomplete(exported_portable, tmp_path):
    folder = copy_export(exported_portable, tmp_path / "e")
    data = json.loads((folder / "generation.json").read_text())
    path = _write_generation(folder, json.dumps({k: v for k, v in data.items() if k != "alpha"}))
    with pytest.raises(GenerationConfigError, match=r"missing fields \['alpha'\]"):
        read_generation_config(folder)
    _write_generation(folder, '{"format": "transformer_ext.generation_co')
    with pytest.raises(GenerationConfigError, match=f"{path} is not valid JSON"):
        read_generation_config(folder)
    _write_generation(folder, "[1, 2]")
    with pytest.raises(GenerationConfigError, match="must hold a JSON object, got list"):
        read_generation_config(folder)
    path.unlink()
    with pytest.raises(GenerationConfigError, match=f"{path} not found: the manifest names it"):
        read_generation_config(folder)


def test_exporter_writes_the_generation_options_it_is_given(tmp_path, model_dir, fast_export, capsys):
    out = tmp_path / "out"
    export_onnx(
        model_dir,
        out,
        validate=False,
        cache_len=32,
        generation={"beam_size": 4, "length_penalty": "average", "alpha": 1.0, "max_new_tokens": 20},
    )
    config = read_generation_config(out)
    assert (config.beam_size, config.length_penalty, config.alpha, config.max_new_tokens) == (
        4,
        "average",
        1.0,
        20,
    )
    # from the command line, and the translations printed are decoded as the file says
    assert (
        main(
            [
                "--model",
                str(model_dir),
                "--output-dir",
                str(out),
                "--no-validate",
                "--beam-size",
                "2",
                "--max-len-a",
                "0",
                "--max-len-b",
                "3",
                "--examples",
                "2",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "example translations: none (the model folder records no example pairs" in printed  # not the demo
    config = read_generation_config(out)
    assert (config.beam_size, config.max_len_a, config.max_len_b, config.max_new_tokens) == (2, 0.0, 3.0, 64)
    # given sources (as the BLEU gate's), the translations are decoded as the file says
    from types import SimpleNamespace

    from export.onnx import examples_text

    exported = SimpleNamespace(manifest=json.loads((out / "manifest.json").read_text()), output_dir=out)
    printed = examples_text(exported, 2, [("abc", "x"), ("hello", "y")])
    assert printed.startswith("translations decoded by ONNX Runtime (beam 2, as generation.json says)")
    lines = [line for line in printed.splitlines() if line.startswith("  '") and " -> " in line]
    texts = [ast.literal_eval(line.split(" -> ")[1].split("  (")[0]) for line in lines]
    assert len(texts) == 2 and all(len(t) <= 3 for t in texts)  # a character tokenizer: at most 3 tokens


@pytest.mark.parametrize(
    "options, match",
    [
        ({"beam_size": 0}, "the generation options: beam_size must be >= 1, got 0"),
        ({"max_new_tokens": 33}, "max_new_tokens 33 exceeds the export's cache capacity max_cache_len = 32"),
        ({"temperature": 0.7}, r"unknown fields \['temperature'\]"),
    ],
)
def test_bad_generation_options_are_refused_before_anything_is_written(
    tmp_path, model_dir, fast_export, options, match
):
    with pytest.raises(GenerationConfigError, match=match):
        export_onnx(model_dir, tmp_path / "out", validate=False, cache_len=32, generation=options)
    assert not (tmp_path / "out").exists() and fast_export == []


def test_cli_bad_generation_option_is_one_line(tmp_path, model_dir, fast_export, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--model", str(model_dir), "--output-dir", str(tmp_path / "out"), "--length-penalty", "-1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        "python -m export.onnx: error: --length-penalty must be a finite number >= 0 (negative exponents: "
        "--length-penalty-type hf), got -1.0"
    )
    assert not (tmp_path / "out").exists() and fast_export == []


def test_cli_generation_flags_take_the_decoding_names_and_the_old_spellings(
    tmp_path, model_dir, fast_export, capsys
):
    """The generation config's flags are the decoding commands' (--length-penalty the exponent,
    --length-penalty-type the formula, --max/min-decoding-length); --alpha, --length-penalty NAME,
    --min-new-tokens and --max-new-tokens warn once each and write the same generation.json."""
    new = ["--beam-size", "3", "--length-penalty", "1.5", "--length-penalty-type", "average"]
    new += ["--min-decoding-length", "2", "--max-decoding-length", "20"]
    old = ["--beam-size", "3", "--alpha", "1.5", "--length-penalty", "average"]
    old += ["--min-new-tokens", "2", "--max-new-tokens", "20"]
    written = []
    for name, flags in (("new", new), ("old", old)):
        out = tmp_path / name
        assert main(["--model", str(model_dir), "--output-dir", str(out), "--no-validate", *flags]) == 0
        written.append(json.loads((out / "generation.json").read_text()))
        err = capsys.readouterr().err
        assert ("deprecated" in err) == (name == "old"), err
        if name == "old":
            for spelling in ("--alpha", "--length-penalty average", "--min-new-tokens", "--max-new-tokens"):
                assert f"{spelling} is deprecated" in err, err
    assert written[0] == written[1]
    g = written[0]
    assert (g["beam_size"], g["alpha"], g["length_penalty"]) == (3, 1.5, "average")
    assert (g["min_new_tokens"], g["max_new_tokens"]) == (2, 20)


def test_full_disk_while_writing_the_generation_config_keeps_the_old_export(
    tmp_path, model_dir, fast_export, monkeypatch
):
    out = tmp_path / "out"
    export_onnx(model_dir, out, validate=False)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real_replace = os.replace

    def replace(src, dst, *args, **kwargs):
        if os.path.basename(os.fspath(dst)) == "generation.json":
            raise OSError(errno.ENOSPC, "No space left on device", os.fspath(dst))
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match=f"No space left on device: '{out}'"):
        export_onnx(model_dir, out, validate=False, generation={"beam_size": 5})
    monkeypatch.setattr(os, "replace", real_replace)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name or ".old-" in p.name] == []


# ------------------------------------------------------------------------------------------
# the self-contained folder: TensorRT engine folders too
# ------------------------------------------------------------------------------------------


def test_engine_folder_apart_from_the_export_holds_the_tokenizer_and_generation_config(
    exported_portable, tmp_path, monkeypatch
):
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt([]))
    export_dir = copy_export(exported_portable, tmp_path / "export")
    engines = tmp_path / "engines"
    trtb.build_engines(export_dir, trtb.BuildOptions(output_dir=engines))
    for name in ("tokenizer.json", "generation.json"):
        assert (engines / name).read_bytes() == (export_dir / name).read_bytes()
    manifest = read_manifest(engines)
    assert manifest["files"] == sorted(os.listdir(engines))
    assert read_generation_config(engines) == read_generation_config(export_dir)
    # a version-2 export gets the default generation config from the build (its manifest is version 3)
    old = as_version_2(exported_portable, tmp_path / "v2")
    trtb.build_engines(old, trtb.BuildOptions())
    assert read_manifest(old)["format_version"] == 3
    assert read_generation_config(old) == GenerationConfig.defaults_for(read_manifest(old))
    assert read_manifest(old)["files"] == sorted(os.listdir(old))


# ------------------------------------------------------------------------------------------
# file hashes
# ------------------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_manifest_records_the_sha256_of_every_listed_file(exported_portable):
    manifest = json.loads((exported_portable / "manifest.json").read_text())
    expected = {
        name: _sha256(exported_portable / name) for name in manifest["files"] if name != "manifest.json"
    }
    assert manifest["sha256"] == expected


def test_a_permuted_tokenizer_of_the_same_sizes_is_refused_naming_the_file(exported_portable, tmp_path):
    from transformer_ext.translate import Translator

    folder = copy_export(exported_portable, tmp_path / "e")
    path = folder / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab = data["target_vocab"]
    vocab[4], vocab[5] = vocab[5], vocab[4]  # same sizes, same special ids: only the hash tells
    path.write_text(json.dumps(data))
    with pytest.raises(ef.ManifestError, match=rf"{path} is not the file this export was written with"):
        read_manifest(folder)
    with pytest.raises(UserError, match=r"tokenizer.json is not the file this export was written with"):
        Translator.from_export_dir(folder)


def test_a_changed_graph_is_found_on_request_and_old_folders_without_hashes_load(exported_portable, tmp_path):
    folder = copy_export(exported_portable, tmp_path / "e")
    graph = folder / "decoder_step.onnx"
    graph.write_bytes(graph.read_bytes() + b"\0")
    read_manifest(folder)  # graphs are hashed only on request: reading them all costs time
    with pytest.raises(ef.ManifestError, match=rf"{graph} is not the file this export was written with"):
        read_manifest(folder, verify=True)
    graph.write_bytes(graph.read_bytes()[:-1])
    assert read_manifest(folder, verify=True)["sha256"]["decoder_step.onnx"] == _sha256(graph)
    (folder / "tokenizer.json").write_text((folder / "tokenizer.json").read_text() + " ")
    rewrite(folder, sha256=None)  # as written before the hashes were recorded
    assert "sha256" not in read_manifest(folder, verify=True)


def test_translate_verify_checks_the_graphs_too(exported_portable, tmp_path, capsys):
    import io

    from transformer_ext.translate import main as translate_main

    folder = copy_export(exported_portable, tmp_path / "e")
    graph = folder / "encoder.onnx"
    proto = graph.read_bytes()
    graph.write_bytes(proto + b"\0")
    stdout = io.StringIO()
    assert translate_main(["--model", str(folder), "--verify", "ab"], stdout=stdout) == 1
    err = capsys.readouterr().err
    assert f"{graph} is not the file this export was written with" in err and "Traceback" not in err
    graph.write_bytes(proto)
    assert translate_main(["--model", str(folder), "--verify", "ab"], stdout=stdout) == 0
