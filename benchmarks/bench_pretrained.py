"""Decode speed on an imported MarianMT checkpoint: transformers ``generate`` against ours.

    python benchmarks/bench_pretrained.py --size tiny --out results/bench_pretrained_tiny.json
    python benchmarks/bench_pretrained.py --size opus-mt-en-de --out results/bench_pretrained.json

A Marian checkpoint with random weights is written by transformers (``--size opus-mt-en-de``: the
real model's dimensions, vocabulary 58,101, d_model 512, 6+6 layers, 8 heads, d_ff 2048, swish,
scaled embeddings; ``tiny``: a seconds-long smoke run), converted with
``python -m transformer_ext.convert`` and exported with ``python -m export.onnx``. Every engine
runs in a process of its own (docs/DESIGN.md section 4): ``transformers`` (PyTorch ``generate``
with the checkpoint's generation config), ``ours-eager`` (EagerRunner) and ``ours-ort`` (OrtRunner,
float32), each decoding the same sources greedily and with beam 4 at batch 1 and 16 and 1 and 2
threads, rounds interleaved; the tokens are compared before any time is reported (float32 engines
must agree token for token). The Optimum (``ORTModelForSeq2SeqLM``, its environment:
requirements/optimum.txt) and CTranslate2 peers of the issue are not implemented here yet.
The JSON records the machine (benchmarks/common.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SIZES = {
    "tiny": dict(
        d_model=32, layers=2, heads=4, d_ff=64, vocab_size=120, max_positions=64, sources=8, src_len=12
    ),
    "opus-mt-en-de": dict(
        d_model=512, layers=6, heads=8, d_ff=2048, vocab_size=58101, max_positions=512, sources=16, src_len=24
    ),
}
ENGINES = ("transformers", "ours-eager", "ours-ort")
MODES = ("greedy", "beam4")


def _write_checkpoint(folder: Path, size: dict) -> None:
    """A Marian checkpoint of ``size`` written by transformers (random weights, a dummy SentencePiece
    vocabulary of the right size)."""
    import torch
    from transformers import GenerationConfig, MarianConfig, MarianMTModel

    sys.path.insert(0, str(REPO / "tests"))
    from hf_checkpoints import marian_vocab, sample_lines, train_spm

    folder.mkdir(parents=True, exist_ok=True)
    spm = train_spm(sample_lines(400, 0), 100)
    vocab = marian_vocab(spm)
    pad = vocab.pop("<pad>")
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
        eos_token_id=0,
        forced_eos_token_id=0,
    )
    torch.manual_seed(0)
    model = MarianMTModel(config)
    model.generation_config = GenerationConfig(
        bad_words_ids=[[pad]],
        num_beams=4,
        max_length=49,  # 48 generated tokens at most
        decoder_start_token_id=pad,
        pad_token_id=pad,
        eos_token_id=0,
        forced_eos_token_id=0,
    )
    model.save_pretrained(folder)


def _sources(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(2, vocab - 1) for _ in range(length - 1)] + [0] for _ in range(n)]


# ------------------------------------------------------------------------------------------
# workers (one process per engine)
# ------------------------------------------------------------------------------------------


def _worker(
    engine: str, folder: str, sources: list, batch: int, mode: str, threads: int, repeats: int
) -> dict:
    import numpy as np

    beam = mode == "beam4"
    if engine == "transformers":
        import torch
        from transformers import AutoModelForSeq2SeqLM

        torch.set_num_threads(threads)
        model = AutoModelForSeq2SeqLM.from_pretrained(folder).eval()

        def run(chunk):
            with torch.no_grad():
                out = model.generate(input_ids=torch.tensor(chunk), num_beams=4 if beam else 1)
            rows = []
            for row in out[:, 1:].tolist():
                row = row[: row.index(0)] if 0 in row else row
                rows.append([t for t in row if t != model.config.pad_token_id])
            return rows

    else:
        from transformer_ext.convert.generation import read_generation_defaults
        from transformer_ext.decoding import beam_search, greedy_decode
        from transformer_ext.tokenizer import load_tokenizer

        if engine == "ours-ort":
            from transformer_ext.runtimes import OrtRunner

            runner = OrtRunner(folder, intra_op_num_threads=threads)
        else:
            import torch

            from transformer_ext.checkpoint import load_model
            from transformer_ext.runtimes import EagerRunner

            torch.set_num_threads(threads)
            runner = EagerRunner(load_model(folder))
        tok, gen = load_tokenizer(folder), read_generation_defaults(folder)

        def run(chunk):
            ids = np.array(chunk, dtype=np.int64)
            lengths = np.full(len(chunk), ids.shape[1], dtype=np.int64)
            options = gen.search_options(tok, len(chunk), beam=beam)
            if beam:
                return [h[0].tokens for h in beam_search(runner, ids, lengths, **options)]
            return greedy_decode(runner, ids, lengths, **options)

    chunks = [sources[i : i + batch] for i in range(0, len(sources), batch)]
    tokens = [t for chunk in chunks for t in run(chunk)]  # warm-up, and the tokens compared
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for chunk in chunks:
            run(chunk)
        times.append(time.perf_counter() - t0)
    return {"tokens": tokens, "seconds": sorted(times)[len(times) // 2], "generated": sum(map(len, tokens))}


def _run_worker(engine, folder, sources, batch, mode, threads, repeats) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    payload = json.dumps(
        dict(
            engine=engine,
            folder=folder,
            sources=sources,
            batch=batch,
            mode=mode,
            threads=threads,
            repeats=repeats,
        )
    )
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", payload], capture_output=True, text=True, env=env, timeout=7200
    )
    if proc.returncode != 0:
        raise RuntimeError(f"engine {engine} failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------
# the benchmark
# ------------------------------------------------------------------------------------------


def run(
    size_name: str, out: str, batches=(1, 16), threads_list=(1, 2), modes=MODES, repeats: int = 3
) -> dict:
    sys.path.insert(0, str(HERE))
    from common import machine_info, write_json

    from export.onnx import export_onnx
    from transformer_ext.convert import convert_transformers

    size = SIZES[size_name]
    with tempfile.TemporaryDirectory() as tmp:
        hf, ours, onnx_dir = Path(tmp) / "hf", Path(tmp) / "ours", Path(tmp) / "onnx"
        _write_checkpoint(hf, size)
        convert_transformers(hf, ours)
        export_onnx(ours, onnx_dir, validate=False)
        folders = {"transformers": str(hf), "ours-eager": str(ours), "ours-ort": str(onnx_dir)}
        sources = _sources(size["sources"], size["src_len"], size["vocab_size"])
        cells = []
        for mode in modes:
            for batch in batches:
                for threads in threads_list:
                    results = {
                        e: _run_worker(e, folders[e], sources, batch, mode, threads, repeats) for e in ENGINES
                    }
                    reference = results["transformers"]["tokens"]
                    for e, r in results.items():
                        if r["tokens"] != reference:
                            bad = sum(a != b for a, b in zip(r["tokens"], reference))
                            raise RuntimeError(
                                f"{e} differs from transformers on {bad} sources ({mode}, batch {batch})"
                            )
                    cell = dict(mode=mode, batch=batch, threads=threads)
                    for e, r in results.items():
                        cell[e] = dict(seconds=r["seconds"], tokens_per_s=r["generated"] / r["seconds"])
                    cell["speedup_ort_vs_transformers"] = (
                        results["transformers"]["seconds"] / results["ours-ort"]["seconds"]
                    )
                    cells.append(cell)
    payload = dict(size=size_name, config=size, engines=list(ENGINES), cells=cells, machine=machine_info())
    write_json(out, payload)
    return payload


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--out", default=str(HERE / "results" / "bench_pretrained.json"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(_worker(**json.loads(args.worker))))
        return 0
    result = run(args.size, args.out, repeats=args.repeats)
    for cell in result["cells"]:
        print(cell["mode"], cell["batch"], cell["threads"], f"{cell['speedup_ort_vs_transformers']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
