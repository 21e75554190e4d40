"""TRL jobs on zeropp save and resume as TRL users run them: ``ZeroPPSFTTrainer`` and
``ZeroPPGRPOTrainer`` at their configs' defaults (bf16, gradient checkpointing, AdamW with a linear
schedule, checkpoints at ``save_strategy="steps"``; only step counts and sizes shortened), the tiny
Llama, tokenizer, prompts and texts of test_trl, 4 gloo ranks as 2 nodes x 2. A second job resumes
from a checkpoint, and SFT's ``save_model`` writes a directory ``from_pretrained`` loads without
zeropp."""

from __future__ import annotations

import os

import pytest
import torch

from distributed import run_distributed

pytest.importorskip("trl")
pytest.importorskip("datasets")

from test_trl import (  # noqa: E402
    ALL_THREE_JSON,
    GENERATIONS,
    NEW_TOKENS,
    TWO_BY_TWO,
    _datasets,
    share_of_a,
    tiny_llama,
    tiny_tokenizer,
)

ALL_THREE_GATHERED = {**ALL_THREE_JSON, "zero_optimization": {**ALL_THREE_JSON["zero_optimization"],
                                                               "stage3_gather_16bit_weights_on_model_save": True}}
"""All three techniques as a DeepSpeed config that, like Hugging Face's stock ZeRO-3 file, has
``save_model`` gather the full weights (DeepSpeed's default, False, saves the shards alone)."""
STEPS, SAVE_STEPS = 6, 3
"""SFT: 32 texts in batches of 2 on 4 ranks; GRPO: 16 prompts, 4 a step (4 generations each, one
prompt per rank). Both take 4 steps an epoch, so checkpoint 3 is mid-epoch and the resumed job
skips the epoch's first 3 batches."""


def _arguments(output_dir: str):
    from trl import SFTConfig

    # save_strategy is Trainer's default ("steps"); only its interval is shortened to fit the run
    return SFTConfig(output_dir=output_dir, per_device_train_batch_size=2, max_steps=STEPS, save_steps=SAVE_STEPS,
                     learning_rate=1e-3, logging_steps=1, report_to=[], use_cpu=True, seed=0, disable_tqdm=True)


def _trainer(how: str, output_dir: str):
    from zeropp.hf import ZeroPPSFTTrainer
    from zeropp.tools.modes import MODES

    tokenizer, (_, texts) = tiny_tokenizer(), _datasets()
    zeropp_config = MODES["zero3"].config(2) if how == "zero3" else ALL_THREE_GATHERED
    return ZeroPPSFTTrainer(tiny_llama(len(tokenizer)), _arguments(output_dir), train_dataset=texts,
                            processing_class=tokenizer, zeropp_config=zeropp_config)


def _losses(trainer) -> dict[int, float]:
    return {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}


def probe() -> torch.Tensor:
    """The fixed input the logits are compared on: token ids of the tokenizer's words."""
    return torch.arange(4, 12).repeat(2, 1)


def _sft_worker(rank: int, out_dir: str, modes: tuple[str, ...]) -> dict:
    results = {}
    for how in modes:
        whole = _trainer(how, f"{out_dir}/{how}/whole")
        whole.train()
        whole.save_model()
        whole.model.eval()  # as from_pretrained returns it
        with torch.no_grad():
            logits = whole.model(probe()).logits
        resumed = _trainer(how, f"{out_dir}/{how}/resumed")
        resumed.train(resume_from_checkpoint=f"{out_dir}/{how}/whole/checkpoint-{SAVE_STEPS}")
        params = {n: p.detach().full_tensor().numpy() for n, p in whole.model.named_parameters()}
        results[how] = {"whole": _losses(whole), "resumed": _losses(resumed),
                        "checkpoints": sorted(os.listdir(f"{out_dir}/{how}/whole")),
                        "params": params if rank == 0 else None,  # numpy: plain bytes across processes
                        "logits": logits.numpy() if rank == 0 else None}
    return results


def _grpo_arguments(output_dir: str):
    from trl import GRPOConfig

    # GRPOConfig's defaults (bf16, gradient checkpointing, beta 0, sampling); sizes shortened
    return GRPOConfig(output_dir=output_dir, per_device_train_batch_size=GENERATIONS, num_generations=GENERATIONS,
                      max_completion_length=NEW_TOKENS, max_steps=STEPS, save_steps=SAVE_STEPS, learning_rate=1e-3,
                      logging_steps=1, report_to=[], use_cpu=True, seed=0, disable_tqdm=True)


def _grpo_logs(trainer) -> dict[int, tuple]:
    return {e["step"]: (e["loss"], e["reward"], e["grad_norm"]) for e in trainer.state.log_history if "loss" in e}


def _grpo_worker(out_dir: str, modes: tuple[str, ...]) -> dict:
    from zeropp.hf import ZeroPPGRPOTrainer
    from zeropp.tools.modes import MODES

    tokenizer, (prompts, _) = tiny_tokenizer(), _datasets()
    results = {}
    for how in modes:
        zeropp_config = MODES["zero3"].config(2) if how == "zero3" else ALL_THREE_JSON
        runs = {}
        for run, resume in (("whole", None), ("resumed", f"{out_dir}/{how}/whole/checkpoint-{SAVE_STEPS}")):
            args = _grpo_arguments(f"{out_dir}/{how}/{run}")
            trainer = ZeroPPGRPOTrainer(tiny_llama(len(tokenizer)), share_of_a, args, train_dataset=prompts,
                                        processing_class=tokenizer, zeropp_config=zeropp_config)
            trainer.train(resume_from_checkpoint=resume)
            runs[run] = _grpo_logs(trainer)
        results[how] = runs
    return results


def _worker(rank: int, world_size: int, out_dir: str, modes: tuple[str, ...]) -> dict:
    """Both trainers' jobs in one spawned run: most of a run's time is each rank importing TRL."""
    return {"sft": _sft_worker(rank, f"{out_dir}/sft", modes), "grpo": _grpo_worker(f"{out_dir}/grpo", modes)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[dict, str]:
    out_dir = str(tmp_path_factory.mktemp("trl_checkpoint"))
    return run_distributed(_worker, 4, out_dir, ("zero3", "all"), env=TWO_BY_TWO, timeout=600)[0], out_dir


@pytest.mark.slow
@pytest.mark.parametrize("how", ["zero3", "all"])
def test_sft_checkpoints_at_the_default_strategy_and_a_second_job_resumes_with_equal_losses(runs, how: str) -> None:
    """Checkpoints at steps 3 and 6; a second job with a fresh model resumes from checkpoint-3
    (model, AdamW moments, schedule, RNG, trainer state, its place in the epoch) and, training
    being deterministic on CPU, logs exactly the losses of steps 4-6 of the job that was never
    interrupted, under plain ZeRO-3 and under all three techniques."""
    result = runs[0]["sft"][how]
    whole, resumed = result["whole"], result["resumed"]
    print(how, "losses", whole, "resumed", resumed)
    assert {f"checkpoint-{SAVE_STEPS}", f"checkpoint-{STEPS}", "model.safetensors", "config.json"} <= set(
        result["checkpoints"])
    assert sorted(whole) == list(range(1, STEPS + 1)) and whole[STEPS] < whole[1]
    assert sorted(resumed) == list(range(1, STEPS + 1))  # 1-3 from the checkpoint's trainer state
    for step in range(SAVE_STEPS + 1, STEPS + 1):
        assert resumed[step] == whole[step], (step, whole, resumed)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["zero3", "all"])
def test_save_model_loads_with_from_pretrained_without_zeropp(runs, how: str) -> None:
    """``trainer.save_model()`` (every rank) writes a directory ``AutoModelForCausalLM.from_pretrained``
    loads in this process, without zeropp: its weights are the sharded model's full-precision
    parameters exactly, and under plain ZeRO-3, whose forward uses those exact weights, so are
    its logits (both in eval mode, in fp32)."""
    from transformers import AutoModelForCausalLM

    result, out_dir = runs[0]["sft"][how], runs[1]
    loaded = AutoModelForCausalLM.from_pretrained(f"{out_dir}/sft/{how}/whole").eval()
    state = loaded.state_dict()
    assert set(state) == set(result["params"])
    for name, value in result["params"].items():
        assert torch.equal(state[name], torch.from_numpy(value)), name
    if how == "zero3":
        with torch.no_grad():
            assert torch.equal(loaded(probe()).logits, torch.from_numpy(result["logits"]))


@pytest.mark.slow
@pytest.mark.parametrize("how", ["zero3", "all"])
def test_grpo_resumes_with_the_uninterrupted_samples_and_losses(runs, how: str) -> None:
    """GRPO at its defaults (sampling, 4 generations of 6 tokens per prompt): a second job resumed
    from checkpoint-3 gets back the weights, AdamW moments, schedule and every rank's random state,
    so it samples the same completions as the uninterrupted job and logs exactly its rewards,
    losses and gradient norms for steps 4-6, under plain ZeRO-3 and under all three techniques."""
    whole, resumed = runs[0]["grpo"][how]["whole"], runs[0]["grpo"][how]["resumed"]
    print(how, "whole", whole, "resumed", resumed)
    assert sorted(whole) == sorted(resumed) == list(range(1, STEPS + 1))
    assert len({reward for _, reward, _ in whole.values()}) > 1  # the samples change as the model trains
    for step in range(SAVE_STEPS + 1, STEPS + 1):
        assert resumed[step] == whole[step], (step, whole, resumed)
