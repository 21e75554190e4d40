"""The optimizer step inside backward, unit by unit, and the next forward's gathers started
right after it: see [Note: step in backward].

    steps = zeropp.optimizer_in_backward(model, torch.optim.AdamW, lr=3e-4, gather_ahead=True)
    for x, y in batches:
        model(x, y).backward()      # each unit's AdamW step runs in here; no optimizer.step()
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from zeropp.fsdp.access import FSDPModule, all_gather_input, unit_parameters
from zeropp.fsdp.after_step import steps_in_backward
from zeropp.fsdp.comms import GatherAhead
from zeropp.fsdp.unused import GradientPresence
from zeropp.setup.sharding import sharded_comms


class OptimizerInBackward:
    """One optimizer per unit, stepped in backward once the unit's gradients are reduced.

    [Note: step in backward]
    At a slow link the forward is bound by its gathers: at 100 Mbit/s the 25M GPT's qwZ
    gathers take longer than its forward computes, and nothing can be gathered sooner, because
    the weights change at the optimizer step. Stepping each unit in backward moves that point:
    a unit's gradients are final when its reduce-scatter has written them (with ``overlap``,
    when the next unit's reduce-scatter finishes it, [Note: late reduce-scatter]), and its
    optimizer state depends on nothing else, so its step can run then; with ``gather_ahead`` the
    gather of its new weights for the next forward starts right after ([Note: gathers ahead])
    and crosses the link while the remaining units' backward computes. Per-element optimizers
    (SGD, Adam, AdamW, ...) give the same bits as one ``optimizer.step()`` after backward. What
    needs every gradient at once (clipping by the global norm, a loss scaler's skip) cannot run
    this way; neither can accumulation over micro-batches unless FSDP2 is told to skip the
    reduce-scatter (``set_requires_gradient_sync(False)``) on all but the last. The gradients
    are released after each step (``zero_grad(set_to_none=True)``).
    """

    def __init__(self, model: nn.Module, optimizer_class: Callable[..., torch.optim.Optimizer], *,
                 gather_ahead: bool = False, **optimizer_kwargs: Any) -> None:
        comms = sharded_comms(model)
        if not comms.units:
            raise ValueError(f"optimizer_in_backward needs a model sharded by zeropp.shard or zeropp.enable; "
                             f"{type(model).__name__} is not")
        units = [(unit, all_gather, reduce_scatter, presence, params)
                 for unit, all_gather, reduce_scatter, presence in zip(
                     comms.units, comms.all_gathers, comms.reduce_scatters, comms.presences, strict=True)
                 if (params := [p for p in unit_parameters(unit) if p.requires_grad])]
        stepped = {id(p) for *_, params in units for p in params}
        missed = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in stepped]
        if missed:
            raise ValueError(f"optimizer_in_backward steps the parameters of FSDP units; {missed[:3]} belong to "
                             "none (0-dim parameters stay outside FSDP2, or the root is not a unit): train such a "
                             "model with an optimizer stepped after backward")
        self.gather_ahead = gather_ahead
        self.optimizers: list[torch.optim.Optimizer] = []
        self._gathers: list[GatherAhead] = []
        for unit, all_gather, reduce_scatter, presence, params in units:
            optimizer = optimizer_class(params, **optimizer_kwargs)
            steps_in_backward(optimizer)  # its steps start no gathers after the step: it starts its own
            gather = all_gather if gather_ahead and isinstance(all_gather, GatherAhead) else None
            reduce_scatter.after_reduce = functools.partial(_step, unit, optimizer, presence, gather)
            self.optimizers.append(optimizer)
            if gather is not None:
                self._gathers.append(gather)
        self._reduce_scatters = comms.reduce_scatters

    @property
    def ahead_bytes(self) -> int:
        """Bytes this rank holds for gathers started ahead (0 without ``gather_ahead``, or once
        the next forward has taken them)."""
        return sum(gather.ahead_bytes for gather in self._gathers)

    def wait_ahead(self) -> None:
        """Wait until the gathers started ahead have arrived (the next forward then only decodes)."""
        for gather in self._gathers:
            gather.wait_ahead()

    def state_dict(self) -> list[dict[str, Any]]:
        """Each unit's optimizer state, in unit order."""
        return [optimizer.state_dict() for optimizer in self.optimizers]

    def load_state_dict(self, state: list[dict[str, Any]]) -> None:
        """Load what ``state_dict`` returned, on a model sharded the same way."""
        if len(state) != len(self.optimizers):
            raise ValueError(f"state holds {len(state)} optimizers' states; this model steps {len(self.optimizers)}")
        for optimizer, one in zip(self.optimizers, state):
            optimizer.load_state_dict(one)

    def close(self) -> None:
        """Stop stepping in backward (the caller's optimizer takes over) and drop gathers started
        ahead."""
        for reduce_scatter in self._reduce_scatters:
            reduce_scatter.after_reduce = None
        for gather in self._gathers:
            gather.drop_ahead()


def _step(unit: FSDPModule, optimizer: torch.optim.Optimizer, presence: GradientPresence,
          gather: GatherAhead | None) -> None:
    """One unit's step (parameters no rank had a gradient for skipped), and the start of its
    gather for the next forward."""
    presence.resolve()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if gather is not None and (started := all_gather_input(unit)) is not None:
        gather.gather_ahead(*started)


def optimizer_in_backward(model: nn.Module, optimizer_class: Callable[..., torch.optim.Optimizer], *,
                          gather_ahead: bool = False, **optimizer_kwargs: Any) -> OptimizerInBackward:
    """Step ``optimizer_class(unit_params, **optimizer_kwargs)`` for each unit of a model sharded
    by zeropp inside backward, as soon as the unit's gradients are reduced; with
    ``gather_ahead``, start the unit's gather for the next forward right after (holding its
    gathered payload until then). See [Note: step in backward]."""
    return OptimizerInBackward(model, optimizer_class, gather_ahead=gather_ahead, **optimizer_kwargs)
