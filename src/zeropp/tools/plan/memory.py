"""One rank's memory through one training step, moment by moment: the memory ``zeropp plan``
predicts, which ``zeropp bench scale`` measures on one rank of 64 to 4,096 with FSDP2's memory
tracker.

[Note: a rank's memory through a step]
All step long a rank holds its shards. FSDP2 keeps each parameter's shard padded (dim 0 padded
to a multiple of the shard group: every rank the same size, one whose rows are all padding
too); AdamW keeps two fp32 states of the unpadded shard (none where it is empty); after a unit's
reduce-scatter its gradients are views of the padded reduce-scatter output. Over that, the step
walks the units:

- forward, unit by unit: the gather (FSDP2's flat all-gather output, then each parameter's
  padded unsharded copy: for a moment two copies of the unit in the gather dtype; under qwZ the
  packed payloads of every rank beside the flat output while they decode), the unit's compute
  (its unsharded weights, the activations it saves) and, under hpZ, the secondary copy it keeps
  for backward (the padded unit over the node's ranks in the gather dtype, or under qwZ the
  payload rows it is kept as: ``traffic.secondary_copy_bytes``; none over a partition of the
  whole world, ``traffic.keeps_secondary_copy``);
- backward, in reverse: the unit gathered again (under hpZ from its secondary copy, freed then;
  kept as codes, the gather receives and decodes the world's payload rows as forward's does)
  and the unit after it prefetched (FSDP2 gathers the next unit of backward while one computes),
  the unit's unsharded gradients (unpadded, gather dtype), then its reduce-scatter: the unit's
  weights freed, the previous unit's reduce-scatter input released (FSDP2 keeps the last one
  until the next reduce-scatter), the padded input in the reduce dtype filled from the gradients,
  and what the comm allocates: nothing for FSDP2's own, for qgZ [Note: qgZ's buffers], for the
  replicas' reduction [Note: the replicas' buffers] after the shard group's (the larger). The
  gradients are freed once copied, except a head's, final norm's or embedding's in a unit of
  its own (``UnitShape.is_single_layer``), held until the reduce-scatter returns;
- the optimizer step: every gradient beside AdamW's temporaries.

A root that holds parameters is gathered first and stays whole to the end of backward (FSDP2
does not reshard the root after forward), its gradients held from the first to its
reduce-scatter. The peak is the largest moment, broken down as it stands then. With
``overlap``, see [Note: overlap's memory]. Not modelled: error feedback's residuals, and the
allocator's own slack (FSDP2's tracker counts tensor storages, so it is not in the
measurement either). With activation checkpointing a block saves its input only and recomputes
its activations in its backward. CPU offload takes the shards, the gradient shards and AdamW's
states off the device and adds each gather's copy-in ([Note: CPU offload in a step] in
``zeropp.tools.plan.offload``); the optimizer on the host takes AdamW's states and the step's
temporaries off it ([Note: the optimizer on the host in a step] there).

On a 2-D layout ([Note: 2-D layouts in the plan] in ``zeropp.tools.plan.layout``) the shard group
is the unit's data-parallel group (W / t ranks, or HSDP's node) and the unit what one tensor
parallel rank holds: shards, gradients, AdamW's states and gathered units are 1/t of what the
same shard group would hold of the whole model. The activations are those of the t x batch
sequences of the tensor parallel group, of which the split layers keep 1/t
(``ModelShape.block_activation_bytes``), the loss's logits split by vocabulary.

[Note: overlap's memory]
With ``overlap`` (``zeropp.setup.install``'s [Note: prefetch]) a step holds more at once: in
forward each block's gather was started before it (by the root, or by the blocks before it:
``FORWARD_AHEAD`` ahead), so while a block decodes and computes the next ``FORWARD_AHEAD``
gathers are in flight, each holding what its collective holds (``gather_forward``); the root's
and the first blocks' gathers start when the previous step's optimizer step ends, beside the
gradients not yet zeroed (``after_step``), and the first blocks' are still in flight when the
root waits for its own. In backward the unit prefetched is still in flight through the
backward and reduce-scatter of the unit before it (what its collective holds, under qwZ the
payloads beside the flat output; they are let go once decoded, before its copy-out). A unit's
reduction finishes late ([Note: late reduce-scatter] in ``zeropp.fsdp.comms``): qgZ's last
collective (the last slice's cross-node exchange, beside the partial rows it was coded from)
stays in flight through the next unit's backward; quantized HSDP's replica exchange too, and its
all-gather through the unit after that. The last units' are finished at the end of backward,
after the root's reduction starts. Measured (``zeropp bench scale``, one rank of Llama-3-8B's
2-layer slice): the plan 1.020x the peak at 64 ranks and 1.022x at 384, and 1.013x on the
narrow Llama at 384 (docs/measurements.md).

[Note: qgZ's buffers]
qgZ runs over column slices of the W rows of S elements (``ZeroPPConfig.grad_slice_bytes``: s
columns, at most that many bytes of fp32 rows; all S without it), coding each peer's rows
straight from the input. Hop 1 (inside the node, when a node has several ranks) holds the
packed rows it sends to its D - 1 node peers (W - N rows) and as many received, then decodes
one peer's N rows at a time into one buffer and adds them to N partial rows: its largest
moment is max(2 x packed, packed + 2 x N x s x 4). Hop 2 does the same with the N partial
rows (N - 1 sent, one row from each node), while they stay alive. N and D are the shard
group's (``Layout.shard_group``): the world's in 1-D. With more than one slice the hops run as a
pipeline (``zeropp.techniques.qgz``' [Note: qgZ slices in a pipeline]): while slice k-1's hop 1
is summed (both of its exchange's buffers still held, its partials and a decode buffer), slice
k's hop 1 is in flight (2 x packed) and slice k-2's hop 2 too (2 x its packed rows, beside the
partials they were coded from).

[Note: the replicas' buffers]
HSDP with ``quantized_replica_gradients`` (``zeropp.techniques.replicas``' [Note: the replicas' reduction]),
after the shard group's reduce-scatter: the chunk copied as R rows of s elements in fp32 (each
parameter's slice cut in R parts, rounded up; while the copy is made, the chunk cast to fp32
when the reduce dtype is not), the reduced row (s x 4), and then either qgZ's one hop across the
replicas (the R - 1 packed rows sent and as many received, or the sent rows beside a decoded
row and their sum: max(2 x packed, packed + 2 x s x 4)) or the all-gather (this rank's packed
row and the R received, decoded into the R rows). Not counted: the per-parameter padding
temporaries while the rows are cut.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import torch

from zeropp.codes.codec import payload_bytes, segments_for
from zeropp.config import ZeroPPConfig
from zeropp.setup.install import FORWARD_AHEAD
from zeropp.setup.topology import Topology
from zeropp.tools.plan.layout import Layout, layout_for
from zeropp.tools.plan.model import ModelShape, UnitShape
from zeropp.tools.plan.traffic import (
    Precision,
    backward_gathers_from_shard,
    gathered_quantized,
    keeps_codes,
    keeps_secondary_copy,
    keeps_weight_deltas,
    node_copy_row_bytes,
    offloads_optimizer,
    offloads_shards,
    padded_numels,
    replica_row,
    secondary_copy_bytes,
)

PARAMETER_BYTES = 4
"""The parameters' own dtype (fp32): the shards, their gradients' and AdamW's states' element size."""


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank holds at the step's peak, by what they are."""

    parameters: float
    """The padded parameter shards."""
    optimizer: float
    """AdamW's two states of this rank's unpadded shards."""
    gradients: float
    """Sharded gradients so far, and the unsharded gradients of the unit in backward."""
    secondary_copy: float
    """hpZ's secondary copies held (with ``weight_deltas``, the node copy kept from step to step)."""
    gathered: float
    """Unsharded weights and the all-gathers' buffers and payloads."""
    reduce_buffers: float
    """Reduce-scatter inputs (FSDP2 keeps one past its unit) and what the comm allocates."""
    activations: float
    """What forward saved for backward, and the loss's temporaries."""
    moment: str
    """Where the peak is, e.g. "backward reduce-scatter lm_head"."""

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self) if f.name != "moment")


@dataclass(frozen=True)
class UnitBytes:
    """What one unit costs one rank (bytes), see [Note: a rank's memory through a step]."""

    name: str
    shard: float
    optimizer: float
    gradient: float
    """The padded sharded gradient (the reduce-scatter output)."""
    whole: float
    """The padded unsharded weights, gather dtype."""
    whole_gradients: float
    secondary: float
    gather_forward: float
    """What the forward gather holds while its collective runs (FSDP2's flat output included);
    its copy-out then holds two copies of ``whole``."""
    gather_backward: float
    reduce_input: float
    reducing: float
    """What the reduce-scatter comm allocates at its largest moment."""
    held_gradients: float
    """Unsharded gradients autograd holds through the reduce-scatter (``UnitShape.is_single_layer``)."""
    activations: float
    """Saved for backward by the unit's forward."""
    recompute: float
    """Recomputed in the unit's backward (activation checkpointing)."""
    loss: float
    """Temporaries of the loss in forward beside the saved activations (the unit that computes
    it): the 16-bit logits and their fp32 copy, 6 V bytes per token."""
    loss_gradients: float
    """The loss's gradients in backward, once the saved log-probabilities are used: 8 V bytes
    per token (measured with FSDP2's tracker on a Llama head)."""
    largest_local: float
    """The largest unpadded parameter shard on this rank (AdamW's temporaries)."""
    copy_in: float = 0.0
    """CPU offload: the unit's shard copied to the device and cast to the gather dtype, held
    beside the flat all-gather output while it is copied in, before the forward gather."""
    copy_in_backward: float = 0.0
    """The same before the backward gather (0 where hpZ's secondary copy serves it)."""
    late: float = 0.0
    """With ``overlap``: what the reduce-scatter comm still holds while its last collective is in
    flight, through the next unit's backward ([Note: overlap's memory])."""
    later: float = 0.0
    """With ``overlap``: what it holds through the backward of the unit after that (the
    replicas' all-gather across nodes)."""
    node_copy: float = 0.0
    """``weight_deltas``: the unit's rows of its node copy, held the whole step (and between steps)."""
    decode: float = 0.0
    """``delta_reference="codes"``: one rank's rows decoded from the gathered codes, allocated at
    the gather's wait, not while its collective is in flight (a prefetched unit holds only the
    codes and FSDP2's output through the backward of the unit before it)."""

    @property
    def has_parameters(self) -> bool:
        return self.shard > 0


def local_rows(rows: int, shard_size: int, rank: int) -> int:
    """Rows of a dim-0 ``rows`` parameter on ``rank`` (``torch.chunk``'s split, FSDP2's): chunks
    of ceil(rows / shard_size) rows, the last ones short or empty."""
    chunk = math.ceil(rows / shard_size)
    return max(0, min(chunk, rows - rank * chunk))


def _delta_decode_bytes(padded: list[int], config: ZeroPPConfig, shard: Topology, gather_dtype: torch.dtype) -> float:
    """``UnitBytes.decode``: with the copy kept as codes, one rank's N rows decoded at a time."""
    if config.delta_reference != "codes":
        return 0.0
    return shard.num_nodes * (sum(padded) // shard.world_size) * gather_dtype.itemsize


def _delta_gather_bytes(padded: list[int], config: ZeroPPConfig, shard: Topology, gather_dtype: torch.dtype,
                        refresh: bool) -> float:
    """What a gather from the node copy holds while its collectives run: FSDP2's flat output
    (the node's rows are gathered into it, then put in chunk order holding one chunk: [Note:
    chunk order in place] in ``zeropp.techniques.deltas``; a copy kept as codes is gathered as
    codes, decoded into it at the wait: ``UnitBytes.decode``); in a forward that adds a
    step's differences, this rank's chunk of them in fp32 while it is coded, its code, every
    node's code and one decoded chunk in fp32 (the audit's bound, a chunk of fp32 per unit, aside)."""
    whole = sum(padded) * gather_dtype.itemsize
    chunk = sum(padded) // shard.world_size
    if config.delta_reference == "codes":  # the node's codes
        held = whole + shard.world_size * node_copy_row_bytes(padded, config, shard.world_size,
                                                              Precision(gather_dtype=gather_dtype))
    else:
        held = whole + chunk * gather_dtype.itemsize
    if not refresh:
        return held
    payload = payload_bytes(segments_for(padded, [True] * len(padded), shard.world_size, config.delta_bits),
                            config.deltas_block_size, torch.float32)
    return held + chunk * 4 + (1 + shard.num_nodes) * payload


def _gather_bytes(padded: list[int], quantize: list[bool], group: int, config: ZeroPPConfig | None,
                  gather_dtype: torch.dtype) -> float:
    """What a gather over ``group`` ranks holds while the collective runs: FSDP2's flat output,
    and under qwZ every rank's packed payload and this rank's own."""
    whole = sum(padded) * gather_dtype.itemsize
    if config is None or not any(quantize):
        return whole
    segments = segments_for(padded, quantize, group, config.weight_bits,
                            asymmetric=config.weight_code == "asymmetric")
    return whole + (group + 1) * payload_bytes(segments, config.block_size, gather_dtype)


def _qgz_slice(trainable: list[int], config: ZeroPPConfig, world: int) -> tuple[int, int, Callable[[int], float]]:
    """qgZ's slice over a shard group of ``world`` ranks ([Note: qgZ's buffers]): the chunk's
    elements, a slice's columns, and a slice's payload row at a bit width (the chunk's, in
    proportion to the columns)."""
    chunk = sum(trainable) // world
    columns = chunk if config.grad_slice_bytes is None else min(chunk, max(1, config.grad_slice_bytes // (4 * world)))
    grouped = config.gradient_code.grouped_scales

    def packed_row(bits: int) -> float:
        segments = segments_for(trainable, [True] * len(trainable), world, bits, grouped_scales=grouped)
        return payload_bytes(segments, config.gradient_block_size, torch.float32) * columns / chunk

    return chunk, columns, packed_row


def _qgz_bytes(trainable: list[int], config: ZeroPPConfig, shard: Topology) -> float:
    """qgZ's buffers at their largest moment ([Note: qgZ's buffers]) over the shard group as
    placed on nodes (``Layout.shard_group``)."""
    world, nodes, per_node = shard.world_size, shard.num_nodes, shard.ranks_per_node
    chunk, columns, packed_row = _qgz_slice(trainable, config, world)
    slices = math.ceil(chunk / columns)
    first = (world - nodes) * packed_row(config.grad_bits_intra) if per_node > 1 else 0.0
    second = (nodes - 1) * packed_row(config.grad_bits_inter) if nodes > 1 else 0.0
    partials = nodes * columns * 4
    peak = 0.0
    if per_node > 1:
        peak = max(2 * first, first + 2 * partials)
    if nodes > 1:
        peak = max(peak, (partials if per_node > 1 else 0.0) + max(2 * second, second + 2 * columns * 4))
    if slices == 1:
        return peak
    # the pipeline: slice k's hop 1 in flight while slice k-1's is summed (its exchange's both
    # buffers still held, its partials and one decode buffer), and slice k-2's hop 2 in flight
    # with the partials it was coded from
    ahead = 2 * first if per_node > 1 else 0.0
    behind = 2 * second + partials if nodes > 1 and slices > 2 else 0.0
    summing = 2 * first + 2 * partials if per_node > 1 else 2 * second + 2 * columns * 4 + partials
    return max(peak, ahead + summing + behind)


def _replica_bytes(chunk_numels: list[int], config: ZeroPPConfig, num_replicas: int, reduce_dtype: torch.dtype
                   ) -> float:
    """The replicas' reduction's buffers at their largest moment ([Note: the replicas' buffers])."""
    row = replica_row(chunk_numels, config, num_replicas)
    rows = num_replicas * row.numel * 4
    cast = sum(chunk_numels) * 4 if reduce_dtype != torch.float32 else 0
    packed = (num_replicas - 1) * row.nbytes
    exchange = max(2 * packed, packed + 2 * row.numel * 4)
    gather = (1 + num_replicas) * row.nbytes
    return rows + max(cast, row.numel * 4 + max(exchange, gather))


def _qgz_late_bytes(trainable: list[int], config: ZeroPPConfig, shard: Topology) -> float:
    """qgZ's buffers while its last collective is in flight ([Note: overlap's memory]): the last
    slice's cross-node exchange (its packed rows sent and received, beside the partial rows they
    were coded from), or on one node its intra-node exchange."""
    world, nodes, per_node = shard.world_size, shard.num_nodes, shard.ranks_per_node
    _, columns, packed_row = _qgz_slice(trainable, config, world)
    if nodes > 1:
        return 2 * (nodes - 1) * packed_row(config.grad_bits_inter) + (nodes * columns * 4 if per_node > 1 else 0.0)
    return 2 * (world - nodes) * packed_row(config.grad_bits_intra) if per_node > 1 else 0.0


def _replica_late_bytes(chunk_numels: list[int], config: ZeroPPConfig, num_replicas: int) -> tuple[float, float]:
    """The replicas' reduction beside backward ([Note: the replicas' reduction beside backward]):
    through the next unit's backward the R rows, the reduced row and the exchange's packed rows
    sent and received; through the one after, the R rows and the all-gather's packed rows."""
    row = replica_row(chunk_numels, config, num_replicas)
    rows = num_replicas * row.numel * 4
    packed = (num_replicas - 1) * row.nbytes
    return rows + row.numel * 4 + 2 * packed, rows + (1 + num_replicas) * row.nbytes


def unit_bytes(unit: UnitShape, model: ModelShape, config: ZeroPPConfig | None, topology: Topology,
               precision: Precision, rank: int, tokens: tuple[int, int], last: bool,
               checkpointing: bool = False, layout: Layout | None = None) -> UnitBytes:
    """``unit``'s costs on ``rank``: ``unit`` as the rank holds it before FSDP2 shards it (one
    tensor parallel rank's shapes, ``Layout.local_units``), ``config`` None FSDP2's own (HSDP
    unless ``layout`` says otherwise, ``layout.layout_for``); ``tokens``: (batch, context) per
    rank, a tensor parallel group training t x batch sequences; ``last``: it computes the loss."""
    layout = layout_for(config, layout)
    parts = [_part_bytes(part, shard, layout.part_index(rank, topology, part), model, config, topology, precision,
                         tokens, last and i == 0, checkpointing, layout)
             for i, (part, shard) in enumerate(layout.parts(unit, topology))]
    return functools.reduce(_both_groups, parts)


def _both_groups(first: UnitBytes, second: UnitBytes) -> UnitBytes:
    """A unit of two parameter groups (expert parallel's experts beside the rest of the block):
    both held and both gathered together; what the unit computes and saves is the first's; the
    groups reduce one after the other."""
    kept = ("name", "activations", "recompute", "loss", "loss_gradients")
    summed = {f.name: getattr(first, f.name) + getattr(second, f.name) for f in fields(UnitBytes) if f.name not in kept}
    return replace(first, **{**summed, "reducing": max(first.reducing, second.reducing),
                             "largest_local": max(first.largest_local, second.largest_local)})


def _part_bytes(unit: UnitShape, shard: Topology, index: int, model: ModelShape, config: ZeroPPConfig | None,
                topology: Topology, precision: Precision, tokens: tuple[int, int], last: bool, checkpointing: bool,
                layout: Layout) -> UnitBytes:
    """``unit_bytes`` of one parameter group, sharded over ``shard``, this rank ``index`` in it."""
    shard_size, replicas, degree = shard.world_size, layout.num_replicas(topology), layout.tensor_parallel
    padded = padded_numels(unit, shard_size)
    gather_dtype, reduce_size = precision.gather_dtype, precision.reduce_dtype.itemsize
    local = [local_rows(shape[0], shard_size, index) * math.prod(shape[1:]) for shape in unit.shapes]
    trainable = [n for n, t in zip(padded, unit.trainable) if t]
    quantize = gathered_quantized(unit, config, topology, shard)
    secondary = keeps_secondary_copy(config, topology)
    codes = secondary and keeps_codes(quantize, config, topology)
    backward_group = config.hpz_partition_size if secondary and not codes else shard_size
    backward_quantize = (quantize if not secondary or codes or config.quantize_intra_node_weights
                         else [False] * len(quantize))
    batch, context = tokens
    sequences = degree * batch
    whole_gradients = sum(math.prod(s) for s, t in zip(unit.shapes, unit.trainable) if t) * gather_dtype.itemsize
    activations = model.block_activation_bytes(sequences, context, gather_dtype.itemsize,
                                               degree) if unit.is_block else 0.0
    recompute = activations if checkpointing else 0.0
    if checkpointing and unit.is_block:
        activations = sequences * context * model.embed_dim * gather_dtype.itemsize
    if last:
        activations += model.head_activation_bytes(sequences, context, degree)
    reducing = _qgz_bytes(trainable, config, shard) if config is not None and config.quantized_gradients \
        and trainable else 0.0
    if config is not None and config.quantized_replica_gradients and replicas > 1 and trainable:
        chunks = [n // shard_size for n in trainable]
        reducing = max(reducing, _replica_bytes(chunks, config, replicas, precision.reduce_dtype))
    late = later = 0.0
    if config is not None and config.overlap and trainable:
        if config.quantized_replica_gradients and replicas > 1:
            late, later = _replica_late_bytes([n // shard_size for n in trainable], config, replicas)
        elif config.quantized_gradients:
            late = _qgz_late_bytes(trainable, config, shard)
    copy_in = sum(padded) / shard_size * gather_dtype.itemsize if offloads_shards(config) else 0.0
    deltas = keeps_weight_deltas(config, shard)
    if deltas:
        forward_gather = _delta_gather_bytes(padded, config, shard, gather_dtype, any(unit.trainable))
        backward_gather = _delta_gather_bytes(padded, config, shard, gather_dtype, False)
    else:
        forward_gather = _gather_bytes(padded, quantize, shard_size, config, gather_dtype) if padded else 0.0
        backward_gather = _gather_bytes(padded, backward_quantize, backward_group, config, gather_dtype) \
            if padded else 0.0
    return UnitBytes(
        name=unit.name,
        shard=sum(padded) / shard_size * PARAMETER_BYTES,
        optimizer=2 * sum(n for n, t in zip(local, unit.trainable) if t) * PARAMETER_BYTES,
        gradient=sum(trainable) / shard_size * reduce_size,
        whole=sum(padded) * gather_dtype.itemsize,
        whole_gradients=whole_gradients,
        secondary=0.0 if deltas else secondary_copy_bytes(unit, config, topology, precision),
        gather_forward=forward_gather,
        gather_backward=backward_gather,
        reduce_input=sum(trainable) * reduce_size,
        reducing=reducing,
        held_gradients=whole_gradients if unit.is_single_layer else 0.0,
        activations=activations,
        recompute=recompute,
        loss=6 * sequences * context * model.vocab_size // degree if last else 0.0,
        loss_gradients=8 * sequences * context * model.vocab_size // degree if last else 0.0,
        largest_local=max((n for n, t in zip(local, unit.trainable) if t), default=0) * PARAMETER_BYTES,
        copy_in=copy_in,
        copy_in_backward=copy_in if backward_gathers_from_shard(config, topology) and not deltas else 0.0,
        late=late,
        later=later,
        node_copy=shard.num_nodes * node_copy_row_bytes(padded, config, shard_size, precision) if deltas else 0.0,
        decode=_delta_decode_bytes(padded, config, shard, gather_dtype) if deltas else 0.0,
    )


class _Timeline:
    """The step's moments: what is held now, by category; the largest total so far. With CPU
    offload nothing sharded stays on the device: no shards, no AdamW states, and each gradient
    shard only until it is copied to the host; with the optimizer on the host, no AdamW states."""

    def __init__(self, parameters: float, optimizer: float, config: ZeroPPConfig | None) -> None:
        self.held = dict.fromkeys(("gradients", "secondary_copy", "gathered", "reduce_buffers", "activations"), 0.0)
        self.shards_on_host, self.optimizer_on_host = offloads_shards(config), offloads_optimizer(config)
        self.static = {"parameters": 0.0 if self.shards_on_host else parameters,
                       "optimizer": 0.0 if self.optimizer_on_host else optimizer}
        self.peak: RankMemory | None = None

    def moment(self, label: str, **extra: float) -> None:
        """A moment: what is held plus ``extra`` bytes by category."""
        now = RankMemory(**self.static, **{k: v + extra.get(k, 0.0) for k, v in self.held.items()}, moment=label)
        if self.peak is None or now.total > self.peak.total:
            self.peak = now


def _forward(timeline: _Timeline, blocks: list[UnitBytes], ahead: int) -> None:
    """The blocks' forward; with ``ahead`` (``overlap``) each block's gather was started before
    it (by the root or the blocks before), and the next ``ahead`` are in flight while it computes
    ([Note: overlap's memory])."""
    held = timeline.held

    def in_flight(first: int, last: int) -> float:
        return sum(unit.gather_forward for unit in blocks[first:last])

    for i, unit in enumerate(blocks):
        started = in_flight(i + 1, i + ahead)  # issued before this block's wait
        if unit.copy_in:
            timeline.moment(f"forward copy-in {unit.name}", gathered=unit.whole + unit.copy_in + started)
        timeline.moment(f"forward gather {unit.name}", gathered=unit.gather_forward + unit.decode + started)
        timeline.moment(f"forward copy-out {unit.name}", gathered=2 * unit.whole + started)
        started = in_flight(i + 1, i + 1 + ahead)  # and this block's own prefetch
        timeline.moment(f"forward {unit.name}", gathered=unit.whole + started,
                        activations=unit.activations + unit.loss)
        held["activations"] += unit.activations
        if unit.secondary:
            timeline.moment(f"forward reshard {unit.name}", gathered=unit.whole + started,
                            secondary_copy=unit.secondary)
            held["secondary_copy"] += unit.secondary


def _reduce(timeline: _Timeline, unit: UnitBytes, prefetched: float, unfinished: float = 0.0) -> None:
    """A unit's reduce-scatter: its input filled from the gradients, then the comm's buffers
    (beside ``unfinished``: the units before it still reducing, with ``overlap``)."""
    if unit.reduce_input:
        timeline.moment(f"reduce-scatter copy-in {unit.name}", gathered=prefetched,
                        reduce_buffers=unit.reduce_input + unfinished, gradients=unit.whole_gradients)
        timeline.moment(f"reduce-scatter {unit.name}", gathered=prefetched,
                        reduce_buffers=unit.reduce_input + unit.reducing + unfinished,
                        gradients=unit.gradient + unit.held_gradients)
    if not timeline.shards_on_host:
        timeline.held["gradients"] += unit.gradient


def _backward(timeline: _Timeline, blocks: list[UnitBytes], overlap: bool) -> float:
    """The units' backward in reverse. A prefetched unit holds FSDP2's flat all-gather output
    until its own backward starts; its copy-out into the unsharded weights, and the release of
    its secondary copy, happen then. With ``overlap`` its gather is still in flight until then
    (what the collective holds: under qwZ the payloads beside the flat output), and the last
    units' reductions are still in flight ([Note: overlap's memory]): returns what they hold as
    backward reaches the root."""
    held = timeline.held
    pending = 0.0  # the previous unit's reduce-scatter input, which FSDP2 keeps until the next one
    order = blocks[::-1]
    for i, unit in enumerate(order):
        unfinished = (order[i - 1].late if i >= 1 else 0.0) + (order[i - 2].later if i >= 2 else 0.0)
        if i == 0:
            if unit.copy_in_backward:
                timeline.moment(f"backward copy-in {unit.name}", gathered=unit.whole + unit.copy_in_backward)
            timeline.moment(f"backward gather {unit.name}", gathered=unit.gather_backward + unit.decode)
        elif unit.decode:  # the prefetched codes decoded at this unit's wait
            timeline.moment(f"backward decode {unit.name}", gathered=unit.gather_backward + unit.decode,
                            reduce_buffers=pending + unfinished)
        timeline.moment(f"backward copy-out {unit.name}", gathered=2 * unit.whole, reduce_buffers=pending + unfinished)
        held["secondary_copy"] -= unit.secondary
        after = order[i + 1] if i + 1 < len(order) else None
        prefetched = 0.0 if after is None else after.gather_backward if overlap else after.whole
        if after is not None and after.copy_in_backward:
            timeline.moment(f"backward prefetch copy-in {after.name}",
                            gathered=unit.whole + after.whole + after.copy_in_backward,
                            reduce_buffers=pending + unfinished)
        if after is not None:
            timeline.moment(f"backward prefetch {after.name}", gathered=unit.whole + after.gather_backward,
                            reduce_buffers=pending + unfinished)
        if unit.loss_gradients:
            held["activations"] -= unit.activations
        timeline.moment(f"backward {unit.name}", gathered=unit.whole + prefetched, reduce_buffers=pending + unfinished,
                        gradients=unit.whole_gradients, activations=unit.loss_gradients + unit.recompute)
        if not unit.loss_gradients:
            held["activations"] -= unit.activations
        _reduce(timeline, unit, prefetched, unfinished)
        pending = unit.reduce_input or pending
    return (order[-1].late if order else 0.0) + (order[-2].later if len(order) >= 2 else 0.0)


def rank_memory(model: ModelShape, config: ZeroPPConfig | None, topology: Topology, precision: Precision,
                batch: int, context_length: int, rank: int = 0, checkpointing: bool = False,
                layout: Layout | None = None) -> RankMemory:
    """The peak of one training step on ``rank`` ([Note: a rank's memory through a step]): ``model``
    trained in a mode (``config``; None for FSDP2's own, ``layout``: see ``layout.layout_for``) on
    ``batch`` sequences of ``context_length`` tokens per rank, AdamW; ``checkpointing``:
    activation checkpointing of every block."""
    layout = layout_for(config, layout)
    local_units = layout.local_units(model)
    with_parameters = [u for u in local_units if u.shapes]
    last = with_parameters[-1] if with_parameters else None
    units = [unit_bytes(u, model, config, topology, precision, rank, (batch, context_length), u is last,
                        checkpointing, layout) for u in local_units]
    *blocks, root = units
    blocks = [u for u in blocks if u.has_parameters]
    timeline = _Timeline(sum(u.shard for u in units), sum(u.optimizer for u in units), config)
    held = timeline.held
    held["secondary_copy"] += sum(u.node_copy for u in units)  # weight_deltas: held from step to step
    ahead = FORWARD_AHEAD if config is not None and config.overlap else 0
    started = sum(u.gather_forward for u in blocks[:ahead])  # with overlap, since the last step ended
    if root.has_parameters:  # gathered first, whole until the end of backward, its gradients from the loss on
        if root.copy_in:
            timeline.moment(f"forward copy-in {root.name}", gathered=root.whole + root.copy_in + started)
        timeline.moment(f"forward gather {root.name}", gathered=root.gather_forward + started)
        timeline.moment(f"forward copy-out {root.name}", gathered=2 * root.whole + started)
        held["gathered"] += root.whole
    _forward(timeline, blocks, ahead)
    if root.has_parameters:
        held["activations"] += root.activations
        timeline.moment(f"loss {root.name}", activations=root.loss)
        held["gradients"] += root.whole_gradients
        if root.copy_in_backward:  # counted whole throughout, its backward gather copies its shard in again
            timeline.moment(f"backward copy-in {root.name}", gathered=root.copy_in_backward)
    unfinished = _backward(timeline, blocks, bool(ahead))
    if root.has_parameters:
        held["gathered"] -= root.whole
        held["gradients"] -= root.whole_gradients
        held["activations"] -= root.activations
        _reduce(timeline, root, 0.0, unfinished)
    largest = max((u.largest_local for u in units), default=0.0)
    if not timeline.optimizer_on_host:  # offloaded, AdamW steps on the host
        timeline.moment("optimizer step", activations=2 * largest)
    if ahead:  # the next forward's first gathers, started when the step ends
        first = [u for u in (root, *blocks[:ahead]) if u.has_parameters and not u.copy_in]
        timeline.moment("after the step", gathered=sum(u.gather_forward for u in first))
    assert timeline.peak is not None
    return timeline.peak

