"""How one rank's chunk of a flat FSDP buffer becomes bytes on the wire, and back.

An FSDP2 unit communicates all its parameters in one flat buffer: each rank's chunk is the
concatenation of that rank's slice of every parameter. ZeRO++ quantizes these chunks before
they travel. zeropp quantizes every parameter's slice on its own (blocks never cover two
parameters, so a LayerNorm never shares a scale with a large matrix), can leave some slices in
full precision (trainable parameters when only frozen ones are quantized), and packs it all
into one uint8 payload per chunk so data and scales travel in one collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from zeropp.quant import dequantize_rows, packed_numel, quantize_rows

_ALIGN = 4  # every segment starts 4-byte aligned, so packed fp32 scales can be viewed in place


@dataclass(frozen=True)
class Segment:
    """One parameter's slice of a chunk."""

    numel: int
    bits: int | None
    """Quantization bits, or None to send the slice in its own dtype."""


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class ChunkCodec:
    """Encodes rows of chunks (num_chunks, chunk_numel) into packed rows (num_chunks, nbytes)."""

    def __init__(self, segments: Sequence[Segment], block_size: int, dtype: torch.dtype) -> None:
        self.segments = tuple(segments)
        self.block_size = block_size
        self.dtype = dtype
        self.numel = sum(s.numel for s in self.segments)
        self._spans: list[tuple[int, int, int, int]] = []  # element offset, numel, byte offset, bytes
        element_offset = byte_offset = 0
        for segment in self.segments:
            nbytes = self._segment_bytes(segment)
            self._spans.append((element_offset, segment.numel, byte_offset, nbytes))
            element_offset += segment.numel
            byte_offset += _round_up(nbytes, _ALIGN)
        self.nbytes = byte_offset

    def _segment_bytes(self, segment: Segment) -> int:
        if segment.bits is None:
            return segment.numel * self.dtype.itemsize
        return packed_numel(segment.numel, segment.bits, self.block_size)

    @property
    def is_quantized(self) -> bool:
        return any(s.bits is not None for s in self.segments)

    def encode(self, chunks: Tensor, out: Tensor) -> None:
        """Write each row of ``chunks`` (num_chunks, numel) as one packed row of ``out``."""
        for segment, (elem, numel, byte, nbytes) in zip(self.segments, self._spans):
            source, target = chunks[:, elem:elem + numel], out[:, byte:byte + nbytes]
            if segment.bits is None:
                target.copy_(source.contiguous().view(torch.uint8).view(target.shape))
            else:
                quantize_rows(source, segment.bits, self.block_size, target)

    def decode(self, packed: Tensor, out: Tensor) -> None:
        """Decode packed rows (num_chunks, nbytes) into the rows of ``out`` (num_chunks, numel)."""
        for segment, (elem, numel, byte, nbytes) in zip(self.segments, self._spans):
            source, target = packed[:, byte:byte + nbytes], out[:, elem:elem + numel]
            if segment.bits is None:
                target.copy_(source.contiguous().view(self.dtype).view(target.shape))
            else:
                dequantize_rows(source, segment.bits, self.block_size, target)


def segments_for(padded_numels: Sequence[int], quantize: Sequence[bool], group_size: int,
                 bits: int) -> list[Segment]:
    """Each parameter's slice of one chunk when its padded numel is split over ``group_size``."""
    segments = []
    for numel, quantized in zip(padded_numels, quantize, strict=True):
        if numel % group_size:
            raise ValueError(f"a parameter's padded numel {numel} is not divisible by the group "
                             f"size {group_size}; FSDP2 pads dim 0 to the world size, so the group "
                             "must divide the world size")
        segments.append(Segment(numel // group_size, bits if quantized else None))
    return segments
