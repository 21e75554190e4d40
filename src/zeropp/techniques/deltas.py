"""Weight differences over hpZ's node copy: every gather inside the node, and only each step's
coded differences across nodes (``ZeroPPConfig(weight_deltas=True)``).

[Note: weight differences]
Under ZeRO-3 every step sends the whole model across nodes as the forward's gather (qwZ halves
it), although a step moves a weight by about the learning rate and hpZ already holds the whole
model on every node between a unit's forward and its backward. Here that copy lives on from
step to step. A unit sharded over S = N nodes x D ranks lays its flat buffer out as S chunks,
chunk ``n*D + d`` owned by rank d of node n. The rank of local index d on every node holds the
N chunks ``n*D + d`` (``rows``): its own chunk and those of the ranks of its index on the other
nodes, the ranks of its inter-node group. So:

- a gather (forward or backward) all-gathers ``rows`` inside the node: the D ranks' rows are
  all S chunks, put back in chunk order; nothing crosses a node;
- after an optimizer step each rank codes the difference between its new chunk (FSDP2's gather
  input: the shard in the gather dtype) and its own row, ``delta_bits`` per element in blocks,
  and all-gathers the codes over its inter-node group; every rank of the group decodes the N
  differences and adds them to its rows in the same arithmetic, the owner to its own row as
  well. Every node's copy stays the same bit for bit, and the owner's next difference is taken
  against what the nodes hold: the loop is closed, so a code's rounding is carried by the next
  difference instead of adding up. A row lies within half a step of its last difference's code
  of the weight (plus the gather dtype's rounding), where qwZ's gather lies within half an INT8
  step of the weight itself;
- a full refresh sends each chunk whole over the inter-node group instead: the first gather, a
  load or ``load_state_dict``, an edit of the weights outside the optimizer step, the audit
  finding a row beyond its bound, ``zeropp.refresh_weights``.

What a unit's next forward does is decided for every unit at the root's forward, on every rank
at once ([Note: one decision]). Cross-node bytes per step: a unit's P weights once, at
``delta_bits`` per weight (plus a scale per block), N - 1 times per chunk; a unit without a
trainable parameter sends nothing after its first gather. Memory: the rows, P / D weights in
the gather dtype, held for the whole job where hpZ holds its copy from forward to backward.

[Note: one decision]
A refresh is a collective, so every rank of an inter-node group must take the same one; but
what each rank sees (its shards' version counters) is its own: an empty shard of a small
parameter may not move when the others do, and an edit may touch some ranks' shards only. So
at every root forward each rank states, per unit, what its own chunk needs (nothing; a
difference: an optimizer holding the unit's parameters stepped, and nothing else changed them
since; whole: its rows were never filled, its shards changed outside a step, a load,
``zeropp.refresh_weights``, the audit), and one all-reduce (max, a byte per unit) makes it every
rank's. The unit's next forward gather carries it out; gradient accumulation's micro-batches and
``no_grad`` forwards between steps find nothing to do and send nothing across nodes.

[Note: the copy as codes]
With ``delta_reference="codes"`` a rank keeps its rows as qwZ's INT8 payload rows of the chunks
(codes and block scales), as hpZ keeps its copy under qwZ: a difference is taken against the
decoded row, and each holder adds the decoded differences to its decoded rows and codes them
again, in the same arithmetic on every node; a full refresh sends the owners' INT8 codes, qwZ's
bytes; the node gathers send the codes, decoded into FSDP2's output in chunk order. Half the
memory and node bytes of a bf16 copy (a quarter of fp32's); the forward sees INT8's half step of
the weight on top of the difference's. The loop stays closed: each difference is taken against
what the nodes hold, so neither code's rounding adds up over steps.

A step is learnt of from the optimizer's step hook (``zeropp.fsdp.after_step.on_step``), not from
the shards' version counters: a foreach or fused optimizer (AdamW's default on GPUs, HF
Trainer's ``adamw_torch_fused``) writes DTensor parameters without bumping either counter
(measured on torch 2.13: AdamW with ``foreach=True`` or ``fused=True`` leaves both at 0, the
for-loop AdamW bumps the DTensor's). The counters still tell an edit outside a step (a load, an
in-place change through ``model.parameters()``); an edit made with foreach ops is one they do
not see, for which ``zeropp.refresh_weights`` exists.
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from zeropp.codes.bounds import block_constant, coding_bound
from zeropp.codes.codec import ChunkCodec, segments_for
from zeropp.fsdp.access import AllGather, CommGroup, in_backward, shard_versions, unit_parameters
from zeropp.fsdp.after_step import on_step
from zeropp.fsdp.comms import Completion, DecodeOnWait, RecordedComm, Started, all_gather, all_reduce
from zeropp.fsdp.ledger import CommLedger
from zeropp.setup.topology import ShardGroups, Topology
from zeropp.techniques.audit import Auditable, Request, Tally

NOTHING, DIFFERENCE, WHOLE = 0, 1, 2
"""What a unit's next forward gather does to its rows ([Note: one decision])."""


def delta_codec(padded_numels: Sequence[int], floating: Sequence[bool], group_size: int, bits: int,
                block_size: int) -> ChunkCodec:
    """The code of one rank's chunk of differences (fp32): each floating-point parameter's slice
    in blocks of ``bits``, any other's sent as it is."""
    return ChunkCodec(segments_for(padded_numels, list(floating), group_size, bits), block_size, torch.float32)


class DeltaAllGather(RecordedComm, Auditable, AllGather):
    """One unit's gathers from its node copy, refreshed by coded weight differences ([Note:
    weight differences]). FSDP2 asks for a gather over the unit's shard group (S ranks) in
    forward and in backward; both are served from ``rows`` inside the node.

    Audited ([Note: the audit] in ``zeropp.techniques.audit``), a forward gather holds each
    rank's own row against its chunk of the master shards (FSDP2's gather input), within the
    bound of the row's last difference (0 after a full refresh) and the gather dtype's rounding,
    and its rows against the other nodes' (a digest of 16 bytes each, over the inter-node group:
    a row corrupted on one node would otherwise pass its error to the others through the owner's
    next difference, which is taken against the owner's own row). A row beyond its bound or
    differing from its peers (corrupted memory, a code gone wrong) makes the next forward refresh
    the unit whole, on every rank."""

    technique = "deltas"

    def __init__(self, topology: Topology, shard: ShardGroups, unit: CommGroup, padded_numels: Sequence[int],
                 floating: Sequence[bool], trainable: bool, *, bits: int, block_size: int, audited: bool = False,
                 reference_codec: ChunkCodec | None = None, ledger: CommLedger | None = None) -> None:
        super().__init__(topology, ledger)
        self.shard, self.unit, self.trainable = shard, unit, trainable
        self.param_ids = frozenset(id(p) for p in unit_parameters(unit))
        """The unit's parameters as an optimizer holds them (the primary shards)."""
        self.num_nodes, self.ranks_per_node = shard.placement.num_nodes, shard.placement.ranks_per_node
        self.group_size = self.num_nodes * self.ranks_per_node
        self.node_index = shard.inter_node_group.rank()
        """Which of ``rows`` is this rank's own chunk."""
        self.codec = delta_codec(padded_numels, floating, self.group_size, bits, block_size)
        self.bits, self.audited = bits, audited
        """``audited``: the audit may check the rows, so each difference's bound is kept for it."""
        self.reference_dtype = torch.float32
        """The gather dtype (set by the first gather: FSDP2's input is in it)."""
        self.reference_codec = reference_codec
        """``delta_reference="codes"``: the rows are kept as this codec's INT8 payload rows of the
        chunks (qwZ's code), not as the chunks themselves ([Note: the copy as codes])."""
        self.rows: torch.Tensor | None = None
        """(N, chunk) in the gather dtype, or (N, payload bytes) of ``reference_codec``: chunk
        ``n*D + d`` of the unit for n = 0..N-1, d this rank's index in its node."""
        self.pending = WHOLE
        """What the next forward gather does (the largest decided since the last one)."""
        self.forced = True
        """A full refresh asked for locally (nothing filled yet, a load, ``refresh_weights``, the audit)."""
        self.versions: tuple[int, ...] | None = None
        """The shards' versions when the rows were last decided on."""
        self.stepped = False
        """An optimizer holding the unit's parameters stepped since the last decision."""
        self.stepped_versions: tuple[int, ...] | None = None
        """The shards' versions right after the last optimizer step over them."""
        self.refreshes = {NOTHING: 0, DIFFERENCE: 0, WHOLE: 0}
        """Forward gathers by what they did to the rows first."""
        self.last_bound: torch.Tensor | None = None
        """Per element of this rank's own row: the bound of its last difference's code (fp32,
        block-constant as ``zeropp.codes.bounds`` lays it out), plus the gather dtype's rounding;
        kept only where ``audited`` (a chunk of fp32 per unit)."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, async_op: bool = False) -> dist.Work | None:
        work, complete = self.start(input_tensor, group, async_op, output_tensor)
        if work is not None and async_op:
            return DecodeOnWait(work, lambda: complete(output_tensor))
        if work is not None:
            work.wait()
        complete(output_tensor)
        return None

    def local_need(self) -> int:
        """What this rank's own chunk needs before the next forward ([Note: one decision])."""
        versions = shard_versions([self.unit])
        edited = versions != self.versions and versions != self.stepped_versions
        if self.forced or self.rows is None or edited:
            need = WHOLE
        elif self.stepped and self.trainable:
            need = DIFFERENCE
        else:
            need = NOTHING
        self.versions, self.forced, self.stepped = versions, False, False
        return need

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer`` has stepped: if it holds the unit's parameters, their changes are a step's."""
        if any(id(p) in self.param_ids for group in optimizer.param_groups for p in group["params"]):
            self.stepped = True
            self.stepped_versions = shard_versions([self.unit])

    def start(self, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool,
              output_tensor: torch.Tensor | None) -> Started:
        if group.size() != self.group_size:
            raise RuntimeError(f"weight_deltas: unit {self.recorder.unit!r} was asked to gather over {group.size()} "
                               f"ranks; its node copy serves gathers over its shard group of {self.group_size}")
        chunk = input_tensor.numel()
        self.reference_dtype = input_tensor.dtype
        if output_tensor is None:
            output_tensor = input_tensor.new_empty(chunk * self.group_size)
        action = NOTHING if in_backward() else self.pending
        request = None if in_backward() else self.take_audit()
        if not in_backward():
            self.refreshes[action] += 1
        if action != NOTHING:
            self.pending = NOTHING
            work, complete = self._refresh(action, input_tensor, output_tensor, async_op)
        else:
            work, complete = self._gather_rows(output_tensor, async_op)
        if request is not None:
            complete = complete.followed_by(lambda _: self._check(request, input_tensor))
        return work, complete

    def _check(self, request: Request, master: torch.Tensor) -> None:
        """The audit: this rank's own row against its master chunk, and its rows against those
        of the ranks of its index on the other nodes, which hold the same (a digest of each)."""
        own = self._row_value(self.node_index)
        bound = self.last_bound if self.last_bound is not None else self._coding_bound(own)
        tally = Tally()
        tally.add(self.codec, own, master.view(1, -1), bound.view(1, -1))
        digests = torch.empty((self.num_nodes, 2), dtype=torch.int64, device=own.device)
        all_gather(digests.view(-1), _digest(self.rows), self.shard.inter_node_group, self.recorder, "audit")
        tally.violations += int(not bool((digests == digests[0]).all()))
        if not request.record(self.technique, tally).within_bound:
            self.forced = True

    def _refresh(self, action: int, input_tensor: torch.Tensor, output_tensor: torch.Tensor, async_op: bool
                 ) -> Started:
        """Bring the rows up to date across nodes (async if asked), then gather them in the node."""
        inter = self.shard.inter_node_group
        if action == WHOLE or self.rows is None:
            send = self._stored(input_tensor.view(1, -1))
            arrived = send.new_empty((self.num_nodes, send.shape[1]))
            work = all_gather(arrived.view(-1), send.view(-1), inter, self.recorder, "refresh",
                              dtype=None if self.reference_codec is None else "int8", async_op=async_op)
            self.last_bound = None

            def adopt() -> None:
                self.rows = arrived
        else:
            delta = input_tensor.float().view(1, -1) - self._row_value(self.node_index)
            send = torch.empty((1, self.codec.nbytes), dtype=torch.uint8, device=input_tensor.device)
            self.codec.encode(delta, send)
            arrived = torch.empty((self.num_nodes, self.codec.nbytes), dtype=torch.uint8, device=send.device)
            work = all_gather(arrived.view(-1), send.view(-1), inter, self.recorder, self.technique,
                              dtype=f"int{self.bits}", async_op=async_op)
            own = self.node_index
            bound = coding_bound(self.codec, delta) if self.audited else None
            del delta

            def adopt() -> None:
                self._apply(arrived)
                if bound is not None:
                    self.last_bound = bound + self._coding_bound(self._row_value(own))

        if work is None:
            adopt()
            return self._gather_rows(output_tensor, async_op)
        return work, Completion(arrived, lambda output: self._after(work, adopt, output))

    def _after(self, work: dist.Work, adopt: Callable[[], None], output: torch.Tensor) -> None:
        work.wait()
        adopt()
        self._gather_rows(output, False)[1](output)

    def _apply(self, arrived: torch.Tensor) -> None:
        """Add the N decoded differences to the rows, one row at a time (one chunk of fp32 held),
        as every holder of them does."""
        decoded = torch.empty((1, self.codec.numel), dtype=torch.float32, device=arrived.device)
        for node in range(self.num_nodes):
            self.codec.decode(arrived[node:node + 1], decoded)
            if self.reference_codec is not None:
                self.rows[node:node + 1] = self._stored(self._row_value(node) + decoded)
            elif self.rows.dtype == torch.float32:
                self.rows[node] += decoded[0]
            else:
                self.rows[node].copy_(self.rows[node].float() + decoded[0])

    def _stored(self, chunks: torch.Tensor) -> torch.Tensor:
        """Chunks (rows, chunk) as the rows keep them: in the gather dtype, or coded."""
        dtype = self.reference_dtype
        if self.reference_codec is None:
            return chunks.to(dtype)
        codes = torch.empty((len(chunks), self.reference_codec.nbytes), dtype=torch.uint8, device=chunks.device)
        self.reference_codec.encode(chunks.to(dtype), codes)
        return codes

    def _row_value(self, node: int) -> torch.Tensor:
        """Row ``node`` as the weights it holds, (1, chunk) in fp32."""
        if self.reference_codec is None:
            return self.rows[node:node + 1].float()
        value = torch.empty((1, self.reference_codec.numel), dtype=self.reference_dtype, device=self.rows.device)
        self.reference_codec.decode(self.rows[node:node + 1], value)
        return value.float()

    def _coding_bound(self, value: torch.Tensor) -> torch.Tensor:
        """What keeping ``value`` (1, chunk) in the rows may change of it: the gather dtype's
        rounding of a sum, or the INT8 code's half step."""
        if self.reference_codec is not None:
            return coding_bound(self.reference_codec, value, out_dtype=self.reference_dtype)
        return block_constant(self.codec, _rounding(value.to(self.reference_dtype)))

    def _gather_rows(self, output: torch.Tensor, async_op: bool) -> Started:
        """The S chunks from the node's rows, gathered straight into FSDP2's output and put in chunk
        order there: rank d's row n is chunk n*D + d ([Note: chunk order in place]); rows kept as
        codes are gathered as codes and decoded into the output in chunk order."""
        rows, per_node, nodes = self.rows, self.ranks_per_node, self.num_nodes
        if self.reference_codec is not None:
            received = rows.new_empty((per_node * nodes, rows.shape[1]))
            work = None if per_node == 1 else all_gather(received.view(-1), rows.view(-1), self.shard.intra_node_group,
                                                         self.recorder, "hpZ", dtype="int8", async_op=async_op)
            if per_node == 1:
                received.copy_(rows)

            def decode(written: torch.Tensor) -> None:  # rank d's N rows to chunks n*D + d, one rank's at a time
                chunks = written.view(nodes, per_node, -1)
                rank_rows = chunks.new_empty((nodes, chunks.shape[2]))
                for local in range(per_node):
                    self.reference_codec.decode(received[local * nodes:(local + 1) * nodes], rank_rows)
                    chunks[:, local].copy_(rank_rows)

            return work, Completion(received, decode)
        if per_node == 1:
            output.view_as(rows).copy_(rows)
            return None, Completion(rows, lambda _: None)
        work = all_gather(output.view(-1), rows.view(-1), self.shard.intra_node_group, self.recorder, "hpZ",
                          async_op=async_op)
        return work, Completion(rows, lambda written: in_chunk_order(written.view(self.group_size, -1),
                                                                     per_node, nodes))

    def copy_bytes(self) -> int:
        """Bytes of the rows held (0 before the first gather)."""
        return 0 if self.rows is None else self.rows.numel() * self.rows.element_size()


def in_chunk_order(blocks: torch.Tensor, ranks_per_node: int, num_nodes: int) -> None:
    """Reorder ``blocks`` (D*N, chunk) in place from the node gather's order (rank d's N rows,
    d = 0..D-1) to chunk order (chunk n*D + d at n*D + d).

    [Note: chunk order in place]
    A node gather of the rows lands in rank order: block d*N + n is chunk n*D + d. Gathering
    into a buffer and copying it over transposed would hold a second whole unit (the embedding
    or the head of a large vocabulary: a gigabyte at Llama-3-8B's). The permutation is applied in
    FSDP2's own output instead, cycle by cycle, holding one block: the same copies, one block of
    memory."""
    if ranks_per_node == 1 or num_nodes == 1:
        return
    count = ranks_per_node * num_nodes
    done = [False] * count
    for start in range(count):
        if done[start]:
            continue
        done[start] = True
        source = _source_of(start, ranks_per_node, num_nodes)
        if source == start:
            continue
        held, place = blocks[start].clone(), start
        while source != start:
            blocks[place].copy_(blocks[source])
            done[source] = True
            place, source = source, _source_of(source, ranks_per_node, num_nodes)
        blocks[place].copy_(held)


def _source_of(target: int, ranks_per_node: int, num_nodes: int) -> int:
    """Where the gather put the block that belongs at ``target`` (chunk n*D + d: rank d's row n)."""
    node, local = divmod(target, ranks_per_node)
    return local * num_nodes + node


def _digest(rows: torch.Tensor) -> torch.Tensor:
    """Two integers that differ where two copies of ``rows`` differ in any bit (but for a
    collision): the sum of their bytes as integers, and the sum weighted by position."""
    bits = rows.contiguous().view(-1).view(torch.uint8).long()
    return torch.stack([bits.sum(), (bits * torch.arange(1, len(bits) + 1, device=bits.device)).sum()])


def _rounding(row: torch.Tensor) -> torch.Tensor:
    """Per element, what adding a decoded difference to ``row`` in its dtype may round off (a
    whole ulp, for the difference's own fp32 rounding too)."""
    eps = torch.finfo(row.dtype).eps if row.dtype != torch.float32 else 2.0 ** -22
    return eps * row.float().abs().view(1, -1)


@dataclass
class WeightDeltas:
    """The delta comms of one sharded model and the decision that drives them ([Note: one decision])."""

    comms: list[DeltaAllGather]
    topology: Topology

    def decide(self) -> None:
        """Every rank's needs, per unit, made every rank's (the largest), and set on each comm."""
        needs = torch.tensor([comm.local_need() for comm in self.comms], dtype=torch.uint8)
        needs = needs.to(_device_of(self.comms))
        all_reduce(needs, dist.ReduceOp.MAX, None, self.comms[0].recorder, "deltas")
        for comm, need in zip(self.comms, needs.tolist()):
            comm.pending = max(comm.pending, need)

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer over some of the model's parameters has stepped."""
        for comm in self.comms:
            comm.after_step(optimizer)

    def force_whole(self) -> None:
        for comm in self.comms:
            comm.forced = True


def _device_of(comms: Sequence[DeltaAllGather]) -> torch.device:
    for comm in comms:
        if comm.rows is not None:
            return comm.rows.device
    backend = dist.get_backend()
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


_MODELS: weakref.WeakKeyDictionary[nn.Module, WeightDeltas] = weakref.WeakKeyDictionary()


def keep_weight_deltas(model: nn.Module, comms: list[DeltaAllGather], topology: Topology) -> None:
    """Drive ``comms`` from ``model``'s root forward, its optimizer steps and its loads
    ([Note: one decision]); a model enabled again keeps its hooks and takes the new comms."""
    first = model not in _MODELS
    _MODELS[model] = WeightDeltas(comms, topology)
    if first:
        model.register_forward_pre_hook(_decide, prepend=True)
        model.register_load_state_dict_pre_hook(_loading)
        reference = weakref.ref(model)
        on_step(model, lambda optimizer: _stepped(reference, optimizer))


def _decide(model: nn.Module, _: object) -> None:
    _MODELS[model].decide()


def _loading(model: nn.Module, *_: object) -> None:
    _MODELS[model].force_whole()


def _stepped(reference: weakref.ref[nn.Module], optimizer: torch.optim.Optimizer) -> None:
    model = reference()
    if model is not None and model in _MODELS:
        _MODELS[model].after_step(optimizer)


def weight_deltas_of(model: nn.Module) -> WeightDeltas | None:
    """The weight deltas installed on ``model`` (None without ``weight_deltas``)."""
    return _MODELS.get(model)


def refresh_weights(model: nn.Module) -> None:
    """Send ``model``'s weights whole across nodes at its next forward, replacing the node
    copy's differences ([Note: weight differences]): after changing the weights in a way zeropp
    cannot see (a change through another reference to the same storage). Every rank must call it.
    A model without ``weight_deltas`` has no copy to refresh: nothing happens."""
    deltas = _MODELS.get(model)
    if deltas is not None:
        deltas.force_whole()


def copy_checksums(model: nn.Module) -> list[str]:
    """A digest of this rank's rows of every unit's node copy: equal on the ranks of one local
    index on every node, which hold the same rows ([Note: weight differences])."""
    deltas = _MODELS.get(model)
    if deltas is None:
        return []
    return [hashlib.sha256(comm.rows.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:16]
            if comm.rows is not None else "" for comm in deltas.comms]


def held_copy_bytes(model: nn.Module) -> int:
    """Bytes of node copies held on this rank (every unit's rows)."""
    deltas = _MODELS.get(model)
    return 0 if deltas is None else sum(comm.copy_bytes() for comm in deltas.comms)


__all__ = ["DeltaAllGather", "WeightDeltas", "copy_checksums", "held_copy_bytes", "keep_weight_deltas",
           "refresh_weights", "weight_deltas_of"]
