"""The bound the multi-rank tests hold a quantized gradient reduction to, from the exact values."""

from __future__ import annotations

import math

import torch

BLOCK_SIZE, QMAX_INT4 = 256, 7
"""zeropp's default block of 256 elements, and INT4's largest level."""


def half_steps(contribution: torch.Tensor, qmax: int = QMAX_INT4, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """Half the quantization step of every element of one parameter's shard, in its shape: blocks
    of ``block_size`` from the start of the shard (its segment of the unit's chunk), step = the
    block's absmax / ``qmax``."""
    flat = contribution.reshape(-1).float()
    blocks = torch.nn.functional.pad(flat, (0, -flat.numel() % block_size)).view(-1, block_size)
    return (blocks.abs().amax(1) / qmax / 2).repeat_interleave(block_size)[:flat.numel()].view_as(contribution)


def shard_half_steps(tensor: torch.Tensor, world_size: int, qmax: int) -> torch.Tensor:
    """Half a quantization step of every element of a whole parameter coded shard by shard, as
    zeropp's codes code each rank's slice: blocks of 256 from the start of each rank's FSDP2 shard
    (dim-0 chunks of ceil(rows / world)), step = the block's absmax / ``qmax``."""
    rows = math.ceil(tensor.shape[0] / world_size)
    return torch.cat([half_steps(chunk, qmax) for chunk in tensor.split(rows)])


def excess(quantized: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor, magnitude: torch.Tensor) -> float:
    """The most any element of ``quantized`` lies beyond ``bound`` of ``exact`` (<= 0: within), the
    bound widened by fp32's rounding of the sums: 1e-6 of itself and of ``magnitude`` (the size of
    what was summed)."""
    slack = bound * (1 + 1e-6) + 1e-6 * magnitude + 1e-30
    return ((quantized - exact).abs() - slack).max().item()


def contributions_excess(quantized: dict[str, torch.Tensor], exact: dict[str, torch.Tensor],
                         contributions: list[dict[str, torch.Tensor]], hops: int) -> dict[str, float]:
    """``excess`` of every parameter, its bound ``hops`` times the sum of each rank's contribution's
    INT4 half steps (each contribution coded once a hop: a row, then inside its node's partial,
    whose step is at most the sum of its rows' steps)."""
    return {name: excess(quantized[name], value, hops * sum(half_steps(part[name]) for part in contributions),
                         sum(part[name].abs() for part in contributions))
            for name, value in exact.items()}
