"""Plot validation BLEU (and chrF) against training steps from a run's summary.json.

python recipes/plot_curve.py RUN/summary.json OUT.png
"""

import json
import sys


def main(argv):
    if len(argv) != 2:
        print("usage: python recipes/plot_curve.py RUN/summary.json OUT.png", file=sys.stderr)
        return 2
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = json.load(open(argv[0], encoding="utf-8"))
    history = [h for h in summary["history"] if "bleu" in h]
    if not history:
        print(f"{argv[0]}: no validation with BLEU yet", file=sys.stderr)
        return 1
    steps = [h["step"] for h in history]
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
    ax.plot(steps, [h["bleu"] for h in history], "o-", label="BLEU")
    ax.plot(steps, [h["chrf"] for h in history], "s--", label="chrF", alpha=0.7)
    ax.set_xlabel("optimiser steps")
    ax.set_ylabel("validation score (Ruth + Philippians)")
    minutes = history[-1]["elapsed_s"] / 60
    ax.set_title(f"en-de Bible, {summary.get('parameters', 0) / 1e6:.1f}M parameters, {minutes:.0f} min")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(argv[1])
    print(f"wrote {argv[1]} ({len(history)} validations)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
