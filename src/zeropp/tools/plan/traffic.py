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
  reduced shard is all-reduced across nodes, or with ``quantized_replica_gradients`` reduced by
  the replicas' all-to-all and all-gather in ``grad_bits_inter`` bits.
- Tensor parallel x FSDP: the unit's shapes on one tensor parallel rank, sharded over its
  data-parallel group ([Note: 2-D layouts in the plan] in ``zeropp.tools.plan.layout``).
- qwZ: the gathers send each parameter's slice block-quantized (``zeropp.codes.codec``'s payload);
  a gather whose group sits inside one node (HSDP's) goes in full precision, labelled hpZ, unless
  ``quantize_intra_node_weights``.
- hpZ: the backward gather runs inside the node from the secondary copy: in full precision, or
  with qwZ as the payload rows the copy is kept as (each rank's world rows of the forward gather,
  [Note: hpZ's copy as qwZ's codes] in ``zeropp.techniques.hpz``). A partition of the whole world (one node)
  keeps no copy (``zeropp.setup.topology``'s [Note: one node mesh]): the step is the mode's without hpZ.
- Weight differences (``weight_deltas``, [Note: weight differences] in ``zeropp.techniques.deltas``):
  each gather, forward and backward, takes the node's rows of the unit's copy inside the node
  (N chunks a rank, in the gather dtype); a trainable unit's forward first all-gathers each
  rank's chunk of differences, coded, over its peers of its local index on the other nodes;
  one all-reduce of a byte per unit a forward decides, on every rank, what each unit does. A
  step here is one after the first (the first, and a full refresh, send the chunk whole).
- qgZ: the reduce-scatter becomes two all-to-alls over the shard group as placed on nodes; a
  rank sends each node peer the N chunks it owes that peer's local index, then each remote node
  one chunk, never its own rows (one hop where the group has one node or one rank per node).
- Every zeropp mode: one byte per parameter of each trainable unit, all-reduced in backward
  (which ranks had a gradient, ``zeropp.fsdp.unused``).

A 0-dim parameter is kept whole on every rank and its gradient all-reduced after each backward
(``zeropp.fsdp.scalars``). Tensor parallel's own all-reduces are DTensor's, not the ledger's:
``tensor_parallel_transfers`` prices them apart.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from zeropp.codes.codec import payload_bytes, segments_for
from zeropp.config import ZeroPPConfig
from zeropp.fsdp.ledger import COUNTS, GroupKind, Op
from zeropp.setup.topology import Topology
from zeropp.techniques.qwz import has_two_hops
from zeropp.tools.plan.layout import Layout, group_kind, layout_for
from zeropp.tools.plan.model import ModelShape, UnitShape

FSDP2_OWN = ZeroPPConfig()
"""FSDP2's own collectives (``config`` None), priced as zeropp's without a technique: the same
bytes, without zeropp's presence exchange."""


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
    counted in the ledger, given no time by the cost model (``zeropp.fsdp.unused``'s exchange)."""
    span: int = 0
    """The nodes each of its groups spans; 0: every node (a group of ``GroupKind.INTER`` or
    ``MIXED`` that does not, such as expert parallel's experts' shard group or its token
    exchange across two nodes of many, says how many)."""

    def nodes(self, topology: Topology) -> int:
        return self.span or topology.num_nodes

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


def unit_transfers(unit: UnitShape, config: ZeroPPConfig | None, topology: Topology, precision: Precision,
                   layout: Layout | None = None) -> list[Transfer]:
    """The collectives of one unit in one step; ``config`` None is FSDP2's own, on HSDP unless
    ``layout`` says otherwise (``layout.layout_for``). ``unit``: what one rank holds of it before
    FSDP2 shards it (one tensor parallel rank's shapes, ``Layout.local_units``)."""
    if not unit.shapes:
        return []
    layout = layout_for(config, layout)
    fsdp = config if config is not None else FSDP2_OWN
    transfers = []
    for part, shard in layout.parts(unit, topology):  # one per parameter group (expert parallel: two)
        padded = padded_numels(part, shard.world_size)
        collectives = [*_gathers(part, padded, fsdp, topology, shard, precision),
                       *_reduce(part, padded, fsdp, topology, shard, precision)]
        if layout.expert_parallel > 1 and shard.num_nodes < topology.num_nodes:  # the experts' group, on some nodes
            collectives = [t if t.kind in (GroupKind.INTRA, GroupKind.WORLD) else replace(t, span=shard.num_nodes)
                           for t in collectives]
        transfers += [*collectives, *_replicas(part, padded, config, topology, layout, precision)]
        if config is not None:
            transfers += _presence(part, topology, shard, layout.num_replicas(topology))
    return transfers


def shard_kind(topology: Topology, shard: Topology) -> GroupKind:
    """The link class of a unit's shard group (``Layout.shard_group``)."""
    return group_kind(topology, shard.num_nodes, shard.ranks_per_node)


def _presence(unit: UnitShape, topology: Topology, shard: Topology, replicas: int) -> list[Transfer]:
    """[Note: gradients some ranks lack] (``zeropp.fsdp.unused``): one byte per parameter of a unit
    with trainable parameters, max-reduced in backward over its shard group, then across HSDP's
    replicas (one rank per node)."""
    if not any(unit.trainable):
        return []
    exchanges = [(shard_kind(topology, shard), shard.world_size, shard.num_nodes)]
    if replicas > 1:
        exchanges.append((group_kind(topology, replicas, 1), replicas, replicas))
    return [Transfer(Op.ALL_REDUCE, kind, size, len(unit.shapes), "backward", "presence", "uint8", background=True,
                     span=0 if nodes == topology.num_nodes else nodes)
            for kind, size, nodes in exchanges if size > 1]


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


def gathered_quantized(unit: UnitShape, config: ZeroPPConfig | None, topology: Topology,
                       shard: Topology) -> list[bool]:
    """Which of the unit's parameters its gathers over the shard group send quantized: qwZ's,
    unless the group sits inside one node and ``quantize_intra_node_weights`` is off (qwZ's comm
    sends those in full precision)."""
    if config is None:
        return [False] * len(unit.shapes)
    inside = shard_kind(topology, shard) is GroupKind.INTRA and not config.quantize_intra_node_weights
    return [quantized and not inside for quantized in _quantized(unit, config)]


def keeps_secondary_copy(config: ZeroPPConfig | None, topology: Topology) -> bool:
    """Whether hpZ keeps a secondary copy of each unit from its forward to its backward: over a
    partition smaller than the world. A partition of the whole world is the primary shard itself,
    so a run keeps no copy and gathers backward from the shard, as ZeRO-3 does (``zeropp.setup.topology``'s
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
    they are decoded from ([Note: hpZ's copy as qwZ's codes] in ``zeropp.techniques.hpz``); 0 where hpZ keeps
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
    or alone (``offload="optimizer"``, ``zeropp.fsdp.offload.HostOptimizer``)."""
    return config is not None and config.offload != "none"


def backward_gathers_from_shard(config: ZeroPPConfig | None, topology: Topology) -> bool:
    """Whether a unit's backward all-gather starts from its primary shard, as forward's does:
    in every mode but hpZ with a secondary copy (made on the device from forward's gathered
    weights), which serves it instead (``keeps_secondary_copy``)."""
    return not keeps_secondary_copy(config, topology)


def keeps_weight_deltas(config: ZeroPPConfig | None, shard: Topology) -> bool:
    """Whether a unit sharded over ``shard`` keeps its copy from step to step (``weight_deltas``):
    its shard group spans several nodes."""
    return config is not None and config.weight_deltas and shard.num_nodes > 1


def delta_payload(unit: UnitShape, padded: list[int], config: ZeroPPConfig, group_size: int) -> int:
    """Bytes of one rank's chunk of coded differences (fp32 differences, ``delta_bits`` codes)."""
    segments = segments_for(padded, [True] * len(padded), group_size, config.delta_bits)
    return payload_bytes(segments, config.deltas_block_size, torch.float32)


def _delta_gathers(unit: UnitShape, padded: list[int], config: ZeroPPConfig, topology: Topology, shard: Topology,
                   precision: Precision) -> list[Transfer]:
    """A unit's gathers from its node copy, and its differences' all-gather across nodes."""
    nodes, per_node = shard.num_nodes, shard.ranks_per_node
    chunk = sum(padded) // shard.world_size
    found = []
    if any(unit.trainable):
        found.append(Transfer(Op.ALL_GATHER, GroupKind.INTER, nodes, delta_payload(unit, padded, config,
                                                                                  shard.world_size),
                              "forward", "deltas", f"int{config.delta_bits}", (1 + nodes) * chunk,
                              span=0 if nodes == topology.num_nodes else nodes))
    if per_node > 1:
        rows, dtype = node_copy_row_bytes(padded, config, shard.world_size, precision) * nodes, \
            "int8" if config.delta_reference == "codes" else _dtype_name(precision.gather_dtype)
        found += [Transfer(Op.ALL_GATHER, GroupKind.INTRA, per_node, rows, phase, "hpZ", dtype)
                  for phase in ("forward", "backward")]
    return found


def node_copy_row_bytes(padded: list[int], config: ZeroPPConfig, group_size: int, precision: Precision) -> int:
    """Bytes of one row (one chunk) of a unit's node copy: the chunk in the gather dtype, or its
    INT8 payload with ``delta_reference="codes"``."""
    if config.delta_reference == "codes":
        return payload_bytes(segments_for(padded, [True] * len(padded), group_size, 8), config.block_size,
                             precision.gather_dtype)
    return sum(padded) // group_size * precision.gather_dtype.itemsize


def _gathers(unit: UnitShape, padded: list[int], config: ZeroPPConfig, topology: Topology, shard: Topology,
             precision: Precision) -> list[Transfer]:
    if keeps_weight_deltas(config, shard):
        return _delta_gathers(unit, padded, config, topology, shard, precision)
    size, itemsize = shard.world_size, precision.gather_dtype.itemsize  # the world in 1-D
    quantized, sent = _quantized(unit, config), gathered_quantized(unit, config, topology, shard)
    if any(sent):
        world_gather = _quantized_gather(padded, sent, size, config, precision)
    else:  # qwZ's comm labels a full-precision gather inside the node hpZ; FSDP2's own comm is "fsdp"
        world_gather = _Payload(sum(padded) // size * itemsize, "hpZ" if any(quantized) else "fsdp",
                                _dtype_name(precision.gather_dtype))
    nodes, per_node = topology.num_nodes, topology.ranks_per_node
    if any(sent) and config.hierarchical_gather and shard == topology and has_two_hops(topology):
        # qwZ's two hops ([Note: two-hop gather]): the chunk to every node, then the node's
        # chunks to the node's ranks; the codec work is booked on the first
        across = world_gather.gather(GroupKind.INTER, nodes, "")
        inside = _Payload(nodes * world_gather.bytes_per_peer, "qwZ", world_gather.dtype).gather(
            GroupKind.INTRA, per_node, "")
        world_hops = [across, inside]
    else:
        world_hops = [world_gather.gather(shard_kind(topology, shard), size, "")]
    forward = [replace(t, phase="forward") for t in world_hops]
    if not keeps_secondary_copy(config, topology):
        return [*forward, *(replace(t, phase="backward") for t in world_hops)]
    hpz = config.hpz_partition_size
    if keeps_codes(quantized, config, topology):
        # the copy's rows, the world's chunks in the forward's payload, decoded after
        rows = size // hpz
        node_gather = _Payload(rows * world_gather.bytes_per_peer, "hpZ", world_gather.dtype,
                               world_gather.coded_elements // (1 + size) * size)
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


def _reduce(unit: UnitShape, padded: list[int], config: ZeroPPConfig, topology: Topology, shard: Topology,
            precision: Precision) -> list[Transfer]:
    """The reduce-scatter over the shard group: FSDP2's, or qgZ's hops as the group sits on nodes
    (inside its node, then across its nodes)."""
    size = shard.world_size
    trainable = [numel for numel, t in zip(padded, unit.trainable) if t]
    if not trainable:
        return []
    chunk = sum(trainable) // size
    if not config.quantized_gradients:
        return [Transfer(Op.REDUCE_SCATTER, shard_kind(topology, shard), size,
                         chunk * precision.reduce_dtype.itemsize, "backward", "fsdp",
                         _dtype_name(precision.reduce_dtype))]
    transfers = []
    for bits, nodes, per_node, rows in ((config.grad_bits_intra, 1, shard.ranks_per_node, shard.num_nodes),
                                        (config.grad_bits_inter, shard.num_nodes, 1, 1)):
        hop = nodes * per_node
        if hop > 1:
            segments = segments_for(trainable, [True] * len(trainable), size, bits,
                                    grouped_scales=config.gradient_code.grouped_scales)
            per_row = payload_bytes(segments, config.gradient_block_size, torch.float32)
            coded = 2 * (hop - 1) * rows * chunk  # rows sent are encoded, rows received decoded
            transfers.append(Transfer(Op.ALL_TO_ALL, group_kind(topology, nodes, per_node), hop, rows * per_row,
                                      "backward", "qgZ", f"int{bits}", coded))
    return transfers


class ReplicaRow(NamedTuple):
    """One row of the replicas' reduction ([Note: the replicas' reduction] in ``zeropp.techniques.replicas``)."""

    numel: int
    """Each trainable parameter's slice of the rank's chunk cut in R parts, the parts rounded up."""
    nbytes: int
    """The row's payload in ``grad_bits_inter`` bits with its blocks' fp32 scales (the plain code)."""


def replica_row(chunk_numels: Sequence[int], config: ZeroPPConfig, num_replicas: int) -> ReplicaRow:
    """The row each replica owns of a chunk of trainable slices of ``chunk_numels`` elements."""
    parts = [-(-numel // num_replicas) for numel in chunk_numels]
    segments = segments_for([part * num_replicas for part in parts], [True] * len(parts), num_replicas,
                            config.grad_bits_inter)
    return ReplicaRow(sum(parts), payload_bytes(segments, config.gradient_block_size, torch.float32))


def _replicas(unit: UnitShape, padded: list[int], config: ZeroPPConfig | None, topology: Topology, layout: Layout,
              precision: Precision) -> list[Transfer]:
    """HSDP: the reduced shard reduced across the replicas (one rank per node): FSDP2's
    all-reduce in the reduce dtype, or with ``quantized_replica_gradients`` an all-to-all of the
    rows owed to the other replicas and an all-gather of the reduced rows, both coded."""
    replicas, size = layout.num_replicas(topology), layout.shard_group(topology).world_size  # HSDP: no experts' mesh
    chunks = [numel // size for numel, t in zip(padded, unit.trainable) if t]
    if replicas == 1 or not sum(chunks):
        return []
    kind = group_kind(topology, replicas, 1)
    if config is None or not config.quantized_replica_gradients:
        reduce_bytes = sum(chunks) * precision.reduce_dtype.itemsize
        return [Transfer(Op.ALL_REDUCE, kind, replicas, reduce_bytes // replicas, "backward", "hsdp",
                         _dtype_name(precision.reduce_dtype))]
    row, dtype = replica_row(chunks, config, replicas), f"int{config.grad_bits_inter}"
    return [Transfer(Op.ALL_TO_ALL, kind, replicas, row.nbytes, "backward", "replicas", dtype,
                     2 * (replicas - 1) * row.numel),
            Transfer(Op.ALL_GATHER, kind, replicas, row.nbytes, "backward", "replicas", dtype,
                     (1 + replicas) * row.numel)]


def step_transfers(model: ModelShape, config: ZeroPPConfig | None, topology: Topology, precision: Precision,
                   layout: Layout | None = None) -> list[list[Transfer]]:
    """Every unit's collectives in one step (``model.units`` order), the scalars' all-reduces
    as a last entry when the model has trainable 0-dim parameters; ``layout``: see
    ``layout.layout_for``."""
    layout = layout_for(config, layout)
    per_unit = [unit_transfers(unit, config, topology, precision, layout) for unit in layout.local_units(model)]
    if model.num_trainable_scalars and topology.world_size > 1:
        per_unit.append([Transfer(Op.ALL_REDUCE, GroupKind.WORLD, topology.world_size, 4, "backward", "scalars",
                                  "float32")] * model.num_trainable_scalars)
    copies = sum(keeps_weight_deltas(config, shard) for unit in layout.local_units(model)
                 for part, shard in layout.parts(unit, topology) if part.shapes)
    if copies:  # [Note: one decision]: a byte per unit keeping a copy, every forward
        per_unit.append([Transfer(Op.ALL_REDUCE, GroupKind.WORLD, topology.world_size, copies, "forward", "deltas",
                                  "uint8", background=True)])
    return per_unit


def tensor_parallel_transfers(model: ModelShape, topology: Topology, layout: Layout, precision: Precision,
                              batch: int, context_length: int, checkpointing: bool = False) -> list[list[Transfer]]:
    """Tensor parallel's own collectives per unit in one step (``model.units`` order; none
    without it): all-reduces of the t x ``batch`` sequences' activations over the group inside
    the node, in the gather dtype ([Note: tensor parallel in the plan] in
    ``zeropp.tools.plan.layout``). A block: the outputs of its attention's and its MLP's row
    parallel products in forward (again in the recomputed forward with ``checkpointing``), the
    gradients of their column parallel inputs in backward. The root: the vocab parallel
    embedding's output in forward, the head's input gradient in backward, and the cross
    entropy's three all-reduces of one fp32 value per token (maximum, target logit, sum of
    exponentials) in forward."""
    degree = layout.tensor_parallel
    if degree == 1:
        return [[] for _ in model.units]
    tokens, kind = degree * batch * context_length, group_kind(topology, 1, degree)

    def all_reduce(phase: str, nbytes: int, dtype: torch.dtype) -> Transfer:
        return Transfer(Op.ALL_REDUCE, kind, degree, nbytes // degree, phase, "tp", _dtype_name(dtype))

    hidden = tokens * model.embed_dim * precision.gather_dtype.itemsize
    recomputed = 2 if checkpointing else 0
    block = ([all_reduce("forward", hidden, precision.gather_dtype)] * 2
             + [all_reduce("backward", hidden, precision.gather_dtype)] * (2 + recomputed))
    per_unit = [block if unit.is_block else [] for unit in model.units]
    per_unit[-1] = [*per_unit[-1], all_reduce("forward", hidden, precision.gather_dtype),
                    *[all_reduce("forward", tokens * 4, torch.float32)] * 3,
                    all_reduce("backward", hidden, precision.gather_dtype)]
    return per_unit


def expert_parallel_transfers(model: ModelShape, topology: Topology, layout: Layout, precision: Precision,
                              batch: int, context_length: int, checkpointing: bool = False) -> list[list[Transfer]]:
    """Expert parallel's token exchanges per unit in one step (``model.units`` order; none
    without it), [Note: expert parallel in the plan]: per MoE block, every token's top-k copies
    to the experts' ranks and back, in the gather dtype, a 1/e share to each rank of the EP group
    (uniform routing); two all-to-alls forward, two backward, two more recomputed."""
    degree = layout.expert_parallel
    if degree == 1:
        return [[] for _ in model.units]
    ep = Topology(num_nodes=max(1, degree // topology.ranks_per_node),
                  ranks_per_node=min(degree, topology.ranks_per_node))
    kind = group_kind(topology, ep.num_nodes, ep.ranks_per_node)
    routed = batch * context_length * model.experts_per_token * model.embed_dim * precision.gather_dtype.itemsize
    exchange = Transfer(Op.ALL_TO_ALL, kind, degree, routed // degree, "forward", "ep_tokens",
                        _dtype_name(precision.gather_dtype), span=ep.num_nodes if kind is not GroupKind.INTRA else 0)
    backward = replace(exchange, phase="backward")
    block = [exchange] * 2 + [backward] * (4 if checkpointing else 2)
    return [block if any(unit.experts) else [] for unit in model.units]


def ranks_sending_across(t: Transfer, topology: Topology) -> int:
    """How many of the world's ranks have, in their group of ``t``'s kind, a ring successor on
    another node (gloo's rings run in rank order): one per node in each group that spans nodes
    (the world ring: each node's last rank; a group of one rank per node: all of them). A group
    of ranks on several nodes and several on each (a tensor parallel layout's data-parallel
    group) spans every node, the same number on each."""
    if topology.num_nodes == 1 or t.kind is GroupKind.INTRA:
        return 0
    return topology.world_size // t.group_size * t.nodes(topology)


def ledger_counts(transfers: Sequence[Transfer], topology: Topology, backend: str = "gloo") -> dict[str, int]:
    """The ledger's per-step ``COUNTS`` summed over every rank (``CommLedger.combined``)."""
    world = topology.world_size
    totals = dict.fromkeys(COUNTS, 0)
    for t in transfers:  # every rank sends the same in each of them (no broadcast in a step)
        sent = t.factor * t.bytes_per_peer * (t.group_size - 1)
        remote = {GroupKind.INTRA: 0, GroupKind.INTER: t.group_size - 1}.get(
            t.kind, t.group_size - t.group_size // t.nodes(topology))  # world, mixed: its nodes, as many on each
        cross = t.factor * t.bytes_per_peer * remote
        totals["calls"] += world
        totals["bytes"] += world * sent
        totals["cross_node_bytes"] += world * cross
        if backend == "gloo" and t.op in (Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.ALL_REDUCE):
            rounds = 1 if t.op is Op.ALL_GATHER else 2
            ring = rounds * t.bytes_per_peer * (t.group_size - 1)
            totals["backend_bytes"] += world * ring
            totals["backend_cross_node_bytes"] += ranks_sending_across(t, topology) * ring
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
