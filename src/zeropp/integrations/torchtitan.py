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

The layouts, as torchtitan builds them under ``SPMD_BACKEND`` (world mesh unflattened to
``(pp, dp_replicate, fsdp, tp)``, tensor parallel innermost):

- FSDP alone: every unit is sharded over the 1-D ``fsdp`` mesh of all ranks; every technique.
- tensor parallel x FSDP (``tensor_parallel_degree``): the blocks are tensor parallel on the
  ``tp`` mesh, then each unit is sharded over the 1-D ``fsdp`` sub-mesh (its parameters are
  DTensors on ``(fsdp, tp)``): qwZ and qgZ run over that sub-mesh, one rank per node when tensor
  parallel fills the node.
- HSDP (``data_parallel_replicate_degree``): each unit is sharded on the 2-D ``(dp_replicate,
  fsdp)`` mesh; qgZ runs inside the shard group, ``quantized_replica_gradients`` quantizes the
  replicas' all-reduce. Both degrees together give HSDP of tensor parallel blocks.
- expert parallel (``expert_parallel_degree``): each MoE block's routed experts are sharded over
  the ranks of one EP index (``efsdp``), the rest of the block over ``fsdp``; FSDP2 keeps the two
  as parameter groups of one unit and each gets its own qwZ and qgZ over its own group
  (``zeropp.fsdp.access.CommGroup``). The tokens' all-to-alls stay torchtitan's, counted in the
  ledger as ``ep_tokens`` ([Note: expert parallelism's token exchanges]).
- pipeline parallel (``pipeline_parallel_degree``): each stage's model part is parallelized as
  above and gets qwZ and qgZ over its data-parallel group ([Note: pipeline parallel in torchtitan]).
- context parallel (``context_parallel_degree``): torchtitan folds it into the FSDP mesh, so each
  unit is sharded over its ``dp_shard x cp`` ranks and zeropp's comms run over them as over any
  FSDP group; the keys and values go round the ``cp`` group by torch's ring attention, untouched.

hpZ has nothing to keep where tensor parallel fills the node (one data-parallel rank per node)
or under HSDP (the shard group is a node): there ``zeropp.enable`` refuses
``hpz_partition_size > 1`` by name (``llama3_debugmodel`` turns it on for several nodes, so take
another config function there), and for the experts where a node holds one rank of their group.
hpZ is refused on a pipeline stage ([Note: hpZ under pipeline parallelism]).
"""

from __future__ import annotations

import dataclasses
import os
import weakref
from collections.abc import Callable
from typing import Any

from torch import nn

from zeropp.config import ZeroPPConfig
from zeropp.setup.sharding import enable
from zeropp.setup.topology import Topology

SPMD_BACKEND = "partial_dtensor"
"""torchtitan's ``parallelism.spmd_backend`` that hands ``fully_shard`` the data-parallel mesh
alone (``fsdp``, or ``(dp_replicate, fsdp)``), its tensor parallel blocks DTensors on ``tp``:
FSDP2 units whose shard group zeropp reads to run qgZ's hops and hpZ's node partition. The
other backends shard on the whole multi-axis mesh named by ``DataParallelMeshDims``."""


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
        model = enable(self.parallelize_fn(model, **kwargs), self.config,
                       pipeline_rank=pipeline_rank(kwargs.get("parallel_dims")))
        count_token_exchanges(model, Topology.from_env())
        return model


def pipeline_rank(parallel_dims: Any) -> int | None:
    """This rank's index on torchtitan's ``pp`` mesh, None without pipeline parallelism.

    [Note: pipeline parallel in torchtitan]
    torchtitan's ``pipeline_llm`` cuts the meta-device model into one part per stage (the first
    holds the embedding, the last the norm and output head; a looped schedule gives each rank
    several), calls the model spec's parallelize function on each part, and runs them with a
    ``torch.distributed.pipelining`` schedule (1F1B, Interleaved1F1B, ...). ``with_zeropp``'s
    parallelize function is that function, so every stage's units get qwZ and qgZ over the
    stage's data-parallel group (the ranks of one pipeline rank: a 2-D layout, [Note: shard
    groups on nodes]); ``zeropp.enable`` is told the pipeline rank, so ranks compare units only
    with the ranks holding the same stages ([Note: pipeline stages]). The schedule turns
    gradient sync off for every microbatch's backward and reduce-scatters each stage once, after
    the last, by calling FSDP2's post-backward itself (outside autograd: the ledger still books
    those reductions as backward's). The point-to-point sends of activations between stages are
    the schedule's and are not counted. hpZ is refused on a stage ([Note: hpZ under pipeline
    parallelism] in ``zeropp.setup.plan``)."""
    if parallel_dims is None or not parallel_dims.pp_enabled:
        return None
    return parallel_dims.get_mesh("pp").get_local_rank()


EXPERT_TOKENS = "ep_tokens"
"""The ledger's name for expert parallelism's token exchanges (torchtitan's, in the model's dtype)."""


def count_token_exchanges(model: nn.Module, topology: Topology) -> None:
    """[Note: expert parallelism's token exchanges]
    Under expert parallelism each MoE layer sends every routed token to the rank holding its
    expert and the output back (torchtitan's token dispatcher: two all-to-alls of uneven splits
    forward, their mirror images in backward). They are torchtitan's, not zeropp's, and zeropp
    leaves them as they are; they are counted in the ledger, under ``EXPERT_TOKENS``, so that a
    job's cross-node bill is whole. Each forward exchange records what it sends and, when
    autograd will run it backward, the mirror exchange backward's gradient sends (what it
    received). The token counts' own small exchange is left out."""
    from zeropp.fsdp.comms import group_info

    for module in model.modules():
        dispatcher = getattr(module, "token_dispatcher", None)  # an MoE layer's routed experts hold one
        if hasattr(dispatcher, "_dispatch_token_exchange") and dispatcher not in _COUNTED:
            for name in ("_dispatch_token_exchange", "_combine_token_exchange"):
                setattr(dispatcher, name, _counted(getattr(dispatcher, name), dispatcher, topology, group_info))
            _COUNTED.add(dispatcher)


_COUNTED: weakref.WeakSet = weakref.WeakSet()
"""Token dispatchers whose exchanges are counted already (a model enabled twice)."""


def _counted(exchange: Callable[..., Any], dispatcher: Any, topology: Topology, group_info: Callable) -> Callable:
    import torch
    import torch.distributed as dist

    from zeropp.fsdp.ledger import Op, comm_ledger

    def counted(rows: Any, pg: Any, first_splits: list[int], second_splits: list[int]) -> Any:
        group = dispatcher.ep_mesh.get_group()
        ranks = dist.get_process_group_ranks(group)
        me = dist.get_rank()
        remote = [topology.node_of(rank) != topology.node_of(me) for rank in ranks]
        row_bytes = rows[0].numel() * rows.element_size() if len(rows) else 0
        sends, receives = second_splits, first_splits  # both exchanges send by their last argument
        skip_me = [0 if rank == me else 1 for rank in ranks]
        info = group_info(topology, group)
        ledger = comm_ledger()
        ledger.record_sends(Op.ALL_TO_ALL, info, [n * row_bytes * k for n, k in zip(sends, skip_me)], remote,
                            rows.dtype, EXPERT_TOKENS)
        if torch.is_grad_enabled() and rows.requires_grad:
            ledger.record_sends(Op.ALL_TO_ALL, info, [n * row_bytes * k for n, k in zip(receives, skip_me)], remote,
                                rows.dtype, EXPERT_TOKENS, phase="backward")
        return exchange(rows, pg, first_splits, second_splits)

    counted.__name__ = exchange.__name__
    return counted


def _check_parallelism(parallelism: Any) -> None:
    """torchtitan's layout must put FSDP2 units on ``SPMD_BACKEND``'s data-parallel meshes (every
    parallelism of torchtitan 0.3 runs there: FSDP, HSDP, tensor, expert, pipeline and context
    parallel; context parallel folds into the FSDP mesh, so its units are sharded over
    ``dp_shard x cp`` and zeropp's comms run over that group)."""
    if parallelism is None:
        raise ValueError("ZeroPPParallelize needs torchtitan's parallelism config (keyword 'parallelism')")
    if parallelism.spmd_backend != SPMD_BACKEND:
        raise ValueError(f"zeropp needs parallelism.spmd_backend={SPMD_BACKEND!r} (FSDP2 units on the data-parallel "
                         f"mesh alone), got {parallelism.spmd_backend!r}; with_zeropp sets it")


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
