"""The check step of the set-up ([Note: plan, check, install] in ``zeropp.setup.plan``): every
rank's plan compared with the others' in one exchange, the topology held against the process
group and the hosts, then the plan's refusals raised, on every rank alike, before any group is
built. See [Note: ranks that disagree].

[Note: ranks that disagree]
zeropp's collectives assume every rank built the same thing: the same ``ZeroPPConfig``, the same
topology, the same parameters in the same units. A config read from a per-host file, an
environment variable set on one node, or a model built with another width on one rank breaks
that, and the first collective that differs aborts inside the backend ("collective mismatch",
a SIGABRT under gloo; a hang or mixed data under NCCL), naming nothing a user can act on. So
``zeropp.shard``, ``zeropp.enable`` (and ``zeropp.initialize`` through them) first compare the
views: each rank sends its host name (the topology check needs it) and a digest of its view in
one small all-gather; only if the digests differ do the ranks exchange the views themselves and
every rank raises the same ``ValueError``, naming the first entry that differs, its value on each
side and the ranks holding each. A view is an ordered list of (entry, value) pairs.
The same exchange carries what each rank alone can see: the shard group of each unit on a 2-D
mesh (a rank sees its own group only), from which every rank learns every shard group.

[Note: pipeline stages]
Under pipeline parallelism (``zeropp.enable(part, pipeline_rank=...)``, which torchtitan's
``with_zeropp`` calls on each stage's model part) the ranks of different pipeline ranks hold
different layers, so only the config and the topology are compared over the world; the units and
the plan are compared among the ranks of the same pipeline rank, which hold the same stages (one
or, with a looped schedule, several, enabled in the same order on each). Each enable is still one
all-gather over the world, so every rank must enable as many model parts as the others: a
pipeline schedule gives each rank the same number of stages.

A unit's shard groups still span every stage: the groups zeropp builds for them (qgZ's hops on
nodes) are created with ``new_group``, which every rank of the world must call for every group,
in the same order, while each stage's units know only their own stage's groups. So a stage's
unit is given the same-sized groups the other stages' units use beside its own (torchtitan's
pipeline mesh is outermost, so each stage's data-parallel groups are the others' shifted by a
stage), and every rank asks for the same groups first.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import socket
from collections.abc import Sequence

import torch.distributed as dist
from torch import nn

from zeropp.config import ZeroPPConfig
from zeropp.fsdp.access import comm_groups, unit_layout
from zeropp.fsdp.comms import all_gather_strings
from zeropp.setup.plan import Plan
from zeropp.setup.topology import Topology, check_hosts, check_world_size

View = list[tuple[str, str]]
"""One rank's set-up as ordered (entry, value) pairs."""


def require_process_group(caller: str) -> None:
    if not dist.is_initialized():
        raise RuntimeError(f"{caller} needs torch.distributed initialised: call "
                           "dist.init_process_group (torchrun sets the environment for it) first")


def check(plan: Plan, view: View, stage_view: View = ()) -> Plan:
    """The plan agreed by every rank ([Note: ranks that disagree]) and checked: the topology fits
    the process group and the hosts, and nothing is refused. ``view`` must be the same on every
    rank; ``stage_view`` and the plan on every rank of the same pipeline rank (every rank without
    pipeline parallelism: [Note: pipeline stages]). Returns the plan with every unit's shard
    groups (collective over the world: one small all-gather)."""
    local = [list(unit.shard_ranks) if unit.layout.shard_group_size != plan.topology.world_size else None
             for unit in plan.units]
    scope = "" if plan.pipeline_rank is None else str(plan.pipeline_rank)
    agreed = agree(view, [*stage_view, *plan_view(plan)], scope, json.dumps(local))
    check_world_size(plan.topology)
    check_hosts(plan.topology, agreed.hosts)
    plan.check()
    every = [json.loads(entry) for entry, theirs in zip(agreed.locals, agreed.scopes) if theirs == scope]
    layouts = [None if mine is None else tuple(dict.fromkeys(tuple(ranks[i]) for ranks in every))
               for i, mine in enumerate(local)]
    if plan.pipeline_rank is not None:
        used = sorted({tuple(group) for entry in agreed.locals for group in json.loads(entry) if group is not None})
        layouts = [None if layout is None else _across_stages(layout, used) for layout in layouts]
    return plan.with_shard_layouts(layouts)


def _across_stages(layout: tuple[tuple[int, ...], ...], used: list[tuple[int, ...]]) -> tuple[tuple[int, ...], ...]:
    """A stage's shard groups with the other stages' groups of the same size that share no rank
    with them, in rank order ([Note: pipeline stages]): the same on every stage."""
    groups = list(layout)
    for group in used:
        if len(group) == len(layout[0]) and all(set(group).isdisjoint(mine) for mine in groups):
            groups.append(group)
    return tuple(sorted(groups))


def plan_view(plan: Plan) -> View:
    """What the plan does to each unit, as every rank must see it alike."""
    return [(f"plan of unit {unit.name}", f"gathers {unit.gathers}, secondary copy {unit.secondary}, gradients "
             f"{unit.gradients}, replicas {unit.replicas}, quantized {unit.quantized}, spared {unit.spared}")
            for unit in plan.units]


def config_view(config: ZeroPPConfig, topology: Topology) -> View:
    """The config field by field, and the topology."""
    fields = [(f"ZeroPPConfig.{f.name}", repr(getattr(config, f.name))) for f in dataclasses.fields(config)]
    return [*fields, ("topology", f"{topology.num_nodes} nodes x {topology.ranks_per_node} ranks per node")]


def parameters_view(model: nn.Module) -> View:
    """Each parameter of a model not sharded yet: shape, dtype, trainable."""
    return [(f"parameter {name}", f"shape {tuple(p.shape)}, {p.dtype}, requires_grad={p.requires_grad}")
            for name, p in model.named_parameters()]


def units_view(model: nn.Module) -> View:
    """Each unit of a sharded model and its parameters (unsharded shape, dtype, trainable)."""
    names = {id(module): name or "the root" for name, module in model.named_modules()}
    view = []
    for group in comm_groups(model):  # a unit's parameter groups: one, or one per mesh
        label = names[id(group.unit)] + (f" #{group.index}" if group.index else "")
        layout = unit_layout(group)
        view.append((f"unit {label}", f"{len(layout.names)} parameters, sharded over "
                     f"{layout.shard_group_size} ranks"))
        view.extend((f"unit {label} parameter {name}",
                     f"shape {tuple(shape)}, {dtype}, requires_grad={trainable}")
                    for name, shape, dtype, trainable in zip(layout.names, layout.shapes, layout.gather_dtypes,
                                                            layout.trainable))
    return view


@dataclasses.dataclass(frozen=True)
class Agreed:
    """What the ranks' exchange returns, each in rank order."""

    hosts: list[str]
    scopes: list[str]
    """Each rank's scope: ranks compare their stage views with those of the same scope."""
    locals: list[str]
    """What each rank alone holds (its units' shard groups)."""


def agree(view: View, stage_view: View = (), scope: str = "", local: str = "") -> Agreed:
    """Check that every rank holds the same ``view``, and every rank of the same ``scope`` (its
    pipeline rank, or "" for all) the same ``stage_view``: one all-gather of two digests, the
    host name, ``scope`` and ``local`` (what this rank alone holds). Raises the same
    ``ValueError`` on every rank otherwise, naming the first entry that differs."""
    texts = json.dumps(view), json.dumps(stage_view)
    world, stage = (hashlib.sha256(text.encode()).hexdigest() for text in texts)
    gathered = [entry.split("\n", 4)
                for entry in all_gather_strings(f"{world}\n{stage}\n{socket.gethostname()}\n{scope}\n{local}")]
    scopes = [theirs for _, _, _, theirs, _ in gathered]
    stages: dict[str, set[str]] = {}
    for _, digest, _, theirs, _ in gathered:
        stages.setdefault(theirs, set()).add(digest)
    differing = [theirs for theirs, digests in stages.items() if len(digests) > 1]
    if len({digest for digest, *_ in gathered}) > 1 or differing:  # every rank sees it: all take this branch
        views = [json.loads(other) for other in all_gather_strings(json.dumps([view, stage_view]))]
        if len({digest for digest, *_ in gathered}) > 1:
            raise ValueError(describe_disagreement([[tuple(pair) for pair in theirs[0]] for theirs in views]))
        ranks = [rank for rank, theirs in enumerate(scopes) if theirs == differing[0]]
        raise ValueError(describe_disagreement([[tuple(pair) for pair in views[rank][1]] for rank in ranks], ranks,
                                               f" of pipeline rank {differing[0]}" if differing[0] else ""))
    return Agreed([host for _, _, host, _, _ in gathered], scopes, [mine for *_, mine in gathered])


def describe_disagreement(views: Sequence[View], ranks: Sequence[int] | None = None, where: str = "") -> str:
    """The first entry on which the ranks' views differ, each value and the ranks holding it
    (``ranks``: the global rank of each view, default its index; ``where``: which ranks these are)."""
    as_dicts = [dict(view) for view in views]
    keys = list(dict.fromkeys(key for view in views for key, _ in view))
    for key in keys:
        holders: dict[str, list[int]] = {}
        for rank, entries in zip(ranks if ranks is not None else range(len(views)), as_dicts):
            holders.setdefault(entries.get(key, "(absent)"), []).append(rank)
        if len(holders) > 1:
            sides = "; ".join(f"{value} on {_ranks(holding)}" for value, holding in holders.items())
            same = "the same pipeline stages" if where else "the same model"
            return (f"zeropp: the ranks{where} disagree on {key}: {sides}. Every rank must shard {same} with "
                    "the same ZeroPPConfig and topology (check per-host config files and environment variables "
                    "such as ZEROPP_RANKS_PER_NODE and LOCAL_WORLD_SIZE)")
    return "zeropp: the ranks' views differ, but no entry does (a digest collision)"


def _ranks(ranks: list[int]) -> str:
    """``rank 3`` or ``ranks 0-2, 5``: runs of consecutive ranks written as ranges."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    text = ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)) for run in runs)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"
