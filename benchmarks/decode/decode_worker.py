"""One decoding engine in a process of its own, for ``bench_decode.py`` (docs/DESIGN.md section 4).

Started by the parent as ``python -m benchmarks.decode.decode_worker '<json spec>'``; it loads only what
its engine needs (the CTranslate2 and ONNX Runtime workers import numpy and their engine, never
torch: the check is made after the engine is built and reported to the parent), then answers
decode requests until told to stop. Requests and answers are pickled over the process's stdin
and the original stdout; anything the engine prints goes to stderr.

Spec: ``{"engine": "ctranslate2" | "onnxrt" | "eager" | "transformers" | "optimum", "model":
<folder>, "threads": N, "compute_type": "float32" | "int8" (CTranslate2), "forbid_torch": bool,
"bos": id, "eos": id}``, optionally ``"workers": W`` (``ctranslate2`` and ``onnxrt``, W dividing N:
the batch split into W parts decoded at once, each on N / W threads: CTranslate2's
``inter_threads=W, intra_threads=N/W`` with ``max_batch_size`` = a W-th of the batch, ours W
``OrtRunner`` s, each in a worker process of its own under ``runtimes.procpool.ProcessSourceParallel``
(default, ``"pool": "processes"``: no interpreter lock shared by the parts' host work; the workers
import no torch either, and count in ``torch_imported``) or in threads of this process under
``runtimes.pool.SourceParallel`` (``"pool": "threads"``); the ready answer records it as
``split_pool``: the pool and, for processes, the workers' pids), ``"pack_weights": false``
(``onnxrt``: ``OrtRunner(pack_weights=False)``, the weight products read from the mapped
``weights.data``, shared by worker processes), and optionally ``"banned_ids": [id, ...]`` (never generated: our
``banned_ids``, transformers' ``bad_words_ids``) and ``"vocabulary": <a JSON list of token
strings>`` (CTranslate2: token ``i`` is id ``i``, as in a converted Hugging Face model's
``shared_vocabulary.json``; without it the tokens are ``s<id>`` / ``t<id>`` with our four specials).
Request: ``("decode", mode, input_ids, src_lengths, n_tokens)`` with mode ``"greedy"`` or
``"beam4"``: exactly ``n_tokens`` tokens per sequence (EOS suppressed until then), beam search
without length penalty; answer ``("done", (tokens, seconds))``, ``tokens`` the best hypothesis per
source, ``seconds`` the decode's wall time measured here.

Spec ``"task": "lines"`` (``ctranslate2`` and ``onnxrt`` only; benchmarks/decode/bench_small_model.py):
the worker translates text instead. Request ``("translate", lines, options)``; answer ``("done",
(outputs, cpu_seconds, wall_seconds))``, ``outputs`` one ``(token ids, text)`` per line, the
seconds the process's CPU time and the wall time of the whole call (tokenization included). The
``onnxrt`` worker runs ``Translator.from_export_dir(model).translate_iterable`` (the translate
CLI's path) with ``options["max_batch_tokens"]`` (and ``options["max_decoding_length"]``, new tokens at
most, where given; with ``spec["split"]`` the answer holds a fourth item, the CPU seconds and
calls of its encoder and decoder step graphs); the ``ctranslate2`` one tokenizes with the
tokenizer in ``spec["tokenizer"]`` (a folder holding ours), runs ``translate_iterable`` in token
batches of ``options["max_batch_tokens"]``, greedy, ``max_decoding_length`` =
``options["max_decoding_length"]``, and detokenizes with the same tokenizer.

The ``transformers`` (PyTorch ``generate``) and ``optimum`` (``ORTModelForSeq2SeqLM.generate``)
workers read a Hugging Face folder; the parent may start them with another environment's python
(benchmarks/decode/bench_pretrained.py): this file imports nothing of the package at module level.
"""

from __future__ import annotations

import functools
import json
import os
import pickle
import sys
import time
import traceback

BEAM = 4


def _ctranslate2(spec):
    import ctranslate2

    workers = int(spec.get("workers", 1))
    translator = ctranslate2.Translator(
        spec["model"],
        device="cpu",
        compute_type=spec["compute_type"],
        intra_threads=int(spec["threads"]) // workers,
        inter_threads=workers,
    )
    if spec.get("vocabulary"):
        with open(spec["vocabulary"], encoding="utf-8") as f:
            pieces = json.load(f)
        target_ids = {tok: i for i, tok in enumerate(pieces)}

        def source(t):
            return pieces[int(t)]

        def target(t):
            return target_ids[t]

    else:
        specials = ["<pad>", "<s>", "</s>", "<unk>"]
        target_ids = {tok: i for i, tok in enumerate(specials)}

        def source(t):
            return f"s{int(t)}"

        def target(t):
            return target_ids[t] if t in target_ids else int(t[1:])

    def decode(mode, src, lengths, n):
        batch = [[source(t) for t in row[:length]] for row, length in zip(src, lengths)]
        beam = 1 if mode == "greedy" else BEAM
        results = translator.translate_batch(
            batch,
            beam_size=beam,
            length_penalty=0.0,
            # with several workers the batch is split into as many sub-batches, decoded at once
            max_batch_size=-(-len(batch) // workers),
            max_decoding_length=n,
            min_decoding_length=n,
        )
        return [[target(t) for t in r.hypotheses[0]] for r in results]

    return decode


def _decode_part(runner, src, lengths, *, mode, n, bos, eos, banned):
    """One decode request on ``runner`` (or one part of it, in a pool): exactly ``n`` tokens,
    greedy or beam 4 without length penalty -> the best hypothesis's tokens per source. A
    module-level function, so that a process pool can send it to its workers."""
    from transformer_ext.decoding import beam_search, greedy_decode

    if mode == "greedy":
        return greedy_decode(
            runner,
            src,
            lengths,
            bos_id=bos,
            eos_id=eos,
            max_decoding_length=n,
            min_decoding_length=n,
            banned_ids=banned,
        )
    hyps = beam_search(
        runner,
        src,
        lengths,
        bos_id=bos,
        eos_id=eos,
        banned_ids=banned,
        beam_size=BEAM,
        max_decoding_length=n,
        min_decoding_length=n,
        length_penalty_type="none",
    )
    return [list(row[0].tokens) for row in hyps]


def _search(runner, spec, parallel=None):
    bos, eos = int(spec["bos"]), int(spec["eos"])
    banned = [int(t) for t in spec.get("banned_ids", ())]

    def decode(mode, src, lengths, n):
        search = functools.partial(_decode_part, mode=mode, n=n, bos=bos, eos=eos, banned=banned)
        if parallel is not None:  # the parts of the batch on several runners at once
            return parallel.run(search, src, lengths)
        return search(runner, src, lengths)

    return decode


def _onnxrt(spec):
    from transformer_ext.runtimes.ort import OrtRunner

    workers = int(spec.get("workers", 1))
    threads = int(spec["threads"]) // workers
    make = functools.partial(
        OrtRunner,
        spec["model"],
        intra_op_num_threads=threads,
        pack_weights=bool(spec.get("pack_weights", True)),
    )
    if workers == 1:
        return _search(make(), spec)
    from transformer_ext.runtimes.pool import open_source_parallel

    pool = spec.get("pool", "processes")
    parallel = open_source_parallel(make, workers, pool=pool)
    decode = _search(None, spec, parallel)
    decode.close, decode.parallel = parallel.close, parallel
    decode.pool = {"pool": pool}
    if pool == "processes":
        decode.pool.update(
            worker_pids=parallel.worker_pids, workers_torch_imported=parallel.workers_torch_imported
        )
    return decode


def _eager(spec):
    import torch

    from transformer_ext.checkpoint import load_model
    from transformer_ext.runtimes import EagerRunner

    torch.set_num_threads(int(spec["threads"]))
    model = load_model(spec["model"], torch.device("cpu")).eval()
    dtype = spec.get("dtype", "float32")
    return _search(EagerRunner(model, torch.device("cpu"), dtype=dtype), spec)


def _generate(model, spec):
    """Decoding with a Hugging Face model's ``generate`` (transformers' PyTorch model or Optimum's
    ``ORTModelForSeq2SeqLM``): the checkpoint's generation config with exactly ``n`` new tokens
    (``min_new_tokens = max_new_tokens``, no forced EOS at the end), ``bad_words_ids`` the banned
    tokens, greedy or beam 4; the best sequence per source without its decoder start token."""
    import numpy as np
    import torch
    import transformers

    transformers.logging.set_verbosity_error()  # not one max_length warning per call
    torch.set_num_threads(int(spec["threads"]))
    banned = [[int(t)] for t in spec.get("banned_ids", ())]
    model.generation_config.forced_eos_token_id = None  # exactly n tokens: no EOS forced at the end

    def decode(mode, src, lengths, n):
        ids = torch.from_numpy(np.ascontiguousarray(src, dtype=np.int64))
        mask = (torch.arange(ids.shape[1])[None, :] < torch.from_numpy(np.asarray(lengths))[:, None]).long()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                num_beams=1 if mode == "greedy" else BEAM,
                max_new_tokens=n,  # transformers' own names
                min_new_tokens=n,
                bad_words_ids=banned or None,
            )
        return [row[1:] for row in out.tolist()]

    return decode


def _transformers(spec):
    import torch
    from transformers import AutoModelForSeq2SeqLM

    torch.set_num_threads(int(spec["threads"]))
    model = AutoModelForSeq2SeqLM.from_pretrained(spec["model"], dtype=torch.float32).eval()
    return _generate(model, spec)


def _optimum(spec):
    """Optimum's ``ORTModelForSeq2SeqLM`` at its best CPU settings: the export with past key
    values (the merged decoder where the export has one), its own io-binding choice (off on CPU),
    ONNX Runtime's CPU provider with ``intra_op_num_threads`` = the thread count."""
    import onnxruntime
    from optimum.onnxruntime import ORTModelForSeq2SeqLM

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = int(spec["threads"])
    options.inter_op_num_threads = 1
    model = ORTModelForSeq2SeqLM.from_pretrained(
        spec["model"], provider="CPUExecutionProvider", session_options=options, use_cache=True
    )
    return _generate(model, spec)


def _ct2_lines(spec):
    """Text in, text out through CTranslate2 (``"task": "lines"``): our tokenizer both ways."""
    import ctranslate2

    from transformer_ext.text import normalize_text
    from transformer_ext.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(spec["tokenizer"])
    translator = ctranslate2.Translator(
        spec["model"], device="cpu", compute_type=spec["compute_type"], intra_threads=int(spec["threads"])
    )
    specials = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}  # the conversion's (bench_decode._ct2_spec)

    def target(t):
        return specials[t] if t in specials else int(t[1:])

    def translate(lines, options):
        source = ([f"s{i}" for i in tokenizer.encode_source(normalize_text(line))] for line in lines)
        results = translator.translate_iterable(
            source,
            max_batch_size=int(options["max_batch_tokens"]),
            batch_type="tokens",
            beam_size=1,
            max_decoding_length=int(options["max_decoding_length"]),
        )
        out = []
        for r in results:
            ids = [target(t) for t in r.hypotheses[0]]
            out.append((ids, tokenizer.decode_target(ids)))
        return out

    return translate


def _timed_calls(obj, method: str, totals: dict, key: str) -> None:
    """``obj.method`` counted in ``totals[key + "_calls"]`` and its process CPU time (every
    thread's: ONNX Runtime's pool included) added to ``totals[key + "_cpu_seconds"]``."""
    inner = getattr(obj, method)

    def timed(*args, **kwargs):
        start = time.process_time()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[key + "_cpu_seconds"] += time.process_time() - start
            totals[key + "_calls"] += 1

    setattr(obj, method, timed)


def _onnxrt_lines(spec):
    """Text in, text out through our Translator on an export folder (``"task": "lines"``).

    With ``spec["split"]`` the runner's two graph sessions are timed per call, and after each
    translation ``translate.split`` holds the CPU seconds and calls of the encoder graph
    (``encoder_*``) and of the decoder step graph (``step_*``); the rest of a translation's CPU
    time is the host's (tokenization, batching, the search, the caches)."""
    from transformer_ext.translator import Translator

    translator = Translator.from_export_dir(spec["model"], threads=int(spec["threads"]))
    totals = dict.fromkeys(("encoder_cpu_seconds", "encoder_calls", "step_cpu_seconds", "step_calls"), 0)
    if spec.get("split"):
        _timed_calls(translator.runner.encoder, "run", totals, "encoder")
        _timed_calls(translator.runner.decoder, "run_with_iobinding", totals, "step")

    def translate(lines, options):
        cap = options.get("max_decoding_length")
        extra = {"max_decoding_length": int(cap)} if cap is not None else {}
        totals.update(dict.fromkeys(totals, 0))
        stream = translator.translate_iterable(
            lines, max_batch_tokens=int(options["max_batch_tokens"]), **extra
        )
        outputs = [(t.tokens, str(t)) for t in stream]
        translate.split = dict(totals) if spec.get("split") else None
        return outputs

    translate.split = None
    return translate


LINE_BUILDERS = {"ctranslate2": _ct2_lines, "onnxrt": _onnxrt_lines}

BUILDERS = {
    "ctranslate2": _ctranslate2,
    "onnxrt": _onnxrt,
    "eager": _eager,
    "transformers": _transformers,
    "optimum": _optimum,
}


def main() -> int:
    proto_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever an engine prints must not corrupt the protocol
    sys.stdout = sys.stderr
    proto_in = sys.stdin.buffer

    def send(msg):
        pickle.dump(msg, proto_out)
        proto_out.flush()

    try:
        spec = json.loads(sys.argv[1])
        sys.path.insert(
            0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        )  # the repository: this worker runs under the peer engines' interpreters too
        lines_task = spec.get("task") == "lines"
        decode = (LINE_BUILDERS if lines_task else BUILDERS)[spec["engine"]](spec)
        pool = getattr(decode, "pool", None)  # a split over worker processes: theirs count too
        torch_imported = "torch" in sys.modules or any((pool or {}).get("workers_torch_imported", ()))
        if spec.get("forbid_torch") and torch_imported:
            raise RuntimeError(f"the {spec['engine']} worker imported torch; it must load only its engine")
        send(
            (
                "ready",
                {
                    "torch_imported": torch_imported,
                    "pid": os.getpid(),
                    "workers": int(spec.get("workers", 1)),
                    **({"split_pool": pool} if pool else {}),
                    "modules": sorted(
                        m
                        for m in ("torch", "ctranslate2", "onnxruntime", "transformers", "optimum")
                        if m in sys.modules
                    ),
                },
            )
        )
        while True:
            msg = pickle.load(proto_in)
            if msg[0] == "stop":
                getattr(decode, "close", lambda: None)()
                return 0
            if msg[0] == "translate":
                c0, t0 = time.process_time(), time.perf_counter()
                outputs = decode(msg[1], msg[2])
                reply = (outputs, time.process_time() - c0, time.perf_counter() - t0)
                split = getattr(decode, "split", None)  # the onnxrt worker's, with spec["split"]
                send(("done", reply + (split,) if split is not None else reply))
                continue
            _, mode, src, lengths, n = msg
            t0 = time.perf_counter()
            tokens = decode(mode, src, lengths, n)
            send(("done", (tokens, time.perf_counter() - t0)))
    except EOFError:
        return 0
    except BaseException:  # reported to the parent, which raises it naming the engine
        send(("error", traceback.format_exc()))
        return 1


if __name__ == "__main__":
    sys.exit(main())
