"""ChunkCodec: per-parameter segments of a chunk, quantized or raw, packed into one payload."""

from __future__ import annotations

import json
import random

import pytest
import torch

import codec_golden
from zeropp.codes import quant
from zeropp.codes.codec import ChunkCodec, Segment, segments_for
from zeropp.codes.quant import (
    dequantize_packed,
    dequantize_rows,
    min_block_size,
    packed_numel,
    quantize_packed,
    quantize_rows,
)


def _expected(chunk: torch.Tensor, codec: ChunkCodec) -> torch.Tensor:
    """Each segment on its own: dequantize(quantize(slice)) or the slice itself."""
    parts, offset = [], 0
    for segment in codec.segments:
        piece = chunk[offset:offset + segment.numel]
        offset += segment.numel
        if segment.bits is None:
            parts.append(piece)
        else:
            packed = quantize_packed(piece, segment.bits, codec.block_size)
            parts.append(dequantize_packed(packed, segment.bits, codec.block_size, segment.numel, chunk.dtype))
    return torch.cat(parts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_codec_round_trip_equals_per_segment_quantization(dtype: torch.dtype) -> None:
    segments = [Segment(5, 8), Segment(3, None), Segment(300, 4), Segment(1, 8), Segment(7, None)]
    codec = ChunkCodec(segments, block_size=32, dtype=dtype)
    chunks = torch.randn(3, codec.numel, generator=torch.Generator().manual_seed(0)).to(dtype)
    chunks[1, 10] = 1e4  # an outlier in the raw segment must not disturb its neighbours' scales
    # encode into the middle of a wider buffer: rows are strided views, as in a comm buffer
    wide = torch.zeros(3, codec.nbytes + 8, dtype=torch.uint8)
    codec.encode(chunks, wide[:, 4:4 + codec.nbytes])
    out = torch.empty(3, codec.numel + 2, dtype=dtype)
    codec.decode(wide[:, 4:4 + codec.nbytes], out[:, 1:1 + codec.numel])
    for row in range(3):
        assert torch.equal(out[row, 1:1 + codec.numel], _expected(chunks[row], codec))
    assert codec.nbytes % 4 == 0 and codec.is_quantized


def test_codec_bytes_are_the_sum_of_aligned_segments() -> None:
    codec = ChunkCodec([Segment(3, None), Segment(40, 8)], block_size=32, dtype=torch.bfloat16)
    assert codec.nbytes == 8 + packed_numel(40, 8, 32)  # 6 raw bytes aligned up to 8
    assert not ChunkCodec([Segment(4, None)], 32, torch.float32).is_quantized


def test_rows_functions_accept_strided_rows() -> None:
    x = torch.randn(4, 100)
    view = x[:, 10:74]  # strided rows
    out = torch.empty(4, 2 * packed_numel(64, 8, 32), dtype=torch.uint8)
    quantize_rows(view, 8, 32, out[:, :packed_numel(64, 8, 32)])
    decoded = torch.empty(4, 64)
    dequantize_rows(out[:, :packed_numel(64, 8, 32)], 8, 32, decoded)
    for row in range(4):
        single = dequantize_packed(quantize_packed(view[row].clone(), 8, 32), 8, 32, 64, torch.float32)
        assert torch.equal(decoded[row], single)
    with pytest.raises(ValueError, match="4-byte aligned"):
        quantize_rows(view, 8, 32, out[:, 1:1 + packed_numel(64, 8, 32)])


def test_segments_for_splits_padded_numels() -> None:
    assert segments_for([8, 12], [True, False], 4, 8) == [Segment(2, 8), Segment(3, None)]
    with pytest.raises(ValueError, match="padded numel 10 is not divisible by the group size 4"):
        segments_for([10], [True], 4, 8)


def test_byte_mode_codes_each_segment_in_its_own_dtype() -> None:
    """A mixed-dtype unit's chunk is raw bytes (FSDP2's uint8 all-gather); each segment is read
    in its own dtype, coded, and decoded back into its byte range: the same as coding each
    parameter's slice on its own, and raw segments come back byte for byte."""
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(7, generator=g).to(torch.bfloat16), torch.randn(33, generator=g),
             torch.randn(5, generator=g).to(torch.float16), torch.randn(3, generator=g)]
    segments = [Segment(7, 8, torch.bfloat16), Segment(33, 4, torch.float32), Segment(5, None, torch.float16),
                Segment(3, 8, torch.float32)]
    codec = ChunkCodec(segments, block_size=32, dtype=torch.uint8)
    chunk = torch.cat([p.view(torch.uint8) for p in parts]).view(1, -1)
    assert codec.byte_mode and codec.numel == chunk.numel() == 7 * 2 + 33 * 4 + 5 * 2 + 3 * 4
    packed = torch.empty(1, codec.nbytes, dtype=torch.uint8)
    codec.encode(chunk, packed)
    out = torch.empty_like(chunk)
    codec.decode(packed, out)
    offset = 0
    for part, segment in zip(parts, segments):
        nbytes = part.numel() * part.element_size()
        decoded = out[0, offset:offset + nbytes].clone().view(part.dtype)
        offset += nbytes
        if segment.bits is None:
            assert torch.equal(decoded, part)
        else:
            expected = dequantize_packed(quantize_packed(part, segment.bits, 32), segment.bits, 32, part.numel(),
                                         part.dtype)
            assert torch.equal(decoded, expected)
    with pytest.raises(ValueError, match="every segment's dtype"):
        ChunkCodec([Segment(4, 8, torch.float32), Segment(4, 8)], 32, torch.uint8)


@pytest.mark.parametrize("byte_mode,kernel", [(False, "auto"), (False, "torch"), (True, "auto")])
def test_regrouped_codec_decodes_the_chunks_of_a_coarser_split(byte_mode: bool, kernel: str) -> None:
    """A unit of three parameters (padded numels 24, 8, 16; the middle one raw) split over 8
    ranks, as 2 chunks of 4 ranks' each (FSDP2's layout for hpZ's group of 2): the payload rows
    of ranks 4i .. 4i + 3 regrouped decode, with the regrouped codec, to row i = parameter by
    parameter that parameter's decoded slices of those ranks, bit for bit what decoding the 8
    rows and regrouping the values by hand gives (the C kernels, and the torch path); the
    regrouped codec's bytes are the rows'."""
    previous = quant.set_kernel(kernel)
    try:
        _check_regrouped(byte_mode)
    finally:
        quant.set_kernel(previous)


def _check_regrouped(byte_mode: bool) -> None:
    g = torch.Generator().manual_seed(0)
    dtypes = [torch.bfloat16, torch.float32, torch.float16] if byte_mode else [torch.float32] * 3
    params = [torch.randn(n, generator=g).to(dtype) for n, dtype in zip((24, 8, 16), dtypes)]
    segments = segments_for([24, 8, 16], [True, False, True], 8, 8, dtypes if byte_mode else None)
    codec = ChunkCodec(segments, block_size=32, dtype=torch.uint8 if byte_mode else torch.float32)

    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.uint8) if byte_mode else t

    chunks = torch.stack([torch.cat([raw(p.view(8, -1)[rank]) for p in params]) for rank in range(8)])
    packed = torch.empty(8, codec.nbytes, dtype=torch.uint8)
    codec.encode(chunks, packed)
    decoded = torch.empty_like(chunks)
    codec.decode(packed, decoded)
    lengths = [raw(p.view(8, -1)[0]).numel() for p in params]
    expected = torch.cat([piece.reshape(2, -1) for piece in decoded.split(lengths, dim=1)], dim=1)
    regrouped = codec.regrouped(4)
    rows = torch.cat([codec.regroup_payload(group) for group in packed.split(4)])
    assert rows.shape == (2, regrouped.nbytes) and regrouped.numel == 4 * codec.numel
    out = torch.empty_like(expected)
    regrouped.decode(rows, out)
    assert torch.equal(out, expected)


def _random_layouts(count: int) -> list[tuple[list[Segment], int, torch.dtype, int]]:
    """Chunk layouts that exercise the one-pass codec: empty, tiny, block-aligned and ragged
    segments, raw ones between quantized ones, every code width, every input dtype."""
    rng = random.Random(0)
    layouts = []
    for _ in range(count):
        bits = rng.randint(2, 8)
        block_size = rng.choice([min_block_size(bits), 32, 256])
        dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16])
        sizes = [0, 1, 2, 3, 7, block_size, 2 * block_size, 3 * block_size + 1, rng.randint(0, 700)]
        segments = [Segment(rng.choice(sizes), bits if rng.random() < 0.7 else None)
                    for _ in range(rng.randint(1, 8))]
        segments.append(Segment(rng.randint(1, 300), bits))
        layouts.append((segments, block_size, dtype, rng.randint(1, 4)))
    return layouts


@pytest.fixture
def torch_kernel():
    """The torch path: the one-pass plan is what the C kernels replace where they apply."""
    previous = quant.set_kernel("torch")
    yield
    quant.set_kernel(previous)


@pytest.mark.parametrize(("segments", "block_size", "dtype", "rows"), _random_layouts(84))
def test_one_pass_codec_is_bit_identical_to_per_segment(segments: list[Segment], block_size: int,
                                                        dtype: torch.dtype, rows: int, torch_kernel) -> None:
    codec = ChunkCodec(segments, block_size, dtype)
    assert codec._plan is not None
    generator = torch.Generator().manual_seed(len(segments) * block_size)
    magnitudes = torch.rand(rows, codec.numel, generator=generator).pow(4) * 10
    chunks = (torch.randn(rows, codec.numel, generator=generator) * magnitudes).to(dtype)
    chunks[0, codec.numel // 2] = float("nan")  # a non-finite block
    chunks[-1, :40] = 0  # zero blocks
    chunks[-1, 40:44] = 1e-41  # subnormal scales
    reference, one_pass = (torch.zeros(rows, codec.nbytes + 8, dtype=torch.uint8) for _ in range(2))
    codec.encode_segments(chunks, reference[:, 4:-4])
    codec.encode(chunks, one_pass[:, 4:-4])  # strided rows, as in a comm buffer
    assert torch.equal(one_pass, reference)
    decoded_reference, decoded = (torch.empty(rows, codec.numel + 2, dtype=dtype) for _ in range(2))
    codec.decode_segments(reference[:, 4:-4], decoded_reference[:, 1:-1])
    codec.decode(reference[:, 4:-4], decoded[:, 1:-1])
    # compared as bytes, so NaNs compare too
    assert torch.equal(decoded[:, 1:-1].view(torch.uint8), decoded_reference[:, 1:-1].view(torch.uint8))


def test_byte_mode_and_mixed_width_chunks_take_the_per_segment_path() -> None:
    assert ChunkCodec([Segment(64, 8, torch.bfloat16), Segment(8, None, torch.float32)], 32, torch.uint8)._plan is None
    assert ChunkCodec([Segment(64, 8), Segment(64, 4)], 32, torch.float32)._plan is None
    assert ChunkCodec([Segment(64, 8), Segment(64, None)], 32, torch.float32)._plan is not None


def test_one_pass_codec_takes_chunks_of_another_dtype(torch_kernel) -> None:
    """qgZ's codec is fp32 and may be handed bf16 gradients: the one-pass path codes them as the
    per-segment path does."""
    codec = ChunkCodec([Segment(37, 4), Segment(5, 4), Segment(64, 4)], 32, torch.float32)
    chunks = torch.randn(2, codec.numel, generator=torch.Generator().manual_seed(1)).bfloat16()
    reference, one_pass = (torch.zeros(2, codec.nbytes, dtype=torch.uint8) for _ in range(2))
    codec.encode_segments(chunks, reference)
    codec.encode(chunks, one_pass)
    assert torch.equal(one_pass, reference)
    decoded_reference, decoded = (torch.empty(2, codec.numel, dtype=torch.bfloat16) for _ in range(2))
    codec.decode_segments(reference, decoded_reference)
    codec.decode(reference, decoded)
    assert torch.equal(decoded, decoded_reference)


def test_8_and_4_bit_codes_are_the_reference_bytes() -> None:
    """300 cases (flat tensors and random chunk layouts, every input dtype, NaNs, zero and
    subnormal blocks) give the bytes and decoded values the codec wrote before the 2- to 7-bit
    widths and the shared packing existed (digests in tests/data/codec_golden.json)."""
    golden = json.loads(codec_golden.GOLDEN.read_text())
    assert len(golden) == 2 * codec_golden.NUM_CASES
    changed = sorted(key for key, digest in codec_golden.digests().items() if golden[key] != digest)
    assert not changed, f"{len(changed)} cases changed bytes or values: {changed[:10]}"
