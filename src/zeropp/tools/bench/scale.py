"""``zeropp bench scale``: one real rank of a 64- to 4,096-rank job, on this CPU.

Each run is one process on PyTorch's fake process group ([Note: one real rank of a large job] in
``zeropp.tools.bench.scale_rank``): a rank of W ranks, 8 to a node, sets up Llama-3-8B's shapes under
a mode and, for the step runs, trains two steps. Per run: set-up time, the process groups this
rank belongs to and the ``new_group`` calls every rank makes, this rank's shards (which are
empty), the step's peak memory measured by FSDP2's memory tracker beside ``zeropp plan``'s
prediction for the same rank (``zeropp.tools.plan.memory``), the time of one step and how much of it
runs in zeropp's own frames (cProfile). Runs:

- the full model (32 layers), set-up and optimizer state only (no step), every mode at rank 0;
- a slice of it (2 layers, the real embedding, norm and head) that trains: every mode at rank 0,
  and all three techniques at the last rank, a middle one and the first rank whose shard of
  some parameter is empty (where one is).

Step times are one CPU rank's (no byte moves), taken on whatever machine runs this: compare them
across world sizes within one run. Results: ``bench_scale.json``, ``bench_scale.png``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from zeropp.setup.topology import Topology
from zeropp.tools.bench.quant import _machine as machine_info
from zeropp.tools.bench.scale_rank import FULL_LAYERS, RunConfig, build_meta_llama
from zeropp.tools.modes import MODES, check_modes, zeropp_modes

WORLD_SIZES = (64, 384, 1024, 4096)
SCALE_MODES = ("zero3", "qwz", "hpz", "qgz", "all")
SLICE_LAYERS = 2
POSITION_MODE = "all"
"""The mode trained at every rank position; the others train at rank 0."""
QUICK = {"model": "narrow", "world_sizes": (384, 1024), "modes": ("zero3", "all")}
RUN_TIMEOUT_S = 1800
TOLERANCE = 0.10
"""Predicted peak memory within 10% of the measured one."""


def model_shape(model: str, num_layers: int) -> Any:
    """``zeropp.tools.plan``'s view of the benchmark's Llama with ``num_layers`` layers, in its units."""
    from zeropp.tools.plan.model import hf_module

    llama, units = build_meta_llama(model, num_layers)
    return hf_module(llama, units, name=f"{model} ({num_layers} layers)")


def first_empty_rank(shape: Any, world_size: int) -> int | None:
    """The lowest rank whose shard of some parameter is empty: FSDP2 splits dim 0 in chunks of
    ceil(rows / W), so only ceil(rows / chunk) ranks hold rows."""
    holding = [math.ceil(s[0] / math.ceil(s[0] / world_size)) for unit in shape.units for s in unit.shapes]
    first = min(holding, default=world_size)
    return first if first < world_size else None


def rank_positions(shape: Any, world_size: int) -> dict[str, int]:
    """Rank 0, a middle rank, the last, and the first with an empty shard (where there is one)."""
    positions = {"first": 0, "middle": world_size // 2 + 3, "last": world_size - 1}
    empty = first_empty_rank(shape, world_size)
    if empty is not None:
        positions["empty"] = empty
    return positions


@dataclass(frozen=True)
class Plan:
    """What one ``zeropp bench scale`` measures."""

    model: str = "llama3-8b"
    world_sizes: tuple[int, ...] = WORLD_SIZES
    modes: tuple[str, ...] = SCALE_MODES
    slice_layers: int = SLICE_LAYERS
    full: bool = True
    """Also set up the full model (no step)."""

    def runs(self) -> list[tuple[str, RunConfig]]:
        """(rank position, run) of every run, full model first."""
        shape = model_shape(self.model, self.slice_layers)
        out = []
        for world_size in self.world_sizes:
            if self.full:
                out += [("first", RunConfig(world_size=world_size, rank=0, mode=mode, model=self.model,
                                            num_layers=FULL_LAYERS[self.model], step=False)) for mode in self.modes]
            for position, rank in rank_positions(shape, world_size).items():
                modes = self.modes if position == "first" else (POSITION_MODE,) if POSITION_MODE in self.modes else ()
                out += [(position, RunConfig(world_size=world_size, rank=rank, mode=mode, model=self.model,
                                             num_layers=self.slice_layers)) for mode in modes]
        return out


def launch(config: RunConfig) -> dict[str, Any]:
    """Run ``config`` in a process of its own; its record, or the error it died with."""
    with tempfile.TemporaryDirectory(prefix="zeropp-scale-") as folder:
        out = Path(folder) / "record.json"
        command = [sys.executable, "-m", "zeropp.tools.bench.scale_rank", "--world-size", str(config.world_size),
                   "--rank", str(config.rank), "--mode", config.mode, "--model", config.model,
                   "--layers", str(config.num_layers), "--context-length", str(config.context_length),
                   "--device", config.device, "--timed-steps", str(config.timed_steps),
                   "--out", str(out), *(["--step"] if config.step else [])]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        started = time.perf_counter()
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return {"config": asdict(config), "error": f"timed out after {RUN_TIMEOUT_S} s"}
        if done.returncode != 0 or not out.exists():
            last = done.stderr.strip().splitlines()[-1:]
            return {"config": asdict(config), "error": last[0] if last else f"exit {done.returncode}"}
        return {**json.loads(out.read_text()), "process_s": time.perf_counter() - started}


def predicted(shape: Any, config: RunConfig) -> Any:
    """``zeropp plan``'s peak memory of the run's rank (bf16 gathers, fp32 reduction)."""
    from zeropp.tools.plan.memory import rank_memory
    from zeropp.tools.plan.traffic import Precision

    topology = Topology.from_world(config.world_size, config.ranks_per_node)
    mode = MODES[config.mode].config(config.ranks_per_node)
    precision = Precision(gather_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return rank_memory(shape, mode, topology, precision, config.batch_size, config.context_length, config.rank)


def row(position: str, record: dict[str, Any], shapes: dict[int, Any]) -> dict[str, Any]:
    """One result: the record's figures and the prediction of the same rank."""
    config = RunConfig(**record["config"])
    out = {"world_size": config.world_size, "rank": config.rank, "position": position, "mode": config.mode,
           "layers": config.num_layers, "step": config.step, "ran": "error" not in record, **record}
    if "error" in record:
        return out
    plan = predicted(shapes[config.num_layers], config)
    out["predicted"] = {**asdict(plan), "total": plan.total}
    out["predicted_sharded"] = {"parameters": plan.parameters, "optimizer": plan.optimizer}
    if config.step:
        out["predicted_over_measured"] = plan.total / record["peak_bytes"]
    return out


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    mib = 2 ** 20
    lines = [f"{'W':>5} {'rank':>11} {'mode':<6}{'layers':>7}{'set-up s':>9}{'groups':>7}{'new_group':>10}"
             f"{'empty':>6}{'peak MiB':>10}{'plan MiB':>10}{'plan/meas':>10}{'step s':>8}{'zeropp s':>9}"
             f"{'share':>7}{'C codec s':>10}"]
    for r in rows:
        head = f"{r['world_size']:>5} {r['position'] + ' ' + str(r['rank']):>11} {r['mode']:<6}{r['layers']:>7}"
        if not r["ran"]:
            lines.append(f"{head}  FAILED: {r['error']}")
            continue
        setup = (f"{r['setup_s']:>9.2f}{r['process_groups']:>7}{r['new_group_calls']:>10}"
                 f"{len(r['layout']['empty']):>6}")
        if not r["step"]:
            state = (r["sharded_bytes"]["parameters"] + r["sharded_bytes"]["optimizer"]) / mib
            plan = (r["predicted_sharded"]["parameters"] + r["predicted_sharded"]["optimizer"]) / mib
            lines.append(f"{head}{setup}{state:>10.0f}{plan:>10.0f}{plan / state:>10.3f}   (set-up: sharded state)")
            continue
        share = r["zeropp_python_s"] / r["step_s"]
        lines.append(f"{head}{setup}{r['peak_bytes'] / mib:>10.0f}{r['predicted']['total'] / mib:>10.0f}"
                     f"{r['predicted_over_measured']:>10.3f}{r['step_s']:>8.2f}{r['zeropp_python_s']:>9.3f}"
                     f"{share:>7.1%}{r['zeropp_native_s']:>10.2f}")
    return "\n".join(lines)


def plot(rows: Sequence[dict[str, Any]], path: str) -> None:
    """Groups against world size (slice and full model), predicted / measured peak memory, and
    zeropp's share of a step, per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in rows if r["ran"]]
    modes = list(dict.fromkeys(r["mode"] for r in ran))
    fig, (groups, ratio, share) = plt.subplots(1, 3, figsize=(16, 4.5))
    for i, mode in enumerate(modes):
        for layers, style in sorted({(r["layers"], "-" if r["step"] else "--") for r in ran}):
            points = sorted((r["world_size"], r["new_group_calls"]) for r in ran
                            if r["mode"] == mode and r["layers"] == layers and r["rank"] == 0)
            groups.plot(*zip(*points), style, color=f"C{i}", marker="o", label=f"{mode}, {layers} layers")
        steps = [r for r in ran if r["mode"] == mode and r["step"]]
        ratio.scatter([r["world_size"] for r in steps], [r["predicted_over_measured"] for r in steps], color=f"C{i}",
                      label=mode)
        first = sorted((r["world_size"], r["zeropp_python_s"] / r["step_s"]) for r in steps if r["rank"] == 0)
        share.plot(*zip(*first), color=f"C{i}", marker="o", label=mode)
    groups.set_yscale("log")
    groups.set_ylabel("new_group calls at set-up (every rank makes them)")
    ratio.axhspan(1 - TOLERANCE, 1 + TOLERANCE, color="green", alpha=0.1)
    ratio.set_ylabel("peak memory: zeropp plan / measured")
    share.set_ylabel("zeropp's own time / step (rank 0)")
    for ax in (groups, ratio, share):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["world_size"] for r in ran}), [str(w) for w in sorted({r["world_size"] for r in ran})])
        ax.set_xlabel("world size (8 ranks per node)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("one real rank of a large job (fake process group), Llama shapes, CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(out_dir: str = "benchmarks/results", quick: bool = False, world_sizes: Sequence[int] | None = None,
        modes: Sequence[str] | None = None, full: bool = True, name: str = "bench_scale") -> dict[str, Any]:
    """Measure every run of the plan, print the table, write ``<name>.json`` and ``.png``.
    ``quick``: the narrow Llama at 384 and 1,024 ranks, ZeRO-3 and all three (seconds per run)."""
    plan = Plan(**QUICK) if quick else Plan()
    plan = replace(plan, full=full, **({"world_sizes": tuple(world_sizes)} if world_sizes else {}),
                   **({"modes": tuple(modes)} if modes else {}))
    check_modes(plan.modes, zeropp_modes())
    shapes = {layers: model_shape(plan.model, layers) for layers in (plan.slice_layers, FULL_LAYERS[plan.model])}
    started, rows = time.perf_counter(), []
    for position, config in plan.runs():
        rows.append(row(position, launch(config), shapes))
        print(format_table(rows[-1:]).splitlines()[-1] if rows[1:] else format_table(rows), flush=True)
    result = {"date": time.strftime("%Y-%m-%d"), "machine": machine_info(torch.device("cpu")),
              "config": {**asdict(plan), "ranks_per_node": RunConfig.ranks_per_node, "tolerance": TOLERANCE,
                         "elapsed_s": time.perf_counter() - started, "precision": "bf16 gathers, fp32 reduction",
                         "tokens_per_step": RunConfig.batch_size * RunConfig.context_length},
              "records": rows}
    print("\n" + format_table(rows))
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w") as file:
        json.dump(result, file, indent=1)
    plot(rows, os.path.join(out_dir, f"{name}.png"))
    print(f"\nwrote {path} and {name}.png")
    return result
