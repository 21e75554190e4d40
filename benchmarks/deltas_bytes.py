"""One training step's bytes on one real rank of a large job, all three techniques with and without
weight differences (and with qwZ's two-hop gather, whose direct sends cross each node link
(N - 1)/N times where the ring's cross it for every remote rank): the ledger's cross-node and total
bytes of the step after the first (whose forward refreshed the node copy whole), on PyTorch's
fake process group (a rank of N nodes x 8;
groups, layouts and what each comm asks to send are the real rank's, no byte moves). The 25.3M
GPT of ``zeropp bench step``, fp32 gathers as there, and a bf16 run beside it.

    python benchmarks/deltas_bytes.py --out benchmarks/results/deltas_bytes.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import time
from pathlib import Path

import torch

RANKS_PER_NODE = 8
MODES = ("all", "all_hier", "all_delta")


def one_rank(world_size: int, mode: str, dtype: str, queue: multiprocessing.Queue) -> None:
    """Rank 0 of ``world_size`` on the fake process group: two steps, the second's ledger."""
    import os

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import zeropp
    from zeropp.tools.models import GPT, GPTConfig
    from zeropp.tools.modes import MODES as NAMED

    os.environ["ZEROPP_RANKS_PER_NODE"] = str(RANKS_PER_NODE)
    torch.set_num_threads(1)
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=65, context_length=64, num_layers=8, num_heads=8, embed_dim=512))
    gather = getattr(torch, dtype)
    config = NAMED[mode].config(RANKS_PER_NODE, param_dtype=None if gather == torch.float32 else gather,
                                reduce_dtype=torch.float32)
    model = zeropp.shard(model, config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    x = torch.randint(0, 65, (2, 64), generator=torch.Generator().manual_seed(1))
    ledger = zeropp.comm_ledger()
    for step in range(2):
        if step == 1:
            ledger.reset()
        model(x, x)[1].backward()
        optimizer.step()
        optimizer.zero_grad()
    total = ledger.summary()["total"]
    by_technique = {k: v["cross_node_bytes"] for k, v in ledger.summary()["by_technique"].items()}
    explained = zeropp.explain(model)
    queue.put({"world_size": world_size, "mode": mode, "dtype": dtype, "cross_node_bytes": total["cross_node_bytes"],
               "bytes": total["bytes"], "by_technique": by_technique,
               "explained_cross_node_bytes": explained.cross_node_bytes})
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/deltas_bytes.json")
    parser.add_argument("--nodes", default="2,16", help="comma-separated node counts (8 ranks a node)")
    args = parser.parse_args()
    context = multiprocessing.get_context("spawn")
    rows = []
    for nodes in map(int, args.nodes.split(",")):
        for dtype in ("float32", "bfloat16"):
            for mode in MODES:
                queue = context.Queue()
                process = context.Process(target=one_rank, args=(nodes * RANKS_PER_NODE, mode, dtype, queue))
                process.start()
                rows.append(queue.get(timeout=900))
                process.join()
    print(f"{'ranks':>6} {'dtype':<9} {'mode':<10} {'cross-node MB':>14} {'vs all':>7} {'explain = ledger':>17}")
    for row in rows:
        base = next(r for r in rows if r["world_size"] == row["world_size"] and r["dtype"] == row["dtype"]
                    and r["mode"] == "all")
        row["vs_all"] = row["cross_node_bytes"] / base["cross_node_bytes"]
        print(f"{row['world_size']:>6} {row['dtype']:<9} {row['mode']:<10} {row['cross_node_bytes'] / 1e6:>14.2f} "
              f"{row['vs_all']:>7.3f} {str(row['explained_cross_node_bytes'] == row['cross_node_bytes']):>17}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "ranks_per_node": RANKS_PER_NODE,
                                          "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
