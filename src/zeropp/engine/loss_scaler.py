"""fp16 loss scaling as DeepSpeed does it (``DynamicLossScaler``), for ``zeropp.initialize``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from zeropp.config import TrainingConfig


@dataclass(kw_only=True)
class LossScaler:
    """fp16 loss scaling with DeepSpeed's rules: on overflow the scale halves (not below
    ``min_scale``) once ``hysteresis`` overflows have been absorbed; after ``window`` steps
    without overflow it doubles. A static scaler (``dynamic=False``) never changes."""

    scale: float
    dynamic: bool = True
    window: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    hysteresis_left: int = 2
    iteration: int = 0
    last_overflow_iteration: int = -1

    @classmethod
    def from_config(cls, training: TrainingConfig) -> LossScaler:
        if training.loss_scale > 0:
            return cls(scale=training.loss_scale, dynamic=False)
        return cls(scale=2.0 ** training.initial_scale_power, window=training.loss_scale_window,
                   hysteresis=training.hysteresis, hysteresis_left=training.hysteresis,
                   min_scale=training.min_loss_scale)

    def update(self, overflow: bool) -> None:
        """Account for one optimizer step (DeepSpeed's ``DynamicLossScaler.update_scale``)."""
        if not self.dynamic:
            return
        if overflow:
            if self.hysteresis == 1 or self.hysteresis_left == 1:
                self.scale = max(self.scale / 2, self.min_scale)
            else:
                self.hysteresis_left -= 1
            self.last_overflow_iteration = self.iteration
        elif (self.iteration - self.last_overflow_iteration) % self.window == 0:
            self.hysteresis_left = self.hysteresis
            self.scale *= 2
        self.iteration += 1

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            setattr(self, name, value)
