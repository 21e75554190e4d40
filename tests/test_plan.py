"""The cost model (``zeropp.tools.plan``): its bytes against real gloo runs' ledgers, its calibration
on synthetic data with known constants, its predictions' structure, and its refusals."""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from distributed import run_distributed
from zeropp.config import ZeroPPConfig
from zeropp.fsdp.ledger import COUNTS
from zeropp.setup.topology import Topology
from zeropp.tools.bench.worker import BENCH_MODES, WorkerConfig, run
from zeropp.tools.models import GPTConfig
from zeropp.tools.modes import MODES, System
from zeropp.tools.plan import calibrate, cost, emulated, memory, recommend, scale, traffic
from zeropp.tools.plan import model as model_shape

TRAFFIC_JOB = WorkerConfig(modes=(*BENCH_MODES, "all_hier", "all_scale8", "all_delta", "all_delta_g8",
                                  "all_delta_rotnorm", "all_delta_codes"),
                           warmup_steps=1, steps=1, batch_size=12, context_length=18, num_layers=2, embed_dim=48,
                           num_heads=2)
"""The bench's six modes, qwZ's two-hop gather, qgZ's 8-bit block scales and weight differences
over a copy in the gather dtype, as codes and beside 8-bit or rotated gradients (the measured step
after the warm-up step's full refresh sends differences), on a GPT whose dims
0 (84 characters, 18 positions) leave FSDP2 padding on six ranks; one step each, after one warm-up
step: each step ends by starting the next forward's first gathers ([Note: gathers after the step]),
so a window opened after a step holds one step's collectives."""


def _traffic_job(rank: int, world_size: int, config: WorkerConfig) -> dict | None:
    return run(config)


def _measured_rows(ledgers: list[dict]) -> dict[tuple, dict[str, int]]:
    """Every rank's ledger rows, summed per row key (what ``CommLedger.combined`` holds)."""
    rows: dict[tuple, dict[str, int]] = defaultdict(lambda: dict.fromkeys(COUNTS, 0))
    for ledger in ledgers:
        for r in ledger["rows"]:
            key = (r["phase"], r["op"], r["kind"], r["group_size"], r["dtype"], r["technique"])
            for count in COUNTS:
                rows[key][count] += int(r[count])
    return dict(rows)


def _predicted_rows(mode: str, config: WorkerConfig, topology: Topology, vocab_size: int) -> dict:
    shape = model_shape.gpt(GPTConfig(vocab_size=vocab_size, context_length=config.context_length,
                                      num_layers=config.num_layers, num_heads=config.num_heads,
                                      embed_dim=config.embed_dim))
    precision = traffic.Precision(gather_dtype=getattr(torch, config.param_dtype),
                                  reduce_dtype=getattr(torch, config.reduce_dtype))
    zeropp_config = None if MODES[mode].system is System.HSDP else MODES[mode].config(topology.ranks_per_node)
    transfers = [t for unit in traffic.step_transfers(shape, zeropp_config, topology, precision) for t in unit]
    return traffic.ledger_rows(transfers, topology)


def test_bytes_equal_the_ledger_of_a_real_run() -> None:
    """Every ledger row of every mode (calls, direct and backend bytes, all ranks summed) is
    what the cost model computes from the parameter shapes alone: equal, not close. Three nodes
    of two ranks: FSDP2 pads the 84-row embedding and 18-row positions to multiples of 6, and the
    gathers travel in bf16 while gradients reduce in fp32."""
    num_nodes, ranks_per_node = 3, 2
    config = replace(TRAFFIC_JOB, param_dtype="bfloat16")
    world_size = num_nodes * ranks_per_node
    record, *_ = run_distributed(_traffic_job, world_size, config,
                                 env={"ZEROPP_RANKS_PER_NODE": str(ranks_per_node)}, timeout=300)
    topology = Topology(num_nodes=num_nodes, ranks_per_node=ranks_per_node)
    for mode in config.modes:
        measured = _measured_rows(record["modes"][mode]["ledger_per_step"])
        predicted = _predicted_rows(mode, config, topology, vocab_size=84)
        assert predicted == measured, mode
    assert record["num_parameters"] == model_shape.gpt(GPTConfig(
        vocab_size=84, context_length=18, num_layers=2, num_heads=2, embed_dim=48)).num_parameters


@pytest.mark.parametrize("num_nodes,ranks_per_node", [(1, 4), (2, 2)])
def test_hpz_copy_and_backward_gathers_are_those_of_a_real_run(num_nodes: int, ranks_per_node: int) -> None:
    """hpZ over the node: on one node of 4 its partition is the whole world, where a run keeps no
    secondary copy and gathers backward from the shard (qwZ's gather quantized over the world),
    as the plan prices it; on 2 nodes of 2 it keeps the copy the plan counts (decoded for hpZ,
    codes for all three). Every ledger row and every rank's copy, equal."""
    config = replace(TRAFFIC_JOB, modes=("hpz", "all"), param_dtype="bfloat16")
    world_size = num_nodes * ranks_per_node
    record, *_ = run_distributed(_traffic_job, world_size, config,
                                 env={"ZEROPP_RANKS_PER_NODE": str(ranks_per_node)}, timeout=300)
    topology = Topology(num_nodes=num_nodes, ranks_per_node=ranks_per_node)
    shape = model_shape.gpt(GPTConfig(vocab_size=84, context_length=config.context_length,
                                      num_layers=config.num_layers, num_heads=config.num_heads,
                                      embed_dim=config.embed_dim))
    precision = traffic.Precision(gather_dtype=torch.bfloat16)
    for mode in config.modes:
        measured = record["modes"][mode]
        assert _predicted_rows(mode, config, topology, vocab_size=84) == _measured_rows(measured["ledger_per_step"])
        copy = sum(traffic.secondary_copy_bytes(u, MODES[mode].config(ranks_per_node), topology, precision)
                   for u in shape.units)
        assert measured["secondary_copy_bytes"] == [copy] * world_size, mode
        assert (copy > 0) == (num_nodes > 1)


def test_hpz_over_the_whole_world_is_priced_as_without_it() -> None:
    """On one node of 8 hpZ's partition of 8 is the primary shard: the same collectives, memory
    and step as the mode without hpZ, with or without qwZ, offloaded or not. Over the node of 2
    nodes it keeps a copy."""
    shape, workload, machine = _small_gpt(4, 256), _paper_workload(1024), scale.V100_DGX2
    both = {"quantized_weights": True, "quantized_gradients": True}
    one_node = Topology(num_nodes=1, ranks_per_node=8)
    for options in ({}, both, {**both, "quantize_intra_node_weights": True}, {"offload": "cpu"}):
        with_hpz, without = ZeroPPConfig(**options, hpz_partition_size=8), ZeroPPConfig(**options)
        assert all(traffic.secondary_copy_bytes(u, with_hpz, one_node, workload.precision) == 0 for u in shape.units)
        for price in (lambda c: traffic.step_transfers(shape, c, one_node, workload.precision),
                      lambda c: cost.memory(shape, c, one_node, workload),
                      lambda c: cost.step_time(shape, c, one_node, workload, machine)):
            assert price(with_hpz) == price(without), options
    two_nodes = Topology(num_nodes=2, ranks_per_node=4)
    assert cost.memory(shape, ZeroPPConfig(hpz_partition_size=4), two_nodes, workload).secondary_copy > 0


def test_model_shapes_of_a_gpt_and_a_hugging_face_llama() -> None:
    """Units are the blocks in order, then the root; a tied matrix is counted once."""
    gpt = model_shape.gpt(GPTConfig(vocab_size=100, context_length=32, num_layers=3, num_heads=2, embed_dim=16,
                                    tie_embeddings=True))
    assert [u.name for u in gpt.units] == ["Block"] * 3 + ["GPT (root)"]
    block = 4 * 16 * 16 + 4 * 16 + 2 * 4 * 16 * 16 + 4 * 16 + 16 + 4 * 16  # attention, MLP, two LayerNorms
    assert gpt.units[0].num_parameters == block
    assert gpt.num_parameters == 3 * block + 100 * 16 + 32 * 16 + 2 * 16
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    llama = model_shape.hf(config)
    assert [u.name for u in llama.units] == ["LlamaDecoderLayer"] * 2 + ["LlamaForCausalLM (root)"]
    with torch.device("meta"):
        reference = transformers.AutoModelForCausalLM.from_config(config)
    assert llama.num_parameters == sum(p.numel() for p in reference.parameters())


def _small_gpt(layers: int, width: int) -> model_shape.ModelShape:
    return model_shape.gpt(GPTConfig(vocab_size=84, context_length=64, num_layers=layers, num_heads=width // 64,
                                     embed_dim=width))


KNOWN = cost.Machine(name="known", ranks_per_node=2, inter_node_bytes_per_s=float("inf"),
                     intra_node_bytes_per_s=float("inf"), latency_s=1.3e-3, flops_per_s=1.1e10,
                     activation_s_per_element=2.0e-9, codec_elements_per_s=2.5e8, overlap=0.0,
                     serial_bytes_per_s=4.0e8, update_s_per_parameter=3.0e-8, backend="gloo")
"""Constants of an imaginary CPU cluster, to be recovered by the fit."""


def _synthetic_measurements(machine: cost.Machine, link_efficiency: float,
                            overlap: tuple[bool, ...] = (False,)) -> list[calibrate.Measurement]:
    """Steps priced by the cost model itself on two model sizes, every mode, three link rates;
    zeropp's modes also with ``overlap`` where ``overlap`` holds True."""
    topology = Topology(num_nodes=2, ranks_per_node=2)
    workload = cost.Workload(batch_per_rank=4, context_length=64, precision=traffic.Precision(
        gather_dtype=torch.float32, reduce_dtype=torch.float32))
    out = []
    for shape in (_small_gpt(4, 256), _small_gpt(6, 384)):
        for mode in BENCH_MODES:
            for overlapped in overlap:
                config = None if MODES[mode].system is System.HSDP else MODES[mode].config(2, overlap=overlapped)
                if config is None and overlapped:
                    continue
                for rate in (None, 125e6, 12.5e6):
                    priced = replace(machine, inter_node_bytes_per_s=float("inf") if rate is None
                                     else rate * link_efficiency)
                    step = cost.step_time(shape, config, topology, workload, priced).step_s
                    out.append(calibrate.Measurement(model=shape, config=config, workload=workload,
                                                     topology=topology, link_bytes_per_s=rate, step_s=step, label=mode))
    return out


SERIAL_COST = {"all_gather/world": 1.4, "all_gather/node": 1.6, "reduce_scatter/node": 1.1}
"""Relative costs per sent byte, as ``benchmarks/collective_rates.py`` measures them."""


@pytest.mark.parametrize("serial_cost", [{}, SERIAL_COST])
def test_calibration_recovers_known_constants(serial_cost: dict[str, float]) -> None:
    """Step times made by the cost model from known constants are fitted back to those
    constants: the grid, refined twice, resolves the two nonlinear ones to 0.2%, and the linear
    ones follow. FLOPs and elementwise work are told apart by two model sizes only, so their
    split moves by a few percent while each model's compute time stays within 0.1%. With each
    collective's relative cost per byte given, the same holds for a machine that has them."""
    measured = _synthetic_measurements(replace(KNOWN, serial_cost=serial_cost), link_efficiency=0.93)
    fitted = calibrate.fit(measured, serial_cost)
    per_flop, per_activation, *rest = fitted.coefficients
    assert rest == pytest.approx([KNOWN.latency_s, 1 / KNOWN.codec_elements_per_s, KNOWN.update_s_per_parameter],
                                 rel=1e-2)
    for shape in {m.model for m in measured}:
        workload = measured[0].workload
        true = cost.step_flops(shape, workload) / KNOWN.flops_per_s + cost.activation_elements(
            shape, workload) * KNOWN.activation_s_per_element
        found = cost.step_flops(shape, workload) * per_flop + cost.activation_elements(shape, workload) * per_activation
        assert found == pytest.approx(true, rel=1e-3)
    assert fitted.send_bytes_per_s == pytest.approx(KNOWN.serial_bytes_per_s, rel=2e-3)
    assert fitted.link_efficiency == pytest.approx(0.93, rel=2e-3)
    assert max(map(abs, fitted.relative_errors)) < 1e-3
    # the fitted machine prices a step as the fit does, with overlap too
    m = measured[-1]
    for config in (m.config, replace(m.config, overlap=True)):
        step = replace(m, config=config)
        machine = fitted.machine(m.topology, m.link_bytes_per_s)
        assert cost.step_time(m.model, config, m.topology, m.workload, machine).step_s == pytest.approx(
            fitted.predict(step), rel=1e-9)


def test_calibration_keeps_a_measured_optimizer_rate() -> None:
    """Given the optimizer's cost per parameter (measured on the host), the fit keeps it exactly
    and recovers the other constants around it; told a wrong one (half), it cannot fit the steps
    as well."""
    measured = _synthetic_measurements(KNOWN, link_efficiency=0.93)
    fitted = calibrate.fit(measured, {}, KNOWN.update_s_per_parameter)
    assert fitted.coefficients[calibrate.LINEAR.index("sharded_parameters")] == KNOWN.update_s_per_parameter
    assert fitted.coefficients[2:4] == pytest.approx([KNOWN.latency_s, 1 / KNOWN.codec_elements_per_s], rel=1e-2)
    assert max(map(abs, fitted.relative_errors)) < 1e-3
    wrong = calibrate.fit(measured, {}, KNOWN.update_s_per_parameter / 2)
    assert max(map(abs, wrong.relative_errors)) > 10 * max(map(abs, fitted.relative_errors))


def test_overlap_on_a_cpu_backend_takes_the_longer_of_cpu_and_link() -> None:
    """With ``overlap`` on gloo the step is the longer of the CPU's work and the link's time plus
    the optimizer, and the part of the shorter that does not overlap ([Note: overlap on a CPU
    backend]): with full overlap never more than the step without it, equal to it with no link
    limit (nothing to hide), and at 100 Mbit/s no less than the cross-node bytes over the link.
    The fit recovers a machine's overlap fraction from its steps with ``overlap`` to 0.01, and the
    fitted machine prices those steps as the fit does."""
    for threads_overlap in (1.0, 0.7):
        machine = replace(KNOWN, threads_overlap=threads_overlap)
        measured = _synthetic_measurements(machine, link_efficiency=1.0, overlap=(False, True))
        fitted = calibrate.fit(measured)
        assert fitted.overlap == pytest.approx(threads_overlap, abs=0.01)
        assert max(map(abs, fitted.relative_errors)) < 2e-2
        for m in measured:
            if not calibrate.overlapped(m):
                continue
            serial = fitted.predict(replace(m, config=replace(m.config, overlap=False)))
            overlapped = fitted.predict(m)
            priced = cost.step_time(m.model, m.config, m.topology, m.workload,
                                    fitted.machine(m.topology, m.link_bytes_per_s))
            assert priced.step_s == pytest.approx(overlapped, rel=1e-9)
            if threads_overlap == 1.0:
                assert overlapped <= serial * (1 + 1e-9)
                if m.link_bytes_per_s is None:
                    assert overlapped == pytest.approx(serial, rel=1e-9)
            if m.link_bytes_per_s is not None:
                transfers = [t for unit in traffic.step_transfers(m.model, m.config, m.topology,
                                                                  m.workload.precision)
                             for t in unit if not t.background]
                link_s = sum(cost.link_bytes(t, m.topology, "gloo")[1] for t in transfers) / (
                    m.link_bytes_per_s * fitted.link_efficiency)
                assert overlapped >= link_s + priced.optimizer_s - 1e-9


def test_relative_costs_change_the_step_and_come_from_the_measured_rates() -> None:
    """A machine whose all-gathers cost more per byte prices a ZeRO-3 step higher and a qwZ
    step (a quarter of the gather bytes) relatively lower; ``emulated.serial_cost`` turns the
    benchmark's rates into costs relative to the world reduce-scatter, at its largest size."""
    measured = _synthetic_measurements(KNOWN, link_efficiency=1.0)
    zero3, qwz = (next(m for m in measured if m.label == mode and m.link_bytes_per_s is None)
                  for mode in ("zero3", "qwz"))
    weighted = replace(KNOWN, serial_cost=SERIAL_COST)

    def step(m: calibrate.Measurement, machine: cost.Machine) -> float:
        return cost.step_time(m.model, m.config, m.topology, m.workload, machine).step_s

    assert step(zero3, weighted) > step(zero3, KNOWN)
    assert step(qwz, weighted) / step(zero3, weighted) < step(qwz, KNOWN) / step(zero3, KNOWN)
    rows = [{"op": op, "group": group, "output_mb": mb, "sent_mb_per_s": rate}
            for mb, scale_by in ((8, 2.0), (32, 1.0))
            for op, group, rate in (("reduce_scatter", "world", 500.0), ("all_gather", "world", 250.0),
                                    ("all_gather", "node", 200.0))
            for rate in [rate * scale_by]]
    assert emulated.serial_cost({"rows": rows}) == {"reduce_scatter/world": 1.0, "all_gather/world": 2.0,
                                                   "all_gather/node": 2.5}
    with pytest.raises(ValueError, match="reduce_scatter over the world"):
        emulated.serial_cost({"rows": rows[1:3]})


def test_calibration_refuses_what_cannot_be_fitted() -> None:
    measured = _synthetic_measurements(KNOWN, link_efficiency=1.0)
    with pytest.raises(ValueError, match="needs at least 7 measured steps without overlap"):
        calibrate.fit(measured[:3])
    with pytest.raises(ValueError, match="positive and finite"):
        calibrate.fit([replace(m, step_s=float("nan")) if i == 0 else m for i, m in enumerate(measured)])


def test_committed_step_records_read_as_measurements() -> None:
    """``zeropp bench step``'s JSON becomes one measurement per zeropp/FSDP2 mode and rate, the
    GPT rebuilt from its config with the record's parameter count (DeepSpeed left out)."""
    record = json.loads(Path("benchmarks/results/bench_step.json").read_text())
    measured = emulated.measurements(record)
    zeropp_rows = [r for r in record["records"] if r["mode"] != "deepspeed"]
    assert len(measured) == len(zeropp_rows) == 24
    quantized_hsdp = next(m for m in measured if m.label.endswith("hsdp_quantized unlimited"))
    assert quantized_hsdp.config.quantized_replica_gradients  # priced as the replicas' INT4 exchange
    assert next(m for m in measured if m.label.endswith(" hsdp unlimited")).config is None  # FSDP2's HSDP
    assert all(m.model.num_parameters == record["config"]["num_parameters"] for m in measured)
    wrong = {**record, "config": {**record["config"], "num_parameters": 1}}
    with pytest.raises(ValueError, match="another corpus"):
        emulated.measurements(wrong)


def _paper_workload(tokens: int) -> cost.Workload:
    return cost.Workload(batch_per_rank=tokens // 512, context_length=512, precision=scale.FP16,
                         activation_checkpointing=True)


def test_overlap_bounds_and_monotone_bandwidth() -> None:
    """No overlap is compute plus every collective; ideal overlap lies between the longer of
    the two and their sum; a faster link never makes a step slower."""
    shape = _small_gpt(4, 256)
    topology = Topology(num_nodes=4, ranks_per_node=4)
    workload = _paper_workload(1024)
    for mode in ("zero3", "all"):
        config = MODES[mode].config(4)
        serial = cost.step_time(shape, config, topology, workload, replace(scale.V100_DGX2, overlap=0.0))
        assert serial.step_s == pytest.approx(serial.compute_s + serial.communication_s, rel=1e-12)
        ideal = cost.step_time(shape, config, topology, workload, scale.V100_DGX2)
        assert max(ideal.compute_s, ideal.communication_s) <= ideal.step_s <= serial.step_s
        times = [cost.step_time(shape, config, topology, workload,
                                replace(scale.V100_DGX2, inter_node_bytes_per_s=gbit * cost.GBIT)).step_s
                 for gbit in (25, 100, 400, 1600)]
        assert times == sorted(times, reverse=True)


def test_paper_volume_is_three_copies_against_three_quarters() -> None:
    """At 384 V100s in fp16 ZeRO-3's node sends 3 (W - 1)/W model copies per step (two ring
    gathers and a ring reduce-scatter); all three send INT8 weights once (half a copy, plus a
    4-byte scale per 256 elements) and INT4 gradients once per remote node: the paper's 4x."""
    world = 384
    shape = scale.paper_model("18B")
    volume = scale.volume_ratio(shape, Topology(num_nodes=24, ranks_per_node=16), scale.FP16)
    assert volume["zero3_in_model_copies"] == pytest.approx(3 * (world - 1) / world, rel=1e-3)  # padding only
    weights = 0.5 * (1 + 4 / 256) * (world - 1) / world
    gradients = 0.25 * (1 + 4 / 128) * (24 - 1) / 24  # 128 bytes of 4-bit codes per 4-byte scale
    assert volume["all_in_model_copies"] == pytest.approx(weights + gradients, rel=1e-3)
    assert 3.9 < volume["ratio"] < 4.0


def test_memory_counts_the_secondary_copy_and_sharded_state() -> None:
    """Every rank holds the padded shards (4 bytes each); AdamW's two fp32 states of its unpadded
    rows; only hpZ holds secondary copies, the blocks over the node's 4 ranks in fp16 at most.
    (tests/test_scale.py checks the whole peak against FSDP2's memory tracker.)"""
    shape = _small_gpt(4, 256)
    topology = Topology(num_nodes=2, ranks_per_node=4)
    workload = _paper_workload(1024)
    zero3, hpz, every = (cost.memory(shape, MODES[mode].config(4), topology, workload)
                         for mode in ("zero3", "hpz", "all"))
    padded = sum(sum(traffic.padded_numels(u, 8)) for u in shape.units)
    rows = sum(math.prod(s[1:]) * memory.local_rows(s[0], 8, 0) for u in shape.units for s in u.shapes)
    assert zero3.parameters == every.parameters == padded / 8 * 4
    assert zero3.optimizer == every.optimizer == rows * 2 * 4
    blocks = sum(sum(traffic.padded_numels(u, 8)) for u in shape.units[:-1])
    assert zero3.secondary_copy == 0 < hpz.secondary_copy <= blocks / 4 * 2  # fp16 over the node's 4 ranks
    # with qwZ each unit's copy is 2 of the world's 8 payload rows: a byte per element and a 4-byte
    # scale per 256; each parameter's slice of a row adds at most a partial block's scale and 3 bytes
    # rounding its codes up to 4
    precision = workload.precision
    for unit in shape.units:
        plain = traffic.secondary_copy_bytes(unit, MODES["hpz"].config(4), topology, precision)
        coded = traffic.secondary_copy_bytes(unit, MODES["all"].config(4), topology, precision)
        numel = sum(traffic.padded_numels(unit, 8))
        assert plain == numel / 4 * 2
        assert numel / 4 * (1 + 4 / 256) <= coded <= numel / 4 * (1 + 4 / 256) + 2 * len(unit.shapes) * (4 + 3)
    assert 0 < every.secondary_copy <= 0.53 * hpz.secondary_copy


def test_recommend_quantizes_on_slow_links_and_not_on_fast_ones() -> None:
    shape = scale.paper_model("18B")
    topology = Topology(num_nodes=24, ranks_per_node=16)
    slow = recommend.recommend(shape, topology, _paper_workload(1024),
                               replace(scale.V100_DGX2, inter_node_bytes_per_s=0.9 * 100 * cost.GBIT))
    assert slow.choice.config is not None and slow.choice.config.quantized_gradients
    assert slow.baseline.step.step_s / slow.choice.step.step_s > 1.5
    fast = recommend.recommend(shape, topology, _paper_workload(2048),
                               replace(scale.V100_DGX2, inter_node_bytes_per_s=1e13))
    assert fast.choice.lossiness == 0, fast.reason
    assert "accuracy for nothing" in fast.reason


def test_recommend_refuses_a_model_that_fits_nowhere() -> None:
    topology = Topology(num_nodes=1, ranks_per_node=16)
    with pytest.raises(ValueError, match=r"GPT-138B does not fit on 16 GPUs of 32 GB.*needs \d+\.\d GB per GPU"):
        recommend.recommend(scale.paper_model("138B"), topology, _paper_workload(1024), scale.V100_DGX2)


@pytest.mark.parametrize("argv,message", [
    (["--gpus", "100"], "--gpus=100 must be a positive multiple of the GPUs per node \\(16\\)"),
    (["--overlap", "1.5"], "--overlap=1.5 must be between 0"),
    (["--model", "gpt:4x100"], "--model 'gpt:4x100': give gpt:LAYERSxWIDTH"),
    (["--model", "hf:/nonexistent.json"], "hf:<an existing config.json>"),
    (["--tflops", "0"], "--flops-per-s must be positive"),
    (["--calibrate", "--calibration-records", "/nonexistent.json"], "/nonexistent.json does not exist"),
])
def test_plan_command_refuses_impossible_inputs(argv: list[str], message: str, capsys) -> None:
    from zeropp.tools.cli import build_parser

    args = build_parser(["plan", *argv]).parse_args(["plan", *argv])
    assert args.func(args) == 2
    assert re.search(message, capsys.readouterr().err)


def test_plan_command_prints_every_mode(capsys) -> None:
    from zeropp.tools.cli import build_parser

    argv = ["plan", "--model", "gpt:4x256", "--gpus", "32", "--batch-per-gpu", "1"]
    args = build_parser(argv).parse_args(argv)
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert [line.split()[0] for line in out.splitlines()[2:]] == ["zero3", "hsdp", "qwz", "hpz", "qgz", "all"]
