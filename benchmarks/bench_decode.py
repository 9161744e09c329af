"""End-to-end greedy decoding speed (DESIGN.md section 4).

    python benchmarks/bench_decode.py                    # base + small, batch 1 and 16, 3 repeats
    python benchmarks/bench_decode.py --quick            # tiny model, 1 repeat: a smoke test
    python benchmarks/bench_decode.py --models small --engines eager_ops,torch_cat

Settings: random weights (the speed does not depend on them), 8000-token source and target
vocabularies, source length 24, exactly 48 generated tokens per sequence (EOS suppressed until
then: ``min_new_tokens = max_new_tokens = 48``), float32, 2 threads, medians over repeats, the
engines of one case timed side by side (interleaved, rotating order). Every engine's tokens are
compared with the first engine's before any time is recorded; an engine that disagrees is not
timed and the run exits with status 1.

A measurement covers a whole decode: encoder, 48 decoder steps, search. Reported as generated
tokens per second (``batch * 48 / median seconds``).

Each engine runs in its own process (``--same-process`` to turn that off), built once per case;
the parent asks one engine at a time for a decode and the engine times it itself. Idle intra-op
threads spin (the runtimes' default; ``--passive-threads`` makes them sleep, for a busy machine).

Engines (``ENGINES``; another backend is one more entry whose ``build`` returns a decode
function ``(input_ids, src_lengths, n_tokens) -> list[list[int]]``):

* ``uncached``: the seed's re-decode loop, the full decoder over the whole prefix at every step;
* ``eager_ops``: :class:`transformer_ext.runtimes.EagerRunner`: cross K/V once, preallocated
  self-attention cache written in place, fused ``decode_attention``;
* ``compiled_ops``: the same runner with ``compile=True``: ``model.decode_step`` through
  ``torch.compile`` (fullgraph, static shapes: the preallocated cache keeps every step's shapes
  equal, so one graph serves the whole decode; compiled during the untimed warm-up run);
* ``torch_cat``: :class:`transformer_ext.runtimes.CatCacheRunner`: plain PyTorch, cross K/V once,
  ``torch.cat``-grown self-attention cache, eager masked softmax (the seed's KV-cache decoder);
* ``onnxrt`` / ``onnxrt_ts``: :class:`transformer_ext.runtimes.OrtRunner` on the model exported by
  ``export.onnx`` (portable / tensorscatter flavour; exported once per model, not timed), ONNX
  Runtime CPU with ``--threads`` intra-op threads that sleep rather than spin when idle (present
  when onnx and onnxruntime are installed);
* ``ctranslate2``: the peer engine CTranslate2 (float32, ``intra_threads=--threads``,
  ``inter_threads=1``, ``min_decoding_length`` suppressing EOS), its model built with
  ``ctranslate2.specs`` from the same weights, our positional table assigned explicitly (present
  when ``ctranslate2`` is installed: ``pip install ctranslate2`` in the benchmark environment only);
  ``ctranslate2_1t``: the same with ``intra_threads=1``, which is faster at batch 1 on the 2-core
  development machine, so the comparison is made against the better of the two.

At batch 1 the benchmark also prints each engine's fraction of the memory-bandwidth floor: the
bytes of the decoder and output-projection weights read per generated token divided by this
machine's measured copy bandwidth (STREAM-style, read + write bytes of a large ``numpy`` copy).
"""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

# Idle intra-op threads spin for a while before sleeping (the OpenMP and ONNX Runtime default).
# At batch 1 a decoder step is ~50 small parallel regions, and waking sleeping threads costs
# ~80 us per region (measured: a 512x512 linear takes 35 us with spinning threads and 120 us
# with OMP_WAIT_POLICY=PASSIVE), so spinning is what a latency-bound deployment runs with.
# On a machine whose cores are shared with other jobs a spinning thread loses its time slices
# instead: ``--passive-threads`` makes every engine's idle threads sleep (OMP_WAIT_POLICY=PASSIVE
# for torch and CTranslate2, allow_spinning=False for ONNX Runtime). The variable must be set
# before torch (libgomp) is loaded, hence this check of the raw command line.
PASSIVE_THREADS = "--passive-threads" in sys.argv[1:]
if PASSIVE_THREADS:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo, if not installed
from common import environment, sync, write_json  # noqa: E402

from transformer_ext.config import TransformerConfig  # noqa: E402
from transformer_ext.decoding import greedy_decode  # noqa: E402
from transformer_ext.model import Transformer  # noqa: E402
from transformer_ext.runtimes import CatCacheRunner, EagerRunner, greedy_decode_uncached  # noqa: E402

logger = logging.getLogger("bench_decode")
HERE = os.path.dirname(os.path.abspath(__file__))

SRC_LEN = 24
NEW_TOKENS = 48

DecodeFn = Callable[[np.ndarray, np.ndarray, int], "list[list[int]]"]


@dataclass
class Engine:
    """A decoding backend: ``build(model, device)`` returns its decode function."""

    name: str
    description: str
    build: Callable[[Transformer, torch.device], DecodeFn]


def _runner_engine(runner_cls, **options) -> Callable[[Transformer, torch.device], DecodeFn]:
    def build(model: Transformer, device: torch.device) -> DecodeFn:
        return _greedy_exactly_n(runner_cls(model, device, **options), model)

    return build


def _greedy_exactly_n(runner, model: Transformer) -> DecodeFn:
    """Greedy decoding with ``runner`` that generates exactly ``n`` tokens per row (EOS suppressed)."""
    c = model.config

    def decode(src: np.ndarray, lengths: np.ndarray, n: int):
        return greedy_decode(runner, src, lengths, bos_id=c.bos_id, eos_id=c.eos_id,
                             max_new_tokens=n, min_new_tokens=n)

    return decode


def _build_uncached(model: Transformer, device: torch.device) -> DecodeFn:
    c = model.config

    def decode(src: np.ndarray, lengths: np.ndarray, n: int):
        return greedy_decode_uncached(
            model, torch.from_numpy(src).to(device), torch.from_numpy(lengths).to(device),
            bos_id=c.bos_id, eos_id=c.eos_id, max_new_tokens=n, min_new_tokens=n,
        )

    return decode


_EXPORTS: dict = {}  # (id(model), flavour) -> export folder, exported once per model


def _scratch_dir(prefix: str) -> str:
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def _onnxrt_engine(flavour: str) -> Callable[[Transformer, torch.device], DecodeFn]:
    """Export with ``export.onnx`` (untimed, once per model), decode with :class:`OrtRunner`."""

    def build(model: Transformer, device: torch.device) -> DecodeFn:
        from export.onnx import export_onnx
        from transformer_ext.checkpoint import save_model
        from transformer_ext.runtimes import OrtRunner

        key = (id(model), flavour)
        if key not in _EXPORTS:
            scratch = _scratch_dir("bench_onnx_")
            save_model(model, os.path.join(scratch, "model"))  # CPU copy of the weights
            export_onnx(os.path.join(scratch, "model"), os.path.join(scratch, flavour), flavour=flavour,
                        validate=False)  # the benchmark compares whole decodes itself
            _EXPORTS[key] = os.path.join(scratch, flavour)
        runner = OrtRunner(_EXPORTS[key], intra_op_num_threads=torch.get_num_threads(),
                           allow_spinning=not PASSIVE_THREADS)
        return _greedy_exactly_n(runner, model)

    return build


def _ct2_spec(model: Transformer):
    """A ``ctranslate2.specs.TransformerSpec`` holding ``model``'s weights (float32)."""
    from ctranslate2.specs import common_spec, transformer_spec

    def arr(t):
        return t.detach().float().cpu().numpy()

    def linear(spec, *layers):  # several layers: fused along the output dimension (Q|K|V, K|V)
        spec.weight = np.concatenate([arr(l.weight) for l in layers], 0)
        if layers[0].bias is not None:
            spec.bias = np.concatenate([arr(l.bias) for l in layers], 0)

    def norm(spec, ln):
        spec.gamma, spec.beta = arr(ln.weight), arr(ln.bias)

    c = model.config
    spec = transformer_spec.TransformerSpec.from_config(
        (c.n_encoder_layers, c.n_decoder_layers), c.n_heads, pre_norm=c.norm_first,
        activation=common_spec.Activation.RELU)
    spec.config.layer_norm_epsilon = c.layer_norm_eps
    enc, dec = spec.encoder, spec.decoder
    enc.embeddings[0].weight, enc.scale_embeddings = arr(model.src_embed.lut.weight), True
    dec.embeddings.weight, dec.scale_embeddings = arr(model.tgt_embed.lut.weight), True
    # CTranslate2's built-in table concatenates sin and cos; ours interleaves them: assign ours.
    enc.position_encodings.encodings = arr(model.src_pe.pe)
    dec.position_encodings.encodings = arr(model.tgt_pe.pe)
    for ls, layer in zip(enc.layer, model.encoder.layers):
        a = layer.self_attn
        linear(ls.self_attention.linear[0], a.W_Q, a.W_K, a.W_V)
        linear(ls.self_attention.linear[1], a.W_O)
        norm(ls.self_attention.layer_norm, layer.sublayer[0].norm)
        linear(ls.ffn.linear_0, layer.feed_forward.w_1)
        linear(ls.ffn.linear_1, layer.feed_forward.w_2)
        norm(ls.ffn.layer_norm, layer.sublayer[1].norm)
    for ls, layer in zip(dec.layer, model.decoder.layers):
        a, x = layer.self_attn, layer.src_attn
        linear(ls.self_attention.linear[0], a.W_Q, a.W_K, a.W_V)
        linear(ls.self_attention.linear[1], a.W_O)
        norm(ls.self_attention.layer_norm, layer.sublayer[0].norm)
        linear(ls.attention.linear[0], x.W_Q)
        linear(ls.attention.linear[1], x.W_K, x.W_V)
        linear(ls.attention.linear[2], x.W_O)
        norm(ls.attention.layer_norm, layer.sublayer[1].norm)
        linear(ls.ffn.linear_0, layer.feed_forward.w_1)
        linear(ls.ffn.linear_1, layer.feed_forward.w_2)
        norm(ls.ffn.layer_norm, layer.sublayer[2].norm)
    if c.norm_first:
        norm(enc.layer_norm, model.encoder.norm)
        norm(dec.layer_norm, model.decoder.norm)
    linear(dec.projection, model.generator.proj)
    specials = ["<pad>", "<s>", "</s>", "<unk>"]  # our ids 0..3
    spec.register_source_vocabulary(specials + [f"s{i}" for i in range(len(specials), c.src_vocab_size)])
    spec.register_target_vocabulary(specials + [f"t{i}" for i in range(len(specials), c.tgt_vocab_size)])
    spec.config.bos_token, spec.config.eos_token, spec.config.unk_token = "<s>", "</s>", "<unk>"
    spec.config.decoder_start_token = "<s>"
    return spec, specials


def _ctranslate2_engine(threads: int | None = None) -> Callable[[Transformer, torch.device], DecodeFn]:
    """CTranslate2 with ``intra_threads=threads`` (None: ``--threads``, the DESIGN.md setting)."""

    def build(model: Transformer, device: torch.device) -> DecodeFn:
        return _build_ctranslate2(model, device, threads or torch.get_num_threads())

    return build


def _build_ctranslate2(model: Transformer, device: torch.device, threads: int) -> DecodeFn:
    import ctranslate2

    c = model.config
    if (c.pad_id, c.bos_id, c.eos_id) != (0, 1, 2):
        raise ValueError("the CTranslate2 engine assumes pad/bos/eos ids 0/1/2")
    spec, specials = _ct2_spec(model)
    spec.validate()
    spec.optimize(quantization="float32")
    out = os.path.join(_scratch_dir("bench_ct2_"), "model")
    os.makedirs(out)
    spec.save(out)
    translator = ctranslate2.Translator(out, device="cuda" if device.type == "cuda" else "cpu",
                                        compute_type="float32", intra_threads=threads,
                                        inter_threads=1)
    target_ids = {tok: i for i, tok in enumerate(specials)}

    def decode(src: np.ndarray, lengths: np.ndarray, n: int):
        batch = [[f"s{int(t)}" for t in row[:length]] for row, length in zip(src, lengths)]
        results = translator.translate_batch(batch, beam_size=1, max_batch_size=len(batch),
                                             max_decoding_length=n, min_decoding_length=n)
        return [[target_ids[t] if t in target_ids else int(t[1:]) for t in r.hypotheses[0]] for r in results]

    return decode


ENGINES: list[Engine] = [
    Engine("uncached", "seed re-decode loop (no cache)", _build_uncached),
    Engine("eager_ops", "EagerRunner: compiled ops, in-place cache", _runner_engine(EagerRunner)),
    Engine("compiled_ops", "EagerRunner(compile=True): decode_step through torch.compile (static shapes)",
           _runner_engine(EagerRunner, compile=True)),
    Engine("torch_cat", "CatCacheRunner: plain PyTorch, torch.cat cache", _runner_engine(CatCacheRunner)),
]
if importlib.util.find_spec("onnxruntime") and importlib.util.find_spec("onnx"):
    ENGINES += [
        Engine("onnxrt", "ONNX Runtime, portable export (runner appends K/V in place)", _onnxrt_engine("portable")),
        Engine("onnxrt_ts", "ONNX Runtime, tensorscatter export (cache updated in place in the graph)",
               _onnxrt_engine("tensorscatter")),
    ]
if importlib.util.find_spec("ctranslate2"):
    ENGINES += [
        Engine("ctranslate2", "CTranslate2 float32 (peer engine, same weights), intra_threads=--threads",
               _ctranslate2_engine()),
        # Reported beside the DESIGN.md setting because on this 2-core machine CTranslate2 at batch
        # 1 was measured faster with one thread (104 vs 63 tokens/s): its best is the bar.
        Engine("ctranslate2_1t", "CTranslate2 float32, intra_threads=1", _ctranslate2_engine(1)),
    ]

MODELS = {
    "base": dict(),  # the preset as is: 6+6 layers, d_model 512, 8 heads, d_ff 2048, 8000/8000
    "small": dict(),  # demo-like: 3+3 layers, d_model 256, 4 heads, d_ff 1024, 8000/8000
    "tiny": dict(max_len=64),  # --quick
}


def make_sources(config: TransformerConfig, batch: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    low = max(config.pad_id, config.bos_id, config.eos_id) + 1
    src = rng.integers(low, config.src_vocab_size, size=(batch, SRC_LEN), dtype=np.int64)
    return src, np.full(batch, SRC_LEN, dtype=np.int64)


def _engine_by_name(name: str) -> Engine:
    for e in ENGINES:
        if e.name == name:
            return e
    raise ValueError(f"unknown engine {name!r}; available: {[e.name for e in ENGINES]}")


def _timed(fn: DecodeFn, device: torch.device, src: np.ndarray, lengths: np.ndarray, n: int):
    sync(str(device))
    t0 = time.perf_counter()
    tokens = fn(src, lengths, n)
    sync(str(device))
    return tokens, time.perf_counter() - t0


def _engine_worker(conn, name: str, model_dir: str, device: str, threads: int) -> None:
    """Body of one engine's process: build the engine, then run the decodes the parent asks for.

    Runs in a fresh (spawned) interpreter, so no other engine's thread pool lives in it: with
    spinning idle threads, two runtimes in one process (torch's and CTranslate2's own libgomp,
    ONNX Runtime's pool) steal each other's cores and every number drops (measured: torch eager
    74 tokens/s beside the other engines vs 119 alone, base batch 1).
    """
    try:
        from transformer_ext.checkpoint import load_model

        torch.set_num_threads(threads)
        dev = torch.device(device)
        model = load_model(model_dir, dev)
        fn = _engine_by_name(name).build(model, dev)
        conn.send(("ready", None))
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            _, src, lengths, n = msg
            conn.send(("done", _timed(fn, dev, src, lengths, n)))
    except BaseException:  # reported to the parent, which raises it
        import traceback

        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


class _EngineProcess:
    """One engine in its own process; the parent runs one decode at a time across all of them."""

    def __init__(self, name: str, model_dir: str, device: str, threads: int):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.name = name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_engine_worker, args=(child, name, model_dir, device, threads), daemon=True)
        self.proc.start()
        child.close()
        self._reply()  # built

    def _reply(self):
        try:
            kind, payload = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"engine {self.name}: worker process died (exit code {self.proc.exitcode})") from None
        if kind == "error":
            raise RuntimeError(f"engine {self.name} failed in its worker process:\n{payload}")
        return payload

    def __call__(self, src: np.ndarray, lengths: np.ndarray, n: int):
        self.conn.send(("decode", src, lengths, n))
        return self._reply()

    def close(self) -> None:
        try:
            self.conn.send(("stop",))
        except (BrokenPipeError, OSError):
            pass
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()


def bench_case(model: Transformer, engines: list[Engine], device: torch.device, batch: int,
               repeats: int, model_dir: str | None = None) -> dict:
    """Tokens first (compared with the first engine), then interleaved timed repeats.

    With ``model_dir`` (the model saved there) each engine runs in its own process, built once
    for this case; only one engine decodes at any time. Without it every engine runs here.
    """
    src, lengths = make_sources(model.config, batch)
    threads = torch.get_num_threads()
    runners: dict = {}
    try:
        for e in engines:
            if model_dir is not None:
                runners[e.name] = _EngineProcess(e.name, model_dir, str(device), threads)
            else:
                fn = e.build(model, device)
                runners[e.name] = lambda s, l, n, fn=fn: _timed(fn, device, s, l, n)
        return _measure(runners, batch, src, lengths, repeats)
    finally:
        for r in runners.values():
            if isinstance(r, _EngineProcess):
                r.close()


def _measure(runners: dict, batch: int, src: np.ndarray, lengths: np.ndarray, repeats: int) -> dict:
    case: dict = {"batch": batch, "src_len": SRC_LEN, "new_tokens": NEW_TOKENS, "engines": {}}
    reference_name, reference_tokens = None, None
    timed = []
    for name, run_fn in runners.items():  # warm-up run, which also gives the tokens
        tokens, _ = run_fn(src, lengths, NEW_TOKENS)
        if any(len(row) != NEW_TOKENS for row in tokens):
            raise RuntimeError(f"{name} did not generate exactly {NEW_TOKENS} tokens per row")
        entry = case["engines"].setdefault(name, {})
        if reference_tokens is None:
            reference_name, reference_tokens = name, tokens
            entry["tokens_match"] = True
        else:
            entry["tokens_match"] = tokens == reference_tokens
            if not entry["tokens_match"]:
                mismatch = [b for b in range(batch) if tokens[b] != reference_tokens[b]]
                logger.error("%s: tokens differ from %s in rows %s; not timed", name, reference_name, mismatch)
                continue
        timed.append(name)
    samples: dict[str, list[float]] = {name: [] for name in timed}
    for r in range(repeats):
        order = timed[r % len(timed):] + timed[: r % len(timed)] if timed else []
        for name in order:
            _, seconds = runners[name](src, lengths, NEW_TOKENS)
            samples[name].append(seconds)
    for name in timed:
        med = statistics.median(samples[name])
        case["engines"][name].update(
            seconds=med, samples=samples[name], tokens_per_second=batch * NEW_TOKENS / med,
            ms_per_step=1e3 * med / NEW_TOKENS,
        )
    case["reference_engine"] = reference_name
    case["tokens_sample"] = reference_tokens[0][:12]
    return case


def copy_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 7) -> float:
    """This machine's copy bandwidth in bytes/s (STREAM-style: read + write bytes), median of repeats."""
    a = np.ones(nbytes // 4, dtype=np.float32)
    b = np.empty_like(a)
    np.copyto(b, a)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(b, a)
        times.append(time.perf_counter() - t0)
    return 2 * a.nbytes / statistics.median(times)


def weight_bytes_per_token(model: Transformer) -> int:
    """Bytes of the weights one generated token reads: the decoder layers (the cross-attention K/V
    projections excluded: they run once per source in the encoder pass) and the output projection
    (one embedding row is negligible)."""
    seen, total = set(), 0
    params = list(model.decoder.named_parameters(prefix="decoder")) + list(model.generator.named_parameters(prefix="generator"))
    for name, p in params:
        if id(p) in seen or ".src_attn.W_K." in name or ".src_attn.W_V." in name:
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
    return total


def bandwidth_floor(model: Transformer, cases: list, bandwidth: float) -> dict:
    """Floor seconds per generated token at batch 1 and each engine's fraction of it."""
    nbytes = weight_bytes_per_token(model)
    floor = nbytes / bandwidth
    entry = {"weight_bytes_per_token": nbytes, "copy_bandwidth_bytes_per_s": bandwidth,
             "floor_ms_per_token": 1e3 * floor, "fraction_of_floor": {}}
    for case in cases:
        if case["batch"] != 1:
            continue
        for name, e in case["engines"].items():
            if "ms_per_step" in e:
                entry["fraction_of_floor"][name] = 1e3 * floor / e["ms_per_step"]
    return entry


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [(m, c) for m, r in results["models"].items() for c in r["cases"]]
    engines = [e["name"] for e in results["engines"]]
    fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(cases)), 4.8))
    width = 0.8 / max(1, len(engines))
    for i, name in enumerate(engines):
        xs, ys = [], []
        for j, (_, case) in enumerate(cases):
            tps = case["engines"].get(name, {}).get("tokens_per_second")
            if tps is not None:
                xs.append(j + (i - (len(engines) - 1) / 2) * width)
                ys.append(tps)
        bars = ax.bar(xs, ys, width, label=name)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(range(len(cases)), [f"{m}\nbatch {c['batch']}" for m, c in cases])
    ax.set(ylabel="generated tokens / second", yscale="log",
           title=f"greedy decoding, {NEW_TOKENS} tokens, source {SRC_LEN}, float32, "
                 f"{results['environment']['torch_threads']} threads ({results['device']})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)


def run(models: list[str], engine_names: list[str] | None, batch_sizes: list[int], repeats: int,
        device: str = "cpu", threads: int = 2, out: str | None = None, isolate: bool = True) -> dict:
    """Run the benchmark and write ``out`` (JSON) and the PNG beside it; returns the results."""
    torch.set_num_threads(threads)
    dev = torch.device(device)
    engines = [e for e in ENGINES if engine_names is None or e.name in engine_names]
    if engine_names is not None:
        unknown = sorted(set(engine_names) - {e.name for e in ENGINES})
        if unknown:
            raise ValueError(f"unknown engines {unknown}; available: {[e.name for e in ENGINES]}")
    results: dict = {
        "device": device, "environment": {**environment(), "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
                                          "idle_threads": "sleep" if PASSIVE_THREADS else "spin"},
        "src_len": SRC_LEN, "new_tokens": NEW_TOKENS,
        "dtype": "float32", "repeats": repeats, "engine_processes": "one per engine" if isolate else "shared",
        "engines": [{"name": e.name, "description": e.description} for e in engines], "models": {},
    }
    results["load_average_start"] = os.getloadavg()
    for model_name in models:
        torch.manual_seed(0)
        config = TransformerConfig.preset(model_name, **MODELS.get(model_name, {}))
        model = Transformer(config).to(dev).eval()
        entry = {"config": config.to_dict(), "parameters": sum(p.numel() for p in model.parameters()), "cases": []}
        model_dir = None
        if isolate:
            from transformer_ext.checkpoint import save_model

            model_dir = os.path.join(_scratch_dir("bench_model_"), model_name)
            save_model(model.cpu(), model_dir)
            model.to(dev)
        for batch in batch_sizes:
            logger.info("%s, batch %d ...", model_name, batch)
            case = bench_case(model, engines, dev, batch, repeats, model_dir)
            for name, e in case["engines"].items():
                if "tokens_per_second" in e:
                    logger.info("  %-10s %9.1f tokens/s  (%.1f ms/step)", name, e["tokens_per_second"], e["ms_per_step"])
            entry["cases"].append(case)
        if dev.type == "cpu" and 1 in batch_sizes:
            bandwidth = results.setdefault("copy_bandwidth_bytes_per_s", copy_bandwidth())
            entry["bandwidth_floor"] = floor = bandwidth_floor(model, entry["cases"], bandwidth)
            logger.info("  batch 1 memory-bandwidth floor: %.2f ms/token (%.1f MB of weights per token at %.1f GB/s "
                        "copy bandwidth); fraction reached: %s", floor["floor_ms_per_token"],
                        floor["weight_bytes_per_token"] / 1e6, bandwidth / 1e9,
                        ", ".join(f"{k} {v:.0%}" for k, v in floor["fraction_of_floor"].items()))
        results["models"][model_name] = entry
    results["load_average_end"] = os.getloadavg()  # other jobs on the machine distort the times
    out = out or os.path.join(HERE, "results", "bench_decode.json")
    write_json(out, results)
    plot(results, os.path.splitext(out)[0] + ".png")
    logger.info("wrote %s and %s", out, os.path.splitext(out)[0] + ".png")
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=None, help="comma-separated presets (default: base,small; --quick: tiny)")
    p.add_argument("--engines", default=None, help=f"comma-separated subset of {[e.name for e in ENGINES]}")
    p.add_argument("--batch-sizes", default="1,16", help="comma-separated batch sizes (default: 1,16)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per case; medians reported (default: 3)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default: 2)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument("--quick", action="store_true", help="tiny model, 1 repeat: a smoke test")
    p.add_argument("--same-process", action="store_true",
                   help="run every engine in this process instead of one process per engine (faster to start; "
                        "the engines' thread pools then compete for the cores)")
    p.add_argument("--passive-threads", action="store_true",
                   help="idle intra-op threads of every engine sleep instead of spinning (use on a machine "
                        "whose cores are busy with other jobs; costs ~80 us per parallel region at batch 1)")
    p.add_argument("--out", default=None,
                   help="JSON path (default: benchmarks/results/bench_decode.json, or bench_decode_quick.json "
                        "with --quick); the PNG goes beside it")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda needs a visible CUDA GPU")
    models = args.models.split(",") if args.models else (["tiny"] if args.quick else ["base", "small"])
    engines = args.engines.split(",") if args.engines else None
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    repeats = 1 if args.quick else args.repeats
    out = args.out or (os.path.join(HERE, "results", "bench_decode_quick.json") if args.quick else None)
    results = run(models, engines, batch_sizes, repeats, args.device, args.threads, out,
                  isolate=not args.same_process)
    ok = all(e.get("tokens_match", False) for m in results["models"].values() for c in m["cases"]
             for e in c["engines"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
