"""The bound the multi-rank tests hold a quantized gradient reduction to, from the exact values."""

from __future__ import annotations

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
