"""Time and memory of one training step, from the step's collectives (``zeropp.tools.plan.traffic``) and
a few machine constants.

[Note: the collective time model]
Each collective costs a fixed time per call, a time per peer (ring steps, messages), and its
bytes over the slowest link it loads:

- a ring sends ``rounds x (g - 1) x c`` bytes over every edge at once (an all-reduce, and gloo's
  reduce-scatter, which is an all-reduce underneath, take two rounds; NCCL's reduce-scatter
  one); a ring over the world has one edge out of each node, so it pays that many bytes over
  the node link and, inside the node, over the rank's link, whichever is slower; the data-parallel
  groups of a tensor parallel layout (D / t ranks on each node) run t such rings at once, each
  with its edge out of each node: the node link carries t of them;
- an all-to-all inside the node sends ``(g - 1) x c`` from every rank over its own link; across
  nodes, every rank of a node sends its share to remote ranks at once through the node link;
- a collective among one rank per node (qgZ's second hop, HSDP's all-reduce) runs on every local
  index at once: the node link carries ``ranks_per_node`` of them.

With ``serial_bytes_per_s`` (a CPU backend, where every byte costs the sender's CPU time) the
rank's own sending is one more resource: a ring moves its chunks through the CPU while earlier
chunks are on the wire, so the collective takes the slowest of link and CPU, not their sum.
Codec work (qwZ, qgZ) comes before and after the transfer: elements / ``codec_elements_per_s``.

[Note: overlap]
With streams (NCCL) FSDP2 prefetches: unit i+1's gather runs during unit i's forward, and in
backward unit i-1's gather and unit i+1's reduce-scatter run during unit i's backward. A unit's
slot then takes the longer of its compute and the communication it hides, plus whatever part of
the shorter one fails to overlap: ``Machine.overlap`` is that fraction's complement, 1 for ideal
streams, less where communication kernels slow compute or prefetching stalls. Without streams
(gloo on CPU, the emulated cluster) it is 0: compute and communication add up, and the sum is
the same whatever the order. With CPU offload a unit's host-to-device copies join its gathers
and its device-to-host copy its reduce-scatter ([Note: CPU offload in a step] in
``zeropp.tools.plan.offload``); with the optimizer on the host its copies follow backward, outside
this schedule ([Note: the optimizer on the host in a step] there). Tensor parallel's all-reduces
sit between a unit's products, which wait for them: they join the unit's compute in its slot.

[Note: overlap on a CPU backend]
zeropp's ``overlap`` on gloo issues each collective on the backend's threads and waits for it
where its result is needed: gathers two units ahead, the next step's first gathers as soon as the
optimizer has stepped, qgZ's slices as a pipeline and its cross-node hop during the next unit's
backward, HSDP's replica reduction beside backward. The CPU stays one resource, whose work adds
up (compute, codec, each call's cost and the sends' CPU time); the link is the other, which
carries every cross-node byte and is idle while the optimizer steps (the next step's gathers
start after it, its last reductions end before it). The step takes the longer of the two, plus
the part of the shorter that does not run beside it (``1 - Machine.threads_overlap``): the
backend's sending threads wait for a core that compute holds, and the link waits for them.
``zeropp plan --calibrate`` fits that fraction on the small models' steps with ``overlap``
(0.79 on the emulated cluster's two cores for four ranks; docs/results.md, "Calibrated on the
emulated cluster").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from zeropp.config import ZeroPPConfig
from zeropp.fsdp.ledger import GroupKind, Op
from zeropp.setup.topology import Topology
from zeropp.tools.plan.layout import Layout, layout_for
from zeropp.tools.plan.memory import RankMemory, rank_memory
from zeropp.tools.plan.model import ModelShape
from zeropp.tools.plan.offload import copy_seconds, step_copies
from zeropp.tools.plan.traffic import (
    Precision,
    Transfer,
    expert_parallel_transfers,
    offloads_shards,
    padded_numels,
    step_transfers,
    tensor_parallel_transfers,
)

GBIT = 1e9 / 8
"""Bytes per second in one Gbit/s."""


@dataclass(frozen=True, kw_only=True)
class Machine:
    """The constants of one kind of cluster (per GPU or rank unless said otherwise)."""

    name: str
    ranks_per_node: int
    inter_node_bytes_per_s: float
    """One direction of a node's links to the other nodes, all its NICs together."""
    intra_node_bytes_per_s: float
    """One direction of one rank's link inside the node (NVLink / NVSwitch, or loopback)."""
    latency_s: float
    """Fixed cost of one collective call (launch, synchronisation, the backend's own steps)."""
    flops_per_s: float
    """Sustained training FLOP/s of one rank on the model's matmuls."""
    activation_s_per_element: float = 0.0
    """Time per activation element per layer (norms, activations, softmax: work that grows with
    tokens x width, not with parameters); 0 where ``flops_per_s`` already folds it in."""
    codec_elements_per_s: float
    """Elements quantized or dequantized per second by one rank."""
    memory_bytes: float = float("inf")
    """Memory per rank."""
    overlap: float = 1.0
    """How much of the shorter of a unit's compute and the communication it hides runs beside the
    other (CUDA streams), see [Note: overlap]: 1 ideal, 0 one after the other (gloo on CPU)."""
    hop_latency_s: float = 0.0
    """A ring's or all-to-all's cost per peer (each of its ``g - 1`` steps or messages)."""
    serial_bytes_per_s: float = float("inf")
    """A CPU backend's rate of moving a rank's sends through the CPU, whatever the link."""
    serial_cost: Mapping[str, float] = field(default_factory=dict)
    """What a sent byte of each kind of collective (``serial_kind``: ``"all_gather/world"``,
    ``"all_gather/node"``, ``"reduce_scatter/node"``, ...) costs the CPU, relative to
    ``serial_bytes_per_s`` (1 where absent): gloo's all-gathers cost more per byte than its
    reduce-scatters, measured by ``benchmarks/collective_rates.py``."""
    update_s_per_parameter: float = 0.0
    """The optimizer's time per sharded parameter it updates."""
    threads_overlap: float = 1.0
    """On a CPU backend with zeropp's ``overlap``: the part of the shorter of the CPU's work and
    the link's time that runs beside the other ([Note: overlap on a CPU backend])."""
    backend: str = "nccl"
    host_device_bytes_per_s: float = 25e9
    """One rank's copies between pinned host memory and its device, each direction (CPU
    offload): PCIe Gen4 x16's effective rate unless the machine says otherwise (32 GB/s on the
    wire, about 25 GB/s measured with pinned buffers)."""


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What each rank trains on per step."""

    batch_per_rank: int
    """Sequences per rank per step (micro-batch)."""
    context_length: int
    precision: Precision = Precision()
    activation_checkpointing: bool = False
    """Recompute each layer's forward in backward (one more forward's FLOPs, far less memory)."""

    @property
    def tokens_per_rank(self) -> int:
        return self.batch_per_rank * self.context_length


def rank_sends(t: Transfer, backend: str) -> int:
    """Bytes one rank sends in ``t``: ``(g - 1)`` times what it owes each peer, twice for an
    all-reduce (a reduce-scatter and an all-gather) and for gloo's reduce-scatter (a whole
    all-reduce, see ``zeropp.fsdp.ledger``)."""
    rounds = 2 if t.op is Op.ALL_REDUCE or (t.op is Op.REDUCE_SCATTER and backend == "gloo") else 1
    return rounds * (t.group_size - 1) * t.bytes_per_peer


def serial_kind(t: Transfer) -> str:
    """The key of ``Machine.serial_cost`` for ``t``: the op (an all-reduce is priced as gloo's
    reduce-scatter, which runs one) and whether it runs inside one node."""
    op = {Op.ALL_GATHER: "all_gather", Op.REDUCE_SCATTER: "reduce_scatter", Op.ALL_REDUCE: "reduce_scatter"}.get(
        t.op, t.op.value)
    return f"{op}/{'node' if t.kind is GroupKind.INTRA else 'world'}"


def weighted_sends(t: Transfer, backend: str, serial_cost: Mapping[str, float]) -> float:
    """``rank_sends`` weighted by the collective's relative CPU cost per byte (``Machine.serial_cost``)."""
    return rank_sends(t, backend) * serial_cost.get(serial_kind(t), 1.0)


def serial_seconds(t: Transfer, machine: Machine) -> float:
    """The CPU time of a rank's sends in ``t`` on a CPU backend."""
    return weighted_sends(t, machine.backend, machine.serial_cost) / machine.serial_bytes_per_s


def link_bytes(t: Transfer, topology: Topology, backend: str) -> tuple[float, float]:
    """(bytes over one rank's link inside the node, bytes over one node's link to the others)
    for one collective, see [Note: the collective time model]."""
    if t.group_size <= 1:
        return 0.0, 0.0
    sent = rank_sends(t, backend)
    if t.kind is GroupKind.INTRA or topology.num_nodes == 1:
        return sent, 0.0
    if t.kind is GroupKind.INTER:  # one group per local index, all at once
        return 0.0, topology.ranks_per_node * sent
    per_node = t.group_size // t.nodes(topology)  # the world's D, or D / t of a data-parallel group
    if t.op is Op.ALL_TO_ALL:
        remote = t.group_size - per_node
        return sent, topology.ranks_per_node * remote * t.bytes_per_peer
    return sent, topology.ranks_per_node // per_node * sent  # each group's ring: one edge out of each node


def transfer_seconds(t: Transfer, topology: Topology, machine: Machine) -> float:
    """One collective's time on ``machine``, codec work included."""
    if t.group_size <= 1:
        return 0.0
    return _call_seconds(t, machine) + max(_link_seconds(t, topology, machine), serial_seconds(t, machine))


@dataclass(frozen=True)
class StepTime:
    """A step's predicted time and where it goes (seconds, per rank)."""

    step_s: float
    compute_s: float
    optimizer_s: float
    communication_s: float
    """All collectives and their codec work, as if nothing overlapped."""
    cross_node_s: float
    """The collectives that cross nodes, alone."""
    host_copy_s: float = 0.0
    """Offload's host-device copies, as if nothing overlapped."""

    @property
    def exposed_s(self) -> float:
        """What the step waits on communication."""
        return self.step_s - self.compute_s - self.optimizer_s


def step_flops(model: ModelShape, workload: Workload) -> float:
    """FLOPs one rank computes per step, counted as the ZeRO++ paper and Megatron count them:
    with activation checkpointing the recomputed forward is included."""
    flops = workload.tokens_per_rank * model.training_flops_per_token(workload.context_length)
    return flops * 4 / 3 if workload.activation_checkpointing else flops  # 8 instead of 6 per parameter


def activation_elements(model: ModelShape, workload: Workload) -> float:
    """Layers x tokens x width: the elementwise work of a step, per rank."""
    return model.num_layers * workload.tokens_per_rank * model.embed_dim


def unit_compute_s(model: ModelShape, workload: Workload, machine: Machine) -> list[float]:
    """Each unit's forward + backward compute (recompute included), split by parameter count."""
    total = sum(unit.num_parameters for unit in model.units)
    seconds = (step_flops(model, workload) / machine.flops_per_s
               + activation_elements(model, workload) * machine.activation_s_per_element)
    return [seconds * unit.num_parameters / total for unit in model.units]


def sharded_parameters(model: ModelShape, config: ZeroPPConfig | None, topology: Topology,
                       layout: Layout | None = None) -> float:
    """Parameters one rank holds and updates (padding included), over its shard group
    (``layout.layout_for``: HSDP's inside the node; a tensor parallel rank's 1/t)."""
    layout = layout_for(config, layout)
    return sum(sum(padded_numels(part, shard.world_size)) / shard.world_size
               for unit in layout.local_units(model) for part, shard in layout.parts(unit, topology))


def step_time(model: ModelShape, config: ZeroPPConfig | None, topology: Topology, workload: Workload,
              machine: Machine, layout: Layout | None = None) -> StepTime:
    """One training step of ``model`` in a mode (``config``; None for FSDP2's own, ``layout``:
    see ``layout.layout_for``) on ``machine``. Tensor parallel's all-reduces and expert
    parallel's token exchanges run between its products, in the compute's own time: they add to
    it ([Note: overlap])."""
    layout = layout_for(config, layout)
    per_unit = [[t for t in unit if not t.background] for unit in step_transfers(model, config, topology,
                                                                                    workload.precision, layout)]
    compute = unit_compute_s(model, workload, machine)
    comm = [{phase: sum(transfer_seconds(t, topology, machine) for t in unit if _phase(t) == phase)
             for phase in ("forward_gather", "backward_gather", "reduce")} for unit in per_unit]
    sizes = (workload.batch_per_rank, workload.context_length, workload.activation_checkpointing)
    between_products = [[*tp, *ep] for tp, ep in zip(  # tensor parallel's all-reduces, expert parallel's tokens
        tensor_parallel_transfers(model, topology, layout, workload.precision, *sizes),
        expert_parallel_transfers(model, topology, layout, workload.precision, *sizes), strict=True)]
    tensor_parallel = [{phase: sum(transfer_seconds(t, topology, machine) for t in unit if t.phase == phase)
                        for phase in ("forward", "backward")} for unit in between_products]
    total_comm = sum(sum(c.values()) for c in comm) + sum(sum(c.values()) for c in tensor_parallel)
    host_copy, pageable = _add_host_copies(comm, model, config, topology, machine)
    idle = {"forward_gather": 0.0, "backward_gather": 0.0, "reduce": 0.0}
    comm += [idle] * (len(compute) - len(comm))
    compute += [0.0] * (len(comm) - len(compute))
    tensor_parallel += [{"forward": 0.0, "backward": 0.0}] * (len(compute) - len(tensor_parallel))
    cross = sum(transfer_seconds(t, topology, machine) for unit in [*per_unit, *between_products] for t in unit
                if link_bytes(t, topology, machine.backend)[1] > 0)
    forward_share = (1 / 4) if workload.activation_checkpointing else (1 / 3)
    forward = [c * forward_share + tp["forward"] for c, tp in zip(compute, tensor_parallel)]
    backward = [c * (1 - forward_share) + tp["backward"] for c, tp in zip(compute, tensor_parallel)]
    step = _overlapped(forward, backward, comm, machine.overlap) + pageable
    optimizer = sharded_parameters(model, config, topology, layout) * machine.update_s_per_parameter
    if config is not None and config.overlap and machine.backend == "gloo":
        # [Note: overlap on a CPU backend]: the CPU's work against the link's
        transfers = [t for unit in [*per_unit, *between_products] for t in unit]
        cpu = sum(compute) + sum(_cpu_seconds(t, machine) for t in transfers) + optimizer
        link = sum(_link_seconds(t, topology, machine) for t in transfers) + optimizer
        step = overlapped_step(cpu, link, machine.threads_overlap) - optimizer + pageable
    return StepTime(step + optimizer, sum(compute), optimizer, total_comm, cross, host_copy)


def overlapped_step(cpu_s: float, link_s: float, overlap: float) -> float:
    """A step whose collectives run beside the CPU's work ([Note: overlap on a CPU backend]):
    the longer of the two, plus the part of the shorter that does not overlap."""
    return max(cpu_s, link_s) + (1 - overlap) * min(cpu_s, link_s)


def _call_seconds(t: Transfer, machine: Machine) -> float:
    """What ``t`` costs besides moving its bytes: the call, its peers' hops and its codec work."""
    return (machine.latency_s + (t.group_size - 1) * machine.hop_latency_s
            + t.coded_elements / machine.codec_elements_per_s)


def _cpu_seconds(t: Transfer, machine: Machine) -> float:
    """The CPU's share of ``t`` on a CPU backend: its call, its codec work and its sends."""
    return _call_seconds(t, machine) + serial_seconds(t, machine) if t.group_size > 1 else 0.0


def _link_seconds(t: Transfer, topology: Topology, machine: Machine) -> float:
    """The links' share of ``t`` alone: the longer of its bytes over a rank's link inside the
    node and over the node's link to the others."""
    intra, inter = link_bytes(t, topology, machine.backend)
    return max(intra / machine.intra_node_bytes_per_s, inter / machine.inter_node_bytes_per_s)


def _add_host_copies(comm: list[dict[str, float]], model: ModelShape, config: ZeroPPConfig | None,
                     topology: Topology, machine: Machine) -> tuple[float, float]:
    """Offload's copies ([Note: CPU offload in a step], [Note: the optimizer on the host in a
    step] in ``zeropp.tools.plan.offload``): CPU offload's, pinned, each added to its unit's
    collective in ``comm``; pageable ones, and the optimizer's after backward, the step waits
    for. Returns the copies' seconds, and those the step waits for on top of ``comm``."""
    copies = [copy_seconds(c, config, machine.host_device_bytes_per_s) for c in step_copies(model, config, topology)]
    total = sum(sum(c.values()) for c in copies)
    if not (offloads_shards(config) and config.offload_pin_memory):
        return total, total
    for unit_comm, unit_copy_s in zip(comm, copies):
        for phase, seconds in unit_copy_s.items():
            unit_comm[phase] += seconds
    return total, 0.0


def _phase(t: Transfer) -> str:
    if t.op is Op.ALL_GATHER:
        return "forward_gather" if t.phase == "forward" else "backward_gather"
    return "reduce"


def _overlapped(forward_work: list[float], backward_work: list[float], comm: list[dict[str, float]],
                overlap: float) -> float:
    """FSDP2's prefetching schedule ([Note: overlap]) over the units in the order given, each with
    its forward's and its backward's work: the first gather and the last reduce-scatter are
    exposed; every other collective runs during a unit's work, and the slot takes the longer of
    the two plus the part of the shorter that does not overlap (``1 - overlap``)."""
    def slot(work: float, hidden: float) -> float:
        return max(work, hidden) + (1 - overlap) * min(work, hidden)

    n = len(forward_work)
    forward = comm[0]["forward_gather"]
    for i in range(n):
        ahead = comm[i + 1]["forward_gather"] if i + 1 < n else 0.0
        forward += slot(forward_work[i], ahead)
    backward = comm[n - 1]["backward_gather"]
    for i in reversed(range(n)):
        ahead = comm[i - 1]["backward_gather"] if i > 0 else 0.0
        behind = comm[i + 1]["reduce"] if i + 1 < n else 0.0
        backward += slot(backward_work[i], ahead + behind)
    return forward + backward + comm[0]["reduce"]


def memory(model: ModelShape, config: ZeroPPConfig | None, topology: Topology, workload: Workload,
           rank: int = 0, layout: Layout | None = None) -> RankMemory:
    """Peak bytes on ``rank`` in one step, by what they are (``zeropp.tools.plan.memory``)."""
    return rank_memory(model, config, topology, workload.precision, workload.batch_per_rank, workload.context_length,
                       rank, workload.activation_checkpointing, layout)


def tokens_per_s(model: ModelShape, config: ZeroPPConfig | None, topology: Topology, workload: Workload,
                 machine: Machine, layout: Layout | None = None) -> float:
    """Training throughput of the whole cluster."""
    return topology.world_size * workload.tokens_per_rank / step_time(model, config, topology, workload,
                                                                       machine, layout).step_s


def achieved_flops(model: ModelShape, config: ZeroPPConfig | None, topology: Topology, workload: Workload,
                   machine: Machine, layout: Layout | None = None) -> float:
    """FLOP/s per rank (``step_flops`` over the step's time)."""
    return step_flops(model, workload) / step_time(model, config, topology, workload, machine, layout).step_s


def cross_node_bytes_per_node(transfers: Sequence[Transfer], topology: Topology, backend: str = "nccl") -> float:
    """Bytes one node's link carries to the others per step (rings and all-to-alls alike)."""
    return sum(link_bytes(t, topology, backend)[1] for t in transfers)
