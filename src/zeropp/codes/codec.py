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

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from zeropp.codes import gradcode, native, quant, weightcode
from zeropp.codes.gradcode import GradientCode
from zeropp.codes.quant import dequantize_rows, packed_numel, quantize_rows

_ALIGN = 4  # every segment starts 4-byte aligned, so packed fp32 scales can be viewed in place
_SCALE_BYTES = 4  # fp32 scales


@dataclass(frozen=True)
class Segment:
    """One parameter's slice of a chunk."""

    numel: int
    bits: int | None
    """Quantization bits, or None to send the slice in its own dtype."""
    dtype: torch.dtype | None = None
    """The slice's dtype; needed when the chunk is a byte buffer (see [Note: mixed-dtype units])."""
    asymmetric: bool = False
    """Coded with ``zeropp.codes.weightcode``'s asymmetric code (a scale and a center per block)
    instead of ``quant``'s symmetric one."""
    grouped_scales: bool = False
    """Block scales as 8-bit codes under one fp32 scale per ``gradcode.SCALE_GROUP`` blocks
    (qgZ's ``scale_bits=8``, [Note: grouped scales] in ``zeropp.codes.gradcode``)."""

    @property
    def blocks_per_scale(self) -> int:
        """Blocks per fp32 scale: the unit in which the payload lays out blocks and scales."""
        return gradcode.SCALE_GROUP if self.grouped_scales else 1

    @property
    def param_bytes(self) -> int:
        """Bytes per unit of ``blocks_per_scale`` blocks beside the codes."""
        if self.asymmetric:
            return weightcode.PARAM_BYTES
        return _SCALE_BYTES + (gradcode.SCALE_GROUP if self.grouped_scales else 0)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class ChunkCodec:
    """Encodes rows of chunks (num_chunks, chunk_numel) into packed rows (num_chunks, nbytes).

    ``dtype`` is the chunks' dtype; ``torch.uint8`` with segments of other dtypes is byte mode
    ([Note: mixed-dtype units]), where ``numel`` counts bytes. ``code``: qgZ's lower-error block
    code options (``zeropp.codes.gradcode``), coded in one pass; None or plain is ``quant``'s code.
    Segments with ``asymmetric`` are coded in one pass too, with ``zeropp.codes.weightcode``."""

    def __init__(self, segments: Sequence[Segment], block_size: int, dtype: torch.dtype,
                 code: GradientCode | None = None) -> None:
        self.segments = tuple(segments)
        self.block_size = block_size
        self.dtype = dtype
        self.code = None if code is None or code.is_plain else code
        self.byte_mode = dtype == torch.uint8 and any(s.dtype not in (None, torch.uint8) for s in self.segments)
        if self.byte_mode and any(s.dtype is None for s in self.segments):
            raise ValueError("a byte-buffer chunk needs every segment's dtype (Segment.dtype)")
        grouped = {s.grouped_scales for s in self.segments if s.bits is not None}
        if grouped and grouped != {self.code is not None and self.code.grouped_scales}:
            raise ValueError(f"the gradient code {self.code} and the segments' grouped_scales disagree: build the "
                             "segments with segments_for(..., grouped_scales=code.grouped_scales); got segments "
                             f"{self.segments}")
        self._spans: list[tuple[int, int, int, int]] = []  # input offset, input length, byte offset, bytes
        input_offset = byte_offset = 0
        for segment in self.segments:
            input_numel = segment.numel * segment.dtype.itemsize if self.byte_mode else segment.numel
            nbytes = segment_bytes(segment, block_size, dtype, self.byte_mode)
            self._spans.append((input_offset, input_numel, byte_offset, nbytes))
            input_offset += input_numel
            byte_offset += _round_up(nbytes, _ALIGN)
        self.numel = input_offset
        self.nbytes = byte_offset
        self._has_raw = any(s.bits is None for s in self.segments)
        self._plan = _OnePassPlan(self) if _one_pass_applies(self) else None
        self._native_table = (native.segment_table(self._spans, [s.bits for s in self.segments])
                              if _native_applies(self) else None)
        self._grouped_tables = (_GroupedTables(self.code, self._plan.bits, block_size)
                                if self._native_table is not None and self.code is not None and self._plan is not None
                                else None)
        if self.code is not None and (self._plan is None or self._plan.has_raw or self._plan.asymmetric):
            raise ValueError(f"the gradient code {self.code} needs a chunk of symmetric quantized segments of one "
                             f"width and one float dtype; got segments {self.segments} in {dtype}")
        if self._plan is None and any(s.asymmetric for s in self.segments):
            raise ValueError("the asymmetric weight code needs a chunk of one float dtype (not a unit FSDP2 "
                             "gathers as bytes because its parameters mix dtypes: set a MixedPrecisionPolicy "
                             "param_dtype / ZeroPPConfig param_dtype) whose quantized segments share one width; "
                             f"got segments {self.segments} in {dtype}")

    @property
    def is_quantized(self) -> bool:
        return any(s.bits is not None for s in self.segments)

    def _one_pass(self, data: Tensor) -> _OnePassPlan | None:
        """The one-pass plan for the chunks (or decoded output) ``data``, or None where it does
        not apply: the layout does not allow it, the Triton kernels are chosen, or raw segments
        would be read or written in a dtype other than the codec's."""
        plan = self._plan
        if self.code is not None or (plan is not None and plan.asymmetric):
            return plan  # these codes exist in the one-pass torch code only
        if plan is None or quant._use_triton(data.device, plan.bits) or (plan.has_raw and data.dtype != self.dtype):
            return None
        return plan

    def _native(self, rows: Tensor, packed: Tensor) -> bool:
        """Whether this call codes the whole chunk in one call of the C kernels: they are chosen
        and built, the layout allows it, and ``rows`` (chunks or decoded output) are CPU rows of a
        dtype they take (the codec's own where raw segments are copied)."""
        return (self._native_table is not None and quant.native_chosen() and native.takes(rows)
                and (rows.dtype == self.dtype or not self._has_raw) and (packed.shape[1] <= 1 or packed.stride(1) == 1))

    def encode(self, chunks: Tensor, out: Tensor, generator: torch.Generator | None = None) -> None:
        """Write each row of ``chunks`` (num_chunks, numel) as one packed row of ``out``;
        ``generator`` draws the uniforms of stochastic rounding."""
        if self._native(chunks, out):
            if self._grouped_tables is None:
                native.encode_chunks(chunks, self._native_table, self.block_size, out)
            else:
                native.encode_grouped_chunks(chunks, self._native_table, self.block_size, self._grouped_tables, out)
            return
        plan = self._one_pass(chunks)
        if plan is not None:
            plan.encode(chunks, out, generator)
        else:
            self.encode_segments(chunks, out)

    def decode(self, packed: Tensor, out: Tensor) -> None:
        """Decode packed rows (num_chunks, nbytes) into the rows of ``out`` (num_chunks, numel)."""
        if self._native(out, packed):
            if self._grouped_tables is None:
                native.decode_chunks(packed, self._native_table, self.block_size, out)
            else:
                native.decode_grouped_chunks(packed, self._native_table, self.block_size, self._grouped_tables, out)
            return
        plan = self._one_pass(out)
        if plan is not None:
            plan.decode(packed, out)
        else:
            self.decode_segments(packed, out)

    def regrouped(self, rows_per_chunk: int) -> ChunkCodec:
        """The codec of chunks that each join ``rows_per_chunk`` consecutive chunks of this one
        segment by segment: each segment's slices of those chunks, one after the other. FSDP2
        lays out a unit split over hpZ's h ranks so, from the chunks of the S ranks it is
        sharded over (``rows_per_chunk`` = S/h; [Note: hpZ's copy as qwZ's codes] in
        ``zeropp.techniques.hpz``). Its payload is ``regroup_payload`` of theirs: the same codes, so it
        decodes to the same values."""
        return ChunkCodec([s for s in self.segments for _ in range(rows_per_chunk)], self.block_size, self.dtype)

    def regroup_payload(self, packed: Tensor) -> Tensor:
        """Packed rows (m, nbytes) of consecutive chunks as one packed row (1, m * nbytes) of
        ``regrouped(m)``: each segment's bytes of every row, one after the other."""
        spans = [_round_up(nbytes, _ALIGN) for _, _, _, nbytes in self._spans]
        return torch.cat([piece.reshape(1, -1) for piece in packed.split(spans, dim=1)], dim=1)

    def encode_segments(self, chunks: Tensor, out: Tensor) -> None:
        """``encode``, one segment at a time (the reference the one-pass codec is tested against)."""
        for segment, (start, length, byte, nbytes) in zip(self.segments, self._spans):
            source, target = chunks[:, start:start + length], out[:, byte:byte + nbytes]
            if segment.bits is None:
                target.copy_(source.contiguous().view(torch.uint8).view(target.shape))
            elif self.byte_mode:  # a copy: the slice's bytes need not be aligned for its dtype
                aligned = source.clone(memory_format=torch.contiguous_format).view(segment.dtype)
                quantize_rows(aligned, segment.bits, self.block_size, target)
            else:
                quantize_rows(source, segment.bits, self.block_size, target)

    def decode_segments(self, packed: Tensor, out: Tensor) -> None:
        """``decode``, one segment at a time."""
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


def segment_bytes(segment: Segment, block_size: int, dtype: torch.dtype, byte_mode: bool = False) -> int:
    """Bytes of one segment in a payload (before alignment): packed codes and scales, or the
    slice itself in its dtype (``dtype``, the chunk's, unless in byte mode)."""
    if segment.bits is None:
        return segment.numel * (segment.dtype if byte_mode else dtype).itemsize
    unit = block_size * segment.blocks_per_scale
    extra_per_unit = segment.param_bytes - _SCALE_BYTES
    return packed_numel(segment.numel, segment.bits, unit) + extra_per_unit * -(-segment.numel // unit)


def payload_bytes(segments: Sequence[Segment], block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one chunk's payload: ``ChunkCodec(segments, block_size, dtype).nbytes``, computed
    without building the codec (the cost model sizes models of billions of parameters with it)."""
    byte_mode = dtype == torch.uint8 and any(s.dtype not in (None, torch.uint8) for s in segments)
    return sum(_round_up(segment_bytes(s, block_size, dtype, byte_mode), _ALIGN) for s in segments)


def segments_for(padded_numels: Sequence[int], quantize: Sequence[bool], group_size: int,
                 bits: int, dtypes: Sequence[torch.dtype | None] | None = None,
                 asymmetric: bool = False, grouped_scales: bool = False) -> list[Segment]:
    """Each parameter's slice of one chunk when its padded numel is split over ``group_size``;
    ``dtypes``: each parameter's gather dtype (for units that mix dtypes); ``asymmetric``: the
    quantized slices take ``zeropp.codes.weightcode``'s code; ``grouped_scales``: their block scales
    travel as 8-bit codes (``Segment.grouped_scales``)."""
    dtypes = dtypes if dtypes is not None else [None] * len(padded_numels)
    segments = []
    for numel, quantized, dtype in zip(padded_numels, quantize, dtypes, strict=True):
        if numel % group_size:
            raise ValueError(f"a parameter's padded numel {numel} is not divisible by the group "
                             f"size {group_size}; FSDP2 pads dim 0 to the world size, so the group "
                             "must divide the world size")
        segments.append(Segment(numel // group_size, bits if quantized else None, dtype, quantized and asymmetric,
                                quantized and grouped_scales))
    return segments


def _one_pass_applies(codec: ChunkCodec) -> bool:
    """Whether ``codec`` can be coded in one pass: one dtype (no byte mode) and one code (width
    and symmetry)."""
    widths = {(s.bits, s.asymmetric, s.grouped_scales) for s in codec.segments if s.bits is not None and s.numel}
    return not codec.byte_mode and len(widths) == 1 and codec.dtype in quant.INPUT_DTYPES


def _native_applies(codec: ChunkCodec) -> bool:
    """Whether the C kernels can code ``codec``'s chunks: the plain symmetric code at widths
    they take, one dtype (no byte mode) they read, segments that may mix widths and raw ones;
    or qgZ's grouped-scale code rounding to nearest, unrotated, with its groups of blocks within
    a kernel's block buffer."""
    code = codec.code
    if code is not None and not (code.grouped_scales and code.rotation == "none" and code.rounding == "nearest"
                                 and codec.block_size * gradcode.SCALE_GROUP <= native.MAX_BLOCK_SIZE):
        return False
    return (not codec.byte_mode and codec.dtype in native.DTYPES
            and all(s.bits is None or (s.bits in native.BITS and not s.asymmetric) for s in codec.segments)
            and codec.block_size <= native.MAX_BLOCK_SIZE)


class _GroupedTables:
    """The constants the C kernels read to code qgZ's grouped-scale gradient code at one width
    and block size ([Note: grouped scales] and [Note: normal levels] in zeropp.codes.gradcode):
    the normal levels and their midpoints (None for evenly spaced levels), the 256 decoded scale
    codes, and the scale search."""

    def __init__(self, code: GradientCode, bits: int, block_size: int) -> None:
        table = code.table(bits, block_size, torch.device("cpu"))
        self.bits = bits
        self.levels = None if table is None else table.contiguous()
        self.midpoints = (None if table is None else
                          torch.tensor(gradcode._level_midpoints(bits, block_size), dtype=torch.float32))
        self.scale_levels = gradcode._scale_levels("cpu").contiguous()
        self.reach, self.search_steps = gradcode.scale_search(bits, block_size, code)


class _Pieces:
    """Rows assembled from pieces of other rows: each source is split along dim 1 into fixed
    sizes, and a fixed choice of the pieces is concatenated in order, in one ``torch.cat``."""

    def __init__(self, splits: Sequence[Sequence[int]], order: Sequence[tuple[int, int]]) -> None:
        self.splits = [list(sizes) for sizes in splits]
        first = [sum(len(sizes) for sizes in self.splits[:i]) for i in range(len(self.splits))]
        flat = [first[source] + index for source, index in order if self.splits[source][index]]
        self._pick = operator.itemgetter(*flat) if len(flat) > 1 else (lambda pieces: (pieces[flat[0]],))

    def split(self, sources: Sequence[Tensor]) -> list[Tensor]:
        pieces: list[Tensor] = []
        for source, sizes in zip(sources, self.splits):  # trailing sources no piece is taken from may be left out
            pieces += source.split(sizes, dim=1)
        return pieces

    def cat(self, pieces: list[Tensor], out: Tensor | None = None) -> Tensor:
        chosen = self._pick(pieces)
        return torch.cat(chosen, dim=1) if out is None else torch.cat(chosen, dim=1, out=out)


class _OnePassPlan:
    """[Note: one-pass codec]
    Coding a chunk segment by segment costs some twenty small tensor operations per parameter,
    which on a unit of a dozen small parameters is milliseconds per call where the bytes take
    microseconds. The plan codes every segment of a chunk at once, with the same bytes and values
    (tests compare it with the per-segment path bit for bit). It lays the quantized segments out
    as whole blocks, each segment starting a new block with its tail zero-filled (as the
    per-segment path pads it), so the scales and codes of all blocks come from one call of the
    block code; elements move between the chunk, the block layout and the payload by splitting
    rows into fixed pieces and concatenating a fixed choice of them (``_Pieces``), one
    ``torch.cat`` per layout change, planned once per layout. (An index gather does the same
    moves but costs ten times a copy per element on CPU.)
    """

    def __init__(self, codec: ChunkCodec) -> None:
        itemsize = codec.dtype.itemsize
        first = next(s for s in codec.segments if s.bits is not None and s.numel)
        self.bits, self.asymmetric, self.param_bytes = first.bits, first.asymmetric, first.param_bytes
        param_bytes = self.param_bytes
        # blocks and scales are laid out per unit: one block, or a group sharing an fp32 scale
        block_size = codec.block_size * first.blocks_per_scale
        self.codec, self.block_size, self.grouped = codec, block_size, first.grouped_scales
        code_bytes_per_block = block_size * self.bits // 8
        # splits of each source (lists of piece sizes along dim 1) ...
        lengths, pads, codes, scales, chunk_bytes, zero_bytes = [], [], [], [], [], []
        payload, payload_elements, junk, values = [], [], [], []
        # ... and, per layout, the pieces it is made of: (source, piece)
        to_blocks, to_payload, to_codes, to_scales, to_out = [], [], [], [], []
        whole = []  # per scaled block of a row: does it hold a whole block of its segment (no padding)?
        for segment, (_, length, _, nbytes) in zip(codec.segments, codec._spans, strict=True):
            lengths.append(length)
            chunk_bytes.append(length * itemsize)
            if segment.bits is None:
                padded = _round_up(nbytes, _ALIGN)
                to_payload += [(2, len(chunk_bytes) - 1), (3, len(zero_bytes))]
                zero_bytes.append(padded - nbytes)
                payload.append(padded)
                to_out.append((1, len(payload_elements)))
                payload_elements += [length, (padded - nbytes) // itemsize]
                continue
            num_blocks = -(-length // block_size)
            num_whole = length // codec.block_size
            whole += [True] * num_whole + [False] * (num_blocks * block_size // codec.block_size - num_whole)
            data_bytes = nbytes - num_blocks * param_bytes
            to_blocks += [(0, len(lengths) - 1), (1, len(pads))]
            pads.append(num_blocks * block_size - length)
            to_payload += [(0, len(codes)), (1, len(scales))]
            codes += [data_bytes, num_blocks * code_bytes_per_block - data_bytes]
            scales.append(num_blocks * param_bytes)
            to_codes += [(0, len(payload)), (1, len(junk))]
            to_scales.append((0, len(payload) + 1))
            payload += [data_bytes, num_blocks * param_bytes]
            junk.append(num_blocks * code_bytes_per_block - data_bytes)
            payload_elements.append(nbytes // itemsize)
            to_out.append((0, len(values)))
            values += [length, num_blocks * block_size - length]
        self.blocks = _Pieces([lengths, pads], to_blocks)
        self.payload = _Pieces([codes, scales, chunk_bytes, zero_bytes], to_payload)
        self.codes = _Pieces([payload, junk], to_codes)
        self.scales = _Pieces([payload, junk], to_scales)
        self.out = _Pieces([values, payload_elements], to_out)
        self.num_pad, self.num_zero_bytes, self.num_junk = sum(pads), sum(zero_bytes), sum(junk)
        self.has_raw = any(s.bits is None for s in codec.segments)
        self.aligned = not self.has_raw and not self.num_pad
        """Every segment is quantized and fills whole blocks: the chunk is the block layout."""
        self.whole = None if all(whole) else torch.tensor(whole)

    def _whole(self, num_blocks: int, device: torch.device) -> Tensor | None:
        """Per block of ``num_blocks`` (whole rows of them): whether it is whole, not a segment's
        padded tail ([Note: block rotation]); None if all are."""
        if self.whole is None:
            return None
        return self.whole.to(device).repeat(num_blocks // len(self.whole))

    def _scales_and_codes(self, blocks: Tensor, fresh: bool,
                          generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
        """The block code of (num_units, unit) fp32 blocks: the scales' bytes per unit (quant's
        fp32 scale, weightcode's (scale, center) pair, or a group's fp32 scale and block codes)
        and the integer-valued codes per element."""
        code = self.codec.code
        if self.asymmetric:
            params = weightcode.block_params(blocks, self.bits)
            return params.view(torch.uint8), weightcode.block_codes(blocks, params, self.bits)
        if code is None:
            scales = quant._block_scales(blocks, self.bits)
            return scales[:, None].view(torch.uint8), quant._block_codes(blocks, scales, overwrite=fresh)
        blocks = blocks.view(-1, self.codec.block_size)
        if code.rotation == "hadamard":
            blocks = gradcode.rotate(blocks, self._whole(len(blocks), blocks.device))
        if not self.grouped:
            scales = gradcode.block_scales(blocks, self.bits, code)
            return scales[:, None].view(torch.uint8), gradcode.block_codes(blocks, scales, self.bits, code, generator)
        top, scale_codes, codes = gradcode.grouped_block_code(blocks, self.bits, code, generator,
                                                              self._whole(len(blocks), blocks.device))
        return torch.cat((top[:, None].view(torch.uint8), scale_codes), dim=1), codes

    def _values(self, codes: Tensor, params: Tensor) -> Tensor:
        """Decoded fp32 values from codes (num_units, unit) and the scales' bytes per unit
        (num_units, param_bytes), as ``_scales_and_codes`` wrote them."""
        code = self.codec.code
        if self.asymmetric:
            return weightcode.block_values(codes, params.view(torch.float32))
        if code is None:
            return codes.mul_(params.view(torch.float32))
        codes = codes.view(-1, self.codec.block_size)
        if self.grouped:
            top = params[:, :_SCALE_BYTES].contiguous().view(torch.float32).view(-1)
            scales = gradcode.decode_group_scales(top, params[:, _SCALE_BYTES:]).view(-1)
        else:
            scales = params.view(torch.float32).view(-1)
        values = gradcode.block_values(codes, scales, self.bits, code)
        if code.rotation == "hadamard":
            values = gradcode.rotate(values, self._whole(len(values), values.device), inverse=True)
        return values

    def encode(self, chunks: Tensor, out: Tensor, generator: torch.Generator | None = None) -> None:
        rows, block_size = chunks.shape[0], self.block_size
        if self.aligned:
            blocks, fresh = quant._to_blocks(chunks, block_size)
        else:
            pieces = self.blocks.split([chunks, chunks.new_zeros((rows, self.num_pad))])
            blocks, fresh = self.blocks.cat(pieces).float().view(-1, block_size), True
        params, codes = self._scales_and_codes(blocks, fresh, generator)
        sources = [quant.pack_codes(codes.view(rows, -1), self.bits), params.reshape(rows, -1)]
        if self.has_raw:
            sources += [chunks.view(torch.uint8), chunks.new_zeros((rows, self.num_zero_bytes), dtype=torch.uint8)]
        self.payload.cat(self.payload.split(sources), out=out)

    def decode(self, packed: Tensor, out: Tensor) -> None:
        rows, block_size = packed.shape[0], self.block_size
        pieces = self.codes.split([packed, packed.new_zeros((rows, self.num_junk))])
        codes = quant.unpack_codes(self.codes.cat(pieces), self.bits)
        params = self.scales.cat(pieces).view(-1, self.param_bytes)
        values = self._values(codes.view(-1, block_size), params).view(rows, -1)
        if self.aligned:
            out.copy_(values)
        else:
            self.out.cat(self.out.split([values, packed.view(out.dtype)] if self.has_raw else [values]), out=out)
