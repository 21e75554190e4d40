"""Errors raised from a config value name it as the user wrote it: the dotted DeepSpeed key for a
config read from DeepSpeed, the field name for a ``ZeroPPConfig`` built directly, also when the
check runs later (hpZ against the topology, a unit's sharding, the batch sizes)."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch
from torch import nn

import zeropp
from distributed import run_fake_rank
from zeropp.config import TrainingConfig, ZeroPPConfig, parse_deepspeed
from zeropp.setup.topology import Topology
from zeropp.techniques.hpz import check_hpz

KEYS = {
    "quantized_weights": "zero_optimization.zero_quantized_weights",
    "quantized_nontrainable_weights": "zero_optimization.zero_quantized_nontrainable_weights",
    "hpz_partition_size": "zero_optimization.zero_hpz_partition_size",
    "quantized_gradients": "zero_optimization.zero_quantized_gradients",
    **{name: f"zero_optimization.zeropp.{name}" for name in (
        "block_size", "weight_bits", "low_bit_trainable_weights", "grad_bits_inter", "grad_block_size",
        "grad_full_precision_parameters", "grad_full_precision_below", "grad_levels", "hierarchical_gather",
        "unquantized_parameters")},
    "bf16": "bf16.enabled",
    "fp16": "fp16.enabled",
}
"""The DeepSpeed key of each field these tests meet, as a user writes it."""


def deepspeed(**zero_optimization: Any) -> dict[str, Any]:
    return {"zero_optimization": {"stage": 3, **zero_optimization}}


def assert_named_as_deepspeed(message: str, fields: list[str]) -> None:
    for name in fields:
        assert KEYS[name] in message, (name, message)


def assert_named_as_fields(message: str, fields: list[str]) -> None:
    assert "zero_optimization" not in message and ".enabled" not in message, message
    for name in fields:
        assert name in message, (name, message)


def test_a_config_read_from_deepspeed_knows_each_fields_key() -> None:
    """``key_of`` gives the DeepSpeed key, also of a field the file did not set; a config built
    directly names its fields; the keys are no setting (equal configs stay equal) and survive
    pickling (a config sent to spawned ranks)."""
    read = ZeroPPConfig.from_deepspeed(deepspeed(zero_hpz_partition_size=2))
    assert [read.key_of(name) for name in ("hpz_partition_size", "quantized_weights")] == \
        [KEYS["hpz_partition_size"], KEYS["quantized_weights"]]
    assert ZeroPPConfig(hpz_partition_size=2).key_of("hpz_partition_size") == "hpz_partition_size"
    assert read == ZeroPPConfig(hpz_partition_size=2) and hash(read) == hash(ZeroPPConfig(hpz_partition_size=2))
    assert pickle.loads(pickle.dumps(read)).key_of("hpz_partition_size") == KEYS["hpz_partition_size"]
    assert parse_deepspeed(deepspeed()).training.key_of("bf16") == "bf16.enabled"


CROSS_FIELD = [
    # (DeepSpeed zero_optimization keys, the same as ZeroPPConfig fields, the fields the error names)
    ({"zeropp": {"grad_full_precision_parameters": ["*ln*"]}}, {"grad_full_precision_parameters": ("*ln*",)},
     ["grad_full_precision_parameters", "quantized_gradients"]),
    ({"zero_quantized_gradients": True, "zeropp": {"grad_full_precision_below": 1024, "grad_levels": "normal"}},
     {"quantized_gradients": True, "grad_full_precision_below": 1024, "grad_levels": "normal"},
     ["grad_full_precision_parameters", "grad_full_precision_below", "grad_levels"]),
    ({"zeropp": {"hierarchical_gather": True}}, {"hierarchical_gather": True},
     ["hierarchical_gather", "quantized_weights", "quantized_nontrainable_weights"]),
    ({"zero_quantized_weights": True, "zeropp": {"weight_bits": 6, "block_size": 8}},
     {"quantized_weights": True, "weight_bits": 6, "block_size": 8}, ["block_size", "weight_bits"]),
    ({"zero_quantized_gradients": True, "zeropp": {"grad_bits_inter": 2, "grad_block_size": 8}},
     {"quantized_gradients": True, "grad_bits_inter": 2, "grad_block_size": 8}, ["grad_block_size", "grad_bits_inter"]),
    ({"zero_quantized_weights": True, "zeropp": {"weight_bits": 2}}, {"quantized_weights": True, "weight_bits": 2},
     ["weight_bits", "quantized_weights", "quantized_nontrainable_weights", "low_bit_trainable_weights"]),
]


@pytest.mark.parametrize(("section", "fields", "named"), CROSS_FIELD)
def test_cross_field_errors_name_keys_or_fields(section: dict, fields: dict, named: list[str]) -> None:
    with pytest.raises(ValueError) as from_deepspeed:
        parse_deepspeed(deepspeed(**section))
    assert_named_as_deepspeed(str(from_deepspeed.value), named)
    with pytest.raises(ValueError) as built:
        ZeroPPConfig(**fields)
    assert_named_as_fields(str(built.value), named)


def test_training_errors_name_keys_or_fields() -> None:
    """bf16 with fp16, and batch sizes that do not multiply out (top-level keys: same spelling)."""
    with pytest.raises(ValueError, match=r"bf16\.enabled=True and fp16\.enabled=True are both set"):
        parse_deepspeed({**deepspeed(), "bf16": {"enabled": True}, "fp16": {"enabled": True}})
    with pytest.raises(ValueError, match=r"^bf16=True and fp16=True are both set"):
        TrainingConfig(bf16=True, fp16=True)
    batch = parse_deepspeed({**deepspeed(), "train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}).training
    with pytest.raises(ValueError, match=r"train_batch_size=30, train_micro_batch_size_per_gpu=4, .*world_size=4: "
                                         r"train_batch_size must equal"):
        batch.resolve_batch(4)


def test_hpz_check_names_the_key_through_hf_trainer() -> None:
    """``ZeroPPTrainer(zeropp_config=dict)`` and ``TrainingArguments(deepspeed=...)`` read the
    config through ``complete_from_training_arguments``: its ZeroPPConfig keeps the keys that
    ``zeropp.shard``'s hpZ check names."""
    pytest.importorskip("transformers")
    from transformers import TrainingArguments

    from zeropp.integrations.hf_deepspeed import complete_from_training_arguments

    args = TrainingArguments(output_dir="unused", use_cpu=True, report_to=[])
    config = complete_from_training_arguments(deepspeed(zero_hpz_partition_size=8), args).zeropp
    with pytest.raises(ValueError, match=r"^zero_optimization\.zero_hpz_partition_size=8 must divide the ranks"):
        check_hpz(config.hpz_partition_size, Topology(num_nodes=2, ranks_per_node=4),
                  config.key_of("hpz_partition_size"))


WORLD_SIZE, RANKS_PER_NODE = 8, 4


def _error(call: Any) -> str:
    try:
        call()
    except ValueError as error:
        return str(error)
    return "no error"


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))


def _sharded_by_user(**unit_options: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = _model()
    fully_shard(model[0], **unit_options)
    fully_shard(model)
    return model


def _later_checks_worker(rank: int, world_size: int) -> dict[str, tuple[str, str]]:
    """Each later check's error, for the config read from DeepSpeed and for the same ZeroPPConfig
    built directly, on one rank of 2 nodes x 4 ranks (fake process group)."""
    from torch.distributed.device_mesh import DeviceMesh

    topology = Topology.from_world(world_size, RANKS_PER_NODE)
    # shard groups of 3 ranks on one node and 1 on the other: (0, 1, 2, 4) and (3, 5, 6, 7)
    uneven_mesh = DeviceMesh("cpu", torch.tensor([[0, 1, 2, 4], [3, 5, 6, 7]]), mesh_dim_names=("replicate", "shard"))
    cases = {
        "hpz_size": (deepspeed(zero_hpz_partition_size=8), {"hpz_partition_size": 8},
                     lambda config: zeropp.shard(_model(), config, topology=topology)),
        "hpz_unit": (deepspeed(zero_hpz_partition_size=4), {"hpz_partition_size": 4},
                     lambda config: zeropp.enable(_sharded_by_user(reshard_after_forward=2), config,
                                                  topology=topology)),
        "qgz_unit": (deepspeed(zero_quantized_gradients=True), {"quantized_gradients": True},
                     lambda config: zeropp.enable(_sharded_by_user(mesh=uneven_mesh), config, topology=topology)),
        "pattern": (deepspeed(zero_quantized_weights=True, zeropp={"unquantized_parameters": ["*embed*"]}),
                    {"quantized_weights": True, "unquantized_parameters": ("*embed*",)},
                    lambda config: zeropp.shard(_model(), config, topology=topology)),
    }
    messages = {}
    for name, (source, fields, check) in cases.items():
        messages[name] = (_error(lambda: check(parse_deepspeed(source).zeropp)),
                          _error(lambda: check(ZeroPPConfig(**fields))))
    source = {**deepspeed(zero_hpz_partition_size=8), "train_micro_batch_size_per_gpu": 1}
    messages["initialize"] = (_error(lambda: zeropp.initialize(model=_model(), config=source, topology=topology)),
                              messages["hpz_size"][1])
    return messages


@pytest.fixture(scope="module")
def later_errors() -> dict[str, tuple[str, str]]:
    return run_fake_rank(_later_checks_worker, WORLD_SIZE, 0)


@pytest.mark.parametrize(("case", "named", "problem"), [
    ("hpz_size", ["hpz_partition_size"], "=8 must divide the ranks per node (4"),
    ("initialize", ["hpz_partition_size"], "=8 must divide the ranks per node (4"),
    ("hpz_unit", ["hpz_partition_size"], "=4, but unit '0' (FSDPLinear) was sharded with reshard_after_forward=2"),
    ("qgz_unit", ["quantized_gradients"], "qgZ needs a group to hold the same number of ranks on each node it spans"),
    ("pattern", ["unquantized_parameters"], " pattern '*embed*' matches no parameter"),
])
def test_later_checks_name_keys_or_fields(later_errors: dict[str, tuple[str, str]], case: str, named: list[str],
                                          problem: str) -> None:
    """``zeropp.shard``/``enable`` (and ``zeropp.initialize`` through them) check hpZ against the
    topology, each unit's sharding and the patterns against the model: each error names the
    DeepSpeed key for a config read from DeepSpeed, the field for one built directly."""
    from_deepspeed, built = later_errors[case]
    assert problem in from_deepspeed and problem in built, (from_deepspeed, built)
    assert_named_as_deepspeed(from_deepspeed, named)
    assert_named_as_fields(built, named)
