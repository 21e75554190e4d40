"""Kernels: how fast the codec encodes and decodes, against a copy of the same bytes.

For every code zeropp sends (qwZ's weights, symmetric and asymmetric, in bf16; qgZ's gradients
in fp32: the plain code, normal levels, the Hadamard rotation, stochastic rounding, 8-bit block
scales) at 2, 4 and 8 bits, one ``ChunkCodec`` encodes a chunk of ``NUMEL`` elements and decodes
it, on every path that takes it: the torch path everywhere, the Triton kernels on CUDA (plain
code, 4 and 8 bits), the C kernels on the CPU (plain code). ``copy_`` of the same tensor into an
existing one is the memory-bandwidth anchor: ``encode_vs_copy`` near 1 means coding costs about
one extra copy. GB/s count the bytes of the uncoded chunk (``copy_traffic_gbps``, the bytes a
copy reads and writes, is the figure to hold against the memory's bandwidth); on CUDA each time
is the median of ``REPEATS`` runs of ``INNER`` calls between two synchronizations. Checks: the
decoded chunk is finite, and every path of one code and width decodes it alike (the same bytes:
the same error).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from zeropp.codes import native, quant, quant_triton
from zeropp.codes.codec import ChunkCodec, segments_for
from zeropp.codes.gradcode import GradientCode
from zeropp.tools.bench.quant import median_seconds
from zeropp.tools.check.record import Context, Record
from zeropp.tools.check.report import parts_table, table

BLOCK_SIZE = 256
NUMEL = {"gpu": 2**26, "smoke": 2**14}
REPEATS = {"gpu": 5, "smoke": 3}
INNER = {"cuda": 5, "cpu": 1}
SMOKE_WIDTHS = (4,)
"""The smoke form codes at one width: each code's path is proven, nothing is measured."""


@dataclass(frozen=True)
class Code:
    """One code as a unit's chunk carries it."""

    dtype: torch.dtype
    widths: tuple[int, ...]
    asymmetric: bool = False
    gradient: GradientCode | None = None


CODES = {
    "weights": Code(torch.bfloat16, (2, 4, 8)),
    "weights_asymmetric": Code(torch.bfloat16, (2, 4, 8), asymmetric=True),
    "gradients": Code(torch.float32, (2, 4, 8)),
    "gradients_normal_levels": Code(torch.float32, (2, 4), gradient=GradientCode(levels="normal")),
    "gradients_hadamard": Code(torch.float32, (2, 4, 8), gradient=GradientCode(rotation="hadamard")),
    "gradients_stochastic": Code(torch.float32, (2, 4, 8), gradient=GradientCode(rounding="stochastic")),
    "gradients_scale8": Code(torch.float32, (2, 4, 8), gradient=GradientCode(scale_bits=8)),
}


def paths(code: Code, bits: int, chunk: torch.Tensor) -> tuple[str, ...]:
    """The ``quant.set_kernel`` paths that code ``chunk`` differently: the C and Triton kernels
    take the plain symmetric code only."""
    plain = code.gradient is None and not code.asymmetric
    return ("torch",
            *(("native",) if plain and native.applies(chunk, bits, BLOCK_SIZE) else ()),
            *(("triton",) if plain and quant_triton.available(chunk.device) and bits in quant_triton.BITS else ()))


def seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds of one call of ``fn``, after a warm-up call (the codec benchmark's timer)."""
    return median_seconds(fn, repeats, device, cuda_inner=INNER["cuda"])


def measure(name: str, code: Code, bits: int, path: str, chunk: torch.Tensor, repeats: int) -> dict[str, Any]:
    """Encode and decode ``chunk`` (1, numel) with ``code`` at ``bits`` on ``path``."""
    codec = ChunkCodec(segments_for([chunk.shape[1]], [True], 1, bits, asymmetric=code.asymmetric,
                                    grouped_scales=code.gradient is not None and code.gradient.grouped_scales),
                       BLOCK_SIZE, chunk.dtype, code=code.gradient)
    packed = torch.empty(1, codec.nbytes, dtype=torch.uint8, device=chunk.device)
    decoded = torch.empty_like(chunk)
    generator = torch.Generator(chunk.device).manual_seed(0)
    previous = quant.set_kernel(path)
    try:
        encode_s = seconds(lambda: codec.encode(chunk, packed, generator), chunk.device, repeats)
        decode_s = seconds(lambda: codec.decode(packed, decoded), chunk.device, repeats)
    finally:
        quant.set_kernel(previous)
    error = (decoded.double() - chunk.double()).square().mean().sqrt() / chunk.double().square().mean().sqrt()
    copy_s = seconds(lambda: decoded.copy_(chunk), chunk.device, repeats)
    nbytes = chunk.numel() * chunk.element_size()
    return {"code": name, "bits": bits, "path": path, "dtype": str(chunk.dtype).removeprefix("torch."),
            "numel": chunk.numel(), "compression": nbytes / codec.nbytes, "encode_gbps": nbytes / encode_s / 1e9,
            "decode_gbps": nbytes / decode_s / 1e9, "copy_gbps": nbytes / copy_s / 1e9,
            "copy_traffic_gbps": 2 * nbytes / copy_s / 1e9,
            "encode_vs_copy": copy_s / encode_s, "decode_vs_copy": copy_s / decode_s,
            "relative_rms_error": error.item()}


def run(context: Context, record: Record) -> None:
    form = "smoke" if context.smoke else "gpu"
    device = torch.device(context.device)
    for name, code in CODES.items():
        with record.part(name) as part:
            chunk = torch.randn(1, NUMEL[form], generator=torch.Generator().manual_seed(0)).to(device, code.dtype)
            widths = SMOKE_WIDTHS if context.smoke else code.widths
            part["rows"] = [measure(name, code, bits, path, chunk, REPEATS[form])
                            for bits in widths for path in paths(code, bits, chunk)]
            errors = {(row["bits"], row["path"]): row["relative_rms_error"] for row in part["rows"]}
            part["checks"] = {"decoded values finite": all(math.isfinite(e) for e in errors.values()),
                              "every path decodes alike": all(e == errors[(bits, "torch")]
                                                             for (bits, _), e in errors.items())}


def summary(parts: dict[str, dict[str, Any]]) -> str:
    rows = [row for part in parts.values() for row in part.get("rows", [])]
    if not rows:
        return ""
    best = max(rows, key=lambda row: row["encode_vs_copy"])
    worst = min(rows, key=lambda row: row["encode_vs_copy"])
    return (f"{len(rows)} code x width x path rows; encode at {worst['encode_vs_copy']:.3g}x "
            f"({worst['code']} {worst['bits']}-bit {worst['path']}) to {best['encode_vs_copy']:.3g}x "
            f"({best['code']} {best['bits']}-bit {best['path']}) of a copy's speed")


def markdown(parts: dict[str, dict[str, Any]]) -> list[str]:
    header = ["code", "bits", "path", "dtype", "encode GB/s", "decode GB/s", "copy GB/s", "encode / copy",
              "decode / copy", "rel. RMS error"]
    figures = ("encode_gbps", "decode_gbps", "copy_gbps", "encode_vs_copy", "decode_vs_copy")
    rows = [[r["code"], r["bits"], r["path"], r["dtype"], *(f"{r[k]:.3g}" for k in figures),
             f"{r['relative_rms_error']:.2e}"] for part in parts.values() for r in part.get("rows", [])]
    return [*parts_table(parts), "", *table(header, rows)]
