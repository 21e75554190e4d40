"""A DeepSpeed config under HF Trainer (``zeropp.hf.ZeroPPTrainer``): "auto" values from
TrainingArguments, disagreements named, ZeRO++ keys honoured, ``TrainingArguments.deepspeed``."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from distributed import run_distributed
from models import TokenRows

pytest.importorskip("transformers")

TWO_BY_TWO = {"ZEROPP_RANKS_PER_NODE": "2"}
STEPS = 4
ZEROPP_KEYS = {"stage": 3, "zero_quantized_weights": True, "zero_hpz_partition_size": 2,
               "zero_quantized_gradients": True, "zeropp": {"block_size": 128}}
TRAINER_KEYS_AUTO = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                     "train_batch_size": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
                     "fp16": {"enabled": "auto"}}


def _arguments(**overrides):
    from transformers import TrainingArguments

    return TrainingArguments(**{"output_dir": "unused", "per_device_train_batch_size": 2,
                                "gradient_accumulation_steps": 3, "max_grad_norm": 0.5, "learning_rate": 0.1,
                                "adam_beta1": 0.8, "adam_beta2": 0.99, "adam_epsilon": 1e-7, "weight_decay": 0.01,
                                "use_cpu": True, "report_to": [], **overrides})


def test_auto_values_come_from_training_arguments_and_zeropp_keys_are_honoured() -> None:
    from zeropp.config import ZeroPPConfig
    from zeropp.integrations.hf_deepspeed import complete_from_training_arguments

    config = {**TRAINER_KEYS_AUTO,
              "zero_optimization": {**ZEROPP_KEYS, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                    "stage3_param_persistence_threshold": "auto"},
              "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                        "weight_decay": "auto"}},
              "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                                "warmup_num_steps": "auto", "total_num_steps": "auto"}}}
    completed = complete_from_training_arguments(config, _arguments())
    assert completed.zeropp == ZeroPPConfig(quantized_weights=True, hpz_partition_size=2, quantized_gradients=True,
                                            block_size=128)
    assert completed.optimizer.params == {"lr": 0.1, "betas": (0.8, 0.99), "eps": 1e-7, "weight_decay": 0.01}
    scheduler = completed.scheduler_config(100, warmup_steps=5)
    assert scheduler.params == {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1, "warmup_num_steps": 5,
                                "total_num_steps": 100, "warmup_type": "log"}
    assert completed.scheduler_config(100, warmup_steps=0).params["warmup_num_steps"] == 1  # DeepSpeed wants >= 1
    assert config["train_micro_batch_size_per_gpu"] == "auto"  # the caller's dict is left as it was


def test_values_given_that_agree_are_accepted_and_bf16_sets_the_compute_dtype() -> None:
    from zeropp.integrations.hf_deepspeed import complete_from_training_arguments

    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3, "train_batch_size": 6,
              "gradient_clipping": 0.5, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}
    assert complete_from_training_arguments(config, _arguments(bf16=True)).zeropp.param_dtype == torch.bfloat16


def test_a_disagreeing_key_names_both_values_and_the_fix() -> None:
    from zeropp.integrations.hf_deepspeed import complete_from_training_arguments

    config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.999]}}, "zero_optimization": {"stage": 3}}
    with pytest.raises(ValueError) as error:
        complete_from_training_arguments(config, _arguments())
    message = str(error.value)
    for expected in ("train_micro_batch_size_per_gpu=4 but TrainingArguments per_device_train_batch_size=2",
                     "gradient_clipping=1.0 but TrainingArguments max_grad_norm=0.5",
                     "bf16.enabled=True but TrainingArguments bf16=False",
                     "optimizer.params.betas=[0.9, 0.999] but TrainingArguments [adam_beta1, adam_beta2]=[0.8, 0.99]",
                     'or to "auto"'):
        assert expected in message, message


def test_a_scheduler_step_count_that_disagrees_with_training_is_named() -> None:
    from zeropp.integrations.hf_deepspeed import complete_from_training_arguments

    config = {"zero_optimization": {"stage": 3},
              "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 50}}}
    completed = complete_from_training_arguments(config, _arguments())
    with pytest.raises(ValueError, match="total_num_steps=50 but TrainingArguments the number of training steps=100"):
        completed.scheduler_config(100, warmup_steps=0)


def test_auto_outside_the_keys_trainer_owns_is_refused_by_name() -> None:
    from zeropp.integrations.hf_deepspeed import complete_from_training_arguments

    config = {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": "auto"}}
    with pytest.raises(ValueError, match="zero_optimization.zero_hpz_partition_size='auto' is not allowed"):
        complete_from_training_arguments(config, _arguments())


def _tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16))


def _Rows() -> TokenRows:
    return TokenRows(48, 16, 64)


def _trainer(out_dir: str, zeropp_config=None, **overrides):
    from transformers import TrainingArguments

    from zeropp.hf import ZeroPPTrainer

    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=2, max_steps=STEPS, learning_rate=0.5,
                             optim="sgd", lr_scheduler_type="constant", max_grad_norm=1.0, logging_steps=1,
                             save_strategy="no", report_to=[], seed=0, dataloader_drop_last=True, disable_tqdm=True,
                             **{"use_cpu": True, **overrides})
    model = _tiny_llama()
    return ZeroPPTrainer(model, args, train_dataset=_Rows(), zeropp_config=zeropp_config), model


def _train(out_dir: str, zeropp_config=None, **overrides) -> dict:
    trainer, model = _trainer(out_dir, zeropp_config, **overrides)
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    return {"losses": [e["loss"] for e in logs], "lrs": [e["learning_rate"] for e in logs],
            "final": {n: p.full_tensor().detach() for n, p in model.named_parameters()},
            "config": trainer.zeropp_config,
            "deepspeed_off": not trainer.is_deepspeed_enabled and trainer.args.deepspeed is None,
            "optimizer": type(trainer.optimizer.optimizer).__name__}


def _deepspeed_worker(rank: int, world_size: int, out_dir: str, with_deepspeed: bool) -> dict:
    from zeropp.config import ZeroPPConfig

    path = f"{out_dir}/ds_config.json"
    sgd = {"optimizer": {"type": "SGD", "params": {"lr": "auto"}}}
    if rank == 0:
        with open(path, "w") as f:
            json.dump({**TRAINER_KEYS_AUTO, "zero_optimization": ZEROPP_KEYS, **sgd}, f)
    torch.distributed.barrier()
    config = ZeroPPConfig(quantized_weights=True, hpz_partition_size=2, quantized_gradients=True, block_size=128)
    results = {"config": _train(f"{out_dir}/config", config), "json": _train(f"{out_dir}/json", path)}
    if with_deepspeed:  # read from TrainingArguments and cleared
        results["arguments"] = _train(f"{out_dir}/arguments", deepspeed=path)
        # without use_cpu, TrainingArguments(deepspeed=...) chooses DeepSpeed's distributed type;
        # once cleared, the choice is the one the same arguments make without a DeepSpeed config
        chosen = [_trainer(f"{out_dir}/devices", config, use_cpu=False, **given)[0].accelerator.state.distributed_type
                  for config, given in ((None, {"deepspeed": path}), (config, {}))]
        results["devices"] = [str(kind) for kind in chosen]
    warmup_decay = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                        "warmup_num_steps": "auto", "total_num_steps": "auto",
                                                        "warmup_type": "linear"}}
    results["schedule"] = _train(f"{out_dir}/schedule", {"zero_optimization": {"stage": 3}, **sgd,
                                                         "scheduler": warmup_decay}, warmup_steps=2)
    try:
        _train(f"{out_dir}/disagree", {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 4})
        results["disagreement"] = "no error"
    except ValueError as error:
        results["disagreement"] = str(error)
    reference = results["config"].pop("final")  # tensors stay in the worker (the result queue passes plain data)
    for run in results.values():
        if isinstance(run, dict) and "losses" in run:
            final = run.pop("final", reference)
            run["same_parameters"] = all(torch.equal(final[n], reference[n]) for n in reference)
    return results


@pytest.mark.slow
def test_deepspeed_json_trains_bit_for_bit_as_the_same_zeroppconfig(tmp_path) -> None:
    """4 SGD steps on 2x2 with all three techniques (block size 128 from ``zeropp.*``): the config
    given as a ZeroPPConfig, as a DeepSpeed JSON path (Trainer's keys "auto", an SGD optimizer
    section with lr "auto"), and as ``TrainingArguments(deepspeed=path)`` give the same losses and
    the same parameters bit for bit; Trainer runs no DeepSpeed. A WarmupDecayLR section with
    every parameter "auto" follows DeepSpeed's formula over Trainer's 4 steps and 2 warm-up
    steps. A disagreeing batch size is refused before anything trains."""
    from zeropp.engine.lr_schedules import warmup_decay_lr

    with_deepspeed = importlib.util.find_spec("deepspeed") is not None
    result = run_distributed(_deepspeed_worker, 4, str(tmp_path), with_deepspeed, env=TWO_BY_TWO, timeout=600)[0]
    reference = result["config"]
    print("losses", {name: run["losses"] for name, run in result.items() if isinstance(run, dict)})
    print("devices", result.get("devices"))
    assert len(reference["losses"]) == STEPS and reference["losses"][-1] < reference["losses"][0]
    for name in ("json", "arguments") if with_deepspeed else ("json",):
        run = result[name]
        assert run["config"] == reference["config"] and run["deepspeed_off"] and run["optimizer"] == "SGD"
        assert run["losses"] == reference["losses"], name
        assert run["same_parameters"], name
    if with_deepspeed:
        with_config, without = result["devices"]
        assert with_config == without and "DEEPSPEED" not in with_config, result["devices"]
    # the rate each step ran with (Trainer logs it): DeepSpeed's iteration k - 1 for step k
    expected = [warmup_decay_lr(step - 1, total_num_steps=STEPS, warmup_min_lr=0.0, warmup_max_lr=0.5,
                                warmup_num_steps=2, warmup_type="linear") for step in range(STEPS)]
    assert result["schedule"]["lrs"] == pytest.approx(expected, rel=1e-12), result["schedule"]["lrs"]
    assert "train_micro_batch_size_per_gpu=4 but TrainingArguments per_device_train_batch_size=2" \
        in result["disagreement"]


def test_a_config_given_twice_or_of_the_wrong_type_is_refused() -> None:
    from zeropp.config import ZeroPPConfig
    from zeropp.hf import ZeroPPRequest

    args = _arguments()
    args.deepspeed = "ds_config.json"  # the field TrainingArguments(deepspeed=...) keeps (DeepSpeed not set up)
    with pytest.raises(ValueError, match="deepspeed='ds_config.json' are both given; give the ZeRO.. settings once"):
        ZeroPPRequest.take(args, ZeroPPConfig(), None)
    with pytest.raises(TypeError, match="zeropp_config=3 is a int; expected a ZeroPPConfig, or a DeepSpeed config"):
        ZeroPPRequest.take(_arguments(), 3, None)


def test_zeropp_hf_imports_without_trl_and_names_the_extra_when_a_trl_trainer_is_asked_for() -> None:
    import subprocess
    import sys

    code = ("import sys; sys.modules['trl'] = None\n"  # as if trl were not installed
            "import zeropp.hf\n"
            "try:\n    zeropp.hf.ZeroPPGRPOTrainer\nexcept ImportError as error:\n    print(error)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "zeropp's TRL trainers need trl: pip install 'zeropp[trl]'" in out
