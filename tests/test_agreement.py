"""Ranks that disagree on the config, the topology or the model get one clear error on every rank,
before any collective can mismatch (zeropp.setup.checks)."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

import zeropp
from distributed import run_distributed
from zeropp.setup.checks import describe_disagreement

TWO_BY_TWO = {"ZEROPP_RANKS_PER_NODE": "2"}


def _model(width: int = 16) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Sequential(nn.Linear(width, 16), nn.Linear(16, 16)), nn.Linear(16, 4))


def _error(call) -> str:
    try:
        call()
    except ValueError as error:
        return str(error)
    return "no error"


def _disagreeing_worker(rank: int, world_size: int) -> dict:
    """Each case on one process group: the failed check leaves it usable for the next."""
    out = {}
    out["config"] = _error(lambda: zeropp.shard(_model(), zeropp.ZeroPPConfig(quantized_weights=rank == 0)))
    os.environ["ZEROPP_RANKS_PER_NODE"] = "1" if rank >= 2 else "2"
    out["topology"] = _error(lambda: zeropp.shard(_model()))
    os.environ["ZEROPP_RANKS_PER_NODE"] = "2"
    out["shape"] = _error(lambda: zeropp.shard(_model(width=17 if rank == 3 else 16)))
    model = _model()
    fully_shard(model[0])
    fully_shard(model)
    out["enable"] = _error(lambda: zeropp.enable(model, zeropp.ZeroPPConfig(hpz_partition_size=1 + (rank == 1))))
    out["agreeing"] = _error(lambda: zeropp.shard(_model(), zeropp.ZeroPPConfig(quantized_gradients=True)))
    return out


def test_ranks_that_disagree_get_the_same_error_naming_the_difference() -> None:
    """A config field, the topology, a parameter's shape, and enable's config differing on some
    ranks: every rank raises the same ValueError naming the entry, each value and its ranks (no
    abort inside gloo); ranks that agree shard as usual."""
    results = run_distributed(_disagreeing_worker, 4, env=TWO_BY_TWO)
    for case in ("config", "topology", "shape", "enable"):
        assert len({r[case] for r in results}) == 1, case
    first = results[0]
    assert "ranks disagree on ZeroPPConfig.quantized_weights: True on rank 0; False on ranks 1-3" in first["config"]
    assert ("ranks disagree on topology: 2 nodes x 2 ranks per node on ranks 0, 1; "
            "4 nodes x 1 ranks per node on ranks 2, 3") in first["topology"]
    assert ("ranks disagree on parameter 0.0.weight: shape (16, 16), torch.float32, requires_grad=True on "
            "ranks 0-2; shape (16, 17), torch.float32, requires_grad=True on rank 3") in first["shape"]
    assert "ranks disagree on ZeroPPConfig.hpz_partition_size: 1 on ranks 0, 2, 3; 2 on rank 1" in first["enable"]
    assert "ZEROPP_RANKS_PER_NODE" in first["config"]
    assert all(r["agreeing"] == "no error" for r in results)


@pytest.mark.parametrize("views,expected", [
    ([[("a", "1"), ("b", "2")], [("a", "1"), ("b", "3")]], "disagree on b: 2 on rank 0; 3 on rank 1"),
    ([[("a", "1")], [("a", "1"), ("b", "2")]], "disagree on b: (absent) on rank 0; 2 on rank 1"),
    ([[("a", "x")]] * 3 + [[("a", "y")]] + [[("a", "x")]] * 2, "disagree on a: x on ranks 0-2, 4, 5; y on rank 3"),
])
def test_describe_disagreement_names_the_first_entry_that_differs(views, expected) -> None:
    assert expected in describe_disagreement(views)
