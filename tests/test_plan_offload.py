"""Offload in the cost model (``zeropp.tools.plan.offload``), CPU offload and the optimizer on the
host: the host-device bytes of a model small enough to count by hand, host and device memory
against the plan's own shards and AdamW states, the copies' time in the step, the copies and host
tensors of real steps, and ``zeropp plan --offload cpu|optimizer``."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import replace

import pytest
import torch

from zeropp.config import ZeroPPConfig, parse_deepspeed
from zeropp.setup.topology import Topology
from zeropp.tools.models import GPTConfig
from zeropp.tools.modes import MODES
from zeropp.tools.plan import cost, memory, offload, scale, traffic
from zeropp.tools.plan import model as model_shape

BLOCK = model_shape.UnitShape("Block", ((6, 4), (6,)), (True, True))
ROOT = model_shape.UnitShape("root", ((10, 4),), (True,), is_block=False)
TINY = model_shape.ModelShape(name="tiny", units=(BLOCK, BLOCK, ROOT), num_layers=2, embed_dim=4, num_heads=1,
                              vocab_size=10)
"""On 4 ranks each rank's padded shard of a block is 2 rows of (6, 4) and 2 of (6,), 10 fp32
elements (40 bytes), and of the root 3 rows of (10, 4), 12 elements (48 bytes); rank 3 holds no
real row of a block and 1 of the root."""
FOUR = Topology(num_nodes=2, ranks_per_node=2)
CPU = {"offload": "cpu"}
OPTIMIZER = {"offload": "optimizer"}


@pytest.mark.parametrize("ranks_per_node,hpz,rank,to_device,to_host", [
    (2, 1, 0, 2 * (40 + 40 + 48), 40 + 40 + 48),  # ZeRO-3: every unit's padded shard before both gathers
    (2, 1, 3, 2 * (40 + 40 + 48), 4 * 4),  # the padded shard goes up, the unpadded rows come back
    (2, 2, 0, 40 + 40 + 48, 40 + 40 + 48),  # hpZ's copy on the device serves the backward gather
    (4, 2, 0, 40 + 40 + 48, 40 + 40 + 48),  # also over half a node
    (4, 4, 0, 2 * (40 + 40 + 48), 40 + 40 + 48),  # a partition of the whole world keeps no copy
])
def test_host_device_bytes_of_a_model_counted_by_hand(ranks_per_node: int, hpz: int, rank: int, to_device: int,
                                                      to_host: int) -> None:
    topology = Topology(num_nodes=4 // ranks_per_node, ranks_per_node=ranks_per_node)
    copies = offload.step_copies(TINY, ZeroPPConfig(hpz_partition_size=hpz, **CPU), topology, rank)
    assert sum(c.to_device for c in copies) == to_device
    assert sum(c.to_host for c in copies) == to_host
    assert [c.to_device_forward for c in copies] == [40, 40, 48]
    assert offload.step_copies(TINY, ZeroPPConfig(hpz_partition_size=hpz), topology, rank) == [
        offload.UnitCopies(0.0, 0.0, 0.0)] * 3


def test_host_memory_of_a_model_counted_by_hand() -> None:
    """Shards 128 bytes, gradient shards (real rows) 128, AdamW 256 on rank 0; pinned, the root's
    48-byte shard and 48-byte gradient each take 64. Rank 3: the same shards, 16 bytes of gradient."""
    assert offload.host_memory(TINY, ZeroPPConfig(**CPU), FOUR) == offload.HostMemory(128, 128, 256, 16 + 16)
    assert offload.host_memory(TINY, ZeroPPConfig(**CPU), FOUR, rank=3) == offload.HostMemory(128, 16, 32, 16)
    unpinned = ZeroPPConfig(offload="cpu", offload_pin_memory=False)
    assert offload.host_memory(TINY, unpinned, FOUR).total == 128 + 128 + 256
    assert offload.host_memory(TINY, ZeroPPConfig(), FOUR).total == 0
    assert offload.host_memory(TINY, None, FOUR).total == 0  # FSDP2's HSDP: no offload


def test_each_gather_copies_the_shard_in_beside_its_output() -> None:
    """On the device the unit's shard, cast to the gather dtype, joins each gather from the
    shard; none joins a backward gather hpZ's copy serves."""
    precision = traffic.Precision(gather_dtype=torch.bfloat16)
    for hpz, backward in ((1, 2 * 10), (2, 0)):
        unit = memory.unit_bytes(BLOCK, TINY, ZeroPPConfig(hpz_partition_size=hpz, **CPU), FOUR, precision,
                                 0, (1, 4), last=False)
        assert (unit.copy_in, unit.copy_in_backward) == (2 * 10, backward)


@pytest.mark.parametrize("hpz", [1, 2, 4])
def test_the_optimizer_on_the_host_counted_by_hand(hpz: int) -> None:
    """Rank 0's unpadded rows are 2 x (6, 4) + 2 of (6,) per block and 3 x (10, 4) of the root,
    32 elements: each step copies their gradients to the host in fp32 (128 bytes) and the updated
    masters back into the fp32 shards (128), in every mode; the host holds the masters (128),
    the gradient copies (128) and AdamW's states (256), pageable. Rank 3 has 1 row of the root,
    4 elements. Nothing is copied for a gather, and the device's gathers copy nothing in."""
    config = ZeroPPConfig(hpz_partition_size=hpz, **OPTIMIZER)
    for rank, rows in ((0, [10, 10, 12]), (3, [0, 0, 4])):
        copies = offload.step_copies(TINY, config, FOUR, rank)
        assert copies == [offload.UnitCopies(0.0, 0.0, 4 * n, to_device_step=4 * n) for n in rows]
        assert offload.host_memory(TINY, config, FOUR, rank) == offload.HostMemory(
            4 * sum(rows), 4 * sum(rows), 8 * sum(rows), 0)
    assert offload.host_memory(TINY, replace(config, offload_pin_memory=False), FOUR).total == 128 + 128 + 256
    unit = memory.unit_bytes(BLOCK, TINY, config, FOUR, traffic.Precision(), 0, (1, 4), last=False)
    assert unit.copy_in == unit.copy_in_backward == 0


def _gpt() -> model_shape.ModelShape:
    return model_shape.gpt(GPTConfig(vocab_size=84, context_length=64, num_layers=4, num_heads=4, embed_dim=256))


WORKLOAD = cost.Workload(batch_per_rank=2, context_length=64, precision=scale.FP16, activation_checkpointing=True)


@pytest.mark.parametrize("mode", ["zero3", "qwz", "hpz", "qgz", "all"])
@pytest.mark.parametrize("rank", [0, 7])
def test_offload_moves_the_shards_and_optimizer_state_to_the_host(mode: str, rank: int) -> None:
    """The device holds no shards or AdamW states and its peak drops by at least what the plan
    counts for them without offload; the host holds exactly those, the gradient shards and the
    pinned allocations' rounding."""
    shape, topology = _gpt(), Topology(num_nodes=2, ranks_per_node=4)
    resident = cost.memory(shape, MODES[mode].config(4), topology, WORKLOAD, rank)
    offloaded = cost.memory(shape, MODES[mode].config(4, **CPU), topology, WORKLOAD, rank)
    assert offloaded.parameters == offloaded.optimizer == 0
    assert resident.total - offloaded.total >= resident.parameters + resident.optimizer
    host = offload.host_memory(shape, MODES[mode].config(4, **CPU), topology, rank)
    assert (host.parameters, host.optimizer, host.gradients) == (resident.parameters, resident.optimizer,
                                                                 resident.optimizer / 2)
    assert host.total == resident.parameters + resident.optimizer + host.gradients + host.pinned_rounding
    assert 0 < host.pinned_rounding < host.parameters + host.gradients
    pageable = MODES[mode].config(4, offload="cpu", offload_pin_memory=False)
    assert offload.host_memory(shape, pageable, topology, rank).pinned_rounding == 0


@pytest.mark.parametrize("mode", ["zero3", "qwz", "hpz", "qgz", "all"])
@pytest.mark.parametrize("rank", [0, 7])
def test_the_optimizer_on_the_host_moves_adamw_state_off_the_device(mode: str, rank: int) -> None:
    """The device keeps its shards and gradient shards and loses AdamW's states: its peak (in
    backward on this GPT, not at the step) drops by exactly what the plan counts for them without
    offload; the host holds those states, and fp32 masters and gradient copies each half their
    size, pageable."""
    shape, topology = _gpt(), Topology(num_nodes=2, ranks_per_node=4)
    resident = cost.memory(shape, MODES[mode].config(4), topology, WORKLOAD, rank)
    offloaded = cost.memory(shape, MODES[mode].config(4, **OPTIMIZER), topology, WORKLOAD, rank)
    assert resident.optimizer > 0 == offloaded.optimizer
    assert offloaded.parameters == resident.parameters and offloaded.gradients == resident.gradients
    assert (offloaded.moment, resident.total - offloaded.total) == (resident.moment, resident.optimizer)
    host = offload.host_memory(shape, MODES[mode].config(4, **OPTIMIZER), topology, rank)
    assert host == offload.HostMemory(resident.optimizer / 2, resident.optimizer / 2, resident.optimizer, 0)


def test_the_optimizers_copies_add_to_the_step_whole() -> None:
    """The gradients' copies to the host and the masters' back, (D2H + H2D) / rate, come after
    backward: the step grows by them with ideal overlap as without; the host's AdamW is priced
    as the device's."""
    shape, topology = _gpt(), Topology(num_nodes=2, ranks_per_node=4)
    machine = replace(scale.V100_DGX2, host_device_bytes_per_s=2e9, flops_per_s=1e11)
    for mode in ("zero3", "all"):
        resident, offloaded = MODES[mode].config(4), MODES[mode].config(4, **OPTIMIZER)
        copies = offload.step_copies(shape, offloaded, topology)
        copy_s = sum(c.to_device + c.to_host for c in copies) / 2e9
        assert copy_s > 0
        for overlap in (0.0, 1.0):
            timed = replace(machine, overlap=overlap)
            base, step = (cost.step_time(shape, config, topology, WORKLOAD, timed) for config in (resident, offloaded))
            assert step.host_copy_s == pytest.approx(copy_s, rel=1e-12)
            assert step.step_s == pytest.approx(base.step_s + copy_s, rel=1e-12)
            assert (step.optimizer_s, step.communication_s) == (base.optimizer_s, base.communication_s)


def test_the_copies_time_is_hidden_as_the_collectives_are_or_added_whole() -> None:
    """At ``host_device_bytes_per_s`` the copies take (H2D + D2H) / rate. Without overlap they add
    to the step whole; with ideal overlap the pinned ones hide, but for the first gather's and the
    last reduce-scatter's; pageable ones always add whole. (A slow GPU, so that compute can hide them.)"""
    shape, topology = _gpt(), Topology(num_nodes=2, ranks_per_node=4)
    machine = replace(scale.V100_DGX2, host_device_bytes_per_s=2e9, flops_per_s=1e11)
    for mode in ("zero3", "all"):
        resident, pinned, pageable = (MODES[mode].config(4, **options) for options in (
            {}, CPU, {"offload": "cpu", "offload_pin_memory": False}))
        copies = offload.step_copies(shape, pinned, topology)
        copy_s = sum(c.to_device + c.to_host for c in copies) / 2e9
        for overlap in (0.0, 1.0):
            timed = replace(machine, overlap=overlap)
            base, hidden, blocking = (cost.step_time(shape, config, topology, WORKLOAD, timed)
                                      for config in (resident, pinned, pageable))
            assert hidden.host_copy_s == blocking.host_copy_s == pytest.approx(copy_s, rel=1e-12)
            assert base.host_copy_s == 0
            assert blocking.step_s == pytest.approx(base.step_s + copy_s, rel=1e-12)
            if overlap == 0:
                assert hidden.step_s == pytest.approx(base.step_s + copy_s, rel=1e-12)
            else:
                exposed = (copies[0].to_device_forward + copies[0].to_host) / 2e9
                assert base.step_s + exposed <= hidden.step_s < base.step_s + copy_s


REAL_CONFIGS = {
    2: {"zero3": {}, "hpz": {"hpz_partition_size": 2},
        "all": {"quantized_weights": True, "quantized_gradients": True, "hpz_partition_size": 2}},
    4: {"hpz half the node": {"hpz_partition_size": 2}, "hpz over the world": {"hpz_partition_size": 4}},
}
"""Configurations by ranks per node, on 4 ranks."""


def _copies_of_a_real_step(rank: int, world_size: int, configs: dict[str, dict]) -> dict[str, tuple[int, int]]:
    """Per entry of ``configs``, the bytes FSDP2 copies host to device in the second step (each padded shard
    read for a gather from the primary shards, where ``FSDPParam.all_gather_inputs`` copies it)
    and the gradient bytes it copied to the host."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam, ShardedState

    import zeropp
    from models import global_batch, make_model, rows

    copied = [0]
    original = FSDPParam.all_gather_inputs

    def counting(fsdp_param: FSDPParam) -> list[torch.Tensor]:
        if fsdp_param.offload_to_cpu and fsdp_param.sharded_state is ShardedState.SHARDED:
            copied[0] += fsdp_param._sharded_param_data.nbytes
        return original.fget(fsdp_param)

    FSDPParam.all_gather_inputs = property(counting)
    out = {}
    try:
        for name, options in configs.items():
            model = zeropp.shard(make_model("gpt"), ZeroPPConfig(**options, **CPU))
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            for step in range(2):
                copied[0] = 0
                x, y = (rows(t, rank, world_size) for t in global_batch(step, 2 * world_size))
                model(x, y)[1].backward()
                to_host = sum(p.grad.to_local().nbytes for p in model.parameters() if p.grad is not None)
                assert {p.grad.device.type for p in model.parameters() if p.grad is not None} == {"cpu"}
                optimizer.step()
                optimizer.zero_grad()
            out[name] = (copied[0], to_host)
    finally:
        FSDPParam.all_gather_inputs = original
    return out


@pytest.mark.parametrize("ranks_per_node", sorted(REAL_CONFIGS))
def test_the_copies_are_those_a_real_step_makes(ranks_per_node: int) -> None:
    """On 4 gloo ranks (2 nodes of 2, 1 node of 4), zeropp with CPU offload copies each unit's padded shard for
    every gather from the primary shards and each rank's gradient rows back: the plan's bytes,
    rank by rank (the GPT of ``tests/models.py``, whose dims 0 leave FSDP2 padding): hpZ's copy
    serves the backward gather, qwZ's codes of it too, a partition of the whole world does not."""
    from distributed import run_distributed
    from models import CONTEXT, VOCAB

    configs = REAL_CONFIGS[ranks_per_node]
    measured = run_distributed(_copies_of_a_real_step, 4, configs, env={"ZEROPP_RANKS_PER_NODE": str(ranks_per_node)},
                               timeout=300)
    topology = Topology(num_nodes=4 // ranks_per_node, ranks_per_node=ranks_per_node)
    shape = model_shape.gpt(GPTConfig(vocab_size=VOCAB, context_length=CONTEXT, num_layers=2, num_heads=2,
                                      embed_dim=16))
    for rank, record in enumerate(measured):
        for name, options in configs.items():
            copies = offload.step_copies(shape, ZeroPPConfig(**options, **CPU), topology, rank)
            assert record[name] == (sum(c.to_device for c in copies), sum(c.to_host for c in copies)), (rank, name)


def _host_optimizer_of_a_real_step(rank: int, world_size: int, configs: dict[str, dict]) -> dict[str, dict]:
    """Per entry of ``configs``, in the second step of ``HostOptimizer``: the gradient bytes it
    copied to the host (its masters' fp32 gradients), the bytes of the device shards it copies the
    updated masters into, and what it holds on the host then (masters, AdamW's two states)."""
    import zeropp
    from models import global_batch, make_model, rows

    out: dict[str, dict] = {}
    for name, options in configs.items():
        model = zeropp.shard(make_model("gpt"), ZeroPPConfig(**options, **OPTIMIZER))
        optimizer = zeropp.offload_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
        host_step, measured = optimizer.host.step, {}

        def counting_step() -> None:
            stepped = [(p, master) for p, master in optimizer.masters.items() if master.grad is not None]
            assert {(m.grad.device.type, m.grad.dtype) for _, m in stepped} == {("cpu", torch.float32)}
            host_step()
            states = [optimizer.host.state[m][key] for _, m in stepped for key in ("exp_avg", "exp_avg_sq")]
            measured.update(to_host=sum(m.grad.nbytes for _, m in stepped),
                            to_device=sum(p.to_local().nbytes for p, _ in stepped),
                            masters=sum(m.nbytes for m in optimizer.masters.values()),
                            optimizer=sum(state.nbytes for state in states))

        optimizer.host.step = counting_step
        for step in range(2):
            x, y = (rows(t, rank, world_size) for t in global_batch(step, 2 * world_size))
            model(x, y)[1].backward()
            optimizer.step()
            optimizer.zero_grad()
        out[name] = measured
    return out


def test_the_optimizers_copies_and_host_tensors_are_those_of_a_real_step() -> None:
    """On 4 gloo ranks (2 nodes of 2), ``HostOptimizer`` copies each rank's gradient rows to the
    host in fp32 and the updated masters into the device shards, and holds the masters and AdamW's
    states: the plan's bytes, rank by rank, ZeRO-3 and all three techniques alike (the GPT of
    ``tests/models.py``, whose dims 0 leave ranks short rows)."""
    from distributed import run_distributed
    from models import CONTEXT, VOCAB

    configs = {"zero3": {}, "all": REAL_CONFIGS[2]["all"]}
    measured = run_distributed(_host_optimizer_of_a_real_step, 4, configs, env={"ZEROPP_RANKS_PER_NODE": "2"},
                               timeout=300)
    shape = model_shape.gpt(GPTConfig(vocab_size=VOCAB, context_length=CONTEXT, num_layers=2, num_heads=2,
                                      embed_dim=16))
    for rank, record in enumerate(measured):
        for name, options in configs.items():
            config = ZeroPPConfig(**options, **OPTIMIZER)
            copies = offload.step_copies(shape, config, FOUR, rank)
            host = offload.host_memory(shape, config, FOUR, rank)
            assert record[name] == {"to_host": sum(c.to_host for c in copies),
                                    "to_device": sum(c.to_device for c in copies),
                                    "masters": host.parameters, "optimizer": host.optimizer}, (rank, name)
            assert host.gradients == record[name]["to_host"]


def test_a_deepspeed_config_with_offload_is_priced_with_it() -> None:
    """Both sections are CPU offload (here pageable); ``offload_optimizer`` alone, pinned or not,
    is the optimizer on the host: the same host memory, but masters in place of the shards, and
    the copies of the step instead of the gathers'."""
    parsed = parse_deepspeed({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                                    "offload_optimizer": {"device": "cpu", "pin_memory": False}}})
    host = offload.host_memory(TINY, parsed.zeropp, FOUR)
    assert host == offload.HostMemory(128, 128, 256, 0)
    alone = parse_deepspeed({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu",
                                                                                      "pin_memory": True}}})
    assert alone.zeropp.offload == "optimizer"
    assert offload.host_memory(TINY, alone.zeropp, FOUR) == offload.HostMemory(128, 128, 256, 0)
    copies = offload.step_copies(TINY, alone.zeropp, FOUR)
    assert [(c.to_device_forward, c.to_device_backward, c.to_host, c.to_device_step) for c in copies] == [
        (0, 0, 40, 40), (0, 0, 40, 40), (0, 0, 48, 48)]


def _plan(argv: list[str], capsys) -> str:
    from zeropp.tools.cli import build_parser

    argv = ["plan", *argv]
    args = build_parser(argv).parse_args(argv)
    assert args.func(args) == 0
    return capsys.readouterr().out


PLAN = ["--model", "gpt:4x256", "--gpus", "16", "--machine", "h100", "--batch-per-gpu", "1",
        "--modes", "zero3,hsdp,hpz"]


def test_plan_command_prices_offload(capsys) -> None:
    """``--offload cpu`` adds host memory, the copies' bytes and time to each row and leaves
    FSDP2's own HSDP out; the JSON carries them per mode; ``--host-device-gbyte`` sets the rate."""
    table = _plan([*PLAN, "--offload", "cpu"], capsys).splitlines()
    assert "offload cpu, pinned host memory, host<->device 50 GB/s" in table[0]
    assert table[1].split()[-10:] == ["device", "GB", "host", "GB", "H2D", "GB", "D2H", "GB", "copy", "s"]
    assert [line.split()[0] for line in table[2:4]] == ["zero3", "hpz"] and "hsdp" in table[4]
    record = json.loads(_plan([*PLAN, "--offload", "cpu", "--json", "--host-device-gbyte", "10"], capsys))
    assert (record["offload"], record["host_device_bytes_per_s"]) == ("cpu", 10e9)
    assert record["left_out"] == ["hsdp"]
    shape, topology = model_shape.transformer(num_layers=4, embed_dim=256, num_heads=4, context_length=512), \
        Topology(num_nodes=2, ranks_per_node=8)
    for row in record["modes"]:
        config = MODES[row["mode"]].config(8, **CPU)
        copies = offload.step_copies(shape, config, topology)
        assert row["host_to_device_bytes"] == sum(c.to_device for c in copies)
        assert row["device_to_host_bytes"] == sum(c.to_host for c in copies)
        assert row["host_copy_s"] == pytest.approx(sum(c.to_device + c.to_host for c in copies) / 10e9, rel=1e-12)
        assert row["host_memory"]["total"] == offload.host_memory(shape, config, topology).total > 0
        assert row["device_memory"]["parameters"] == row["device_memory"]["optimizer"] == 0
    resident = json.loads(_plan([*PLAN, "--json"], capsys))
    assert [row["mode"] for row in resident["modes"]] == ["zero3", "hsdp", "hpz"]
    assert all(row["host_memory"]["total"] == row["host_to_device_bytes"] == 0 for row in resident["modes"])
    assert _plan(PLAN, capsys).splitlines()[1].split()[-2:] == ["memory", "GB"]


def test_plan_command_prices_the_optimizer_on_the_host(capsys) -> None:
    """``--offload optimizer``: pageable host memory whatever ``--no-pin-memory`` says, HSDP left
    out, each row the plan's host memory, copies and their time added to the step; the device
    keeps its shards and loses AdamW's states."""
    table = _plan([*PLAN, "--offload", "optimizer"], capsys).splitlines()
    assert "offload optimizer, pageable host memory, host<->device 50 GB/s" in table[0]
    assert table[1].split()[-10:] == ["device", "GB", "host", "GB", "H2D", "GB", "D2H", "GB", "copy", "s"]
    assert _plan([*PLAN, "--offload", "optimizer", "--no-pin-memory"], capsys).splitlines() == table
    record = json.loads(_plan([*PLAN, "--offload", "optimizer", "--json", "--host-device-gbyte", "10"], capsys))
    assert (record["offload"], record["offload_pin_memory"], record["left_out"]) == ("optimizer", False, ["hsdp"])
    resident = {row["mode"]: row for row in json.loads(_plan([*PLAN, "--json"], capsys))["modes"]}
    shape, topology = model_shape.transformer(num_layers=4, embed_dim=256, num_heads=4, context_length=512), \
        Topology(num_nodes=2, ranks_per_node=8)
    assert [row["mode"] for row in record["modes"]] == ["zero3", "hpz"]
    for row in record["modes"]:
        config = MODES[row["mode"]].config(8, **OPTIMIZER)
        copies = offload.step_copies(shape, config, topology)
        assert row["host_to_device_bytes"] == row["device_to_host_bytes"] == sum(c.to_host for c in copies) > 0
        assert row["host_copy_s"] == pytest.approx(2 * row["host_to_device_bytes"] / 10e9, rel=1e-12)
        assert row["step_s"] == pytest.approx(resident[row["mode"]]["step_s"] + row["host_copy_s"], rel=1e-12)
        assert row["host_memory"] == {**dataclasses.asdict(offload.host_memory(shape, config, topology)),
                                      "total": 2 * resident[row["mode"]]["device_memory"]["optimizer"]}
        device = resident[row["mode"]]["device_memory"]
        assert row["device_memory"] == {**device, "optimizer": 0.0, "total": device["total"] - device["optimizer"]}


def test_plan_command_refuses_to_recommend_with_offload(capsys) -> None:
    from zeropp.tools.cli import build_parser

    argv = ["plan", "--recommend", "--offload", "cpu"]
    args = build_parser(argv).parse_args(argv)
    assert args.func(args) == 2
    assert "--recommend prices configurations without offload" in capsys.readouterr().err
