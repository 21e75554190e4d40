"""Quantized HSDP: the gradients' all-reduce across replicas as quantized traffic.

HSDP (``fully_shard`` on a (replicate, shard) mesh) reduce-scatters each unit's gradients inside
its shard group, usually a node, then all-reduces the shard across the replicas, which sit on
different nodes: that all-reduce is all of HSDP's cross-node traffic, and FSDP2 sends it in the
reduce dtype. With ``ZeroPPConfig.quantized_replica_gradients`` the unit's reduce-scatter comm
does the whole reduction ([Note: the replicas' reduction]) and FSDP2's all-reduce is turned off
(``access.set_replicas_reduced_by_comm``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from zeropp.codes.codec import ChunkCodec
from zeropp.fsdp.comms import LateReduceScatter, all_gather, defer_last_stage, reduction_of
from zeropp.fsdp.ledger import CommLedger
from zeropp.setup.topology import ProcessGroups, ShardGroups, Topology
from zeropp.techniques.qgz import HierarchicalQuantizedReduceScatter


class ReplicatedReduceScatter(LateReduceScatter):
    """[Note: the replicas' reduction]
    A unit's gradient reduction under HSDP with R replicas of a shard group of S ranks, in three
    steps, each rank ending with the same values as every replica of its shard:
    1. ``shard``: the reduce-scatter inside the shard group FSDP2 asked for (qgZ's, or FSDP2's own
       counted), giving this rank's chunk reduced over its shard group.
    2. the chunk as R rows, each parameter's slice cut in R parts (so no block spans two
       parameters), reduce-scattered across the replicas by qgZ's one hop (R nodes of one rank):
       the R - 1 rows owed to the other replicas travel in ``bits`` (own row exact), each
       replica sums its row in fp32.
    3. that row coded once more and all-gathered across the replicas; every replica, the owner
       too, decodes every row from the same codes, so the replicas hold the same gradients and
       the same weights after the step (they never drift apart).
    Cross-node bytes per rank: 2 (R - 1) / R x the chunk x bits / 8 against 2 (R - 1) / R x the
    chunk x 4 for a ring all-reduce in fp32: 8x less at INT4. The error of an element: half a
    step of each of the R - 1 rows it was sent in, plus half a step of the reduced row's block.
    AVG divides by R (the shard's AVG divided by S already), as does SUM when FSDP2 divides by
    its default factor afterwards (it counts only the shard group once this comm reduces the
    replicas); PREMUL_SUM and SUM with the unit's own factor sum.

    [Note: the replicas' reduction beside backward]
    With ``overlap`` (and the unit's gradients read only after backward, [Note: late
    reduce-scatter] in ``zeropp.fsdp.comms``), steps 2 and 3 cross nodes while backward goes on,
    as FSDP2 overlaps its own all-reduce across replicas: the call runs step 1 inside the node,
    starts step 2's all-to-all and returns; when the next unit's call has started its own, the
    first one's rows are summed and step 3's all-gather started; when the one after that comes
    (or backward ends), it is decoded into the output. Every rank issues the same collectives
    on the replicas' group in the same order, and each value is computed as without
    ``overlap``: the gradients are the same, bit for bit."""

    technique = "replicas"

    def __init__(self, groups: ProcessGroups, shard: LateReduceScatter, replicate_group: dist.ProcessGroup,
                 chunk_numels: Sequence[int], full_precision: Sequence[bool], *, bits: int, block_size: int,
                 divides_by_default_factor: bool, ledger: CommLedger | None = None) -> None:
        super().__init__(groups.topology, ledger)
        self.shard = shard
        """The reduce-scatter inside the shard group (step 1)."""
        self.replicate_group = replicate_group
        self.num_replicas = replicate_group.size()
        self.chunk_numels = list(chunk_numels)
        """Each trainable parameter's slice of this rank's chunk."""
        self.parts = [-(-numel // self.num_replicas) for numel in self.chunk_numels]
        """Each parameter's part of a replica's row."""
        self.divides_by_default_factor = divides_by_default_factor
        placement = ShardGroups(Topology(num_nodes=self.num_replicas, ranks_per_node=1),
                                tuple(dist.get_process_group_ranks(replicate_group)), None, replicate_group)
        self.reduce = HierarchicalQuantizedReduceScatter(
            groups, [part * self.num_replicas for part in self.parts], bits_intra=bits, bits_inter=bits,
            block_size=block_size, full_precision=full_precision, shard=placement, ledger=ledger)
        self.reduce.technique = self.technique

    @property
    def row_codec(self) -> ChunkCodec:
        """The code of a replica's row: qgZ's hop, per parameter part."""
        return self.reduce.codec(sum(self.parts), self.reduce.bits_inter)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op: dist.ReduceOp, async_op: bool = False) -> dist.Work | None:
        self.shard(output_tensor, input_tensor, group, op)
        reduction = reduction_of(op)
        if output_tensor.numel() != sum(self.chunk_numels):
            raise RuntimeError(f"quantized HSDP got a chunk of {output_tensor.numel()} elements; the unit's "
                               f"trainable parameters make {sum(self.chunk_numels)}")
        if self.num_replicas > 1 and self.finishes_late(output_tensor, op):
            rows = self._as_rows(output_tensor.view(-1).float())
            reduced = rows.new_empty(rows.shape[1])
            summed = self.reduce.start_late(reduced, rows, reduction_of(dist.ReduceOp.SUM), self.replicate_group)
            self.complete(functools.partial(self._gather_late, summed, reduced, rows, output_tensor,
                                            reduction.kind), True)
            return None
        self.complete(lambda: self._reduce_replicas(output_tensor, reduction.kind), False)
        return None

    def _reduce_replicas(self, output_tensor: torch.Tensor, kind: dist.ReduceOp.RedOpType) -> None:
        rows = self._as_rows(output_tensor.view(-1).float())
        reduced = rows.new_empty(rows.shape[1])
        self.reduce(reduced, rows.view(-1), self.replicate_group, dist.ReduceOp.SUM)
        self._gather(reduced, rows, output_tensor, kind, async_op=False)()

    def _gather(self, reduced: torch.Tensor, rows: torch.Tensor, output_tensor: torch.Tensor,
                kind: dist.ReduceOp.RedOpType, async_op: bool) -> Callable[[], None]:
        """Step 3 started: this rank's reduced row coded and all-gathered across the replicas;
        what it returns waits, decodes every row and writes ``output_tensor``."""
        codec = self.row_codec
        mine = torch.empty((1, codec.nbytes), dtype=torch.uint8, device=rows.device)
        codec.encode(reduced.view(1, -1), mine)
        received = torch.empty((self.num_replicas, codec.nbytes), dtype=torch.uint8, device=rows.device)
        work = all_gather(received.view(-1), mine.view(-1), self.replicate_group, self.recorder, self.technique,
                          dtype=f"int{self.reduce.bits_inter}", async_op=async_op)

        def write() -> None:
            if work is not None:
                work.wait()
            codec.decode(received, rows)
            if kind == dist.ReduceOp.AVG or (kind == dist.ReduceOp.SUM and self.divides_by_default_factor):
                rows.div_(self.num_replicas)
            self._from_rows(rows, output_tensor.view(-1))
        return write

    def _gather_late(self, summed: Callable[[], None], reduced: torch.Tensor, rows: torch.Tensor,
                     output_tensor: torch.Tensor, kind: dist.ReduceOp.RedOpType) -> None:
        """Steps 2 and 3 of a late call: see [Note: the replicas' reduction beside backward]."""
        summed()
        write = self._gather(reduced, rows, output_tensor, kind, async_op=True)
        if self.after_reduce is None:
            defer_last_stage(write)
        else:  # the unit's optimizer step follows at once (``zeropp.optimizer_in_backward``)
            write()

    def _as_rows(self, chunk: torch.Tensor) -> torch.Tensor:
        """The chunk as R rows: row r holds part r of every parameter's slice (zero-padded)."""
        rows = chunk.new_zeros((self.num_replicas, sum(self.parts)))
        start = column = 0
        for numel, part in zip(self.chunk_numels, self.parts):
            padded = chunk.new_zeros(part * self.num_replicas)
            padded[:numel] = chunk[start:start + numel]
            rows[:, column:column + part] = padded.view(self.num_replicas, part)
            start, column = start + numel, column + part
        return rows

    def _from_rows(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        """``_as_rows`` undone, into ``out`` in its dtype."""
        start = column = 0
        for numel, part in zip(self.chunk_numels, self.parts):
            out[start:start + numel] = rows[:, column:column + part].reshape(-1)[:numel]
            start, column = start + numel, column + part

