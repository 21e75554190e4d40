"""zeropp.config: the dataclasses' validation and the DeepSpeed JSON reader, no process group."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import pathlib
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zeropp import config as config_module
from zeropp.codes.gradcode import GradientCode
from zeropp.config import (
    DeepSpeedConfig,
    OptimizerConfig,
    SchedulerConfig,
    TrainingConfig,
    ZeroPPConfig,
    parse_deepspeed,
)

# The ZeRO++ tutorial's example (DeepSpeed docs, "DeepSpeed Configuration Changes").
TUTORIAL_CONFIG: dict[str, Any] = {
    "zero_optimization": {
        "stage": 3,
        "reduce_bucket_size": 10000000,
        "reduce_scatter": True,
        "zero_quantized_weights": True,
        "zero_hpz_partition_size": 16,
        "zero_quantized_gradients": True,
        "contiguous_gradients": True,
        "overlap_comm": True,
    }
}

# Every key zeropp reads, with a valid value.
FULL_CONFIG: dict[str, Any] = {
    "train_batch_size": 32,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "steps_per_print": 5,
    "wall_clock_breakdown": False,
    "bf16": {"enabled": False},
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12,
             "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1},
    "optimizer": {"type": "AdamW",
                  "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupCosineLR",
                  "params": {"total_num_steps": 1000, "warmup_num_steps": 100,
                             "warmup_min_ratio": 0.0, "cos_min_ratio": 0.1,
                             "warmup_type": "linear"}},
    "zero_optimization": {
        "stage": 3,
        "zero_quantized_weights": True,
        "zero_quantized_nontrainable_weights": False,
        "zero_hpz_partition_size": 8,
        "zero_quantized_gradients": True,
        "reduce_bucket_size": 5e8,
        "stage3_prefetch_bucket_size": 50000000,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_scatter": True,
        "zeropp": {"block_size": 128, "weight_bits": 8, "weight_code": "asymmetric",
                   "unquantized_parameters": ["*embed_tokens*", "lm_head.*"], "grad_bits_intra": 8,
                   "grad_bits_inter": 4, "quantize_intra_node_weights": True,
                   "error_feedback": True, "grad_rotation": "hadamard", "grad_rounding": "stochastic",
                   "grad_levels": "normal", "grad_block_size": 64, "grad_scale_bits": 8, "overlap": True,
                   "hierarchical_gather": True},
    },
}


@pytest.fixture(autouse=True)
def fresh_ignored_key_report(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts as a fresh process would: no ignored key reported yet."""
    monkeypatch.setattr(config_module, "_REPORTED_IGNORED_KEYS", set())


def with_value(config: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    """A deep copy of ``config`` with the dotted key set to ``value``, creating sections."""
    result = copy.deepcopy(config)
    *parents, last = dotted.split(".")
    section = result
    for name in parents:
        section = section.setdefault(name, {})
    section[last] = value
    return result


def without(config: dict[str, Any], dotted: str) -> dict[str, Any]:
    result = copy.deepcopy(config)
    *parents, last = dotted.split(".")
    section = result
    for name in parents:
        section = section[name]
    del section[last]
    return result


def assert_names(error: pytest.ExceptionInfo[ValueError], key: str, value: Any) -> None:
    message = str(error.value)
    assert key in message and repr(value) in message, message


# --- ZeroPPConfig ---------------------------------------------------------------------------


def test_zeropp_defaults_are_plain_fsdp2() -> None:
    config = ZeroPPConfig()
    assert not (config.quantized_weights or config.quantized_gradients or config.error_feedback)
    assert config.hpz_partition_size == 1 and config.block_size == 256
    assert (config.weight_bits, config.grad_bits_intra, config.grad_bits_inter) == (8, 8, 4)
    assert config.param_dtype is None and config.reduce_dtype is None


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(ZeroPPConfig)])
def test_zeropp_every_field_rejects_a_string(name: str) -> None:
    with pytest.raises(ValueError) as error:
        ZeroPPConfig(**{name: "yes"})  # type: ignore[arg-type]
    assert str(error.value).startswith(f"{name}='yes' is not allowed; expected ")


@pytest.mark.parametrize(
    ("name", "value", "allowed"),
    [
        ("quantized_weights", 1, "a bool"),
        ("quantized_nontrainable_weights", None, "a bool"),
        ("quantized_gradients", 0, "a bool"),
        ("quantize_intra_node_weights", 1.0, "a bool"),
        ("error_feedback", "true", "a bool"),
        ("hpz_partition_size", 0, "an int >= 1"),
        ("hpz_partition_size", True, "an int >= 1"),
        ("hpz_partition_size", 8.0, "an int >= 1"),
        ("block_size", 100, "a power of two from 8 to 65536"),
        ("block_size", 4, "a power of two from 8 to 65536"),
        ("block_size", 131072, "a power of two from 8 to 65536"),
        ("block_size", 256.0, "a power of two from 8 to 65536"),
        ("weight_bits", 1, "an int from 2 to 8"),
        ("weight_bits", 9, "an int from 2 to 8"),
        ("weight_bits", 8.0, "an int from 2 to 8"),
        ("grad_bits_intra", 16, "2, 4 or 8"),
        ("grad_bits_intra", 6, "2, 4 or 8"),
        ("grad_bits_inter", True, "2, 4 or 8"),
        ("low_bit_trainable_weights", 1, "a bool"),
        ("overlap", "yes", "a bool"),
        ("hierarchical_gather", 1, "a bool"),
        ("weight_code", "q4_1", "'symmetric' or 'asymmetric'"),
        ("unquantized_parameters", "*embed*", "a list of parameter-name patterns"),
        ("unquantized_parameters", ["ok", 3], "a list of parameter-name patterns"),
        ("grad_full_precision_parameters", "*ln*", "a list of parameter-name patterns"),
        ("grad_full_precision_below", -1, "an int >= 0"),
        ("grad_full_precision_below", 1024.0, "an int >= 0"),
        ("param_dtype", torch.float64, "torch.bfloat16"),
        ("param_dtype", "bfloat16", "torch.bfloat16"),
        ("reduce_dtype", torch.int8, "torch.float32"),
    ],
)
def test_zeropp_rejects_bad_values(name: str, value: Any, allowed: str) -> None:
    with pytest.raises(ValueError) as error:
        ZeroPPConfig(**{name: value})
    assert_names(error, name, value)
    assert allowed in str(error.value)


@pytest.mark.parametrize("dtype", [None, torch.float32, torch.bfloat16, torch.float16])
def test_zeropp_accepts_mixed_precision_dtypes(dtype: torch.dtype | None) -> None:
    config = ZeroPPConfig(param_dtype=dtype, reduce_dtype=dtype)
    assert config.param_dtype is dtype and config.reduce_dtype is dtype


@pytest.mark.parametrize("block_size", [8, 256, 4096, 65536])
def test_zeropp_accepts_powers_of_two(block_size: int) -> None:
    assert ZeroPPConfig(block_size=block_size, weight_bits=4).block_size == block_size


@pytest.mark.parametrize("bits", range(2, 9))
def test_zeropp_accepts_every_weight_width_for_frozen_weights(bits: int) -> None:
    config = ZeroPPConfig(quantized_nontrainable_weights=True, weight_bits=bits)
    assert config.weight_bits == bits and config.quantizes_weights


def test_hierarchical_gather_needs_qwz() -> None:
    with pytest.raises(ValueError, match=r"hierarchical_gather=true changes qwZ's weight gather, which is off.*"
                                         r"zero_quantized_weights"):
        ZeroPPConfig.from_deepspeed({"zero_optimization": {"stage": 3, "zeropp": {"hierarchical_gather": True}}})
    assert ZeroPPConfig(quantized_nontrainable_weights=True, hierarchical_gather=True).hierarchical_gather


def test_full_precision_gradients_from_deepspeed_json() -> None:
    """The keys reach the config under zero_optimization.zeropp; patterns without qgZ, or beside a
    lower-error gradient code (which cannot send raw segments), are refused by name."""
    section = {"stage": 3, "zero_quantized_gradients": True,
               "zeropp": {"grad_full_precision_parameters": ["*ln*", "*.bias"], "grad_full_precision_below": 1024}}
    config = ZeroPPConfig.from_deepspeed({"zero_optimization": section})
    assert config.grad_full_precision_parameters == ("*ln*", "*.bias") and config.grad_full_precision_below == 1024
    with pytest.raises(ValueError, match=r"grad_full_precision_parameters=\['\*ln\*'\].*qgZ is off.*"
                                         r"set quantized_gradients=true"):
        ZeroPPConfig(grad_full_precision_parameters=("*ln*",))
    with pytest.raises(ValueError, match=r"grad_full_precision_below=1024.*grad_levels='normal'"):
        ZeroPPConfig(quantized_gradients=True, grad_full_precision_below=1024, grad_levels="normal")


def test_wide_gradients_from_deepspeed_json() -> None:
    """``grad_wide_parameters`` reaches the config under zero_optimization.zeropp; without qgZ, or
    beside a lower-error gradient code, it is refused by name."""
    section = {"stage": 3, "zero_quantized_gradients": True, "zeropp": {"grad_wide_parameters": ["*embed*"]}}
    assert ZeroPPConfig.from_deepspeed({"zero_optimization": section}).grad_wide_parameters == ("*embed*",)
    with pytest.raises(ValueError, match=r"grad_wide_parameters=\['\*embed\*'\].*qgZ is off.*quantized_gradients=true"):
        ZeroPPConfig(grad_wide_parameters=("*embed*",))
    with pytest.raises(ValueError, match=r"grad_wide_parameters=.*grad_rotation='hadamard'"):
        ZeroPPConfig(quantized_gradients=True, grad_wide_parameters=("*embed*",), grad_rotation="hadamard")


def test_low_bit_trainable_weights_need_the_opt_in() -> None:
    with pytest.raises(ValueError, match=r"weight_bits=2 with quantized_weights=true is not allowed.*3 levels"
                                         r".*weight_bits >= 4.*quantized_nontrainable_weights.*low_bit_trainable"):
        ZeroPPConfig(quantized_weights=True, weight_bits=2)
    with pytest.raises(ValueError, match=r"zeropp\.weight_bits=3 with zero_optimization\.zero_quantized_weights=true"):
        ZeroPPConfig.from_deepspeed({"zero_optimization": {
            "stage": 3, "zero_quantized_weights": True, "zeropp": {"weight_bits": 3}}})
    config = ZeroPPConfig.from_deepspeed({"zero_optimization": {
        "stage": 3, "zero_quantized_weights": True,
        "zeropp": {"weight_bits": 2, "low_bit_trainable_weights": True}}})
    assert (config.weight_bits, config.low_bit_trainable_weights) == (2, True)
    assert ZeroPPConfig(quantized_weights=True, weight_bits=4).weight_bits == 4


@pytest.mark.parametrize(("options", "key", "smallest"), [
    ({"quantized_weights": True, "weight_bits": 6, "block_size": 8}, "weight_bits=6", 16),
    ({"quantized_nontrainable_weights": True, "weight_bits": 3, "block_size": 16}, "weight_bits=3", 32),
    ({"quantized_gradients": True, "grad_bits_inter": 2, "block_size": 8}, "grad_bits_inter=2", 16),
])
def test_block_size_must_fit_every_code_width(options: dict[str, Any], key: str, smallest: int) -> None:
    with pytest.raises(ValueError, match=rf"block_size=\d+ is not allowed with {key}.*block_size >= {smallest}"):
        ZeroPPConfig(**options)
    assert ZeroPPConfig(**{**options, "block_size": smallest}).block_size == smallest
    assert ZeroPPConfig(weight_bits=3, block_size=8).weight_bits == 3  # qwZ off: the width is unused


def test_grad_block_size_is_qgz_own() -> None:
    """qgZ codes with ``grad_block_size`` where it is set (checked against the gradient widths),
    qwZ keeps ``block_size``."""
    with pytest.raises(ValueError, match=r"grad_block_size=8 is not allowed with grad_bits_inter=2.*"
                                         r"grad_block_size >= 16"):
        ZeroPPConfig(quantized_gradients=True, grad_bits_inter=2, grad_block_size=8)
    config = ZeroPPConfig(quantized_weights=True, weight_bits=6, block_size=256, quantized_gradients=True,
                          grad_block_size=64, grad_scale_bits=8)
    assert (config.block_size, config.gradient_block_size, config.gradient_code.grouped_scales) == (256, 64, True)
    assert ZeroPPConfig(block_size=128).gradient_block_size == 128


def test_zeropp_is_frozen_and_keyword_only() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        ZeroPPConfig().block_size = 512  # type: ignore[misc]
    with pytest.raises(TypeError):
        ZeroPPConfig(True)  # type: ignore[misc]


# --- TrainingConfig, optimizer, scheduler ---------------------------------------------------


@pytest.mark.parametrize(
    ("name", "value", "allowed"),
    [
        ("train_batch_size", 0, "an int >= 1"),
        ("train_micro_batch_size_per_gpu", 2.0, "an int >= 1"),
        ("gradient_accumulation_steps", False, "an int >= 1"),
        ("gradient_clipping", -1.0, "a finite number >= 0"),
        ("gradient_clipping", float("inf"), "a finite number >= 0"),
        ("gradient_clipping", float("nan"), "a finite number >= 0"),
        ("gradient_clipping", True, "a finite number >= 0"),
        ("bf16", 1, "a bool"),
        ("loss_scale", -2.0, "a finite number >= 0"),
        ("initial_scale_power", 128, "an int from 0 to 127"),
        ("initial_scale_power", -1, "an int from 0 to 127"),
        ("loss_scale_window", 0, "an int >= 1"),
        ("hysteresis", 0, "an int >= 1"),
        ("min_loss_scale", 0.0, "a finite number > 0"),
        ("optimizer", {"type": "AdamW"}, "an OptimizerConfig or None"),
        ("scheduler", "WarmupLR", "a SchedulerConfig or None"),
        ("steps_per_print", 0, "an int >= 1"),
        ("wall_clock_breakdown", None, "a bool"),
    ],
)
def test_training_rejects_bad_values(name: str, value: Any, allowed: str) -> None:
    with pytest.raises(ValueError) as error:
        TrainingConfig(**{name: value})
    assert_names(error, name, value)
    assert allowed in str(error.value)


def test_training_normalises_numbers_and_refuses_two_half_precisions() -> None:
    config = TrainingConfig(gradient_clipping=1, min_loss_scale=2)
    assert config.gradient_clipping == 1.0 and isinstance(config.gradient_clipping, float)
    assert isinstance(config.min_loss_scale, float)
    with pytest.raises(ValueError, match="bf16=True and fp16=True"):
        TrainingConfig(bf16=True, fp16=True)


@pytest.mark.parametrize(
    ("train", "micro", "accum", "world_size", "expected"),
    [
        (32, 4, 2, 4, (32, 4, 2)),
        (32, 4, None, 4, (32, 4, 2)),
        (32, None, 2, 4, (32, 4, 2)),
        (None, 4, 2, 4, (32, 4, 2)),
        (None, 4, None, 4, (16, 4, 1)),
        (32, None, None, 4, (32, 8, 1)),
        (8, 8, 1, 1, (8, 8, 1)),
    ],
)
def test_resolve_batch_fills_the_missing_one(
    train: int | None, micro: int | None, accum: int | None, world_size: int,
    expected: tuple[int, int, int],
) -> None:
    config = TrainingConfig(train_batch_size=train, train_micro_batch_size_per_gpu=micro,
                            gradient_accumulation_steps=accum)
    assert config.resolve_batch(world_size) == expected


@pytest.mark.parametrize(
    ("train", "micro", "accum", "world_size", "problem"),
    [
        (None, None, 2, 4, "set train_batch_size or train_micro_batch_size_per_gpu"),
        (None, None, None, 4, "set train_batch_size or train_micro_batch_size_per_gpu"),
        (32, 4, 4, 4, "must equal"),
        (30, 4, None, 4, "must equal"),
        (30, None, 2, 4, "must equal"),
        (2, None, None, 4, "must equal"),
        (8, 4, None, 4, "must equal"),
    ],
)
def test_resolve_batch_names_all_three_and_the_world_size(
    train: int | None, micro: int | None, accum: int | None, world_size: int, problem: str
) -> None:
    config = TrainingConfig(train_batch_size=train, train_micro_batch_size_per_gpu=micro,
                            gradient_accumulation_steps=accum)
    with pytest.raises(ValueError) as error:
        config.resolve_batch(world_size)
    message = str(error.value)
    assert problem in message
    for part in (f"train_batch_size={train}", f"train_micro_batch_size_per_gpu={micro}",
                 f"gradient_accumulation_steps={accum}", f"world_size={world_size}"):
        assert part in message, message


@pytest.mark.parametrize("world_size", [0, -2, True, 4.0])
def test_resolve_batch_rejects_a_bad_world_size(world_size: Any) -> None:
    with pytest.raises(ValueError) as error:
        TrainingConfig(train_batch_size=8).resolve_batch(world_size)
    assert_names(error, "world_size", world_size)


@pytest.mark.parametrize(("given", "canonical"), [("adamw", "AdamW"), ("ADAM", "Adam"),
                                                  ("sgd", "SGD"), ("AdamW", "AdamW")])
def test_optimizer_type_is_case_insensitive(given: str, canonical: str) -> None:
    assert OptimizerConfig(type=given).type == canonical


def test_optimizer_params_are_normalised() -> None:
    config = OptimizerConfig(type="AdamW", params={"lr": 1, "betas": [0.9, 0.99]})
    assert config.params == {"lr": 1.0, "betas": (0.9, 0.99)}
    assert isinstance(config.params["lr"], float)


@pytest.mark.parametrize(
    ("params", "class_name", "kwargs"),
    [
        ({"type": "AdamW"}, "AdamW", {"weight_decay": 0.0}),
        ({"type": "Adam", "params": {"lr": 0.1}}, "AdamW", {"lr": 0.1, "weight_decay": 0.0}),
        ({"type": "Adam", "params": {"adam_w_mode": False}}, "Adam", {"weight_decay": 0.0}),
        ({"type": "AdamW", "params": {"adam_w_mode": False}}, "AdamW", {"weight_decay": 0.0}),
        ({"type": "AdamW", "params": {"torch_adam": True}}, "AdamW", {}),
        ({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}, "SGD",
         {"lr": 0.1, "momentum": 0.9}),
    ],
)
def test_optimizer_maps_deepspeed_semantics_to_torch(
    params: dict[str, Any], class_name: str, kwargs: dict[str, Any]
) -> None:
    config = OptimizerConfig(type=params["type"], params=params.get("params", {}))
    assert config.torch_class_name == class_name
    assert config.torch_kwargs() == kwargs
    getattr(torch.optim, class_name)([torch.zeros(2, requires_grad=True)], **kwargs)


def test_optimizer_unknown_param_lists_the_allowed_ones() -> None:
    with pytest.raises(ValueError) as error:
        OptimizerConfig(type="SGD", params={"lr": 0.1, "betas": [0.9, 0.9]})
    assert_names(error, "optimizer.params.betas", [0.9, 0.9])
    assert "lr, momentum, dampening, weight_decay, nesterov" in str(error.value)


def test_sgd_momentum_must_be_non_negative() -> None:
    with pytest.raises(ValueError) as error:
        OptimizerConfig(type="SGD", params={"momentum": -0.9})
    assert_names(error, "optimizer.params.momentum", -0.9)


@pytest.mark.parametrize(
    ("scheduler_type", "params", "expected"),
    [
        ("WarmupLR", {}, {"warmup_min_lr": 0.0, "warmup_max_lr": 0.001,
                          "warmup_num_steps": 1000, "warmup_type": "log"}),
        ("WarmupDecayLR", {"total_num_steps": 10, "warmup_max_lr": 1},
         {"warmup_min_lr": 0.0, "warmup_max_lr": 1.0, "warmup_num_steps": 1000,
          "warmup_type": "log", "total_num_steps": 10}),
        ("WarmupCosineLR", {"total_num_steps": 10},
         {"total_num_steps": 10, "warmup_min_ratio": 0.0, "warmup_num_steps": 1000,
          "cos_min_ratio": 0.0001, "warmup_type": "log"}),
    ],
)
def test_scheduler_fills_deepspeed_defaults(
    scheduler_type: str, params: dict[str, Any], expected: dict[str, Any]
) -> None:
    assert SchedulerConfig(type=scheduler_type, params=params).params == expected


@pytest.mark.parametrize("scheduler_type", ["WarmupDecayLR", "WarmupCosineLR"])
def test_scheduler_requires_total_num_steps(scheduler_type: str) -> None:
    with pytest.raises(ValueError, match=f"scheduler.params.total_num_steps is missing; "
                                         f"{scheduler_type} requires it"):
        SchedulerConfig(type=scheduler_type, params={"warmup_num_steps": 5})


def test_scheduler_type_is_exact_and_params_are_per_type() -> None:
    with pytest.raises(ValueError) as error:
        SchedulerConfig(type="warmuplr")
    assert_names(error, "scheduler.type", "warmuplr")
    assert "WarmupLR, WarmupDecayLR, WarmupCosineLR" in str(error.value)
    with pytest.raises(ValueError) as error:
        SchedulerConfig(type="WarmupLR", params={"cos_min_ratio": 0.1})
    assert_names(error, "scheduler.params.cos_min_ratio", 0.1)
    assert "warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type" in str(error.value)


# --- parse_deepspeed ------------------------------------------------------------------------


def test_tutorial_config_turns_on_all_three_techniques() -> None:
    parsed = parse_deepspeed(TUTORIAL_CONFIG)
    assert parsed.zeropp == ZeroPPConfig(quantized_weights=True, hpz_partition_size=16,
                                         quantized_gradients=True)
    assert parsed.ignored_keys == (
        "zero_optimization.reduce_bucket_size", "zero_optimization.reduce_scatter",
        "zero_optimization.contiguous_gradients", "zero_optimization.overlap_comm",
    )
    assert parsed.training == TrainingConfig()


def test_full_config_reaches_every_field() -> None:
    parsed = parse_deepspeed(FULL_CONFIG)
    assert parsed.zeropp == ZeroPPConfig(
        quantized_weights=True, hpz_partition_size=8, quantized_gradients=True, block_size=128,
        weight_bits=8, weight_code="asymmetric", unquantized_parameters=("*embed_tokens*", "lm_head.*"),
        grad_bits_intra=8, grad_bits_inter=4, quantize_intra_node_weights=True,
        error_feedback=True, grad_rotation="hadamard", grad_rounding="stochastic", grad_levels="normal",
        grad_block_size=64, grad_scale_bits=8, overlap=True, hierarchical_gather=True, param_dtype=torch.float16)
    assert parsed.zeropp.gradient_code == GradientCode(rotation="hadamard", rounding="stochastic", levels="normal",
                                                       scale_bits=8)
    assert parsed.zeropp.gradient_block_size == 64
    training = parsed.training
    assert training.resolve_batch(4) == (32, 4, 2)
    assert (training.fp16, training.bf16, training.initial_scale_power) == (True, False, 12)
    assert (training.loss_scale_window, training.min_loss_scale, training.steps_per_print) == (
        500, 1.0, 5)
    assert training.optimizer == OptimizerConfig(type="AdamW", params={
        "lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1})
    assert training.scheduler is not None and training.scheduler.params["cos_min_ratio"] == 0.1
    assert parsed.ignored_keys == tuple(
        f"zero_optimization.{name}" for name in ("reduce_bucket_size",
                                                 "stage3_prefetch_bucket_size", "overlap_comm",
                                                 "contiguous_gradients", "reduce_scatter"))


def test_path_and_dict_give_the_same_result(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(FULL_CONFIG))
    expected = parse_deepspeed(FULL_CONFIG)
    assert parse_deepspeed(path) == expected
    assert parse_deepspeed(str(path)) == expected
    assert ZeroPPConfig.from_deepspeed(path) == expected.zeropp
    assert isinstance(expected, DeepSpeedConfig)


@pytest.mark.parametrize(("enabled", "dtype"), [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_half_precision_sets_param_dtype_only(enabled: str, dtype: torch.dtype) -> None:
    parsed = parse_deepspeed({**TUTORIAL_CONFIG, enabled: {"enabled": True}})
    assert parsed.zeropp.param_dtype is dtype and parsed.zeropp.reduce_dtype is None
    assert getattr(parsed.training, enabled) is True


def test_disabled_half_precision_keeps_the_model_dtype() -> None:
    parsed = parse_deepspeed({**TUTORIAL_CONFIG, "bf16": {"enabled": False}, "fp16": {}})
    assert parsed.zeropp.param_dtype is None
    assert not parsed.training.bf16 and not parsed.training.fp16


def test_bf16_and_fp16_together_are_an_error() -> None:
    config = {**TUTORIAL_CONFIG, "bf16": {"enabled": True}, "fp16": {"enabled": True}}
    with pytest.raises(ValueError, match="bf16.enabled=True and fp16.enabled=True"):
        parse_deepspeed(config)


@pytest.mark.parametrize(
    ("key", "value", "allowed"),
    [
        ("zero_optimization.stage", 2, "3 (zeropp implements ZeRO-3 only)"),
        ("zero_optimization.stage", 0, "3 (zeropp implements ZeRO-3 only)"),
        ("zero_optimization.stage", "3", "3 (zeropp implements ZeRO-3 only)"),
        ("zero_optimization.stage", 3.0, "3 (zeropp implements ZeRO-3 only)"),
        ("zero_optimization", [], "a JSON object"),
        ("zero_optimization.zero_quantized_weights", "yes", "a bool"),
        ("zero_optimization.zero_quantized_weights", 1, "a bool"),
        ("zero_optimization.zero_quantized_nontrainable_weights", None, "a bool"),
        ("zero_optimization.zero_hpz_partition_size", 0, "an int >= 1"),
        ("zero_optimization.zero_hpz_partition_size", 16.0, "an int >= 1"),
        ("zero_optimization.zero_quantized_gradients", "true", "a bool"),
        ("zero_optimization.reduce_bucket_size", -1, "a finite number >= 0"),
        ("zero_optimization.reduce_bucket_size", "5e8", "a finite number >= 0"),
        ("zero_optimization.reduce_bucket_size", 10**400, "a finite number >= 0"),
        ("zero_optimization.stage3_prefetch_bucket_size", float("inf"), "a finite number >= 0"),
        ("zero_optimization.overlap_comm", 1, "a bool"),
        ("zero_optimization.contiguous_gradients", "no", "a bool"),
        ("zero_optimization.reduce_scatter", [], "a bool"),
        ("zero_optimization.zeropp", [], "a JSON object"),
        ("zero_optimization.zeropp.block_size", 100, "a power of two from 8 to 65536"),
        ("zero_optimization.zeropp.weight_bits", 1, "an int from 2 to 8"),
        ("zero_optimization.zeropp.grad_bits_intra", 8.0, "2, 4 or 8"),
        ("zero_optimization.zeropp.grad_bits_inter", 16, "2, 4 or 8"),
        ("zero_optimization.zeropp.quantize_intra_node_weights", 0, "a bool"),
        ("zero_optimization.zeropp.error_feedback", "on", "a bool"),
        ("zero_optimization.zeropp.grad_rotation", "fwht", "'none' or 'hadamard'"),
        ("zero_optimization.zeropp.grad_rounding", True, "'nearest' or 'stochastic'"),
        ("zero_optimization.zeropp.grad_levels", "nf4", "'uniform' or 'normal'"),
        ("zero_optimization.zeropp.grad_scale_bits", 16, "32 or 8"),
        ("zero_optimization.zeropp.grad_block_size", 48, "a power of two from 8 to 65536"),
        ("zero_optimization.zeropp.weight_code", "minmax", "'symmetric' or 'asymmetric'"),
        ("zero_optimization.zeropp.blocksize", 64, "accepts only block_size, weight_bits"),
        ("bf16", True, "a JSON object"),
        ("bf16.enabled", "true", "a bool"),
        ("fp16", [], "a JSON object"),
        ("fp16.enabled", 1, "a bool"),
        ("fp16.loss_scale", -1, "a finite number >= 0"),
        ("fp16.initial_scale_power", 200, "an int from 0 to 127"),
        ("fp16.loss_scale_window", 0, "an int >= 1"),
        ("fp16.hysteresis", 1.5, "an int >= 1"),
        ("fp16.min_loss_scale", 0, "a finite number > 0"),
        ("train_batch_size", 0, "an int >= 1"),
        ("train_micro_batch_size_per_gpu", 2.0, "an int >= 1"),
        ("gradient_accumulation_steps", -1, "an int >= 1"),
        ("gradient_clipping", -0.5, "a finite number >= 0"),
        ("gradient_clipping", float("nan"), "a finite number >= 0"),
        ("steps_per_print", 0, "an int >= 1"),
        ("wall_clock_breakdown", "false", "a bool"),
        ("optimizer", "AdamW", "a JSON object"),
        ("optimizer.type", "Lamb", "one of AdamW, Adam, SGD (any case)"),
        ("optimizer.type", 3, "one of AdamW, Adam, SGD (any case)"),
        ("optimizer.params", [], "a JSON object"),
        ("optimizer.params", None, "a JSON object"),
        ("optimizer.params.lr", -1e-3, "a finite number >= 0"),
        ("optimizer.params.lr", "1e-3", "a finite number >= 0"),
        ("optimizer.params.betas", [0.9], "a list of two numbers, each in [0, 1)"),
        ("optimizer.params.betas", [0.9, 1.0], "a list of two numbers, each in [0, 1)"),
        ("optimizer.params.betas", {"beta1": 0.9}, "a list of two numbers, each in [0, 1)"),
        ("optimizer.params.eps", 0, "a finite number > 0"),
        ("optimizer.params.weight_decay", -0.1, "a finite number >= 0"),
        ("optimizer.params.momentum", 0.9, "accepts only lr, betas, eps, weight_decay"),
        ("scheduler", [], "a JSON object"),
        ("scheduler.type", "OneCycle", "one of WarmupLR, WarmupDecayLR, WarmupCosineLR"),
        ("scheduler.params.warmup_type", "cosine", '"log" or "linear"'),
        ("scheduler.params.warmup_num_steps", -1, "an int >= 0"),
        ("scheduler.params.total_num_steps", 0, "an int >= 1"),
        ("scheduler.params.cos_min_ratio", -1, "a finite number >= 0"),
        ("scheduler.params.warmup_min_ratio", "0", "a finite number >= 0"),
        ("scheduler.params.warmup_max_lr", 0.1, "accepts only total_num_steps"),
    ],
)
def test_parse_error_names_key_value_and_what_is_allowed(
    key: str, value: Any, allowed: str
) -> None:
    with pytest.raises(ValueError) as error:
        parse_deepspeed(with_value(FULL_CONFIG, key, value))
    if key == "zero_optimization.reduce_bucket_size" and isinstance(value, int) and value > 10**300:
        assert key in str(error.value)  # reprlib shortens the 401-digit value
    else:
        assert_names(error, key, value)
    assert allowed in str(error.value)


@pytest.mark.parametrize(
    "key",
    ["train_batch_size", "gradient_accumulation_steps", "gradient_clipping", "bf16.enabled",
     "fp16.loss_scale", "zero_optimization.stage", "zero_optimization.reduce_bucket_size",
     "zero_optimization.zero_hpz_partition_size", "zero_optimization.zeropp.block_size",
     "optimizer.params.lr", "optimizer.params.betas", "scheduler.params.total_num_steps"],
)
def test_auto_must_be_resolved_first(key: str) -> None:
    with pytest.raises(ValueError) as error:
        parse_deepspeed(with_value(FULL_CONFIG, key, "auto"))
    assert_names(error, key, "auto")
    assert "Hugging Face Trainer placeholder" in str(error.value)


@pytest.mark.parametrize(
    ("missing", "message"),
    [
        ("zero_optimization", "zero_optimization.stage is missing; zeropp implements ZeRO-3 only"),
        ("zero_optimization.stage", "zero_optimization.stage is missing"),
        ("optimizer.type", "optimizer.type is missing; expected one of AdamW, Adam, SGD"),
        ("scheduler.type", "scheduler.type is missing; expected one of WarmupLR"),
        ("scheduler.params.total_num_steps", "scheduler.params.total_num_steps is missing"),
    ],
)
def test_missing_required_keys_are_named(missing: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_deepspeed(without(FULL_CONFIG, missing))


def test_unknown_and_unused_keys_are_ignored_by_dotted_name() -> None:
    config = with_value(FULL_CONFIG, "activation_checkpointing", {"partition_activations": True})
    config = with_value(config, "zero_optimization.memory_efficient_linear", False)  # offload: tests/test_offload.py
    config = with_value(config, "fp16.auto_cast", False)
    config = with_value(config, "optimizer.legacy_fusion", False)
    config = with_value(config, "bf16.enabled_typo", "anything")
    config = with_value(config, "zero_optimization.stage3_max_live_parameters", "auto")
    ignored = parse_deepspeed(config).ignored_keys
    for key in ("activation_checkpointing", "zero_optimization.memory_efficient_linear",
                "fp16.auto_cast", "optimizer.legacy_fusion", "bf16.enabled_typo",
                "zero_optimization.stage3_max_live_parameters"):
        assert key in ignored


def test_a_dotted_name_is_not_a_nested_key() -> None:
    parsed = parse_deepspeed({**TUTORIAL_CONFIG, "bf16.enabled": True})
    assert parsed.zeropp.param_dtype is None and "bf16.enabled" in parsed.ignored_keys
    with pytest.raises(ValueError, match="zero_optimization.zeropp.x.block_size=8 is not a zeropp"):
        parse_deepspeed({"zero_optimization": {"stage": 3, "zeropp": {"x.block_size": 8}}})


def test_ignored_keys_are_reported_once_per_process(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="zeropp"):
        parse_deepspeed(TUTORIAL_CONFIG)
        parse_deepspeed(TUTORIAL_CONFIG)
        parse_deepspeed(FULL_CONFIG)
    messages = [record.getMessage() for record in caplog.records if record.name == "zeropp"]
    assert len(messages) == 2, messages
    for key in ("zero_optimization.reduce_bucket_size", "zero_optimization.overlap_comm",
                "zero_optimization.reduce_scatter", "zero_optimization.contiguous_gradients"):
        assert key in messages[0] and key not in messages[1]
    assert "zero_optimization.stage3_prefetch_bucket_size" in messages[1]


def test_a_config_without_ignored_keys_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="zeropp"):
        parse_deepspeed({"zero_optimization": {"stage": 3}})
    assert not caplog.records


def test_file_problems_name_the_path(tmp_path: pathlib.Path) -> None:
    cases = {
        "missing.json": None,
        "broken.json": '{"zero_optimization": {"stage": 3,}}',
        "list.json": "[1, 2]",
        "latin1.json": b'{"x": "\xe9"}',
        "deep.json": "[" * 100_000 + "]" * 100_000,
    }
    for name, content in cases.items():
        path = tmp_path / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        elif content is not None:
            path.write_text(content)
        with pytest.raises(ValueError, match=f"DeepSpeed config '{path}'"):
            parse_deepspeed(path)
    with pytest.raises(ValueError, match="DeepSpeed config"):
        parse_deepspeed(tmp_path)  # a directory
    with pytest.raises(ValueError, match="holds a JSON list at the top level"):
        parse_deepspeed(tmp_path / "list.json")


@pytest.mark.parametrize("config", [None, 3, [1], 2.5, True, b"{}"])
def test_config_must_be_a_dict_or_a_path(config: Any) -> None:
    with pytest.raises(ValueError) as error:
        parse_deepspeed(config)
    assert_names(error, "config", config)


# --- fuzz: only ValueError may escape -------------------------------------------------------

KNOWN_NAMES = sorted({
    *FULL_CONFIG, *FULL_CONFIG["zero_optimization"], *FULL_CONFIG["zero_optimization"]["zeropp"],
    *FULL_CONFIG["fp16"], "enabled", "type", "params", "lr", "betas", "eps", "weight_decay",
    "momentum", "nesterov", "adam_w_mode", "torch_adam", "total_num_steps", "warmup_min_lr",
    "warmup_max_lr", "warmup_type", "cos_min_ratio", "zeropp",
})
json_keys = st.sampled_from(KNOWN_NAMES) | st.text(max_size=5)
json_leaves = (st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5)
               | st.sampled_from(["auto", "log", "linear", "AdamW", "sgd", "WarmupLR"])
               | st.sampled_from([10**400, -(10**400), 2**63, float("inf"), float("nan"), 0, -1,
                                  0.5, 3, 8, 256]))
json_values = st.recursive(
    json_leaves,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(json_keys, children,
                                                                     max_size=4),
    max_leaves=12,
)
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def parses_or_raises_value_error(config: Any) -> None:
    try:
        parse_deepspeed(config)
    except ValueError as error:
        assert str(error)


def dotted_paths(section: dict[str, Any], prefix: str = "") -> list[str]:
    paths = []
    for name, value in section.items():
        paths.append(prefix + name)
        if isinstance(value, dict):
            paths.extend(dotted_paths(value, f"{prefix}{name}."))
    return paths


NASTY_VALUES = [None, True, False, 0, -1, 1, 2**63, 10**400, -(10**400), 0.5, -0.0, float("inf"),
                float("-inf"), float("nan"), "", "auto", "3", [], [1, 2], [0.9, 0.99], {},
                {"enabled": True}, {"type": "AdamW"}]


def test_every_key_with_every_nasty_value_raises_only_value_error() -> None:
    for path in dotted_paths(FULL_CONFIG):
        for value in NASTY_VALUES:
            parses_or_raises_value_error(with_value(FULL_CONFIG, path, value))


@FUZZ
@given(st.dictionaries(json_keys, json_values, max_size=6) | json_values)
def test_fuzz_random_whole_configs(config: Any) -> None:
    if isinstance(config, str):
        config = [config]  # a str is a path; random paths are not what this test is about
    parses_or_raises_value_error(config)


@FUZZ
@given(st.dictionaries(json_keys, json_values, max_size=4),
       st.dictionaries(json_keys, json_values, max_size=4))
def test_fuzz_random_keys_inside_a_stage_3_config(
    top: dict[str, Any], zero: dict[str, Any]
) -> None:
    parses_or_raises_value_error({**top, "zero_optimization": {**zero, "stage": 3}})


@FUZZ
@given(st.sampled_from(dotted_paths(FULL_CONFIG)), json_leaves | json_values, json_keys)
def test_fuzz_values_substituted_into_a_valid_config(path: str, value: Any, extra: str) -> None:
    parses_or_raises_value_error(with_value(FULL_CONFIG, path, value))
    parent = path.rpartition(".")[0]
    if parent:
        parses_or_raises_value_error(with_value(FULL_CONFIG, f"{parent}.{extra}", value))


@FUZZ
@given(st.dictionaries(st.sampled_from([f.name for f in dataclasses.fields(ZeroPPConfig)]),
                       json_values | st.sampled_from([torch.float64, torch.bfloat16]), max_size=4))
def test_fuzz_zeropp_config_fields(fields: dict[str, Any]) -> None:
    try:
        ZeroPPConfig(**fields)
    except ValueError as error:
        assert str(error)
