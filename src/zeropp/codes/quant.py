"""Symmetric block quantization (2 to 8 bits, fp32 scales) and its one-buffer packing.

ZeRO++ (Wang et al., 2023, §3.1, §3.3) quantizes weights before the all-gather (qwZ) and
gradients before the all-to-all (qgZ). Both cut a flat tensor into blocks of ``block_size``
consecutive elements, each with its own scale so an outlier costs precision only in its block,
and ship codes and scales together. Pure tensor math: the same code runs on CPU and CUDA.

[Note: block code]
With block absmax ``a`` and ``qmax = 2**(bits - 1) - 1`` (127 at 8 bits, 7 at 4, 1 at 2), scale = ``a / qmax`` in
fp32 and code = ``round(x / scale)`` in ``[-qmax, qmax]``: the absmax element maps to ``±qmax``,
so nothing clips, and ``|x - code * scale| <= scale / 2`` up to fp32 rounding of the division
and product. A zero block gets scale 0 and decodes to exact zeros. A scale below the smallest
normal fp32 is rounded with an absolute, not relative, error, so it is moved up one ulp; then
``scale >= a / qmax`` exactly and the codes still fit. Near the top of the fp32 range a scale
whose ``qmax * scale`` rounds to inf is moved down one ulp, so finite input decodes finite.

[Note: non-finite blocks]
A NaN or ±inf in a block gives it a NaN scale and all-zero codes, so the whole block decodes
to NaN (overflow checks and loss scalers still see it) and no NaN is ever cast to an integer,
which is undefined behaviour.

[Note: packed layout]
A packed uint8 buffer is ``[codes | fp32 scales of all blocks]``. At 8 bits the codes are int8
bytes. Below 8 bits each code is stored as the unsigned field ``code + 2**(bits - 1)``, packed
densely and little-endian: element ``i`` takes bits ``[i * bits, (i + 1) * bits)`` of the code
stream, bit 0 being the lowest bit of byte 0. So 4 bits are two nibbles per byte, the even
element in the low nibble; 6 bits are 3 bytes per 4 elements. The codes cover the real elements
only (the last block is zero-padded inside the computation, not on the wire), rounded up to 4
bytes, so the scales, and every buffer in a run of consecutive ones (one per rank's chunk), are
4-byte aligned. A block's codes fill whole 4-byte words (``block_size * bits`` is a multiple of
32), so codes computed over whole blocks always cover those bytes. A run of ``num_chunks``
buffers is coded in one vectorised pass; blocks never straddle two chunks.

[Note: scratch buffers]
On CPU a fresh tensor of more than a few MB is new memory from the operating system, and its
first touch costs a page fault per 4 KiB page: measured here, a pass that writes a new 64 MB
fp32 tensor costs about six times the same pass into an existing one. The block code needs
full-size fp32 temporaries (the blocks of a cast or padded input, the codes before narrowing,
the decoded values before a cast), so on CPU it takes them from scratch buffers, one per
thread and role, grown as needed and reused by every call (``_scratch``); a scratch view never
leaves the function that took it. On CUDA the caching allocator already reuses memory.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import warnings

import torch
from torch import Tensor

from zeropp.codes import native, quant_triton

__all__ = [
    "dequantize",
    "dequantize_chunks",
    "dequantize_from",
    "dequantize_packed",
    "error_bound",
    "min_block_size",
    "pack_codes",
    "packed_numel",
    "quantize",
    "quantize_chunks",
    "quantize_into",
    "quantize_packed",
    "quantize_rows",
    "dequantize_rows",
    "set_kernel",
    "unpack_codes",
]

ALLOWED_BITS = (2, 3, 4, 5, 6, 7, 8)
MIN_BLOCK_SIZE = 8
MAX_BLOCK_SIZE = 65536
INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OUTPUT_DTYPES = (*INPUT_DTYPES, torch.float64)
_SCALE_BYTES = 4  # fp32
KERNELS = ("auto", "native", "torch", "triton")
"""``auto`` (the default): the C kernels (``zeropp.codes.native``) for CPU tensors they take (2, 4 and
8 bits, fp32 and bf16, where a C compiler built them), the Triton kernels
(``zeropp.codes.quant_triton``) for CUDA tensors at 4 and 8 bits when Triton imports, the torch path
for everything else; ``native``: the C kernels, and the torch path for everything else, CUDA
included; ``torch``: always the torch path; ``triton``: the Triton kernels, and an error for
tensors they cannot take. Every path gives the same bytes and values: the C kernels are checked
against the torch path on CPU, the Triton kernels on an H100 (``tests/test_quant_triton.py``)."""
_kernel = "auto"


def set_kernel(name: str) -> str:
    """Choose the (de)quantization path (see ``KERNELS``; the environment variable
    ``ZEROPP_QUANT_KERNEL`` sets it at import) and return the previous choice."""
    global _kernel
    if name not in KERNELS:
        raise ValueError(f"quantization kernel {name!r} is not known; allowed: {KERNELS}")
    previous, _kernel = _kernel, name
    return previous


def native_chosen() -> bool:
    """Whether ``set_kernel`` lets CPU tensors take the C kernels (``zeropp.codes.native``)."""
    return _kernel in ("native", "auto")


def _use_native(rows: Tensor, bits: int, block_size: int) -> bool:
    """Whether this call takes the C kernels, per ``set_kernel``."""
    return native_chosen() and native.applies(rows, bits, block_size)


_TRITON_FAILED: set[str] = set()
"""Devices where the Triton kernels failed to compile or launch under ``auto``: the torch path
codes there from then on."""


def _use_triton(device: torch.device, bits: int) -> bool:
    """Whether this call takes the Triton kernels, per ``set_kernel``."""
    if _kernel in ("torch", "native") or (_kernel == "auto" and str(device) in _TRITON_FAILED):
        return False
    usable = quant_triton.available(device) and bits in quant_triton.BITS
    if _kernel == "triton" and not usable:
        if bits not in quant_triton.BITS:
            reason = f"they code {' and '.join(map(str, quant_triton.BITS))} bits, not {bits}"
        elif quant_triton.triton is None:
            reason = "Triton is not installed"
        else:
            reason = f"the tensor is on {device}"
        raise RuntimeError(f"the quantization kernel is set to 'triton', but {reason}; the Triton "
                           "kernels need a CUDA tensor and Triton (set ZEROPP_QUANT_KERNEL=auto or torch)")
    return usable


def _triton_ran(kernel, device: torch.device, *args) -> bool:
    """Run a Triton kernel and say whether it ran. Under ``auto`` a kernel that fails (a GPU or
    Triton version it does not compile for) warns once and leaves ``device`` to the torch path,
    which gives the same bytes; under ``triton`` the failure is raised."""
    try:
        kernel(*args)
        return True
    except Exception as error:  # compile errors come as several Triton and CUDA types
        if _kernel == "triton":
            raise
        _TRITON_FAILED.add(str(device))
        warnings.warn(f"zeropp's Triton quantization kernels failed on {device} ({type(error).__name__}: "
                      f"{str(error)[:300]}); coding with the torch path there from now on (same bytes, slower). "
                      "ZEROPP_QUANT_KERNEL=triton raises instead, =native skips Triton.", RuntimeWarning, stacklevel=2)
        return False


def _check_config(bits: int, block_size: int) -> None:
    """Raise ValueError unless ``bits`` and ``block_size`` describe a supported code."""
    if not isinstance(bits, int) or isinstance(bits, bool) or bits not in ALLOWED_BITS:
        raise ValueError(f"bits={bits!r} is not supported; allowed: {ALLOWED_BITS}")
    _check_block_size(block_size)
    if block_size < min_block_size(bits):
        raise ValueError(
            f"block_size={block_size} is not allowed with bits={bits}: a block's codes must fill whole "
            f"4-byte words (block_size * bits a multiple of 32); allowed: block_size >= {min_block_size(bits)}"
        )


def min_block_size(bits: int) -> int:
    """The smallest block size whose codes fill whole 4-byte words at ``bits`` per element; a
    power-of-two block fits exactly when it is at least this (``block_size * bits`` is then a
    multiple of 32)."""
    return max(MIN_BLOCK_SIZE, 32 // math.gcd(bits, 32))


def _check_block_size(block_size: int) -> None:
    """Raise ValueError unless ``block_size`` is a power of two in the allowed range."""
    is_int = isinstance(block_size, int) and not isinstance(block_size, bool)
    in_range = is_int and MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE
    if not in_range or block_size & (block_size - 1) != 0:
        raise ValueError(
            f"block_size={block_size!r} is not allowed; "
            f"allowed: a power of two in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}]"
        )


def _check_count(name: str, value: int, minimum: int) -> None:
    """Raise ValueError unless ``value`` is an int of at least ``minimum``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}={value!r} is not allowed; allowed: an int >= {minimum}")


def _check_dtype(name: str, dtype: torch.dtype, allowed: tuple[torch.dtype, ...]) -> None:
    """Raise ValueError unless ``dtype`` is one of ``allowed``."""
    if dtype not in allowed:
        raise ValueError(f"{name}={dtype} is not allowed; allowed: {allowed}")


def _check_tensor(name: str, tensor: Tensor, numel: int, dtype: torch.dtype) -> None:
    """Raise ValueError unless ``tensor`` has ``numel`` elements of ``dtype``."""
    _check_dtype(f"{name}.dtype", tensor.dtype, (dtype,))
    if tensor.numel() != numel:
        raise ValueError(f"{name} has {tensor.numel()} elements; expected {numel}")


def _check_packed(name: str, packed: Tensor, numel: int) -> None:
    """Raise ValueError unless ``packed`` is a contiguous uint8 buffer of ``numel`` bytes that
    starts 4-byte aligned, so its fp32 scales can be viewed in place."""
    _check_tensor(name, packed, numel, torch.uint8)
    if not packed.is_contiguous() or packed.storage_offset() % _SCALE_BYTES != 0:
        raise ValueError(
            f"{name} (storage_offset={packed.storage_offset()}, contiguous="
            f"{packed.is_contiguous()}) is not allowed; allowed: contiguous, 4-byte aligned"
        )


def _check_out(out: Tensor, numel: int) -> None:
    """Raise ValueError unless ``out`` is a contiguous float tensor of ``numel`` elements."""
    _check_tensor("out", out, numel, out.dtype)
    _check_dtype("out.dtype", out.dtype, OUTPUT_DTYPES)
    if not out.is_contiguous():
        raise ValueError(f"out (strides {out.stride()}) is not allowed; allowed: contiguous")


_scratch_buffers = threading.local()


def _scratch(role: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """An uninitialised tensor for a temporary, reused across calls on CPU ([Note: scratch buffers])."""
    if device.type != "cpu" or torch.compiler.is_compiling():  # inductor plans its own buffers
        return torch.empty(shape, dtype=dtype, device=device)
    buffers = _scratch_buffers.__dict__.setdefault("buffers", {})
    numel = math.prod(shape)
    buffer = buffers.get((role, dtype))
    if buffer is None or buffer.numel() < numel:
        buffer = buffers[(role, dtype)] = torch.empty(numel, dtype=dtype)
    return buffer[:numel].view(shape)


def _num_blocks(numel: int, block_size: int) -> int:
    """Number of blocks covering ``numel`` elements, the last one zero-padded."""
    return -(-numel // block_size)


def _data_bytes(numel: int, bits: int, block_size: int) -> int:
    """Bytes of codes for ``numel`` elements, rounded up to a multiple of 4 (not to whole blocks,
    so a tiny tensor such as a bias costs a few bytes, not a full block)."""
    return -(-numel * bits // 32) * 4


def packed_numel(numel: int, bits: int, block_size: int) -> int:
    """Bytes of one packed buffer for ``numel`` elements: codes, then fp32 scales.

    Always a multiple of 4 (see [Note: packed layout]), so buffers can be laid end to end.
    """
    _check_config(bits, block_size)
    _check_count("numel", numel, 0)
    return _data_bytes(numel, bits, block_size) + _SCALE_BYTES * _num_blocks(numel, block_size)


def _to_blocks(chunks: Tensor, block_size: int) -> tuple[Tensor, bool]:
    """View ``chunks`` (num_chunks, chunk_numel) as fp32 rows of one block each, zero-padded,
    and say whether that is a fresh copy, which later steps may then overwrite. Casting and
    padding share one pass over memory."""
    num_chunks, numel = chunks.shape
    padding = -numel % block_size
    if chunks.dtype == torch.float32 and not padding:
        return chunks.reshape(-1, block_size), False
    blocks = _scratch("blocks", (num_chunks, numel + padding), torch.float32, chunks.device)
    blocks[:, :numel].copy_(chunks)
    blocks[:, numel:].zero_()
    return blocks.view(-1, block_size), True


def _block_scales(blocks: Tensor, bits: int) -> Tensor:
    """fp32 scale per block row: absmax / qmax, NaN for non-finite blocks (see the Notes)."""
    qmax = 2 ** (bits - 1) - 1
    absmax = torch.maximum(blocks.amax(dim=1), blocks.amin(dim=1).neg_())  # both keep NaN
    absmax.add_(0.0)  # an all-zero block can give -0 (max(-0, +0) depends on vectorisation): make it +0
    # a true division: CUDA divides by a Python number through its reciprocal (a * (1 / qmax)),
    # which can land one ulp off the correctly rounded quotient that the kernels compute
    scales = absmax / torch.full_like(absmax, qmax)
    subnormal = (scales < torch.finfo(torch.float32).tiny) & (absmax > 0)
    scales = torch.where(subnormal, scales.nextafter(torch.full_like(scales, torch.inf)), scales)
    overflows = torch.isinf(scales * qmax) & torch.isfinite(absmax)
    scales = torch.where(overflows, scales.nextafter(torch.zeros_like(scales)), scales)
    return torch.where(torch.isfinite(scales), scales, torch.nan)


def _block_codes(blocks: Tensor, scales: Tensor, overwrite: bool) -> Tensor:
    """Integer-valued fp32 codes ``round(x / scale)``; zero for zero and non-finite blocks.
    With ``overwrite`` the codes replace ``blocks`` in place, saving a full-size allocation.

    Dividing by inf maps a zero block to 0 and a non-finite block to 0 or NaN; nan_to_num_
    then zeroes the NaNs, so the later integer cast never sees one. Only a NaN scale (a
    non-finite block) can leave a NaN, so on CPU, where asking costs no device sync, the pass
    is skipped when there is none (not under torch.compile, which cannot branch on data).
    """
    divisors = torch.where(scales > 0, scales, torch.inf)[:, None]
    if overwrite:
        codes = blocks.div_(divisors)
    else:
        codes = torch.div(blocks, divisors, out=_scratch("codes", tuple(blocks.shape), torch.float32, blocks.device))
    codes.round_()
    if codes.device.type != "cpu" or torch.compiler.is_compiling() or bool(scales.isnan().any()):
        codes.nan_to_num_(0.0)
    return codes


def pack_codes(codes: Tensor, bits: int) -> Tensor:
    """Integer-valued fp32 codes (rows, n) as packed bytes (rows, n * bits / 8) in the layout of
    [Note: packed layout]; ``n`` is a multiple of 8 (whole blocks are)."""
    if bits == 8:
        return codes.to(torch.int8).view(torch.uint8)
    rows, offset = codes.shape[0], 2 ** (bits - 1)
    if 8 % bits == 0:  # whole fields per byte: their weighted sum is exact in fp32 (at most 255)
        per_byte = 8 // bits
        packed = _scratch("packing", (rows, codes.shape[1] // per_byte), torch.float32, codes.device)
        torch.add(codes[:, 0::per_byte], codes[:, 1::per_byte], alpha=2**bits, out=packed)
        for field in range(2, per_byte):
            packed.add_(codes[:, field::per_byte], alpha=2 ** (bits * field))
        return packed.add_(offset * sum(2 ** (bits * f) for f in range(per_byte))).to(torch.uint8)
    # 8 fields make one little-endian 64-bit word, of which the low ``bits`` bytes are kept
    shifts = torch.arange(0, 8 * bits, bits, dtype=torch.int64, device=codes.device)
    words = ((codes.view(rows, -1, 8).to(torch.int64) + offset) << shifts).sum(dim=2)
    return _word_bytes(words).view(rows, -1, 8)[:, :, :bits].reshape(rows, -1)


def unpack_codes(data: Tensor, bits: int) -> Tensor:
    """Packed bytes (rows, nbytes) back to fp32 codes (rows, >= nbytes * 8 // bits); the codes
    past the last whole field, if any, are garbage and must be ignored."""
    if bits == 8:
        return data.view(torch.int8).float()
    return _unpack_fields(data, bits).float().sub_(2 ** (bits - 1))


def _unpack_fields(data: Tensor, bits: int) -> Tensor:
    """Packed bytes (rows, nbytes), below 8 bits, as the unsigned fields ``code + 2**(bits - 1)``
    (rows, >= nbytes * 8 // bits), uint8 or int64."""
    rows, mask = data.shape[0], 2**bits - 1
    if 8 % bits == 0:
        fields = [data & mask] + [(data >> (bits * f)) & mask for f in range(1, 8 // bits)]
        return torch.stack(fields, dim=-1).view(rows, -1)
    num_words = -(-data.shape[1] // bits)
    staged = data.new_zeros((rows, num_words * bits))
    staged[:, :data.shape[1]] = data
    word_bytes = data.new_zeros((rows, num_words, 8))
    word_bytes[:, :, :bits] = staged.view(rows, num_words, bits)
    shifts = torch.arange(0, 8 * bits, bits, dtype=torch.int64, device=data.device)
    fields = (_bytes_word(word_bytes)[:, :, None] >> shifts) & mask
    return fields.view(rows, -1)


def _word_bytes(words: Tensor) -> Tensor:
    """int64 words (rows, n) as their bytes, least significant first (rows, 8n)."""
    if sys.byteorder == "little":
        return words.view(torch.uint8)
    shifts = torch.arange(0, 64, 8, dtype=torch.int64, device=words.device)
    return ((words[:, :, None] >> shifts) & 0xFF).to(torch.uint8).view(words.shape[0], -1)


def _bytes_word(word_bytes: Tensor) -> Tensor:
    """Bytes (rows, n, 8), least significant first, as int64 words (rows, n)."""
    if sys.byteorder == "little":
        return word_bytes.view(torch.int64).squeeze(2)
    shifts = torch.arange(0, 64, 8, dtype=torch.int64, device=word_bytes.device)
    return (word_bytes.to(torch.int64) << shifts).sum(dim=2)


def _store_codes(codes: Tensor, bits: int, data_out: Tensor) -> None:
    """Write the leading fp32 codes of (num_chunks, padded_numel) into ``data_out`` packed
    (``data_out`` holds at least the real elements; the codes past them are zeros)."""
    data_bytes = data_out.shape[1]
    if bits == 8:
        data_out.view(torch.int8).copy_(codes[:, :data_bytes])
        return
    num_codes = -(-data_bytes // bits) * 8  # whole 8-code groups covering the bytes
    data_out.copy_(pack_codes(codes[:, :num_codes], bits)[:, :data_bytes])


def _scale_blocks(values: Tensor, scales: Tensor, block_size: int) -> None:
    """``values *= scale`` of each element's block, in place; ``values`` (num_chunks, numel)
    fp32 with contiguous rows, ``scales`` (num_chunks, num_blocks)."""
    num_chunks, numel = values.shape
    full = numel // block_size * block_size
    if full:
        values[:, :full].view(num_chunks, full // block_size, block_size).mul_(scales[:, :full // block_size, None])
    if numel > full:
        values[:, full:].mul_(scales[:, full // block_size:][:, :1])


def _split_rows(packed: Tensor, bits: int, block_size: int, chunk_numel: int) -> tuple[Tensor, Tensor]:
    """Views of packed rows (num_chunks, packed bytes): codes (num_chunks, data_bytes) uint8
    and scales (num_chunks, num_blocks) fp32."""
    data_bytes = _data_bytes(chunk_numel, bits, block_size)
    return packed[:, :data_bytes], packed[:, data_bytes:].view(torch.float32)


def _check_rows(name: str, rows: Tensor, shape: tuple[int, int], dtype: torch.dtype | None) -> None:
    """Raise ValueError unless ``rows`` is a 2-D ``shape`` view whose rows are contiguous and,
    for packed bytes (``dtype`` uint8), start 4-byte aligned so the scales can be viewed."""
    if dtype is not None:
        _check_dtype(f"{name}.dtype", rows.dtype, (dtype,))
    if rows.dim() != 2 or tuple(rows.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(rows.shape)}; expected {shape}")
    aligned = dtype != torch.uint8 or rows.numel() == 0 or (rows.storage_offset() % _SCALE_BYTES == 0
                                       and (shape[0] == 1 or rows.stride(0) % _SCALE_BYTES == 0))
    if (shape[0] > 0 and shape[1] > 1 and rows.stride(1) != 1) or not aligned:
        raise ValueError(f"{name} (strides {rows.stride()}, storage_offset {rows.storage_offset()}) "
                         "is not allowed; allowed: contiguous rows, 4-byte aligned for packed bytes")


def _encode_into(
    chunks: Tensor, bits: int, block_size: int, data_out: Tensor, scales_out: Tensor
) -> None:
    """Quantize ``chunks`` (num_chunks, chunk_numel) into the views ``data_out``
    (num_chunks, data_bytes) and ``scales_out`` (num_chunks, num_blocks), all rows at once."""
    if _use_triton(chunks.device, bits) and _triton_ran(quant_triton.encode_rows, chunks.device, chunks, bits,
                                                         block_size, data_out, scales_out):
        return
    if _use_native(chunks, bits, block_size):
        native.encode_rows(chunks, bits, block_size, data_out, scales_out)
        return
    blocks, is_copy = _to_blocks(chunks, block_size)  # (num_chunks * num_blocks, block_size)
    scales = _block_scales(blocks, bits)
    codes = _block_codes(blocks, scales, overwrite=is_copy)
    scales_out.copy_(scales.view(scales_out.shape))
    _store_codes(codes.view(scales_out.shape[0], scales_out.shape[1] * block_size), bits, data_out)


def _decode_into(data: Tensor, scales: Tensor, bits: int, block_size: int, out: Tensor) -> None:
    """Dequantize codes (num_chunks, data_bytes) and scales (num_chunks, num_blocks) into
    ``out`` (num_chunks, chunk_numel): ``code * scale`` in fp32, then cast to out's dtype."""
    if _use_triton(out.device, bits) and _triton_ran(quant_triton.decode_rows, out.device, data, scales, bits,
                                                     block_size, out):
        return
    if _use_native(out, bits, block_size):
        native.decode_rows(data, scales, bits, block_size, out)
        return
    numel = out.shape[1]
    values = out if out.dtype == torch.float32 else _scratch("values", tuple(out.shape), torch.float32, out.device)
    if bits == 8:
        values.copy_(data.view(torch.int8)[:, :numel])
    else:  # the fields, then minus the offset: integers, exact in fp32
        values.copy_(_unpack_fields(data, bits)[:, :numel]).sub_(2 ** (bits - 1))
    _scale_blocks(values, scales, block_size)  # code * scale in fp32 ...
    if values is not out:
        out.copy_(values)  # ... then one rounding to out's dtype


def quantize(x: Tensor, bits: int, block_size: int) -> tuple[Tensor, Tensor]:
    """Quantize ``x`` (flattened) to ``(data, scales)``: uint8 codes and fp32 per-block scales.

    ``data`` has ``bits`` bits per element, rounded up to 4 bytes (see [Note: packed layout]);
    ``scales`` has shape (num_blocks,).
    """
    _check_config(bits, block_size)
    _check_dtype("x.dtype", x.dtype, INPUT_DTYPES)
    data = torch.empty(_data_bytes(x.numel(), bits, block_size), dtype=torch.uint8, device=x.device)
    scales = torch.empty(_num_blocks(x.numel(), block_size), dtype=torch.float32, device=x.device)
    _encode_into(x.reshape(1, -1), bits, block_size, data.view(1, -1), scales.view(1, -1))
    return data, scales


def dequantize(
    data: Tensor, scales: Tensor, bits: int, block_size: int, numel: int, dtype: torch.dtype
) -> Tensor:
    """Decode ``quantize``'s output to a flat tensor of ``numel`` elements in ``dtype``."""
    _check_config(bits, block_size)
    _check_count("numel", numel, 0)
    _check_tensor("data", data, _data_bytes(numel, bits, block_size), torch.uint8)
    _check_tensor("scales", scales, _num_blocks(numel, block_size), torch.float32)
    _check_dtype("dtype", dtype, OUTPUT_DTYPES)
    out = torch.empty(numel, dtype=dtype, device=data.device)
    _decode_into(data.reshape(1, -1), scales.reshape(1, -1), bits, block_size, out.view(1, -1))
    return out


def quantize_rows(x: Tensor, bits: int, block_size: int, out: Tensor) -> None:
    """Quantize each row of ``x`` (num_chunks, chunk_numel) independently into the packed row
    of ``out`` (num_chunks, packed_numel(chunk_numel)), in one vectorised pass.

    Rows may be strided views (e.g. one parameter's segment in every rank's slot of a
    communication buffer) as long as each row is contiguous.
    """
    _check_config(bits, block_size)
    _check_dtype("x.dtype", x.dtype, INPUT_DTYPES)
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (num_chunks, chunk_numel), got shape {tuple(x.shape)}")
    num_chunks, chunk_numel = x.shape
    _check_rows("x", x, (num_chunks, chunk_numel), None)
    _check_rows("out", out, (num_chunks, packed_numel(chunk_numel, bits, block_size)), torch.uint8)
    if chunk_numel == 0:
        return
    data_out, scales_out = _split_rows(out, bits, block_size, chunk_numel)
    _encode_into(x, bits, block_size, data_out, scales_out)


def dequantize_rows(packed: Tensor, bits: int, block_size: int, out: Tensor) -> None:
    """Decode each packed row of ``packed`` into the row of ``out`` (num_chunks, chunk_numel,
    any float dtype): the receive side of a quantized all-gather or all-to-all."""
    _check_config(bits, block_size)
    if out.dim() != 2:
        raise ValueError(f"out must be 2-D (num_chunks, chunk_numel), got shape {tuple(out.shape)}")
    num_chunks, chunk_numel = out.shape
    _check_dtype("out.dtype", out.dtype, OUTPUT_DTYPES)
    _check_rows("out", out, (num_chunks, chunk_numel), None)
    _check_rows("packed", packed, (num_chunks, packed_numel(chunk_numel, bits, block_size)), torch.uint8)
    if chunk_numel == 0:
        return
    data, scales = _split_rows(packed, bits, block_size, chunk_numel)
    _decode_into(data, scales, bits, block_size, out)


def quantize_chunks(x: Tensor, num_chunks: int, bits: int, block_size: int, out: Tensor) -> None:
    """Quantize ``x`` viewed as (num_chunks, chunk_numel) into ``num_chunks`` consecutive
    packed buffers in ``out``, each chunk independently, in one vectorised pass.

    This is the send side of a quantized all-gather or all-to-all: chunk ``i`` goes to rank ``i``.
    """
    _check_config(bits, block_size)
    _check_count("num_chunks", num_chunks, 1)
    _check_dtype("x.dtype", x.dtype, INPUT_DTYPES)
    if x.numel() % num_chunks != 0:
        raise ValueError(f"num_chunks={num_chunks} does not divide x.numel()={x.numel()}")
    chunk_numel = x.numel() // num_chunks
    _check_packed("out", out, num_chunks * packed_numel(chunk_numel, bits, block_size))
    quantize_rows(x.reshape(num_chunks, chunk_numel), bits, block_size, out.view(num_chunks, -1))


def dequantize_chunks(
    packed: Tensor, num_chunks: int, bits: int, block_size: int, chunk_numel: int, out: Tensor
) -> None:
    """Decode ``num_chunks`` consecutive packed buffers of ``chunk_numel`` elements each into
    ``out`` (num_chunks * chunk_numel elements, any float dtype) in one vectorised pass.
    """
    _check_config(bits, block_size)
    _check_count("num_chunks", num_chunks, 1)
    _check_count("chunk_numel", chunk_numel, 0)
    _check_packed("packed", packed, num_chunks * packed_numel(chunk_numel, bits, block_size))
    _check_out(out, num_chunks * chunk_numel)
    dequantize_rows(packed.view(num_chunks, -1), bits, block_size, out.view(num_chunks, chunk_numel))


def quantize_into(x: Tensor, bits: int, block_size: int, out: Tensor) -> None:
    """Quantize ``x`` into the packed buffer ``out`` (uint8, ``packed_numel`` bytes, which may
    be a 4-byte aligned slice of a larger buffer)."""
    quantize_chunks(x, 1, bits, block_size, out)


def dequantize_from(packed: Tensor, bits: int, block_size: int, numel: int, out: Tensor) -> None:
    """Decode one packed buffer of ``numel`` elements into the flat float tensor ``out``."""
    dequantize_chunks(packed, 1, bits, block_size, numel, out)


def quantize_packed(x: Tensor, bits: int, block_size: int) -> Tensor:
    """Quantize ``x`` into a new packed uint8 buffer (codes then fp32 scales)."""
    out = torch.empty(packed_numel(x.numel(), bits, block_size), dtype=torch.uint8, device=x.device)
    quantize_into(x, bits, block_size, out)
    return out


def dequantize_packed(
    packed: Tensor, bits: int, block_size: int, numel: int, dtype: torch.dtype
) -> Tensor:
    """Decode a packed buffer into a new flat tensor of ``numel`` elements in ``dtype``."""
    _check_dtype("dtype", dtype, OUTPUT_DTYPES)
    out = torch.empty(numel, dtype=dtype, device=packed.device)
    dequantize_from(packed, bits, block_size, numel, out)
    return out


def error_bound(scales: Tensor, block_size: int, numel: int) -> Tensor:
    """Per-element bound ``scale / 2`` on ``|x - dequantize(quantize(x))|`` for ``numel`` elements.

    This is the exact-arithmetic bound; fp32 rounding of the division and the product adds at
    most ``(2 * qmax + 1) * scale * 2**-24`` (plus ``2**-150`` where the product underflows),
    and casting to a narrower dtype adds that dtype's half ulp.
    """
    _check_block_size(block_size)
    _check_count("numel", numel, 0)
    _check_tensor("scales", scales, _num_blocks(numel, block_size), torch.float32)
    return (scales.reshape(-1, 1) / 2).expand(-1, block_size).reshape(-1)[:numel]


set_kernel(os.environ.get("ZEROPP_QUANT_KERNEL", "auto"))
