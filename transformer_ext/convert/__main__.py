"""``python -m transformer_ext.convert transformers HF_DIR --out MODEL_DIR``: the converter CLI."""

from __future__ import annotations

if __name__ == "__main__":  # before the imports: one line, not a traceback, where they are missing
    from transformer_ext.commands import require

    require("transformer_ext.convert")

import argparse
import logging
import sys
from typing import Optional, Sequence

from ..cli import add_debug_flag, add_version_flag, run_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="transformer-ext-convert",
        description="Convert a pretrained checkpoint folder into a transformer_ext model folder.",
    )
    add_version_flag(parser)
    sub = parser.add_subparsers(dest="source", required=True, metavar="SOURCE")
    hf = sub.add_parser(
        "transformers",
        help="a local Hugging Face checkpoint folder (MarianMT / opus-mt, M2M100, NLLB-200)",
        description="Read a local Hugging Face checkpoint folder (config.json, weights, generation config, "
        "tokenizer files) without transformers and write a model folder of ours.",
    )
    hf.add_argument(
        "hf_dir",
        metavar="HF_DIR",
        help="the checkpoint folder (as save_pretrained writes it), or a Hugging Face hub id (ORG/NAME) "
        "where no such folder exists: read from the hub cache, downloaded unless HF_HUB_OFFLINE=1 "
        "(needs huggingface_hub)",
    )
    hf.add_argument(
        "--out", required=True, metavar="MODEL_DIR", help="the model folder to create (must not exist)"
    )
    add_debug_flag(hf)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)

    def work() -> int:
        from . import convert_transformers

        out = convert_transformers(args.hf_dir, args.out)
        print(out)
        return 0

    return run_cli(parser.prog, work, debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
