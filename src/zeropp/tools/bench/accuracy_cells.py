"""The verdict over cells ([Note: cells] in ``zeropp.tools.bench.accuracy_pretrained``): the worst
cell, each cell's statement (the default beside the lowest upper end found there) and the
recommendation over the cells, from the rows ``accuracy_pretrained.cell_rows`` measures; as JSON
and markdown. Pure functions of the rows: no run, no process group."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

CONTROL = "zero3_order"
"""The control's mode: ZeRO-3 with its gradient sums in another fp32 order, never a config."""


def upper_end(row: dict[str, Any]) -> float | None:
    """A row's 95% upper end (its mean where it has one pair; None without one)."""
    if row["ci95_percent"] is not None:
        return row["ci95_percent"][1]
    return row["mean_delta_percent"]


def worst(rows: Sequence[dict[str, Any]], mode: str = "all") -> dict[str, Any] | None:
    """The cell where ``mode`` costs most ([Note: cells]): the largest upper end."""
    measured = [row for row in rows if row["mode"] == mode and upper_end(row) is not None]
    return max(measured, key=upper_end, default=None)


def per_cell(rows: Sequence[dict[str, Any]], tolerance: float, default: str = "all") -> list[dict[str, Any]]:
    """Per cell: the default's verdict, whether its 95% upper end is within ``tolerance``, and the
    config with the lowest upper end found there (two pairs or more; fewer bytes break a tie), with
    its gap over the tolerance: the statement a cell owes where the default is not within."""
    cells = []
    for cell in dict.fromkeys(row["cell"] for row in rows):
        mine = [row for row in rows if row["cell"] == cell and row["mode"] != CONTROL]
        mode_row = next((row for row in mine if row["mode"] == default), None)
        judged = [row for row in mine if row["ci95_percent"] is not None]
        best = min(judged, key=lambda row: (row["ci95_percent"][1], row["cross_node_mb_per_step"] or 0.0),
                   default=None)
        default_end = None if mode_row is None or mode_row["ci95_percent"] is None else mode_row["ci95_percent"][1]
        cells.append({
            "cell": cell, "default": default, "default_pairs": 0 if mode_row is None else mode_row["pairs"],
            "default_mean_percent": None if mode_row is None else mode_row["mean_delta_percent"],
            "default_ci95_percent": None if mode_row is None else mode_row["ci95_percent"],
            "default_within": None if default_end is None else default_end <= tolerance,
            "best": None if best is None else best["mode"],
            "best_pairs": None if best is None else best["pairs"],
            "best_mean_percent": None if best is None else best["mean_delta_percent"],
            "best_ci95_percent": None if best is None else best["ci95_percent"],
            "best_cross_node_mb_per_step": None if best is None else best["cross_node_mb_per_step"],
            "best_gap_points": None if best is None else max(0.0, best["ci95_percent"][1] - tolerance),
        })
    return cells


def cells_table(cells: Sequence[dict[str, Any]], tolerance: float) -> str:
    """Markdown: per cell, the default's verdict and the lowest upper end found."""
    lines = [f"| cell | the default (pairs) | within {tolerance}% | lowest upper end found (pairs) "
             "| its cross-node MB/step | its gap over the tolerance |", "|---|---|---|---|---:|---:|"]
    for cell in cells:
        within = {None: "no interval", True: "yes", False: "no"}[cell["default_within"]]
        best = "—" if cell["best"] is None else (
            f"{cell['best']}: {_percent(cell['best_mean_percent'])} {_interval(cell['best_ci95_percent'])} "
            f"({cell['best_pairs']})")
        mb, gap = cell["best_cross_node_mb_per_step"], cell["best_gap_points"]
        gap_text = "—" if gap is None else "none" if gap == 0 else f"{gap:.2f} points"
        lines.append(f"| {cell['cell']} | {_percent(cell['default_mean_percent'])} "
                     f"{_interval(cell['default_ci95_percent'])} ({cell['default_pairs']}) | {within} | {best} "
                     f"| {'—' if mb is None else f'{mb:.1f}'} | {gap_text} |")
    return "\n".join(lines)


def recommend(rows: Sequence[dict[str, Any]], tolerance: float) -> dict[str, Any]:
    """Of the configs whose 95% upper end is under ``tolerance`` percent in every cell with an
    interval, and whose mean is under it in every cell of one pair, the one with an interval in the
    most cells, then the fewest cross-node bytes per step ([Note: your own data] in
    ``zeropp.tools.bench.accuracy_pretrained``)."""
    configs = dict.fromkeys(row["mode"] for row in rows if row["mode"] != CONTROL)
    judged = []
    for mode in configs:
        mine = [row for row in rows if row["mode"] == mode]
        ends = [row["ci95_percent"][1] for row in mine if row["ci95_percent"] is not None]
        singles = [row.get("mean_delta_percent") for row in mine if row["ci95_percent"] is None]
        prices = [row["cross_node_mb_per_step"] for row in mine]
        bytes_ = None if None in prices else max(prices)  # a budget's widened units differ by cell
        judged.append({"mode": mode, "upper_end_percent": max(ends, default=None),
                       "one_pair_mean_percent": max((m for m in singles if m is not None), default=None),
                       "cross_node_mb_per_step": bytes_, "cells": len(mine), "cells_with_interval": len(ends)})
    within = [j for j in judged if j["upper_end_percent"] is not None and j["upper_end_percent"] <= tolerance
              and (j["one_pair_mean_percent"] is None or j["one_pair_mean_percent"] <= tolerance)]
    within.sort(key=lambda j: (-j["cells_with_interval"], j["cross_node_mb_per_step"] is None,
                               j["cross_node_mb_per_step"] or 0.0))
    if within:
        best = within[0]
        cells = len({row["cell"] for row in rows})
        where = (f" in the {best['cells_with_interval']} of {cells} cells with an interval"
                 if best["cells_with_interval"] < cells else "")
        reason = (f"{best['mode']}: 95% upper end {best['upper_end_percent']:+.2f}% <= {tolerance}%{where}, "
                  + (f"{best['cross_node_mb_per_step']:.1f} MB across nodes per step, the fewest of those within "
                     "in as many cells"
                     if best['cross_node_mb_per_step'] is not None else "the first within"))
        return {"recommended": best["mode"], "tolerance_percent": tolerance, "reason": reason, "configs": judged}
    measured = [j for j in judged if j["upper_end_percent"] is not None]
    if not measured:
        reason = "no config has two seed pairs yet: run more seeds (--seeds) for an interval"
    else:
        def highest(judgement: dict[str, Any]) -> float:  # what rules it out: an upper end or a pair's mean
            return max(v for v in (judgement["upper_end_percent"], judgement["one_pair_mean_percent"]) if v is not None)

        closest = min(measured, key=highest)
        single = closest["one_pair_mean_percent"]
        figures = f"95% upper end {closest['upper_end_percent']:+.2f}%" + (
            f", one pair's mean {single:+.2f}% where a cell has one" if single is not None else "")
        reason = (f"no config is under {tolerance}% in every cell it ran in: the closest is {closest['mode']} "
                  f"({figures}; over by {highest(closest) - tolerance:.2f} points); keep ZeRO-3 for this data, "
                  "or run more seeds if the interval is wide")
    return {"recommended": None, "tolerance_percent": tolerance, "reason": reason, "configs": judged}


def summary_text(result: dict[str, Any]) -> str:
    """The table over the cells, then the worst cell and the recommendation."""
    tolerance = result["recommendation"]["tolerance_percent"]
    lines = [table(result["rows"]), "", cells_table(result["cells"], tolerance), ""]
    if result["worst"] is not None:
        row = result["worst"]
        lines.append(f"worst cell for all three: {row['cell']}, {_percent(row['mean_delta_percent'])} "
                     f"{_interval(row['ci95_percent'])} over {row['pairs']} pair(s)")
    lines.append(f"recommendation (tolerance {tolerance}%): "
                 f"{result['recommendation']['reason']}")
    return "\n".join(lines)


def _interval(interval: list[float] | None) -> str:
    return "—" if interval is None else f"[{interval[0]:+.2f}, {interval[1]:+.2f}]"


def _percent(value: float | None) -> str:
    return "—" if value is None else f"{value:+.2f}%"


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: per cell and mode, its delta against ZeRO-3 beside the control's, on the same seeds."""
    lines = ["| cell | ZeRO-3's held-out fall | mode | pairs | Δ val loss vs ZeRO-3 (full precision) | 95% interval "
             "| control Δ | control 95% interval | Δ through the gathers | cross-node MB/step |",
             "|---|---:|---|---:|---:|---|---:|---|---:|---:|"]
    for row in rows:
        fall = "—" if row["zero3_held_out_fall_percent"] is None else f"{row['zero3_held_out_fall_percent']:.1f}%"
        mb = "—" if row["cross_node_mb_per_step"] is None else f"{row['cross_node_mb_per_step']:.1f}"
        lines.append(
            f"| {row['cell']} | {fall} | {row['mode']} | {row['pairs']} | {_percent(row['mean_delta_percent'])} "
            f"| {_interval(row['ci95_percent'])} | {_percent(row['control_mean_delta_percent'])} "
            f"| {_interval(row['control_ci95_percent'])} | {_percent(row['gathered_mean_delta_percent'])} | {mb} |")
    return "\n".join(lines)
