"""Digests of the 8- and 4-bit codes as the codec wrote them before it grew 2- to 7-bit widths
and its shared packing, so later versions are checked against those exact bytes and values.

``python tests/codec_golden.py`` rewrites ``tests/data/codec_golden.json`` from the zeropp on
the path; run it only against the implementation whose bytes are the reference.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import random

import torch

from zeropp.codes import quant
from zeropp.codes.codec import ChunkCodec, Segment

GOLDEN = pathlib.Path(__file__).parent / "data" / "codec_golden.json"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _digest(*tensors: torch.Tensor) -> str:
    """A short hash of the tensors' bytes (NaNs included)."""
    h = hashlib.sha256()
    for tensor in tensors:
        h.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _values(rng: random.Random, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Heavy-tailed values with zero blocks, a subnormal run and, sometimes, a NaN."""
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    x = torch.randn(shape, generator=g) * torch.rand(shape, generator=g).pow(4) * 10
    flat = x.view(-1)
    if flat.numel() > 64:
        flat[:40] = 0
        flat[40:44] = 1e-41 if dtype == torch.float32 else 1e-3
    if flat.numel() and rng.random() < 0.3:
        flat[rng.randrange(flat.numel())] = float("nan")
    return x.to(dtype)


def quantize_case(index: int) -> str:
    """quantize + dequantize of one flat tensor."""
    rng = random.Random(index)
    bits, block_size, dtype = rng.choice((4, 8)), rng.choice((8, 32, 64, 256, 1024)), rng.choice(DTYPES)
    numel = rng.choice((1, 7, block_size, 3 * block_size + 5, rng.randint(1, 20_000)))
    x = _values(rng, (numel,), dtype)
    data, scales = quant.quantize(x, bits, block_size)
    decoded = quant.dequantize(data, scales, bits, block_size, numel, dtype)
    return _digest(data, scales, decoded)


def codec_case(index: int) -> str:
    """A chunk of random segments, quantized and raw, through ChunkCodec.encode / decode."""
    rng = random.Random(10_000 + index)
    bits, block_size, dtype = rng.choice((4, 8)), rng.choice((8, 32, 256)), rng.choice(DTYPES)
    sizes = (0, 1, 3, 7, block_size, 2 * block_size, 3 * block_size + 1, rng.randint(0, 700))
    segments = [Segment(rng.choice(sizes), bits if rng.random() < 0.7 else None) for _ in range(rng.randint(1, 8))]
    segments.append(Segment(rng.randint(1, 300), bits))
    codec = ChunkCodec(segments, block_size, dtype)
    rows = rng.randint(1, 4)
    chunks = _values(rng, (rows, codec.numel), dtype)
    packed = torch.zeros(rows, codec.nbytes, dtype=torch.uint8)
    codec.encode(chunks, packed)
    decoded = torch.empty(rows, codec.numel, dtype=dtype)
    codec.decode(packed, decoded)
    return _digest(packed, decoded)


NUM_CASES = 150  # of each kind


def digests() -> dict[str, str]:
    """Every case's digest, keyed by kind and index."""
    return {**{f"quantize/{i}": quantize_case(i) for i in range(NUM_CASES)},
            **{f"codec/{i}": codec_case(i) for i in range(NUM_CASES)}}


if __name__ == "__main__":
    GOLDEN.write_text(json.dumps(digests(), indent=0, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}")
