"""How one rank's chunk of a flat FSDP buffer becomes bytes on the wire, and back.

An FSDP2 unit communicates all its parameters in one flat buffer: each rank's chunk is the
concatenation of that rank's slice of every parameter. ZeRO++ quantizes these chunks before
they travel. zeropp quantizes every parameter's slice on its own (blocks never cover two
parameters, so a LayerNorm never shares a scale with a large matrix), can leave some slices in
full precision (trainable parameters when only frozen ones are quantized), and packs it all
into one uint8 payload per chunk so data and scales travel in one collective.

[Note: mixed-dtype units]
FSDP2 all-gathers a unit whose parameters have different dtypes (a frozen bf16 base beside fp32
LoRA adapters, without a mixed-precision ``param_dtype``) as one uint8 buffer: each rank's chunk
is every parameter's slice as raw bytes, one after the other. The codec then runs in byte mode:
each segment carries its parameter's dtype, is read from its byte range as that dtype, coded as
usual (quantized, or raw bytes), and decoded back into the same byte range. Units of one dtype
never enter byte mode, so their payloads are unchanged.
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
    dtype: torch.dtype | None = None
    """The slice's dtype; needed when the chunk is a byte buffer (see [Note: mixed-dtype units])."""


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class ChunkCodec:
    """Encodes rows of chunks (num_chunks, chunk_numel) into packed rows (num_chunks, nbytes).

    ``dtype`` is the chunks' dtype; ``torch.uint8`` with segments of other dtypes is byte mode
    ([Note: mixed-dtype units]), where ``numel`` counts bytes."""

    def __init__(self, segments: Sequence[Segment], block_size: int, dtype: torch.dtype) -> None:
        self.segments = tuple(segments)
        self.block_size = block_size
        self.dtype = dtype
        self.byte_mode = dtype == torch.uint8 and any(s.dtype not in (None, torch.uint8) for s in self.segments)
        if self.byte_mode and any(s.dtype is None for s in self.segments):
            raise ValueError("a byte-buffer chunk needs every segment's dtype (Segment.dtype)")
        self._spans: list[tuple[int, int, int, int]] = []  # input offset, input length, byte offset, bytes
        input_offset = byte_offset = 0
        for segment in self.segments:
            input_numel = segment.numel * segment.dtype.itemsize if self.byte_mode else segment.numel
            nbytes = self._segment_bytes(segment)
            self._spans.append((input_offset, input_numel, byte_offset, nbytes))
            input_offset += input_numel
            byte_offset += _round_up(nbytes, _ALIGN)
        self.numel = input_offset
        self.nbytes = byte_offset

    def _segment_bytes(self, segment: Segment) -> int:
        if segment.bits is None:
            return segment.numel * (segment.dtype if self.byte_mode else self.dtype).itemsize
        return packed_numel(segment.numel, segment.bits, self.block_size)

    @property
    def is_quantized(self) -> bool:
        return any(s.bits is not None for s in self.segments)

    def encode(self, chunks: Tensor, out: Tensor) -> None:
        """Write each row of ``chunks`` (num_chunks, numel) as one packed row of ``out``."""
        for segment, (start, length, byte, nbytes) in zip(self.segments, self._spans):
            source, target = chunks[:, start:start + length], out[:, byte:byte + nbytes]
            if segment.bits is None:
                target.copy_(source.contiguous().view(torch.uint8).view(target.shape))
            elif self.byte_mode:  # a copy: the slice's bytes need not be aligned for its dtype
                aligned = source.clone(memory_format=torch.contiguous_format).view(segment.dtype)
                quantize_rows(aligned, segment.bits, self.block_size, target)
            else:
                quantize_rows(source, segment.bits, self.block_size, target)

    def decode(self, packed: Tensor, out: Tensor) -> None:
        """Decode packed rows (num_chunks, nbytes) into the rows of ``out`` (num_chunks, numel)."""
        for segment, (start, length, byte, nbytes) in zip(self.segments, self._spans):
            source, target = packed[:, byte:byte + nbytes], out[:, start:start + length]
            if segment.bits is None:
                target.copy_(source.contiguous().view(target.dtype).view(target.shape))
            elif self.byte_mode:
                decoded = torch.empty((len(packed), segment.numel), dtype=segment.dtype, device=packed.device)
                dequantize_rows(source, segment.bits, self.block_size, decoded)
                target.copy_(decoded.view(torch.uint8))
            else:
                dequantize_rows(source, segment.bits, self.block_size, target)


def segments_for(padded_numels: Sequence[int], quantize: Sequence[bool], group_size: int,
                 bits: int, dtypes: Sequence[torch.dtype | None] | None = None) -> list[Segment]:
    """Each parameter's slice of one chunk when its padded numel is split over ``group_size``;
    ``dtypes``: each parameter's gather dtype (for units that mix dtypes)."""
    dtypes = dtypes if dtypes is not None else [None] * len(padded_numels)
    segments = []
    for numel, quantized, dtype in zip(padded_numels, quantize, dtypes, strict=True):
        if numel % group_size:
            raise ValueError(f"a parameter's padded numel {numel} is not divisible by the group "
                             f"size {group_size}; FSDP2 pads dim 0 to the world size, so the group "
                             "must divide the world size")
        segments.append(Segment(numel // group_size, bits if quantized else None, dtype))
    return segments
