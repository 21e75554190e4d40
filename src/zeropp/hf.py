"""HF ``transformers.Trainer`` on a zeropp-sharded model.

Trainer reaches FSDP2 through accelerate's FSDP plugin, which accelerate enables on GPUs and other
accelerators but not for CPU processes (gloo), and whose units it shards with its own settings.
So zeropp shards the model itself and hands Trainer a model that is already distributed:
``ZeroPPTrainer`` shards (``zeropp.shard``, or ``zeropp.enable`` on a model that is already an
``FSDPModule``) before Trainer sees the model, and tells accelerate not to wrap it in DDP, which
would all-reduce gradients FSDP2 already reduced (accelerate refuses DTensor parameters under DDP
anyway). Everything else is Trainer's own: its data loaders give each rank its rows, its
optimizer and schedule step the shards, and ``max_grad_norm`` clips with
``torch.nn.utils.clip_grad_norm_``, which reduces the norm of sharded gradients over the ranks.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from zeropp._fsdp import mark_prepared_for_accelerate
from zeropp.config import ZeroPPConfig
from zeropp.sharding import UnitSpec, enable, shard
from zeropp.topology import Topology

try:
    from transformers import Trainer
except ImportError as error:  # pragma: no cover - exercised only without the extra installed
    raise ImportError("zeropp.hf needs transformers: pip install 'zeropp[hf]'") from error


def prepare_model(model: nn.Module, config: ZeroPPConfig | None = None, *, topology: Topology | None = None,
                  units: UnitSpec | None = None) -> nn.Module:
    """Shard ``model`` with zeropp (or add ZeRO++ to a model already sharded with ``fully_shard``)
    and mark it as distributed for accelerate, so Trainer uses it as it is."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        enable(model, config, topology=topology)
    else:
        shard(model, config, topology=topology, units=units)
    mark_prepared_for_accelerate(model)
    return model


class ZeroPPTrainer(Trainer):
    """``transformers.Trainer`` whose model is sharded by zeropp: pass ``zeropp_config`` (and
    optionally ``zeropp_units``, the modules to shard as units; default the repeated blocks)."""

    def __init__(self, model: nn.Module, *args: Any, zeropp_config: ZeroPPConfig | None = None,
                 zeropp_units: UnitSpec | None = None, **kwargs: Any) -> None:
        prepare_model(model, zeropp_config, units=zeropp_units)
        super().__init__(model, *args, **kwargs)
