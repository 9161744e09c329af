"""Decode speed on an imported MarianMT, T5 or mBART-50 checkpoint: ours against the tools its users would pick.

    python -m benchmarks.decode.bench_pretrained --size tiny                     # seconds: a smoke run
    python -m benchmarks.decode.bench_pretrained --size opus-mt-en-de \\
        --optimum-python /work/venv-optimum/bin/python --ct2-python /work/venv-optimum/bin/python
    python -m benchmarks.decode.bench_pretrained --size t5-base --optimum-python ... --ct2-python ...
    python -m benchmarks.decode.bench_pretrained --size mbart-large-50 --optimum-python ... --ct2-python ...

The sizes (``--size``): ``opus-mt-en-de`` and ``tiny`` (MarianMT, below); ``t5-base``
(google/t5-v1_1-base's shape: T5 v1.1, MADLAD-400's architecture, 12+12 layers, d_model 768, d_ff
2048 gated GELU, 12 heads, vocabulary 32,128, the relative position bias) and ``mbart-large-50``
(facebook/mbart-large-50-many-to-many-mmt's shape: 12+12 layers, d_model 1024, d_ff 4096, 16
heads, vocabulary 250,054), both written by transformers with random weights
(``pretrained_families.py``), ``mbart-large-50-vocab32k`` (the same layers with a 32,054-token
vocabulary), and ``t5-tiny`` / ``mbart-tiny`` (the same code path in seconds).
t5-base and mbart-large-50 decode 16 new tokens per sequence in 3 rounds, without ``eager`` unless
``--engines`` names it: the run's length on 2 cores. Their sources: T5's pieces then ``</s>``;
mBART-50's ``en_XX``, pieces, ``</s>``; both decode from their decoder start (``<pad>``, ``</s>``)
with nothing banned (their generation configs ban nothing; mBART-50's target language is not
forced, so every engine decodes freely).

The checkpoint. A Marian checkpoint with random weights is written by transformers
(``MarianMTModel(config).save_pretrained``; ``--size opus-mt-en-de``: the real model's dimensions,
vocabulary 58,101, d_model 512, 6+6 layers, 8 heads, d_ff 2048, swish, scaled embeddings, tied
output projection, ``<pad>`` as the decoder start and banned, as in Helsinki-NLP/opus-mt-en-de's
generation config; ``tiny``: a seconds-long smoke run). From that one folder, untimed:
``python -m transformer_ext.convert`` and ``python -m export.onnx`` (float32; ``export.quantize
int8``, no quality gate for random weights) for ours; ``optimum.exporters.onnx`` (``optimum-cli
export onnx --task text2text-generation-with-past``) in the Optimum environment; CTranslate2's
``ct2-transformers-converter`` (``--quantization float32`` and ``int8``) in its environment.

The engines, each in a process of its own that loads only what it needs (``decode_worker.py``;
the ONNX Runtime and CTranslate2 workers import no torch, checked there and recorded):

* ``transformers``: PyTorch ``generate`` (this environment's transformers), ``torch.set_num_threads(N)``;
* ``optimum``: Optimum's ``ORTModelForSeq2SeqLM.generate`` (requirements/optimum.txt, an
  environment of its own: ``--optimum-python``), the export with past key values (its merged
  decoder), its io-binding default (off on CPU), ``SessionOptions.intra_op_num_threads = N``;
* ``ctranslate2`` / ``ctranslate2_int8``: CTranslate2 ``translate_batch`` (``--ct2-python``; its
  converter needs torch and transformers < 4.58), ``intra_threads=N, inter_threads=1`` (split
  settings: ``inter_threads=W``, ``intra_threads=T``). Its
  Marian converter drops ``<pad>`` from the vocabulary (the decoder starts from a zero embedding),
  so ``<pad>`` cannot be generated, as the generation config's ``bad_words_ids`` asks;
* ``eager``, ``onnxrt``, ``onnxrt_int8``: ours (EagerRunner, OrtRunner on the float32 and the
  int8 export) with ``transformer_ext.decoding``.

An engine whose python is not given, does not exist or cannot import its engine is skipped; the
reason is logged and recorded in the JSON (``skipped_engines``).

What is decoded: the same sources (random ids, length 24, ``</s>`` last) through every engine,
exactly 48 new tokens per sequence (tiny: 8): ``min_new_tokens = max_new_tokens`` for
``generate`` (its forced ``</s>`` at the end off) and for ours, ``min_decoding_length =
max_decoding_length`` for CTranslate2; ``<pad>`` banned everywhere; greedy and beam 4 (the best
hypothesis; every hypothesis has the same length, so transformers' length penalty, ours
``"none"`` and CTranslate2's ``length_penalty=0`` rank alike), batch 1 and 16, 1 and 2 threads
and the 2x1 split (batch 1 included).
Tokens are compared before any time is taken: every float32 engine against transformers' (the
first float32 engine), token for token; a disagreement is logged as an error, the engine's entry
in the cell says ``tokens_match: false`` (and how many rows agree), the cell says
``float32_tokens_agree: false``, and the exit status is 1; it is still timed. The int8 engines
record their agreement with the float32 tokens and with each other, and each with its own
runtime's float32 engine (``agreement_with_own_float32``: rows equal, the mean common prefix, and
whether that is at least :data:`INT8_TOLERANCE` of the new tokens; below it a warning is logged).
Ours int8 is ``export.quantize int8`` with the quality gate off (``gate=False``: random weights
have no translations to gate on), recorded as ``int8_quality_gate``.

Thread settings (``--threads``): ``N`` runs every engine on N threads; ``WxT`` (for example
``2x1``) splits each batch over W workers of T threads for the engines that can (ours: W
OrtRunners, each in a worker process, ``runtimes.procpool``; CTranslate2: ``inter_threads=W``), as
``bench_decode.py`` does; transformers and Optimum have no such setting and sit it out, so in a
split cell the tokens are compared against CTranslate2 float32's. Each engine's "best" is its
fastest setting over all of them.

Timing: one worker per engine and thread setting; per cell, ``--rounds`` rounds, every engine once
per round in a rotating order, medians reported (docs/DESIGN.md section 4). The JSON records the
machine (benchmarks/common.py: lscpu model, ISA flags, L3, measured read and copy bandwidth per
thread count; the load average before and after) and the ratios side by side: ours ONNX Runtime
float32 against Optimum, transformers ``generate`` and CTranslate2 float32, ours int8 against
CTranslate2 int8, ours eager against transformers, each at equal threads and each engine at its
best thread count. A PNG of tokens/s per cell goes beside the JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

import numpy as np

HERE = Path(__file__).resolve().parents[1]  # benchmarks/ (results/ lives here)
REPO = HERE.parent
from benchmarks.common import environment, machine_info, write_json
from benchmarks.decode import pretrained_families
from benchmarks.decode.bench_decode import (
    SPLITTABLE,
    Engine,
    EngineProcess,
    measure_case,
    parse_setting,
    plot,
    setting_threads,
    setting_workers,
)

logger = logging.getLogger("bench_pretrained")

SIZES = {
    "tiny": dict(
        family="marian",
        d_model=32,
        layers=2,
        heads=4,
        d_ff=64,
        vocab_size=120,
        max_positions=64,
        src_len=12,
        new_tokens=8,
        embed_std=0.3,
        gain=2.0,
        rounds=5,
    ),
    "opus-mt-en-de": dict(
        family="marian",
        d_model=512,
        layers=6,
        heads=8,
        d_ff=2048,
        vocab_size=58101,
        max_positions=512,
        src_len=24,
        new_tokens=48,
        embed_std=0.3,
        gain=2.0,
        rounds=5,
    ),
    # google/t5-v1_1-base's shape (pretrained_families.py); eager left out of the default engines
    # (--engines adds it) and 16 new tokens, 3 rounds: the run's length on 2 cores
    "t5-tiny": dict(
        family="t5",
        d_model=32,
        d_kv=8,
        layers=2,
        heads=4,
        d_ff=64,
        vocab_size=160,
        buckets=32,
        max_distance=128,
        max_positions=64,
        src_len=12,
        new_tokens=8,
        embed_std=0.3,
        lm_std=0.5,
        gain=2.0,
        rounds=5,
    ),
    "t5-base": dict(
        family="t5",
        d_model=768,
        d_kv=64,
        layers=12,
        heads=12,
        d_ff=2048,
        vocab_size=32128,
        buckets=32,
        max_distance=128,
        max_positions=512,
        src_len=24,
        new_tokens=16,
        embed_std=0.3,
        lm_std=0.3,
        gain=2.0,
        rounds=3,
        default_engines=(
            "transformers",
            "optimum",
            "ctranslate2",
            "onnxrt",
            "onnxrt_int8",
            "ctranslate2_int8",
        ),
    ),
    # facebook/mbart-large-50-many-to-many-mmt's shape (pretrained_families.py)
    "mbart-tiny": dict(
        family="mbart",
        d_model=32,
        layers=2,
        heads=4,
        d_ff=64,
        vocab_size=154,
        max_positions=64,
        src_len=12,
        new_tokens=8,
        embed_std=0.3,
        gain=2.0,
        rounds=5,
    ),
    "mbart-large-50": dict(
        family="mbart",
        d_model=1024,
        layers=12,
        heads=16,
        d_ff=4096,
        vocab_size=250054,
        max_positions=1024,
        src_len=24,
        new_tokens=16,
        embed_std=0.3,
        gain=2.0,
        rounds=3,
        default_engines=(
            "transformers",
            "optimum",
            "ctranslate2",
            "onnxrt",
            "onnxrt_int8",
            "ctranslate2_int8",
        ),
    ),
    # mbart-large-50 with a 32,054-token vocabulary (32,000 pieces): the same layers, an output
    # projection an eighth the size, for a run nearer t5-base's length
    "mbart-large-50-vocab32k": dict(
        family="mbart",
        d_model=1024,
        layers=12,
        heads=16,
        d_ff=4096,
        vocab_size=32054,
        max_positions=1024,
        src_len=24,
        new_tokens=16,
        embed_std=0.3,
        gain=2.0,
        rounds=3,
        default_engines=(
            "transformers",
            "optimum",
            "ctranslate2",
            "onnxrt",
            "onnxrt_int8",
            "ctranslate2_int8",
        ),
    ),
}
MODES = ("greedy", "beam4")
EOS = 0  # Marian: </s> is id 0, <unk> 1, <pad> the last id

# Which python runs each engine: this environment's ("main"), Optimum's or CTranslate2's.
ENGINES: list[tuple[Engine, str]] = [
    (
        Engine(
            "transformers",
            "transformers generate (PyTorch), the checkpoint's generation config",
            "transformers",
            "hf",
            "float32",
            False,
        ),
        "main",
    ),
    (
        Engine(
            "optimum",
            "Optimum ORTModelForSeq2SeqLM.generate (ONNX Runtime, export with past key values)",
            "optimum",
            "optimum",
            "float32",
            False,
        ),
        "optimum",
    ),
    (
        Engine(
            "ctranslate2",
            "CTranslate2 float32 (ct2-transformers-converter)",
            "ctranslate2",
            "ct2",
            "float32",
            True,
            "float32",
        ),
        "ct2",
    ),
    (
        Engine(
            "eager",
            "ours: EagerRunner (torch, compiled ops, in-place cache)",
            "eager",
            "model",
            "float32",
            False,
        ),
        "main",
    ),
    (
        Engine(
            "onnxrt", "ours: OrtRunner on python -m export.onnx (float32)", "onnxrt", "onnx", "float32", True
        ),
        "main",
    ),
    (
        Engine(
            "onnxrt_int8",
            "ours: OrtRunner on export.quantize int8 (dynamic int8, per-channel)",
            "onnxrt",
            "onnx_int8",
            "int8",
            True,
        ),
        "main",
    ),
    (
        Engine(
            "ctranslate2_int8",
            "CTranslate2 int8 (ct2-transformers-converter --quantization int8)",
            "ctranslate2",
            "ct2_int8",
            "int8",
            True,
            "int8",
        ),
        "ct2",
    ),
]
ENGINE_NAMES = [e.name for e, _ in ENGINES]
# (ours, peer) pairs of the ratios
PAIRS = (
    ("onnxrt", "optimum"),
    ("onnxrt", "transformers"),
    ("onnxrt", "ctranslate2"),
    ("onnxrt_int8", "ctranslate2_int8"),
    ("eager", "transformers"),
)
# What a python must import to run an environment's engines.
ENV_MODULES = {"optimum": "optimum.onnxruntime, onnxruntime", "ct2": "ctranslate2"}


# ------------------------------------------------------------------------------------------
# The checkpoint and the artifacts (untimed)
# ------------------------------------------------------------------------------------------


def write_checkpoint(folder: Path, size: dict) -> None:
    """The transformers checkpoint of ``size``: its family's writer (Marian here, T5 and mBART-50 in
    pretrained_families.py)."""
    family = size.get("family", "marian")
    if family == "t5":
        pretrained_families.write_t5(folder, size)
    elif family == "mbart":
        pretrained_families.write_mbart(folder, size)
    else:
        write_marian(folder, size)


def specials(size: dict) -> pretrained_families.Specials:
    """The decoder start, ``</s>``, the banned ids and the source ids of ``size``'s family."""
    family = size.get("family", "marian")
    if family == "t5":
        return pretrained_families.t5_specials(size)
    if family == "mbart":
        return pretrained_families.mbart_specials(size)
    pad = size["vocab_size"] - 1  # Marian: </s> 0, <unk> 1, <pad> the last id
    return pretrained_families.Specials(
        decoder_start=pad, eos=EOS, banned=(pad,), source_ids=(2, pad), source_suffix=(EOS,)
    )


def write_marian(folder: Path, size: dict) -> None:
    """A Marian checkpoint of ``size`` written by transformers (random weights as in the tests'
    checkpoints, a dummy SentencePiece vocabulary of the right size, opus-mt-en-de's generation
    config)."""
    import torch
    from transformers import GenerationConfig, MarianConfig, MarianMTModel

    sys.path.insert(0, str(REPO / "tests"))
    from hf_checkpoints import _random_weights, marian_vocab, sample_lines, train_spm

    folder.mkdir(parents=True, exist_ok=True)
    spm = train_spm(sample_lines(400, 0), 100)
    vocab = marian_vocab(spm)
    vocab.pop("<pad>")
    while len(vocab) < size["vocab_size"] - 1:  # filler pieces up to the real vocabulary size
        vocab[f"\u2581filler{len(vocab)}"] = len(vocab)
    vocab["<pad>"] = len(vocab)
    pad = vocab["<pad>"]
    (folder / "source.spm").write_bytes(spm)
    (folder / "target.spm").write_bytes(spm)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    config = MarianConfig(
        vocab_size=len(vocab),
        decoder_vocab_size=len(vocab),
        d_model=size["d_model"],
        encoder_layers=size["layers"],
        decoder_layers=size["layers"],
        encoder_attention_heads=size["heads"],
        decoder_attention_heads=size["heads"],
        encoder_ffn_dim=size["d_ff"],
        decoder_ffn_dim=size["d_ff"],
        max_position_embeddings=size["max_positions"],
        activation_function="swish",
        scale_embedding=True,
        pad_token_id=pad,
        decoder_start_token_id=pad,
        eos_token_id=EOS,
        forced_eos_token_id=EOS,
    )
    torch.manual_seed(0)
    model = MarianMTModel(config)
    # Random weights drawn as the parity tests' checkpoints draw them (biases and LayerNorms not
    # all alike, which the export contract would take for one weight stored twice; logits spread
    # widely, so that float32 rounding never decides a token). Random weights give repetitive
    # output (at opus-mt-en-de size about one token repeated per source; each cell records how
    # many distinct tokens the compared decode holds); smaller embeddings gave more varied tokens
    # but near-ties that float32 engines broke differently. <pad>'s embedding row stays zero.
    _random_weights(model, 0, std=size["embed_std"], gain=size["gain"])
    with torch.no_grad():
        model.get_input_embeddings().weight[pad].zero_()
    model.tie_weights()
    model.generation_config = GenerationConfig(
        bad_words_ids=[[pad]],
        num_beams=4,
        max_length=512,
        decoder_start_token_id=pad,
        pad_token_id=pad,
        eos_token_id=EOS,
        forced_eos_token_id=EOS,
    )
    model.save_pretrained(folder)


def _run_tool(what: str, argv: list[str]) -> None:
    logger.info("%s ...", what)
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise RuntimeError(f"{what} failed (exit status {proc.returncode}):\n{tail}")


def prepare(size: dict, engines: list[Engine], pythons: dict, scratch: Path) -> dict:
    """Every artifact the engines read, built once from one transformers checkpoint: ``{artifact:
    folder}``."""
    from export.onnx import export_onnx
    from export.quantize import quantize_export
    from transformer_ext.convert import convert_transformers

    needed = {e.artifact for e in engines}
    paths = {"hf": scratch / "hf"}
    logger.info("writing the transformers checkpoint (untimed) ...")
    write_checkpoint(paths["hf"], size)
    if needed & {"model", "onnx", "onnx_int8"}:
        paths["model"] = convert_transformers(paths["hf"], scratch / "model")
    if needed & {"onnx", "onnx_int8"}:
        logger.info("exporting ours to ONNX (untimed) ...")
        paths["onnx"] = scratch / "onnx"
        cache_len = min(size["max_positions"], max(64, size["new_tokens"] + 1))
        export_onnx(paths["model"], paths["onnx"], validate=False, cache_len=cache_len)
    if "onnx_int8" in needed:
        paths["onnx_int8"] = scratch / "onnx_int8"
        # random weights have no translation quality to gate on: INT8_GATE, recorded in the JSON
        quantize_export(paths["onnx"], paths["onnx_int8"], "int8", gate=False)
    if "optimum" in needed:
        paths["optimum"] = scratch / "optimum"
        _run_tool(
            "optimum-cli export onnx (untimed)",
            [
                pythons["optimum"],
                "-m",
                "optimum.exporters.onnx",
                "--model",
                str(paths["hf"]),
                "--task",
                "text2text-generation-with-past",
                str(paths["optimum"]),
            ],
        )
    for artifact, quantization in (("ct2", "float32"), ("ct2_int8", "int8")):
        if artifact in needed:
            paths[artifact] = scratch / artifact
            _run_tool(
                f"ct2-transformers-converter --quantization {quantization} (untimed)",
                [
                    pythons["ct2"],
                    "-c",
                    "import sys; from ctranslate2.converters.transformers import main; sys.exit(main())",
                    "--model",
                    str(paths["hf"]),
                    "--output_dir",
                    str(paths[artifact]),
                    "--quantization",
                    quantization,
                ],
            )
    return {k: str(v) for k, v in paths.items()}


def _prepare_kept(size: dict, engines: list[Engine], pythons: dict, folder: Path) -> dict:
    """:func:`prepare` into ``folder``, a new folder left in place; on any failure or interruption
    the folder and the parents made for it are removed (nothing half-built is left)."""
    from export.manifest import make_parents, remove_made_parents

    made: list[Path] = []
    try:
        make_parents(folder, made)
        folder.mkdir()
        try:
            return prepare(size, engines, pythons, folder)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
    except BaseException:
        remove_made_parents(made)
        raise


def check_python(env: str, python: Optional[str]) -> Optional[str]:
    """Why the engines of ``env`` cannot run with ``python`` (None: they can)."""
    if env == "main":
        return None
    flag = "--optimum-python" if env == "optimum" else "--ct2-python"
    if not python:
        return f"no {flag} given"
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        return f"{flag} {python}: no such executable"
    modules = ENV_MODULES[env]
    proc = subprocess.run([python, "-c", f"import {modules}"], capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return f"{flag} {python} cannot import {modules}: {last}"
    return None


def make_sources(batch: int, src_len: int, pad: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``batch`` Marian sources of ``src_len`` ids (random pieces, neither ``</s>``, ``<unk>`` nor
    ``<pad>``, then ``</s>``), as Marian's tokenizer ends a source."""
    rng = random.Random(seed)
    rows = [[rng.randrange(2, pad) for _ in range(src_len - 1)] + [EOS] for _ in range(batch)]
    return np.array(rows, dtype=np.int64), np.full(batch, src_len, dtype=np.int64)


# An int8 engine against the float32 engine of its own runtime (random weights: int8 drifts from
# float32 sooner or later in a row; the tolerance says how soon is still expected).
INT8_FLOAT32 = {"onnxrt_int8": "onnxrt", "ctranslate2_int8": "ctranslate2"}
INT8_TOLERANCE = 0.5  # mean common prefix with its own float32 tokens, a fraction of the new tokens
INT8_GATE = (
    "ours int8: export.quantize int8 with its quality gate off (quantize_export(gate=False)): the gate "
    "compares translations against references, which random weights do not have; CTranslate2 int8 has none"
)


def int8_agreement(tokens: list, reference: list, n: int) -> dict:
    """An int8 engine's tokens against its own float32 engine's: the rows equal, the mean common
    prefix (a fraction of ``n``) and whether it is within :data:`INT8_TOLERANCE`."""
    prefixes = []
    for mine, theirs in zip(tokens, reference):
        k = 0
        while k < min(len(mine), len(theirs)) and mine[k] == theirs[k]:
            k += 1
        prefixes.append(k / n)
    mean = float(np.mean(prefixes)) if prefixes else 1.0
    return dict(
        rows_equal=float(np.mean([a == b for a, b in zip(tokens, reference)])) if tokens else 1.0,
        mean_common_prefix=mean,
        tolerance=INT8_TOLERANCE,
        within_tolerance=mean >= INT8_TOLERANCE,
    )


class _FirstDecode:
    """A worker whose first decode after :meth:`reset` is kept (measure_case's compared decode)."""

    def __init__(self, worker):
        self.worker, self.tokens = worker, None

    def reset(self) -> None:
        self.tokens = None

    def __call__(self, *args):
        out = self.worker(*args)
        if self.tokens is None:
            self.tokens = out[0]
        return out


# ------------------------------------------------------------------------------------------
# Ratios and the report
# ------------------------------------------------------------------------------------------


def ratios(cases: list[dict]) -> list[dict]:
    """Ours / peer in tokens per second for every pair of :data:`PAIRS` both of which ran: per
    cell at equal threads, and per (mode, batch) each at its own best thread count."""

    def tps(case, name):
        return case["engines"].get(name, {}).get("tokens_per_second")

    def agree(case, name):
        return case["engines"].get(name, {}).get("tokens_match", True)

    rows = []
    for ours, peer in PAIRS:
        for c in cases:
            if tps(c, ours) and tps(c, peer):
                rows.append(
                    dict(
                        ours=ours,
                        peer=peer,
                        mode=c["mode"],
                        batch=c["batch"],
                        threads=c["threads"],
                        ratio=tps(c, ours) / tps(c, peer),
                        tokens_agree=agree(c, ours) and agree(c, peer),
                    )
                )
        for mode, batch in sorted({(c["mode"], c["batch"]) for c in cases}):
            group = [c for c in cases if (c["mode"], c["batch"]) == (mode, batch)]
            best = {}
            for name in (ours, peer):
                timed = [(tps(c, name), c["threads"], c) for c in group if tps(c, name)]
                if timed:
                    best[name] = max(timed, key=lambda x: x[0])
            if len(best) == 2:
                rows.append(
                    dict(
                        ours=ours,
                        peer=peer,
                        mode=mode,
                        batch=batch,
                        threads="best",
                        ours_threads=best[ours][1],
                        peer_threads=best[peer][1],
                        ratio=best[ours][0] / best[peer][0],
                        tokens_agree=agree(best[ours][2], ours) and agree(best[peer][2], peer),
                    )
                )
    return rows


def summary_table(results: dict) -> str:
    names = [e["name"] for e in results["engines"]]
    lines = [f"{results['size']}: tokens/s (median of {results['rounds']} rounds)"]
    lines.append(f"{'cell':<16}" + "".join(f"{n:>18}" for n in names))
    for c in results["models"][results["size"]]["cases"]:
        cells = []
        for n in names:
            e = c["engines"].get(n, {})
            mark = "" if e.get("tokens_match", True) else "!"
            cells.append(
                f"{e['tokens_per_second']:17.1f}{mark or ' '}" if "tokens_per_second" in e else f"{'-':>18}"
            )
        lines.append(
            f"{c['mode'] + ' b' + str(c['batch']) + ' ' + str(c['threads']) + 't':<16}" + "".join(cells)
        )
    lines.append("(! = float32 tokens differ from transformers')")
    lines.append("ratios (ours / peer, tokens/s):")
    for r in results["ratios"]:
        threads = (
            f"best ({r['ours_threads']}t vs {r['peer_threads']}t)"
            if r["threads"] == "best"
            else f"{r['threads']}t"
        )
        flag = "" if r["tokens_agree"] else "  TOKENS DIFFER"
        lines.append(
            f"  {r['ours']:<12} vs {r['peer']:<17} {r['mode']:<6} b{r['batch']:<3} {threads:<20} "
            f"{r['ratio']:6.2f}x{flag}"
        )
    for name, reason in results["skipped_engines"].items():
        lines.append(f"skipped {name}: {reason}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------
# The benchmark
# ------------------------------------------------------------------------------------------


def _check_run_args(size_name, engine_names, modes, keep_artifacts, prepare_only) -> None:
    if size_name not in SIZES:
        raise ValueError(f"unknown size {size_name!r}; available: {sorted(SIZES)}")
    if keep_artifacts is not None and os.path.lexists(keep_artifacts):
        raise ValueError(f"--keep-artifacts {keep_artifacts}: it exists; give a folder to create")
    if prepare_only and keep_artifacts is None:
        raise ValueError("--prepare-only needs --keep-artifacts DIR (where the models are left)")
    if engine_names is not None:
        unknown = sorted(set(engine_names) - set(ENGINE_NAMES))
        if unknown:
            raise ValueError(f"unknown engines {unknown}; available: {ENGINE_NAMES}")
    bad_modes = sorted(set(modes) - set(MODES))
    if bad_modes:
        raise ValueError(f"unknown modes {bad_modes}; available: {list(MODES)}")


def _select_engines(engine_names, reasons) -> tuple[list, dict, dict]:
    """The engines to run (those asked for whose environment is usable), the environment of each,
    and the skipped ones with the reason."""
    engines, envs, skipped = [], {}, {}
    for engine, env in ENGINES:
        if engine_names is not None and engine.name not in engine_names:
            continue
        if reasons[env]:
            skipped[engine.name] = reasons[env]
            logger.warning("skipping %s: %s", engine.name, reasons[env])
            continue
        engines.append(engine)
        envs[engine.name] = env
    if not engines:
        raise ValueError("no engine left to run")
    return engines, envs, skipped


def _measure_setting(
    entry, engines, envs, pythons, paths, size_name, size, threads, modes, batch_sizes, rounds
):
    """Every case of one thread setting, each engine in a worker process of its own, appended to
    ``entry["cases"]``."""
    sp = specials(size)
    workers: dict = {}
    n_workers = setting_workers(threads)
    # a split setting runs the engines whose worker can split a batch
    setting_engines = [e for e in engines if n_workers == 1 or e.worker in SPLITTABLE]
    try:
        for e in setting_engines:
            more: dict = {"banned_ids": list(sp.banned)}
            if e.worker == "ctranslate2":
                more["vocabulary"] = os.path.join(paths[e.artifact], "shared_vocabulary.json")
            if n_workers > 1:
                more["workers"] = n_workers
            workers[e.name] = EngineProcess(
                e,
                paths[e.artifact],
                setting_threads(threads),
                {"bos_id": sp.decoder_start, "eos_id": sp.eos},
                python=pythons[envs[e.name]],
                extra=more,
            )
            entry["workers"][f"{e.name}/{threads}"] = workers[e.name].info
        for mode in modes:
            for batch in batch_sizes:
                # a batch smaller than the split still runs: CTranslate2 with inter_threads=W at
                # batch 1 is a setting a user may pick, and is timed as such
                logger.info("%s %s batch %d, %s thread(s) ...", size_name, mode, batch, threads)
                recorders = {name: _FirstDecode(w) for name, w in workers.items()}
                case = measure_case(
                    recorders,
                    setting_engines,
                    mode,
                    batch,
                    {},
                    rounds,
                    sources=sp.sources(batch, size["src_len"]),
                    new_tokens=size["new_tokens"],
                    time_mismatched=True,
                )
                case["threads"] = threads
                for q, f in INT8_FLOAT32.items():
                    if q in recorders and f in recorders:
                        agreement = int8_agreement(
                            recorders[q].tokens, recorders[f].tokens, size["new_tokens"]
                        )
                        case["engines"][q]["agreement_with_own_float32"] = dict(engine=f, **agreement)
                        if not agreement["within_tolerance"]:
                            logger.warning(
                                "%s batch %d, %s thread(s): %s keeps to %s for %.0f%% of the tokens "
                                "on average (tolerance %.0f%%)",
                                mode,
                                batch,
                                threads,
                                q,
                                f,
                                100 * agreement["mean_common_prefix"],
                                100 * INT8_TOLERANCE,
                            )
                for name, e in case["engines"].items():
                    differ = (
                        ""
                        if e.get("tokens_match", True)
                        else f"  TOKENS DIFFER from {case['reference_engine']}"
                    )
                    logger.info("  %-17s %8.1f tokens/s%s", name, e["tokens_per_second"], differ)
                entry["cases"].append(case)
    finally:
        for w in workers.values():
            w.close()


def run(
    size_name: str,
    out: str,
    *,
    engine_names: Optional[list[str]] = None,
    modes=MODES,
    batch_sizes=(1, 16),
    threads_list=(1, 2),
    rounds: Optional[int] = None,
    optimum_python: Optional[str] = None,
    ct2_python: Optional[str] = None,
    scratch: Optional[str] = None,
    keep_artifacts: Optional[str] = None,
    prepare_only: bool = False,
) -> dict:
    """Run the benchmark, write ``out`` (JSON) and the PNG beside it; returns the results.

    ``keep_artifacts``: a new folder to build the models in and leave there (for
    ``profile_decode.py --export DIR/onnx_int8``, say) instead of a temporary one;
    ``prepare_only``: build them and return ``{"artifacts": {name: folder}}``, nothing timed or
    written besides. ``engine_names`` None: the size's ``default_engines`` (all of them where it has
    none); ``rounds`` None: the size's."""
    import tempfile

    _check_run_args(size_name, engine_names, modes, keep_artifacts, prepare_only)
    size = SIZES[size_name]
    if engine_names is None and "default_engines" in size:
        engine_names = list(size["default_engines"])
    rounds = size["rounds"] if rounds is None else rounds
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    sp = specials(size)
    pythons = {"main": sys.executable, "optimum": optimum_python, "ct2": ct2_python}
    reasons = {env: check_python(env, pythons[env]) for env in ("main", "optimum", "ct2")}
    engines, envs, skipped = _select_engines(engine_names, reasons)
    if keep_artifacts is not None:
        paths = _prepare_kept(size, engines, pythons, Path(keep_artifacts))
        if prepare_only:
            logger.info("models in %s: %s", keep_artifacts, ", ".join(sorted(paths)))
            return {"artifacts": paths}
    results: dict = {
        "size": size_name,
        "family": size.get("family", "marian"),
        "config": size,
        "src_len": size["src_len"],
        "new_tokens": size["new_tokens"],
        "modes": list(modes),
        "batch_sizes": list(batch_sizes),
        "threads": list(threads_list),
        "rounds": rounds,
        "decoding": (
            f"exactly {size['new_tokens']} new tokens per sequence (EOS suppressed until then, "
            "no forced EOS), "
            + (f"ids {list(sp.banned)} banned, " if sp.banned else "nothing banned, ")
            + f"decoder start {sp.decoder_start}, "
            "beam 4 best hypothesis (equal lengths: length penalties rank alike), "
            "tokens compared before timing"
        ),
        "int8_quality_gate": INT8_GATE,
        "int8_tolerance": (
            f"each int8 engine's tokens against its own runtime's float32 tokens: the mean common "
            f"prefix at least {INT8_TOLERANCE:.0%} of the new tokens (agreement_with_own_float32; "
            "logged, not an error)"
        ),
        "engine_processes": "one per engine and thread count (decode_worker.py), rounds interleaved",
        "engines": [
            {"name": e.name, "description": e.description, "dtype": e.dtype, "python": pythons[envs[e.name]]}
            for e in engines
        ],
        "skipped_engines": skipped,
        "machine": machine_info(tuple(sorted({setting_threads(t) for t in threads_list}))),
        "environment": environment(),
        "load_average_start": os.getloadavg(),
        "models": {},
    }
    with tempfile.TemporaryDirectory(prefix="bench_pretrained_", dir=scratch) as tmp:
        if keep_artifacts is None:
            paths = prepare(size, engines, pythons, Path(tmp))
        entry: dict = {"artifacts": sorted(paths), "workers": {}, "cases": []}
        for threads in threads_list:
            _measure_setting(
                entry, engines, envs, pythons, paths, size_name, size, threads, modes, batch_sizes, rounds
            )
    results["models"][size_name] = entry
    results["ratios"] = ratios(entry["cases"])
    results["float32_tokens_agree"] = all(c["float32_tokens_agree"] for c in entry["cases"])
    results["load_average_end"] = os.getloadavg()
    write_json(out, results)
    plot(results, os.path.splitext(out)[0] + ".png")
    logger.info("wrote %s and %s", out, os.path.splitext(out)[0] + ".png")
    return results


def _ints(text: str, flag: str, parser) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        parser.error(f"{flag} takes comma-separated integers, got {text!r}")
    if min(values) < 1:
        parser.error(f"{flag} values must be >= 1, got {text!r}")
    return values


def _settings(text: str, parser) -> list:
    try:
        return [parse_setting(t) for t in text.split(",")]
    except ValueError as exc:
        parser.error(f"--threads takes comma-separated settings N or WxT ({exc})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default="opus-mt-en-de")
    p.add_argument(
        "--engines",
        default=None,
        help=f"comma-separated subset of {ENGINE_NAMES} (default: all; t5-base and the mbart-large-50 "
        "sizes: all but eager)",
    )
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of greedy,beam4")
    p.add_argument("--batch-sizes", default="1,16", help="comma-separated batch sizes (default: 1,16)")
    p.add_argument(
        "--threads",
        default="1,2,2x1",
        help="comma-separated thread settings: N threads, or WxT (the batch split over W workers of "
        "T threads; ours and CTranslate2 only) (default: 1,2,2x1)",
    )
    p.add_argument(
        "--rounds",
        "--repeats",
        type=int,
        default=None,
        help="timed rounds per cell (default: the size's: 5, or 3 for t5-base and the mbart-large-50 sizes)",
    )
    p.add_argument(
        "--optimum-python", default=None, help="python of the Optimum environment (requirements/optimum.txt)"
    )
    p.add_argument(
        "--ct2-python",
        default=None,
        help="python of an environment with ctranslate2 4.8.5 (and its converter)",
    )
    p.add_argument(
        "--scratch", default=None, help="where the temporary model folders go (default: the system's)"
    )
    p.add_argument(
        "--out",
        default=None,
        help="JSON path (default: benchmarks/results/bench_pretrained[_tiny].json); the PNG goes beside it",
    )
    p.add_argument(
        "--keep-artifacts",
        default=None,
        metavar="DIR",
        help="build the models in DIR (a new folder) and leave them there, e.g. for "
        "profile_decode.py --export DIR/onnx_int8",
    )
    p.add_argument(
        "--prepare-only", action="store_true", help="with --keep-artifacts: build the models, time nothing"
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.rounds is not None and args.rounds < 1:
        p.error("--rounds must be >= 1")
    suffix = "" if args.size == "opus-mt-en-de" else f"_{args.size}"
    out = args.out or str(HERE / "results" / f"bench_pretrained{suffix}.json")
    try:
        results = run(
            args.size,
            out,
            engine_names=args.engines.split(",") if args.engines else None,
            modes=args.modes.split(","),
            batch_sizes=_ints(args.batch_sizes, "--batch-sizes", p),
            threads_list=_settings(args.threads, p),
            rounds=args.rounds,
            optimum_python=args.optimum_python,
            ct2_python=args.ct2_python,
            scratch=args.scratch,
            keep_artifacts=args.keep_artifacts,
            prepare_only=args.prepare_only,
        )
    except ValueError as exc:
        p.error(str(exc))
    if args.prepare_only:
        return 0
    print(summary_table(results))
    if not results["float32_tokens_agree"]:
        logger.error("float32 engines disagree with transformers' tokens in some cells (marked '!')")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
