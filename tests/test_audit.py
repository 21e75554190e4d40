"""The live audit: the codes' error bounds hold, an audited run is bit for bit the same run, a
corrupted code is caught and named, and the fallback then trains as ZeRO-3 does."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.distributed as dist

import zeropp
from distributed import run_distributed
from models import global_batch, make_model, rows
from zeropp.codes import gradcode
from zeropp.codes.bounds import block_constant, block_norms, coding_bound
from zeropp.codes.codec import ChunkCodec, segments_for
from zeropp.codes.gradcode import GradientCode
from zeropp.codes.quant import packed_numel
from zeropp.setup.sharding import sharded_comms
from zeropp.techniques.qwz import QuantizedAllGather

BLOCK = 64

CODECS = {
    "int8 weights, a raw segment": (ChunkCodec(segments_for([512, 96, 200], [True, False, True], 2, 8),
                                               BLOCK, torch.float32), torch.float32),
    "int4 weights in bf16": (ChunkCodec(segments_for([512, 200], [True, True], 2, 4), BLOCK, torch.bfloat16),
                             torch.bfloat16),
    "asymmetric int4 weights": (ChunkCodec(segments_for([512, 200], [True, True], 2, 4, asymmetric=True),
                                           BLOCK, torch.float32), torch.float32),
    "int2 gradients": (ChunkCodec(segments_for([512, 200], [True, True], 2, 2), BLOCK, torch.float32),
                       torch.float32),
    "rotated, normal levels": (ChunkCodec(segments_for([512, 200], [True, True], 2, 4), BLOCK, torch.float32,
                                          GradientCode(rotation="hadamard", levels="normal")), torch.float32),
    "stochastic rounding": (ChunkCodec(segments_for([512, 200], [True, True], 2, 4), BLOCK, torch.float32,
                                       GradientCode(rotation="hadamard", rounding="stochastic")), torch.float32),
    "8-bit scales": (ChunkCodec(segments_for([4096, 200], [True, True], 2, 4, grouped_scales=True), BLOCK,
                                torch.float32, GradientCode(levels="normal", scale_bits=8)), torch.float32),
}


@pytest.mark.parametrize("name", list(CODECS))
def test_every_block_within_its_bound(name: str) -> None:
    """The bound of ``coding_bound`` holds on every block of heavy-tailed rows (outliers, a
    block of zeros, tiny values), and is not vacuous: the error reaches a sizeable part of it."""
    codec, dtype = CODECS[name]
    generator = torch.Generator().manual_seed(0)
    values = torch.randn((6, codec.numel), generator=generator) * torch.rand((6, 1), generator=generator)
    values[0, 3] = 40.0
    values[1, BLOCK:2 * BLOCK] = 0.0
    values[2] *= 1e-30
    values = values.to(dtype)
    packed = torch.empty((6, codec.nbytes), dtype=torch.uint8)
    codec.encode(values, packed, torch.Generator().manual_seed(1))
    decoded = torch.empty_like(values)
    codec.decode(packed, decoded)
    error = block_norms(codec, decoded.float() - values.float())
    bound = block_norms(codec, coding_bound(codec, values, out_dtype=dtype))
    assert (error <= bound * (1 + 1e-6)).all(), (error / bound).max()
    assert (error[bound > 0] / bound[bound > 0]).max() > 0.2


def test_block_constant_bounds_add() -> None:
    """Two block-constant bounds summed elementwise have block norms equal to the sum of theirs,
    so a sum of codings is bounded by the sum of their bounds ([Note: block-constant bounds])."""
    codec, _ = CODECS["int2 gradients"]
    generator = torch.Generator().manual_seed(2)
    first, second = (block_constant(codec, torch.rand((3, codec.numel), generator=generator)) for _ in range(2))
    summed = block_norms(codec, first + second)
    assert torch.allclose(summed, block_norms(codec, first) + block_norms(codec, second), rtol=1e-6)
    single = block_constant(codec, torch.rand((1, codec.numel), generator=generator))
    assert torch.allclose(block_norms(codec, single), block_norms(codec, single * 1.0), rtol=0)


def test_non_finite_blocks_have_non_finite_bounds() -> None:
    codec, _ = CODECS["int8 weights, a raw segment"]
    values = torch.zeros((1, codec.numel))
    values[0, 5] = float("nan")
    bound = coding_bound(codec, values)
    assert bound[0, :BLOCK].isnan().all() and bound[0, BLOCK:256].isfinite().all()


# ---- multi-rank: 2 nodes x 2 ranks ----------------------------------------------------------

ENV = {"ZEROPP_RANKS_PER_NODE": "2"}
STEPS = 6
ALL = dict(quantized_weights=True, hpz_partition_size=2, quantized_gradients=True)


def _train(rank: int, world_size: int, model: torch.nn.Module, steps: int,
           optimizer: torch.optim.Optimizer | None = None) -> tuple[torch.optim.Optimizer, list[float]]:
    optimizer = optimizer if optimizer is not None else torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        x, y = global_batch(step, 8)
        _, loss = model(rows(x, rank, world_size), rows(y, rank, world_size))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return optimizer, losses


def _audited_run(rank: int, world_size: int, options: dict) -> dict:
    _, plain = _train(rank, world_size, zeropp.shard(make_model("gpt"), zeropp.ZeroPPConfig(**ALL, **options)), STEPS)
    model = zeropp.shard(make_model("gpt"), zeropp.ZeroPPConfig(**ALL, **options, audit_every=2))
    _, audited = _train(rank, world_size, model, STEPS)
    report = zeropp.audit_report(model)
    return {"plain": plain, "audited": audited, "rows": [vars(row) for row in report],
            "audit_bytes": zeropp.comm_ledger().summary()["by_technique"].get("audit", {}).get("bytes")}


@pytest.mark.parametrize("options", [{}, {"error_feedback": True, "grad_bits_intra": 8, "overlap": True},
                                     {"grad_rotation": "hadamard", "grad_levels": "normal", "grad_slice_bytes": 4096}],
                         ids=["default", "error-feedback-overlap", "rotated-sliced"])
def test_audit_changes_no_number_and_stays_within_bounds(options: dict) -> None:
    """With no fault: the audited run's losses are bit for bit the run's without the audit, and
    every audited collective is within its bound, the error a sizeable part of it (not vacuous)."""
    results = run_distributed(_audited_run, 4, options, env=ENV)
    for result in results:
        assert result["audited"] == result["plain"]
        assert result["rows"] == results[0]["rows"]  # every rank records the same rows
    report = results[0]["rows"]
    assert [row["step"] for row in report if row["technique"] == "qwZ"] == [2, 4, 6]
    assert {row["technique"] for row in report} == {"qwZ", "qgZ"}
    assert len({row["unit"] for row in report}) == 3  # the rotation moves on
    for row in report:
        assert row["within_bound"] and not row["fell_back"]
        assert 0 < row["relative_error"] <= row["bound"] < 1
    assert results[0]["audit_bytes"] is not None


def _corrupt_scales(comm: QuantizedAllGather, factor: float) -> None:
    """Every payload the comm decodes gets its first segment's block scales multiplied by ``factor``."""
    decode = comm._decode

    def corrupted(received: torch.Tensor, codec: ChunkCodec, output: torch.Tensor) -> None:
        segment, (_, _, byte, nbytes) = codec.segments[0], codec._spans[0]
        data_bytes = packed_numel(segment.numel, segment.bits, codec.block_size) - 4 * -(-segment.numel //
                                                                                       codec.block_size)
        scales = received[:, byte + data_bytes:byte + nbytes].contiguous().view(torch.float32)
        received[:, byte + data_bytes:byte + nbytes] = (scales * factor).view(torch.uint8)
        decode(received, codec, output)

    comm._decode = corrupted


def _faulty_run(rank: int, world_size: int, faulty_units: str) -> dict:
    config = zeropp.ZeroPPConfig(**ALL, audit_every=1, audit_fallback=True)
    model = zeropp.shard(make_model("gpt"), config)
    comms = sharded_comms(model)
    names = [gather.recorder.unit for gather in comms.all_gathers]
    targets = range(len(names)) if faulty_units == "all" else [names.index("blocks.1")]
    for index in targets:
        _corrupt_scales(comms.all_gathers[index], 1.5)
    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("zeropp").addHandler(handler)
    optimizer, _ = _train(rank, world_size, model, 2 * len(names))
    result = {"rows": [vars(row) for row in zeropp.audit_report(model)], "warnings": warnings, "names": names,
              "exact_comms": [type(gather).__name__ for gather in comms.all_gathers]}
    if faulty_units == "all":  # every unit fell back: from here on it is ZeRO-3, bit for bit
        state = copy.deepcopy((model.state_dict(), optimizer.state_dict()))
        _, after = _train(rank, world_size, model, 3, optimizer)
        reference = zeropp.shard(make_model("gpt"), zeropp.ZeroPPConfig())
        reference.load_state_dict(state[0])
        reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=3e-3)
        reference_optimizer.load_state_dict(state[1])
        _, zero3 = _train(rank, world_size, reference, 3, reference_optimizer)
        result.update(after=after, zero3=zero3)
    dist.barrier()
    return result


def test_corrupted_scales_are_caught_named_and_fall_back() -> None:
    """One unit's qwZ scales corrupted (x 1.5): the audit names it at its first audit, within
    ``audit_every`` x the number of audited units steps, beyond its bound, on every rank; with
    ``audit_fallback`` the unit gathers exactly from the next step on and is not flagged again."""
    results = run_distributed(_faulty_run, 4, "one", env=ENV)
    result = results[0]
    flagged = [row for row in result["rows"] if not row["within_bound"]]
    assert len(flagged) == 1 and flagged[0]["unit"] == "blocks.1" and flagged[0]["technique"] == "qwZ"
    assert flagged[0]["step"] <= len(result["names"]) and flagged[0]["fell_back"]
    assert flagged[0]["relative_error"] > 10 * flagged[0]["bound"]
    assert any("blocks.1" in w and "qwZ" in w and "beyond" in w for w in result["warnings"])
    index = result["names"].index("blocks.1")
    assert result["exact_comms"][index] == "CountingAllGather"
    assert all(name == "QuantizedAllGather" for i, name in enumerate(result["exact_comms"]) if i != index)
    later = [row for row in result["rows"] if row["step"] > flagged[0]["step"]]
    assert later and all(row["within_bound"] and row["unit"] != "blocks.1" for row in later)
    for other in results[1:]:
        assert other["rows"] == result["rows"]


@pytest.mark.slow
def test_fallen_back_units_train_as_zero3() -> None:
    """Every unit's codes corrupted: each falls back as the rotation reaches it, and from then on
    the run's losses are ZeRO-3's from the same state, bit for bit."""
    results = run_distributed(_faulty_run, 4, "all", env=ENV)
    for result in results:
        assert set(result["exact_comms"]) == {"CountingAllGather"}
        assert result["after"] == result["zero3"]


def test_audit_fallback_needs_the_audit() -> None:
    with pytest.raises(ValueError, match="audit_fallback=true .* audit is off: set audit_every"):
        zeropp.ZeroPPConfig(quantized_weights=True, audit_fallback=True)
    config = zeropp.ZeroPPConfig.from_deepspeed({"zero_optimization": {
        "stage": 3, "zero_quantized_weights": True, "zeropp": {"audit_every": 100, "audit_fallback": True}}})
    assert (config.audit_every, config.audit_fallback) == (100, True)
    with pytest.raises(ValueError, match="zero_optimization.zeropp.audit_every=-1"):
        zeropp.ZeroPPConfig.from_deepspeed({"zero_optimization": {"stage": 3, "zeropp": {"audit_every": -1}}})


def test_stochastic_rounding_bound_uses_the_whole_gap() -> None:
    """Stochastic rounding may land a whole level gap away: its bound is twice nearest rounding's."""
    nearest = GradientCode(rotation="hadamard")
    stochastic = GradientCode(rotation="hadamard", rounding="stochastic")
    codecs = [ChunkCodec(segments_for([512], [True], 2, 4), BLOCK, torch.float32, code) for code in (nearest,
                                                                                                       stochastic)]
    values = torch.randn((2, codecs[0].numel), generator=torch.Generator().manual_seed(3))
    ratio = coding_bound(codecs[1], values) / coding_bound(codecs[0], values)
    gap = gradcode.max_level_gap(4, BLOCK, nearest)
    assert torch.allclose(ratio, torch.full_like(ratio, 2.0), rtol=1e-4), gap


def _engine_run(rank: int, world_size: int) -> dict:
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("zeropp").addHandler(handler)
    logging.getLogger("zeropp").setLevel(logging.INFO)
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
              "zero_optimization": {"stage": 3, "zero_quantized_weights": True, "zero_hpz_partition_size": 2,
                                    "zero_quantized_gradients": True, "zeropp": {"audit_every": 1}}}
    engine, _, _, _ = zeropp.initialize(model=make_model("gpt"), config=config)
    for step in range(3):
        x, y = global_batch(step, 8)
        _, loss = engine(rows(x, rank, world_size), rows(y, rank, world_size))
        engine.backward(loss)
        engine.step()
    return {"logged": [line for line in records if line.startswith("zeropp audit:")],
            "rows": len(zeropp.audit_report(engine.module))}


def test_engine_logs_the_audit() -> None:
    """The DeepSpeed-style engine with ``zero_optimization.zeropp.audit_every``: rank 0 logs each
    row at ``steps_per_print`` (both techniques, every step here)."""
    results = run_distributed(_engine_run, 4, env=ENV)
    logged = results[0]["logged"]
    assert len(logged) == results[0]["rows"] == 6
    assert all("within its bound" in line for line in logged)
    assert {"qwZ" in line for line in logged} == {True, False}
    assert results[1]["logged"] == []


# ---- a per-unit error budget ([Note: a per-unit error budget]) ------------------------------

def _qgz_cross_node_bytes() -> int:
    return zeropp.comm_ledger().summary(technique="qgZ")["total"]["cross_node_bytes"]


def _budget_run(rank: int, world_size: int, budget: float) -> dict:
    """Step 1 with the budget (every unit's qgZ audited), then steps 2-4; beside it, the same
    step 1 without the budget, and steps 2-4 from its state with every gradient at 8 bits."""
    model = zeropp.shard(make_model("gpt"), zeropp.ZeroPPConfig(**ALL, audit_every=1000, grad_error_budget=budget))
    optimizer, first = _train(rank, world_size, model, 1)
    zeropp.comm_ledger().reset()
    _, later = _train(rank, world_size, model, 3, optimizer)
    budget_bytes = _qgz_cross_node_bytes()
    result = {"rows": [vars(row) for row in zeropp.audit_report(model)], "losses": first + later,
              "budget_bytes": budget_bytes}
    plain = zeropp.shard(make_model("gpt"), zeropp.ZeroPPConfig(**ALL))
    plain_optimizer, plain_first = _train(rank, world_size, plain, 1)
    wide = zeropp.shard(make_model("gpt"), zeropp.ZeroPPConfig(**ALL, grad_wide_parameters=("*",)))
    wide.load_state_dict(plain.state_dict())
    wide_optimizer = torch.optim.AdamW(wide.parameters(), lr=3e-3)
    wide_optimizer.load_state_dict(plain_optimizer.state_dict())
    zeropp.comm_ledger().reset()
    _, wide_later = _train(rank, world_size, wide, 3, wide_optimizer)
    result.update(wide_losses=plain_first + wide_later, wide_bytes=_qgz_cross_node_bytes())
    zeropp.comm_ledger().reset()
    _train(rank, world_size, plain, 3, plain_optimizer)
    result["plain_bytes"] = _qgz_cross_node_bytes()
    return result


def test_units_over_the_error_budget_go_to_8_bits_on_every_rank() -> None:
    """A budget under every unit's 4-bit error: the first forward audits every unit's qgZ, every
    unit widens, and steps 2-4 are bit for bit a run whose gradients all travel at 8 bits from
    the same state, at its cross-node bytes (more than 4-bit's)."""
    results = run_distributed(_budget_run, 4, 1e-9, env=ENV)
    result = results[0]
    first = [row for row in result["rows"] if row["step"] == 1]
    assert {row["technique"] for row in first} == {"qgZ"} and len(first) == 3  # the root and two blocks
    assert all(row["widened"] and row["within_bound"] for row in first)
    assert result["losses"] == result["wide_losses"]
    assert result["budget_bytes"] == result["wide_bytes"] > 1.5 * result["plain_bytes"]
    for other in results[1:]:
        assert other["rows"] == result["rows"] and other["losses"] == other["wide_losses"]


def test_units_under_the_error_budget_keep_their_bits() -> None:
    """A budget between the units' errors widens exactly the units above it, and a budget over
    every unit's error widens none: the run is then the plain one, bytes and all."""
    calibration = run_distributed(_budget_run, 4, 1e-9, env=ENV)[0]
    errors = sorted(row["relative_error"] for row in calibration["rows"] if row["step"] == 1)
    assert errors[0] < errors[-1]
    middle = (errors[0] + errors[-1]) / 2
    result = run_distributed(_budget_run, 4, middle, env=ENV)[0]
    first = [row for row in result["rows"] if row["step"] == 1]
    assert [row["widened"] for row in first] == [row["relative_error"] > middle for row in first]
    assert any(row["widened"] for row in first) and not all(row["widened"] for row in first)
    assert result["plain_bytes"] < result["budget_bytes"] < result["wide_bytes"]
    above = run_distributed(_budget_run, 4, 2 * errors[-1], env=ENV)[0]
    assert not any(row["widened"] for row in above["rows"])
    assert above["budget_bytes"] == above["plain_bytes"]
    assert above["losses"][0] == result["losses"][0]


def test_the_error_budget_names_what_it_needs() -> None:
    with pytest.raises(ValueError, match=r"grad_error_budget=0.05 .* audit is off: set audit_every"):
        zeropp.ZeroPPConfig(quantized_gradients=True, grad_error_budget=0.05)
    with pytest.raises(ValueError, match=r"grad_error_budget=0.05 widens qgZ's .* qgZ is off"):
        zeropp.ZeroPPConfig(quantized_weights=True, audit_every=10, grad_error_budget=0.05)
    with pytest.raises(ValueError, match=r"grad_error_budget=0.05 .*grad_rotation='hadamard'"):
        zeropp.ZeroPPConfig(quantized_gradients=True, audit_every=10, grad_error_budget=0.05,
                            grad_rotation="hadamard")
    with pytest.raises(ValueError, match=r"zero_optimization.zeropp.grad_error_budget=-1 .* >= 0"):
        zeropp.ZeroPPConfig.from_deepspeed({"zero_optimization": {"stage": 3, "zeropp": {"grad_error_budget": -1}}})
    config = zeropp.ZeroPPConfig.from_deepspeed({"zero_optimization": {
        "stage": 3, "zero_quantized_gradients": True, "zeropp": {"audit_every": 100, "grad_error_budget": 0.1}}})
    assert (config.audit_every, config.grad_error_budget) == (100, 0.1)
