"""A training job for the dead-peer test, one process per rank, started by the test without
torchrun (so nothing restarts or kills the survivors): all three techniques on 2 x 2; at
``--at-step``, rank ``--rank`` is SIGKILLed (``--fail kill``) or stops calling collectives
(``--fail stall``) just before unit ``blocks.1`` gathers its weights.

    RANK=0 WORLD_SIZE=4 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 ZEROPP_RANKS_PER_NODE=2 \\
        ZEROPP_TIMEOUT_S=10 python tests/peer_job.py --fail kill --rank 1 --at-step 2
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist

import zeropp
from models import global_batch, make_model, rows
from zeropp.tools.modes import MODES


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail", choices=("kill", "stall"), required=True)
    parser.add_argument("--rank", type=int, default=1)
    parser.add_argument("--at-step", type=int, default=2)
    parser.add_argument("--serial", action="store_true", help="overlap=False: every collective in turn")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = zeropp.shard(make_model("gpt"), MODES["all"].config(2, overlap=not args.serial))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = 0

    def fail(*_: object) -> None:
        if rank == args.rank and step == args.at_step:
            print(f"rank {rank}: {args.fail} before unit blocks.1 gathers, step {step}", flush=True)
            if args.fail == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(3600)

    model.blocks[1].register_forward_pre_hook(fail, prepend=True)
    for step in range(args.at_step + 2):
        x, y = (rows(t, rank, world_size) for t in global_batch(step, 8))
        model(x, y)[1].backward()
        optimizer.step()
        optimizer.zero_grad()
    print(f"rank {rank}: finished", flush=True)


if __name__ == "__main__":
    main()
