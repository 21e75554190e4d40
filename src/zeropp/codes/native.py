"""quant's symmetric block code, and qgZ's grouped-scale gradient code, as native C on CPU
(``native_codec.c``): one pass per block.

The torch path codes a tensor in a dozen full passes over memory (absmax, division, rounding,
casts, packing), each a separate kernel; on CPU that is several times a copy's time. The C
kernel does a block's absmax and codes while the block sits in cache, with the same IEEE
operations in the same order, so bytes and decoded values are those of the torch path (tests
compare them bit for bit). It is compiled on first use with the system's C compiler (``cc``,
or ``$CC``) for this CPU (``-march=native``) into ``~/.cache/zeropp`` (or
``$ZEROPP_CACHE_DIR``), keyed by the source and the CPU, and loaded with ctypes; without a
compiler, ``available()`` is False and zeropp codes with the torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

SOURCE = Path(__file__).with_name("native_codec.c")
BITS = (2, 4, 8)
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
"""Row dtypes the kernels read and write, and their code in the C source."""
MAX_BLOCK_SIZE = 65536

_error: str | None = None


def _cpu_key() -> str:
    """What the compiled code depends on beside the source: the machine and its CPU flags."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        pass
    return f"{platform.machine()} {platform.system()} {flags}"


def _library_path() -> Path:
    digest = hashlib.sha256(SOURCE.read_bytes() + _cpu_key().encode()).hexdigest()[:16]
    cache = Path(os.environ.get("ZEROPP_CACHE_DIR", Path.home() / ".cache" / "zeropp"))
    return cache / f"native_codec-{digest}.so"


def _compile(target: Path) -> None:
    """Build the shared library into ``target`` atomically (ranks may build it at once)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    compiler = os.environ.get("CC", "cc")
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        subprocess.run([compiler, "-O3", "-march=native", "-fPIC", "-shared", "-std=c11", "-o", str(built),
                        str(SOURCE), "-lm"], check=True, capture_output=True, text=True)
        os.replace(built, target)


@functools.cache
def _library() -> ctypes.CDLL | None:
    global _error
    path = _library_path()
    try:
        if not path.exists():
            _compile(path)
        library = ctypes.CDLL(str(path))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = error.stderr if isinstance(error, subprocess.CalledProcessError) else error
        _error = f"building {SOURCE.name} failed: {detail}"
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    library.zeropp_encode_rows.argtypes = [ptr, i64, ctypes.c_int, i64, i64, i64, ctypes.c_int, ptr, i64, i64,
                                           ptr, i64]
    library.zeropp_decode_rows.argtypes = [ptr, i64, ptr, i64, i64, i64, i64, ctypes.c_int, ptr, i64,
                                           ctypes.c_int]
    library.zeropp_encode_chunks.argtypes = [ptr, i64, ctypes.c_int, i64, ptr, i64, i64, ptr, i64]
    library.zeropp_decode_chunks.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, i64, ctypes.c_int]
    library.zeropp_encode_grouped_chunks.argtypes = [ptr, i64, ctypes.c_int, i64, ptr, i64, i64, ctypes.c_int, ptr,
                                                     ptr, ptr, ctypes.c_int, ctypes.c_float, ptr, i64]
    library.zeropp_decode_grouped_chunks.argtypes = [ptr, i64, i64, ptr, i64, i64, ctypes.c_int, ptr, ptr, ptr, i64,
                                                     ctypes.c_int]
    return library


def available() -> bool:
    """Whether the kernels could be built and loaded here."""
    return _library() is not None


def unavailable_reason() -> str:
    """Why ``available()`` is False ("" when it is True)."""
    return "" if available() else str(_error)


def takes(rows: Tensor) -> bool:
    """Whether the kernels read and write these rows: a CPU tensor of a dtype they take, each
    row contiguous, and the kernels built."""
    return (rows.device.type == "cpu" and rows.dtype in DTYPES and (rows.shape[1] <= 1 or rows.stride(1) == 1)
            and available())


def applies(rows: Tensor, bits: int, block_size: int) -> bool:
    """Whether the kernels code these rows at this width and block size."""
    return bits in BITS and block_size <= MAX_BLOCK_SIZE and takes(rows)


def encode_rows(chunks: Tensor, bits: int, block_size: int, data_out: Tensor, scales_out: Tensor) -> None:
    """``quant._encode_into`` for CPU rows: chunks (rows, numel) with contiguous rows into
    ``data_out`` (rows, data bytes) and ``scales_out`` (rows, num blocks)."""
    num_rows, numel = chunks.shape
    _library().zeropp_encode_rows(
        chunks.data_ptr(), chunks.stride(0), DTYPES[chunks.dtype], num_rows, numel, block_size, bits,
        data_out.data_ptr(), data_out.stride(0), data_out.shape[1], scales_out.data_ptr(), scales_out.stride(0))


def decode_rows(data: Tensor, scales: Tensor, bits: int, block_size: int, out: Tensor) -> None:
    """``quant._decode_into`` for CPU rows: codes (rows, data bytes) and scales (rows, num
    blocks) into ``out`` (rows, numel) with contiguous rows."""
    num_rows, numel = out.shape
    _library().zeropp_decode_rows(
        data.data_ptr(), data.stride(0), scales.data_ptr(), scales.stride(0), num_rows, numel, block_size, bits,
        out.data_ptr(), out.stride(0), DTYPES[out.dtype])


def segment_table(spans: list[tuple[int, int, int, int]], bits: list[int | None]) -> Tensor:
    """A chunk codec's segments for ``encode_chunks``: per segment its element offset and count
    in a row, its byte offset and bytes (before alignment) in the payload, and its bits (0:
    copied as it is)."""
    return torch.tensor([[*span, b or 0] for span, b in zip(spans, bits, strict=True)], dtype=torch.int64)


def encode_chunks(chunks: Tensor, table: Tensor, block_size: int, out: Tensor) -> None:
    """``ChunkCodec.encode`` in one call: rows of ``chunks`` (rows, numel) into payload rows of
    ``out`` (rows, nbytes), each segment as ``table`` says."""
    _library().zeropp_encode_chunks(chunks.data_ptr(), chunks.stride(0), DTYPES[chunks.dtype], chunks.shape[0],
                                    table.data_ptr(), table.shape[0], block_size, out.data_ptr(), out.stride(0))


def decode_chunks(packed: Tensor, table: Tensor, block_size: int, out: Tensor) -> None:
    """``ChunkCodec.decode`` in one call: payload rows of ``packed`` into the rows of ``out``."""
    _library().zeropp_decode_chunks(packed.data_ptr(), packed.stride(0), packed.shape[0], table.data_ptr(),
                                    table.shape[0], block_size, out.data_ptr(), out.stride(0), DTYPES[out.dtype])


def _pointer(tensor: Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def encode_grouped_chunks(chunks: Tensor, table: Tensor, block_size: int, tables: Any, out: Tensor) -> None:
    """``encode_chunks`` for qgZ's grouped-scale gradient code (rounding to nearest, unrotated);
    ``tables`` holds its constants (``bits``; ``levels`` and ``midpoints``, fp32 tensors or None
    for evenly spaced levels; ``scale_levels``, 256 fp32; ``search_steps`` and ``reach``), as
    ``zeropp.codes.codec`` builds them from ``zeropp.codes.gradcode``."""
    _library().zeropp_encode_grouped_chunks(
        chunks.data_ptr(), chunks.stride(0), DTYPES[chunks.dtype], chunks.shape[0], table.data_ptr(), table.shape[0],
        block_size, tables.bits, _pointer(tables.levels), _pointer(tables.midpoints), tables.scale_levels.data_ptr(),
        tables.search_steps, tables.reach, out.data_ptr(), out.stride(0))


def decode_grouped_chunks(packed: Tensor, table: Tensor, block_size: int, tables: Any, out: Tensor) -> None:
    """``decode_chunks`` for the grouped-scale gradient code."""
    _library().zeropp_decode_grouped_chunks(
        packed.data_ptr(), packed.stride(0), packed.shape[0], table.data_ptr(), table.shape[0], block_size,
        tables.bits, _pointer(tables.levels), tables.scale_levels.data_ptr(), out.data_ptr(), out.stride(0),
        DTYPES[out.dtype])
