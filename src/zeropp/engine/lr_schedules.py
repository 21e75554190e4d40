"""DeepSpeed's warmup learning-rate schedules (``scheduler.type`` WarmupLR, WarmupDecayLR,
WarmupCosineLR), as pure functions of the iteration plus one small driver.

[Note: DeepSpeed's iteration count]
DeepSpeed's schedules start at ``last_batch_iteration = -1`` and set the optimizer's learning rate
already in the constructor (WarmupLR: ``warmup_min_lr``; WarmupCosineLR: 0). The engine steps the
schedule after every *applied* optimizer step, so optimizer step k (counted from 0) runs with the
rate of iteration k - 1. ``warmup_num_steps`` below 2 is raised to 2 (the log warm-up divides by
``log(warmup_num_steps)``). Everything here follows DeepSpeed's ``runtime/lr_schedules.py``; the
only deviations: WarmupCosineLR at iteration -1 sets *every* parameter group to 0 (DeepSpeed's
``[0.0]`` reaches only the first group), and a cosine phase of zero length decays in one step
instead of dividing by zero.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from zeropp.config import SchedulerConfig

LrAt = Callable[[int, float], float]
"""``(iteration, the group's initial lr) -> lr``: one schedule's formula."""


def _warmup_steps(warmup_num_steps: int) -> int:
    return max(2, warmup_num_steps)


def warmup_fraction(iteration: int, warmup_num_steps: int, warmup_type: str) -> float:
    """How far warm-up has come at ``iteration`` (0 -> 1): log(i+1)/log(n) or i/n."""
    n = _warmup_steps(warmup_num_steps)
    if warmup_type == "log":
        return math.log(iteration + 1) / math.log(n)
    return iteration / n


def warmup_lr(iteration: int, *, warmup_min_lr: float, warmup_max_lr: float, warmup_num_steps: int,
              warmup_type: str) -> float:
    """WarmupLR: min -> max over the warm-up, then max."""
    if iteration < 0:
        return warmup_min_lr
    gamma = 1.0
    if iteration < _warmup_steps(warmup_num_steps):
        gamma = warmup_fraction(iteration, warmup_num_steps, warmup_type)
    return warmup_min_lr + (warmup_max_lr - warmup_min_lr) * gamma


def warmup_decay_lr(iteration: int, *, total_num_steps: int, warmup_min_lr: float, warmup_max_lr: float,
                    warmup_num_steps: int, warmup_type: str) -> float:
    """WarmupDecayLR: WarmupLR's warm-up, then linear decay to 0 at ``total_num_steps``."""
    n = _warmup_steps(warmup_num_steps)
    if iteration < n:
        return warmup_lr(iteration, warmup_min_lr=warmup_min_lr, warmup_max_lr=warmup_max_lr,
                         warmup_num_steps=warmup_num_steps, warmup_type=warmup_type)
    gamma = max(0.0, (total_num_steps - iteration) / max(1.0, total_num_steps - n))
    return warmup_min_lr + (warmup_max_lr - warmup_min_lr) * gamma


def warmup_cosine_ratio(iteration: int, *, total_num_steps: int, warmup_min_ratio: float,
                        warmup_num_steps: int, cos_min_ratio: float, warmup_type: str) -> float:
    """WarmupCosineLR's multiplier of the initial lr: warm-up from ``warmup_min_ratio`` to 1,
    then a half cosine down to ``cos_min_ratio`` at ``total_num_steps``."""
    if iteration < 0:
        return 0.0
    n = _warmup_steps(warmup_num_steps)
    if iteration < n:
        fraction = warmup_fraction(iteration, warmup_num_steps, warmup_type)
        return warmup_min_ratio + fraction * (1.0 - warmup_min_ratio)
    progress = (iteration - n + 1) / max(1, total_num_steps - n)
    return max(0.0, cos_min_ratio + (1.0 - cos_min_ratio) * (1 + math.cos(math.pi * progress)) / 2)


def schedule_formula(config: SchedulerConfig) -> LrAt:
    """The formula of a DeepSpeed ``scheduler`` section (its params already completed)."""
    params = config.params
    if config.type == "WarmupLR":
        return lambda iteration, base_lr: warmup_lr(iteration, **params)
    if config.type == "WarmupDecayLR":
        return lambda iteration, base_lr: warmup_decay_lr(iteration, **params)
    if config.type == "WarmupCosineLR":
        return lambda iteration, base_lr: base_lr * warmup_cosine_ratio(iteration, **params)
    raise ValueError(f"scheduler.type={config.type!r} is not one of WarmupLR, WarmupDecayLR, "
                     "WarmupCosineLR")


class WarmupSchedule:
    """Sets each parameter group's lr to ``lr_at(iteration, initial lr)``; ``step()`` advances the
    iteration. Same interface as a torch LR scheduler (``step``, ``get_last_lr``, ``state_dict``,
    ``load_state_dict``); its state is JSON (two numbers and a list). See [Note: DeepSpeed's
    iteration count]."""

    def __init__(self, optimizer: torch.optim.Optimizer, lr_at: LrAt, name: str = "") -> None:
        self.optimizer = optimizer
        self.lr_at = lr_at
        self.name = name
        self.base_lrs = [float(group["lr"]) for group in optimizer.param_groups]
        self.last_batch_iteration = -1
        self._apply()

    def _apply(self) -> None:
        for group, base_lr in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = self.lr_at(self.last_batch_iteration, base_lr)

    def step(self) -> None:
        self.last_batch_iteration += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration, "base_lrs": list(self.base_lrs)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_batch_iteration = int(state["last_batch_iteration"])
        self.base_lrs = [float(lr) for lr in state["base_lrs"]]
        self._apply()


def build_scheduler(config: SchedulerConfig, optimizer: torch.optim.Optimizer) -> WarmupSchedule:
    """The schedule a DeepSpeed ``scheduler`` section asks for, driving ``optimizer``."""
    return WarmupSchedule(optimizer, schedule_formula(config), config.type)
