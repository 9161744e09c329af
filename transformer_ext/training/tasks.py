"""The kinds of training run: a :class:`Task` loads its data, builds its tokenizer and model, names
its default metric and its final check.

* :class:`DemoTask` (no ``--train``): English to German number words from ``num2words``
  (:mod:`transformer_ext.data`: a deterministic train / valid / held-out split of the number
  range, oversampled short numbers), a character tokenizer built from the training split,
  checkpoints selected by exact match, and at the end the exact match of the best model on the
  held-out numbers (greedy and beam).
* :class:`ParallelTextTask` (``--train SRC TGT --valid SRC TGT`` or the TSV forms): line-aligned
  UTF-8 text, a SentencePiece (or character) tokenizer learnt from the training split only,
  pairs filtered by length and ratio, checkpoints selected by validation BLEU.

:func:`task_for` picks the task of a run's options: the first class of :data:`TASKS` whose
:meth:`Task.matches` accepts them. A new kind of run is a new subclass, registered with
:func:`register_task`; the trainer only calls the methods below. Every method that reads data
runs before anything is written, so bad data leaves the disk untouched.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Optional, Sequence

import torch

from ..data import (
    Example,
    encode_examples,
    example_cost,
    make_examples,
    oversample,
    split_numbers,
)
from ..tokenizer import CharTokenizer
from .errors import TrainingError, TrainingUsageError
from .options import TrainOptions, build_config
from .run_folder import PROVENANCE_FILE
from .validation import validate

logger = logging.getLogger(__name__)

__all__ = [
    "TrainingData",
    "Task",
    "DemoTask",
    "ParallelTextTask",
    "FineTuneTask",
    "TASKS",
    "register_task",
    "task_for",
]


@dataclass
class TrainingData:
    """A task's data, encoded with the run's tokenizer."""

    train_pairs: Any  # (source ids, target ids) per training example (a list, or data.ParallelIds)
    costs: Sequence[int]  # the batching cost of each training example (data.example_cost)
    valid_examples: list[Example]  # validation sources and references
    valid_pairs: Optional[list] = None  # their token ids when already encoded (None: encoded on demand)
    report: dict = dataclasses.field(default_factory=dict)  # what filtering dropped, for summary.json


class Task:
    """One kind of training run. Subclasses set the class attributes and implement the methods."""

    name: ClassVar[str] = ""
    default_metric: ClassVar[str] = "loss"  # what selects best/ when --best-metric is not given
    scores_text: ClassVar[bool] = False  # validation also scores BLEU and chrF

    def __init__(self, opts: TrainOptions):
        self.opts = opts
        self.provenance: Optional[bytes] = None  # provenance.json copied into every model folder
        self.model_files: dict[str, bytes] = {}  # more files of every model folder (name -> content)

    @classmethod
    def matches(cls, opts: TrainOptions) -> bool:
        """Whether ``opts`` describe a run of this task."""
        raise NotImplementedError

    @property
    def best_metric(self) -> str:
        return self.opts.best_metric or self.default_metric

    def load_data(self, ctx) -> None:
        """Read and check the data (before anything is written)."""
        raise NotImplementedError

    def build_tokenizer(self, ctx):
        """The tokenizer of a new run (a resumed run loads its own)."""
        raise NotImplementedError

    def build_model(self, tokenizer, device: torch.device):
        """The model of a new run: the preset with the flags' overrides, initialised from ``--seed``."""
        from ..model import Transformer

        config = build_config(self.opts, tokenizer)
        check_model_memory(config, device)
        torch.manual_seed(self.opts.seed)
        return Transformer(config).to(device)

    def encode(self, tokenizer, config) -> TrainingData:
        """The data as token ids of ``tokenizer``, checked against the model's ``config``."""
        raise NotImplementedError

    def describe(self, data: TrainingData, n_batches: int, steps_per_epoch: int) -> None:
        """Log what the run trains on."""

    def final_check(self, best_dir: Path, device: torch.device) -> Optional[dict]:
        """What the best model scores at the end (``summary.json``'s ``heldout``); None: nothing."""
        return None


def _memory_bytes(device: torch.device) -> Optional[int]:
    """The memory of ``device`` (a GPU's, or this machine's RAM); None where it cannot be told."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


# float32 weights, their gradients and Adam's two moments: the least a parameter takes in training
TRAINING_BYTES_PER_PARAMETER = 16


def check_model_memory(config, device: torch.device) -> None:
    """Refuse a model whose weights, gradients and Adam state alone exceed the memory of ``device``.

    The model is built on the meta device to count its parameters and buffers (nothing allocated).
    """
    from ..model import Transformer

    with torch.device("meta"):
        shape = Transformer(config)
    n_params = sum(p.numel() for p in shape.parameters())
    need = n_params * TRAINING_BYTES_PER_PARAMETER + sum(
        b.numel() * b.element_size() for b in shape.buffers()
    )
    have = _memory_bytes(device)
    if have is not None and need > have:
        raise TrainingUsageError(
            f"the model ({n_params:,} parameters, d_model {config.d_model}, d_ff {config.d_ff}, "
            f"{config.n_encoder_layers}+{config.n_decoder_layers} layers, vocabularies "
            f"{config.src_vocab_size}/{config.tgt_vocab_size}, max_len {config.max_len}) needs at least "
            f"{need / 2**30:.1f} GiB for its weights, gradients and Adam state, more than the "
            f"{have / 2**30:.1f} GiB of memory of {device.type}; choose a smaller model"
        )


# ---------------------------------------------------------------------- the demo task
class DemoTask(Task):
    """English to German number words (the bundled model's task)."""

    name = "demo"
    default_metric = "exact"

    @classmethod
    def matches(cls, opts: TrainOptions) -> bool:
        return True

    def load_data(self, ctx) -> None:
        opts = self.opts
        # the split is fixed by (range, split_seed); the tokenizer comes from the training split
        try:
            self.splits = split_numbers(opts.range_low, opts.range_high, seed=opts.split_seed)
        except ValueError as exc:
            raise TrainingUsageError(f"--range {opts.range_low} {opts.range_high}: {exc}") from None
        if not self.splits.valid or not self.splits.heldout:
            raise TrainingUsageError(
                f"--range {opts.range_low} {opts.range_high} holds too few numbers: its validation "
                "and held-out splits (5% of the numbers each) are empty; widen the range"
            )
        self.train_examples = make_examples(oversample(self.splits.train, opts.oversample))
        self.valid_examples = make_examples(self.splits.valid)
        if not self.train_examples:
            raise TrainingError("the training split is empty; widen the number range")

    def build_tokenizer(self, ctx):
        return CharTokenizer.build(
            [e.source for e in self.train_examples],
            [e.target for e in self.train_examples],
            shared=self.opts.shared_vocab,
            lowercase=True,
        )

    def encode(self, tokenizer, config) -> TrainingData:
        train_pairs = encode_examples(tokenizer, self.train_examples)
        longest = max(max(len(s), len(t) + 1) for s, t in train_pairs)
        if longest > config.max_len:
            raise TrainingError(
                f"the longest training sequence has {longest} tokens, more than max_len={config.max_len}"
            )
        costs = [example_cost(len(s), len(t)) for s, t in train_pairs]
        return TrainingData(train_pairs, costs, self.valid_examples)

    def describe(self, data: TrainingData, n_batches: int, steps_per_epoch: int) -> None:
        opts, splits = self.opts, self.splits
        logger.info(
            "data: %d train / %d valid / %d held-out numbers in %d..%d; %d training examples per epoch "
            "(oversampling %s), %d batches of <= %d tokens",
            len(splits.train),
            len(splits.valid),
            len(splits.heldout),
            opts.range_low,
            opts.range_high,
            len(self.train_examples),
            list(opts.oversample) or "none",
            steps_per_epoch,
            opts.max_tokens,
        )

    def final_check(self, best_dir: Path, device: torch.device) -> Optional[dict]:
        """Exact match of the best model on the held-out numbers, greedy and (``--final-beam``) beam."""
        from ..checkpoint import load_model

        beam = self.opts.final_beam
        model = load_model(best_dir, device)
        tokenizer = CharTokenizer.load(best_dir)
        examples = make_examples(self.splits.heldout)
        t0 = time.monotonic()
        greedy = validate(model, tokenizer, examples, device=device, with_loss=False)
        report: dict[str, Any] = dict(
            n=len(examples),
            greedy_exact_match=greedy["exact_match"],
            greedy_seconds=round(time.monotonic() - t0, 1),
            greedy_errors=greedy["errors"],
        )
        logger.info(
            "held-out (%d numbers never trained on): greedy exact match %.4f",
            len(examples),
            greedy["exact_match"],
        )
        if beam and beam > 1:
            t0 = time.monotonic()
            beamed = validate(model, tokenizer, examples, device=device, with_loss=False, beam_size=beam)
            report.update(
                beam_size=beam,
                beam_exact_match=beamed["exact_match"],
                beam_seconds=round(time.monotonic() - t0, 1),
                beam_errors=beamed["errors"],
            )
            logger.info("held-out: beam %d exact match %.4f", beam, beamed["exact_match"])
        return report


# ---------------------------------------------------------------------- parallel text
def _data_name(files, tsv) -> str:
    return f"{files[0]} / {files[1]}" if files is not None else str(tsv)


def _read_pairs(files, tsv, flag: str) -> tuple[list[str], list[str]]:
    from ..data import DataError, read_parallel, read_tsv

    try:
        return read_parallel(*files) if files is not None else read_tsv(tsv)
    except DataError as exc:
        raise TrainingError(f"{flag}: {exc}") from None


def find_provenance(opts: TrainOptions) -> Optional[bytes]:
    """The corpus's provenance.json (written by transformer_ext.corpora) next to the training data, if any."""
    first = opts.train_files[0] if opts.train_files is not None else opts.train_tsv
    path = Path(first).parent / PROVENANCE_FILE
    if not path.is_file():
        return None
    data = path.read_bytes()
    try:
        json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TrainingError(
            f"{path} is not a provenance file (not UTF-8 JSON: {exc}); remove it or fix it"
        ) from None
    logger.info("corpus provenance from %s goes into every model folder", path)
    return data


class ParallelTextTask(Task):
    """Line-aligned parallel text: ``--train SRC TGT --valid SRC TGT`` (or the TSV forms)."""

    name = "parallel-text"
    default_metric = "bleu"
    scores_text = True

    @classmethod
    def matches(cls, opts: TrainOptions) -> bool:
        return opts.train_files is not None or opts.train_tsv is not None

    @property
    def train_name(self) -> str:
        return _data_name(self.opts.train_files, self.opts.train_tsv)

    @property
    def valid_name(self) -> str:
        return _data_name(self.opts.valid_files, self.opts.valid_tsv)

    def load_data(self, ctx) -> None:
        opts = self.opts
        self.train_src, self.train_tgt = _read_pairs(opts.train_files, opts.train_tsv, "--train")
        self.valid_src, self.valid_tgt = _read_pairs(opts.valid_files, opts.valid_tsv, "--valid")
        if not self.valid_src:
            raise TrainingError(f"the validation set {self.valid_name} has no lines")
        if not self.train_src:
            raise TrainingError(f"the training set {self.train_name} has no lines")
        if opts.test_files is not None:  # read now so that a bad test set fails before training
            test_src, _ = _read_pairs(opts.test_files, None, "--test")
            if not test_src:
                raise TrainingError(f"the test set {_data_name(opts.test_files, None)} has no lines")
        self.provenance = find_provenance(opts)

    def build_tokenizer(self, ctx):
        """Learnt from the training split only. SentencePiece under torchrun: rank 0 trains it, the
        other ranks wait and receive the same model files."""
        from ..spm_tokenizer import SentencePieceTokenizer
        from ..tokenizer import TokenizerError

        opts = self.opts
        if (opts.tokenizer or "sentencepiece") == "char":
            return CharTokenizer.build(self.train_src, self.train_tgt, shared=opts.shared_vocab)
        payload = tok = None
        if ctx.is_main:
            t0 = time.monotonic()
            try:
                tok = SentencePieceTokenizer.train(
                    self.train_src,
                    self.train_tgt,
                    vocab_size=opts.vocab_size,
                    model_type=opts.spm_model_type,
                    shared=opts.shared_vocab,
                    threads=opts.threads or 1,
                )
            except TokenizerError as exc:
                ctx.broadcast(None)
                raise TrainingError(f"--vocab-size / --tokenizer: {exc}") from None
            logger.info(
                "trained %s in %.1f s on %d training pairs", tok, time.monotonic() - t0, len(self.train_src)
            )
            payload = (tok._src_bytes, None if tok.shared else tok._tgt_bytes, tok.model_type)
        payload = ctx.broadcast(payload)
        if payload is None:
            raise TrainingError("rank 0 could not train the SentencePiece model (see its error)")
        if ctx.is_main:
            return tok
        return SentencePieceTokenizer(payload[0], payload[1], model_type=payload[2])

    def encode(self, tokenizer, config) -> TrainingData:
        from ..data import encode_parallel

        train_pairs, train_report = encode_parallel(
            tokenizer,
            self.train_src,
            self.train_tgt,
            max_len=config.max_len,
            max_len_ratio=self.opts.max_len_ratio,
        )
        logger.info("training data %s: %s", self.train_name, train_report.describe())
        if train_report.kept == 0:
            raise TrainingError(
                f"no training pair is left after filtering {self.train_name}: {train_report.describe()}"
            )
        valid_ids, valid_report = encode_parallel(
            tokenizer, self.valid_src, self.valid_tgt, max_len=config.max_len, max_len_ratio=None
        )
        logger.info("validation data %s: %s", self.valid_name, valid_report.describe())
        if valid_report.kept == 0:
            raise TrainingError(
                f"no validation pair is left after filtering {self.valid_name}: {valid_report.describe()}"
            )
        valid_examples = [
            Example(int(i), self.valid_src[i], self.valid_tgt[i]) for i in valid_report.kept_index
        ]
        report = dict(train=dataclasses.asdict(train_report), valid=dataclasses.asdict(valid_report))
        for r in report.values():
            r.pop("kept_index", None)
        del self.train_src, self.train_tgt
        return TrainingData(
            train_pairs,
            train_pairs.costs,
            valid_examples,
            valid_pairs=[valid_ids[i] for i in range(len(valid_ids))],
            report=report,
        )

    def final_check(self, best_dir: Path, device: torch.device) -> Optional[dict]:
        """BLEU and chrF of the best model on ``--test``, greedy and (``--final-beam``) beam: the
        numbers of ``python -m transformer_ext.evaluate --model BEST --src SRC --ref TGT [--beam N]``."""
        from ..evaluate import evaluate_files

        if self.opts.test_files is None:
            return None
        src, ref = (Path(p) for p in self.opts.test_files)
        report: dict[str, Any] = dict(src=str(src), ref=str(ref))
        beams = [("greedy", 1)] + ([("beam", self.opts.final_beam)] if self.opts.final_beam > 1 else [])
        for name, beam in beams:
            scores = evaluate_files(
                best_dir, src, ref, beam=beam, device=str(device), threads=self.opts.threads
            )
            report.update(
                {
                    "n": scores["n"],
                    f"{name}_bleu": scores["bleu"],
                    f"{name}_chrf": scores["chrf"],
                    f"{name}_seconds": scores["seconds"],
                    "bleu_signature": scores["bleu_signature"],
                    "chrf_signature": scores["chrf_signature"],
                }
            )
            if name == "beam":
                report["beam_size"] = beam
            logger.info(
                "test %s (%d pairs), %s: BLEU %.2f, chrF %.2f",
                src,
                scores["n"],
                "greedy" if beam == 1 else f"beam {beam}",
                scores["bleu"],
                scores["chrf"],
            )
        return report

    def describe(self, data: TrainingData, n_batches: int, steps_per_epoch: int) -> None:
        logger.info(
            "data: %d training pairs (%d target tokens), %d validation pairs; %d batches of <= %d tokens "
            "per epoch, %d optimiser steps per epoch (--update-freq %d)",
            len(data.train_pairs),
            data.train_pairs.n_target_tokens(),
            len(data.valid_examples),
            n_batches,
            self.opts.max_tokens,
            steps_per_epoch,
            self.opts.update_freq,
        )


# The task classes, most specific first: task_for() takes the first whose matches() accepts the options.
class FineTuneTask(ParallelTextTask):
    """Parallel text from a trained model (``--init-from MODEL_DIR``): its weights, architecture and
    tokenizer, e.g. a Hugging Face checkpoint converted by :mod:`transformer_ext.convert`."""

    name = "fine-tune"

    @classmethod
    def matches(cls, opts: TrainOptions) -> bool:
        return opts.init_from is not None and super().matches(opts)

    def load_data(self, ctx) -> None:
        from ..checkpoint import load_model
        from ..spm_tokenizer import load_any_tokenizer
        from ..tokenizer import check_model_config

        if self.opts.resume:  # the run's last/ holds the model, tokenizer and what came with them
            self._resume_files(ctx)
            return
        folder = Path(self.opts.init_from)
        if not folder.is_dir():
            raise TrainingError(f"--init-from {folder}: model folder not found")
        try:
            self.initial = load_model(folder, "cpu")
            self.initial_tokenizer = load_any_tokenizer(folder)
            check_model_config(self.initial_tokenizer, self.initial.config)
        except (OSError, ValueError) as exc:
            raise TrainingError(f"--init-from {folder}: {exc}") from None
        super().load_data(ctx)
        self.model_files.update(_generation_defaults_file(folder))
        self.provenance = _fine_tune_provenance(folder, self.provenance)

    def _resume_files(self, ctx) -> None:
        """A resumed fine-tune needs nothing from the --init-from folder, which may have moved:
        the model and tokenizer come from the run's last checkpoint (the trainer loads them), the
        generation defaults and the provenance (naming the model it started from) are copied from
        that checkpoint too."""
        from .run_folder import last_dir

        last = last_dir(Path(self.opts.out_dir))
        super().load_data(ctx)
        self.model_files.update(_generation_defaults_file(last, f"cannot resume: {last}"))
        path = last / PROVENANCE_FILE
        self.provenance = path.read_bytes() if path.is_file() else self.provenance

    def build_tokenizer(self, ctx):
        return self.initial_tokenizer

    def build_model(self, tokenizer, device: torch.device):
        model = self.initial.to(device)
        model.train()
        logger.info("fine-tuning %s (%s)", self.opts.init_from, model.config.to_dict())
        return model


def _generation_defaults_file(folder: Path, what: Optional[str] = None) -> dict[str, bytes]:
    """``{generation_defaults.json: content}`` of the model folder ``folder`` (checked: a model
    converted from transformers decodes with it), {} when it has none (a model of ours). An
    error starts with ``what`` (default ``--init-from FOLDER``)."""
    from ..convert.generation import GENERATION_DEFAULTS_FILE, read_generation_defaults

    try:
        if read_generation_defaults(folder) is None:
            return {}
    except ValueError as exc:
        raise TrainingError(f"{what or f'--init-from {folder}'}: {exc}") from None
    return {GENERATION_DEFAULTS_FILE: (folder / GENERATION_DEFAULTS_FILE).read_bytes()}


def _sha256(path: Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fine_tune_provenance(folder: Path, corpus: Optional[bytes]) -> bytes:
    """The provenance.json of a fine-tuned model: the corpus's (its fields, when the training
    data has one) and ``init_from``: the model folder it started from, the SHA-256 of its config
    and weights, and that folder's own provenance (e.g. the converted checkpoint's), if any."""
    body: dict = {}
    if corpus is not None:
        body = json.loads(corpus.decode("utf-8"))  # checked by find_provenance
        if not isinstance(body, dict):
            body = {"corpus_provenance": body}
    own = None
    if (folder / PROVENANCE_FILE).is_file():
        try:
            own = json.loads((folder / PROVENANCE_FILE).read_bytes().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise TrainingError(f"--init-from {folder / PROVENANCE_FILE}: not UTF-8 JSON ({exc})") from None
    body["init_from"] = {
        "model_dir": str(folder.resolve()),
        "files": {name: _sha256(folder / name) for name in ("config.json", "model.safetensors")},
        "provenance": own,
    }
    return (json.dumps(body, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


TASKS: list[type[Task]] = [FineTuneTask, ParallelTextTask, DemoTask]


def register_task(cls: type[Task]) -> type[Task]:
    """Add a task class in front of the others (usable as a class decorator)."""
    if cls not in TASKS:
        TASKS.insert(0, cls)
    return cls


def task_for(opts: TrainOptions) -> Task:
    """The task of a run described by ``opts``."""
    for cls in TASKS:
        if cls.matches(opts):
            return cls(opts)
    raise TrainingError("no training task matches these options")
