"""zeropp.optimizer_in_backward: the step inside backward, and gathers started ahead, give the
bits of an ordinary loop."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zeropp
from distributed import run_distributed
from models import global_batch, make_model, rows
from zeropp.fsdp.after_step import gather_after_step

TWO_BY_TWO = {"ZEROPP_RANKS_PER_NODE": "2"}
NUM_STEPS = 3
EDITED_STEP = 1
"""Before this step's forward every run scales its weights in place: a gather started ahead of it
holds the old weights and must not be used."""


def _train(rank: int, world_size: int, options: dict, in_backward: bool, gather_ahead: bool) -> dict:
    counts = _count_gathers_ahead()
    model = make_model("gpt")
    zeropp.shard(model, zeropp.ZeroPPConfig(**options))
    zeropp.comm_ledger().reset()
    if in_backward:
        steps = zeropp.optimizer_in_backward(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1,
                                             gather_ahead=gather_ahead)
    else:  # the loop without zeropp's gathers after the step ([Note: gathers after the step]): the baseline
        gather_after_step(model, None)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses, ahead_bytes = [], []
    for step in range(NUM_STEPS):
        if step == EDITED_STEP:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.5)
        x, y = (rows(t, rank, world_size) for t in global_batch(step, 8))
        _, loss = model(x, y)
        loss.backward()
        if in_backward:
            ahead_bytes.append(steps.ahead_bytes)
            assert all(p.grad is None for p in model.parameters())
        else:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    if in_backward:  # one state per unit, each AdamW's own, and it loads back
        state = steps.state_dict()
        assert len(state) == 3 and all(len(one["state"]) > 0 for one in state)
        steps.load_state_dict(state)
        try:
            steps.load_state_dict(state[:2])
            raise AssertionError("a state for 2 of 3 units was accepted")
        except ValueError as error:
            assert "2 optimizers' states; this model steps 3" in str(error)
        steps.close()  # the last step's gathers dropped, nothing stepped in backward any more
        assert steps.ahead_bytes == 0
        assert all(rs.after_reduce is None for rs in zeropp.sharded_comms(model).reduce_scatters)
    params = {name: p.full_tensor() for name, p in model.named_parameters()}
    ledger = zeropp.comm_ledger()
    return {"losses": losses, "params": params, "ledger": ledger.summary()["total"],
            "started_in_forward": _started_in_forward(ledger), "counts": counts, "ahead_bytes": ahead_bytes}


def _started_in_forward(ledger: zeropp.CommLedger) -> dict[str, int]:
    """The ledger's counts of forward gathers over the world or across nodes."""
    totals = [ledger.summary(phase="forward", kind=kind)["total"] for kind in ("world", "inter")]
    return {k: sum(t[k] for t in totals) for k in totals[0]}


def _count_gathers_ahead() -> dict[str, int]:
    """Counts of gathers started ahead that a forward took or that were dropped, from now on."""
    from zeropp.fsdp.comms import GatherAhead

    counts = {"taken": 0, "dropped": 0}
    take, drop = getattr(GatherAhead, "_original", (GatherAhead._take_ahead, GatherAhead.drop_ahead))

    def counting_take(self, *args):  # noqa: ANN001, ANN202
        started = take(self, *args)
        counts["taken"] += started is not None
        return started

    def counting_drop(self):  # noqa: ANN001, ANN202
        counts["dropped"] += self._ahead is not None
        drop(self)

    GatherAhead._original = (take, drop)
    GatherAhead._take_ahead, GatherAhead.drop_ahead = counting_take, counting_drop
    return counts


def _compare(rank: int, world_size: int, options: dict) -> dict:
    runs = {key: _train(rank, world_size, options, *key) for key in ((False, False), (True, False), (True, True))}
    plain = runs[(False, False)]
    return {
        "params_equal": {str(key): all(torch.equal(plain["params"][n], run["params"][n]) for n in plain["params"])
                         for key, run in runs.items()},
        "losses": {str(key): run["losses"] for key, run in runs.items()},
        "ledgers": {str(key): run["ledger"] for key, run in runs.items()},
        "started_in_forward": plain["started_in_forward"],
        "counts": runs[(True, True)]["counts"], "ahead_bytes": runs[(True, True)]["ahead_bytes"],
        "no_ahead_counts": runs[(True, False)]["counts"],
    }


@pytest.mark.parametrize("options", [
    {"quantized_weights": True, "quantized_gradients": True, "hpz_partition_size": 2, "overlap": True},
    pytest.param({}, marks=pytest.mark.slow),
    pytest.param({"quantized_weights": True, "quantized_gradients": True, "hpz_partition_size": 2,
                  "hierarchical_gather": True}, marks=pytest.mark.slow),
    pytest.param({"quantized_weights": True, "quantized_gradients": True, "overlap": True,
                  "param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}, marks=pytest.mark.slow),
])
def test_step_in_backward_trains_bit_identically(options: dict) -> None:
    """AdamW stepped per unit in backward, with and without the next forward's gathers started
    ahead, gives the parameters, losses and ledger of ``optimizer.step()`` after backward, bit for
    bit; gathers started ahead are taken by the next forward, except after an in-place edit of
    the weights, where every one is dropped and the forward gathers the edited weights."""
    results = run_distributed(_compare, 4, dict(options), env=TWO_BY_TWO)
    num_units = 3  # two blocks and the root
    for r in results:
        assert all(r["params_equal"].values()), r["params_equal"]
        losses = list(r["losses"].values())
        assert losses[0] == losses[1] == losses[2]
        # the same bytes, but for the gathers started ahead that no forward took (those dropped at
        # the edit and the last step's): two forwards' worth of what a gather sends first (the
        # ring, or the two-hop gather's hop across nodes; its hop inside the node runs on use)
        plain, no_ahead, ahead = r["ledgers"].values()
        assert no_ahead == plain
        assert ahead == {k: plain[k] + 2 * r["started_in_forward"][k] // NUM_STEPS for k in plain}
        # steps 0 and 1 start a gather per unit; step 1's forward drops them (edited weights),
        # step 2's takes them; step 2's own are dropped by close()
        assert r["counts"] == {"taken": num_units, "dropped": 2 * num_units}
        assert r["no_ahead_counts"] == {"taken": 0, "dropped": 0}
        assert all(held > 0 for held in r["ahead_bytes"])


def test_a_model_zeropp_did_not_shard_is_refused() -> None:
    with pytest.raises(ValueError, match="needs a model sharded by zeropp"):
        zeropp.optimizer_in_backward(nn.Linear(4, 4), torch.optim.AdamW, lr=1e-3)


class _WithScalar(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.temperature = nn.Parameter(torch.tensor(1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x / self.temperature


def _refuse_a_parameter_outside_the_units(rank: int, world_size: int) -> dict:
    model = _WithScalar()
    zeropp.shard(model, zeropp.ZeroPPConfig(quantized_weights=True))
    message = "no error"
    try:
        zeropp.optimizer_in_backward(model, torch.optim.AdamW, lr=1e-3)
    except ValueError as error:
        message = str(error)
    hooked = [rs.after_reduce is not None for rs in zeropp.sharded_comms(model).reduce_scatters]
    return {"message": message, "hooked": hooked}


def test_a_parameter_no_unit_holds_is_refused() -> None:
    """A 0-dim parameter stays outside FSDP2: no unit's step would update it, so the call is
    refused, naming it, and installs nothing."""
    for r in run_distributed(_refuse_a_parameter_outside_the_units, 2):
        assert "['temperature']" in r["message"] and "stepped after backward" in r["message"]
        assert not any(r["hooked"])
