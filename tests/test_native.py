"""The C kernels of the symmetric block code and of qgZ's grouped-scale gradient code
(zeropp.codes.native) against the torch path: the same bytes and the same decoded bits for every
width they code, both row dtypes, edge sizes and values, strided rows and whole chunk layouts;
and a machine without a compiler falls back."""

from __future__ import annotations

import pytest
import torch

from test_codec import _random_layouts
from test_quant_triton import _with_kernel
from zeropp.codes import native, quant
from zeropp.codes.codec import ChunkCodec, Segment
from zeropp.codes.gradcode import GradientCode

pytestmark = pytest.mark.skipif(not native.available(), reason=f"no C kernels: {native.unavailable_reason()}")
SIZES = (1, 5, 31, 32, 33, 255, 256, 257, 1000, 4096 + 7, 100_003)


def _bits_of(x: torch.Tensor) -> torch.Tensor:
    """The raw bits, so NaNs compare too."""
    return x.view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[x.dtype])


def _input(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Wide magnitudes inside blocks, plus zero, subnormal, non-finite and near-overflow blocks."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=generator) * torch.rand(numel, generator=generator).pow(6) * 100
    if numel > 300:
        x[:32] = 0
        x[40:44] = 1e-41
        x[70] = float("nan")
        x[100] = float("inf")
        x[140] = float("-inf")
        x[200:204] = 3.0e38
        x[-3:] = -0.0
    return x.to(dtype)


@pytest.mark.parametrize(("bits", "block_size"), [(bits, block_size) for bits in native.BITS
                                                  for block_size in (8, 32, 256, 4096)
                                                  if block_size >= quant.min_block_size(bits)])
@pytest.mark.parametrize("dtype", list(native.DTYPES), ids=str)
def test_bytes_and_decoded_bits_equal_the_torch_path(bits: int, dtype: torch.dtype, block_size: int) -> None:
    for i, numel in enumerate(SIZES):
        x = _input(numel, dtype, seed=i * 10 + bits)
        reference = _with_kernel("torch", quant.quantize_packed, x, bits, block_size)
        packed = _with_kernel("native", quant.quantize_packed, x, bits, block_size)
        assert torch.equal(packed, reference), numel
        for out_dtype in native.DTYPES:
            expected = _with_kernel("torch", quant.dequantize_packed, reference, bits, block_size, numel, out_dtype)
            decoded = _with_kernel("native", quant.dequantize_packed, reference, bits, block_size, numel, out_dtype)
            assert torch.equal(_bits_of(decoded), _bits_of(expected)), (numel, out_dtype)


def test_strided_rows_of_a_comm_buffer() -> None:
    """Rows that are slices of wider rows (one parameter's segment in every rank's slot)."""
    wide = _input(4 * 600, torch.float32, seed=3).view(4, 600)
    rows = wide[:, 50:50 + 333]
    shape = (4, quant.packed_numel(333, 4, 32))
    packed = {kernel: torch.zeros(4, shape[1] + 12, dtype=torch.uint8) for kernel in ("torch", "native")}
    decoded = {kernel: torch.zeros(4, 340) for kernel in ("torch", "native")}
    for kernel in ("torch", "native"):
        _with_kernel(kernel, quant.quantize_rows, rows, 4, 32, packed[kernel][:, 4:4 + shape[1]])
        _with_kernel(kernel, quant.dequantize_rows, packed[kernel][:, 4:4 + shape[1]], 4, 32,
                     decoded[kernel][:, 2:2 + 333])
    assert torch.equal(packed["native"], packed["torch"])
    assert torch.equal(_bits_of(decoded["native"]), _bits_of(decoded["torch"]))


@pytest.mark.parametrize(("segments", "block_size", "dtype", "rows"), _random_layouts(40))
def test_chunk_codec_layouts_equal_the_torch_path(segments, block_size: int, dtype: torch.dtype, rows: int) -> None:
    codec = ChunkCodec(segments, block_size, dtype)
    _assert_codec_kernels_agree(codec, _input(rows * codec.numel, torch.float32, seed=len(segments)).view(rows, -1)
                                .to(dtype))


def _assert_codec_kernels_agree(codec: ChunkCodec, chunks: torch.Tensor) -> None:
    """The C kernels write the torch path's payload bytes and decode its payload to the same bits."""
    rows = chunks.shape[0]
    packed = {kernel: torch.full((rows, codec.nbytes), 0xA5, dtype=torch.uint8) for kernel in ("torch", "native")}
    decoded = {kernel: torch.empty(rows, codec.numel, dtype=chunks.dtype) for kernel in ("torch", "native")}
    for kernel in ("torch", "native"):
        _with_kernel(kernel, codec.encode, chunks, packed[kernel])
        _with_kernel(kernel, codec.decode, packed["torch"], decoded[kernel])
    assert torch.equal(packed["native"], packed["torch"])
    assert torch.equal(decoded["native"].view(torch.uint8), decoded["torch"].view(torch.uint8))


def test_fp32_codec_given_bf16_rows_and_mixed_widths() -> None:
    """qgZ's fp32 codec takes bf16 gradients; a chunk may mix widths (one C call codes both)."""
    for segments in ([Segment(37, 4), Segment(5, 4), Segment(64, 4)], [Segment(100, 8), Segment(64, 2)]):
        codec = ChunkCodec(segments, 32, torch.float32)
        chunks = _input(2 * codec.numel, torch.float32, seed=5).view(2, -1).bfloat16()
        packed = {kernel: torch.zeros(2, codec.nbytes, dtype=torch.uint8) for kernel in ("torch", "native")}
        decoded = {kernel: torch.empty(2, codec.numel, dtype=torch.bfloat16) for kernel in ("torch", "native")}
        for kernel in ("torch", "native"):
            _with_kernel(kernel, codec.encode, chunks, packed[kernel])
            _with_kernel(kernel, codec.decode, packed["torch"], decoded[kernel])
        assert torch.equal(packed["native"], packed["torch"])
        assert torch.equal(decoded["native"].view(torch.int16), decoded["torch"].view(torch.int16))


def test_without_a_compiler_zeropp_codes_with_the_torch_path(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("ZEROPP_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    native._library.cache_clear()
    try:
        assert not native.available()
        assert "building native_codec.c failed" in native.unavailable_reason()
        x = _input(1000, torch.float32, seed=9)
        assert torch.equal(_with_kernel("native", quant.quantize_packed, x, 8, 32),
                           _with_kernel("torch", quant.quantize_packed, x, 8, 32))
    finally:
        monkeypatch.undo()
        native._library.cache_clear()
    assert native.available()


def _grouped_layouts() -> list[tuple[list[Segment], int, GradientCode, int, torch.dtype, int]]:
    """qgZ's grouped-scale codes on ragged chunk layouts: several groups of blocks, partial
    groups and blocks, one-element segments, every width, both level kinds, both row dtypes."""
    layouts = []
    for index, (bits, levels, block_size) in enumerate([(4, "normal", 64), (4, "normal", 256), (2, "normal", 32),
                                                       (8, "normal", 64), (4, "uniform", 64), (8, "uniform", 32)]):
        sizes = [16 * block_size * 2 + 5, 1, block_size, 3 * block_size + 7, 16 * block_size]
        segments = [Segment(numel, bits, grouped_scales=True) for numel in sizes[index % 2:]]
        code = GradientCode(levels=levels, scale_bits=8)
        layouts += [(segments, block_size, code, bits, dtype, 1 + index % 3) for dtype in native.DTYPES]
    return layouts


@pytest.mark.parametrize(("segments", "block_size", "code", "bits", "dtype", "rows"), _grouped_layouts())
def test_grouped_gradient_code_equals_the_torch_path(segments, block_size: int, code: GradientCode, bits: int,
                                                     dtype: torch.dtype, rows: int) -> None:
    """Bytes (scale codes and the searched scales included) and decoded bits as the torch path's,
    on values with zero, subnormal, non-finite and near-overflow blocks and, in the second half,
    gradients whose blocks mix exact zeros with nonzero values (absent tokens' rows)."""
    codec = ChunkCodec(segments, block_size, torch.float32, code=code)
    assert codec._grouped_tables is not None, "the C kernels must take this code"
    chunks = _input(rows * codec.numel, torch.float32, seed=bits).view(rows, -1)
    half = chunks[:, codec.numel // 2:]
    half.copy_(torch.randn(half.shape, generator=torch.Generator().manual_seed(1))
               * (torch.rand(half.shape, generator=torch.Generator().manual_seed(2)) < 0.7))
    _assert_codec_kernels_agree(codec, chunks.to(dtype))


def test_rotated_or_stochastic_codes_keep_the_torch_path() -> None:
    """The kernels code neither rotation nor stochastic rounding: those codecs take the torch path."""
    segments = [Segment(1024, 4, grouped_scales=True)]
    for code in (GradientCode(rotation="hadamard", levels="normal", scale_bits=8),
                 GradientCode(rounding="stochastic", scale_bits=8)):
        assert ChunkCodec(segments, 64, torch.float32, code=code)._native_table is None
