"""The emulated cluster: rate parsing and command mapping (anywhere), and on a machine that permits
network namespaces, a real 2 nodes x 2 ranks gloo job through the launcher, its link counters and
its teardown (also after a crashed rank)."""

from __future__ import annotations

import fcntl
import json
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from zeropp.tools.cluster import Cluster, ClusterError, check_support, launch, parse_bandwidth
from zeropp.tools.cluster.launch import script_arguments
from zeropp.tools.cluster.netns import CLUSTER_LOCK, list_namespaces, node_address

NUMEL = 64 * 1024
"""fp32 elements each rank contributes to the all-gather (256 KiB: far above the control traffic)."""


@pytest.mark.parametrize("text,bits", [
    ("100mbit", 10**8), ("1gbit", 10**9), ("500kbit", 5 * 10**5), ("1.5Gbit", 15 * 10**8),
    ("10mbps", 8 * 10**7), ("1gibit", 2**30), ("unlimited", None), (None, None),
])
def test_parse_bandwidth(text: str | None, bits: int | None) -> None:
    assert parse_bandwidth(text) == bits


@pytest.mark.parametrize("text", ["100mb", "fast", "-5mbit", "", "1 gbit/s"])
def test_parse_bandwidth_rejects(text: str) -> None:
    with pytest.raises(ValueError, match=f"bandwidth {text!r} is not a rate: use tc syntax such as 100mbit"):
        parse_bandwidth(text)


def test_parse_bandwidth_rejects_tiny_rate() -> None:
    with pytest.raises(ValueError, match="bandwidth '0kbit' is below 8kbit"):
        parse_bandwidth("0kbit")


def test_script_arguments() -> None:
    assert script_arguments(["python", "train.py", "--x"]) == (sys.executable, ["train.py", "--x"])
    assert script_arguments(["python3", "-m", "zeropp.tools.demo"]) == (sys.executable, ["-m", "zeropp.tools.demo"])
    assert script_arguments(["/opt/env/bin/python", "t.py"]) == ("/opt/env/bin/python", ["t.py"])
    assert script_arguments(["./run.sh", "a"]) == (sys.executable, ["--no-python", "./run.sh", "a"])
    for command in ([], ["python"], ["-m"]):
        with pytest.raises(ValueError, match="launch needs a command after '--'"):
            script_arguments(command)


def test_cluster_rejects_bad_node_count() -> None:
    with pytest.raises(ValueError, match="num_nodes must be an int in \\[1, 250\\], got 0"):
        Cluster(0)


@pytest.fixture
def namespaces() -> Iterator[None]:
    """Skip where namespaces are not permitted; one cluster test at a time on this machine (the
    names are fixed), never while someone else's cluster is up."""
    reason = check_support()
    if reason is not None:
        pytest.skip(reason)
    with open(CLUSTER_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if list_namespaces():
            pytest.skip(f"namespaces {list_namespaces()} exist: another cluster is up (zeropp cluster down)")
        yield
        assert list_namespaces() == [], "the cluster was not torn down"


def test_cluster_context_manager(namespaces: None) -> None:
    with pytest.raises(RuntimeError, match="inside"), Cluster(2, "100mbit") as cluster:
        current = Cluster.current()
        assert (current.num_nodes, current.bandwidth_bits) == (2, 10**8)
        assert set(cluster.link_bytes()) == {0, 1}
        with pytest.raises(ClusterError, match="already exist"):
            Cluster(1).up()
        raise RuntimeError("inside")


ALL_GATHER = """
import json, os, socket, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
numel = {numel}
out = torch.empty(world * numel)
dist.all_gather_into_tensor(out, torch.arange(numel, dtype=torch.float32) + rank * numel)
assert torch.equal(out, torch.arange(world * numel, dtype=torch.float32)), "all_gather values wrong"
probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
probe.connect(("10.77.0.254", 9))  # sends nothing: picks the source address of this namespace's eth0
record = dict(rank=rank, hostname=socket.gethostname(), address=probe.getsockname()[0],
              local_world_size=int(os.environ["LOCAL_WORLD_SIZE"]))
with open(os.path.join(sys.argv[1], f"rank{{rank}}.json"), "w") as f:
    json.dump(record, f)
dist.destroy_process_group()
"""


def test_launch_all_gather_on_two_nodes(namespaces: None, tmp_path: Path) -> None:
    script = tmp_path / "all_gather.py"
    script.write_text(textwrap.dedent(ALL_GATHER.format(numel=NUMEL)))
    result = launch(["python", str(script), str(tmp_path)], num_nodes=2, nproc_per_node=2, bandwidth="100mbit")
    assert result.exit_code == 0
    assert result.bandwidth_bits == 10**8
    records = sorted((json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")), key=lambda r: r["rank"])
    assert [(r["rank"], r["hostname"], r["address"], r["local_world_size"]) for r in records] == [
        (rank, f"zpp-n{rank // 2}", node_address(rank // 2), 2) for rank in range(4)]
    # Each node must obtain the 2 chunks of the other node's ranks, and deliver its own 2, at least
    # once whatever the algorithm: 2 * NUMEL * 4 bytes per node and direction, frames add headers.
    must_cross = 2 * NUMEL * 4
    for node, counts in result.link_bytes.items():
        assert counts["rx_bytes"] >= must_cross, (node, counts)
        assert counts["tx_bytes"] >= must_cross, (node, counts)


CRASH = """
import sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 3:
    sys.exit(3)
dist.all_reduce(torch.ones(1))  # the others wait for rank 3 until they are stopped
"""


@pytest.mark.slow
def test_crashed_rank_fails_the_launch_and_tears_down(namespaces: None, tmp_path: Path) -> None:
    script = tmp_path / "crash_rank3.py"
    script.write_text(textwrap.dedent(CRASH))
    result = launch(["python", str(script)], num_nodes=2, nproc_per_node=2)
    assert result.exit_code != 0
    survivors = [p for p in Path("/proc").glob("[0-9]*") if _cmdline(p).find(str(script)) >= 0]
    assert survivors == []


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def test_demo_runs_under_a_slow_link_where_it_can(monkeypatch: pytest.MonkeyPatch) -> None:
    """``zeropp demo`` runs on the emulated cluster with the link asked for where the cluster can
    be built; elsewhere on local processes, saying why; a malformed rate is an error."""
    from zeropp.tools import demo

    assert demo.where_to_run("none") == (None, None) and demo.where_to_run("unlimited") == (None, None)
    with pytest.raises(ValueError, match="bandwidth 'fast' is not a rate"):
        demo.where_to_run("fast")
    monkeypatch.setattr(demo, "check_support", lambda: "the emulated cluster needs root")
    assert demo.where_to_run("100mbit") == (None, "the emulated cluster needs root")
    monkeypatch.setattr(demo, "check_support", lambda: None)
    assert demo.where_to_run("100mbit") == ("100mbit", None)
