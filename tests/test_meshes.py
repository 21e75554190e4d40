"""zeropp on 2-D meshes: tensor parallel x FSDP (torchtitan's layout) and HSDP.

Each test builds the same composition twice on the same weights and data, once with FSDP2's own
collectives and once with zeropp, and compares the full gradients after one backward. ZeRO-3's
path must give them bit for bit; qgZ within the bound of its hops on the unit's shard group
([Note: shard groups on nodes] in ``zeropp.setup.topology``), derived from the largest gradient entry
any data-parallel rank contributes (``_bound``), computed here by a single process.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tests.distributed import run_distributed
from torch import nn

import zeropp

WIDTH, HIDDEN, BATCH, NUM_BLOCKS = 32, 64, 4, 2
QMAX_INT4 = 7


def _model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    blocks = [nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, WIDTH)) for _ in range(NUM_BLOCKS)]
    return nn.Sequential(*blocks, nn.Linear(WIDTH, 1))


def _batch(dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + dp_rank)
    return torch.randn(BATCH, WIDTH, generator=generator), torch.randn(BATCH, 1, generator=generator)


def _loss(model: nn.Module, dp_rank: int) -> torch.Tensor:
    inputs, targets = _batch(dp_rank)
    return nn.functional.mse_loss(model(inputs), targets)


def _sharded(layout: str, tp: int, options: dict | None) -> tuple[nn.Module, int]:
    """The model on a 2-D mesh: ``tp`` (tensor parallel inside the node, FSDP across, built as
    torchtitan builds it) or ``hsdp`` (replicate across nodes, shard inside); with zeropp's
    ``options`` or (None) FSDP2 alone. Returns it and this rank's data-parallel index."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    world_size = torch.distributed.get_world_size()
    model = _model(0)
    if layout == "tp":
        mesh = init_device_mesh("cpu", (world_size // tp, tp), mesh_dim_names=("dp_shard", "tp"))
        for block in model[:NUM_BLOCKS]:
            parallelize_module(block, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        dp_mesh, dp_rank = mesh["dp_shard"], mesh["dp_shard"].get_local_rank()
    else:
        per_node = int(__import__("os").environ["ZEROPP_RANKS_PER_NODE"])
        dp_mesh = init_device_mesh("cpu", (world_size // per_node, per_node), mesh_dim_names=("replicate", "shard"))
        dp_rank = torch.distributed.get_rank()
    for block in model[:NUM_BLOCKS]:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    if options is not None:
        zeropp.enable(model, zeropp.ZeroPPConfig(**options))
    return model, dp_rank


def _gradients(rank: int, world_size: int, layout: str, tp: int, options: dict) -> dict | None:
    """Full gradients of FSDP2's run and zeropp's, and zeropp's cross-node bytes by technique."""
    out = {}
    for name, chosen in (("fsdp2", None), ("zeropp", options)):
        zeropp.comm_ledger().reset()
        model, dp_rank = _sharded(layout, tp, chosen)
        _loss(model, dp_rank).backward()
        out[name] = {n: p.grad.full_tensor().numpy() for n, p in model.named_parameters()}
        out[f"{name}_ledger"] = {k: v["cross_node_bytes"]
                                 for k, v in zeropp.comm_ledger().summary()["by_technique"].items()}
    return out if rank == 0 else None


def _largest_contributions(num_dp_ranks: int) -> dict[str, float]:
    """Per parameter, the largest gradient entry any data-parallel rank's batch gives (one process)."""
    largest: dict[str, float] = {}
    for dp_rank in range(num_dp_ranks):
        model = _model(0)
        _loss(model, dp_rank).backward()
        for name, p in model.named_parameters():
            largest[name] = max(largest.get(name, 0.0), float(p.grad.abs().max()))
    return largest


def _bound(largest: float, num_nodes: int, per_node: int) -> float:
    """qgZ's error on the average over the N x D ranks of a shard group, INT4 both hops, each
    block's scale at most ``largest`` / 7 (its absmax over the qmax): hop 1 adds half a step for
    each of the D - 1 peers' rows, hop 2 half a step of each of the N - 1 partials, whose entries
    are at most D x largest plus hop 1's error. Own rows travel exact ([Note: qgZ own rows])."""
    step = largest / QMAX_INT4
    hop1 = (per_node - 1) * step / 2
    hop2 = (num_nodes - 1) * (per_node * largest + hop1) / QMAX_INT4 / 2 if num_nodes > 1 else 0.0
    return (hop1 + hop2) / (num_nodes * per_node) + 1e-6 * largest


def _check(result: dict, num_dp_ranks: int, num_nodes: int, per_node: int, exact: bool) -> None:
    largest = _largest_contributions(num_dp_ranks)
    for name, reference in result["fsdp2"].items():
        got = result["zeropp"][name]
        if exact:
            np.testing.assert_array_equal(got, reference, err_msg=name)
            continue
        error = float(np.abs(got - reference).max())
        bound = _bound(largest[name], num_nodes, per_node)
        assert error <= bound, f"{name}: error {error:.3g} over the bound {bound:.3g}"
    if not exact:  # a block of one element codes exactly; the matrices cannot
        matrices = [name for name, g in result["fsdp2"].items() if g.ndim == 2]
        assert all(np.abs(result["zeropp"][n] - result["fsdp2"][n]).max() > 0 for n in matrices), "not quantized?"


LAYOUTS = [
    # (world, ranks per node, tp): the data-parallel group's ranks on nodes
    pytest.param(4, 2, 2, 2, 1, id="2x2-tp2-one-dp-rank-per-node"),
    pytest.param(8, 4, 2, 2, 2, id="2x4-tp2-two-hops", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("world", "per_node", "tp", "num_nodes", "dp_per_node"), LAYOUTS)
def test_tensor_parallel_x_fsdp_zero3_path_equals_fsdp2(world: int, per_node: int, tp: int, num_nodes: int,
                                                         dp_per_node: int) -> None:
    result = run_distributed(_gradients, world, "tp", tp, {}, env={"ZEROPP_RANKS_PER_NODE": str(per_node)})[0]
    _check(result, world // tp, num_nodes, dp_per_node, exact=True)


@pytest.mark.parametrize(("world", "per_node", "tp", "num_nodes", "dp_per_node"), LAYOUTS)
def test_tensor_parallel_x_fsdp_qgz_within_the_bound_of_its_shard_group(
        world: int, per_node: int, tp: int, num_nodes: int, dp_per_node: int) -> None:
    """qgZ on the data-parallel sub-mesh: one quantized all-to-all across nodes where the group
    has one rank per node, two hops where it has several; the DTensor parameters' local shards
    are coded as plain rows."""
    options = {"quantized_gradients": True}
    result = run_distributed(_gradients, world, "tp", tp, options, env={"ZEROPP_RANKS_PER_NODE": str(per_node)})[0]
    _check(result, world // tp, num_nodes, dp_per_node, exact=False)


def test_tensor_parallel_x_fsdp_with_qwz_and_qgz_sends_only_codes_across_nodes() -> None:
    """With qwZ and qgZ every FSDP collective of this layout crosses nodes, and each sends codes:
    the ledger books no full-precision byte across nodes, and the gradients stay finite."""
    options = {"quantized_weights": True, "quantized_gradients": True}
    result = run_distributed(_gradients, 4, "tp", 2, options, env={"ZEROPP_RANKS_PER_NODE": "2"})[0]
    crossing = result["zeropp_ledger"]
    assert crossing["qwZ"] > 0 and crossing["qgZ"] > 0 and crossing.get("fsdp", 0) == 0, crossing
    assert all(np.isfinite(g).all() for g in result["zeropp"].values())


def test_hsdp_qgz_reduces_inside_the_node() -> None:
    """HSDP (replicate across nodes, shard inside): qgZ's shard group is one node, so it is hop 1
    alone, INT4; the replicas' all-reduce stays FSDP2's."""
    options = {"quantized_gradients": True}
    result = run_distributed(_gradients, 4, "hsdp", 1, options, env={"ZEROPP_RANKS_PER_NODE": "2"})[0]
    _check(result, 4, 1, 2, exact=False)


def _replica_bound(largest: float, num_replicas: int) -> float:
    """The replicas' reduction's error on the average over R replicas, INT4 both ways, every
    replica's shard average at most ``largest``: half a step of each of the R - 1 rows sent, then
    half a step of the reduced row (at most R x largest plus that) in the all-gather, over R."""
    sent = (num_replicas - 1) * largest / QMAX_INT4 / 2
    gathered = (num_replicas * largest + sent) / QMAX_INT4 / 2
    return (sent + gathered) / num_replicas + 1e-6 * largest


def _replica_shards(rank: int, world_size: int, options: dict) -> dict:
    """This rank's gradient shards under quantized HSDP, FSDP2's full gradients, zeropp's, and
    the cross-node bytes of zeropp's run by technique, and what enable logged."""
    import logging

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("zeropp").addHandler(handler)
    from zeropp.fsdp.access import fsdp_units, secondary_bytes_held

    out = _gradients(rank, world_size, "hsdp", 1, options) or {}
    model, dp_rank = _sharded("hsdp", 1, options)
    loss = _loss(model, dp_rank)
    out["held_after_forward"] = secondary_bytes_held(fsdp_units(model))
    loss.backward()
    out["shards"] = {n: p.grad.to_local().numpy() for n, p in model.named_parameters()}
    out["logged"] = records
    return out


def test_quantized_hsdp_reduces_replicas_in_int4_and_every_replica_holds_the_same_gradients() -> None:
    """HSDP with the replicas' all-reduce quantized: FSDP2's all-reduce is off, the comm reduces
    across replicas within ``_replica_bound`` of FSDP2's exact HSDP gradients, the replicas of a
    shard hold bit for bit the same values, and the cross-node bytes are the replicas' INT4
    exchange alone."""
    results = run_distributed(_replica_shards, 4, {"quantized_replica_gradients": True},
                              env={"ZEROPP_RANKS_PER_NODE": "2"})
    largest = _largest_contributions(4)
    for name, reference in results[0]["fsdp2"].items():
        error = float(np.abs(results[0]["zeropp"][name] - reference).max())
        assert error <= _replica_bound(largest[name], 2), name
    for name in results[0]["shards"]:  # ranks 0 and 2 hold shard 0 on two replicas; 1 and 3 shard 1
        np.testing.assert_array_equal(results[0]["shards"][name], results[2]["shards"][name])
        np.testing.assert_array_equal(results[1]["shards"][name], results[3]["shards"][name])
    crossing = results[0]["zeropp_ledger"]
    assert crossing["replicas"] > 0 and crossing.get("fsdp", 0) == 0, crossing
    assert results[0]["held_after_forward"] == 0  # no second shard kept between forward and backward


def _replicas_trained(rank: int, world_size: int) -> dict:
    """Three AdamW steps of quantized HSDP (qgZ inside the node too), without and with ``overlap``:
    the losses and this rank's shards, and how many of the calls with ``overlap`` ran late."""
    from zeropp.techniques.replicas import ReplicatedReduceScatter

    late = [0]
    gather_late = ReplicatedReduceScatter._gather_late

    def counted(self, *args):  # noqa: ANN001, ANN202
        late[0] += 1
        return gather_late(self, *args)

    ReplicatedReduceScatter._gather_late = counted
    out = {}
    for overlap in (False, True):
        model, dp_rank = _sharded("hsdp", 1, {"quantized_replica_gradients": True, "quantized_gradients": True,
                                              "overlap": overlap})
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for _ in range(3):
            loss = _loss(model, dp_rank)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        shards = {n: p.to_local().detach().numpy().copy() for n, p in model.named_parameters()}
        out[overlap] = {"losses": losses, "shards": shards}
    out["late"] = late[0]
    return out


def test_quantized_hsdp_reduces_replicas_beside_backward_bit_for_bit() -> None:
    """With ``overlap`` the replicas' exchanges run while backward goes on ([Note: the replicas'
    reduction beside backward]): every unit's call (3 units, 3 steps) ran late, and training is
    the same as without ``overlap``, bit for bit, on every rank."""
    for r in run_distributed(_replicas_trained, 4, env={"ZEROPP_RANKS_PER_NODE": "2"}):
        assert r["late"] == 3 * (NUM_BLOCKS + 1), r["late"]
        assert r[True]["losses"] == r[False]["losses"]
        for name, shard in r[False]["shards"].items():
            np.testing.assert_array_equal(r[True]["shards"][name], shard, err_msg=name)


def test_qwz_under_hsdp_says_it_changes_nothing() -> None:
    """HSDP gathers inside the node, where qwZ sends full precision: enable says so and names
    the option that quantizes those gathers."""
    logged = run_distributed(_replica_shards, 4, {"quantized_weights": True}, env={"ZEROPP_RANKS_PER_NODE": "2"})
    assert any("quantize_intra_node_weights" in message for message in logged[0]["logged"]), logged[0]["logged"]


def _replicas_without_hsdp(rank: int, world_size: int) -> str:
    model, _ = _sharded("tp", 2, None)
    try:
        zeropp.enable(model, zeropp.ZeroPPConfig(quantized_replica_gradients=True))
    except ValueError as error:
        return str(error)
    return "accepted"


def test_quantized_replica_gradients_without_replicas_is_refused() -> None:
    message = run_distributed(_replicas_without_hsdp, 4, env={"ZEROPP_RANKS_PER_NODE": "2"})[0]
    assert "quantized_replica_gradients" in message and "no replicas" in message, message


def _hpz_on_tensor_parallel(rank: int, world_size: int) -> dict | None:
    """qwZ alone and qwZ with hpZ over the node's data-parallel ranks, TP 2 on 2 nodes x 4: full
    gradients after one backward, and each run's cross-node bytes by technique."""
    out = {}
    for name, options in (("zero3", {}), ("hpz_alone", {"hpz_partition_size": 2}), ("qwz", {"quantized_weights": True}),
                          ("hpz", {"quantized_weights": True, "hpz_partition_size": 2})):
        zeropp.comm_ledger().reset()
        model, dp_rank = _sharded("tp", 2, options)
        _loss(model, dp_rank).backward()
        out[name] = {n: p.grad.full_tensor().numpy() for n, p in model.named_parameters()}
        ledger = zeropp.comm_ledger()
        out[f"{name}_ledger"] = ledger.summary()["by_technique"]
        out[f"{name}_gathers"] = [ledger.summary(op="all_gather", **phase)["total"]["cross_node_bytes"]
                                  for phase in ({"phase": "forward"}, {})]
    return out if rank == 0 else None


@pytest.mark.slow
def test_hpz_on_tensor_parallel_keeps_its_copy_on_the_node_and_changes_no_bit() -> None:
    """hpZ on a 2-D mesh ([Note: hpZ on a 2-D mesh]): the data-parallel group holds 2 ranks of
    each node, which keep the forward's rows (qwZ's codes, or the gathered weights) between them;
    backward's gathers run inside the node (none of their bytes crosses) with the forward's
    weights, so the gradients are those of the same run without hpZ bit for bit, and only the
    forward's gathers cross nodes."""
    result = run_distributed(_hpz_on_tensor_parallel, 8, env={"ZEROPP_RANKS_PER_NODE": "4"})[0]
    for with_hpz, without in (("hpz", "qwz"), ("hpz_alone", "zero3")):
        for name, reference in result[without].items():
            np.testing.assert_array_equal(result[with_hpz][name], reference, err_msg=f"{with_hpz}: {name}")
        hpz = result[f"{with_hpz}_ledger"]["hpZ"]
        assert hpz["bytes"] > 0 and hpz["cross_node_bytes"] == 0, hpz
        forward, every = result[f"{without}_gathers"]
        assert result[f"{with_hpz}_gathers"] == [forward, forward] and forward < every, result


def _hpz_refused(rank: int, world_size: int, layout: str, options: dict) -> str:
    model, _ = _sharded(layout, 2, None)
    try:
        zeropp.enable(model, zeropp.ZeroPPConfig(**options))
    except ValueError as error:
        return str(error)
    return "accepted"


@pytest.mark.parametrize(("layout", "options", "says"), [
    ("tp", {"quantized_weights": True, "hpz_partition_size": 2}, "a node holds no partition"),
    ("hsdp", {"quantized_weights": True, "hpz_partition_size": 2}, "hpZ has nothing to save"),
])
def test_hpz_where_it_cannot_work_on_a_2d_mesh_is_refused(layout: str, options: dict, says: str) -> None:
    """TP filling the node leaves one data-parallel rank per node; HSDP's shard group is a node:
    either way a ValueError at set-up naming hpZ and what to set."""
    message = run_distributed(_hpz_refused, 4, layout, options, env={"ZEROPP_RANKS_PER_NODE": "2"})[0]
    assert says in message and "hpz_partition_size=1" in message, message
