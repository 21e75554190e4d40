"""accelerate's own loop on a zeropp-sharded model, with the real accelerate on 4 gloo ranks (2 x 2):
``prepare``, ``accumulate``, ``backward``, ``clip_grad_norm_``; ``save_state`` / ``load_state``
resume exactly; ``get_state_dict`` + ``save_pretrained`` write what ``from_pretrained`` loads
without zeropp; ``unwrap_model``, evaluation, ``gather_for_metrics``; accelerate's FSDP2 plugin
functions on the same model; the DeepSpeed plugin refused with the route."""

from __future__ import annotations

import types

import pytest
import torch

from distributed import run_distributed

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

TWO_BY_TWO = {"ZEROPP_RANKS_PER_NODE": "2"}
VOCAB, LENGTH, STEPS, SAVED_AT, ACCUMULATION = 48, 16, 6, 3, 2


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=LENGTH))


def _rows(count: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCAB, (count, 1), generator=g)
            + torch.randint(1, 4, (count, 1), generator=g) * torch.arange(LENGTH)) % VOCAB


def _prepared(accelerator):
    """A model sharded with all three techniques, AdamW, a schedule and the data, through prepare."""
    import zeropp

    model = zeropp.shard(_model(), zeropp.ZeroPPConfig(quantized_weights=True, hpz_partition_size=2,
                                                       quantized_gradients=True))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    loader = torch.utils.data.DataLoader(_rows(2 * 4 * ACCUMULATION * STEPS, 1), batch_size=2)
    return accelerator.prepare(model, optimizer, loader, scheduler)


def _train(accelerator, model, optimizer, loader, scheduler, steps: int) -> list[float]:
    """``steps`` optimizer steps of ``ACCUMULATION`` micro-batches: accelerate's no_trainer loop."""
    losses, seen = [], 0
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        seen += 1
        if accelerator.sync_gradients:
            losses.append(accelerator.gather(loss.detach()).mean().item())
            if len(losses) == steps:
                break
    return losses


def _accelerator(attached: bool):
    """accelerate's ``Accelerator`` as its docs make it, or attached by the user
    ([Note: attached on prepare]: ``prepare`` attaches the plain one)."""
    from accelerate import Accelerator

    import zeropp.accelerate

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATION)
    return zeropp.accelerate.attach(accelerator) if attached else accelerator


def _job(rank: int, world_size: int, out: str, attached: bool) -> dict:
    from transformers import LlamaForCausalLM

    result = {}
    accelerator = _accelerator(attached)
    model, optimizer, loader, scheduler = _prepared(accelerator)
    result["prepared_as_is"] = isinstance(model, torch.distributed.fsdp.FSDPModule)
    first = _train(accelerator, model, optimizer, loader, scheduler, SAVED_AT)
    accelerator.save_state(f"{out}/state")
    rest = _train(accelerator, model, optimizer, accelerator.skip_first_batches(loader, SAVED_AT * ACCUMULATION),
                  scheduler, STEPS - SAVED_AT)
    result["uninterrupted"] = first + rest
    # evaluation, the metrics gathered from every rank, the model unwrapped
    model.eval()
    with torch.no_grad():
        eval_rows = _rows(8, 2)[rank * 2:(rank + 1) * 2]
        per_row = torch.stack([model(input_ids=row[None], labels=row[None]).loss for row in eval_rows])
    result["gathered_eval"] = accelerator.gather_for_metrics(per_row).tolist()
    result["unwrapped_is_model"] = accelerator.unwrap_model(model) is model
    model.train()
    # the whole model, saved the accelerate way and loaded without zeropp
    state_dict = accelerator.get_state_dict(model)
    keys = sorted(state_dict)  # save_pretrained consumes the dict
    accelerator.unwrap_model(model).save_pretrained(f"{out}/final", is_main_process=accelerator.is_main_process,
                                                    save_function=accelerator.save, state_dict=state_dict)
    accelerator.wait_for_everyone()
    trained = {name: p.full_tensor() for name, p in model.named_parameters()}
    if accelerator.is_main_process:
        loaded = LlamaForCausalLM.from_pretrained(f"{out}/final")
        result["from_pretrained_equal"] = all(torch.equal(loaded.state_dict()[name], value)
                                              for name, value in trained.items())
        result["state_dict_keys"] = keys == sorted(_model().state_dict())
    else:
        result["empty_elsewhere"] = keys == []
    # a new job: the same model, optimizer, schedule and data position from the saved state
    accelerator = _accelerator(attached)
    model, optimizer, loader, scheduler = _prepared(accelerator)
    accelerator.load_state(f"{out}/state")
    result["resumed"] = first + _train(accelerator, model, optimizer,
                                       accelerator.skip_first_batches(loader, SAVED_AT * ACCUMULATION), scheduler,
                                       STEPS - SAVED_AT)
    result["files"] = sorted(p.name for p in __import__("pathlib").Path(f"{out}/state").iterdir())
    return result


@pytest.mark.slow
@pytest.mark.parametrize("attached", [True, False], ids=["attached", "as_accelerate_documents_it"])
def test_an_accelerate_loop_trains_saves_resumes_and_exports(tmp_path, attached: bool) -> None:
    """The same loop with ``zeropp.accelerate.attach`` and with accelerate's plain ``Accelerator()``,
    which its ``prepare`` attaches: every call works either way."""
    results = run_distributed(_job, 4, str(tmp_path), attached, env=TWO_BY_TWO, timeout=300)
    main = results[0]
    assert main["prepared_as_is"] and main["unwrapped_is_model"]
    assert len(main["uninterrupted"]) == STEPS and main["uninterrupted"][-1] < main["uninterrupted"][0]
    for result in results:
        assert result["resumed"] == result["uninterrupted"], (result["resumed"], result["uninterrupted"])
        assert len(result["gathered_eval"]) == 8 and result["gathered_eval"] == main["gathered_eval"]
    assert main["from_pretrained_equal"] and main["state_dict_keys"]
    assert all(result["empty_elsewhere"] for result in results[1:])
    assert "zeropp" in main["files"] and "scheduler.bin" in main["files"]
    assert not any(name.startswith(("model", "optimizer")) for name in main["files"])


def _unprepared_job(rank: int, world_size: int, out: str) -> dict:
    """An accelerator that never prepared the zeropp model: each call that would need ``attach``
    raises on every rank, naming it, before any collective; attached afterwards, they work."""
    from accelerate import Accelerator

    import zeropp
    import zeropp.accelerate

    model = zeropp.shard(_model(), zeropp.ZeroPPConfig(quantized_weights=True, hpz_partition_size=2,
                                                       quantized_gradients=True))
    accelerator = Accelerator(cpu=True)
    errors = {}
    for call in (lambda: accelerator.get_state_dict(model), lambda: accelerator.get_state_dict(model, unwrap=False)):
        try:
            call()
            errors.setdefault("get_state_dict", []).append("no error")
        except ValueError as error:
            errors.setdefault("get_state_dict", []).append(str(error))
    accelerator._models.append(model)  # as prepare_model of an accelerate that reads the mark elsewhere
    if rank == 0:  # accelerate's own layout of a saved state: the whole model in one file
        __import__("pathlib").Path(f"{out}/plain").mkdir()
        torch.save(_model().state_dict(), f"{out}/plain/pytorch_model.bin")
    torch.distributed.barrier()
    for name, call in (("save_state", lambda: accelerator.save_state(f"{out}/state")),
                       ("load_state", lambda: accelerator.load_state(f"{out}/plain"))):
        try:
            call()
            errors[name] = "no error"
        except ValueError as error:
            errors[name] = str(error)
    zeropp.accelerate.attach(accelerator)
    full = accelerator.get_state_dict(model)
    accelerator.save_state(f"{out}/state")
    accelerator.load_state(f"{out}/state")
    return {**errors, "attached_keys": len(full) if accelerator.is_main_process else None}


def test_an_accelerator_that_never_prepared_the_model_names_attach_on_every_rank(tmp_path) -> None:
    results = run_distributed(_unprepared_job, 4, str(tmp_path), env=TWO_BY_TWO, timeout=120)
    for result in results:
        for message in [*result["get_state_dict"], result["save_state"], result["load_state"]]:
            assert "zeropp.accelerate.attach(accelerator)" in message, message
    assert results[0]["attached_keys"] == len(_model().state_dict())


def _fsdp2_plugin_job(rank: int, world_size: int, out: str) -> dict:
    """What accelerate's FSDP2 plugin does with an FSDPModule, called as it calls it (on CPU
    accelerate never enables the plugin itself): prepare hands the model back, its full state dict
    gathers every weight exactly, and its sharded save and load restore every shard."""
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model, load_fsdp_model, save_fsdp_model
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    import zeropp

    model = zeropp.shard(_model(), zeropp.ZeroPPConfig(quantized_weights=True, hpz_partition_size=2,
                                                       quantized_gradients=True))
    stand_in = Accelerator(cpu=True)  # MULTI_CPU: the plugin is handed to its functions as they take it
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    stand_in.state.fsdp_plugin = plugin
    same = fsdp2_prepare_model(stand_in, model) is model
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    exact = {name: p.full_tensor() for name, p in model.named_parameters()}
    equal = rank != 0 or all(torch.equal(full[name], value) for name, value in exact.items())
    save_fsdp_model(plugin, stand_in, model, out)
    before = {name: p.to_local().clone() for name, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    load_fsdp_model(plugin, stand_in, model, out)
    restored = all(torch.equal(p.to_local(), before[name]) for name, p in model.named_parameters())
    return {"prepared_as_is": same, "full_state_dict_exact": equal, "restored": restored}


@pytest.mark.slow
def test_accelerates_fsdp2_plugin_functions_on_a_zeropp_model(tmp_path) -> None:
    for result in run_distributed(_fsdp2_plugin_job, 4, str(tmp_path), env=TWO_BY_TWO, timeout=300):
        assert result == {"prepared_as_is": True, "full_state_dict_exact": True, "restored": True}


def test_the_deepspeed_plugin_is_refused_with_the_route() -> None:
    from accelerate.utils import DistributedType

    import zeropp.accelerate

    with pytest.raises(ValueError, match=r"zeropp.shard\(model, zeropp.ZeroPPConfig.from_deepspeed"):
        zeropp.accelerate.attach(types.SimpleNamespace(distributed_type=DistributedType.DEEPSPEED))
