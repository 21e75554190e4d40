"""Weight differences over hpZ's node copy (``ZeroPPConfig(weight_deltas=True)``), on real gloo
ranks: every node's copy the same bit for bit after every step, the forward's weights within half
a step of the last difference's code of the master weights, tighter than qwZ's INT8 gather at 8
bits, training as ZeRO-3 within that bound, every full-refresh trigger, gradient accumulation and
frozen units sending nothing, the audit's fallback, and the refusals."""

from __future__ import annotations

import pytest
import torch

import zeropp
from bounds import shard_half_steps
from distributed import run_distributed
from models import forward_weights, global_batch, make_model, rows
from zeropp.techniques.deltas import DIFFERENCE, NOTHING, WHOLE, copy_checksums, weight_deltas_of

TWO_BY_TWO = {"ZEROPP_RANKS_PER_NODE": "2"}
QMAX = {4: 7, 8: 127}


def _config(ranks_per_node: int, **options) -> zeropp.ZeroPPConfig:
    return zeropp.ZeroPPConfig(weight_deltas=True, hpz_partition_size=ranks_per_node, **options)


def _batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = global_batch(step, 2 * world_size)
    return rows(x, rank, world_size), rows(y, rank, world_size)


def _masters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.full_tensor().detach().float().clone() for name, p in model.named_parameters() if p.dim()}


def _refreshes(model: torch.nn.Module) -> list[dict[int, int]]:
    return [dict(comm.refreshes) for comm in weight_deltas_of(model).comms]


def _excess(seen: dict[str, torch.Tensor], masters: dict[str, torch.Tensor], before: dict[str, torch.Tensor],
            world_size: int, bits: int) -> float:
    """How far beyond its bound the forward's weights lie from the master weights (<= 0: within):
    half a step of the difference's code (master - the copy before the step, coded shard by
    shard in blocks of 256), plus fp32's rounding of the sums."""
    worst = -float("inf")
    for name, master in masters.items():
        bound = shard_half_steps(master - before[name], world_size, QMAX[bits]) + 2.0 ** -21 * master.abs()
        worst = max(worst, ((seen[name] - master).abs() - bound).max().item())
    return worst


def _closed_loop_job(rank: int, world_size: int, ranks_per_node: int, bits: int, steps: int) -> dict:
    """Train with weight differences; after every step the copies' checksums, and the forward's
    weights against the master weights and the bound of the difference that brought them."""
    model = zeropp.shard(make_model("gpt"), _config(ranks_per_node, delta_bits=bits))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    checksums, excesses, errors, first_exact = [], [], [], None
    before = None
    for step in range(steps):
        x, y = _batch(step, rank, world_size)
        seen = forward_weights(model, x, y)
        masters = _masters(model)
        if before is None:
            first_exact = all(torch.equal(seen[n], masters[n]) for n in masters)
        else:
            excesses.append(_excess(seen, masters, before, world_size, bits))
            errors.append(max((seen[n] - masters[n]).abs().max().item() for n in masters))
        before = seen
        model(x, y)[1].backward()
        optimizer.step()
        optimizer.zero_grad()
        checksums.append(copy_checksums(model))
    return {"checksums": checksums, "excesses": excesses, "errors": errors, "first_exact": first_exact,
            "refreshes": _refreshes(model)}


@pytest.mark.parametrize("num_nodes,ranks_per_node", [(2, 2), (3, 2)], ids=["2x2", "3x2"])
def test_every_nodes_copy_is_the_same_and_within_the_last_difference(num_nodes: int, ranks_per_node: int) -> None:
    """8 AdamW steps at 4 bits: after each, the ranks of one local index on every node hold the
    same rows (checksums); each forward after a step sees every weight within half a step of its
    difference's code of the master; the first forward's weights are the master's exactly (a
    full refresh), every later one a difference."""
    steps, world = 8, num_nodes * ranks_per_node
    results = run_distributed(_closed_loop_job, world, ranks_per_node, 4, steps,
                              env={"ZEROPP_RANKS_PER_NODE": str(ranks_per_node)})
    for step in range(steps):
        for rank, result in enumerate(results):
            peer = results[rank % ranks_per_node]  # the same local index on node 0
            assert result["checksums"][step] == peer["checksums"][step], (step, rank)
        assert len({tuple(r["checksums"][step]) for r in results}) == ranks_per_node  # the rows differ by index
    for result in results:
        assert result["first_exact"]
        assert max(result["excesses"]) <= 0, result["excesses"]
        # each step's first forward refreshes, its second (the training forward) finds nothing to do
        assert result["refreshes"] == [{NOTHING: steps, DIFFERENCE: steps - 1, WHOLE: 1}] * len(result["refreshes"])
        assert max(result["errors"]) > 0  # the differences are coded, not sent whole


def _eight_bits_job(rank: int, world_size: int) -> dict:
    """The same weights, after 3 steps of the weight-differences model: the error of its 8-bit
    copy, and of qwZ's INT8 gather of them (a second model loaded with them)."""
    result = _closed_loop_job(rank, world_size, 2, 8, 4)
    model = zeropp.shard(make_model("gpt"), _config(2, delta_bits=8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(4):
        x, y = _batch(step, rank, world_size)
        model(x, y)[1].backward()
        optimizer.step()
        optimizer.zero_grad()
    x, y = _batch(4, rank, world_size)
    masters = _masters(model)
    copy = forward_weights(model, x, y)
    qwz = zeropp.shard(make_model("gpt"), zeropp.ZeroPPConfig(quantized_weights=True))
    qwz.load_state_dict(model.state_dict())
    gathered = forward_weights(qwz, x, y)
    norm = lambda seen: sum((seen[n] - masters[n]).square().sum() for n in masters).sqrt().item()  # noqa: E731
    return {"copy": norm(copy), "qwz": norm(gathered), "excess": max(result["excesses"])}


def test_eight_bit_differences_are_tighter_than_qwzs_int8_gather() -> None:
    """On the same weights, the copy refreshed by 8-bit differences lies far closer to the master
    weights than qwZ's INT8 gather of them (a difference is about the learning rate, a weight
    its block's maximum); measured ratio in the test's output."""
    result = run_distributed(_eight_bits_job, 4, env=TWO_BY_TWO)[0]
    print(f"L2 error: 8-bit differences {result['copy']:.3e}, qwZ INT8 {result['qwz']:.3e}")
    assert result["excess"] <= 0
    assert 0 < result["copy"] < result["qwz"] / 4, result


def _did(model: torch.nn.Module, action: object) -> set[str]:
    """What the units' gathers did to their rows while ``action()`` ran."""
    before = _refreshes(model)
    action()
    names = {NOTHING: "nothing", DIFFERENCE: "difference", WHOLE: "whole"}
    done = set()
    for old, new in zip(before, _refreshes(model)):
        done |= {names[kind] for kind in new if new[kind] > old[kind]}
    return done or {"no gather"}


def _triggers_job(rank: int, world_size: int, out: str) -> dict:
    """Each event that can change the weights outside an optimizer step, and what the next
    forward does: a full refresh, after which the forward's weights are the master's exactly."""
    from zeropp import checkpoint

    model = zeropp.shard(make_model("gpt"), _config(2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x, y = _batch(0, rank, world_size)

    def train_step() -> None:
        model(x, y)[1].backward()
        optimizer.step()
        optimizer.zero_grad()

    def exact_forward() -> bool:
        seen, masters = forward_weights(model, x, y), _masters(model)
        return all(torch.equal(seen[n], masters[n]) for n in masters)

    result = {"first step": _did(model, train_step), "after a step": _did(model, train_step)}
    exact = {}
    model.load_state_dict(model.state_dict())
    result["load_state_dict"] = _did(model, lambda: exact.setdefault("load_state_dict", exact_forward()))
    checkpoint.save(out, "saved", model=model, optimizer=optimizer)
    train_step()
    checkpoint.load(out, "saved", model=model, optimizer=optimizer)
    result["checkpoint load"] = _did(model, lambda: exact.setdefault("checkpoint load", exact_forward()))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    result["edit under no_grad"] = _did(model, lambda: exact.setdefault("edit under no_grad", exact_forward()))
    zeropp.refresh_weights(model)
    result["refresh_weights"] = _did(model, lambda: exact.setdefault("refresh_weights", exact_forward()))
    train_step()
    result["no_grad forward after a step"] = _did(model, lambda: forward_weights(model, x, y))
    result["second no_grad forward"] = _did(model, lambda: forward_weights(model, x, y))
    # gradient accumulation: the second micro-batch finds nothing to do and sends nothing across nodes
    train_step()
    model(x, y)[1].backward()
    ledger = zeropp.comm_ledger()
    ledger.reset()
    result["second micro-batch"] = _did(model, lambda: model(x, y)[1].backward())
    result["micro-batch cross-node gathers"] = ledger.summary(op="all_gather")["total"]["cross_node_bytes"]
    result["micro-batch decisions"] = ledger.summary(op="all_reduce", technique="deltas")["total"]["calls"]
    optimizer.zero_grad()
    zeropp.enable(model, _config(2, quantized_gradients=True))  # a new config: new comms, a fresh copy
    result["enabled again"] = _did(model, lambda: exact.setdefault("enabled again", exact_forward()))
    result["exact"] = exact
    return result


def test_every_full_refresh_trigger_and_nothing_between_micro_batches(tmp_path) -> None:
    """The first forward, ``load_state_dict``, a checkpoint load, an edit under ``no_grad``,
    ``zeropp.refresh_weights`` and a new config each make the next forward refresh every unit
    whole, with exact weights (fp32); after a step the next forward sends differences, later
    forwards nothing; a second micro-batch gathers nothing across nodes (one all-reduce of a byte
    per unit makes the decision, [Note: one decision])."""
    results = run_distributed(_triggers_job, 4, str(tmp_path), env=TWO_BY_TWO)
    for result in results:
        assert result["first step"] == {"whole"}
        assert result["after a step"] == {"difference"}
        for trigger in ("load_state_dict", "checkpoint load", "edit under no_grad", "refresh_weights",
                        "enabled again"):
            assert result[trigger] == {"whole"}, (trigger, result[trigger])
            assert result["exact"][trigger], trigger
        assert result["no_grad forward after a step"] == {"difference"}
        assert result["second no_grad forward"] == {"nothing"}
        assert result["second micro-batch"] == {"nothing"}
        assert result["micro-batch cross-node gathers"] == 0
        # the decision (one all-reduce of a byte per unit), the gathers inside the nodes, qgZ's reductions
        assert result["micro-batch decisions"] == 1


class _Frozen(torch.nn.Module):
    """Three blocks, the middle one frozen (a LoRA base, a frozen tower)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(24, 24) for _ in range(3))
        self.blocks[1].requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x.square().mean()


def _frozen_job(rank: int, world_size: int, steps: int) -> dict:
    model = zeropp.shard(_Frozen(), _config(2))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ledger = zeropp.comm_ledger()
    for step in range(steps):
        if step == 1:
            ledger.reset()
        model(torch.randn(4, 24, generator=torch.Generator().manual_seed(step * 10 + rank))).backward()
        optimizer.step()
        optimizer.zero_grad()
    comms = weight_deltas_of(model).comms
    deltas = ledger.summary(op="all_gather", technique="deltas")["total"]
    return {"refreshes": _refreshes(model), "trainable": [c.trainable for c in comms],
            "payload": [c.codec.nbytes for c in comms], "delta_cross_node_bytes": deltas["cross_node_bytes"],
            "refresh_bytes": ledger.summary(technique="refresh")["total"]["bytes"]}


def test_a_frozen_unit_crosses_nodes_once_and_each_step_sends_the_trainable_differences() -> None:
    """After the first step a unit without a trainable parameter sends nothing; each step's
    differences cross nodes once per trainable unit: its payload to the other node (2 x 2)."""
    steps = 4
    result = run_distributed(_frozen_job, 4, steps, env=TWO_BY_TWO)[0]
    frozen = [i for i, trainable in enumerate(result["trainable"]) if not trainable]
    assert len(frozen) == 1
    assert result["refreshes"][frozen[0]] == {NOTHING: steps - 1, DIFFERENCE: 0, WHOLE: 1}
    expected = (steps - 1) * sum(p for p, t in zip(result["payload"], result["trainable"]) if t)
    assert result["delta_cross_node_bytes"] == expected, (result["delta_cross_node_bytes"], expected)
    assert result["refresh_bytes"] == 0


def _audit_job(rank: int, world_size: int) -> dict:
    """The audit holds each row against its master chunk and its peers' rows; rows corrupted on
    rank 0 are found, and every rank's next forward refreshes those units whole."""
    model = zeropp.shard(make_model("gpt"), _config(2, audit_every=1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    units = len(weight_deltas_of(model).comms)
    x, y = _batch(0, rank, world_size)

    def train_step() -> None:
        model(x, y)[1].backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(2 * units):
        train_step()
    clean = [row for row in zeropp.audit_report(model) if row.technique == "deltas"]
    if rank == 0:
        for comm in weight_deltas_of(model).comms:
            comm.rows[1 - comm.node_index] += 1.0  # a row rank 0 holds for the other node's rank
    during = [_did(model, lambda: model(x, y)[1].backward()) for _ in range(units + 1)]  # micro-batches
    rows = [row for row in zeropp.audit_report(model) if row.technique == "deltas"][len(clean):]
    seen, masters = forward_weights(model, x, y), _masters(model)
    return {"clean": [(row.within_bound, row.relative_error, row.bound) for row in clean],
            "corrupted": [(row.unit, row.within_bound) for row in rows[:units]], "during": during,
            "exact_after": all(torch.equal(seen[n], masters[n]) for n in masters),
            "checksums": copy_checksums(model), "units": units}


def test_the_audit_finds_a_corrupted_copy_and_refreshes_it_whole() -> None:
    """With ``audit_every=1`` every training forward audits one unit: its rows against the master
    shards and against the other nodes' rows. Within the bound while training; once rank 0's
    copy of another rank's row is corrupted, each unit's audit (in micro-batches, which refresh
    nothing) finds it, and the next forward refreshes that unit whole on every rank: the weights
    exact and the copies equal again."""
    results = run_distributed(_audit_job, 4, env=TWO_BY_TWO)
    for result in results:
        assert len(result["clean"]) >= result["units"] and all(within for within, _, _ in result["clean"])
        assert all(error <= bound for _, error, bound in result["clean"])
        assert len(result["corrupted"]) == result["units"] and not any(w for _, w in result["corrupted"])
        assert all("whole" in did for did in result["during"][1:])  # the first after the step sends differences
        assert result["exact_after"]
    assert results[0]["checksums"] == results[2]["checksums"]


def _refusals_job(rank: int, world_size: int, cases: list[str]) -> dict:
    from test_meshes import _sharded

    builds = {
        "a partition smaller than the node": lambda: zeropp.shard(make_model("gpt"), _config(2)),
        "HSDP": lambda: _sharded("hsdp", 2, {"weight_deltas": True, "hpz_partition_size": 2}),
        "mixed dtypes": lambda: zeropp.shard(_mixed(), _config(int(__import__("os").environ["ZEROPP_RANKS_PER_NODE"])))}
    out = {}
    for name in cases:
        try:
            builds[name]()
            out[name] = "no error"
        except ValueError as error:
            out[name] = str(error)
    return out


def _mixed() -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    model[0].to(torch.bfloat16).requires_grad_(False)
    return model


def test_where_the_copy_cannot_live_it_is_refused_by_name() -> None:
    """Without hpZ (a config error), with hpZ's partition smaller than a node, on HSDP's units
    (no cross-node gather to replace), on a unit FSDP2 gathers as bytes (several dtypes)."""
    with pytest.raises(ValueError, match="weight_deltas=true keeps hpZ's node copy.*hpz_partition_size"):
        zeropp.ZeroPPConfig(weight_deltas=True)
    results = run_distributed(_refusals_job, 4, ["a partition smaller than the node", "mixed dtypes"],
                              env={"ZEROPP_RANKS_PER_NODE": "4"})
    results = [{**one, **two} for one, two in zip(results, run_distributed(_refusals_job, 4, ["HSDP"], env=TWO_BY_TWO))]
    first = results[0]
    assert "set hpz_partition_size=4" in first["a partition smaller than the node"]
    assert "HSDP" in first["HSDP"] and "quantized_replica_gradients" in first["HSDP"]
    assert "param_dtype" in first["mixed dtypes"]
    assert all(result == first for result in results)


@pytest.mark.parametrize("ranks_per_node,num_nodes", [(2, 2), (3, 2), (2, 3), (4, 3), (8, 5), (1, 4), (4, 1)])
def test_the_node_gather_is_put_in_chunk_order_in_place(ranks_per_node: int, num_nodes: int) -> None:
    """Block d*N + n of the node gather (rank d's row n) ends at chunk n*D + d, in place."""
    from zeropp.techniques.deltas import in_chunk_order

    rows = torch.arange(ranks_per_node * num_nodes * 3, dtype=torch.float32).view(ranks_per_node, num_nodes, 3)
    blocks = rows.reshape(-1, 3).clone()
    in_chunk_order(blocks, ranks_per_node, num_nodes)
    assert torch.equal(blocks.view(num_nodes, ranks_per_node, 3), rows.transpose(0, 1))


def _codes_job(rank: int, world_size: int, steps: int) -> dict:
    """Weight differences over a copy kept as qwZ's INT8 codes: the copies' checksums after each
    step, and each forward's weights against the master's within the difference's half step plus
    INT8's half step of the value kept."""
    from zeropp.techniques.deltas import held_copy_bytes

    out = {}
    for reference in ("weights", "codes"):
        model = zeropp.shard(make_model("gpt"), _config(2, delta_reference=reference))
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        checksums, excesses, before = [], [], None
        for step in range(steps):
            x, y = _batch(step, rank, world_size)
            seen, masters = forward_weights(model, x, y), _masters(model)
            if before is not None:
                excesses.append(max(((seen[n] - m).abs() - shard_half_steps(m - before[n], world_size, QMAX[4])
                                     - 1.01 * shard_half_steps(seen[n], world_size, 127) - 2.0**-21 * m.abs()
                                     ).max().item() for n, m in masters.items()))
            before = seen
            model(x, y)[1].backward()
            optimizer.step()
            optimizer.zero_grad()
            checksums.append(copy_checksums(model))
        out[reference] = {"checksums": checksums, "excesses": excesses, "held": held_copy_bytes(model)}
    return out


def test_a_copy_kept_as_codes_stays_the_same_on_every_node_within_int8_and_the_difference() -> None:
    """``delta_reference="codes"``: a quarter of the fp32 copy's memory (INT8 codes and scales),
    the same rows on every node after every step, the forward within both codes' half steps."""
    steps = 5
    results = run_distributed(_codes_job, 4, steps, env=TWO_BY_TWO)
    for rank, result in enumerate(results):
        codes = result["codes"]
        assert max(codes["excesses"]) <= 0, codes["excesses"]
        assert codes["checksums"] == results[rank % 2]["codes"]["checksums"]
        assert 0.25 <= codes["held"] / result["weights"]["held"] <= 0.27
