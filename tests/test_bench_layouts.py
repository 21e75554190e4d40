"""``zeropp bench layouts``' job on real gloo ranks, without the emulated cluster's links: torchtitan's
expert parallel and pipeline parallel layouts each built twice, by torchtitan alone and with
zeropp's qwZ + qgZ, from the same initial weights, one step each on the same batch."""

from __future__ import annotations

import sys

import pytest
import torch.distributed.fsdp

from distributed import run_distributed

if sys.version_info < (3, 11) or not hasattr(torch.distributed.fsdp, "DataParallelMeshDims"):
    pytest.skip("torchtitan 0.3.0 needs Python >= 3.11 and torch >= 2.13", allow_module_level=True)


def _measure(rank: int, world_size: int, layout: str) -> dict | None:
    from zeropp.tools.bench import layouts

    return layouts.measure(layout, steps=1, warmup_steps=0, wire=False)


@pytest.mark.parametrize(("layout", "ranks_per_node"), [("ep", "2"), ("pp", "1")])
def test_both_systems_train_the_layout_from_the_same_weights(layout: str, ranks_per_node: str) -> None:
    """The first step's global loss: the same weights and batch, so the two differ only by qwZ's
    INT8 weights in forward (relative weight errors under 1%: the loss moves, by far less than
    1%); zeropp's ledger holds its quantized gathers and reductions across nodes, torchtitan's
    run none (FSDP2 alone is not counted), and an expert parallel run its token exchanges, inside
    the nodes."""
    from zeropp.tools.bench.layouts import BASELINE, rows_of

    record = run_distributed(_measure, 4, layout, env={"ZEROPP_RANKS_PER_NODE": ranks_per_node}, timeout=300)[0]
    plain, both = record["systems"][BASELINE], record["systems"]["qwz_qgz"]
    loss, quantized = plain["losses"][0], both["losses"][0]
    assert 0 < abs(quantized - loss) <= 1e-2 * loss, (loss, quantized)
    assert plain["ledger_cross_node_bytes"] == {}
    assert both["ledger_cross_node_bytes"]["qwZ"] > 0 and both["ledger_cross_node_bytes"]["qgZ"] > 0
    if layout == "ep":
        assert both["ledger_cross_node_bytes"]["ep_tokens"] == 0  # expert parallel 2 inside each node
    rows = rows_of(record, "unlimited")
    assert [r["system"] for r in rows] == [BASELINE, "qwz_qgz"] and rows[0]["vs_torchtitan"] == 1.0
    assert rows[0]["cross_node_mb"] is None  # no links read without the emulated cluster
