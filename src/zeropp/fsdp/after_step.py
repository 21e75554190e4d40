"""The next forward's first gathers started as soon as the optimizer step ends, in the user's own
loop: see [Note: gathers after the step].

[Note: gathers after the step]
A training step ends with the optimizer step and the next one begins with the root's gather and
the first blocks' (FSDP2's forward prefetch, [Note: prefetch] in ``zeropp.setup.install``). The
weights those gathers move are final once the step returns, so nothing stops them from starting
then: whatever the loop does before its next forward (the learning-rate schedule, zeroing the
gradients, logging, loading the next batch) runs while they cross the link. zeropp registers one
global hook on ``torch.optim.Optimizer``'s step (``register_optimizer_step_post_hook``, so any
optimizer, however wrapped: a stock loop, zeropp's engine, accelerate's optimizer inside the HF
Trainer or Lightning's), and when an optimizer holding a sharded model's parameters has stepped,
it starts, for the units the next forward gathers first (the root and the blocks the root
prefetches), the gather FSDP2 will ask for ([Note: gathers ahead] in ``zeropp.fsdp.comms``).
The forward takes each if its input is equal, element for element, to the one FSDP2 then builds,
so an edit or a checkpoint load in between is seen and gathered afresh; the bytes and the
weights are those of the gathers they replace, so training is the same bit for bit.

Rules, so that every rank issues the same collectives in the same order: the hook fires on every
rank's ``optimizer.step()`` as the step itself does; a step inside backward (``zeropp.optimizer_in_
backward``, which starts its own gathers ahead) starts nothing; a step before the model's first
forward (DCP's ``get_state_dict`` steps an optimizer with zero gradients to build its state)
starts nothing; units not resharded (a unit kept whole) and units whose shards live on the host
(``offload="cpu"``) are skipped, as their forward does not gather from the device shards. What it costs: the
payloads of those few units held from the step to the forward, which the forward would hold a
moment later anyway. A job that ends after a step leaves them in flight. Before the process
group goes, zeropp waits for them, meets the other ranks in a barrier, and then waits until the
backend's threads have let go of their tensors ([Note: the backend lets go after the wait] in
``zeropp.fsdp.comms``): a rank whose last release of such a tensor fell to a gloo thread during
the interpreter's finalization aborted ("terminate called without an active exception"). It
does so at exit (an ``atexit`` hook) and, as most scripts end by destroying the process group
before that hook runs, inside ``torch.distributed.destroy_process_group`` when the default group
goes, which zeropp wraps once it has a model (torch has no hook on the group's end; a subgroup's
destroy, and torch's own callers inside ``distributed_c10d``, are left as they are); the wrapper
does nothing more when no gather is in flight. ``comms`` notes every gather started ahead with
its work and tensors, holding its comm weakly, so they are found whatever became of the model
(out of reach with the function that trained it, or freed), and with them those
``zeropp.optimizer_in_backward(..., gather_ahead=True)`` started in the last backward. Neither
runs while an exception propagates, nor at the exit of a script that ended with one: its peers
may be inside another collective, and a rank that failed must exit at once.
"""

from __future__ import annotations

import atexit
import functools
import logging
import sys
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from zeropp.fsdp.access import CommGroup, all_gather_input, in_backward, is_initialized, is_resharded
from zeropp.fsdp.comms import GatherAhead, barrier, finish_gathers_ahead, gathers_ahead_in_flight, wait_until_let_go

AheadUnits = Callable[[], Sequence[tuple[CommGroup, Any]]]
"""A model's units gathered first in forward, each with its current all-gather comm."""

_MODELS: weakref.WeakKeyDictionary[nn.Module, tuple[frozenset[int], AheadUnits]] = weakref.WeakKeyDictionary()
_ON_STEP: weakref.WeakKeyDictionary[nn.Module, tuple[frozenset[int], Callable[[torch.optim.Optimizer], None]]] = \
    weakref.WeakKeyDictionary()
_STEPPED_IN_BACKWARD: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_hook: Any = None
logger = logging.getLogger(__name__)


def gather_after_step(model: nn.Module, units: AheadUnits | None) -> None:
    """Start ``units()``' gathers whenever an optimizer holding ``model``'s parameters has stepped
    ([Note: gathers after the step]); None stops it for ``model``."""
    if units is None:
        _MODELS.pop(model, None)
        return
    _MODELS[model] = (frozenset(id(p) for p in model.parameters()), units)
    _install_hook()


def on_step(model: nn.Module, callback: Callable[[torch.optim.Optimizer], None]) -> None:
    """Call ``callback(optimizer)`` right after every step of an optimizer holding ``model``'s
    parameters, inside backward too (``zeropp.optimizer_in_backward``): the weights' differences
    (``zeropp.techniques.deltas``) learn of a step so, which its version counters may not show
    (foreach and fused optimizers write DTensor parameters without bumping them)."""
    _ON_STEP[model] = (frozenset(id(p) for p in model.parameters()), callback)
    _install_hook()


def _install_hook() -> None:
    global _hook
    if _hook is None:
        _hook = register_optimizer_step_post_hook(_after_step)
        atexit.register(_finish_at_exit)
        dist.destroy_process_group = _finish_before(dist.destroy_process_group)


def _holds(optimizer: torch.optim.Optimizer, param_ids: frozenset[int]) -> bool:
    return any(id(p) in param_ids for group in optimizer.param_groups for p in group["params"])


def _finish_started() -> None:
    """Finish the gathers started ahead (after the last step, or inside its backward), let no
    rank close its connections while a peer may still be receiving one, and wait until the
    backend has let go of their tensors ([Note: gathers after the step])."""
    if not gathers_ahead_in_flight():
        return
    try:
        held = finish_gathers_ahead()
        barrier()
    except RuntimeError as error:  # a peer already gone: nothing is left to receive from it
        logger.debug("zeropp: the gathers started by the last step ended with: %s", error)
        return
    if not wait_until_let_go(held):
        logger.debug("zeropp: the backend still held tensors of the last step's gathers after 5 s")


def _finish_at_exit() -> None:
    """The exit's finish, unless the script ended with an uncaught exception."""
    if getattr(sys, "last_value", None) is None and dist.is_initialized():
        _finish_started()


def _finish_before(destroy: Callable[..., None]) -> Callable[..., None]:
    """``torch.distributed.destroy_process_group``, finishing the gathers started ahead first when
    the default group goes (every group with it), unless an exception is propagating."""
    @functools.wraps(destroy)
    def destroy_process_group(group: dist.ProcessGroup | None = None) -> None:
        if (group is None or group is dist.GroupMember.WORLD) and dist.is_initialized() and \
                sys.exc_info()[1] is None:
            _finish_started()
        destroy(group)
    return destroy_process_group


def steps_in_backward(optimizer: torch.optim.Optimizer) -> None:
    """Mark ``optimizer`` as one stepped inside backward: its steps start nothing here (the gathers
    it starts ahead are finished before the process group goes all the same)."""
    _STEPPED_IN_BACKWARD.add(optimizer)
    _install_hook()


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for param_ids, callback in list(_ON_STEP.values()):
        if _holds(optimizer, param_ids):
            callback(optimizer)
    if in_backward() or optimizer in _STEPPED_IN_BACKWARD:
        return
    for model, (param_ids, units) in list(_MODELS.items()):
        if not is_initialized(model) or not _holds(optimizer, param_ids):
            continue  # a step before the first forward (DCP's optimizer-state init) starts nothing
        for group, all_gather in units():
            if isinstance(all_gather, GatherAhead) and is_resharded(group) and \
                    (started := all_gather_input(group)) is not None:
                all_gather.gather_ahead(*started)


def ahead_bytes(model: nn.Module) -> int:
    """Bytes ``model``'s gathers started after the step hold until its forward takes them."""
    entry = _MODELS.get(model)
    return 0 if entry is None else sum(g.ahead_bytes for _, g in entry[1]() if isinstance(g, GatherAhead))
