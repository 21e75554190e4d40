"""The set-up as one plan: what zeropp will do to every unit of a model, computed before anything
is built, checked on it, agreed across ranks, then installed (``zeropp.setup.install``).

[Note: plan, check, install]
``zeropp.shard`` and ``zeropp.enable`` go one way through three steps:

1. **plan** (this module): from the model, the config and the topology, with no collective and
   no process group, an immutable ``Plan``: per unit its parameters, its shard group and where
   that group sits on the nodes, its replicas, and what each direction gets (the weight gather:
   FSDP2's or qwZ's, with which parameters quantized; hpZ's secondary copy and how it is kept;
   the gradient reduction: FSDP2's or qgZ's, with which parameters spared; the replicas'
   reduction), and every refusal, each with its reason. A bare model's plan (``zeropp.shard``)
   predicts the units ``fully_shard`` will make on the world mesh; a sharded model's
   (``zeropp.enable``) reads them from FSDP2.
2. **check**: one exchange among the ranks (``zeropp.setup.checks``) compares their plans and
   hands each rank every other rank's shard groups (a 2-D mesh's ranks see their own group
   only); then the first refusal, if any, is raised, on every rank alike, before any group is
   built.
3. **install** (``zeropp.setup.install``): the process groups the plan needs, each built once,
   and each unit's comms and hooks, in one pass.

``zeropp.explain`` prints the same plan: the collectives each unit issues in a training step,
with their bytes (``zeropp.setup.explain``).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch.distributed as dist
from torch import nn

from zeropp.config import ZeroPPConfig
from zeropp.fsdp.access import (
    UnitLayout,
    comm_groups,
    gathers_itself,
    offloads_to_cpu,
    replicate_group,
    root_kept_whole_after_forward,
    self_gathered_dtype,
    shard_group_ranks,
    unit_layout,
    unit_parameters,
)
from zeropp.setup.topology import Topology, place_on_nodes
from zeropp.techniques.hpz import check_hpz
from zeropp.techniques.qgz import full_precision_gradients
from zeropp.techniques.qwz import quantized_parameters

UnitSpec = Sequence[type[nn.Module] | nn.Module]
"""What ``zeropp.shard`` takes as ``units``: module classes or modules to shard as units."""


@dataclass(frozen=True)
class UnitPlan:
    """What zeropp does to one unit (a module given to ``fully_shard``)."""

    name: str
    """The unit's path in the model, "the root" for the model itself; a unit whose parameters
    FSDP2 keeps in several groups (each on its own mesh: ``zeropp.fsdp.access.CommGroup``) has a
    plan per group, the second named "<path> #1" and so on."""
    kind: str
    """The unit's class name."""
    layout: UnitLayout
    """Its parameters as FSDP2 lays them out (names as the model spells them)."""
    shard_ranks: tuple[int, ...]
    """This rank's shard group: the global ranks the unit is sharded over, in group order."""
    replica_ranks: tuple[int, ...] | None
    """HSDP: the ranks holding this rank's shard in the other replicas (this rank included)."""
    quantized: tuple[bool, ...]
    """Per parameter: qwZ codes it in the weight gather."""
    spared: tuple[bool, ...]
    """Per trainable parameter: qgZ sends its gradient unquantized."""
    secondary: str
    """hpZ's secondary copy: "none"; "fsdp" (FSDP2's own, over hpZ's node mesh or the unit's own
    ``reshard_after_forward`` group); "codes" (the same, kept as qwZ's codes); "node copy" (a
    2-D mesh: kept by zeropp); "deltas" (zeropp's node copy kept from step to step and refreshed
    by weight differences, which serves every gather: ``zeropp.techniques.deltas``)."""
    partition: int
    """Ranks the unit stays sharded over between forward and backward (hpZ's partition; the
    shard group's size where it keeps no secondary copy)."""
    gradients: str
    """The reduction inside the shard group: "fsdp" or "qgZ" (for units that train something)."""
    replicas: str
    """The reduction across HSDP's replicas: "none", "fsdp" (FSDP2's all-reduce) or "quantized"."""
    shard_layout: tuple[tuple[int, ...], ...] | None = None
    """Every shard group of the unit's mesh, each its global ranks (filled by the ranks' exchange);
    None for a unit sharded over the world."""
    wide: tuple[bool, ...] = ()
    """Per trainable parameter: qgZ codes its gradient at 8 bits on both hops
    (``grad_wide_parameters``); empty: none."""

    @property
    def gathers(self) -> str:
        """The weight gather: "deltas" from the node copy, "qwZ" when any parameter is quantized,
        else "fsdp"."""
        if self.secondary == "deltas":
            return "deltas"
        return "qwZ" if any(self.quantized) else "fsdp"


@dataclass(frozen=True)
class Plan:
    """What ``zeropp.shard`` / ``zeropp.enable`` will do, unit by unit ([Note: plan, check, install])."""

    config: ZeroPPConfig
    topology: Topology
    units: tuple[UnitPlan, ...]
    """In ``model.modules()`` order (the root first), as FSDP2's units are."""
    scalar_bytes: tuple[int, ...] = ()
    """Each trainable 0-dim parameter's bytes (kept whole, its gradient all-reduced: ``zeropp.fsdp.scalars``)."""
    refusals: tuple[str, ...] = ()
    """Why the set-up cannot go ahead, each naming the key or unit, the value and what would work."""
    warnings: tuple[str, ...] = ()
    """What the set-up will log (a technique that changes nothing on this layout)."""
    pipeline_rank: int | None = None
    """This rank's index on the pipeline mesh when the model is a pipeline stage's part (None
    without pipeline parallelism): [Note: pipeline stages] in ``zeropp.setup.checks``."""

    @property
    def hpz_mesh(self) -> bool:
        """Whether hpZ's node mesh is built ([Note: one node mesh] in ``zeropp.setup.topology``)."""
        return self.config.hpz_partition_size not in (1, self.topology.world_size)

    def check(self) -> None:
        """Raise the first refusal, if any."""
        if self.refusals:
            raise ValueError(self.refusals[0])

    def with_shard_layouts(self, layouts: Sequence[tuple[tuple[int, ...], ...] | None]) -> Plan:
        """This plan with every unit's shard groups, as the ranks' exchange found them."""
        units = tuple(dataclasses.replace(unit, shard_layout=layout) for unit, layout in zip(self.units, layouts))
        return dataclasses.replace(self, units=units)


def plan_sharded(model: nn.Module, config: ZeroPPConfig, topology: Topology, pipeline_rank: int | None = None
                 ) -> Plan:
    """The plan of ``zeropp.enable`` on a model FSDP2 has sharded: its units as FSDP2 holds them;
    ``pipeline_rank``: the model is a pipeline stage's part ([Note: pipeline stages])."""
    names = {id(module): name or "the root" for name, module in model.named_modules()}
    param_names = {id(p): name for name, p in model.named_parameters()}
    units = []
    for group in comm_groups(model):
        layout = unit_layout(group)
        layout = dataclasses.replace(layout, names=[param_names.get(id(p), "?") for p in unit_parameters(group)])
        if group.unit is model and root_kept_whole_after_forward(model):
            layout = dataclasses.replace(layout, post_forward_group_size=layout.shard_group_size,
                                         kept_whole_after_forward=True)
        replicas = replicate_group(group)
        name = names[id(group.unit)] + (f" #{group.index}" if group.index else "")
        units.append((name, type(group.unit).__name__, layout, shard_group_ranks(group) or (dist.get_rank(),),
                      None if replicas is None else tuple(dist.get_process_group_ranks(replicas))))
    refusals = _model_refusals(model, config, topology)
    if pipeline_rank is not None:
        refusals += _pipeline_refusals(config, bool(_scalar_bytes(model)))
    if config.offload == "cpu":
        module_names = {id(module): name or type(model).__name__ for name, module in model.named_modules()}
        missing = list(dict.fromkeys(module_names[id(group.unit)] for group in comm_groups(model)
                                     if unit_parameters(group) and not offloads_to_cpu(group)))
        if missing:
            refusals.append(f"{config.key_of('offload')}={config.offload!r}, but {', '.join(missing[:3])}"
                            f"{' and others' if len(missing) > 3 else ''} were sharded without CPU offload; "
                            "zeropp.enable cannot move shards fully_shard placed: pass "
                            "offload_policy=CPUOffloadPolicy() to fully_shard (or use zeropp.shard, which does)")
    return dataclasses.replace(_plan(config, topology, units, _scalar_bytes(model), refusals),
                               pipeline_rank=pipeline_rank)


def _pipeline_refusals(config: ZeroPPConfig, scalars: bool) -> list[str]:
    """What a pipeline stage's part refuses.

    [Note: hpZ under pipeline parallelism]
    torchtitan shards each stage's units with ``reshard_after_forward=False`` under pipeline
    parallelism (its "default" policy): a unit gathered for a microbatch's forward stays whole
    until the schedule's last backward, so the microbatches gather each unit once in forward and
    never in backward, and backward's cross-node gather, the one hpZ moves inside the node, does
    not exist. Keeping the unit whole costs its unsharded weights for the stage's lifetime and
    saves every regather; hpZ's node copy would cost the same memory and still regather per
    microbatch inside the node. So where memory allows the whole unit wins, and zeropp keeps it.
    With ``reshard_after_forward=True`` ("always") each microbatch regathers in backward and hpZ
    would help, but the looped schedules unshard and reshard stages themselves, outside
    autograd, which hpZ's copy is not verified with; so hpZ is refused on a stage's part,
    naming qwZ and qgZ, which work on every stage (their bytes: ``zeropp.explain``)."""
    refusals = []
    if config.hpz_partition_size > 1:
        refusals.append(
            f"{config.key_of('hpz_partition_size')}={config.hpz_partition_size}, but the model is a pipeline stage's "
            "part: torchtitan keeps a stage's units whole from a microbatch's forward to the last backward, so "
            "backward gathers nothing for hpZ's copy to serve (and the looped schedules' own unshard and reshard "
            f"calls are not verified with it). Set {config.key_of('hpz_partition_size')}=1; qwZ and qgZ work on "
            "every stage")
    if config.audit_every:  # its totals are summed over the world, and each stage audits its own units
        refusals.append(f"{config.key_of('audit_every')}={config.audit_every}, but the model is a pipeline stage's "
                        "part: the audit sums its findings over the world, whose stages audit different units. "
                        f"Set {config.key_of('audit_every')}=0 under pipeline parallelism")
    if scalars:  # broadcast and reduced over the world (zeropp.fsdp.scalars), which other stages do not join
        refusals.append("the pipeline stage's part has trainable 0-dim parameters, which zeropp keeps whole and "
                        "reduces over the world, whose other stages hold other parameters: make them 1-element "
                        "tensors (shape [1]) so that FSDP2 shards them with their unit")
    return refusals


def plan_bare(model: nn.Module, config: ZeroPPConfig, topology: Topology, units: list[nn.Module]) -> Plan:
    """The plan of ``zeropp.shard``: the units ``fully_shard`` will make of ``units`` and then the
    root, on the world mesh, each owning the parameters no unit inside it claimed (children
    first, as FSDP2 claims them), 0-dim parameters left whole."""
    world = topology.world_size
    names = {id(module): name or "the root" for name, module in model.named_modules()}
    param_names = {id(p): name for name, p in model.named_parameters()}
    claimed: set[int] = set()
    planned = {}
    for unit in [*units, model]:
        params = [p for p in unit.parameters() if id(p) not in claimed and p.dim() > 0]
        claimed.update(id(p) for p in params)
        layout = UnitLayout(
            names=[param_names[id(p)] for p in params], shapes=[p.shape for p in params],
            padded_numels=[-(-p.shape[0] // world) * world * math.prod(p.shape[1:]) for p in params],
            trainable=[p.requires_grad for p in params],
            gather_dtypes=[self_gathered_dtype(p, config.param_dtype or p.dtype) for p in params],
            shard_group_size=world if params else 1, post_forward_group_size=world if params else 1,
            reduce_dtype=config.reduce_dtype or config.param_dtype or params[0].dtype if params else None,
            self_gathered=tuple(map(gathers_itself, params)) if any(map(gathers_itself, params)) else ())
        planned[id(unit)] = (names[id(unit)], type(unit).__name__, layout, tuple(range(world)), None)
    in_order = [planned[id(module)] for module in model.modules() if id(module) in planned]  # the root first
    return _plan(config, topology, in_order, _scalar_bytes(model), _model_refusals(model, config, topology))


def _scalar_bytes(model: nn.Module) -> list[int]:
    """Each trainable 0-dim parameter's bytes (kept whole outside FSDP2: ``zeropp.fsdp.scalars``)."""
    return [p.numel() * p.element_size() for p in model.parameters() if p.dim() == 0 and p.requires_grad]


def _model_refusals(model: nn.Module, config: ZeroPPConfig, topology: Topology) -> list[str]:
    """The checks that need the model and the topology but no unit: hpZ's size, the name patterns."""
    refusals = _refused(check_hpz, config.hpz_partition_size, topology, config.key_of("hpz_partition_size"))
    names = [name for name, _ in model.named_parameters()]
    for key in ("unquantized_parameters", "grad_full_precision_parameters", "grad_wide_parameters"):
        for pattern in getattr(config, key):
            if not any(fnmatch.fnmatchcase(name, pattern) for name in names):
                refusals.append(f"{config.key_of(key)} pattern {pattern!r} matches no parameter of "
                                f"{type(model).__name__}; its parameters are named like {names[:3]}")
    return refusals


def _refused(check: Callable[..., None], *args: object) -> list[str]:
    """The message of a check that raises ``ValueError``, as a list (empty when it passes)."""
    try:
        check(*args)
    except ValueError as error:
        return [str(error)]
    return []


def _plan(config: ZeroPPConfig, topology: Topology, planned: list, scalar_bytes: list[int],
          refusals: list[str]) -> Plan:
    """Each unit's techniques and refusals, from its layout and groups."""
    hpz_mesh = config.hpz_partition_size not in (1, topology.world_size)
    units, warnings, self_gathered = [], [], []
    for name, kind, layout, shard_ranks, replica_ranks in planned:
        refusals += _unit_refusals(f"unit {name!r} ({kind})", layout, shard_ranks, replica_ranks, config, topology)
        if any(layout.self_gathered):  # [Note: weights that gather themselves]
            quantized = [False] * len(layout.names)
            self_gathered.append(name)
        else:
            quantized = quantized_parameters(layout, config.quantized_weights, config.quantized_nontrainable_weights,
                                             config.unquantized_parameters)
        trainable = [i for i, t in enumerate(layout.trainable) if t]
        spared = full_precision_gradients([layout.names[i] for i in trainable], [layout.shapes[i] for i in trainable],
                                          config.grad_full_precision_parameters, config.grad_full_precision_below)
        on_world = layout.shard_group_size == topology.world_size
        on_hpz_mesh = hpz_mesh and on_world and not layout.kept_whole_after_forward and not any(layout.self_gathered)
        partition = config.hpz_partition_size if on_hpz_mesh else layout.post_forward_group_size
        smaller_after_forward = partition < layout.shard_group_size
        if not layout.padded_numels:
            secondary = "none"
        elif config.weight_deltas and len({topology.node_of(rank) for rank in shard_ranks}) > 1:
            secondary = "deltas"
        elif not on_world and config.hpz_partition_size > 1:
            secondary = "node copy"
        elif any(layout.self_gathered) and hpz_mesh and on_world and not layout.kept_whole_after_forward:
            secondary = "node copy"  # [Note: weights that gather themselves]: zeropp's copy, over the node
        elif smaller_after_forward:
            secondary = "codes" if any(quantized) else "fsdp"
        else:
            secondary = "none"
        replicas = "none" if replica_ranks is None else ("quantized" if config.quantized_replica_gradients
                                                         else "fsdp")
        gradients = "qgZ" if config.quantized_gradients else "fsdp"
        wide = tuple(any(fnmatch.fnmatchcase(layout.names[i], pattern) for pattern in config.grad_wide_parameters)
                     for i in trainable) if config.grad_wide_parameters else ()
        units.append(UnitPlan(name, kind, layout, tuple(shard_ranks), replica_ranks, tuple(quantized), tuple(spared),
                              secondary, partition, gradients, replicas, wide=wide))
    if self_gathered and (config.quantized_weights or config.quantized_nontrainable_weights or hpz_mesh):
        warnings.append(
            f"zeropp: {len(self_gathered)} unit(s) ({', '.join(self_gathered[:3])}"
            f"{', ...' if len(self_gathered) > 3 else ''}) "
            "hold weights that gather themselves through FSDP2's extension (torchao's float8 all-gather, 1 byte per "
            "weight): qwZ leaves their gathers to it; hpZ keeps their forward's float8 bytes as zeropp's own copy "
            "over each node's ranks (FSDP2 cannot reshard them to a node partition); qgZ reduces their gradients")
    with_params = [unit for unit in units if unit.layout.padded_numels]
    if config.quantized_weights and not config.quantize_intra_node_weights and with_params and all(
            len({topology.node_of(rank) for rank in unit.shard_ranks}) == 1 for unit in with_params):
        warnings.append(
            f"zeropp: {config.key_of('quantized_weights')}=true, but every unit gathers its weights inside a node "
            f"(HSDP's shard group): qwZ sends full precision there and changes nothing; set "
            f"{config.key_of('quantize_intra_node_weights')}=true to quantize these gathers too")
    return Plan(config, topology, tuple(units), tuple(scalar_bytes), tuple(refusals), tuple(warnings))


def _unit_refusals(name: str, layout: UnitLayout, ranks: Sequence[int], replicas: Sequence[int] | None,
                   config: ZeroPPConfig, topology: Topology) -> list[str]:
    """A unit's sharding against the techniques asked for; each message names the unit (``name``:
    its path in the model and class) and says how to shard it instead."""
    if not layout.padded_numels:
        return []
    refusals = []
    on_world = layout.shard_group_size == topology.world_size
    if config.quantized_gradients and not on_world:
        try:
            place_on_nodes(topology, ranks)
        except ValueError as error:
            refusals.append(f"{config.key_of('quantized_gradients')}: {name} reduce-scatters over {error}; or "
                            f"turn {config.key_of('quantized_gradients')} off")
    if config.quantized_replica_gradients and replicas is None:
        refusals.append(
            f"{config.key_of('quantized_replica_gradients')}=true quantizes the gradients' all-reduce across HSDP's "
            f"replicas, but {name} has no replicas (sharded on a 1-D mesh or a tensor parallel x FSDP one): shard "
            "it with fully_shard(module, mesh=<(replicate, shard) mesh>) or leave the option off")
    hpz, hpz_key = config.hpz_partition_size, config.key_of("hpz_partition_size")
    if config.weight_deltas:
        refusals += _deltas_refusals(name, layout, replicas, config, topology)
    if hpz > 1 and not on_world:
        refusals += _hpz_on_2d_mesh(config, topology, name, ranks, layout.shard_group_size)
    if hpz > 1 and layout.post_forward_group_size not in (hpz, layout.shard_group_size):
        refusals.append(
            f"{hpz_key}={hpz}, but {name} was sharded with reshard_after_forward="
            f"{layout.post_forward_group_size} (its weights stay sharded over that many ranks after forward): "
            f"shard it with reshard_after_forward=True (zeropp.enable then sets hpZ's partition) or {hpz}, "
            f"or set {hpz_key}={layout.post_forward_group_size}")
    return refusals


def _deltas_refusals(name: str, layout: UnitLayout, replicas: Sequence[int] | None, config: ZeroPPConfig,
                     topology: Topology) -> list[str]:
    """Where a unit cannot keep its node copy from step to step ([Note: weight differences] in
    ``zeropp.techniques.deltas``), each naming why and what works instead. (On a 2-D mesh hpZ's
    own refusal asks for its size to be the unit's ranks per node.)"""
    key, hpz_key = config.key_of("weight_deltas"), config.key_of("hpz_partition_size")
    if layout.shard_group_size == topology.world_size and config.hpz_partition_size != topology.ranks_per_node:
        return [f"{key}=true keeps the node copy over each whole node, but {hpz_key}={config.hpz_partition_size} "
                f"splits the {topology.ranks_per_node} ranks of a node: set {hpz_key}={topology.ranks_per_node}"]
    if replicas is not None:
        return [f"{key}=true refreshes a copy of the weights each node holds, but {name} is sharded HSDP style "
                "(replicated across nodes, sharded inside one): its gathers never cross nodes, so there is no "
                f"cross-node gather to replace. Leave {key} false (quantized_replica_gradients cuts HSDP's "
                "cross-node bytes)"]
    if any(layout.self_gathered):
        return [f"{key}=true codes weight differences in the gather dtype, but {name} holds weights that gather "
                "themselves (torchao's float8 all-gather: 1 byte a weight, its own scales): leave them to it "
                f"and set {key} false, or convert the model without float8 all-gather"]
    if len(set(layout.gather_dtypes)) > 1:
        return [f"{key}=true, but {name} gathers parameters of several dtypes "
                f"({', '.join(sorted({str(d) for d in layout.gather_dtypes}))}), which FSDP2 moves as raw bytes: "
                "set ZeroPPConfig param_dtype (one gather dtype), or leave it false"]
    if layout.post_forward_group_size not in (layout.shard_group_size,) and not layout.kept_whole_after_forward:
        return [f"{key}=true serves every gather of {name} from zeropp's node copy, but the unit was sharded with "
                f"reshard_after_forward={layout.post_forward_group_size}: shard it with reshard_after_forward=True"]
    return []


def _hpz_on_2d_mesh(config: ZeroPPConfig, topology: Topology, name: str, ranks: Sequence[int],
                    group_size: int) -> list[str]:
    """hpZ on a unit of a 2-D mesh keeps its copy over the unit's data-parallel ranks on each
    node ([Note: hpZ on a 2-D mesh]): hpZ's size must equal those ranks per node (at least two)."""
    hpz, hpz_key = config.hpz_partition_size, config.key_of("hpz_partition_size")
    per_node = len(ranks) // len({topology.node_of(rank) for rank in ranks})
    where = (f"{hpz_key}={hpz}, but {name} is sharded over {group_size} of {topology.world_size} ranks (a 2-D "
             f"mesh: tensor parallel x FSDP, or HSDP), {per_node} of them on each node")
    if per_node == 1:
        return [f"{where}: a node holds no partition of its data-parallel group to keep hpZ's copy in. "
                f"Set {hpz_key}=1 (qwZ and qgZ work on this layout)"]
    if per_node == group_size:
        return [f"{where}: its shard group is one node already (HSDP), so backward's gather never "
                f"crosses nodes and hpZ has nothing to save. Set {hpz_key}=1"]
    if hpz != per_node:
        return [f"{where}: hpZ's copy on a 2-D mesh spans the unit's data-parallel ranks of a node. "
                f"Set {hpz_key}={per_node}"]
    return []
