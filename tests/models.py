"""Small models for the multi-rank tests, and the single-process reference loop they compare to."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from zeropp.tools.models import GPT, GPTConfig

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


def train_on_corpus(config, num_steps: int, rank: int, world_size: int, batch_size: int = 32,
                    seed: int = 0, lr: float = 3e-3) -> dict:
    """Shard a small GPT with ``config`` and train it on Shakespeare (same seed and data order
    for every config), returning every step's global loss and the ledger's summary."""
    import zeropp
    from zeropp.fsdp.comms import all_reduce_mean
    from zeropp.tools.data import CharCorpus

    corpus = CharCorpus.shakespeare()
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=corpus.vocab_size, context_length=32, num_layers=2, num_heads=4,
                          embed_dim=64))
    topology = zeropp.Topology.from_env()
    zeropp.shard(model, config, topology=topology)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    ledger = zeropp.comm_ledger()
    ledger.reset()
    local = slice(rank * batch_size // world_size, (rank + 1) * batch_size // world_size)
    losses = []
    for step in range(num_steps):
        x, y = corpus.batch_at("train", step, batch_size, 32, seed)
        _, loss = model(x[local], y[local])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        ledger.step()
        with ledger.suspended():
            losses.append(all_reduce_mean(loss, topology))
    summary = ledger.summary()
    with torch.no_grad(), ledger.suspended():
        val = [all_reduce_mean(model(*(t[local] for t in corpus.batch_at("val", i, 64, 32, seed)))[1], topology)
               for i in range(4)]
    return {"losses": losses, "ledger": summary, "steps": num_steps, "val_loss": sum(val) / len(val)}


class TokenRows(torch.utils.data.Dataset):
    """Learnable token rows for the Hugging Face tests: ``count`` arithmetic progressions mod
    ``vocab`` of ``length`` tokens (a random start, a stride in 1..3), as ``input_ids`` and
    ``labels`` (HF shifts them)."""

    def __init__(self, vocab: int, length: int, count: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (count, 1), generator=g)
        stride = torch.randint(1, 4, (count, 1), generator=g)
        self.rows = (start + stride * torch.arange(length)) % vocab

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def forward_weights(model: nn.Module, *inputs: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every parameter with a dimension as a forward of ``model`` on ``inputs`` sees it (in fp32),
    captured by forward pre-hooks on the leaf modules and the root; FSDP2 has gathered them then."""
    seen: dict[str, torch.Tensor] = {}
    handles = []
    for name, module in model.named_modules():
        if list(module.children()) and module is not model:
            continue

        def capture(module: nn.Module, _: object, prefix: str = name) -> None:
            for local, p in module.named_parameters(recurse=module is not model):
                if p.dim() and not isinstance(p, torch.distributed.tensor.DTensor):
                    seen.setdefault(f"{prefix}.{local}" if prefix else local, p.detach().float().clone())
        handles.append(module.register_forward_pre_hook(capture))
    try:
        model(*inputs)
    finally:
        for handle in handles:
            handle.remove()
    return seen
