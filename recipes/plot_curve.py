"""Plot validation BLEU (and chrF) from the summary.json of one run or of several runs side by side.

python recipes/plot_curve.py RUN/summary.json OUT.png
python recipes/plot_curve.py --minutes --label float32 A/summary.json --label bf16 B/summary.json OUT.png

One run: BLEU and chrF against optimiser steps. Several runs: BLEU of each, labelled with
``--label`` (given before its summary; the folder name otherwise). ``--minutes`` puts the
training time (the summary's ``elapsed_s``) on the x axis instead of steps, which is how runs of
different speed compare.
"""

import argparse
import io
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
from transformer_ext.fsutil import atomic_write_bytes  # noqa: E402


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="plot_curve.py",
        description="Plot validation BLEU/chrF of one run or BLEU of several runs from their summary.json.",
    )
    parser.add_argument(
        "--minutes", action="store_true", help="training minutes on the x axis instead of steps"
    )
    parser.add_argument(
        "--label", action="append", default=[], help="label of the next summary (repeat once per summary)"
    )
    parser.add_argument("paths", nargs="+", metavar="PATH", help="RUN/summary.json ... then OUT.png")
    # --label may sit between the summaries: parse_intermixed keeps the positionals together.
    args = parser.parse_intermixed_args(argv)
    if len(args.paths) < 2:
        parser.error("give at least one summary.json and the output PNG")
    args.summaries, args.out = args.paths[:-1], args.paths[-1]
    if args.label and len(args.label) != len(args.summaries):
        parser.error(
            f"{len(args.label)} --label for {len(args.summaries)} summaries: give one per summary or none"
        )
    if not args.out.endswith(".png"):
        parser.error(f"the last path is the output and must end in .png, got {args.out!r}")
    return args


def load_history(path):
    """The validations with BLEU of one summary.json, or an error message."""
    try:
        with open(path, encoding="utf-8") as f:
            summary = json.load(f)
    except (OSError, ValueError) as exc:
        return None, None, f"{path}: cannot read a summary.json ({exc})"
    history = [h for h in summary.get("history", []) if "bleu" in h]
    if not history:
        return None, None, f"{path}: no validation with BLEU yet"
    return summary, history, None


def main(argv):
    args = parse_args(argv)
    runs = []
    for i, path in enumerate(args.summaries):
        summary, history, error = load_history(path)
        if error:
            print(error, file=sys.stderr)
            return 1
        label = args.label[i] if args.label else os.path.basename(os.path.dirname(os.path.abspath(path)))
        runs.append((label, summary, history))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def xs(history):
        return [h["elapsed_s"] / 60 for h in history] if args.minutes else [h["step"] for h in history]

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
    if len(runs) == 1:
        _, summary, history = runs[0]
        ax.plot(xs(history), [h["bleu"] for h in history], "o-", label="BLEU")
        ax.plot(xs(history), [h["chrf"] for h in history], "s--", label="chrF", alpha=0.7)
        minutes = history[-1]["elapsed_s"] / 60
        ax.set_title(f"en-de Bible, {summary.get('parameters', 0) / 1e6:.1f}M parameters, {minutes:.0f} min")
    else:
        for label, _summary, history in runs:
            ax.plot(xs(history), [h["bleu"] for h in history], "o-", markersize=3, label=label)
        ax.set_title(f"en-de Bible, {runs[0][1].get('parameters', 0) / 1e6:.1f}M parameters: validation BLEU")
    ax.set_xlabel("training minutes" if args.minutes else "optimiser steps")
    ax.set_ylabel("validation score (Ruth + Philippians)" if len(runs) == 1 else "validation BLEU")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    try:
        atomic_write_bytes(args.out, buf.getvalue())  # a reader sees the old PNG or the new one
    except OSError as exc:
        print(f"{args.out}: cannot write the plot ({exc})", file=sys.stderr)
        return 1
    print(f"wrote {args.out} ({', '.join(f'{label}: {len(h)} validations' for label, _, h in runs)})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
