"""Benchmark of block quantization: speed against a memory copy, error against one scale.

Two questions decide whether quantized communication pays off:
1. Is (de)quantizing cheap next to the transfer it shrinks? Throughput is reported in GB/s of
   the unquantized tensor and as a ratio to ``copy_`` of the same tensor into an existing
   buffer, the memory-bandwidth anchor: a ratio near 1 means quantization costs about one extra
   copy. ``round_trip_vs_copy`` is the time of ``copy_`` over the time of quantize plus
   dequantize. Every width from 2 to 8 bits is timed with the torch path, the torch path under
   ``torch.compile`` (fp32 input; inductor's vectorised C++ on CPU, generated Triton on CUDA),
   on CPU the C kernels (``zeropp.codes.native``, the default there; 2, 4 and 8 bits), and on CUDA
   the hand-written Triton kernels.
2. What do blocks buy? ZeRO++ (§3.1) uses a scale per block instead of one per tensor so an
   outlier only coarsens its own block; the error table compares both on Gaussian weights and
   on heavy-tailed Student-t (ν = 3) weights.

Results are printed and written to ``<out_dir>/bench_quant.json``.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from zeropp.codes import native, quant, quant_triton
from zeropp.codes.codec import ChunkCodec, segments_for
from zeropp.codes.quant import (
    dequantize_from,
    dequantize_packed,
    packed_numel,
    quantize_into,
    quantize_packed,
    set_kernel,
)
from zeropp.tools.check.machine import cpu_name

BLOCK_SIZE = 256
BITS = (8, 6, 5, 4, 3, 2)
INPUT_DTYPES = (torch.float32, torch.bfloat16)
ERROR_NUMEL = 2**20
STUDENT_T_DF = 3.0
CUDA_INNER = 20


def _device() -> torch.device:
    """CUDA when present (where the collectives run), else CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _machine(device: torch.device) -> dict[str, Any]:
    """What the numbers were measured on."""
    cpu = cpu_name()
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu,
        "num_cpus": os.cpu_count(),
        "num_threads": torch.get_num_threads(),
        "load_average_1min": os.getloadavg()[0],  # other work on a shared machine skews timings
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
    }


def median_seconds(fn: Callable[[], object], repeats: int, device: torch.device, cuda_inner: int = CUDA_INNER) -> float:
    """Median wall time of ``fn`` over ``repeats`` runs, after one warm-up run. On CUDA each
    run is ``cuda_inner`` back-to-back calls between two synchronizations (a single kernel on a
    small tensor takes microseconds, under the timer's resolution), divided by their number."""
    fn()
    inner = cuda_inner if device.type == "cuda" else 1
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) / inner)
    return statistics.median(times)


def _kernels(device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
    """The (de)quantization paths to time: the torch path, the same compiled (fp32 input), on
    CPU the C kernels where they built, and on CUDA the Triton kernels."""
    compiled = ("compiled",) if dtype == torch.float32 else ()
    c_kernels = ("native",) if device.type == "cpu" and native.available() else ()
    return ("torch", *compiled, *c_kernels, *(("triton",) if quant_triton.available(device) else ()))


def _coders(kernel: str, x: torch.Tensor, bits: int, packed: torch.Tensor, decoded: torch.Tensor
            ) -> tuple[Callable[[], object], Callable[[], object], float]:
    """Quantize and dequantize calls for one kernel, and the seconds the first calls took
    (torch.compile's compile time; a warm-up otherwise). ``compiled`` is the block code of the
    torch path (scales, codes, packing; unpacking, scaling) over whole blocks, compiled as one
    function each way, so inductor can fuse it."""
    if kernel == "compiled":
        encode, decode = _compiled_block_code(x.view(-1, BLOCK_SIZE), bits)
    else:
        encode = lambda: quantize_into(x, bits, BLOCK_SIZE, packed)  # noqa: E731
        decode = lambda: dequantize_from(packed, bits, BLOCK_SIZE, x.numel(), decoded)  # noqa: E731
    start = time.perf_counter()
    encode()
    decode()
    return encode, decode, time.perf_counter() - start


def _compiled_block_code(blocks: torch.Tensor, bits: int) -> tuple[Callable[[], object], Callable[[], object]]:
    """torch.compile of the torch path's block code on (num_blocks, BLOCK_SIZE) fp32 rows."""
    def encode(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scales = quant._block_scales(blocks, bits)
        return scales, quant.pack_codes(quant._block_codes(blocks, scales, overwrite=False), bits)

    def decode(code_bytes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return quant.unpack_codes(code_bytes, bits).view(-1, BLOCK_SIZE).mul_(scales[:, None])

    # A fresh compile for every width and size: without the reset, dynamo's recompile limit (8
    # per function) silently falls back to eager for the later ones; dynamic=False, or a
    # recompile would make ``bits`` symbolic and inductor emits a float64 shift in its Triton
    # (torch 2.11, CUDA).
    torch._dynamo.reset()
    compiled_encode, compiled_decode = torch.compile(encode, dynamic=False), torch.compile(decode, dynamic=False)
    coded: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def run_encode() -> None:
        coded["last"] = compiled_encode(blocks)

    return run_encode, lambda: compiled_decode(coded["last"][1], coded["last"][0])


def _throughput_rows(
    numel: int, dtype: torch.dtype, repeats: int, device: torch.device
) -> list[dict[str, Any]]:
    """Quantize and dequantize speed for one tensor, at every bit width and kernel, against
    its clone.

    ``copy_`` into a preallocated buffer (on CUDA the device-to-device copy) is reported too:
    unlike ``clone`` it pays no allocation, so the two bracket the cost of touching the
    tensor's memory once. ``*_traffic_gbps`` count bytes read plus bytes written, the figure
    to hold against the memory's bandwidth.
    """
    x = torch.randn(numel, device=device).to(dtype)
    nbytes = numel * x.element_size()
    decoded = torch.empty_like(x)
    clone_s = median_seconds(lambda: torch.clone(x), repeats, device)
    copy_s = median_seconds(lambda: decoded.copy_(x), repeats, device)
    rows = []
    for kernel in _kernels(device, dtype):
        previous = set_kernel(kernel if kernel in ("triton", "native") else "torch")
        try:
            kernel_bits = {"native": native.BITS, "triton": quant_triton.BITS}.get(kernel, BITS)
            for bits in (b for b in BITS if b in kernel_bits):
                num_bytes = packed_numel(numel, bits, BLOCK_SIZE)
                packed = torch.empty(num_bytes, dtype=torch.uint8, device=device)
                encode, decode, first_call_s = _coders(kernel, x, bits, packed, decoded)
                quantize_s = median_seconds(encode, repeats, device)
                dequantize_s = median_seconds(decode, repeats, device)
                rows.append({
                    "numel": numel,
                    "dtype": str(dtype).removeprefix("torch."),
                    "kernel": kernel,
                    "bits": bits,
                    "block_size": BLOCK_SIZE,
                    "compression": nbytes / packed.numel(),
                    "clone_gbps": nbytes / clone_s / 1e9,
                    "copy_gbps": nbytes / copy_s / 1e9,
                    "quantize_gbps": nbytes / quantize_s / 1e9,
                    "dequantize_gbps": nbytes / dequantize_s / 1e9,
                    "quantize_vs_clone": clone_s / quantize_s,
                    "dequantize_vs_clone": clone_s / dequantize_s,
                    "quantize_vs_copy": copy_s / quantize_s,
                    "dequantize_vs_copy": copy_s / dequantize_s,
                    "round_trip_vs_copy": copy_s / (quantize_s + dequantize_s),
                    "first_call_s": first_call_s,
                    "copy_traffic_gbps": 2 * nbytes / copy_s / 1e9,
                    "quantize_traffic_gbps": (nbytes + num_bytes) / quantize_s / 1e9,
                    "dequantize_traffic_gbps": (nbytes + num_bytes) / dequantize_s / 1e9,
                })
        finally:
            set_kernel(previous)
    return rows


DEMO_UNIT = [128, 128, 49152, 384, 16384, 128, 128, 128, 65536, 512, 65536, 128]
"""Padded numels of one demo-GPT block (4 x 128) as FSDP2 lays them out on 4 ranks."""


def _chunk_rows(repeats: int) -> list[dict[str, Any]]:
    """One demo unit's chunk: the fused one-pass codec (the default; its block code in C where
    the C kernels take the width, else torch's) and the same with torch's block code, against
    coding each parameter segment on its own (torch's), encode of one rank's row and decode of
    four rows."""
    rows = []
    for bits in BITS:
        codec = ChunkCodec(segments_for(DEMO_UNIT, [True] * len(DEMO_UNIT), 4, bits), BLOCK_SIZE, torch.float32)
        chunks = torch.randn(4, codec.numel)
        packed = torch.empty(4, codec.nbytes, dtype=torch.uint8)
        decoded = torch.empty_like(chunks)
        times = {}
        for path, kernel, encode, decode in (
                ("fused", "native", codec.encode, codec.decode),
                ("fused_torch", "torch", codec.encode, codec.decode),
                ("per_segment", "torch", codec.encode_segments, codec.decode_segments)):
            previous = set_kernel(kernel)
            try:
                times[f"{path}_encode_ms"] = 1e3 * median_seconds(lambda: encode(chunks[:1], packed[:1]), repeats,
                                                                   chunks.device)
                times[f"{path}_decode_ms"] = 1e3 * median_seconds(lambda: decode(packed, decoded), repeats,
                                                                   chunks.device)
            finally:
                set_kernel(previous)
        rows.append({"bits": bits, "segments": len(DEMO_UNIT), "chunk_numel": codec.numel, **times})
    return rows


def _per_tensor_round_trip(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Quantize with one scale for the whole tensor (absmax / qmax) and decode, in fp32."""
    qmax = 2 ** (bits - 1) - 1
    scale = x.abs().max() / qmax
    return torch.round(x / scale) * scale


def _error_stats(x: torch.Tensor, decoded: torch.Tensor) -> dict[str, float]:
    """RMS, relative RMS and max absolute error of ``decoded`` against ``x``."""
    error = decoded.double() - x.double()
    rms = error.square().mean().sqrt().item()
    return {
        "rms_error": rms,
        "relative_rms_error": rms / x.double().square().mean().sqrt().item(),
        "max_abs_error": error.abs().max().item(),
    }


def _weights(distribution: str, numel: int) -> torch.Tensor:
    """Synthetic fp32 weights: standard Gaussian or Student-t with ``STUDENT_T_DF`` degrees."""
    if distribution == "gaussian":
        return torch.randn(numel)
    return torch.distributions.StudentT(STUDENT_T_DF).sample((numel,))


def _error_rows() -> list[dict[str, Any]]:
    """Blocked (``BLOCK_SIZE``) vs per-tensor quantization error for each distribution and bits."""
    torch.manual_seed(0)
    rows = []
    for distribution in ("gaussian", f"student_t_df{STUDENT_T_DF:g}"):
        x = _weights(distribution, ERROR_NUMEL)
        for bits in BITS:
            packed = quantize_packed(x, bits, BLOCK_SIZE)
            blocked = dequantize_packed(packed, bits, BLOCK_SIZE, x.numel(), x.dtype)
            per_tensor = _per_tensor_round_trip(x, bits)
            for scheme, decoded in (("block", blocked), ("per_tensor", per_tensor)):
                stats = _error_stats(x, decoded)
                rows.append({"distribution": distribution, "bits": bits, "scheme": scheme, **stats})
    return rows


def _print_tables(throughput: list[dict[str, Any]], errors: list[dict[str, Any]]) -> None:
    """Human-readable summary of both tables (GB/s of the unquantized tensor)."""
    print(f"{'numel':>10} {'dtype':>9} {'kernel':>8} {'bits':>4} {'clone':>7} {'copy_':>7} "
          f"{'quant':>7} {'/copy_':>6} {'dequant':>7} {'/copy_':>6} {'q+dq / copy_':>12}")
    for r in throughput:
        print(f"{r['numel']:>10} {r['dtype']:>9} {r['kernel']:>8} {r['bits']:>4} "
              f"{r['clone_gbps']:>7.2f} {r['copy_gbps']:>7.2f} {r['quantize_gbps']:>7.2f} "
              f"{r['quantize_vs_copy']:>6.2f} {r['dequantize_gbps']:>7.2f} {r['dequantize_vs_copy']:>6.2f} "
              f"{r['round_trip_vs_copy']:>12.2f}")
    print(f"\n{'distribution':>16} {'bits':>4} {'scheme':>10} {'rms':>10} {'rel rms':>10} "
          f"{'max abs':>10}")
    for r in errors:
        print(f"{r['distribution']:>16} {r['bits']:>4} {r['scheme']:>10} {r['rms_error']:>10.3e} "
              f"{r['relative_rms_error']:>10.3e} {r['max_abs_error']:>10.3e}")


def run(
    out_dir: str = "benchmarks/results",
    sizes: Sequence[int] = (2**20, 2**24),
    repeats: int = 5,
) -> dict:
    """Measure quantization throughput and error, print them, and write bench_quant.json
    (bench_quant_cuda.json on a CUDA machine, where the Triton kernels are timed too).

    Throughput (median of ``repeats`` after a warm-up) is in GB/s of the unquantized tensor
    for fp32 and bf16 input at every width in ``BITS`` with block size 256; error is measured
    on ``ERROR_NUMEL`` fp32 weights.
    """
    device = _device()
    throughput = [
        row
        for numel in sizes
        for dtype in INPUT_DTYPES
        for row in _throughput_rows(numel, dtype, repeats, device)
    ]
    chunks = _chunk_rows(max(repeats, 21)) if device.type == "cpu" else []
    errors = _error_rows()
    config = {"block_size": BLOCK_SIZE, "sizes": list(sizes), "repeats": repeats}
    result = {
        "machine": _machine(device),
        "config": {**config, "error_numel": ERROR_NUMEL, "gbps": "bytes of the unquantized tensor"},
        "throughput": throughput,
        "demo_unit_chunk": chunks,
        "error": errors,
    }
    _print_tables(throughput, errors)
    print(f"\n{'bits':>4} {'encode: fused':>13} {'fused, torch':>12} {'per-segment':>11} {'decode: fused':>13} "
          f"{'fused, torch':>12} {'per-segment':>11}  (ms, one demo unit: encode 1 row, decode 4)")
    for r in chunks:
        print(f"{r['bits']:>4} {r['fused_encode_ms']:>13.3f} {r['fused_torch_encode_ms']:>12.3f} "
              f"{r['per_segment_encode_ms']:>11.3f} {r['fused_decode_ms']:>13.3f} {r['fused_torch_decode_ms']:>12.3f} "
              f"{r['per_segment_decode_ms']:>11.3f}")
    os.makedirs(out_dir, exist_ok=True)
    name = "bench_quant_cuda.json" if device.type == "cuda" else "bench_quant.json"
    path = os.path.join(out_dir, name)
    with open(path, "w") as file:
        json.dump(result, file, indent=2)
    print(f"\nwrote {path}")
    return result
