"""The CTranslate2 baseline server of bench_serve: one ``translate_batch`` per request, as its users write one.

A FastAPI app with the native API's route (``POST /v1/translate``: ``{"text": str or [str]}``
answered ``{"translations": [{"text": ...}]}``) and ``GET /readyz``. Each request is one
``ctranslate2.Translator.translate_batch`` call on the request's sources, in FastAPI's thread
pool (a plain ``def`` route), so ``inter_threads`` translator replicas serve that many requests
at once; nothing batches across requests. The model is a CTranslate2 conversion of the same
weights whose tokens are ``s<id>`` / ``t<id>`` (``benchmarks.decode.bench_decode`` converts ours
that way); the tokenizer folder's tokenizer turns text into ids and back. Each source may
generate ``floor(a * n + b)`` tokens (EOS included), at most ``--max-decoding-length``: the budget rule of
the served translator, so both engines generate the same tokens. Greedy search.

    python -m benchmarks.serve.ct2_server --ct2-model DIR --tokenizer DIR --inter-threads 2 --intra-threads 1

It listens on a free port of 127.0.0.1 and logs ``listening on http://HOST:PORT``; it imports no
torch (the tokenizer module does not).
"""

from __future__ import annotations

import argparse
import math
import socket
import sys


def build_app(ct2_model: str, tokenizer_dir: str, inter_threads: int, intra_threads: int, budget: tuple):
    import ctranslate2
    from fastapi import FastAPI, HTTPException

    from transformer_ext.text import normalize_text
    from transformer_ext.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    translator = ctranslate2.Translator(
        ct2_model, device="cpu", inter_threads=inter_threads, intra_threads=intra_threads
    )
    specials = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}  # bench_decode's conversion
    a, b, cap = budget
    app = FastAPI()

    def translate(texts: list[str]) -> list[str]:
        ids = [tokenizer.encode_source(normalize_text(t), unknown="unk") for t in texts]
        longest = max(len(s) for s in ids)
        results = translator.translate_batch(
            [[f"s{i}" for i in s] for s in ids],
            beam_size=1,
            max_decoding_length=max(1, min(cap, math.floor(a * longest + b))),
        )
        return [
            tokenizer.decode_target([specials[t] if t in specials else int(t[1:]) for t in r.hypotheses[0]])
            for r in results
        ]

    @app.post("/v1/translate")
    def route(body: dict):
        text = body.get("text")
        texts = text if isinstance(text, list) else [text]
        if not texts or not all(isinstance(t, str) and t.strip() for t in texts):
            raise HTTPException(400, "text: expected a non-empty string or list of strings")
        return {"translations": [{"text": t} for t in translate(texts)]}

    @app.get("/readyz")
    def ready():
        return {"status": "ready"}

    return app


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ct2-model", required=True, help="the CTranslate2 model folder")
    parser.add_argument("--tokenizer", required=True, help="a folder with the model's tokenizer files")
    parser.add_argument("--inter-threads", type=int, default=1, help="translator replicas")
    parser.add_argument("--intra-threads", type=int, default=1, help="threads of each replica")
    parser.add_argument("--max-len-a", type=float, default=1.5, help="budget tokens per source token")
    parser.add_argument("--max-len-b", type=float, default=10.0, help="budget extra tokens")
    parser.add_argument("--max-decoding-length", type=int, default=1024, help="the largest budget")
    args = parser.parse_args(argv)
    if min(args.inter_threads, args.intra_threads, args.max_decoding_length) < 1:
        parser.error("--inter-threads, --intra-threads and --max-decoding-length must be >= 1")
    if (
        not (math.isfinite(args.max_len_a) and math.isfinite(args.max_len_b))
        or min(args.max_len_a, args.max_len_b) < 0
    ):
        parser.error("--max-len-a and --max-len-b must be finite and >= 0")
    import uvicorn

    app = build_app(
        args.ct2_model,
        args.tokenizer,
        args.inter_threads,
        args.intra_threads,
        (args.max_len_a, args.max_len_b, args.max_decoding_length),
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    print(f"listening on http://127.0.0.1:{sock.getsockname()[1]}", file=sys.stderr, flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False)).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
