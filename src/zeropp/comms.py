"""The recorded primitives: the only module that calls torch.distributed collectives.

Each primitive records what this rank moves in the ledger and then issues one collective, in one
function, so no byte leaves without being counted and no count is made for a byte that does not
leave. The ZeRO++ comms (``qwz``, ``qgz``) and the engine build on them; ``CountingAllGather``
and ``CountingReduceScatter`` are FSDP2's default collectives, counted, for plain ZeRO-3.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from zeropp._fsdp import AllGather, ReduceScatter, at_backward_end, backward_id, in_backward
from zeropp.ledger import CommLedger, GroupInfo, Op, comm_ledger
from zeropp.topology import Topology

# torch 2.13 renamed the tensor collectives; 2.11 has only the old names.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op: dist.ReduceOp,
                           group: dist.ProcessGroup, async_op: bool) -> dist.Work | None:
    if hasattr(dist, "reduce_scatter_single"):
        return dist.reduce_scatter_single(output, input, op=op, group=group, async_op=async_op)
    return dist.reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)


def nbytes(tensor: torch.Tensor) -> int:
    """Bytes of a tensor's elements."""
    return tensor.numel() * tensor.element_size()


class Recorder:
    """Where collectives are recorded: a ledger, the topology, and a per-group cache of the link
    facts the ledger needs (computed once per process group)."""

    def __init__(self, topology: Topology, ledger: CommLedger | None = None) -> None:
        self.topology = topology
        self.ledger = ledger if ledger is not None else comm_ledger()
        self._groups: dict[dist.ProcessGroup, GroupInfo] = {}

    def group_info(self, group: dist.ProcessGroup) -> GroupInfo:
        info = self._groups.get(group)
        if info is None:
            ranks = dist.get_process_group_ranks(group)
            info = self._groups[group] = GroupInfo.of(self.topology, ranks, dist.get_rank(),
                                                      str(dist.get_backend(group)))
        return info

    def record(self, op: Op, group: dist.ProcessGroup, bytes_per_peer: int, dtype: torch.dtype | str,
               technique: str) -> None:
        self.ledger.record(op, self.group_info(group), bytes_per_peer, dtype, technique)


def all_gather(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, recorder: Recorder,
               technique: str, *, dtype: torch.dtype | str | None = None,
               async_op: bool = False) -> dist.Work | None:
    """Every rank's ``input`` into ``output`` (rank order). ``dtype`` labels the payload in the
    ledger when it is not the tensor's own (a packed uint8 payload of INT8 codes is "int8")."""
    recorder.record(Op.ALL_GATHER, group, nbytes(input), dtype or input.dtype, technique)
    return _all_gather_tensor(output, input, group=group, async_op=async_op)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup,
                   recorder: Recorder, technique: str, *, async_op: bool = False) -> dist.Work | None:
    """This rank's chunk of ``input`` reduced with ``op`` over the group, into ``output``."""
    recorder.record(Op.REDUCE_SCATTER, group, nbytes(output), input.dtype, technique)
    return _reduce_scatter_tensor(output, input, op, group, async_op)


def all_to_all(output: torch.Tensor, input: torch.Tensor, split_sizes: list[int], group: dist.ProcessGroup,
               recorder: Recorder, technique: str, *, dtype: torch.dtype | str,
               async_op: bool = False) -> dist.Work | None:
    """Send ``split_sizes[peer]`` elements of ``input`` to each peer and receive as many from
    it, in rank order (the same splits both ways). The ledger counts the largest split as what
    goes to each peer (zeropp's exchanges send equal splits to every peer but themselves)."""
    bytes_per_peer = max(split_sizes, default=0) * input.element_size()
    recorder.record(Op.ALL_TO_ALL, group, bytes_per_peer, dtype, technique)
    return dist.all_to_all_single(output, input, output_split_sizes=split_sizes, input_split_sizes=split_sizes,
                                  group=group, async_op=async_op)


def all_reduce_sum(buffer: torch.Tensor, group: dist.ProcessGroup | None, recorder: Recorder,
                   technique: str) -> None:
    """Sum ``buffer`` over the group (default: the world), in place."""
    recorder.record(Op.ALL_REDUCE, group or dist.group.WORLD, nbytes(buffer), buffer.dtype, technique)
    dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group)


def broadcast(tensor: torch.Tensor, source_rank: int, group: dist.ProcessGroup | None, recorder: Recorder,
              technique: str) -> None:
    """Every rank's ``tensor`` becomes ``source_rank``'s (a global rank), in place. The ledger
    counts the source's sends: ``tensor`` to every peer."""
    group = group or dist.group.WORLD
    bytes_per_peer = nbytes(tensor) if dist.get_rank() == source_rank else 0
    recorder.record(Op.BROADCAST, group, bytes_per_peer, tensor.dtype, technique)
    dist.broadcast(tensor, src=source_rank, group=group)


def all_gather_strings(value: str, group: dist.ProcessGroup | None = None) -> list[str]:
    """Every rank's ``value`` (e.g. its hostname), in rank order. Used once at start-up; not
    counted (a few bytes, before training)."""
    out: list[str] = [""] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


class RecordedComm:
    """Shared by zeropp's FSDP2 comms: the technique its bytes are booked under, and a recorder."""

    technique = "fsdp"

    def __init__(self, topology: Topology, ledger: CommLedger | None = None) -> None:
        self.topology = topology
        self.recorder = Recorder(topology, ledger)

    @property
    def ledger(self) -> CommLedger:
        return self.recorder.ledger

    def group_info(self, group: dist.ProcessGroup) -> GroupInfo:
        return self.recorder.group_info(group)

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class LateReduceScatter(RecordedComm, ReduceScatter):
    """A reduce-scatter that may return before its output is written: see [Note: late
    reduce-scatter].

    [Note: late reduce-scatter]
    FSDP2 on CPU has no streams: it calls the reduce-scatter and reads the output at once, so
    the transfer of every unit's gradients stops backward. Yet, when nothing reads a unit's
    gradients before backward ends (``_fsdp.gradients_read_only_after_backward``: each sharded
    gradient is a bare view of the output), the output may be written later. With ``overlap``
    such a comm starts its (last) collective asynchronously and hands ``finish_late`` what
    remains (wait, decode, sum, write the output). At most one unit is left unfinished: the
    next unit's call, once its own collective is on its way, finishes the previous one, and
    the end of backward finishes the last (an autograd end-of-backward callback, which runs
    before ``backward()`` returns). So the transfer of unit i runs while unit i-1's backward
    computes, and the gradients are complete, bit for bit as without ``overlap``, when the
    caller next sees them. A backward pass that starts while another's work is unfinished (a
    reentrant checkpoint's inner backward, or one after a failed backward) finishes it first.
    """

    may_finish_late: Callable[[torch.dtype, dist.ReduceOp], bool] | None = None
    """Set by ``zeropp.shard`` with ``overlap``: whether a call with this reduce dtype and op may
    leave its output unwritten until backward ends (the unit's gradients are read no sooner)."""

    def finishes_late(self, output_tensor: torch.Tensor, op: dist.ReduceOp) -> bool:
        return (self.may_finish_late is not None and in_backward()
                and self.may_finish_late(output_tensor.dtype, op))


_unfinished: deque[Callable[[], None]] = deque()
_unfinished_backward = [-1]  # the backward pass whose end finishes ``_unfinished``


def finish_late(finish: Callable[[], None]) -> None:
    """Run ``finish`` after the next late reduce-scatter starts, or when backward ends: see
    [Note: late reduce-scatter]. Call it inside backward."""
    backward = backward_id()
    if _unfinished_backward[0] != backward:
        finish_unfinished()
        _unfinished_backward[0] = backward
        at_backward_end(finish_unfinished)
    _unfinished.append(finish)
    while len(_unfinished) > 1:
        _unfinished.popleft()()


def finish_unfinished() -> None:
    """Finish every late reduce-scatter, oldest first."""
    _unfinished_backward[0] = -1
    while _unfinished:
        _unfinished.popleft()()


class CountingAllGather(RecordedComm, AllGather):
    """FSDP2's default all-gather, counted in the ledger."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, async_op: bool = False) -> dist.Work | None:
        return all_gather(output_tensor, input_tensor, group, self.recorder, self.technique, async_op=async_op)


class CountingReduceScatter(LateReduceScatter):
    """FSDP2's default reduce-scatter, counted in the ledger."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op: dist.ReduceOp, async_op: bool = False) -> dist.Work | None:
        late = not async_op and self.finishes_late(output_tensor, op)
        work = reduce_scatter(output_tensor, input_tensor, op, group, self.recorder, self.technique,
                              async_op=async_op or late)
        if late:
            finish_late(work.wait)
            return None
        return work


def all_reduce_mean(value: torch.Tensor, topology: Topology, group: dist.ProcessGroup | None = None) -> float:
    """The mean of a scalar over ``group`` (default: the world), e.g. a loss for logging."""
    buffer = value.detach().float().reshape(1).clone()
    all_reduce_sum(buffer, group, Recorder(topology), "metrics")
    return buffer.item() / dist.get_world_size(group)


def global_grad_norm_and_overflow(local_grads: Sequence[torch.Tensor], topology: Topology,
                                  device: torch.device) -> tuple[float, bool]:
    """The L2 norm of the gradient over every rank's shards, and whether any element on any rank
    is non-finite: one all-reduce of two numbers (fp64). ``local_grads`` are this rank's shards
    (plain tensors, not DTensors), each element owned by exactly one rank."""
    norms = [torch.linalg.vector_norm(g, 2) for g in local_grads]
    local = torch.stack(norms).double() if norms else torch.zeros(0, dtype=torch.float64, device=device)
    buffer = torch.stack([local.square().sum(), (~torch.isfinite(local)).sum().double()]).to(device)
    all_reduce_sum(buffer, None, Recorder(topology), "engine")
    sum_of_squares, num_nonfinite = buffer.tolist()
    return sum_of_squares ** 0.5, num_nonfinite > 0 or sum_of_squares != sum_of_squares
