"""The multi-rank harness itself (``tests/distributed.py``): a failed run names its cause first,
and a rank killed by a signal runs the ranks once more ([Note: a rank killed by a signal])."""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from distributed import run_distributed


def _crash_once(rank: int, world_size: int, marker: str) -> int:
    dist.barrier()
    if rank == 1 and not os.path.exists(marker):
        Path(marker).touch()
        ctypes.string_at(0)  # SIGSEGV, as a crash in native code
    dist.barrier()
    return rank


def test_a_rank_killed_by_a_signal_runs_the_ranks_once_more(tmp_path, capfd) -> None:
    assert run_distributed(_crash_once, 2, str(tmp_path / "crashed"), timeout=60) == [0, 1]
    assert (tmp_path / "crashed").exists()
    assert "running the ranks once more" in capfd.readouterr().err


def _crash_always(rank: int, world_size: int) -> None:
    dist.barrier()
    if rank == 1:
        ctypes.string_at(0)
    dist.barrier()


def test_a_second_crash_fails_naming_the_signal() -> None:
    with pytest.raises(AssertionError, match=r"1: -11"):
        run_distributed(_crash_always, 2, timeout=60)


def _fail_on_one(rank: int, world_size: int) -> None:
    dist.barrier()
    if rank == 1:
        raise ValueError("rank 1's own error")
    dist.all_reduce(__import__("torch").zeros(1))  # rank 0 waits for rank 1, which never comes


def test_the_rank_with_its_own_error_is_named_first() -> None:
    with pytest.raises(AssertionError, match=r"(?s)ranks \[1.*--- rank 1:.*rank 1's own error"):
        run_distributed(_fail_on_one, 2, timeout=60)


def _peers_go_on_after_rank_0(rank: int, world_size: int) -> float:
    if rank == 0:
        return 0.0  # rank 0 is done at once; its peers still need the store
    time.sleep(1.0)
    group = dist.new_group([1, 2, 3], use_local_synchronization=True)
    total = torch.ones(1)
    dist.all_reduce(total, group=group)
    return total.item()


def test_peers_build_groups_after_rank_0_is_done() -> None:
    """The store outlives every rank ([Note: ranks leave together]): peers that build a group
    through it after rank 0 has finished its function get their group."""
    assert run_distributed(_peers_go_on_after_rank_0, 4, timeout=60) == [0.0, 3.0, 3.0, 3.0]
