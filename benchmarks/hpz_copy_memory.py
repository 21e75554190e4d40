"""hpZ's secondary copy as qwZ's codes against FSDP2's decoded copy: memory and backward bytes.

    ZEROPP_RANKS_PER_NODE=2 torchrun --nproc-per-node 4 benchmarks/hpz_copy_memory.py [--param-dtype float32]

Trains the benchmark GPT (``zeropp bench step``'s 25M model, 8 x 512) on 2 nodes x 2 ranks
three ways: hpZ alone, all three with the secondary copy decoded (FSDP2's, the path before
codes: ``zeropp.hpz.keep_decoded_secondary_copies``) and all three with the copy as codes (the
default). Each takes one AdamW step (which creates the optimizer state), then one step tracked
by PyTorch's memory tracker (``MemTracker``, a dispatch mode: the largest sum of live tensor
storages, without the allocator's slack or the process's code; FSDP2's own ``FSDPMemTracker``
re-registers FSDP2's forward hooks ahead of zeropp's, which breaks hpZ's reshard at each root
forward). Per variant, every rank's: the copy held at the
end of forward (``held_secondary_copy_bytes``), ``secondary_copy_bytes``, the tracked peak of
the step, and the bytes its backward's intra-node gathers send (the ledger). No timing. Rank 0
prints a table and writes the JSON (default ``benchmarks/results/hpz_copy_memory.json``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker

import zeropp
from zeropp.comms import all_gather_strings
from zeropp.hpz import held_secondary_copy_bytes, keep_decoded_secondary_copies, secondary_copy_bytes
from zeropp.tools.models import GPT, GPTConfig

VARIANTS = {"hpz": False, "all, decoded copy": True, "all, codes": False}
"""Each variant and whether it keeps FSDP2's decoded copy."""
VOCAB, CONTEXT, BATCH = 84, 64, 8  # the bench's character vocabulary, context and global batch


def measure(name: str, decoded: bool, param_dtype: torch.dtype, rank: int, world_size: int) -> dict:
    """One variant's figures on this rank."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, context_length=CONTEXT, num_layers=8, num_heads=8, embed_dim=512))
    options = {"quantized_weights": True, "quantized_gradients": True} if name != "hpz" else {}
    zeropp.shard(model, zeropp.ZeroPPConfig(hpz_partition_size=2, param_dtype=param_dtype, **options))
    if decoded:
        keep_decoded_secondary_copies(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, VOCAB, (BATCH, CONTEXT + 1), generator=torch.Generator().manual_seed(0))
    x, y = (t[rank * BATCH // world_size:(rank + 1) * BATCH // world_size] for t in (tokens[:, :-1], tokens[:, 1:]))
    ledger = zeropp.comm_ledger()

    def step() -> int:
        loss = model(x, y)[1]
        held = held_secondary_copy_bytes(model)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return held

    step()  # creates AdamW's state: the tracked step is a steady one
    ledger.reset()
    tracker = MemTracker()
    tracker.track_external(model, optimizer, x, y)
    with tracker:
        held = step()
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))["Total"]
    gathers = ledger.summary(phase="backward", op="all_gather")["by_group"]
    return {"held_after_forward": held, "secondary_copy_bytes": secondary_copy_bytes(model), "tracked_peak": peak,
            "backward_intra_gather_bytes": gathers.get("intra", {}).get("bytes", 0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--param-dtype", choices=["bfloat16", "float32"], default="float32")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/hpz_copy_memory.json"))
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    param_dtype = getattr(torch, args.param_dtype)
    mine = {name: measure(name, decoded, param_dtype, rank, world_size) for name, decoded in VARIANTS.items()}
    ranks = [json.loads(text) for text in all_gather_strings(json.dumps(mine))]
    if rank == 0:
        result = {"param_dtype": args.param_dtype, "world_size": world_size,
                  "variants": {name: {key: [r[name][key] for r in ranks] for key in mine[name]} for name in VARIANTS}}
        print(f"{'variant':<20}{'copy MB/rank':>14}{'tracked peak MB/rank (max)':>28}{'backward intra MB/rank':>24}")
        for name, figures in result["variants"].items():
            copy, peak, intra = (max(figures[key]) / 1e6 for key in
                                 ("held_after_forward", "tracked_peak", "backward_intra_gather_bytes"))
            print(f"{name:<20}{copy:>14.2f}{peak:>28.1f}{intra:>24.2f}")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
