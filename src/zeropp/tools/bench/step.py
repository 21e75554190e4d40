"""``zeropp bench step``: training-step time of every mode at several inter-node bandwidths.

On a 2-node x 2-rank emulated cluster, at each bandwidth one job trains every mode (plain FSDP2,
FSDP2 HSDP, zeropp's qwZ, hpZ, qgZ and all three) in turns, step by step (see the worker), so the
ratios against plain FSDP2 compare steps taken under the same load of a shared machine. Peak RSS
is a process-wide figure, so each mode's comes from a job of its own (one step, unlimited links:
the link rate does not change what a rank holds). Results: ``bench_step.json`` (one record per
mode x bandwidth) and ``bench_step.png``.

DeepSpeed ZeRO-3, the seed system's own baseline, is an optional peer (mode ``deepspeed``): it
trains beside the others when DeepSpeed is installed, and the JSON says why not otherwise. Its
ZeRO++ quantizer kernels are CUDA-only, so on CPU it runs plain ZeRO-3.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from typing import Any

import torch

from zeropp.tools.bench.comm import (
    NUM_NODES,
    QUICK_MODEL,
    RANKS_PER_NODE,
    exclusive_cluster,
    launch_worker,
    machine_info,
    run_each_mode,
)
from zeropp.tools.bench.worker import BENCH_MODES, WorkerConfig
from zeropp.tools.modes import BASELINE, MODES, System

BANDWIDTHS = ("unlimited", "1gbit", "100mbit")
TIMED_STEPS = {"unlimited": 4, "1gbit": 4, "100mbit": 3}
"""Timed steps per mode: a plain FSDP2 step of the 25M model takes ~20 s at 100 Mbit/s."""
TARGET_RATIO = {"unlimited": 1.15, "100mbit": 0.45}
"""The targets for zeropp with all three techniques, as step time / plain FSDP2's (drawn on the plot)."""


def deepspeed_available() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def deepspeed_status(modes: Sequence[str], param_dtype: str) -> str:
    """What the results say about DeepSpeed ZeRO-3, the optional peer."""
    peers = [mode for mode in modes if MODES[mode].system is System.DEEPSPEED]
    if peers:
        from importlib.metadata import version

        return (f"DeepSpeed {version('deepspeed')} ZeRO-3 (DS_ACCELERATOR=cpu, gloo), modes {peers}: "
                f"{param_dtype} gathers, fp32 gradient reduction, no clipping, each mode's "
                f"zero_optimization options (zeropp.modes), its own defaults otherwise; its collectives "
                f"bypass zeropp's ledger (wire bytes only). Its hpZ (zero_hpz_partition_size) runs on "
                f"CPU; its quantized gathers and gradients (zero_quantized_weights, "
                f"zero_quantized_gradients) need CUDA quantizer kernels, so they are not run here")
    if not deepspeed_available():
        return ("not installed (optional: DS_BUILD_OPS=0 pip install --no-build-isolation "
                "deepspeed==0.19.8); not measured")
    return "installed but not among the modes asked for; not measured"


def ledger_totals(ledger: list[dict[str, Any]] | None) -> dict[str, int | None]:
    """A mode's per-step ledger bytes over all ranks: cross-node (backend figure and direct
    sends) and intra-node (backend figure); all None for a peer system, whose collectives
    bypass the ledger."""
    if ledger is None:
        return dict.fromkeys(("cross_node_backend", "cross_node_direct", "intra_node_backend"))
    total = {count: sum(r["total"][count] for r in ledger)
             for count in ("backend_cross_node_bytes", "cross_node_bytes", "backend_bytes")}
    return {"cross_node_backend": total["backend_cross_node_bytes"],
            "cross_node_direct": total["cross_node_bytes"],
            "intra_node_backend": total["backend_bytes"] - total["backend_cross_node_bytes"]}


def mode_rows(record: dict[str, Any], bandwidth: str, memory: dict[str, dict[str, Any]] | None
              ) -> list[dict[str, Any]]:
    """One result row per mode of a job at ``bandwidth``: time, ratio, bytes, memory."""
    baseline = record["modes"][BASELINE]["median_step_s"] if BASELINE in record["modes"] else None
    rows = []
    for mode, result in record["modes"].items():
        ledger = ledger_totals(result["ledger_per_step"])
        rss = memory[mode]["peak_rss_mb"] if memory else record["peak_rss_mb"]
        rows.append({
            "mode": mode,
            "bandwidth": bandwidth,
            "median_step_s": result["median_step_s"],
            "ratio_vs_zero3": result["median_step_s"] / baseline if baseline else None,
            "cross_node_bytes_ledger": ledger["cross_node_backend"],
            "cross_node_bytes_direct": ledger["cross_node_direct"],
            "cross_node_bytes_wire": result["wire_per_step"]["cross_node_bytes"],
            "peak_rss_mb": max(rss),
            "peak_rss_mb_per_rank": rss,
            "peak_rss_source": "own job (1 step, unlimited)" if memory else "the job of all modes",
            "intra_node_bytes_ledger": ledger["intra_node_backend"],
            "intra_node_bytes_wire": result["wire_per_step"]["intra_node_bytes"],
            "secondary_copy_bytes": max(result["secondary_copy_bytes"]),
            "step_times_s": result["step_times_s"],
            "losses": result["losses"],
        })
    return rows


def add_floors(rows: list[dict[str, Any]], num_nodes: int) -> None:
    """Each limited row's floor: the longer of the same mode's step with no limit (its compute
    and codec work) and its cross-node wire bytes over the nodes' links at the rate (each node's
    link carries its own sends, one direction: total / nodes / rate), and the step over it. A
    step at its floor keeps the link or the CPU busy throughout."""
    from zeropp.tools.cluster.netns import parse_bandwidth

    free = {r["mode"]: r["median_step_s"] for r in rows if parse_bandwidth(r["bandwidth"]) is None}
    for r in rows:
        rate = parse_bandwidth(r["bandwidth"])
        if rate is None or r["mode"] not in free:
            r["floor_s"] = r["over_floor"] = None
            continue
        r["floor_s"] = max(free[r["mode"]], r["cross_node_bytes_wire"] / num_nodes / (rate / 8))
        r["over_floor"] = r["median_step_s"] / r["floor_s"]


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'bandwidth':<10}{'mode':<16}{'median s':>9}{'x zero3':>8}{'x-node MB ledger':>17}"
            f"{'wire':>8}{'wire x zero3':>13}{'peak RSS MB':>12}{'x floor':>8}")
    lines = ["per training step, all ranks together (wire: inter-node link frames)", head]
    wire_zero3 = {r["bandwidth"]: r["cross_node_bytes_wire"] for r in rows if r["mode"] == BASELINE}
    for r in rows:
        ratio = f"{r['ratio_vs_zero3']:.3f}" if r["ratio_vs_zero3"] is not None else "n/a"
        wire_ratio = r["cross_node_bytes_wire"] / wire_zero3[r["bandwidth"]] if r["bandwidth"] in wire_zero3 else None
        ledger = f"{r['cross_node_bytes_ledger'] / 1e6:.1f}" if r["cross_node_bytes_ledger"] is not None else "n/a"
        floor = f"{r['over_floor']:.2f}" if r.get("over_floor") is not None else ""
        lines.append(f"{r['bandwidth']:<10}{r['mode']:<16}{r['median_step_s']:>9.2f}{ratio:>8}"
                     f"{ledger:>17}{r['cross_node_bytes_wire'] / 1e6:>8.1f}"
                     f"{wire_ratio if wire_ratio is not None else float('nan'):>13.3f}{r['peak_rss_mb']:>12.0f}"
                     f"{floor:>8}")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """Step time relative to plain FSDP2, and cross-node wire bytes, per bandwidth and mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bandwidths = list(dict.fromkeys(r["bandwidth"] for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    by_key = {(r["bandwidth"], r["mode"]): r for r in rows}
    width = 0.8 / len(modes)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, mode in enumerate(modes):
        xs = [b + (i - (len(modes) - 1) / 2) * width for b in range(len(bandwidths))]
        ratios = [by_key[(bw, mode)]["ratio_vs_zero3"] or 0 for bw in bandwidths]
        wire = [by_key[(bw, mode)]["cross_node_bytes_wire"] / 1e6 for bw in bandwidths]
        left.bar(xs, ratios, width, label=mode, color=f"C{i}")
        right.bar(xs, wire, width, label=mode, color=f"C{i}")
    left.axhline(1.0, color="black", lw=0.8)
    for b, bandwidth in enumerate(bandwidths):  # the targets for zeropp with all three
        target = TARGET_RATIO.get(bandwidth)
        if target is not None:
            left.plot([b - 0.45, b + 0.45], [target, target], "k--", lw=1)
            left.annotate(f"target {target}", (b + 0.45, target), fontsize=7, ha="right", va="bottom")
    left.set_ylabel("median step time / plain FSDP2 (same run)")
    right.set_ylabel("cross-node bytes per step on the wire (MB, all links)")
    for ax in (left, right):
        ax.set_xticks(range(len(bandwidths)), [f"{bw}\nbetween nodes" for bw in bandwidths])
        ax.grid(axis="y", alpha=0.3)
    left.legend(ncol=3, fontsize=8)
    fig.suptitle(f"GPT training step, {NUM_NODES} nodes x {RANKS_PER_NODE} CPU ranks (gloo), emulated links")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


STEP_MODES = (*BENCH_MODES, "hsdp_quantized", "all_serial")
"""The worker's modes, and beside them quantized HSDP and all three without ``overlap`` (what
the default's overlap buys, measured in the same run)."""


def default_modes() -> tuple[str, ...]:
    """``STEP_MODES``, plus DeepSpeed ZeRO-3 where DeepSpeed is installed."""
    return STEP_MODES + (("deepspeed",) if deepspeed_available() else ())


def run(out_dir: str = "benchmarks/results", modes: Sequence[str] | None = None,
        bandwidths: Sequence[str] = BANDWIDTHS, warmup_steps: int = 1, steps: int | None = None,
        quick: bool = False, param_dtype: str = "bfloat16", model: dict[str, int] | None = None,
        memory_jobs: bool = True) -> dict[str, Any]:
    """Time every mode at every bandwidth, print the table, write bench_step.json and .png.

    ``steps``: timed steps per mode (default ``TIMED_STEPS`` per bandwidth). ``quick``: the
    0.43M-parameter model, one timed step, no separate memory jobs (a smoke run). ``modes``:
    default ``default_modes()``. ``param_dtype``: of compute and weight gathers ("float32" where
    the CPU has no fast bf16 matmul: without AVX-512 BF16/AMX a bf16 step is compute-bound).
    ``model``: ``WorkerConfig`` shape fields (``num_layers``, ``embed_dim``, ``num_heads``) in
    place of the 25M GPT's. ``memory_jobs`` False skips the per-mode peak-RSS jobs (the rows
    then carry the shared job's RSS).
    """
    modes = default_modes() if modes is None else tuple(modes)
    if BASELINE not in modes:
        raise ValueError(f"modes={list(modes)} must include 'zero3', the baseline of every ratio")
    base = WorkerConfig(modes=tuple(modes), warmup_steps=warmup_steps, wire=True, param_dtype=param_dtype,
                        **(QUICK_MODEL if quick else model or {}))
    started = time.perf_counter()
    memory = None if quick or not memory_jobs else run_each_mode(modes, replace(base, warmup_steps=0, steps=1))
    rows, jobs = [], {}
    for bandwidth in bandwidths:
        num_steps = 1 if quick else steps or TIMED_STEPS.get(bandwidth, 3)
        with exclusive_cluster(NUM_NODES, bandwidth):
            record, result = launch_worker(replace(base, steps=num_steps), NUM_NODES, RANKS_PER_NODE)
        rows += mode_rows(record, bandwidth, memory)
        jobs[bandwidth] = {"elapsed_s": result.elapsed_s, "peak_rss_mb": record["peak_rss_mb"], "steps": num_steps}
        print(format_table([r for r in rows if r["bandwidth"] == bandwidth]), flush=True)
    add_floors(rows, NUM_NODES)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine_info(torch.device("cpu")),
        "config": {**asdict(base), "num_nodes": NUM_NODES, "ranks_per_node": RANKS_PER_NODE,
                   "num_parameters": record["num_parameters"], "bandwidths": list(bandwidths),
                   "elapsed_s": time.perf_counter() - started},
        "deepspeed": deepspeed_status(modes, param_dtype),
        "jobs": jobs,
        "records": rows,
    }
    print("\n" + format_table(rows))
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "bench_step.json")
    with open(path, "w") as file:
        json.dump(result, file, indent=2)
    plot(rows, os.path.join(out_dir, "bench_step.png"))
    print(f"\nwrote {path} and bench_step.png")
    return result
