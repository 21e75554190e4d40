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
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, **({"fused": True} if variant == "fused" else {}))
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


@pytest.mark.parametrize("variant", ["fused", "offload", "optimizer on the host", "optimizer in backward"])
def test_the_copy_follows_every_way_a_step_runs(variant: str) -> None:
    """A fused AdamW (which writes DTensors without bumping their version counters), shards on the
    host (CPU offload), the optimizer on the host, the step inside backward: after every step the
    next forward sends the differences and sees the weights within their bound, never the last
    step's weights."""
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


def _counts(model: torch.nn.Module) -> dict[int, int]:
    """The units' forward gathers by what they did to the rows, summed."""
    total = {0: 0, DIFFERENCE: 0, WHOLE: 0}
    for counts in _refreshes(model):
        for kind, count in counts.items():
            total[kind] += count
    return total


def _trainer_job(rank: int, world_size: int, out: str) -> dict:
    """HF Trainer with all three and weight differences, saving every 3 steps as its default
    strategy does (every ``save_steps``), then a second Trainer resuming from the checkpoint."""
    from transformers import TrainingArguments

    from test_hf import STEPS as TRAINER_STEPS
    from test_hf import Sequences, tiny_llama
    from zeropp.hf import ZeroPPTrainer

    config = zeropp.ZeroPPConfig(**ALL_DELTA)
    runs = {}
    for name, resume in (("uninterrupted", None), ("resumed", f"{out}/uninterrupted/checkpoint-3")):
        model = tiny_llama(False)
        args = TrainingArguments(output_dir=f"{out}/{name}", per_device_train_batch_size=2, max_steps=TRAINER_STEPS,
                                 learning_rate=3e-3, lr_scheduler_type="constant", logging_steps=1, save_steps=3,
                                 report_to=[], use_cpu=True, seed=0, dataloader_drop_last=True, disable_tqdm=True)
        trainer = ZeroPPTrainer(model, args=args, train_dataset=Sequences(), zeropp_config=config)
        trainer.train(resume_from_checkpoint=resume)
        runs[name] = {"losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
                      "counts": _counts(model)}
    return runs


def test_hf_trainer_trains_saves_and_resumes_with_weight_differences(tmp_path) -> None:
    """The resumed Trainer rebuilds the copy whole from the loaded weights (it is never saved):
    its losses are the uninterrupted run's up to the differences' rounding, which the
    uninterrupted run's copy carries and the rebuilt one does not."""
    result = run_distributed(_trainer_job, 4, str(tmp_path), env=TWO_BY_TWO, timeout=300)[0]
    whole, resumed = result["uninterrupted"], result["resumed"]
    assert whole["counts"][WHOLE] == 3 and whole["counts"][DIFFERENCE] > 0  # one per unit: the first forward
    assert resumed["counts"][WHOLE] == 3
    # the resumed Trainer's log holds the checkpoint's first three entries, then its own
    assert resumed["losses"][3:] == pytest.approx(whole["losses"][3:], rel=1e-3), (resumed["losses"], whole["losses"])
    assert whole["losses"][-1] < whole["losses"][0]


def _engine_job(rank: int, world_size: int, out: str) -> dict:
    """zeropp.initialize with a DeepSpeed file asking for all three and weight differences
    (``zero_optimization.zeropp.weight_deltas``): steps, a checkpoint, its load."""
    from models import global_batch, rows

    zero = {"stage": 3, "zero_quantized_weights": True, "zero_quantized_gradients": True,
            "zero_hpz_partition_size": 2, "zeropp": {"weight_deltas": True, "delta_bits": 8}}
    engine, *_ = zeropp.initialize(model=make_model("gpt"), config={
        "train_micro_batch_size_per_gpu": 2, "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}})
    losses = []
    for step in range(4):
        x, y = (rows(t, rank, world_size) for t in global_batch(step, 2 * world_size))
        loss = engine(x, y)[1]
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if step == 1:
            engine.save_checkpoint(out, tag="two")
    before = _counts(engine.module)
    engine.load_checkpoint(out, tag="two")
    x, y = (rows(t, rank, world_size) for t in global_batch(2, 2 * world_size))
    again = engine(x, y)[1].item()
    after = _counts(engine.module)
    bits = {comm.codec.segments[0].bits for comm in zeropp.techniques.deltas.weight_deltas_of(engine.module).comms}
    return {"losses": losses, "again": again, "whole_on_load": after[WHOLE] - before[WHOLE], "bits": bits,
            "units": len(_refreshes(engine.module))}


def test_the_engine_takes_weight_differences_from_its_deepspeed_file(tmp_path) -> None:
    """The loaded checkpoint's forward refreshes every unit whole and gives step 3's loss again,
    up to the 8-bit differences' rounding of the weights step 3 first saw."""
    import zeropp.techniques.deltas  # noqa: F401

    result = run_distributed(_engine_job, 4, str(tmp_path), env=TWO_BY_TWO)[0]
    assert result["bits"] == {8}
    assert result["whole_on_load"] == result["units"]
    assert result["again"] == pytest.approx(result["losses"][2], rel=1e-4)
    assert result["losses"][-1] < result["losses"][0]


def _accelerate_job(rank: int, world_size: int, out: str) -> dict:
    """accelerate's own loop as its docs write it (a plain ``Accelerator()``) on a model with all
    three and weight differences: steps, ``save_state``, a step, ``load_state``, the step again."""
    from accelerate import Accelerator

    from test_accelerate import _model, _rows

    model = zeropp.shard(_model(), zeropp.ZeroPPConfig(**ALL_DELTA))
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
    batches = _rows(4 * 2 * 5, 1).view(5, 4, 2, -1)[:, rank]

    def step(batch: torch.Tensor) -> float:
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    losses = [step(batches[i]) for i in range(3)]
    accelerator.save_state(f"{out}/state")
    losses.append(step(batches[3]))
    before = _counts(model)
    accelerator.load_state(f"{out}/state")
    again = step(batches[3])
    return {"losses": losses, "again": again, "whole_on_load": _counts(model)[WHOLE] - before[WHOLE],
            "units": len(_refreshes(model))}


def test_accelerate_saves_and_loads_a_model_with_weight_differences(tmp_path) -> None:
    """``load_state`` loads the weights the copy is rebuilt from: the next forward refreshes every
    unit whole, and the step after the save gives its loss again up to the differences' rounding."""
    for result in run_distributed(_accelerate_job, 4, str(tmp_path), env=TWO_BY_TWO, timeout=300):
        assert result["whole_on_load"] == result["units"]
        assert result["again"] == pytest.approx(result["losses"][3], rel=1e-3)


def _torchtitan_job(rank: int, world_size: int) -> dict:
    import test_torchtitan

    test_torchtitan.MODES["all_delta"] = zeropp.ZeroPPConfig(**ALL_DELTA)
    return {mode: test_torchtitan._train(mode, rank, world_size)["losses"] for mode in ("all", "all_delta")}


def test_torchtitan_trains_with_weight_differences() -> None:
    """torchtitan's llama3 debug model through its own parallelize and optimizer container, with
    ``with_zeropp``'s weight differences: its losses those of all three without them, to the
    differences' rounding of the forward's weights (INT8 under qwZ alone)."""
    pytest.importorskip("torchtitan")
    result = run_distributed(_torchtitan_job, 4, env=TWO_BY_TWO, timeout=300)[0]
    assert result["all_delta"] == pytest.approx(result["all"], rel=2e-3), result


def _tensor_parallel_job(rank: int, world_size: int) -> dict:
    """Tensor parallel 2 inside the node x FSDP over 4 ranks (2 on each node), as torchtitan
    builds it: FSDP2 alone, then with weight differences on the data-parallel sub-mesh."""
    from test_meshes import _loss, _sharded

    out = {}
    for name, options in (("fsdp2", None), ("deltas", {"weight_deltas": True, "hpz_partition_size": 2})):
        model, dp_rank = _sharded("tp", 2, options)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        zeropp.comm_ledger().reset()
        losses = []
        for _ in range(4):
            loss = _loss(model, dp_rank)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        gathers = zeropp.comm_ledger().summary(op="all_gather")["by_technique"]
        out[name] = {"losses": losses, "gathers": {k: v["cross_node_bytes"] for k, v in gathers.items()}}
        if options is not None:
            out["counts"] = _counts(model)
            out["checksums"] = zeropp.techniques.deltas.copy_checksums(model)
    return out


def test_tensor_parallel_units_keep_their_copy_over_their_data_parallel_ranks() -> None:
    """On 2 nodes x 4 ranks, TP 2 x FSDP 4: each unit's copy lives on the 2 ranks of its
    data-parallel group in a node; its first forward is FSDP2's bit for bit (a full refresh),
    the later ones within the differences' rounding; only differences and the first refresh
    cross nodes; the peers' copies are the same (ranks 0 and 4, 1 and 5, ... hold the same rows)."""
    import zeropp.techniques.deltas  # noqa: F401

    results = run_distributed(_tensor_parallel_job, 8, env={"ZEROPP_RANKS_PER_NODE": "4"}, timeout=300)
    for rank, result in enumerate(results):
        assert result["deltas"]["losses"][0] == result["fsdp2"]["losses"][0]
        assert result["deltas"]["losses"] == pytest.approx(result["fsdp2"]["losses"], rel=1e-3)
        assert set(result["deltas"]["gathers"]) == {"hpZ", "refresh", "deltas"}, result["deltas"]["gathers"]
        assert result["deltas"]["gathers"]["hpZ"] == 0
        assert result["counts"][WHOLE] > 0 and result["counts"][DIFFERENCE] == 3 * result["counts"][WHOLE]
        assert result["checksums"] == results[(rank + 4) % 8]["checksums"]
