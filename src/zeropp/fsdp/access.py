"""The one module that touches private state of the libraries zeropp builds on: FSDP2's
parameter groups, comm interfaces and asynchronous gathers, c10d's group registry, autograd's
graph task and end-of-backward callbacks, three DCP helpers (nested-dict assignment, the
metadata-driven load planner, loading without a process group), and accelerate's mark of a model
it has already prepared.

FSDP2's public surface (``fully_shard``, ``FSDPModule.set_custom_all_gather`` and friends) does
not say how a unit lays out its flat buffers, which mesh its post-forward reshard uses, or which
comm it holds, nor when it divides the gradients around its reduce-scatter; c10d does not name a
PREMUL_SUM op's factor on torch 2.11. zeropp needs those facts to size its codecs, account for
hpZ's secondary copy and compute the reduction FSDP2 asks for, so each is read here, behind a
small function with a tested contract; when torch moves a private name, this file is the only
one to change. Verified against torch 2.11 and 2.13 (``tests/test_fsdp_access.py``).
"""

from __future__ import annotations

import dataclasses
import datetime
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.distributed import distributed_c10d as c10d
from torch.distributed.checkpoint._nested_dict import set_element
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner as EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict as load_state_dict_into
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
    _get_all_gather_input_metadatas,
    _get_gradient_divide_factors,
    _get_param_all_gather_inputs,
)
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo, TrainingState
from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

__all__ = [
    "AllGather",
    "EmptyStateDictLoadPlanner",
    "ReduceScatter",
    "CommGroup",
    "UnitLayout",
    "all_gather_input",
    "at_backward_end",
    "backward_id",
    "before_gradient_reduction",
    "counting_new_groups",
    "fsdp_units",
    "give_zero_gradients",
    "gradients_present",
    "gradients_read_only_after_backward",
    "gathers_itself",
    "in_backward",
    "load_state_dict_into",
    "mark_prepared_for_accelerate",
    "num_process_groups",
    "reached_in_backward",
    "reduce_op_parts",
    "register_primary_shards",
    "release_secondary_shards",
    "secondary_bytes_held",
    "secondary_released",
    "secondary_shard_rank",
    "self_gathered_dtype",
    "shard_versions",
    "set_element",
    "set_post_forward_mesh",
    "set_process_group_timeouts",
    "set_unshard_async",
    "then_after_forward",
    "unit_layout",
    "unit_parameters",
    "unsharded_gradients",
]


@dataclass(frozen=True)
class UnitLayout:
    """What one FSDP unit communicates, in FSDP2's flat-buffer order."""

    names: list[str]
    """Each parameter's name in the unit (``module.named_parameters()``), for error messages."""
    shapes: list[torch.Size]
    """Each parameter's unsharded shape."""
    padded_numels: list[int]
    """Each parameter's numel with dim 0 padded to a multiple of the shard group's size."""
    trainable: list[bool]
    gather_dtypes: list[torch.dtype]
    """The dtype each parameter is all-gathered in (the mixed-precision ``param_dtype``, else its
    own); FSDP2 gathers a unit whose dtypes differ as one uint8 buffer."""
    shard_group_size: int
    """Ranks the unit is sharded over (its FSDP mesh's shard dimension); 1 for an empty unit."""
    post_forward_group_size: int
    """Ranks the unit stays sharded over between forward and backward: the hpZ partition size
    (``set_post_forward_mesh``, or ``reshard_after_forward`` an int), else ``shard_group_size``
    (also for a unit kept whole after forward: see ``kept_whole_after_forward``)."""
    kept_whole_after_forward: bool = False
    """The unit keeps its weights gathered from forward to backward (``reshard_after_forward=False``)."""
    reduce_dtype: torch.dtype | None = None
    """The dtype its gradients are reduced in (the mixed-precision ``reduce_dtype``, else the
    gather dtype); None for a unit that owns no parameters."""
    self_gathered: tuple[bool, ...] = ()
    """Per parameter: a tensor subclass that gathers its own representation through FSDP2's
    extension (``fsdp_pre_all_gather``: torchao's float8 weights), in its gather dtype; empty
    where none does ([Note: weights that gather themselves])."""


def unit_layout(module: FSDPModule | CommGroup) -> UnitLayout:
    """Read a unit's parameter layout from FSDP2 (empty for a unit that owns no parameters)."""
    param_group = _param_group(module)
    if param_group is None:
        return UnitLayout([], [], [], [], [], 1, 1)
    world_size = param_group.mesh_info.shard_mesh_size
    post_forward = param_group.post_forward_mesh_info
    params = param_group.fsdp_params
    param_dtype = param_group.mp_policy.param_dtype
    name_of = {id(p): name for name, p in _module(module).named_parameters()}
    return UnitLayout(
        names=[name_of.get(id(p.sharded_param), "?") for p in params],
        shapes=[p.sharded_param.shape for p in params],
        padded_numels=[p.padded_sharded_param_size.numel() * world_size for p in params],
        trainable=[p.sharded_param.requires_grad for p in params],
        gather_dtypes=[self_gathered_dtype(p._sharded_local_tensor, param_dtype or p.sharded_param.dtype)
                       for p in params],
        shard_group_size=world_size,
        post_forward_group_size=post_forward.shard_mesh_size if post_forward is not None else world_size,
        kept_whole_after_forward=post_forward is None,
        reduce_dtype=param_group.mp_policy.reduce_dtype or param_dtype or params[0].sharded_param.dtype,
        self_gathered=tuple(gathers_itself(p._sharded_local_tensor) for p in params)
        if any(gathers_itself(p._sharded_local_tensor) for p in params) else (),
    )


def gathers_itself(tensor: torch.Tensor) -> bool:
    """[Note: weights that gather themselves]
    A parameter whose local tensor is a subclass defining FSDP2's all-gather extension
    (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``) hands FSDP2 its own all-gather inputs:
    torchao's float8 training weights (``enable_fsdp_float8_all_gather``) cast themselves to
    float8 with a scale agreed over the shard group (an all-reduce of the amax) and travel as 1
    byte per weight, in forward and again in backward. FSDP2 gathers a unit holding one as a byte
    buffer; it cannot reshard such a parameter to a smaller mesh after forward (it raises
    NotImplementedError), so hpZ cannot use FSDP2's secondary copy. zeropp leaves such a unit's
    gathers to the extension (qwZ's INT8 would not save bytes on float8 and would code a code);
    with hpZ the unit reshards fully after forward and zeropp keeps the forward gather's bytes
    itself, each of the node's ranks its share of the rows, and serves backward's gather from them
    inside the node (``zeropp.techniques.hpz_mesh.NodeCopy``, as on a 2-D mesh): the same float8
    bytes, the scale recomputed by the extension from the same weights. Its gradients are plain
    tensors, which qgZ reduces."""
    return hasattr(tensor, "fsdp_pre_all_gather")


def self_gathered_dtype(tensor: torch.Tensor, default: torch.dtype) -> torch.dtype:
    """The dtype ``tensor`` all-gathers itself in when it gathers itself (torchao's float8
    weights keep it as ``_dtype``), else ``default``."""
    dtype = getattr(tensor, "_dtype", None) if gathers_itself(tensor) else None
    return dtype if isinstance(dtype, torch.dtype) else default


def root_kept_whole_after_forward(root: FSDPModule) -> bool:
    """Whether FSDP2 will leave the root unit whole after forward: at its lazy initialisation it
    does so for a root sharded without an explicit ``reshard_after_forward`` (torch 2.13 records
    that in ``_auto_reshard_after_forward``; a torch without the field always does)."""
    return bool(getattr(root._get_fsdp_state(), "_auto_reshard_after_forward", True))


def shard_group_ranks(unit: FSDPModule) -> tuple[int, ...] | None:
    """The global ranks, in group order, of the group a unit is sharded over (the data-parallel
    ranks its reduce-scatter runs over); None for a unit that owns no parameters."""
    param_group = _param_group(unit)
    if param_group is None:
        return None
    return tuple(dist.get_process_group_ranks(param_group.mesh_info.shard_process_group))


def shard_group(unit: FSDPModule | CommGroup) -> dist.ProcessGroup | None:
    """The group a unit's gradients are reduce-scattered over (its data-parallel shard group);
    None for a unit that owns no parameters."""
    param_group = _param_group(unit)
    return None if param_group is None else param_group.mesh_info.shard_process_group


def replicate_group(unit: FSDPModule) -> dist.ProcessGroup | None:
    """The group a unit's gradients are reduced across after its reduce-scatter: HSDP's
    replicate group (also once ``set_replicas_reduced_by_comm`` took that over); None for a unit
    sharded without replicas or owning no parameters."""
    param_group = _param_group(unit)
    if param_group is None or param_group.mesh_info.replicate_mesh_dim is None:
        return None
    return param_group.mesh_info.mesh.get_group(param_group.mesh_info.replicate_mesh_dim)


def default_divide_factor(unit: FSDPModule) -> bool:
    """Whether FSDP2 divides a unit's summed gradients by its default factor (no
    ``set_gradient_divide_factor``)."""
    param_group = _param_group(unit)
    return param_group is None or param_group.gradient_divide_factor is None


def set_replicas_reduced_by_comm(unit: FSDPModule, by_comm: bool) -> None:
    """HSDP: whether the unit's reduce-scatter comm also reduces across the replicas (``by_comm``)
    instead of FSDP2's all-reduce after it. FSDP2 all-reduces when the parameter group's mesh
    info is HSDP's; this gives the group the same mesh as FSDP-only mesh info (same shard group,
    same replicate dimension recorded), or back. The parameters keep their own (their DTensor
    placements stay Replicate x Shard). See zeropp.techniques.replicas [Note: the replicas' reduction]."""
    param_group = _param_group(unit)
    if param_group is None or param_group.mesh_info.replicate_mesh_dim is None:
        return
    info = param_group.mesh_info
    kind = FSDPMeshInfo if by_comm else HSDPMeshInfo
    if type(info) is not kind:
        param_group.mesh_info = kind(**{f.name: getattr(info, f.name) for f in dataclasses.fields(kind) if f.init})
        if param_group.post_forward_mesh_info == info:  # resharding to the same mesh: it must stay the same
            param_group.post_forward_mesh_info = param_group.mesh_info


def set_post_forward_mesh(unit: FSDPModule, mesh: DeviceMesh) -> None:
    """Reshard the unit after forward over the rows of ``mesh`` (2-D: replicas x partition)
    instead of the mesh FSDP2 chose: hpZ's secondary partition, one mesh for every unit ([Note:
    one node mesh] in ``zeropp.setup.topology``). FSDP2's public ``set_reshard_after_forward`` takes
    only a bool; an int ``reshard_after_forward`` makes FSDP2 build a mesh per unit. Each
    parameter's post-forward shard shape is derived as FSDP2 derives it when sharding."""
    param_group = _param_group(unit)
    if param_group is None:
        return
    info = HSDPMeshInfo(mesh, shard_mesh_dim=1, replicate_mesh_dim=0)
    param_group.post_forward_mesh_info = info
    for fsdp_param in param_group.fsdp_params:
        fsdp_param.post_forward_mesh_info = info
        fsdp_param._init_sharded_post_forward_param_metadata(torch.empty(fsdp_param._orig_size, device="meta"))


def register_primary_shards(unit: FSDPModule, whole: bool = False) -> None:
    """After a unit's forward under hpZ, FSDP2 registers the secondary (post-forward) shards as
    the module's parameters and keeps their data in its own fields for the backward gather. Put
    the primary shards (the ones the optimizer holds) back in the module: every reader and writer
    of parameters (state dicts, DCP, ``load_state_dict`` and FSDP2's own post-load hook, in-place
    edits) then sees the primary shards, while the backward still gathers from the secondary
    data. FSDP2 registers the primary shards itself again when it reshards. ``whole``: also for
    a unit left whole after forward (``generation_mode(copy="full")``)."""
    param_group = _param_group(unit)
    if param_group is None:
        return
    states = (ShardedState.SHARDED_POST_FORWARD, ShardedState.UNSHARDED) if whole else \
        (ShardedState.SHARDED_POST_FORWARD,)
    for fsdp_param in param_group.fsdp_params:
        if fsdp_param.sharded_state in states:
            fsdp_param._setattr_on_modules(fsdp_param.sharded_param)


def register_whole_parameters(unit: FSDPModule) -> None:
    """Before a forward that reuses a unit left whole: register its whole parameters on the
    module again (``register_primary_shards`` replaced them; FSDP2 skips the unshard that would
    register them, the unit being unsharded already)."""
    param_group = _param_group(unit)
    if param_group is not None and param_group.is_unsharded:
        for fsdp_param in param_group.fsdp_params:
            fsdp_param._setattr_on_modules(fsdp_param.unsharded_param)


def unit_parameters(unit: FSDPModule) -> list[nn.Parameter]:
    """The parameters the unit itself shards (not those of units inside it), as the optimizer
    holds them (the primary shards), in FSDP2's order."""
    param_group = _param_group(unit)
    return [] if param_group is None else [p.sharded_param for p in param_group.fsdp_params]


def unsharded_gradients(unit: FSDPModule) -> list[torch.Tensor]:
    """The unit's gradients as autograd wrote them, before its reduce-scatter (whole, in the
    gather dtype): what FSDP2 reduces when the unit's backward ends."""
    param_group = _param_group(unit)
    if param_group is None:
        return []
    whole = [p._unsharded_param for p in param_group.fsdp_params if hasattr(p, "_unsharded_param")]
    return [param.grad for param in whole if param.grad is not None]


@torch.no_grad()
def all_gather_input(unit: FSDPModule) -> tuple[torch.Tensor, dist.ProcessGroup] | None:
    """What the unit's next unshard will hand its all-gather comm, built from its primary shards
    as FSDP2 builds it (each parameter's padded shard in its gather dtype, one after the other;
    as bytes when the dtypes differ), and the group it gathers over; None for a unit without
    parameters or with only one rank to gather from."""
    param_group = _param_group(unit)
    if param_group is None or param_group.mesh_info.shard_mesh_size == 1:
        return None
    inputs = _get_param_all_gather_inputs(param_group.fsdp_params)
    dtype = _get_all_gather_input_metadatas(inputs)[2]
    flat = [t.reshape(-1).view(torch.uint8) if dtype == torch.uint8 else t.reshape(-1) for ts in inputs for t in ts]
    return torch.cat(flat), param_group._all_gather_process_group


@dataclass(frozen=True, eq=False)
class CommGroup:
    """One FSDP2 parameter group of a unit: the parameters one all-gather and one reduce-scatter
    move, over one mesh. A unit holds one, or several where ``fully_shard``'s
    ``shard_placement_fn`` gives some of its parameters another mesh (torchtitan's routed experts
    under expert parallelism: the experts on their own FSDP mesh, the rest of the block on the
    data-parallel one). Every function here that takes a unit takes a group as well."""

    unit: FSDPModule
    index: int

    @property
    def param_group(self) -> Any:
        groups = self.unit._get_fsdp_state()._fsdp_param_groups
        return groups[self.index] if groups else None


def comm_groups(model: nn.Module) -> Iterator[CommGroup]:
    """Every parameter group of every unit of ``model``, units in ``fsdp_units`` order (a unit
    without parameters gives one empty group)."""
    for unit in fsdp_units(model):
        for index in range(max(1, len(unit._get_fsdp_state()._fsdp_param_groups))):
            yield CommGroup(unit, index)


def groups_of(unit: FSDPModule) -> int:
    """How many parameter groups ``unit`` holds (``CommGroup``)."""
    return len(unit._get_fsdp_state()._fsdp_param_groups)


def set_comms(group: CommGroup, all_gather: AllGather, reduce_scatter: ReduceScatter) -> None:
    """Install a group's all-gather and reduce-scatter comms. FSDP2's public
    ``set_custom_all_gather`` / ``set_custom_reduce_scatter`` refuse a unit of several groups (one
    comm for several meshes would be ambiguous); each group holds its own in FSDP2's fields."""
    if groups_of(group.unit) <= 1:
        group.unit.set_custom_all_gather(all_gather)
        group.unit.set_custom_reduce_scatter(reduce_scatter)
        return
    group.param_group._all_gather_comm = all_gather
    group.param_group._reduce_scatter_comm = reduce_scatter


def _param_group(unit: FSDPModule | CommGroup) -> Any:
    """The FSDP2 parameter group of a group, or of a unit that holds one (None for a unit without
    parameters)."""
    if isinstance(unit, CommGroup):
        return unit.param_group
    groups = unit._get_fsdp_state()._fsdp_param_groups
    if len(groups) > 1:
        raise ValueError(f"{type(unit).__name__} holds {len(groups)} parameter groups (a shard_placement_fn gave "
                         "some parameters another mesh): address each through access.comm_groups")
    return groups[0] if groups else None


def _module(unit: FSDPModule | CommGroup) -> FSDPModule:
    """The unit itself, or the unit a group belongs to."""
    return unit.unit if isinstance(unit, CommGroup) else unit


def _param_groups(units: Iterable[FSDPModule | CommGroup]) -> Iterator[Any]:
    """Every parameter group of ``units`` (a group: itself)."""
    for unit in units:
        if isinstance(unit, CommGroup):
            if unit.param_group is not None:
                yield unit.param_group
        else:
            yield from unit._get_fsdp_state()._fsdp_param_groups


def is_initialized(model: FSDPModule) -> bool:
    """Whether FSDP2 has set up ``model``'s sharding state (its lazy initialisation, at the first
    forward): before it, a parameter group cannot build its gather's input."""
    return model._get_fsdp_state()._is_root is not None


def is_resharded(unit: FSDPModule) -> bool:
    """Whether the unit holds only its primary shards (its next forward gathers them over its
    shard group), not its whole parameters or hpZ's secondary shards; False without parameters
    or with its shards on the host, whose forward first copies them to the device."""
    param_group = _param_group(unit)
    return param_group is not None and param_group.is_sharded and not any(
        p.offload_to_cpu for p in param_group.fsdp_params)


def offloads_to_cpu(unit: FSDPModule) -> bool:
    """Whether the unit keeps its shards on the host (``fully_shard(offload_policy=CPUOffloadPolicy())``)."""
    param_group = _param_group(unit)
    return param_group is not None and any(p.offload_to_cpu for p in param_group.fsdp_params)


def _fsdp_params(units: Iterable[FSDPModule | CommGroup]) -> Iterator[Any]:
    for param_group in _param_groups(units):
        yield from param_group.fsdp_params


def shard_versions(units: Iterable[FSDPModule]) -> tuple[int, ...]:
    """The version counters of the units' primary shards: any in-place change of a shard (an
    optimizer step, a load, an edit through ``model.parameters()``, a copy into its local tensor
    such as ``zeropp.offload_optimizer``'s) bumps one."""
    # both counters: in-place ops through DTensor dispatch bump the DTensor's own and not its local
    # tensor's, and a write into the local tensor (``to_local().copy_``) bumps only the local one
    return tuple(version for p in _fsdp_params(units)
                 for version in (p.sharded_param._version, p.sharded_param._local_tensor._version))


def secondary_bytes_held(units: Iterable[FSDPModule]) -> int:
    """Bytes of post-forward (secondary) shards the units hold right now (a released shard's
    placeholder holds none: ``release_secondary_shards``)."""
    return sum(p._sharded_post_forward_param_data.nbytes for p in _fsdp_params(units)
               if p.sharded_state is ShardedState.SHARDED_POST_FORWARD
               and not _is_placeholder(p._sharded_post_forward_param_data))


def secondary_shard_rank(unit: FSDPModule) -> int:
    """This rank's index in the unit's post-forward (hpZ) group: which 1/hpZ slice of every
    parameter its secondary shard holds."""
    return _param_group(unit).post_forward_mesh_info.shard_mesh_rank


def then_after_forward(unit: FSDPModule, hook: Callable[[], None] | None) -> None:
    """Run ``hook`` right after each post-forward of the unit (FSDP2's reshard after forward,
    skipped in backward's recomputation), before the next unit runs; it replaces a hook set
    before (None removes it)."""
    group = _param_group(unit)
    if group is None:
        return
    original = getattr(group.post_forward, "without_hook", group.post_forward)
    if hook is None:
        group.post_forward = original
        return

    def post_forward(*args: Any) -> Any:
        output = original(*args)
        hook()
        return output

    post_forward.without_hook = original  # type: ignore[attr-defined]
    group.post_forward = post_forward


def release_secondary_shards(unit: FSDPModule) -> bool:
    """Free the post-forward (secondary) shards FSDP2 made for the unit's backward gather, if it
    holds them: each becomes a placeholder of its size that holds no memory (read as zeros), and
    the module gets its primary shards back (``register_primary_shards``). Whoever releases them
    must then serve the unit's next gather from its own copy ([Note: hpZ's copy as qwZ's codes]
    in ``zeropp.techniques.hpz``); FSDP2's copy-in still reads the placeholders to build that gather's
    input. Returns whether the shards were released.

    The placeholder is one zero element expanded to the shard's size; where FSDP2 gathers the
    unit as bytes (its parameters' dtypes differ) it reads each shard through a byte view, which
    needs unit stride, so there it is a view of one zero buffer per device (as large as the
    largest such shard, shared by all of them)."""
    group = _param_group(unit)
    if group is None or not group.is_sharded_post_forward or secondary_released(unit):
        return False
    as_bytes = len({p.param_dtype or p.orig_dtype for p in group.fsdp_params}) > 1
    for fsdp_param in group.fsdp_params:
        shard = fsdp_param._sharded_post_forward_param_data
        fsdp_param._sharded_post_forward_param_data = _placeholder(shard.numel(), shard.dtype, shard.device, as_bytes)
        fsdp_param._sharded_post_forward_param = None
        fsdp_param._setattr_on_modules(fsdp_param.sharded_param)
    return True


def secondary_released(unit: FSDPModule) -> bool:
    """Whether the unit is between forward and backward with its secondary shards released."""
    group = _param_group(unit)
    return (group is not None and group.is_sharded_post_forward
            and any(_is_placeholder(p._sharded_post_forward_param_data) for p in group.fsdp_params))


_PLACEHOLDERS: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
_ZERO_BYTES: dict[torch.device, torch.Tensor] = {}


def _placeholder(numel: int, dtype: torch.dtype, device: torch.device, as_bytes: bool) -> torch.Tensor:
    if as_bytes:
        nbytes = numel * dtype.itemsize
        zeros = _ZERO_BYTES.get(device)
        if zeros is None or zeros.numel() < nbytes:
            zeros = _ZERO_BYTES[device] = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        placeholder = zeros[:nbytes].view(dtype)
    else:
        placeholder = torch.zeros((), dtype=dtype, device=device).expand(numel)
    _PLACEHOLDERS[id(placeholder)] = placeholder
    return placeholder


def _is_placeholder(tensor: torch.Tensor | None) -> bool:
    return tensor is not None and _PLACEHOLDERS.get(id(tensor)) is tensor


def unsharded_bytes_held(units: Iterable[FSDPModule]) -> int:
    """Bytes of whole (unsharded) parameters the units hold right now, outside a forward."""
    return sum(p._unsharded_param.numel() * p._unsharded_param.element_size()
               for group in _param_groups(units) if group.is_unsharded for p in group.fsdp_params)


def post_forward_meshes(units: Sequence[FSDPModule]) -> list[Any]:
    """Each parameter group's post-forward mesh, the units' groups in order: where FSDP2 reshards
    it after forward (the world, hpZ's node group, or None: it stays whole). ``units[0]`` must be
    the root: its lazy initialisation runs first (FSDP2 runs it at the first forward, and it sets
    the root's mesh to None), so the meshes read are those forwards use."""
    units[0]._get_fsdp_state()._lazy_init()
    return [group.post_forward_mesh_info for group in _param_groups(units)]


def set_post_forward_meshes(units: Iterable[FSDPModule], meshes: Sequence[Any] | None) -> None:
    """Set each parameter group's post-forward mesh (``post_forward_meshes``); None for all keeps
    them whole after forward, which ``FSDPModule.set_reshard_after_forward(False)`` also does, but
    that cannot bring hpZ's node mesh back."""
    groups = list(_param_groups(units))
    for group, mesh in zip(groups, meshes if meshes is not None else [None] * len(groups), strict=True):
        group.post_forward_mesh_info = mesh


def set_unshard_async(root: FSDPModule, enabled: bool) -> None:
    """Have FSDP2 issue the pre-forward and pre-backward gathers of ``root`` and every unit in it
    with ``async_op`` (and wait for them just before use), so that an explicitly prefetched
    gather runs beside compute."""
    root._set_unshard_async_op(enabled)


def fsdp_units(model: nn.Module) -> Iterator[FSDPModule]:
    """Every unit of ``model`` in ``modules()`` order: each module ``fully_shard`` made one, once
    per unit (``fully_shard([norm, head])`` groups two modules into one unit, named by the first)."""
    seen = set()
    for module in model.modules():
        if isinstance(module, FSDPModule) and id(state := module._get_fsdp_state()) not in seen:
            seen.add(id(state))
            yield module


def in_backward() -> bool:
    """Whether autograd is running a backward pass on this thread (FSDP2's backward gathers)."""
    return torch._C._current_graph_task_id() != -1


def backward_id() -> int:
    """The running backward pass's graph task (-1 outside backward): tells one backward from the next."""
    return torch._C._current_graph_task_id()


def at_backward_end(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the running backward pass has run its last node, before
    ``backward()`` returns (after FSDP2's own end-of-backward work, queued before it)."""
    Variable._execution_engine.queue_callback(callback)


def before_gradient_reduction(unit: FSDPModule, hook: Callable[[], None]) -> None:
    """Run ``hook`` at the start of every post-backward of the unit that reduce-scatters its
    gradients (gradient sync on), before FSDP2 collects the gradients to send; it replaces a hook
    set before. FSDP2 sends only the parameters that hold a gradient on this rank, so this is
    where a gradient can still be added (``give_zero_gradients``)."""
    group = _param_group(unit)
    if group is None:
        return
    original = getattr(group.post_backward, "without_hook", group.post_backward)

    def post_backward(*args: Any) -> Any:
        if group.reduce_grads:
            hook()
        return original(*args)

    post_backward.without_hook = original  # type: ignore[attr-defined]
    group.post_backward = post_backward


def reached_in_backward(unit: FSDPModule) -> bool:
    """Whether the running backward pass has reached the unit on this rank (FSDP2 ran its
    pre-backward: autograd computes gradients through it), as opposed to FSDP2 calling its
    post-backward at the end of backward for a unit this backward never reached."""
    group = _param_group(unit)
    return group is not None and group._training_state is TrainingState.PRE_BACKWARD


def gradients_present(unit: FSDPModule) -> list[bool]:
    """Which of the unit's parameters (FSDP2's order) hold a gradient for FSDP2 to reduce-scatter:
    computed in this backward, or accumulated over micro-steps without gradient sync."""
    return [fsdp_param.unsharded_accumulated_grad is not None
            or (hasattr(fsdp_param, "_unsharded_param") and fsdp_param.unsharded_param.grad is not None)
            for fsdp_param in _fsdp_params([unit])]


def give_zero_gradients(unit: FSDPModule, which: Sequence[bool]) -> None:
    """Give the unit's parameters chosen by ``which`` (FSDP2's order) a zero unsharded gradient,
    so FSDP2 reduce-scatters them as if autograd had computed zeros."""
    for fsdp_param, zero in zip(_fsdp_params([unit]), which, strict=True):
        if zero:
            fsdp_param.unsharded_param.grad = torch.zeros_like(fsdp_param.unsharded_param)


def gradients_read_only_after_backward(unit: FSDPModule, reduce_dtype: torch.dtype,
                                       op: dist.ReduceOp) -> bool:
    """Whether FSDP2 leaves the unit's reduce-scatter output alone until backward ends, so a
    comm may fill it later: every sharded gradient becomes a view of the output (no gradient to
    add it to, no cast to another dtype, no division after the collective, no HSDP all-reduce,
    no all-reduce hook, no CPU offload) and no post-accumulate-grad hook reads it in backward."""
    group = _param_group(unit)
    if (group is None or isinstance(group.mesh_info, HSDPMeshInfo) or group._all_reduce_hook is not None
            or _divides_after_reduce_scatter(group, reduce_dtype, op)):
        return False
    return all(
        fsdp_param.sharded_param.grad is None and fsdp_param.sharded_param.dtype == reduce_dtype
        and not fsdp_param.offload_to_cpu
        and not getattr(fsdp_param.sharded_param, "_post_accumulate_grad_hooks", None)
        for fsdp_param in group.fsdp_params)


def _divides_after_reduce_scatter(group: Any, reduce_dtype: torch.dtype, op: dist.ReduceOp) -> bool:
    """Whether FSDP2 divides the unit's reduce-scatter output after the collective: only with
    SUM (AVG and PREMUL_SUM carry the whole division), by the post-divide factor of FSDP2's own
    rule for the unit's settings, unless that is 1 (``comms`` [Note: the reductions FSDP2 asks
    for])."""
    if reduce_op_parts(op)[0] != dist.ReduceOp.SUM:
        return False
    post_divide_factor = _get_gradient_divide_factors(
        group._reduce_scatter_process_group, None, reduce_dtype, group.device.type,
        group.gradient_divide_factor, group.force_sum_reduction_for_comms)[1]
    return post_divide_factor is not None and post_divide_factor != 1


def reduce_op_parts(op: dist.ReduceOp | dist.ReduceOp.RedOpType
                    ) -> tuple[dist.ReduceOp.RedOpType, float | torch.Tensor | None]:
    """A c10d reduce op as its kind (``ReduceOp.SUM``, ``PREMUL_SUM``, ...) and, for PREMUL_SUM,
    the factor each rank's input is multiplied by (None for the other kinds). torch 2.13 names
    the factor ``op.factor``; 2.11 gives it only through the op's pickled state, which both
    versions share."""
    if isinstance(op, dist.ReduceOp.RedOpType):
        return op, None
    kind, factor = op.__getstate__()
    return kind, factor


def set_process_group_timeouts(timeout_s: float) -> None:
    """Make every process group of this process (the world and the subgroups, which
    ``new_group`` creates with the backend's default) give up on a collective after
    ``timeout_s`` seconds, so a dead or hung peer surfaces as an error."""
    timeout = datetime.timedelta(seconds=timeout_s)
    for group in list(c10d._world.pg_map):
        c10d._set_pg_timeout(timeout, group)


def num_process_groups() -> int:
    """Process groups this process is a member of, the world included (c10d's registry)."""
    return len(c10d._world.pg_map)


@contextmanager
def counting_new_groups() -> Iterator[list[int]]:
    """Count the groups created inside the block, this rank a member or not: ``new_group`` is
    collective over the world, so every rank pays for every call. zeropp's, ``DeviceMesh``'s
    and FSDP2's calls alike run through c10d's ``_new_group_with_tag``; the yielded list's one
    element is the count so far."""
    count = [0]
    create = c10d._new_group_with_tag

    def counted(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return create(*args, **kwargs)

    c10d._new_group_with_tag = counted
    try:
        yield count
    finally:
        c10d._new_group_with_tag = create


def mark_prepared_for_accelerate(model: nn.Module) -> None:
    """Make accelerate's ``prepare_model`` hand ``model`` back as it is (it skips a model that
    carries its "already prepared" mark): no DDP wrapper over FSDP2's DTensor parameters, no move."""
    model._is_accelerate_prepared = True
