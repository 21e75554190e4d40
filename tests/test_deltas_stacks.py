"""Weight differences wherever the node copy serves: CPU offload, the optimizer on the host, the
step inside backward, generation, and the stacks (HF Trainer, the DeepSpeed-style engine,
accelerate, torchtitan), each against the bound of the last difference and never stale."""

from __future__ import annotations

import pytest
import torch

import zeropp
from distributed import run_distributed
from models import VOCAB, forward_weights, make_model
from test_deltas import TWO_BY_TWO, _batch, _excess, _masters, _refreshes
from zeropp.techniques.deltas import DIFFERENCE, WHOLE

ALL_DELTA = {"quantized_weights": True, "quantized_gradients": True, "hpz_partition_size": 2, "weight_deltas": True}
STEPS = 4


def _loop_job(rank: int, world_size: int, variant: str) -> dict:
    """``STEPS`` AdamW steps of the GPT with all three and weight differences in a plain loop as
    ``variant`` runs it; each forward's weights against the master's and the last difference."""
    options = {**ALL_DELTA, **({"offload": "cpu"} if variant == "offload" else {})}
    model = zeropp.shard(make_model("gpt"), zeropp.ZeroPPConfig(**options))
    in_backward = None
    if variant == "optimizer in backward":
        in_backward = zeropp.optimizer_in_backward(model, torch.optim.AdamW, lr=3e-3)
        optimizer = None
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        if variant == "optimizer on the host":
            optimizer = zeropp.offload_optimizer(optimizer)
    excesses, stale, losses, before = [], [], [], None
    for step in range(STEPS):
        x, y = _batch(step, rank, world_size)
        seen, masters = forward_weights(model, x, y), _masters(model)
        if before is not None:
            excesses.append(_excess(seen, masters, before, world_size, 4))
            stale.append(all(torch.equal(seen[n], before[n]) for n in masters))
        before = seen
        loss = model(x, y)[1]
        loss.backward()
        losses.append(loss.item())
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad()
    del in_backward
    return {"excesses": excesses, "stale": stale, "losses": losses, "refreshes": _refreshes(model)}


@pytest.mark.parametrize("variant", ["offload", "optimizer on the host", "optimizer in backward"])
def test_the_copy_follows_every_way_a_step_runs(variant: str) -> None:
    """Shards on the host (CPU offload), the optimizer on the host, the step inside backward: after
    every step the next forward sends the differences and sees the weights within their bound,
    never the last step's weights."""
    for result in run_distributed(_loop_job, 4, variant, env=TWO_BY_TWO):
        assert max(result["excesses"]) <= 0, result["excesses"]
        assert not any(result["stale"])
        for counts in result["refreshes"]:
            assert counts[WHOLE] == 1 and counts[DIFFERENCE] == STEPS - 1, counts


def _generation_job(rank: int, world_size: int) -> dict:
    model = zeropp.shard(make_model("gpt"), zeropp.ZeroPPConfig(**ALL_DELTA))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x, y = _batch(0, rank, world_size)
    model(x, y)[1].backward()
    optimizer.step()
    optimizer.zero_grad()
    prompt = torch.randint(0, VOCAB, (2, 4), generator=torch.Generator().manual_seed(rank))
    ledger = zeropp.comm_ledger()
    with torch.no_grad():
        model(prompt)  # the step's differences
        ledger.reset()
        with zeropp.generation_mode(model):
            tokens = model.generate(prompt, 6, temperature=0)
        inside = ledger.summary(op="all_gather")["total"]
        plain = model.generate(prompt, 6, temperature=0)
    try:
        with zeropp.generation_mode(model, copy="full"):
            pass
        refused = ""
    except ValueError as error:
        refused = str(error)
    return {"same": torch.equal(tokens, plain), "cross_node": inside["cross_node_bytes"], "calls": inside["calls"],
            "refused": refused}


def test_generation_gathers_inside_the_node_until_the_next_step() -> None:
    """After a step's differences, every forward of generation gathers from the node copy: no
    byte crosses nodes, the tokens those of the same weights without ``generation_mode``."""
    for result in run_distributed(_generation_job, 4, env=TWO_BY_TWO):
        assert result["same"] and result["calls"] > 0 and result["cross_node"] == 0
        assert "copy='node'" in result["refused"]
