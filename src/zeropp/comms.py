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
from zeropp.topology import Topology

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
            info = self._groups[group] = GroupInfo.of(self.topology, ranks, dist.get_rank())
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
