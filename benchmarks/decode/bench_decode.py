"""End-to-end decoding speed against CTranslate2, measured fairly (docs/DESIGN.md section 4).

    python -m benchmarks.decode.bench_decode                      # base: every engine at 1, 2 and 2x1 threads, greedy + beam 4
    python -m benchmarks.decode.bench_decode --quick              # tiny model, 1 repeat: a smoke test
    python -m benchmarks.decode.bench_decode --engines onnxrt,ctranslate2 --modes greedy --threads 2

Fairness. Every engine runs in a process of its own that loads only what it needs
(``decode_worker.py``): the CTranslate2 and ONNX Runtime workers import numpy and their engine,
never torch (checked in the worker; recorded per engine in the JSON as ``torch_imported``), so
no second OpenMP pool competes for the cores. The parent builds the models once, untimed:
random weights (seed 0), saved; exported with ``export.onnx`` (float32, and quantized with
``export.quantize``: ``int8``, ``int4`` and ``int8-nbits``; the quality gate needs a trained model,
so it is skipped for these random weights and the quantized tokens are compared, not required,
to match), in the ``ort`` flavour for the engines ``onnxrt_gqa`` / ``onnxrt_gqa_int8`` (each
decoder self-attention one ONNX Runtime ``GroupQueryAttention``) and in the ``custom-op`` flavour
for ``onnxrt_op`` / ``onnxrt_op_int8`` (each decoder self- and cross-attention one node of our own
operator library, ``transformer_ext.DecodeAttention``: build it first with
``scripts/fetch_ort_headers.sh`` and ``csrc/ort/build.sh``); converted once with
``ctranslate2.specs`` from the same weights (our positional table assigned explicitly) and saved
as float32 and int8 models. Only one engine decodes at any time; rounds are interleaved in a
rotating order; medians of ``--repeats`` are reported.

Settings: source length 24, exactly 48 generated tokens per sequence (EOS suppressed until then:
ours and CTranslate2's ``min_decoding_length =
max_decoding_length = 48``), greedy and beam 4 (no length penalty on either side: our
``length_penalty_type="none"``, CTranslate2's ``length_penalty=0``; best hypothesis compared),
batch 1, 16 and 64, 1 and 2 threads for every engine (CTranslate2 ``intra_threads=N,
inter_threads=1``; ONNX Runtime ``intra_op_num_threads=N``; torch ``set_num_threads(N)``). A
setting ``WxT`` (``--threads 1,2,2x1``) splits each batch over W workers of T threads for the
engines that can (CTranslate2 ``inter_threads=W, intra_threads=T`` with ``max_batch_size`` a
W-th of the batch; ours W one-runner worker processes, ``runtimes.procpool.ProcessSourceParallel``); the best
setting of each engine may be one of these.

Tokens first: every float32 engine's tokens are compared with the first float32 engine's
before any time is recorded; one that disagrees is not timed (exit status 1). Quantized engines
(int8, int4) are timed and their agreement with the float32 tokens and with each other is recorded,
and so is ``eager_bf16``'s (``EagerRunner(dtype="bfloat16")`` on the same weights, compared with our
float32 eager decode; left out, with the reason logged, where the CPU has no native bfloat16).

Besides tokens/s per case, the JSON and the printed table give each engine's faster thread count
per mode and batch (``best_threads``: its tokens/s there and at every thread count) and the
speed-up of every quantized engine over the float32 engine of its runtime, per cell and with
each at its faster thread count (``quantized_speedups``: ours ``onnxrt_int8`` / ``onnxrt_int8_nbits``
/ ``onnxrt_int4`` over ``onnxrt``, CTranslate2's ``ctranslate2_int8`` over ``ctranslate2``); the
plot has those speed-ups in a second panel.

The JSON records the machine (``lscpu``: CPU model, cores, L3; measured read and copy
bandwidth with 1 and 2 threads), the load average before and after, and per model the batch-1
bandwidth floor of every engine: the bytes its weights actually occupy that one generated token
reads (decoder layers and output projection, one embedding row; cross-attention K/V projections
run once per source and are excluded) divided by the measured read bandwidth at the engine's
thread count, and the fraction of that floor the engine reached.
"""

from __future__ import annotations

import argparse
import atexit
import hashlib
import importlib.util
import logging
import os
import pickle
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Optional

import numpy as np

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (results/ lives here)
from benchmarks.common import environment, machine_info, save_figure, write_json

logger = logging.getLogger("bench_decode")

SRC_LEN = 24
NEW_TOKENS = 48
MODES = ("greedy", "beam4")
WORKER = os.path.join(HERE, "decode", "decode_worker.py")


@dataclass(frozen=True)
class Engine:
    name: str
    description: str
    worker: str  # decode_worker.BUILDERS key
    artifact: str  # the prepared model folder it reads: "model", "onnx", "onnx_int8", "onnx_int4", "ct2" ...
    dtype: str  # float32 / int8 / int4 / bfloat16 (the weights it decodes with)
    forbid_torch: bool
    compute_type: str = "float32"
    weight_bytes: str = ""  # the key of its weight bytes per token, when not its artifact's
    float32_engine: str = ""  # a quantized engine: the float32 engine of the same runtime (its speed-up)

    @property
    def bytes_key(self) -> str:
        return self.weight_bytes or self.artifact


ENGINES: list[Engine] = [
    Engine(
        "onnxrt",
        "ONNX Runtime, portable export (python -m export.onnx), OrtRunner",
        "onnxrt",
        "onnx",
        "float32",
        True,
    ),
    Engine("eager", "EagerRunner: torch, compiled ops, in-place cache", "eager", "model", "float32", False),
    Engine(
        "eager_bf16",
        "EagerRunner(dtype='bfloat16'): bfloat16 weights and caches, float32 accumulation (native bf16 CPUs)",
        "eager",
        "model",
        "bfloat16",
        False,
        weight_bytes="model_bf16",
    ),
]
if importlib.util.find_spec("ctranslate2"):
    ENGINES.insert(
        1,
        Engine(
            "ctranslate2",
            "CTranslate2 float32 (peer, same weights)",
            "ctranslate2",
            "ct2",
            "float32",
            True,
            "float32",
        ),
    )
ENGINES.append(
    Engine(
        "onnxrt_int8",
        "ONNX Runtime, python -m export.onnx --quantize int8 (dynamic int8, per-channel, reduce_range)",
        "onnxrt",
        "onnx_int8",
        "int8",
        True,
        float32_engine="onnxrt",
    )
)
# Block-wise weight-only MatMulNBits (export.quantize --scheme int4 / int8-nbits; defaults: blocks
# of 32, accuracy_level 4); compared with CTranslate2 int8, its nearest peer.
for _scheme, _dtype in (("int4", "int4"), ("int8-nbits", "int8")):
    ENGINES.append(
        Engine(
            f"onnxrt_{_scheme.replace('-', '_')}",
            f"ONNX Runtime, python -m export.onnx --quantize {_scheme} (MatMulNBits, weight-only, default blocks: int4 128, int8-nbits 32)",
            "onnxrt",
            f"onnx_{_scheme.replace('-', '_')}",
            _dtype,
            True,
            float32_engine="onnxrt",
        )
    )
# The ort flavour (python -m export.onnx --flavour ort): each decoder self-attention one ONNX
# Runtime GroupQueryAttention; float32 and int8.
ENGINES.append(
    Engine(
        "onnxrt_gqa",
        "ONNX Runtime, python -m export.onnx --flavour ort (GroupQueryAttention self-attention), OrtRunner",
        "onnxrt",
        "onnx_gqa",
        "float32",
        True,
    )
)
ENGINES.append(
    Engine(
        "onnxrt_gqa_int8",
        "ONNX Runtime, python -m export.onnx --flavour ort --quantize int8",
        "onnxrt",
        "onnx_gqa_int8",
        "int8",
        True,
        float32_engine="onnxrt_gqa",
    )
)
# The custom-op flavour (python -m export.onnx --flavour custom-op): each decoder self- and
# cross-attention one transformer_ext.DecodeAttention node of our own operator library
# (csrc/ort/, copied into the export folder); float32 and int8.
ENGINES.append(
    Engine(
        "onnxrt_op",
        "ONNX Runtime, python -m export.onnx --flavour custom-op (our DecodeAttention operator), OrtRunner",
        "onnxrt",
        "onnx_op",
        "float32",
        True,
    )
)
ENGINES.append(
    Engine(
        "onnxrt_op_int8",
        "ONNX Runtime, python -m export.onnx --flavour custom-op --quantize int8",
        "onnxrt",
        "onnx_op_int8",
        "int8",
        True,
        float32_engine="onnxrt_op",
    )
)
if importlib.util.find_spec("ctranslate2"):
    ENGINES.append(
        Engine(
            "ctranslate2_int8",
            "CTranslate2 int8 (peer, same weights, converted with quantization=int8)",
            "ctranslate2",
            "ct2_int8",
            "int8",
            True,
            "int8",
            float32_engine="ctranslate2",
        )
    )
PEERS = ("ctranslate2", "ctranslate2_int8")
# What each dtype's engines are compared with: CTranslate2 of the same dtype (int4: its int8, as it
# has no 4-bit CPU path); bfloat16, which CTranslate2 does not run on CPUs, with our float32 eager
# decode of the same weights.
PEER_OF_DTYPE = {
    "float32": "ctranslate2",
    "int8": "ctranslate2_int8",
    "int4": "ctranslate2_int8",
    "bfloat16": "eager",
}

MODELS = {
    "base": dict(),  # the preset: 6+6 layers, d_model 512, 8 heads, d_ff 2048, 8000/8000 vocabularies
    "small": dict(),
    "tiny": dict(max_len=64),  # --quick and the tests
}


def _scratch_dir(prefix: str) -> str:
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


# ------------------------------------------------------------------------------------------
# Preparing the artifacts (parent only: torch lives here)
# ------------------------------------------------------------------------------------------


def _ct2_spec(model):
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
        (c.n_encoder_layers, c.n_decoder_layers),
        c.n_heads,
        pre_norm=c.norm_first,
        activation=common_spec.Activation.RELU,
    )
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
    return spec


def _ct2_decoder_bytes(spec) -> int:
    """Bytes one generated token reads from a converted CTranslate2 model: every decoder variable
    but the embedding table (one row) and the cross-attention K/V projection (once per source).
    ``optimize`` turns identical arrays into aliases (the tied output projection is an alias of
    the target embeddings): an alias counts as the array it names, each array once, except that
    the projection reads the whole table the embedding lookup reads one row of."""
    variables = dict(spec.variables(ordered=True))

    def array(name):
        while isinstance(variables[name], str):
            name = variables[name]
        value = variables[name]
        return name, np.asarray(value.numpy() if hasattr(value, "numpy") else value)

    total, counted = 0, set()
    for name in variables:
        if not name.startswith("decoder/") or "/attention/linear_1/" in name:
            continue
        target, value = array(name)
        if name.startswith("decoder/embeddings"):
            total += value.nbytes // max(1, value.shape[0]) if value.ndim else value.nbytes
        elif target not in counted:
            counted.add(target)
            total += value.nbytes
    return total


def _onnx_decoder_bytes(path: str) -> int:
    """Bytes of the decoder step's initializers that one step reads: every initializer a non-
    Gather node consumes, one row of those only gathered from (the embedding table)."""
    import onnx

    model = onnx.load(path)
    users: dict[str, set] = {}
    for node in model.graph.node:
        for name in node.input:
            users.setdefault(name, set()).add(node.op_type)
    total = 0
    for t in model.graph.initializer:
        nbytes = (
            int(np.prod(t.dims, dtype=np.int64)) * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
        )
        ops = users.get(t.name, set())
        if ops and ops <= {"Gather", "GatherBlockQuantized"} and len(t.dims) == 2:
            nbytes //= max(1, int(t.dims[0]))
        total += nbytes
    return total


def _torch_decoder_bytes(model) -> int:
    seen, total = set(), 0
    params = list(model.decoder.named_parameters(prefix="decoder")) + list(
        model.generator.named_parameters(prefix="generator")
    )
    for name, p in params:
        if id(p) in seen or ".src_attn.W_K." in name or ".src_attn.W_V." in name:
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
    return total + model.config.d_model * 4  # one embedding row


# The export flavours other than portable the engines run, by artifact (each also quantized to
# int8 as "<artifact>_int8"): the ort flavour's GroupQueryAttention, our own DecodeAttention.
FLAVOUR_ARTIFACTS = {"onnx_gqa": "ort", "onnx_op": "custom-op"}
ONNX_ARTIFACTS = {"onnx", "onnx_int8", "onnx_int4", "onnx_int8_nbits"} | {
    a for artifact in FLAVOUR_ARTIFACTS for a in (artifact, f"{artifact}_int8")
}
PREPARED = "prepared.json"
PREPARED_VERSION = 8  # bumped when what prepare() records, or an export it makes, changes


def prepare(model_name: str, engines: list[Engine], scratch: str) -> tuple[dict, dict, dict]:
    """Build every artifact the engines need, once: ``(paths, weight_bytes_per_token, config dict)``.

    ``scratch/prepared.json`` records what was built; a later run given the same folder
    (``--artifacts``) reuses it when it holds every artifact the engines need.
    """
    import json

    record = os.path.join(scratch, PREPARED)
    if os.path.isfile(record):
        with open(record) as f:
            saved = json.load(f)
        if {e.artifact for e in engines} <= set(saved["paths"]) and saved.get("version") == PREPARED_VERSION:
            logger.info("reusing the artifacts in %s", scratch)
            return saved["paths"], saved["weight_bytes_per_token"], saved["config"]
    import torch

    from transformer_ext.checkpoint import save_model
    from transformer_ext.config import TransformerConfig
    from transformer_ext.model import Transformer

    torch.manual_seed(0)
    config = TransformerConfig.preset(model_name, **MODELS.get(model_name, {}))
    if (config.pad_id, config.bos_id, config.eos_id) != (0, 1, 2):
        raise ValueError("the CTranslate2 conversion assumes pad/bos/eos ids 0/1/2")
    model = Transformer(config).eval()
    needed = {e.artifact for e in engines}
    paths, nbytes = {"model": os.path.join(scratch, "model")}, {}
    for name in needed | {"model"}:  # a folder of an earlier, incomplete or older preparation is rebuilt
        if os.path.exists(os.path.join(scratch, name)):
            shutil.rmtree(os.path.join(scratch, name))
    save_model(model, paths["model"])
    nbytes["model"] = _torch_decoder_bytes(model)
    nbytes["model_bf16"] = nbytes["model"] // 2  # every decoder weight at 2 bytes
    if needed & ONNX_ARTIFACTS:
        from export.onnx import export_onnx
        from export.quantize import quantize_export

        paths["onnx"] = os.path.join(scratch, "onnx")
        logger.info("exporting %s to ONNX (untimed) ...", model_name)
        export_onnx(paths["model"], paths["onnx"], validate=False, cache_len=min(config.max_len, 64))
        nbytes["onnx"] = _onnx_decoder_bytes(os.path.join(paths["onnx"], "decoder_step.onnx"))
        if "onnx_int8" in needed:
            paths["onnx_int8"] = os.path.join(scratch, "onnx_int8")
            quantize_export(paths["onnx"], paths["onnx_int8"], "int8", gate=False)  # random weights: no gate
            nbytes["onnx_int8"] = _onnx_decoder_bytes(os.path.join(paths["onnx_int8"], "decoder_step.onnx"))
        for scheme in ("int4", "int8-nbits"):
            artifact = f"onnx_{scheme.replace('-', '_')}"
            if artifact in needed:
                paths[artifact] = os.path.join(scratch, artifact)
                quantize_export(paths["onnx"], paths[artifact], scheme, gate=False)  # random weights: no gate
                nbytes[artifact] = _onnx_decoder_bytes(os.path.join(paths[artifact], "decoder_step.onnx"))
        for artifact, flavour in FLAVOUR_ARTIFACTS.items():
            if needed & {artifact, f"{artifact}_int8"}:
                paths[artifact] = os.path.join(scratch, artifact)
                logger.info("exporting %s to ONNX, %s flavour (untimed) ...", model_name, flavour)
                export_onnx(
                    paths["model"],
                    paths[artifact],
                    validate=False,
                    cache_len=min(config.max_len, 64),
                    flavour=flavour,
                )
                nbytes[artifact] = _onnx_decoder_bytes(os.path.join(paths[artifact], "decoder_step.onnx"))
                if f"{artifact}_int8" in needed:
                    quantized = f"{artifact}_int8"
                    paths[quantized] = os.path.join(scratch, quantized)
                    quantize_export(paths[artifact], paths[quantized], "int8", gate=False)
                    nbytes[quantized] = _onnx_decoder_bytes(
                        os.path.join(paths[quantized], "decoder_step.onnx")
                    )
    for artifact, quantization in (("ct2", "float32"), ("ct2_int8", "int8")):
        if artifact in needed:
            spec = _ct2_spec(model)
            spec.validate()
            spec.optimize(quantization=quantization)
            paths[artifact] = os.path.join(scratch, artifact)
            os.makedirs(paths[artifact])
            spec.save(paths[artifact])
            nbytes[artifact] = _ct2_decoder_bytes(spec)
    write_json(
        record,
        {
            "version": PREPARED_VERSION,
            "paths": paths,
            "weight_bytes_per_token": nbytes,
            "config": config.to_dict(),
        },
    )
    return paths, nbytes, config.to_dict()


# ------------------------------------------------------------------------------------------
# Workers
# ------------------------------------------------------------------------------------------


class EngineProcess:
    """One engine in its own process (``decode_worker.py``); one request at a time."""

    def __init__(
        self,
        engine: Engine,
        model_path: str,
        threads: int,
        config: dict,
        *,
        python: str | None = None,
        extra: dict | None = None,
    ):
        """``python``: the interpreter to run the worker with (another virtual environment's;
        default: this one's); ``extra``: more keys of the worker's spec (decode_worker.py)."""
        self.name = engine.name
        spec = {
            "engine": engine.worker,
            "model": model_path,
            "threads": threads,
            "compute_type": engine.compute_type,
            "dtype": engine.dtype,
            "forbid_torch": engine.forbid_torch,
            "bos": config["bos_id"],
            "eos": config["eos_id"],
            **(extra or {}),
        }
        import json

        per_worker = str(threads // int(spec.get("workers", 1)))  # each worker's own pool
        env = dict(os.environ, OMP_NUM_THREADS=per_worker, MKL_NUM_THREADS=per_worker)
        self.proc = subprocess.Popen(
            [python or sys.executable, WORKER, json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        self.info = self._reply()

    def _reply(self):
        try:
            kind, payload = pickle.load(self.proc.stdout)
        except EOFError:
            raise RuntimeError(
                f"engine {self.name}: worker process died (exit code {self.proc.wait()})"
            ) from None
        if kind == "error":
            raise RuntimeError(f"engine {self.name} failed in its worker process:\n{payload}")
        return payload

    def __call__(self, mode: str, src: np.ndarray, lengths: np.ndarray, n: int):
        pickle.dump(("decode", mode, src, lengths, n), self.proc.stdin)
        self.proc.stdin.flush()
        return self._reply()

    def close(self) -> None:
        try:
            pickle.dump(("stop",), self.proc.stdin)
            self.proc.stdin.close()
        except (BrokenPipeError, OSError, ValueError):
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ------------------------------------------------------------------------------------------
# Measuring
# ------------------------------------------------------------------------------------------


def make_sources(config: dict, batch: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    low = max(config["pad_id"], config["bos_id"], config["eos_id"]) + 1
    src = rng.integers(low, config["src_vocab_size"], size=(batch, SRC_LEN), dtype=np.int64)
    return src, np.full(batch, SRC_LEN, dtype=np.int64)


def _agreement(a: list, b: list) -> float:
    return sum(x == y for x, y in zip(a, b)) / max(1, len(a))


def measure_case(
    workers: dict,
    engines: list[Engine],
    mode: str,
    batch: int,
    config: dict,
    repeats: int,
    *,
    sources: tuple[np.ndarray, np.ndarray] | None = None,
    new_tokens: int = NEW_TOKENS,
    time_mismatched: bool = False,
) -> dict:
    """Tokens first (warm-up decode of every engine, compared), then interleaved timed rounds.

    ``sources``: ``(input_ids, src_lengths)`` (default: :func:`make_sources`); ``new_tokens``:
    the tokens generated per sequence; ``time_mismatched``: a float32 engine whose tokens differ
    from the reference's is still timed (its entry says ``tokens_match: false``)."""
    src, lengths = sources if sources is not None else make_sources(config, batch)
    case: dict = {
        "mode": mode,
        "batch": batch,
        "src_len": int(src.shape[1]),
        "new_tokens": new_tokens,
        "engines": {},
    }
    tokens: dict = {}
    reference = None
    timed = []
    for e in engines:
        out, _ = workers[e.name](mode, src, lengths, new_tokens)
        if any(len(row) != new_tokens for row in out):
            raise RuntimeError(f"{e.name} ({mode}) did not generate exactly {new_tokens} tokens per sequence")
        tokens[e.name] = out
        entry = case["engines"].setdefault(e.name, {"dtype": e.dtype})
        if e.dtype == "float32":
            if reference is None:
                reference = e.name
            entry["tokens_match"] = out == tokens[reference]
            if not entry["tokens_match"]:
                rows = [b for b in range(batch) if out[b] != tokens[reference][b]]
                entry["rows_equal_to_float32"] = _agreement(out, tokens[reference])
                logger.error(
                    "%s %s batch %d: TOKENS DIFFER from %s in rows %s; %s",
                    e.name,
                    mode,
                    batch,
                    reference,
                    rows,
                    "timed, marked tokens_match: false" if time_mismatched else "not timed",
                )
                if not time_mismatched:
                    continue
        timed.append(e.name)
    for e in engines:
        if e.dtype != "float32":  # quantized (int8, int4) or bfloat16
            entry = case["engines"][e.name]
            if reference is not None:
                entry["rows_equal_to_float32"] = _agreement(tokens[e.name], tokens[reference])
            others = [o.name for o in engines if o.dtype != "float32" and o.name != e.name]
            for other in others:
                entry[f"rows_equal_to_{other}"] = _agreement(tokens[e.name], tokens[other])
    case["reference_engine"] = reference
    if reference is not None:  # how varied the compared tokens are (a constant output proves little)
        case["reference_distinct_tokens"] = len({t for row in tokens[reference] for t in row})
        # cells of other thread settings decode the same sources: equal digests, equal tokens
        case["reference_tokens_sha1"] = hashlib.sha1(
            np.asarray(tokens[reference], dtype=np.int64).tobytes()
        ).hexdigest()
    case["float32_tokens_agree"] = all(
        e.get("tokens_match", True) for e in case["engines"].values() if e["dtype"] == "float32"
    )
    samples: dict[str, list[float]] = {name: [] for name in timed}
    for r in range(repeats):
        order = timed[r % len(timed) :] + timed[: r % len(timed)] if timed else []
        for name in order:
            samples[name].append(workers[name](mode, src, lengths, new_tokens)[1])
    for name in timed:
        med = statistics.median(samples[name])
        case["engines"][name].update(
            seconds=med,
            samples=samples[name],
            tokens_per_second=batch * new_tokens / med,
            ms_per_step=1e3 * med / new_tokens,
        )
    return case


# Engines whose worker splits a batch over several workers (decode_worker.py "workers")
SPLITTABLE = ("onnxrt", "ctranslate2")


QUANTIZATION_KEYS = (
    "scheme",
    "bits",
    "block_size",
    "symmetric",
    "accuracy_level",
    "kernel_compute",
    "weights",
)


def export_quantization(path: str) -> Optional[dict]:
    """What an export folder's manifest says of its quantization (scheme, block size, ...);
    None for a float32 export or an artifact that is not an export folder."""
    from transformer_ext.export_format import MANIFEST_NAME, manifest_quantization, read_manifest

    if not os.path.isfile(os.path.join(path, MANIFEST_NAME)):
        return None
    q = manifest_quantization(read_manifest(path))
    if not q:
        return None
    out = {k: q[k] for k in QUANTIZATION_KEYS if k in q}
    if "few_rows" in q:  # an int8 export's few-row decoder step: when OrtRunner runs it, its blocks
        few = q["few_rows"]
        out["few_rows"] = (
            {k: few[k] for k in ("file", "max_rows", "min_threads", "bits", "block_size", "kernel_compute")}
            if few
            else None
        )
    return out


def parse_setting(text: str):
    """A thread setting: ``"N"`` -> N (one worker on N threads), ``"WxT"`` -> ``"WxT"`` (the batch
    split over W workers of T threads each, W >= 2). ValueError otherwise."""
    text = text.strip()
    workers, sep, per = text.partition("x")
    if not sep:
        n = int(text)
        if n < 1:
            raise ValueError(f"a thread count must be >= 1, got {text!r}")
        return n
    w, t = int(workers), int(per)
    if w < 2 or t < 1:
        raise ValueError(f"a split setting is WxT with W >= 2 workers of T >= 1 threads, got {text!r}")
    return f"{w}x{t}"


def setting_threads(setting) -> int:
    """The threads a setting uses in all."""
    if isinstance(setting, int):
        return setting
    w, t = setting.split("x")
    return int(w) * int(t)


def setting_workers(setting) -> int:
    return 1 if isinstance(setting, int) else int(setting.split("x")[0])


def _setting_order(setting) -> tuple:
    """Ties go to fewer threads, then to one worker."""
    return (-setting_threads(setting), -setting_workers(setting))


def _ratios(results: dict) -> list[dict]:
    """Ours vs the peer of the same dtype, at equal threads, and vs the peer's better thread count."""
    rows = []
    for model_name, m in results["models"].items():
        cases = m["cases"]
        for c in cases:
            for name, e in c["engines"].items():
                peer = PEER_OF_DTYPE.get(e["dtype"])
                if name in PEERS or name == peer or "tokens_per_second" not in e:
                    continue
                p = c["engines"].get(peer, {})
                if "tokens_per_second" not in p:
                    continue
                best = max(
                    (
                        (x["engines"][peer]["tokens_per_second"], x["threads"])
                        for x in cases
                        if x["mode"] == c["mode"]
                        and x["batch"] == c["batch"]
                        and "tokens_per_second" in x["engines"].get(peer, {})
                    ),
                    key=lambda v: (v[0], _setting_order(v[1])),
                )
                rows.append(
                    {
                        "model": model_name,
                        "engine": name,
                        "peer": peer,
                        "mode": c["mode"],
                        "batch": c["batch"],
                        "threads": c["threads"],
                        "ratio_same_threads": e["tokens_per_second"] / p["tokens_per_second"],
                        "peer_best_threads": best[1],
                        "ratio_vs_peer_best": e["tokens_per_second"] / best[0],
                    }
                )
    return rows


def _cells(results: dict):
    """``(model, case)`` for every measured case."""
    for model_name, m in results["models"].items():
        for c in m["cases"]:
            yield model_name, c


def _tps(case: dict, name: str):
    return case["engines"].get(name, {}).get("tokens_per_second")


def _best_threads(results: dict) -> list[dict]:
    """Each engine's faster thread count per model, mode and batch (its tokens/s there, and at
    every thread count measured)."""
    by_cell: dict = {}
    for model_name, c in _cells(results):
        for name in c["engines"]:
            tps = _tps(c, name)
            if tps is not None:
                key = (model_name, name, c["mode"], c["batch"])
                by_cell.setdefault(key, {})[c["threads"]] = tps
    rows = []
    for (model_name, name, mode, batch), by_threads in by_cell.items():
        threads = max(by_threads, key=lambda t: (by_threads[t], _setting_order(t)))
        rows.append(
            {
                "model": model_name,
                "engine": name,
                "mode": mode,
                "batch": batch,
                "best_threads": threads,
                "tokens_per_second": by_threads[threads],
                "tokens_per_second_by_threads": {
                    str(t): v for t, v in sorted(by_threads.items(), key=lambda kv: str(kv[0]))
                },
            }
        )
    return rows


def _quantized_speedups(results: dict, engines: list[Engine]) -> list[dict]:
    """Per cell (model, mode, batch, threads) the speed-up of every quantized engine over the
    float32 engine of its runtime (ours: ``onnxrt``; CTranslate2: ``ctranslate2``), and the
    same with each at its faster thread count (``threads: "best"``)."""
    pairs = [(e.name, e.float32_engine) for e in engines if e.float32_engine]
    rows = []
    for model_name, c in _cells(results):
        for name, base in pairs:
            q, f = _tps(c, name), _tps(c, base)
            if q is not None and f is not None:
                rows.append(
                    {
                        "model": model_name,
                        "engine": name,
                        "float32_engine": base,
                        "mode": c["mode"],
                        "batch": c["batch"],
                        "threads": c["threads"],
                        "speedup": q / f,
                    }
                )
    best = {(r["model"], r["engine"], r["mode"], r["batch"]): r for r in _best_threads(results)}
    for (model_name, name, mode, batch), r in best.items():
        base = dict(pairs).get(name)
        f = best.get((model_name, base, mode, batch))
        if base and f:
            rows.append(
                {
                    "model": model_name,
                    "engine": name,
                    "float32_engine": base,
                    "mode": mode,
                    "batch": batch,
                    "threads": "best",
                    "engine_threads": r["best_threads"],
                    "float32_threads": f["best_threads"],
                    "speedup": r["tokens_per_second"] / f["tokens_per_second"],
                }
            )
    return rows


def bandwidth_floors(cases: list, nbytes: dict, engines: list[Engine], machine: dict) -> dict:
    """Batch-1 floor (ms per generated token) per engine and thread count, and the fraction reached."""
    out = {}
    read = machine.get("read_bandwidth_bytes_per_s", {})
    for e in engines:
        b = nbytes.get(e.bytes_key)
        if b is None:
            continue
        entry = {"weight_bytes_per_token": b, "by_threads": {}}
        for c in cases:
            if c["batch"] != 1 or c["mode"] != "greedy" or "ms_per_step" not in c["engines"].get(e.name, {}):
                continue
            bw = read.get(str(setting_threads(c["threads"])))
            if not bw:
                continue
            floor_ms = 1e3 * b / bw
            entry["by_threads"][str(c["threads"])] = {
                "read_bandwidth_bytes_per_s": bw,
                "floor_ms_per_token": floor_ms,
                "fraction_of_floor": floor_ms / c["engines"][e.name]["ms_per_step"],
            }
        out[e.name] = entry
    return out


def summary_table(results: dict) -> str:
    """Tokens/s of every engine per case, and our ratios against the peer of the same dtype."""
    lines = []
    for model_name, m in results["models"].items():
        names = [e["name"] for e in results["engines"]]
        lines.append(f"{model_name}: tokens/s (median of {results['repeats']})")
        lines.append(f"{'case':<18}" + "".join(f"{n:>18}" for n in names))
        for c in m["cases"]:
            row = f"{c['mode']} b{c['batch']} {c['threads']}t"
            cells = []
            for n in names:
                e = c["engines"].get(n, {})
                cells.append(f"{e['tokens_per_second']:18.1f}" if "tokens_per_second" in e else f"{'-':>18}")
            lines.append(f"{row:<18}" + "".join(cells))
    best = {(r["model"], r["engine"], r["mode"], r["batch"]): r for r in results.get("best_threads", [])}
    for model_name, m in results["models"].items():
        names = [e["name"] for e in results["engines"]]
        cells = sorted({(c["mode"], c["batch"]) for c in m["cases"]}, key=lambda x: (MODES.index(x[0]), x[1]))
        lines.append("")
        lines.append(f"{model_name}: each engine at its faster thread count (tokens/s @ threads)")
        lines.append(f"{'case':<18}" + "".join(f"{n:>18}" for n in names))
        for mode, batch in cells:
            row = []
            for n in names:
                r = best.get((model_name, n, mode, batch))
                row.append(f"{r['tokens_per_second']:13.1f} @{r['best_threads']}t" if r else f"{'-':>18}")
            lines.append(f"{f'{mode} b{batch} best':<18}" + "".join(row))
    speedups = results.get("quantized_speedups", [])
    if speedups:
        lines.append("")
        lines.append(
            "quantized over float32 of the same runtime (speed-up per cell; best = each at its faster threads)"
        )
        for r in speedups:
            threads = (
                f"best ({r['engine_threads']}t vs {r['float32_threads']}t)"
                if r["threads"] == "best"
                else f"{r['threads']}t"
            )
            lines.append(
                f"  {r['engine']:<18} / {r['float32_engine']:<12} {r['mode']:<6} b{r['batch']:<3} {threads}: "
                f"{r['speedup']:.2f}x"
            )
    lines.append("")
    lines.append("ratios (ours / peer of the same dtype): same threads | vs the peer's better thread count")
    for r in results.get("ratios", []):
        lines.append(
            f"  {r['engine']:<12} vs {r['peer']:<17} {r['mode']:<6} b{r['batch']:<3} {r['threads']}t: "
            f"{r['ratio_same_threads']:.2f}x | {r['ratio_vs_peer_best']:.2f}x (peer best at "
            f"{r['peer_best_threads']}t)"
        )
    for model_name, m in results["models"].items():
        for name, f in m.get("bandwidth_floor_batch1", {}).items():
            for t, v in f["by_threads"].items():
                lines.append(
                    f"  floor {model_name} {name} {t}t: {f['weight_bytes_per_token'] / 1e6:.1f} MB/token, "
                    f"{v['floor_ms_per_token']:.2f} ms, reached {v['fraction_of_floor']:.0%}"
                )
    return "\n".join(lines)


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [(m, c) for m, r in results["models"].items() for c in r["cases"]]
    engines = [e["name"] for e in results["engines"]]
    speedups = [r for r in results.get("quantized_speedups", []) if r["threads"] != "best"]
    if speedups:
        fig, (ax, ax2) = plt.subplots(2, 1, figsize=(max(7, 1.6 * len(cases)), 9))
    else:
        fig, ax = plt.subplots(figsize=(max(7, 1.6 * len(cases)), 5))
    width = 0.8 / max(1, len(engines))
    for i, name in enumerate(engines):
        xs, ys = [], []
        for j, (_, case) in enumerate(cases):
            tps = case["engines"].get(name, {}).get("tokens_per_second")
            if tps is not None:
                xs.append(j + (i - (len(engines) - 1) / 2) * width)
                ys.append(tps)
        bars = ax.bar(xs, ys, width, label=name)
        ax.bar_label(bars, fmt="%.0f", fontsize=6, rotation=90)
    ax.set_xticks(
        range(len(cases)), [f"{c['mode']}\nb{c['batch']} {c['threads']}t" for _, c in cases], fontsize=8
    )
    cpu = results["machine"].get("model_name", "?")
    ax.set(
        ylabel="generated tokens / second",
        yscale="log",
        title=f"{'/'.join(results['models'])}: {results.get('new_tokens', NEW_TOKENS)} tokens, source "
        f"{results.get('src_len', SRC_LEN)}, one process per engine\n{cpu}",
    )
    ax.legend(fontsize=7)
    if speedups:
        quantized = list(dict.fromkeys(r["engine"] for r in speedups))
        index = {(m, c["mode"], c["batch"], c["threads"]): j for j, (m, c) in enumerate(cases)}
        width2 = 0.8 / len(quantized)
        for i, name in enumerate(quantized):
            rows = [r for r in speedups if r["engine"] == name]
            xs = [
                index[(r["model"], r["mode"], r["batch"], r["threads"])]
                + (i - (len(quantized) - 1) / 2) * width2
                for r in rows
            ]
            bars = ax2.bar(
                xs, [r["speedup"] for r in rows], width2, label=f"{name} / {rows[0]['float32_engine']}"
            )
            ax2.bar_label(bars, fmt="%.2f", fontsize=6, rotation=90)
        ax2.axhline(1.0, color="grey", linewidth=0.8)
        ax2.set_xticks(
            range(len(cases)), [f"{c['mode']}\nb{c['batch']} {c['threads']}t" for _, c in cases], fontsize=8
        )
        ax2.set(ylabel="speed-up over float32 (same runtime)")
        ax2.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)


def _model_folder(artifacts: str | None, model_name: str) -> str:
    """Where ``model_name``'s engines are built: ``<artifacts>/<model>`` (reused when this benchmark
    prepared it), or a new temporary folder."""
    if not artifacts:
        return _scratch_dir(f"bench_decode_{model_name}_")
    scratch = os.path.join(os.path.abspath(artifacts), model_name)
    if not os.path.isfile(os.path.join(scratch, PREPARED)) and os.path.exists(scratch):
        raise ValueError(
            f"--artifacts: {scratch} exists but was not prepared by this benchmark "
            f"(no {PREPARED}); choose a new folder"
        )
    os.makedirs(scratch, exist_ok=True)
    return scratch


def _measure_setting(entry, engines, paths, config, threads, modes, batch_sizes, repeats, model_name) -> None:
    """Every case of one thread setting (``threads``: N, or WxT for a split), each engine in a
    worker process of its own, appended to ``entry["cases"]``."""
    workers: dict = {}
    n_workers = setting_workers(threads)
    # a split setting runs the engines that can split a batch
    setting_engines = [e for e in engines if n_workers == 1 or e.worker in SPLITTABLE]
    try:
        for e in setting_engines:
            extra = {"workers": n_workers} if n_workers > 1 else None
            workers[e.name] = EngineProcess(
                e, paths[e.artifact], setting_threads(threads), config, extra=extra
            )
            entry["workers"][f"{e.name}/{threads}"] = workers[e.name].info
        for mode in modes:
            for batch in batch_sizes:
                # a batch smaller than the split still runs: CTranslate2 with inter_threads=W
                # at batch 1 is a setting a user may pick, and is timed as such
                logger.info("%s %s batch %d, %s thread(s) ...", model_name, mode, batch, threads)
                case = measure_case(workers, setting_engines, mode, batch, config, repeats)
                case["threads"] = threads
                for name, e in case["engines"].items():
                    if "tokens_per_second" in e:
                        logger.info("  %-17s %8.1f tokens/s", name, e["tokens_per_second"])
                entry["cases"].append(case)
    finally:
        for w in workers.values():
            w.close()


def run(
    models: list[str],
    engine_names: list[str] | None = None,
    batch_sizes=(1, 16, 64),
    modes=MODES,
    threads_list=(1, 2, "2x1"),
    repeats: int = 5,
    out: str | None = None,
    artifacts: str | None = None,
    prepare_only: bool = False,
) -> dict:
    """Run the benchmark and write ``out`` (JSON) and the PNG beside it; returns the results.

    ``artifacts``: a folder to build the models in (``<artifacts>/<model>``) and reuse on the next
    run, instead of a temporary one; ``prepare_only`` builds them and measures nothing."""
    available = {e.name: e for e in ENGINES}
    if engine_names is not None:
        unknown = sorted(set(engine_names) - set(available))
        if unknown:
            raise ValueError(f"unknown engines {unknown}; available: {sorted(available)}")
    bad_modes = sorted(set(modes) - set(MODES))
    if bad_modes:
        raise ValueError(f"unknown modes {bad_modes}; available: {list(MODES)}")
    engines = [e for e in ENGINES if engine_names is None or e.name in engine_names]
    machine = machine_info()
    if not machine["bf16"]["native"] and any(e.dtype == "bfloat16" for e in engines):
        logger.warning("bfloat16 engines left out: %s", machine["bf16"]["reason"])
        engines = [e for e in engines if e.dtype != "bfloat16"]
    results: dict = {
        "machine": machine,
        "environment": environment(),
        "src_len": SRC_LEN,
        "new_tokens": NEW_TOKENS,
        "modes": list(modes),
        "threads": list(threads_list),
        "batch_sizes": list(batch_sizes),
        "repeats": repeats,
        "engine_processes": "one per engine and thread count (decode_worker.py)",
        "beam": {
            "size": 4,
            "length_penalty": "none (ours: length_penalty_type='none'; CTranslate2: length_penalty=0)",
        },
        "engines": [{"name": e.name, "description": e.description, "dtype": e.dtype} for e in engines],
        "models": {},
        "load_average_start": os.getloadavg(),
    }
    for model_name in models:
        paths, nbytes, config = prepare(model_name, engines, _model_folder(artifacts, model_name))
        if prepare_only:
            continue
        entry = {
            "config": config,
            "weight_bytes_per_token": {e.name: nbytes.get(e.bytes_key) for e in engines},
            "quantization": {e.name: export_quantization(paths[e.artifact]) for e in engines},
            "workers": {},
            "cases": [],
        }
        for threads in threads_list:
            _measure_setting(entry, engines, paths, config, threads, modes, batch_sizes, repeats, model_name)
            entry["bandwidth_floor_batch1"] = bandwidth_floors(entry["cases"], nbytes, engines, machine)
            results["models"][model_name] = entry
            # what is measured so far, in case the run is cut short (the final write replaces it)
            write_json(
                os.path.splitext(out or os.path.join(HERE, "results", "bench_decode.json"))[0]
                + ".partial.json",
                {**results, "complete": False},
            )
    if prepare_only:
        return results
    results["ratios"] = _ratios(results)
    results["best_threads"] = _best_threads(results)
    results["quantized_speedups"] = _quantized_speedups(results, engines)
    results["load_average_end"] = os.getloadavg()
    results["complete"] = True
    out = out or os.path.join(HERE, "results", "bench_decode.json")
    write_json(out, results)
    partial = os.path.splitext(out)[0] + ".partial.json"
    if os.path.exists(partial):
        os.remove(partial)
    plot(results, os.path.splitext(out)[0] + ".png")
    logger.info("wrote %s and %s", out, os.path.splitext(out)[0] + ".png")
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=None, help="comma-separated presets (default: base; --quick: tiny)")
    p.add_argument("--engines", default=None, help=f"comma-separated subset of {[e.name for e in ENGINES]}")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of greedy,beam4")
    p.add_argument(
        "--batch-sizes", default="1,16,64", help="comma-separated batch sizes, every mode (default: 1,16,64)"
    )
    p.add_argument(
        "--threads",
        default="1,2,2x1",
        help="comma-separated thread settings, every engine (default: 1,2,2x1): N threads, or WxT, the "
        "batch split over W workers of T threads each (ours: W OrtRunners under "
        "runtimes.procpool.ProcessSourceParallel; CTranslate2: inter_threads=W, intra_threads=T, max_batch_size "
        "a W-th of the batch; other engines skip it)",
    )
    p.add_argument(
        "--repeats", type=int, default=5, help="timed rounds per case; medians reported (default: 5)"
    )
    p.add_argument("--quick", action="store_true", help="tiny model, 1 repeat: a smoke test")
    p.add_argument(
        "--artifacts",
        default=None,
        help="folder to build the exported / converted models in and reuse on later runs (default: a "
        "temporary folder)",
    )
    p.add_argument(
        "--prepare-only", action="store_true", help="build the artifacts (with --artifacts) and stop"
    )
    p.add_argument(
        "--out",
        default=None,
        help="JSON path (default: benchmarks/results/bench_decode.json, "
        "bench_decode_quick.json with --quick); the PNG goes beside it",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    models = args.models.split(",") if args.models else (["tiny"] if args.quick else ["base"])
    try:
        batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
        threads = [parse_setting(t) for t in args.threads.split(",")]
    except ValueError as exc:
        p.error(f"--batch-sizes takes comma-separated integers and --threads N or WxT settings ({exc})")
    if args.repeats < 1 or min(batch_sizes) < 1:
        p.error("--repeats and --batch-sizes must be >= 1")
    out = args.out or (os.path.join(HERE, "results", "bench_decode_quick.json") if args.quick else None)
    if args.prepare_only and not args.artifacts:
        p.error("--prepare-only needs --artifacts")
    results = run(
        models,
        args.engines.split(",") if args.engines else None,
        batch_sizes,
        args.modes.split(","),
        threads,
        1 if args.quick else args.repeats,
        out,
        args.artifacts,
        args.prepare_only,
    )
    if args.prepare_only:
        return 0
    print(summary_table(results))
    ok = all(
        e.get("tokens_match", True)
        for m in results["models"].values()
        for c in m["cases"]
        for e in c["engines"].values()
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
