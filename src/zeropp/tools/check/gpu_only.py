"""What needs a GPU to mean anything: compiled blocks, half precision, offload to the host.

- ``bf16`` and ``fp16``: DeepSpeed-config training (``zeropp.initialize``, ``bf16.enabled`` /
  ``fp16.enabled`` with dynamic loss scaling) of a small GPT with all three techniques on 4 gloo
  ranks sharing the device as 2 nodes x 2: every loss finite, the last below the first.
- ``offload=cpu`` and ``offload=optimizer``: ``ZeroPPConfig.offload`` with all three, the shards
  (FSDP2's ``CPUOffloadPolicy``) or the optimizer's state (``zeropp.offload_optimizer``) on the
  host while the model computes on the GPU, and the first loss equal to the run's without
  offload (the same weights reach the same forward); on the CPU host and device are one memory,
  so only the logic runs.
- ``compile``: each block ``compile()``-d before ``zeropp.shard`` with qwZ (torchtitan's order),
  2 ranks: the first step's loss within 1e-4 of the eager run's (inductor reorders fp32 sums),
  the second within 1e-3; the compile's cost is the first step's time over the eager one's.

- ``float8``: torchao's float8 training (``Float8LinearConfig(enable_fsdp_float8_all_gather=True)``,
  the blocks' linear layers; an H100 or newer runs their matmuls in float8) with all three
  techniques on 4 ranks as 2 nodes x 2: the blocks' weights still gather themselves as float8
  (qwZ leaves them to torchao), every loss finite, the last below the first. Skipped, saying
  so, where torchao is not installed.

The smoke form trains fewer steps on the CPU and compiles with the "eager" backend (dynamo's
capture of the blocks and FSDP2's hooks, without inductor's minute of C++ compilation).
"""

from __future__ import annotations

import importlib.util
import math
from typing import Any

import torch

from zeropp.tools.check.ranks import run_ranks
from zeropp.tools.check.record import Context, Record, Skip
from zeropp.tools.check.report import parts_table, table
from zeropp.tools.check.training import ROWS_PER_RANK, median_ms, optimizer_step, run_steps, tiny_gpt

TWO_BY_TWO = {"ZEROPP_RANKS_PER_NODE": "2"}
STEPS = {"gpu": 10, "smoke": 3}
ALL_THREE = {"zero_quantized_weights": True, "zero_hpz_partition_size": 2, "zero_quantized_gradients": True}
COMPILE_FIRST_LOSS_RTOL = 1e-4
COMPILE_SECOND_LOSS_RTOL = 1e-3
OFFLOAD_FIRST_LOSS_RTOL = 1e-6
OFFLOADS = ("none", "cpu", "optimizer")
WHAT = {"shard_devices": "parameter shards", "state_devices": "optimizer state"}
LEAST_PART_S = 10.0
LEAST_COMPILE_S = 30.0
"""Seconds a part needs on a GPU at least (ranks start, CUDA initialises; inductor compiles)."""


def precision_rank(rank: int, world_size: int, device: str, precision: str, num_steps: int) -> dict[str, Any]:
    """All three techniques in ``precision`` ("bf16" or "fp16") through the DeepSpeed-config engine."""
    import zeropp

    config = {"train_batch_size": ROWS_PER_RANK * world_size, "train_micro_batch_size_per_gpu": ROWS_PER_RANK,
              "zero_optimization": {"stage": 3, **ALL_THREE}, "steps_per_print": 10**6,
              precision: {"enabled": True, **({"initial_scale_power": 8} if precision == "fp16" else {})},
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}}
    engine = zeropp.initialize(model=tiny_gpt().to(device), config=config)[0]
    applied = []

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = engine(x, y)[1]
        engine.backward(loss)
        engine.step()
        applied.append(engine.was_step_applied())
        return loss.item()

    losses, times = run_steps(step, rank, world_size, device, num_steps)
    skipped = applied.count(False)
    return {"losses": losses, "step_s": times, "skipped_steps": skipped, "loss_scale": engine.loss_scale}


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int, world_size: int, device: str,
           num_steps: int) -> dict[str, Any]:
    losses, times = run_steps(optimizer_step(model, optimizer), rank, world_size, device, num_steps)
    return {"losses": losses, "step_s": times}


def _device_types(tensors: list[torch.Tensor]) -> list[str]:
    return sorted({(t.to_local() if hasattr(t, "to_local") else t).device.type for t in tensors})


def offload_rank(rank: int, world_size: int, device: str, num_steps: int) -> dict[str, Any]:
    """All three under each ``ZeroPPConfig.offload``: where the shards and the optimizer's state
    live after training, and the losses."""
    import zeropp
    from zeropp.tools.modes import MODES

    out = {}
    for offload in OFFLOADS:
        model = zeropp.shard(tiny_gpt().to(device), MODES["all"].config(2, offload=offload))
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        if offload == "optimizer":
            optimizer = zeropp.offload_optimizer(optimizer)
        run = _train(model, optimizer, rank, world_size, device, num_steps)
        state = [t for entry in optimizer.state.values() for t in entry.values() if isinstance(t, torch.Tensor)]
        out[offload] = {"shard_devices": _device_types(list(model.parameters())),
                        "state_devices": _device_types(state), **run}
    return out


def compile_rank(rank: int, world_size: int, device: str, backend: str, num_steps: int) -> dict[str, Any]:
    """qwZ on a GPT whose blocks are compiled with ``backend``, and the same GPT eager."""
    import zeropp
    from zeropp.tools.modes import MODES

    out = {}
    for compiled in (False, True):
        model = tiny_gpt().to(device)
        if compiled:
            for block in model.blocks:
                block.compile(backend=backend)
        zeropp.shard(model, MODES["qwz"].config(world_size))
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        out["compiled" if compiled else "eager"] = _train(model, optimizer, rank, world_size, device, num_steps)
    return out


def float8_rank(rank: int, world_size: int, device: str, num_steps: int) -> dict[str, Any]:
    """All three on a GPT whose blocks' linear layers are torchao's float8 ones, gathered as float8."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    import zeropp
    from zeropp.tools.modes import MODES

    model = tiny_gpt().to(device)
    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True),
                               module_filter_fn=lambda module, name: name.startswith("blocks."))
    zeropp.shard(model, MODES["all"].config(2))
    weight = next(m.weight for m in model.blocks.modules() if type(m).__name__ == "Float8Linear")
    run = _train(model, torch.optim.AdamW(model.parameters(), lr=3e-3), rank, world_size, device, num_steps)
    return {**run, "gathered_as": type(weight.to_local()).__name__}


def _mean_losses(results: list[dict[str, Any]]) -> list[float]:
    """The global loss of each step: the mean of the ranks' (equal batch shares)."""
    return [sum(step) / len(step) for step in zip(*(r["losses"] for r in results))]


def _falls(losses: list[float]) -> dict[str, bool]:
    return {"losses finite": all(math.isfinite(x) for x in losses), "last loss below the first": losses[-1] < losses[0]}


def _relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def run(context: Context, record: Record) -> None:
    steps = STEPS["smoke" if context.smoke else "gpu"]
    for precision in ("bf16", "fp16"):
        with record.part(precision) as part:
            results = run_ranks(precision_rank, 4, context.device, precision, steps, env=TWO_BY_TWO,
                                timeout_s=context.need(LEAST_PART_S))
            part.update(losses=_mean_losses(results), step_s=results[0]["step_s"],
                        skipped_steps=results[0]["skipped_steps"], loss_scale=results[0]["loss_scale"])
            part["checks"] = _falls(part["losses"])
    with record.part("offload") as offload_part:
        results = run_ranks(offload_rank, 4, context.device, steps, env=TWO_BY_TWO,
                            timeout_s=context.need(LEAST_PART_S))
    if offload_part["status"] == "passed":
        _record_offloads(record, results, context.device)
    with record.part("float8") as part:
        if importlib.util.find_spec("torchao") is None:
            raise Skip("torchao is not installed in this Python (pip install torchao: the test extra has it)")
        results = run_ranks(float8_rank, 4, context.device, steps, env=TWO_BY_TWO,
                            timeout_s=context.need(LEAST_PART_S))
        part.update(losses=_mean_losses(results), step_s=results[0]["step_s"], gathered_as=results[0]["gathered_as"])
        part["checks"] = {**_falls(part["losses"]),
                          "weights gathered as float8": part["gathered_as"] == "WeightWithDynamicFloat8CastTensor"}
    with record.part("compile") as part:
        backend = "eager" if context.smoke else "inductor"
        results = run_ranks(compile_rank, 2, context.device, backend, 2, env={"ZEROPP_RANKS_PER_NODE": "2"},
                            timeout_s=context.need(LEAST_COMPILE_S))
        eager, compiled = (_mean_losses([r[kind] for r in results]) for kind in ("eager", "compiled"))
        part.update(backend=backend, losses=compiled, eager_losses=eager, step_s=results[0]["compiled"]["step_s"],
                    eager_step_s=results[0]["eager"]["step_s"])
        part["checks"] = {"first loss as eager": _relative(compiled[0], eager[0]) <= COMPILE_FIRST_LOSS_RTOL,
                          "second loss as eager": _relative(compiled[1], eager[1]) <= COMPILE_SECOND_LOSS_RTOL}


def _record_offloads(record: Record, results: list[dict[str, Any]], device: str) -> None:
    """One part per offload: its losses against no offload's, and where its state lived."""
    runs = {offload: {"losses": _mean_losses([r[offload] for r in results]), "step_s": results[0][offload]["step_s"],
                      "shard_devices": results[0][offload]["shard_devices"],
                      "state_devices": results[0][offload]["state_devices"]} for offload in OFFLOADS}
    where = {"cpu": {"shard_devices": ["cpu"], "state_devices": ["cpu"]},
             "optimizer": {"shard_devices": [device], "state_devices": ["cpu"]}}
    for offload, expected in where.items():
        with record.part(f"offload={offload}") as part:
            part.update(runs[offload])
            first_error = _relative(runs[offload]["losses"][0], runs["none"]["losses"][0])
            part["checks"] = {**_falls(runs[offload]["losses"]),
                              **{f"{WHAT[key]} on {places[0]}": runs[offload][key] == places
                                 for key, places in expected.items()},
                              "first loss as without offload": first_error <= OFFLOAD_FIRST_LOSS_RTOL}


def summary(parts: dict[str, dict[str, Any]]) -> str:
    return "; ".join(f"{name} {p['losses'][0]:.3f} -> {p['losses'][-1]:.3f}" for name, p in parts.items()
                     if p.get("losses"))


def _notes(name: str, p: dict[str, Any]) -> str:
    if name == "fp16":
        return f"{p['skipped_steps']} steps skipped on overflow, loss scale {p['loss_scale']:g}"
    if name.startswith("offload="):
        return f"shards on {', '.join(p['shard_devices'])}, optimizer state on {', '.join(p['state_devices'])}"
    if name == "compile":
        return f"{p['backend']}; first step {p['step_s'][0]:.1f} s, eager {p['eager_step_s'][0]:.1f} s"
    if name == "float8":
        return f"the blocks' weights gathered as {p['gathered_as']}"
    return ""


def markdown(parts: dict[str, dict[str, Any]]) -> list[str]:
    rows = [[name, f"{p['losses'][0]:.4f}", f"{p['losses'][-1]:.4f}", len(p["losses"]),
             f"{median_ms(p['step_s']):.1f}" if p.get("step_s") else "", _notes(name, p)]
            for name, p in parts.items() if p.get("losses")]
    return [*parts_table(parts), "",
            *table(["part", "first loss", "last loss", "steps", "median step ms", "notes"], rows)]
