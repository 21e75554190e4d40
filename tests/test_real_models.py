"""Models users bring: units that mix dtypes (a frozen bf16/fp16 base beside fp32 adapters),
0-dim parameters, weights loaded at any point, and models already sharded with fully_shard."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import zeropp
from distributed import run_distributed, run_fake_rank
from models import global_batch, make_model, reference_copy, rows
from zeropp.codes.quant import dequantize_packed, quantize_packed
from zeropp.tools.modes import MODES

TWO_BY_TWO = {"ZEROPP_RANKS_PER_NODE": "2"}
WIDTH, RANK_LORA, BLOCK = 10, 3, 32


class AdaptedLinear(nn.Module):
    """A frozen base layer in ``base_dtype`` and trainable fp32 low-rank adapters, in one unit
    (what PEFT's LoRA builds on a bf16 model)."""

    def __init__(self, base_dtype: torch.dtype) -> None:
        super().__init__()
        self.base = nn.Linear(WIDTH, WIDTH + 1).to(base_dtype).requires_grad_(False)  # odd: dim 0 padded
        self.lora_a = nn.Parameter(torch.randn(RANK_LORA, WIDTH) / WIDTH)
        self.lora_b = nn.Parameter(torch.randn(WIDTH + 1, RANK_LORA) / RANK_LORA)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base(x.to(self.base.weight.dtype)).to(x.dtype)
        return base + x.to(self.lora_a.dtype) @ self.lora_a.t() @ self.lora_b.t()


class AdaptedStack(nn.Module):
    def __init__(self, base_dtype: torch.dtype) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(AdaptedLinear(base_dtype) for _ in range(3))
        self.head = nn.Linear(WIDTH + 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))[:, :WIDTH]
        return self.head(F.pad(x, (0, 1)).to(self.head.weight.dtype))


def _expected_gather(full: torch.Tensor, world_size: int, quantized: bool) -> torch.Tensor:
    """What qwZ's all-gather yields for a parameter: each rank's dim-0 shard (zero-padded as
    FSDP2 pads it) as ``dequantize(quantize(shard))``, blocks starting at the shard."""
    rows_per_rank = -(-full.shape[0] // world_size)
    padded = torch.zeros((rows_per_rank * world_size, *full.shape[1:]), dtype=full.dtype)
    padded[:full.shape[0]] = full
    if not quantized:
        return full
    shards = []
    for shard in padded.chunk(world_size):
        flat = shard.reshape(-1)
        shards.append(dequantize_packed(quantize_packed(flat, 8, BLOCK), 8, BLOCK, flat.numel(), flat.dtype))
    return torch.cat(shards).view(padded.shape)[:full.shape[0]]


def _mixed_dtype_worker(rank: int, world_size: int, base_dtype: torch.dtype, param_dtype: torch.dtype | None,
                        quantize_all: bool) -> dict:
    torch.manual_seed(0)
    model = AdaptedStack(base_dtype)
    full = {name: p.detach().clone() for name, p in model.named_parameters()}
    config = zeropp.ZeroPPConfig(quantized_weights=quantize_all, quantized_nontrainable_weights=True,
                                 block_size=BLOCK, param_dtype=param_dtype)
    zeropp.shard(model, config)
    gathered: dict[str, torch.Tensor] = {}

    def keep_first_gathers(module: nn.Module, _: tuple) -> None:
        prefix = f"blocks.{list(model.blocks).index(module)}."
        for n, p in module.named_parameters():
            gathered.setdefault(prefix + n, p.detach().clone())

    for block in model.blocks:
        block.register_forward_pre_hook(keep_first_gathers)
    ledger = zeropp.comm_ledger()
    ledger.reset()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(1))
    losses = []
    for step in range(3):
        loss = (model(rows(x, rank, world_size)) ** 2).mean()
        loss.backward()
        if step == 2:  # the three forwards' gathers, not those the last step starts (``overlap``)
            qwz = ledger.summary(phase="forward", op="all_gather")["by_technique"]["qwZ"]
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    frozen_unchanged = all(torch.equal(p.full_tensor(), full[n]) for n, p in model.named_parameters()
                           if not p.requires_grad)
    mismatched = []
    for name, value in gathered.items():
        expected = full[name].to(param_dtype) if param_dtype is not None else full[name]
        wanted = _expected_gather(expected, world_size, quantize_all or "base" in name)
        if value.dtype != wanted.dtype or not torch.equal(value, wanted):
            mismatched.append(name)
    return {"num_gathered": len(gathered), "mismatched": mismatched, "losses": losses,
            "frozen_unchanged": frozen_unchanged, "qwz_forward_bytes": qwz["bytes"]}


def _qwz_bytes_per_rank_and_block(param_dtype: torch.dtype | None, base_dtype: torch.dtype,
                                  quantize_all: bool) -> int:
    """One rank's payload for one AdaptedLinear on 4 ranks: each parameter's dim-0 shard (dim 0
    padded to a multiple of 4), INT8 codes rounded up to 4 bytes plus one fp32 scale per block of
    32, or its raw bytes in the gather dtype; every segment 4-byte aligned."""
    shards = {"base.weight": (3 * WIDTH, True), "base.bias": (3, True),
              "lora_a": (1 * WIDTH, quantize_all), "lora_b": (3 * RANK_LORA, quantize_all)}
    total = 0
    for name, (numel, quantized) in shards.items():
        dtype = param_dtype or (base_dtype if name.startswith("base") else torch.float32)
        size = -(-numel // 4) * 4 + 4 * -(-numel // BLOCK) if quantized else numel * dtype.itemsize
        total += -(-size // 4) * 4
    return total


@pytest.mark.parametrize("base_dtype,param_dtype,quantize_all", [
    (torch.bfloat16, None, False),   # PEFT's default: bf16 base, fp32 adapters, one byte-buffer gather
    pytest.param(torch.float16, None, False, marks=pytest.mark.slow),
    pytest.param(torch.bfloat16, None, True, marks=pytest.mark.slow),  # qwZ on every parameter
    pytest.param(torch.bfloat16, torch.bfloat16, False, marks=pytest.mark.slow),  # one dtype again
])
def test_mixed_dtype_units_gather_each_parameter_in_its_own_dtype(base_dtype, param_dtype, quantize_all) -> None:
    """The first forward's gathers equal, per parameter, dequantize(quantize(shard)) in the
    parameter's gather dtype for the quantized ones and the exact value for the others; the
    ledger counts the payload at its real size; training runs; the frozen base stays
    bit-identical."""
    result = run_distributed(_mixed_dtype_worker, 4, base_dtype, param_dtype, quantize_all, env=TWO_BY_TWO)[0]
    assert result["frozen_unchanged"]
    assert all(torch.isfinite(torch.tensor(result["losses"])))
    assert result["losses"][-1] < result["losses"][0]
    assert result["num_gathered"] == 3 * 4 and result["mismatched"] == []
    forwards, blocks, peers = 3, 3, 3
    per_forward = blocks * _qwz_bytes_per_rank_and_block(param_dtype, base_dtype, quantize_all)
    if quantize_all:  # the root's head too: weight (1, 11) and bias (1,), dim 0 padded to 4
        per_forward += (12 + 4) + (4 + 4)
    expected_bytes = forwards * peers * per_forward
    assert result["qwz_forward_bytes"] == expected_bytes


class WithTemperature(nn.Module):
    """The test GPT with a learned 0-dim temperature on its logits (CLIP's ``logit_scale``)."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = make_model("gpt")
        self.temperature = nn.Parameter(torch.tensor(1.3))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits, _ = self.gpt(x, y)
        logits = logits / self.temperature
        return logits, F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _scalar_worker(rank: int, world_size: int, mode: str, micro_steps: int) -> dict:
    model = WithTemperature()
    reference = reference_copy(model)
    zeropp.shard(model, MODES[mode].config(2))
    ledger = zeropp.comm_ledger()
    ledger.reset()
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.2, momentum=0.9)
    for step in range(4):
        x, y = global_batch(step, 8)
        for micro in range(micro_steps):
            mx, my = rows(x, micro, micro_steps), rows(y, micro, micro_steps)
            (model(rows(mx, rank, world_size), rows(my, rank, world_size))[1] / micro_steps).backward()
            (reference(mx, my)[1] / micro_steps).backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    errors = {}
    for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
        value = p.full_tensor() if hasattr(p, "full_tensor") else p
        errors[name] = ((value.detach() - ref.detach()).norm() / ref.norm()).item()
    scalar_rows = [r for r in ledger.rows() if r["technique"] == "scalars"]
    return {"errors": errors, "temperature": model.temperature.item(), "scalar_rows": scalar_rows,
            "is_plain_tensor": type(model.temperature) is nn.Parameter}


@pytest.mark.parametrize("mode,micro_steps", [("zero3", 1), pytest.param("zero3", 2, marks=pytest.mark.slow),
                                              pytest.param("all", 1, marks=pytest.mark.slow)])
def test_scalar_parameters_train_as_in_one_process(mode: str, micro_steps: int) -> None:
    """fp32, 2x2, SGD: under ZeRO-3 every parameter, the 0-dim temperature included, equals the
    single-process run within 1e-5 relative after 4 steps (fp32 summation order only; with 2
    micro-steps too); under all three techniques the temperature is equal on every rank and
    follows the reference within the quantization's effect. Its gradient is averaged by one
    4-byte all-reduce per backward, counted under ``scalars``."""
    results = run_distributed(_scalar_worker, 4, mode, micro_steps, env=TWO_BY_TWO)
    assert len({r["temperature"] for r in results}) == 1
    errors = results[0]["errors"]
    assert results[0]["is_plain_tensor"]
    if mode == "zero3":
        assert max(errors.values()) <= 1e-5, errors
    else:
        assert errors["temperature"] <= 0.02, errors
    all_reduces = [r for r in results[0]["scalar_rows"] if r["op"] == "all_reduce"]
    assert sum(r["calls"] for r in all_reduces) == 4 * micro_steps
    assert all(r["dtype"] == "float32" for r in all_reduces)


LOAD_SCENARIOS = (("after_forward", "set_model_state_dict"), ("after_no_grad", "load_state_dict"),
                  ("between_micro_steps", "set_model_state_dict"))


def _load_worker(rank: int, world_size: int, mode: str) -> dict:
    config = MODES[mode].config(2)
    donor = make_model("gpt", seed=1)
    fresh = zeropp.shard(make_model("gpt", seed=1), config)  # never saw other weights
    x, y = (rows(t, rank, world_size) for t in global_batch(0, 8))
    with torch.no_grad():
        expected = fresh(x, y)[0]
    results = {}
    for when, how in LOAD_SCENARIOS:
        model = zeropp.shard(make_model("gpt", seed=0), config)
        if when == "after_forward":
            model(x, y)  # its backward never runs
        elif when == "after_no_grad":
            with torch.no_grad():
                model(x, y)
        else:
            model.set_requires_gradient_sync(False)
            model(x, y)[1].backward()
            model.set_requires_gradient_sync(True)
        if how == "set_model_state_dict":
            set_model_state_dict(model, donor.state_dict(), options=StateDictOptions(full_state_dict=True))
        else:
            model.load_state_dict(fresh.state_dict())
        with torch.no_grad():
            after = model(x, y)[0]
        results[f"{when}/{how}"] = (after - expected).abs().max().item()
    return results


@pytest.mark.parametrize("mode", [pytest.param(m, marks=[pytest.mark.slow] * (m != "all"))
                                  for m in ("zero3", "qwz", "hpz", "qgz", "all")])
@pytest.mark.slow
def test_weights_load_at_any_point(mode: str) -> None:
    """After a forward whose backward never ran, after a no_grad forward, or between micro-steps,
    loading other weights makes the next forward compute exactly what a model sharded with those
    weights from the start computes (bit for bit: the same shards, quantized the same way)."""
    results = run_distributed(_load_worker, 4, mode, env=TWO_BY_TWO)
    assert all(diff == 0.0 for r in results for diff in r.values()), results


def _enable_worker(rank: int, world_size: int, hpz_reshard: bool | int) -> dict:
    config = MODES["all"].config(2)
    ours = zeropp.shard(make_model("gpt"), config)
    theirs = make_model("gpt")
    mp = MixedPrecisionPolicy()
    for block in theirs.blocks:
        fully_shard(block, reshard_after_forward=hpz_reshard, mp_policy=mp)
    fully_shard(theirs, reshard_after_forward=hpz_reshard, mp_policy=mp)
    try:
        zeropp.enable(theirs, config)
    except ValueError as error:
        return {"error": str(error)}
    losses = {}
    for name, model in (("ours", ours), ("theirs", theirs)):
        opt = torch.optim.SGD(model.parameters(), lr=0.2)
        losses[name] = []
        for step in range(3):
            x, y = (rows(t, rank, world_size) for t in global_batch(step, 8))
            loss = model(x, y)[1]
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[name].append(loss.item())
    installed = zeropp.sharded_comms(theirs)
    return {"losses": losses, "num_qgz": len(installed.qgz), "hooks": installed.fresh_copy_hooks}


@pytest.mark.parametrize("hpz_reshard", [2, pytest.param(True, marks=pytest.mark.slow)])
def test_enable_adds_zeropp_to_a_model_sharded_with_fully_shard(hpz_reshard: bool | int) -> None:
    """A model the user sharded with fully_shard, with reshard_after_forward=2 or True (as
    torchtitan and accelerate shard: a bool), trains, once enabled with all three techniques
    (hpZ 2), exactly as zeropp.shard's (bit-identical losses): enable sets hpZ's partition."""
    result = run_distributed(_enable_worker, 4, hpz_reshard, env=TWO_BY_TWO)[0]
    assert result["losses"]["ours"] == result["losses"]["theirs"]
    assert result["num_qgz"] == 3 and result["hooks"]


def _refusal_worker(rank: int, world_size: int) -> str:
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4).double(), nn.Linear(4, 4).double()))
    try:
        zeropp.shard(model, zeropp.ZeroPPConfig(quantized_weights=True))
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.slow
def test_a_dtype_the_codec_cannot_take_is_refused_by_name() -> None:
    message = run_distributed(_refusal_worker, 2)[0]
    assert "'0.0.weight'" in message and "(4, 4)" in message and "torch.float64" in message
    assert "torch.float32, torch.bfloat16, torch.float16" in message


def test_enable_refuses_a_bare_model() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        zeropp.enable(make_model("gpt"))


def _engine_scalar_worker(rank: int, world_size: int) -> dict:
    model = WithTemperature()
    with torch.no_grad():
        model.temperature.fill_(0.05)  # sharp logits: the temperature's gradient is a large part of the norm
    reference = reference_copy(model)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1e-3,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {"stage": 3}}
    engine, *_ = zeropp.initialize(model=model, config=config)
    x, y = global_batch(0, 8)
    engine.backward(engine(rows(x, rank, world_size), rows(y, rank, world_size))[1])
    engine.step()
    reference(x, y)[1].backward()
    expected = torch.sqrt(sum(p.grad.double().square().sum() for p in reference.parameters())).item()
    share = reference.temperature.grad.abs().item() / expected
    return {"norm": engine.last_grad_norm, "expected": expected, "temperature_share": share}


@pytest.mark.slow
def test_engine_clips_with_scalars_counted_once() -> None:
    """zeropp.initialize on a model with a 0-dim parameter: the global gradient norm it clips
    with equals the single-process norm (the replicated scalar's gradient counted once, not once
    per rank) within fp32 summation error."""
    result = run_distributed(_engine_scalar_worker, 4, env=TWO_BY_TWO)[0]
    assert result["temperature_share"] >= 0.01, result  # counted 4 times, it would move the norm visibly
    assert abs(result["norm"] - result["expected"]) <= 1e-5 * result["expected"], result


def _grouped_worker(rank: int, world_size: int) -> dict:
    from zeropp.techniques.qwz import QuantizedAllGather

    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4))
    fully_shard(model[0])
    fully_shard([model[1], model[2]])  # one unit of two modules, as torchtitan shards [norm, output]
    fully_shard(model)
    zeropp.enable(model, zeropp.ZeroPPConfig(quantized_weights=True, unquantized_parameters=("2.*",)))
    installed = zeropp.sharded_comms(model)
    grouped = installed.all_gathers[[i for i, group in enumerate(installed.units) if group.unit is model[1]][0]]
    return {"units": len(installed.units), "grouped_quantized": grouped.quantized,
            "grouped_is_qwz": isinstance(grouped, QuantizedAllGather)}


def test_a_unit_grouping_several_modules_gets_one_set_of_comms_and_full_names() -> None:
    """fully_shard([norm, head]) makes one unit of two modules: zeropp installs its comms once
    (three units, not four) and matches unquantized_parameters against the parameters' names in
    the model ("2.*" keeps the head's weight and bias whole, the norm's are quantized)."""
    result = run_fake_rank(_grouped_worker, 4, 1)
    assert result["units"] == 3
    assert result["grouped_is_qwz"] and result["grouped_quantized"] == [True, True, False, False]
