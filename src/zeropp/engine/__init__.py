"""``zeropp.initialize``: the DeepSpeed-style engine over a model sharded by ``zeropp.shard``.

A DeepSpeed user keeps their config file and their loop::

    engine, optimizer, _, scheduler = zeropp.initialize(model=model, config="ds_config.json")
    for batch in loader:
        loss = engine(batch); engine.backward(loss); engine.step()

``engine.step()`` is called after every micro-batch and steps the optimizer only at the
gradient-accumulation boundary, as DeepSpeed's does. Between boundaries FSDP2 keeps the
unsharded gradients locally (``set_requires_gradient_sync(False)``) and the boundary's
backward reduce-scatters their sum once, so accumulation costs no extra communication (the
price: each unit keeps its unsharded gradient in memory between micro-steps). At a boundary: one
all-reduce gives the global gradient norm and whether any rank saw a non-finite element; fp16
skips the step on overflow (and resets qgZ's error feedback), otherwise gradients are unscaled
and clipped, the optimizer and the schedule step.

Timeouts: ``timeout_s`` (argument) or the environment variable ``ZEROPP_TIMEOUT_S`` sets how long
any collective of this process waits for a peer before raising (default: the backend's, 30 min
for gloo, 10 min for NCCL), so a dead or hung rank surfaces as an error.

Beside it in this package: fp16 loss scaling (``loss_scaler``), DeepSpeed's learning-rate schedules
(``lr_schedules``), the random-number state a checkpoint resumes (``rng``), and the rest of
DeepSpeedEngine's interface: its accessors, and for each name zeropp lacks, what to use instead
(``deepspeed_api``).
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from zeropp import checkpoint
from zeropp.config import DeepSpeedConfig, parse_deepspeed
from zeropp.engine.deepspeed_api import DeepSpeedInterface
from zeropp.engine.loss_scaler import LossScaler
from zeropp.engine.lr_schedules import build_scheduler
from zeropp.engine.rng import rng_state, set_rng_state
from zeropp.fsdp.access import set_process_group_timeouts
from zeropp.fsdp.comms import collective_timeout_s, global_grad_norm_and_overflow
from zeropp.fsdp.ledger import comm_ledger
from zeropp.fsdp.offload import offload_optimizer
from zeropp.setup.explain import Explanation, explain
from zeropp.setup.sharding import UnitSpec, enable, shard, sharded_comms
from zeropp.setup.topology import Topology
from zeropp.techniques.audit import ReportCursor, audit_log_line
from zeropp.techniques.qgz import HierarchicalQuantizedReduceScatter

logger = logging.getLogger("zeropp")

def qgz_comms(model: nn.Module) -> list[HierarchicalQuantizedReduceScatter]:
    """The qgZ reduce-scatter comm of every sharded unit of ``model`` that has one."""
    return sharded_comms(model).qgz


def _owned_grads(params: list[torch.Tensor], grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients this rank owns for a global norm: its shards of every sharded parameter, and
    the whole (replicated, equal on every rank) gradients of 0-dim parameters on rank 0 only."""
    rank = dist.get_rank()
    return [g for p, g in zip(params, grads) if isinstance(p, DTensor) or rank == 0]


class ZeroPPEngine(DeepSpeedInterface):
    """Forward, backward with accumulation and loss scaling, optimizer step with clipping,
    schedule, logging and checkpoints: DeepSpeed's engine interface on a zeropp-sharded model."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, lr_scheduler: Any,
                 config: DeepSpeedConfig, topology: Topology) -> None:
        self.module, self.optimizer, self.lr_scheduler = module, optimizer, lr_scheduler
        self.config, self.topology = config, topology
        training = config.training
        self._train_batch, self._micro_batch, self._accumulation = training.resolve_batch(topology.world_size)
        self.loss_scaler = LossScaler.from_config(training) if training.fp16 else None
        self.global_steps = 0
        self.global_samples = 0
        """Samples trained on, over all ranks: the global batch size summed over optimizer steps."""
        self.micro_steps = 0
        self.skipped_steps = 0
        self.last_grad_norm: float | None = None
        """The global gradient norm (unscaled, before clipping) of the last boundary."""
        self._step_applied = False
        self._boundary_override: bool | None = None
        """``set_gradient_accumulation_boundary``'s word, which wins over counting micro-steps."""
        self._inside_no_sync = False
        self._backwards_since_step = 0
        self._last_backward_reduced = True
        module.set_requires_gradient_sync(True)
        self._gradient_sync = True
        """What the module's units were last told by ``set_requires_gradient_sync``."""
        self._device = next(module.parameters()).device
        self._loss_sum = torch.zeros((), dtype=torch.float32, device=self._device)
        self._timings = {"forward": 0.0, "backward": 0.0, "step": 0.0}
        self._ledger = comm_ledger()
        self._audit = ReportCursor(module)

    # -- the training loop ------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        output = self.module(*args, **kwargs)
        self._timings["forward"] += time.perf_counter() - started
        return output

    forward = __call__

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro-step ends an accumulation window (``step`` will update):
        every ``gradient_accumulation_steps``-th one, unless ``set_gradient_accumulation_boundary``
        said otherwise."""
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self._accumulation == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Say from outside whether the coming backward and ``step`` end the window, instead of
        counting micro-steps (accelerate says it before every backward and calls ``step`` at the
        boundary only). It holds until said again, as in DeepSpeed."""
        self._boundary_override = is_boundary

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside keep their gradients on this rank, unreduced (FSDP2 can, so
        zeropp allows what DeepSpeed refuses under ZeRO-3); the next backward outside reduces
        the sum once. ``step`` may not be called inside."""
        if self._inside_no_sync:
            raise RuntimeError("engine.no_sync() entered again inside itself; it does not nest")
        self._inside_no_sync = True
        try:
            yield
        finally:
            self._inside_no_sync = False

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> None:
        """Backpropagate ``loss / gradient_accumulation_steps`` (undivided with ``scale_wrt_gas``
        False; times the loss scale in fp16); gradients are reduced across ranks only in the
        boundary's backward, and never inside ``no_sync``."""
        started = time.perf_counter()
        reduce = self.is_gradient_accumulation_boundary() and not self._inside_no_sync
        if reduce != self._gradient_sync:
            self.module.set_requires_gradient_sync(reduce)
            self._gradient_sync = reduce
        scaled = loss / self._accumulation if scale_wrt_gas else loss
        if self.loss_scaler is not None:
            scaled = scaled.float() * self.loss_scaler.scale
        scaled.backward(retain_graph=retain_graph)
        self._loss_sum += loss.detach().float() / self._accumulation
        self._backwards_since_step += 1
        self._last_backward_reduced = reduce
        self._timings["backward"] += time.perf_counter() - started

    def step(self) -> None:
        """Call after every ``backward``: at a boundary, update the parameters (unless fp16
        overflowed), step the schedule and log; otherwise only count the micro-step."""
        if self._inside_no_sync:
            raise RuntimeError("engine.step() inside engine.no_sync(): leave the context and run the "
                               "window's last backward outside it, so that the gradients are reduced")
        if self.is_gradient_accumulation_boundary():
            if not self._last_backward_reduced:
                raise RuntimeError("engine.step() at an accumulation boundary, but the last backward did "
                                   "not reduce the gradients (it ran before the boundary or inside "
                                   "no_sync): run the window's last backward at the boundary")
            started = time.perf_counter()
            self._take_step()
            self.global_steps += 1
            self.global_samples += self._train_batch
            self._backwards_since_step = 0
            self._ledger.step()
            self._timings["step"] += time.perf_counter() - started
            if self.global_steps % self.config.training.steps_per_print == 0:
                self._log()
            self._loss_sum.zero_()
        self.micro_steps += 1

    def _take_step(self) -> None:
        params = [p for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
        norm, overflow = global_grad_norm_and_overflow(_owned_grads(params, grads), self.topology, self._device)
        self.last_grad_norm = norm / (self.loss_scaler.scale if self.loss_scaler else 1.0)
        self._step_applied = not (overflow and self.loss_scaler is not None)
        if not self._step_applied:
            self.skipped_steps += 1
            for comm in qgz_comms(self.module):
                comm.reset_error_feedback()  # the residuals hold this step's overflowed values
            if dist.get_rank() == 0:
                logger.warning("zeropp: fp16 gradient overflow at step %d, step skipped, loss scale %g",
                               self.global_steps + 1, self.loss_scaler.scale)
        else:
            factor = self._gradient_factor()
            if factor != 1.0:
                for grad in grads:
                    grad.mul_(factor)
            self.optimizer.step()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow)
        self.optimizer.zero_grad(set_to_none=True)

    def _gradient_factor(self) -> float:
        """1/loss scale, times the clipping coefficient torch's ``clip_grad_norm_`` would use."""
        factor = 1.0 / self.loss_scaler.scale if self.loss_scaler else 1.0
        clip = self.config.training.gradient_clipping
        if clip > 0 and self.last_grad_norm is not None:
            norm = torch.tensor(self.last_grad_norm, dtype=torch.float32)
            factor *= torch.clamp(clip / (norm + 1e-6), max=1.0).item()
        return factor

    def _log(self) -> None:
        if dist.get_rank() != 0:
            return
        scale = f" loss_scale={self.loss_scaler.scale:g}" if self.loss_scaler else ""
        norm = f" grad_norm={self.last_grad_norm:.4g}" if self.last_grad_norm is not None else ""
        logger.info("zeropp: step=%d skipped=%d lr=%s loss(rank 0)=%.5g%s%s", self.global_steps,
                    self.skipped_steps, [f"{lr:.3e}" for lr in self.get_lr()], self._loss_sum.item(),
                    scale, norm)
        for row in self._audit.new_rows():  # [Note: the audit]: ZeroPPConfig.audit_every
            logger.info(audit_log_line(row))
        if self.config.training.wall_clock_breakdown:
            logger.info("zeropp: time (s, since start) %s",
                        " ".join(f"{name}={seconds:.3f}" for name, seconds in self._timings.items()))

    # -- the model's state between steps --------------------------------------------------------

    def zero_grad(self) -> None:
        """Drop every gradient (``step`` does so itself at each boundary)."""
        self.optimizer.zero_grad(set_to_none=True)

    def train(self, mode: bool = True) -> ZeroPPEngine:
        """Put the model in training (or, with False, evaluation) mode."""
        self.module.train(mode)
        return self

    def eval(self) -> ZeroPPEngine:
        """Put the model in evaluation mode."""
        return self.train(False)

    def was_step_applied(self) -> bool:
        """Whether the last boundary updated the parameters (False after an fp16 overflow)."""
        return self._step_applied

    @property
    def loss_scale(self) -> float:
        """The fp16 loss scale now (1 without fp16). DeepSpeed's ``loss_scale()`` is a method
        returning the configured static scale; here it is the scale in use."""
        return self.loss_scaler.scale if self.loss_scaler else 1.0

    def comm_report(self) -> str:
        """The ledger's per-step table of this rank's communication; rank 0 also prints it."""
        table = self._ledger.table()
        if dist.get_rank() == 0:
            print(table)
        return table

    def explain(self) -> Explanation:
        """What zeropp does to the engine's model, unit by unit (``zeropp.explain``); rank 0 also
        prints it."""
        explanation = explain(self.module)
        if dist.get_rank() == 0:
            print(explanation)
        return explanation

    # -- checkpoints ----------------------------------------------------------------------------

    def save_checkpoint(self, save_dir: str | os.PathLike[str], tag: str | None = None,
                        client_state: dict[str, Any] | None = None) -> Path:
        """Save everything needed to resume exactly (see ``zeropp.checkpoint``) as
        ``save_dir/<tag>`` (default ``global_step<N>``), then point ``save_dir/latest`` at it.
        ``client_state`` (JSON-serialisable, e.g. the data position) comes back from
        ``load_checkpoint``. Call it on every rank, at an accumulation boundary."""
        if self._backwards_since_step:
            raise RuntimeError(f"save_checkpoint after {self._backwards_since_step} backward pass(es) since the "
                               f"last optimizer step, inside an accumulation window of {self._accumulation}: "
                               "save after the boundary's step()")
        engine_state = {
            "global_steps": self.global_steps, "global_samples": self.global_samples,
            "micro_steps": self.micro_steps,
            "skipped_steps": self.skipped_steps,
            "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler else None,
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
            "client_state": client_state if client_state is not None else {},
        }
        return checkpoint.save(save_dir, tag or f"global_step{self.global_steps}", model=self.module,
                               optimizer=self.optimizer, engine_state=engine_state, rank_state=rng_state())

    def load_checkpoint(self, load_dir: str | os.PathLike[str], tag: str | None = None
                        ) -> tuple[Path | None, dict[str, Any] | None]:
        """Restore a checkpoint (``load_dir/latest`` if no tag), saved at any world size or
        ZeRO++ setting. Returns (its path, the client_state), or (None, None) without ``latest``.
        RNG states are restored only for ranks that existed when it was saved."""
        loaded = checkpoint.load(load_dir, tag, model=self.module, optimizer=self.optimizer)
        if loaded is None:
            logger.warning("zeropp: no %s in %s: nothing loaded", checkpoint.LATEST, load_dir)
            return None, None
        state = loaded.engine_state
        self.global_steps, self.micro_steps = state["global_steps"], state["micro_steps"]
        self.global_samples = state.get("global_samples", self.global_steps * self._train_batch)
        self._backwards_since_step = 0
        self.skipped_steps = state["skipped_steps"]
        if self.loss_scaler is not None and state["loss_scaler"] is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        if self.lr_scheduler is not None and state["lr_scheduler"] is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        if loaded.rank_state is not None:
            set_rng_state(loaded.rank_state)
        else:
            logger.warning("zeropp: %s was saved by %d ranks; rank %d keeps its current RNG state",
                           loaded.path, loaded.saved_world_size, dist.get_rank())
        with_feedback = [comm for comm in qgz_comms(self.module) if comm.error_feedback]
        for comm in with_feedback:
            comm.reset_error_feedback()
        if with_feedback:
            logger.warning("zeropp: qgZ error-feedback residuals are not saved in checkpoints (each "
                           "rank's is as large as the unsharded gradient in fp32); they restart from "
                           "zero, so training resumed from %s is not bit-identical to an uninterrupted "
                           "run", loaded.path)
        self.optimizer.zero_grad(set_to_none=True)
        return loaded.path, state["client_state"]

    def resume_if_possible(self, load_dir: str | os.PathLike[str]) -> bool:
        """Load ``load_dir/latest`` if it exists (e.g. after torchrun restarted the job)."""
        return self.load_checkpoint(load_dir)[0] is not None


# -- initialize ---------------------------------------------------------------------------------

OptimizerArg = torch.optim.Optimizer | Callable[[Any], torch.optim.Optimizer] | None


def initialize(*, model: nn.Module, config: dict[str, Any] | str | os.PathLike[str],
               model_parameters: Iterable[Any] | None = None, optimizer: OptimizerArg = None,
               lr_scheduler: Any = None, topology: Topology | None = None,
               units: UnitSpec | None = None, timeout_s: float | None = None
               ) -> tuple[ZeroPPEngine, torch.optim.Optimizer, None, Any]:
    """DeepSpeed's ``initialize``: returns (engine, optimizer, None, lr_scheduler).

    Initialises torch.distributed from the torchrun environment if needed (NCCL for a CUDA
    model, else gloo; one process without torchrun), shards ``model`` with ``zeropp.shard``
    (unless it already is an FSDP module), and builds the optimizer from the config's
    ``optimizer`` section over ``model_parameters`` (tensors or param-group dicts of the
    unsharded model; default all trainable parameters) unless ``optimizer`` is given (an
    optimizer over the unsharded parameters with no state yet, re-pointed at the shards, or a
    callable taking the param groups). The config's ``scheduler`` wins over ``lr_scheduler``
    (an object with ``step`` and ``state_dict``, or a callable taking the optimizer), as in
    DeepSpeed. ``timeout_s`` (else ``$ZEROPP_TIMEOUT_S``) bounds every collective's wait.
    """
    parsed = parse_deepspeed(config)
    timeout_s = timeout_s if timeout_s is not None else collective_timeout_s()
    _init_distributed(model, timeout_s)
    topology = topology if topology is not None else Topology.from_env()
    parsed.training.resolve_batch(topology.world_size)  # batch keys wrong: fail before sharding
    name_of = {id(p): name for name, p in model.named_parameters()}
    groups = _param_groups(model, model_parameters, name_of)
    if isinstance(model, FSDPModule):
        enable(model, parsed.zeropp, topology=topology)  # sharded already: by the user, or an earlier engine
    else:
        shard(model, parsed.zeropp, topology=topology, units=units)
    if timeout_s is not None:
        set_process_group_timeouts(timeout_s)
    sharded = dict(model.named_parameters())
    groups = [{**group, "params": [sharded[name] for name in group["params"]]} for group in groups]
    optimizer = _build_optimizer(parsed, optimizer, groups, name_of, sharded)
    if parsed.zeropp.offload == "optimizer":  # DeepSpeed's offload_optimizer alone
        optimizer = offload_optimizer(optimizer)
    if parsed.training.scheduler is not None:
        if lr_scheduler is not None:
            logger.warning("zeropp: the config's scheduler (%s) is used; the lr_scheduler passed to "
                           "initialize is ignored (DeepSpeed's rule)", parsed.training.scheduler.type)
        lr_scheduler = build_scheduler(parsed.training.scheduler, optimizer)
    elif callable(lr_scheduler):
        lr_scheduler = lr_scheduler(optimizer)
    engine = ZeroPPEngine(model, optimizer, lr_scheduler, parsed, topology)
    return engine, optimizer, None, lr_scheduler


def _init_distributed(model: nn.Module, timeout_s: float | None) -> None:
    """Start torch.distributed unless it runs: from torchrun's variables, else one process."""
    if dist.is_initialized():
        return
    on_cuda = torch.cuda.is_available() and next(model.parameters()).device.type == "cuda"
    backend = "nccl" if on_cuda else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s is not None else None
    if on_cuda:
        torch.cuda.set_device(next(model.parameters()).device)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        dist.init_process_group(backend, store=_restart_scoped_store(timeout), rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    else:
        dist.init_process_group(backend, timeout=timeout)


def _restart_scoped_store(timeout: datetime.timedelta | None) -> dist.Store:
    """[Note: torchrun restarts and the shared store]
    torchrun (torch >= 2.5) keeps one TCPStore in its agent for the whole job and hands the same
    address to every restart, while ``init_process_group`` does not scope its keys by attempt.
    After a restart, a rank can then read a peer's address published by the *previous* attempt
    while creating a group and fail with "connection refused" (pytorch/pytorch#135712; seen here
    in ``new_group``). Prefixing the store with the restart count keeps each attempt's keys
    apart. Jobs that call ``init_process_group`` themselves can set
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` for torchrun instead."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), is_master=False,
                          timeout=timeout or datetime.timedelta(minutes=5))
    return dist.PrefixStore(f"zeropp/restart_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def _param_groups(model: nn.Module, model_parameters: Iterable[Any] | None,
                  name_of: dict[int, str]) -> list[dict[str, Any]]:
    """``model_parameters`` as param groups holding parameter *names* (sharding replaces the
    parameter objects; names survive)."""
    if model_parameters is None:
        return [{"params": [name for name, p in model.named_parameters() if p.requires_grad]}]
    items = list(model_parameters)
    raw_groups = items if items and isinstance(items[0], dict) else [{"params": items}]
    groups = []
    for group in raw_groups:
        names = []
        for p in group["params"]:
            if id(p) not in name_of:
                raise ValueError("model_parameters holds a tensor that is not a parameter of the model")
            names.append(name_of[id(p)])
        groups.append({**group, "params": names})
    return groups


def _build_optimizer(parsed: DeepSpeedConfig, optimizer: OptimizerArg, groups: list[dict[str, Any]],
                     name_of: dict[int, str], sharded: dict[str, nn.Parameter]) -> torch.optim.Optimizer:
    config = parsed.training.optimizer
    if optimizer is not None and config is not None:
        raise ValueError("an optimizer was passed to initialize and the config has an 'optimizer' "
                         "section; give one or the other")
    if isinstance(optimizer, torch.optim.Optimizer):
        if optimizer.state:
            raise ValueError("the optimizer passed to initialize already has state; build it before "
                             "training (zeropp re-points it at the sharded parameters)")
        for group in optimizer.param_groups:
            if any(id(p) not in name_of and not isinstance(p, DTensor) for p in group["params"]):
                raise ValueError("the optimizer passed to initialize holds a tensor that is not a "
                                 "parameter of the model")
            group["params"] = [p if isinstance(p, DTensor) else sharded[name_of[id(p)]]
                               for p in group["params"]]
        return optimizer
    if optimizer is not None:
        return optimizer(groups)
    if config is None:
        raise ValueError("no optimizer: pass optimizer= to initialize or add an 'optimizer' section "
                         "(type AdamW, Adam or SGD) to the config")
    return getattr(torch.optim, config.torch_class_name)(groups, **config.torch_kwargs())
