"""One decoding engine in a process of its own, for ``bench_decode.py`` (docs/DESIGN.md section 4).

Started by the parent as ``python benchmarks/decode_worker.py '<json spec>'``; it loads only what
its engine needs (the CTranslate2 and ONNX Runtime workers import numpy and their engine, never
torch: the check is made after the engine is built and reported to the parent), then answers
decode requests until told to stop. Requests and answers are pickled over the process's stdin
and the original stdout; anything the engine prints goes to stderr.

Spec: ``{"engine": "ctranslate2" | "onnxrt" | "eager", "model": <folder>, "threads": N,
"compute_type": "float32" | "int8" (CTranslate2), "forbid_torch": bool, "bos": id, "eos": id}``.
Request: ``("decode", mode, input_ids, src_lengths, n_tokens)`` with mode ``"greedy"`` or
``"beam4"``: exactly ``n_tokens`` tokens per sequence (EOS suppressed until then), beam search
without length penalty; answer ``("done", (tokens, seconds))``, ``tokens`` the best hypothesis per
source, ``seconds`` the decode's wall time measured here.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import time
import traceback

BEAM = 4


def _ctranslate2(spec):
    import ctranslate2

    translator = ctranslate2.Translator(
        spec["model"],
        device="cpu",
        compute_type=spec["compute_type"],
        intra_threads=int(spec["threads"]),
        inter_threads=1,
    )
    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    target_ids = {tok: i for i, tok in enumerate(specials)}

    def decode(mode, src, lengths, n):
        batch = [[f"s{int(t)}" for t in row[:length]] for row, length in zip(src, lengths)]
        beam = 1 if mode == "greedy" else BEAM
        results = translator.translate_batch(
            batch,
            beam_size=beam,
            length_penalty=0.0,
            max_batch_size=len(batch),
            max_decoding_length=n,
            min_decoding_length=n,
        )
        return [[target_ids[t] if t in target_ids else int(t[1:]) for t in r.hypotheses[0]] for r in results]

    return decode


def _search(runner, spec):
    bos, eos = int(spec["bos"]), int(spec["eos"])

    def decode(mode, src, lengths, n):
        from transformer_ext.decoding import beam_search, greedy_decode

        if mode == "greedy":
            return greedy_decode(
                runner, src, lengths, bos_id=bos, eos_id=eos, max_new_tokens=n, min_new_tokens=n
            )
        hyps = beam_search(
            runner,
            src,
            lengths,
            bos_id=bos,
            eos_id=eos,
            beam_size=BEAM,
            max_new_tokens=n,
            min_new_tokens=n,
            length_penalty="none",
        )
        return [list(row[0].tokens) for row in hyps]

    return decode


def _onnxrt(spec):
    from transformer_ext.runtimes.ort import OrtRunner

    return _search(OrtRunner(spec["model"], intra_op_num_threads=int(spec["threads"])), spec)


def _eager(spec):
    import torch

    from transformer_ext.checkpoint import load_model
    from transformer_ext.runtimes import EagerRunner

    torch.set_num_threads(int(spec["threads"]))
    model = load_model(spec["model"], torch.device("cpu")).eval()
    dtype = spec.get("dtype", "float32")
    return _search(EagerRunner(model, torch.device("cpu"), dtype=dtype), spec)


BUILDERS = {"ctranslate2": _ctranslate2, "onnxrt": _onnxrt, "eager": _eager}


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
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
        decode = BUILDERS[spec["engine"]](spec)
        torch_imported = "torch" in sys.modules
        if spec.get("forbid_torch") and torch_imported:
            raise RuntimeError(f"the {spec['engine']} worker imported torch; it must load only its engine")
        send(
            (
                "ready",
                {
                    "torch_imported": torch_imported,
                    "pid": os.getpid(),
                    "modules": sorted(m for m in ("torch", "ctranslate2", "onnxruntime") if m in sys.modules),
                },
            )
        )
        while True:
            msg = pickle.load(proto_in)
            if msg[0] == "stop":
                return 0
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
