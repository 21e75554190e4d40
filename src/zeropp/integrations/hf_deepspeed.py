"""A DeepSpeed config under HF ``transformers.Trainer``: Trainer's own settings and zeropp's keys.

A DeepSpeed user moving to ``zeropp.hf.ZeroPPTrainer`` keeps their config file. Its keys fall in
two kinds, as under DeepSpeed's own Trainer integration:

- keys Trainer owns (batch sizes, accumulation, clipping, the optimizer's and the schedule's
  hyper-parameters, bf16/fp16): ``"auto"`` takes the ``TrainingArguments`` value, and a value
  given must agree with ``TrainingArguments`` (``TRAINER_OWNED``); every disagreement is named
  in one error with both values;
- everything else is read by ``zeropp.config.parse_deepspeed``: the ZeRO++ keys
  (``zero_quantized_weights``, ``zero_hpz_partition_size``, ``zero_quantized_gradients``,
  ``zero_optimization.zeropp.*``) become the ``ZeroPPConfig``.

The config's ``optimizer`` and ``scheduler`` sections, when present, are what Trainer builds
(DeepSpeed's rule, which its Trainer integration keeps: they win over ``optim`` and
``lr_scheduler_type``). ``TrainingArguments.deepspeed`` is read and then cleared, with what
``TrainingArguments`` set up from it, so that Trainer, accelerate and TRL train without DeepSpeed.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from zeropp.config import (
    OptimizerConfig,
    SchedulerConfig,
    ZeroPPConfig,
    load_deepspeed,
    parse_deepspeed,
)

DeepSpeedSource = dict[str, Any] | str | os.PathLike[str]
"""A DeepSpeed config: a dict, or the path of a JSON file."""

TRAINER_OWNED: tuple[tuple[str, str, Callable[[Any], Any]], ...] = (
    # (dotted DeepSpeed key, the TrainingArguments setting it must equal, that setting's value)
    ("train_micro_batch_size_per_gpu", "per_device_train_batch_size", lambda a: a.per_device_train_batch_size),
    ("gradient_accumulation_steps", "gradient_accumulation_steps", lambda a: a.gradient_accumulation_steps),
    ("train_batch_size", "per_device_train_batch_size * gradient_accumulation_steps * world_size",
     lambda a: a.per_device_train_batch_size * a.gradient_accumulation_steps * a.world_size),
    ("gradient_clipping", "max_grad_norm", lambda a: a.max_grad_norm),
    ("optimizer.params.lr", "learning_rate", lambda a: a.learning_rate),
    ("optimizer.params.betas", "[adam_beta1, adam_beta2]", lambda a: [a.adam_beta1, a.adam_beta2]),
    ("optimizer.params.eps", "adam_epsilon", lambda a: a.adam_epsilon),
    ("optimizer.params.weight_decay", "weight_decay", lambda a: a.weight_decay),
    ("scheduler.params.warmup_max_lr", "learning_rate", lambda a: a.learning_rate),
    ("fp16.enabled", "fp16", lambda a: a.fp16),
    ("bf16.enabled", "bf16", lambda a: a.bf16),
)
"""The keys whose value Trainer takes from ``TrainingArguments``."""

_FILLED_ONLY = {"scheduler.params.warmup_min_lr": 0.0}
"""``"auto"`` keys with a fixed value (not a Trainer setting; any value given stands)."""
_STEP_COUNTS = ("scheduler.params.total_num_steps", "scheduler.params.warmup_num_steps")
"""Scheduler keys known once Trainer knows the number of training steps (``scheduler_config``)."""
_SIZED_FROM_MODEL = ("zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
                     "zero_optimization.stage3_param_persistence_threshold")
"""``"auto"`` keys DeepSpeed's Trainer integration sizes from the model's width; they size
DeepSpeed's buckets, which zeropp does not have (FSDP2 communicates per unit), so they are dropped."""


@dataclass(frozen=True)
class TrainerDeepSpeedConfig:
    """A DeepSpeed config completed from ``TrainingArguments``: what ``ZeroPPTrainer`` acts on."""

    zeropp: ZeroPPConfig
    """The ZeRO++ techniques (and bf16/fp16 as FSDP2's compute dtype)."""
    optimizer: OptimizerConfig | None
    """The optimizer Trainer builds, or None for Trainer's own (``optim``)."""
    scheduler: dict[str, Any] | None
    """The ``scheduler`` section (``"auto"`` step counts still open), or None for Trainer's own."""
    save_full_weights: bool = True
    """``save_model`` gathers the full weights into a ``from_pretrained`` directory; False writes
    the sharded checkpoint alone (``stage3_gather_16bit_weights_on_model_save``: False, as under
    DeepSpeed, where the key's default is False too; without a DeepSpeed config, True)."""

    def scheduler_config(self, num_training_steps: int, warmup_steps: int) -> SchedulerConfig:
        """The scheduler section with its step counts: ``total_num_steps`` Trainer's number of
        training steps and ``warmup_num_steps`` its warm-up steps (at least 1, as DeepSpeed
        requires), each filled where ``"auto"`` and checked where given."""
        if self.scheduler is None:
            raise ValueError("the DeepSpeed config has no scheduler section")
        config = copy.deepcopy({"scheduler": self.scheduler})
        owned = (("scheduler.params.total_num_steps", "the number of training steps", num_training_steps),
                 ("scheduler.params.warmup_num_steps", "warmup_steps (or warmup_ratio)", max(1, warmup_steps)))
        _raise_disagreements([d for key, name, value in owned if (d := _fill_or_compare(config, key, name, value))])
        return SchedulerConfig(type=config["scheduler"].get("type"), params=config["scheduler"].get("params", {}))


def complete_from_training_arguments(source: DeepSpeedSource, args: Any) -> TrainerDeepSpeedConfig:
    """Read a DeepSpeed config for a Trainer run with ``args`` (``TrainingArguments``): fill its
    ``"auto"`` values, check the keys Trainer owns agree with ``args`` (one ValueError naming
    every disagreement, both values and the fix), and read the rest with ``parse_deepspeed``."""
    config = copy.deepcopy(load_deepspeed(source))
    disagreements = [d for key, name, value_of in TRAINER_OWNED
                     if (d := _fill_or_compare(config, key, name, value_of(args)))]
    _raise_disagreements(disagreements)
    for key, value in _FILLED_ONLY.items():
        if _get(config, key) == "auto":
            _set(config, key, value)
    for key in _SIZED_FROM_MODEL:
        if _get(config, key) == "auto":
            _delete(config, key)
    scheduler = copy.deepcopy(config.get("scheduler"))
    for key in _STEP_COUNTS:  # checked now with a stand-in; the real counts come with training
        if _get(config, key) == "auto":
            _set(config, key, 1)
    parsed = parse_deepspeed(config)
    return TrainerDeepSpeedConfig(zeropp=parsed.zeropp, optimizer=parsed.training.optimizer, scheduler=scheduler,
                                  save_full_weights=parsed.training.gather_16bit_weights_on_model_save)


def take_from_training_arguments(args: Any) -> DeepSpeedSource | None:
    """``args.deepspeed`` (a path or a dict), after clearing it from ``args``: see [Note: clearing
    TrainingArguments.deepspeed]. None (and ``args`` untouched) when it is not set."""
    source = getattr(args, "deepspeed", None)
    if not source:
        return None
    clear_deepspeed(args)
    return source


def clear_deepspeed(args: Any) -> None:
    """[Note: clearing TrainingArguments.deepspeed]
    ``TrainingArguments(deepspeed=...)`` sets DeepSpeed up while the arguments are built: it keeps
    a ``hf_deepspeed_config`` and a ``deepspeed_plugin``, registers the config globally (so
    ``is_deepspeed_zero3_enabled()`` holds, which changes ``from_pretrained``, ``generate`` and
    Trainer's saving), and, unless ``use_cpu``, picks accelerate's DeepSpeed distributed type for
    the devices it caches. Trainer would then hand the model to DeepSpeed. zeropp trains instead,
    so all four are undone: the fields are set to None, the global registration removed, and the
    device set-up chosen again, without DeepSpeed, at once (choosing it resets accelerate's state,
    so it must happen before Trainer builds its ``Accelerator``)."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    args.deepspeed = None
    args.hf_deepspeed_config = None
    args.deepspeed_plugin = None
    unset_hf_deepspeed_config()
    vars(args).pop("_setup_devices", None)  # a functools.cached_property: dropped, then computed again
    _ = args.device


def _fill_or_compare(config: dict[str, Any], key: str, name: str, value: Any) -> str | None:
    """Set ``key`` to ``value`` where it is ``"auto"``; where it holds another value that differs,
    describe the disagreement. A key absent from ``config`` is left absent."""
    given = _get(config, key)
    if given is None:
        return None
    if given == "auto":
        _set(config, key, value)
        return None
    if _same(given, value):
        return None
    return f"{key}={given!r} but TrainingArguments {name}={value!r}"


def _same(given: Any, value: Any) -> bool:
    """Equal as JSON values (a list and a tuple of the same numbers are the same)."""
    if isinstance(given, (list, tuple)) and isinstance(value, (list, tuple)):
        return len(given) == len(value) and all(_same(g, v) for g, v in zip(given, value))
    if isinstance(given, bool) or isinstance(value, bool):
        return given is value
    return given == value


def _raise_disagreements(disagreements: list[str]) -> None:
    if disagreements:
        raise ValueError(
            "the DeepSpeed config disagrees with TrainingArguments, from which Trainer takes these settings:\n- "
            + "\n- ".join(disagreements)
            + '\nSet each key to the TrainingArguments value or to "auto" (filled from TrainingArguments), '
            "or change TrainingArguments")


def _get(config: dict[str, Any], key: str) -> Any:
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _set(config: dict[str, Any], key: str, value: Any) -> None:
    *parents, last = key.split(".")
    node = config
    for part in parents:
        node = node[part]
    node[last] = value


def _delete(config: dict[str, Any], key: str) -> None:
    *parents, last = key.split(".")
    node = config
    for part in parents:
        node = node[part]
    del node[last]
