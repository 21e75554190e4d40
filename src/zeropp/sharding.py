"""``zeropp.shard``: apply ZeRO-3 (FSDP2) to a model, with the ZeRO++ comms plugged in.

Parallelism is a function applied to a model: choose the units, ``fully_shard`` each one and
then the root on the world mesh, and install the comms the config asks for (``qwz``, ``qgz``,
or FSDP2's own, counted) and hpZ's hooks (``hpz``). ``sharded_comms(model)`` returns what was
installed, for the engine (qgZ's error feedback) and for inspection.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from zeropp._fsdp import (
    AllGather,
    ReduceScatter,
    default_divide_factor,
    fsdp_units,
    gradients_read_only_after_backward,
    replicate_group,
    set_post_forward_mesh,
    set_process_group_timeouts,
    set_replicas_reduced_by_comm,
    set_unshard_async,
    shard_group_ranks,
    unit_layout,
    unit_parameters,
)
from zeropp.agreement import agree, config_view, parameters_view, units_view
from zeropp.audit import Audit, Auditable, AuditedUnit, install_audit
from zeropp.checks import check_offload, check_patterns, check_unit, gathers_stay_in_nodes, require_process_group
from zeropp.comms import CountingAllGather, CountingReduceScatter, Recorder, all_gather_strings, collective_timeout_s
from zeropp.config import ZeroPPConfig
from zeropp.hpz import (
    check_hpz,
    generate_in_generation_mode,
    has_secondary_copy,
    keep_secondary_as_codes,
    keep_secondary_copies_fresh,
)
from zeropp.hpz_mesh import NodeCopy, NodeCopyAllGather
from zeropp.qgz import HierarchicalQuantizedReduceScatter, full_precision_gradients
from zeropp.qwz import QuantizedAllGather, quantized_parameters
from zeropp.replicas import ReplicatedReduceScatter
from zeropp.scalars import replicate_scalars, scalar_parameters
from zeropp.topology import (
    ProcessGroups,
    Topology,
    build_process_groups,
    check_hosts,
    check_world_size,
    device_type_of,
)
from zeropp.unused import GradientPresence

logger = logging.getLogger("zeropp")

UnitSpec = Sequence[type[nn.Module] | nn.Module]


def shard(
    model: nn.Module,
    config: ZeroPPConfig | None = None,
    *,
    topology: Topology | None = None,
    units: UnitSpec | None = None,
) -> nn.Module:
    """Shard ``model`` ZeRO-3 style over every rank, in place, and return it: ``fully_shard`` the
    units and then the root on the world mesh, then ``enable`` the ZeRO++ comms.

    Args:
        model: any module; its parameters must be on the device the process group uses. 0-dim
            parameters stay whole on every rank (``zeropp.scalars``).
        config: which ZeRO++ techniques to use; ``None`` is plain ZeRO-3 (FSDP2).
        topology: nodes x ranks per node; default ``Topology.from_env()``.
        units: module classes or modules to shard as separate units (each gathers its weights
            just before use); default: the repeated blocks of the model, see ``default_units``.
    """
    require_process_group("zeropp.shard")
    config = config if config is not None else ZeroPPConfig()
    topology = topology if topology is not None else Topology.from_env()
    _check_layout(topology, agree([*config_view(config, topology), *parameters_view(model)]))
    check_hpz(config.hpz_partition_size, topology, config.key_of("hpz_partition_size"))
    check_patterns(model, config)
    unit_modules = select_units(model, units)
    scalars = scalar_parameters(model)
    groups = build_process_groups(topology, device_type_of(model), config.hpz_partition_size)
    mp_policy = MixedPrecisionPolicy(param_dtype=config.param_dtype, reduce_dtype=config.reduce_dtype)
    for module in [*unit_modules, model]:  # hpZ's node mesh is set by _enable ([Note: one node mesh])
        fully_shard(module, mesh=groups.mesh, reshard_after_forward=True, mp_policy=mp_policy,
                    offload_policy=offload_policy(config), ignored_params=set(scalars) or None)
    replicate_scalars(scalars, topology)
    return _enable(model, config, groups)


def offload_policy(config: ZeroPPConfig) -> OffloadPolicy:
    """FSDP2's offload policy for ``config.offload``: ``CPUOffloadPolicy`` (pinned host memory
    where CUDA is present and ``offload_pin_memory`` asks for it) or none."""
    if config.offload == "cpu":
        return CPUOffloadPolicy(pin_memory=config.offload_pin_memory and torch.cuda.is_available())
    return OffloadPolicy()


def enable(model: nn.Module, config: ZeroPPConfig | None = None, *, topology: Topology | None = None) -> nn.Module:
    """Add ZeRO++ to a model already sharded with ``fully_shard`` (by the user, accelerate's FSDP2
    plugin or torchtitan), in place, and return it: qwZ and qgZ comms on every unit, hpZ's node
    mesh and never-stale hooks. Calling it again replaces the comms (a re-initialised engine).

    With ``hpz_partition_size > 1`` every unit that reshards after forward (``fully_shard``'s
    ``reshard_after_forward=True``, or the same int) reshards to hpZ's node partition instead,
    one mesh for the whole model ([Note: one node mesh]); a unit kept whole after forward
    (``reshard_after_forward=False``) stays whole. qgZ runs over each unit's shard group: the
    world, or on a 2-D mesh (tensor parallel x FSDP, HSDP) its data-parallel sub-mesh, placed on
    nodes ([Note: shard groups on nodes]).
    """
    require_process_group("zeropp.enable")
    if not isinstance(model, FSDPModule):
        raise ValueError(f"zeropp.enable needs the root module sharded with fully_shard; "
                         f"{type(model).__name__} is not an FSDPModule (use zeropp.shard for a bare model)")
    config = config if config is not None else ZeroPPConfig()
    topology = topology if topology is not None else Topology.from_env()
    _check_layout(topology, agree([*config_view(config, topology), *units_view(model)]))
    check_hpz(config.hpz_partition_size, topology, config.key_of("hpz_partition_size"))
    check_patterns(model, config)
    check_offload(model, config)
    return _enable(model, config, build_process_groups(topology, device_type_of(model), config.hpz_partition_size))


def _check_layout(topology: Topology, hostnames: list[str]) -> None:
    """The topology fits the process group and the hosts the ranks run on ([Note: ranks that
    disagree] made sure every rank claims the same one)."""
    check_world_size(topology)
    check_hosts(topology, hostnames)


def _enable(model: FSDPModule, config: ZeroPPConfig, groups: ProcessGroups) -> nn.Module:
    units = list(fsdp_units(model))
    names = {id(module): name for name, module in model.named_modules()}
    for unit in units:
        check_unit(unit, config, groups.topology, names[id(unit)] or "the root")
    for unit in units:
        set_replicas_reduced_by_comm(unit, config.quantized_replica_gradients)
    if config.quantized_weights and not config.quantize_intra_node_weights and gathers_stay_in_nodes(
            units, groups.topology):
        logger.warning(
            "zeropp: %s=true, but every unit gathers its weights inside a node (HSDP's shard group): qwZ sends "
            "full precision there and changes nothing; set %s=true to quantize these gathers too",
            config.key_of("quantized_weights"), config.key_of("quantize_intra_node_weights"))
    if groups.hpz_mesh is not None:
        for unit in units:
            unit_shape = unit_layout(unit)
            if not unit_shape.kept_whole_after_forward and unit_shape.shard_group_size == groups.topology.world_size:
                set_post_forward_mesh(unit, groups.hpz_mesh)
    installed = ShardedComms()
    param_names = {id(p): name for name, p in model.named_parameters()}
    for unit in units:
        all_gather, reduce_scatter = _install_comms(unit, groups, config, param_names)
        presence = GradientPresence(unit, Recorder(groups.topology))
        for recorder in (all_gather.recorder, reduce_scatter.recorder, presence.recorder):
            recorder.unit = names[id(unit)] or "the root"
        installed.add(unit, all_gather, reduce_scatter, presence)
    install_audit(model, _audit(config, installed, groups.topology) if config.audit_every else None)
    if (timeout_s := collective_timeout_s()) is not None:
        set_process_group_timeouts(timeout_s)
    if config.overlap:
        prefetch_neighbours(model)
    previous = _SHARDED.get(model)
    installed.fresh_copy_hooks = previous is not None and previous.fresh_copy_hooks
    if not installed.fresh_copy_hooks and any(has_secondary_copy(unit) for unit in units):
        keep_secondary_copies_fresh(model)
        generate_in_generation_mode(model)
        installed.fresh_copy_hooks = True
    _SHARDED[model] = installed
    return model


def shard_layout(unit: FSDPModule, topology: Topology) -> tuple[tuple[int, ...], ...] | None:
    """Every shard group of the mesh ``unit`` is sharded on (each its global ranks, in group
    order), or None when the unit is sharded over the world. A rank sees its own group only, so
    the ranks exchange theirs (a few bytes, at set-up; collective over the world)."""
    mine = shard_group_ranks(unit)
    if mine is None or len(mine) == topology.world_size:
        return None
    every = all_gather_strings(",".join(map(str, mine)))
    return tuple(tuple(int(rank) for rank in ranks.split(",")) for ranks in dict.fromkeys(every))


_FORWARD_AHEAD = 2
"""Units gathered ahead of the one computing, in forward ([Note: prefetch])."""


def prefetch_neighbours(model: FSDPModule) -> None:
    """Each unit gathers the units after it while it computes: see [Note: prefetch].

    [Note: prefetch]
    On CUDA FSDP2 overlaps a unit's gather with the previous unit's compute through streams. On
    CPU it has none, so every gather blocks the step, and a slow link's transfer adds to compute
    instead of hiding behind it. With ``overlap`` the root and every block name the units to
    gather ahead (``set_modules_to_forward_prefetch``: the next two blocks, the root the first
    two; ``set_modules_to_backward_prefetch``: the previous block, the root the last one) and
    FSDP2 issues gathers with ``async_op``: the backend moves the bytes on its own threads while
    this one computes, and FSDP2 waits just before the weights are used (qwZ decodes then:
    ``comms.DecodeOnWait``). Two ahead in forward, because there a gather on a slow link takes
    longer than a block's compute: with one ahead the link idled while each block decoded and
    computed (at 100 Mbit/s on the 25M GPT the forward took 2.2-2.5 s with one, 1.85-2.0 s with
    two, where its link time is 1.5 s). Backward gathers run inside the node (hpZ) or are
    followed by a block's longer backward, so one ahead suffices there. Blocks are taken in
    registration order, the forward order of a model built as a stack of blocks (zeropp's
    default units). Reduce-scatters overlap the other way: see [Note: late reduce-scatter].
    """
    blocks = [unit for unit in fsdp_units(model) if unit is not model]
    if not blocks:
        return
    model.set_modules_to_forward_prefetch(blocks[:_FORWARD_AHEAD])
    model.set_modules_to_backward_prefetch(blocks[-1:])
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + _FORWARD_AHEAD])
        block.set_modules_to_backward_prefetch(blocks[i - 1:i] if i else [])
    set_unshard_async(model, True)


@dataclass
class ShardedComms:
    """The comms installed on a model's units, in ``model.modules()`` order (the root first)."""

    units: list[FSDPModule] = field(default_factory=list)
    all_gathers: list[AllGather] = field(default_factory=list)
    reduce_scatters: list[ReduceScatter] = field(default_factory=list)
    presences: list[GradientPresence] = field(default_factory=list)
    """Each unit's gradients made the same on every rank before its reduce-scatter (``zeropp.unused``)."""
    fresh_copy_hooks: bool = False
    """Whether hpZ's never-stale hooks are on the root (installed once per model)."""

    def add(self, unit: FSDPModule, all_gather: AllGather, reduce_scatter: ReduceScatter,
            presence: GradientPresence) -> None:
        unit.set_custom_all_gather(all_gather)
        unit.set_custom_reduce_scatter(reduce_scatter)
        self.units.append(unit)
        self.all_gathers.append(all_gather)
        self.reduce_scatters.append(reduce_scatter)
        self.presences.append(presence)

    @property
    def qgz(self) -> list[HierarchicalQuantizedReduceScatter]:
        """The qgZ reduce-scatters (they hold the error-feedback residuals)."""
        inner = [c.shard if isinstance(c, ReplicatedReduceScatter) else c for c in self.reduce_scatters]
        return [c for c in inner if isinstance(c, HierarchicalQuantizedReduceScatter)]


    def replace(self, index: int, all_gather: AllGather, reduce_scatter: ReduceScatter) -> None:
        """Install other comms on the ``index``-th unit (the audit's fallback to exact ones)."""
        unit = self.units[index]
        unit.set_custom_all_gather(all_gather)
        unit.set_custom_reduce_scatter(reduce_scatter)
        self.all_gathers[index], self.reduce_scatters[index] = all_gather, reduce_scatter


def _audit(config: ZeroPPConfig, installed: ShardedComms, topology: Topology) -> Audit:
    """The audit of every unit with a quantized collective ([Note: the audit] in ``zeropp.audit``)."""
    audited = []
    for index, (all_gather, reduce_scatter) in enumerate(zip(installed.all_gathers, installed.reduce_scatters)):
        inner = reduce_scatter.shard if isinstance(reduce_scatter, ReplicatedReduceScatter) else reduce_scatter
        comms = [comm for comm in (all_gather, inner) if isinstance(comm, Auditable)]
        if comms:
            audited.append(AuditedUnit(all_gather.recorder.unit, comms,
                                       functools.partial(_fall_back, installed, index, topology)))
    if not audited:
        logger.warning("zeropp: %s=%d audits quantized collectives, but no unit has one (qwZ and qgZ are off): "
                       "nothing will be audited", config.key_of("audit_every"), config.audit_every)
    return Audit(config.audit_every, config.audit_fallback, audited, Recorder(topology))


def _fall_back(installed: ShardedComms, index: int, topology: Topology) -> None:
    """Give the ``index``-th unit exact collectives (FSDP2's own, counted), hpZ's copy as FSDP2
    keeps it, and FSDP2's all-reduce across HSDP's replicas, for the rest of the run."""
    unit, before = installed.units[index], installed.reduce_scatters[index]
    all_gather, reduce_scatter = CountingAllGather(topology), CountingReduceScatter(topology)
    all_gather.recorder.unit = reduce_scatter.recorder.unit = before.recorder.unit
    reduce_scatter.may_finish_late, reduce_scatter.after_reduce = before.may_finish_late, before.after_reduce
    keep_secondary_as_codes(unit, None)
    if isinstance(before, ReplicatedReduceScatter):
        set_replicas_reduced_by_comm(unit, False)
    installed.replace(index, all_gather, reduce_scatter)


_SHARDED: weakref.WeakKeyDictionary[nn.Module, ShardedComms] = weakref.WeakKeyDictionary()


def sharded_comms(model: nn.Module) -> ShardedComms:
    """The comms ``zeropp.shard`` installed on ``model``; none for a model it did not shard."""
    return _SHARDED.get(model, ShardedComms())


def _install_comms(module: FSDPModule, groups: ProcessGroups, config: ZeroPPConfig, param_names: dict[int, str]
                   ) -> tuple[AllGather, ReduceScatter]:
    """The all-gather and reduce-scatter comms ``config`` asks for, for one unit; ``param_names``
    gives each parameter's name in the model (a unit may group several modules)."""
    layout = unit_layout(module)
    named = dataclasses.replace(layout, names=[param_names.get(id(p), "?") for p in unit_parameters(module)])
    quantized = quantized_parameters(named, config.quantized_weights, config.quantized_nontrainable_weights,
                                     config.unquantized_parameters)
    shard = (groups.shard_groups(shard_layout(module, groups.topology))
             if config.quantized_gradients or config.hpz_partition_size > 1 else None)
    node_copy = None  # hpZ on a 2-D mesh: the copy zeropp keeps on the node ([Note: hpZ on a 2-D mesh])
    if config.hpz_partition_size > 1 and layout.shard_group_size != groups.topology.world_size:
        node_copy = NodeCopy(layout.shard_group_size, shard.intra_node_group, shard.intra_node_group.rank())
    if any(quantized):
        all_gather = QuantizedAllGather(
            groups.topology, layout.padded_numels, quantized, bits=config.weight_bits,
            asymmetric=config.weight_code == "asymmetric", block_size=config.block_size,
            quantize_intra_node=config.quantize_intra_node_weights,
            dtypes=layout.gather_dtypes, two_hop=groups if config.hierarchical_gather else None)
        chunk_dtype = layout.gather_dtypes[0] if len(set(layout.gather_dtypes)) == 1 else torch.uint8
        all_gather.secondary_codes = keep_secondary_as_codes(
            module, all_gather.codec(layout.shard_group_size, chunk_dtype).nbytes)
        if node_copy is not None:
            all_gather.secondary_codes = node_copy
    elif node_copy is not None:
        all_gather = NodeCopyAllGather(groups.topology, node_copy)
    else:
        all_gather = CountingAllGather(groups.topology)
        keep_secondary_as_codes(module, None)
    trainable = [n for n, t in zip(layout.padded_numels, layout.trainable) if t]
    spared = full_precision_gradients(
        [n for n, t in zip(named.names, layout.trainable) if t],
        [s for s, t in zip(layout.shapes, layout.trainable) if t],
        config.grad_full_precision_parameters, config.grad_full_precision_below)
    if config.quantized_gradients:
        reduce_scatter = HierarchicalQuantizedReduceScatter(
            groups, trainable, bits_intra=config.grad_bits_intra, bits_inter=config.grad_bits_inter,
            block_size=config.gradient_block_size, error_feedback=config.error_feedback, code=config.gradient_code,
            full_precision=spared, slice_bytes=config.grad_slice_bytes, shard=shard)
    else:
        reduce_scatter = CountingReduceScatter(groups.topology)
    replicas = replicate_group(module)
    if config.quantized_replica_gradients and replicas is not None:
        reduce_scatter = ReplicatedReduceScatter(
            groups, reduce_scatter, replicas, [n // layout.shard_group_size for n in trainable], spared,
            bits=config.grad_bits_inter, block_size=config.gradient_block_size,
            divides_by_default_factor=default_divide_factor(module))
    if config.overlap:
        reduce_scatter.may_finish_late = functools.partial(gradients_read_only_after_backward, module)
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
