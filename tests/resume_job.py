"""A training job for the resume test, run under torchrun: trains with zeropp.initialize,
checkpoints every ``--every`` steps, resumes from ``--ckpt`` when a checkpoint exists, and can
SIGKILL one rank once (guarded by a marker file) to let torchrun restart the group. Rank 0 writes
the final full parameters to ``--out``. The model has dropout, so an exact resume needs the RNG
states restored too.

    python -m torch.distributed.run --standalone --nproc-per-node 2 --max-restarts 1 \\
        tests/resume_job.py --ckpt DIR --out params.pt --steps 6 --every 2 --kill-at 5
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

import zeropp
from models import CONTEXT, VOCAB, global_batch, rows

GLOBAL_BATCH = 8
CONFIG = {
    "train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 3, "zero_quantized_weights": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.01, "warmup_num_steps": 4}},
    "steps_per_print": 1000,
}


class DropoutLM(nn.Module):
    def __init__(self, width: int = 24) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU(),
                                                  nn.Dropout(0.2)) for _ in range(2))
        self.head = nn.Linear(width * CONTEXT, VOCAB * CONTEXT)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = x + block(x)
        logits = self.head(x.flatten(1)).view(idx.shape[0], CONTEXT, VOCAB)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--kill-at", type=int, default=0, help="step after which rank 1 SIGKILLs itself once")
    args = parser.parse_args()
    torch.manual_seed(0)
    engine, *_ = zeropp.initialize(model=DropoutLM(), config=CONFIG)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234 + rank)  # per-rank dropout streams
    engine.resume_if_possible(args.ckpt)
    accumulation = engine.gradient_accumulation_steps()
    for step in range(engine.global_steps, args.steps):  # the data position is the step
        x, y = global_batch(step, GLOBAL_BATCH)
        for micro in range(accumulation):
            xm, ym = (rows(rows(t, rank, world_size), micro, accumulation) for t in (x, y))
            engine.backward(engine(xm, ym))
            engine.step()
        marker = args.ckpt / "killed"
        if step + 1 == args.kill_at and rank == 1 and not marker.exists():
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        if (step + 1) % args.every == 0:
            engine.save_checkpoint(args.ckpt)
    state = get_model_state_dict(engine.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save({"params": state, "global_steps": engine.global_steps, "restarts":
                    int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
