"""Topology validation and the ledger's byte model; no process group needed."""

from __future__ import annotations

import pytest
import torch

from zeropp.fsdp.ledger import CommLedger, GroupInfo, GroupKind, Op, group_kind
from zeropp.setup.topology import Topology, check_hosts


def test_from_env_reads_local_world_size_and_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.delenv("ZEROPP_RANKS_PER_NODE", raising=False)
    assert Topology.from_env(world_size=8) == Topology(num_nodes=2, ranks_per_node=4)
    monkeypatch.setenv("ZEROPP_RANKS_PER_NODE", "2")
    assert Topology.from_env(world_size=8) == Topology(num_nodes=4, ranks_per_node=2)
    assert Topology.from_env(ranks_per_node=1, world_size=8) == Topology(num_nodes=8, ranks_per_node=1)


def test_from_env_defaults_to_one_node(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("LOCAL_WORLD_SIZE", "ZEROPP_RANKS_PER_NODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert Topology.from_env() == Topology(num_nodes=1, ranks_per_node=3)


@pytest.mark.parametrize("world,per_node,match", [
    (6, 4, r"world size 6 is not a multiple of ranks_per_node=4.*\[1, 2, 3, 6\]"),
    (4, 0, "ranks_per_node must be a positive int, got 0"),
    (4, True, "ranks_per_node must be a positive int, got True"),
])
def test_from_world_errors(world: int, per_node: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Topology.from_world(world, per_node)


def test_bad_environment_value_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZEROPP_RANKS_PER_NODE", "two")
    with pytest.raises(ValueError, match="ZEROPP_RANKS_PER_NODE='two' must be an integer"):
        Topology.from_env(world_size=4)


def test_topology_fields_validated() -> None:
    with pytest.raises(ValueError, match="Topology.num_nodes must be a positive int, got -1"):
        Topology(num_nodes=-1, ranks_per_node=2)


def test_node_arithmetic_is_node_contiguous() -> None:
    t = Topology(num_nodes=3, ranks_per_node=2)
    assert [t.node_of(r) for r in range(6)] == [0, 0, 1, 1, 2, 2]
    assert t.node_ranks(1) == [2, 3]
    assert t.peer_ranks(1) == [1, 3, 5]
    assert t.local_rank_of(5) == 1


def test_check_hosts() -> None:
    t = Topology(num_nodes=2, ranks_per_node=2)
    check_hosts(t, ["a", "a", "b", "b"])
    check_hosts(t, ["a"] * 4)  # emulated: two claimed nodes on one host is allowed
    with pytest.raises(ValueError, match=r"claimed node 0 \(ranks \[0, 1\]\) spans hosts \['a', 'b'\]"):
        check_hosts(t, ["a", "b", "a", "b"])
    with pytest.raises(ValueError, match="3 hostnames for a world of 4"):
        check_hosts(t, ["a", "a", "b"])


def test_group_kinds() -> None:
    t = Topology(num_nodes=2, ranks_per_node=4)
    assert group_kind(t, list(range(8))) is GroupKind.WORLD
    assert group_kind(t, [4, 5]) is GroupKind.INTRA
    assert group_kind(t, [1, 5]) is GroupKind.INTER
    assert group_kind(t, [0, 1, 4]) is GroupKind.MIXED


def test_ledger_direct_send_model() -> None:
    """2 nodes x 4: an all-gather of a 10-byte chunk on the world sends 7 x 10 bytes, 4 x 10 of
    them to the other node; an all-reduce counts twice (reduce-scatter + all-gather)."""
    t = Topology(num_nodes=2, ranks_per_node=4)
    ledger = CommLedger()
    world = GroupInfo.of(t, list(range(8)), rank=1)
    intra = GroupInfo.of(t, [0, 1, 2, 3], rank=1)
    ledger.record(Op.ALL_GATHER, world, 10, torch.bfloat16, "fsdp")
    ledger.record(Op.ALL_GATHER, intra, 10, torch.bfloat16, "fsdp")
    ledger.record(Op.ALL_REDUCE, world, 3, torch.float32, "metrics")
    s = ledger.summary()
    # gloo rings: rank 1's successor (2) is on its node, so its ring sends stay there.
    assert s["by_group"]["world"] == {"calls": 2, "bytes": 70 + 42, "cross_node_bytes": 40 + 24,
                                      "backend_bytes": 70 + 42, "backend_cross_node_bytes": 0}
    assert s["by_group"]["intra"] == {"calls": 1, "bytes": 30, "cross_node_bytes": 0,
                                      "backend_bytes": 30, "backend_cross_node_bytes": 0}
    last = GroupInfo.of(t, list(range(8)), rank=3)  # its successor, 4, is on the other node
    assert last.backend_sends(Op.REDUCE_SCATTER, 10, 70, 40) == (140, 140)
    assert last.backend_sends(Op.ALL_TO_ALL, 10, 70, 40) == (70, 40)
    assert s["by_op"]["all_gather"]["bytes"] == 100
    assert ledger.summary(technique="metrics")["total"]["calls"] == 1
    with ledger.suspended():
        ledger.record(Op.ALL_GATHER, world, 10, torch.bfloat16, "fsdp")
    assert ledger.summary()["total"]["calls"] == 3
    ledger.step()
    ledger.step()
    assert "all_gather" in ledger.table()
    assert ledger.report()["fsdp"] == {"calls": 1.0, "bytes": 50.0, "cross_node_bytes": 20.0,
                                       "backend_bytes": 50.0, "backend_cross_node_bytes": 0.0}
    ledger.reset()
    assert set(ledger.summary()["total"].values()) == {0}
