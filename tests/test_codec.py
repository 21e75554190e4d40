"""ChunkCodec: per-parameter segments of a chunk, quantized or raw, packed into one payload."""

from __future__ import annotations

import pytest
import torch

from zeropp.codec import ChunkCodec, Segment, segments_for
from zeropp.quant import dequantize_packed, dequantize_rows, packed_numel, quantize_packed, quantize_rows


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
