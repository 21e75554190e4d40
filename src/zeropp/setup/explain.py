"""``zeropp.explain``: what zeropp does to a model, unit by unit, before or after sharding.

Every collective a training step issues on this rank (forward and backward gathers, the gradient
reduction, the exchanges beside them), with its technique, code, error bound, group and bytes,
priced from the plan ([Note: plan, check, install] in ``zeropp.setup.plan``) with the ledger's
arithmetic (``zeropp.fsdp.ledger.direct_sends``) and the comms' own codecs: one step's bytes are
the ledger's for that step (``tests/test_explain.py``). The refusals of a plan that cannot be
installed are listed with their reasons.

A step here is one forward, one backward and the reduction of every unit that trains something,
as a loop without gradient accumulation runs it; with ``weight_deltas``, a step after the first,
whose forward sends each trainable unit's differences (the first, and a full refresh, send the
weights whole instead, once). Not counted: the loop's own collectives (a loss
averaged for logging), the audit's (every ``audit_every`` steps), and the all-reduce FSDP2 runs
itself across HSDP's replicas (outside zeropp's comms; shown, marked "FSDP2's own").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch import nn

from zeropp.codes.codec import payload_bytes, segments_for
from zeropp.config import ZeroPPConfig
from zeropp.fsdp.ledger import GroupInfo, Op, direct_sends
from zeropp.setup.install import gather_chunk_dtype, sharded_comms
from zeropp.setup.plan import Plan, UnitPlan, UnitSpec, plan_bare, plan_sharded
from zeropp.setup.topology import ShardGroups, Topology, place_on_nodes
from zeropp.techniques.deltas import delta_codec
from zeropp.techniques.qgz import HierarchicalQuantizedReduceScatter
from zeropp.techniques.qwz import QuantizedAllGather, has_two_hops


@dataclass(frozen=True)
class Collective:
    """One collective of one unit in a training step, on this rank."""

    unit: str
    direction: str
    """"forward gather", "backward gather", "gradients", "replicas", "presence" or "scalars"."""
    technique: str
    """The ledger's technique label ("qwZ", "hpZ", "qgZ", "fsdp", ...)."""
    op: Op
    group: tuple[int, ...]
    """The group's global ranks (this rank's)."""
    code: str
    """How the payload is coded ("fp32", "int8 blocks of 256", ...)."""
    bound: str
    """The error the code allows."""
    bytes_per_peer: int
    calls: int = 1
    in_ledger: bool = True
    """False for FSDP2's own all-reduce across HSDP's replicas."""
    bytes: int = 0
    cross_node_bytes: int = 0


@dataclass
class Explanation:
    """What zeropp does to a model: prints as a table. ``cross_node_bytes`` and ``bytes``: this
    rank's bytes for one training step (direct sends, as the ledger counts them)."""

    plan: Plan
    rank: int
    collectives: list[Collective] = field(default_factory=list)

    @property
    def cross_node_bytes(self) -> int:
        return sum(c.cross_node_bytes for c in self.collectives)

    @property
    def bytes(self) -> int:
        return sum(c.bytes for c in self.collectives)

    def by_technique(self) -> dict[str, dict[str, int]]:
        """Bytes and cross-node bytes per ledger technique (the rows the ledger holds)."""
        totals: dict[str, dict[str, int]] = {}
        for c in self.collectives:
            if c.in_ledger:
                entry = totals.setdefault(c.technique, {"calls": 0, "bytes": 0, "cross_node_bytes": 0})
                entry["calls"] += c.calls
                entry["bytes"] += c.bytes
                entry["cross_node_bytes"] += c.cross_node_bytes
        return totals

    def table(self) -> str:
        plan, topology = self.plan, self.plan.topology
        lines = [f"zeropp plan on rank {self.rank} of {topology.num_nodes} nodes x {topology.ranks_per_node} ranks; "
                 f"{_techniques(plan.config)}", "",
                 "| unit | parameters | shard group | replicas | hpZ copy | collective | technique | code | bound "
                 "| group | MB per step | cross-node MB |", "|" + "---|" * 12]
        for unit in plan.units:
            rows = [c for c in self.collectives if c.unit == unit.name]
            head = [unit.name, f"{_count(unit)} in {len(unit.layout.shapes)}", _group_text(unit.shard_ranks, topology),
                    "—" if unit.replica_ranks is None else _group_text(unit.replica_ranks, topology), unit.secondary]
            if not rows:
                lines.append("| " + " | ".join(head + ["—"] * 7) + " |")
            for i, c in enumerate(rows):
                cells = head if i == 0 else [""] * len(head)
                lines.append("| " + " | ".join(cells + [
                    c.direction + ("" if c.in_ledger else " (FSDP2's own)"), c.technique, c.code, c.bound,
                    _group_text(c.group, topology), f"{c.bytes / 1e6:.3f}", f"{c.cross_node_bytes / 1e6:.3f}"]) + " |")
        for c in self.collectives:
            if c.unit == "":
                lines.append(f"| (the model) | | | | | {c.direction} | {c.technique} | {c.code} | {c.bound} | "
                             f"{_group_text(c.group, topology)} | {c.bytes / 1e6:.3f} | "
                             f"{c.cross_node_bytes / 1e6:.3f} |")
        lines += ["", f"this rank, one training step: {self.bytes / 1e6:.3f} MB sent, "
                      f"{self.cross_node_bytes / 1e6:.3f} MB of it across nodes"]
        if plan.refusals:
            lines += ["", "refused:", *(f"- {refusal}" for refusal in plan.refusals)]
        lines += [f"note: {warning}" for warning in plan.warnings]
        return "\n".join(lines)

    __str__ = table


def explain(model_or_plan: nn.Module | Plan, config: ZeroPPConfig | None = None, *,
            topology: Topology | None = None, units: UnitSpec | None = None) -> Explanation:
    """What zeropp does (a sharded model: what it did) to each unit, as a table (``print`` it) with
    each collective's technique, code, bound, group and bytes per training step, and the
    refusals: of a ``Plan``, of a model ``zeropp.shard`` or ``enable`` set up, of a model sharded
    with ``fully_shard`` (``config``: what ``enable`` would add), or of a bare model (what
    ``zeropp.shard(model, config, units=units)`` would do)."""
    from torch.distributed.fsdp import FSDPModule

    from zeropp.setup.sharding import select_units

    if isinstance(model_or_plan, Plan):
        plan = model_or_plan
    elif config is None and (installed := sharded_comms(model_or_plan).plan) is not None:
        plan = installed
    else:
        config = config if config is not None else ZeroPPConfig()
        topology = topology if topology is not None else Topology.from_env()
        if isinstance(model_or_plan, FSDPModule):
            plan = plan_sharded(model_or_plan, config, topology)
        else:
            plan = plan_bare(model_or_plan, config, topology, select_units(model_or_plan, units))
    rank = dist.get_rank() if dist.is_initialized() else 0
    explanation = Explanation(plan, rank)
    for unit in plan.units:
        explanation.collectives += _unit_collectives(plan, unit, rank)
    world = tuple(range(plan.topology.world_size))
    explanation.collectives += [_priced(plan.topology, rank, Collective(
        "", "scalars", "scalars", Op.ALL_REDUCE, world, "fp32", "exact", size)) for size in plan.scalar_bytes]
    if deltas := sum(unit.secondary == "deltas" for unit in plan.units):
        explanation.collectives.append(_priced(plan.topology, rank, Collective(
            "", "decision", "deltas", Op.ALL_REDUCE, world, "one byte per unit", "exact", deltas)))
    return explanation


def _unit_collectives(plan: Plan, unit: UnitPlan, rank: int) -> list[Collective]:
    layout, topology = unit.layout, plan.topology
    if not layout.padded_numels:
        return []
    found = [*_gathers(plan, unit, rank)]
    if any(layout.trainable):
        found += _reduction(plan, unit, rank)
        # over the ranks the gradients are reduced over ([Note: gradients some ranks lack]); not on a
        # pipeline stage, whose schedule reduces outside autograd, where the exchange does not run
        groups = () if plan.pipeline_rank is not None else (unit.shard_ranks, unit.replica_ranks)
        found += [Collective(unit.name, "presence", "presence", Op.ALL_REDUCE, ranks, "one byte per parameter",
                             "exact", len(layout.names)) for ranks in groups if ranks is not None]
    return [_priced(topology, rank, c) for c in found]


def _gathers(plan: Plan, unit: UnitPlan, rank: int) -> list[Collective]:
    """The forward gather, and the backward gather of a unit that reshards after forward."""
    layout, config, topology = unit.layout, plan.config, plan.topology
    size = layout.shard_group_size
    dtype = gather_chunk_dtype(unit)
    plain = _chunk_bytes(layout.padded_numels, layout.gather_dtypes, size)
    same_node = len({topology.node_of(r) for r in unit.shard_ranks}) == 1
    forward: list[Collective]
    codec = None
    if unit.gathers == "qwZ":
        comm = QuantizedAllGather(topology, layout.padded_numels, list(unit.quantized), bits=config.weight_bits,
                                  block_size=config.block_size, asymmetric=config.weight_code == "asymmetric",
                                  dtypes=layout.gather_dtypes)
        codec = comm.codec(size, dtype)
    code, bound = _weight_code(config) if codec is not None else (_dtype_name(dtype), "exact")
    if codec is not None and same_node and not config.quantize_intra_node_weights:
        forward = [Collective(unit.name, "forward gather", "hpZ", Op.ALL_GATHER, unit.shard_ranks,
                              _dtype_name(dtype), "exact", plain)]
    elif codec is not None and config.hierarchical_gather and size == topology.world_size and has_two_hops(topology):
        across = tuple(topology.peer_ranks(topology.local_rank_of(rank)))
        inside = tuple(topology.node_ranks(topology.node_of(rank)))
        forward = [Collective(unit.name, "forward gather", "qwZ", Op.ALL_GATHER, across, code, bound, codec.nbytes),
                   Collective(unit.name, "forward gather", "qwZ", Op.ALL_GATHER, inside, code, bound,
                              topology.num_nodes * codec.nbytes)]
    else:
        forward = [Collective(unit.name, "forward gather", "qwZ" if codec is not None else "fsdp", Op.ALL_GATHER,
                              unit.shard_ranks, code, bound, codec.nbytes if codec is not None else plain)]
    if unit.secondary == "deltas":
        return _from_node_copy(plan, unit, rank, dtype, plain)
    if layout.kept_whole_after_forward:
        return forward
    if unit.secondary in ("codes", "fsdp"):
        partition = unit.partition
        start = rank // partition * partition
        group = tuple(range(start, start + partition))
        rows = size // partition
        if unit.secondary == "codes":
            backward = Collective(unit.name, "backward gather", "hpZ", Op.ALL_GATHER, group, code,
                                  "the forward's codes, bit for bit", rows * codec.nbytes)
        else:
            backward = Collective(unit.name, "backward gather", "fsdp", Op.ALL_GATHER, group, _dtype_name(dtype),
                                  "exact", _chunk_bytes(layout.padded_numels, layout.gather_dtypes, partition))
        return [*forward, backward]
    if unit.secondary == "node copy":
        group = tuple(r for r in unit.shard_ranks if topology.node_of(r) == topology.node_of(rank))
        rows = size // len(group)
        per_row = codec.nbytes if codec is not None else plain
        return [*forward, Collective(unit.name, "backward gather", "hpZ", Op.ALL_GATHER, group,
                                     code if codec is not None else _dtype_name(dtype),
                                     "the forward's weights, bit for bit", rows * per_row)]
    return [*forward, *(Collective(c.unit, "backward gather", c.technique, c.op, c.group, c.code, c.bound,
                                   c.bytes_per_peer) for c in forward)]


def _from_node_copy(plan: Plan, unit: UnitPlan, rank: int, dtype: torch.dtype, chunk_bytes: int
                    ) -> list[Collective]:
    """A unit's gathers from its node copy ([Note: weight differences] in ``zeropp.techniques.deltas``),
    after a step: a unit that trains sends its chunk's coded differences to the ranks of its
    index on the other nodes, then each gather (forward, and backward unless the unit stays
    whole) takes the node's rows inside the node. The first step and a full refresh send the
    chunk whole across nodes instead (not priced here: a step after it)."""
    layout, config, topology = unit.layout, plan.config, plan.topology
    placement = place_on_nodes(topology, unit.shard_ranks)
    node, index = divmod(unit.shard_ranks.index(rank), placement.ranks_per_node)
    inside = unit.shard_ranks[node * placement.ranks_per_node:(node + 1) * placement.ranks_per_node]
    across = unit.shard_ranks[index::placement.ranks_per_node]
    found = []
    if any(layout.trainable):
        codec = delta_codec(layout.padded_numels, [d.is_floating_point for d in layout.gather_dtypes],
                            layout.shard_group_size, config.delta_bits, config.deltas_block_size)
        found.append(Collective(unit.name, "forward gather", "deltas", Op.ALL_GATHER, across,
                                f"int{config.delta_bits} differences, blocks of {config.deltas_block_size}",
                                "half a step of the difference per element", codec.nbytes))
    if placement.ranks_per_node > 1:
        code, row = _dtype_name(dtype), chunk_bytes
        if config.delta_reference == "codes":
            floating = [d.is_floating_point for d in layout.gather_dtypes]
            row = payload_bytes(segments_for(layout.padded_numels, floating, layout.shard_group_size, 8),
                                config.block_size, dtype)
            code = f"int8 codes of the copy, blocks of {config.block_size}"
        rows = placement.num_nodes * row
        found.append(Collective(unit.name, "forward gather", "hpZ", Op.ALL_GATHER, inside, code, "the node copy",
                                rows))
        if not layout.kept_whole_after_forward:
            found.append(Collective(unit.name, "backward gather", "hpZ", Op.ALL_GATHER, inside, code,
                                    "the forward's weights, bit for bit", rows))
    return found


def _reduction(plan: Plan, unit: UnitPlan, rank: int) -> list[Collective]:
    """The gradient reduction inside the shard group, and across HSDP's replicas."""
    layout, config = unit.layout, plan.config
    size = layout.shard_group_size
    trainable = [n for n, t in zip(layout.padded_numels, layout.trainable) if t]
    found = []
    if unit.gradients == "qgZ":
        found += _qgz(plan, unit, trainable, rank)
    else:
        found.append(Collective(unit.name, "gradients", "fsdp", Op.REDUCE_SCATTER, unit.shard_ranks,
                                _dtype_name(layout.reduce_dtype), "exact",
                                sum(trainable) // size * layout.reduce_dtype.itemsize))
    if unit.replicas == "fsdp":
        found.append(Collective(unit.name, "replicas", "fsdp", Op.ALL_REDUCE, unit.replica_ranks,
                                _dtype_name(layout.reduce_dtype), "exact",
                                sum(trainable) // size * layout.reduce_dtype.itemsize, in_ledger=False))
    elif unit.replicas == "quantized":
        replicas = len(unit.replica_ranks)
        parts = [-(-(numel // size) // replicas) for numel in trainable]
        comm = HierarchicalQuantizedReduceScatter(
            None, [part * replicas for part in parts], bits_intra=config.grad_bits_inter,
            bits_inter=config.grad_bits_inter, block_size=config.gradient_block_size,
            full_precision=list(unit.spared),
            shard=ShardGroups(Topology(num_nodes=replicas, ranks_per_node=1), unit.replica_ranks, None, None))
        row = comm.codec(sum(parts), config.grad_bits_inter)
        code = f"int{config.grad_bits_inter} blocks of {config.gradient_block_size}"
        found += [Collective(unit.name, "replicas", "replicas", Op.ALL_TO_ALL, unit.replica_ranks, code,
                             "half a step per element, each row", row.nbytes),
                  Collective(unit.name, "replicas", "replicas", Op.ALL_GATHER, unit.replica_ranks, code,
                             "half a step per element", row.nbytes)]
    return found


def _qgz(plan: Plan, unit: UnitPlan, trainable: Sequence[int], rank: int) -> list[Collective]:
    """qgZ's hops over the unit's shard group placed on nodes, slice by slice ([Note: qgZ slices])."""
    config, topology, layout = plan.config, plan.topology, unit.layout
    placement = place_on_nodes(topology, unit.shard_ranks)
    comm = HierarchicalQuantizedReduceScatter(
        None, list(trainable), bits_intra=config.grad_bits_intra, bits_inter=config.grad_bits_inter,
        block_size=config.gradient_block_size, code=config.gradient_code, full_precision=list(unit.spared),
        wide=list(unit.wide), slice_bytes=config.grad_slice_bytes,
        shard=ShardGroups(placement, unit.shard_ranks, None, None))
    chunk = sum(trainable) // layout.shard_group_size
    pieces = comm.slices(chunk)
    mine = unit.shard_ranks.index(rank)
    node, index = divmod(mine, placement.ranks_per_node)
    inside = unit.shard_ranks[node * placement.ranks_per_node:(node + 1) * placement.ranks_per_node]
    across = unit.shard_ranks[index::placement.ranks_per_node]
    code = _gradient_code(config)
    found = []
    if placement.ranks_per_node > 1:
        found.append(Collective(unit.name, "gradients", "qgZ", Op.ALL_TO_ALL, inside, code + " (hop 1)",
                                "half a step per element and hop", 0, len(pieces)))
    if placement.num_nodes > 1:
        found.append(Collective(unit.name, "gradients", "qgZ", Op.ALL_TO_ALL, across, code + " (hop 2)",
                                "half a step per element and hop", 0, len(pieces)))
    sizes = {"hop 1": sum(placement.num_nodes * piece.intra.nbytes for piece in pieces),
             "hop 2": sum(piece.inter.nbytes for piece in pieces)}
    return [_with_bytes(c, sizes["hop 1" if "hop 1" in c.code else "hop 2"]) for c in found]


def _with_bytes(collective: Collective, bytes_per_peer: int) -> Collective:
    return replace(collective, bytes_per_peer=bytes_per_peer)


def _priced(topology: Topology, rank: int, collective: Collective) -> Collective:
    """The collective with its bytes and cross-node bytes (``bytes_per_peer`` summed over its calls)."""
    info = GroupInfo.of(topology, list(collective.group), rank)
    sent, cross = direct_sends(collective.op, info, collective.bytes_per_peer)
    return replace(collective, bytes=sent, cross_node_bytes=cross)


def _chunk_bytes(padded_numels: Sequence[int], dtypes: Sequence[torch.dtype], group_size: int) -> int:
    """Bytes of one rank's chunk of a unit split over ``group_size`` ranks."""
    return sum(numel // group_size * dtype.itemsize for numel, dtype in zip(padded_numels, dtypes))


def _weight_code(config: ZeroPPConfig) -> tuple[str, str]:
    kind = "asymmetric" if config.weight_code == "asymmetric" else "symmetric"
    return (f"int{config.weight_bits} {kind}, blocks of {config.block_size}",
            "half a step per element (block absmax / qmax / 2)")


def _gradient_code(config: ZeroPPConfig) -> str:
    code = config.gradient_code
    options = [] if code.is_plain else [name for name, on in (
        ("Hadamard", code.rotation == "hadamard"), ("stochastic", code.rounding == "stochastic"),
        ("normal levels", code.levels == "normal"), ("8-bit scales", code.grouped_scales)) if on]
    extra = f" {', '.join(options)}" if options else ""
    return f"int{config.grad_bits_intra}/int{config.grad_bits_inter}{extra}, blocks of {config.gradient_block_size}"


def _techniques(config: ZeroPPConfig) -> str:
    on = [name for name, flag in (("qwZ", config.quantized_weights), ("frozen weights quantized",
                                                                      config.quantized_nontrainable_weights),
                                  (f"hpZ {config.hpz_partition_size}", config.hpz_partition_size > 1),
                                  (f"weight differences (int{config.delta_bits})", config.weight_deltas),
                                  ("qgZ", config.quantized_gradients),
                                  ("quantized replicas", config.quantized_replica_gradients)) if flag]
    return ", ".join(on) if on else "plain ZeRO-3 (FSDP2)"


def _group_text(ranks: Sequence[int], topology: Topology) -> str:
    nodes = sorted({topology.node_of(rank) for rank in ranks})
    shown = f"{ranks[0]}-{ranks[-1]}" if list(ranks) == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2 \
        else ",".join(map(str, ranks))
    return f"ranks {shown} on {len(nodes)} node{'s' if len(nodes) > 1 else ''}"


def _count(unit: UnitPlan) -> str:
    numel = sum(math.prod(shape) for shape in unit.layout.shapes)
    return f"{numel / 1e6:.2f}M" if numel >= 10_000 else str(numel)


def _dtype_name(dtype: torch.dtype | None) -> str:
    return str(dtype).removeprefix("torch.")
