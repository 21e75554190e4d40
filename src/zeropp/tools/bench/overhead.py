"""``zeropp bench overhead``: what each ZeRO++ technique costs where the network costs nothing.

On one machine with no link limit ZeRO++ can only lose: its codecs, extra hops and secondary
copies are work that a fast network does not pay back. This benchmark measures that cost, the
fixed cost per collective above all, which small units (norms, biases, small models) feel most.
For three GPTs (the demo model, a 6-layer x 96-wide one and the 25M-parameter benchmark model)
one job on 2 x 2 local ranks (no emulated links) trains ZeRO-3 and each technique in turns, step
by step, and then times single calls of one transformer block's comms: qwZ's quantized
all-gather and qgZ's reduce-scatter against the plain collectives of the same unit. Ratios are
against ZeRO-3 in the same job. Results: ``bench_overhead.json`` and ``.png``.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from zeropp.tools.bench.quant import _machine as machine_info
from zeropp.tools.bench.worker import WorkerConfig
from zeropp.tools.cluster.launch import launch_local
from zeropp.tools.modes import BASELINE

NUM_NODES, RANKS_PER_NODE = 2, 2
MODES = (BASELINE, "qwz", "hpz", "qgz", "all")
MODELS = {
    "demo": WorkerConfig(num_layers=4, embed_dim=128, num_heads=4, batch_size=32, param_dtype="float32",
                         warmup_steps=3, steps=30),
    "gpt_6x96": WorkerConfig(num_layers=6, embed_dim=96, num_heads=4, batch_size=32, param_dtype="float32",
                             warmup_steps=3, steps=30),
    "gpt_25m": WorkerConfig(param_dtype="float32", warmup_steps=1, steps=6),
}
"""The models: the demo GPT as ``make demo`` trains it (fp32), a deeper narrower one, and the
benchmark GPT of ``zeropp bench step``, all in fp32 (bf16 matmuls are slow on CPUs without
AVX-512 BF16, which would hide the communication)."""
TARGETS = {"demo": 1.10, "gpt_6x96": 1.10, "gpt_25m": 1.00}
"""Step time of all three techniques / ZeRO-3's, no network limit."""
TARGET_UNIT_ALL_GATHER = 2.0
"""A quantized all-gather of a demo unit / the plain all-gather of the same unit."""
UNIT_COMM_CALLS = 40


def run_model(name: str, config: WorkerConfig) -> dict[str, Any]:
    """One job of ``config`` on local ranks; the worker's record."""
    with tempfile.TemporaryDirectory(prefix="zeropp-overhead-") as folder:
        out = Path(folder) / "record.json"
        code = launch_local("zeropp.tools.bench.worker", ["--out", str(out), *config.worker_args()],
                            NUM_NODES, RANKS_PER_NODE)
        if code != 0 or not out.exists():
            raise RuntimeError(f"the overhead job for model {name!r} failed (exit {code})")
        return json.loads(out.read_text())


def model_row(name: str, record: dict[str, Any]) -> dict[str, Any]:
    baseline = record["modes"][BASELINE]["median_step_s"]
    return {
        "model": name,
        "num_parameters": record["num_parameters"],
        "median_step_s": {mode: r["median_step_s"] for mode, r in record["modes"].items()},
        "ratio_vs_zero3": {mode: r["median_step_s"] / baseline for mode, r in record["modes"].items()},
        "target_all": TARGETS.get(name),
        "unit_comms": record["unit_comms"],
    }


def format_table(rows: list[dict[str, Any]]) -> str:
    modes = list(rows[0]["ratio_vs_zero3"])
    lines = ["step time / ZeRO-3's, same job, no network limit (2 x 2 local ranks)",
             f"{'model':<10}{'params':>9}{'zero3 s':>9}" + "".join(f"{m:>8}" for m in modes if m != BASELINE)
             + f"{'target':>8}"]
    for r in rows:
        lines.append(f"{r['model']:<10}{r['num_parameters'] / 1e6:>8.2f}M{r['median_step_s'][BASELINE]:>9.3f}"
                     + "".join(f"{r['ratio_vs_zero3'][m]:>8.3f}" for m in modes if m != BASELINE)
                     + f"{r['target_all']:>8.2f}")
    lines += ["", "one call on one transformer block's unit (median of the slowest rank, ms)",
              f"{'model':<10}{'chunk':>8}{'dtype':>10}{'plain AG':>10}{'qwZ AG':>9}{'x':>7}"
              f"{'plain RS':>10}{'qgZ RS':>9}{'x':>7}"]
    for r in rows:
        u, ms = r["unit_comms"], {k: v * 1e3 for k, v in r["unit_comms"]["median_s"].items()}
        lines.append(f"{r['model']:<10}{u['chunk_numel']:>8}{u['gather_dtype']:>10}{ms['plain_all_gather']:>10.2f}"
                     f"{ms['qwz_all_gather']:>9.2f}{u['all_gather_ratio']:>7.2f}{ms['plain_reduce_scatter']:>10.2f}"
                     f"{ms['qgz_reduce_scatter']:>9.2f}{u['reduce_scatter_ratio']:>7.2f}")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """Step-time ratio per model and mode, with the targets of all three; unit comm ratios."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in rows[0]["ratio_vs_zero3"] if m != BASELINE]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [2, 1]})
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        xs = [m + (i - (len(modes) - 1) / 2) * width for m in range(len(rows))]
        left.bar(xs, [r["ratio_vs_zero3"][mode] for r in rows], width, label=mode, color=f"C{i}")
    for m, r in enumerate(rows):
        left.plot([m - 0.45, m + 0.45], [r["target_all"]] * 2, "k--", lw=1)
    left.axhline(1.0, color="black", lw=0.8)
    left.set_xticks(range(len(rows)), [f"{r['model']}\n{r['num_parameters'] / 1e6:.2f}M" for r in rows])
    left.set_ylabel("median step time / ZeRO-3's (same job)")
    left.legend(ncol=4, fontsize=8)
    xs = range(len(rows))
    right.bar([x - 0.2 for x in xs], [r["unit_comms"]["all_gather_ratio"] for r in rows], 0.4, label="qwZ all-gather")
    right.bar([x + 0.2 for x in xs], [r["unit_comms"]["reduce_scatter_ratio"] for r in rows], 0.4,
              label="qgZ reduce-scatter")
    right.axhline(TARGET_UNIT_ALL_GATHER, color="black", ls="--", lw=1)
    right.set_xticks(list(xs), [r["model"] for r in rows])
    right.set_ylabel("one call / the plain collective (one block's unit)")
    right.legend(fontsize=8)
    for ax in (left, right):
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"ZeRO++ overhead with no network limit, {NUM_NODES} x {RANKS_PER_NODE} local CPU ranks (gloo)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(out_dir: str = "benchmarks/results", models: tuple[str, ...] = tuple(MODELS), quick: bool = False
        ) -> dict[str, Any]:
    """Measure every model, print the table, write ``bench_overhead.json`` and ``.png``.
    ``quick``: two timed steps and a few calls per model (a smoke run)."""
    unknown = sorted(set(models) - MODELS.keys())
    if unknown:
        raise ValueError(f"unknown models {unknown}; allowed: {list(MODELS)}")
    started, rows, configs = time.perf_counter(), [], {}
    for name in models:
        config = replace(MODELS[name], modes=MODES, unit_comm_calls=3 if quick else UNIT_COMM_CALLS,
                         **({"warmup_steps": 1, "steps": 2} if quick else {}))
        configs[name] = asdict(config)
        rows.append(model_row(name, run_model(name, config)))
        print(format_table(rows[-1:]), flush=True)
    result = {
        "machine": machine_info(torch.device("cpu")),
        "config": {"num_nodes": NUM_NODES, "ranks_per_node": RANKS_PER_NODE, "bandwidth": "unlimited (local)",
                   "models": configs, "elapsed_s": time.perf_counter() - started},
        "targets": {"all_vs_zero3": TARGETS, "unit_all_gather_vs_plain": TARGET_UNIT_ALL_GATHER},
        "records": rows,
    }
    print("\n" + format_table(rows))
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "bench_overhead.json")
    with open(path, "w") as file:
        json.dump(result, file, indent=2)
    plot(rows, os.path.join(out_dir, "bench_overhead.png"))
    print(f"\nwrote {path} and bench_overhead.png")
    return result
