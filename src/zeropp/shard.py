"""``zeropp.shard``: apply ZeRO-3 (FSDP2) to a model, with the ZeRO++ comms plugged in.

Parallelism is a function applied to a model: choose the units, ``fully_shard`` each one and
then the root on the world mesh, and install the comms the config asks for.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from zeropp.comms import (
    CountingAllGather,
    CountingReduceScatter,
    HierarchicalQuantizedReduceScatter,
    QuantizedAllGather,
    all_gather_strings,
)
from zeropp.config import ZeroPPConfig
from zeropp.topology import ProcessGroups, Topology, build_process_groups, check_hosts, device_type_of

UnitSpec = Sequence[type[nn.Module] | nn.Module]


def shard(
    model: nn.Module,
    config: ZeroPPConfig | None = None,
    *,
    topology: Topology | None = None,
    units: UnitSpec | None = None,
) -> nn.Module:
    """Shard ``model`` ZeRO-3 style over every rank, in place, and return it.

    Args:
        model: any module; its parameters must be on the device the process group uses.
        config: which ZeRO++ techniques to use; ``None`` is plain ZeRO-3 (FSDP2).
        topology: nodes x ranks per node; default ``Topology.from_env()``.
        units: module classes or modules to shard as separate units (each gathers its weights
            just before use); default: the repeated blocks of the model, see ``default_units``.
    """
    if not dist.is_initialized():
        raise RuntimeError("zeropp.shard needs torch.distributed initialised: call "
                           "dist.init_process_group (torchrun sets the environment for it) first")
    config = config if config is not None else ZeroPPConfig()
    topology = topology if topology is not None else Topology.from_env()
    groups = build_process_groups(topology, device_type_of(model))
    check_hosts(topology, all_gather_strings(socket.gethostname()))
    check_hpz(config.hpz_partition_size, topology)
    unit_modules = select_units(model, units)
    mp_policy = MixedPrecisionPolicy(param_dtype=config.param_dtype, reduce_dtype=config.reduce_dtype)
    # hpZ: after forward each unit keeps a 1/hpz slice (inside the node) for the backward gather
    reshard = config.hpz_partition_size if config.hpz_partition_size > 1 else True
    for module in [*unit_modules, model]:
        fully_shard(module, mesh=groups.mesh, reshard_after_forward=reshard, mp_policy=mp_policy)
        _install_comms(module, groups, config)
    if config.hpz_partition_size > 1:
        sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
        model.register_forward_pre_hook(lambda *_: _drop_secondary_copies(sharded), prepend=True)
        model.register_forward_hook(lambda *_: None if torch.is_grad_enabled() else _drop_secondary_copies(sharded))
    return model


def check_hpz(hpz_partition_size: int, topology: Topology) -> None:
    """hpZ's secondary partition must stay inside a node: its size must divide ranks per node
    (and so the world size)."""
    if topology.ranks_per_node % hpz_partition_size != 0:
        divisors = [d for d in range(1, topology.ranks_per_node + 1) if topology.ranks_per_node % d == 0]
        raise ValueError(
            f"hpz_partition_size={hpz_partition_size} must divide the ranks per node "
            f"({topology.ranks_per_node}, layout {topology.num_nodes} nodes x "
            f"{topology.ranks_per_node}) so that the secondary partition stays inside a node; "
            f"allowed: {divisors} (1 = off, {topology.ranks_per_node} = the whole node)")


def _drop_secondary_copies(units: list[FSDPModule]) -> None:
    """[Note: hpZ secondary copies are never stale]
    FSDP2 keeps a unit's post-forward (secondary) shards until its backward. A forward that has
    no backward (``no_grad`` evaluation, a forward whose loss is dropped) would leave them in
    place, and the next forward would gather weights from them even after an optimizer step or
    ``load_state_dict`` changed the primary shards. So every root forward starts from the
    primary shards, and a ``no_grad`` root forward drops its copies at once (no backward will
    use them). Resharding is idempotent and costs nothing when no copy is left.

    Between a forward and its backward FSDP2 registers the secondary shards as the module's
    parameters: an in-place edit through ``model.parameters()`` in that window lands in the
    secondary copy, not in the primary shards the optimizer holds (FSDP2's behaviour)."""
    for unit in units:
        unit.reshard()


@dataclass(frozen=True)
class UnitParameters:
    """The parameters one FSDP unit communicates, in FSDP2's flat-buffer order."""

    padded_numels: list[int]
    """Each parameter's numel with dim 0 padded to a multiple of the world size."""
    trainable: list[bool]


def unit_parameters(module: FSDPModule) -> UnitParameters:
    """Read a unit's parameter layout from FSDP2 (the order and padding of its flat buffers)."""
    param_group = module._get_fsdp_state()._fsdp_param_group
    if param_group is None:
        return UnitParameters([], [])
    world_size = param_group.mesh_info.shard_mesh_size
    params = param_group.fsdp_params
    return UnitParameters([p.padded_sharded_param_size.numel() * world_size for p in params],
                          [p.sharded_param.requires_grad for p in params])


def secondary_copy_bytes(model: nn.Module) -> int:
    """Bytes of hpZ's secondary copy on this rank: each unit's parameters (in the gather dtype)
    split over its hpZ group, held between a unit's forward and its backward. 0 without hpZ."""
    total = 0
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        param_group = module._get_fsdp_state()._fsdp_param_group
        if param_group is None or param_group.post_forward_mesh_info is None:
            continue
        world_size = param_group.mesh_info.shard_mesh_size
        group_size = param_group.post_forward_mesh_info.shard_mesh_size
        if group_size == world_size:
            continue
        for p in param_group.fsdp_params:
            itemsize = (param_group.mp_policy.param_dtype or p.sharded_param.dtype).itemsize
            total += p.padded_sharded_param_size.numel() * world_size // group_size * itemsize
    return total


def _install_comms(module: nn.Module, groups: ProcessGroups, config: ZeroPPConfig) -> None:
    assert isinstance(module, FSDPModule)
    layout = unit_parameters(module)
    quantized = [config.quantized_weights or (config.quantized_nontrainable_weights and not trainable)
                 for trainable in layout.trainable]
    if any(quantized):
        module.set_custom_all_gather(QuantizedAllGather(
            groups.topology, layout.padded_numels, quantized, bits=config.weight_bits,
            block_size=config.block_size, quantize_intra_node=config.quantize_intra_node_weights))
    else:
        module.set_custom_all_gather(CountingAllGather(groups.topology))
    if config.quantized_gradients:
        trainable = [n for n, t in zip(layout.padded_numels, layout.trainable) if t]
        module.set_custom_reduce_scatter(HierarchicalQuantizedReduceScatter(
            groups, trainable, bits_intra=config.grad_bits_intra, bits_inter=config.grad_bits_inter,
            block_size=config.block_size, error_feedback=config.error_feedback))
    else:
        module.set_custom_reduce_scatter(CountingReduceScatter(groups.topology))


def default_units(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks: children of the model's largest ModuleList/Sequential whose children
    all share one class (largest by parameter count). Empty if the model has none."""
    best: list[nn.Module] = []
    best_numel = 0
    for module in model.modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or module is model:
            continue
        children = list(module.children())
        if len(children) < 2 or len({type(c) for c in children}) != 1:
            continue
        numel = sum(p.numel() for p in module.parameters())
        if numel > best_numel:
            best, best_numel = children, numel
    return best


def select_units(model: nn.Module, units: UnitSpec | None) -> list[nn.Module]:
    """Resolve ``units`` to submodules of ``model``, children before parents (FSDP2's order)."""
    if units is None:
        return default_units(model)
    classes = tuple(u for u in units if isinstance(u, type))
    chosen = {id(u) for u in units if isinstance(u, nn.Module)}
    for u in units:
        if not isinstance(u, (type, nn.Module)):
            raise ValueError(f"units must hold nn.Module classes or modules, got {u!r}")
    submodules = [m for m in model.modules() if m is not model]
    missing = chosen - {id(m) for m in submodules}
    if missing:
        raise ValueError(f"{len(missing)} module(s) given in units are not submodules of the model "
                         "(the root is always sharded last and must not be listed)")
    picked = [m for m in submodules if id(m) in chosen or (classes and isinstance(m, classes))]
    if not picked:
        raise ValueError(f"units={list(units)!r} matched no submodule of {type(model).__name__}")
    order = {id(m): i for i, m in enumerate(model.modules())}
    return sorted(picked, key=lambda m: -order[id(m)])
