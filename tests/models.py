"""Small models for the multi-rank tests, and the single-process reference loop they compare to."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from zeropp.models import GPT, GPTConfig

VOCAB = 37
CONTEXT = 12


class ResidualMLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 3 * width + 1)  # odd sizes: FSDP2 pads dim 0
        self.down = nn.Linear(3 * width + 1, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class TiedLM(nn.Module):
    """Structurally unlike the GPT: tied input/output embedding, no attention, a frozen
    parameter (a fixed feature mixing), odd widths, and a ModuleList of blocks."""

    def __init__(self, vocab: int = VOCAB, width: int = 22, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.Parameter(torch.randn(width, width) / width**0.5, requires_grad=False)
        self.layers = nn.ModuleList(ResidualMLP(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.embed(idx) @ self.mix
        for layer in self.layers:
            x = layer(x)
        logits = self.norm(x) @ self.embed.weight.t()
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def make_model(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "gpt":
        return GPT(GPTConfig(vocab_size=VOCAB, context_length=CONTEXT, num_layers=2, num_heads=2,
                             embed_dim=16))
    if kind == "tied":
        return TiedLM()
    raise ValueError(kind)


def global_batch(step: int, batch_size: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Learnable sequences (so a loss that falls means training works): arithmetic progressions
    mod VOCAB with a random start and a stride in 1..3."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    start = torch.randint(0, VOCAB, (batch_size, 1), generator=g)
    stride = torch.randint(1, 4, (batch_size, 1), generator=g)
    tokens = (start + stride * torch.arange(CONTEXT + 1)) % VOCAB
    return tokens[:, :-1], tokens[:, 1:]


def rows(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    n = t.shape[0] // world_size
    return t[rank * n:(rank + 1) * n]


def train_steps(model: nn.Module, optimizer: torch.optim.Optimizer, batch_of: Callable[[int, int], tuple],
                num_steps: int, micro_steps: int, on_step: Callable[[int, float], None]) -> None:
    """The loop every test uses: ``micro_steps`` backward passes of loss/micro_steps, one step."""
    for step in range(num_steps):
        total = 0.0
        for micro in range(micro_steps):
            x, y = batch_of(step, micro)
            _, loss = model(x, y)
            (loss / micro_steps).backward()
            total += loss.item() / micro_steps
        optimizer.step()
        optimizer.zero_grad()
        on_step(step, total)


def reference_copy(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)
