"""Triton kernels for ``zeropp.codes.quant`` on CUDA: one pass over memory per encode and per decode.

The torch path of ``zeropp.codes.quant`` makes about eight elementwise passes (cast, pad, amax, amin,
divide, round, narrow, pack); each of these kernels reads its input once and writes its output
once. They are bit-identical to the torch path for every input, non-finite and subnormal values
included, so a rank using them and a rank using the torch path exchange the same bytes:

* scale = ``absmax / qmax`` with IEEE round-to-nearest division (``div_rn``; Triton's plain
  ``/`` on fp32 is an approximate division), then the same one-ulp moves as
  ``quant._block_scales`` (up for a subnormal scale of a non-zero block, down where
  ``qmax * scale`` overflows), NaN for a block holding a NaN or an inf;
* code = ``round_half_even(x / scale)`` (``div_rn`` again; the rounding adds and subtracts
  1.5 * 2**23, exact for the |code| <= 128 that can occur), 0 where the scale is 0 or NaN;
* decode = ``code * scale`` in fp32, cast to the output dtype with round-to-nearest-even.

A program handles ``group`` consecutive blocks of one row, about 4096 elements, so a block of
256 costs no more launches than a copy. ``tests/test_quant_triton.py`` checks bit-identity on a
GPU; ``zeropp bench quant`` measures both paths against a device-to-device copy.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: zeropp.codes.quant keeps its torch path
    triton = None

__all__ = ["BITS", "available", "encode_rows", "decode_rows"]

BITS = (4, 8)
"""The code widths the kernels take; ``zeropp.codes.quant`` codes the others with its torch path."""

_ELEMENTS_PER_PROGRAM = 4096


def available(device: torch.device) -> bool:
    """Whether the kernels can run on ``device``: a CUDA device and an importable Triton."""
    return triton is not None and device.type == "cuda"


if triton is not None:
    # a kernel may read a global only if it is a constexpr: Triton's compiler refuses a plain float
    # (its CPU interpreter accepts one, so only a compile shows it: tests/test_cuda.py)
    _FP32_TINY = tl.constexpr(1.1754943508222875e-38)  # smallest normal fp32
    _ROUNDING_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23: (v + M) - M rounds |v| < 2**22 half to even

    @triton.jit
    def _block_scale(absmax, finite, QMAX: tl.constexpr):
        """fp32 scale per block from its finite absmax, as ``quant._block_scales``."""
        scale = tl.math.div_rn(absmax, QMAX * 1.0)
        up = (scale.to(tl.int32, bitcast=True) + 1).to(tl.float32, bitcast=True)
        scale = tl.where((scale < _FP32_TINY) & (absmax > 0.0), up, scale)
        down = (scale.to(tl.int32, bitcast=True) - 1).to(tl.float32, bitcast=True)
        scale = tl.where(scale * QMAX == float("inf"), down, scale)
        return tl.where(finite, scale, float("nan"))

    @triton.jit
    def _block_codes(x, scale):
        """Integer codes (int32) of ``x`` (G, K) for per-block ``scale`` (G,)."""
        usable = scale > 0.0  # false for zero and NaN scales: their codes are 0
        divisor = tl.where(usable, scale, 1.0)[:, None]
        q = tl.math.div_rn(x, divisor)
        q = (q + _ROUNDING_MAGIC) - _ROUNDING_MAGIC
        return tl.where(usable[:, None], q, 0.0).to(tl.int32)

    @triton.jit
    def _absmax_finite(x):
        """Per-row max |x| over finite elements, and whether every element is finite."""
        ax = tl.abs(x)
        is_finite = ax < float("inf")  # false for NaN too
        absmax = tl.max(tl.where(is_finite, ax, 0.0), axis=1)
        finite = tl.min(is_finite.to(tl.int32), axis=1) > 0
        return absmax, finite

    @triton.jit
    def _encode_kernel(x_ptr, x_stride, data_ptr, data_stride, scales_ptr, scales_stride,
                       numel, num_blocks, data_bytes,
                       BITS: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr):
        row = tl.program_id(1).to(tl.int64)
        blocks = tl.program_id(0) * GROUP + tl.arange(0, GROUP)
        x_row = x_ptr + row * x_stride
        data_row = data_ptr + row * data_stride
        QMAX: tl.constexpr = 2 ** (BITS - 1) - 1
        if BITS == 8:
            idx = blocks[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
            x = tl.load(x_row + idx, mask=idx < numel, other=0.0).to(tl.float32)
            absmax, finite = _absmax_finite(x)
            scale = _block_scale(absmax, finite, QMAX)
            codes = _block_codes(x, scale)
            tl.store(data_row + idx, codes.to(tl.int8), mask=idx < data_bytes)
        else:
            pair = blocks[:, None] * (BLOCK // 2) + tl.arange(0, BLOCK // 2)[None, :]
            even = tl.load(x_row + 2 * pair, mask=2 * pair < numel, other=0.0).to(tl.float32)
            odd = tl.load(x_row + 2 * pair + 1, mask=2 * pair + 1 < numel, other=0.0).to(tl.float32)
            absmax_even, finite_even = _absmax_finite(even)
            absmax_odd, finite_odd = _absmax_finite(odd)
            scale = _block_scale(tl.maximum(absmax_even, absmax_odd), finite_even & finite_odd, QMAX)
            low = _block_codes(even, scale) + 8
            high = _block_codes(odd, scale) + 8
            tl.store(data_row + pair, (low | (high << 4)).to(tl.uint8), mask=pair < data_bytes)
        tl.store(scales_ptr + row * scales_stride + blocks, scale, mask=blocks < num_blocks)

    @triton.jit
    def _decode_kernel(data_ptr, data_stride, scales_ptr, scales_stride, out_ptr, out_stride,
                       numel, num_blocks,
                       BITS: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr):
        row = tl.program_id(1).to(tl.int64)
        blocks = tl.program_id(0) * GROUP + tl.arange(0, GROUP)
        data_row = data_ptr + row * data_stride
        out_row = out_ptr + row * out_stride
        scale = tl.load(scales_ptr + row * scales_stride + blocks, mask=blocks < num_blocks, other=0.0)
        out_dtype = out_ptr.dtype.element_ty
        if BITS == 8:
            idx = blocks[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
            codes = tl.load(data_row + idx, mask=idx < numel, other=0).to(tl.float32)
            tl.store(out_row + idx, (codes * scale[:, None]).to(out_dtype), mask=idx < numel)
        else:
            pair = blocks[:, None] * (BLOCK // 2) + tl.arange(0, BLOCK // 2)[None, :]
            byte = tl.load(data_row + pair, mask=2 * pair < numel, other=0x88).to(tl.int32)
            low = ((byte & 15) - 8).to(tl.float32) * scale[:, None]
            high = ((byte >> 4) - 8).to(tl.float32) * scale[:, None]
            tl.store(out_row + 2 * pair, low.to(out_dtype), mask=2 * pair < numel)
            tl.store(out_row + 2 * pair + 1, high.to(out_dtype), mask=2 * pair + 1 < numel)


def _launch_shape(num_chunks: int, num_blocks: int, block_size: int) -> tuple[int, tuple[int, int], int]:
    """Blocks per program, the grid, and warps per program. Block groups go on the grid's
    first axis (up to 2**31 - 1 programs), chunks (one per rank) on the second (up to 65535)."""
    group = max(1, _ELEMENTS_PER_PROGRAM // block_size)
    grid = (-(-num_blocks // group), num_chunks)
    num_warps = 8 if group * block_size >= 8192 else 4
    return group, grid, num_warps


def _on(device: torch.device) -> contextlib.AbstractContextManager:
    """Launch on ``device`` (CPU tensors reach here only under ``TRITON_INTERPRET=1``)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def encode_rows(chunks: Tensor, bits: int, block_size: int, data_out: Tensor, scales_out: Tensor) -> None:
    """``quant._encode_into`` on CUDA: ``chunks`` (num_chunks, numel) into the views
    ``data_out`` (num_chunks, data_bytes) uint8 and ``scales_out`` (num_chunks, num_blocks) fp32.
    Arguments are checked by the caller; each row of ``chunks`` is contiguous."""
    num_chunks, numel = chunks.shape
    num_blocks = scales_out.shape[1]
    if num_chunks == 0 or num_blocks == 0:
        return
    group, grid, num_warps = _launch_shape(num_chunks, num_blocks, block_size)
    with _on(chunks.device):
        _encode_kernel[grid](chunks, chunks.stride(0), data_out, data_out.stride(0), scales_out,
                             scales_out.stride(0), numel, num_blocks, data_out.shape[1],
                             BITS=bits, BLOCK=block_size, GROUP=group, num_warps=num_warps)


def decode_rows(data: Tensor, scales: Tensor, bits: int, block_size: int, out: Tensor) -> None:
    """``quant._decode_into`` on CUDA: codes (num_chunks, data_bytes) and scales
    (num_chunks, num_blocks) into ``out`` (num_chunks, numel). Arguments are checked by the
    caller; ``out``'s rows are contiguous."""
    num_chunks, numel = out.shape
    num_blocks = scales.shape[1]
    if num_chunks == 0 or num_blocks == 0:
        return
    group, grid, num_warps = _launch_shape(num_chunks, num_blocks, block_size)
    codes = data.view(torch.int8) if bits == 8 else data
    with _on(out.device):
        _decode_kernel[grid](codes, codes.stride(0), scales, scales.stride(0), out, out.stride(0),
                             numel, num_blocks, BITS=bits, BLOCK=block_size, GROUP=group,
                             num_warps=num_warps)
