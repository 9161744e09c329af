"""Disk and memory footprint of a deployed model: ours (float32, int8, int4) beside CTranslate2.

    python -m benchmarks bench_footprint                                 # opus-mt-en-de size and base
    python -m benchmarks bench_footprint --models base --repeats 1       # a quicker run
    python -m benchmarks bench_footprint --ct2-python /path/to/venv/bin/python

What is measured, per model and engine:

* the same float32 and int8 folders with the weights inside each graph (``weights, inside each
  graph``: the layout without a shared ``weights.data``), to show what one shared file saves;
* ``folder_bytes``: the bytes of every file of the folder the engine loads (exact);
  ``reference_bytes``: the float32 checkpoint's ``model.safetensors``, and the ratios to it and to
  CTranslate2 int8's folder;
* in a process of its own per engine and repeat (``--worker``), which imports only what the
  engine needs (ours: numpy, onnxruntime, sentencepiece, no torch; recorded as
  ``torch_imported``): the resident set size (``VmRSS``) and its peak (``VmHWM``) after the
  imports, after loading the folder, after the first translation and after a second one of a
  batch of :data:`BATCH` sources (``after_batch_translation``: what a runner that serves batches
  holds too, such as an int8 runner's dynamic decoder step, which opens at the first step of more
  rows than its few-row step runs), read from ``/proc/self/status``, with ``RssAnon`` and
  ``RssFile`` (the private memory and the mapped file pages); ``load_seconds`` (folder opened,
  sessions made), ``first_translation_seconds`` (from the start of the load to the first
  translation done) and ``batch_translation_seconds`` (the second translation alone).

The models: ``opus-mt-en-de``, a MarianMT of Helsinki-NLP/opus-mt-en-de's dimensions (vocabulary
58,101, d_model 512, 6+6 layers), and ``base``, a MarianMT of the ``base`` preset's dimensions
(d_model 512, 6+6 layers, d_ff 2048, one 8000-token vocabulary: :func:`checkpoint_size`), each
written by transformers with random weights (``bench_pretrained.write_checkpoint``) and
converted with ``transformer_ext.convert``, so that CTranslate2 converts the same checkpoint.
Both exported with ``export.onnx`` (float32) and
``export.quantize`` (int8 and int4, no quality gate: random weights), untimed. The first
translation: one source, greedy, 48 new tokens (the random weights never end it earlier:
``min_length``).

CTranslate2 (``ct2-transformers-converter --quantization float32 | int8`` on the transformers
checkpoint, ``ctranslate2.Translator.translate_batch``) runs in this Python when it imports
ctranslate2, else with ``--ct2-python``, a Python that does (its converter needs torch and
transformers); without either it is skipped with the reason in the JSON. The table gives each of our engines beside CTranslate2 at the same
precision (int4 beside CTranslate2 int8, whose CPU build has no 4-bit weights).

Sizes are exact. The RSS figures depend on the allocator and the ONNX Runtime version, not on
the load of the machine; the timings do, and are indicative on a shared machine: the JSON
records the load average before and after, the CPU (``lscpu``) and the versions. Medians of
``--repeats`` runs. Writes ``benchmarks/results/bench_footprint.json`` and a markdown table
beside it (``.md``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]
logger = logging.getLogger("bench_footprint")

MODELS = ("opus-mt-en-de", "base")
OURS = {"float32": "onnx", "int8": "onnx_int8", "int4": "onnx_int4"}
# The same folders with every graph holding its own initializers (no shared weights file), as
# exports were laid out before weights.data: what sharing one file saves in memory.
INLINE = {
    "float32, weights inside each graph": "onnx_inline",
    "int8, weights inside each graph": "onnx_int8_inline",
}
CT2 = {"float32": "ct2", "int8": "ct2_int8"}
NEW_TOKENS = 48
BATCH = 4  # sources of the second translation (more rows than an int8 folder's few-row step runs)
PREPARED = "prepared.json"  # what prepare() built in a scratch folder
SOURCE_TEXT = "the green house by the river is seven hundred years old"
SOURCE_IDS = [5, 9, 12, 7, 31, 44, 18, 27, 3, 11, 64, 2]  # base: ids below every vocabulary size, EOS last


# ------------------------------------------------------------------------------------------
# The worker: one engine, one folder, one process
# ------------------------------------------------------------------------------------------


_STATUS_KEYS = {"VmRSS": "rss", "VmHWM": "peak_rss", "RssAnon": "rss_anon", "RssFile": "rss_file"}


def _status() -> dict:
    """``VmRSS``, ``VmHWM``, ``RssAnon`` and ``RssFile`` of this process in bytes (Linux
    ``/proc/self/status``)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in _STATUS_KEYS:
                out[_STATUS_KEYS[key]] = int(value.split()[0]) * 1024
    return out


def _running_peak(stages: list[dict]) -> list[dict]:
    """``stages`` (:func:`_status` records in order) with each ``peak_rss`` the largest read so
    far: Linux reports ``VmHWM`` as the larger of the peak it last recorded and the current RSS,
    and records the peak only at some events (an unmapping, for one), so a read after the RSS fell
    without one (mapped file pages reclaimed, for one) can be lower than an earlier read."""
    peak, out = 0, []
    for stage in stages:
        peak = max(peak, stage["peak_rss"])
        out.append(dict(stage, peak_rss=peak))
    return out


def worker(engine: str, folder: str, threads: int) -> dict:
    """Load ``folder`` with ``engine`` (``ours`` or ``ct2``) and translate one source; the record."""
    t0 = time.perf_counter()
    if engine == "ours":
        import numpy as np

        from transformer_ext.export_format import read_manifest, tokenizer_files
        from transformer_ext.translator import Translator
    else:
        import ctranslate2
        import sentencepiece
    imported = _status()
    t1 = time.perf_counter()
    if engine == "ours":
        has_tokenizer = bool(tokenizer_files(read_manifest(folder)))
        if has_tokenizer:
            translator = Translator.from_export_dir(folder, threads=threads)
        else:
            from transformer_ext.runtimes import OrtRunner

            runner = OrtRunner(folder, intra_op_num_threads=threads)
    else:
        translator = ctranslate2.Translator(folder, device="cpu", intra_threads=threads, inter_threads=1)
        spm = sentencepiece.SentencePieceProcessor(model_file=os.path.join(folder, "source.spm"))
    loaded = _status()
    t2 = time.perf_counter()
    if engine == "ours" and has_tokenizer:
        (out,) = translator.translate(
            [SOURCE_TEXT],
            max_decoding_length=NEW_TOKENS,
            min_decoding_length=NEW_TOKENS,
            strict=False,
            beam_size=1,
        )
        tokens = len(out.tokens)
    elif engine == "ours":
        ids = np.array([SOURCE_IDS], dtype=np.int64)
        (row,) = runner.greedy(ids, np.array([len(SOURCE_IDS)]), max_decoding_length=NEW_TOKENS)
        tokens = len(row)
    else:
        source = spm.encode(SOURCE_TEXT, out_type=str) + ["</s>"]
        (result,) = translator.translate_batch(
            [source], beam_size=1, max_decoding_length=NEW_TOKENS, min_decoding_length=NEW_TOKENS
        )
        tokens = len(result.hypotheses[0])
    t3 = time.perf_counter()
    first = _status()
    if engine == "ours" and has_tokenizer:
        translator.translate(
            [SOURCE_TEXT] * BATCH,
            max_decoding_length=NEW_TOKENS,
            min_decoding_length=NEW_TOKENS,
            strict=False,
            beam_size=1,
        )
    elif engine == "ours":
        runner.greedy(
            np.repeat(ids, BATCH, axis=0), np.full(BATCH, len(SOURCE_IDS)), max_decoding_length=NEW_TOKENS
        )
    else:
        translator.translate_batch(
            [source] * BATCH, beam_size=1, max_decoding_length=NEW_TOKENS, min_decoding_length=NEW_TOKENS
        )
    t4 = time.perf_counter()
    stages = _running_peak([imported, loaded, first, _status()])
    return {
        "engine": engine,
        "folder": folder,
        "threads": threads,
        "tokens": tokens,
        "import_seconds": t1 - t0,
        "load_seconds": t2 - t1,
        "first_translation_seconds": t3 - t1,
        "batch_translation_seconds": t4 - t3,
        "after_import": stages[0],
        "after_load": stages[1],
        "after_first_translation": stages[2],
        "after_batch_translation": stages[3],
        "torch_imported": "torch" in sys.modules,
    }


def _run_worker(python: str, engine: str, folder: str, threads: int) -> dict:
    proc = subprocess.run(
        [
            python,
            "-m",
            "benchmarks.deploy.bench_footprint",
            "--worker",
            engine,
            folder,
            "--threads",
            str(threads),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])},
    )
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise RuntimeError(f"{engine} worker on {folder} failed (exit status {proc.returncode}):\n{tail}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------
# Preparation (untimed)
# ------------------------------------------------------------------------------------------


def folder_bytes(folder: str) -> int:
    """The bytes of every file under ``folder``."""
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def checkpoint_size(model: str) -> dict:
    """The dimensions of the transformers checkpoint written for ``model``
    (``bench_pretrained.write_checkpoint``): opus-mt-en-de's, and for ``base`` the ``base``
    preset's (d_model 512, 8 heads, 6+6 layers, d_ff 2048, an 8000-token vocabulary, shared)."""
    from benchmarks.decode import bench_pretrained

    opus = bench_pretrained.SIZES["opus-mt-en-de"]
    if model == "base":
        from transformer_ext.config import TransformerConfig

        preset = TransformerConfig.preset("base")
        return dict(
            opus,
            d_model=preset.d_model,
            heads=preset.n_heads,
            layers=preset.n_encoder_layers,
            d_ff=preset.d_ff,
            vocab_size=preset.tgt_vocab_size,
        )
    return dict(opus)


def prepare(model: str, scratch: Path, ct2_python: Optional[str]) -> tuple[dict, dict]:
    """``({artifact: folder}, {artifact: why it is missing})``, everything built once under
    ``scratch``; ``scratch/prepared.json`` records it, and a later run given the same folder
    reuses it."""
    record = scratch / PREPARED
    if record.is_file():
        saved = json.loads(record.read_text())
        logger.info("%s: reusing the folders in %s", model, scratch)
        return saved["paths"], saved["skipped"]
    from export.onnx import export_onnx
    from export.quantize import quantize_export

    paths, skipped = {}, {}
    from benchmarks.decode import bench_pretrained
    from transformer_ext.convert import convert_transformers

    paths["hf"] = scratch / "hf"
    logger.info("%s: writing the transformers checkpoint ...", model)
    bench_pretrained.write_checkpoint(paths["hf"], checkpoint_size(model))
    paths["model"] = convert_transformers(paths["hf"], scratch / "model")
    cache_len = 64
    logger.info("%s: exporting (float32, int8, int4) ...", model)
    paths["onnx"] = scratch / "onnx"
    export_onnx(paths["model"], paths["onnx"], validate=False, cache_len=cache_len)
    for scheme in ("int8", "int4"):
        paths[OURS[scheme]] = scratch / OURS[scheme]
        quantize_export(paths["onnx"], paths[OURS[scheme]], scheme, gate=False)  # random weights: no gate
    for src, artifact in (("onnx", "onnx_inline"), ("onnx_int8", "onnx_int8_inline")):
        paths[artifact] = scratch / artifact
        inline_weights(paths[src], paths[artifact])
    for precision, artifact in CT2.items():
        if "hf" not in paths:
            skipped[artifact] = "no transformers checkpoint of this model to convert"
        elif ct2_python is None:
            skipped[artifact] = (
                "ctranslate2 is not importable here (not in the main environment): give --ct2-python"
            )
        else:
            paths[artifact] = scratch / artifact
            proc = subprocess.run(
                [
                    ct2_python,
                    "-c",
                    "import sys; from ctranslate2.converters.transformers import main; sys.exit(main())",
                    "--model",
                    str(paths["hf"]),
                    "--output_dir",
                    str(paths[artifact]),
                    "--quantization",
                    precision,
                ],
                capture_output=True,
                text=True,
            )
            if proc.returncode != 0:
                skipped[artifact] = "ct2-transformers-converter failed: " + (proc.stderr or "").strip()[-300:]
                del paths[artifact]
            else:
                shutil.copy2(paths["hf"] / "source.spm", paths[artifact] / "source.spm")
    paths = {k: str(v) for k, v in paths.items()}
    record.write_text(json.dumps({"paths": paths, "skipped": skipped}))
    return paths, skipped


def inline_weights(src: Path, dst: Path) -> None:
    """Copy the export folder ``src`` to ``dst`` with the initializers inside each graph (no
    ``weights.data``, no ``weights`` section), as exports without a shared weights file are."""
    import onnx

    from export.manifest import write_manifest
    from transformer_ext.export_format import MANIFEST_NAME, WEIGHTS_FILE

    shutil.copytree(src, dst)
    for graph in sorted(dst.glob("*.onnx")):
        onnx.save(onnx.load(graph), graph)  # the external data read in, saved inside the graph
    (dst / WEIGHTS_FILE).unlink()
    manifest = json.loads((dst / MANIFEST_NAME).read_text())
    manifest.pop("weights")
    manifest["files"].remove(WEIGHTS_FILE)
    manifest["sha256"].pop(WEIGHTS_FILE, None)
    write_manifest(dst, manifest)


def _ct2_importable(python: Optional[str]) -> Optional[str]:
    if python is None:
        try:
            import ctranslate2  # noqa: F401
        except ImportError:
            return None
        return sys.executable
    proc = subprocess.run([python, "-c", "import ctranslate2"], capture_output=True)
    return python if proc.returncode == 0 else None


# ------------------------------------------------------------------------------------------
# The run, the table
# ------------------------------------------------------------------------------------------


def _median_record(runs: list[dict]) -> dict:
    def med(get):
        return statistics.median(get(r) for r in runs)

    return {
        "repeats": len(runs),
        "tokens": runs[0]["tokens"],
        "torch_imported": any(r["torch_imported"] for r in runs),
        "load_seconds": med(lambda r: r["load_seconds"]),
        "first_translation_seconds": med(lambda r: r["first_translation_seconds"]),
        "rss_after_import": med(lambda r: r["after_import"]["rss"]),
        "rss_after_load": med(lambda r: r["after_load"]["rss"]),
        "peak_rss_after_load": med(lambda r: r["after_load"]["peak_rss"]),
        "peak_rss_after_first_translation": med(lambda r: r["after_first_translation"]["peak_rss"]),
        "batch_translation_seconds": med(lambda r: r["batch_translation_seconds"]),
        "rss_anon_after_first_translation": med(lambda r: r["after_first_translation"]["rss_anon"]),
        "rss_file_after_first_translation": med(lambda r: r["after_first_translation"]["rss_file"]),
        "peak_rss_after_batch_translation": med(lambda r: r["after_batch_translation"]["peak_rss"]),
        "runs": runs,
    }


def run(
    models, repeats: int, threads: int, scratch: Path, ct2_python: Optional[str], inline: bool = True
) -> dict:
    import onnxruntime

    from benchmarks.common import lscpu

    results = {
        "benchmark": "bench_footprint",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "load_average_before": list(os.getloadavg()),
        "machine": lscpu(),
        "versions": {"onnxruntime": onnxruntime.__version__, "python": sys.version.split()[0]},
        "threads": threads,
        "new_tokens": NEW_TOKENS,
        "note": "sizes are exact; the timings are indicative (a shared machine: see the load averages)",
        "models": {},
    }
    ct2 = _ct2_importable(ct2_python)
    if ct2 is not None:
        proc = subprocess.run(
            [ct2, "-c", "import ctranslate2; print(ctranslate2.__version__)"], capture_output=True, text=True
        )
        results["versions"]["ctranslate2"] = proc.stdout.strip() or None
    for model in models:
        paths, skipped = prepare(model, scratch / model, ct2)
        reference = Path(paths["model"]) / "model.safetensors"
        if "hf" in paths:
            reference = Path(paths["hf"]) / "model.safetensors"
        entry = {"reference": str(reference), "reference_bytes": reference.stat().st_size, "engines": {}}
        for label, artifact, engine in [
            *((f"ours {p}", a, "ours") for p, a in OURS.items()),
            *((f"ours {p}", a, "ours") for p, a in (INLINE.items() if inline else ())),
            *((f"ctranslate2 {p}", a, "ct2") for p, a in CT2.items()),
        ]:
            if artifact not in paths:
                entry["engines"][label] = {"skipped": skipped.get(artifact, "not built")}
                continue
            python = sys.executable if engine == "ours" else ct2
            runs = []
            for i in range(repeats):
                logger.info("%s, %s: run %d of %d", model, label, i + 1, repeats)
                runs.append(_run_worker(python, engine, paths[artifact], threads))
            entry["engines"][label] = {
                "folder_bytes": folder_bytes(paths[artifact]),
                "files": {p.name: p.stat().st_size for p in sorted(Path(paths[artifact]).iterdir())},
                **_median_record(runs),
            }
        ct2_int8 = entry["engines"].get("ctranslate2 int8", {}).get("folder_bytes")
        for record in entry["engines"].values():
            if "folder_bytes" in record:
                record["ratio_to_reference"] = record["folder_bytes"] / entry["reference_bytes"]
                if ct2_int8:
                    record["ratio_to_ctranslate2_int8"] = record["folder_bytes"] / ct2_int8
        results["models"][model] = entry
    results["load_average_after"] = list(os.getloadavg())
    return results


def _mb(n: Optional[float]) -> str:
    return "" if n is None else f"{n / 1e6:.1f}"


def summary_table(results: dict) -> str:
    """The markdown tables of ``results``: every engine's folder, peak RSS and times, then (where
    CTranslate2 was measured) :func:`comparison_table`."""
    lines = [
        "| model | engine | folder MB | / checkpoint | peak RSS after load MB | peak RSS after first translation MB | load s | load + first translation s "
        f"| peak RSS after a batch of {BATCH} MB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for model, entry in results["models"].items():
        lines.append(
            f"| {model} | checkpoint `model.safetensors` | {_mb(entry['reference_bytes'])} | 1.00 | | | | | |"
        )
        for label, r in entry["engines"].items():
            if "skipped" in r:
                lines.append(f"| {model} | {label} | skipped: {r['skipped']} | | | | | | |")
                continue
            lines.append(
                f"| {model} | {label} | {_mb(r['folder_bytes'])} | {r['ratio_to_reference']:.3f} | "
                f"{_mb(r['peak_rss_after_load'])} | {_mb(r['peak_rss_after_first_translation'])} | "
                f"{r['load_seconds']:.2f} | {r['first_translation_seconds']:.2f} | "
                f"{_mb(r.get('peak_rss_after_batch_translation'))} |"
            )
    before, after = results["load_average_before"], results["load_average_after"]
    lines.append("")
    lines.append(
        f"Load average before {before[0]:.2f}, after {after[0]:.2f} (1 minute); {results['threads']} "
        f"thread(s); median of {next(iter(next(iter(results['models'].values()))['engines'].values())).get('repeats', 0)} runs; "
        "sizes exact, timings indicative."
    )
    comparison = comparison_table(results)
    return "\n".join(lines) + "\n" + ("\n" + comparison if comparison else "")


def ct2_peer(label: str) -> Optional[str]:
    """The CTranslate2 engine an engine of ours is compared with: the same precision (int4, which
    CTranslate2's CPU build does not run, against its int8); None for CTranslate2's own."""
    if not label.startswith("ours "):
        return None
    return "ctranslate2 float32" if label.split(",")[0] == "ours float32" else "ctranslate2 int8"


def _ratio(a: Optional[float], b: Optional[float]) -> str:
    return "" if not a or not b else f"{a / b:.2f}"


def comparison_table(results: dict) -> str:
    """Each of our engines against CTranslate2 (empty where CTranslate2 was not measured): the
    folder against CTranslate2 int8's, the peak RSS after the first translation and the time to
    the first translation (load included) against CTranslate2 at the same precision (:func:`ct2_peer`)."""
    lines = []
    for model, entry in results["models"].items():
        engines = entry["engines"]
        ct2_int8 = engines.get("ctranslate2 int8", {}).get("folder_bytes")
        for label, r in engines.items():
            peer = engines.get(ct2_peer(label) or "", {})
            if "skipped" in r or not label.startswith("ours ") or "folder_bytes" not in peer:
                continue
            folder = f"{r['folder_bytes'] / ct2_int8:.3f}" if ct2_int8 else ""
            lines.append(
                f"| {model} | {label} | {ct2_peer(label)} | {folder} | "
                f"{_ratio(r['peak_rss_after_first_translation'], peer['peak_rss_after_first_translation'])} | "
                f"{_ratio(r['first_translation_seconds'], peer['first_translation_seconds'])} |"
            )
    if not lines:
        return ""
    head = [
        "| model | engine | against | folder / CTranslate2 int8 folder | peak RSS after first translation / "
        "CTranslate2 | load + first translation / CTranslate2 |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    return "\n".join(head + lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {list(MODELS)}")
    p.add_argument("--repeats", type=int, default=3, help="worker processes per engine (medians)")
    p.add_argument(
        "--threads",
        type=int,
        default=2,
        help="intra-op threads of every engine (2: the int8 few-row step is used)",
    )
    p.add_argument(
        "--ct2-python", default=None, help="a Python that imports ctranslate2 (default: skip CTranslate2)"
    )
    p.add_argument(
        "--scratch", default=None, help="where the folders are built (default: a temporary folder)"
    )
    p.add_argument(
        "--no-inline",
        dest="inline",
        action="store_false",
        help="leave out the folders with the weights inside each graph (what the shared file saves)",
    )
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "bench_footprint.json"))
    p.add_argument("--worker", nargs=2, metavar=("ENGINE", "FOLDER"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker[0], args.worker[1], args.threads)))
        return 0
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    if unknown or not models:
        p.error(f"--models: unknown {unknown}, expected some of {list(MODELS)}")
    if args.repeats < 1 or args.threads < 1:
        p.error("--repeats and --threads must be >= 1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from benchmarks.common import write_json
    from transformer_ext.fsutil import atomic_write_text

    scratch = Path(args.scratch) if args.scratch else Path(tempfile.mkdtemp(prefix="bench_footprint_"))
    try:
        results = run(models, args.repeats, args.threads, scratch, args.ct2_python, args.inline)
    finally:
        if not args.scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    write_json(args.out, results)
    table = summary_table(results)
    atomic_write_text(os.path.splitext(args.out)[0] + ".md", table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
