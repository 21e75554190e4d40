"""The optimizer on the host (ZeRO-Offload's form, DeepSpeed's ``offload_optimizer`` alone): the
parameter shards stay on the device, in the model's dtype, and gather as they always do; an fp32
master copy of each shard and the optimizer's state live in host memory, and the step runs there.

[Note: the optimizer on the host]
FSDP2's ``CPUOffloadPolicy`` moves the parameter shards themselves to the host (so the optimizer
steps there as a consequence); it has nothing for keeping the weights on the device and only the
optimizer away. ``HostOptimizer`` does that around any ``torch.optim`` optimizer class:

- ``param_groups`` hold the model's (device) parameters, as any optimizer's do, so learning-rate
  schedules, gradient clipping and DCP's ``get_state_dict`` see an ordinary optimizer;
- each parameter has an fp32 master of its local shard on the host; the wrapped optimizer (the
  same class, built over the masters with the same hyper-parameters) keeps its state beside it;
- ``step`` copies each local gradient shard to the host in fp32, syncs the hyper-parameters
  (a schedule changed ``lr`` on ``param_groups``), steps the wrapped optimizer, and copies each
  updated master back into its device shard, cast to the shard's dtype. With a bf16 model the
  device holds bf16 shards and the host their fp32 masters, DeepSpeed's arrangement.

For a checkpoint the state, the master included, is shown to DCP as DTensors laid out like the
parameter (``DTensor.from_local`` over the host tensors, no copy), so each rank saves its own
shard and a load reshards; ``load_state_dict`` copies what DCP loaded into the host tensors.
On CPU ranks host and device are one memory: the steps equal the plain optimizer's bit for bit.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

_MASTER = "master"
"""The state entry holding a parameter's fp32 master shard."""


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _like(parameter: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
    """``host`` (a tensor of the parameter's local shape, or a scalar) as DCP must see it: a
    DTensor laid out as ``parameter`` where it is one, sharing the host tensor's memory."""
    if not isinstance(parameter, DTensor) or host.dim() == 0:
        return host
    return DTensor.from_local(host, parameter.device_mesh, parameter.placements, run_check=False,
                              shape=parameter.shape, stride=parameter.stride())


class _State(collections.defaultdict):
    """``HostOptimizer.state``: clearing it clears the host optimizer's state too, so that an
    optimizer emptied again after DCP's first-step fill (``zeropp.checkpoint``'s [Note: optimizer
    state before the first step]) is as empty as before."""

    def __init__(self, host: torch.optim.Optimizer) -> None:
        super().__init__(dict)
        self.host = host

    def clear(self) -> None:
        super().clear()
        self.host.state.clear()


class HostOptimizer(torch.optim.Optimizer):
    """``optimizer_class`` stepping fp32 master shards on the host for the device parameters in
    ``params`` (see [Note: the optimizer on the host])."""

    def __init__(self, params: Iterable[Any], optimizer_class: type[torch.optim.Optimizer],
                 **defaults: Any) -> None:
        super().__init__(params, defaults)
        self.optimizer_class = optimizer_class
        self.masters = {p: _local(p).detach().to("cpu", torch.float32, copy=True)
                        for group in self.param_groups for p in group["params"]}
        host_groups = [{**self._hyper_parameters(group), "params": [self.masters[p] for p in group["params"]]}
                       for group in self.param_groups]
        self.host = optimizer_class(host_groups)  # each group carries every hyper-parameter
        self.state = _State(self.host)

    @classmethod
    def wrapping(cls, optimizer: torch.optim.Optimizer) -> HostOptimizer:
        """The same optimizer (class, groups, hyper-parameters) moved to the host; it must not have
        stepped yet (its state would be left behind)."""
        if isinstance(optimizer, HostOptimizer):
            return optimizer
        if optimizer.state:
            raise ValueError(f"{type(optimizer).__name__} already has state; offload it before its first step")
        return cls(optimizer.param_groups, type(optimizer), **optimizer.defaults)

    @staticmethod
    def _hyper_parameters(group: dict[str, Any]) -> dict[str, Any]:
        return {key: value for key, value in group.items() if key != "params"}

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, host_group in zip(self.param_groups, self.host.param_groups):
            host_group.update(self._hyper_parameters(group))
            for p in group["params"]:
                master = self.masters[p]
                master.grad = None if p.grad is None else _local(p.grad).to("cpu", torch.float32)
        self.host.step()
        for group in self.param_groups:
            for p in group["params"]:
                master = self.masters[p]
                if master.grad is not None:
                    _local(p).copy_(master)
                    master.grad = None
                self._show_state(p)
        return loss

    def _show_state(self, p: torch.Tensor) -> None:
        """``self.state[p]``: the host optimizer's state of ``p``'s master and the master itself,
        as DCP must see them (``_like``)."""
        host_state = self.host.state.get(self.masters[p], {})
        self.state[p] = {**{key: _like(p, value) if torch.is_tensor(value) else value
                            for key, value in host_state.items()},
                         _MASTER: _like(p, self.masters[p])}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Copy a saved state (this class's ``state_dict``, or DCP's view of it) into the host
        tensors: masters, then the wrapped optimizer's state; then the hyper-parameters."""
        parameters = [p for group in self.param_groups for p in group["params"]]
        saved_keys = [key for group in state_dict["param_groups"] for key in group["params"]]
        if len(saved_keys) != len(parameters):
            raise ValueError(f"the saved optimizer state has {len(saved_keys)} parameters, this optimizer "
                             f"{len(parameters)}: load a state saved for the same parameters")
        index_of = {key: index for index, key in enumerate(saved_keys)}  # ids, or DCP's names, by position
        host_state: dict[int, dict[str, Any]] = {}
        for key, saved in state_dict["state"].items():
            index = index_of[key]
            p, saved = parameters[index], dict(saved)
            if _MASTER in saved:
                self.masters[p].copy_(_local(saved.pop(_MASTER)).to("cpu", torch.float32))
                _local(p).copy_(self.masters[p])
            host_state[index] = {name: _local(value).to("cpu") if torch.is_tensor(value) else value
                                 for name, value in saved.items()}
        indices = iter(range(len(parameters)))
        groups = [{**saved, "params": [next(indices) for _ in group["params"]]}
                  for saved, group in zip(state_dict["param_groups"], self.param_groups)]
        self.host.load_state_dict({"state": host_state, "param_groups": groups})
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update({key: value for key, value in saved.items() if key != "params"})
        dict.clear(self.state)
        for p in parameters:
            if self.masters[p] in self.host.state:
                self._show_state(p)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state with each parameter's master, keyed as ``param_groups``."""
        for group in self.param_groups:
            for p in group["params"]:
                if self.masters[p] in self.host.state:
                    self._show_state(p)
        return super().state_dict()


def offload_optimizer(optimizer: torch.optim.Optimizer) -> HostOptimizer:
    """Move ``optimizer`` (built over a zeropp model's parameters, not yet stepped) to the host:
    its state and an fp32 master of each shard live in host memory and its step runs there,
    while the parameters stay on the device ([Note: the optimizer on the host])."""
    return HostOptimizer.wrapping(optimizer)
