"""qwZ, hpZ and qgZ on NCCL: one rank per GPU, every GPU of this machine.

NCCL runs one rank per GPU, so this section needs two GPUs at least (the runner skips it,
saying so, with fewer). With 4 or more (an even number) the ranks are declared 2 nodes, so
qgZ's two hops and hpZ's node-local copy both run; with 2 or 3, one node. Each mode trains the
same GPT from the same weights on the same batches: every loss finite, the last below the
first, and the first equal to ZeRO-3's where the forward is the same (hpZ, qgZ: within fp32
summation order, 1e-5) or within qwZ's INT8 weight error of it (qwZ, all three: 1e-2).
"""

from __future__ import annotations

import math
from typing import Any

from zeropp.tools.check.ranks import run_ranks
from zeropp.tools.check.record import Context, Record
from zeropp.tools.check.report import parts_table, table
from zeropp.tools.check.training import median_ms, optimizer_step, run_steps, tiny_gpt

MODES_RUN = ("zero3", "qwz", "hpz", "qgz", "all")
NUM_STEPS = 5
LEAST_S = 15.0
"""Seconds the ranks need at least: NCCL's start on every GPU, five modes of five steps."""
FIRST_LOSS_RTOL = {"zero3": 0.0, "hpz": 1e-5, "qgz": 1e-5, "qwz": 1e-2, "all": 1e-2}


def ranks_per_node(num_gpus: int) -> int:
    """2 nodes where the GPUs split evenly into nodes of 2 or more, else one node."""
    return num_gpus // 2 if num_gpus >= 4 and num_gpus % 2 == 0 else num_gpus


def nccl_rank(rank: int, world_size: int, modes: tuple[str, ...], node_size: int,
              device: str = "cuda") -> dict[str, Any]:
    """Each mode's run on this rank (``device``: this rank's GPU, which ``run_ranks`` made current)."""
    import torch

    import zeropp
    from zeropp.tools.modes import MODES

    out = {}
    for mode in modes:
        model = zeropp.shard(tiny_gpt().to(device), MODES[mode].config(node_size))
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses, times = run_steps(optimizer_step(model, optimizer), rank, world_size, device, NUM_STEPS)
        out[mode] = {"losses": losses, "step_s": times}
    return out


def run(context: Context, record: Record) -> None:
    node_size = ranks_per_node(context.num_gpus)
    results: list[dict[str, Any]] = []
    with record.part("ranks") as part:
        part.update(world_size=context.num_gpus, ranks_per_node=node_size)
        results = run_ranks(nccl_rank, context.num_gpus, MODES_RUN, node_size, backend="nccl",
                            env={"ZEROPP_RANKS_PER_NODE": str(node_size)}, timeout_s=context.need(LEAST_S))
    if not results:
        return
    losses = {mode: [sum(s) / len(s) for s in zip(*(r[mode]["losses"] for r in results))] for mode in MODES_RUN}
    for mode in MODES_RUN:
        with record.part(mode) as part:
            part.update(losses=losses[mode], step_s=results[0][mode]["step_s"])
            first, reference = losses[mode][0], losses["zero3"][0]
            part["checks"] = {"losses finite": all(math.isfinite(x) for x in losses[mode]),
                              "last loss below the first": losses[mode][-1] < first,
                              "first loss as ZeRO-3's": abs(first - reference)
                              <= FIRST_LOSS_RTOL[mode] * abs(reference)}


def summary(parts: dict[str, dict[str, Any]]) -> str:
    ran = {name: p for name, p in parts.items() if p.get("losses")}
    if not ran:
        return ""
    layout = parts["ranks"]
    return f"{layout['world_size']} ranks ({layout['ranks_per_node']} per node): " + ", ".join(
        f"{name} {p['losses'][0]:.3f} -> {p['losses'][-1]:.3f}" for name, p in ran.items())


def markdown(parts: dict[str, dict[str, Any]]) -> list[str]:
    rows = [[name, f"{p['losses'][0]:.4f}", f"{p['losses'][-1]:.4f}", f"{median_ms(p['step_s']):.1f}"]
            for name, p in parts.items() if p.get("losses")]
    return [*parts_table(parts), "", *table(["mode", "first loss", "last loss", "median step ms"], rows)]
