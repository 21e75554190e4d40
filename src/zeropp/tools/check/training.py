"""The small training runs of the check's multi-rank parts: a GPT on learnable sequences, one
rank's rows of each global batch, the step's loss, on any device."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import torch

from zeropp.tools.models import GPT, GPTConfig

VOCAB = 37
CONTEXT = 32
ROWS_PER_RANK = 4
"""Rows of each global batch a rank trains on."""
T = TypeVar("T")


def tiny_gpt(seed: int = 0, num_layers: int = 2, embed_dim: int = 64) -> GPT:
    """The same GPT on every rank (same seed): 2 blocks of width 64, about 0.1M parameters."""
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=VOCAB, context_length=CONTEXT, num_layers=num_layers,
                         num_heads=max(1, embed_dim // 32), embed_dim=embed_dim))


def local_batch(step: int, batch_size: int, rank: int, world_size: int,
                device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of step ``step``'s global batch: arithmetic progressions mod VOCAB with a
    random start and a stride in 1..3 (learnable, so a loss that falls means training works)."""
    generator = torch.Generator().manual_seed(step)
    start = torch.randint(0, VOCAB, (batch_size, 1), generator=generator)
    stride = torch.randint(1, 4, (batch_size, 1), generator=generator)
    tokens = ((start + stride * torch.arange(CONTEXT + 1)) % VOCAB).chunk(world_size)[rank].to(device)
    return tokens[:, :-1], tokens[:, 1:]


def synchronize(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], T], device: str) -> tuple[T, float]:
    """``fn()``'s result and its seconds, the device's queued work included."""
    synchronize(device)
    started = time.perf_counter()
    result = fn()
    synchronize(device)
    return result, time.perf_counter() - started


def optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Callable[..., float]:
    """One training step of a plain loop on a batch (x, y): its loss."""
    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = model(x, y)[1]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()
    return step


def run_steps(step: Callable[[torch.Tensor, torch.Tensor], float], rank: int, world_size: int, device: str,
              num_steps: int) -> tuple[list[float], list[float]]:
    """``step`` on this rank's rows of ``num_steps`` global batches: the losses and each step's seconds."""
    losses, times = [], []
    for index in range(num_steps):
        x, y = local_batch(index, ROWS_PER_RANK * world_size, rank, world_size, device)
        loss, seconds = timed(lambda: step(x, y), device)
        losses.append(loss)
        times.append(seconds)
    return losses, times


def median_ms(seconds: list[float]) -> float:
    """The median of ``seconds``, in milliseconds."""
    ordered = sorted(seconds)
    return ordered[len(ordered) // 2] * 1e3
