"""Lower-error codes for qgZ's gradient blocks, at the same bytes as the block code of ``quant``.

qgZ sends every gradient element in 4 bits (ZeRO++ §3.3). Three options change how a block is
coded without changing its size on the wire (codes plus one fp32 scale per block):

- ``rotation="hadamard"``: multiply each whole block by a randomized Hadamard matrix before
  coding and by its transpose after decoding ([Note: block rotation]).
- ``rounding="stochastic"``: round up or down at random, with the probability that makes the
  code unbiased ([Note: stochastic rounding]).
- ``levels="normal"``: 2- and 4-bit codes whose levels are fitted to a Gaussian block scaled by
  its absmax, instead of evenly spaced ([Note: normal levels]
The packed layout is ``quant``'s: the same fields, the same fp32 scale per block (for normal
levels the scale is the block's absmax itself). Pure tensor math, no torch.distributed. [Note:
block rotation] H_B / sqrt(B) times a diagonal of random signs is orthogonal. Rotating a block
spreads an outlier over all B elements, so the absmax of a heavy-tailed block drops towards that
of a Gaussian one, and the scale with it; the error, measured in the rotated basis, comes back
through the transpose with the same L2 norm: ``||x - q||_2 <= sqrt(B) * max_error_per_element``
per block. The signs come from a fixed seed, the same on every rank, so rotation commutes with
qgZ's sum. Only whole blocks are rotated: a parameter's last, partial block is zero-padded
inside the computation but its padding is not sent, and a rotation would move signal into that
padding; it is coded unrotated. Gaussian blocks gain nothing (a rotated Gaussian block is
Gaussian). [Note: stochastic rounding] Between the two levels ``lo <= v <= hi`` around a value,
choose ``hi`` with probability ``(v - lo) / (hi - lo)``: the expected code is ``v`` exactly, so
the error has no bias and needs no error feedback, at twice the variance of rounding to nearest
for evenly spaced levels; any single error is below one level gap. The uniforms come from a
``torch.Generator`` the caller seeds per rank and hop, so a run reproduces. [Note: normal
levels] Levels ``l_0 < ... < l_{L-1}`` (L = 2**bits) with ``l_0 = -1``, ``l_{L-1} = 1``,
symmetric, fitted by Lloyd's algorithm to Gaussian blocks of the block size divided by their
absmax (their values lie in [-1, 1], with the extremes held fixed so nothing clips), once per
width and block size. A value ``x`` in a block with absmax ``a`` is coded as the index of the
nearest level to ``x / a``; the error is at most half the largest gap times ``a`` (at 4 bits and
blocks of 256: 0.133 a, against a / 14 for the evenly spaced code), and its mean square on
Gaussian blocks is 0.60x the evenly spaced code's (0.68x at blocks of 64). Zeros are not exact
inside a block with nonzero values (the levels nearest 0 are +-0.044 at 4 bits and 256); an
all-zero block has absmax 0 and decodes to zeros.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from zeropp import quant

ROTATIONS = ("none", "hadamard")
ROUNDINGS = ("nearest", "stochastic")
LEVELS = ("uniform", "normal")

NORMAL_LEVEL_BITS = (2, 4)
"""Widths with normal levels; 8-bit hops keep the evenly spaced code (256 levels leave little to gain)."""

ROTATION_SEED = 0x5EED
"""Seed of the rotation's signs; the same on every rank, so every rank rotates alike."""


@dataclass(frozen=True)
class GradientCode:
    """How qgZ codes a gradient block beyond the plain block code; see the module Notes."""

    rotation: str = "none"
    """"hadamard": rotate whole blocks by a randomized Hadamard matrix ([Note: block rotation])."""
    rounding: str = "nearest"
    """"stochastic": unbiased random rounding between the two nearest levels."""
    levels: str = "uniform"
    """"normal": levels fitted to Gaussian blocks (2 and 4 bits); 8-bit hops stay uniform."""

    def __post_init__(self) -> None:
        for name, allowed in (("rotation", ROTATIONS), ("rounding", ROUNDINGS), ("levels", LEVELS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} is not allowed; allowed: {', '.join(allowed)}")

    @property
    def is_plain(self) -> bool:
        """Whether this is ``quant``'s block code unchanged."""
        return self == GradientCode()

    def table(self, bits: int, block_size: int, device: torch.device) -> Tensor | None:
        """The decoded value of each field 0 .. 2**bits - 1, in units of the scale, for normal
        levels at this width; None for evenly spaced levels (value = field - 2**(bits - 1))."""
        if self.levels != "normal" or bits not in NORMAL_LEVEL_BITS:
            return None
        return _level_table(bits, block_size, str(device))


@functools.cache
def _level_table(bits: int, block_size: int, device: str) -> Tensor:
    half = torch.tensor(fit_normal_levels(bits, block_size), dtype=torch.float32)
    return torch.cat((half.flip(0).neg(), half)).to(device)


@functools.cache
def _rotation(block_size: int, device: str) -> Tensor:
    """The (B, B) matrix R = diag(signs) H_B / sqrt(B); a row-block x rotates as x @ R."""
    if block_size & (block_size - 1):
        raise ValueError(f"block_size={block_size} is not allowed with rotation='hadamard'; "
                         "allowed: a power of two")
    hadamard = torch.ones(1, 1, dtype=torch.float64)
    while hadamard.shape[0] < block_size:
        hadamard = torch.cat((torch.cat((hadamard, hadamard), 1), torch.cat((hadamard, -hadamard), 1)), 0)
    generator = torch.Generator().manual_seed(ROTATION_SEED)
    signs = torch.randint(0, 2, (block_size,), generator=generator, dtype=torch.float64) * 2 - 1
    return (signs[:, None] * hadamard / math.sqrt(block_size)).float().to(device)


def rotate(blocks: Tensor, whole: Tensor | None, inverse: bool = False) -> Tensor:
    """A new fp32 tensor: each row of ``blocks`` (num_blocks, B) rotated (or rotated back with
    ``inverse``) where ``whole`` (num_blocks,) is True, copied unchanged where it is False."""
    rotation = _rotation(blocks.shape[1], str(blocks.device))
    rotated = blocks @ (rotation.t() if inverse else rotation)
    return rotated if whole is None else torch.where(whole[:, None], rotated, blocks)


def block_scales(blocks: Tensor, bits: int, code: GradientCode) -> Tensor:
    """Scale per block row: ``quant``'s absmax / qmax, or the absmax itself for normal levels."""
    if code.table(bits, blocks.shape[1], blocks.device) is None:
        return quant._block_scales(blocks, bits)
    return quant._block_scales(blocks, 2)  # qmax = 1 at 2 bits: the absmax, with quant's special cases


def block_codes(blocks: Tensor, scales: Tensor, bits: int, code: GradientCode,
                generator: torch.Generator | None) -> Tensor:
    """Integer-valued fp32 codes in [-2**(bits-1), 2**(bits-1) - 1] (field minus the offset)
    of ``blocks`` (num_blocks, B) with ``scales`` (num_blocks,); zero for zero and non-finite blocks."""
    divisors = torch.where(scales > 0, scales, torch.inf)[:, None]
    units = (blocks / divisors).nan_to_num_(0.0)  # in units of the scale
    table = code.table(bits, blocks.shape[1], blocks.device)
    if table is None:
        qmax = 2 ** (bits - 1) - 1
        if code.rounding == "nearest":
            return units.round_()
        return units.add_(_uniform(units, generator)).floor_().clamp_(-qmax, qmax)
    edges = (table[1:] + table[:-1]) / 2
    if code.rounding == "nearest":
        fields = torch.bucketize(units, edges)
    else:  # lo = the last level <= units; go up with probability (units - lo) / gap
        lower = (torch.bucketize(units, table, right=True) - 1).clamp_(0, len(table) - 2)
        gap = table[lower + 1] - table[lower]
        fields = lower + (_uniform(units, generator) * gap < units - table[lower])
    return fields.float().sub_(2 ** (bits - 1))


def _uniform(like: Tensor, generator: torch.Generator | None) -> Tensor:
    if generator is None:
        raise ValueError("rounding='stochastic' needs a torch.Generator (seeded per rank and hop)")
    return torch.rand(like.shape, generator=generator, device=like.device)


def block_values(codes: Tensor, scales: Tensor, bits: int, code: GradientCode) -> Tensor:
    """Decoded fp32 values (num_blocks, B) of integer-valued codes and their block scales."""
    table = code.table(bits, codes.shape[1], codes.device)
    units = codes if table is None else table[codes.add(2 ** (bits - 1)).long()]  # a new tensor
    return units.mul_(scales[:, None])


def max_level_gap(bits: int, block_size: int, code: GradientCode) -> float:
    """The largest distance between two adjacent levels, in units of the scale: an element's
    error is at most half of it (rounding to nearest) or all of it (stochastic rounding)."""
    table = code.table(bits, block_size, torch.device("cpu"))
    return 1.0 if table is None else (table[1:] - table[:-1]).max().item()


FIT_VALUES = 2 ** 19
"""Gaussian samples behind a fit: enough to pin the levels to a few 1e-3 (0.1 s)."""


def fit_normal_levels(bits: int, block_size: int, num_values: int = FIT_VALUES, iterations: int = 200,
                      seed: int = 0) -> list[float]:
    """Lloyd's algorithm on Gaussian blocks of ``block_size`` divided by their absmax: the
    non-negative half of the symmetric levels, the largest fixed at 1 ([Note: normal levels]).
    Deterministic (fixed seed, fp64 on CPU), so every rank computes the same levels."""
    generator = torch.Generator().manual_seed(seed)
    num_blocks = max(num_values // block_size, 16)
    samples = torch.randn(num_blocks, block_size, generator=generator, dtype=torch.float64)
    units, _ = (samples / samples.abs().amax(1, keepdim=True)).flatten().abs().sort()
    num_half = 2 ** (bits - 1)
    levels = torch.linspace(0, 1, num_half + 1, dtype=torch.float64)[1:]
    for _ in range(iterations):  # on |x| with symmetric levels: cells between midpoints, first from 0
        edges = torch.cat((torch.zeros(1, dtype=torch.float64), (levels[1:] + levels[:-1]) / 2,
                           torch.ones(1, dtype=torch.float64)))
        bounds = torch.searchsorted(units, edges)
        sums = torch.cat((torch.zeros(1, dtype=torch.float64), units.cumsum(0)))
        counts = (bounds[1:] - bounds[:-1]).clamp(min=1)
        levels = (sums[bounds[1:]] - sums[bounds[:-1]]) / counts
        levels[-1] = 1.0
    return levels.tolist()
