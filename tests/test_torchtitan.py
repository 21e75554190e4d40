"""zeropp on torchtitan: its llama3 debug model, built, sharded and initialised by torchtitan's own
model registry, ``parallelize_llama`` and weight init, trained on 2 nodes x 2 gloo ranks with
torchtitan's AdamW, learning-rate schedule, loss and gradient clipping, against its plain FSDP2.

torchtitan's Trainer needs CUDA (it sets the CUDA device and NCCL), so this test runs what the
Trainer runs for a model, step by step, on CPU: the config from torchtitan's ``ConfigManager``
(``--module zeropp.torchtitan --config llama3_debugmodel``), the model spec's parallelize
function on the meta-device model, ``to_empty`` and ``init_weights``, then forward, loss,
backward, ``clip_grad_norm_``, optimizer and scheduler steps. Two changes for CPU: SDPA
attention (flex attention has no CPU backward) and fp32 parameters (torchtitan's default is
bf16; bf16 matrix products are slow on CPU and fp32 makes the ZeRO-3 comparison bit-exact).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import pathlib
import sys

import pytest
import torch
import torch.distributed.fsdp

import zeropp
from distributed import run_distributed
from zeropp.codes.quant import error_bound, quantize

if sys.version_info < (3, 11) or not hasattr(torch.distributed.fsdp, "DataParallelMeshDims"):
    pytest.skip("torchtitan 0.3.0 needs Python >= 3.11 and torch >= 2.13 (it imports "
                "torch.distributed.fsdp.DataParallelMeshDims)", allow_module_level=True)

TWO_BY_TWO = {"ZEROPP_RANKS_PER_NODE": "2"}
STEPS, LOCAL_BATCH, SEQ_LEN = 3, 2, 32
CPU_OVERRIDES = ["--training.mixed_precision_param", "float32", "--training.seq_len", str(SEQ_LEN),
                 "--training.local_batch_size", str(LOCAL_BATCH), "--training.steps", "10"]
MODES = {
    "torchtitan": None,  # parallelize_llama alone: FSDP2's own comms
    "zero3": zeropp.ZeroPPConfig(),
    "hpz": zeropp.ZeroPPConfig(hpz_partition_size=2),
    "all": zeropp.ZeroPPConfig(quantized_weights=True, hpz_partition_size=2, quantized_gradients=True),
}


def _trainer_config(mode: str):
    """The run's Trainer.Config, loaded as torchtitan's command line loads it."""
    from torchtitan.config import ConfigManager
    from torchtitan.models.common.attention import ScaledDotProductAttention

    module = "llama3" if mode == "torchtitan" else "zeropp.torchtitan"
    overrides = ["--parallelism.spmd_backend", "partial_dtensor"] if mode == "torchtitan" else []
    config = ConfigManager().parse_args(["--module", module, "--config", "llama3_debugmodel",
                                         *CPU_OVERRIDES, *overrides])
    if mode != "torchtitan":  # the mode's techniques in place of the config's own
        config.model_spec.parallelize_fn = dataclasses.replace(config.model_spec.parallelize_fn, config=MODES[mode])
    for layer in config.model_spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


def _build(config, world_size: int) -> torch.nn.Module:
    """What torchtitan's Trainer does to get a sharded, initialised model (trainer.py), on the
    ``world_size`` ranks of the process group."""
    from zeropp.tools.bench.layouts import build_parts

    assert torch.distributed.get_world_size() == world_size
    _, _, (model,), _, _ = build_parts(config)
    return model


def _force_sum(model: torch.nn.Module) -> None:
    """torchtitan sets every unit's gradient divide factor to 1.0, so FSDP2 asks for
    PREMUL_SUM(1.0), which gloo cannot run; forced sums ask for SUM and divide by 1.0 (not at
    all): the same sums, so this is torchtitan's plain FSDP2 on gloo."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def _train(mode: str, rank: int, world_size: int) -> dict:
    """``STEPS`` training steps as torchtitan's Trainer takes them; this rank's parameter shards
    after them, the global losses, the first step's gradient shards and the ledger."""
    from torchtitan.distributed import utils as dist_utils

    config = _trainer_config(mode)
    model = _build(config, world_size)
    if mode == "torchtitan":
        _force_sum(model)
    optimizers = config.optimizer.build(model_parts=[model])
    schedulers = config.lr_scheduler.build(optimizers=optimizers, training_steps=config.training.steps)
    ledger = zeropp.comm_ledger()
    ledger.reset()
    losses, lrs, first_grads = [], [], None
    initial_shards = [p.to_local().detach().clone() for p in model.parameters()]
    global_tokens = world_size * LOCAL_BATCH * SEQ_LEN
    for step in range(STEPS):
        tokens = torch.randint(0, config.model_spec.model.vocab_size, (world_size, LOCAL_BATCH, SEQ_LEN + 1),
                               generator=torch.Generator().manual_seed(step))[rank]
        logits = model(tokens[:, :-1])
        # torchtitan's loss: the sum over this rank's tokens / the global token count (gradients summed)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten(),
                                                 reduction="sum") / global_tokens
        loss.backward()
        if first_grads is None:
            first_grads = [p.grad.to_local().clone() for p in model.parameters()]
        dist_utils.clip_grad_norm_(list(model.parameters()), config.training.max_norm, foreach=True)
        lrs.append(optimizers.optimizers[0].param_groups[0]["lr"])
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        losses.append(_global_sum(loss.detach()))
    return {"losses": losses, "shards": [p.to_local().detach().clone() for p in model.parameters()],
            "initial_shards": initial_shards, "first_grads": first_grads, "lrs": lrs,
            "betas": optimizers.optimizers[0].param_groups[0]["betas"], "ledger": ledger.rows()}


def _global_sum(value: torch.Tensor) -> float:
    total = value.clone()
    torch.distributed.all_reduce(total)
    return total.item()


def adam_step_bound(step: int, betas: tuple[float, float]) -> float:
    """The largest |m_hat / (sqrt(v_hat) + eps)| Adam's update can reach at 1-based ``step``,
    for any gradients: m and v weigh the same gradients by a_i = (1 - b1) b1^(t-i) and
    b_i = (1 - b2) b2^(t-i), so by Cauchy-Schwarz |m| <= sqrt(sum a_i^2 / b_i) sqrt(v); the
    bias corrections divide m by 1 - b1^t and v by 1 - b2^t. (1 at step 1: the sign.)"""
    beta1, beta2 = betas
    ratio = sum(((1 - beta1) * beta1 ** k) ** 2 / ((1 - beta2) * beta2 ** k) for k in range(step))
    return math.sqrt(ratio) * math.sqrt(1 - beta2 ** step) / (1 - beta1 ** step)


def _first_order_loss_terms(shards: list[torch.Tensor], grads: list[torch.Tensor]) -> torch.Tensor:
    """qwZ's forward changes each weight w_i by at most e_i, half its block's scale (absmax /
    127 / 2, blocks of 256 from the start of each parameter's shard), so to first order the
    loss changes by sum_i g_i d_i with |d_i| <= e_i, g = dL/dw: at most sum_i |g_i| e_i, and,
    for rounding errors spread evenly over [-e_i, e_i] (variance e_i^2 / 3), with standard
    deviation sqrt(sum_i g_i^2 e_i^2 / 3). This rank's shares of the two sums."""
    worst, variance = 0.0, 0.0
    for shard, grad in zip(shards, grads):
        flat = shard.reshape(-1)
        if flat.numel():
            e = error_bound(quantize(flat, 8, 256)[1], 256, flat.numel()).double()
            g = grad.reshape(-1).double()
            worst += (g.abs() * e).sum().item()
            variance += (g.square() * e.square()).sum().item() / 3
    return torch.tensor([worst, variance], dtype=torch.float64)


def _torchtitan_worker(rank: int, world_size: int) -> dict:
    """Every mode on the same ranks; what the tests compare, as numbers (tensors do not outlive
    the ranks)."""
    runs = {mode: _train(mode, rank, world_size) for mode in MODES}
    reference, zero3, every = runs["torchtitan"], runs["zero3"], runs["all"]
    loss_terms = _first_order_loss_terms(zero3["initial_shards"], zero3["first_grads"])
    torch.distributed.all_reduce(loss_terms)
    return {
        "losses": {mode: run["losses"] for mode, run in runs.items()},
        "zero3_shards_equal": all(torch.equal(a, b) for a, b in zip(zero3["shards"], reference["shards"])),
        "hpz_shards_equal": all(torch.equal(a, b) for a, b in zip(runs["hpz"]["shards"], zero3["shards"])),
        "max_parameter_difference": max((a - b).abs().max().item() for a, b in zip(every["shards"], zero3["shards"])
                                        if a.numel()),
        "parameter_bound": sum(2 * lr * adam_step_bound(t + 1, zero3["betas"]) for t, lr in enumerate(zero3["lrs"])),
        "first_loss_worst": loss_terms[0].item(), "first_loss_sigma": loss_terms[1].sqrt().item(),
        "ledgers": {mode: runs[mode]["ledger"] for mode in ("zero3", "hpz", "all")},
    }


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_distributed(_torchtitan_worker, 4, env=TWO_BY_TWO, timeout=900)


@pytest.mark.slow
def test_zero3_and_hpz_through_zeropp_are_torchtitans_fsdp2_bit_for_bit(runs: list[dict]) -> None:
    """Same losses and parameters after the AdamW steps: zeropp's counted comms compute what
    FSDP2's own compute (PREMUL_SUM(1.0) as a sum on gloo), and hpZ's backward gathers inside
    the node bring back the same weights."""
    for rank in runs:
        assert rank["losses"]["zero3"] == rank["losses"]["hpz"] == rank["losses"]["torchtitan"]
        assert rank["zero3_shards_equal"] and rank["hpz_shards_equal"]


@pytest.mark.slow
def test_all_three_train_within_the_bound(runs: list[dict]) -> None:
    """With every technique, against zeropp's ZeRO-3 (= torchtitan's FSDP2):
    - the first loss differs only by qwZ's forward weights: within 6 standard deviations of
      its first-order spread (``_first_order_loss_terms``; measured 0.85), and nonzero;
    - after the steps every parameter is within the AdamW bound: each step moves a parameter by
      at most lr x ``adam_step_bound`` whatever the gradients, so two runs from one start differ
      by at most the sum of twice that (weight decay only shrinks a difference). Elements
      whose tiny gradient changes sign under qgZ's rounding reach it (measured 98% of it)."""
    for rank in runs:
        losses = rank["losses"]
        first_difference = abs(losses["all"][0] - losses["zero3"][0])
        assert 0 < first_difference <= 6 * rank["first_loss_sigma"], (first_difference, rank["first_loss_sigma"])
        assert 0 < rank["max_parameter_difference"] <= rank["parameter_bound"]
        assert losses["all"][-1] < losses["all"][0] and all(map(math.isfinite, losses["all"]))


def _cross_node(rows: list[dict], **match: str) -> int:
    return sum(r["cross_node_bytes"] for r in rows if all(r[k] == v for k, v in match.items()))


@pytest.mark.slow
def test_the_ledger_shows_zeropp_traffic(runs: list[dict]) -> None:
    """The forward gathers are qwZ's INT8, the backward gathers hpZ's, inside the node (none
    crosses it) and sending the INT8 codes its copy is kept as, every gradient exchange qgZ's
    (INT8 inside the node, INT4 across: no full-precision reduce-scatter left), beside one byte
    per parameter saying which ranks had a gradient (zeropp.fsdp.unused). Cross-node bytes
    against ZeRO-3's fp32: qwZ sends a byte per element and an fp32 scale per 256, (1 + 4/256) /
    4 = 0.2539 of fp32; qgZ sends its inter-node hop only, 1/D of the chunks at half a byte plus
    4/256, (0.5 + 4/256) / 2 / 4 = 0.0645 of the reduce-scatter's (2 x 2); padding to whole
    blocks and 4-byte words adds a little."""
    for rank in runs:
        zero3, every = rank["ledgers"]["zero3"], rank["ledgers"]["all"]
        assert {(r["op"], r["phase"], r["kind"], r["dtype"], r["technique"]) for r in every} == {
            ("all_gather", "forward", "world", "int8", "qwZ"), ("all_gather", "backward", "intra", "int8", "hpZ"),
            ("all_to_all", "backward", "intra", "int8", "qgZ"), ("all_to_all", "backward", "inter", "int4", "qgZ"),
            ("all_reduce", "backward", "world", "uint8", "presence")}
        assert _cross_node(every, technique="hpZ") == 0 < _cross_node(zero3, op="all_gather", phase="backward")
        ratio = _cross_node(every, technique="qwZ") / _cross_node(zero3, op="all_gather", phase="forward")
        assert 0.2539 <= ratio <= 0.255, ratio
        ratio = _cross_node(every, technique="qgZ") / _cross_node(zero3, op="reduce_scatter")
        assert 0.0644 <= ratio <= 0.065, ratio


def test_the_config_loads_through_torchtitans_command_line(tmp_path, monkeypatch) -> None:
    """``--module zeropp.torchtitan --config llama3_debugmodel`` (torchtitan's ConfigManager,
    command-line overrides applied) under torchrun's environment for 2 nodes x 2: llama3's spec
    with ``parallelize_llama`` then ``zeropp.enable`` with all three (hpZ over a node), on the
    1-D FSDP mesh; a user's config function gets the same from a DeepSpeed JSON file."""
    from torchtitan.config import ConfigManager
    from torchtitan.models.llama3 import parallelize_llama
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from zeropp.torchtitan import ZeroPPParallelize, with_zeropp

    monkeypatch.delenv("ZEROPP_RANKS_PER_NODE", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    config = ConfigManager().parse_args(["--module", "zeropp.torchtitan", "--config", "llama3_debugmodel",
                                         "--training.steps", "7"])
    assert config.model_spec.parallelize_fn == ZeroPPParallelize(parallelize_llama, zeropp.ZeroPPConfig(
        quantized_weights=True, hpz_partition_size=2, quantized_gradients=True))
    assert (config.training.steps, config.parallelism.spmd_backend) == (7, "partial_dtensor")
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "zero_quantized_weights": True,
                                                      "zero_hpz_partition_size": 8}}))
    from_json = with_zeropp(llama3_debugmodel(), path).model_spec.parallelize_fn
    assert from_json.config == zeropp.ZeroPPConfig(quantized_weights=True, hpz_partition_size=8)


class _Parallelized(Exception):
    """Raised by a stand-in parallelize function: the checks before it passed."""


def _stand_in_parallelize(model: torch.nn.Module, **kwargs) -> torch.nn.Module:
    raise _Parallelized


def test_meshes_zeropp_cannot_shard_over_are_refused() -> None:
    """A mesh other than ``partial_dtensor``'s: a ValueError naming what to change, before
    anything is sharded. Tensor parallelism, HSDP replicas, expert, pipeline and context
    parallelism go on to torchtitan's parallelize function (``test_torchtitan_meshes``,
    ``test_torchtitan_moe``, ``test_torchtitan_pipeline`` and ``test_torchtitan_cp`` run them)."""
    from torchtitan.config import ParallelismConfig
    from torchtitan.trainer import Trainer

    from zeropp.torchtitan import ZeroPPParallelize, with_zeropp

    parallelize = ZeroPPParallelize(_stand_in_parallelize, zeropp.ZeroPPConfig())
    for settings, named in [({"spmd_backend": "spmd_types"}, "spmd_backend='partial_dtensor'.*'spmd_types'"),
                            ({"spmd_backend": "full_dtensor", "tensor_parallel_degree": 2}, "'full_dtensor'")]:
        with pytest.raises(ValueError, match=named):
            parallelize(torch.nn.Linear(2, 2), parallelism=ParallelismConfig(**settings))
    for settings in [{"tensor_parallel_degree": 2}, {"data_parallel_replicate_degree": 2},
                     {"tensor_parallel_degree": 2, "data_parallel_replicate_degree": 2}, {"expert_parallel_degree": 2},
                     {"pipeline_parallel_degree": 2}, {"context_parallel_degree": 2}]:
        with pytest.raises(_Parallelized):
            parallelize(torch.nn.Linear(2, 2),
                        parallelism=ParallelismConfig(**settings, spmd_backend="partial_dtensor"))
    with pytest.raises(ValueError, match="model_spec"):
        with_zeropp(Trainer.Config(), zeropp.ZeroPPConfig())


def test_only_zeropp_torchtitan_imports_torchtitan() -> None:
    """``import zeropp`` (or any other zeropp module) never needs torchtitan: only the integration
    imports it, and the benchmark of torchtitan's layouts, inside its functions."""
    package = pathlib.Path(zeropp.__file__).parent
    importers, at_module_level = [], []
    for path in package.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            if any(name.split(".")[0] == "torchtitan" for name in names):
                importers.append(path.relative_to(package).as_posix())
                at_module_level += [importers[-1]] if node in tree.body else []
    assert set(importers) == {"integrations/torchtitan.py", "tools/bench/layouts.py"}
    assert "tools/bench/layouts.py" not in at_module_level
