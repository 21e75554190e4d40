"""hpZ on a 2-D mesh (tensor parallel x FSDP): the secondary copy zeropp keeps itself where FSDP2
cannot reshard a unit's DTensor parameters after forward ([Note: hpZ on a 2-D mesh])."""

from __future__ import annotations

import torch
import torch.distributed as dist

from zeropp.codes.codec import ChunkCodec
from zeropp.fsdp.access import in_backward
from zeropp.fsdp.comms import Completion, CountingAllGather, Started, all_gather, buffered
from zeropp.fsdp.ledger import CommLedger
from zeropp.setup.topology import Topology


class NodeCopy:
    """[Note: hpZ on a 2-D mesh]
    On a tensor parallel x FSDP mesh FSDP2 cannot reshard a unit's DTensor parameters to a
    smaller mesh after forward, so it has no secondary copy to give; zeropp keeps one itself. The
    unit reshards fully after forward (FSDP2's ``True``). Its forward gather over the S ranks of
    its data-parallel group received S rows (qwZ's payload rows, or without qwZ the S gathered
    chunks, ``NodeCopyAllGather``); of the h = S / N of those ranks on this rank's node, the one
    at index i keeps rows i S/h .. (i + 1) S/h - 1 (a copy of those rows alone). Backward's
    gather, which FSDP2 asks of the whole data-parallel group, is served by an all-gather of the
    kept rows over the h ranks of the node instead: in index order they are the S rows (decoded
    into FSDP2's output as the forward decoded them, with qwZ), so the weights are bit for bit
    the forward's and no byte of it crosses a node. The copy is taken by
    backward's gather; a forward that does not reach backward leaves it until the unit's next
    forward replaces it. Weights changed between a forward and its backward (a step, a load) do
    not reach that backward: it computes with the weights the forward used, as autograd does."""

    def __init__(self, group_size: int, node_group: dist.ProcessGroup, index: int) -> None:
        self.group_size = group_size
        """Ranks of the unit's data-parallel group (S)."""
        self.node_group = node_group
        """Its ranks on this rank's node (h of them), the group backward's gather runs over."""
        self.partition_size = node_group.size()
        self.rows_per_copy = group_size // self.partition_size
        self._first_row = index * self.rows_per_copy
        self._held: torch.Tensor | None = None

    def received(self, rows: torch.Tensor, codec: ChunkCodec | None = None) -> None:
        """A forward gather's rows (S, row): keep this rank's S/h of them."""
        if len(rows) == self.group_size and not in_backward():
            self._held = rows[self._first_row:self._first_row + self.rows_per_copy].clone()

    def take(self, group_size: int) -> torch.Tensor | None:
        """The kept rows for backward's gather over the data-parallel group, once."""
        if group_size != self.group_size or not in_backward():
            return None
        held, self._held = self._held, None
        return held

    def drop(self) -> None:
        self._held = None

    @property
    def held_bytes(self) -> int:
        return 0 if self._held is None else self._held.numel()


class NodeCopyAllGather(CountingAllGather):
    """hpZ without qwZ on a 2-D mesh: FSDP2's gather, counted, whose forward keeps this rank's
    rows of the gathered chunks on the node and whose backward gathers them inside the node
    ([Note: hpZ on a 2-D mesh])."""

    def __init__(self, topology: Topology, copy: NodeCopy, ledger: CommLedger | None = None) -> None:
        super().__init__(topology, ledger)
        self.copy = copy

    def start(self, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool,
              output_tensor: torch.Tensor | None) -> Started:
        if output_tensor is None:
            output_tensor = input_tensor.new_empty(input_tensor.numel() * group.size())
        held = self.copy.take(group.size())
        if held is not None:
            work = all_gather(output_tensor, held.view(-1), self.copy.node_group, self.recorder, "hpZ",
                              async_op=async_op)
            return work, buffered(output_tensor)
        work = all_gather(output_tensor, input_tensor, group, self.recorder, self.technique, async_op=async_op)
        gathered = output_tensor

        def write_and_keep(output: torch.Tensor) -> None:
            if output.data_ptr() != gathered.data_ptr():
                output.copy_(gathered)
            self.copy.received(output.view(group.size(), -1))

        return work, Completion(gathered, write_and_keep)
