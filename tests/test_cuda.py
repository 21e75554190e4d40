"""What the CUDA path must satisfy beyond the Triton kernels' bytes (``test_quant_triton.py``).

* The Triton kernels compile for Hopper (sm_90) wherever Triton is installed, GPU or not: the
  interpreter runs kernels that the compiler refuses (it reads plain global floats, which Triton
  kernels may not).
* The torch path's scales (and the asymmetric code's) are correctly rounded quotients on every device.
  CUDA divides by a Python number through its reciprocal, one ulp off in places; the C and
  Triton kernels divide exactly, so the torch path must too for the three to agree.
* On a CUDA device the torch path gives the CPU's bytes, and zeropp trains on CUDA tensors: four
  gloo ranks sharing one GPU, as a 2x2 cluster, against the same run on CPU.
* Under ``auto`` a Triton kernel that fails falls back to the torch path (simulated on CPU).

The GPU tests skip without CUDA; the compile test skips without Triton.
"""

from __future__ import annotations

import itertools
import math
import warnings

import pytest
import torch

import zeropp
from distributed import run_distributed
from models import global_batch, make_model, rows
from zeropp.codes import quant, quant_triton, weightcode
from zeropp.tools.modes import MODES

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
DEVICES = ("cpu", pytest.param("cuda", marks=needs_cuda))


@pytest.mark.skipif(quant_triton.triton is None, reason="needs Triton")
@pytest.mark.parametrize("bits", quant_triton.BITS)
def test_triton_kernels_compile_for_hopper(bits):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    common = {"numel": "i32", "num_blocks": "i32", "BITS": "constexpr", "BLOCK": "constexpr",
              "GROUP": "constexpr"}
    code_type = "*i8" if bits == 8 else "*u8"
    for block_size, (in_type, out_type) in itertools.product(
            (8, 256, 65536), (("*fp32", "*fp32"), ("*bf16", "*bf16"), ("*fp16", "*fp64"))):
        group, _, num_warps = quant_triton._launch_shape(1, 1, block_size)
        constants = {"BITS": bits, "BLOCK": block_size, "GROUP": group}
        encode = {"x_ptr": in_type, "x_stride": "i64", "data_ptr": "*u8", "data_stride": "i64",
                  "scales_ptr": "*fp32", "scales_stride": "i64", "data_bytes": "i32", **common}
        decode = {"data_ptr": code_type, "data_stride": "i64", "scales_ptr": "*fp32", "scales_stride": "i64",
                  "out_ptr": out_type, "out_stride": "i64", **common}
        for kernel, signature in ((quant_triton._encode_kernel, encode), (quant_triton._decode_kernel, decode)):
            names = kernel.arg_names
            signature = {name: signature[name] for name in names}
            compiled = quant_triton.triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants),
                                                   target=target, options={"num_warps": num_warps})
            assert compiled.asm["cubin"], f"{kernel.fn.__name__} at {bits} bits, blocks of {block_size}: no cubin"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", quant.ALLOWED_BITS)
def test_scales_are_correctly_rounded_quotients(device, bits):
    g = torch.Generator().manual_seed(bits)
    # block maxima spread over fp32's normal range, where no subnormal or overflow rule applies
    absmax = torch.exp(torch.empty(1 << 16).uniform_(-80.0, 80.0, generator=g)).float()
    blocks = torch.zeros(absmax.numel(), 8)
    blocks[:, 3] = absmax
    blocks[::2, 3] *= -1
    qmax = 2 ** (bits - 1) - 1
    exact = (absmax.double() / qmax).float()  # fp64 holds the quotient exactly enough to round once
    scales = quant._block_scales(blocks.to(device), bits).cpu()
    wrong = (scales != exact).sum().item()
    assert wrong == 0, f"{wrong} of {absmax.numel()} scales on {device} are not absmax / {qmax} rounded once"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", (2, 4, 8))
def test_asymmetric_scales_are_correctly_rounded_quotients(device, bits):
    g = torch.Generator().manual_seed(bits)
    blocks = torch.exp(torch.empty(1 << 14, 8).uniform_(-60.0, 60.0, generator=g)).float()
    blocks[::2] *= -1
    half_range = blocks.amax(dim=1) * 0.5 - blocks.amin(dim=1) * 0.5  # as block_params forms it, in fp32
    exact = (half_range.double() / ((2**bits - 1) / 2)).float()
    scales = weightcode.block_params(blocks.to(device), bits)[:, 0].cpu()
    wrong = (scales != exact).sum().item()
    assert wrong == 0, f"{wrong} of {blocks.shape[0]} asymmetric scales on {device} are not rounded once"


@needs_cuda
@pytest.mark.parametrize("kernel", ("torch", "auto"))
def test_cuda_gives_the_cpu_bytes(kernel):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1 << 18, generator=g) * torch.logspace(-30, 30, 1 << 18)
    x[1000:1008] = 0.0
    x[5000] = float("nan")
    for bits, block_size in itertools.product(quant.ALLOWED_BITS, (32, 256)):
        on_cpu = quant.quantize_packed(x, bits, block_size)
        previous = quant.set_kernel(kernel)
        try:
            on_cuda = quant.quantize_packed(x.cuda(), bits, block_size)
            decoded = quant.dequantize_packed(on_cuda, bits, block_size, x.numel(), torch.float32).cpu()
        finally:
            quant.set_kernel(previous)
        assert torch.equal(on_cuda.cpu(), on_cpu), f"{bits} bits, blocks of {block_size}: bytes differ"
        reference = quant.dequantize_packed(on_cpu, bits, block_size, x.numel(), torch.float32)
        assert torch.equal(decoded.isnan(), reference.isnan())
        assert torch.equal(decoded.nan_to_num(), reference.nan_to_num()), f"{bits} bits: values differ"


def _train(rank: int, world_size: int, device: str, mode: str) -> dict:
    model = make_model("gpt").to(device)
    zeropp.shard(model, MODES[mode].config(ranks_per_node=2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ledger = zeropp.comm_ledger()
    losses = []
    for step in range(3):
        x, y = (rows(t, rank, world_size).to(device) for t in global_batch(step, 4 * world_size))
        _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    shards = {name: p.to_local().detach().cpu().double().tolist() for name, p in model.named_parameters()}
    return {"losses": losses, "shards": shards, "bytes": ledger.summary()["total"]}


@needs_cuda
@pytest.mark.parametrize("mode", ("zero3", "all"))
def test_zeropp_trains_on_cuda_tensors(mode):
    """Four gloo ranks share the GPU (NCCL takes one rank per GPU). The bytes on the wire are the
    CPU run's exactly; losses and shards differ only by the GPU's float summation order, which
    three AdamW steps at lr 1e-2 keep far below 1e-2 of each shard (measured 7e-4 on an H100)."""
    env = {"ZEROPP_RANKS_PER_NODE": "2"}
    on_cuda = run_distributed(_train, 4, "cuda", mode, env=env)
    on_cpu = run_distributed(_train, 4, "cpu", mode, env=env)
    for rank, (gpu, cpu) in enumerate(zip(on_cuda, on_cpu)):
        assert gpu["bytes"] == cpu["bytes"], f"rank {rank}: the ledgers differ"
        assert math.isclose(gpu["losses"][0], cpu["losses"][0], rel_tol=1e-5), (gpu["losses"], cpu["losses"])
        assert gpu["losses"][-1] < gpu["losses"][0]
        for name, shard in cpu["shards"].items():
            a, b = torch.tensor(shard), torch.tensor(gpu["shards"][name])
            assert (a - b).norm() <= 1e-2 * a.norm() + 1e-12, f"rank {rank} {name}: {(a - b).norm() / a.norm():.2e}"


def test_a_failing_triton_kernel_falls_back_to_the_torch_path_under_auto(monkeypatch):
    """A GPU or Triton version the kernels do not compile for: ``auto`` warns once and codes
    with the torch path (the same bytes), ``triton`` raises. Simulated on CPU tensors."""
    def broken(*args):
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(quant_triton, "available", lambda device: True)
    monkeypatch.setattr(quant_triton, "encode_rows", broken)
    monkeypatch.setattr(quant_triton, "decode_rows", broken)
    monkeypatch.setattr(quant, "_TRITON_FAILED", set())
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    previous = quant.set_kernel("torch")
    try:
        expected = quant.quantize_packed(x, 4, 32)
        expected_values = quant.dequantize_packed(expected, 4, 32, x.numel(), torch.float32)
        quant.set_kernel("triton")
        with pytest.raises(RuntimeError, match="no kernel image"):
            quant.quantize_packed(x, 4, 32)
        quant.set_kernel("auto")
        with pytest.warns(RuntimeWarning, match="Triton quantization kernels failed on cpu"):
            packed = quant.quantize_packed(x, 4, 32)
        assert torch.equal(packed, expected)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once only: the device now takes the torch path
            decoded = quant.dequantize_packed(packed, 4, 32, x.numel(), torch.float32)
            assert torch.equal(quant.quantize_packed(x, 4, 32), expected)
        assert torch.equal(decoded, expected_values)
    finally:
        quant.set_kernel(previous)
