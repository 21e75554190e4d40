"""``zeropp accuracy``: does ZeRO++ cost accuracy, and how much? A verdict per technique that
separates its cost from the drift any perturbation causes in a short training run.

The grid: cells of (corpus, model setting); in each cell, seeds; for each seed, ZeRO-3, the
perturbation controls and the techniques, every run from the same initial weights on the same
batches (``zeropp converge``, one folder per cell and seed, resumable: a rerun trains only what
is missing). Runs go in passes, the most telling first (the default ``all`` and its control on
every corpus, then the single techniques, ...), seeds in the outer loop, so that a grid cut off
midway leaves every cell with about as many seeds as the others.

The verdict (zeropp.tools.bench.paired [Note: paired verdict]) is written after every run to ``<out>/accuracy.json``,
``accuracy.png`` and ``accuracy.md``.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zeropp.tools.bench import accuracy_pretrained, converge
from zeropp.tools.bench.paired import CONTROL, mean, std, summary, verdict
from zeropp.tools.modes import BASELINE

DEFAULT = "all"
"""The mode every other code is also compared with directly (``against_default``): all three at
the default settings."""
ORDER_CONTROL = "zero3_order"
"""The second control ([Note: perturbation controls] in zeropp.tools.modes): the drift of the smallest
perturbation there is; every mode is paired with ``CONTROL``, whose perturbation is of qwZ's size."""
CORPORA = ("shakespeare", "kjv", "mormon")
SEEDS = (0, 1, 2, 3, 4)
STEPS = 300
"""Per run: the demo's default length; the grid's 150+ runs take 3 minutes each at the demo size on
2 shared cores (1000 steps, as ``zeropp converge`` takes by default, would take 10)."""

EARLY_STEPS = 50
"""[Note: early loss spikes] The grid's recipe (AdamW at its full learning rate from step 1, no
warm-up, as the demo trains) makes the train loss jump up for a step or a few between steps 5 and
20 on some seeds, ZeRO-3's runs included (the Book of Mormon seed 1: +1.8 nats at step 9): an
Adam step overshoots while the second moments are young. Which steps spike, and how high,
depends on the exact trajectory, so a perturbed run can spike where ZeRO-3 did not (or not where
it did), and the gap that leaves lasts to the end. These spikes, not a steady cost, make the
few deltas of several percent; ``largest_early_rise_nats`` in the report names them per run."""

ATTEMPTS = 3
"""Tries per cell and seed: a job that dies is run again rather than ending a grid of hours (a
gloo rank aborting at exit after its last step, since mended in [Note: gathers after the step],
was seen once in the grid's trial runs)."""


@dataclass(frozen=True, kw_only=True)
class Setting:
    """A model and learning rate the grid trains, with the modes it runs there."""

    name: str
    training: dict[str, Any] = field(default_factory=dict)
    """``DemoConfig`` fields over ``zeropp converge``'s (batch 64, lr 1e-3, the demo's 4 x 128 GPT)."""


SETTINGS = {setting.name: setting for setting in (
    Setting(name="demo"),
    Setting(name="wide", training={"num_layers": 6, "embed_dim": 192, "num_heads": 6, "lr": 6e-4}),
    Setting(name="narrow", training={"num_layers": 4, "embed_dim": 96, "num_heads": 3, "lr": 2e-3}),
)}
"""``narrow``'s rows of 96 share blocks of 64 with their neighbours, where the normal levels of
``all_scale8`` put nonzero values on exact-zero entries (``zeropp bench qgz-error``'s updates)."""
PASSES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("demo", (BASELINE, CONTROL, "all")),
    ("demo", ("qwz", "qgz", ORDER_CONTROL)),
    ("demo", ("all_scale8",)),
    ("narrow", (BASELINE, "all", "all_scale8")),
    ("narrow", (CONTROL,)),
    ("demo", ("all_spare",)),
    ("demo", ("all_delta",)),
    ("wide", (BASELINE, CONTROL, "all")),
    ("wide", ("all_spare",)),
)
"""(setting, modes added), in the order they run: the default against its control, the cost
attributed to each technique, the lowest-error gradient code where its blocks hold whole rows,
then the default against that code where rows share blocks (the choice of default turns on
that pair, which needs no control), the narrow setting's control, the spared code, all three
with weight differences (``weight_deltas``: exact forward weights up to the last difference's
code), and the
default on a wider setting (the slowest runs, last). hpZ alone is not in the grid: its training
is bit-identical to ZeRO-3's (docs/results.md), so its delta is 0 on every seed."""


def run(out_dir: str | Path, *, corpora: Sequence[str] = CORPORA, seeds: Sequence[int] = SEEDS,
        passes: Sequence[tuple[str, tuple[str, ...]]] = PASSES, steps: int = STEPS,
        runs_dir: str | Path = "runs/accuracy", eval_batches: int = 8) -> dict[str, Any]:
    """Train every missing run of the grid, pass by pass, rewriting the verdict after each cell."""
    out_dir = Path(out_dir)
    modes: dict[str, list[str]] = {}
    for setting_name, added in passes:
        chosen = modes.setdefault(setting_name, [])
        chosen += [name for name in added if name not in chosen]
        for seed in seeds:
            for corpus in corpora:
                cell = f"{corpus}_{setting_name}"
                for attempt in range(ATTEMPTS):  # converge.run resumes: a retry trains only what is missing
                    try:
                        converge.run(out_dir / cell / f"seed_{seed}", steps=steps, modes=tuple(chosen),
                                     eval_every=steps // 3, eval_batches=eval_batches, reference=False,
                                     runs_dir=Path(runs_dir) / cell / f"seed_{seed}", seed=seed, corpus=corpus,
                                     **SETTINGS[setting_name].training)
                        break
                    except RuntimeError as error:
                        print(f"{cell} seed {seed}, attempt {attempt + 1} of {ATTEMPTS}: {error}", flush=True)
                report(out_dir)
    return report(out_dir)


def report(out_dir: str | Path) -> dict[str, Any]:
    """The verdict of every cell and seed found under ``out_dir``: JSON, PNG and markdown."""
    out_dir = Path(out_dir)
    cells = {}
    for cell_dir in sorted(p for p in out_dir.iterdir() if p.is_dir()):
        per_seed = dict(sorted((int(p.name.removeprefix("seed_")), json.loads((p / "converge.json").read_text()))
                               for p in cell_dir.glob("seed_*") if (p / "converge.json").exists()))
        if per_seed:
            cells[cell_dir.name] = cell_verdict(per_seed)
    by_setting: dict[str, dict[str, dict[str, Any]]] = {}
    for cell_name, cell in cells.items():
        by_setting.setdefault(setting_of(cell_name, cell), {})[cell_name] = cell
    result = {"control": CONTROL, "cells": cells,
              "by_setting": {name: pooled_verdict(group) for name, group in by_setting.items()},
              "pooled": pooled_verdict(cells),
              "against_default": {name: against_default(group) for name, group in by_setting.items()}}
    (out_dir / "accuracy.json").write_text(json.dumps(result, indent=1))
    (out_dir / "accuracy.md").write_text(summary_table(result) + "\n\n" + table(result) + "\n")
    plot(out_dir / "accuracy.png", result)
    return result


def setting_of(cell_name: str, cell: dict[str, Any]) -> str:
    """The model setting of a cell (its name is ``<corpus>_<setting>``)."""
    return cell_name.removeprefix(f"{cell['settings']['corpus']}_")


def paired_deltas(per_seed: dict[int, dict[str, Any]], name: str) -> dict[int, float]:
    """Per seed where both ran: the final validation loss of ``name`` against ZeRO-3's, in percent."""
    deltas = {}
    for seed, results in sorted(per_seed.items()):
        modes = results["modes"]
        if name in modes and BASELINE in modes:
            baseline = modes[BASELINE]["final_val_loss"]
            deltas[seed] = 100 * (modes[name]["final_val_loss"] - baseline) / baseline
    return deltas


def cell_verdict(per_seed: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """One cell: its settings, ZeRO-3's spread over seeds, and per mode its paired deltas, the
    control's, and the verdict on their difference (zeropp.tools.bench.paired [Note: paired verdict])."""
    first = per_seed[min(per_seed)]
    names = list(dict.fromkeys(name for results in per_seed.values() for name in results["modes"]))
    control = paired_deltas(per_seed, CONTROL)
    baseline = [r["modes"][BASELINE]["final_val_loss"] for r in per_seed.values() if BASELINE in r["modes"]]
    modes = {}
    for name in names:
        if name == BASELINE:
            continue
        deltas = paired_deltas(per_seed, name)
        modes[name] = {"deltas_percent": deltas, "control_deltas_percent": {k: control[k] for k in deltas
                                                                             if k in control},
                       **summary(list(deltas.values())),
                       "vs_control": verdict([deltas[k] - control[k] for k in deltas if k in control])}
    settings = {key: value for key, value in first["settings"].items() if key != "seed"}
    early_rises = {name: {seed: largest_early_rise(results["modes"][name]["train_loss"])
                          for seed, results in per_seed.items() if name in results["modes"]} for name in names}
    return {"settings": settings, "seeds": sorted(per_seed), "zero3_final_val_losses": baseline,
            "zero3_seed_spread_percent": 100 * std(baseline) / mean(baseline) if len(baseline) > 1 else None,
            "modes": modes, "largest_early_rise_nats": early_rises}


def largest_early_rise(train_loss: list[float]) -> float:
    """The largest rise of the train loss from one step to the next in the first ``EARLY_STEPS``:
    how high the run's early loss spike went ([Note: early loss spikes])."""
    early = train_loss[:EARLY_STEPS]
    return max((after - before for before, after in zip(early, early[1:])), default=0.0)


def pooled_verdict(cells: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per mode, every (cell, seed) pair of every cell pooled: the paired verdict over all corpora
    and settings, and the verdict on the mode's deltas alone (against 0: tighter by about sqrt(2)
    where the control's deltas average 0, which the control's own row tests)."""
    differences: dict[str, list[float]] = {}
    deltas: dict[str, list[float]] = {}
    for cell in cells.values():
        for name, entry in cell["modes"].items():
            control = entry["control_deltas_percent"]
            differences.setdefault(name, []).extend(entry["deltas_percent"][k] - control[k] for k in control)
            deltas.setdefault(name, []).extend(entry["deltas_percent"].values())
    return {name: {"vs_control": verdict(differences[name]), "delta_alone": verdict(deltas[name], against="ZeRO-3")}
            for name in differences}


def against_default(cells: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per technique other than ``DEFAULT``: its Δ minus the default's on every (cell, seed) where
    both ran, pooled; the choice between two codes needs no control, as the drift of each is
    in both deltas alike."""
    differences: dict[str, list[float]] = {}
    for cell in cells.values():
        for name in cell["modes"]:
            if name not in (DEFAULT, CONTROL, ORDER_CONTROL):
                differences.setdefault(name, []).extend(minus_default(cell, name))
    return {name: verdict(values, against=f"the default ({DEFAULT})")
            for name, values in differences.items() if values}


def minus_default(cell: dict[str, Any], name: str) -> list[float]:
    """Per seed of ``cell`` where both ran: the Δ of ``name`` minus the default's."""
    default = cell["modes"].get(DEFAULT, {}).get("deltas_percent", {})
    return [delta - default[seed] for seed, delta in cell["modes"][name]["deltas_percent"].items() if seed in default]


def summary_table(result: dict[str, Any]) -> str:
    """Markdown: per mode, the verdict pooled over the corpora of each setting, and over every cell."""
    settings = list(result["by_setting"])
    names = list(dict.fromkeys(name for pooled in result["by_setting"].values() for name in pooled))
    lines = [f"Per mode and setting, pooled over corpora and seeds: the mode's Δ minus {CONTROL}'s Δ, "
             f"mean and 95% t interval (pairs; Wilcoxon signed-rank p); for the controls {CONTROL} and "
             f"{ORDER_CONTROL}, their Δ alone", "",
             "| mode | " + " | ".join(settings) + " | every cell |", "|---|" + "---|" * (len(settings) + 1)]
    for name in names:
        pooled = [result["by_setting"][setting].get(name) for setting in settings] + [result["pooled"].get(name)]
        key = "delta_alone" if name in (CONTROL, ORDER_CONTROL) else "vs_control"
        lines.append(f"| {name} | " + " | ".join("—" if entry is None else short(entry[key]) for entry in pooled)
                     + " |")
    direct = result.get("against_default", {})
    names = list(dict.fromkeys(name for pooled in direct.values() for name in pooled))
    if names:
        lines += ["", f"Against the default directly: the mode's Δ minus {DEFAULT}'s Δ on the same seed, "
                      "pooled over corpora (no control needed)", "",
                  "| mode | " + " | ".join(direct) + " |", "|---|" + "---|" * len(direct)]
        lines += [f"| {name} | " + " | ".join(short(pooled[name]) if name in pooled else "—"
                                              for pooled in direct.values()) + " |" for name in names]
    return "\n".join(lines)


def short(entry: dict[str, Any]) -> str:
    """A verdict in a table cell: its word, the mean, the interval and the number of pairs."""
    if entry["interval_percent"] is None:
        return f"too few seeds ({entry['n']})"
    low, high = entry["interval_percent"]
    word = "noise" if low <= 0 <= high else "costs" if low > 0 else "better"
    return (f"{word}: {entry['mean_percent']:+.2f}% [{low:+.2f}, {high:+.2f}] "
            f"({entry['n']}; signed-rank p {entry['signed_rank_p']:.2g})")


def table(result: dict[str, Any]) -> str:
    """Markdown: per mode and cell, the mean paired delta ± standard error, the control's, and the verdict."""
    lines = [f"Δ: final validation loss against ZeRO-3 on the same seed, mean ± standard error; "
             f"verdict: the mode's Δ minus the control's ({CONTROL}) per seed, 95% t interval", "",
             "| cell | seeds | ZeRO-3 seed spread | mode | Δ | control Δ | verdict | signed-rank p |",
             "|---|---:|---:|---|---:|---:|---|---:|"]
    for cell_name, cell in result["cells"].items():
        spread = cell["zero3_seed_spread_percent"]
        control = summary(list(cell["modes"].get(CONTROL, {}).get("deltas_percent", {}).values()))
        for name, entry in cell["modes"].items():
            if name == CONTROL:
                continue
            lines.append(f"| {cell_name} | {entry['n']} | {'—' if spread is None else f'{spread:.2f}%'} | {name} | "
                         f"{_pm(entry)} | {_pm(control)} | {entry['vs_control']['text']} | "
                         f"{_p(entry['vs_control'])} |")
    lines += ["", "Pooled over every cell and seed:", "",
              f"| mode | pairs | Δ minus {CONTROL}'s Δ (the verdict) | Δ alone, against 0 |", "|---|---:|---|---|"]
    lines += [f"| {name} | {entry['vs_control']['n']} | {'—' if name == CONTROL else entry['vs_control']['text']} | "
              f"{entry['delta_alone']['text']} |" for name, entry in result["pooled"].items()]
    return "\n".join(lines)


def _p(entry: dict[str, Any]) -> str:
    return f"{entry['signed_rank_p']:.2g}" if "signed_rank_p" in entry else "—"


def _pm(entry: dict[str, Any]) -> str:
    if entry.get("mean_percent") is None:
        return "—"
    error = entry.get("standard_error_percent")
    return f"{entry['mean_percent']:+.2f}%" + ("" if error is None else f" ± {error:.2f}")


def plot(path: Path, result: dict[str, Any]) -> None:
    """One row per setting. Left: each mode's Δ minus the control's per (corpus, seed), the verdict;
    right: each code's Δ minus the default's on the same seed. Dots per seed, one marker per
    corpus; the pooled mean and 95% interval beside them. The y range follows the dots, so an
    interval from two seeds does not flatten the rest: one cut off ends in an arrow."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = list(result["by_setting"])
    if not settings:
        return
    corpora = sorted({cell["settings"]["corpus"] for cell in result["cells"].values()})
    markers = dict(zip(corpora, "o^sDv"))
    names = dict.fromkeys(name for cell in result["cells"].values() for name in cell["modes"] if name != CONTROL)
    colors = {name: f"C{i % 10}" for i, name in enumerate(names)}
    fig, axes = plt.subplots(len(settings), 2, figsize=(12, 3.2 * len(settings)), squeeze=False)
    for row, setting in zip(axes, settings):
        direct = result["against_default"].get(setting, {})
        left: dict[str, dict[str, list[float]]] = {}  # mode -> corpus -> per-seed differences
        right: dict[str, dict[str, list[float]]] = {}
        for cell_name, cell in result["cells"].items():
            if setting_of(cell_name, cell) != setting:
                continue
            corpus = cell["settings"]["corpus"]
            for name, entry in cell["modes"].items():
                if name != CONTROL:
                    left.setdefault(name, {})[corpus] = entry["vs_control"]["differences_percent"]
                if name in direct:
                    right.setdefault(name, {})[corpus] = minus_default(cell, name)
        _panel(row[0], left, {name: result["by_setting"][setting][name]["vs_control"] for name in left},
               markers, colors)
        row[0].set_title(f"{setting}: Δ minus {CONTROL}'s Δ (the verdict)", fontsize=9)
        _panel(row[1], right, direct, markers, colors)
        row[1].set_title(f"{setting}: Δ minus the default's ({DEFAULT}) on the same seed", fontsize=9)
        row[0].set_ylabel("difference, % of ZeRO-3's val loss")
    handles = [plt.Line2D([], [], ls="", marker=markers[c], color="k", mfc="none", label=c) for c in corpora]
    fig.legend(handles=handles, loc="upper right", fontsize=8)
    fig.suptitle("per seed (markers by corpus), pooled mean and 95% t interval; grey: ±0.3%", fontsize=9)
    fig.tight_layout(rect=(0, 0, 0.93, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _panel(ax, dots: dict[str, dict[str, list[float]]], verdicts: dict[str, dict[str, Any]],
           markers: dict[str, str], colors: dict[str, str]) -> None:
    """One panel of ``plot``: per mode, its per-seed differences and their pooled verdict."""
    names = [name for name in dots if any(dots[name].values())]
    values = [v for name in names for per_corpus in dots[name].values() for v in per_corpus]
    if not values:
        ax.text(0.5, 0.5, "no pairs yet", ha="center", va="center", transform=ax.transAxes, fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
        return
    ax.axhline(0, color="k", lw=0.8)
    ax.axhspan(-0.3, 0.3, color="grey", alpha=0.15)
    limit = 1.25 * max(abs(v) for v in values) + 0.5
    for i, name in enumerate(names):
        for j, (corpus, per_corpus) in enumerate(sorted(dots[name].items())):
            ax.plot([i - 0.15 + 0.1 * j] * len(per_corpus), per_corpus, ls="", marker=markers[corpus],
                    ms=4, color=colors[name], mfc="none")
        entry = verdicts.get(name)
        if entry and entry["interval_percent"] is not None:
            low, high = entry["interval_percent"]
            ax.vlines(i + 0.25, max(low, -limit), min(high, limit), color=colors[name], lw=2)
            ax.plot(i + 0.25, entry["mean_percent"], "o", color=colors[name])
            for end in (low, high):
                if abs(end) > limit:
                    ax.annotate("", xy=(i + 0.25, math.copysign(limit, end)),
                                xytext=(i + 0.25, math.copysign(0.8 * limit, end)),
                                arrowprops={"arrowstyle": "->", "color": colors[name]})
    ax.set_ylim(-limit, limit)
    ax.set_xlim(-0.6, len(names) - 0.4)
    ax.set_xticks(range(len(names)), names, rotation=20, fontsize=8)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``zeropp accuracy`` options."""
    parser.add_argument("--out", default=None, help="default benchmarks/results/accuracy (with --pretrained: "
                        "benchmarks/results/accuracy_pretrained; with --model: zeropp-accuracy)")
    parser.add_argument("--runs", default=None, help="per-run directories (default runs/accuracy, with --pretrained "
                        "runs/accuracy_pretrained, with --model <out>/runs_work)")
    parser.add_argument("--seeds", type=lambda text: [int(k) for k in text.split(",")], default=None,
                        help=f"default {','.join(map(str, SEEDS))} (with --pretrained: "
                             f"{','.join(map(str, accuracy_pretrained.SEEDS))})")
    parser.add_argument("--corpora", type=lambda text: text.split(","), default=list(CORPORA),
                        help="the from-scratch grid's corpora (--pretrained takes --cells)")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"default {STEPS} (with --pretrained: the setting's 30; other steps only with --model)")
    parser.add_argument("--report-only", action="store_true", help="write the verdict of the runs found, train none")
    parser.add_argument("--pretrained", action="store_true",
                        help="the fine-tuning grid on SmolLM2-135M instead (zeropp.tools.bench.accuracy_pretrained; "
                             "--out defaults to benchmarks/results/accuracy_pretrained)")
    accuracy_pretrained.add_arguments(parser)
    parser.set_defaults(func=run_from_args)


def run_from_args(args: argparse.Namespace) -> int:
    """``zeropp accuracy``: the grid (or only its report)."""
    if args.pretrained:
        return accuracy_pretrained.run_from_args(args)
    out = args.out or "benchmarks/results/accuracy"
    if args.report_only:
        result = report(out)
    else:
        result = run(out, corpora=args.corpora, seeds=args.seeds or SEEDS, steps=args.steps or STEPS,
                     runs_dir=args.runs or "runs/accuracy")
    print(summary_table(result) + "\n\n" + table(result))
    return 0

