"""Offload as the cost model sees it: CPU offload (``ZeroPPConfig.offload="cpu"``, FSDP2's
``CPUOffloadPolicy``) and the optimizer on the host (``offload="optimizer"``,
``zeropp.fsdp.offload.HostOptimizer``): what a rank holds in host memory, and what each unit copies
between host and device in a step.

[Note: CPU offload in a step]
FSDP2 keeps every parameter's padded shard on the host in the parameters' dtype (fp32,
``memory.PARAMETER_BYTES``), page-locked when ``offload_pin_memory`` asks for it. The optimizer
steps where the shards are, so AdamW's two states of the unpadded shard and the reduced gradient
shard live on the host too; the device holds none of the three. In a step:

- before every all-gather FSDP2 issues from a unit's shard it copies the padded shard to the
  device (``FSDPParam.all_gather_inputs``), casts it to the gather dtype there and copies that
  into the flat all-gather input: forward's gather and backward's, unless hpZ's secondary copy
  (on the device) serves backward (``traffic.backward_gathers_from_shard``). The root is
  gathered twice too: zeropp shards it with ``reshard_after_forward=True``;
- after a unit's reduce-scatter FSDP2 casts the reduced shard to the parameters' dtype and copies
  each parameter's unpadded rows to the host, once per step (no gradient accumulation);
- PyTorch's caching host allocator rounds each pinned allocation up to a power of two: every
  parameter's shard is pinned once, every gradient shard on its copy. That rounding is all the
  pinned staging there is (FSDP2 keeps no staging buffer of its own).

On the device this leaves what [Note: a rank's memory through a step] lists besides the shards,
gradient shards and optimizer state, plus, at each copy-in, the unit's shard in the gather dtype
beside the flat all-gather output; the reduced gradient shard lives there only until copied.

Time, at ``Machine.host_device_bytes_per_s`` each way: pinned copies are asynchronous, on the
stream that feeds the all-gather and the one after the reduce-scatter, so a unit's host-to-device
copies join its gathers and its device-to-host copy its reduce-scatter in [Note: overlap]'s
schedule: hidden behind compute as they are, save the first gather's. Pageable copies block the
CPU that launches the next kernels: they add to the step whole. Not modelled: the optimizer's
time on the host (``Machine.update_s_per_parameter`` prices it as on the device), its
temporaries there, and ranks of a node contending for the host's memory bandwidth beyond what
the per-rank rate already accounts for.

[Note: the optimizer on the host in a step]
``HostOptimizer`` (``zeropp.fsdp.offload``'s [Note: the optimizer on the host]) leaves the parameter
shards on the device in the parameters' dtype (``memory.PARAMETER_BYTES``), so the gathers, the
reduce-scatters and the gradient shards are the mode's without offload. For each trainable parameter (the
optimizer's ``param_groups``, as ``zeropp.initialize`` builds them) it keeps an fp32 master of
the unpadded shard in host memory and AdamW's two fp32 states beside it: the device holds no
optimizer state and no master (the plan's parameters are fp32: the device shard is the parameter
itself, and the copies below cast nothing). After backward its ``step``:

- copies each gradient shard's unpadded rows to the host in fp32 (``.to("cpu", torch.float32)``),
  all of them alive while the host steps;
- steps AdamW on the masters there (its temporaries on the host too);
- copies each updated master into its device shard, cast to the shard's dtype.

Time, at ``Machine.host_device_bytes_per_s`` each way: the copies run between the last
reduce-scatter and the next forward with nothing to overlap them, so they add to the step whole.
``Machine.update_s_per_parameter`` prices the host's AdamW as on the device. Not modelled: the
host tensors are pageable, whose copies may run below the pinned rate (``--host-device-gbyte``
sets it), AdamW's temporaries on the host, and ranks of a node sharing the host's memory
bandwidth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from zeropp.config import ZeroPPConfig
from zeropp.setup.topology import Topology
from zeropp.tools.plan.memory import PARAMETER_BYTES, local_rows
from zeropp.tools.plan.model import ModelShape, UnitShape
from zeropp.tools.plan.traffic import backward_gathers_from_shard, offloads_optimizer, offloads_shards, padded_numels

MASTER_BYTES = 4
"""fp32: ``HostOptimizer``'s masters, the gradient copies it steps them with, and AdamW's states."""


@dataclass(frozen=True)
class HostMemory:
    """Bytes one rank holds in host memory with offload (all 0 without)."""

    parameters: float
    """The padded parameter shards (offload cpu), or the fp32 masters of the trainable shards'
    unpadded rows (offload optimizer)."""
    gradients: float
    """The gradient shards' unpadded rows: reduced, in the parameters' dtype (offload cpu), or
    copied in fp32 for the host's step (offload optimizer)."""
    optimizer: float
    """AdamW's two states of the unpadded shards."""
    pinned_rounding: float
    """What the caching host allocator adds rounding pinned shards up to powers of two (offload
    cpu, pinned)."""

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))


@dataclass(frozen=True)
class UnitCopies:
    """Bytes one unit copies between host and device on one rank in one step."""

    to_device_forward: float
    """Offload cpu: the padded shard, before the forward gather."""
    to_device_backward: float
    """Offload cpu: the padded shard again before the backward gather (0 where hpZ's copy serves it)."""
    to_host: float
    """The gradient shard's unpadded rows: after the unit's reduce-scatter, in the parameters'
    dtype (offload cpu), or in fp32 for the host's step (offload optimizer)."""
    to_device_step: float = 0.0
    """Offload optimizer: the updated masters' rows copied into the shard after the host's step,
    in the parameters' dtype."""

    @property
    def to_device(self) -> float:
        return self.to_device_forward + self.to_device_backward + self.to_device_step


def _shard_size(config: ZeroPPConfig | None, topology: Topology) -> int:
    return topology.ranks_per_node if config is None else topology.world_size


def _trainable_numels(unit: UnitShape, shard_size: int, rank: int) -> list[int]:
    """Each trainable parameter's unpadded rows on ``rank``, in elements."""
    return [local_rows(shape[0], shard_size, rank % shard_size) * math.prod(shape[1:])
            for shape, trainable in zip(unit.shapes, unit.trainable) if trainable]


def unit_copies(unit: UnitShape, config: ZeroPPConfig | None, topology: Topology, rank: int = 0) -> UnitCopies:
    """``unit``'s host-device copies on ``rank`` ([Note: CPU offload in a step], [Note: the
    optimizer on the host in a step]); all 0 without offload."""
    if not offloads_optimizer(config) or not unit.shapes:
        return UnitCopies(0.0, 0.0, 0.0)
    shard_size = _shard_size(config, topology)
    trainable = sum(_trainable_numels(unit, shard_size, rank))
    if not offloads_shards(config):
        return UnitCopies(0.0, 0.0, trainable * MASTER_BYTES, to_device_step=trainable * PARAMETER_BYTES)
    shard = sum(padded_numels(unit, shard_size)) / shard_size * PARAMETER_BYTES
    return UnitCopies(
        to_device_forward=shard,
        to_device_backward=shard if backward_gathers_from_shard(config, topology) else 0.0,
        to_host=trainable * PARAMETER_BYTES)


def step_copies(model: ModelShape, config: ZeroPPConfig | None, topology: Topology,
                rank: int = 0) -> list[UnitCopies]:
    """Every unit's host-device copies in one step (``model.units`` order)."""
    return [unit_copies(unit, config, topology, rank) for unit in model.units]


def _pinned_rounding(sizes: list[float]) -> float:
    """What rounding each allocation up to a power of two adds (0 stays 0)."""
    return sum(2 ** math.ceil(math.log2(size)) - size for size in sizes if size > 0)


def host_memory(model: ModelShape, config: ZeroPPConfig | None, topology: Topology, rank: int = 0) -> HostMemory:
    """What ``rank`` holds in host memory through a step with offload: with CPU offload ([Note:
    CPU offload in a step]) shards, gradient shards, AdamW's states and the pinned allocations'
    rounding; with the optimizer there ([Note: the optimizer on the host in a step]) fp32
    masters, their gradients and AdamW's states."""
    if not offloads_optimizer(config):
        return HostMemory(0.0, 0.0, 0.0, 0.0)
    shard_size = _shard_size(config, topology)
    trainable = [n for unit in model.units for n in _trainable_numels(unit, shard_size, rank)]
    if not offloads_shards(config):
        masters = sum(trainable) * MASTER_BYTES
        return HostMemory(parameters=masters, gradients=masters, optimizer=2 * masters, pinned_rounding=0.0)
    shards = [n / shard_size * PARAMETER_BYTES for unit in model.units for n in padded_numels(unit, shard_size)]
    gradients = [n * PARAMETER_BYTES for n in trainable]
    pinned = _pinned_rounding(shards + gradients) if config.offload_pin_memory else 0.0
    return HostMemory(parameters=sum(shards), gradients=sum(gradients), optimizer=2 * sum(gradients),
                      pinned_rounding=pinned)


def copy_seconds(copies: UnitCopies, config: ZeroPPConfig | None, bytes_per_s: float) -> dict[str, float]:
    """A unit's copies in seconds, by when they run: with CPU offload beside the collective whose
    chain they join ([Note: overlap]), with the optimizer on the host at the ``"step"``, after
    backward."""
    if offloads_shards(config):
        return {"forward_gather": copies.to_device_forward / bytes_per_s,
                "backward_gather": copies.to_device_backward / bytes_per_s,
                "reduce": copies.to_host / bytes_per_s}
    return {"step": (copies.to_host + copies.to_device_step) / bytes_per_s}
