"""The only module that calls torch.distributed collectives.

FSDP2 lets a unit replace its all-gather and reduce-scatter with objects implementing its
``AllGather`` / ``ReduceScatter`` interfaces (``allocate`` + ``__call__``). zeropp's comms are
such objects: counting wrappers around FSDP2's defaults (the ZeRO-3 baseline), and later the
ZeRO++ comms. Every one of them records what it moves in the ledger.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from zeropp.codec import ChunkCodec, segments_for
from zeropp.ledger import CommLedger, GroupInfo, GroupKind, Op, comm_ledger
from zeropp.topology import ProcessGroups, Topology

# torch 2.13 renamed the tensor collectives; 2.11 has only the old names.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op, group, async_op: bool):
    if hasattr(dist, "reduce_scatter_single"):
        return dist.reduce_scatter_single(output, input, op=op, group=group, async_op=async_op)
    return dist.reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)


class _Counted:
    """Shared by every zeropp comm: where to record, and a per-group cache of link facts."""

    technique = "fsdp"

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
               technique: str | None = None) -> None:
        self.ledger.record(op, self.group_info(group), bytes_per_peer, dtype, technique or self.technique)

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class CountingAllGather(_Counted, AllGather):
    """FSDP2's default all-gather, counted in the ledger."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, async_op: bool = False) -> dist.Work | None:
        self.record(Op.ALL_GATHER, group, _nbytes(input_tensor), input_tensor.dtype)
        return _all_gather_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class CountingReduceScatter(_Counted, ReduceScatter):
    """FSDP2's default reduce-scatter, counted in the ledger."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op: dist.ReduceOp, async_op: bool = False) -> dist.Work | None:
        self.record(Op.REDUCE_SCATTER, group, _nbytes(output_tensor), input_tensor.dtype)
        return _reduce_scatter_tensor(output_tensor, input_tensor, op, group, async_op)


class QuantizedAllGather(_Counted, AllGather):
    """qwZ: each rank's chunk travels block-quantized (data and scales in one uint8 payload) and
    every rank's chunk, its own included, is decoded into the output, so all ranks hold the same
    weights: ``dequantize(quantize(shard))`` of every shard.

    Each parameter's slice is quantized on its own. ``quantized`` says which parameters are
    (all of them for qwZ; the frozen ones for quantized non-trainable weights). On an intra-node
    group (hpZ's backward gather) the chunk travels in full precision unless
    ``quantize_intra_node`` is set.
    """

    technique = "qwZ"

    def __init__(self, topology: Topology, padded_numels: list[int], quantized: list[bool], *,
                 bits: int, block_size: int, quantize_intra_node: bool = False,
                 ledger: CommLedger | None = None) -> None:
        super().__init__(topology, ledger)
        self.padded_numels, self.quantized = padded_numels, quantized
        self.bits, self.block_size = bits, block_size
        self.quantize_intra_node = quantize_intra_node
        self._codecs: dict[tuple[int, torch.dtype], ChunkCodec] = {}

    def codec(self, group_size: int, dtype: torch.dtype) -> ChunkCodec:
        """The codec of one chunk when the unit's parameters are split over ``group_size`` ranks."""
        key = (group_size, dtype)
        if key not in self._codecs:
            segments = segments_for(self.padded_numels, self.quantized, group_size, self.bits)
            self._codecs[key] = ChunkCodec(segments, self.block_size, dtype)
        return self._codecs[key]

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, async_op: bool = False) -> dist.Work | None:
        info = self.group_info(group)
        if info.kind is GroupKind.INTRA and not self.quantize_intra_node:
            self.record(Op.ALL_GATHER, group, _nbytes(input_tensor), input_tensor.dtype, "hpZ")
            return _all_gather_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
        codec = self.codec(info.size, input_tensor.dtype)
        if codec.numel != input_tensor.numel():
            raise RuntimeError(f"qwZ all-gather got a chunk of {input_tensor.numel()} elements, but the "
                               f"unit's parameters make chunks of {codec.numel} on {info.size} ranks")
        send = torch.empty((1, codec.nbytes), dtype=torch.uint8, device=input_tensor.device)
        codec.encode(input_tensor.view(1, -1), send)
        received = torch.empty((info.size, codec.nbytes), dtype=torch.uint8, device=input_tensor.device)
        self.record(Op.ALL_GATHER, group, codec.nbytes, f"int{self.bits}")
        _all_gather_tensor(received.view(-1), send.view(-1), group=group)
        codec.decode(received, output_tensor.view(info.size, -1))
        return None


def intra_node_send_order(num_nodes: int, ranks_per_node: int) -> torch.Tensor:
    """qgZ's remap: slot d*N + n of the intra-node send buffer holds chunk n*D + d, so local
    rank d receives, from every node peer, the N chunks owed to local index d on every node."""
    return torch.arange(num_nodes * ranks_per_node).view(num_nodes, ranks_per_node).t().reshape(-1)


class HierarchicalQuantizedReduceScatter(_Counted, ReduceScatter):
    """qgZ: the gradient reduce-scatter as two quantized all-to-all hops, intra-node then
    inter-node, reduced in fp32 between them (ZeRO++ section 3.3). See [Note: qgZ remap].

    [Note: qgZ remap]
    FSDP2 hands over W = N x D chunks of S elements, chunk c owed to global rank c = n*D + d.
    Viewed as (N, D, S), the rows [:, d] are the N chunks owed to the ranks with local index d on
    every node; hop 1 sends them to local rank d, which sums what its node's D ranks sent (the
    partial sums for node n's rank d), and hop 2 sends partial n to node n over the inter-node
    group, where the N partials are summed: each rank ends with its own chunk's total. AVG then
    divides by W exactly. With one node or one rank per node, one hop vanishes.

    Each parameter's slice of a chunk is quantized on its own when the chunk is laid out as the
    unit's trainable parameters (the usual case); otherwise (a parameter without a gradient
    this step) the whole chunk is one run of blocks, still quantized with the same bound.

    [Note: qgZ own rows]
    In each hop a rank owes some rows to itself (hop 1: its share of its own gradient; hop 2:
    its own node's partial). Those never travel, so they are not quantized either: they enter
    the sum in fp32. This halves the codec's work on a 2 x 2 layout (1/D of hop 1, 1/N of hop
    2 in general), sends the same bytes to every peer, and only lowers the error (the bound in
    tests/test_qgz.py leaves those terms out). DeepSpeed quantizes every row, its own included.
    """

    technique = "qgZ"

    def __init__(self, groups: ProcessGroups, padded_numels: list[int], *, bits_intra: int,
                 bits_inter: int, block_size: int, error_feedback: bool = False,
                 ledger: CommLedger | None = None) -> None:
        super().__init__(groups.topology, ledger)
        self.groups = groups
        self.padded_numels = padded_numels
        self.bits_intra, self.bits_inter, self.block_size = bits_intra, bits_inter, block_size
        self.error_feedback = error_feedback
        self._residuals: dict[int, torch.Tensor] = {}  # hop -> fp32 quantization residual
        self._codecs: dict[tuple[int, int], ChunkCodec] = {}

    def codec(self, chunk_numel: int, bits: int) -> ChunkCodec:
        key = (chunk_numel, bits)
        if key not in self._codecs:
            world_size = self.topology.world_size
            if sum(self.padded_numels) == chunk_numel * world_size:
                segments = segments_for(self.padded_numels, [True] * len(self.padded_numels), world_size, bits)
            else:
                segments = segments_for([chunk_numel], [True], 1, bits)
            self._codecs[key] = ChunkCodec(segments, self.block_size, torch.float32)
        return self._codecs[key]

    @property
    def residual_bytes(self) -> int:
        """Bytes held for error feedback (fp32 residuals of both hops)."""
        return sum(_nbytes(r) for r in self._residuals.values())

    def reset_error_feedback(self) -> None:
        """Forget the residuals, e.g. after a loss scaler skipped a step on overflow."""
        self._residuals.clear()

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op: dist.ReduceOp, async_op: bool = False) -> dist.Work | None:
        topology = self.topology
        if group.size() != topology.world_size:
            raise ValueError(f"qgZ reduce-scatter runs on the world ({topology.world_size} ranks), "
                             f"got a group of {group.size()}")
        if op not in (dist.ReduceOp.AVG, dist.ReduceOp.SUM):
            raise ValueError(f"qgZ reduce-scatter supports ReduceOp.AVG and SUM, got {op}")
        num_nodes, ranks_per_node = topology.num_nodes, topology.ranks_per_node
        chunk_numel = output_tensor.numel()
        chunks = input_tensor.view(num_nodes, ranks_per_node, chunk_numel)
        if ranks_per_node > 1:
            partial = self._intra_node_hop(chunks, chunk_numel)  # (N, S) fp32
        else:
            partial = chunks[:, 0].float()
        total = self._inter_node_hop(partial, chunk_numel) if num_nodes > 1 else partial[0]
        if op == dist.ReduceOp.AVG:
            total = total.div_(topology.world_size)
        output_tensor.copy_(total)
        return None

    def _with_residual(self, hop: int, x: torch.Tensor) -> torch.Tensor:
        residual = self._residuals.get(hop)
        if residual is None or residual.shape != x.shape:
            return x
        return x.float() + residual

    def _keep_residual(self, hop: int, x: torch.Tensor, sent: torch.Tensor, packed: torch.Tensor,
                       codec: ChunkCodec) -> None:
        """Error feedback: remember what quantization lost on the rows ``sent`` (indices into
        ``x``), to add it before the next call; the rows kept are exact, their residual zero."""
        decoded = torch.empty((len(sent), x.shape[1]), dtype=torch.float32, device=x.device)
        codec.decode(packed, decoded)
        lost = x[sent].float() - decoded
        residual = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        if bool(lost.isfinite().all()):
            residual[sent] = lost
        self._residuals[hop] = residual

    def _exchange(self, rows: torch.Tensor, codec: ChunkCodec, hop: int, group: dist.ProcessGroup,
                  order: torch.Tensor | None = None) -> torch.Tensor:
        """Send ``rows`` (k, S) in ``order`` of rows to the group's ranks (k / size rows each) and
        return, in the same slots, what each rank sent, decoded to fp32 (k, S).

        Only the rows bound for other ranks are quantized; the block this rank owes itself stays
        in fp32 and never enters the collective, which sends it nothing (see [Note: qgZ own rows]).
        """
        size, me = group.size(), group.rank()
        per_peer = rows.shape[0] // size
        if order is None:
            order = torch.arange(rows.shape[0], device=rows.device)
        own = order[me * per_peer:(me + 1) * per_peer]
        sent = torch.cat((order[:me * per_peer], order[(me + 1) * per_peer:]))
        if self.error_feedback:
            rows = self._with_residual(hop, rows)
        packed = torch.empty((len(sent), codec.nbytes), dtype=torch.uint8, device=rows.device)
        codec.encode(rows[sent], packed)
        if self.error_feedback:
            self._keep_residual(hop, rows, sent, packed, codec)
        received = torch.empty_like(packed)
        splits = [0 if peer == me else per_peer * codec.nbytes for peer in range(size)]
        bits = codec.segments[0].bits
        self.record(Op.ALL_TO_ALL, group, per_peer * codec.nbytes, f"int{bits}")
        dist.all_to_all_single(received.view(-1), packed.view(-1), output_split_sizes=splits,
                               input_split_sizes=splits, group=group)
        decoded = torch.empty(rows.shape, dtype=torch.float32, device=rows.device)
        before, after = me * per_peer, (me + 1) * per_peer
        for source, target in ((received[:before], decoded[:before]), (received[before:], decoded[after:])):
            if len(source):
                codec.decode(source, target)
        decoded[before:after] = rows[own]
        return decoded

    def _intra_node_hop(self, chunks: torch.Tensor, chunk_numel: int) -> torch.Tensor:
        """Hop 1: (N, D, S) chunks; local rank d gets rows [:, d] from each node peer; sum them."""
        num_nodes, ranks_per_node = chunks.shape[:2]
        codec = self.codec(chunk_numel, self.bits_intra)
        rows = chunks.reshape(num_nodes * ranks_per_node, chunk_numel)
        order = intra_node_send_order(num_nodes, ranks_per_node).to(rows.device)
        decoded = self._exchange(rows, codec, 1, self.groups.intra_node_group, order)
        return decoded.view(ranks_per_node, num_nodes, chunk_numel).sum(dim=0)

    def _inter_node_hop(self, partial: torch.Tensor, chunk_numel: int) -> torch.Tensor:
        """Hop 2: partial n goes to node n; sum the N partials received."""
        codec = self.codec(chunk_numel, self.bits_inter)
        return self._exchange(partial, codec, 2, self.groups.inter_node_group).sum(dim=0)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def all_reduce_mean(value: torch.Tensor, topology: Topology, group: dist.ProcessGroup | None = None) -> float:
    """The mean of a scalar over ``group`` (default: the world), e.g. a loss for logging."""
    buffer = value.detach().float().reshape(1).clone()
    _Counted(topology).record(Op.ALL_REDUCE, group or dist.group.WORLD, _nbytes(buffer), buffer.dtype, "metrics")
    dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group)
    return buffer.item() / dist.get_world_size(group)


def all_gather_strings(value: str, group: dist.ProcessGroup | None = None) -> list[str]:
    """Every rank's ``value`` (e.g. its hostname), in rank order. Used once at start-up."""
    out: list[str] = [""] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def global_grad_norm_and_overflow(local_grads: Sequence[torch.Tensor], topology: Topology,
                                  device: torch.device) -> tuple[float, bool]:
    """The L2 norm of the gradient over every rank's shards, and whether any element on any rank
    is non-finite: one all-reduce of two numbers (fp64). ``local_grads`` are this rank's shards
    (plain tensors, not DTensors), each element owned by exactly one rank."""
    norms = torch._foreach_norm(list(local_grads), 2) if local_grads else []
    local = torch.stack(norms).double() if norms else torch.zeros(0, dtype=torch.float64, device=device)
    buffer = torch.stack([local.square().sum(), (~torch.isfinite(local)).sum().double()]).to(device)
    _Counted(topology).record(Op.ALL_REDUCE, dist.group.WORLD, _nbytes(buffer), buffer.dtype, "engine")
    dist.all_reduce(buffer, op=dist.ReduceOp.SUM)
    sum_of_squares, num_nonfinite = buffer.tolist()
    return sum_of_squares ** 0.5, num_nonfinite > 0 or sum_of_squares != sum_of_squares


def set_collective_timeout(timeout_s: float) -> None:
    """Make every process group of this process (the world and zeropp's subgroups, which
    ``new_group`` creates with the backend's 30-minute default) give up on a collective after
    ``timeout_s`` seconds, so a dead or hung peer surfaces as an error."""
    import datetime

    from torch.distributed import distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=timeout_s)
    for group in list(c10d._world.pg_map):
        c10d._set_pg_timeout(timeout, group)
