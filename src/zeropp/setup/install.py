"""The plan installed on FSDP2's units, in one pass ([Note: plan, check, install] in
``zeropp.setup.plan``): the process groups the plan needs (each built once), then per unit the
replicas' reduction, hpZ's post-forward mesh, the gather and reduce-scatter comms and the
gradient presence exchange; then the model's hooks (the audit, prefetching, hpZ's never-stale
copies). ``sharded_comms(model)`` returns what was installed.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from zeropp.codes.codec import ChunkCodec, segments_for
from zeropp.config import ZeroPPConfig
from zeropp.fsdp.access import (
    AllGather,
    CommGroup,
    ReduceScatter,
    comm_groups,
    default_divide_factor,
    fsdp_units,
    gradients_read_only_after_backward,
    replicate_group,
    set_comms,
    set_post_forward_mesh,
    set_process_group_timeouts,
    set_replicas_reduced_by_comm,
    set_unshard_async,
    shard_group,
)
from zeropp.fsdp.after_step import gather_after_step
from zeropp.fsdp.comms import CountingAllGather, CountingReduceScatter, GatherAhead, Recorder, collective_timeout_s
from zeropp.fsdp.unused import GradientPresence
from zeropp.setup.plan import Plan, UnitPlan
from zeropp.setup.topology import ProcessGroups, Topology, build_process_groups
from zeropp.techniques.audit import Audit, Auditable, AuditedUnit, install_audit
from zeropp.techniques.deltas import DeltaAllGather, keep_weight_deltas
from zeropp.techniques.hpz import generate_in_generation_mode, keep_secondary_as_codes, keep_secondary_copies_fresh
from zeropp.techniques.hpz_mesh import NodeCopy, NodeCopyAllGather
from zeropp.techniques.qgz import HierarchicalQuantizedReduceScatter
from zeropp.techniques.qwz import QuantizedAllGather
from zeropp.techniques.replicas import ReplicatedReduceScatter

logger = logging.getLogger("zeropp")


def process_groups(plan: Plan, device_type: str) -> ProcessGroups:
    """The groups every unit of the plan shares: the world mesh, this rank's node and its peers
    across nodes, hpZ's node mesh (collective: every rank builds them in the same order)."""
    return build_process_groups(plan.topology, device_type, plan.config.hpz_partition_size)


def install(model: FSDPModule, plan: Plan, groups: ProcessGroups) -> nn.Module:
    """Install ``plan`` (made by ``plan_sharded`` of this model, agreed and checked) on its units."""
    config, units = plan.config, list(comm_groups(model))  # a unit's parameter groups, each planned
    for message in plan.warnings:
        logger.warning(message)
    installed = ShardedComms(plan=plan)
    for unit, planned in zip(units, plan.units, strict=True):
        set_replicas_reduced_by_comm(unit, planned.replicas == "quantized")
        if groups.hpz_mesh is not None and planned.secondary in ("fsdp", "codes") and \
                planned.layout.shard_group_size == plan.topology.world_size:
            set_post_forward_mesh(unit, groups.hpz_mesh)
    deltas = []
    for unit, planned in zip(units, plan.units):
        all_gather, reduce_scatter = _comms(unit, planned, groups, config)
        if isinstance(all_gather, DeltaAllGather):
            deltas.append(all_gather)
        presence = GradientPresence(unit, Recorder(groups.topology), shard_group(unit), replicate_group(unit))
        for recorder in (all_gather.recorder, reduce_scatter.recorder, presence.recorder):
            recorder.unit = planned.name
        installed.add(unit, all_gather, reduce_scatter, presence)
    if deltas:
        keep_weight_deltas(model, deltas, groups.topology)
    install_audit(model, _audit(config, installed, groups.topology) if config.audit_every else None)
    if (timeout_s := collective_timeout_s()) is not None:
        set_process_group_timeouts(timeout_s)
    if config.overlap:
        prefetch_neighbours(model)
    gather_after_step(model, installed.first_gathered(model) if config.overlap else None)
    previous = _SHARDED.get(model)
    installed.fresh_copy_hooks = previous is not None and previous.fresh_copy_hooks
    if not installed.fresh_copy_hooks and any(unit.secondary in ("fsdp", "codes") for unit in plan.units):
        keep_secondary_copies_fresh(model)
        generate_in_generation_mode(model)
        installed.fresh_copy_hooks = True
    _SHARDED[model] = installed
    return model


def _comms(module: CommGroup, planned: UnitPlan, groups: ProcessGroups, config: ZeroPPConfig
           ) -> tuple[AllGather, ReduceScatter]:
    """The all-gather and reduce-scatter comms of one unit, as planned."""
    layout, topology = planned.layout, groups.topology
    shard = (groups.shard_groups(planned.shard_layout)
             if config.quantized_gradients or config.hpz_partition_size > 1 else None)
    node_copy = None  # hpZ on a 2-D mesh: the copy zeropp keeps on the node ([Note: hpZ on a 2-D mesh])
    if planned.secondary == "node copy":
        node_copy = NodeCopy(layout.shard_group_size, shard.intra_node_group, shard.intra_node_group.rank())
    if planned.gathers == "deltas":
        floating = [dtype.is_floating_point for dtype in layout.gather_dtypes]
        reference = None if config.delta_reference == "weights" else ChunkCodec(
            segments_for(layout.padded_numels, floating, layout.shard_group_size, 8), config.block_size,
            gather_chunk_dtype(planned))
        all_gather = DeltaAllGather(topology, shard, module, layout.padded_numels, floating, any(layout.trainable),
                                    bits=config.delta_bits, block_size=config.deltas_block_size,
                                    audited=config.audit_every > 0, reference_codec=reference)
        keep_secondary_as_codes(module, None)
    elif planned.gathers == "qwZ":
        all_gather = QuantizedAllGather(
            topology, layout.padded_numels, list(planned.quantized), bits=config.weight_bits,
            asymmetric=config.weight_code == "asymmetric", block_size=config.block_size,
            quantize_intra_node=config.quantize_intra_node_weights,
            dtypes=layout.gather_dtypes, two_hop=groups if config.hierarchical_gather else None)
        all_gather.secondary_codes = node_copy if node_copy is not None else keep_secondary_as_codes(
            module, all_gather.codec(layout.shard_group_size, gather_chunk_dtype(planned)).nbytes)
    elif node_copy is not None:
        all_gather = NodeCopyAllGather(topology, node_copy)
    else:
        all_gather = CountingAllGather(topology)
        keep_secondary_as_codes(module, None)
    trainable = [n for n, t in zip(layout.padded_numels, layout.trainable) if t]
    if config.quantized_gradients:
        reduce_scatter = HierarchicalQuantizedReduceScatter(
            groups, trainable, bits_intra=config.grad_bits_intra, bits_inter=config.grad_bits_inter,
            block_size=config.gradient_block_size, error_feedback=config.error_feedback, code=config.gradient_code,
            full_precision=list(planned.spared), wide=list(planned.wide), slice_bytes=config.grad_slice_bytes,
            shard=shard)
    else:
        reduce_scatter = CountingReduceScatter(topology)
    if planned.replicas == "quantized":
        reduce_scatter = ReplicatedReduceScatter(
            groups, reduce_scatter, replicate_group(module), [n // layout.shard_group_size for n in trainable],
            list(planned.spared), bits=config.grad_bits_inter, block_size=config.gradient_block_size,
            divides_by_default_factor=default_divide_factor(module))
    if config.overlap:
        reduce_scatter.may_finish_late = functools.partial(gradients_read_only_after_backward, module)
    return all_gather, reduce_scatter


def gather_chunk_dtype(planned: UnitPlan) -> torch.dtype:
    """The dtype of the chunk FSDP2 gathers for a unit: its parameters' one gather dtype, or bytes
    when they mix dtypes ([Note: mixed-dtype units] in ``zeropp.codes.codec``)."""
    dtypes = set(planned.layout.gather_dtypes)
    return planned.layout.gather_dtypes[0] if len(dtypes) == 1 else torch.uint8


FORWARD_AHEAD = 2
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
    model.set_modules_to_forward_prefetch(blocks[:FORWARD_AHEAD])
    model.set_modules_to_backward_prefetch(blocks[-1:])
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + FORWARD_AHEAD])
        block.set_modules_to_backward_prefetch(blocks[i - 1:i] if i else [])
    set_unshard_async(model, True)


@dataclass
class ShardedComms:
    """The comms installed on a model's units (on each parameter group of a unit), in
    ``model.modules()`` order (the root first), and the plan they were installed from."""

    units: list[CommGroup] = field(default_factory=list)
    """Each unit's parameter groups (one, or several where FSDP2 gives some parameters another mesh)."""
    all_gathers: list[AllGather] = field(default_factory=list)
    reduce_scatters: list[ReduceScatter] = field(default_factory=list)
    presences: list[GradientPresence] = field(default_factory=list)
    """Each unit's gradients made the same on every rank before its reduce-scatter (``zeropp.fsdp.unused``)."""
    fresh_copy_hooks: bool = False
    """Whether hpZ's never-stale hooks are on the root (installed once per model)."""
    plan: Plan | None = None
    """What ``zeropp.shard`` / ``enable`` installed (``zeropp.explain`` prints it)."""

    def add(self, unit: CommGroup, all_gather: AllGather, reduce_scatter: ReduceScatter,
            presence: GradientPresence) -> None:
        set_comms(unit, all_gather, reduce_scatter)
        self.units.append(unit)
        self.all_gathers.append(all_gather)
        self.reduce_scatters.append(reduce_scatter)
        self.presences.append(presence)

    @property
    def qgz(self) -> list[HierarchicalQuantizedReduceScatter]:
        """The qgZ reduce-scatters (they hold the error-feedback residuals)."""
        inner = [c.shard if isinstance(c, ReplicatedReduceScatter) else c for c in self.reduce_scatters]
        return [c for c in inner if isinstance(c, HierarchicalQuantizedReduceScatter)]

    def first_gathered(self, model: nn.Module) -> Callable[[], list[tuple[CommGroup, AllGather]]]:
        """The parameter groups the next forward gathers first (the root's and the blocks the
        root prefetches, [Note: prefetch]), each with its all-gather comm as installed then."""
        blocks = [unit for unit in fsdp_units(model) if unit is not model]
        first = {id(model), *(id(block) for block in blocks[:FORWARD_AHEAD])}
        indices = [i for i, group in enumerate(self.units) if id(group.unit) in first]
        return lambda: [(self.units[i], self.all_gathers[i]) for i in indices]

    def replace(self, index: int, all_gather: AllGather, reduce_scatter: ReduceScatter) -> None:
        """Install other comms on the ``index``-th unit (the audit's fallback to exact ones)."""
        if isinstance(before := self.all_gathers[index], GatherAhead):
            before.drop_ahead()  # a gather started on the comm being replaced: nobody would take it
        set_comms(self.units[index], all_gather, reduce_scatter)
        self.all_gathers[index], self.reduce_scatters[index] = all_gather, reduce_scatter


def _audit(config: ZeroPPConfig, installed: ShardedComms, topology: Topology) -> Audit:
    """The audit of every unit with a quantized collective ([Note: the audit] in ``zeropp.techniques.audit``)."""
    audited = []
    for index, (all_gather, reduce_scatter) in enumerate(zip(installed.all_gathers, installed.reduce_scatters)):
        inner = reduce_scatter.shard if isinstance(reduce_scatter, ReplicatedReduceScatter) else reduce_scatter
        comms = [comm for comm in (all_gather, inner) if isinstance(comm, Auditable)]
        if comms:
            widen = inner.widen if isinstance(inner, HierarchicalQuantizedReduceScatter) else None
            audited.append(AuditedUnit(all_gather.recorder.unit, comms,
                                       functools.partial(_fall_back, installed, index, topology), widen))
    if not audited:
        logger.warning("zeropp: %s=%d audits quantized collectives, but no unit has one (qwZ and qgZ are off): "
                       "nothing will be audited", config.key_of("audit_every"), config.audit_every)
    return Audit(config.audit_every, config.audit_fallback, audited, Recorder(topology),
                 error_budget=config.grad_error_budget)


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
