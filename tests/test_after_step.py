"""The next forward's first gathers started when the optimizer step ends ([Note: gathers after the
step] in ``zeropp.fsdp.after_step``): in a stock loop with accumulation and clipping, in the
engine and in the HF Trainer, training is bit for bit the same as without them, and the forward
takes them."""

from __future__ import annotations

import pytest
import torch

import zeropp
from distributed import run_distributed
from models import global_batch, make_model, rows
from zeropp.fsdp import after_step, comms
from zeropp.fsdp.after_step import ahead_bytes, gather_after_step
from zeropp.fsdp.comms import GatherAhead

TWO_BY_TWO = {"ZEROPP_RANKS_PER_NODE": "2"}
ALL_THREE = {"quantized_weights": True, "quantized_gradients": True, "hpz_partition_size": 2, "overlap": True}
NUM_STEPS, ACCUMULATION, CLIP = 4, 2, 0.05
EDITED_STEP = 2
"""Before this step's forward the loop scales the weights in place, after the step's gathers started."""


def _counts(model: torch.nn.Module) -> dict[str, int]:
    gathers = [g for g in zeropp.sharded_comms(model).all_gathers if isinstance(g, GatherAhead)]
    return {"taken": sum(g.taken_ahead for g in gathers), "dropped": sum(g.dropped_ahead for g in gathers)}


def _stock_loop(rank: int, world_size: int, after_step: bool) -> dict:
    """AdamW, two micro-batches per step, clipping by the global norm, a schedule, an edit."""
    model = make_model("gpt")
    zeropp.shard(model, zeropp.ZeroPPConfig(**ALL_THREE))
    if not after_step:
        gather_after_step(model, None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    losses, held = [], []
    for step in range(NUM_STEPS):
        if step == EDITED_STEP:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.5)
        for micro in range(ACCUMULATION):
            x, y = (rows(t, rank, world_size) for t in global_batch(step * ACCUMULATION + micro, 8))
            _, loss = model(x, y)
            (loss / ACCUMULATION).backward()
            losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        held.append(ahead_bytes(model))
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
    params = {name: p.full_tensor() for name, p in model.named_parameters()}
    return {"losses": losses, "params": params, "counts": _counts(model), "held": held}


def _engine(rank: int, world_size: int, after_step: bool) -> dict:
    """zeropp's engine from a DeepSpeed config: accumulation, clipping, its own schedule."""
    model = make_model("gpt")
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": ACCUMULATION,
              "gradient_clipping": CLIP, "zero_optimization": {
                  "stage": 3, "zero_quantized_weights": True, "zero_quantized_gradients": True,
                  "zero_hpz_partition_size": 2, "zeropp": {"overlap": True}},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2, "warmup_max_lr": 1e-2}}}
    engine, *_ = zeropp.initialize(model=model, config=config)
    if not after_step:
        gather_after_step(model, None)
    losses = []
    for step in range(NUM_STEPS * ACCUMULATION):
        x, y = (rows(t, rank, world_size) for t in global_batch(step, 8))
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    params = {name: p.full_tensor() for name, p in model.named_parameters()}
    return {"losses": losses, "params": params, "counts": _counts(model)}


def _both(rank: int, world_size: int, which: str) -> dict:
    train = {"loop": _stock_loop, "engine": _engine}[which]
    on, off = train(rank, world_size, True), train(rank, world_size, False)
    return {"losses": (on["losses"], off["losses"]), "counts": (on["counts"], off["counts"]),
            "held": on.get("held"), "params_equal": all(torch.equal(on["params"][n], off["params"][n])
                                                        for n in on["params"])}


def test_gathers_after_the_step_in_a_stock_loop_change_no_bit() -> None:
    """Every step but the edited one's forward takes the root's and the first blocks' gathers
    started by the step before (here the whole 2-block model: 3 units); at the edit the forward
    sees the changed weights and drops them; the last step's wait for a next forward."""
    for r in run_distributed(_both, 4, "loop", env=TWO_BY_TWO):
        on, off = r["losses"]
        assert on == off and r["params_equal"]
        units = 3
        assert r["counts"][0] == {"taken": units * (NUM_STEPS - 2), "dropped": units}, r["counts"]
        assert r["counts"][1] == {"taken": 0, "dropped": 0}
        assert all(held > 0 for held in r["held"])


def _train_in_a_function(rank: int, world_size: int) -> None:
    """Two steps of all three in a function, whose model the caller never sees."""
    model = make_model("gpt")
    zeropp.shard(model, zeropp.ZeroPPConfig(**ALL_THREE))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        x, y = (rows(t, rank, world_size) for t in global_batch(step, 8))
        model(x, y)[1].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _ends_by_destroying_the_group(rank: int, world_size: int) -> dict:
    import gc

    import torch.distributed as dist

    _train_in_a_function(rank, world_size)
    gc.collect()
    in_flight = comms.gathers_ahead_in_flight()
    held = [entry for _, _, tensors in comms._AHEAD_IN_FLIGHT.values() for entry in tensors]
    waited, original = [], after_step.wait_until_let_go

    def spy(entries: comms.Held, timeout_s: float = 5.0) -> bool:
        waited.append((len(entries), original(entries, timeout_s)))
        return waited[-1][1]

    after_step.wait_until_let_go = spy
    try:
        dist.destroy_process_group()
    finally:
        after_step.wait_until_let_go = original
    return {"in_flight": in_flight, "held": len(held), "waited": waited,
            "still_held": [(t._use_count(), before) for t, before in held if t._use_count() > before],
            "left": comms.gathers_ahead_in_flight(), "wrapped": hasattr(dist.destroy_process_group, "__wrapped__")}


def test_gathers_in_flight_at_the_end_are_finished_when_the_script_destroys_its_group() -> None:
    """A job that trains in a function and ends with ``destroy_process_group``, as most scripts
    do, before zeropp's exit hook can run: destroying the group waits for every gather the last
    step started, meets the other ranks, and returns only once the backend's threads hold none of
    their tensors ([Note: the backend lets go after the wait]: a gloo thread that released the
    last reference during finalization aborted the rank, several runs in thirty of such a job
    under load)."""
    for r in run_distributed(_ends_by_destroying_the_group, 4, env=TWO_BY_TWO):
        assert r["wrapped"] and r["in_flight"] > 0 and r["held"] >= 2 * r["in_flight"], r
        assert r["waited"] == [(r["held"], True)] and r["left"] == 0 and r["still_held"] == [], r


def test_the_destroy_wrapper_finishes_for_the_default_group_only_and_not_while_an_exception_propagates(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A subgroup's destroy leaves the gathers alone (other ranks may still take theirs), and a
    rank that fails must exit at once (its peers may be inside another collective)."""
    finished, destroyed = [], []
    monkeypatch.setattr(after_step, "_finish_started", lambda: finished.append(True))
    monkeypatch.setattr(after_step.dist, "is_initialized", lambda: True)
    destroy = after_step._finish_before(lambda group=None: destroyed.append(group))
    subgroup = object()
    destroy()
    destroy(subgroup)
    try:
        raise ValueError("the script failed")
    except ValueError:
        destroy()
    assert finished == [True] and destroyed == [None, subgroup, None]


@pytest.mark.slow
def test_gathers_after_the_step_in_the_engine_change_no_bit() -> None:
    for r in run_distributed(_both, 4, "engine", env=TWO_BY_TWO):
        on, off = r["losses"]
        assert on == off and r["params_equal"]
        assert r["counts"][0] == {"taken": 3 * (NUM_STEPS - 1), "dropped": 0}, r["counts"]
        assert r["counts"][1] == {"taken": 0, "dropped": 0}


def _trainer(rank: int, world_size: int, out_dir: str) -> dict:
    from transformers import TrainingArguments

    from test_hf import Sequences, tiny_llama
    from zeropp.hf import ZeroPPTrainer
    from zeropp.tools.modes import MODES

    results = {}
    for overlap in (True, False):
        model = tiny_llama(lora=False)
        args = TrainingArguments(output_dir=f"{out_dir}/{overlap}", per_device_train_batch_size=2, max_steps=4,
                                 gradient_accumulation_steps=2, learning_rate=0.5, optim="adamw_torch",
                                 max_grad_norm=1.0, logging_steps=1, report_to=[], use_cpu=True, seed=0,
                                 dataloader_drop_last=True, disable_tqdm=True)
        trainer = ZeroPPTrainer(model, args=args, train_dataset=Sequences(),
                                zeropp_config=MODES["all"].config(2, overlap=overlap))
        trainer.train()
        results[overlap] = {"losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
                            "counts": _counts(model),
                            "params": {n: p.full_tensor() for n, p in model.named_parameters()}}
    on, off = results[True], results[False]
    return {"losses": (on["losses"], off["losses"]), "counts": on["counts"],
            "params_equal": all(torch.equal(on["params"][n], off["params"][n]) for n in on["params"])}


@pytest.mark.slow
def test_gathers_after_the_step_under_the_hf_trainer_change_no_bit(tmp_path) -> None:
    """Trainer's defaults (its save strategy included) with accumulation and clipping: the
    all-three run with ``overlap`` (gathers after accelerate's optimizer step) against the same
    run without, bit for bit; its forwards took the gathers started after each step."""
    pytest.importorskip("transformers")
    for r in run_distributed(_trainer, 4, str(tmp_path), env=TWO_BY_TWO, timeout=300):
        on, off = r["losses"]
        assert len(on) == 4 and on == off and r["params_equal"]
        assert r["counts"]["taken"] > 0 and r["counts"]["dropped"] <= r["counts"]["taken"], r["counts"]


@pytest.mark.slow
def test_a_job_that_ends_after_a_step_exits_cleanly(tmp_path) -> None:
    """The README's plain loop with ``overlap`` (named, though the default): its last optimizer
    step starts gathers that no forward takes, still in the backend's threads when the script
    ends. Both ranks exit with 0: zeropp finishes them at exit, the ranks meet in a barrier, and
    each waits until the backend has let go of their tensors (a gloo thread that released the
    last of them during finalization aborted the rank now and then under load, so this run
    catches a regression only when the race comes up; the test above checks the wait itself)."""
    import os
    import subprocess
    import sys

    from test_packaging import readme_plain_loop

    text = readme_plain_loop()
    assert "quantized_gradients=True)" in text
    script = tmp_path / "train.py"
    script.write_text(text.replace("quantized_gradients=True)", "quantized_gradients=True, overlap=True)"))
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "ZEROPP_RANKS_PER_NODE": "2"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stdout.count("README loop done") == 2


def test_waiting_for_the_backend_to_let_go_ends_only_when_no_one_else_holds_the_tensor() -> None:
    """``wait_until_let_go`` compares each tensor's use count with the one noted before the
    collective: a view (another holder, as a gloo work is) keeps it waiting until the timeout;
    with the view gone it returns at once."""
    buffer = torch.zeros(8)
    held = [(buffer, buffer._use_count())]
    view = buffer.view(2, 4)
    assert not comms.wait_until_let_go(held, timeout_s=0.05)
    del view
    assert comms.wait_until_let_go(held, timeout_s=0.05)
