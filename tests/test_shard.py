"""zeropp.shard with no ZeRO++ technique on must train exactly like single-process PyTorch."""

from __future__ import annotations

import math
import sys

import pytest
import torch
from torch import nn

import zeropp
from distributed import run_distributed
from models import global_batch, make_model, reference_copy, rows, train_steps
from zeropp.setup.sharding import default_units, select_units

GLOBAL_BATCH = 8
TWO_BY_TWO = {"ZEROPP_RANKS_PER_NODE": "2"}


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}


def _max_relative_error(model: nn.Module, reference: nn.Module) -> float:
    full = _full_params(model)
    worst = 0.0
    for name, ref in reference.named_parameters():
        worst = max(worst, ((full[name].float() - ref).norm() / ref.norm()).item())
    return worst


def _relative_change(model: nn.Module, initial: nn.Module) -> float:
    """||theta - theta_0|| / ||theta_0|| over all trainable parameters together."""
    pairs = [(p, p0) for p, p0 in zip(model.parameters(), initial.parameters()) if p.requires_grad]
    change = sum((p - p0).square().sum() for p, p0 in pairs)
    return (change / sum(p0.square().sum() for _, p0 in pairs)).sqrt().item()


def _train_against_reference(rank: int, world_size: int, kind: str, micro_steps: int, num_steps: int,
                             param_dtype: torch.dtype | None) -> dict:
    """Train the sharded model on this rank's rows and a single-process copy on the whole batch."""
    model = make_model(kind)
    reference = reference_copy(model)
    initial = reference_copy(model)
    config = zeropp.ZeroPPConfig(param_dtype=param_dtype,
                                 reduce_dtype=torch.float32 if param_dtype else None)
    zeropp.shard(model, config)
    # SGD, not Adam: Adam's first step moves every element by ~lr * sign(grad), so a gradient that
    # is mathematically zero (attention's key bias) turns fp32 summation noise into lr-sized
    # differences. SGD passes gradient differences on linearly, which is what we bound.
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    ref_opt = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.2, momentum=0.9)
    micro_batch = GLOBAL_BATCH // micro_steps

    def batch(step: int, micro: int, local: bool) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = (rows(t, micro, micro_steps) for t in global_batch(step, GLOBAL_BATCH))
        return (rows(x, rank, world_size), rows(y, rank, world_size)) if local else (x, y)

    assert micro_batch % world_size == 0
    errors, losses, ref_losses = [], [], []
    frozen_before = {n: p.full_tensor().clone() for n, p in model.named_parameters() if not p.requires_grad}
    for step in range(num_steps):
        train_steps(model, opt, lambda s, m: batch(step, m, True), 1, micro_steps,
                    lambda s, loss: losses.append(loss))
        train_steps(reference, ref_opt, lambda s, m: batch(step, m, False), 1, micro_steps,
                    lambda s, loss: ref_losses.append(loss))
        errors.append(_max_relative_error(model, reference))
    frozen_unchanged = all(torch.equal(p.full_tensor(), frozen_before[n])
                           for n, p in model.named_parameters() if not p.requires_grad)
    moved = _relative_change(reference, initial)
    return {"errors": errors, "moved": moved, "losses": losses, "ref_losses": ref_losses,
            "frozen_unchanged": frozen_unchanged,
            "sharded_dtype": next(model.parameters()).to_local().dtype,
            "ledger": zeropp.comm_ledger().summary()}


@pytest.mark.parametrize("kind,micro_steps", [("gpt", 1), pytest.param("gpt", 2, marks=pytest.mark.slow),
                                              pytest.param("tied", 2, marks=pytest.mark.slow)])
def test_fp32_training_equals_single_process(kind: str, micro_steps: int) -> None:
    """fp32: parameters equal single-process training on the same global batch within 1e-5
    relative (per tensor, ||p - p_ref|| / ||p_ref||) after every one of 5 steps. The only
    difference is the order of floating-point sums in the gradient mean."""
    results = run_distributed(_train_against_reference, 4, kind, micro_steps, 5, None, env=TWO_BY_TWO)
    for r in results:
        assert len(r["errors"]) == 5
        assert max(r["errors"]) <= 1e-5, r["errors"]
        assert r["frozen_unchanged"]
        assert r["moved"] >= 100 * 1e-5, "parameters barely moved, so the comparison proves little"


@pytest.mark.slow
def test_bf16_mixed_precision_tracks_fp32() -> None:
    """bf16 parameters with fp32 gradient reduction against the fp32 single-process run.

    Bound: bf16 keeps 8 significant bits (unit roundoff u = 2^-8). At step 1 both runs hold the
    same weights; bf16 rounds weights and activations (relative error ~u each) while the loss is
    reduced in fp32, so the loss deviates by at most 2u relative (measured: 0.05u). Afterwards
    the trajectories drift apart through the rounded gradients; we allow 8u per step (measured:
    at most 3.1u by step 5) and a parameter deviation of 5% of the parameter norm after 5 SGD
    steps (measured 2.1%, against 0 for a correct fp32 run and ~100% for a broken one).
    """
    results = run_distributed(_train_against_reference, 4, "gpt", 1, 5, torch.bfloat16, env=TWO_BY_TWO)
    r = results[0]
    u = 2.0 ** -8
    first, ref_first = r["losses"][0], r["ref_losses"][0]
    assert abs(first - ref_first) <= 2 * u * ref_first
    for loss, ref in zip(r["losses"], r["ref_losses"]):
        assert abs(loss - ref) <= 8 * u * abs(ref), (r["losses"], r["ref_losses"])
    assert max(r["errors"]) <= 0.05
    assert max(r["errors"]) > 0, "bf16 run identical to fp32: mixed precision was not applied"
    assert r["sharded_dtype"] == torch.float32
    assert set(r["ledger"]["by_op"]) == {"all_gather", "reduce_scatter", "all_reduce"}  # all_reduce: zeropp.fsdp.unused


class _Stack(nn.Module):
    """A known model for the closed-form byte count: three units and a root-owned head."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(10, 7), nn.Linear(7, 7), nn.Linear(7, 9))
        self.head = nn.Linear(9, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(x))


def _padded_shard_numel(shape: torch.Size, world_size: int) -> int:
    """Elements of one rank's shard: FSDP2 pads dim 0 up to a multiple of the world size."""
    rows_per_rank = math.ceil(shape[0] / world_size)
    return rows_per_rank * math.prod(shape[1:])


def _one_step_ledger(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = _Stack()
    shapes = [[p.shape for p in unit.parameters()] for unit in [*model.layers, model.head]]
    zeropp.shard(model)
    zeropp.comm_ledger().reset()
    model(torch.randn(4, 10)).square().mean().backward()
    ledger = zeropp.comm_ledger()
    return {"shapes": shapes, "all": ledger.summary(),
            "forward": ledger.summary(phase="forward"), "backward": ledger.summary(phase="backward")}


def test_ledger_matches_closed_form_2x2() -> None:
    """One fp32 step of a known model: every unit (the root's head included) is gathered in
    forward and again in backward, and its gradients reduce-scattered. Per unit each rank owes
    its padded shard (S elements, 4 bytes) to each of W-1 = 3 peers, 2 of them on the other node;
    beside that, one byte per parameter all-reduced (which ranks had a gradient, zeropp.fsdp.unused)."""
    results = run_distributed(_one_step_ledger, 4, env=TWO_BY_TWO)
    world_size = 4
    shard_bytes = sum(4 * _padded_shard_numel(s, world_size) for unit in results[0]["shapes"] for s in unit)
    num_units = len(results[0]["shapes"])
    for rank, r in enumerate(results):
        # gloo's rings (see zeropp.fsdp.ledger): ranks 1 and 3 send to the other node, 0 and 2 do not;
        # its reduce-scatter is a ring all-reduce, twice an all-gather's bytes.
        crosses = rank in (1, 3)
        for phase in ("forward", "backward"):
            gathers = r[phase]["by_op"]["all_gather"]
            assert gathers == {"calls": num_units, "bytes": 3 * shard_bytes, "cross_node_bytes": 2 * shard_bytes,
                               "backend_bytes": 3 * shard_bytes,
                               "backend_cross_node_bytes": 3 * shard_bytes * crosses}
        assert "reduce_scatter" not in r["forward"]["by_op"]
        rs = r["backward"]["by_op"]["reduce_scatter"]
        assert rs == {"calls": num_units, "bytes": 3 * shard_bytes, "cross_node_bytes": 2 * shard_bytes,
                      "backend_bytes": 6 * shard_bytes, "backend_cross_node_bytes": 6 * shard_bytes * crosses}
        presence_bytes = 2 * 3 * sum(len(unit) for unit in results[0]["shapes"])  # an all-reduce: two rounds
        assert r["backward"]["by_op"]["all_reduce"]["bytes"] == presence_bytes
        assert r["all"]["total"]["bytes"] == 9 * shard_bytes + presence_bytes
        assert r["all"]["by_group"] == {"world": r["all"]["total"]}


def test_default_units_are_the_repeated_blocks() -> None:
    model = make_model("gpt")
    assert default_units(model) == list(model.blocks)
    tied = make_model("tied")
    assert default_units(tied) == list(tied.layers)
    assert default_units(nn.Linear(3, 3)) == []


def test_select_units_by_class_and_instance_children_first() -> None:
    model = make_model("tied")
    picked = select_units(model, [nn.LayerNorm, model.layers[0]])
    assert picked.index(model.layers[0].norm) < picked.index(model.layers[0])
    assert model.norm in picked


@pytest.mark.parametrize("units,match", [
    ([nn.Conv2d], "matched no submodule"),
    ([nn.Linear(2, 2)], "not submodules"),
    (["layers"], "classes or modules"),
])
def test_select_units_errors(units: list, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        select_units(make_model("tied"), units)


def test_shard_without_process_group_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        zeropp.shard(make_model("tied"))


def _started_in_forward(ledger: zeropp.CommLedger) -> dict[str, int]:
    """The ledger's counts of forward gathers over the world or across nodes: what a gather
    started after the step sends (the two-hop gather's hop inside the node runs on use)."""
    totals = [ledger.summary(op="all_gather", phase="forward", kind=kind)["total"] for kind in ("world", "inter")]
    return {k: sum(t[k] for t in totals) for k in totals[0]}


def _train_with_and_without_overlap(rank: int, world_size: int, options: dict) -> dict:
    """Two SGD steps of two micro-batches each (the second adds to the first's gradients, so
    it must finish on time) of the GPT, sharded with ``options``, once with ``overlap`` and once
    without; how many qwZ gathers were decoded on wait and how many reduce-scatters finished late
    in the overlap run."""
    from zeropp.fsdp import comms

    counts = {"decoded_on_wait": 0, "finished_late": 0}
    original_init, original_finish_late = comms.DecodeOnWait.__init__, comms.finish_late

    def counting_init(self, *args):  # noqa: ANN001, ANN202
        counts["decoded_on_wait"] += 1
        original_init(self, *args)

    def counting_finish_late(finish):  # noqa: ANN001, ANN202
        counts["finished_late"] += 1
        original_finish_late(finish)

    comms.DecodeOnWait.__init__ = counting_init
    for module in (comms, sys.modules["zeropp.techniques.qgz"]):
        module.finish_late = counting_finish_late
    runs = {}
    for overlap in (False, True):
        model = make_model("gpt")
        zeropp.shard(model, zeropp.ZeroPPConfig(**options, overlap=overlap))
        opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
        zeropp.comm_ledger().reset()
        losses: list[float] = []
        train_steps(model, opt, lambda s, m: tuple(rows(t, rank, world_size) for t in global_batch(s, GLOBAL_BATCH)),
                    2, 2, lambda s, loss: losses.append(loss))
        ledger = zeropp.comm_ledger()
        runs[overlap] = {"params": _full_params(model), "losses": losses, "ledger": ledger.summary()["total"],
                         "forward_gathers": _started_in_forward(ledger),
                         "counts": dict(counts), "unfinished": len(comms._unfinished)}
    plain, overlapped = runs[False], runs[True]
    return {"params_equal": all(torch.equal(plain["params"][n], overlapped["params"][n]) for n in plain["params"]),
            "losses": (plain["losses"], overlapped["losses"]), "ledgers": (plain["ledger"], overlapped["ledger"]),
            "forward_gathers": plain["forward_gathers"],
            "counts": (plain["counts"], overlapped["counts"]), "unfinished": overlapped["unfinished"]}


@pytest.mark.parametrize("options", [
    {},
    pytest.param({"quantized_weights": True, "quantized_gradients": True, "hpz_partition_size": 2,
                  "hierarchical_gather": True}, marks=pytest.mark.slow),
])
def test_overlap_trains_bit_identically(options: dict) -> None:
    """``overlap`` changes when comms run, not what they carry: parameters after two steps are
    bit-identical to the run without it, every ledger count is equal but for the gathers the
    last step started for a next forward that never came ([Note: gathers after the step]: one
    forward's, as the root and both blocks are gathered first), reduce-scatters finished late
    (and none is left unfinished after backward), and with qwZ the gathers were issued
    asynchronously (decoded when FSDP2 waited for them)."""
    results = run_distributed(_train_with_and_without_overlap, 4, dict(options), env=TWO_BY_TWO)
    forwards = 4  # two steps of two micro-batches
    for r in results:
        assert r["params_equal"]
        assert r["losses"][0] == r["losses"][1]
        plain, overlapped = r["ledgers"]
        assert overlapped == {k: plain[k] + r["forward_gathers"][k] // forwards for k in plain}, r["ledgers"]
        plain, overlapped = r["counts"]
        assert plain == {"decoded_on_wait": 0, "finished_late": 0}
        assert overlapped["finished_late"] > 0 and r["unfinished"] == 0
        if options.get("quantized_weights"):
            assert overlapped["decoded_on_wait"] > 0


def _tensor_parallel_with_hpz(rank: int, world_size: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp_shard"])
    try:
        zeropp.enable(model, zeropp.ZeroPPConfig(quantized_weights=True, hpz_partition_size=2))
    except ValueError as error:
        return str(error)
    return "accepted"


def test_hpz_on_a_tensor_parallel_mesh_is_refused_at_set_up_not_in_forward() -> None:
    """Tensor parallel inside the node, FSDP across (torchtitan's 2-D layout): FSDP2 cannot
    reshard its DTensor parameters to hpZ's partition after forward (it raised
    NotImplementedError in the first forward). ``enable`` refuses it, naming hpZ and what works."""
    message = run_distributed(_tensor_parallel_with_hpz, 4, env={"ZEROPP_RANKS_PER_NODE": "2"})[0]
    assert "hpz_partition_size=2" in message and "sharded over 2 of 4 ranks" in message, message
    assert "hpz_partition_size=1" in message
