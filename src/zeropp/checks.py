"""What ``zeropp.enable`` checks before it installs anything: each unit's sharding against the
techniques asked for (qgZ's shard group on nodes, hpZ on 2-D meshes, HSDP's replicas), the name
patterns against the model, CPU offload against how the units were sharded. Every error names
the unit or key, the value and what would work; none needs a collective.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from zeropp._fsdp import offloads_to_cpu, replicate_group, shard_group_ranks, unit_layout, unit_parameters
from zeropp.config import ZeroPPConfig
from zeropp.topology import Topology, place_on_nodes


def require_process_group(caller: str) -> None:
    if not dist.is_initialized():
        raise RuntimeError(f"{caller} needs torch.distributed initialised: call "
                           "dist.init_process_group (torchrun sets the environment for it) first")


def check_unit(unit: FSDPModule, config: ZeroPPConfig, topology: Topology, name: str) -> None:
    """A unit sharded by someone else must suit the techniques asked for; the error names the unit
    (``name``, its path in the model) and says how to shard it instead."""
    layout = unit_layout(unit)
    name = f"unit {name!r} ({type(unit).__name__})"
    if config.quantized_gradients and layout.padded_numels and layout.shard_group_size != topology.world_size:
        try:
            place_on_nodes(topology, shard_group_ranks(unit))
        except ValueError as error:
            raise ValueError(f"{config.key_of('quantized_gradients')}: {name} reduce-scatters over {error}; or "
                             f"turn {config.key_of('quantized_gradients')} off") from None
    if config.quantized_replica_gradients and layout.padded_numels and replicate_group(unit) is None:
        raise ValueError(
            f"{config.key_of('quantized_replica_gradients')}=true quantizes the gradients' all-reduce across HSDP's "
            f"replicas, but {name} has no replicas (sharded on a 1-D mesh or a tensor parallel x FSDP one): shard "
            "it with fully_shard(module, mesh=<(replicate, shard) mesh>) or leave the option off")
    hpz, hpz_key = config.hpz_partition_size, config.key_of("hpz_partition_size")
    if hpz > 1 and layout.padded_numels and layout.shard_group_size != topology.world_size:
        _check_hpz_on_2d_mesh(config, topology, name, shard_group_ranks(unit), layout.shard_group_size)
    if hpz > 1 and layout.padded_numels and layout.post_forward_group_size not in (hpz, layout.shard_group_size):
        raise ValueError(
            f"{hpz_key}={hpz}, but {name} was sharded with reshard_after_forward="
            f"{layout.post_forward_group_size} (its weights stay sharded over that many ranks after forward): "
            f"shard it with reshard_after_forward=True (zeropp.enable then sets hpZ's partition) or {hpz}, "
            f"or set {hpz_key}={layout.post_forward_group_size}")


def _check_hpz_on_2d_mesh(config: ZeroPPConfig, topology: Topology, name: str, ranks: Sequence[int],
                          group_size: int) -> None:
    """hpZ on a unit of a 2-D mesh keeps its copy over the unit's data-parallel ranks on each
    node ([Note: hpZ on a 2-D mesh]): hpZ's size must equal those ranks per node (at least two)."""
    hpz, hpz_key = config.hpz_partition_size, config.key_of("hpz_partition_size")
    per_node = len(ranks) // len({topology.node_of(rank) for rank in ranks})
    where = (f"{hpz_key}={hpz}, but {name} is sharded over {group_size} of {topology.world_size} ranks (a 2-D "
             f"mesh: tensor parallel x FSDP, or HSDP), {per_node} of them on each node")
    if per_node == 1:
        raise ValueError(f"{where}: a node holds no partition of its data-parallel group to keep hpZ's copy in. "
                         f"Set {hpz_key}=1 (qwZ and qgZ work on this layout)")
    if per_node == group_size:
        raise ValueError(f"{where}: its shard group is one node already (HSDP), so backward's gather never "
                         f"crosses nodes and hpZ has nothing to save. Set {hpz_key}=1")
    if hpz != per_node:
        raise ValueError(f"{where}: hpZ's copy on a 2-D mesh spans the unit's data-parallel ranks of a node. "
                         f"Set {hpz_key}={per_node}")


def check_patterns(model: nn.Module, config: ZeroPPConfig) -> None:
    """Every pattern of ``unquantized_parameters`` and ``grad_full_precision_parameters`` names a
    parameter (a typo would otherwise quantize what the user meant to keep)."""
    names = [name for name, _ in model.named_parameters()]
    for key in ("unquantized_parameters", "grad_full_precision_parameters"):
        for pattern in getattr(config, key):
            if not any(fnmatch.fnmatchcase(name, pattern) for name in names):
                raise ValueError(f"{config.key_of(key)} pattern {pattern!r} matches no parameter of "
                                 f"{type(model).__name__}; its parameters are named like {names[:3]}")


def check_offload(model: FSDPModule, config: ZeroPPConfig) -> None:
    """``enable`` cannot move shards already placed by ``fully_shard``: a config asking for CPU
    offload needs every unit sharded with ``CPUOffloadPolicy``."""
    if config.offload != "cpu":
        return
    missing = [name or type(model).__name__ for name, unit in model.named_modules()
               if isinstance(unit, FSDPModule) and unit_parameters(unit) and not offloads_to_cpu(unit)]
    if missing:
        raise ValueError(f"{config.key_of('offload')}={config.offload!r}, but {', '.join(missing[:3])}"
                         f"{' and others' if len(missing) > 3 else ''} were sharded without CPU offload; zeropp.enable "
                         "cannot move shards fully_shard placed: pass offload_policy=CPUOffloadPolicy() to "
                         "fully_shard (or use zeropp.shard, which does)")


def gathers_stay_in_nodes(units: list[FSDPModule], topology: Topology) -> bool:
    """Whether every unit with parameters gathers over a group inside one node (on every rank:
    a mesh's shard groups are alike)."""
    groups = [shard_group_ranks(unit) for unit in units if unit_layout(unit).padded_numels]
    return bool(groups) and all(len({topology.node_of(rank) for rank in ranks}) == 1 for ranks in groups)
