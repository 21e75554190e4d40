"""The cost model on torchtitan's expert parallel layout ([Note: expert parallel in the plan] in
``zeropp.tools.plan.layout``): the experts' own shard group placed on nodes, each block's two
parameter groups' bytes, the tokens' all-to-alls, the active parameters of an MoE, and the
``zeropp plan --expert-parallel`` table. An MoE block of shapes whose every slice is whole
blocks, so each figure follows from the math."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from zeropp.config import ZeroPPConfig
from zeropp.fsdp.ledger import GroupKind, Op
from zeropp.setup.topology import Topology
from zeropp.tools.modes import MODES
from zeropp.tools.plan import cost, memory, table, traffic
from zeropp.tools.plan import model as model_shape
from zeropp.tools.plan.cli import model_from_arg
from zeropp.tools.plan.layout import Layout, layout_for

ROOT = Path(__file__).resolve().parents[1]
PRECISION = traffic.Precision(gather_dtype=torch.bfloat16, reduce_dtype=torch.float32)
WIDTH, EXPERTS, INNER, TOP_K, VOCAB = 512, 64, 128, 2, 1024
ATTENTION = ((WIDTH, WIDTH),) * 4
ROUTED = ((EXPERTS, 2 * INNER, WIDTH), (EXPERTS, WIDTH, INNER))
BLOCK = model_shape.UnitShape("MoeBlock", (*ATTENTION, (EXPERTS, WIDTH), *ROUTED), (True,) * 7,
                              experts=(False,) * 5 + (True, True))
ROOT_UNIT = model_shape.UnitShape("root", ((VOCAB, WIDTH), (VOCAB, WIDTH)), (True, True), is_block=False)
MOE = model_shape.ModelShape(name="moe", units=(BLOCK, BLOCK, ROOT_UNIT), num_layers=2, embed_dim=WIDTH,
                             num_heads=4, vocab_size=VOCAB, num_experts=EXPERTS, experts_per_token=TOP_K)
H100S = Topology(num_nodes=8, ranks_per_node=8)


@pytest.mark.parametrize(("degree", "nodes", "per_node"), [(2, 8, 4), (8, 8, 1), (16, 4, 1), (64, 1, 1)])
def test_the_experts_shard_group_on_nodes(degree: int, nodes: int, per_node: int) -> None:
    """EP groups are consecutive ranks; the experts' FSDP group holds one EP index: D / e ranks on
    every node when e divides D, one rank on each of W / e nodes when e is a multiple of D."""
    assert Layout(expert_parallel=degree).expert_group(H100S) == Topology(num_nodes=nodes, ranks_per_node=per_node)


def test_layouts_the_plan_does_not_price_are_refused() -> None:
    with pytest.raises(ValueError, match="must divide the 8 ranks per node or be a multiple"):
        Layout(expert_parallel=3).expert_group(Topology(num_nodes=3, ranks_per_node=8))
    with pytest.raises(ValueError, match="not with tensor_parallel=2"):
        Layout(expert_parallel=2, tensor_parallel=2)
    with pytest.raises(ValueError, match="with expert parallel is not priced"):
        layout_for(MODES["all"].config(8), Layout(expert_parallel=8))
    with pytest.raises(ValueError, match="must divide the 64 experts of MoeBlock"):
        Layout(expert_parallel=128).parts(BLOCK, Topology(num_nodes=16, ranks_per_node=8))


def test_a_blocks_two_parameter_groups_and_their_gathers() -> None:
    """Expert parallel 8 on 8 x 8: the block's attention and router over all 64 ranks, its
    experts (8 of 64 per EP rank) over the 8 ranks of one EP index, one per node. ZeRO-3's
    forward gathers: each rank sends its 1/64 and its 1/8 chunk to every peer, in bf16."""
    layout = Layout(expert_parallel=8)
    (dense, world), (routed, experts) = layout.parts(BLOCK, H100S)
    assert world == H100S and experts == Topology(num_nodes=8, ranks_per_node=1)
    assert routed.shapes == ((8, 2 * INNER, WIDTH), (8, WIDTH, INNER))
    assert dense.shapes == (*ATTENTION, (EXPERTS, WIDTH))
    gathers = [t for t in traffic.unit_transfers(BLOCK, ZeroPPConfig(), H100S, PRECISION, layout)
               if t.op is Op.ALL_GATHER and t.phase == "forward"]
    assert [(t.kind, t.group_size, t.bytes_per_peer) for t in gathers] == [
        (GroupKind.WORLD, 64, (4 * WIDTH * WIDTH + EXPERTS * WIDTH) // 64 * 2),
        (GroupKind.INTER, 8, 8 * 3 * INNER * WIDTH // 8 * 2)]
    # the rank's shards: the same elements as without expert parallel, split otherwise
    shards = cost.sharded_parameters(MOE, ZeroPPConfig(), H100S, layout)
    assert shards == cost.sharded_parameters(MOE, ZeroPPConfig(), H100S, Layout())


def test_the_tokens_all_to_alls() -> None:
    """Per MoE block and step: every token's top-2 copies out and back, forward and backward,
    plus the recomputed forward's with checkpointing; a 1/e share to each EP peer; inside the
    node when e divides D, across 2 nodes when e = 2 D."""
    tokens = 2 * 4096  # batch 2 of 4096
    for degree, kind in ((8, GroupKind.INTRA), (16, GroupKind.MIXED)):
        layout = Layout(expert_parallel=degree)
        per_unit = traffic.expert_parallel_transfers(MOE, H100S, layout, PRECISION, 2, 4096, checkpointing=True)
        assert per_unit[2] == []  # the root routes nothing
        block = per_unit[0]
        assert [t.phase for t in block] == ["forward"] * 2 + ["backward"] * 4
        assert {(t.op, t.kind, t.group_size, t.bytes_per_peer, t.technique) for t in block} == {
            (Op.ALL_TO_ALL, kind, degree, tokens * TOP_K * WIDTH * 2 // degree, "ep_tokens")}
        crossing = cost.link_bytes(block[0], H100S, "nccl")[1]
        assert crossing == (0 if degree == 8 else 8 * 8 * tokens * TOP_K * WIDTH * 2 // 16)


def test_expert_parallel_holds_less_gathered_and_moves_the_same_shards() -> None:
    """A block's whole gathered weights under expert parallel 8: its attention and router, and
    an eighth of its experts."""
    config = ZeroPPConfig()
    plain = memory.unit_bytes(BLOCK, MOE, config, H100S, PRECISION, 0, (1, 512), False, layout=Layout())
    expert = memory.unit_bytes(BLOCK, MOE, config, H100S, PRECISION, 0, (1, 512), False,
                               layout=Layout(expert_parallel=8))
    dense = 4 * WIDTH * WIDTH + EXPERTS * WIDTH
    routed = 3 * INNER * WIDTH * EXPERTS
    assert plain.whole == (dense + routed) * 2 and expert.whole == (dense + routed // 8) * 2
    assert expert.activations == plain.activations and expert.shard == plain.shard


def test_an_moes_active_parameters_and_its_step() -> None:
    """Qwen3-30B-A3B from its config: 30.5B parameters, 3.3B active per token (its model card's
    figures); ``zeropp plan --expert-parallel 8`` on 64 H100s prices zero3 and qwZ + qgZ, leaves
    hpZ's modes out, and the experts' mesh shrinks what a block gathers."""
    shape = model_from_arg(f"hf:{ROOT / 'benchmarks/configs/qwen3-30b-a3b.json'}", 4096)
    assert shape.num_experts == 128 and shape.experts_per_token == 8
    assert math.isclose(shape.num_parameters, 30.53e9, rel_tol=1e-3)
    assert math.isclose(shape.active_parameters, 3.35e9, rel_tol=1e-2)
    workload = cost.Workload(batch_per_rank=1, context_length=4096, precision=PRECISION)
    from zeropp.tools.plan.scale import H100_NODE

    record = table.plan_record(shape, H100S, workload, H100_NODE, ("zero3", "qwz_qgz", "all"), expert_parallel=8)
    rows = {row["mode"]: row for row in record["modes"]}
    assert set(rows) == {"zero3", "qwz_qgz"} and record["left_out"] == ["all"]
    assert rows["qwz_qgz"]["cross_node_bytes_per_node"] < rows["zero3"]["cross_node_bytes_per_node"] / 2
    without = table.plan_record(shape, H100S, workload, H100_NODE, ("zero3",))["modes"][0]
    assert rows["zero3"]["device_memory"]["gathered"] < without["device_memory"]["gathered"]
    json.dumps(record)
    assert "expert parallel 8" in table.format_record(record)
    dense = model_from_arg(f"hf:{ROOT / 'benchmarks/configs/llama3-8b.json'}", 4096)
    with pytest.raises(ValueError, match="has no routed experts"):
        table.plan_record(dense, H100S, workload, H100_NODE, ("zero3",), expert_parallel=8)
