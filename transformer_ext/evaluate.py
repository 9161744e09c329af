"""Score translations with sacrebleu: BLEU and chrF of detokenized hypotheses against raw references.

``python -m transformer_ext.evaluate --model DIR --src FILE --ref FILE`` translates ``--src``
with the model folder (eager PyTorch) or an export folder (ONNX Runtime), and prints BLEU and
chrF with their sacrebleu signatures and the decoding settings (``--json``: one JSON object).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

logger = logging.getLogger(__name__)

__all__ = ["score_texts", "EvaluationError", "load_translator", "evaluate_files", "main"]


def _sacrebleu():
    try:
        import sacrebleu
    except ImportError as exc:  # pragma: no cover - depends on the environment
        from .cli import UserError

        raise UserError(
            "scoring needs the sacrebleu package: pip install sacrebleu==2.6.0 (or the [eval] extra)"
        ) from exc
    return sacrebleu


def score_texts(hypotheses: Sequence[str], references: Sequence[str]) -> dict:
    """Corpus BLEU (13a tokenization, exp smoothing) and chrF of ``hypotheses`` against one reference each.

    Returns ``{"bleu", "chrf", "bleu_signature", "chrf_signature", "n"}`` with sacrebleu's
    default settings, so the numbers equal those of the ``sacrebleu`` command on the same files.
    """
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    sacrebleu = _sacrebleu()
    bleu, chrf = sacrebleu.BLEU(), sacrebleu.CHRF()
    hyps, refs = list(hypotheses), [list(references)]
    b = bleu.corpus_score(hyps, refs)
    c = chrf.corpus_score(hyps, refs)
    return dict(
        bleu=float(b.score),
        chrf=float(c.score),
        bleu_signature=str(bleu.get_signature()),
        chrf_signature=str(chrf.get_signature()),
        n=len(hyps),
        bleu_detail=str(b),
    )


# ---------------------------------------------------------------------- command line
import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Optional  # noqa: E402

from .cli import UserError, add_debug_flag, add_option, run_cli  # noqa: E402
from .devices import DeviceUsageError, check_device_name  # noqa: E402
from .search_flags import add_decoding_flags, check_decoding_flags, decoding_values, given_flag  # noqa: E402

# The SearchOptions fields evaluate takes, in --help order: (field, old spellings, metavar).
EVALUATE_FLAGS = (
    ("beam_size", ("--beam",), "N"),
    ("length_penalty", ("--alpha",), "A"),
    ("length_penalty_type", (), None),
    ("early_stopping", (), None),
    ("max_decoding_length", (), "N"),
    ("min_decoding_length", (), "N"),
    ("max_len_a", (), "A"),
    ("max_len_b", (), "B"),
    ("repetition_penalty", (), "P"),
    ("no_repeat_ngram_size", (), "N"),
    ("sampling_topk", (), "K"),
    ("sampling_topp", (), "P"),
    ("sampling_temperature", (), "T"),
    ("seed", (), "N"),
)


class EvaluationError(UserError, ValueError):
    """Evaluation inputs that do not fit together (line counts, an empty source file, a bad --output)."""


def load_translator(
    model: Path,
    *,
    device: str = "cpu",
    threads: Optional[int] = None,
    source_lang: Optional[str] = None,
    target_lang: Optional[str] = None,
    dtype: Optional[str] = None,
):
    """``(translator, runtime name)`` of a model folder (eager PyTorch) or an export folder (ONNX
    Runtime; needs no torch); ``source_lang`` / ``target_lang``: a multilingual model's languages
    (see :class:`~transformer_ext.translator.Translator`); ``dtype``: a model folder's decode dtype
    (``"bfloat16"``: see :class:`~transformer_ext.runtimes.eager.EagerRunner`)."""
    from .translator import RuntimeNotAvailableError, Translator, _read_pretrained, is_export_dir

    languages = dict(source_lang=source_lang, target_lang=target_lang)

    if not model.is_dir():
        raise EvaluationError(
            f"--model {model} is not a folder (expected a model folder or an export folder)"
        )
    if is_export_dir(model) and not (model / "config.json").exists():
        if dtype is not None:
            raise EvaluationError(
                f"--dtype applies to a model folder (eager PyTorch); --model {model} is an export folder"
            )
        return Translator.from_export_dir(model, threads=threads, **languages), "onnxruntime"
    try:
        from .checkpoint import load_model
        from .devices import parse_device
        from .runtimes.eager import EagerRunner, check_dtype
        from .spm_tokenizer import load_any_tokenizer
    except ImportError as exc:
        raise RuntimeNotAvailableError(
            f"--model {model} is a model folder, which runs on PyTorch, and this installation lacks it "
            f"({exc}): evaluate an export folder instead (python -m export.onnx writes one), or install "
            "transformer_ext with torch"
        ) from exc

    torch_device = parse_device(device)
    check_dtype(dtype, torch_device, what="--dtype")  # before the folder is read
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    tokenizer = load_any_tokenizer(model)
    runner = EagerRunner(load_model(model, torch_device), torch_device, dtype=dtype)
    pretrained = _read_pretrained(model)
    runtime = "eager" if dtype is None else f"eager {dtype}"
    return Translator(tokenizer, runner, source_dir=model, pretrained=pretrained, **languages), runtime


def budget_text(settings: dict) -> str:
    """The length budget of resolved decoding ``settings`` in its one form: "at most B tokens"
    (the same for every source, as a model converted from transformers has it) or "at most A *
    source length + B tokens"."""
    a, b = settings["max_len_a"], settings["max_len_b"]
    if a == 0:
        return f"at most {math.floor(b)} tokens"
    return f"at most {a:g} * source length + {b:g} tokens"


def evaluate_files(
    model: Path,
    src: Path,
    ref: Path,
    *,
    beam: Optional[int] = None,
    output: Optional[Path] = None,
    device: str = "cpu",
    threads: Optional[int] = None,
    batch_size: int = 64,
    source_lang: Optional[str] = None,
    target_lang: Optional[str] = None,
    dtype: Optional[str] = None,
    **search: Any,
) -> dict:
    """Translate ``src`` with ``model``, score against ``ref``; returns the report (see :func:`main`).

    ``search``: the translator's search options (:class:`~transformer_ext.decoding.SearchOptions`
    names; None: the model's); ``beam`` is ``beam_size`` (default 1: greedy search, whatever the
    model's generation config says)."""
    from .fsutil import atomic_write_text
    from .text import DataError, read_lines

    options = {k: v for k, v in search.items() if v is not None}
    if beam is not None and "beam_size" in options:
        raise EvaluationError(
            f"beam ({beam}) and beam_size ({options['beam_size']}) are one option: give one"
        )
    options.setdefault("beam_size", 1 if beam is None else beam)
    options["batch_size"] = batch_size
    try:
        sources, references = read_lines(src), read_lines(ref)
    except DataError as exc:
        raise EvaluationError(str(exc)) from None
    if len(sources) != len(references):
        raise EvaluationError(
            f"--src {src} has {len(sources)} lines but --ref {ref} has {len(references)}: the "
            "reference file must have one line per source line"
        )
    if not sources:
        raise EvaluationError(f"--src {src} has no lines")
    translator, runtime = load_translator(
        model, device=device, threads=threads, source_lang=source_lang, target_lang=target_lang, dtype=dtype
    )
    keep = [i for i, s in enumerate(sources) if s.strip()]
    if len(keep) < len(sources):
        logger.warning("%d empty source lines get empty hypotheses", len(sources) - len(keep))
    settings = translator.resolve_options(**options)
    t0 = time.monotonic()
    # strict: a score over sources the model cannot represent (<unk> pieces) would not say what it seems to
    texts = translator.translate([sources[i] for i in keep], progress=True, strict=True, **options)
    seconds = time.monotonic() - t0
    hypotheses = [""] * len(sources)
    for i, text in zip(keep, texts):
        hypotheses[i] = text
    if output is not None:
        atomic_write_text(output, "".join(h + "\n" for h in hypotheses))
    scores = score_texts(hypotheses, references)
    return dict(
        model=str(model),
        runtime=runtime,
        src=str(src),
        ref=str(ref),
        n=len(sources),
        bleu=round(scores["bleu"], 2),
        chrf=round(scores["chrf"], 2),
        bleu_signature=scores["bleu_signature"],
        chrf_signature=scores["chrf_signature"],
        bleu_detail=scores["bleu_detail"],
        decoding=settings,
        seconds=round(seconds, 1),
        output=str(output) if output is not None else None,
    )


def _check_output(path: Path, src: Path, ref: Path, model: Path) -> None:
    """``--output``: a file path in an existing folder that is neither an input (``--src``,
    ``--ref``) nor inside the model or export folder in use or a training run's managed folders."""
    from .fsutil import check_output_path
    from .translate import managed_dirs

    if path.is_dir():
        raise EvaluationError(f"--output {path} is a folder; give a file path for the hypotheses")
    parent = path.absolute().parent
    if not parent.is_dir():
        raise EvaluationError(f"--output {path}: the folder {parent} does not exist")
    inputs = [("the --src file", src), ("the --ref file", ref), ("the model folder --model", model)]
    check_output_path(path, inputs=inputs, managed_dirs=managed_dirs(path), what="--output")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m transformer_ext.evaluate",
        description="Translate a source file and score it against a reference file with sacrebleu (BLEU with "
        "13a tokenization, chrF), detokenized hypotheses against raw references. MODEL is a model "
        "folder (eager PyTorch) or an export folder (ONNX Runtime).",
    )
    p.add_argument("--model", required=True, help="model folder or export folder")
    p.add_argument("--src", required=True, help="source sentences, one per line (UTF-8)")
    p.add_argument("--ref", required=True, help="reference translations, line-aligned with --src")
    p.add_argument("--output", help="write the hypotheses here (atomically), one per line")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N, for a model folder (default: cpu)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (torch or ONNX Runtime)")
    add_option(
        p,
        "--max-batch-size",
        deprecated=("--batch-size",),
        type=int,
        default=64,
        metavar="N",
        help="sources decoded together (default: 64)",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="a model folder's decode dtype: bfloat16 keeps weights and caches in bfloat16 (float32 "
        "accumulation), on a GPU or a CPU with native bfloat16 only (default: the folder's float32)",
    )
    p.add_argument(
        "--source-lang",
        default=None,
        help="source language code of a multilingual M2M100 / NLLB model (e.g. en, eng_Latn)",
    )
    p.add_argument(
        "--target-lang",
        default=None,
        help="target language code of a multilingual model (Marian's >>xx<< code, M2M100 / NLLB's forced "
        "first token); an unknown code is an error listing the model's codes; without --source-lang / "
        "--target-lang an M2M100 / NLLB model uses its tokenizer_config.json's defaults (named on stderr)",
    )
    add_decoding_flags(
        p.add_argument_group("search (the names of CTranslate2's translate_batch, as translate's)"),
        EVALUATE_FLAGS,
        shown_defaults={"beam_size": "1, greedy search, whatever the model's generation config says"},
    )
    add_debug_flag(p)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_decoding_flags(parser, args, EVALUATE_FLAGS)
    if args.max_batch_size < 1:
        parser.error(f"{given_flag(args, 'max_batch_size')} must be >= 1, got {args.max_batch_size}")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    try:
        check_device_name(args.device)
    except DeviceUsageError as exc:
        parser.error(str(exc))
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )

    def work() -> int:
        src, ref = Path(args.src), Path(args.ref)
        output = Path(args.output) if args.output else None
        if output is not None:
            _check_output(output, src, ref, Path(args.model))
        _sacrebleu()
        report = evaluate_files(
            Path(args.model),
            src,
            ref,
            output=output,
            device=args.device,
            threads=args.threads,
            batch_size=args.max_batch_size,
            source_lang=args.source_lang,
            target_lang=args.target_lang,
            dtype=args.dtype,
            **decoding_values(args, EVALUATE_FLAGS),
        )
        if args.json:
            print(json.dumps(report, indent=1))
            return 0
        d = report["decoding"]
        mode = f"beam {d['beam_size']} (length penalty {d['length_penalty_type']}, exponent {d['length_penalty']:g})"
        if d["sampling"]:
            mode = "sampling ({})".format(", ".join(f"{k} {v}" for k, v in d["sampling"].items()))
        elif d["beam_size"] == 1:
            mode = "greedy"
        print(
            f"{report['model']} ({report['runtime']}), {report['n']} sentences, {mode}, {budget_text(d)}, {report['seconds']} s"
        )
        print(f"BLEU = {report['bleu']:.2f}  {report['bleu_signature']}")
        print(f"     {report['bleu_detail']}")
        print(f"chrF = {report['chrf']:.2f}  {report['chrf_signature']}")
        if output is not None:
            print(f"hypotheses written to {output}")
        return 0

    return run_cli(parser.prog, work, debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
