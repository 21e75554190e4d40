"""hpZ's secondary copy as qwZ's codes against FSDP2's decoded copy and DeepSpeed's: memory and bytes.

    ZEROPP_RANKS_PER_NODE=2 DS_ACCELERATOR=cpu torchrun --nproc-per-node 4 benchmarks/hpz_copy_memory.py \
        --mode all [--param-dtype float32]

Trains the benchmark GPT (``zeropp bench step``'s 25M model, 8 x 512) on 2 nodes x 2 ranks in
one of the bench's modes (``zeropp.tools.modes``; one mode a run, so that no other mode's tensors
are alive in its step): ZeRO-3, hpZ alone, all three with the secondary
copy decoded (FSDP2's, the path before codes: ``zeropp.techniques.hpz.keep_decoded_secondary_copies``),
all three with the copy as codes (the default), and DeepSpeed ZeRO-3 at its defaults, resharding
as FSDP2 does, and resharding with its hpZ (``zero_hpz_partition_size`` = 2). Each takes one
AdamW step (which creates the optimizer state), then one step tracked by PyTorch's memory tracker
(``MemTracker``, a dispatch mode: the largest sum of live tensor storages, without the
allocator's slack or the process's code; FSDP2's own ``FSDPMemTracker`` re-registers FSDP2's
forward hooks ahead of zeropp's, which breaks hpZ's reshard at each root forward). The tracker
is given every tensor alive when the step starts (what the garbage collector reaches: shards,
optimizer state, DeepSpeed's flat buffers alike), so the systems are counted the same way. Per
mode, every rank's: the copy held at the end of forward (zeropp: ``held_secondary_copy_bytes``;
DeepSpeed: its ``ds_secondary_tensor``s), ``secondary_copy_bytes``, the tracked peak of the
step, and (zeropp) the bytes its backward's intra-node gathers send (the ledger). No timing.
Rank 0 prints a row and writes the JSON (default ``benchmarks/results/hpz_copy_memory/<mode>.json``).
"""

from __future__ import annotations

import argparse
import gc
import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed._tools.mem_tracker import MemTracker

import zeropp
from zeropp.fsdp.comms import all_gather_strings
from zeropp.techniques.hpz import held_secondary_copy_bytes, keep_decoded_secondary_copies, secondary_copy_bytes
from zeropp.tools.bench.worker import WorkerConfig, deepspeed_config, deepspeed_secondary_bytes
from zeropp.tools.models import GPT, GPTConfig
from zeropp.tools.modes import MODES, System

COMPARED = ("zero3", "hpz", "all_decoded_copy", "all", "deepspeed", "deepspeed_reshard", "deepspeed_hpz")
"""The modes this measures, names of ``zeropp.tools.modes.MODES``."""
VOCAB, CONTEXT, BATCH = 84, 64, 8  # the bench's character vocabulary, context and global batch
RANKS_PER_NODE = 2


class Run:
    """One mode's model and step on this rank: zeropp's (or DeepSpeed's) forward, the copy held
    after it, backward and AdamW."""

    def __init__(self, mode: str, param_dtype: str, world_size: int) -> None:
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=VOCAB, context_length=CONTEXT, num_layers=8, num_heads=8, embed_dim=512))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        if MODES[mode].system is System.DEEPSPEED:
            import deepspeed

            config = WorkerConfig(modes=(mode,), batch_size=BATCH, context_length=CONTEXT, param_dtype=param_dtype)
            options = MODES[mode].deepspeed_options(RANKS_PER_NODE)
            engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                              config=deepspeed_config(config, world_size, options))
            self.forward, self.held = engine, lambda: deepspeed_secondary_bytes(engine.module)
            self.backward, self.update = engine.backward, engine.step
        else:
            zeropp.shard(model, MODES[mode].config(RANKS_PER_NODE, param_dtype=getattr(torch, param_dtype)))
            if MODES[mode].decoded_secondary_copy:
                keep_decoded_secondary_copies(model)
            self.forward, self.held = model, lambda: held_secondary_copy_bytes(model)
            self.backward: Callable[[torch.Tensor], None] = lambda loss: loss.backward()
            self.update = lambda: (optimizer.step(), optimizer.zero_grad(set_to_none=True))
            self.copy_bytes = lambda: secondary_copy_bytes(model)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> int:
        """One training step; the secondary copy this rank held at the end of its forward."""
        loss = self.forward(x, y)[1]
        held = self.held()
        self.backward(loss)
        self.update()
        return held


def live_tensors() -> list[torch.Tensor]:
    """Every CPU tensor the garbage collector reaches now."""
    gc.collect()
    return [t for t in gc.get_objects() if isinstance(t, torch.Tensor) and not t.is_meta]


def storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    return sum({id(s): s.nbytes() for t in tensors for s in get_untyped_storages(t)}.values())


def measure(mode: str, param_dtype: str, rank: int, world_size: int) -> dict:
    """One mode's figures on this rank; ``live_before``: the tensor bytes alive before its model
    is built (a check that the tracked step counts this mode's tensors only)."""
    live_before = storage_bytes(live_tensors())
    run = Run(mode, param_dtype, world_size)
    tokens = torch.randint(0, VOCAB, (BATCH, CONTEXT + 1), generator=torch.Generator().manual_seed(0))
    rows = slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size)
    x, y = tokens[rows, :-1], tokens[rows, 1:]
    ledger = zeropp.comm_ledger()
    run.step(x, y)  # creates AdamW's state: the tracked step is a steady one
    ledger.reset()
    tracker = MemTracker()
    tracker.track_external(*live_tensors())
    with tracker:
        held = run.step(x, y)
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))["Total"]
    gathers = ledger.summary(phase="backward", op="all_gather")["by_group"]
    zeropp_mode = MODES[mode].system is System.ZEROPP
    return {"live_before": live_before, "held_after_forward": held, "tracked_peak": peak,
            "secondary_copy_bytes": run.copy_bytes() if zeropp_mode else held,
            "backward_intra_gather_bytes": gathers.get("intra", {}).get("bytes", 0) if zeropp_mode else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--param-dtype", choices=["bfloat16", "float32"], default="float32")
    parser.add_argument("--mode", choices=COMPARED, required=True)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    args.out = args.out or Path(f"benchmarks/results/hpz_copy_memory/{args.mode}.json")
    args.modes = (args.mode,)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mine = {mode: measure(mode, args.param_dtype, rank, world_size) for mode in args.modes}
    ranks = [json.loads(text) for text in all_gather_strings(json.dumps(mine))]
    if rank == 0:
        result = {"param_dtype": args.param_dtype, "world_size": world_size,
                  "modes": {mode: {key: [r[mode][key] for r in ranks] for key in mine[mode]} for mode in args.modes}}
        print(f"{'mode':<18}{'copy MB/rank':>14}{'tracked peak MB/rank (max)':>28}{'backward intra MB/rank':>24}")
        for mode, figures in result["modes"].items():
            copy, peak = (max(figures[key]) / 1e6 for key in ("held_after_forward", "tracked_peak"))
            intra = figures["backward_intra_gather_bytes"]
            intra_text = f"{max(intra) / 1e6:.2f}" if intra[0] is not None else "n/a"
            print(f"{mode:<18}{copy:>14.2f}{peak:>28.1f}{intra_text:>24}")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
