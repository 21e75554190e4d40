"""gloo's per-byte cost of each collective zeropp's steps use, alone (no compute beside it).

    zeropp launch --nodes 2 --nproc-per-node 2 --bandwidth unlimited -- benchmarks/collective_rates.py [--out PATH]

Times the all-gather and the reduce-scatter (which gloo runs as an all-reduce) over the world
and over one node's ranks, for 8 and 32 MB of fp32 output, and prints per call the median of
the slowest rank, the bytes each rank sends (what ``zeropp.tools.plan`` charges at one sending rate)
and the rate that makes. Rank 0 writes the JSON (default ``benchmarks/results/collective_rates.json``)
that ``zeropp plan --calibrate --collective-rates`` reads.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

import zeropp
from zeropp.fsdp.comms import Recorder, all_gather, all_gather_strings, reduce_scatter
from zeropp.setup.topology import build_process_groups

SIZES_MB = (8, 32)
CALLS = 5


def slowest_median(call, topology: zeropp.Topology) -> float:  # noqa: ANN001
    call()  # warm-up
    seconds = []
    for _ in range(CALLS):
        dist.barrier()
        started = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - started)
    per_rank = [json.loads(s) for s in all_gather_strings(json.dumps(seconds))]
    return statistics.median(max(rank[i] for rank in per_rank) for i in range(CALLS))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/collective_rates.json"))
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    topology = zeropp.Topology.from_env()
    groups = build_process_groups(topology)
    recorder = Recorder(topology)
    rows = []
    for size_mb in SIZES_MB:
        numel = size_mb * 2**20 // 4
        for kind, group in (("world", dist.group.WORLD), ("node", groups.intra_node_group)):
            size = group.size()
            chunk, whole = torch.randn(numel // size), torch.randn(numel)
            gathered, reduced = torch.empty(numel), torch.empty(numel // size)
            calls = {
                "all_gather": (lambda: all_gather(gathered, chunk, group, recorder, "bench"), 1),
                "reduce_scatter": (lambda: reduce_scatter(reduced, whole, dist.ReduceOp.SUM, group, recorder,
                                                          "bench"), 2),
            }
            for op, (call, rounds) in calls.items():
                seconds = slowest_median(call, topology)
                sent = rounds * (size - 1) * (numel // size) * 4
                rows.append({"op": op, "group": kind, "ranks": size, "output_mb": size_mb, "ms": seconds * 1e3,
                             "sent_mb": sent / 1e6, "sent_mb_per_s": sent / seconds / 1e6})
    if dist.get_rank() == 0:
        print(f"{'op':15s} {'group':6s} {'MB':>4s} {'ms':>7s} {'sent MB':>8s} {'sent MB/s':>10s}")
        for r in rows:
            print(f"{r['op']:15s} {r['group']:6s} {r['output_mb']:4d} {r['ms']:7.1f} {r['sent_mb']:8.1f} "
                  f"{r['sent_mb_per_s']:10.1f}")
        out = args.out
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"topology": {"num_nodes": topology.num_nodes,
                                                "ranks_per_node": topology.ranks_per_node},
                                   "calls": CALLS, "rows": rows}, indent=2) + "\n")
        print(f"wrote {out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
