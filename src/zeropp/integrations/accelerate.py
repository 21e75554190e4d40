"""accelerate's own loops (``accelerate launch``, HF's ``*_no_trainer.py`` examples, research code)
on a zeropp-sharded model: see [Note: accelerate on a zeropp model].

    model = zeropp.shard(model, config)                  # before prepare
    accelerator = zeropp.accelerate.attach(Accelerator())
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    ...                                                  # accumulate(), backward(), clip_grad_norm_()
    accelerator.save_state("ckpt")                       # and load_state("ckpt") to resume
    accelerator.unwrap_model(model).save_pretrained(
        "out", is_main_process=accelerator.is_main_process, save_function=accelerator.save,
        state_dict=accelerator.get_state_dict(model))    # from_pretrained("out") loads it without zeropp

[Note: accelerate on a zeropp model]
``zeropp.shard`` and ``zeropp.enable`` mark the model as prepared, so ``accelerator.prepare``
hands it back as it is: no DDP wrapper over FSDP2's DTensor parameters (on CPU accelerate would
add one and fail in its first broadcast), and with accelerate's FSDP2 plugin (on GPUs) its
``fsdp2_prepare_model`` returns at once for a model that is an ``FSDPModule`` already. Training
needs nothing more. Saving does, where accelerate has no FSDP plugin (on CPU it never enables
one): there ``save_state`` writes each model's state dict through safetensors' clean-up, which
reads every tensor's storage (a DTensor has none to read), and writes the optimizers' states from
rank 0 alone (each rank's optimizer holds only its own shards); ``get_state_dict`` returns the
sharded state dict, on which ``save_pretrained`` runs a collective on rank 0 alone and hangs.
``attach`` makes those calls reach zeropp, on the accelerator instance, for zeropp's models only:

- ``save_state(dir)`` / ``load_state(dir)``: each zeropp model and the optimizer over its
  parameters go to a zeropp checkpoint (``dir/zeropp/model_<i>``: DCP, sharded, atomic, verified,
  any world size), every rank taking part; accelerate saves and loads everything else itself
  (schedulers, dataloaders' positions, RNG states, the grad scaler, other models);
- ``get_state_dict(model)`` (also behind ``save_model``): the full state dict, each tensor
  gathered in full precision, on the main process (an empty dict elsewhere), as accelerate's
  FSDP2 path returns it, so ``save_pretrained`` on the main process writes a model
  ``from_pretrained`` loads without zeropp. Every rank must call it (it gathers).

With accelerate's FSDP plugin accelerate's own FSDP2 save and load reach the DTensors, and
``attach`` leaves them. Its DeepSpeed plugin runs DeepSpeed's own engine, which would take the
model from zeropp: ``attach`` refuses it and names the route.

[Note: attached on prepare]
A user who follows accelerate's own docs never calls ``attach``. So the "already prepared" mark
zeropp puts on its models (``mark_prepared``) is an object, not ``True``: accelerate's
``prepare_model`` asks it for its truth value, and at that moment the caller's frame holds the
accelerator, which the mark attaches. ``prepare`` then overwrites the mark with ``True``; the
accelerator is attached by then. For the accelerators that never prepared the model (a model
passed straight to ``get_state_dict``, or an accelerate whose ``prepare_model`` reads the mark
elsewhere), the model's state-dict hooks see accelerate's ``save_state``, ``load_state`` and
``get_state_dict`` among their callers and raise on every rank (each rank calls them), naming
``attach``: the alternative is a storage error on rank 0 or a collective on rank 0 alone, a hang.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

try:
    from accelerate import Accelerator
    from accelerate.utils import DistributedType
except ImportError as error:  # pragma: no cover - exercised only without the extra installed
    raise ImportError("zeropp.accelerate needs accelerate: pip install 'zeropp[hf]'") from error

from zeropp import checkpoint
from zeropp.setup.install import sharded_comms

CHECKPOINT_DIRECTORY = "zeropp"
"""Where ``save_state`` puts zeropp's models and optimizers, inside accelerate's directory."""


def attach(accelerator: Accelerator) -> Accelerator:
    """Make ``accelerator``'s ``save_state``, ``load_state``, ``get_state_dict`` (and so
    ``save_model``) handle zeropp-sharded models ([Note: accelerate on a zeropp model]); returns
    it. Call it once, before or after ``prepare``; other models are left to accelerate."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        raise ValueError(
            "accelerate's DeepSpeed plugin (accelerate launch --use_deepspeed) runs DeepSpeed's own ZeRO engine, which "
            "takes the model from zeropp (and runs ZeRO++'s quantized collectives on CUDA only). Launch without it "
            "and shard with the same file: zeropp.shard(model, zeropp.ZeroPPConfig.from_deepspeed('ds_config.json')) "
            "before accelerator.prepare; or use zeropp.initialize, the DeepSpeed-style engine")
    if accelerator.distributed_type == DistributedType.FSDP or getattr(accelerator, "_zeropp_attached", False):
        return accelerator
    hidden = _Hidden()
    save_state, load_state, get_state_dict = accelerator.save_state, accelerator.load_state, accelerator.get_state_dict

    def save_state_with_zeropp(output_dir: str | None = None, *args: Any, **kwargs: Any) -> Any:
        with hidden.taken_from(accelerator):
            return save_state(output_dir, *args, **kwargs)

    def load_state_with_zeropp(input_dir: str | None = None, *args: Any, **kwargs: Any) -> Any:
        with hidden.taken_from(accelerator):
            return load_state(input_dir, *args, **kwargs)

    def get_state_dict_with_zeropp(model: nn.Module, unwrap: bool = True) -> dict[str, Any]:
        if not is_zeropp_model(model):
            return get_state_dict(model, unwrap)
        return full_state_dict(model, accelerator.is_main_process)

    accelerator.register_save_state_pre_hook(hidden.save)
    accelerator.register_load_state_pre_hook(hidden.load)
    accelerator.save_state, accelerator.load_state = save_state_with_zeropp, load_state_with_zeropp
    accelerator.get_state_dict = get_state_dict_with_zeropp
    accelerator._zeropp_attached = True
    return accelerator


def mark_prepared(model: nn.Module) -> None:
    """Make accelerate's ``prepare`` hand ``model`` back as it is, attach the accelerator that
    prepares it, and refuse by name accelerate's saves and loads from an accelerator that is not
    attached ([Note: attached on prepare])."""
    model._is_accelerate_prepared = _PreparedMark()
    if not getattr(model, "_zeropp_accelerate_guard", False):
        model.register_state_dict_pre_hook(_refuse_unattached)
        model.register_load_state_dict_pre_hook(_refuse_unattached)
        model._zeropp_accelerate_guard = True


class _PreparedMark:
    """accelerate's "already prepared" mark that attaches the accelerator reading it."""

    def __bool__(self) -> bool:
        accelerator = sys._getframe(1).f_locals.get("self")
        if isinstance(accelerator, Accelerator):
            attach(accelerator)
        return True


_ACCELERATE_CALLS = {"save_state", "load_state", "get_state_dict"}
"""accelerate's calls that need ``attach`` to reach a zeropp model's shards."""


def _refuse_unattached(*_: Any) -> None:
    """A state-dict hook: raise if an accelerator that is not attached is what asks."""
    frame = sys._getframe(1)
    while frame is not None:
        accelerator = frame.f_locals.get("self")
        if frame.f_code.co_name in _ACCELERATE_CALLS and isinstance(accelerator, Accelerator):
            if getattr(accelerator, "_zeropp_attached", False) or accelerator.distributed_type == DistributedType.FSDP:
                return
            raise ValueError(
                f"accelerator.{frame.f_code.co_name} on a zeropp-sharded model needs zeropp's checkpoint path: "
                "call accelerator = zeropp.accelerate.attach(accelerator) (or pass the model through "
                "accelerator.prepare, which attaches it); without it accelerate would save every rank's "
                "shards from rank 0 alone")
        frame = frame.f_back


def is_zeropp_model(model: nn.Module) -> bool:
    """Whether ``model`` (or the model inside an accelerate wrapper) was set up by zeropp."""
    return any(sharded_comms(module).plan is not None for module in model.modules())


class _Hidden:
    """zeropp's models and their optimizers, taken out of accelerate's lists while its
    ``save_state`` / ``load_state`` runs, and saved or loaded by its pre-hooks, which run inside
    those calls with the directory accelerate resolved."""

    def __init__(self) -> None:
        self.pairs: list[tuple[nn.Module, torch.optim.Optimizer | None]] = []

    @contextlib.contextmanager
    def taken_from(self, accelerator: Accelerator) -> Iterator[None]:
        models, optimizers = list(accelerator._models), list(accelerator._optimizers)
        ours = [model for model in models if is_zeropp_model(model)]
        self.pairs = [(model, _optimizer_of(model, optimizers)) for model in ours]
        taken = {id(optimizer) for _, optimizer in self.pairs}
        accelerator._models[:] = [model for model in models if not is_zeropp_model(model)]
        accelerator._optimizers[:] = [opt for opt in optimizers if id(_inner(opt)) not in taken]
        try:
            yield
        finally:
            accelerator._models[:], accelerator._optimizers[:] = models, optimizers
            self.pairs = []

    def save(self, models: list[nn.Module], weights: list[dict[str, Any]], output_dir: str) -> None:
        for index, (model, optimizer) in enumerate(self.pairs):
            checkpoint.save(Path(output_dir) / CHECKPOINT_DIRECTORY, f"model_{index}", model=model,
                            optimizer=optimizer)

    def load(self, models: list[nn.Module], input_dir: str) -> None:
        for index, (model, optimizer) in enumerate(self.pairs):
            checkpoint.load(Path(input_dir) / CHECKPOINT_DIRECTORY, f"model_{index}", model=model,
                            optimizer=optimizer)


def _inner(optimizer: Any) -> torch.optim.Optimizer:
    """The optimizer inside accelerate's ``AcceleratedOptimizer``."""
    return getattr(optimizer, "optimizer", optimizer)


def _optimizer_of(model: nn.Module, optimizers: list[Any]) -> torch.optim.Optimizer | None:
    """The optimizer over ``model``'s parameters, if one of ``optimizers`` is (the first)."""
    params = {id(p) for p in model.parameters()}
    for optimizer in optimizers:
        inner = _inner(optimizer)
        if any(id(p) in params for group in inner.param_groups for p in group["params"]):
            return inner
    return None


@torch.no_grad()
def full_state_dict(model: nn.Module, keep: bool) -> dict[str, torch.Tensor]:
    """``model``'s state dict with every tensor gathered whole, in full precision, on the CPU: in
    a dict on the process that ``keep``s it, an empty dict elsewhere (collective: every rank
    gathers every sharded tensor, once per tensor, tied names sharing it)."""
    full: dict[str, torch.Tensor] = {}
    seen: dict[int, str] = {}
    for name, value in model.state_dict(keep_vars=True).items():
        if id(value) in seen:
            if keep:
                full[name] = full[seen[id(value)]]
            continue
        seen[id(value)] = name
        tensor = value.full_tensor() if isinstance(value, DTensor) else value
        if keep:
            full[name] = tensor.detach().to("cpu").clone()
    return full
