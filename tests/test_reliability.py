"""A peer that dies or stops mid-step: every surviving rank raises, in zeropp's terms, and exits
non-zero, within ZEROPP_TIMEOUT_S (comms.Recorder.issue, [Note: a peer that dies])."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from distributed import free_port

WORLD_SIZE = 4
FAILING_RANK = 1
TIMEOUT_S = 10


def _launch(fail: str, serial: bool) -> list[subprocess.Popen]:
    """The four ranks of tests/peer_job.py, each its own process, as torchrun would start them
    (without its agent, which would stop the survivors itself)."""
    port = free_port()
    job = Path(__file__).with_name("peer_job.py")
    procs = []
    for rank in range(WORLD_SIZE):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(WORLD_SIZE), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "ZEROPP_RANKS_PER_NODE": "2",
               "ZEROPP_TIMEOUT_S": str(TIMEOUT_S), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(job.parent), *sys.path])}
        procs.append(subprocess.Popen([sys.executable, str(job), "--fail", fail, "--rank", str(FAILING_RANK),
                                       *(["--serial"] if serial else [])],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


@pytest.mark.parametrize("fail,serial", [("kill", True), ("stall", True), ("kill", False), ("stall", False)])
def test_surviving_ranks_name_the_collective_and_exit_non_zero(fail: str, serial: bool) -> None:
    """Rank 1 SIGKILLed, or stuck, just before unit blocks.1 gathers its weights at step 2: each
    other rank raises zeropp's CollectiveError naming the collective it waited for and exits with
    status 1, within the timeout plus start-up (a hang fails the test). With every collective in
    turn that is the qwZ all-gather of unit 'blocks.1'; with ``overlap`` (the default) the
    survivors have started later collectives by then, and the one named is the first they wait on."""
    procs = _launch(fail, serial)
    try:
        survivors = {}
        for rank, proc in enumerate(procs):
            if rank != FAILING_RANK:
                survivors[rank] = (*proc.communicate(timeout=300), proc.returncode)
        if fail == "kill":
            procs[FAILING_RANK].wait(timeout=30)
            assert procs[FAILING_RANK].returncode == -9
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    for rank, (out, err, code) in survivors.items():
        print(f"--- rank {rank} ({fail}), exit {code}:\n{err.strip().splitlines()[-1]}")
        assert code == 1, (rank, out, err)
        assert "finished" not in out
        named = "the qwZ all_gather of unit 'blocks.1'" if serial else "the "
        pattern = r"zeropp\.fsdp\.comms\.CollectiveError: zeropp: the \S+ \S+ of unit '[^']+' over the"
        assert re.search(pattern, err), err
        assert f"zeropp.fsdp.comms.CollectiveError: zeropp: {named}" in err, err
        assert "a peer rank died or stopped calling collectives" in err
        assert f"bounded by ZEROPP_TIMEOUT_S={TIMEOUT_S} s" in err
