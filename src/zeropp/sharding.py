"""``zeropp.shard``: apply ZeRO-3 (FSDP2) to a model, with the ZeRO++ comms plugged in.

Parallelism is a function applied to a model: choose the units, ``fully_shard`` each one and
then the root on the world mesh, and install the comms the config asks for (``qwz``, ``qgz``,
or FSDP2's own, counted) and hpZ's hooks (``hpz``). ``sharded_comms(model)`` returns what was
installed, for the engine (qgZ's error feedback) and for inspection.
"""

from __future__ import annotations

import socket
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from zeropp._fsdp import AllGather, ReduceScatter, unit_layout
from zeropp.comms import CountingAllGather, CountingReduceScatter, all_gather_strings
from zeropp.config import ZeroPPConfig
from zeropp.hpz import check_hpz, keep_secondary_copies_fresh, reshard_after_forward
from zeropp.qgz import HierarchicalQuantizedReduceScatter
from zeropp.qwz import QuantizedAllGather
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
    reshard = reshard_after_forward(config.hpz_partition_size)
    installed = ShardedComms()
    for module in [*unit_modules, model]:
        fully_shard(module, mesh=groups.mesh, reshard_after_forward=reshard, mp_policy=mp_policy)
        installed.add(module, *_install_comms(module, groups, config))
    if config.hpz_partition_size > 1:
        keep_secondary_copies_fresh(model)
    _SHARDED[model] = installed
    return model


@dataclass
class ShardedComms:
    """The comms ``shard`` installed on a model's units, in sharding order (children first)."""

    all_gathers: list[AllGather] = field(default_factory=list)
    reduce_scatters: list[ReduceScatter] = field(default_factory=list)

    def add(self, unit: FSDPModule, all_gather: AllGather, reduce_scatter: ReduceScatter) -> None:
        unit.set_custom_all_gather(all_gather)
        unit.set_custom_reduce_scatter(reduce_scatter)
        self.all_gathers.append(all_gather)
        self.reduce_scatters.append(reduce_scatter)

    @property
    def qgz(self) -> list[HierarchicalQuantizedReduceScatter]:
        """The qgZ reduce-scatters (they hold the error-feedback residuals)."""
        return [c for c in self.reduce_scatters if isinstance(c, HierarchicalQuantizedReduceScatter)]


_SHARDED: weakref.WeakKeyDictionary[nn.Module, ShardedComms] = weakref.WeakKeyDictionary()


def sharded_comms(model: nn.Module) -> ShardedComms:
    """The comms ``zeropp.shard`` installed on ``model``; none for a model it did not shard."""
    return _SHARDED.get(model, ShardedComms())


def _install_comms(module: FSDPModule, groups: ProcessGroups, config: ZeroPPConfig
                   ) -> tuple[AllGather, ReduceScatter]:
    """The all-gather and reduce-scatter comms ``config`` asks for, for one unit."""
    layout = unit_layout(module)
    quantized = [config.quantized_weights or (config.quantized_nontrainable_weights and not trainable)
                 for trainable in layout.trainable]
    if any(quantized):
        all_gather = QuantizedAllGather(
            groups.topology, layout.padded_numels, quantized, bits=config.weight_bits,
            block_size=config.block_size, quantize_intra_node=config.quantize_intra_node_weights)
    else:
        all_gather = CountingAllGather(groups.topology)
    if config.quantized_gradients:
        trainable = [n for n, t in zip(layout.padded_numels, layout.trainable) if t]
        reduce_scatter = HierarchicalQuantizedReduceScatter(
            groups, trainable, bits_intra=config.grad_bits_intra, bits_inter=config.grad_bits_inter,
            block_size=config.block_size, error_feedback=config.error_feedback)
    else:
        reduce_scatter = CountingReduceScatter(groups.topology)
    return all_gather, reduce_scatter


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
