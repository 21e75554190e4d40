"""DeepSpeed's own ZeRO++ unit tests (``tests/unit/runtime/zero/test_zeropp.py`` in DeepSpeed's
repository) ported onto ``zeropp.initialize``, and the DeepSpeedEngine names scripts call.

The port keeps DeepSpeed's model (9 x ``Linear(1024)`` returning its ``CrossEntropyLoss``), its
configs (fp16 with loss scale 1 and Adam at lr 1; accumulation 3 with a dynamic loss scale),
its data helper (which asks the engine for ``device``, ``train_micro_batch_size_per_gpu()`` and
``get_data_types()``) and its loops, on 4 ranks for hpZ partition sizes 1, 2 and 4.
DeepSpeed's ``DistributedTest`` becomes four spawned gloo ranks: 2 nodes x 2 for sizes 1 and 2,
one node of 4 for size 4 (hpZ's partition must fit in a node). DeepSpeed asserted on its own
parameter attributes (``ds_secondary_tensor``) and otherwise only that the loops ran; these
assert what each loop must do in zeropp: hpZ's secondary copy after every training forward and
the backward gathering inside the node, Adam's first step of exactly lr per weight, steps
skipped on overflow with the weights left finite, evaluation leaving the weights bit-identical,
gradients reduced only at accumulation boundaries.
"""

from __future__ import annotations

import ast
import copy
import importlib.util
import math
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import zeropp
from distributed import run_distributed
from models import global_batch, make_model, rows
from zeropp.engine import ZeroPPEngine
from zeropp.engine.deepspeed_api import IMPLEMENTED, NOT_IN_ZEROPP, safetensors_filename
from zeropp.fsdp.access import fsdp_units, unit_layout
from zeropp.techniques.hpz import held_secondary_copy_bytes, secondary_copy_bytes

H_DIM = 1024
N_LAYERS = 9
TOTAL_SAMPLES = 20
GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guide.md"
GUIDE_SECTION = "## `zeropp.initialize` and DeepSpeedEngine's names"


class NNModel(nn.Module):
    """DeepSpeed's test model: ``n_layers`` Linear layers of width ``h_dim``, then the
    cross-entropy of the last one's output over ``h_dim`` classes."""

    def __init__(self, h_dim: int = H_DIM, n_layers: int = N_LAYERS) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(h_dim, h_dim) for _ in range(n_layers)])
        self.cross_entropy_loss = nn.CrossEntropyLoss()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.cross_entropy_loss(x, y)


def random_dataloader(model, total_samples: int, hidden_dim: int, device: torch.device
                      ) -> torch.utils.data.DataLoader:
    """DeepSpeed's helper: random inputs in the engine's model dtype, random class labels."""
    batch_size = model.train_micro_batch_size_per_gpu()
    data = torch.randn(total_samples, hidden_dim, device=device, dtype=model.get_data_types()[0])
    labels = torch.empty(total_samples, dtype=torch.long, device=device).random_(hidden_dim)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data, labels), batch_size=batch_size)


def _config(zpg: int, **zero: object) -> dict:
    """DeepSpeed's test config: micro-batch 1, ZeRO-3 with hpZ ``zpg``, Adam at lr 1, fp16 with a
    static loss scale of 1 (``zero`` adds or overrides ``zero_optimization`` keys)."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "stage3_max_reuse_distance": 0, "zero_hpz_partition_size": zpg,
                              "contiguous_gradients": True, "overlap_comm": True, **zero},
        "optimizer": {"type": "Adam", "params": {"lr": 1.0}},
        "fp16": {"enabled": True, "loss_scale": 1.0},
    }


def _layout(zpg: int) -> dict[str, str]:
    """hpZ's partition lives inside a node: 2 nodes x 2 up to size 2, one node of 4 for size 4."""
    return {"ZEROPP_RANKS_PER_NODE": "2" if zpg <= 2 else "4"}


def _initialize(rank: int, config: dict):
    """DeepSpeed's ``deepspeed.initialize(model=..., model_parameters=..., config=...)``, the
    model the same on every rank and the data different."""
    torch.manual_seed(0)
    model = NNModel()
    reference = copy.deepcopy(model)
    engine, *_ = zeropp.initialize(model=model, model_parameters=model.parameters(), config=config)
    torch.manual_seed(1 + rank)
    loader = random_dataloader(engine, TOTAL_SAMPLES, H_DIM, engine.device)
    return engine, reference, loader


def _units_with_parameters(engine) -> list:
    """The model's sharded units that hold parameters."""
    return [u for u in fsdp_units(engine.module) if unit_layout(u).padded_numels]


def _hpz_layout(engine) -> dict:
    """What DeepSpeed checked on ``ds_secondary_tensor``, in zeropp's terms: over how many ranks
    each unit's weights stay sharded after forward, the bytes of hpZ's copy, and the elements of
    all units (padded as FSDP2 shards them)."""
    layouts = [unit_layout(u) for u in _units_with_parameters(engine)]
    return {"post_forward_group_sizes": {layout.post_forward_group_size for layout in layouts},
            "secondary_bytes": secondary_copy_bytes(engine.module),
            "num_elements": sum(n for layout in layouts for n in layout.padded_numels)}


def _weights(engine) -> list[torch.Tensor]:
    """The optimizer's parameters: this rank's primary shards, the weights training updates."""
    return [p for group in engine.optimizer.param_groups for p in group["params"]]


def _local_shards(engine) -> list[torch.Tensor]:
    return [p.to_local().clone() for p in _weights(engine)]


def _equal_shards(engine, before: list[torch.Tensor]) -> bool:
    return all(torch.equal(p.to_local(), b) for p, b in zip(_weights(engine), before))


# ---- TestZeroPPConfigSweep.test: qwZ + qgZ + hpZ, fp16 at loss scale 1, Adam at lr 1 ----------


def _sweep(rank: int, world_size: int, zpg: int) -> dict:
    config = _config(zpg, zero_quantized_weights=True, zero_quantized_gradients=True)
    engine, _, loader = _initialize(rank, config)
    ledger = zeropp.comm_ledger()
    before = _local_shards(engine)
    out: dict = {**_hpz_layout(engine), "losses": [], "applied": [], "held_after_forward": [],
                 "backward_gather_kinds": set(), "backward_cross_node_bytes": 0}
    for n, (x, y) in enumerate(loader):
        ledger.reset()
        loss = engine(x, y)
        out["held_after_forward"].append(held_secondary_copy_bytes(engine.module))
        engine.backward(loss)
        gathers = ledger.summary(phase="backward", op="all_gather")
        out["backward_gather_kinds"] |= set(gathers["by_group"])
        out["backward_cross_node_bytes"] += gathers["total"]["cross_node_bytes"]
        engine.step()
        out["losses"].append(loss.item())
        out["applied"].append(engine.was_step_applied())
        if n == 0:
            first_step = [(p.to_local() - b).abs() for p, b in zip(_weights(engine), before)]
            out["first_step_max"] = max(d.max().item() for d in first_step)
            out["first_step_at_lr"] = sum((d > 0.999).sum().item() for d in first_step) / sum(
                d.numel() for d in first_step)
    out.update(global_steps=engine.global_steps, micro_steps=engine.micro_steps,
               skipped_steps=engine.skipped_steps,
               finite=all(bool(p.to_local().isfinite().all()) for p in _weights(engine)))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("zpg", [1, 2, 4])
def test_zeropp_config_sweep(zpg: int) -> None:
    """20 steps on 20 random samples per rank. The first loss is ln 1024 to within 0.5: PyTorch's
    default init shrinks the activations about sqrt(3)-fold per layer, so after 9 layers the
    logits are nearly equal. Adam's first step moves every weight by lr x g / (|g| + eps) (both
    moments are g before bias correction), so by at most lr = 1 (plus an fp32 rounding), and
    most weights (those whose gradient survives fp16 and INT4) by 1 to within 1e-3. Those
    weights then overflow fp16 (the loss goes non-finite, as in DeepSpeed): every such step
    is skipped, on every rank alike, and the weights stay finite. hpZ: with ``zpg`` > 1 every
    unit keeps its weights sharded over ``zpg`` ranks after each forward: with 2, a copy of half
    the model (as qwZ's codes) from which the backward gathers inside the node; with 4, the
    whole world, no more than the primary shard's worth. With 1 no copy is kept and the
    backward gathers over both nodes."""
    results = run_distributed(_sweep, 4, zpg, env=_layout(zpg))
    for r in results:
        assert abs(r["losses"][0] - math.log(H_DIM)) < 0.5, r["losses"]
        assert r["applied"][0] and r["first_step_max"] <= 1.0 + 2.5e-7 and r["first_step_at_lr"] > 0.5, r
        assert (r["global_steps"], r["micro_steps"]) == (TOTAL_SAMPLES, TOTAL_SAMPLES)
        assert r["skipped_steps"] == r["applied"].count(False)
        assert r["finite"]
        assert r["applied"] == results[0]["applied"]
        assert r["post_forward_group_sizes"] == {zpg if zpg > 1 else 4}
        if zpg == 1:
            assert r["secondary_bytes"] == 0 and r["held_after_forward"] == [0] * TOTAL_SAMPLES
            assert r["backward_gather_kinds"] == {"world"} and r["backward_cross_node_bytes"] > 0
        elif zpg == 2:
            # half of every weight, kept as qwZ's codes: a byte each and an fp32 scale per 256
            assert r["secondary_bytes"] == r["num_elements"] // 2 * (1 + 4 / 256)
            assert r["held_after_forward"] == [r["secondary_bytes"]] * TOTAL_SAMPLES
            assert r["backward_gather_kinds"] == {"intra"} and r["backward_cross_node_bytes"] == 0
        else:  # the partition is the whole world (one node): at most a quarter of the weights in fp16
            assert max(r["held_after_forward"]) <= r["num_elements"] // 4 * 2


# ---- TestZeroPPConfigSweep.test_eval: hpZ, no_grad forwards ----------------------------------


def _eval(rank: int, world_size: int, zpg: int) -> dict:
    engine, reference, loader = _initialize(rank, _config(zpg))
    reference.half()
    before = _local_shards(engine)
    registered = [id(p) for p in engine.module.parameters()]
    out: dict = {**_hpz_layout(engine), "losses": [], "reference_losses": [], "held_after_forward": []}
    for x, y in loader:
        with torch.no_grad():
            loss = engine(x, y)
            out["held_after_forward"].append(held_secondary_copy_bytes(engine.module))
            out["losses"].append(loss.item())
            out["reference_losses"].append(reference(x, y).item())
    out["unchanged"] = _equal_shards(engine, before)
    out["same_parameters"] = [id(p) for p in engine.module.parameters()] == registered
    out.update(global_steps=engine.global_steps, micro_steps=engine.micro_steps)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("zpg", [1, 2, 4])
def test_zeropp_eval_under_no_grad(zpg: int) -> None:
    """20 ``no_grad`` forwards: every loss is finite and equals, bit for bit, the same fp16
    model's loss in one process (the gathered weights are the fp32 shards cast to fp16, as
    ``model.half()`` casts them); the weights stay bit-identical and remain the model's
    registered parameters, no step is counted, and hpZ (configured: the partition is ``zpg``)
    holds nothing after a forward no backward will follow, so no copy can go stale."""
    results = run_distributed(_eval, 4, zpg, env=_layout(zpg))
    for r in results:
        assert all(math.isfinite(loss) for loss in r["losses"]), r["losses"]
        assert r["losses"] == r["reference_losses"]
        assert r["unchanged"] and (r["global_steps"], r["micro_steps"]) == (0, 0)
        assert r["post_forward_group_sizes"] == {zpg if zpg > 1 else 4}
        assert r["held_after_forward"] == [0] * TOTAL_SAMPLES
        assert r["same_parameters"]


# ---- TestZeroPPConfigSweep.test_gradient_accumulation: 3 micro-steps, dynamic loss scale -------


def _accumulation(rank: int, world_size: int, zpg: int) -> dict:
    config = {**_config(zpg), "gradient_accumulation_steps": 3, "fp16": {"enabled": True, "loss_scale": 0.0}}
    engine, _, loader = _initialize(rank, config)
    ledger = zeropp.comm_ledger()
    num_units = len(_units_with_parameters(engine))
    out: dict = {**_hpz_layout(engine), "num_units": num_units, "losses": [], "boundary": [],
                 "reduce_scatters": [], "held_after_forward": [], "changed": [], "applied": []}
    for x, y in loader:
        before = _local_shards(engine)
        ledger.reset()
        out["boundary"].append(engine.is_gradient_accumulation_boundary())
        loss = engine(x, y)
        out["held_after_forward"].append(held_secondary_copy_bytes(engine.module))
        engine.backward(loss)
        out["reduce_scatters"].append(ledger.summary(op="reduce_scatter")["total"]["calls"])
        engine.step()
        out["losses"].append(loss.item())
        out["changed"].append(not _equal_shards(engine, before))
        if out["boundary"][-1]:
            out["applied"].append(engine.was_step_applied())
    out.update(global_steps=engine.global_steps, micro_steps=engine.micro_steps,
               skipped_steps=engine.skipped_steps, loss_scale=engine.loss_scale,
               finite=all(bool(p.to_local().isfinite().all()) for p in _weights(engine)))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("zpg", [1, 2, 4])
def test_zeropp_gradient_accumulation(zpg: int) -> None:
    """20 micro-steps, 3 per optimizer step, fp16 with DeepSpeed's dynamic loss scale (2**16,
    hysteresis 2). Every third micro-step is a boundary (6 steps; the last two micro-steps
    start a seventh window); gradients are reduce-scattered only in a boundary's backward, once
    per unit, and the weights change only at an applied boundary. hpZ's copy is made at every
    micro-step's forward, the intermediate ones too. The first window's losses are finite; each
    overflow skips its step on every rank, the first absorbed by the hysteresis and each later
    one halving the scale, and the weights stay finite."""
    results = run_distributed(_accumulation, 4, zpg, env=_layout(zpg))
    boundaries = ([False, False, True] * 7)[:TOTAL_SAMPLES]
    for r in results:
        assert r["boundary"] == boundaries
        assert r["reduce_scatters"] == [r["num_units"] if b else 0 for b in boundaries]
        assert (r["global_steps"], r["micro_steps"]) == (6, TOTAL_SAMPLES)
        assert all(math.isfinite(loss) for loss in r["losses"][:3]), r["losses"]
        applied = iter(r["applied"])
        assert r["changed"] == [b and next(applied) for b in boundaries]
        assert r["skipped_steps"] == r["applied"].count(False)
        assert r["loss_scale"] == 2.0**16 / 2.0 ** max(r["skipped_steps"] - 1, 0)
        assert r["applied"] == results[0]["applied"] and r["finite"]
        if zpg == 1:
            assert r["held_after_forward"] == [0] * TOTAL_SAMPLES
        elif zpg == 2:  # no qwZ here: half of every weight in fp16
            assert r["secondary_bytes"] == r["num_elements"] // 2 * 2
            assert r["held_after_forward"] == [r["secondary_bytes"]] * TOTAL_SAMPLES
        else:  # the partition is the whole world (one node): at most a quarter of the weights in fp16
            assert max(r["held_after_forward"]) <= r["num_elements"] // 4 * 2


# ---- save_16bit_model ----------------------------------------------------------------------------


def _save_config(gather: bool) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
            "zero_optimization": {"stage": 3, "zero_quantized_weights": True, "zero_hpz_partition_size": 2,
                                  "stage3_gather_16bit_weights_on_model_save": gather},
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}


def _save_16bit(rank: int, world_size: int, directory: str) -> dict:
    engine, *_ = zeropp.initialize(model=make_model("tied"), config=_save_config(True))
    for step in range(2):
        x, y = (rows(t, rank, world_size) for t in global_batch(step, 2 * world_size))
        engine.backward(engine(x, y)[1])
        engine.step()
    with torch.no_grad():
        engine(x, y)  # an evaluation forward before saving, as training scripts do
    out = {"saved": engine.save_16bit_model(directory),
           "saved_trainable": engine.save_16bit_model(f"{directory}/trainable", "weights.bin",
                                                      exclude_frozen_parameters=True),
           "full": {n: p.full_tensor().detach().numpy() for n, p in engine.module.named_parameters()},
           "trainable": sorted(n for n, p in engine.module.named_parameters() if p.requires_grad)}
    other, *_ = zeropp.initialize(model=make_model("tied", seed=1), config=_save_config(False))
    out["off"] = other.save_16bit_model(f"{directory}/off")
    return out


def test_save_16bit_model_writes_the_exact_full_weights(tmp_path) -> None:
    """bf16 training with qwZ and hpZ on 2 x 2, two steps and an evaluation forward, then
    ``save_16bit_model`` on every rank. The file (DeepSpeed's default name, written as
    ``model.safetensors``), loaded with safetensors in this one process into an unsharded bf16
    copy of the model, holds exactly each parameter's ``full_tensor()`` in bf16: the gathered
    fp32 shards, not qwZ's codes. ``exclude_frozen_parameters`` leaves out the frozen matrix;
    a ``.bin`` name becomes ``.safetensors``. With
    ``stage3_gather_16bit_weights_on_model_save`` false it returns False and writes nothing."""
    from safetensors.torch import load_file

    results = run_distributed(_save_16bit, 4, str(tmp_path), env={"ZEROPP_RANKS_PER_NODE": "2"})
    assert all(r["saved"] and r["saved_trainable"] and r["off"] is False for r in results)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model.safetensors", "trainable"]
    assert not (tmp_path / "off").exists()
    full = {name: torch.from_numpy(value) for name, value in results[0]["full"].items()}
    model = make_model("tied").to(torch.bfloat16)
    model.load_state_dict(load_file(tmp_path / "model.safetensors"), strict=True)
    for name, p in model.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p, full[name].to(torch.bfloat16)), name
    trainable = load_file(tmp_path / "trainable" / "weights.safetensors")
    assert sorted(trainable) == results[0]["trainable"] and "mix" not in trainable
    assert all(torch.equal(trainable[n], full[n].to(torch.bfloat16)) for n in trainable)
    assert [path.name for path in (tmp_path / "trainable").iterdir()] == ["weights.safetensors"]


def test_safetensors_filename() -> None:
    """DeepSpeed's default becomes transformers' name; other names keep their stem."""
    assert safetensors_filename("pytorch_model.bin") == "model.safetensors"
    assert safetensors_filename("weights.bin") == "weights.safetensors"
    assert safetensors_filename("model.safetensors") == "model.safetensors"
    assert safetensors_filename("weights") == "weights.safetensors"


# ---- the rest of DeepSpeedEngine's names ---------------------------------------------------------


def _deepspeed_engine_methods() -> list[str]:
    """The public methods of the installed DeepSpeed's ``DeepSpeedEngine``, read from its source
    (importing deepspeed builds its ops)."""
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or spec.origin is None:
        pytest.skip("deepspeed is not installed (pip install -e '.[peer]')")
    tree = ast.parse((Path(spec.origin).parent / "runtime" / "engine.py").read_text(encoding="utf-8"))
    engine = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "DeepSpeedEngine")
    return [node.name for node in engine.body if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")]


INSTANCE_ATTRIBUTES = {"module", "optimizer", "lr_scheduler", "config", "global_steps", "global_samples",
                       "micro_steps", "skipped_steps"}


def test_every_deepspeed_engine_method_is_implemented_or_says_the_zeropp_way() -> None:
    """Each public method of DeepSpeed's engine is on ``ZeroPPEngine`` or in ``NOT_IN_ZEROPP``
    (never both), and the guide's table lists every name of both."""
    methods = _deepspeed_engine_methods()
    assert len(methods) > 150
    assert not set(IMPLEMENTED) & set(NOT_IN_ZEROPP)
    assert [m for m in methods if m not in IMPLEMENTED and m not in NOT_IN_ZEROPP] == []
    assert [n for n in IMPLEMENTED if n not in INSTANCE_ATTRIBUTES and not hasattr(ZeroPPEngine, n)] == []
    guide = GUIDE.read_text(encoding="utf-8")
    section = guide[guide.index(GUIDE_SECTION):]
    section = section[:section.index("\n## ", 1)]
    listed = set(re.findall(r"`([a-z_0-9]+)`", section))
    assert [n for n in (*IMPLEMENTED, *NOT_IN_ZEROPP) if n not in listed] == []


def _names(rank: int, world_size: int) -> dict:
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 3, "zero_quantized_weights": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "betas": [0.8, 0.9]}}}
    engine, *_ = zeropp.initialize(model=make_model("tied"), config=config)
    ledger = zeropp.comm_ledger()
    exact_norms: list[float] = []
    engine.optimizer.register_step_pre_hook(lambda optimizer, *_: exact_norms.append(math.sqrt(sum(
        p.grad.full_tensor().double().square().sum().item() for p in _weights(engine) if p.grad is not None))))

    def backward(step: int, micro: int) -> int:
        """One micro-batch's forward and backward; the reduce-scatters it issued."""
        x, y = (rows(rows(t, micro, 2), rank, world_size) for t in global_batch(step, 4 * world_size))
        before = ledger.summary(op="reduce_scatter")["total"]["calls"]
        engine.backward(engine(x, y)[1])
        return ledger.summary(op="reduce_scatter")["total"]["calls"] - before

    out: dict = {"reduce_scatters": []}
    for step in range(2):  # DeepSpeed's loop: step() after every backward
        for micro in range(2):
            out["reduce_scatters"].append(backward(step, micro))
            engine.step()
    out["norms"] = (engine.get_global_grad_norm(), exact_norms[-1])
    for step in range(2, 4):  # accelerate's: the boundary said before each backward, step() at it only
        for micro in range(2):
            engine.set_gradient_accumulation_boundary(micro == 1)
            out["reduce_scatters"].append(backward(step, micro))
        engine.step()
    with engine.no_sync():
        out["reduce_scatters"].append(backward(4, 0))
        out["step_in_no_sync"] = _error(engine.step)
    out["step_unreduced"] = _error(engine.step)
    out["reduce_scatters"].append(backward(4, 1))
    engine.step()
    out.update(
        counts=(engine.global_steps, engine.micro_steps, engine.global_samples),
        where=(str(engine.device), engine.global_rank, engine.local_rank, engine.world_size, engine.dp_world_size,
               engine.mp_world_size, engine.get_data_parallel_rank()),
        stage=(engine.zero_optimization(), engine.zero_optimization_stage(),
               engine.zero_optimization_partition_weights(), engine.zero_hpz_partition_size(),
               engine.zero_quantized_weights(), engine.zero_quantized_gradients(),
               engine.zero_gather_16bit_weights_on_model_save()),
        precision=(engine.fp16_enabled(), engine.bfloat16_enabled(), engine.get_data_types(), engine.loss_scale),
        batch=engine.get_batch_info(), lr=engine.get_lr(), mom=engine.get_mom(), optimizer=engine.optimizer_name(),
        units=len(_units_with_parameters(engine)),
        not_in_zeropp=_error(lambda: engine.zero_offload_optimizer()),
        has_deepspeed_io=hasattr(engine, "deepspeed_io"),
        passed_through=engine.embed is engine.module.embed,
        unknown=_error(lambda: engine.no_such_name),
    )
    return out


def _error(action) -> str | None:
    """``type: message`` of what ``action()`` raised, or None."""
    try:
        action()
    except Exception as error:  # the point: which error, with which message
        return f"{type(error).__name__}: {error}"
    return None


def test_deepspeed_engine_names_on_four_ranks() -> None:
    """The accessors against what they must say on 2 x 2 with bf16, qwZ and accumulation 2;
    ``get_global_grad_norm()`` against the fp64 norm of the full gradients the optimizer
    steps on. Two windows of DeepSpeed's loop, two of accelerate's (the boundary set before
    each backward, ``step`` at the boundary only) and one through ``no_sync``: gradients are
    reduce-scattered once per unit, in each window's last backward only; ``step`` inside
    ``no_sync``, or after a backward that did not reduce, is an error. A DeepSpeed name zeropp
    lacks raises an ``AttributeError`` naming the zeropp way; the model's own names pass
    through."""
    results = run_distributed(_names, 4, env={"ZEROPP_RANKS_PER_NODE": "2"})
    for rank, r in enumerate(results):
        assert r["reduce_scatters"] == [0, r["units"]] * 5
        assert r["step_in_no_sync"].startswith("RuntimeError: engine.step() inside engine.no_sync()")
        assert r["step_unreduced"].startswith("RuntimeError: engine.step() at an accumulation boundary")
        assert r["counts"] == (5, 4 + 2 + 1, 5 * 16)  # step() calls that did not raise: 4, 2, 1
        engine_norm, exact_norm = r["norms"]
        assert abs(engine_norm - exact_norm) <= 1e-5 * exact_norm
        assert r["where"] == ("cpu", rank, rank, 4, 4, 1, rank)
        assert r["stage"] == (True, 3, True, 1, True, False, False)
        assert r["precision"] == (False, True, (torch.bfloat16, torch.bfloat16), 1.0)
        assert r["batch"] == (16, 2, 2) and r["optimizer"] == "AdamW"
        assert r["lr"] == [0.01] and r["mom"] == [(0.8, 0.9)]
        assert r["not_in_zeropp"].startswith("NotInZeroPP: DeepSpeedEngine.zero_offload_optimizer has no "
                                             "counterpart on zeropp's engine: offload")
        assert "CPUOffloadPolicy" in r["not_in_zeropp"]
        assert r["has_deepspeed_io"] is False and r["passed_through"]
        assert r["unknown"].startswith("AttributeError: 'ZeroPPEngine' object has no attribute 'no_such_name'")
