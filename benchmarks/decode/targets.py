"""The speed targets of the decode and pretrained benchmarks, scored on benchmark JSONs: which cells each run meets, machine by machine.

    python -m benchmarks.decode.targets benchmarks/results/bench_decode_20261203_xeon_run*.json \\
        benchmarks/results/bench_small_model_xeon*.json
    python -m benchmarks.decode.targets FILES --markdown            # one row per target, as README quotes it

Reads ``bench_decode.py`` JSONs (the ``best_threads`` records: each engine's tokens/s at every
thread setting it ran, and its best; the ``bandwidth_floor_batch1`` records),
``bench_small_model.py`` JSONs (CPU seconds of the demo model's file translation) and
``bench_pretrained.py`` JSONs (its ``ratios`` at opus-mt and t5-base dimensions), groups them
by the machine each recorded (CPU model, L3, instruction-set flags: a ratio from one machine
says nothing of another), and scores every target of :data:`TARGETS` in every cell of every
run that measured it:

* ``best``: ours over the peer, each engine at its own best setting (``best_threads``: 1, 2 or a
  split such as ``2x1``), at least ``minimum``;
* ``same_threads``: ours over the peer at 1 and at 2 threads, at least ``minimum``;
* ``floor``: the fraction of the batch-1 bandwidth floor an engine reached at 2 threads (never
  met where the engine's weights fit the machine's L3: the floor is not a floor there);
* ``cpu_time``: ours' CPU seconds over CTranslate2's on the same lines, at most ``maximum``;
* ``pretrained``: bench_pretrained's ratio of ours over a peer (Optimum, transformers,
  CTranslate2) at 2 threads or each at its best setting, at least ``minimum``.

A cell a run did not measure is left out of that run (an engine or batch size it did not run),
so the count of runs differs per cell. Nothing is timed here: the numbers are the JSONs'. Prints
a table per machine (``--markdown`` for README) and writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Optional

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (results/ lives here)

from benchmarks.common import write_json

MODEL = "base"
BATCHES = (1, 16, 64)


@dataclass(frozen=True)
class Target:
    name: str
    kind: str  # "best", "same_threads", "floor", "cpu_time" or "pretrained"
    cells: tuple = ()  # (mode, batch) pairs; empty for cpu_time
    pairs: tuple = ()  # (ours, peer) engine pairs
    minimum: Optional[float] = None
    maximum: Optional[float] = None
    threads: tuple = field(default=("1", "2"))
    sizes: tuple = ()  # pretrained: the bench_pretrained sizes it is scored on (empty: every size)


TARGETS = (
    Target(
        "int8 at least 1.3x CTranslate2 int8, each at its best setting",
        "best",
        cells=tuple((m, b) for m in ("greedy", "beam4") for b in BATCHES),
        pairs=(("onnxrt_int8", "ctranslate2_int8"), ("onnxrt_op_int8", "ctranslate2_int8")),
        minimum=1.3,
    ),
    Target(
        "float32 at least 1.2x CTranslate2 float32, each at its best setting",
        "best",
        cells=tuple((m, b) for m in ("greedy", "beam4") for b in BATCHES),
        pairs=(("onnxrt", "ctranslate2"), ("onnxrt_op", "ctranslate2")),
        minimum=1.2,
    ),
    Target(
        "float32 greedy b1 at least 90% of the bandwidth floor at 2 threads",
        "floor",
        cells=(("greedy", 1),),
        pairs=(("onnxrt", ""),),
        minimum=0.9,
        threads=("2",),
    ),
    Target(
        "int4 greedy b1 at least 1.5x our int8, each at its best setting",
        "best",
        cells=(("greedy", 1),),
        pairs=(("onnxrt_int4", "onnxrt_int8"),),
        minimum=1.5,
    ),
    Target(
        "int4 greedy b1 at least 3x CTranslate2 int8, each at its best setting",
        "best",
        cells=(("greedy", 1),),
        pairs=(("onnxrt_int4", "ctranslate2_int8"),),
        minimum=3.0,
    ),
    Target(
        "no cell below 1.0x CTranslate2 at equal settings (1 thread, 2 threads, 2x1)",
        "same_threads",
        cells=tuple((m, b) for m in ("greedy", "beam4") for b in BATCHES),
        pairs=(("onnxrt", "ctranslate2"), ("onnxrt_int8", "ctranslate2_int8")),
        minimum=1.0,
        threads=("1", "2", "2x1"),
    ),
    Target(
        "demo model's 5,000-line greedy translation in no more CPU time than CTranslate2",
        "cpu_time",
        pairs=(("onnxrt", "ctranslate2"),),
        maximum=1.0,
    ),
)
_PRETRAINED_CELLS = tuple((m, b) for m in ("greedy", "beam4") for b in (1, 16))
_MARIAN = ("opus-mt-en-de", "tiny")
# The pretrained-model targets on bench_pretrained.py (opus-mt-en-de dimensions, and t5-base's for
# the T5 ones): its ``ratios`` records, at 2 threads or with each engine at its best setting
# ("best", the 2x1 split among the settings).
PRETRAINED_TARGETS = (
    Target(
        "ONNX Runtime float32 at least 3x Optimum at batch 1, 2 threads",
        "pretrained",
        cells=(("greedy", 1), ("beam4", 1)),
        pairs=(("onnxrt", "optimum"),),
        minimum=3.0,
        threads=("2",),
        sizes=_MARIAN,
    ),
    Target(
        "ONNX Runtime float32 at least 4x transformers generate at batch 1, 2 threads",
        "pretrained",
        cells=(("greedy", 1), ("beam4", 1)),
        pairs=(("onnxrt", "transformers"),),
        minimum=4.0,
        threads=("2",),
        sizes=_MARIAN,
    ),
    Target(
        "opus-mt float32 at least 1.2x CTranslate2 float32, each at its best setting",
        "pretrained",
        cells=_PRETRAINED_CELLS,
        pairs=(("onnxrt", "ctranslate2"),),
        minimum=1.2,
        threads=("best",),
        sizes=_MARIAN,
    ),
    Target(
        "opus-mt int8 at least 1.3x CTranslate2 int8, each at its best setting",
        "pretrained",
        cells=_PRETRAINED_CELLS,
        pairs=(("onnxrt_int8", "ctranslate2_int8"),),
        minimum=1.3,
        threads=("best",),
        sizes=_MARIAN,
    ),
    Target(
        "t5-base float32 at least 1.2x CTranslate2 float32, each at its best setting",
        "pretrained",
        cells=_PRETRAINED_CELLS,
        pairs=(("onnxrt", "ctranslate2"),),
        minimum=1.2,
        threads=("best",),
        sizes=("t5-base",),
    ),
    Target(
        "t5-base int8 at least 1.3x CTranslate2 int8, each at its best setting",
        "pretrained",
        cells=_PRETRAINED_CELLS,
        pairs=(("onnxrt_int8", "ctranslate2_int8"),),
        minimum=1.3,
        threads=("best",),
        sizes=("t5-base",),
    ),
)
ALL_TARGETS = TARGETS + PRETRAINED_TARGETS
# Which benchmark's JSON each kind of target is scored on.
_SOURCE = {"best": "decode", "same_threads": "decode", "floor": "decode", "cpu_time": "small_model"}


class TargetsError(ValueError):
    """A file that is not a benchmark JSON this scores."""


def machine_key(machine: dict) -> str:
    machine = machine.get("lscpu", machine)  # bench_small_model nests lscpu's record
    simd = ",".join(machine.get("simd") or [])
    return (
        f"{machine.get('model_name', '?')} | L3 {machine.get('l3', '?')} | {simd or 'no SIMD flags recorded'}"
    )


def l3_bytes(machine: dict) -> Optional[int]:
    """lscpu's L3 size (``"105 MiB (1 instance)"``) in bytes, or None."""
    text = (machine.get("lscpu", machine).get("l3") or "").split()
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    try:
        return int(float(text[0]) * units[text[1]])
    except (IndexError, KeyError, ValueError):
        return None


def load(path: str) -> tuple[str, dict]:
    """``(kind, payload)`` of a benchmark JSON: ``"decode"``, ``"small_model"`` or ``"pretrained"``."""
    try:
        with open(path, encoding="utf-8") as f:
            payload = json.load(f)
    except (OSError, ValueError) as e:
        raise TargetsError(f"{path}: cannot read a JSON file ({e})") from None
    if not isinstance(payload, dict) or not isinstance(payload.get("machine"), dict):
        raise TargetsError(f"{path}: not a benchmark JSON (no 'machine' record)")
    if payload.get("benchmark") == "bench_small_model":
        if not isinstance(payload.get("results"), dict):
            raise TargetsError(f"{path}: a bench_small_model JSON without 'results'")
        return "small_model", payload
    if isinstance(payload.get("best_threads"), list):
        return "decode", payload
    ratios = payload.get("ratios")
    if (
        "size" in payload
        and isinstance(ratios, list)
        and all(isinstance(r, dict) and "ours" in r for r in ratios)
    ):
        return "pretrained", payload
    raise TargetsError(f"{path}: not a bench_decode.py, bench_pretrained.py or bench_small_model.py JSON")


def _tokens(payload: dict) -> dict:
    """``(engine, mode, batch) -> best_threads record`` of the model :data:`MODEL`."""
    return {
        (r["engine"], r["mode"], int(r["batch"])): r
        for r in payload["best_threads"]
        if r.get("model", MODEL) == MODEL
    }


def score_decode(target: Target, payload: dict) -> list[dict]:
    """Every cell of ``target`` one bench_decode JSON measured: ``{"cell", "value", "met"}``."""
    tokens = _tokens(payload)
    l3 = l3_bytes(payload["machine"])
    floors = payload.get("models", {}).get(MODEL, {}).get("bandwidth_floor_batch1") or {}
    cells = []
    for ours, peer in target.pairs:
        for mode, batch in target.cells:
            mine = tokens.get((ours, mode, batch))
            theirs = tokens.get((peer, mode, batch))
            label = f"{mode} b{batch}"
            if target.kind == "best" and mine and theirs:
                value = mine["tokens_per_second"] / theirs["tokens_per_second"]
                setting = f"{mine['best_threads']} vs {theirs['best_threads']}"
                cells.append({"cell": label, "pair": f"{ours}/{peer}", "setting": setting, "value": value})
            elif target.kind == "same_threads" and mine and theirs:
                for t in target.threads:
                    a = mine["tokens_per_second_by_threads"].get(t)
                    b = theirs["tokens_per_second_by_threads"].get(t)
                    if a and b:
                        cells.append({"cell": f"{label} {t}t", "pair": f"{ours}/{peer}", "value": a / b})
            elif target.kind == "floor" and batch == 1:
                weight_bytes = floors.get(ours, {}).get("weight_bytes_per_token")
                for t in target.threads:
                    record = floors.get(ours, {}).get("by_threads", {}).get(t)
                    if record and record.get("fraction_of_floor") is not None:
                        cell = {"cell": f"{label} {t}t", "pair": ours, "value": record["fraction_of_floor"]}
                        if weight_bytes and l3 and weight_bytes <= l3:
                            cell["not_a_floor"] = (
                                f"{weight_bytes / 1e6:.0f} MB of weights fit the {l3 >> 20} MiB L3"
                            )
                        cells.append(cell)
    for c in cells:
        c["met"] = False if c.get("not_a_floor") else _met(target, c["value"])
    return cells


def score_small_model(target: Target, payload: dict) -> list[dict]:
    results = payload["results"]
    cells = []
    for ours, peer in target.pairs:
        mine, theirs = results.get(ours), results.get(peer)
        if mine and theirs and mine.get("cpu_seconds") and theirs.get("cpu_seconds"):
            value = mine["cpu_seconds"] / theirs["cpu_seconds"]
            cells.append({"cell": "5,000 lines, 1 thread", "pair": f"{ours}/{peer}", "value": value})
    for c in cells:
        c["met"] = _met(target, c["value"])
    return cells


def score_pretrained(target: Target, payload: dict) -> list[dict]:
    """Every cell of a pretrained-model target one bench_pretrained JSON measured (none where the
    target is for other sizes than the JSON's)."""
    if target.sizes and payload.get("size") not in target.sizes:
        return []
    ratios = {
        (r["ours"], r["peer"], r["mode"], int(r["batch"]), str(r["threads"])): r for r in payload["ratios"]
    }
    cells = []
    for ours, peer in target.pairs:
        for mode, batch in target.cells:
            for t in target.threads:
                r = ratios.get((ours, peer, mode, batch, t))
                if r is None or r.get("ratio") is None:
                    continue
                label = f"{mode} b{batch}" + ("" if t == "best" else f" {t}t")
                cell = {"cell": label, "pair": f"{ours}/{peer}", "value": r["ratio"]}
                if t == "best":
                    cell["setting"] = f"{r.get('ours_threads')} vs {r.get('peer_threads')}"
                cells.append(cell)
    for c in cells:
        c["met"] = _met(target, c["value"])
    return cells


def _met(target: Target, value: float) -> bool:
    if target.minimum is not None and not value >= target.minimum:
        return False
    return not (target.maximum is not None and not value <= target.maximum)


def score(paths: list[str]) -> dict:
    """Every target per machine over the runs in ``paths``."""
    machines: dict[str, dict] = {}
    for path in paths:
        kind, payload = load(path)
        key = machine_key(payload["machine"])
        entry = machines.setdefault(key, {"machine": key, "runs": [], "targets": {}})
        entry["runs"].append(os.path.basename(path))
        for target in ALL_TARGETS:
            if _SOURCE.get(target.kind, "pretrained") != kind:
                continue
            scorer = {
                "decode": score_decode,
                "small_model": score_small_model,
                "pretrained": score_pretrained,
            }
            cells = scorer[kind](target, payload)
            rows = entry["targets"].setdefault(target.name, {})
            for c in cells:
                row = rows.setdefault(
                    (c["cell"], c["pair"]), {"cell": c["cell"], "pair": c["pair"], "runs": []}
                )
                run = {"run": os.path.basename(path), "value": c["value"], "met": c["met"]}
                if "not_a_floor" in c:
                    run["not_a_floor"] = c["not_a_floor"]
                if "setting" in c:
                    run["setting"] = c["setting"]
                row["runs"].append(run)
    out = {"targets": [t.name for t in ALL_TARGETS], "machines": []}
    for entry in machines.values():
        targets = []
        for target in ALL_TARGETS:
            rows = list(entry["targets"].get(target.name, {}).values())
            for row in rows:
                values = [r["value"] for r in row["runs"]]
                row.update(
                    low=min(values),
                    high=max(values),
                    met_runs=sum(r["met"] for r in row["runs"]),
                    measured_runs=len(values),
                )
            targets.append(
                {
                    "target": target.name,
                    "kind": target.kind,
                    "minimum": target.minimum,
                    "maximum": target.maximum,
                    "cells": rows,
                    "met_everywhere": bool(rows) and all(r["met_runs"] == r["measured_runs"] for r in rows),
                    "measured": bool(rows),
                }
            )
        out["machines"].append({"machine": entry["machine"], "runs": entry["runs"], "targets": targets})
    return out


def _fmt(row: dict, kind: str) -> str:
    if kind == "floor":
        text = f"{100 * row['low']:.0f}-{100 * row['high']:.0f}%"
        reasons = sorted({r["not_a_floor"] for r in row["runs"] if "not_a_floor" in r})
        return text + (f" (not a floor: {reasons[0]})" if reasons else "")
    low, high = f"{row['low']:.2f}", f"{row['high']:.2f}"
    return f"{low}x" if low == high else f"{low}-{high}x"


def _cell_text(row: dict, kind: str, pairs: int) -> str:
    who = f" {row['pair'].split('/')[0]}" if pairs > 1 else ""
    return f"{row['cell']}{who} {_fmt(row, kind)} ({row['met_runs']}/{row['measured_runs']})"


def render(result: dict, markdown: bool = False) -> str:
    """Every cell per target (plain), or one row per target (``markdown``): the cells met in every
    run that measured them, and the others with their range and the runs that met them."""
    lines = []
    for m in result["machines"]:
        runs = m["runs"]
        plural = "s" if len(runs) != 1 else ""
        lines.append(f"{m['machine']} ({len(runs)} run{plural}: {', '.join(runs)})")
        if markdown:
            lines += [
                "",
                "| target | met in every run | missed in some run: range (runs met / measured) |",
                "| --- | --- | --- |",
            ]
        for t in m["targets"]:
            pairs = len({row["pair"] for row in t["cells"]})
            if markdown:
                if not t["measured"]:
                    continue
                met = [r for r in t["cells"] if r["met_runs"] == r["measured_runs"]]
                missed = [r for r in t["cells"] if r["met_runs"] < r["measured_runs"]]
                lines.append(
                    f"| {t['target']} | {', '.join(_cell_text(r, t['kind'], pairs) for r in met) or '-'} "
                    f"| {', '.join(_cell_text(r, t['kind'], pairs) for r in missed) or '-'} |"
                )
                continue
            if not t["measured"]:
                continue
            lines.append(f"  {t['target']}: {'met in every run' if t['met_everywhere'] else 'missed'}")
            for row in t["cells"]:
                met = f"{row['met_runs']} of {row['measured_runs']}"
                lines.append(f"    {row['cell']:<22} {row['pair']:<34} {_fmt(row, t['kind']):>14}  met {met}")
        unmeasured = sum(not t["measured"] for t in m["targets"])
        if unmeasured:
            lines += ["", f"({unmeasured} of {len(m['targets'])} targets not measured by these runs)"]
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "files", nargs="+", help="bench_decode.py, bench_pretrained.py and bench_small_model.py JSON files"
    )
    p.add_argument("--markdown", action="store_true", help="print Markdown tables")
    p.add_argument("--out", default=None, help="write the scores as JSON here")
    args = p.parse_args(argv)
    try:
        if args.out:  # never over one of the files it reads
            from transformer_ext.fsutil import OutputConflictError, check_output_path

            try:
                check_output_path(args.out, inputs=[("the input", f) for f in args.files], what="--out")
            except OutputConflictError as e:
                raise TargetsError(str(e)) from None
        result = score(args.files)
    except TargetsError as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 1
    print(render(result, markdown=args.markdown))
    if args.out:
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
