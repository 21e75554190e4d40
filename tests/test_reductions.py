"""Every reduction FSDP2 may ask a reduce-scatter comm for (comms [Note: the reductions FSDP2 asks
for]): AVG, SUM and PREMUL_SUM with a factor, from each setting that produces them, through the
counted comm (zeropp's ZeRO-3) and qgZ, on 2 nodes x 2 ranks; anything else is refused by name."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import zeropp
from distributed import run_distributed
from zeropp.fsdp.access import fsdp_units, reduce_op_parts
from zeropp.fsdp.comms import CountingReduceScatter
from zeropp.setup.topology import Topology, build_process_groups
from zeropp.techniques.qgz import HierarchicalQuantizedReduceScatter

TWO_BY_TWO = {"ZEROPP_RANKS_PER_NODE": "2"}
WIDTH = 8

# setting -> (gradient_divide_factor, force_sum_reduction_for_comms, reduce_dtype)
SETTINGS = {
    "default": (None, False, None),
    "factor_1": (1.0, False, None),  # torchtitan's
    "factor_3": (3.0, False, None),
    "factor_world": (4.0, False, None),
    "forced_sum": (None, True, None),
    "forced_sum_factor_1": (1.0, True, None),
    "bf16_reduce": (None, False, torch.bfloat16),
    "fp16_reduce": (None, False, torch.float16),
}
OPS_ASKED = {  # what FSDP2 hands the comm for each setting: (op, PREMUL_SUM's factor)
    "default": ("AVG", None), "factor_1": ("PREMUL_SUM", 1.0), "factor_3": ("PREMUL_SUM", 1 / 3),
    "factor_world": ("AVG", None), "forced_sum": ("SUM", None), "forced_sum_factor_1": ("SUM", None),
    "bf16_reduce": ("AVG", None), "fp16_reduce": ("SUM", None),
}
MODES = ("fsdp", "counted", "counted_overlap", "qgz", "qgz_overlap")


_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup) -> None:
    """FSDP2's default reduce-scatter (torch 2.13 renamed it; 2.11 has only the old name)."""
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(output, input, op=op, group=group)


class RecordingReduceScatter(CountingReduceScatter):
    """zeropp's counted reduce-scatter, keeping each call's op, input (as given) and output."""

    def __init__(self, topology: Topology) -> None:
        super().__init__(topology)
        self.calls: list[tuple[str, float | None, torch.Tensor, torch.Tensor, dist.ProcessGroup]] = []

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: dist.ReduceOp, async_op: bool = False) -> dist.Work | None:
        given = input_tensor.clone()
        result = super().__call__(output_tensor, input_tensor, group, op, async_op)
        kind, factor = reduce_op_parts(op)
        self.calls.append((kind.name, factor, given, output_tensor.clone(), group))
        return result


def _model(setting: str) -> nn.Module:
    factor, force_sum, reduce_dtype = SETTINGS[setting]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 2))
    policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    for module in (model[0], model[2], model):
        fully_shard(module, mp_policy=policy)
    for unit in fsdp_units(model):
        if factor is not None:
            unit.set_gradient_divide_factor(factor)
        unit.set_force_sum_reduction_for_comms(force_sum)
    return model


def _gradients(setting: str, mode: str, rank: int, topology: Topology) -> tuple[list[torch.Tensor], list]:
    """This rank's gradient shards after one backward, and the counted comm's recorded calls."""
    model = _model(setting)
    recorders = []
    if mode == "counted":
        recorders = [RecordingReduceScatter(topology) for _ in fsdp_units(model)]
        for unit, recorder in zip(fsdp_units(model), recorders):
            unit.set_custom_reduce_scatter(recorder)
    elif mode != "fsdp":
        zeropp.enable(model, zeropp.ZeroPPConfig(quantized_gradients=mode.startswith("qgz"),
                                                 overlap=mode.endswith("overlap")), topology=topology)
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(rank))
    (model(x) ** 2).sum().backward()
    return [p.grad.to_local().clone() for p in model.parameters()], [c for r in recorders for c in r.calls]


def _by_hand(calls: list, world_size: int) -> list[dict]:
    """Each counted call against the same math done by hand in fp32 (PREMUL_SUM: every rank's
    input times the factor, then gloo's SUM; AVG and SUM: gloo's own reduce-scatter, which is
    FSDP2's default comm) and against the exact float64 result, with its rounding bound: the
    products round once (u |f x_r|) and the W - 1 fp32 additions of any order at most
    (W - 1) u sum_r |f x_r| (first order; AVG divides that by W and rounds once more), so
    |error| <= W u sum_r |f x_r| / (W for AVG), u the unit roundoff of the reduce dtype (2^-24
    for fp32)."""
    checks = []
    for kind, factor, given, output, group in calls:
        scaled = given * factor if kind == "PREMUL_SUM" else given
        by_hand = torch.empty_like(output)
        _reduce_scatter(by_hand, scaled.clone(), dist.ReduceOp.AVG if kind == "AVG" else dist.ReduceOp.SUM, group)
        everyone = torch.empty(world_size * scaled.numel(), dtype=scaled.dtype)
        _all_gather(everyone, scaled, group=group)
        mine = everyone.view(world_size, world_size, -1)[:, dist.get_rank(group)].double()
        divisor = world_size if kind == "AVG" else 1
        exact = mine.sum(0) / divisor
        bound = world_size * torch.finfo(output.dtype).eps / 2 * mine.abs().sum(0) / divisor
        check = {"kind": kind, "equal": torch.equal(output, by_hand),
                 "excess": ((output.double() - exact).abs() - bound).max().item()}
        if kind == "PREMUL_SUM" and factor != 1:  # the by-hand check tells premultiplying from scaling the sum
            summed = torch.empty_like(output)
            _reduce_scatter(summed, given.clone(), dist.ReduceOp.SUM, group)
            check["sum_then_scale_differs"] = not torch.equal(summed * factor, output)
        checks.append(check)
    return checks


def _reductions_worker(rank: int, world_size: int) -> dict:
    topology = Topology.from_env()
    grads, asked, by_hand = {}, {}, {}
    for setting in SETTINGS:
        for mode in MODES:
            if mode == "fsdp" and OPS_ASKED[setting][0] == "PREMUL_SUM":
                continue  # gloo cannot run PREMUL_SUM: FSDP2's default comm fails
            shards, calls = _gradients(setting, mode, rank, topology)
            grads[setting, mode] = [(str(t.dtype), t.tolist()) for t in shards]  # tensors do not outlive the rank
            if calls:
                asked[setting] = sorted({(kind, factor) for kind, factor, *_ in calls})
                by_hand[setting] = _by_hand(calls, world_size)
    return {"grads": grads, "asked": asked, "by_hand": by_hand, "refused": _refusals(topology)}


def _refusals(topology: Topology) -> list[str]:
    """What each comm says for ops FSDP2 never passes (raised before any collective)."""
    groups = build_process_groups(topology)
    world = groups.mesh.get_group()
    comms = [CountingReduceScatter(topology),
             HierarchicalQuantizedReduceScatter(groups, [4 * 16], bits_intra=4, bits_inter=4, block_size=16)]
    messages = []
    for op in (dist.ReduceOp.MAX, dist.ReduceOp.PRODUCT, dist._make_nccl_premul_sum(torch.tensor(0.5))):
        for comm in comms:
            try:
                comm(torch.empty(16), torch.ones(64), world, op)
                messages.append("accepted")
            except ValueError as error:
                messages.append(str(error))
    return messages


@pytest.fixture(scope="module")
def reductions() -> list[dict]:
    return run_distributed(_reductions_worker, 4, env=TWO_BY_TWO, timeout=300)


def test_each_setting_asks_for_the_op_comms_note_lists(reductions: list[dict]) -> None:
    """FSDP2's rule, as the note lists it: AVG by default and when the factor is the world
    size; PREMUL_SUM(1 / f) for any other factor; SUM when sums are forced or the reduce dtype
    is fp16."""
    for result in reductions:
        assert {s: calls[0] for s, calls in result["asked"].items()} == OPS_ASKED
        assert all(len(calls) == 1 for calls in result["asked"].values())


def test_the_counted_comm_is_the_same_math_done_by_hand(reductions: list[dict]) -> None:
    """Every call, every op: bit for bit gloo's own reduce-scatter (AVG, SUM) or the inputs
    multiplied by the factor and summed (PREMUL_SUM), which is NCCL's PREMUL_SUM; within the
    derived rounding of the exact result. Summing first and scaling after gives other bits for
    factor 1/3 (in some unit's call), so the check tells the two apart."""
    for result in reductions:
        for setting, checks in result["by_hand"].items():
            for check in checks:
                assert check["equal"], (setting, check)
                assert check["excess"] <= 0, (setting, check)
        assert any(check["sum_then_scale_differs"] for check in result["by_hand"]["factor_3"])


def test_gradients_equal_fsdp2_under_every_setting(reductions: list[dict]) -> None:
    """zeropp's counted comm gives FSDP2's own gradients bit for bit wherever gloo runs the op;
    PREMUL_SUM(1.0), torchtitan's, gives the gradients of forced sums with factor 1 (the same
    sum); with ``overlap`` (a late finish where FSDP2 divides nothing after the collective)
    every comm gives its bits without it."""
    for result in reductions:
        grads = _tensors(result)
        for setting, (kind, _) in OPS_ASKED.items():
            if kind != "PREMUL_SUM":
                _assert_equal(grads[setting, "counted"], grads[setting, "fsdp"], setting)
            _assert_equal(grads[setting, "counted_overlap"], grads[setting, "counted"], setting)
            _assert_equal(grads[setting, "qgz_overlap"], grads[setting, "qgz"], setting)
        _assert_equal(grads["factor_1", "counted"], grads["forced_sum_factor_1", "fsdp"], "factor_1")


def test_qgz_applies_each_op_to_its_fp32_total(reductions: list[dict]) -> None:
    """qgZ's fp32 total T (sums forced, factor 1: nothing divides it) is the same under every
    fp32 setting (the same inputs, quantized the same way); the gradients are then T / 4 (AVG,
    and forced sums that FSDP2 divides by the world size after), T (PREMUL_SUM(1.0)) and
    T x 1/3 (PREMUL_SUM(1/3)), bit for bit. qgZ's error against the exact sum, for every op,
    is bounded in tests/test_qgz.py."""
    for result in reductions:
        grads = _tensors(result)
        total = grads["forced_sum_factor_1", "qgz"]
        quarter = [t / 4 for t in total]
        for setting in ("default", "factor_world", "forced_sum"):
            _assert_equal(grads[setting, "qgz"], quarter, setting)
        _assert_equal(grads["factor_1", "qgz"], total, "factor_1")
        _assert_equal(grads["factor_3", "qgz"], [t.clone().mul_(1 / 3) for t in total], "factor_3")
        assert not all(torch.equal(q, c) for q, c in zip(grads["default", "qgz"], grads["default", "counted"])), \
            "qgZ gave the exact gradients: was anything quantized?"


def test_ops_fsdp2_never_asks_for_are_refused_by_name(reductions: list[dict]) -> None:
    """MAX, PRODUCT and a PREMUL_SUM whose factor is a (per-rank) tensor: a ValueError from
    both comms that names the op and lists what is supported."""
    for message in reductions[0]["refused"]:
        assert "is not supported; supported: ReduceOp.AVG, ReduceOp.SUM, or ReduceOp.PREMUL_SUM" in message
    assert [m.split(" is not")[0] for m in reductions[0]["refused"][::2]] == [
        "a gradient reduce-scatter with ReduceOp.MAX", "a gradient reduce-scatter with ReduceOp.PRODUCT",
        "a gradient reduce-scatter with ReduceOp.PREMUL_SUM with factor tensor(0.5000)"]


def _tensors(result: dict) -> dict:
    """A rank's gradients as tensors again (sent as values: the dtype is exact for their values)."""
    return {key: [torch.tensor(values, dtype=getattr(torch, dtype.removeprefix("torch."))) for dtype, values in shards]
            for key, shards in result["grads"].items()}


def _assert_equal(got: list[torch.Tensor], want: list[torch.Tensor], setting: str) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w), (setting, (g - w).abs().max().item())
