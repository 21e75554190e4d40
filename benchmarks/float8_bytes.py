"""What qwZ, hpZ and qgZ do beside torchao's float8 training: one training step's bytes, cross-node
and in all, of a float8 model (every linear layer torchao's ``Float8Linear`` with its float8
all-gather) on 2 nodes x 2 ranks, in FSDP2's bf16 gathers without float8, with torchao's float8
gathers, and with torchao's float8 plus each of zeropp's modes (from zeropp's ledger; FSDP2's own
collectives are counted by zeropp's plain comms, ``ZeroPPConfig()``).

    ZEROPP_RANKS_PER_NODE=2 torchrun --nproc-per-node 4 benchmarks/float8_bytes.py \\
        --out benchmarks/results/float8_bytes.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import zeropp

WIDTH, BLOCKS = 512, 4
RUNS = {
    "bf16 gathers, no float8": (False, zeropp.ZeroPPConfig()),
    "torchao float8 gathers": (True, zeropp.ZeroPPConfig()),
    "float8 + qgZ": (True, zeropp.ZeroPPConfig(quantized_gradients=True)),
    "float8 + all three": (True, zeropp.ZeroPPConfig(quantized_weights=True, hpz_partition_size=2,
                                                     quantized_gradients=True)),
    "bf16 + all three, no float8": (False, zeropp.ZeroPPConfig(quantized_weights=True, hpz_partition_size=2,
                                                               quantized_gradients=True)),
}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc, self.proj = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(torch.relu(self.fc(self.norm(x))))


def one_step(float8: bool, config: zeropp.ZeroPPConfig) -> dict[str, dict[str, int]]:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(BLOCKS)], nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 16))
    if float8:
        convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model[:BLOCKS]:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    zeropp.enable(model, config)
    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(dist.get_rank()))
    model(x).float().square().mean().backward()  # the first step: lazy initialisation
    model.zero_grad(set_to_none=True)
    zeropp.comm_ledger().reset()
    model(x).float().square().mean().backward()
    totals = zeropp.comm_ledger().summary()["by_technique"]
    sums = torch.tensor([[v["bytes"], v["cross_node_bytes"]] for v in totals.values()], dtype=torch.float64)
    dist.all_reduce(sums)  # every rank's bytes (the same techniques on every rank, in the same order)
    return {technique: {"bytes": int(b), "cross_node_bytes": int(c)}
            for technique, (b, c) in zip(totals, sums.tolist())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        runs = {name: one_step(*setting) for name, setting in RUNS.items()}
        if dist.get_rank() == 0:
            base = sum(t["cross_node_bytes"] for t in runs["bf16 gathers, no float8"].values())
            rows = []
            print(f"{'run':<30}{'cross-node MB':>15}{'x bf16':>8}{'all MB':>9}  by technique (cross-node MB)")
            for name, totals in runs.items():
                cross = sum(t["cross_node_bytes"] for t in totals.values())
                every = sum(t["bytes"] for t in totals.values())
                rows.append({"run": name, "cross_node_bytes": cross, "bytes": every, "by_technique": totals})
                parts = ", ".join(f"{k} {v['cross_node_bytes'] / 1e6:.2f}" for k, v in totals.items())
                print(f"{name:<30}{cross / 1e6:>15.2f}{cross / base:>8.3f}{every / 1e6:>9.2f}  {parts}")
            args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "width": WIDTH, "blocks": BLOCKS,
                                            "world": "2 nodes x 2 ranks", "rows": rows}, indent=2))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
