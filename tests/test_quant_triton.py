"""The Triton kernels of ``zeropp.codes.quant_triton`` give the torch path's bytes, bit for bit.

Both paths run on the same input through the public functions of ``zeropp.codes.quant``, switched with
``quant.set_kernel``: packed buffers (codes and fp32 scales) must be byte-equal, decoded tensors
bit-equal in every output dtype (NaNs compared by position: they are never read). Inputs cover
block boundaries, every block size, strided rows, zero blocks, NaN/inf blocks, subnormal inputs
and scales, and values next to the fp32 maximum.

These tests need a CUDA GPU and Triton and skip cleanly without them. For development without a
GPU, ``TRITON_INTERPRET=1`` runs the same kernels on CPU tensors through Triton's interpreter.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zeropp.codes import quant, quant_triton

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and quant_triton.triton is not None
if torch.cuda.is_available() and quant_triton.triton is not None:
    DEVICE = torch.device("cuda")
elif INTERPRET:
    DEVICE = torch.device("cpu")
else:
    DEVICE = None
pytestmark = pytest.mark.skipif(DEVICE is None, reason="needs a CUDA GPU and Triton "
                                "(or TRITON_INTERPRET=1 with Triton installed)")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INTERPRET_BF16 = """Triton's interpreter (3.9) converts bf16 <-> fp32 with its own bit arithmetic, which
mishandles subnormals and saturates instead of overflowing to inf; a GPU converts exactly (and
rounds to nearest even; the interpreter truncates). Under the interpreter, bf16 inputs hold no
subnormals and nothing is decoded to bf16."""
OUT_DTYPES = (torch.float32, torch.float16, torch.float64) + (() if INTERPRET else (torch.bfloat16,))
BLOCK_SIZES = (8, 32, 256, 4096) + (() if INTERPRET else (65536,))
_INT_OF = {torch.float64: torch.int64, torch.float32: torch.int32,
           torch.bfloat16: torch.int16, torch.float16: torch.int16}


@pytest.fixture(autouse=True)
def _restore_kernel(monkeypatch):
    if INTERPRET and DEVICE.type == "cpu":  # let the kernels take CPU tensors under the interpreter
        monkeypatch.setattr(quant_triton, "available", lambda device: True)
    previous = quant.set_kernel("auto")
    yield
    quant.set_kernel(previous)


def _with_kernel(name: str, fn, *args):
    previous = quant.set_kernel(name)
    try:
        return fn(*args)
    finally:
        quant.set_kernel(previous)


def _encode(rows: torch.Tensor, bits: int, block_size: int, kernel: str) -> torch.Tensor:
    packed = torch.full((rows.shape[0], quant.packed_numel(rows.shape[1], bits, block_size)), 0xA5,
                        dtype=torch.uint8, device=rows.device)
    _with_kernel(kernel, quant.quantize_rows, rows, bits, block_size, packed)
    return packed


def _decode(packed: torch.Tensor, bits: int, block_size: int, shape, dtype, kernel: str) -> torch.Tensor:
    out = torch.full(shape, 7.0, dtype=dtype, device=packed.device)
    _with_kernel(kernel, quant.dequantize_rows, packed, bits, block_size, out)
    return out


def _assert_bit_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    nan_a, nan_b = a.isnan(), b.isnan()
    assert torch.equal(nan_a, nan_b), "NaN positions differ"
    ints_a = a.masked_fill(nan_a, 0).view(_INT_OF[a.dtype])
    ints_b = b.masked_fill(nan_b, 0).view(_INT_OF[b.dtype])
    mismatch = (ints_a != ints_b).nonzero()
    assert mismatch.numel() == 0, f"{mismatch.shape[0]} elements differ, first at {mismatch[0].tolist()}: " \
        f"{a[tuple(mismatch[0])].item()!r} vs {b[tuple(mismatch[0])].item()!r}"


def _check_both_paths(rows: torch.Tensor, bits: int, block_size: int) -> None:
    torch_packed = _encode(rows, bits, block_size, "torch")
    triton_packed = _encode(rows, bits, block_size, "triton")
    differ = (torch_packed != triton_packed).nonzero()
    assert differ.numel() == 0, f"packed bytes differ at {differ.shape[0]} places, first {differ[0].tolist()} " \
        f"(codes are the first {quant._data_bytes(rows.shape[1], bits, block_size)} bytes of a row)"
    for dtype in OUT_DTYPES:
        expected = _decode(torch_packed, bits, block_size, rows.shape, dtype, "torch")
        actual = _decode(torch_packed, bits, block_size, rows.shape, dtype, "triton")
        _assert_bit_equal(actual, expected)


def _special_input(num_chunks: int, numel: int, block_size: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random rows whose magnitude varies from block to block, with every special block kind."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_chunks, numel, generator=gen, dtype=torch.float64)
    log2 = torch.randint(-30, 30, (num_chunks, -(-numel // block_size)), generator=gen).double()
    if dtype == torch.float16:
        log2 = log2.clamp(-14, 10)
    x = x * torch.repeat_interleave(torch.exp2(log2), block_size, dim=1)[:, :numel]
    flat = x.view(-1)
    specials = [0.0, -0.0, float("nan"), float("inf"), float("-inf")]
    if dtype != torch.float16 and not INTERPRET:
        specials += [1e-40, -3e-39, 3.0e38, -3.4e38]  # subnormal inputs and scales; near fp32 max
    elif dtype == torch.float32:  # see INTERPRET_BF16
        specials += [1e-40, -3e-39, 3.0e38, -3.4e38]
    for i, value in enumerate(specials):  # one special value in a few scattered blocks
        position = (i * 7919 + seed) % flat.numel()
        flat[position] = value
    if numel >= 2 * block_size:  # a whole zero block and a whole tiny block
        x[:, :block_size] = 0.0
        tiny = 1e-3 if dtype == torch.float16 or (INTERPRET and dtype == torch.bfloat16) else 1e-42
        x[:, block_size:2 * block_size] *= tiny
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("bits", (4, 8))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_bit_identical_at_block_boundaries(bits, dtype, block_size):
    sizes = sorted({1, 3, 8, block_size - 1, block_size, block_size + 1, 3 * block_size + 5, 10_007})
    for seed, numel in enumerate(sizes):
        for num_chunks in (1, 3):
            _check_both_paths(_special_input(num_chunks, numel, block_size, dtype, seed), bits, block_size)


@pytest.mark.parametrize("bits", (4, 8))
def test_bit_identical_on_strided_rows(bits):
    """Rows that are slices of wider buffers, as the codec passes them (a parameter's segment
    of every rank's chunk), on both the input and the packed side."""
    block_size, numel = 256, 1000
    wide = _special_input(4, numel + 37, block_size, torch.bfloat16, 11)
    rows = wide[:, 5:5 + numel]
    nbytes = quant.packed_numel(numel, bits, block_size)
    for kernel in ("torch", "triton"):
        buffer = torch.zeros(4, nbytes + 64, dtype=torch.uint8, device=DEVICE)
        _with_kernel(kernel, quant.quantize_rows, rows, bits, block_size, buffer[:, 12:12 + nbytes])
        if kernel == "torch":
            expected = buffer
        else:
            assert torch.equal(buffer, expected)
    out = {k: torch.zeros(4, numel + 9, dtype=torch.float32, device=DEVICE) for k in ("torch", "triton")}
    for kernel, target in out.items():
        _with_kernel(kernel, quant.dequantize_rows, expected[:, 12:12 + nbytes], bits, block_size, target[:, 9:])
    _assert_bit_equal(out["triton"], out["torch"])


def test_empty_and_one_dimensional_inputs():
    for numel in (0, 1, 5):
        x = torch.randn(numel, device=DEVICE)
        for bits in (4, 8):
            a = _with_kernel("torch", quant.quantize_packed, x, bits, 32)
            b = _with_kernel("triton", quant.quantize_packed, x, bits, 32)
            assert torch.equal(a, b)


@settings(max_examples=15 if INTERPRET else 60, deadline=None, derandomize=True)
@given(numel=st.integers(1, 20_000 if INTERPRET else 10**6), bits=st.sampled_from((4, 8)),
       log2_block=st.integers(3, 12), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_bit_identical_property(numel, bits, log2_block, dtype, seed):
    _check_both_paths(_special_input(1, numel, 2**log2_block, dtype, seed), bits, 2**log2_block)


def test_triton_kernel_refuses_cpu_tensors():
    if INTERPRET:
        pytest.skip("the interpreter runs the kernels on CPU tensors")
    quant.set_kernel("triton")
    with pytest.raises(RuntimeError, match="need a CUDA tensor"):
        quant.quantize_packed(torch.ones(8), 8, 8)
