"""The asymmetric (minimum-to-maximum) block code for weights, beside ``quant``'s symmetric one.

``quant``'s code puts its levels evenly on ``[-absmax, absmax]`` of a block: right for values
spread around zero, wasteful for a block whose values sit to one side, and unable to reproduce
a grid that was not symmetric to begin with. The asymmetric code spans each block from its
minimum to its maximum with all ``2**bits`` levels (the symmetric code uses ``2**bits - 1``), at
the price of a second fp32 per block. At 4 bits and blocks of 32 its levels are those of
llama.cpp's Q4_1 (``min + d * q``, q in 0..15), so weights dequantized from a Q4_1 file travel
without loss. Pure tensor math, no torch.distributed; coded in ``zeropp.codes.codec``'s one pass.

[Note: asymmetric block code]
With block minimum ``lo``, maximum ``hi`` and ``L = 2**bits - 1``: ``center = lo/2 + hi/2`` and
``scale = (hi/2 - lo/2) / (L/2)`` (halved first, so finite input never overflows on the way);
the levels are ``center + (k + 1/2) * scale`` for k in ``[-2**(bits-1), 2**(bits-1) - 1]``, the
outer two at ``lo`` and ``hi``. The code of ``x`` is ``k = round((x - center) / scale - 1/2)``,
clamped to that range, so ``|x - level| <= scale / 2`` up to fp32 rounding of the few operations
(an absolute error of a few ulps of the block's largest magnitude, and of the smallest
subnormal times L where the scale is subnormal). ``k`` is stored as ``quant``'s field ``k +
2**(bits-1)`` ([Note: packed layout]); after a segment's codes come its blocks' ``(scale,
center)`` pairs, 8 bytes per block. A constant block (a zero block among them) has scale 0 and
decodes to the constant exactly. A NaN or inf in a block makes its scale and center NaN and its
codes 0, so the block decodes to NaN, as ``quant``'s [Note: non-finite blocks]. A scale whose
top level would round to inf is moved down one ulp, so finite input decodes finite.
"""

from __future__ import annotations

import torch
from torch import Tensor

CODES = ("symmetric", "asymmetric")
"""Weight codes: ``quant``'s symmetric code (one fp32 per block) or this module's (two)."""

PARAM_BYTES = 8
"""Bytes per block of the asymmetric code: an fp32 scale and an fp32 center."""


def block_params(blocks: Tensor, bits: int) -> Tensor:
    """Per block row of ``blocks`` (num_blocks, B) fp32: ``(scale, center)`` (num_blocks, 2)
    fp32, NaN for non-finite blocks (see [Note: asymmetric block code])."""
    half_steps = (2**bits - 1) / 2
    half_lo, half_hi = blocks.amin(dim=1).mul_(0.5), blocks.amax(dim=1).mul_(0.5)  # both keep NaN
    center = half_lo + half_hi
    scale = (half_hi - half_lo).div_(torch.full_like(half_hi, half_steps))  # exact on CUDA too (quant._block_scales)
    overflows = torch.isinf(center.abs() + scale * half_steps) & torch.isfinite(scale)
    scale = torch.where(overflows, scale.nextafter(torch.zeros_like(scale)), scale)
    finite = torch.isfinite(scale) & torch.isfinite(center)
    return torch.stack((scale, center), dim=1).masked_fill_(~finite[:, None], torch.nan)


def block_codes(blocks: Tensor, params: Tensor, bits: int) -> Tensor:
    """Integer-valued fp32 codes in ``[-2**(bits-1), 2**(bits-1) - 1]`` of ``blocks``
    (num_blocks, B) with their ``params`` (num_blocks, 2); zero for non-finite blocks."""
    scale, center = params[:, 0:1], params[:, 1:2]
    divisors = torch.where(scale > 0, scale, torch.inf)  # a constant block: every code 0
    half = 2 ** (bits - 1)
    units = (blocks - center).div_(divisors).sub_(0.5).round_().nan_to_num_(0.0)
    return units.clamp_(-half, half - 1)


def block_values(codes: Tensor, params: Tensor) -> Tensor:
    """Decoded fp32 values (num_blocks, B) of ``codes`` (num_blocks, B, overwritten) and their
    blocks' ``params`` (num_blocks, 2)."""
    return codes.add_(0.5).mul_(params[:, 0:1]).add_(params[:, 1:2])


def error_bound(params: Tensor, bits: int) -> Tensor:
    """Per block: the largest ``|x - decoded|`` the code allows (num_blocks,), the fp32
    rounding of [Note: asymmetric block code] included; NaN for non-finite blocks."""
    scale, center = params[:, 0], params[:, 1]
    magnitude = center.abs() + scale * (2**bits - 1) / 2
    eps, tiny = torch.finfo(torch.float32).eps, torch.finfo(torch.float32).smallest_normal
    return scale / 2 + 4 * eps * magnitude + (2**bits) * tiny * eps
