"""A Lightning job on zeropp saves and resumes as Lightning users run it: ``ModelParallelStrategy``
(FSDP2 applied in ``configure_model``, then ``zeropp.enable``), 4 gloo ranks as 2 nodes x 2, AdamW
with a per-step schedule, a shuffled loader. Lightning's ``ModelCheckpoint`` writes its distributed
checkpoints, a fresh trainer resumes from one, and the full weights are written once for a process
without zeropp, both through Lightning (``save_distributed_checkpoint=False``) and through
``zeropp.checkpoint.full.save_full_weights``."""

from __future__ import annotations

import os

import pytest
import torch

from distributed import run_distributed

L = pytest.importorskip("lightning")
pytest.importorskip("transformers")

from test_lightning import LENGTH, VOCAB, TinyLlama  # noqa: E402  (needs lightning, skipped above)

TWO_BY_TWO = {"ZEROPP_RANKS_PER_NODE": "2"}
ROWS, BATCH, STEPS, SAVE_STEPS = 24, 2, 6, 3
"""24 rows in batches of 2 on 4 ranks: 3 steps an epoch, so checkpoint 3 closes epoch 0 (a
loader without state resumes exactly only at an epoch's end; Lightning warns otherwise)."""


class ResumableLlama(TinyLlama):
    """``TinyLlama`` trained with AdamW and a linear warm-up stepped every batch: state in the
    optimizer and the schedule that a resumed job must get back from the checkpoint."""

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-3)
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


def _rows() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, VOCAB, (ROWS, 1), generator=g)
            + torch.randint(1, 4, (ROWS, 1), generator=g) * torch.arange(LENGTH)) % VOCAB


def probe() -> torch.Tensor:
    """The fixed input the logits are compared on."""
    return _rows()[:4].roll(1, dims=1)


def _fit(how: str, root: str, world_size: int, ckpt_path: str | None = None,
         save_distributed_checkpoint: bool = True) -> ResumableLlama:
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1,
                                     save_distributed_checkpoint=save_distributed_checkpoint)
    trainer = L.Trainer(accelerator="cpu", devices=world_size, max_steps=STEPS, logger=False, strategy=strategy,
                        default_root_dir=root, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[ModelCheckpoint(every_n_train_steps=SAVE_STEPS, save_top_k=-1)])
    module = ResumableLlama(how)
    loader = torch.utils.data.DataLoader(_rows(), batch_size=BATCH, shuffle=True)
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    return module


def _full_parameters(module: ResumableLlama) -> dict:
    """The sharded model's parameters gathered whole, as numpy arrays: they cross the process
    boundary as plain bytes (torch's own sharing hands over file descriptors that vanish when
    the rank's process exits)."""
    return {name: p.detach().full_tensor().numpy() for name, p in module.model.named_parameters()}


def _worker(rank: int, world_size: int, out_dir: str, modes: tuple[str, ...]) -> dict:
    from zeropp.checkpoint.full import save_full_weights

    results = {}
    for how in modes:
        whole = _fit(how, f"{out_dir}/{how}/whole", world_size)
        exported = f"{out_dir}/{how}/exported"
        save_full_weights(whole.model, exported)  # every rank gathers, rank 0 writes
        if rank == 0:
            whole.model.config.save_pretrained(exported)
        whole.model.eval()  # as from_pretrained returns it
        with torch.no_grad():
            logits = whole.model(probe()).logits
        checkpoints = sorted(os.listdir(f"{out_dir}/{how}/whole/checkpoints"))
        # the resumed job writes Lightning's consolidated checkpoints: one file, gathered on rank 0
        resumed = _fit(how, f"{out_dir}/{how}/resumed", world_size,
                       ckpt_path=f"{out_dir}/{how}/whole/checkpoints/epoch=0-step={SAVE_STEPS}.ckpt",
                       save_distributed_checkpoint=False)
        params = _full_parameters(whole)
        results[how] = {"whole": whole.losses, "resumed": resumed.losses, "checkpoints": checkpoints,
                        "params": params if rank == 0 else None, "logits": logits.numpy() if rank == 0 else None}
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[dict, str]:
    out_dir = str(tmp_path_factory.mktemp("lightning"))
    return run_distributed(_worker, 4, out_dir, ("zero3", "all"), env=TWO_BY_TWO, timeout=600)[0], out_dir


@pytest.mark.slow
@pytest.mark.parametrize("how", ["zero3", "all"])
def test_a_fresh_trainer_resumes_from_model_checkpoint_with_the_uninterrupted_losses(runs, how: str) -> None:
    """``ModelCheckpoint(every_n_train_steps=3)`` writes Lightning's distributed checkpoints at
    steps 3 and 6; a new trainer with a fresh model, ``fit(..., ckpt_path=<step 3>)``, resumes
    model, AdamW moments, schedule and loop state, so on CPU (deterministic) it logs exactly the
    losses of steps 4-6 of the run that was never interrupted, under plain ZeRO-3 and under all
    three techniques (hpZ's secondary copies and qwZ's codes made from the loaded weights)."""
    result = runs[0][how]
    print(how, "losses", result["whole"], "resumed", result["resumed"])
    assert result["checkpoints"] == [f"epoch=0-step={SAVE_STEPS}.ckpt", f"epoch=1-step={STEPS}.ckpt"]
    whole = result["whole"]
    assert len(whole) == STEPS and whole[-1] < whole[0]
    assert result["resumed"] == whole[SAVE_STEPS:]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["zero3", "all"])
def test_full_weights_load_without_zeropp(runs, how: str) -> None:
    """Two ways a Lightning user gets the whole model out of a sharded run, each loaded here
    without zeropp into an unsharded ``LlamaForCausalLM``: ``save_full_weights`` on every rank
    after ``fit`` (plus the config from rank 0), read by ``from_pretrained``; and Lightning's own
    consolidated checkpoint (``save_distributed_checkpoint=False``, the resumed job's step 6: the
    same weights, training being deterministic), read by ``torch.load`` and ``load_state_dict``.
    Both hold the sharded model's full-precision parameters exactly; under plain ZeRO-3, whose
    forward uses those exact weights, the unsharded model's logits are the sharded model's."""
    result, out_dir = runs[0][how], runs[1]
    from transformers import LlamaForCausalLM

    exported = LlamaForCausalLM.from_pretrained(f"{out_dir}/{how}/exported").eval()
    consolidated = type(exported)(exported.config).eval()  # fresh random weights, all to be overwritten
    checkpoint = torch.load(f"{out_dir}/{how}/resumed/checkpoints/epoch=1-step={STEPS}.ckpt", weights_only=False)
    consolidated.load_state_dict({name.removeprefix("model."): value
                                  for name, value in checkpoint["state_dict"].items()})
    for model in (exported, consolidated):
        state = model.state_dict()
        assert set(state) == set(result["params"])
        for name, value in result["params"].items():
            assert torch.equal(state[name], torch.from_numpy(value)), name
    if how == "zero3":
        with torch.no_grad():
            for model in (exported, consolidated):
                assert torch.equal(model(probe()).logits, torch.from_numpy(result["logits"]))
