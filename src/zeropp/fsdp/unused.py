"""Parameters that have a gradient on some ranks and not on others: see [Note: gradients some
ranks lack].

[Note: gradients some ranks lack]
FSDP2 reduce-scatters only the parameters that hold a gradient on this rank. When ranks differ
(a top-1 mixture of experts whose expert got no token on one rank, a vision tower some ranks
skip, any branch taken by some ranks only), their reduce-scatter inputs differ in size: gloo
aborts ("Received data size doesn't match expected size"), NCCL hangs or mixes gradients, for
plain ``fully_shard`` as for every technique. One process on the whole batch would give such a
parameter the mean over every sample, which is the mean over the ranks with zeros where a rank
had none; a parameter no sample reached keeps no gradient, so the optimizer skips it.

zeropp gives that result. Before a unit's gradients are reduce-scattered, every trainable
parameter without a gradient on this rank gets a zero one, so every rank sends the same
parameters and the reduction (AVG: divided by the world size) is the one-process mean. With it,
one byte per parameter says whether this rank had a gradient of its own; it is max-reduced over
the ranks the unit's gradients are reduced over (its shard group asynchronously, beside the
reduce-scatter, then HSDP's replicas), and read when the gradients are next used
(at the end of backward, or before ``optimizer_in_backward`` steps the unit): a parameter no
rank had a gradient for gets ``None`` back, unless it held one already (accumulation). The usual
case, every rank with every gradient, costs that one byte per parameter and nothing else. With
qgZ's error feedback, a parameter no rank has a gradient for skips the step even where the
residual carried from earlier steps would have moved it.

Only units the backward reached on this rank and that train something take part: FSDP2 also
calls the post-backward of units no backward reached (a head used only to sample), and those
send nothing, as before. A
unit must run its forward and backward on every rank (its gathers and reduce-scatter are
collectives); the parameters inside it may be used by any subset of ranks. 0-dim parameters,
kept outside FSDP2 (``zeropp.fsdp.scalars``), must have a gradient on every rank.

The exchange runs over those ranks and no others: under pipeline parallelism a stage's units run
their backward on the stage's ranks only (the schedule's first backward reaches the last stage's
units alone), and a world-wide exchange would wait there for ranks that never join it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zeropp.fsdp.access import (
    FSDPModule,
    at_backward_end,
    before_gradient_reduction,
    give_zero_gradients,
    gradients_present,
    reached_in_backward,
    unit_parameters,
)
from zeropp.fsdp.comms import Recorder, all_reduce

TECHNIQUE = "presence"
"""Ledger label of the byte-per-parameter exchange."""


class GradientPresence:
    """One unit's gradients made the same on every rank before they are reduce-scattered: see
    [Note: gradients some ranks lack]."""

    def __init__(self, unit: FSDPModule, recorder: Recorder, group: dist.ProcessGroup | None,
                 replicas: dist.ProcessGroup | None = None) -> None:
        self.unit = unit
        self.recorder = recorder
        self.group, self.replicas = group, replicas
        """The unit's shard group, and HSDP's replicate group (None: the unit has no replicas)."""
        self._pending: tuple[dist.Work | None, torch.Tensor, list[bool]] | None = None
        before_gradient_reduction(unit, self.before_reduction)

    def before_reduction(self) -> None:
        """Zero gradients where this rank has none, and start asking which ranks had one."""
        params = unit_parameters(self.unit)
        if not reached_in_backward(self.unit) or not any(p.requires_grad for p in params):
            return
        self.resolve()  # a backward that ended without its callback (it raised) left one pending
        present = gradients_present(self.unit)
        give_zero_gradients(self.unit, [p.requires_grad and not has for p, has in zip(params, present)])
        flags = torch.tensor(present, dtype=torch.uint8, device=params[0].device)
        work = all_reduce(flags, dist.ReduceOp.MAX, self.group, self.recorder, TECHNIQUE, async_op=True)
        self._pending = (work, flags, [p.grad is None for p in params])
        at_backward_end(self.resolve)

    def resolve(self) -> None:
        """Take the gradient away again from parameters no rank had one for (and that held none
        before this backward); a no-op when nothing is pending."""
        if self._pending is None:
            return
        work, flags, had_none = self._pending
        self._pending = None
        if work is not None:
            work.wait()
        if self.replicas is not None:
            all_reduce(flags, dist.ReduceOp.MAX, self.replicas, self.recorder, TECHNIQUE)
        for param, anywhere, none_before in zip(unit_parameters(self.unit), flags.tolist(), had_none):
            if not anywhere and none_before:
                param.grad = None
