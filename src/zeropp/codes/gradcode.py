"""Lower-error codes for qgZ's gradient blocks, at the same bytes as the block code of ``quant``.

qgZ sends every gradient element in 4 bits (ZeRO++ §3.3). Three options change how a block is
coded without changing its size on the wire (codes plus one fp32 scale per block):

- ``rotation="hadamard"``: multiply each whole block by a randomized Hadamard matrix before
  coding and by its transpose after decoding ([Note: block rotation]).
- ``rounding="stochastic"``: round up or down at random, with the probability that makes the
  code unbiased ([Note: stochastic rounding]).
- ``levels="normal"``: 2- and 4-bit codes whose levels are fitted to a Gaussian block scaled by
  its absmax, instead of evenly spaced ([Note: normal levels]).
- ``scale_bits=8``: each block's scale travels as an 8-bit code relative to one fp32 scale per
  group of ``SCALE_GROUP`` blocks ([Note: grouped scales]), so blocks of 64 cost about the
  bytes per element that blocks of 256 cost with fp32 scales.

The packed layout is ``quant``'s: the same fields, the same fp32 scale per block (for normal
levels the scale is the block's absmax itself), or with ``scale_bits=8`` per group of blocks
the fp32 scale and then one byte per block. Pure tensor math, no torch.distributed. [Note:
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
all-zero block has absmax 0 and decodes to zeros. [Note: grouped scales] Smaller blocks
lower the error (a block of 64 Gaussian values has a smaller absmax than one of 256) but an
fp32 scale per 64 elements adds 0.5 bits per element. With ``scale_bits=8`` a group of
``SCALE_GROUP`` = 16 blocks keeps one fp32 scale, the largest of its blocks' scales ``top``,
and each block ``j`` a byte ``k_j``: its scale decodes as ``s'_j = top * 2**(-k_j /
SCALE_STEPS)`` (k_j <= 254, from a fixed fp32 table, so every rank decodes the same scales;
255 is a scale of 0). The first choice is the level at or just above the block's own scale
``s_j``: nothing clips, and ``s'_j < s_j * 2**(1 / SCALE_STEPS)`` while ``s_j >= top *
2**(-254 / SCALE_STEPS)`` (below it ``s'_j`` is that floor). Rounding to nearest then tries up
to ``SCALE_SEARCH - 1`` levels below it and keeps the one whose coding has the least squared
error on the block (MSE-optimal clipping, as weight quantizers grid-search their clipping
ratio), but only levels at which clipping stays within half a level gap: with outer level
``L``, ``L * (s_j - s'_j) <= s'_j * gap / 2``, and only in whole blocks. In a parameter's short
tail (a LayerNorm's 8-element slice at 384 ranks) the largest value carries most of the block,
clipping it biases the block's largest gradient towards zero on every rank alike, and the
bias adds up in the sum where the errors elsewhere average out: with every block searched the
demo GPT's gradients at 48 x 8 came out at 1.80x plain INT4/INT4's error, with whole blocks
only 0.88x. In every case an element's error is at most half the largest gap times ``s'_j`` (a
whole gap for stochastic rounding, which does not search: clipping would bias it), and
``s'_j`` is at most one step above ``s_j`` or the floor.
A non-finite value makes ``top`` NaN and its whole group decode to NaN (overflow stays
visible). At 4 bits, blocks of 64 and groups of 16: 4 + (32 + 16 * 8) / 1024 = 4.156 bits
per element, against 4.125 for blocks of 256 with fp32 scales (+0.8%). llama.cpp's k-quants
use the same two levels (6-bit block scales under an fp16 one per 256 elements).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from zeropp.codes import quant

ROTATIONS = ("none", "hadamard")
ROUNDINGS = ("nearest", "stochastic")
LEVELS = ("uniform", "normal")

NORMAL_LEVEL_BITS = (2, 4)
"""Widths with normal levels; 8-bit hops keep the evenly spaced code (256 levels leave little to gain)."""

SCALE_BITS = (32, 8)
"""Bits of a block's scale on the wire: its own fp32, or an 8-bit code ([Note: grouped scales])."""

SCALE_GROUP = 16
"""Blocks sharing one fp32 scale with ``scale_bits=8``."""

SCALE_STEPS = 32
"""8-bit scale levels per octave below the group's scale: a decoded scale is at most 2.2%
above the block's own, and scales down to 2**-7.97 (1/250) of the group's keep that precision."""

SCALE_SEARCH = 4
"""Scale codes tried per block when rounding to nearest: the one at or above its scale and up to
three below it, as far as clipping stays within half a level gap ([Note: grouped scales])."""

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
    scale_bits: int = 32
    """8: block scales as 8-bit codes under one fp32 scale per ``SCALE_GROUP`` blocks
    ([Note: grouped scales])."""

    def __post_init__(self) -> None:
        for name, allowed in (("rotation", ROTATIONS), ("rounding", ROUNDINGS), ("levels", LEVELS),
                              ("scale_bits", SCALE_BITS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} is not allowed; "
                                 f"allowed: {', '.join(map(str, allowed))}")

    @property
    def grouped_scales(self) -> bool:
        """Whether block scales travel as 8-bit codes under a group's fp32 scale."""
        return self.scale_bits == 8

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
    """A new fp32 tensor: each row of ``blocks`` (num_blocks, B) rotated (``x @ R``, or rotated
    back: ``x @ R.T``, R of ``_rotation``) where ``whole`` (num_blocks,) is True, copied unchanged
    where it is False. Computed as the fast Walsh-Hadamard transform, B log B additions per
    row, elementwise: each row's result is the same bits whatever rows it is coded with (a matrix
    product's rounding depends on how many rows the library blocks together, so a slice of a
    chunk would not code as the whole chunk does, [Note: qgZ slices])."""
    block_size = blocks.shape[1]
    signs = _signs(block_size, str(blocks.device))
    x = blocks.float() * signs if not inverse else blocks.float()
    half = 1
    while half < block_size:  # Sylvester's H: [[H, H], [H, -H]] at every doubling
        pairs = x.view(len(x), block_size // (2 * half), 2, half)
        x = torch.stack((pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]), dim=2)
        half *= 2
    x = x.view(len(blocks), block_size).mul_(1 / math.sqrt(block_size))
    rotated = x.mul_(signs) if inverse else x
    return rotated if whole is None else torch.where(whole[:, None], rotated, blocks)


@functools.cache
def _signs(block_size: int, device: str) -> Tensor:
    """The random signs of ``_rotation``'s diagonal, fp32."""
    return _rotation(block_size, device)[:, 0].sign()


def block_scales(blocks: Tensor, bits: int, code: GradientCode) -> Tensor:
    """Scale per block row: ``quant``'s absmax / qmax, or the absmax itself for normal levels."""
    if code.table(bits, blocks.shape[1], blocks.device) is None:
        return quant._block_scales(blocks, bits)
    return quant._block_scales(blocks, 2)  # qmax = 1 at 2 bits: the absmax, with quant's special cases


@functools.cache
def _scale_levels(device: str) -> Tensor:
    """The 256 decoded 8-bit scale codes, as fractions of the group's scale: 2**(-k / SCALE_STEPS)
    for k < 255 (computed in fp64, rounded once to fp32), and 0 for 255."""
    steps = torch.arange(255, dtype=torch.float64)
    return torch.cat((torch.exp2(-steps / SCALE_STEPS), torch.zeros(1, dtype=torch.float64))).float().to(device)


def group_scales(scales: Tensor) -> tuple[Tensor, Tensor]:
    """The wire form of block scales (num_groups, SCALE_GROUP): each group's fp32 scale (its
    largest block scale; NaN if any is) and each block's uint8 code, whose decoded scale is at
    or above the block's own ([Note: grouped scales])."""
    top = scales.amax(dim=1)  # NaN if any block is non-finite
    levels = _scale_levels(str(scales.device))
    steps = (scales / top[:, None]).log2_().mul_(-SCALE_STEPS).nan_to_num_(0.0, 254.0, 0.0)
    codes = steps.floor_().clamp_(0, 254).long()  # fp32 logs can miss by a level either way: settle
    codes = torch.where((codes < 254) & (top[:, None] * levels[codes + 1] >= scales), codes + 1, codes)
    for _ in range(2):
        codes = torch.where(top[:, None] * levels[codes] < scales, (codes - 1).clamp_(min=0), codes)
    codes = torch.where(top[:, None] * levels[codes] < scales, 0, codes)  # underflow: the group's scale
    codes = torch.where(scales == 0, 255, codes)
    return top, codes.to(torch.uint8)


def decode_group_scales(top: Tensor, codes: Tensor) -> Tensor:
    """Block scales (num_groups, SCALE_GROUP) from the groups' fp32 scales and the blocks' codes."""
    return top[:, None] * _scale_levels(str(codes.device))[codes.long()]


def grouped_block_code(blocks: Tensor, bits: int, code: GradientCode, generator: torch.Generator | None,
                       whole: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """The code of (num_blocks, B) fp32 blocks with 8-bit scales, num_blocks a multiple of
    ``SCALE_GROUP``: the groups' fp32 scales (num_groups,), the blocks' uint8 scale codes
    (num_groups, SCALE_GROUP) and the integer-valued element codes (num_blocks, B). Rounding to
    nearest takes, per whole block (``whole`` (num_blocks,) True, or None for all), the scale of
    least squared error among the searched ones ([Note: grouped scales])."""
    scales = block_scales(blocks, bits, code)
    top, scale_codes = group_scales(scales.view(-1, SCALE_GROUP))
    decoded = decode_group_scales(top, scale_codes).view(-1)
    codes = block_codes(blocks, decoded, bits, code, generator)
    reach, num_steps = scale_search(bits, blocks.shape[1], code)
    if num_steps == 1:
        return top, scale_codes, codes
    error = _squared_error(codes, decoded, blocks, bits, code)
    first = flat_codes = scale_codes.view(-1)
    for step in range(1, num_steps):
        candidate = torch.where(first < 255, (first.long() + step).clamp_(max=254), 255)
        candidate_scales = decode_group_scales(top, candidate.view(-1, SCALE_GROUP)).view(-1)
        candidate_codes = block_codes(blocks, candidate_scales, bits, code, None)
        candidate_error = _squared_error(candidate_codes, candidate_scales, blocks, bits, code)
        better = (candidate_error < error) & (candidate_scales * reach >= scales)
        if whole is not None:
            better &= whole
        error = torch.where(better, candidate_error, error)
        codes = torch.where(better[:, None], candidate_codes, codes)
        flat_codes = torch.where(better, candidate.to(torch.uint8), flat_codes)
    return top, flat_codes.view(-1, SCALE_GROUP), codes


def scale_search(bits: int, block_size: int, code: GradientCode) -> tuple[float, int]:
    """The grouped scales' search ([Note: grouped scales]): the largest ratio of a block's own
    scale to a searched one at which clipping stays within half a level gap, and how many scale
    codes a whole block tries (1: no search, as for stochastic rounding)."""
    outer = 1.0 if code.table(bits, block_size, torch.device("cpu")) is not None else 2 ** (bits - 1) - 1
    reach = 1 + max_level_gap(bits, block_size, code) / (2 * outer)
    num_steps = min(SCALE_SEARCH, 1 + int(math.log2(reach) * SCALE_STEPS))
    return reach, num_steps if code.rounding == "nearest" else 1


def _squared_error(codes: Tensor, scales: Tensor, blocks: Tensor, bits: int, code: GradientCode) -> Tensor:
    """Per block, the squared L2 error of coding ``blocks`` as ``codes`` with ``scales``: fp32
    squares summed in fp64, exact and so the same in any order (the C kernels add them one by
    one, torch in vector lanes) unless a block's squares span more than 2**23 in magnitude."""
    return (block_values(codes.clone(), scales, bits, code) - blocks).pow_(2).sum(dim=1, dtype=torch.float64)


def block_codes(blocks: Tensor, scales: Tensor, bits: int, code: GradientCode,
                generator: torch.Generator | None) -> Tensor:
    """Integer-valued fp32 codes in [-2**(bits-1), 2**(bits-1) - 1] (field minus the offset)
    of ``blocks`` (num_blocks, B) with ``scales`` (num_blocks,); zero for zero and non-finite blocks."""
    divisors = torch.where(scales > 0, scales, torch.inf)[:, None]
    units = (blocks / divisors).nan_to_num_(0.0)  # in units of the scale
    table = code.table(bits, blocks.shape[1], blocks.device)
    if table is None:
        qmax = 2 ** (bits - 1) - 1
        if code.rounding == "nearest":  # clamped: a searched scale ([Note: grouped scales]) may clip
            return units.round_().clamp_(-qmax, qmax)
        return units.add_(_uniform(units, generator)).floor_().clamp_(-qmax, qmax)
    if code.rounding == "nearest":
        fields = _nearest_fields(units, _level_midpoints(bits, blocks.shape[1]))
    else:  # lo = the last level <= units; go up with probability (units - lo) / gap
        lower = (torch.bucketize(units, table, right=True) - 1).clamp_(0, len(table) - 2)
        gap = table[lower + 1] - table[lower]
        fields = lower + (_uniform(units, generator) * gap < units - table[lower])
    return fields.float().sub_(2 ** (bits - 1))


@functools.cache
def _level_midpoints(bits: int, block_size: int) -> tuple[float, ...]:
    """The midpoints between adjacent normal levels, ascending: fp32 values as Python floats
    (kept on the host, so coding on a GPU needs no copy back)."""
    table = _level_table(bits, block_size, "cpu")
    return tuple(((table[1:] + table[:-1]) / 2).tolist())


def _nearest_fields(units: Tensor, midpoints: Sequence[float]) -> Tensor:
    """The field (uint8) of the level nearest to each finite value of ``units``, ties going
    down: how many ``midpoints`` lie strictly below it, as ``torch.bucketize(units, midpoints)``
    counts them. One comparison per midpoint is 2.2x faster than bucketize's per-element binary
    search on CPU at 16 levels (a symmetric variant with half the comparisons was slower:
    ``torch.nextafter`` and the selects cost more)."""
    fields = torch.zeros(units.shape, dtype=torch.uint8, device=units.device)
    above = torch.empty(units.shape, dtype=torch.bool, device=units.device)
    for midpoint in midpoints:  # fp32 values: the comparison with fp32 units is exact
        fields.add_(torch.gt(units, midpoint, out=above).view(torch.uint8))  # a bool is one byte, 0 or 1
    return fields


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
