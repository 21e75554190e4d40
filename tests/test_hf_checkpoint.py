"""A Hugging Face Trainer job from start to finish on zeropp, at Trainer's default save settings:
Hugging Face's usual ZeRO-3 file (every Trainer-owned value "auto",
``stage3_gather_16bit_weights_on_model_save: true``) plus the three ZeRO++ keys, a tiny GPT-2,
4 gloo ranks as 2 nodes x 2. Checkpoints at ``save_strategy="steps"`` (the default), a second job
resuming from one, ``save_model`` loaded by ``from_pretrained`` without zeropp, a killed save."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from distributed import run_distributed
from models import TokenRows

pytest.importorskip("transformers")

TWO_BY_TWO = {"ZEROPP_RANKS_PER_NODE": "2"}
VOCAB, LENGTH, STEPS, SAVE_STEPS = 64, 16, 6, 3


def ds_config(zeropp: bool, gather: bool = True) -> dict:
    """Hugging Face's stock ZeRO-3 file (tests/deepspeed/ds_config_zero3.json: parameters and
    optimizer offloaded to the CPU) with the three ZeRO++ keys added."""
    zero = {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "offload_param": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
            "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": gather}
    if zeropp:
        zero.update({"zero_quantized_weights": True, "zero_hpz_partition_size": 2, "zero_quantized_gradients": True})
    return {"fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
                     "hysteresis": 2, "min_loss_scale": 1},
            "bf16": {"enabled": "auto"},
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                      "weight_decay": "auto"}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                         "warmup_num_steps": "auto"}},
            "zero_optimization": zero, "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
            "steps_per_print": 2000, "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
            "wall_clock_breakdown": False}


def Rows(count: int = 64, seed: int = 0) -> TokenRows:
    """Learnable token rows of the tiny GPT-2's vocabulary."""
    return TokenRows(VOCAB, LENGTH, count, seed)


def tiny_gpt2(dropout: float = 0.1) -> torch.nn.Module:
    """GPT-2 at transformers' defaults (dropout 0.1, tied head) but tiny."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=4,
                                      resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout))


def _arguments(output_dir: str, config_file: str, **overrides):
    from transformers import TrainingArguments

    # save_strategy is Trainer's default ("steps"); only its interval is shortened to fit the run
    settings = dict(output_dir=output_dir, deepspeed=config_file, per_device_train_batch_size=2,
                    max_steps=STEPS, save_steps=SAVE_STEPS, learning_rate=3e-3, warmup_steps=2,
                    logging_steps=1, report_to=[], use_cpu=True, seed=0, disable_tqdm=True)
    return TrainingArguments(**{**settings, **overrides})


def _losses(trainer) -> dict[int, float]:
    return {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}


def _as_arrays(tensors: dict[str, torch.Tensor]) -> dict:
    """Tensors as numpy arrays, which cross the process boundary as plain bytes (torch's own
    sharing hands over file descriptors that vanish when the rank's process exits)."""
    return {name: tensor.numpy() for name, tensor in tensors.items()}


def _resume_worker(rank: int, world_size: int, out_dir: str, modes: list[str]) -> dict:
    from zeropp.fsdp.access import fsdp_units, offloads_to_cpu, unit_parameters
    from zeropp.hf import ZeroPPTrainer
    from zeropp.integrations import hf_checkpoint

    results = {}
    for mode in modes:
        config_file = f"{out_dir}/ds_{mode}.json"
        if rank == 0:
            with open(config_file, "w") as stream:
                json.dump(ds_config(zeropp=mode == "all"), stream)
        torch.distributed.barrier()
        whole = ZeroPPTrainer(tiny_gpt2(), args=_arguments(f"{out_dir}/{mode}/whole", config_file),
                              train_dataset=Rows())
        whole.train()
        whole.save_model()
        logits = None
        if mode == "zero3":
            whole.model.eval()  # as from_pretrained returns it: no dropout
            with torch.no_grad():
                logits = whole.model(Rows(4, seed=1).rows).logits.numpy()
        reloaded = ZeroPPTrainer(tiny_gpt2(), args=_arguments(f"{out_dir}/{mode}/reloaded", config_file)).model
        hf_checkpoint.load_weights(reloaded, f"{out_dir}/{mode}/whole")  # the save_model directory: full weights
        unequal = torch.tensor(sum(not torch.equal(a.detach().to_local(), b.detach().to_local())
                                   for a, b in zip(reloaded.parameters(), whole.model.parameters())))
        torch.distributed.all_reduce(unequal)  # every rank's shards
        reloaded_equal = unequal.item() == 0
        resumed = ZeroPPTrainer(tiny_gpt2(), args=_arguments(f"{out_dir}/{mode}/resumed", config_file),
                                train_dataset=Rows())
        resumed.train(resume_from_checkpoint=f"{out_dir}/{mode}/whole/checkpoint-{SAVE_STEPS}")
        full = _as_arrays({n: p.detach().full_tensor() for n, p in whole.model.named_parameters()})
        units = [u for u in fsdp_units(resumed.model) if unit_parameters(u)]
        results[mode] = {"whole": _losses(whole), "resumed": _losses(resumed), "logits": logits,
                         "reloaded_equal": reloaded_equal,
                         "offloaded": bool(units) and all(map(offloads_to_cpu, units)),
                         "params": full if rank == 0 else None,
                         "checkpoints": sorted(os.listdir(f"{out_dir}/{mode}/whole"))}
    return results


@pytest.mark.slow
def test_trainer_checkpoints_at_its_default_strategy_and_a_second_job_resumes_with_equal_losses(tmp_path) -> None:
    """Training is deterministic on CPU, so a job resumed from checkpoint-3 (model and optimizer,
    both offloaded as the stock file asks, schedule, RNG, trainer state) must log exactly the
    losses of steps 4-6 of the job that was never interrupted, under plain ZeRO-3 and under all
    three techniques. The model
    ``save_model`` wrote loads with ``from_pretrained`` in this process, without zeropp: its
    weights are the sharded model's exactly, and (ZeRO-3, whose forward uses the exact weights)
    so are its logits."""
    from transformers import AutoModelForCausalLM

    results = run_distributed(_resume_worker, 4, str(tmp_path), ["zero3", "all"], env=TWO_BY_TWO,
                              timeout=600)[0]
    for mode, result in results.items():
        whole, resumed = result["whole"], result["resumed"]
        assert result["offloaded"]  # the stock file's offload sections: FSDP2's CPU offload on every unit
        assert result["reloaded_equal"]  # save_model's files loaded back into a fresh sharded model, every rank
        assert sorted(whole) == list(range(1, STEPS + 1)), whole
        assert sorted(resumed) == list(range(1, STEPS + 1)), resumed  # 1-3 from the checkpoint's trainer state
        for step in resumed:
            assert resumed[step] == whole[step], (mode, step, whole, resumed)
        assert {"checkpoint-3", "checkpoint-6", "model.safetensors", "config.json"} <= set(result["checkpoints"])
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / mode / "whole")
        state = loaded.state_dict()
        for name, value in result["params"].items():
            assert torch.equal(state[name], torch.from_numpy(value)), name
        if mode == "zero3":
            with torch.no_grad():
                assert torch.equal(loaded(Rows(4, seed=1).rows).logits, torch.from_numpy(result["logits"]))


def _lifecycle_worker(rank: int, world_size: int, out_dir: str) -> dict:
    from transformers import TrainerCallback

    from zeropp.hf import ZeroPPTrainer

    config_file = f"{out_dir}/ds_all.json"
    if rank == 0:
        with open(config_file, "w") as stream:
            json.dump(ds_config(zeropp=True), stream)
    torch.distributed.barrier()

    class Evaluations(TrainerCallback):
        def __init__(self) -> None:
            self.losses: list[float] = []

        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            self.losses.append(metrics["eval_loss"])

    evaluations = Evaluations()
    run_dir = f"{out_dir}/run"
    # "best" is the higher evaluation loss, so that the best checkpoint (3) is not the last (6)
    args = dict(eval_strategy="steps", eval_steps=SAVE_STEPS, load_best_model_at_end=True, save_total_limit=1,
                metric_for_best_model="eval_loss", greater_is_better=True)
    first = ZeroPPTrainer(tiny_gpt2(), args=_arguments(run_dir, config_file, **args), train_dataset=Rows(),
                          eval_dataset=Rows(16, seed=1), callbacks=[evaluations])
    first.train()
    best = first.state.best_model_checkpoint
    kept = sorted(name for name in os.listdir(run_dir) if name.startswith("checkpoint-"))
    best_params = _as_arrays({n: p.detach().full_tensor() for n, p in first.model.named_parameters()})
    if rank == 0:  # what a job killed while writing checkpoint-9 leaves: no trainer state, no `latest`
        killed = f"{run_dir}/checkpoint-9"
        os.makedirs(f"{killed}/.tmp-zeropp")
        with open(f"{killed}/model.safetensors.partial", "wb") as stream:
            stream.write(b"\0" * 100)
    torch.distributed.barrier()
    second = ZeroPPTrainer(tiny_gpt2(), args=_arguments(run_dir, config_file, max_steps=STEPS + 3),
                           train_dataset=Rows())
    second.train(resume_from_checkpoint=True)
    return {"best": best, "kept": kept, "evaluations": evaluations.losses,
            "best_params": best_params if rank == 0 else None,
            "second": _losses(second), "first": _losses(first), "global_step": second.state.global_step}


@pytest.mark.slow
def test_evaluation_best_model_checkpoint_rotation_and_resuming_after_a_killed_save(tmp_path) -> None:
    """All three techniques (hpZ on) with evaluation every 3 steps, ``load_best_model_at_end`` and
    ``save_total_limit=1``: the evaluations run, only the best checkpoint is kept, and the model
    at the end holds its weights (loaded back from checkpoint-3 after training reached step 6).
    Then a job killed while writing checkpoint-9 is resumed with ``resume_from_checkpoint=True``:
    the half-written checkpoint is passed over, training continues from checkpoint-3 with the
    first job's losses and reaches step 9."""
    from safetensors.torch import load_file

    result = run_distributed(_lifecycle_worker, 4, str(tmp_path), env=TWO_BY_TWO, timeout=600)[0]
    assert len(result["evaluations"]) == STEPS // SAVE_STEPS and all(map(math.isfinite, result["evaluations"]))
    best = result["best"]
    assert result["evaluations"][0] > result["evaluations"][1]
    assert os.path.basename(best) == f"checkpoint-{SAVE_STEPS}"
    assert result["kept"] == [f"checkpoint-{SAVE_STEPS}"]  # Trainer drops the newest at the end: limit 1, not best
    saved = load_file(os.path.join(best, "model.safetensors"))
    for name, value in result["best_params"].items():
        if name in saved:  # the tied head is saved once, under the embedding's name
            assert torch.equal(saved[name], torch.from_numpy(value)), name
    assert result["global_step"] == STEPS + 3
    assert sorted(result["second"]) == list(range(1, STEPS + 4))
    for step in range(1, STEPS + 1):  # 1-3 from checkpoint-3's trainer state, 4-6 trained again: the same
        assert result["second"][step] == result["first"][step]


def _layout_worker(rank: int, world_size: int, out_dir: str, resume: bool) -> dict:
    from zeropp.hf import ZeroPPTrainer

    config_file = f"{out_dir}/ds_zero3.json"
    if rank == 0 and not resume:
        with open(config_file, "w") as stream:
            json.dump(ds_config(zeropp=False), stream)
    torch.distributed.barrier()
    batch = 8 // world_size  # the same 8 rows per step on 4 ranks and on 2
    args = _arguments(f"{out_dir}/{world_size}", config_file, per_device_train_batch_size=batch)
    trainer = ZeroPPTrainer(tiny_gpt2(dropout=0.0), args=args, train_dataset=Rows())
    trainer.train(resume_from_checkpoint=f"{out_dir}/4/checkpoint-{SAVE_STEPS}" if resume else None)
    return _losses(trainer)


@pytest.mark.slow
def test_a_checkpoint_of_4_ranks_resumes_on_2(tmp_path) -> None:
    """A checkpoint written by 4 ranks (2 nodes x 2) resumes on 2 ranks (1 node): DCP reshards the
    model and optimizer state. The global batch is the same 8 rows, so ZeRO-3's steps 4-6 match
    the uninterrupted 4-rank run up to fp32 summation order (1e-5 relative). Dropout is off here:
    its masks follow each rank's random stream, which a different number of ranks cannot repeat."""
    whole = run_distributed(_layout_worker, 4, str(tmp_path), False, env=TWO_BY_TWO, timeout=300)[0]
    resumed = run_distributed(_layout_worker, 2, str(tmp_path), True, timeout=300)[0]
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for step in range(SAVE_STEPS + 1, STEPS + 1):
        assert abs(resumed[step] - whole[step]) <= 1e-5 * whole[step], (step, whole, resumed)


def _lora_save_worker(rank: int, world_size: int, out_dir: str) -> dict:
    from transformers import TrainingArguments

    from test_hf import Sequences, tiny_llama
    from zeropp.hf import ZeroPPTrainer
    from zeropp.tools.modes import MODES

    model = tiny_llama(lora=True)
    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=2, max_steps=2, learning_rate=0.5,
                             optim="sgd", report_to=[], use_cpu=True, seed=0, disable_tqdm=True)
    trainer = ZeroPPTrainer(model, args=args, train_dataset=Sequences(), zeropp_config=MODES["all"].config(2))
    trainer.train()
    trainer.save_model()
    adapter = {n: p.detach().full_tensor() for n, p in model.named_parameters() if p.requires_grad}
    return _as_arrays(adapter) if rank == 0 else {}


@pytest.mark.slow
def test_save_model_of_a_lora_model_writes_the_adapter_peft_loads(tmp_path) -> None:
    """A PEFT LoRA model under ``ZeroPPTrainer`` (bf16 base, all three techniques): ``save_model``
    writes the adapter as PEFT's ``save_pretrained`` does, gathered whole; ``PeftModel.from_pretrained``
    on the same base in this process, without zeropp, holds exactly the trained adapter."""
    from peft import PeftModel

    from test_hf import tiny_llama

    adapter = run_distributed(_lora_save_worker, 4, str(tmp_path), env=TWO_BY_TWO, timeout=300)[0]
    assert adapter and (tmp_path / "adapter_config.json").is_file()
    base = tiny_llama(lora=False).to(torch.bfloat16)
    loaded = dict(PeftModel.from_pretrained(base, tmp_path).named_parameters())
    for name, value in adapter.items():
        assert torch.equal(loaded[name], torch.from_numpy(value)), name
