"""The cost model on torchtitan's pipeline parallel layout ([Note: pipeline parallel in the plan] in
``zeropp.tools.plan.pipeline``): stages of whole nodes, each unit gathered once a step and reduced
once, the 1F1B bubble, a stage's memory, the refusals, and ``zeropp plan --pipeline-parallel``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from zeropp.config import ZeroPPConfig
from zeropp.fsdp.ledger import Op
from zeropp.setup.topology import Topology
from zeropp.tools.plan import model as model_shape
from zeropp.tools.plan import pipeline, traffic
from zeropp.tools.plan.cost import Workload
from zeropp.tools.plan.layout import Layout
from zeropp.tools.plan.scale import H100_NODE

ROOT = Path(__file__).resolve().parents[1]
PRECISION = traffic.Precision(gather_dtype=torch.bfloat16, reduce_dtype=torch.float32)
WIDTH, VOCAB, LAYERS = 512, 1024, 8
BLOCK = model_shape.UnitShape("Block", ((4 * WIDTH, WIDTH), (WIDTH, 4 * WIDTH), (WIDTH,)), (True,) * 3)
ROOT_UNIT = model_shape.UnitShape("root", ((VOCAB, WIDTH), (WIDTH,), (VOCAB, WIDTH)), (True,) * 3, is_block=False)
MODEL = model_shape.ModelShape(name="toy", units=(BLOCK,) * LAYERS + (ROOT_UNIT,), num_layers=LAYERS, embed_dim=WIDTH,
                               num_heads=8, vocab_size=VOCAB)
CLUSTER = Topology(num_nodes=8, ranks_per_node=8)
WORKLOAD = Workload(batch_per_rank=2, context_length=256, precision=PRECISION)
BOTH = ZeroPPConfig(quantized_weights=True, quantized_gradients=True)


@pytest.mark.parametrize("degree", [1, 2, 3, 8])
def test_stages_hold_the_blocks_in_order_the_embedding_first_the_head_last(degree: int) -> None:
    stages = pipeline.stage_models(MODEL, degree)
    assert sum(s.num_parameters for s in stages) == MODEL.num_parameters
    assert [s.num_layers for s in stages] == [LAYERS // degree + (i < LAYERS % degree) for i in range(degree)]
    assert stages[0].units[-1].shapes[0] == (VOCAB, WIDTH)  # the embedding
    assert stages[-1].units[-1].shapes[-2:] == ((WIDTH,), (VOCAB, WIDTH))  # the final norm and the head
    middle = stages[1:-1]
    assert all(all(u.is_block for u in s.units) for s in middle)


def test_a_stage_is_whole_nodes_of_the_cluster() -> None:
    assert pipeline.stage_topology(CLUSTER, 4) == Topology(num_nodes=2, ranks_per_node=8)
    for degree in (3, 16):  # 64 / 3 ranks; stages of 4 ranks, half a node
        with pytest.raises(ValueError, match=f"pipeline degree {degree} must divide the 64 ranks into stages of "
                                             "whole nodes"):
            pipeline.stage_topology(CLUSTER, degree)


@pytest.mark.parametrize("config", [ZeroPPConfig(), BOTH], ids=["zero3", "qwz_qgz"])
def test_each_unit_is_gathered_once_and_reduced_once_on_its_stage(config: ZeroPPConfig) -> None:
    """A stage's collectives are the 1-D plan's on the stage's nodes, less backward's gathers and
    the presence exchange: byte for byte its forward gather and its reduction."""
    stage, group = pipeline.stage_models(MODEL, 2)[1], pipeline.stage_topology(CLUSTER, 2)
    priced = pipeline._stage_transfers(stage, config, group, WORKLOAD)
    flat = traffic.step_transfers(stage, config, group, PRECISION, Layout())
    for kept, every in zip(priced, flat, strict=True):
        assert kept == [t for t in every if (t.op is not Op.ALL_GATHER or t.phase == "forward")
                        and t.technique != "presence"]
        assert [t.op for t in kept if t.op is Op.ALL_GATHER] == [Op.ALL_GATHER]
        assert any(t.op is not Op.ALL_GATHER for t in kept)


def test_the_1f1b_bubble_and_compute_with_free_links() -> None:
    """With links that cost nothing the step is the schedule's (m + p - 1) slots of one
    microbatch's forward and backward, plus the optimizer: (p - 1) / m of the compute idle."""
    free = dataclasses.replace(H100_NODE, inter_node_bytes_per_s=1e30, intra_node_bytes_per_s=1e30, latency_s=0.0,
                               hop_latency_s=0.0, codec_elements_per_s=1e30)
    degree, model = 4, dataclasses.replace(MODEL, units=(BLOCK,) * 8 + (model_shape.UnitShape(
        "root", ((WIDTH,),), (True,), is_block=False),))  # stages of equal compute
    step = pipeline.pipeline_step(model, None, CLUSTER, WORKLOAD, free, degree)
    microbatches = degree * WORKLOAD.batch_per_rank
    assert step.gathers_s == pytest.approx(0.0, abs=1e-12)
    assert step.reduce_s == pytest.approx(0.0, abs=1e-12)
    assert step.bubble_s == pytest.approx(step.compute_s * (degree - 1) / microbatches, rel=1e-3)
    assert step.step_s == pytest.approx(step.compute_s + step.bubble_s + step.optimizer_s, rel=1e-3)


def test_a_stage_holds_its_weights_and_gradients_whole() -> None:
    """torchtitan keeps a stage's units whole through the step, and FSDP2 accumulates their
    gradients whole in the reduce dtype between microbatches: 2 + 4 bytes per stage parameter
    besides the sharded state (16 bytes over the stage's ranks) and the activations."""
    step = pipeline.pipeline_step(MODEL, None, CLUSTER, WORKLOAD, H100_NODE, 2)
    stage = pipeline.stage_models(MODEL, 2)[0]  # the peak: as many parameters, twice the microbatches in flight
    numel = sum(sum(traffic.padded_numels(u, 32)) for u in stage.units)
    assert step.memory["sharded_state"] == pytest.approx(numel / 32 * 16)
    assert numel * 2 <= step.memory["weights"] <= numel * 2 * 1.5
    assert numel * 4 <= step.memory["gradients"] <= numel * 4 * 1.5
    assert step.memory["total"] == pytest.approx(sum(v for k, v in step.memory.items() if k != "total"))


def test_qwz_and_qgz_cut_a_stage_s_cross_node_bytes() -> None:
    plain = pipeline.pipeline_step(MODEL, None, CLUSTER, WORKLOAD, H100_NODE, 2)
    both = pipeline.pipeline_step(MODEL, BOTH, CLUSTER, WORKLOAD, H100_NODE, 2)
    # each of a node's 8 ranks sends its 4 microbatches' activations (or their gradients) to the other stage
    sends = 8 * 4 * WORKLOAD.context_length * WIDTH * 2
    assert both.cross_node_bytes_per_node < 0.5 * plain.cross_node_bytes_per_node
    assert both.cross_node_bytes_per_node > sends  # the sends are not compressed, the stage's collectives add
    assert both.step_s < plain.step_s


def test_refusals_name_what_to_change() -> None:
    with pytest.raises(ValueError, match="hpz_partition_size=8 under pipeline parallel.*set it to 1"):
        pipeline.pipeline_step(MODEL, ZeroPPConfig(hpz_partition_size=8), CLUSTER, WORKLOAD, H100_NODE, 2)
    with pytest.raises(ValueError, match="microbatch size 3 must divide the 4 sequences"):
        pipeline.pipeline_step(MODEL, None, CLUSTER, WORKLOAD, H100_NODE, 2, microbatch_size=3)
    with pytest.raises(ValueError, match="pipeline degree 16 is more than toy's 8 blocks"):
        pipeline.stage_models(MODEL, 16)


def _plan(argv: list[str]) -> tuple[int, argparse.Namespace]:
    from zeropp.tools.cli import build_parser

    argv = ["plan", *argv]
    args = build_parser(argv).parse_args(argv)
    return args.func(args), args


def test_the_command_prices_llama3_70b_under_pipeline_parallel(capsys) -> None:
    """``zeropp plan --pipeline-parallel 4`` on Llama-3-70B: the modes without hpZ, hpZ's named as left out."""
    argv = ["--machine", "h100", "--gpus", "64", "--inter-node-gbit", "100", "--context", "4096",
            "--model", f"hf:{ROOT / 'benchmarks/configs/llama3-70b.json'}", "--modes", "zero3,qwz_qgz,all",
            "--pipeline-parallel", "4"]
    assert _plan(argv)[0] == 0
    table = capsys.readouterr().out
    assert "pipeline 4 x FSDP 16, 8 microbatches of 1 (1F1B)" in table
    assert "not priced under pipeline parallel: all" in table
    assert _plan([*argv, "--json"])[0] == 0
    record = json.loads(capsys.readouterr().out)
    zero3, both = record["modes"]
    assert (zero3["mode"], both["mode"]) == ("zero3", "qwz_qgz")
    assert both["speedup_vs_zero3"] > 1 and both["cross_node_bytes_per_node"] < zero3["cross_node_bytes_per_node"]
    assert math.isclose(zero3["speedup_vs_zero3"], 1.0)
    assert _plan([*argv[:-1], "3"])[0] == 2
    assert "pipeline degree 3 must divide the 64 ranks" in capsys.readouterr().err
