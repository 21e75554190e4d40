"""How large a block code's error may be: per block, the L2 bound on ``x - decode(encode(x))``
that a codec's segments allow, derived from the exact values alone (never from a payload), so
that a collective's error can be held against it while training (``zeropp.techniques.audit``).

[Note: block-constant bounds]
A bound is a tensor shaped like the values it bounds, holding for each block one value repeated
over the block: ``v_b = (L2 bound of the block's error) / sqrt(n_b)``, so the block's L2 norm of
the vector is the bound itself. Such vectors add: the errors of several codings that sum into
one result (qgZ's hops, each rank's rows) are bounded, by the triangle inequality, by the sum of
their bounds, and the sum of block-constant vectors is block-constant with exactly that norm. So
a bound can be reduced by the same collective as the values it bounds. Per block of ``n``
elements with absolute maximum ``a`` (after the rotation, for rotated gradient blocks):

- the symmetric code at ``b`` bits: each element within half a step, ``a / qmax / 2``
  (``qmax = 2**(b-1) - 1``), plus fp32 rounding of the scale and the product;
- the asymmetric weight code: ``zeropp.codes.weightcode.error_bound`` of the block's parameters;
- qgZ's lower-error codes (``zeropp.codes.gradcode``): half the largest level gap (all of it
  with stochastic rounding), in units of ``a`` for normal levels or of ``a / qmax``; a rotated
  block keeps its error's L2 norm through the rotation back; 8-bit scales sit at most one
  scale step (``2**(1/32)``) above the block's own, or at the group's floor;
- values decoded into a narrower dtype than fp32 add its rounding, ``eps * a``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from zeropp.codes import gradcode, weightcode
from zeropp.codes.codec import ChunkCodec, Segment

_FP32_ROUNDING = 2.0 ** -22
"""A few fp32 ulps of a block's magnitude: the scale's division and the decode's product."""


def coding_bound(codec: ChunkCodec, rows: Tensor, out_dtype: torch.dtype = torch.float32) -> Tensor:
    """The block-constant bound ([Note: block-constant bounds]) on the error of coding each row
    of ``rows`` (num_rows, codec.numel) with ``codec`` and decoding into ``out_dtype``: fp32,
    zero on segments sent unquantized, NaN on blocks holding a non-finite value."""
    if codec.byte_mode:
        raise ValueError("coding_bound takes a codec of one dtype, not a byte-mode chunk")
    bound = torch.zeros(rows.shape, dtype=torch.float32, device=rows.device)
    extra = 0.0 if out_dtype == torch.float32 else torch.finfo(out_dtype).eps
    for segment, (start, stop) in zip(codec.segments, _columns(codec)):
        if segment.bits is None or start == stop:
            continue
        blocks = _blocks(rows[:, start:stop].float(), codec.block_size)  # (rows, num_blocks, B)
        per_block = _segment_bound(blocks, segment, codec) + extra * blocks.abs().amax(dim=2)
        bound[:, start:stop] = _spread(per_block, codec.block_size, stop - start)
    return bound


def block_constant(codec: ChunkCodec, values: Tensor) -> Tensor:
    """``values`` (num_rows, codec.numel), non-negative, as a block-constant vector with the same
    block L2 norms (a bound per element turned into one that adds as [Note: block-constant
    bounds] says)."""
    out = torch.empty(values.shape, dtype=torch.float32, device=values.device)
    for start, stop in _columns(codec):
        if start == stop:
            continue
        blocks = _blocks(values[:, start:stop].float(), codec.block_size)
        counts = _block_counts(stop - start, codec.block_size, values.device)
        out[:, start:stop] = _spread(blocks.norm(dim=2) / counts.sqrt(), codec.block_size, stop - start)
    return out


def block_norms(codec: ChunkCodec, values: Tensor) -> Tensor:
    """The L2 norm of each block of ``values`` (num_rows, codec.numel): (num_rows, num_blocks),
    the blocks of every segment one after the other."""
    norms = [_blocks(values[:, start:stop].float(), codec.block_size).norm(dim=2)
             for start, stop in _columns(codec) if start < stop]
    return torch.cat(norms, dim=1) if norms else values.new_zeros((values.shape[0], 0), dtype=torch.float32)


def _columns(codec: ChunkCodec) -> list[tuple[int, int]]:
    """Each segment's columns in a chunk."""
    columns, start = [], 0
    for segment in codec.segments:
        columns.append((start, start + segment.numel))
        start += segment.numel
    return columns


def _blocks(values: Tensor, block_size: int) -> Tensor:
    """(rows, n) as (rows, num_blocks, block_size), the last block zero-padded."""
    padded = torch.nn.functional.pad(values, (0, -values.shape[1] % block_size))
    return padded.view(values.shape[0], -1, block_size)


def _block_counts(numel: int, block_size: int, device: torch.device) -> Tensor:
    """How many elements each block of a run of ``numel`` holds."""
    counts = torch.full((-(-numel // block_size),), float(block_size), device=device)
    counts[-1] = numel - (len(counts) - 1) * block_size
    return counts


def _spread(per_block: Tensor, block_size: int, numel: int) -> Tensor:
    """One value per block (rows, num_blocks) repeated over the block's elements: (rows, numel)."""
    return per_block.repeat_interleave(block_size, dim=1)[:, :numel]


def _segment_bound(blocks: Tensor, segment: Segment, codec: ChunkCodec) -> Tensor:
    """Per block (rows, num_blocks): the largest error per element, or for rotated blocks the
    error's L2 norm over sqrt(B); NaN where a block is not finite."""
    bits = segment.bits
    if segment.asymmetric:
        params = weightcode.block_params(blocks.flatten(0, 1), bits)
        return weightcode.error_bound(params, bits).view(blocks.shape[:2])
    code = codec.code
    absmax = blocks.abs().amax(dim=2)
    if code is None:
        return absmax * (0.5 / (2 ** (bits - 1) - 1) + _FP32_ROUNDING)
    if code.rotation == "hadamard":
        whole = _whole_blocks(blocks.shape[1], segment.numel, codec.block_size, blocks.device)
        rotated = gradcode.rotate(blocks.flatten(0, 1), whole.repeat(blocks.shape[0]))
        absmax = rotated.abs().amax(dim=1).view(absmax.shape)
    gap = gradcode.max_level_gap(bits, codec.block_size, code)
    levels_in_absmax = code.table(bits, codec.block_size, torch.device("cpu")) is not None
    per_element = (gap if code.rounding == "stochastic" else gap / 2) * (
        1.0 if levels_in_absmax else 1.0 / (2 ** (bits - 1) - 1))
    if code.grouped_scales:
        absmax = _grouped_reach(absmax)
    return absmax * (per_element + _FP32_ROUNDING)


def _whole_blocks(num_blocks: int, numel: int, block_size: int, device: torch.device) -> Tensor:
    """Which blocks of a segment are whole (only those are rotated)."""
    whole = torch.ones(num_blocks, dtype=torch.bool, device=device)
    whole[-1] = numel % block_size == 0
    return whole


def _grouped_reach(absmax: Tensor) -> Tensor:
    """The largest scale an 8-bit scale code can give a block (rows, num_blocks): one step of
    ``2**(1/SCALE_STEPS)`` above its own, or the floor of its group of ``SCALE_GROUP`` blocks
    ([Note: grouped scales] in ``zeropp.codes.gradcode``)."""
    group = gradcode.SCALE_GROUP
    padded = torch.nn.functional.pad(absmax, (0, -absmax.shape[1] % group))
    group_max = padded.view(absmax.shape[0], -1, group).amax(dim=2).repeat_interleave(group, dim=1)
    floor = group_max[:, :absmax.shape[1]] * 2.0 ** (-254 / gradcode.SCALE_STEPS)
    return absmax * 2.0 ** (1 / gradcode.SCALE_STEPS) * (1 + 1e-6) + floor


def relative_norm(numerator: float, denominator: float) -> float:
    """``sqrt(numerator / denominator)`` of two sums of squares, 0 for 0 / 0."""
    return math.sqrt(numerator / denominator) if denominator > 0 else (0.0 if numerator == 0 else math.inf)
