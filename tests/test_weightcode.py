"""The asymmetric weight code (zeropp.codes.weightcode) through the chunk codec: bound, exact cases,
non-finite blocks, bytes, and llama.cpp's Q4_1 levels as an independent reference."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import given, settings

from zeropp.codes import weightcode
from zeropp.codes.codec import ChunkCodec, Segment, payload_bytes, segments_for
from zeropp.codes.quant import min_block_size

ALL_BITS = tuple(range(2, 9))
PROPERTY = settings(max_examples=10, deadline=None, derandomize=True)


def _round_trip(codec: ChunkCodec, chunks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    packed = torch.zeros(chunks.shape[0], codec.nbytes, dtype=torch.uint8)
    codec.encode(chunks, packed)
    decoded = torch.empty_like(chunks)
    codec.decode(packed, decoded)
    return packed, decoded


def _blocks_with_params(x: torch.Tensor, bits: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One segment's fp32 blocks (the tail zero-padded as the codec pads it) and their params."""
    padded = torch.zeros(-(-x.numel() // block_size) * block_size)
    padded[:x.numel()] = x.float()
    blocks = padded.view(-1, block_size)
    return blocks, weightcode.block_params(blocks, bits)


@pytest.mark.parametrize("bits", ALL_BITS)
@PROPERTY
@given(numel=st.integers(1, 3000), log2_magnitude=st.integers(-120, 120), offset=st.floats(-8, 8),
       seed=st.integers(0, 2**31 - 1), block_size=st.sampled_from([32, 64, 256]))
def test_every_element_within_half_a_scale(bits: int, numel: int, log2_magnitude: int, offset: float,
                                           seed: int, block_size: int) -> None:
    """|x - decoded| <= scale / 2 of the element's block, up to fp32 rounding (the code's
    ``error_bound``); blocks of values far from zero (``offset``) included."""
    generator = torch.Generator().manual_seed(seed)
    block_size = max(block_size, min_block_size(bits))
    x = (torch.randn(numel, generator=generator, dtype=torch.float64) + offset) * 2.0**log2_magnitude
    x = x.float()
    codec = ChunkCodec([Segment(numel, bits, asymmetric=True)], block_size, torch.float32)
    _, decoded = _round_trip(codec, x[None])
    _, params = _blocks_with_params(x, bits, block_size)
    bound = weightcode.error_bound(params, bits).repeat_interleave(block_size)[:numel]
    assert ((decoded[0] - x).abs() <= bound).all()
    assert torch.isfinite(decoded).all()


@pytest.mark.parametrize("bits", ALL_BITS)
def test_block_minimum_and_maximum_are_levels(bits: int) -> None:
    """All 2**bits levels span the block: its minimum and maximum decode (nearly) to themselves,
    where the symmetric code spends a level on the side a skewed block does not use."""
    x = torch.rand(4, 256, generator=torch.Generator().manual_seed(bits)) * 3 + 1  # all in [1, 4]
    codec = ChunkCodec([Segment(256, bits, asymmetric=True)], 256, torch.float32)
    _, decoded = _round_trip(codec, x)
    for row, out in zip(x, decoded):
        assert out.min().item() == pytest.approx(row.min().item(), rel=1e-6)
        assert out.max().item() == pytest.approx(row.max().item(), rel=1e-6)
    assert len(decoded[0].unique()) <= 2**bits


def test_constant_and_zero_blocks_decode_exactly() -> None:
    x = torch.cat((torch.zeros(32), torch.full((32,), -3.25), torch.full((32,), 1e-41), torch.randn(32)))
    codec = ChunkCodec([Segment(128, 4, asymmetric=True)], 32, torch.float32)
    _, decoded = _round_trip(codec, x[None])
    assert torch.equal(decoded[0, :96], x[:96])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_block_decodes_to_nan_and_leaves_the_others(bad: float) -> None:
    x = torch.randn(1, 96, generator=torch.Generator().manual_seed(0))
    x[0, 40] = bad
    codec = ChunkCodec([Segment(96, 4, asymmetric=True)], 32, torch.float32)
    _, decoded = _round_trip(codec, x)
    assert decoded[0, 32:64].isnan().all()
    assert torch.isfinite(decoded[0, :32]).all() and torch.isfinite(decoded[0, 64:]).all()


def test_finite_input_at_the_top_of_the_fp32_range_decodes_finite() -> None:
    top = torch.finfo(torch.float32).max
    x = torch.tensor([[top, -top] * 16, [top, top * 0.99] * 16]).float().view(1, -1)
    codec = ChunkCodec([Segment(64, 4, asymmetric=True)], 32, torch.float32)
    _, decoded = _round_trip(codec, x)
    assert torch.isfinite(decoded).all()
    assert ((decoded - x).abs() <= top / 15 / 2 * 1.001).all()


@pytest.mark.parametrize("bits", ALL_BITS)
def test_bytes_are_codes_plus_two_fp32_per_block(bits: int) -> None:
    """A segment costs its packed codes (rounded up to 4 bytes) and 8 bytes per block; raw
    segments are unchanged; the payload is what the math says."""
    block_size = max(32, min_block_size(bits))
    segments = segments_for([3 * block_size * 4 + 8, 40, 12], [True, False, True], 4, bits, asymmetric=True)
    assert [s.asymmetric for s in segments] == [True, False, True]
    expected = 0
    for segment in segments:
        if segment.bits is None:
            expected += segment.numel * 4
        else:
            codes = -(-segment.numel * bits // 32) * 4
            expected += codes + 8 * -(-segment.numel // block_size)
    assert ChunkCodec(segments, block_size, torch.float32).nbytes == expected
    assert payload_bytes(segments, block_size, torch.float32) == expected


def test_raw_segments_travel_unchanged_beside_asymmetric_ones() -> None:
    segments = [Segment(100, 4, asymmetric=True), Segment(37, None), Segment(64, 4, asymmetric=True)]
    codec = ChunkCodec(segments, 32, torch.bfloat16)
    x = torch.randn(3, codec.numel, generator=torch.Generator().manual_seed(2)).bfloat16()
    _, decoded = _round_trip(codec, x)
    assert torch.equal(decoded[:, 100:137], x[:, 100:137])
    for start, numel in ((0, 100), (137, 64)):
        for row in range(3):
            _, params = _blocks_with_params(x[row, start:start + numel], 4, 32)
            bound = weightcode.error_bound(params, 4).repeat_interleave(32)[:numel]
            bf16_rounding = decoded[row, start:start + numel].float().abs() * 2.0**-8
            assert ((decoded[row, start:start + numel].float() - x[row, start:start + numel].float()).abs()
                    <= bound + bf16_rounding).all()


def test_q4_1_weights_travel_without_loss() -> None:
    """Weights dequantized from llama.cpp's Q4_1 (the ``gguf`` package's own quantizer: 32
    elements, fp16 scale and minimum) are levels of the asymmetric 4-bit code at block 32:
    they come back within fp32 rounding, where the symmetric code (15 levels) moves them by
    up to half its scale."""
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize, quantize

    weights = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32) * 0.02
    q4_1 = gguf.GGMLQuantizationType.Q4_1
    grid = torch.from_numpy(dequantize(quantize(weights, q4_1), q4_1).astype(np.float32)).view(1, -1)
    asymmetric = ChunkCodec([Segment(grid.numel(), 4, asymmetric=True)], 32, torch.float32)
    symmetric = ChunkCodec([Segment(grid.numel(), 4)], 32, torch.float32)
    scale = (grid.view(-1, 32).amax(1) - grid.view(-1, 32).amin(1)) / 15  # Q4_1's d
    per_element = scale.repeat_interleave(32)
    asymmetric_error = (_round_trip(asymmetric, grid)[1] - grid).abs()[0]
    symmetric_error = (_round_trip(symmetric, grid)[1] - grid).abs()[0]
    assert (asymmetric_error <= per_element * 2.0**-18).all()
    assert (symmetric_error / per_element).max() > 0.25


def test_units_fsdp2_gathers_as_bytes_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="asymmetric weight code needs a chunk of one float dtype"):
        ChunkCodec([Segment(64, 4, torch.bfloat16, asymmetric=True), Segment(8, None, torch.float32)], 32,
                   torch.uint8)
