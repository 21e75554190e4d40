"""The one module that touches private torch state: FSDP2's parameter groups and comm
interfaces, c10d's group registry, autograd's graph task, and three DCP helpers (nested-dict
assignment, the metadata-driven load planner, loading without a process group).

FSDP2's public surface (``fully_shard``, ``FSDPModule.set_custom_all_gather`` and friends) does
not say how a unit lays out its flat buffers, which mesh its post-forward reshard uses, or which
comm it holds. zeropp needs those facts to size its codecs and account for hpZ's secondary copy,
so each is read here, behind a small function with a tested contract; when torch moves a private
name, this file is the only one to change. Verified against torch 2.11 and 2.13
(``tests/test_fsdp_access.py``).
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed import distributed_c10d as c10d
from torch.distributed.checkpoint._nested_dict import set_element
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner as EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict as load_state_dict_into
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

__all__ = [
    "AllGather",
    "EmptyStateDictLoadPlanner",
    "ReduceScatter",
    "UnitLayout",
    "fsdp_units",
    "in_backward",
    "load_state_dict_into",
    "set_element",
    "set_process_group_timeouts",
    "unit_layout",
]


@dataclass(frozen=True)
class UnitLayout:
    """What one FSDP unit communicates, in FSDP2's flat-buffer order."""

    padded_numels: list[int]
    """Each parameter's numel with dim 0 padded to a multiple of the shard group's size."""
    trainable: list[bool]
    gather_itemsizes: list[int]
    """Bytes per element each parameter is all-gathered in (the mixed-precision ``param_dtype``,
    else its own dtype)."""
    shard_group_size: int
    """Ranks the unit is sharded over (its FSDP mesh's shard dimension); 1 for an empty unit."""
    post_forward_group_size: int
    """Ranks the unit stays sharded over between forward and backward: the hpZ partition size
    when ``reshard_after_forward`` is an int, else ``shard_group_size``."""


def unit_layout(module: FSDPModule) -> UnitLayout:
    """Read a unit's parameter layout from FSDP2 (empty for a unit that owns no parameters)."""
    param_group = module._get_fsdp_state()._fsdp_param_group
    if param_group is None:
        return UnitLayout([], [], [], 1, 1)
    world_size = param_group.mesh_info.shard_mesh_size
    post_forward = param_group.post_forward_mesh_info
    params = param_group.fsdp_params
    param_dtype = param_group.mp_policy.param_dtype
    return UnitLayout(
        padded_numels=[p.padded_sharded_param_size.numel() * world_size for p in params],
        trainable=[p.sharded_param.requires_grad for p in params],
        gather_itemsizes=[(param_dtype or p.sharded_param.dtype).itemsize for p in params],
        shard_group_size=world_size,
        post_forward_group_size=post_forward.shard_mesh_size if post_forward is not None else world_size,
    )


def fsdp_units(model: nn.Module) -> Iterator[FSDPModule]:
    """Every module of ``model`` that ``fully_shard`` made a unit, in ``modules()`` order."""
    return (m for m in model.modules() if isinstance(m, FSDPModule))


def in_backward() -> bool:
    """Whether autograd is running a backward pass on this thread (FSDP2's backward gathers)."""
    return torch._C._current_graph_task_id() != -1


def set_process_group_timeouts(timeout_s: float) -> None:
    """Make every process group of this process (the world and the subgroups, which
    ``new_group`` creates with the backend's default) give up on a collective after
    ``timeout_s`` seconds, so a dead or hung peer surfaces as an error."""
    timeout = datetime.timedelta(seconds=timeout_s)
    for group in list(c10d._world.pg_map):
        c10d._set_pg_timeout(timeout, group)

