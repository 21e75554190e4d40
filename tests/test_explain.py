"""``zeropp.explain``: the plan's bytes per training step are the ledger's bytes of a real step, on
1-D, tensor parallel x FSDP and HSDP layouts; a bare model's plan is the sharded model's; a
refused layout is printed with its reason."""

from __future__ import annotations

import pytest
import torch

import zeropp
from distributed import run_distributed
from models import global_batch, make_model, rows
from zeropp.setup.plan import plan_bare
from zeropp.setup.sharding import select_units

ENV = {"ZEROPP_RANKS_PER_NODE": "2"}
ALL = {"quantized_weights": True, "hpz_partition_size": 2, "quantized_gradients": True}


def _one_step(rank: int, world_size: int, layout: str, options: dict) -> dict:
    if layout == "1d":
        bare = make_model("gpt")
        config = zeropp.ZeroPPConfig(**options)
        before = zeropp.explain(bare, config)
        model = zeropp.shard(bare, config)
        x, y = global_batch(0, 8)
        step = lambda: model(rows(x, rank, world_size), rows(y, rank, world_size))[1]  # noqa: E731
    else:
        from test_meshes import _loss, _sharded

        before = None
        model, dp_rank = _sharded(layout, 2, options)
        step = lambda: _loss(model, dp_rank)  # noqa: E731
    explanation = zeropp.explain(model)
    if options.get("weight_deltas"):  # the steps after the first: a full refresh, then an optimizer step
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        step().backward()
        optimizer.step()
        optimizer.zero_grad()
    ledger = zeropp.comm_ledger()
    ledger.reset()
    step().backward()
    measured = {technique: {count: totals[count] for count in ("calls", "bytes", "cross_node_bytes")}
                for technique, totals in ledger.summary()["by_technique"].items()}
    return {"explained": explanation.by_technique(), "measured": measured, "table": str(explanation),
            "cross_node": explanation.cross_node_bytes, "measured_cross_node":
            ledger.summary()["total"]["cross_node_bytes"],
            "before": None if before is None else (before.by_technique(), before.cross_node_bytes)}


CASES = {
    "1-D, all three, sliced": ("1d", {**ALL, "grad_slice_bytes": 4096}),
    "1-D, two-hop gather, overlap, error feedback": ("1d", {**ALL, "hierarchical_gather": True, "overlap": True,
                                                             "error_feedback": True, "grad_bits_intra": 8}),
    "1-D, ZeRO-3": ("1d", {}),
    "1-D, all three, embeddings' and norms' gradients at 8 bits, sliced": (
        "1d", {**ALL, "grad_wide_parameters": ("*embedding*", "*norm*"), "grad_slice_bytes": 4096}),
    "1-D, all three with weight differences": ("1d", {**ALL, "weight_deltas": True}),
    "1-D, weight differences over a copy kept as codes": ("1d", {"hpz_partition_size": 2, "weight_deltas": True,
                                                               "delta_reference": "codes"}),
    "tensor parallel 2 x FSDP, qwZ and qgZ": ("tp", {"quantized_weights": True, "quantized_gradients": True}),
    "HSDP, quantized replicas and qgZ": ("hsdp", {"quantized_gradients": True, "quantized_replica_gradients": True}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_explained_bytes_are_the_ledgers_of_a_step(case: str) -> None:
    layout, options = CASES[case]
    for rank, result in enumerate(run_distributed(_one_step, 4, layout, options, env=ENV)):
        assert result["explained"] == result["measured"], (rank, result["table"])
        assert result["cross_node"] == result["measured_cross_node"]
        if result["before"] is not None:  # the bare model's plan: the same collectives
            assert result["before"] == (result["explained"], result["cross_node"])
    table = result["table"]
    assert "the root" in table and "cross-node MB" in table and "refused" not in table
    if options.get("quantized_gradients"):
        assert "qgZ" in table and result["cross_node"] > 0


def _refused(rank: int, world_size: int) -> str:
    from test_meshes import _sharded

    model, _ = _sharded("tp", 2, None)
    explanation = zeropp.explain(model, zeropp.ZeroPPConfig(quantized_weights=True, hpz_partition_size=2))
    return str(explanation)


def test_a_refused_layout_is_printed_with_its_reason() -> None:
    """hpZ on tensor parallel 2 x FSDP over 2 nodes of 2: one data-parallel rank per node, so no
    node copy to keep. ``explain`` still prints the plan, and the refusal with its reason."""
    table = run_distributed(_refused, 4, env=ENV)[0]
    assert "refused:" in table and "a node holds no partition of its data-parallel group" in table


def test_a_bare_models_plan_needs_no_process_group() -> None:
    """Planning reads the model alone: 4 ranks as 2 x 2 from one process, nothing built."""
    model = make_model("gpt")
    config = zeropp.ZeroPPConfig(**ALL)
    topology = zeropp.Topology(num_nodes=2, ranks_per_node=2)
    plan = plan_bare(model, config, topology, select_units(model, None))
    assert [unit.name for unit in plan.units] == ["the root", "blocks.0", "blocks.1"]
    assert {unit.secondary for unit in plan.units} == {"codes"} and not plan.refusals
    explanation = zeropp.explain(plan)
    assert explanation.cross_node_bytes > 0 and "blocks.1" in str(explanation)
    assert torch.distributed.is_initialized() is False
