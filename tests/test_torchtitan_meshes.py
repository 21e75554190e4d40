"""zeropp on torchtitan's 2-D layouts: tensor parallel x FSDP and HSDP, built by torchtitan's own
llama3 debug model, ``parallelize_llama`` and weight init on 2 nodes x 2 gloo ranks (CPU, fp32,
SDPA: see ``test_torchtitan``), one forward and backward each, against torchtitan's plain FSDP2
of the same layout.

What torchtitan builds under ``spmd_backend="partial_dtensor"`` (world mesh unflattened to
``(pp, dp_replicate, fsdp, tp)``, tensor parallel innermost, so ranks 2k and 2k + 1 share a node):

- ``tensor_parallel_degree=2``: the blocks tensor parallel on ``tp`` = {0, 1}, {2, 3}, every unit
  sharded over the 1-D ``fsdp`` sub-mesh {0, 2}, {1, 3}, parameters DTensors on ``(fsdp, tp)``.
  The shard group has one rank per node: qgZ is one INT4 all-to-all across the nodes.
- ``data_parallel_replicate_degree=2``: every unit sharded on the 2-D ``(dp_replicate, fsdp)``
  mesh, shard groups {0, 1}, {2, 3} inside the nodes, replicas {0, 2}, {1, 3} across them.
- both (8 ranks, 2 nodes x 4): units on ``(dp_replicate, fsdp)``, parameters on the 3-D
  ``(dp_replicate, fsdp, tp)`` mesh.

The exact reference for a quantized reduction is the same run with the exact one, and the bound
comes from each data-parallel rank's (or replica's) own contribution to the summed gradient,
measured by a backward in which only that rank's loss counts (the others' weighs 0.0, so the
exact reduction returns that contribution unchanged).
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np
import pytest
import torch
import torch.distributed.fsdp

import zeropp
from bounds import QMAX_INT4, half_steps
from distributed import run_distributed

if sys.version_info < (3, 11) or not hasattr(torch.distributed.fsdp, "DataParallelMeshDims"):
    pytest.skip("torchtitan 0.3.0 needs Python >= 3.11 and torch >= 2.13 (it imports "
                "torch.distributed.fsdp.DataParallelMeshDims)", allow_module_level=True)

from test_torchtitan import CPU_OVERRIDES, LOCAL_BATCH, SEQ_LEN, _build, _first_order_loss_terms, _force_sum  # noqa: E402

TWO_BY_TWO = {"ZEROPP_RANKS_PER_NODE": "2"}
TENSOR_PARALLEL = ["--parallelism.tensor_parallel_degree", "2"]
REPLICATE = ["--parallelism.data_parallel_replicate_degree", "2"]
LAYOUTS = {"tp": TENSOR_PARALLEL, "hsdp": REPLICATE, "hsdp_tp": REPLICATE + TENSOR_PARALLEL}
FLOAT_SLACK = 1e-6
"""Relative room for fp32 rounding where a quantized sum is compared to an exact one."""
SHOWN = "feed_forward.w2.weight"
"""The parameter whose mesh the tests show (the first block's, row-wise under tensor parallelism)."""
ZERO3 = zeropp.ZeroPPConfig()
QWZ = zeropp.ZeroPPConfig(quantized_weights=True)
QWZ_QGZ = zeropp.ZeroPPConfig(quantized_weights=True, quantized_gradients=True)
REPLICAS = zeropp.ZeroPPConfig(quantized_replica_gradients=True)


def _trainer_config(layout: str, config: zeropp.ZeroPPConfig | None):
    """The layout's Trainer.Config, loaded as torchtitan's command line loads it: torchtitan's
    own FSDP2 (``config`` None) or zeropp's with ``config``."""
    from torchtitan.config import ConfigManager
    from torchtitan.models.common.attention import ScaledDotProductAttention

    module = "llama3" if config is None else "zeropp.torchtitan"
    backend = ["--parallelism.spmd_backend", "partial_dtensor"] if config is None else []
    trainer_config = ConfigManager().parse_args(["--module", module, "--config", "llama3_debugmodel",
                                                 *CPU_OVERRIDES, *LAYOUTS[layout], *backend])
    if config is not None:
        spec = trainer_config.model_spec
        spec.parallelize_fn = dataclasses.replace(spec.parallelize_fn, config=config)
    for layer in trainer_config.model_spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return trainer_config


def _data_parallel_coordinates(model: torch.nn.Module) -> tuple[int, int, int]:
    """This rank's batch, its replica (0 without HSDP) and the number of batches, read from the
    mesh torchtitan put the parameters on: one batch per data-parallel rank, replica-major."""
    mesh = _shown(model).device_mesh
    sizes = dict(zip(mesh.mesh_dim_names, mesh.shape))
    replica = mesh.get_local_rank("dp_replicate") if "dp_replicate" in sizes else 0
    return replica * sizes["fsdp"] + mesh.get_local_rank("fsdp"), replica, sizes.get("dp_replicate", 1) * sizes["fsdp"]


def _loss(model: torch.nn.Module, config, batch: int, num_batches: int) -> torch.Tensor:
    """torchtitan's loss on batch ``batch``: the sum over its tokens (vocabulary parallel under
    tensor parallelism) over the global token count, so the gradients are summed."""
    from torchtitan.components.loss import cross_entropy_loss

    tokens = torch.randint(0, config.model_spec.model.vocab_size, (num_batches, LOCAL_BATCH, SEQ_LEN + 1),
                           generator=torch.Generator().manual_seed(0))[batch]
    return cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:]) / (num_batches * LOCAL_BATCH * SEQ_LEN)


def _run(layout: str, config: zeropp.ZeroPPConfig | None, world_size: int, *, contributions: str | None = None
         ) -> dict:
    """One forward and backward of the layout: this rank's gradient shards, the global loss, the
    ledger, the mesh of ``SHOWN``; with ``contributions`` ("batch" or "replica") first the
    gradients each batch's or replica's loss alone gives (the others' weighed 0.0), one backward
    each."""
    from torchtitan.distributed import utils as dist_utils

    trainer_config = _trainer_config(layout, config)
    dist_utils.set_spmd_backend(trainer_config.parallelism.spmd_backend)  # as the Trainer does
    model = _build(trainer_config, world_size)
    if config is None:
        _force_sum(model)
    batch, replica, num_batches = _data_parallel_coordinates(model)
    mine, num_parts = {None: (None, 0), "batch": (batch, num_batches),
                       "replica": (replica, trainer_config.parallelism.data_parallel_replicate_degree)}[contributions]
    parts = []
    for part in range(num_parts):
        (_loss(model, trainer_config, batch, num_batches) * float(part == mine)).backward()
        parts.append(_local_gradients(model))
        model.zero_grad(set_to_none=True)
    zeropp.comm_ledger().reset()
    loss = _loss(model, trainer_config, batch, num_batches)
    loss.backward()
    shown = _shown(model)
    tensor_parallel = trainer_config.parallelism.tensor_parallel_degree
    return {"loss": _global_sum(loss.detach()) / tensor_parallel, "grads": _local_gradients(model),
            "shards": [p.to_local().detach() for p in model.parameters()], "contributions": parts,
            "batch": batch, "ledger": zeropp.comm_ledger().summary(),
            "mesh": (shown.device_mesh.mesh_dim_names, [str(p) for p in shown.placements])}


def _shown(model: torch.nn.Module) -> torch.nn.Parameter:
    return next(p for name, p in model.named_parameters() if name.endswith(SHOWN))


def _local_gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.to_local().clone() for name, p in model.named_parameters()}


def _global_sum(value: torch.Tensor) -> float:
    total = value.clone()
    torch.distributed.all_reduce(total)
    return total.item()


def _qgz_excess(quantized: dict, exact: dict, contributions: list[dict], batch: int) -> dict[str, float]:
    """Per parameter, the largest (error - bound) / bound of qgZ's summed gradient shard against
    the exact sum. Shard group of one rank per node: hop 1 has nothing to do and hop 2 sends
    each other rank's contribution to this shard in INT4 (this rank's own travels exact,
    [Note: qgZ own rows]), so an element is off by at most half a step of each of those blocks."""
    excess = {}
    for name, reference in exact.items():
        others = [part[name] for b, part in enumerate(contributions) if b != batch]
        bound = sum(half_steps(c, QMAX_INT4) for c in others).view_as(reference)
        bound = bound * (1 + FLOAT_SLACK) + FLOAT_SLACK * sum(part[name].abs() for part in contributions) + 1e-30
        excess[name] = ((quantized[name] - reference).abs() - bound).div(bound).max().item()
    return excess


def _tensor_parallel_worker(rank: int, world_size: int) -> dict:
    """torchtitan's FSDP2, zeropp's ZeRO-3, qwZ alone (with each batch's contribution) and qwZ +
    qgZ on TP 2 x FSDP 2; what the tests compare, as numbers."""
    reference, zero3 = _run("tp", None, world_size), _run("tp", ZERO3, world_size)
    weights = _run("tp", QWZ, world_size, contributions="batch")
    both = _run("tp", QWZ_QGZ, world_size)
    loss_terms = _first_order_loss_terms(reference["shards"], list(reference["grads"].values()))
    torch.distributed.all_reduce(loss_terms)
    try:
        _run("tp", zeropp.ZeroPPConfig(hpz_partition_size=2), world_size)
        hpz_refusal = "accepted"
    except ValueError as error:
        hpz_refusal = str(error)
    return {
        "mesh": reference["mesh"], "zeropp_mesh": zero3["mesh"],
        "losses": {"reference": reference["loss"], "zero3": zero3["loss"], "qwz": weights["loss"],
                   "qwz_qgz": both["loss"]},
        "zero3_gradients_equal": all(torch.equal(zero3["grads"][n], g) for n, g in reference["grads"].items()),
        "first_loss_sigma": loss_terms[1].sqrt().item(),
        "qgz_excess": _qgz_excess(both["grads"], weights["grads"], weights["contributions"], weights["batch"]),
        "qgz_max_error": max((both["grads"][n] - g).abs().max().item() for n, g in weights["grads"].items()),
        "ledgers": {"zero3": zero3["ledger"], "qwz_qgz": both["ledger"]},
        "hpz_refusal": hpz_refusal,
    }


@pytest.fixture(scope="module")
def tensor_parallel() -> list[dict]:
    return run_distributed(_tensor_parallel_worker, 4, env=TWO_BY_TWO, timeout=300)


def test_torchtitan_shards_tensor_parallel_blocks_over_the_fsdp_sub_mesh(tensor_parallel: list[dict]) -> None:
    """The layout zeropp is handed: DTensor parameters on ``(fsdp, tp)``, FSDP's Shard(0) over
    the data-parallel sub-mesh and the tensor parallel one beside it, unchanged by zeropp."""
    for rank in tensor_parallel:
        assert rank["mesh"] == rank["zeropp_mesh"] == (("fsdp", "tp"), ["S(0)", "S(1)"]), rank["mesh"]


def test_tensor_parallel_zero3_path_is_torchtitans_fsdp2_bit_for_bit(tensor_parallel: list[dict]) -> None:
    for rank in tensor_parallel:
        assert rank["losses"]["zero3"] == rank["losses"]["reference"]
        assert rank["zero3_gradients_equal"]


def test_tensor_parallel_qwz_and_qgz_within_their_bounds(tensor_parallel: list[dict]) -> None:
    """- The loss sees qwZ's forward weights alone: bit for bit qwZ's alone, and nonzero within 6
      standard deviations of INT8 rounding's first-order spread (each weight off by at most
      half its block's step absmax / 127, evenly spread, so the loss by sum dL/dw x that:
      ``_first_order_loss_terms``; weights replicated over tp count on both tp ranks, which
      only widens it; measured 2.1 of them, INT4 weights give 19).
    - The gradients, against qwZ alone (the same weights, the exact reduction), within qgZ's
      INT4 bound from each batch's contribution (``_qgz_excess``), and not exact."""
    for rank in tensor_parallel:
        losses = rank["losses"]
        assert losses["qwz_qgz"] == losses["qwz"]
        assert 0 < abs(losses["qwz"] - losses["reference"]) <= 6 * rank["first_loss_sigma"], losses
        over = {name: excess for name, excess in rank["qgz_excess"].items() if excess > 0}
        assert not over, over
        assert rank["qgz_max_error"] > 0


def _cross_node(summary: dict, key: str, name: str) -> int:
    return summary[key].get(name, {}).get("cross_node_bytes", 0)


def test_tensor_parallel_ledger_shows_qgz_across_nodes_and_no_full_precision_reduce_scatter(
        tensor_parallel: list[dict]) -> None:
    """With qwZ and qgZ every byte of the gradients' exchange that crosses a node is qgZ's INT4
    (no reduce-scatter left, full precision or other), and the forward gathers are qwZ's INT8.
    Against ZeRO-3's fp32: qgZ sends the other rank's chunk at half a byte an element plus a
    4-byte scale per 256, (0.5 + 4/256) / 4 = 0.1289 of the reduce-scatter's; qwZ a byte plus
    4/256, 0.2539 of the gather's; padding to whole blocks and words adds a little."""
    for rank in tensor_parallel:
        zero3, both = rank["ledgers"]["zero3"], rank["ledgers"]["qwz_qgz"]
        assert _cross_node(both, "by_op", "reduce_scatter") == 0 < _cross_node(zero3, "by_op", "reduce_scatter")
        assert _cross_node(both, "by_technique", "fsdp") == 0
        ratio = _cross_node(both, "by_technique", "qgZ") / _cross_node(zero3, "by_op", "reduce_scatter")
        assert 0.1289 <= ratio <= 0.13, ratio
        ratio = _cross_node(both, "by_technique", "qwZ") / _cross_node(zero3, "by_op", "all_gather")
        assert 0.2539 <= ratio <= 0.255, ratio


def test_hpz_on_tensor_parallel_is_refused_by_name(tensor_parallel: list[dict]) -> None:
    """FSDP2 cannot reshard a 2-D mesh's parameters to hpZ's node partition: the config that
    asks for it (``llama3_debugmodel`` on several nodes does) fails naming the option."""
    for rank in tensor_parallel:
        assert "hpz_partition_size=2" in rank["hpz_refusal"] and "2-D mesh" in rank["hpz_refusal"], rank


def _replica_bound(largest: float, num_replicas: int) -> float:
    """The quantized replicas' reduction's error on a sum over R replicas, INT4 both ways, each
    replica's shard-group sum at most ``largest``: half a step of each of the R - 1 rows sent to
    another replica, then half a step of the reduced row (at most R x ``largest`` plus that) in
    the all-gather ([Note: the replicas' reduction])."""
    sent = (num_replicas - 1) * largest / QMAX_INT4 / 2
    gathered = (num_replicas * largest + sent) / QMAX_INT4 / 2
    return (sent + gathered) * (1 + FLOAT_SLACK)


def _hsdp_worker(rank: int, world_size: int, layout: str) -> dict:
    """torchtitan's HSDP (with each replica's contribution), zeropp's ZeRO-3 and quantized
    replicas on ``layout``."""
    reference = _run(layout, None, world_size, contributions="replica")
    zero3, replicas = _run(layout, ZERO3, world_size), _run(layout, REPLICAS, world_size)
    largest = torch.tensor([max(part[n].abs().max().item() for part in reference["contributions"])
                            for n in reference["grads"]])
    torch.distributed.all_reduce(largest, torch.distributed.ReduceOp.MAX)
    return {
        "mesh": reference["mesh"], "zeropp_mesh": replicas["mesh"],
        "losses": {"reference": reference["loss"], "zero3": zero3["loss"], "replicas": replicas["loss"]},
        "zero3_gradients_equal": all(torch.equal(zero3["grads"][n], g) for n, g in reference["grads"].items()),
        "replica_errors": {n: ((replicas["grads"][n] - g).abs().max().item(), bound)
                           for (n, g), bound in zip(reference["grads"].items(), largest.tolist())},
        "replica_shards": {n: g.numpy() for n, g in replicas["grads"].items()},
        "shard_numel": sum(g.numel() for g in replicas["grads"].values()),
        "ledger": replicas["ledger"],
    }


@pytest.fixture(scope="module")
def hsdp() -> list[dict]:
    return run_distributed(_hsdp_worker, 4, "hsdp", env=TWO_BY_TWO, timeout=300)


def _check_hsdp_zero3(ranks: list[dict], mesh: tuple) -> None:
    """torchtitan's HSDP mesh, kept by zeropp; ZeRO-3's reduce-scatter inside the node and FSDP2's
    all-reduce across replicas give torchtitan's loss and gradients exactly."""
    for rank in ranks:
        assert rank["mesh"] == rank["zeropp_mesh"] == mesh, rank["mesh"]
        assert rank["losses"]["zero3"] == rank["losses"]["reference"]
        assert rank["zero3_gradients_equal"]


def _check_quantized_replicas(ranks: list[dict]) -> None:
    """The forward is untouched (same loss); every gradient within ``_replica_bound`` of the
    exact HSDP sum, not exact; the two replicas of a shard (rank i and i + W/2) hold bit for bit
    the same gradients; across nodes only the replicas' INT4 exchange, no fsdp traffic: half
    the shard sent and half gathered at half a byte an element plus 4/256, (0.5 + 4/256) / 4 =
    0.1289 of a ring all-reduce's fp32 (2 (R - 1) / R x the shard x 4 bytes, R = 2), a little
    more for padding."""
    for rank in ranks:
        assert rank["losses"]["replicas"] == rank["losses"]["reference"]
        over = {n: (error, _replica_bound(largest, 2)) for n, (error, largest) in rank["replica_errors"].items()
                if error > _replica_bound(largest, 2)}
        assert not over, over
        assert max(error for error, _ in rank["replica_errors"].values()) > 0
        crossing = rank["ledger"]
        assert _cross_node(crossing, "by_technique", "fsdp") == 0
        ratio = _cross_node(crossing, "by_technique", "replicas") / (4 * rank["shard_numel"])
        assert 0.1289 <= ratio <= 0.13, ratio
    half = len(ranks) // 2
    for first, second in zip(ranks[:half], ranks[half:]):
        for name, shard in first["replica_shards"].items():
            np.testing.assert_array_equal(shard, second["replica_shards"][name], err_msg=name)


def test_hsdp_zero3_path_is_torchtitans_hsdp_bit_for_bit(hsdp: list[dict]) -> None:
    _check_hsdp_zero3(hsdp, (("dp_replicate", "fsdp"), ["R", "S(0)"]))


def test_hsdp_quantized_replica_gradients_within_the_bound_and_the_same_on_every_replica(hsdp: list[dict]) -> None:
    _check_quantized_replicas(hsdp)


@pytest.mark.slow
def test_hsdp_of_tensor_parallel_blocks_zero3_exact_and_quantized_replicas_within_the_bound() -> None:
    """Both degrees on 2 nodes x 4: replicas {i, i + 4} across the nodes, shard groups {0, 2},
    {1, 3}, ... inside them, tensor parallel pairs {0, 1}, ...; parameters on the 3-D
    ``(dp_replicate, fsdp, tp)`` mesh."""
    ranks = run_distributed(_hsdp_worker, 8, "hsdp_tp", env={"ZEROPP_RANKS_PER_NODE": "4"}, timeout=300)
    _check_hsdp_zero3(ranks, (("dp_replicate", "fsdp", "tp"), ["R", "S(0)", "S(1)"]))
    _check_quantized_replicas(ranks)
