"""The accessors of FSDP2's private state (``zeropp.fsdp.access``), the comms handle ``shard`` records,
the one mode registry, and the command line's lazy imports."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import zeropp
from distributed import run_distributed
from zeropp.fsdp.access import (
    at_backward_end,
    backward_id,
    fsdp_units,
    gradients_read_only_after_backward,
    in_backward,
    unit_layout,
)
from zeropp.tools.modes import MODES, System, check_modes, parse_modes, zeropp_modes

TWO_BY_TWO = {"ZEROPP_RANKS_PER_NODE": "2"}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 5)  # weight (5, 6): dim 0 padded 5 -> 8 on 4 ranks
        self.frozen = nn.Parameter(torch.ones(3, 2), requires_grad=False)  # dim 0 padded 3 -> 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + self.frozen.sum()


def _layout(reshard: bool | int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(Block(), nn.Linear(5, 1))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)
    fully_shard(model[0], reshard_after_forward=reshard, mp_policy=mp)
    fully_shard(model, reshard_after_forward=reshard)
    seen_in_backward = []
    x = torch.randn(2, 6, requires_grad=True)
    x.register_hook(lambda grad: seen_in_backward.append(in_backward()))
    model(x).sum().backward()
    block, root = (unit_layout(unit) for unit in (model[0], model))
    return {"block": block, "root": root, "units": len(list(fsdp_units(model))),
            "in_backward": (in_backward(), seen_in_backward)}


def _read_after_backward() -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(Block(), nn.Linear(5, 1))
    fully_shard(model[0])
    fully_shard(model)
    block = model[0]
    avg, fp32 = dist.ReduceOp.AVG, torch.float32
    result = {"fresh": gradients_read_only_after_backward(block, fp32, avg),
              "bf16": gradients_read_only_after_backward(block, torch.bfloat16, avg),
              "after_division": _read_after_division()}
    events: list[tuple[str, int]] = []
    x = torch.randn(2, 6, requires_grad=True)
    x.register_hook(lambda grad: events.append(("hook", backward_id())))
    x.register_hook(lambda grad: at_backward_end(lambda: events.append(("end", backward_id()))))
    for _ in range(2):
        model(x).sum().backward()
        events.append(("returned", backward_id()))
    result["events"] = events
    result["with_grads"] = gradients_read_only_after_backward(block, fp32, avg)
    model.zero_grad(set_to_none=True)
    result["zeroed"] = gradients_read_only_after_backward(block, fp32, avg)
    block.linear.weight.register_post_accumulate_grad_hook(lambda p: None)
    result["hooked"] = gradients_read_only_after_backward(block, fp32, avg)
    return result


def _read_after_division() -> dict[str, bool]:
    """``gradients_read_only_after_backward`` under each op FSDP2 hands the comm (comms [Note:
    the reductions FSDP2 asks for]): FSDP2 divides after the collective only with a SUM whose
    factor is not 1; an all-reduce hook reads the output after the collective too."""
    model = nn.Sequential(Block(), nn.Linear(5, 1))
    fully_shard(model[0])
    fully_shard(model)
    block, fp32, total = model[0], torch.float32, dist.ReduceOp.SUM
    block.set_force_sum_reduction_for_comms(True)  # no factor set: divided by the world size after
    result = {"forced_sum_default_factor": gradients_read_only_after_backward(block, fp32, total)}
    block.set_gradient_divide_factor(3.0)
    result["forced_sum_by_3"] = gradients_read_only_after_backward(block, fp32, total)
    block.set_gradient_divide_factor(1.0)
    result["forced_sum_by_1"] = gradients_read_only_after_backward(block, fp32, total)
    block.set_force_sum_reduction_for_comms(False)
    for factor in (1.0, 3.0):  # set_gradient_divide_factor(f): PREMUL_SUM(1 / f)
        block.set_gradient_divide_factor(factor)
        result[f"premul_{factor:g}"] = gradients_read_only_after_backward(
            block, fp32, dist._make_nccl_premul_sum(1 / factor))
    block.set_gradient_divide_factor(4.0)  # the world size: AVG
    block.set_all_reduce_hook(lambda output: None)
    result["all_reduce_hook"] = gradients_read_only_after_backward(block, fp32, dist.ReduceOp.AVG)
    return result


class MixedBlock(nn.Module):
    """An fp32 weight beside a frozen bf16 bias: FSDP2 gathers the unit as bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(6, 6) / 6)
        self.bias = nn.Parameter(torch.randn(6).to(torch.bfloat16), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.weight.t() + self.bias.float())


def _released_secondary() -> dict:
    """hpZ's secondary shards over a forward and its backward with qwZ (released after forward,
    [Note: hpZ's copy as qwZ's codes]), for a unit of one dtype and one gathered as bytes."""
    from zeropp.fsdp.access import secondary_bytes_held, secondary_released
    from zeropp.techniques.hpz import held_secondary_copy_bytes, secondary_copy_bytes

    torch.manual_seed(0)
    result = {}
    for kind, block in (("one dtype", lambda: nn.Sequential(nn.Linear(6, 6), nn.Tanh())), ("bytes", MixedBlock)):
        model = nn.Sequential(*(block() for _ in range(2)))
        zeropp.shard(model, zeropp.ZeroPPConfig(quantized_weights=True, hpz_partition_size=2), units=list(model))
        units = list(model)
        loss = model(torch.randn(3, 6)).sum()
        after_forward = ([secondary_released(u) for u in units], secondary_bytes_held(units),
                         held_secondary_copy_bytes(model), secondary_copy_bytes(model))
        loss.backward()
        result[kind] = {"after_forward": after_forward,
                        "after_backward": ([secondary_released(u) for u in units], held_secondary_copy_bytes(model))}
    return result


def _fsdp_state_worker(rank: int, world_size: int) -> dict:
    """What the tests of this file read from a process group, from one set of processes (two
    nodes of two ranks): spawning costs more than the checks."""
    return {"layouts": {reshard: _layout(reshard) for reshard in (True, 2)},
            "read_after_backward": _read_after_backward(), "sharded_comms": _sharded_comms(),
            "released_secondary": _released_secondary()}


@pytest.fixture(scope="module")
def fsdp_state() -> dict:
    return run_distributed(_fsdp_state_worker, 4, env=TWO_BY_TWO)[0]


@pytest.mark.parametrize("reshard,post_forward", [(True, 4), (2, 2)])
def test_unit_layout_reads_fsdp2_flat_buffer_order(fsdp_state: dict, reshard: bool | int, post_forward: int) -> None:
    """Padded numels (dim 0 to a multiple of 4 ranks, times the other dims), trainable flags,
    the gather dtype's item size (the unit's mixed-precision bf16, else fp32), and the
    post-forward group (hpZ's size when ``reshard_after_forward`` is an int)."""
    result = fsdp_state["layouts"][reshard]
    block, root = result["block"], result["root"]
    assert block.padded_numels == [8 * 6, 8, 4 * 2]  # linear.weight, linear.bias, frozen
    assert block.trainable == [True, True, False]
    assert block.gather_dtypes == [torch.bfloat16] * 3
    assert block.names == ["linear.weight", "linear.bias", "frozen"]
    assert block.shapes == [(5, 6), (5,), (3, 2)]
    assert (block.shard_group_size, block.post_forward_group_size) == (4, post_forward)
    assert root.padded_numels == [4 * 5, 4] and root.gather_dtypes == [torch.float32] * 2
    assert root.names == ["1.weight", "1.bias"]
    assert result["units"] == 2
    assert result["in_backward"] == (False, [True])


def test_gradients_read_only_after_backward_and_backward_callbacks(fsdp_state: dict) -> None:
    """A unit's reduce-scatter output may be written late only where FSDP2 divides nothing after
    the collective, in the parameters' own dtype, with no gradient to accumulate into, no
    all-reduce hook and no post-accumulate-grad hook; each backward has
    its own id, and a callback queued inside backward runs before ``backward()`` returns."""
    result = fsdp_state["read_after_backward"]
    assert (result["fresh"], result["bf16"]) == (True, False)
    assert result["after_division"] == {"premul_1": True, "premul_3": True, "forced_sum_by_3": False,
                                        "forced_sum_by_1": True, "forced_sum_default_factor": False,
                                        "all_reduce_hook": False}
    assert (result["with_grads"], result["zeroed"], result["hooked"]) == (False, True, False)
    (hook1, id1), (end1, end_id1), (ret1, out1), (hook2, id2), (end2, end_id2), (ret2, out2) = result["events"]
    assert (hook1, end1, ret1, hook2, end2, ret2) == ("hook", "end", "returned") * 2
    assert id1 != -1 and id2 != -1 and id1 != id2
    assert (end_id1, end_id2) == (id1, id2) and out1 == out2 == -1


def _sharded_comms() -> dict:
    from zeropp.fsdp.comms import CountingAllGather, CountingReduceScatter
    from zeropp.techniques.qgz import HierarchicalQuantizedReduceScatter
    from zeropp.techniques.qwz import QuantizedAllGather

    model = nn.Sequential(nn.Sequential(*(nn.Linear(8, 8) for _ in range(3))))  # 3 units and the root
    zeropp.shard(model, zeropp.ZeroPPConfig(quantized_weights=True, quantized_gradients=True))
    installed = zeropp.sharded_comms(model)
    plain = nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)))
    zeropp.shard(plain)
    stranger = nn.Linear(2, 2)
    kept = nn.Sequential(nn.Sequential(*(nn.Linear(8, 8) for _ in range(3))))
    zeropp.shard(kept, zeropp.ZeroPPConfig(quantized_weights=True, unquantized_parameters=["0.1.*", "*.2.bias"]))
    spared = nn.Sequential(nn.Sequential(*(nn.Linear(8, 8) for _ in range(3))))
    zeropp.shard(spared, zeropp.ZeroPPConfig(quantized_gradients=True, grad_full_precision_parameters=["0.1.*"],
                                             grad_full_precision_below=9))
    typos = []
    for config in (zeropp.ZeroPPConfig(unquantized_parameters=("*embed*",)),
                   zeropp.ZeroPPConfig(quantized_gradients=True, grad_full_precision_parameters=("*ln*",))):
        try:
            zeropp.shard(nn.Sequential(nn.Linear(8, 8)), config)
            typos.append("no error")
        except ValueError as error:
            typos.append(str(error))
    typo = " | ".join(typos)
    return {
        "spared": [comm.full_precision for comm in zeropp.sharded_comms(spared).qgz],
        "unquantized": [getattr(comm, "quantized", "plain") for comm in zeropp.sharded_comms(kept).all_gathers[1:]],
        "typo": typo,
        "all_gathers": [type(c) is QuantizedAllGather for c in installed.all_gathers],
        "qgz": len(installed.qgz),
        "reduce_scatters": [type(c) is HierarchicalQuantizedReduceScatter for c in installed.reduce_scatters],
        "plain": ([type(c) is CountingAllGather for c in zeropp.sharded_comms(plain).all_gathers],
                  [type(c) is CountingReduceScatter for c in zeropp.sharded_comms(plain).reduce_scatters],
                  zeropp.sharded_comms(plain).qgz),
        "stranger": (zeropp.sharded_comms(stranger).all_gathers, zeropp.sharded_comms(stranger).qgz),
    }


def test_secondary_shards_are_released_after_forward_and_gone_after_backward(fsdp_state: dict) -> None:
    """With qwZ and hpZ each unit's secondary shards are released after forward (FSDP2 holds
    placeholders, no bytes), in a unit of one dtype and in one FSDP2 gathers as bytes; the
    codes held are the copy; after backward nothing is released or held."""
    for kind, result in fsdp_state["released_secondary"].items():
        released, fsdp_bytes, held, copy = result["after_forward"]
        assert released == [True, True] and fsdp_bytes == 0 and held == copy > 0, kind
        assert result["after_backward"] == ([False, False], 0), kind


def test_shard_records_the_comms_it_installs(fsdp_state: dict) -> None:
    """Three units and the root each get one all-gather and one reduce-scatter comm (the root owns
    no parameter, so nothing to quantize: its all-gather is the counted plain one); the engine
    reaches qgZ's through this handle, not through FSDP2's fields."""
    result = fsdp_state["sharded_comms"]
    assert result["all_gathers"] == [False, True, True, True] and result["reduce_scatters"] == [True] * 4
    assert result["qgz"] == 4
    assert result["plain"] == ([True] * 3, [True] * 3, [])  # the root and its 2 units
    assert result["stranger"] == ([], [])


def test_unquantized_parameters_are_named_as_in_the_model(fsdp_state: dict) -> None:
    """Patterns match the model's own parameter names (a unit's prefix included): unit 1's
    weight and bias (the whole unit: FSDP2's plain gather) and unit 2's bias travel unquantized;
    a pattern matching nothing is refused."""
    result = fsdp_state["sharded_comms"]
    assert result["unquantized"] == [[True, True], "plain", [True, False]]
    assert "unquantized_parameters pattern '*embed*' matches no parameter of Sequential" in result["typo"]
    assert "grad_full_precision_parameters pattern '*ln*' matches no parameter" in result["typo"]


def test_full_precision_gradients_are_chosen_by_name_and_size(fsdp_state: dict) -> None:
    """qgZ spares unit 1 by its pattern (prefix included) and every unit's 8-element bias as under
    9 elements; the 64-element weights of units 0 and 2 stay quantized (the root owns no parameter)."""
    assert fsdp_state["sharded_comms"]["spared"] == [[], [False, True], [True, True], [False, True]]


def test_every_mode_has_one_name_and_a_config() -> None:
    assert MODES["zero3"].config(2) == zeropp.ZeroPPConfig(overlap=False)  # FSDP2's own schedule
    assert MODES["all"].config(4) == zeropp.ZeroPPConfig(quantized_weights=True, hpz_partition_size=4,
                                                         quantized_gradients=True)
    assert MODES["hpz"].config(1).hpz_partition_size == 1
    assert MODES["qgz_int4"].config(2, block_size=64) == zeropp.ZeroPPConfig(
        quantized_gradients=True, grad_bits_intra=4, grad_bits_inter=4, block_size=64)
    assert "hsdp" not in zeropp_modes() and "deepspeed" not in zeropp_modes() and "zero3" in zeropp_modes()
    assert "tp_zero3" not in zeropp_modes() and MODES["tp_qwz_qgz"].tensor_parallel == 2
    assert {MODES[name].system for name in ("hsdp", "deepspeed")} == {System.HSDP, System.DEEPSPEED}
    # an HSDP mode's config is what zeropp.enable adds to FSDP2's hybrid sharding
    assert MODES["hsdp"].config(2) == zeropp.ZeroPPConfig()
    assert MODES["hsdp_quantized"].config(2) == zeropp.ZeroPPConfig(quantized_replica_gradients=True)
    with pytest.raises(ValueError, match="mode 'deepspeed' runs deepspeed, not zeropp"):
        MODES["deepspeed"].config(2)


@pytest.mark.parametrize("text,message", [
    ("zero3,fsdp", r"modes=\['zero3', 'fsdp'\] must be distinct names from \[.*unknown: \['fsdp'\]"),
    ("qwz,qwz", r"modes=\['qwz', 'qwz'\] must be distinct"),
    ("", r"modes=\[\] must be distinct"),
])
def test_mode_lists_are_checked(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_modes(text, zeropp_modes())
    assert check_modes(["all", "zero3"], MODES) == ("all", "zero3")


def test_help_imports_no_torch() -> None:
    """``zeropp --help`` lists every command without importing torch (a cold start on a login
    node), and a subcommand's own ``--help`` has its options."""
    code = ("import sys\nfrom zeropp.tools.cli import build_parser\n"
            "text = build_parser(['--help']).format_help()\n"
            "print('torch' in sys.modules, text)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.startswith("False")
    for name in ("demo", "bench", "converge", "finetune", "checkpoint", "cluster", "launch"):
        assert f"    {name}" in out
    demo = subprocess.run([sys.executable, "-m", "zeropp.tools.cli", "demo", "--help"], capture_output=True, text=True)
    assert demo.returncode == 0 and "--ranks-per-node" in demo.stdout, demo.stderr
