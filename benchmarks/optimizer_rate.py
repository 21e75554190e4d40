"""The optimizer's cost per parameter on this host, as the bench's ranks pay it: four processes at
once (one thread each), each stepping AdamW (fp32, torch's default implementation) over one flat
shard, at the shard sizes of the 25M GPT's ranks under ZeRO-3 (a quarter) and HSDP (a half).

``zeropp plan --calibrate --optimizer-rate <this JSON>`` uses the measured cost instead of fitting
it: on the small calibration models the optimizer's share of a step is too small to separate.

    python benchmarks/optimizer_rate.py --out benchmarks/results/plan/optimizer_rate.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from pathlib import Path

PROCESSES, STEPS, WARMUP = 4, 6, 2
SIZES = (6_334_720, 12_669_440)
"""The 25M GPT's 25,338,880 parameters over 4 ranks (ZeRO-3) and over 2 (HSDP)."""


def _rank(index: int, barrier, results, numel: int) -> None:
    import torch

    torch.set_num_threads(1)
    shard = torch.zeros(numel, requires_grad=True)
    shard.grad = torch.randn(numel, generator=torch.Generator().manual_seed(index))
    optimizer = torch.optim.AdamW([shard], lr=3e-4, weight_decay=0.0)
    times = []
    for _ in range(WARMUP + STEPS):
        barrier.wait()
        started = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - started)
    results[index] = times[WARMUP:]


def measure(numel: int) -> float:
    """The median over steps of the slowest process's AdamW step over ``numel`` parameters."""
    context = mp.get_context("spawn")
    barrier, results = context.Barrier(PROCESSES), context.Manager().dict()
    ranks = [context.Process(target=_rank, args=(i, barrier, results, numel)) for i in range(PROCESSES)]
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join()
    return statistics.median(max(results[i][s] for i in range(PROCESSES)) for s in range(STEPS))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rows = [{"numel": numel, "step_s": (seconds := measure(numel)), "s_per_parameter": seconds / numel}
            for numel in SIZES]
    record = {"date": time.strftime("%Y-%m-%d"), "processes": PROCESSES, "rows": rows,
              "update_s_per_parameter": statistics.fmean(row["s_per_parameter"] for row in rows)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2))
    for row in rows:
        print(f"AdamW over {row['numel']:,} parameters, 4 processes at once: {row['step_s']:.4f} s "
              f"({row['s_per_parameter'] * 1e9:.1f} ns a parameter)")


if __name__ == "__main__":
    main()
