"""zeropp.initialize: the DeepSpeed-style engine against a plain FSDP2 loop, DeepSpeed's schedule
formulas and loss-scaling rules, and the collective timeout."""

from __future__ import annotations

import copy
import logging
import math
import time

import pytest
import torch

import zeropp
from distributed import run_distributed
from models import global_batch, make_model, rows
from zeropp.config import SchedulerConfig, parse_deepspeed
from zeropp.engine import _build_optimizer, _param_groups, qgz_comms
from zeropp.engine.loss_scaler import LossScaler
from zeropp.engine.lr_schedules import WarmupSchedule, build_scheduler, schedule_formula

TWO_BY_TWO = {"ZEROPP_RANKS_PER_NODE": "2"}
MICRO_BATCH = 2
ACCUMULATION = 2
NUM_STEPS = 5
CLIP = 0.05
LR = 0.01


def _engine_config() -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": ACCUMULATION,
        "gradient_clipping": CLIP, "steps_per_print": 2, "zero_optimization": {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupDecayLR", "params": {
            "total_num_steps": NUM_STEPS, "warmup_num_steps": 2, "warmup_min_lr": 0.001,
            "warmup_max_lr": LR, "warmup_type": "linear"}},
    }


def _hand_warmup_decay(iteration: int) -> float:
    """WarmupDecayLR(min 1e-3, max 1e-2, 2 linear warm-up steps, 5 in total), written out:
    min at iterations -1 and 0, halfway at 1, then min + (max - min) * (5 - i) / 3."""
    low, high = 0.001, LR
    if iteration < 0:
        return low
    if iteration < 2:
        return low + (high - low) * iteration / 2
    return low + (high - low) * max(0.0, (5 - iteration) / 3)


def _local_batch(step: int, micro: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch ``micro`` of global step ``step``, this rank's rows: the same global data
    whatever the world size."""
    x, y = global_batch(step, MICRO_BATCH * ACCUMULATION * world_size)
    x, y = (rows(t, micro, ACCUMULATION) for t in (x, y))
    return rows(x, rank, world_size), rows(y, rank, world_size)


def _exact_global_norm(model: torch.nn.Module) -> float:
    """The gradient norm from the gathered full gradients, in fp64: the reference."""
    return math.sqrt(sum(p.grad.full_tensor().double().square().sum().item()
                         for p in model.parameters() if p.grad is not None))


def _engine_vs_plain_loop(rank: int, world_size: int) -> dict:
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("zeropp").addHandler(handler)
    logging.getLogger("zeropp").setLevel(logging.INFO)
    model = make_model("tied")
    reference = copy.deepcopy(model)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine, optimizer, _, scheduler = zeropp.initialize(model=model, config=_engine_config())
    zeropp.shard(reference)
    ref_optimizer = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=LR,
                                      weight_decay=0.1)
    ledger = zeropp.comm_ledger()
    out: dict = {"lr": [], "hand_lr": [], "clip_norm": [], "exact_norm": [], "engine_norm": [],
                 "boundary": [], "reduce_scatters": []}
    for step in range(NUM_STEPS):
        for group in ref_optimizer.param_groups:
            group["lr"] = _hand_warmup_decay(step - 1)
        out["lr"].append(engine.get_lr()[0])
        out["hand_lr"].append(_hand_warmup_decay(step - 1))
        for micro in range(ACCUMULATION):
            x, y = _local_batch(step, micro, rank, world_size)
            out["boundary"].append(engine.is_gradient_accumulation_boundary())
            before = ledger.summary(op="reduce_scatter")["total"]["calls"]
            _, loss = engine(x, y)
            engine.backward(loss)
            out["reduce_scatters"].append(ledger.summary(op="reduce_scatter")["total"]["calls"] - before)
            engine.step()
            _, ref_loss = reference(x, y)
            (ref_loss / ACCUMULATION).backward()  # plain FSDP2: reduce-scatter every micro-step
        out["exact_norm"].append(_exact_global_norm(reference))
        clip_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)
        out["clip_norm_type"] = type(clip_norm).__name__  # a DTensor: .full_tensor() is the global norm
        out["clip_norm"].append(clip_norm.full_tensor().item())
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        out["engine_norm"].append(engine.last_grad_norm)
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    out["errors"] = [((full[n] - p.full_tensor()).norm() / p.full_tensor().norm()).item()
                     for n, p in reference.named_parameters()]
    out["moved"] = max(((full[n] - initial[n]).norm() / initial[n].norm()).item() for n in full)
    out.update(global_steps=engine.global_steps, micro_steps=engine.micro_steps,
               micro_batch=engine.train_micro_batch_size_per_gpu(), logs=records, report=engine.comm_report(),
               optimizer_type=type(optimizer).__name__, scheduler_type=type(scheduler).__name__,
               units=sum(isinstance(m, torch.distributed.fsdp.FSDPModule) for m in model.modules()))
    return out


@pytest.mark.slow
def test_engine_equals_plain_fsdp2_loop_with_accumulation_and_clipping() -> None:
    """5 AdamW steps, 2 micro-batches each, clipping to 0.05, WarmupDecayLR: the engine against
    plain FSDP2 (reduce-scatter every micro-step, ``clip_grad_norm_`` on DTensor gradients, lr
    set by hand). The two differ only in summation order (the engine reduces the sum of both
    micro-steps once; the reference reduces each), so each gradient element differs by a few
    fp32 roundings (u = 6e-8) and every parameter tensor agrees within 1e-6 relative."""
    results = run_distributed(_engine_vs_plain_loop, 4, env=TWO_BY_TWO)
    for r in results:
        assert r["optimizer_type"] == "AdamW" and r["scheduler_type"] == "WarmupSchedule"
        assert r["clip_norm_type"] == "DTensor"
        assert r["lr"] == pytest.approx(r["hand_lr"], rel=1e-12)
        # the clip fired at every step, and every norm is the true global norm
        assert min(r["exact_norm"]) > 2 * CLIP, r["exact_norm"]
        for clip_norm, engine_norm, exact in zip(r["clip_norm"], r["engine_norm"], r["exact_norm"]):
            assert abs(clip_norm - exact) <= 1e-6 * exact
            assert abs(engine_norm - exact) <= 1e-5 * exact
        assert max(r["errors"]) <= 1e-6, r["errors"]
        assert r["moved"] > 1e-2, "parameters barely moved: the comparison would prove little"
        # gradients are reduced only in the boundary's backward, once per sharded unit
        assert r["boundary"] == [False, True] * NUM_STEPS
        assert r["reduce_scatters"] == [0, r["units"]] * NUM_STEPS
        assert (r["global_steps"], r["micro_steps"], r["micro_batch"]) == (NUM_STEPS, 2 * NUM_STEPS, MICRO_BATCH)
        assert "all_reduce" in r["report"] and "engine" in r["report"]
    logs = [line for line in results[0]["logs"] if "step=" in line]
    assert [line.split()[1] for line in logs] == ["step=2", "step=4"]
    assert all(not any("step=" in line for line in r["logs"]) for r in results[1:])


# ---- fp16 loss scaling --------------------------------------------------------------------------


def _fp16_overflow(rank: int, world_size: int) -> dict:
    zero = {"stage": 3, "zero_quantized_gradients": True, "zeropp": {"error_feedback": True}}
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero,
              "fp16": {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 2},
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    model = make_model("tied")
    reference = copy.deepcopy(model)  # the same fp16 + qgZ model, loss scaled by hand
    engine, *_ = zeropp.initialize(model=model, config=config)
    zeropp.shard(reference, zeropp.ZeroPPConfig(param_dtype=torch.float16, quantized_gradients=True,
                                                error_feedback=True))
    comms = qgz_comms(engine.module)
    out: dict = {"scales": [], "changed": [], "applied": [], "residual_bytes": [], "num_comms": len(comms)}
    applied_grads: list[list[torch.Tensor]] = []
    engine.optimizer.register_step_pre_hook(lambda optimizer, *_: applied_grads.append(
        [p.grad.full_tensor() for group in optimizer.param_groups for p in group["params"]]))
    for step in range(5):
        before = {n: p.full_tensor().clone() for n, p in engine.module.named_parameters()}
        x, y = (rows(t, rank, world_size) for t in global_batch(step, 2 * world_size))
        _, loss = engine(x, y)
        if step == 1 and rank == 1:
            loss = loss * float("inf")  # overflow that reaches the other rank through qgZ
        engine.backward(loss)
        if step == 2 and rank == 1:  # overflow that only this rank sees in its gradient shard
            next(p for p in engine.module.parameters() if p.grad is not None).grad.to_local().view(-1)[0] = float("inf")
        engine.step()
        if step == 0:
            (reference(x, y)[1].float() * 2.0**8).backward()
            expected = [p.grad.full_tensor() / 2.0**8 for p in reference.parameters() if p.requires_grad]
            out["unscaled_equal"] = all(torch.equal(g, e) for g, e in zip(applied_grads[0], expected))
        out["scales"].append(engine.loss_scale)
        out["applied"].append(engine.was_step_applied())
        out["residual_bytes"].append(sum(c.residual_bytes for c in comms))
        out["changed"].append(any(not torch.equal(before[n], p.full_tensor())
                                  for n, p in engine.module.named_parameters() if p.requires_grad))
    out["skipped"] = engine.skipped_steps
    out["optimizer_steps"] = len(applied_grads)
    out["finite"] = all(bool(p.full_tensor().isfinite().all()) for p in engine.module.parameters())
    out["bf16_equal"] = _bf16_step_equals_plain_loop(rank, world_size)
    return out


def _bf16_step_equals_plain_loop(rank: int, world_size: int) -> bool:
    """bf16: no loss scaling, so one engine step is bit-identical to a plain bf16 FSDP2 step."""
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}, "bf16": {"enabled": True},
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    model = make_model("tied")
    reference = copy.deepcopy(model)
    engine, *_ = zeropp.initialize(model=model, config=config)
    zeropp.shard(reference, zeropp.ZeroPPConfig(param_dtype=torch.bfloat16))
    ref_optimizer = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.1)
    x, y = (rows(t, rank, world_size) for t in global_batch(0, 2 * world_size))
    engine.backward(engine(x, y)[1])
    engine.step()
    reference(x, y)[1].backward()
    ref_optimizer.step()
    return engine.loss_scale == 1.0 and all(
        torch.equal(p.full_tensor(), r.full_tensor()) for p, r in zip(model.parameters(), reference.parameters()))


@pytest.mark.slow
def test_fp16_overflow_skips_step_lowers_scale_and_resets_error_feedback() -> None:
    """2**8 initial scale, hysteresis 2, window 2. Step 2: an inf loss on rank 1 (non-finite
    gradients reach rank 0 through qgZ); step 3: an inf in rank 1's gradient shard only (rank
    0's gradients are finite: the ranks must agree). Both steps are skipped on every rank with
    parameters unchanged and qgZ's residuals dropped; the first overflow is absorbed by the
    hysteresis, the second halves the scale; two clean steps later it doubles.

    Step 1 hands the optimizer the unscaled gradient: bit for bit the gradient of a plain loop
    that scales the loss by 2**8 by hand, divided by 2**8 (exact: a power of two). bf16 uses no
    scaling: its step equals a plain bf16 FSDP2 step bit for bit."""
    results = run_distributed(_fp16_overflow, 2)
    for r in results:
        assert r["num_comms"] > 0
        assert r["unscaled_equal"]
        assert r["scales"] == [256, 256, 128, 128, 256]
        assert r["applied"] == [True, False, False, True, True]
        assert r["changed"] == [True, False, False, True, True]
        assert r["skipped"] == 2 and r["optimizer_steps"] == 3 and r["finite"]
        assert r["residual_bytes"][0] > 0 and r["residual_bytes"][1] == 0 and r["residual_bytes"][2] == 0
        assert r["residual_bytes"][3] > 0
        assert r["bf16_equal"]


def test_loss_scaler_follows_deepspeed_rules() -> None:
    """DeepSpeed's DynamicLossScaler, traced by hand: window 3, hysteresis 2, floor 2."""
    scaler = LossScaler(scale=8.0, window=3, hysteresis=2, hysteresis_left=2, min_scale=2.0)
    trace = []
    for overflow in [False, False, False, True, True, False, False, False, True, True, True, True]:
        scaler.update(overflow)
        trace.append(scaler.scale)
    # iteration 2: (2 - -1) % 3 == 0 -> 16; overflow at 3 absorbed (hysteresis 2 -> 1); at 4 -> 8;
    # clean 5, 6, 7: (7 - 4) % 3 == 0 -> 16 and hysteresis back to 2; 8 absorbed; 9 -> 8, 10 -> 4,
    # 11 -> 2 (floor)
    assert trace == [8, 8, 16, 16, 8, 8, 8, 16, 16, 8, 4, 2]
    static = LossScaler(scale=128.0, dynamic=False)
    static.update(True)
    assert static.scale == 128.0


# ---- optimizer construction, no process group -------------------------------------------------


def test_optimizer_from_config_and_model_parameters() -> None:
    """The config's optimizer is built over the parameters named in ``model_parameters``
    (param-group dicts keep their options), mapped by name onto the (sharded) parameters."""
    model = make_model("tied")
    name_of = {id(p): name for name, p in model.named_parameters()}
    groups = _param_groups(model, [{"params": [model.norm.weight], "weight_decay": 0.0},
                                   {"params": [model.embed.weight]}], name_of)
    assert groups == [{"params": ["norm.weight"], "weight_decay": 0.0}, {"params": ["embed.weight"]}]
    stand_ins = {name: torch.nn.Parameter(p.detach().clone()) for name, p in model.named_parameters()}
    resolved = [{**g, "params": [stand_ins[n] for n in g["params"]]} for g in groups]
    config = parse_deepspeed({"zero_optimization": {"stage": 3},
                              "optimizer": {"type": "Adam", "params": {"lr": 0.5, "weight_decay": 0.1}}})
    optimizer = _build_optimizer(config, None, resolved, name_of, stand_ins)
    assert type(optimizer) is torch.optim.AdamW  # DeepSpeed's "Adam" is AdamW (adam_w_mode)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.0, 0.1]
    assert optimizer.param_groups[0]["params"][0] is stand_ins["norm.weight"]
    with pytest.raises(ValueError, match="not a parameter of the model"):
        _param_groups(model, [torch.zeros(2)], name_of)


def test_passed_optimizer_is_repointed_and_conflicts_are_errors() -> None:
    model = make_model("tied")
    name_of = {id(p): name for name, p in model.named_parameters()}
    stand_ins = {name: torch.nn.Parameter(p.detach().clone()) for name, p in model.named_parameters()}
    no_optimizer = parse_deepspeed({"zero_optimization": {"stage": 3}})
    passed = torch.optim.SGD([model.norm.weight, model.embed.weight], lr=0.1)
    assert _build_optimizer(no_optimizer, passed, [], name_of, stand_ins) is passed
    assert passed.param_groups[0]["params"] == [stand_ins["norm.weight"], stand_ins["embed.weight"]]
    with_optimizer = parse_deepspeed({"zero_optimization": {"stage": 3}, "optimizer": {"type": "SGD"}})
    with pytest.raises(ValueError, match="give one or the other"):
        _build_optimizer(with_optimizer, passed, [], name_of, stand_ins)
    with pytest.raises(ValueError, match="no optimizer"):
        _build_optimizer(no_optimizer, None, [], name_of, stand_ins)


# ---- schedules, no process group ---------------------------------------------------------------


def _schedule(kind: str, lr: float = 0.5, **params: object) -> WarmupSchedule:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    return build_scheduler(SchedulerConfig(type=kind, params=params), optimizer)


def _lrs(schedule: WarmupSchedule, num_steps: int) -> list[float]:
    lrs = [schedule.get_last_lr()[0]]
    for _ in range(num_steps):
        schedule.step()
        lrs.append(schedule.get_last_lr()[0])
    return lrs


def test_warmup_lr_log_and_linear() -> None:
    """WarmupLR(min 0.1, max 1.1, 4 steps): log gamma = ln(i+1)/ln 4, linear gamma = i/4,
    starting at iteration -1 (min) as DeepSpeed's constructor does."""
    log = _lrs(_schedule("WarmupLR", warmup_min_lr=0.1, warmup_max_lr=1.1, warmup_num_steps=4), 6)
    assert log == pytest.approx([0.1, 0.1, 0.1 + math.log(2) / math.log(4), 0.1 + math.log(3) / math.log(4),
                                 1.1, 1.1, 1.1], rel=1e-12)
    linear = _lrs(_schedule("WarmupLR", warmup_min_lr=0.1, warmup_max_lr=1.1, warmup_num_steps=4,
                            warmup_type="linear"), 5)
    assert linear == pytest.approx([0.1, 0.1, 0.35, 0.6, 0.85, 1.1], rel=1e-12)
    # warmup_num_steps below 2 is raised to 2, as DeepSpeed does
    assert _lrs(_schedule("WarmupLR", warmup_max_lr=1.0, warmup_num_steps=0, warmup_type="linear"), 2) == \
        pytest.approx([0.0, 0.0, 0.5], rel=1e-12)


def test_warmup_decay_lr() -> None:
    """WarmupDecayLR(min 0, max 1, 2 linear steps, total 6): warm-up 0, 0.5, then
    (6 - i) / (6 - 2) from i = 2, floored at 0 past the end."""
    lrs = _lrs(_schedule("WarmupDecayLR", total_num_steps=6, warmup_min_lr=0.0, warmup_max_lr=1.0,
                         warmup_num_steps=2, warmup_type="linear"), 8)
    assert lrs == pytest.approx([0.0, 0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0], abs=1e-15)


def test_warmup_cosine_lr() -> None:
    """WarmupCosineLR(total 10, 4 linear warm-up steps, min ratio 0.2, cos min 0.1) on lr 2.0:
    ratio 0 before the first step; warm-up 0.2 + 0.8 i / 4; then 0.1 + 0.9 (1 + cos(pi (i - 3) /
    6)) / 2 for i >= 4."""
    lrs = _lrs(_schedule("WarmupCosineLR", lr=2.0, total_num_steps=10, warmup_min_ratio=0.2,
                         warmup_num_steps=4, cos_min_ratio=0.1, warmup_type="linear"), 10)
    expected = [0.0] + [2.0 * (0.2 + 0.8 * i / 4) for i in range(4)]
    expected += [2.0 * (0.1 + 0.9 * (1 + math.cos(math.pi * (i - 3) / 6)) / 2) for i in range(4, 10)]
    assert lrs == pytest.approx(expected, rel=1e-12)


def test_schedule_state_round_trips_as_json() -> None:
    import json

    schedule = _schedule("WarmupLR", warmup_max_lr=1.0, warmup_num_steps=10, warmup_type="linear")
    for _ in range(3):
        schedule.step()
    state = json.loads(json.dumps(schedule.state_dict()))
    resumed = _schedule("WarmupLR", warmup_max_lr=1.0, warmup_num_steps=10, warmup_type="linear")
    resumed.load_state_dict(state)
    assert _lrs(resumed, 3) == _lrs(schedule, 3)
    assert schedule_formula(SchedulerConfig(type="WarmupLR", params={}))(5, 0.0) == pytest.approx(
        0.001 * math.log(6) / math.log(1000))


# ---- faults -------------------------------------------------------------------------------------


def _hung_peer(rank: int, world_size: int, timeout_s: float) -> dict:
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = zeropp.initialize(model=make_model("tied"), config=config, timeout_s=timeout_s)
    if rank == 1:
        time.sleep(3 * timeout_s)  # hangs: never joins the forward's all-gather
        return {}
    started = time.monotonic()
    try:
        x, y = (rows(t, rank, world_size) for t in global_batch(0, 2 * world_size))
        engine.backward(engine(x, y)[1])
        engine.step()
    except Exception as error:  # the point of the test: an error, not a hang
        return {"error": f"{type(error).__name__}: {error}", "elapsed": time.monotonic() - started}
    return {"error": None}


@pytest.mark.slow
def test_hung_peer_surfaces_as_error_within_timeout() -> None:
    """Rank 1 stops taking part; rank 0's first collective raises after ``timeout_s`` = 2 s
    instead of the backend's 30-minute default (slack: 15 s on a loaded 2-core machine)."""
    results = run_distributed(_hung_peer, 2, 2.0)
    error, elapsed = results[0]["error"], results[0].get("elapsed")
    assert error is not None and "Timed out" in error, error
    assert 1.5 <= elapsed <= 2.0 + 15, (elapsed, error)
