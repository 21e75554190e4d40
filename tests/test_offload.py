"""CPU offload with ZeRO++: DeepSpeed's offload keys (Hugging Face's stock ZeRO-3 file offloads
parameters and optimizer) map to FSDP2's ``CPUOffloadPolicy``; what zeropp cannot honour is
refused by key. On CPU ranks host and device are the same memory, so these tests check the
logic: where each state is, equal losses, checkpoints, and the stock file end to end."""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch

from distributed import run_distributed
from models import global_batch, make_model, rows

TWO_BY_TWO = {"ZEROPP_RANKS_PER_NODE": "2"}
STOCK_OFFLOAD = {"offload_optimizer": {"device": "cpu", "pin_memory": True},
                 "offload_param": {"device": "cpu", "pin_memory": True}}
"""The offload sections of Hugging Face's tests/deepspeed/ds_config_zero3.json."""


def _zero(**extra) -> dict:
    return {"zero_optimization": {"stage": 3, **extra}, "train_micro_batch_size_per_gpu": 2}


def test_the_stock_offload_sections_become_fsdp2_cpu_offload() -> None:
    from zeropp.config import parse_deepspeed

    parsed = parse_deepspeed(_zero(**STOCK_OFFLOAD))
    assert parsed.zeropp.offload == "cpu" and parsed.zeropp.offload_pin_memory
    assert "zero_optimization.offload_param" not in parsed.ignored_keys
    unpinned = parse_deepspeed(_zero(offload_param={"device": "cpu", "pin_memory": False}))
    assert unpinned.zeropp.offload == "cpu" and not unpinned.zeropp.offload_pin_memory
    assert parse_deepspeed(_zero(offload_param={"device": "none"})).zeropp.offload == "none"
    alone = parse_deepspeed(_zero(offload_optimizer={"device": "cpu", "pin_memory": True}))
    assert alone.zeropp.offload == "optimizer"  # ZeRO-Offload: zeropp.fsdp.offload.HostOptimizer
    assert parse_deepspeed(_zero()).zeropp.offload == "none"


@pytest.mark.parametrize(("sections", "named"), [
    ({"offload_param": {"device": "nvme", "nvme_path": "/local_nvme"}}, "zero_optimization.offload_param.device"),
    ({"offload_optimizer": {"device": "nvme"}}, "zero_optimization.offload_optimizer.device='nvme'"),
    ({"offload_param": {"device": "gpu"}}, "zero_optimization.offload_param.device='gpu'"),
    ({"offload_optimizer": {"device": "cpu", "ratio": 0.3}, "offload_param": {"device": "cpu"}},
     "zero_optimization.offload_optimizer.ratio=0.3"),
    ({"offload_param": {"device": "cpu", "pin_memory": "yes"}}, "zero_optimization.offload_param.pin_memory"),
])
def test_offload_zeropp_cannot_honour_is_refused_by_key(sections, named) -> None:
    from zeropp.config import parse_deepspeed

    with pytest.raises(ValueError, match="") as error:
        parse_deepspeed(_zero(**sections))
    assert named in str(error.value), str(error.value)


def test_ignored_keys_that_could_change_memory_are_never_mixed_with_buffer_sizes(caplog) -> None:
    from zeropp import config as config_module

    config_module._REPORTED_IGNORED_KEYS.clear()
    sections = {name: {**section, "buffer_count": 4} for name, section in STOCK_OFFLOAD.items()}
    with caplog.at_level(logging.WARNING, logger="zeropp"):
        config_module.parse_deepspeed(_zero(**sections, stage3_max_live_parameters=1e9, memory_efficient_linear=True,
                                            overlap_comm=True))
    sized, other = ([r.getMessage() for r in caplog.records if phrase in r.getMessage()]
                    for phrase in ("size DeepSpeed's buffers", "may change memory or numerics"))
    assert len(sized) == 1 and len(other) == 1, caplog.text
    for key in ("zero_optimization.offload_param.buffer_count", "zero_optimization.stage3_max_live_parameters",
                "zero_optimization.overlap_comm"):
        assert key in sized[0] and key not in other[0]
    assert "zero_optimization.memory_efficient_linear" in other[0]


def _train(rank: int, world_size: int, mode: str, offload: str, out_dir: str) -> dict:
    import dataclasses

    import zeropp
    from zeropp import checkpoint
    from zeropp.fsdp.access import fsdp_units, offloads_to_cpu, unit_parameters
    from zeropp.tools.modes import MODES

    config = dataclasses.replace(MODES[mode].config(2), offload=offload)
    model = zeropp.shard(make_model("gpt"), config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if offload == "optimizer":
        optimizer = zeropp.offload_optimizer(optimizer)
    losses = []
    for step in range(4):
        if step == 2:  # a checkpoint round trip in the middle: the later steps must not notice
            checkpoint.save(out_dir, f"{mode}-{offload}", model=model, optimizer=optimizer, engine_state={},
                            rank_state={})
            checkpoint.load(out_dir, f"{mode}-{offload}", model=model, optimizer=optimizer)
        x, y = (rows(t, rank, world_size) for t in global_batch(step, 4 * world_size))
        loss = model(x, y)[1]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    units = [u for u in fsdp_units(model) if unit_parameters(u)]
    host_state = optimizer.host.state.values() if offload == "optimizer" else optimizer.state.values()
    state_devices = {v.device.type for s in host_state for v in s.values() if torch.is_tensor(v)}
    return {"losses": losses, "offloaded_units": sum(map(offloads_to_cpu, units)), "units": len(units),
            "state_devices": sorted(state_devices), "optimizer": type(optimizer).__name__}


@pytest.mark.parametrize("mode", ["zero3", "hpz", "all"])
def test_offloaded_training_equals_training_without_offload(tmp_path, mode) -> None:
    """Each mode without offload, with ``offload="cpu"`` and with ``offload="optimizer"``, with a
    checkpoint saved and loaded mid-run. "cpu": every unit carries FSDP2's CPU offload policy;
    "optimizer": the optimizer is a ``HostOptimizer``, its state and masters on the host. On CPU
    ranks the copies to and from the "device" move nothing, so the losses are equal bit for bit
    (all three techniques included: the same codes of the same values; the host step is the same
    AdamW on the same fp32 values), and the checkpoint round trip (masters included) changes
    nothing."""
    plain = run_distributed(_train, 4, mode, "none", str(tmp_path), env=TWO_BY_TWO)[0]
    offloaded = run_distributed(_train, 4, mode, "cpu", str(tmp_path), env=TWO_BY_TWO)[0]
    optimizer_only = run_distributed(_train, 4, mode, "optimizer", str(tmp_path), env=TWO_BY_TWO)[0]
    assert offloaded["offloaded_units"] == offloaded["units"] > 0 and plain["offloaded_units"] == 0
    assert optimizer_only["offloaded_units"] == 0 and optimizer_only["optimizer"] == "HostOptimizer"
    assert offloaded["state_devices"] == optimizer_only["state_devices"] == ["cpu"]
    assert offloaded["losses"] == plain["losses"], (plain["losses"], offloaded["losses"])
    assert optimizer_only["losses"] == plain["losses"], (plain["losses"], optimizer_only["losses"])
    assert offloaded["losses"][-1] < offloaded["losses"][0]


def _enable_without_policy(rank: int, world_size: int) -> str:
    from torch.distributed.fsdp import fully_shard

    import zeropp

    model = make_model("gpt")
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    try:
        zeropp.enable(model, zeropp.ZeroPPConfig(offload="cpu"))
    except ValueError as error:
        return str(error)
    return "accepted"


def test_enable_refuses_offload_on_units_sharded_without_it() -> None:
    message = run_distributed(_enable_without_policy, 2)[0]
    assert "offload='cpu'" in message and "CPUOffloadPolicy" in message, message


def _engine_with_stock_file(rank: int, world_size: int, offload: tuple[str, ...]) -> dict:
    import zeropp
    from zeropp.fsdp.access import fsdp_units, offloads_to_cpu, unit_parameters

    config = copy.deepcopy(STOCK_DS_FILE)
    for name in STOCK_OFFLOAD:
        if name not in offload:
            del config["zero_optimization"][name]
    model = make_model("gpt")
    engine, optimizer, _, _ = zeropp.initialize(model=model, config=config)
    losses = []
    for step in range(3):
        x, y = (rows(t, rank, world_size) for t in global_batch(step, 2 * world_size))
        loss = engine(x, y)[1]
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    units = [u for u in fsdp_units(engine.module) if unit_parameters(u)]
    return {"losses": losses, "offloaded": all(map(offloads_to_cpu, units)),
            "optimizer": type(engine.optimizer).__name__}


STOCK_DS_FILE = {
    # Hugging Face's tests/deepspeed/ds_config_zero3.json with its "auto" values given (DeepSpeed
    # itself, outside Trainer, needs them so too) and the three ZeRO++ keys
    "fp16": {"enabled": False, "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": False},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-2, "warmup_num_steps": 1}},
    "zero_optimization": {"stage": 3, **STOCK_OFFLOAD, "overlap_comm": True, "contiguous_gradients": True,
                          "sub_group_size": 1e9, "reduce_bucket_size": 1e6, "stage3_prefetch_bucket_size": 1e6,
                          "stage3_param_persistence_threshold": 1e4, "stage3_max_live_parameters": 1e9,
                          "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True,
                          "zero_quantized_weights": True, "zero_hpz_partition_size": 2,
                          "zero_quantized_gradients": True},
    "gradient_accumulation_steps": 1, "gradient_clipping": 1.0, "steps_per_print": 2000,
    "train_micro_batch_size_per_gpu": 2, "wall_clock_breakdown": False,
}


def test_the_stock_file_trains_through_initialize_with_offload() -> None:
    """The stock file (all three ZeRO++ keys added) through ``zeropp.initialize``: with both
    offload sections every unit is offloaded; with ``offload_optimizer`` alone the optimizer is a
    ``HostOptimizer``; the losses are those of the same file without offload."""
    offloaded = run_distributed(_engine_with_stock_file, 4, tuple(STOCK_OFFLOAD), env=TWO_BY_TWO)
    optimizer_only = run_distributed(_engine_with_stock_file, 4, ("offload_optimizer",), env=TWO_BY_TWO)
    plain = run_distributed(_engine_with_stock_file, 4, (), env=TWO_BY_TWO)
    for with_offload, alone, without in zip(offloaded, optimizer_only, plain):
        assert with_offload["offloaded"] and not without["offloaded"] and not alone["offloaded"]
        assert alone["optimizer"] == "HostOptimizer" and without["optimizer"] == "AdamW"
        assert with_offload["losses"] == without["losses"] == alone["losses"]
        assert all(map(math.isfinite, with_offload["losses"]))


def _trainer_resumes_with_the_optimizer_on_the_host(rank: int, world_size: int, out_dir: str) -> dict:
    import json

    from test_hf_checkpoint import SAVE_STEPS, Rows, _arguments, _losses, ds_config, tiny_gpt2
    from zeropp.hf import ZeroPPTrainer

    config_file = f"{out_dir}/ds.json"
    if rank == 0:
        config = ds_config(zeropp=True)
        del config["zero_optimization"]["offload_param"]  # ZeRO-Offload: the optimizer alone
        with open(config_file, "w") as stream:
            json.dump(config, stream)
    torch.distributed.barrier()
    whole = ZeroPPTrainer(tiny_gpt2(), args=_arguments(f"{out_dir}/whole", config_file), train_dataset=Rows())
    whole.train()
    resumed = ZeroPPTrainer(tiny_gpt2(), args=_arguments(f"{out_dir}/resumed", config_file), train_dataset=Rows())
    resumed.train(resume_from_checkpoint=f"{out_dir}/whole/checkpoint-{SAVE_STEPS}")
    return {"whole": _losses(whole), "resumed": _losses(resumed),
            "optimizer": type(resumed.optimizer.optimizer).__name__}


@pytest.mark.slow
def test_trainer_with_the_optimizer_on_the_host_resumes_with_equal_losses(tmp_path) -> None:
    """Hugging Face's stock file with ``offload_param`` removed (the optimizer alone on the host),
    all three techniques, under ``ZeroPPTrainer``: the checkpoint holds the host masters and
    optimizer state, and a second job resuming from it logs the uninterrupted job's losses."""
    result = run_distributed(_trainer_resumes_with_the_optimizer_on_the_host, 4, str(tmp_path), env=TWO_BY_TWO,
                             timeout=300)[0]
    assert result["optimizer"] == "HostOptimizer"
    assert sorted(result["resumed"]) == sorted(result["whole"]) and len(result["whole"]) == 6
    assert result["resumed"] == result["whole"]
