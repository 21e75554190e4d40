"""The recorded primitives: the only module that calls torch.distributed collectives.

Each primitive records what this rank moves in the ledger and then issues one collective, in one
function, so no byte leaves without being counted and no count is made for a byte that does not
leave. The ZeRO++ comms (``qwz``, ``qgz``) and the engine build on them; ``CountingAllGather``
and ``CountingReduceScatter`` are FSDP2's default collectives, counted, for plain ZeRO-3.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import itertools
import os
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from zeropp.fsdp.access import AllGather, ReduceScatter, at_backward_end, backward_id, in_backward, reduce_op_parts
from zeropp.fsdp.ledger import CommLedger, GroupInfo, Op, comm_ledger
from zeropp.setup.topology import Topology

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


TIMEOUT_ENV = "ZEROPP_TIMEOUT_S"


def collective_timeout_s() -> float | None:
    """Seconds a collective waits for its peers before raising, from ``ZEROPP_TIMEOUT_S``; None
    when unset (the backend's default: 30 min for gloo, 10 min for NCCL)."""
    raw = os.environ.get(TIMEOUT_ENV)
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"environment variable {TIMEOUT_ENV}={raw!r} must be a number of seconds > 0")
    return value


class CollectiveError(RuntimeError):
    """A collective zeropp issued failed: see [Note: a peer that dies]."""


class Recorder:
    """Where collectives are recorded: a ledger, and the topology that classifies each group's
    links (``group_info``)."""

    def __init__(self, topology: Topology, ledger: CommLedger | None = None) -> None:
        self.topology = topology
        self.ledger = ledger if ledger is not None else comm_ledger()
        self.unit = ""
        """The unit whose collectives these are (its path in the model), named when one fails."""
        self.phase: str | None = None
        """The phase its collectives are booked under ("backward" for a gradient reduction,
        wherever it runs); None: the phase running ("backward" inside autograd's backward)."""

    def group_info(self, group: dist.ProcessGroup) -> GroupInfo:
        return group_info(self.topology, group)

    def record(self, op: Op, group: dist.ProcessGroup, bytes_per_peer: int, dtype: torch.dtype | str,
               technique: str) -> None:
        self.ledger.record(op, self.group_info(group), bytes_per_peer, dtype, technique, self.phase)

    def issue(self, op: Op, group: dist.ProcessGroup | None, technique: str,
              collective: Callable[[], dist.Work | None], tensors: tuple[torch.Tensor, ...]) -> dist.Work | None:
        """Run ``collective`` (a torch.distributed call on ``tensors``); its failure, now or when
        its work is waited for, is raised as a ``CollectiveError`` saying which collective of
        which unit failed: see [Note: a peer that dies]. Inside ``holding_tensors`` the tensors
        are also noted with their use counts ([Note: the backend lets go after the wait]).

        [Note: a peer that dies]
        When a rank dies (killed, out of memory) or stops calling collectives (stuck, or a
        branch the others did not take), its peers' next collective fails: at once where the
        backend sees the connection close (gloo), or when the wait gives up (``ZEROPP_TIMEOUT_S``,
        else the backend's 30 min for gloo). The backend's message names a socket; zeropp adds
        the technique, the collective, the unit and the group, so the surviving ranks say where
        the step stopped, raise and exit non-zero (torchrun then restarts the job, which resumes
        from the last checkpoint). NCCL aborts the process from its watchdog instead (a
        timeout in its log, with the collective's sequence number)."""
        if _held is not None:
            _held.extend((tensor, tensor._use_count()) for tensor in tensors)
        try:
            work = collective()
        except RuntimeError as error:
            raise self.failure(op, group, technique, error) from error
        return None if work is None else NamedWork(work, lambda error: self.failure(op, group, technique, error))

    def failure(self, op: Op, group: dist.ProcessGroup | None, technique: str, error: Exception) -> CollectiveError:
        """The error a failed collective raises, in zeropp's terms."""
        info = self.group_info(group or dist.group.WORLD)
        unit = f" of unit {self.unit!r}" if self.unit else ""
        timeout = collective_timeout_s()
        waited = (f"{TIMEOUT_ENV}={timeout:g} s" if timeout else
                  f"zeropp.initialize's timeout_s, else the backend's default, 30 min for gloo; {TIMEOUT_ENV} sets it")
        return CollectiveError(
            f"zeropp: the {technique} {op.value}{unit} over the {info.kind.value} group ({info.size} ranks) failed on "
            f"rank {dist.get_rank()}: a peer rank died or stopped calling collectives (the wait is bounded by "
            f"{waited}). "
            f"Every rank must run the same forward and backward. The backend said: {error}")


class NamedWork(dist.Work):
    """A collective in flight whose failure, when waited for, is raised in zeropp's terms."""

    def __init__(self, work: dist.Work, failure: Callable[[Exception], CollectiveError]) -> None:
        super().__init__()
        self._work, self._failure = work, failure

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        try:
            return self._work.wait()
        except RuntimeError as error:
            raise self._failure(error) from error


_GROUP_INFO: dict[tuple[Topology, dist.ProcessGroup], GroupInfo] = {}


def group_info(topology: Topology, group: dist.ProcessGroup) -> GroupInfo:
    """The link facts the ledger needs about ``group``, built once per process group and topology
    and shared by every comm of every unit and every call after: building them reads the
    group's ranks and each one's node, work that grows with the world (4,096 ranks on the world
    group), while a collective's hot path only looks them up."""
    info = _GROUP_INFO.get((topology, group))
    if info is None:
        ranks = dist.get_process_group_ranks(group)
        info = _GROUP_INFO[(topology, group)] = GroupInfo.of(topology, ranks, dist.get_rank(),
                                                              str(dist.get_backend(group)))
    return info


def all_gather(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, recorder: Recorder,
               technique: str, *, dtype: torch.dtype | str | None = None,
               async_op: bool = False) -> dist.Work | None:
    """Every rank's ``input`` into ``output`` (rank order). ``dtype`` labels the payload in the
    ledger when it is not the tensor's own (a packed uint8 payload of INT8 codes is "int8")."""
    recorder.record(Op.ALL_GATHER, group, nbytes(input), dtype or input.dtype, technique)
    return recorder.issue(Op.ALL_GATHER, group, technique,
                          lambda: _all_gather_tensor(output, input, group=group, async_op=async_op),
                          (output, input))


@dataclass(frozen=True)
class Reduction:
    """What a gradient reduce-scatter computes from the ranks' chunks: their sum, divided by the
    group's size (AVG) or with every chunk multiplied by ``factor`` first (PREMUL_SUM). See
    [Note: the reductions FSDP2 asks for].

    [Note: the reductions FSDP2 asks for]
    FSDP2 (``_fsdp_collectives.foreach_reduce`` and ``_get_gradient_divide_factors``, the same
    in torch 2.11 and 2.13) hands a reduce-scatter comm one of three ops, never another:
    - reduce dtype fp32 or bf16, sums not forced: AVG by default, and when the unit's
      ``set_gradient_divide_factor(f)`` equals the shard group's size; any other ``f``:
      PREMUL_SUM with factor 1/f (torchtitan sets f = 1.0, so PREMUL_SUM(1.0)). Nothing
      divides the output after the collective.
    - sums forced (``set_force_sum_reduction_for_comms(True)``, and always on MTIA): SUM, and
      FSDP2 divides the output by ``f`` (default: the data-parallel size) after it.
    - any other reduce dtype (fp16, for overflow's sake): SUM, with the input divided by a power
      of two about sqrt(f) before and the output by the rest after.
    With HSDP the op runs on the shard group and an all-reduce follows; with one rank no comm
    is called. PREMUL_SUM is NCCL's: each rank's input times the factor, then summed. Gloo
    cannot run it, so on any backend but NCCL the primitive multiplies the input by the factor
    and sums: the same products rounded the same way as NCCL's (summing first and scaling the
    sum would round differently unless the factor is a power of two). The input is FSDP2's
    scratch buffer, never read after the call (FSDP2 itself divides it in place before an fp16
    sum), so it is scaled in place. qgZ sums in fp32 and applies the factor (or AVG's division)
    once, to the total.
    """

    kind: dist.ReduceOp.RedOpType
    factor: float | None = None
    """PREMUL_SUM's factor; None for AVG and SUM."""

    def apply(self, total: torch.Tensor, group_size: int) -> torch.Tensor:
        """The reduction of a sum ``total`` over ``group_size`` ranks, in place."""
        if self.kind == dist.ReduceOp.AVG:
            return total.div_(group_size)
        if self.factor is not None and self.factor != 1:
            return total.mul_(self.factor)
        return total


_SUPPORTED_REDUCTIONS = ("ReduceOp.AVG, ReduceOp.SUM, or ReduceOp.PREMUL_SUM with a float factor "
                         "(dist._make_nccl_premul_sum(factor)), the ops FSDP2 asks for")


def reduction_of(op: dist.ReduceOp) -> Reduction:
    """The reduction ``op`` asks for; a ValueError for an op FSDP2 never passes (MAX, a
    PREMUL_SUM whose factor is a per-rank tensor, ...)."""
    kind, factor = reduce_op_parts(op)
    if kind in (dist.ReduceOp.AVG, dist.ReduceOp.SUM):
        return Reduction(kind)
    if kind == dist.ReduceOp.PREMUL_SUM and isinstance(factor, float):
        return Reduction(kind, factor)
    shown = f"ReduceOp.{kind.name}" + (f" with factor {factor!r}" if factor is not None else "")
    raise ValueError(f"a gradient reduce-scatter with {shown} is not supported; supported: {_SUPPORTED_REDUCTIONS}")


def runs_premul_sum(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether the backend that runs ``group``'s collectives on ``device`` has PREMUL_SUM (NCCL)."""
    backends = dict(entry.split(":") for entry in dist.get_backend_config(group).split(","))
    return backends.get(device.type) == "nccl"


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup,
                   recorder: Recorder, technique: str, *, async_op: bool = False) -> dist.Work | None:
    """This rank's chunk of ``input`` reduced with ``op`` over the group, into ``output``. A
    PREMUL_SUM on a backend without it multiplies ``input`` in place and sums ([Note: the
    reductions FSDP2 asks for])."""
    reduction = reduction_of(op)
    if reduction.factor is not None and not runs_premul_sum(group, input.device):
        if reduction.factor != 1:
            input.mul_(reduction.factor)
        op = dist.ReduceOp.SUM
    recorder.record(Op.REDUCE_SCATTER, group, nbytes(output), input.dtype, technique)
    return recorder.issue(Op.REDUCE_SCATTER, group, technique,
                          lambda: _reduce_scatter_tensor(output, input, op, group, async_op), (output, input))


def all_to_all(output: torch.Tensor, input: torch.Tensor, split_sizes: list[int], group: dist.ProcessGroup,
               recorder: Recorder, technique: str, *, dtype: torch.dtype | str,
               async_op: bool = False) -> dist.Work | None:
    """Send ``split_sizes[peer]`` elements of ``input`` to each peer and receive as many from
    it, in rank order (the same splits both ways). The ledger counts the largest split as what
    goes to each peer (zeropp's exchanges send equal splits to every peer but themselves)."""
    bytes_per_peer = max(split_sizes, default=0) * input.element_size()
    recorder.record(Op.ALL_TO_ALL, group, bytes_per_peer, dtype, technique)
    return recorder.issue(Op.ALL_TO_ALL, group, technique, lambda: dist.all_to_all_single(
        output, input, output_split_sizes=split_sizes, input_split_sizes=split_sizes, group=group, async_op=async_op),
        (output, input))


def all_reduce_sum(buffer: torch.Tensor, group: dist.ProcessGroup | None, recorder: Recorder,
                   technique: str) -> None:
    """Sum ``buffer`` over the group (default: the world), in place."""
    all_reduce(buffer, dist.ReduceOp.SUM, group, recorder, technique)


def all_reduce(buffer: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None, recorder: Recorder,
               technique: str, *, async_op: bool = False) -> dist.Work | None:
    """Reduce ``buffer`` with ``op`` over the group (default: the world), in place."""
    recorder.record(Op.ALL_REDUCE, group or dist.group.WORLD, nbytes(buffer), buffer.dtype, technique)
    return recorder.issue(Op.ALL_REDUCE, group, technique,
                          lambda: dist.all_reduce(buffer, op=op, group=group, async_op=async_op), (buffer,))


def broadcast(tensor: torch.Tensor, source_rank: int, group: dist.ProcessGroup | None, recorder: Recorder,
              technique: str) -> None:
    """Every rank's ``tensor`` becomes ``source_rank``'s (a global rank), in place. The ledger
    counts the source's sends: ``tensor`` to every peer."""
    group = group or dist.group.WORLD
    bytes_per_peer = nbytes(tensor) if dist.get_rank() == source_rank else 0
    recorder.record(Op.BROADCAST, group, bytes_per_peer, tensor.dtype, technique)
    recorder.issue(Op.BROADCAST, group, technique, lambda: dist.broadcast(tensor, src=source_rank, group=group),
                   (tensor,))


def all_gather_strings(value: str, group: dist.ProcessGroup | None = None) -> list[str]:
    """Every rank's ``value`` (e.g. its hostname), in rank order. Used once at start-up; not
    counted (a few bytes, before training)."""
    out: list[str] = [""] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


class RecordedComm:
    """Shared by zeropp's FSDP2 comms: the technique its bytes are booked under, and a recorder."""

    technique = "fsdp"
    phase: str | None = None
    """The phase its bytes are booked under (``Recorder.phase``)."""

    def __init__(self, topology: Topology, ledger: CommLedger | None = None) -> None:
        self.topology = topology
        self.recorder = Recorder(topology, ledger)
        self.recorder.phase = self.phase

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
    gradients before backward ends (``access.gradients_read_only_after_backward``: each sharded
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

    phase = "backward"
    """A gradient reduction belongs to backward even where it runs after it (a pipeline schedule
    reduces a stage's gradients once its microbatches' backward passes are done, outside autograd)."""

    may_finish_late: Callable[[torch.dtype, dist.ReduceOp], bool] | None = None
    """Set by ``zeropp.shard`` with ``overlap``: whether a call with this reduce dtype and op may
    leave its output unwritten until backward ends (the unit's gradients are read no sooner)."""

    after_reduce: Callable[[], None] | None = None
    """Set by ``zeropp.optimizer_in_backward``: what to run once this unit's gradients are written
    and FSDP2 has handed them to the parameters (the unit's optimizer step)."""

    def finishes_late(self, output_tensor: torch.Tensor, op: dist.ReduceOp) -> bool:
        return (self.may_finish_late is not None and in_backward()
                and self.may_finish_late(output_tensor.dtype, op))

    def complete(self, finish: Callable[[], None], late: bool) -> None:
        """Write the output with ``finish``: now, or ``late``; then ``after_reduce``, which waits
        for FSDP2 to set the gradients (it does so when this call returns), so it runs with the
        next late reduce-scatter or at the end of backward."""
        after = self.after_reduce
        if late:
            finish_late(finish if after is None else _then(finish, after))
            return
        finish()
        if after is not None:
            if not in_backward():
                raise RuntimeError("optimizer_in_backward steps a unit after its reduce-scatter in backward; "
                                   "this reduce-scatter ran outside backward")
            finish_late(after)


def _then(first: Callable[[], None], second: Callable[[], None]) -> Callable[[], None]:
    def both() -> None:
        first()
        second()
    return both


_unfinished: deque[Callable[[], None]] = deque()
_unfinished_backward = [-1]  # the backward pass whose end finishes ``_unfinished``
_deferred: deque[Callable[[], None]] = deque()
"""The last stages of finished late calls, run before the next one finishes or when all do."""


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
        _run_deferred()
        _unfinished.popleft()()


def defer_last_stage(stage: Callable[[], None]) -> None:
    """Called by a late call's finish: run ``stage`` (its last collective's wait and what
    follows) when the next late call finishes, or when the last does; a comm with three stages
    keeps two units' transfers in flight so ([Note: the replicas' reduction beside backward])."""
    _deferred.append(stage)


def _run_deferred() -> None:
    while _deferred:
        _deferred.popleft()()


def finish_unfinished() -> None:
    """Finish every late reduce-scatter, oldest first, and the last stages they deferred."""
    _unfinished_backward[0] = -1
    while _unfinished:
        _run_deferred()
        _unfinished.popleft()()
    _run_deferred()


class DecodeOnWait(dist.Work):
    """A gather in flight (FSDP2 asked for ``async_op``): waiting for it waits for the payload,
    then decodes it into FSDP2's output, so the transfer overlaps whatever runs between the call
    and the wait, and FSDP2 reads weights as it would from a plain gather. The payload is let go
    once decoded: FSDP2 holds this work through its copy-out into the unsharded weights, where a
    gather that waited at once has freed it already."""

    def __init__(self, work: dist.Work, decode: Callable[[], None]) -> None:
        super().__init__()
        self._work: dist.Work | None = work
        self._decode: Callable[[], None] | None = decode

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        if self._work is not None and self._decode is not None:
            self._work.wait()
            self._decode()
            self._work = self._decode = None
        return True


Held = list[tuple[torch.Tensor, int]]
"""Tensors handed to collectives, each with its use count before the backend took it."""

_held: Held | None = None


@contextlib.contextmanager
def holding_tensors() -> Iterator[Held]:
    """Note every tensor the collectives issued inside hand to the backend, with its use count
    then: see [Note: the backend lets go after the wait]."""
    global _held
    outer, _held = _held, []
    try:
        yield _held
    finally:
        _held = outer


def wait_until_let_go(held: Held, timeout_s: float = 5.0) -> bool:
    """Wait until the backend's threads hold none of ``held``'s tensors (each back to its use
    count before the collective); False if ``timeout_s`` passed first.

    [Note: the backend lets go after the wait]
    A gloo worker thread marks a collective's work done, which wakes its ``wait()``, and only
    then lets go of the work, and with it of the tensors the work held (the ones it was given,
    or views of them, which hold them too). If the Python side has let go of a tensor first,
    that last release is the worker's, and it must take the GIL to free the tensor's Python
    object. During interpreter finalization it cannot: the thread is
    ended there and the process aborts with "terminate called without an active exception"
    (reproduced with a C++ stack: ``ProcessGroupGloo::runLoop`` releasing a work into
    ``TensorImpl::decref_pyobject``, then ``pthread_exit``). Mid-job that release just waits its
    turn for the GIL; at the end of a job it is a race with the exit, lost now and then under
    load. So before the process group goes, zeropp holds on to the tensors of the gathers still
    in flight and waits, after their wait, until every one is back to the use count it had
    before the collective (the backend and its works hold none), and only then lets them go
    on the main thread."""
    deadline = time.monotonic() + timeout_s
    while not let_go(held):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def let_go(held: Held) -> bool:
    """Whether every tensor of ``held`` is back to its use count before the collective."""
    return all(tensor._use_count() <= before for tensor, before in held)


class Completion:
    """What finishes a started gather: writes the ``payload`` it holds into an output (a copy, a
    decode, a second hop); ``nbytes``: the payload's size, held until then."""

    def __init__(self, payload: torch.Tensor, write: Callable[[torch.Tensor], None]) -> None:
        self.nbytes, self._write = nbytes(payload), write

    def __call__(self, output_tensor: torch.Tensor) -> None:
        self._write(output_tensor)

    def followed_by(self, after: Callable[[torch.Tensor], None]) -> Completion:
        """This completion, then ``after`` on the output it wrote (the same payload held)."""
        def write(output_tensor: torch.Tensor) -> None:
            self._write(output_tensor)
            after(output_tensor)

        completion = copy.copy(self)
        completion._write = write
        return completion


def buffered(buffer: torch.Tensor) -> Completion:
    """The completion of a plain gather into ``buffer``: a copy, unless the output is the buffer."""
    def copy_into(output_tensor: torch.Tensor) -> None:
        if output_tensor.data_ptr() != buffer.data_ptr():
            output_tensor.copy_(buffer)
    return Completion(buffer, copy_into)


Started = tuple["dist.Work | None", Completion]
"""A gather on its way: its work (None once done) and what writes the result into an output."""


class GatherAhead:
    """An all-gather comm that can start a unit's next gather before FSDP2 asks for it: see
    [Note: gathers ahead].

    [Note: gathers ahead]
    With ``zeropp.optimizer_in_backward(..., gather_ahead=True)`` each unit's optimizer step runs
    in backward, as soon as its gradients are reduced, and is followed at once by the gather the
    next forward will ask for: ``gather_ahead`` builds the unit's all-gather input as FSDP2 does
    (``access.all_gather_input``) and starts the gather asynchronously. The next forward's call
    with the same group and an equal input (compared element for element, so an edit or a load
    in between is seen) takes it instead of gathering again; any other call drops it (waiting
    for it first, as every rank issued it). The bytes are those of the gather it replaces, and
    the weights the same bits. Every rank starts and takes its gathers at the same points of
    the same program, as for any collective; a rank that changes its shards alone between
    backward and forward breaks that, as it would break FSDP2 itself. What it costs: each
    unit's gathered payload is held from its step to its forward (``ahead_bytes``)."""

    _ahead: tuple[dist.ProcessGroup, torch.Tensor, Started] | None = None
    _in_flight_key: int | None = None
    taken_ahead: int = 0
    """Gathers started ahead that a forward took."""
    dropped_ahead: int = 0
    """Gathers started ahead that no forward took (the weights changed in between, or dropped)."""

    def start(self, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool,
              output_tensor: torch.Tensor | None) -> Started:
        """Start gathering ``input_tensor``: into ``output_tensor``, or a buffer of its size when None."""
        raise NotImplementedError

    def gather_ahead(self, input_tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
        """Start the gather of ``input_tensor`` that the next call will ask for."""
        self.drop_ahead()
        with holding_tensors() as held:
            self._ahead = (group, input_tensor, self.start(input_tensor, group, True, None))
        self._in_flight_key = _in_flight(self, self._ahead[2][0], held)

    def drop_ahead(self) -> None:
        """Forget a gather started ahead (after it has finished: every rank issued it)."""
        if self._ahead is not None:
            work = self._ahead[2][0]
            self._ahead = None
            _AHEAD_IN_FLIGHT.pop(self._in_flight_key, None)
            self.dropped_ahead += 1
            if work is not None:
                work.wait()

    def wait_ahead(self) -> None:
        """Wait for a gather started ahead to arrive, keeping it for the call that takes it."""
        if self._ahead is not None and self._ahead[2][0] is not None:
            self._ahead[2][0].wait()

    @property
    def started_ahead(self) -> bool:
        """Whether a gather started ahead waits to be taken (the same on every rank)."""
        return self._ahead is not None

    @property
    def ahead_bytes(self) -> int:
        """Bytes held by a gather started ahead: its input and the buffer it gathers into."""
        if self._ahead is None:
            return 0
        _, input_tensor, (_, complete) = self._ahead
        return nbytes(input_tensor) + complete.nbytes

    def gather(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
               async_op: bool) -> dist.Work | None:
        """FSDP2's call: take the gather started ahead if it is this one, else start it now."""
        started = self._take_ahead(input_tensor, group)
        if started is None:
            started = self.start(input_tensor, group, async_op, output_tensor)
        work, complete = started
        if work is not None and async_op:
            return DecodeOnWait(work, lambda: complete(output_tensor))
        if work is not None:
            work.wait()
        complete(output_tensor)
        return None

    def _take_ahead(self, input_tensor: torch.Tensor, group: dist.ProcessGroup) -> Started | None:
        if self._ahead is None:
            return None
        if getattr(self, "audit_request", None) is not None:
            self.drop_ahead()  # armed by the audit since it started: gather again, beside the exact one
            return None
        ahead_group, ahead_input, started = self._ahead
        if (ahead_group is group and ahead_input.dtype == input_tensor.dtype
                and ahead_input.shape == input_tensor.shape and torch.equal(ahead_input, input_tensor)):
            self._ahead = None
            _AHEAD_IN_FLIGHT.pop(self._in_flight_key, None)
            self.taken_ahead += 1
            return started
        self.drop_ahead()
        return None


InFlight = tuple["weakref.ref[GatherAhead]", "dist.Work | None", Held]
"""A gather started ahead: its comm (weakly: a freed model frees its comms), its work, and the
tensors it handed the backend."""

_AHEAD_IN_FLIGHT: dict[int, InFlight] = {}
"""Every gather started ahead and not yet taken or dropped, so that a job can finish them before
its process group goes, even those of a model already freed ([Note: gathers after the step] in
``zeropp.fsdp.after_step``). Only the works and their tensors are held, never the comm."""
_in_flight_keys = itertools.count()


def _in_flight(all_gather: GatherAhead, work: dist.Work | None, held: Held) -> int:
    """Note a gather started ahead; forget those of freed comms that the backend has let go."""
    for key, (comm, _, earlier) in list(_AHEAD_IN_FLIGHT.items()):
        if comm() is None and let_go(earlier):
            del _AHEAD_IN_FLIGHT[key]
    key = next(_in_flight_keys)
    _AHEAD_IN_FLIGHT[key] = (weakref.ref(all_gather), work, held)
    return key


def finish_gathers_ahead() -> Held:
    """Wait for every gather started ahead that no call has taken (dropping it from its comm, as
    every rank does), and return the tensors they handed the backend."""
    held: Held = []
    for comm, work, tensors in list(_AHEAD_IN_FLIGHT.values()):
        all_gather = comm()
        if all_gather is not None and all_gather.started_ahead:
            all_gather.drop_ahead()
        elif work is not None:
            work.wait()
        held.extend(tensors)
    _AHEAD_IN_FLIGHT.clear()
    return held


def gathers_ahead_in_flight() -> int:
    """How many gathers started ahead no call has taken or dropped yet."""
    return len(_AHEAD_IN_FLIGHT)


def barrier() -> None:
    """Every rank of the world meets here."""
    dist.barrier()


class CountingAllGather(RecordedComm, GatherAhead, AllGather):
    """FSDP2's default all-gather, counted in the ledger."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, async_op: bool = False) -> dist.Work | None:
        return self.gather(output_tensor, input_tensor, group, async_op)

    def start(self, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool,
              output_tensor: torch.Tensor | None) -> Started:
        if output_tensor is None:
            output_tensor = input_tensor.new_empty(input_tensor.numel() * group.size())
        work = all_gather(output_tensor, input_tensor, group, self.recorder, self.technique, async_op=async_op)
        return work, buffered(output_tensor)


class CountingReduceScatter(LateReduceScatter):
    """FSDP2's default reduce-scatter, counted in the ledger."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op: dist.ReduceOp, async_op: bool = False) -> dist.Work | None:
        late = not async_op and self.finishes_late(output_tensor, op)
        work = reduce_scatter(output_tensor, input_tensor, op, group, self.recorder, self.technique,
                              async_op=async_op or late)
        if async_op:  # FSDP2 waits for it
            self.complete(lambda: None, False)
            return work
        self.complete(work.wait if late else lambda: None, late)
        return None


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
