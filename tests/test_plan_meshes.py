"""The cost model on 2-D layouts (``zeropp.tools.plan.layout``): tensor parallel x FSDP and HSDP,
plain and with the replicas' quantized reduction. Bytes and memory of Llama-shaped models whose
every slice is a whole number of 256-element blocks, so each figure follows from the math: no
scale covers a partial block and no payload is padded."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from distributed import run_distributed
from test_plan import _measured_rows, _traffic_job
from zeropp.config import ZeroPPConfig
from zeropp.fsdp.ledger import GroupKind, Op
from zeropp.setup.topology import Topology
from zeropp.tools.bench.worker import WorkerConfig
from zeropp.tools.models import GPT, GPTConfig
from zeropp.tools.modes import MODES
from zeropp.tools.plan import cost, memory, scale, table, traffic
from zeropp.tools.plan import model as model_shape
from zeropp.tools.plan.layout import Layout, layout_for

BLOCK_SCALE = 4 / 256
"""Bytes of fp32 scale per element in blocks of 256."""
PRECISION = traffic.Precision(gather_dtype=torch.bfloat16, reduce_dtype=torch.float32)
TP2 = Layout(tensor_parallel=2)
HSDP = Layout(hsdp=True)


def _llama(width: int, ffn: int, kv: int, vocab: int, matrices_only: bool = False) -> model_shape.ModelShape:
    """Two Llama blocks (queries, keys, values, output, gate, up, down, two RMSNorms) and the
    root (embedding, final norm, head), as ``model_shape.hf`` reads them; ``matrices_only``:
    without the norms, so tensor parallel splits every parameter."""
    norms = () if matrices_only else ((width,), (width,))
    block = ((width, width), (kv, width), (kv, width), (width, width), (ffn, width), (ffn, width), (width, ffn), *norms)
    root = ((vocab, width), *(() if matrices_only else ((width,),)), (vocab, width))
    units = (*[model_shape.UnitShape("LlamaDecoderLayer", block, (True,) * len(block))] * 2,
             model_shape.UnitShape("root", root, (True,) * len(root), is_block=False))
    return model_shape.ModelShape(name="llama", units=units, num_layers=2, embed_dim=width, num_heads=width // 128,
                                  vocab_size=vocab, architecture="llama", ffn_dim=ffn, num_kv_heads=kv // 128)


SMALL = _llama(512, 1024, 256, 1024)
"""On one of 2 tensor parallel ranks, sharded over 2: every matrix's slice is a multiple of 256
elements, and each norm's (whole on the tensor parallel rank) 256."""
BLOCK_CHUNK = (256 * 512 + 2 * 128 * 512 + 256 * 512 + 3 * 512 * 512) // 2 + 2 * 256
"""A block's chunk on one rank of tp 2 x FSDP 2: q, k, v, o split by rows, gate and up by rows,
down by columns (each 512 x 512 on the tensor parallel rank), halved by FSDP; the norms' halves."""
ROOT_CHUNK = (2 * 512 * 512) // 2 + 256
"""The embedding and the head split by vocabulary, halved; the final norm's half."""


def _rows(mode_transfers: list[traffic.Transfer], technique: str) -> list[traffic.Transfer]:
    return [t for t in mode_transfers if t.technique == technique]


def _flat(per_unit: list[list[traffic.Transfer]]) -> list[traffic.Transfer]:
    return [t for unit in per_unit for t in unit]


def test_tensor_parallel_filling_the_node_sends_every_fsdp_byte_across_nodes() -> None:
    """Tensor parallel 2 x FSDP on 2 nodes of 2: a unit's data-parallel group is one rank per node,
    so its gathers and reduce-scatter are inter-node rings of the tensor parallel rank's chunk
    (every byte crosses), qwZ gathers them in INT8 and qgZ is one INT4 all-to-all across nodes."""
    topology = Topology(num_nodes=2, ranks_per_node=2)
    zero3 = traffic.step_transfers(SMALL, ZeroPPConfig(), topology, PRECISION, TP2)
    for unit, chunk in zip(zero3, (BLOCK_CHUNK, BLOCK_CHUNK, ROOT_CHUNK)):
        fsdp = _rows(unit, "fsdp")
        assert [(t.op, t.kind, t.group_size, t.bytes_per_peer, t.phase) for t in fsdp] == [
            (Op.ALL_GATHER, GroupKind.INTER, 2, 2 * chunk, "forward"),
            (Op.ALL_GATHER, GroupKind.INTER, 2, 2 * chunk, "backward"),
            (Op.REDUCE_SCATTER, GroupKind.INTER, 2, 4 * chunk, "backward")]
        counts = traffic.ledger_counts(fsdp, topology)
        assert counts["cross_node_bytes"] == counts["bytes"] == 4 * (2 + 2 + 4) * chunk
    quantized = traffic.step_transfers(SMALL, MODES["tp_qwz_qgz"].config(2), topology, PRECISION, TP2)
    for unit, chunk in zip(quantized, (BLOCK_CHUNK, BLOCK_CHUNK, ROOT_CHUNK)):
        gathers, qgz = _rows(unit, "qwZ"), _rows(unit, "qgZ")
        assert [(t.kind, t.group_size, t.bytes_per_peer) for t in gathers] == [
            (GroupKind.INTER, 2, chunk * (1 + BLOCK_SCALE))] * 2
        assert [(t.op, t.kind, t.group_size, t.bytes_per_peer, t.dtype) for t in qgz] == [
            (Op.ALL_TO_ALL, GroupKind.INTER, 2, chunk * (0.5 + BLOCK_SCALE), "int4")]
        assert traffic.ledger_counts(qgz, topology)["cross_node_bytes"] == 4 * chunk * (0.5 + BLOCK_SCALE)


def test_tensor_parallel_with_two_ranks_of_each_node_in_the_group() -> None:
    """Tensor parallel 2 on 2 nodes of 4: the data-parallel group holds 2 ranks of each node (a
    mixed group of 4), its ring sends 2 of its 3 peers' bytes across nodes and the node link
    carries two such rings; qgZ takes both hops, 2 inside the node and 2 across."""
    topology = Topology(num_nodes=2, ranks_per_node=4)
    model = _llama(1024, 2048, 512, 1024)  # each norm's slice over the group of 4: 256 elements
    chunk = sum(sum(traffic.padded_numels(u, 4)) for u in TP2.local_units(model)[:1]) // 4
    unit, *_ = traffic.step_transfers(model, ZeroPPConfig(), topology, PRECISION, TP2)
    gather = unit[0]
    assert (gather.kind, gather.group_size, gather.bytes_per_peer) == (GroupKind.MIXED, 4, 2 * chunk)
    counts = traffic.ledger_counts([gather], topology)
    assert (counts["bytes"], counts["cross_node_bytes"]) == (8 * 3 * 2 * chunk, 8 * 2 * 2 * chunk)
    assert counts["backend_cross_node_bytes"] == 4 * 3 * 2 * chunk  # two rings, each node's last rank in each
    assert cost.link_bytes(gather, topology, "nccl") == (3 * 2 * chunk, 2 * 3 * 2 * chunk)
    quantized, *_ = traffic.step_transfers(model, MODES["tp_qwz_qgz"].config(4), topology, PRECISION, TP2)
    assert [(t.kind, t.group_size, t.bytes_per_peer) for t in _rows(quantized, "qgZ")] == [
        (GroupKind.INTRA, 2, 2 * chunk * (1 + BLOCK_SCALE)),  # the rows owed to the node peer's index, one per node,
        (GroupKind.INTER, 2, chunk * (0.5 + BLOCK_SCALE))]      # in INT8 (the default inside the node), then INT4


def test_tensor_parallel_all_reduces_stay_in_the_node_and_join_the_compute() -> None:
    """Each block all-reduces its t x batch sequences' activations twice in forward and twice in
    backward (twice more recomputed with checkpointing), the root five times; none crosses nodes;
    with nothing overlapped the step is the compute plus every collective, these included."""
    topology = Topology(num_nodes=2, ranks_per_node=2)
    batch, context = 3, 64
    hidden = batch * context * 512 * 2  # t x batch sequences of bf16 activations, a t-th to each peer
    for checkpointing, backward in ((False, 2), (True, 4)):
        block, _, root = traffic.tensor_parallel_transfers(SMALL, topology, TP2, PRECISION, batch, context,
                                                           checkpointing)
        assert [(t.phase, t.bytes_per_peer) for t in block] == [("forward", hidden)] * 2 + [
            ("backward", hidden)] * backward
        assert sorted((t.phase, t.bytes_per_peer) for t in root) == sorted(
            [("forward", hidden), ("backward", hidden)] + [("forward", batch * context * 4)] * 3)
        assert all((t.op, t.kind, t.group_size) == (Op.ALL_REDUCE, GroupKind.INTRA, 2) for t in block + root)
        assert cost.cross_node_bytes_per_node(block + root, topology) == 0
    assert traffic.tensor_parallel_transfers(SMALL, topology, Layout(), PRECISION, batch, context) == [[]] * 3
    workload = cost.Workload(batch_per_rank=batch, context_length=context, precision=PRECISION)
    serial = replace(scale.H100_NODE, ranks_per_node=2, overlap=0.0)
    with_tp = cost.step_time(SMALL, ZeroPPConfig(), topology, workload, serial, TP2)
    fsdp_only = sum(cost.transfer_seconds(t, topology, serial)
                    for t in _flat(traffic.step_transfers(SMALL, ZeroPPConfig(), topology, PRECISION, TP2))
                    if not t.background)
    assert with_tp.communication_s > fsdp_only
    assert with_tp.step_s == pytest.approx(with_tp.compute_s + with_tp.communication_s, rel=1e-12)


@pytest.mark.parametrize("num_nodes", [2, 4])
def test_quantized_replicas_send_int4_rows_where_hsdp_all_reduces_fp32(num_nodes: int) -> None:
    """HSDP on R nodes of 2: gathers and reduce-scatter stay in the node; across nodes FSDP2
    all-reduces each chunk in fp32, 2 (R - 1) / R x chunk x 4 bytes per rank, where the replicas'
    reduction sends 2 (R - 1) / R x chunk x (1/2 + 4/256): an all-to-all of the rows owed to the
    others, then an all-gather of the reduced rows."""
    model = _llama(2048, 4096, 1024, 2048)  # each norm's chunk over a node of 2, cut in 4 rows: 256 elements
    topology = Topology(num_nodes=num_nodes, ranks_per_node=2)
    replicas = num_nodes
    chunk = sum(sum(traffic.padded_numels(u, 2)) for u in model.units) // 2
    plain = _flat(traffic.step_transfers(model, None, topology, PRECISION))
    quantized = _flat(traffic.step_transfers(model, MODES["hsdp_quantized"].config(2), topology, PRECISION))
    for transfers in (plain, quantized):
        inside = [t for t in transfers if t.technique == "fsdp"]
        assert {t.kind for t in inside} == {GroupKind.INTRA}
        assert traffic.ledger_counts(inside, topology)["cross_node_bytes"] == 0
    across = traffic.ledger_counts(_rows(plain, "hsdp"), topology)["cross_node_bytes"]
    coded = traffic.ledger_counts(_rows(quantized, "replicas"), topology)["cross_node_bytes"]
    world = topology.world_size
    assert across == world * 2 * (replicas - 1) / replicas * chunk * 4
    assert coded == world * 2 * (replicas - 1) / replicas * chunk * (0.5 + BLOCK_SCALE)
    assert [(t.op, t.kind, t.group_size, t.dtype) for t in _rows(quantized, "replicas")[:2]] == [
        (Op.ALL_TO_ALL, GroupKind.INTER, replicas, "int4"), (Op.ALL_GATHER, GroupKind.INTER, replicas, "int4")]
    # the table's figure: each node's 2 local indices reduce at once over its link
    assert cost.cross_node_bytes_per_node(_rows(quantized, "replicas"), topology) == coded / num_nodes


def test_hsdp_with_qwz_and_qgz_stays_inside_the_node() -> None:
    """Under HSDP qwZ's comm sends the node's gathers in full precision (labelled hpZ) unless
    ``quantize_intra_node_weights``; qgZ is its first hop only, one all-to-all inside the node."""
    topology = Topology(num_nodes=2, ranks_per_node=2)
    chunk = sum(math.prod(shape) for shape in SMALL.units[0].shapes) // 2  # a block over the node's 2 ranks
    for options, gathers in (({}, [("hpZ", "bfloat16", 2 * chunk)] * 2),
                             ({"quantize_intra_node_weights": True}, [("qwZ", "int8", chunk * (1 + BLOCK_SCALE))] * 2)):
        config = ZeroPPConfig(quantized_weights=True, quantized_gradients=True, **options)
        unit, *_ = traffic.step_transfers(SMALL, config, topology, PRECISION, HSDP)
        assert [(t.technique, t.dtype, t.bytes_per_peer) for t in unit if t.op is Op.ALL_GATHER] == gathers
        assert [(t.op, t.kind, t.group_size, t.bytes_per_peer) for t in _rows(unit, "qgZ")] == [
            (Op.ALL_TO_ALL, GroupKind.INTRA, 2, chunk * (1 + BLOCK_SCALE))]  # INT8, the default inside the node
        assert _rows(unit, "hsdp")[0].kind is GroupKind.INTER


def test_replicas_buffers_counted_by_hand() -> None:
    """One block's replicas' reduction on a node of 2 x 4 replicas: its rows in fp32, the reduced
    row, then the larger of the all-to-all's packed rows (sent and received, or sent beside the
    decoded row and the sum) and the all-gather's (this rank's row and the 4 received)."""
    model = _llama(2048, 4096, 1024, 2048)
    topology = Topology(num_nodes=4, ranks_per_node=2)
    block = model.units[0]
    serial = MODES["hsdp_quantized"].config(2, overlap=False)
    unit = memory.unit_bytes(block, model, serial, topology, PRECISION, 0, (1, 64), last=False, layout=HSDP)
    row = sum(math.prod(s) for s in block.shapes) // 2 // 4
    packed = row * (0.5 + BLOCK_SCALE)
    assert unit.reducing == 4 * row * 4 + row * 4 + max(2 * 3 * packed, 3 * packed + 2 * row * 4, 5 * packed)
    plain = memory.unit_bytes(block, model, None, topology, PRECISION, 0, (1, 64), last=False)
    assert plain.reducing == 0 and replace(unit, reducing=0) == plain
    # with ``overlap``, beside the next unit's backward: the rows, the reduced row and the
    # exchange's packed rows; beside the one after: the rows and the all-gather's
    overlapped = memory.unit_bytes(block, model, MODES["hsdp_quantized_overlap"].config(2), topology, PRECISION, 0,
                                   (1, 64), last=False, layout=HSDP)
    assert (unit.late, unit.later) == (0, 0)
    assert (overlapped.late, overlapped.later) == (4 * row * 4 + row * 4 + 2 * 3 * packed, 4 * row * 4 + 5 * packed)


def test_tensor_parallel_divides_the_sharded_state_by_its_degree() -> None:
    """With every parameter split (no norms), a rank of tensor parallel 2 x FSDP over 2 ranks per
    node holds half of what a rank of FSDP alone over the same 2-rank group would: shards, AdamW's
    states, gradient shards, gathered units. Norms stay whole: the Llama's shards are counted
    by hand. Activations are those of the 2 x batch sequences, the split layers' halved."""
    topology = Topology(num_nodes=2, ranks_per_node=2)
    half_world = Topology(num_nodes=2, ranks_per_node=1)
    matrices = _llama(512, 1024, 256, 1024, matrices_only=True)
    for tp_unit, unit in zip(TP2.local_units(matrices), matrices.units):
        split = memory.unit_bytes(tp_unit, matrices, ZeroPPConfig(), topology, PRECISION, 0, (1, 64), last=False,
                                  layout=TP2)
        whole = memory.unit_bytes(unit, matrices, ZeroPPConfig(), half_world, PRECISION, 0, (1, 64), last=False)
        for name in ("shard", "optimizer", "gradient", "whole", "whole_gradients", "gather_forward", "reduce_input"):
            assert getattr(split, name) == getattr(whole, name) / 2, name
    workload = cost.Workload(batch_per_rank=1, context_length=64, precision=PRECISION)
    peak = cost.memory(SMALL, ZeroPPConfig(), topology, workload, layout=TP2)
    assert peak.parameters == 4 * (2 * BLOCK_CHUNK + ROOT_CHUNK)
    assert peak.optimizer == 2 * 4 * (2 * BLOCK_CHUNK + ROOT_CHUNK)
    sequences, h = 2 * 1, 512
    per_token = 16 * h + 8 + (4 * h + 4 * 256 + 4 * 4 + 8 * 1024) / 2
    assert SMALL.block_activation_bytes(sequences, 64, 2, 2) == sequences * 64 * per_token
    assert SMALL.head_activation_bytes(sequences, 64, 2) == sequences * 64 * (4 * 1024 / 2 + 8 * h + 4)


def test_hsdp_shards_and_replicas_on_a_rank_of_another_node() -> None:
    """Under HSDP rank 3 of 2 nodes x 2 holds the rows of local index 1, as rank 1 does; under
    tensor parallel 2 ranks 0 and 1 (one tensor parallel group) hold the same rows."""
    topology = Topology(num_nodes=2, ranks_per_node=2)
    odd = model_shape.UnitShape("odd", ((3, 512),), (True,), is_block=False)
    model = replace(SMALL, units=(odd,))
    for layout, same in ((HSDP, (1, 3)), (TP2, (0, 1))):
        rows = [memory.unit_bytes(layout.local_units(model)[0], model, None, topology, PRECISION, rank, (1, 64),
                                  last=False, layout=layout).optimizer for rank in range(4)]
        assert rows[same[0]] == rows[same[1]]
    assert [HSDP.shard_index(r, topology) for r in range(4)] == [0, 1, 0, 1]
    assert [TP2.shard_index(r, topology) for r in range(4)] == [0, 0, 1, 1]


def test_layouts_refuse_what_they_cannot_run() -> None:
    topology = Topology(num_nodes=2, ranks_per_node=4)
    with pytest.raises(ValueError, match="hpz_partition_size=4 needs every unit sharded over the whole world"):
        layout_for(ZeroPPConfig(hpz_partition_size=4), TP2)
    with pytest.raises(ValueError, match="quantized_replica_gradients=True reduces across HSDP's replicas"):
        layout_for(ZeroPPConfig(quantized_replica_gradients=True), Layout())
    with pytest.raises(ValueError, match="offload='cpu' is priced on a 1-D layout only"):
        layout_for(ZeroPPConfig(offload="cpu"), HSDP)
    with pytest.raises(ValueError, match="Layout.tensor_parallel=3 must divide the 4 ranks per node"):
        traffic.step_transfers(SMALL, ZeroPPConfig(), topology, PRECISION, Layout(tensor_parallel=3))
    with pytest.raises(ValueError, match="Layout.tensor_parallel must be a positive int, got 0"):
        Layout(tensor_parallel=0)
    assert layout_for(None) == HSDP and layout_for(ZeroPPConfig()) == Layout()
    assert layout_for(ZeroPPConfig(quantized_replica_gradients=True)) == HSDP


def test_the_existing_api_prices_the_layouts_it_always_meant() -> None:
    """``config`` alone: None is FSDP2's HSDP, a ZeroPPConfig zeropp's 1-D sharding; the same
    bytes, memory and step as with the layout spelled out."""
    shape = model_shape.transformer(num_layers=2, embed_dim=256, num_heads=4, context_length=128)
    topology = Topology(num_nodes=2, ranks_per_node=4)
    workload = cost.Workload(batch_per_rank=2, context_length=128, precision=PRECISION,
                             activation_checkpointing=True)
    for config, layout in ((None, HSDP), (MODES["all"].config(4), Layout()), (ZeroPPConfig(), Layout())):
        assert traffic.step_transfers(shape, config, topology, PRECISION) == traffic.step_transfers(
            shape, config, topology, PRECISION, layout)
        assert cost.memory(shape, config, topology, workload) == cost.memory(shape, config, topology, workload,
                                                                             layout=layout)
        assert cost.step_time(shape, config, topology, workload, scale.H100_NODE) == cost.step_time(
            shape, config, topology, workload, scale.H100_NODE, layout)


def _demo_units(config: WorkerConfig, vocab_size: int, degree: int) -> list[model_shape.UnitShape]:
    """The demo GPT's units as one rank of its ``tp_*`` modes holds them: each block's MLP split
    over ``degree`` ranks (``fc`` and its bias by rows, ``proj`` by columns), the rest whole."""
    gpt_config = GPTConfig(vocab_size=vocab_size, context_length=config.context_length, num_layers=config.num_layers,
                           num_heads=config.num_heads, embed_dim=config.embed_dim)
    shape = model_shape.gpt(gpt_config)
    with torch.device("meta"):
        names = [name for name, _ in GPT(gpt_config).blocks[0].named_parameters()]
    dims = {"mlp.fc.weight": 0, "mlp.fc.bias": 0, "mlp.proj.weight": 1}

    def split(shape: tuple[int, ...], name: str) -> tuple[int, ...]:
        if name not in dims:
            return shape
        return tuple(n // degree if d == dims[name] else n for d, n in enumerate(shape))

    return [replace(u, shapes=tuple(split(s, n) for s, n in zip(u.shapes, names))) if u.is_block else u
            for u in shape.units]


@pytest.mark.parametrize("num_nodes", [2, 3])
def test_bytes_equal_the_ledger_of_a_real_run(num_nodes: int) -> None:
    """Every ledger row of a real gloo step on ``num_nodes`` nodes of 2, all ranks summed: HSDP
    quantized (3 replicas: each parameter's slice cut in 3 rows, rounded up) as the plan prices
    the GPT; the demo's tensor parallel modes (only its MLPs split, ``_demo_units``) as the plan
    prices those shapes on the tensor parallel layout: one rank per node in each data-parallel
    group."""
    config = WorkerConfig(modes=("hsdp_quantized", "tp_zero3", "tp_qwz_qgz"), warmup_steps=1, steps=1, batch_size=12,
                          context_length=18, num_layers=2, embed_dim=48, num_heads=2, param_dtype="bfloat16")
    topology = Topology(num_nodes=num_nodes, ranks_per_node=2)
    record, *_ = run_distributed(_traffic_job, topology.world_size, config, env={"ZEROPP_RANKS_PER_NODE": "2"},
                                 timeout=300)
    shape = model_shape.gpt(GPTConfig(vocab_size=84, context_length=18, num_layers=2, num_heads=2, embed_dim=48))
    for mode in config.modes:
        zeropp_config, layout = table.mode_configs((mode,), 2)[mode]
        if layout.tensor_parallel > 1:
            predicted = [t for unit in _demo_units(config, 84, 2)
                         for t in traffic.unit_transfers(unit, zeropp_config, topology, PRECISION, layout)]
        else:
            predicted = _flat(traffic.step_transfers(shape, zeropp_config, topology, PRECISION, layout))
        measured = _measured_rows(record["modes"][mode]["ledger_per_step"])
        assert traffic.ledger_rows(predicted, topology) == measured, mode


def _plan(argv: list[str], capsys) -> str:
    from zeropp.tools.cli import build_parser

    argv = ["plan", *argv]
    args = build_parser(argv).parse_args(argv)
    assert args.func(args) == 0
    return capsys.readouterr().out


MESH_MODES = ("zero3", "hsdp", "hsdp_quantized", "tp_zero3", "tp_qwz_qgz")


def test_plan_command_prices_each_mode_on_its_layout(capsys) -> None:
    """Each row is the plan of the mode's layout; HSDP quantized sends less across nodes than
    HSDP, tensor parallel x ZeRO-3 holds about as much as ZeRO-3; with offload the 2-D layouts
    are left out."""
    argv = ["--model", "gpt:4x256", "--gpus", "16", "--machine", "h100", "--batch-per-gpu", "1",
            "--modes", ",".join(MESH_MODES)]
    table_text = _plan(argv, capsys).splitlines()
    assert [line.split()[0] for line in table_text[2:]] == list(MESH_MODES)
    rows = {row["mode"]: row for row in json.loads(_plan([*argv, "--json"], capsys))["modes"]}
    shape = model_shape.transformer(num_layers=4, embed_dim=256, num_heads=4, context_length=512)
    topology = Topology(num_nodes=2, ranks_per_node=8)
    workload = cost.Workload(batch_per_rank=1, context_length=512, precision=PRECISION, activation_checkpointing=True)
    for name, (config, layout) in table.mode_configs(MESH_MODES, 8).items():
        assert layout == table.mode_layout(MODES[name])
        assert rows[name]["step_s"] == cost.step_time(shape, config, topology, workload, scale.H100_NODE, layout).step_s
        assert rows[name]["device_memory"]["total"] == cost.memory(shape, config, topology, workload,
                                                                   layout=layout).total
    assert rows["hsdp_quantized"]["cross_node_bytes_per_node"] < rows["hsdp"]["cross_node_bytes_per_node"] / 7
    assert rows["tp_qwz_qgz"]["cross_node_bytes_per_node"] < rows["tp_zero3"]["cross_node_bytes_per_node"] / 3
    record = json.loads(_plan([*argv, "--offload", "cpu", "--json"], capsys))
    assert record["left_out"] == ["hsdp", "hsdp_quantized", "tp_zero3", "tp_qwz_qgz"]
