"""zeropp beside torchao's float8 training with its float8 all-gather (``Float8LinearConfig(
enable_fsdp_float8_all_gather=True)``), on 2 nodes x 2 gloo ranks (CPU: torch's float8 matmul runs
there), against FSDP2 with the same float8 model and no zeropp.

Every linear layer is torchao's ``Float8Linear``, whose weights gather themselves as float8
([Note: weights that gather themselves] in ``zeropp.fsdp.access``): zeropp's ZeRO-3 path is
FSDP2's bit for bit; qwZ leaves those gathers to torchao and hpZ keeps the forward's float8 bytes
on the node, so all three techniques train exactly as qgZ alone; qgZ reduces the gradients within
its bound.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zeropp
from bounds import excess as bound_excess
from bounds import half_steps
from distributed import run_distributed

pytest.importorskip("torchao.float8", reason="torchao (the test extra) runs float8 training")

TWO_BY_TWO = {"ZEROPP_RANKS_PER_NODE": "2"}
WIDTH, STEPS = 64, 3
"""Narrow: torch's float8 matmul on CPU takes 1.6 s a step at width 256, 0.07 s at 64."""
ALL = zeropp.ZeroPPConfig(quantized_weights=True, hpz_partition_size=2, quantized_gradients=True)
QGZ = zeropp.ZeroPPConfig(quantized_gradients=True)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc, self.proj = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(torch.relu(self.fc(self.norm(x))))


def _model(config: zeropp.ZeroPPConfig | None) -> nn.Module:
    """Two blocks and a head (a LayerNorm and a float8 linear layer, in the root unit), every
    linear layer torchao's float8 with its float8 all-gather, sharded by FSDP2 (and zeropp)."""
    from torch.distributed.fsdp import fully_shard
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block(), nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 16))
    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    for block in model[:2]:
        fully_shard(block)
    fully_shard(model)
    return model if config is None else zeropp.enable(model, config)


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(100 * step + rank))


def _loss(model: nn.Module, rank: int, step: int, weight: float = 1.0) -> torch.Tensor:
    return model(_batch(rank, step)).square().mean() * weight


def _train(config: zeropp.ZeroPPConfig | None, rank: int, world_size: int) -> dict:
    """The first step's gradient shards and ledger; each rank's own contribution to them (its
    loss alone, the others' weighed 0.0); the losses and shards after ``STEPS`` AdamW steps."""
    model = _model(config)
    contributions = []
    for part in range(world_size if config is None else 0):
        _loss(model, rank, 0, float(part == rank)).backward()
        contributions.append([p.grad.to_local().clone() for p in model.parameters()])
        model.zero_grad(set_to_none=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    explained = zeropp.explain(model) if config is not None else None
    losses, grads, ledger = [], None, None
    for step in range(STEPS):
        zeropp.comm_ledger().reset()
        loss = _loss(model, rank, step)
        loss.backward()
        if grads is None:
            grads = [p.grad.to_local().clone() for p in model.parameters()]
            ledger = zeropp.comm_ledger().summary()["by_technique"]
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads, "contributions": contributions, "ledger": ledger,
            "shards": [p.to_local().detach().clone() for p in model.parameters()],
            "self_gathered": type(model[0].fc.weight.to_local()).__name__,
            "explained": None if explained is None else explained.by_technique(),
            "table": None if explained is None else str(explained)}


def _worker(rank: int, world_size: int) -> dict:
    reference, zero3, qgz, every = (_train(config, rank, world_size) for config in (None, zeropp.ZeroPPConfig(),
                                                                                     QGZ, ALL))
    excess = []
    for i, exact in enumerate(reference["grads"]):
        # each rank's contribution coded at most twice: as a row (INT8 inside the node) and in its
        # node's partial (INT4 across): within twice the sum of their INT4 half steps
        parts = [part[i] for part in reference["contributions"]]
        excess.append(bound_excess(qgz["grads"][i], exact, 2 * sum(half_steps(part) for part in parts),
                                   sum(p.abs() for p in parts)))
    return {
        "zero3_equal": zero3["losses"] == reference["losses"] and _equal(zero3, reference),
        "all_is_qgz": every["losses"] == qgz["losses"] and _equal(every, qgz),
        "qgz_excess": max(excess),
        "qgz_error": max((a - b).abs().max().item() for a, b in zip(qgz["grads"], reference["grads"])),
        "losses": {"reference": reference["losses"], "qgz": qgz["losses"]},
        "ledger": every["ledger"], "explained": every["explained"], "table": every["table"],
        "self_gathered": reference["self_gathered"],
    }


def _equal(run: dict, other: dict) -> bool:
    return all(torch.equal(a, b) for a, b in zip(run["grads"] + run["shards"], other["grads"] + other["shards"]))


@pytest.fixture(scope="module")
def float8() -> list[dict]:
    return run_distributed(_worker, 4, env=TWO_BY_TWO, timeout=300)


def test_zero3_path_is_fsdp2_with_torchaos_float8_bit_for_bit(float8: list[dict]) -> None:
    for rank in float8:
        assert rank["self_gathered"] == "WeightWithDynamicFloat8CastTensor"
        assert rank["zero3_equal"]


def test_qwz_leaves_float8_gathers_to_torchao_and_hpz_keeps_them_in_the_node(float8: list[dict]) -> None:
    """All three train exactly as qgZ alone: every unit's weights gather themselves as float8 (no
    qwZ), and hpZ's copy of a block is the forward's float8 bytes, bit for bit. The plan says so,
    and its bytes are the ledger's: forward's float8 gathers across the nodes, backward's inside."""
    for rank in float8:
        assert rank["all_is_qgz"]
        ledger = {technique: totals["bytes"] for technique, totals in rank["ledger"].items()}
        explained = {technique: totals["bytes"] for technique, totals in rank["explained"].items()}
        assert explained == ledger and "qwZ" not in ledger
        assert rank["ledger"]["hpZ"]["cross_node_bytes"] == 0 < rank["ledger"]["hpZ"]["bytes"]
        assert "gather themselves through FSDP2's extension" in rank["table"], rank["table"]
        assert "| fsdp | uint8 |" in rank["table"] and "| node copy |" in rank["table"]
        # a block's forward gather: its float8 weights (1 byte) and fp32 LayerNorm and biases (4 bytes)
        block_bytes = (2 * 4 * WIDTH * WIDTH) + 4 * (2 * WIDTH + 4 * WIDTH + WIDTH)
        assert ledger["fsdp"] >= 2 * block_bytes * 3 // 4  # two blocks, 3 of 4 chunks from the other ranks


def test_qgz_reduces_float8_gradients_within_its_bound(float8: list[dict]) -> None:
    for rank in float8:
        assert rank["qgz_excess"] <= 0, rank["qgz_excess"]
        assert rank["qgz_error"] > 0, "no quantization error at all: was anything quantized?"
        assert rank["losses"]["qgz"][0] == rank["losses"]["reference"][0]
        assert rank["losses"]["qgz"][-1] != rank["losses"]["reference"][-1]
