"""Local ranks for the check's multi-rank parts: ``world_size`` processes forked from one server
that has torch and zeropp imported, a process group in each (gloo: ranks may share one GPU;
NCCL: one GPU per rank), ``fn(rank, world_size, *args)`` called in each, every rank's result
returned. A rank's error is raised here with its traceback; ranks that do not answer within
``timeout_s`` are killed and a ``TimeoutError`` names them.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PRELOADED = ["torch", "torch.distributed.fsdp", "zeropp.setup.sharding", "zeropp.engine"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world_size: int, backend: str, env: dict[str, str], fn: Callable, args: tuple,
          results: Any, timeout_s: float) -> None:
    os.environ.update(env, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))  # the ranks share the cores
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        results.put((rank, True, fn(rank, world_size, *args)))
    except BaseException:  # report everything; the caller raises it
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo", timeout_s: float,
              env: dict[str, str] | None = None) -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` local ranks (``fn`` at module level, its
    result picklable); the results by rank. ``env`` is set in every rank (e.g.
    ``ZEROPP_RANKS_PER_NODE`` to declare 2 nodes x 2)."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(PRELOADED)
    results = context.Queue()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "LOCAL_WORLD_SIZE": str(world_size),
           **(env or {})}
    processes = [context.Process(target=_rank, args=(r, world_size, backend, env, fn, args, results, timeout_s),
                                 daemon=True) for r in range(world_size)]
    for process in processes:
        process.start()
    outcome: dict[int, Any] = {}
    try:
        while len(outcome) < world_size:
            try:
                rank, ok, value = results.get(timeout=timeout_s)
            except queue.Empty:
                missing = sorted(set(range(world_size)) - set(outcome))
                raise TimeoutError(f"ranks {missing} of {world_size} gave no result within {timeout_s:.0f} s") from None
            if not ok:
                raise RuntimeError(f"rank {rank} of {world_size} failed:\n{value}")
            outcome[rank] = value
    finally:
        for process in processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
    return [outcome[r] for r in range(world_size)]
