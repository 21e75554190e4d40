"""HF ``transformers.Trainer`` (and TRL's trainers) on a zeropp-sharded model.

Trainer reaches FSDP2 through accelerate's FSDP plugin, which accelerate enables on GPUs and other
accelerators but not for CPU processes (gloo), and whose units it shards with its own settings.
So zeropp shards the model itself and hands Trainer a model that is already distributed:
``ZeroPPTrainer`` shards (``zeropp.shard``, or ``zeropp.enable`` on a model that is already an
``FSDPModule``) before Trainer sees the model, and tells accelerate not to wrap it in DDP, which
would all-reduce gradients FSDP2 already reduced (accelerate refuses DTensor parameters under DDP
anyway). Everything else is Trainer's own: its data loaders give each rank its rows, its
optimizer and schedule step the shards, and ``max_grad_norm`` clips with
``torch.nn.utils.clip_grad_norm_``, which reduces the norm of sharded gradients over the ranks.

The ZeRO++ settings come as a ``ZeroPPConfig``, or as the user's DeepSpeed config file (a path or
a dict as ``zeropp_config``, or ``TrainingArguments(deepspeed=...)``), read as DeepSpeed's Trainer
integration reads it: see ``zeropp.integrations.hf_deepspeed``. TRL's trainers build on this module:
``zeropp.integrations.hf_trl`` (``zeropp.hf`` imports them on first use, so it needs no trl).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zeropp.config import ZeroPPConfig
from zeropp.engine.lr_schedules import build_scheduler
from zeropp.fsdp.offload import offload_optimizer
from zeropp.integrations import hf_checkpoint
from zeropp.integrations.hf_deepspeed import (
    DeepSpeedSource,
    TrainerDeepSpeedConfig,
    complete_from_training_arguments,
    take_from_training_arguments,
)
from zeropp.setup.explain import Explanation, explain
from zeropp.setup.sharding import UnitSpec, enable, mark_for_accelerate, shard
from zeropp.setup.topology import Topology
from zeropp.techniques.audit import ReportCursor, audit_metrics

try:
    from transformers import Trainer, TrainingArguments
except ImportError as error:  # pragma: no cover - exercised only without the extra installed
    raise ImportError("zeropp.hf needs transformers: pip install 'zeropp[hf]'") from error

ZeroPPSource = ZeroPPConfig | DeepSpeedSource
"""What ``zeropp_config`` takes: a ``ZeroPPConfig``, or a DeepSpeed config (a dict or a JSON path)."""

def prepare_model(model: nn.Module, config: ZeroPPConfig | None = None, *, topology: Topology | None = None,
                  units: UnitSpec | None = None) -> nn.Module:
    """Shard ``model`` with zeropp (or add ZeRO++ to a model already sharded with ``fully_shard``)
    and mark it as distributed for accelerate, so Trainer uses it as it is."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        enable(model, config, topology=topology)
    else:
        shard(sharding_root(model), config, topology=topology, units=units)
    return mark_for_accelerate(model)


def sharding_root(model: nn.Module) -> nn.Module:
    """[Note: a PEFT model's sharding root]
    FSDP2 gathers the root unit's parameters (a causal LM's embedding, final norm and head) in the
    root's forward hooks. A PEFT model's ``generate`` runs its base model's ``generate``, which
    calls the base model, not the PEFT wrapper: with the wrapper as root those parameters would
    stay sharded there ("mixed torch.Tensor and DTensor"). So when the base model holds every
    parameter of the PEFT model (LoRA and the other adapters injected into its layers), the base
    model is the root: the wrapper's forward and ``generate`` both run through its hooks. A model
    with parameters of its own outside (prompt learning) is sharded as a whole."""
    get_base_model = getattr(model, "get_base_model", None)
    if not callable(get_base_model):
        return model
    base = get_base_model()
    inside = {id(p) for p in base.parameters()}
    return base if all(id(p) in inside for p in model.parameters()) else model


@dataclass(frozen=True)
class ZeroPPRequest:
    """The zeropp arguments a trainer was given, held until ``TrainingArguments`` are final."""

    config: ZeroPPConfig | None
    deepspeed: DeepSpeedSource | None
    """A DeepSpeed config (from ``zeropp_config`` or ``TrainingArguments.deepspeed``), if given."""
    units: UnitSpec | None

    @classmethod
    def take(cls, args: Any, zeropp_config: ZeroPPSource | None, units: UnitSpec | None) -> ZeroPPRequest:
        """Read ``zeropp_config`` and ``args.deepspeed`` (then cleared from ``args``: see
        [Note: clearing TrainingArguments.deepspeed]); at most one of them may be given."""
        if zeropp_config is not None and not isinstance(zeropp_config, (ZeroPPConfig, dict, str, os.PathLike)):
            raise TypeError(f"zeropp_config={zeropp_config!r} is a {type(zeropp_config).__name__}; expected a "
                            "ZeroPPConfig, or a DeepSpeed config as a dict or the path of a JSON file")
        in_args = getattr(args, "deepspeed", None)
        if zeropp_config is not None and in_args:
            raise ValueError(f"zeropp_config={zeropp_config!r} and TrainingArguments deepspeed={in_args!r} are both "
                             "given; give the ZeRO++ settings once: drop one of them")
        in_args = take_from_training_arguments(args)
        if zeropp_config is None or isinstance(zeropp_config, ZeroPPConfig):
            return cls(zeropp_config, in_args, units)
        return cls(None, zeropp_config, units)

    def resolve(self, args: Any) -> TrainerDeepSpeedConfig:
        """The settings to train with: the ``ZeroPPConfig``, or the DeepSpeed config completed
        from (and checked against) ``args``."""
        if self.deepspeed is None:
            return TrainerDeepSpeedConfig(zeropp=self.config or ZeroPPConfig(), optimizer=None, scheduler=None)
        return complete_from_training_arguments(self.deepspeed, args)


class ZeroPPTrainer(Trainer):
    """``transformers.Trainer`` whose model is sharded by zeropp.

    ``zeropp_config``: a ``ZeroPPConfig``, or a DeepSpeed config (a dict or the path of a JSON
    file) whose ZeRO++ keys are honoured and whose Trainer-owned keys ("auto" or agreeing with
    ``TrainingArguments``) are checked; or leave it out and set ``TrainingArguments(deepspeed=...)``.
    A DeepSpeed ``optimizer`` or ``scheduler`` section is what Trainer builds, as under
    DeepSpeed. ``zeropp_units``: the modules to shard as units (default the repeated blocks).
    ``self.zeropp_config`` is the ``ZeroPPConfig`` the model was sharded with.
    """

    def __init__(self, model: nn.Module | None = None, args: TrainingArguments | None = None, *more: Any,
                 zeropp_config: ZeroPPSource | None = None, zeropp_units: UnitSpec | None = None,
                 **kwargs: Any) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"{type(self).__name__} needs the model as an nn.Module to shard; got {model!r} "
                             "(model_init is not supported)")
        request = vars(self).pop("_zeropp_request", None)  # left by a TRL subclass: [Note: zeropp in a TRL trainer]
        if request is None:
            request = ZeroPPRequest.take(args, zeropp_config, zeropp_units)
        args = args if args is not None else TrainingArguments(output_dir="tmp_trainer")  # Trainer's default
        self._zeropp_settings = request.resolve(args)
        self.zeropp_config = self._zeropp_settings.zeropp
        prepare_model(model, self.zeropp_config, units=request.units)
        self._zeropp_audit = ReportCursor(model)
        super().__init__(model, args, *more, **kwargs)
        if self._zeropp_settings.optimizer is not None and self.optimizer is not None:
            raise ValueError(f"the DeepSpeed config has an optimizer section ({self._zeropp_settings.optimizer.type}) "
                             f"and optimizers=({type(self.optimizer).__name__}, ...) was given; drop one of them")

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """The DeepSpeed config's optimizer over every trainable parameter (as DeepSpeed builds
        it) when the config has one; else Trainer's (``optim``, or the one given). With
        ``offload="optimizer"`` it steps on the host (``zeropp.fsdp.offload``)."""
        section = self._zeropp_settings.optimizer
        if section is None or self.optimizer is not None:
            super().create_optimizer(model)
        else:
            trainable = [p for p in (self.model if model is None else model).parameters() if p.requires_grad]
            self.optimizer = getattr(torch.optim, section.torch_class_name)(trainable, **section.torch_kwargs())
        if self.zeropp_config.offload == "optimizer":  # its groups are the original's: a schedule built on it works
            self.optimizer = offload_optimizer(self.optimizer)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None) -> Any:
        """The DeepSpeed config's schedule (its ``"auto"`` step counts from ``num_training_steps``
        and the warm-up steps of ``TrainingArguments``) when the config has one; else Trainer's."""
        if self._zeropp_settings.scheduler is None or self.lr_scheduler is not None:
            return super().create_scheduler(num_training_steps, optimizer)
        warmup_steps = self.args.get_warmup_steps(num_training_steps)
        config = self._zeropp_settings.scheduler_config(num_training_steps, warmup_steps)
        self.lr_scheduler = build_scheduler(config, self.optimizer if optimizer is None else optimizer)
        self._created_lr_scheduler = True  # Trainer's own flag: a later train() builds the schedule again
        return self.lr_scheduler

    def explain(self) -> Explanation:
        """What zeropp does to the model, unit by unit (``zeropp.explain``); the main process also
        prints it."""
        explanation = explain(sharding_root(self.model))
        if self.args.should_log:
            print(explanation)
        return explanation

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """Trainer's ``log``, with the audit's new rows as metrics (``zeropp/audit/<technique>/...``,
        ``zeropp.techniques.audit.audit_metrics``) when ``audit_every`` is on: they reach every logger
        Trainer reports to, and ``state.log_history``."""
        super().log({**logs, **audit_metrics(self._zeropp_audit.new_rows())}, *args, **kwargs)

    # Saving and resuming: every rank takes part (see [Note: Trainer's saves on a sharded model]).

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write the model so that ``from_pretrained`` loads it without zeropp: every rank gathers
        the full-precision weights and rank 0 streams them into safetensors, beside the config,
        the tokenizer and the training arguments. With ``stage3_gather_16bit_weights_on_model_save:
        false`` in the DeepSpeed config: the sharded checkpoint alone (``zeropp checkpoint
        consolidate`` turns it into one file), as DeepSpeed writes."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if self._zeropp_settings.save_full_weights:
            hf_checkpoint.save_pretrained_full(self.model, output_dir)
        elif not _internal_call or self.args.save_only_model:  # a checkpoint saves it with the optimizer next
            hf_checkpoint.save_sharded(self.model, self.optimizer, output_dir, self.state.global_step)
        if self.args.should_save:
            self._save_beside_model(output_dir)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_beside_model(self, output_dir: str) -> None:
        """Rank 0: what Trainer writes beside the weights (the config where the weights did not
        bring it, the tokenizer, the training arguments)."""
        os.makedirs(output_dir, exist_ok=True)
        if not self._zeropp_settings.save_full_weights:
            hf_checkpoint.save_config(hf_checkpoint.unwrapped(self.model), output_dir)
        tokenizer = self.processing_class or getattr(self.data_collator, "tokenizer", None)
        if tokenizer is not None:
            tokenizer.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, "training_args.bin"))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Every rank: model and optimizer state as a sharded zeropp checkpoint in the Trainer
        checkpoint; rank 0: the schedule's state, as Trainer saves it."""
        hf_checkpoint.save_sharded(self.model, self.optimizer, output_dir, self.state.global_step)
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, "scheduler.pt"))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """Every rank: the checkpoint's model state into the sharded model."""
        hf_checkpoint.load_weights(self.model if model is None else model, resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Every rank: model and optimizer state from the checkpoint's zeropp checkpoint, and the
        schedule's state."""
        if checkpoint is None:
            return
        hf_checkpoint.load_weights(self.model, checkpoint, self.optimizer)
        scheduler_file = os.path.join(checkpoint, "scheduler.pt")
        if self.lr_scheduler is not None and os.path.isfile(scheduler_file):
            self.lr_scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))

    def _load_best_model(self) -> None:
        """Every rank: the best checkpoint's model state into the sharded model."""
        hf_checkpoint.load_weights(self.model, self.state.best_model_checkpoint)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """Trainer's ``train``; ``resume_from_checkpoint=True`` resumes from the newest complete
        checkpoint in ``output_dir`` (a newer one a killed job left half-written is passed over)."""
        if resume_from_checkpoint is True:
            found = hf_checkpoint.last_complete_checkpoint(self.args.output_dir)
            if found is None:
                raise ValueError(f"resume_from_checkpoint=True, but {self.args.output_dir} holds no complete "
                                 "checkpoint-N directory to resume from")
            resume_from_checkpoint = str(found)
        return super().train(resume_from_checkpoint, *args, **kwargs)
