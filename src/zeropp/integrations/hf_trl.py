"""TRL's trainers on a zeropp-sharded model: ``ZeroPPGRPOTrainer`` and ``ZeroPPSFTTrainer``.

[Note: zeropp in a TRL trainer]
A TRL trainer prepares the model in its own ``__init__`` (loads it from a path, wraps it with
PEFT, sets its pad token) and then calls ``Trainer.__init__``. zeropp must shard after that and
before Trainer, so ``ZeroPPTrainer`` sits after the TRL class in the method resolution order:
``class ZeroPPGRPOTrainer(GRPOTrainer, ZeroPPTrainer)`` resolves to GRPOTrainer, TRL's base
trainer, ZeroPPTrainer, Trainer, and GRPOTrainer's ``super().__init__`` reaches ZeroPPTrainer's.
The zeropp arguments, which TRL's ``__init__`` would refuse, are taken by the outermost
``__init__``, which also clears ``TrainingArguments.deepspeed`` before TRL reads it, and handed
down on the instance. Another TRL trainer takes zeropp the same way: subclass it before
``ZeroPPTrainer`` and set ``self._zeropp_request = ZeroPPRequest.take(args, zeropp_config,
zeropp_units)`` before calling its ``__init__``.

GRPO generates with ``model.generate``; on a model sharded with hpZ that runs inside zeropp's
generation mode by itself (``zeropp.techniques.hpz.generate_in_generation_mode``): the first forward of each
generation gathers across nodes, every later one inside the node.
"""

from __future__ import annotations

from typing import Any

from accelerate.utils import is_peft_model
from torch import nn

from zeropp.integrations.hf import ZeroPPRequest, ZeroPPSource, ZeroPPTrainer
from zeropp.setup.sharding import UnitSpec

try:
    from trl import GRPOTrainer, SFTTrainer
except ImportError as error:  # pragma: no cover - exercised only without trl installed
    raise ImportError("zeropp's TRL trainers need trl: pip install 'zeropp[trl]'") from error


def check_grpo_arguments(args: Any, model: nn.Module | str, peft_config: Any) -> None:
    """Refuse, before anything is built, the GRPO settings zeropp cannot train with."""
    if args.use_vllm:
        raise ValueError(
            "use_vllm=True is not supported by ZeroPPGRPOTrainer: vLLM generates from its own copy of the weights, "
            "which TRL refreshes from the training model's parameters, not from zeropp's shards. Set use_vllm=False: "
            "generation then runs on the sharded model (with hpZ, in zeropp's generation mode)")
    if args.use_transformers_continuous_batching:
        raise ValueError(
            "use_transformers_continuous_batching=True is not supported by ZeroPPGRPOTrainer: transformers' "
            "generate_batch does not keep the ranks in step (no synced_gpus), so a rank that has finished stops "
            "taking part in the weight gathers the others wait on. Set it to False (model.generate keeps them in step)")
    if args.beta != 0.0 and peft_config is None and not is_peft_model(model):
        raise ValueError(
            f"beta={args.beta} is not supported by ZeroPPGRPOTrainer for a full model: the KL term needs a reference "
            "model, which GRPOTrainer loads again from the policy's name and keeps whole on every rank, outside "
            "zeropp. Set beta=0.0 (GRPO's default), or train a PEFT adapter (peft_config=...), whose reference is "
            "the same sharded model with the adapter disabled")


class ZeroPPGRPOTrainer(GRPOTrainer, ZeroPPTrainer):
    """TRL's ``GRPOTrainer`` on a zeropp-sharded model: GRPOTrainer's arguments, plus
    ``zeropp_config`` and ``zeropp_units`` as for ``ZeroPPTrainer``. Generation runs on the
    sharded model (``model.generate``; with hpZ in generation mode); vLLM, continuous batching
    and a reference model for ``beta > 0`` on a full model are refused (``check_grpo_arguments``)."""

    def __init__(self, model: nn.Module | str, reward_funcs: Any = None, args: Any = None, *more: Any,
                 zeropp_config: ZeroPPSource | None = None, zeropp_units: UnitSpec | None = None,
                 **kwargs: Any) -> None:
        self._zeropp_request = ZeroPPRequest.take(args, zeropp_config, zeropp_units)
        if args is not None:
            check_grpo_arguments(args, model, kwargs.get("peft_config"))
        super().__init__(model, reward_funcs, args, *more, **kwargs)


class ZeroPPSFTTrainer(SFTTrainer, ZeroPPTrainer):
    """TRL's ``SFTTrainer`` on a zeropp-sharded model: SFTTrainer's arguments, plus
    ``zeropp_config`` and ``zeropp_units`` as for ``ZeroPPTrainer``."""

    def __init__(self, model: nn.Module | str, args: Any = None, *more: Any,
                 zeropp_config: ZeroPPSource | None = None, zeropp_units: UnitSpec | None = None,
                 **kwargs: Any) -> None:
        self._zeropp_request = ZeroPPRequest.take(args, zeropp_config, zeropp_units)
        super().__init__(model, args, *more, **kwargs)
