"""hpZ: the secondary weight partition inside each node (ZeRO++ section 3.2).

FSDP2 builds it: ``fully_shard(..., reshard_after_forward=<hpZ size>)`` keeps, after a unit's
forward, its weights sharded over the ``hpZ size`` ranks of the node instead of the world, so the
backward all-gather never crosses a node boundary. This module holds what zeropp adds: the size
check, the hooks that keep the secondary copy from ever being stale, and its memory accounting.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from zeropp._fsdp import fsdp_units, register_primary_shards, unit_layout
from zeropp.topology import Topology


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


def reshard_after_forward(hpz_partition_size: int) -> bool | int:
    """FSDP2's ``reshard_after_forward`` for an hpZ size: the size itself, or ``True`` (reshard
    over the whole world, plain ZeRO-3) when hpZ is off."""
    return hpz_partition_size if hpz_partition_size > 1 else True


def keep_secondary_copies_fresh(model: nn.Module) -> None:
    """Install the hooks of [Note: hpZ secondary copies are never stale] on a sharded root."""
    units = list(fsdp_units(model))
    model.register_forward_pre_hook(lambda *_: drop_secondary_copies(units), prepend=True)
    model.register_forward_hook(lambda *_: after_root_forward(units))


def after_root_forward(units: Sequence[FSDPModule]) -> None:
    """See [Note: hpZ secondary copies are never stale]."""
    if torch.is_grad_enabled():
        for unit in units:
            register_primary_shards(unit)
    else:
        drop_secondary_copies(units)


def drop_secondary_copies(units: Sequence[FSDPModule]) -> None:
    """[Note: hpZ secondary copies are never stale]
    FSDP2 keeps a unit's post-forward (secondary) shards until its backward. A forward that has
    no backward (``no_grad`` evaluation, a forward whose loss is dropped) would leave them in
    place, and the next forward would gather weights from them even after an optimizer step or
    ``load_state_dict`` changed the primary shards. So every root forward starts from the
    primary shards, and a ``no_grad`` root forward drops its copies at once (no backward will
    use them). Resharding is idempotent and costs nothing when no copy is left.

    Between a forward and its backward FSDP2 registers the secondary shards as the module's
    parameters. A state dict taken then would hold secondary-mesh shards; a load
    (``load_state_dict``, DCP's ``set_model_state_dict``, a checkpoint load) would fail on the
    mesh mismatch or write into a copy the next forward discards (and FSDP2's post-load hook
    would adopt the secondary shard as the primary); an in-place edit would be lost. So after a
    grad-enabled root forward the primary shards are registered again (``_fsdp.
    register_primary_shards``): everything that reads or writes parameters sees the primary
    shards, the pending backward still gathers from the secondary data FSDP2 keeps, and the next
    forward gathers whatever was loaded."""
    for unit in units:
        unit.reshard()


def has_secondary_copy(unit: FSDPModule) -> bool:
    """Whether the unit keeps a secondary copy after forward (it was sharded with hpZ)."""
    layout = unit_layout(unit)
    return layout.post_forward_group_size < layout.shard_group_size


def secondary_copy_bytes(model: nn.Module) -> int:
    """Bytes of hpZ's secondary copy on this rank: each unit's parameters (in the gather dtype)
    split over its hpZ group, held between a unit's forward and its backward. 0 without hpZ."""
    total = 0
    for unit in fsdp_units(model):
        layout = unit_layout(unit)
        if layout.post_forward_group_size == layout.shard_group_size:
            continue
        total += sum(numel // layout.post_forward_group_size * dtype.itemsize
                     for numel, dtype in zip(layout.padded_numels, layout.gather_dtypes))
    return total
