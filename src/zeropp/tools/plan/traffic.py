"""What one training step sends, unit by unit, in each mode: the ledger's counts computed from
parameter shapes alone, with no process group, so ``zeropp plan`` predicts exactly the bytes a
run records (tests/test_plan.py compares them with real gloo runs).

[Note: the step's collectives]
Every FSDP2 unit (each repeated block, and the root holding what is left) is gathered before
its forward and again before its backward, and its gradients reduce-scattered after its
backward. FSDP2 pads every parameter's dim 0 to a multiple of the shard group's size, so a
rank's chunk of a unit is the sum of ``ceil(d0 / G) * rest`` over its parameters. Per mode:

- ZeRO-3: both gathers and the reduce-scatter run on the world.
- HSDP: the unit is sharded inside the node; gathers and reduce-scatter run on the node, and the
  reduced shard is all-reduced across nodes.
- qwZ: the gathers send each parameter's slice block-quantized (``zeropp.codes.codec``'s payload).
- hpZ: the backward gather runs inside the node from the secondary copy: in full precision, or
  with qwZ as the payload rows the copy is kept as (each rank's world rows of the forward gather,
  [Note: hpZ's copy as qwZ's codes] in ``zeropp.hpz``). A partition of the whole world (one node)
  keeps no copy (``zeropp.topology``'s [Note: one node mesh]): the step is the mode's without hpZ.
- qgZ: the reduce-scatter becomes two all-to-alls; a rank sends each node peer the N chunks it
  owes that peer's local index, then each remote node one chunk, never its own rows.
- Every zeropp mode: one byte per parameter of each trainable unit, all-reduced in backward
  (which ranks had a gradient, ``zeropp.unused``).

A 0-dim parameter is kept whole on every rank and its gradient all-reduced after each backward
(``zeropp.scalars``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from zeropp.codes.codec import payload_bytes, segments_for
from zeropp.config import ZeroPPConfig
from zeropp.ledger import COUNTS, GroupKind, Op
from zeropp.qwz import has_two_hops
from zeropp.tools.plan.model import ModelShape, UnitShape
from zeropp.topology import Topology


@dataclass(frozen=True)
class Transfer:
    """One collective of one unit in one step, as the ledger records it on every rank."""

    op: Op
    kind: GroupKind
    group_size: int
    bytes_per_peer: int
    """What each rank owes each peer of its group (a broadcast: the source's)."""
    phase: str
    technique: str
    dtype: str
    coded_elements: int = 0
    """Elements this rank quantizes and dequantizes for it (qwZ, qgZ; not a ledger count)."""
    background: bool = False
    """Started asynchronously and waited for only when its result is used, with a few bytes:
    counted in the ledger, given no time by the cost model (``zeropp.unused``'s exchange)."""

    @property
    def factor(self) -> int:
        """An all-reduce counts as a reduce-scatter plus an all-gather (the ledger's rule)."""
        return 2 if self.op is Op.ALL_REDUCE else 1


@dataclass(frozen=True, kw_only=True)
class Precision:
    """Element sizes of the step's traffic."""

    gather_dtype: torch.dtype = torch.bfloat16
    """Dtype of the weight all-gathers (FSDP2's ``param_dtype``)."""
    reduce_dtype: torch.dtype = torch.float32
    """Dtype of the gradient reduce-scatter (FSDP2's ``reduce_dtype``)."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def padded_numels(unit: UnitShape, group_size: int) -> list[int]:
    """Each parameter's numel with dim 0 padded to a multiple of ``group_size`` (FSDP2's layout)."""
    return [math.ceil(shape[0] / group_size) * group_size * math.prod(shape[1:]) for shape in unit.shapes]


def unit_transfers(unit: UnitShape, config: ZeroPPConfig | None, topology: Topology,
                   precision: Precision) -> list[Transfer]:
    """The collectives of one unit in one step; ``config`` None is FSDP2's HSDP."""
    if not unit.shapes:
        return []
    if config is None:
        return _hsdp_transfers(unit, topology, precision)
    world = topology.world_size
    padded = padded_numels(unit, world)
    gather = _gathers(unit, padded, config, topology, precision)
    return [*gather, *_reduce(unit, padded, config, topology, precision), *_presence(unit, topology)]


def _presence(unit: UnitShape, topology: Topology) -> list[Transfer]:
    """[Note: gradients some ranks lack] (``zeropp.unused``): one byte per parameter of a unit
    with trainable parameters, max-reduced over the world in backward."""
    if not any(unit.trainable):
        return []
    return [Transfer(Op.ALL_REDUCE, GroupKind.WORLD, topology.world_size, len(unit.shapes), "backward", "presence",
                     "uint8", background=True)]


class _Payload(NamedTuple):
    """What one gather sends each peer, as the ledger labels it, and the codec work it costs."""

    bytes_per_peer: int
    technique: str
    dtype: str
    coded_elements: int = 0

    def gather(self, kind: GroupKind, group_size: int, phase: str) -> Transfer:
        return Transfer(Op.ALL_GATHER, kind, group_size, self.bytes_per_peer, phase, self.technique, self.dtype,
                        self.coded_elements)


def _quantized(unit: UnitShape, config: ZeroPPConfig) -> list[bool]:
    """Which of the unit's parameters qwZ quantizes."""
    return [config.quantized_weights or (config.quantized_nontrainable_weights and not trainable)
            for trainable in unit.trainable]


def keeps_secondary_copy(config: ZeroPPConfig | None, topology: Topology) -> bool:
    """Whether hpZ keeps a secondary copy of each unit from its forward to its backward: over a
    partition smaller than the world. A partition of the whole world is the primary shard itself,
    so a run keeps no copy and gathers backward from the shard, as ZeRO-3 does (``zeropp.topology``'s
    [Note: one node mesh]); ``config`` None (FSDP2's HSDP) has no hpZ."""
    hpz = config.hpz_partition_size if config is not None else 1
    return 1 < hpz < topology.world_size


def keeps_codes(quantized: list[bool], config: ZeroPPConfig, topology: Topology) -> bool:
    """Whether the unit's hpZ copy is kept as qwZ's payload rows: qwZ quantizes it and hpZ keeps a
    copy (``keeps_secondary_copy``)."""
    return any(quantized) and keeps_secondary_copy(config, topology)


def secondary_copy_bytes(unit: UnitShape, config: ZeroPPConfig | None, topology: Topology,
                         precision: Precision) -> float:
    """Bytes of one unit's hpZ secondary copy on a rank, held from its forward to its backward:
    its parameters over hpZ's group in the gather dtype, or with qwZ the world/hpZ payload rows
    they are decoded from ([Note: hpZ's copy as qwZ's codes] in ``zeropp.hpz``); 0 where hpZ keeps
    none (``keeps_secondary_copy``)."""
    if not keeps_secondary_copy(config, topology) or not unit.shapes:
        return 0.0
    hpz, world = config.hpz_partition_size, topology.world_size
    padded = padded_numels(unit, world)
    quantized = _quantized(unit, config)
    if keeps_codes(quantized, config, topology):
        return world // hpz * _quantized_gather(padded, quantized, world, config, precision).bytes_per_peer
    return sum(padded) / hpz * precision.gather_dtype.itemsize


def offloads_shards(config: ZeroPPConfig | None) -> bool:
    """Whether ``config`` keeps the parameter shards on the host (``offload="cpu"``, FSDP2's
    ``CPUOffloadPolicy``): every gather from a shard then starts with a host-to-device copy, and
    each gradient shard goes to the host after its reduce-scatter. ``config`` None (FSDP2's HSDP)
    keeps them on the device."""
    return config is not None and config.offload == "cpu"


def offloads_optimizer(config: ZeroPPConfig | None) -> bool:
    """Whether the optimizer's state and step live on the host: with the shards (``offload="cpu"``)
    or alone (``offload="optimizer"``, ``zeropp.offload.HostOptimizer``)."""
    return config is not None and config.offload != "none"


def backward_gathers_from_shard(config: ZeroPPConfig | None, topology: Topology) -> bool:
    """Whether a unit's backward all-gather starts from its primary shard, as forward's does:
    in every mode but hpZ with a secondary copy (made on the device from forward's gathered
    weights), which serves it instead (``keeps_secondary_copy``)."""
    return not keeps_secondary_copy(config, topology)


def _gathers(unit: UnitShape, padded: list[int], config: ZeroPPConfig, topology: Topology,
             precision: Precision) -> list[Transfer]:
    world, itemsize = topology.world_size, precision.gather_dtype.itemsize
    quantized = _quantized(unit, config)
    if any(quantized):
        world_gather = _quantized_gather(padded, quantized, world, config, precision)
    else:
        world_gather = _Payload(sum(padded) // world * itemsize, "fsdp", _dtype_name(precision.gather_dtype))
    nodes, per_node = topology.num_nodes, topology.ranks_per_node
    if any(quantized) and config.hierarchical_gather and has_two_hops(topology):
        # qwZ's two hops ([Note: two-hop gather]): the chunk to every node, then the node's
        # chunks to the node's ranks; the codec work is booked on the first
        across = world_gather.gather(GroupKind.INTER, nodes, "")
        inside = _Payload(nodes * world_gather.bytes_per_peer, "qwZ", world_gather.dtype).gather(
            GroupKind.INTRA, per_node, "")
        world_hops = [across, inside]
    else:
        world_hops = [world_gather.gather(GroupKind.WORLD, world, "")]
    forward = [replace(t, phase="forward") for t in world_hops]
    if not keeps_secondary_copy(config, topology):
        return [*forward, *(replace(t, phase="backward") for t in world_hops)]
    hpz = config.hpz_partition_size
    if keeps_codes(quantized, config, topology):
        # the copy's rows, the world's chunks in the forward's payload, decoded after
        rows = world // hpz
        node_gather = _Payload(rows * world_gather.bytes_per_peer, "hpZ", world_gather.dtype,
                               world_gather.coded_elements // (1 + world) * world)
    elif any(quantized) and config.quantize_intra_node_weights:
        node_gather = _quantized_gather(padded, quantized, hpz, config, precision)
    else:
        # qwZ's comm labels the full-precision node gather hpZ; FSDP2's own comm is "fsdp"
        node_gather = _Payload(sum(padded) // hpz * itemsize, "hpZ" if any(quantized) else "fsdp",
                               _dtype_name(precision.gather_dtype))
    return [*forward, node_gather.gather(GroupKind.INTRA, hpz, "backward")]


def _quantized_gather(padded: list[int], quantized: list[bool], group_size: int, config: ZeroPPConfig,
                      precision: Precision) -> _Payload:
    """qwZ's payload per peer, and its codec work: encode this rank's chunk, decode every rank's."""
    segments = segments_for(padded, quantized, group_size, config.weight_bits,
                            asymmetric=config.weight_code == "asymmetric")
    coded = sum(s.numel for s in segments if s.bits is not None)
    return _Payload(payload_bytes(segments, config.block_size, precision.gather_dtype), "qwZ",
                    f"int{config.weight_bits}", (1 + group_size) * coded)


def _reduce(unit: UnitShape, padded: list[int], config: ZeroPPConfig, topology: Topology,
            precision: Precision) -> list[Transfer]:
    world = topology.world_size
    trainable = [numel for numel, t in zip(padded, unit.trainable) if t]
    if not trainable:
        return []
    chunk = sum(trainable) // world
    if not config.quantized_gradients:
        return [Transfer(Op.REDUCE_SCATTER, GroupKind.WORLD, world, chunk * precision.reduce_dtype.itemsize,
                         "backward", "fsdp", _dtype_name(precision.reduce_dtype))]
    num_nodes, ranks_per_node = topology.num_nodes, topology.ranks_per_node
    transfers = []
    for bits, size, kind, rows in ((config.grad_bits_intra, ranks_per_node, GroupKind.INTRA, num_nodes),
                                   (config.grad_bits_inter, num_nodes, GroupKind.INTER, 1)):
        if size > 1:
            segments = segments_for(trainable, [True] * len(trainable), world, bits,
                                    grouped_scales=config.gradient_code.grouped_scales)
            per_row = payload_bytes(segments, config.gradient_block_size, torch.float32)
            kind = GroupKind.WORLD if size == world else kind
            coded = 2 * (size - 1) * rows * chunk  # rows sent are encoded, rows received decoded
            transfers.append(Transfer(Op.ALL_TO_ALL, kind, size, rows * per_row, "backward", "qgZ", f"int{bits}",
                                      coded))
    return transfers


def _hsdp_transfers(unit: UnitShape, topology: Topology, precision: Precision) -> list[Transfer]:
    node = topology.ranks_per_node
    padded = padded_numels(unit, node)
    kind = GroupKind.WORLD if node == topology.world_size else GroupKind.INTRA
    shard = sum(padded) // node
    gather_dtype = _dtype_name(precision.gather_dtype)
    transfers = [Transfer(Op.ALL_GATHER, kind, node, shard * precision.gather_dtype.itemsize, phase, "fsdp",
                          gather_dtype) for phase in ("forward", "backward")]
    trainable = sum(numel for numel, t in zip(padded, unit.trainable) if t) // node
    if trainable:
        reduce_bytes = trainable * precision.reduce_dtype.itemsize
        reduce_dtype = _dtype_name(precision.reduce_dtype)
        transfers.append(Transfer(Op.REDUCE_SCATTER, kind, node, reduce_bytes, "backward", "fsdp", reduce_dtype))
        if topology.num_nodes > 1:
            inter = GroupKind.WORLD if node == 1 else GroupKind.INTER
            transfers.append(Transfer(Op.ALL_REDUCE, inter, topology.num_nodes,
                                      reduce_bytes // topology.num_nodes, "backward", "hsdp", reduce_dtype))
    return transfers


def step_transfers(model: ModelShape, config: ZeroPPConfig | None, topology: Topology,
                   precision: Precision) -> list[list[Transfer]]:
    """Every unit's collectives in one step (``model.units`` order), the scalars' all-reduces
    as a last entry when the model has trainable 0-dim parameters."""
    per_unit = [unit_transfers(unit, config, topology, precision) for unit in model.units]
    if model.num_trainable_scalars and topology.world_size > 1:
        per_unit.append([Transfer(Op.ALL_REDUCE, GroupKind.WORLD, topology.world_size, 4, "backward", "scalars",
                                  "float32")] * model.num_trainable_scalars)
    return per_unit


def ranks_sending_across(kind: GroupKind, topology: Topology) -> int:
    """How many of the world's ranks have, in each of their groups of this kind, a ring
    successor on another node (gloo's rings run in rank order)."""
    if topology.num_nodes == 1 or kind is GroupKind.INTRA:
        return 0
    if kind is GroupKind.INTER:
        return topology.world_size
    return topology.num_nodes  # the world ring: each node's last rank sends to the next node


def ledger_counts(transfers: Sequence[Transfer], topology: Topology, backend: str = "gloo") -> dict[str, int]:
    """The ledger's per-step ``COUNTS`` summed over every rank (``CommLedger.combined``)."""
    world, per_node = topology.world_size, topology.ranks_per_node
    totals = dict.fromkeys(COUNTS, 0)
    for t in transfers:  # every rank sends the same in each of them (no broadcast in a step)
        sent = t.factor * t.bytes_per_peer * (t.group_size - 1)
        remote = {GroupKind.INTRA: 0, GroupKind.INTER: t.group_size - 1}.get(t.kind, t.group_size - per_node)
        cross = t.factor * t.bytes_per_peer * remote
        totals["calls"] += world
        totals["bytes"] += world * sent
        totals["cross_node_bytes"] += world * cross
        if backend == "gloo" and t.op in (Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.ALL_REDUCE):
            rounds = 1 if t.op is Op.ALL_GATHER else 2
            ring = rounds * t.bytes_per_peer * (t.group_size - 1)
            totals["backend_bytes"] += world * ring
            totals["backend_cross_node_bytes"] += ranks_sending_across(t.kind, topology) * ring
        else:
            totals["backend_bytes"] += world * sent
            totals["backend_cross_node_bytes"] += world * cross
    return totals


def ledger_rows(transfers: Sequence[Transfer], topology: Topology, backend: str = "gloo"
                ) -> dict[tuple[str, str, str, int, str, str], dict[str, int]]:
    """``ledger_counts`` per ledger row: (phase, op, group kind, group size, dtype, technique)."""
    groups: dict[tuple[str, str, str, int, str, str], list[Transfer]] = {}
    for t in transfers:
        key = (t.phase, t.op.value, t.kind.value, t.group_size, t.dtype, t.technique)
        groups.setdefault(key, []).append(t)
    return {key: ledger_counts(group, topology, backend) for key, group in sorted(groups.items())}
