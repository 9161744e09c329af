"""Average the parameters of several checkpoints into one model folder.

``python -m transformer_ext.average --output-dir DIR CKPT [CKPT ...]`` or ``--last K RUN`` (the K newest
``RUN/checkpoints/step-N/`` folders that ``python -m transformer_ext.train --keep-last K`` left).
Every checkpoint must have the same config.json and the same tokenizer files (they are one
model at different steps); the output is a normal model folder (config.json, model.safetensors,
the tokenizer files, the provenance and the generation defaults (``generation_defaults.json``,
equal in every checkpoint) when they have them, and ``averaged.json`` naming the inputs) that
loads, translates, evaluates and exports like any other. The mean is taken in float64 and stored
in each tensor's dtype.

``--output-dir`` must be new or empty; it is built in a temporary sibling and renamed into place, so
an error or an interruption leaves nothing behind.
"""

from __future__ import annotations

if __name__ == "__main__":  # before the imports: one line, not a traceback, where they are missing
    from transformer_ext.commands import require

    require("transformer_ext.average")

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from .cli import UserError, add_debug_flag, add_option, run_cli

logger = logging.getLogger(__name__)

__all__ = ["AverageError", "average_checkpoints", "last_checkpoints", "main"]

AVERAGED_FILE = "averaged.json"
PROVENANCE_FILE = "provenance.json"
GENERATION_DEFAULTS_FILE = "generation_defaults.json"  # an imported model's (transformer_ext.convert)


class AverageError(UserError, ValueError):
    """Checkpoints that cannot be averaged (different models, missing folders) or a bad --output-dir."""


def last_checkpoints(run: Path, k: int) -> list[Path]:
    """The ``k`` newest ``step-N`` model folders of ``run/checkpoints`` (oldest first)."""
    from .training.run_folder import CHECKPOINTS_DIR, step_checkpoints

    if not run.is_dir():
        raise AverageError(f"--last: {run} is not a folder (expected a training run folder)")
    found = step_checkpoints(run / CHECKPOINTS_DIR)
    for folder in found:
        if (folder / AVERAGED_FILE).is_file():
            raise AverageError(
                f"--last: {folder} is an average of checkpoints ({AVERAGED_FILE}), not a checkpoint of "
                "the training run; move it out of the run folder"
            )
    if not found:
        raise AverageError(
            f"--last: {run / CHECKPOINTS_DIR} holds no step-N checkpoint (train with --keep-last K)"
        )
    if len(found) < k:
        raise AverageError(
            f"--last {k}: {run / CHECKPOINTS_DIR} holds only {len(found)} checkpoints "
            f"({', '.join(p.name for p in found)})"
        )
    return found[-k:]


def check_out(out: Path, folders: Sequence[Path], run: Optional[Path] = None) -> None:
    """Refuse an ``--output-dir`` that overlaps a checkpoint or lies in a training run's managed folders
    (``best/``, ``last/``, ``checkpoints/``: the next ``train --resume`` would replace it, and
    ``--last K`` would take an average in ``checkpoints/`` for a training step)."""
    from .fsutil import check_output_path
    from .training.run_folder import managed_dirs

    check_output_path(
        out,
        inputs=[("the checkpoint", f) for f in folders]
        + ([("the training run of --last", run)] if run else []),
        managed_dirs=managed_dirs(out),
        what="--output-dir",
    )


def _tokenizer_files(folder: Path) -> list[str]:
    from .spm_tokenizer import load_any_tokenizer

    return list(load_any_tokenizer(folder).files)


def _read_or_none(path: Path) -> Optional[bytes]:
    return path.read_bytes() if path.is_file() else None


def average_checkpoints(folders: Sequence[Path], out: Path) -> Path:
    """Write the parameter mean of the model folders ``folders`` as a new model folder ``out``."""
    import torch

    from .checkpoint import canonical_state_dict, load_model, save_model
    from .fsutil import StagedDir, atomic_write_bytes, atomic_write_json

    if not folders:
        raise AverageError("no checkpoint to average")
    folders = [Path(f) for f in folders]
    check_out(out, folders)
    if len({os.path.realpath(f) for f in folders}) != len(folders):
        raise AverageError("the same checkpoint is given more than once: " + ", ".join(map(str, folders)))
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise AverageError(f"--output-dir {out} exists and is not an empty folder; choose a new folder")
    for f in folders:
        resolved = Path(os.path.realpath(f))
        if resolved == Path(os.path.realpath(out)):
            raise AverageError(f"--output-dir {out} is one of the checkpoints")
    first = folders[0]
    tok_files = _tokenizer_files(first)
    reference_config = (first / "config.json").read_bytes()
    model = load_model(first, "cpu")
    sums = {name: t.detach().to(torch.float64).clone() for name, t in canonical_state_dict(model)[0].items()}
    for folder in folders[1:]:
        other = load_model(folder, "cpu")
        if other.config != model.config:
            raise AverageError(
                f"{folder / 'config.json'} differs from {first / 'config.json'}: only checkpoints of one "
                "model can be averaged"
            )
        for name in tok_files:
            if (folder / name).read_bytes() != (first / name).read_bytes():
                raise AverageError(
                    f"{folder / name} differs from {first / name}: the checkpoints have different tokenizers"
                )
        if _read_or_none(folder / GENERATION_DEFAULTS_FILE) != _read_or_none(
            first / GENERATION_DEFAULTS_FILE
        ):
            raise AverageError(
                f"{folder / GENERATION_DEFAULTS_FILE} and {first / GENERATION_DEFAULTS_FILE} differ (or only "
                "one exists): the checkpoints decode differently"
            )
        for name, t in canonical_state_dict(other)[0].items():
            sums[name] += t.detach().to(torch.float64)
        del other
    with torch.no_grad():
        for name, param in canonical_state_dict(model)[0].items():
            param.copy_((sums[name] / len(folders)).to(param.dtype))
    del reference_config
    out.absolute().parent.mkdir(parents=True, exist_ok=True)
    with StagedDir(out) as stage:
        save_model(model, stage.path)
        extra = list(tok_files) + [
            n for n in (PROVENANCE_FILE, GENERATION_DEFAULTS_FILE) if (first / n).is_file()
        ]
        for name in extra:
            atomic_write_bytes(stage.path / name, (first / name).read_bytes())
        atomic_write_json(
            stage.path / AVERAGED_FILE, dict(checkpoints=[str(f) for f in folders], n=len(folders))
        )
        stage.commit()
    logger.info("averaged %d checkpoints into %s", len(folders), out)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m transformer_ext.average",
        description="Average the parameters of checkpoints of one model (same config and tokenizer) into a new "
        "model folder.",
    )
    p.add_argument("checkpoints", nargs="*", metavar="CKPT", help="model folders to average")
    p.add_argument(
        "--last",
        nargs=2,
        metavar=("K", "RUN"),
        help="the K newest RUN/checkpoints/step-N folders (train with --keep-last K)",
    )
    add_option(p, "--output-dir", deprecated=("--out",), required=True, help="the new model folder")
    add_debug_flag(p)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if bool(args.checkpoints) == bool(args.last):
        parser.error("give the checkpoints (CKPT ...) or --last K RUN, one of the two")
    k = None
    if args.last:
        try:
            k = int(args.last[0])
        except ValueError:
            parser.error(f"--last K RUN: K must be an integer, got {args.last[0]!r}")
        if k < 1:
            parser.error(f"--last K RUN: K must be >= 1, got {k}")
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )

    def work() -> int:
        out = Path(args.output_dir)
        check_out(out, [Path(c) for c in args.checkpoints], Path(args.last[1]) if args.last else None)
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise AverageError(f"--output-dir {out} exists and is not an empty folder; choose a new folder")
        folders = (
            last_checkpoints(Path(args.last[1]), k) if args.last else [Path(c) for c in args.checkpoints]
        )
        for f in folders:
            if not f.is_dir():
                raise AverageError(
                    f"checkpoint {f} is not a folder (expected a model folder with config.json and "
                    "model.safetensors)"
                )
        average_checkpoints(folders, out)
        print(f"averaged {len(folders)} checkpoints ({', '.join(f.name for f in folders)}) into {out}")
        return 0

    return run_cli(parser.prog, work, debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
