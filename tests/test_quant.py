"""Property tests for zeropp.codes.quant: the per-element error bound, zero and non-finite blocks,
no clipping, the packed layout, and the vectorised chunk functions.

Quantization is pure tensor math, so no process group is needed. Every decoded element is
checked against a bound derived from the arithmetic (see ``decode_bound``), never a loose rtol.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zeropp.codes.quant import (
    dequantize,
    dequantize_chunks,
    dequantize_from,
    dequantize_packed,
    error_bound,
    packed_numel,
    quantize,
    quantize_chunks,
    quantize_into,
    quantize_packed,
)

FP32_UNIT_ROUNDOFF = 2.0**-24  # relative error of one correctly rounded fp32 operation
FP32_SMALLEST_SUBNORMAL = 2.0**-149
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK_SIZES = tuple(2**k for k in range(5, 13))  # 32 .. 4096
# log2 of the input magnitude: down to fp32 subnormal scales, up to well below overflow.
LOG2_MAGNITUDES = {torch.float32: (-140, 100), torch.bfloat16: (-140, 100), torch.float16: (-20, 8)}
ALL_BITS = tuple(range(2, 9))
EVERY_CODE = pytest.mark.parametrize(
    ("bits", "dtype"), [(bits, dtype) for bits in ALL_BITS for dtype in DTYPES], ids=str
)
PROPERTY = settings(max_examples=12, deadline=None, derandomize=True)

# Biased toward small sizes (edge cases at block boundaries) while still reaching 10**6.
numels = st.one_of(
    st.integers(1, 300),
    st.integers(301, 20_000),
    st.integers(20_001, 10**6),
    st.integers(500_000, 10**6),
)


@dataclass(frozen=True)
class Case:
    """One quantization problem: a reproducible random input and the code to apply."""

    numel: int
    bits: int
    block_size: int
    dtype: torch.dtype
    seed: int
    log2_magnitude: int
    tail_spread: float  # 0: Gaussian; > 0: log-normal factor giving outliers inside blocks

    @property
    def qmax(self) -> int:
        """Largest code magnitude: 127 for 8 bits, 7 for 4 bits, 1 for 2 bits."""
        return 2 ** (self.bits - 1) - 1

    @property
    def num_blocks(self) -> int:
        """Blocks covering ``numel``, the last one zero-padded."""
        return -(-self.numel // self.block_size)

    def tensor(self) -> torch.Tensor:
        """The input in ``dtype``, finite and clamped well inside the dtype's range."""
        gen = torch.Generator().manual_seed(self.seed)
        x = torch.randn(self.numel, generator=gen, dtype=torch.float64)
        log2_factor = torch.randn(self.numel, generator=gen, dtype=torch.float64)
        x *= torch.exp2(log2_factor * self.tail_spread)
        limit = torch.finfo(self.dtype).max / 4
        return (x * 2.0**self.log2_magnitude).clamp(-limit, limit).to(self.dtype)


@st.composite
def cases(
    draw: st.DrawFn, bits: int, dtype: torch.dtype, numel: st.SearchStrategy[int] = numels
) -> Case:
    """Draw a Case for ``bits`` and ``dtype`` over sizes, block sizes and magnitudes."""
    return Case(
        numel=draw(numel),
        bits=bits,
        block_size=draw(st.sampled_from(BLOCK_SIZES)),
        dtype=dtype,
        seed=draw(st.integers(0, 2**31 - 1)),
        log2_magnitude=draw(st.integers(*LOG2_MAGNITUDES[dtype])),
        tail_spread=draw(st.sampled_from((0.0, 3.0))),
    )


def reference_codes(data: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer codes of the documented layout, read bit by bit: int8 bytes at 8 bits; below,
    ``code + 2**(bits - 1)`` in consecutive ``bits``-wide fields of the little-endian bit stream."""
    if bits == 8:
        return data.view(torch.int8).long()
    stream = np.unpackbits(data.numpy(), bitorder="little")
    fields = stream[: stream.size // bits * bits].reshape(-1, bits).astype(np.int64)
    return torch.from_numpy(fields @ (1 << np.arange(bits))) - 2 ** (bits - 1)


def per_element(values: torch.Tensor, block_size: int, numel: int) -> torch.Tensor:
    """Expand one value per block to one value per element."""
    return values.repeat_interleave(block_size)[:numel]


def cast_half_ulp(decoded32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Largest error of rounding the fp32 value ``decoded32`` to ``dtype`` (fp64 result).

    Round to nearest errs by half an ulp: at most |v| * 2**-(mantissa_bits + 1) for a normal
    result, and half the subnormal spacing, smallest_normal * 2**-(mantissa_bits + 1), below
    that. fp32 to fp32 is exact.
    """
    if dtype == torch.float32:
        return torch.zeros_like(decoded32, dtype=torch.float64)
    info = torch.finfo(dtype)
    return decoded32.double().abs().clamp(min=info.smallest_normal) * (info.eps / 2)


def decode_bound(
    scale: torch.Tensor, decoded32: torch.Tensor, bits: int, dtype: torch.dtype
) -> torch.Tensor:
    """Bound on |x - decoded| per element, in fp64.

    Exact arithmetic gives |x - q*s| <= s/2. In fp32, the quotient x/s errs by at most
    (qmax + 1)*u (|x/s| <= qmax, or a hair above when the scale was moved down to avoid
    overflow), which can move round() by that much past a half, and the product q*s
    (|q*s| <= qmax*s) errs by qmax*u*s, or by half the smallest subnormal when it underflows;
    u = 2**-24. Casting to ``dtype`` then adds ``cast_half_ulp``.
    """
    qmax = 2 ** (bits - 1) - 1
    s = scale.double()
    arithmetic = s * (0.5 + (2 * qmax + 1) * FP32_UNIT_ROUNDOFF) + FP32_SMALLEST_SUBNORMAL / 2
    return arithmetic + cast_half_ulp(decoded32, dtype)


def assert_within_bound(x: torch.Tensor, out: torch.Tensor, bound: torch.Tensor) -> None:
    """Assert |x - out| <= bound elementwise, reporting the worst element."""
    error = (x.double() - out.double()).abs()
    excess = error - bound
    worst = int(excess.argmax()) if excess.numel() else 0
    assert bool((excess <= 0).all()), (
        f"element {worst}: x={x[worst].item()!r} decoded={out[worst].item()!r} "
        f"error={error[worst].item():.6g} > bound={bound[worst].item():.6g}"
    )


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when a and b have the same dtype, shape, NaN positions and bytes elsewhere (-0 vs 0
    counts as a difference). NaN payloads may differ between vectorised and scalar kernels."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a_nan, b_nan = a.isnan(), b.isnan()
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    a_bits, b_bits = a.view(as_int).masked_fill(a_nan, 0), b.view(as_int).masked_fill(b_nan, 0)
    return torch.equal(a_nan, b_nan) and torch.equal(a_bits, b_bits)


def decode_reference(payload: torch.Tensor, scales: torch.Tensor, case: Case) -> torch.Tensor:
    """``code * scale`` in fp32 for the first ``numel`` elements, from the documented layout."""
    codes = reference_codes(payload, case.bits)[: case.numel]
    return codes.float() * per_element(scales, case.block_size, case.numel)


def as_blocks(values: torch.Tensor, case: Case) -> torch.Tensor:
    """``values`` (numel elements) zero-padded and viewed as (num_blocks, block_size) in fp64."""
    padded = torch.nn.functional.pad(values.double(), (0, -case.numel % case.block_size))
    return padded.view(case.num_blocks, case.block_size)


@EVERY_CODE
@PROPERTY
@given(data=st.data())
def test_decoded_within_bound(bits: int, dtype: torch.dtype, data: st.DataObject) -> None:
    case = data.draw(cases(bits, dtype))
    x = case.tensor()
    original = x.clone()
    payload, scales = quantize(x, case.bits, case.block_size)
    out = dequantize(payload, scales, case.bits, case.block_size, case.numel, case.dtype)
    assert same_bits(x, original), "quantize modified its input"
    # codes for the real elements only (no block padding on the wire), rounded up to 4 bytes
    assert payload.dtype == torch.uint8
    assert payload.numel() == -(-case.numel * case.bits // 32) * 4
    assert scales.dtype == torch.float32 and scales.shape == (case.num_blocks,)
    decoded32 = decode_reference(payload, scales, case)
    assert same_bits(out, decoded32.to(case.dtype)), "not code * scale in fp32, then cast"
    scale = per_element(scales, case.block_size, case.numel)
    assert_within_bound(x, out, decode_bound(scale, decoded32, case.bits, case.dtype))


@EVERY_CODE
@PROPERTY
@given(data=st.data())
def test_zero_blocks_decode_to_exact_zero(
    bits: int, dtype: torch.dtype, data: st.DataObject
) -> None:
    case = data.draw(cases(bits, dtype))
    x = case.tensor()
    zero_block = data.draw(st.integers(0, case.num_blocks - 1))
    x[zero_block * case.block_size : (zero_block + 1) * case.block_size] = 0
    payload, scales = quantize(x, case.bits, case.block_size)
    out = dequantize(payload, scales, case.bits, case.block_size, case.numel, case.dtype)
    is_zero_block = (as_blocks(x, case) == 0).all(dim=1)
    assert bool((scales[is_zero_block] == 0).all()) and bool((scales[~is_zero_block] > 0).all())
    is_zero_element = per_element(is_zero_block, case.block_size, case.numel)
    assert bool((out[is_zero_element] == 0).all())


@EVERY_CODE
@PROPERTY
@given(data=st.data())
def test_non_finite_block_decodes_non_finite(
    bits: int, dtype: torch.dtype, data: st.DataObject
) -> None:
    case = data.draw(cases(bits, dtype))
    x = case.tensor()
    positions = data.draw(st.lists(st.integers(0, case.numel - 1), min_size=1, max_size=3))
    for position in positions:
        x[position] = data.draw(st.sampled_from((float("nan"), float("inf"), float("-inf"))))
    payload, scales = quantize(x, case.bits, case.block_size)
    out = dequantize(payload, scales, case.bits, case.block_size, case.numel, case.dtype)
    bad_block = torch.zeros(case.num_blocks, dtype=torch.bool)
    bad_block[torch.tensor(positions) // case.block_size] = True
    bad = per_element(bad_block, case.block_size, case.numel)
    assert bool(scales[bad_block].isnan().all())
    codes = reference_codes(payload, case.bits)[: case.numel]
    assert bool((codes[bad] == 0).all()), "NaN must never reach the integer cast"
    assert not bool(out[bad].isfinite().any()), "a non-finite block decoded to finite values"
    assert bool(out[~bad].isfinite().all()), "a finite block decoded to non-finite values"
    decoded32 = decode_reference(payload, scales, case)
    scale = per_element(scales, case.block_size, case.numel)
    bound = decode_bound(scale, decoded32, case.bits, case.dtype)
    assert_within_bound(x[~bad], out[~bad], bound[~bad])


@EVERY_CODE
@PROPERTY
@given(data=st.data())
def test_absmax_element_is_not_clipped(bits: int, dtype: torch.dtype, data: st.DataObject) -> None:
    case = data.draw(cases(bits, dtype))
    x = case.tensor()
    payload, scales = quantize(x, case.bits, case.block_size)
    codes = reference_codes(payload, case.bits)
    assert int(codes.abs().max()) <= case.qmax
    decoded32 = dequantize(payload, scales, case.bits, case.block_size, case.numel, torch.float32)
    rows = torch.arange(case.num_blocks)
    top = as_blocks(x, case).abs().argmax(dim=1)
    absmax = as_blocks(x, case)[rows, top]
    nonzero = absmax != 0
    padded_codes = torch.nn.functional.pad(codes[: case.numel], (0, -case.numel % case.block_size))
    top_codes = padded_codes.view(case.num_blocks, -1)[rows, top][nonzero]
    assert torch.equal(top_codes, absmax[nonzero].sign().long() * case.qmax)
    top_decoded = as_blocks(decoded32, case)[rows, top]
    # scale = fl(a/qmax), decoded = fl(qmax*scale): two roundings of relative u; a subnormal
    # scale is off by at most 1.5 subnormal steps (round, then the one-ulp bump), times qmax.
    u = FP32_UNIT_ROUNDOFF
    tolerance = (2 * u + u * u) * absmax.abs() + 2 * case.qmax * FP32_SMALLEST_SUBNORMAL
    assert bool(((top_decoded - absmax).abs() <= tolerance)[nonzero].all())


def test_subnormal_scale_is_rounded_up_not_clipped() -> None:
    step = FP32_SMALLEST_SUBNORMAL
    x = torch.tensor([3 * step, -step, 0, 0, 2 * step, 0, 0, 0])
    payload, scales = quantize(x, 8, 8)
    assert scales.tolist() == [step], "3*step/127 rounds to 0 and must be bumped to one step"
    assert reference_codes(payload, 8).tolist() == [3, -1, 0, 0, 2, 0, 0, 0]
    assert torch.equal(dequantize(payload, scales, 8, 8, 8, torch.float32), x)


@pytest.mark.parametrize("bits", ALL_BITS)
def test_finite_input_near_fp32_max_decodes_finite(bits: int) -> None:
    largest = torch.finfo(torch.float32).max
    gen = torch.Generator().manual_seed(bits)
    x = (largest * (1 - torch.rand(2**16, generator=gen, dtype=torch.float64) * 1e-6)).float()
    x[1::2] *= -1
    payload, scales = quantize(x, bits, 32)
    out = dequantize(payload, scales, bits, 32, x.numel(), torch.float32)
    assert bool(out.isfinite().all()), "qmax * scale rounded up to inf"
    assert int(reference_codes(payload, bits).abs().max()) == 2 ** (bits - 1) - 1
    scale = per_element(scales, 32, x.numel())
    assert_within_bound(x, out, decode_bound(scale, out, bits, torch.float32))


@EVERY_CODE
@PROPERTY
@given(data=st.data())
def test_packed_round_trip_matches_quantize(
    bits: int, dtype: torch.dtype, data: st.DataObject
) -> None:
    case = data.draw(cases(bits, dtype))
    x = case.tensor()
    payload, scales = quantize(x, case.bits, case.block_size)
    packed = quantize_packed(x, case.bits, case.block_size)
    assert packed.numel() == packed_numel(case.numel, case.bits, case.block_size)
    assert packed.numel() % 4 == 0
    assert torch.equal(packed, torch.cat((payload, scales.view(torch.uint8))))
    expected = dequantize(payload, scales, case.bits, case.block_size, case.numel, case.dtype)
    decoded = dequantize_packed(packed, case.bits, case.block_size, case.numel, case.dtype)
    assert same_bits(decoded, expected)


def test_into_and_from_touch_only_their_slice() -> None:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    size = packed_numel(1000, 4, 64)
    buffer = torch.full((size + 12,), 0xAB, dtype=torch.uint8)
    quantize_into(x, 4, 64, buffer[8 : 8 + size])
    assert bool((buffer[:8] == 0xAB).all()) and bool((buffer[8 + size :] == 0xAB).all())
    assert torch.equal(buffer[8 : 8 + size], quantize_packed(x, 4, 64))
    decoded = torch.full((1010,), -1.0, dtype=torch.bfloat16)
    dequantize_from(buffer[8 : 8 + size], 4, 64, 1000, decoded[5:1005])
    assert bool((decoded[:5] == -1).all()) and bool((decoded[1005:] == -1).all())
    expected = dequantize_packed(quantize_packed(x, 4, 64), 4, 64, 1000, torch.bfloat16)
    assert same_bits(decoded[5:1005], expected)


chunk_numels = st.one_of(st.integers(0, 300), st.integers(301, 50_000))


@EVERY_CODE
@PROPERTY
@given(data=st.data())
def test_chunks_match_per_chunk_calls(bits: int, dtype: torch.dtype, data: st.DataObject) -> None:
    case = data.draw(cases(bits, dtype, numel=chunk_numels))
    num_chunks = data.draw(st.integers(1, 6))
    with_nan = data.draw(st.booleans())
    chunk_numel = case.numel
    x = torch.cat([replace(case, seed=case.seed + i).tensor() for i in range(num_chunks)])
    if with_nan and x.numel():
        x[x.numel() // 2] = float("nan")
    chunks = x.view(num_chunks, chunk_numel)
    chunk_bytes = packed_numel(chunk_numel, case.bits, case.block_size)
    packed = torch.empty(num_chunks * chunk_bytes, dtype=torch.uint8)
    original = x.clone()
    quantize_chunks(x, num_chunks, case.bits, case.block_size, packed)
    assert same_bits(x, original), "quantize_chunks modified its input"
    expected = [quantize_packed(chunk, case.bits, case.block_size) for chunk in chunks]
    assert torch.equal(packed, torch.cat(expected))
    out = torch.empty(num_chunks * chunk_numel, dtype=case.dtype)
    dequantize_chunks(packed, num_chunks, case.bits, case.block_size, chunk_numel, out)
    decoded = [
        dequantize_packed(chunk, case.bits, case.block_size, chunk_numel, case.dtype)
        for chunk in expected
    ]
    assert same_bits(out, torch.cat(decoded))


def test_int4_stores_two_codes_per_byte_low_nibble_first() -> None:
    x = torch.tensor([7.0, -7, 1, 0, -3, 2, 5, -1])  # absmax 7 = qmax, so scale 1 and codes = x
    payload, scales = quantize(x, 4, 8)
    assert scales.tolist() == [1.0]
    # bytes are (code_even + 8) | (code_odd + 8) << 4
    assert payload.tolist() == [15 | 1 << 4, 9 | 8 << 4, 5 | 10 << 4, 13 | 7 << 4]
    payload, _ = quantize(torch.randn(1000, generator=torch.Generator().manual_seed(0)), 4, 256)
    assert payload.numel() == 1000 // 2


def test_odd_widths_pack_densely_little_endian() -> None:
    """6 bits: 4 codes in 3 bytes; 3 bits: 8 codes in 3 bytes; 2 bits: 4 codes per byte."""
    x = torch.tensor([31.0, -31, 1, 0] * 8)  # absmax 31 = qmax at 6 bits: codes = x
    payload, scales = quantize(x, 6, 32)
    assert scales.tolist() == [1.0] and payload.numel() == 24  # 32 codes * 6 bits = 24 bytes
    fields = [63, 1, 33, 32]  # code + 32
    word = sum(f << (6 * i) for i, f in enumerate(fields))
    assert payload[:3].tolist() == [word & 255, word >> 8 & 255, word >> 16]
    x = torch.tensor([3.0, -3, 2, -2, 1, -1, 0, 3] * 4)  # qmax 3 at 3 bits
    payload, _ = quantize(x, 3, 32)
    word = sum((int(c) + 4) << (3 * i) for i, c in enumerate(x[:8].tolist()))
    assert payload.numel() == 12 and payload[:3].tolist() == [word & 255, word >> 8 & 255, word >> 16]
    x = torch.tensor([1.0, -1, 0, 1] * 8)  # qmax 1 at 2 bits: codes -1, 0, 1 stored as 1, 2, 3
    payload, _ = quantize(x, 2, 32)
    assert payload.numel() == 8 and payload[0].item() == 3 | 1 << 2 | 2 << 4 | 3 << 6


@pytest.mark.parametrize("bits", ALL_BITS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_codes_and_decode_equal_the_formula(bits: int, dtype: torch.dtype) -> None:
    """Every code is round-half-even(x / scale) with scale = absmax / qmax in fp32, and every
    decoded element is code * scale in fp32 cast to the output dtype: an element-by-element
    reference, written without any of the library's passes (numel 1000, block 64: a ragged
    last block)."""
    x = (torch.randn(1000, generator=torch.Generator().manual_seed(3)) * 10).to(dtype)
    payload, scales = quantize(x, bits, 64)
    qmax = 2 ** (bits - 1) - 1
    blocks = torch.nn.functional.pad(x.float(), (0, 24)).view(-1, 64)
    expected_scales = blocks.abs().amax(dim=1) / qmax
    assert torch.equal(scales, expected_scales)
    expected_codes = torch.round(blocks / expected_scales[:, None]).flatten()[:1000].to(torch.int64)
    assert torch.equal(reference_codes(payload, bits)[:1000], expected_codes)
    for out_dtype in (torch.float32, torch.bfloat16, torch.float64):
        decoded = dequantize(payload, scales, bits, 64, 1000, out_dtype)
        reference = (expected_codes.float() * expected_scales.repeat_interleave(64)[:1000]).to(out_dtype)
        assert torch.equal(decoded, reference)


def test_empty_input_round_trips() -> None:
    payload, scales = quantize(torch.empty(0, dtype=torch.bfloat16), 4, 32)
    assert payload.numel() == 0 and scales.numel() == 0 and packed_numel(0, 4, 32) == 0
    assert dequantize(payload, scales, 4, 32, 0, torch.bfloat16).shape == (0,)
    assert quantize_packed(torch.empty(0), 8, 32).numel() == 0


def test_error_bound_is_half_the_block_scale() -> None:
    scales = torch.rand(4) + 0.5
    bound = error_bound(scales, 32, 100)
    assert bound.shape == (100,)
    assert torch.equal(bound, torch.stack([scales[i // 32] / 2 for i in range(100)]))


x8 = torch.randn(64)


@pytest.mark.parametrize("bits", [0, 1, 9, 16, True, 8.0])
def test_invalid_bits_is_rejected(bits: object) -> None:
    with pytest.raises(ValueError, match=r"bits=.*allowed: \(2, 3, 4, 5, 6, 7, 8\)"):
        quantize(x8, bits, 32)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"bits="):
        packed_numel(64, bits, 32)  # type: ignore[arg-type]


@pytest.mark.parametrize("block_size", [0, -8, 4, 7, 100, 2**17, 256.0])
def test_invalid_block_size_is_rejected(block_size: object) -> None:
    with pytest.raises(ValueError, match=r"block_size=.*power of two"):
        quantize(x8, 8, block_size)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"block_size="):
        error_bound(torch.ones(1), block_size, 8)  # type: ignore[arg-type]


@pytest.mark.parametrize(("bits", "block_size", "smallest"), [(2, 8, 16), (3, 16, 32), (6, 8, 16), (7, 16, 32)])
def test_block_too_small_for_the_width_is_rejected(bits: int, block_size: int, smallest: int) -> None:
    with pytest.raises(ValueError, match=rf"block_size={block_size} is not allowed with bits={bits}.*"
                                         rf"allowed: block_size >= {smallest}"):
        quantize(x8, bits, block_size)
    quantize(x8, bits, smallest)


def test_invalid_buffers_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"x\.dtype=torch\.int32"):
        quantize(torch.ones(8, dtype=torch.int32), 8, 32)
    with pytest.raises(ValueError, match=r"num_chunks=3 does not divide"):
        quantize_chunks(x8, 3, 8, 32, torch.empty(0, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"num_chunks=0"):
        quantize_chunks(x8, 0, 8, 32, torch.empty(0, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"out has 3 elements; expected 72"):
        quantize_into(x8, 8, 32, torch.empty(3, dtype=torch.uint8))
    packed = quantize_packed(x8, 8, 32)
    with pytest.raises(ValueError, match=r"out has 63 elements; expected 64"):
        dequantize_from(packed, 8, 32, 64, torch.empty(63))
    with pytest.raises(ValueError, match=r"out \(strides \(2,\)\)"):
        dequantize_from(packed, 8, 32, 64, torch.empty(128)[::2])
    with pytest.raises(ValueError, match=r"out\.dtype=torch\.int64"):
        dequantize_from(packed, 8, 32, 64, torch.empty(64, dtype=torch.long))
    misaligned = torch.cat((torch.zeros(1, dtype=torch.uint8), packed))[1:]
    with pytest.raises(ValueError, match=r"packed \(storage_offset=1"):
        dequantize_from(misaligned, 8, 32, 64, torch.empty(64))
    with pytest.raises(ValueError, match=r"numel=-1"):
        packed_numel(-1, 8, 32)
    with pytest.raises(ValueError, match=r"dtype=torch\.int8"):
        dequantize_packed(packed, 8, 32, 64, torch.int8)


def test_signed_zero_blocks_get_positive_zero_scales() -> None:
    """Regression: a block of +0/-0 once got scale -0 in one code path and +0 in another (the
    max of -0 and +0 depends on vectorisation), so chunked and single quantization disagreed."""
    x = torch.zeros(602)
    x[::3] = -0.0
    _, scales = quantize(x, 8, 32)
    assert (scales.view(torch.int32) == 0).all()
    chunked = torch.empty(2 * packed_numel(301, 4, 32), dtype=torch.uint8)
    quantize_chunks(x, 2, 4, 32, chunked)
    assert torch.equal(chunked, torch.cat([quantize_packed(c, 4, 32) for c in x.view(2, 301)]))
