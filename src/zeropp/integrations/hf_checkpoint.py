"""Saving and resuming a zeropp model under HF ``transformers.Trainer``, on every rank.

[Note: Trainer's saves on a sharded model]
Trainer saves from the main process alone when it sees neither DeepSpeed nor FSDP, which is how
``ZeroPPTrainer`` presents itself. On a zeropp model that cannot work: the parameters are shards
(DTensors), and reading them whole is a collective every rank must join, so a save on rank 0
alone waits forever for its peers (or, at a checkpoint, meets them in the next step's
collectives). So every rank takes part in each save, as under DeepSpeed:

- the model Trainer saves (``save_model``, and each checkpoint's model) is the full-precision
  weights gathered parameter by parameter and streamed into safetensors by rank 0
  (``zeropp.checkpoint.full``), beside the config and tokenizer: a directory ``from_pretrained``
  loads without zeropp. With DeepSpeed's ``stage3_gather_16bit_weights_on_model_save: false``
  it is the sharded checkpoint alone, as DeepSpeed writes;
- each checkpoint's model and optimizer state is a zeropp DCP checkpoint (``zeropp/`` inside
  ``checkpoint-N``: sharded, atomic, verified, loadable at another world size or layout), with
  Trainer's own scheduler, RNG and trainer state files beside it;
- resuming loads that DCP checkpoint into the sharded model and optimizer on every rank.

A checkpoint counts as complete when its trainer state (written last, by rank 0) parses and its
model state verifies; ``resume_from_checkpoint=True`` takes the newest complete one, so a job
killed while writing a checkpoint resumes from the one before.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from zeropp import checkpoint
from zeropp.checkpoint.full import (
    DEFAULT_MAX_SHARD_BYTES,
    INDEX_SUFFIX,
    SAFETENSORS_NAME,
    save_full_weights,
    tied_names,
)

logger = logging.getLogger("zeropp")

SHARDED_TAG = "zeropp"
"""The zeropp checkpoint's tag inside a Trainer checkpoint directory (``checkpoint-N/zeropp``)."""
TRAINER_STATE = "trainer_state.json"
_CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")


def _is_writer() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def unwrapped(model: nn.Module) -> nn.Module:
    """The model whose ``config`` and ``save_pretrained`` describe it (``torch.compile``'s
    wrapper removed)."""
    return getattr(model, "_orig_mod", model)


def _is_peft(model: nn.Module) -> bool:
    return callable(getattr(model, "get_base_model", None)) and hasattr(model, "peft_config")


def save_pretrained_full(model: nn.Module, output_dir: str | os.PathLike[str], *,
                         max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
    """Every rank: gather the model's full-precision weights and have rank 0 write a directory
    ``from_pretrained`` loads: the weights as safetensors (streamed, see [Note: streaming the
    consolidated model]) and the config and generation config. A PEFT model writes its adapter
    as ``save_pretrained`` does (the adapter alone, gathered whole: adapters are small)."""
    model = unwrapped(model)
    if _is_peft(model):
        _save_peft_adapter(model, Path(output_dir))
        return
    save_full_weights(model, output_dir, filename=SAFETENSORS_NAME, max_shard_bytes=max_shard_bytes)
    if _is_writer():
        save_config(model, Path(output_dir))


def save_config(model: nn.Module, output_dir: str | os.PathLike[str]) -> None:
    """What ``save_pretrained`` writes beside the weights: the config (naming the class and the
    weights' dtype) and the generation config."""
    config = getattr(model, "config", None)
    if config is None:
        return
    config.architectures = [type(model).__name__]
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    if dtype is not None:
        config.dtype = str(dtype).removeprefix("torch.")
    config.save_pretrained(output_dir)
    generation_config = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", lambda: False)
    if generation_config is not None and can_generate():
        generation_config.save_pretrained(output_dir)


def _save_peft_adapter(model: nn.Module, output_dir: Path) -> None:
    """The trainable parameters (the adapter's) gathered whole, saved by rank 0 through PEFT's
    ``save_pretrained``, which keeps the adapter's entries and writes its config."""
    from torch.distributed.tensor import DTensor

    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    state = {name: value for name, value in model.state_dict().items() if name in trainable}
    full = {name: (value.full_tensor() if isinstance(value, DTensor) else value).detach().cpu()
            for name, value in state.items()}
    if _is_writer():
        model.save_pretrained(output_dir, state_dict=full)


def save_sharded(model: nn.Module, optimizer: torch.optim.Optimizer | None, output_dir: str | os.PathLike[str],
                 trainer_step: int) -> Path:
    """Every rank: the model's (and optimizer's, when given) sharded state as a zeropp DCP
    checkpoint ``output_dir/zeropp`` (see [Note: atomic save] in ``zeropp.checkpoint``)."""
    return checkpoint.save(output_dir, SHARDED_TAG, model=model, optimizer=optimizer,
                           engine_state={"trainer_global_step": trainer_step}, rank_state={})


def has_sharded(directory: str | os.PathLike[str]) -> bool:
    """Whether ``directory`` holds a zeropp checkpoint (complete: ``latest`` names it)."""
    return checkpoint.resolve(directory, None) is not None


def load_weights(model: nn.Module, directory: str | os.PathLike[str],
                 optimizer: torch.optim.Optimizer | None = None) -> None:
    """Every rank: load ``directory``'s model state into the sharded ``model`` (and its optimizer
    state into ``optimizer``, when given): from its zeropp checkpoint where it has one, else from
    full safetensors weights (a ``save_model`` directory), each rank keeping its shards."""
    if has_sharded(directory):
        checkpoint.load(directory, SHARDED_TAG, model=model, optimizer=optimizer)
        return
    if optimizer is not None:
        raise checkpoint.CheckpointError(
            f"{directory} holds no zeropp checkpoint ({SHARDED_TAG}/ and latest): its optimizer state cannot be "
            "resumed; resume from a checkpoint Trainer wrote with save_only_model=False")
    _load_full_weights(model, Path(directory))


def _full_weight_files(directory: Path) -> list[str]:
    """The safetensors files of a ``save_model`` directory (its shards by their index), or []."""
    index = directory / (SAFETENSORS_NAME + INDEX_SUFFIX)
    if index.is_file():
        return sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
    return [SAFETENSORS_NAME] if (directory / SAFETENSORS_NAME).is_file() else []


def _load_full_weights(model: nn.Module, directory: Path) -> None:
    """Every rank reads the whole model from the files and keeps its shards (DCP's
    ``set_model_state_dict`` with a full state dict)."""
    from safetensors.torch import load_file

    files = _full_weight_files(directory)
    if not files:
        raise checkpoint.CheckpointError(f"{directory} holds neither a zeropp checkpoint ({SHARDED_TAG}/) nor "
                                         f"{SAFETENSORS_NAME} (or its index): no model state to load")
    full: dict[str, torch.Tensor] = {}
    for name in files:
        full.update(load_file(directory / name))
    target = unwrapped(model)
    missing = [name for name in target.state_dict() if name not in full]
    tied = tied_names(target)
    for name in missing:
        if name in tied and tied[name] in full:
            full[name] = full[tied[name]]
    set_model_state_dict(target, full, options=StateDictOptions(full_state_dict=True, strict=False))


def is_complete(directory: Path) -> bool:
    """A Trainer checkpoint directory whose trainer state (written last) parses and whose model
    state is there: a zeropp checkpoint ``latest`` names, or full weights."""
    try:
        json.loads((directory / TRAINER_STATE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return has_sharded(directory) or bool(_full_weight_files(directory))


def last_complete_checkpoint(output_dir: str | os.PathLike[str]) -> Path | None:
    """The newest complete ``checkpoint-N`` under ``output_dir`` (see ``is_complete``), or None;
    an incomplete newer one (a job killed while saving) is named in a warning and passed over."""
    directory = Path(output_dir)
    if not directory.is_dir():
        return None
    found = sorted((int(m.group(1)), path) for path in directory.iterdir()
                   if path.is_dir() and (m := _CHECKPOINT_NAME.match(path.name)))
    for _, path in reversed(found):
        if is_complete(path):
            return path
        logger.warning("%s is incomplete (a save that did not finish): resuming from an earlier checkpoint", path)
    return None
