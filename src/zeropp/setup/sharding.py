"""``zeropp.shard`` and ``zeropp.enable``: plan, check, install ([Note: plan, check, install] in
``zeropp.setup.plan``).

Parallelism is a function applied to a model: ``shard`` chooses the units, plans and checks what
zeropp will do, ``fully_shard``s each unit and then the root on the world mesh, and installs the
plan; ``enable`` does the same on a model sharded already (by the user, accelerate, torchtitan,
Lightning). ``sharded_comms(model)`` returns what was installed, ``zeropp.explain(model)`` prints it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from zeropp.config import ZeroPPConfig
from zeropp.fsdp.access import mark_prepared_for_accelerate
from zeropp.fsdp.scalars import replicate_scalars, scalar_parameters
from zeropp.setup.checks import check, config_view, parameters_view, require_process_group, units_view
from zeropp.setup.install import ShardedComms, install, process_groups, sharded_comms
from zeropp.setup.plan import UnitSpec, plan_bare, plan_sharded
from zeropp.setup.topology import Topology, device_type_of

__all__ = ["ShardedComms", "UnitSpec", "default_units", "enable", "select_units", "shard", "sharded_comms"]


def shard(
    model: nn.Module,
    config: ZeroPPConfig | None = None,
    *,
    topology: Topology | None = None,
    units: UnitSpec | None = None,
) -> nn.Module:
    """Shard ``model`` ZeRO-3 style over every rank, in place, and return it: ``fully_shard`` the
    units and then the root on the world mesh, with the ZeRO++ comms the config asks for.

    Args:
        model: any module; its parameters must be on the device the process group uses. 0-dim
            parameters stay whole on every rank (``zeropp.fsdp.scalars``).
        config: which ZeRO++ techniques to use; ``None`` is plain ZeRO-3 (FSDP2).
        topology: nodes x ranks per node; default ``Topology.from_env()``.
        units: module classes or modules to shard as separate units (each gathers its weights
            just before use); default: the repeated blocks of the model, see ``default_units``.
    """
    require_process_group("zeropp.shard")
    config = config if config is not None else ZeroPPConfig()
    topology = topology if topology is not None else Topology.from_env()
    unit_modules = select_units(model, units)
    plan = plan_bare(model, config, topology, unit_modules)
    check(plan, config_view(config, topology), parameters_view(model))
    scalars = scalar_parameters(model)
    groups = process_groups(plan, device_type_of(model))
    mp_policy = MixedPrecisionPolicy(param_dtype=config.param_dtype, reduce_dtype=config.reduce_dtype)
    for module in [*unit_modules, model]:  # hpZ's node mesh is set by install ([Note: one node mesh])
        fully_shard(module, mesh=groups.mesh, reshard_after_forward=True, mp_policy=mp_policy,
                    offload_policy=offload_policy(config), ignored_params=set(scalars) or None)
    replicate_scalars(scalars, topology)
    return mark_for_accelerate(install(model, plan_sharded(model, config, topology), groups))


def offload_policy(config: ZeroPPConfig) -> OffloadPolicy:
    """FSDP2's offload policy for ``config.offload``: ``CPUOffloadPolicy`` (pinned host memory
    where CUDA is present and ``offload_pin_memory`` asks for it) or none."""
    if config.offload == "cpu":
        return CPUOffloadPolicy(pin_memory=config.offload_pin_memory and torch.cuda.is_available())
    return OffloadPolicy()


def enable(model: nn.Module, config: ZeroPPConfig | None = None, *, topology: Topology | None = None,
           pipeline_rank: int | None = None) -> nn.Module:
    """Add ZeRO++ to a model already sharded with ``fully_shard`` (by the user, accelerate's FSDP2
    plugin or torchtitan), in place, and return it: qwZ and qgZ comms on every unit, hpZ's node
    mesh and never-stale hooks. Calling it again replaces the comms (a re-initialised engine).

    With ``hpz_partition_size > 1`` every unit that reshards after forward (``fully_shard``'s
    ``reshard_after_forward=True``, or the same int) reshards to hpZ's node partition instead,
    one mesh for the whole model ([Note: one node mesh]); a unit kept whole after forward
    (``reshard_after_forward=False``) stays whole. qgZ runs over each unit's shard group: the
    world, or on a 2-D mesh (tensor parallel x FSDP, HSDP) its data-parallel sub-mesh, placed on
    nodes ([Note: shard groups on nodes]).

    ``pipeline_rank``: this rank's index on the pipeline mesh, when ``model`` is one pipeline
    stage's part (``torch.distributed.pipelining``; torchtitan's ``with_zeropp`` passes it):
    ranks then compare their units only with the ranks of the same pipeline rank ([Note: pipeline
    stages]), and hpZ is refused ([Note: hpZ under pipeline parallelism]). Every rank must enable
    its stages' parts in the same order.
    """
    require_process_group("zeropp.enable")
    if not isinstance(model, FSDPModule):
        raise ValueError(f"zeropp.enable needs the root module sharded with fully_shard; "
                         f"{type(model).__name__} is not an FSDPModule (use zeropp.shard for a bare model)")
    config = config if config is not None else ZeroPPConfig()
    topology = topology if topology is not None else Topology.from_env()
    plan = check(plan_sharded(model, config, topology, pipeline_rank), config_view(config, topology),
                 units_view(model))
    return mark_for_accelerate(install(model, plan, process_groups(plan, device_type_of(model))))


def mark_for_accelerate(model: nn.Module) -> nn.Module:
    """Mark ``model`` for accelerate's ``prepare`` ([Note: accelerate on a zeropp model]): it hands
    the model back as it is (no DDP over DTensors), and where accelerate is installed the mark
    also attaches the accelerator that prepares it ([Note: attached on prepare]). Returns it."""
    try:
        from zeropp.integrations.accelerate import mark_prepared
    except ImportError:
        mark_prepared_for_accelerate(model)
    else:
        mark_prepared(model)
    return model


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
