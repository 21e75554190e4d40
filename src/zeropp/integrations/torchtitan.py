"""ZeRO++ in torchtitan: its own parallelize function shards the model, then ``zeropp.enable``.

torchtitan (0.3) builds every model from a ``ModelSpec`` whose ``parallelize_fn`` applies its
parallelisms (FSDP2 per transformer block, then the root); a training run is a
``Trainer.Config`` returned by a config function that ``--module <package> --config
<function>`` names on its command line, from torchtitan's own registry or any importable
module. ``with_zeropp(config, zeropp_config)`` returns such a config whose model spec
parallelizes as before and then adds ZeRO++ to the FSDP2 units it made, so a user's config
module is a few lines (README, Quick start):

    def llama3_8b_zeropp():
        return with_zeropp(llama3_8b(), zeropp.ZeroPPConfig(
            quantized_weights=True, hpz_partition_size=8, quantized_gradients=True))

``llama3_debugmodel`` below is one, for torchtitan's debug model with every technique:
``torchrun ... -m torchtitan.train --module zeropp.torchtitan --config llama3_debugmodel``.
torchtitan is imported only here, so ``import zeropp`` never needs it (torchtitan 0.3 needs
Python >= 3.11 and torch >= 2.13). See docs/decisions.md (torchtitan) for why a config function
and not a Trainer subclass.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

from torch import nn

from zeropp.config import ZeroPPConfig
from zeropp.sharding import enable
from zeropp.topology import Topology

SPMD_BACKEND = "partial_dtensor"
"""torchtitan's ``parallelism.spmd_backend`` whose FSDP2 units shard over a 1-D data-parallel
mesh, as qgZ's two hops and hpZ's node mesh need."""


@dataclasses.dataclass(frozen=True)
class ZeroPPParallelize:
    """A torchtitan ``parallelize_fn``: the model's own, then ``zeropp.enable`` with ``config``.

    torchtitan calls it on the model on the meta device, before ``to_empty`` and weight
    init, with keyword arguments it passes on unchanged (``parallel_dims``, ``training``,
    ``parallelism``, ...)."""

    parallelize_fn: Callable[..., nn.Module]
    """The model's own parallelize function (llama3's ``parallelize_llama``, ...)."""
    config: ZeroPPConfig
    """The ZeRO++ techniques to add to the units it shards."""

    def __call__(self, model: nn.Module, **kwargs: Any) -> nn.Module:
        _check_parallelism(kwargs.get("parallelism"))
        return enable(self.parallelize_fn(model, **kwargs), self.config)


_OTHER_PARALLELISMS = ("data_parallel_replicate_degree", "tensor_parallel_degree", "context_parallel_degree",
                       "pipeline_parallel_degree", "expert_parallel_degree")


def _check_parallelism(parallelism: Any) -> None:
    """torchtitan's sharding must be FSDP2 alone over every rank on the 1-D mesh of
    ``SPMD_BACKEND``: no HSDP replicas, no tensor, context, pipeline or expert parallelism."""
    if parallelism is None:
        raise ValueError("ZeroPPParallelize needs torchtitan's parallelism config (keyword 'parallelism')")
    wrong = [f"parallelism.{name}={getattr(parallelism, name)}" for name in _OTHER_PARALLELISMS
             if getattr(parallelism, name) != 1]
    if parallelism.spmd_backend != SPMD_BACKEND:
        wrong.append(f"parallelism.spmd_backend={parallelism.spmd_backend!r}")
    if wrong:
        raise ValueError(f"zeropp shards every unit over all ranks on one 1-D FSDP2 mesh; got {', '.join(wrong)}: "
                         f"set the degrees to 1 and spmd_backend to {SPMD_BACKEND!r} (with_zeropp sets the latter)")


def with_zeropp(config: Any, zeropp_config: ZeroPPConfig | str | os.PathLike[str]) -> Any:
    """torchtitan's ``Trainer.Config`` ``config``, with ZeRO++ added after its model spec's
    parallelize function and ``parallelism.spmd_backend`` set to ``SPMD_BACKEND``.

    ``zeropp_config``: a ``ZeroPPConfig``, or the path of a DeepSpeed JSON file whose
    ``zero_optimization`` section holds the ZeRO++ keys (``zero_quantized_weights``,
    ``zero_hpz_partition_size``, ``zero_quantized_gradients``, ``zeropp``: ...)."""
    spec = config.model_spec
    if spec is None:
        raise ValueError("with_zeropp needs a Trainer.Config with its model_spec set (a config_registry "
                         "function's result, e.g. torchtitan.models.llama3.config_registry.llama3_8b())")
    if not isinstance(zeropp_config, ZeroPPConfig):
        zeropp_config = ZeroPPConfig.from_deepspeed(zeropp_config)
    parallelize = ZeroPPParallelize(spec.parallelize_fn, zeropp_config)
    return dataclasses.replace(
        config, model_spec=dataclasses.replace(spec, parallelize_fn=parallelize),
        parallelism=dataclasses.replace(config.parallelism, spmd_backend=SPMD_BACKEND))


def llama3_debugmodel() -> Any:
    """torchtitan's llama3 debug model and training config with every technique: qwZ, qgZ, and
    hpZ over each node's ranks when there are several nodes (from torchrun's environment,
    ``Topology.from_env``; on one node hpZ would only add work)."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel as debugmodel

    topology = Topology.from_env()
    hpz_partition_size = topology.ranks_per_node if topology.num_nodes > 1 else 1
    return with_zeropp(debugmodel(), ZeroPPConfig(quantized_weights=True, hpz_partition_size=hpz_partition_size,
                                                  quantized_gradients=True))
