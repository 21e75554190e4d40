"""Pipeline parallel x FSDP in the plan: torchtitan's layout for the largest dense models, each
pipeline stage's units sharded by FSDP2 (with zeropp's qwZ and qgZ) over the stage's ranks.

[Note: pipeline parallel in the plan]
With W = N x D ranks and pipeline degree p, torchtitan puts ``pp`` outermost: stage s is the W / p
consecutive ranks s W / p ... (s + 1) W / p - 1, so where D divides W / p each stage holds whole
nodes and its FSDP group is a 1-D layout of W / (p D) nodes x D ranks of its own (qwZ's rings and
qgZ's two hops stay on the stage's nodes). The stages hold the blocks in order, split as evenly
as they go (the first stages one more where p does not divide them), the embedding on the
first, the final norm and head on the last. The global batch is what the 1-D layout trains
(W x ``Workload.batch_per_rank`` sequences): each of the W / p data-parallel ranks of a stage runs
p x that many, as microbatches of ``microbatch_size`` (torchtitan's default, 1) through a 1F1B
schedule, so a rank computes as many FLOPs as a 1-D rank.

Per step, torchtitan keeps a stage's units whole from their first forward to the last backward
(its reshard policy under pipeline parallel), so each unit is gathered once, before the first
microbatch's forward (prefetched one unit ahead, [Note: overlap]), and reduce-scattered once,
after the last microbatch's backward, when the schedule reduces; nothing is gathered in
backward, and hpZ, which serves backward's gathers, has nothing to serve (refused, [Note: hpZ
under pipeline parallelism] in ``zeropp.setup.plan``). Between microbatches FSDP2 accumulates
the unsharded gradients in the reduce dtype, so a rank holds its stage's weights whole in the
gather dtype and their gradients whole in the reduce dtype through the step, besides the
activations of the microbatches in flight (1F1B: p - s on stage s). zeropp's presence exchange
does not run (the schedule reduces outside autograd).

Time: each microbatch's forward and backward on a stage take the stage's compute over the
microbatches, and send its activations (forward) and their gradients (backward) to the next and
previous stage: ``mb x context x width`` elements in the gather dtype from each rank, all D ranks of a
node at once over its link, beside the other microbatches' compute (``Machine.overlap``). The
schedule takes (m + p - 1) forward and backward slots for m microbatches (the 1F1B bubble). A
stage's first gathers delay its first microbatch, and each stage's in turn delays the pipeline's
warm-up; stage s finishes its last backward s backward slots before stage 0, then reduces; the
step ends when the last reduction does, then the optimizer steps. Priced for NCCL with streams;
the emulated cluster's gloo is not calibrated for it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from zeropp.config import ZeroPPConfig
from zeropp.fsdp.ledger import Op
from zeropp.setup.topology import Topology
from zeropp.tools.modes import MODES, System
from zeropp.tools.plan.cost import (
    GBIT,
    Machine,
    Workload,
    cross_node_bytes_per_node,
    sharded_parameters,
    transfer_seconds,
    unit_compute_s,
)
from zeropp.tools.plan.layout import Layout
from zeropp.tools.plan.memory import PARAMETER_BYTES, unit_bytes
from zeropp.tools.plan.model import ModelShape, UnitShape
from zeropp.tools.plan.traffic import Transfer, padded_numels, step_transfers

STATE_BYTES = 4 * PARAMETER_BYTES
"""Bytes per sharded parameter besides the gathered copies: the shard, its gradient, AdamW's two states."""


def stage_models(model: ModelShape, degree: int) -> list[ModelShape]:
    """``model``'s stages under pipeline degree ``degree`` ([Note: pipeline parallel in the plan]):
    consecutive blocks, the embedding (the first parameter with a row per vocabulary entry outside
    the blocks) on the first, the other parameters outside the blocks on the last."""
    blocks = [unit for unit in model.units if unit.is_block]
    if degree > len(blocks):
        raise ValueError(f"pipeline degree {degree} is more than {model.name}'s {len(blocks)} blocks")
    rest = [(shape, trainable) for unit in model.units if not unit.is_block
            for shape, trainable in zip(unit.shapes, unit.trainable)]
    first = next((i for i, (shape, _) in enumerate(rest) if shape[0] == model.vocab_size), None)
    embedding = [rest[first]] if first is not None else []
    head = [item for i, item in enumerate(rest) if i != first]
    sizes = [len(blocks) // degree + (s < len(blocks) % degree) for s in range(degree)]
    stages, start = [], 0
    for s, size in enumerate(sizes):
        units = list(blocks[start:start + size])
        start += size
        extra = (embedding if s == 0 else []) + (head if s == degree - 1 else [])
        if extra:
            units.append(UnitShape(f"stage {s} rest", tuple(shape for shape, _ in extra),
                                   tuple(t for _, t in extra), is_block=False))
        stages.append(dataclasses.replace(model, name=f"{model.name} stage {s}", units=tuple(units), num_layers=size,
                                          num_trainable_scalars=0))
    return stages


def stage_topology(topology: Topology, degree: int) -> Topology:
    """The nodes one stage holds: W / p ranks, whole nodes of ``topology``."""
    world, per_node = topology.world_size, topology.ranks_per_node
    if degree < 1 or world % degree or (world // degree) % per_node:
        raise ValueError(f"pipeline degree {degree} must divide the {world} ranks into stages of whole nodes "
                         f"({per_node} ranks each): choose a degree dividing {topology.num_nodes}")
    return Topology(num_nodes=world // degree // per_node, ranks_per_node=per_node)


@dataclasses.dataclass(frozen=True)
class PipelineStep:
    """A pipeline parallel step's predicted time (seconds, per rank) and its largest stage's memory."""

    step_s: float
    compute_s: float
    """Each rank's forward and backward over all its microbatches (the largest stage's)."""
    bubble_s: float
    """The 1F1B schedule's idle slots, (p - 1) of each pass."""
    gathers_s: float
    """The stages' first gathers the warm-up waits for."""
    reduce_s: float
    """What the step waits for after the last backward: the last stage's reductions to finish."""
    sends_s: float
    """One microbatch's activations between stages, forward and backward, as if nothing overlapped."""
    optimizer_s: float
    cross_node_bytes_per_node: float
    """Per step, the busiest node: its stage's FSDP2 collectives and its activations' sends."""
    memory: dict[str, float]
    """The peak stage's bytes: sharded state, whole weights, whole gradients, activations, total."""


def _stage_transfers(stage: ModelShape, config: ZeroPPConfig, topology: Topology, workload: Workload
                     ) -> list[list[Transfer]]:
    """Each unit's collectives in one step of a stage: the forward gather and the reduce-scatter."""
    return [[t for t in unit if not (t.op is Op.ALL_GATHER and t.phase == "backward") and t.technique != "presence"]
            for unit in step_transfers(stage, config, topology, workload.precision, Layout())]


def _stage_memory(stage: ModelShape, config: ZeroPPConfig, topology: Topology, workload: Workload,
                  microbatch: int, in_flight: int, last: bool) -> dict[str, float]:
    precision = workload.precision
    units = [unit_bytes(unit, stage, config, topology, precision, 0, (microbatch, workload.context_length),
                        last and i == len(stage.units) - 1, workload.activation_checkpointing, Layout())
             for i, unit in enumerate(stage.units)]
    numels = [sum(padded_numels(unit, topology.world_size)) for unit in stage.units]
    state = sum(n / topology.world_size for n in numels) * STATE_BYTES
    weights = sum(u.whole for u in units) + max(u.gather_forward for u in units)
    gradients = sum(n * precision.reduce_dtype.itemsize for n in numels) + max(u.reduce_input for u in units)
    activations = (in_flight * sum(u.activations for u in units) + max(u.recompute for u in units)
                   + max(u.loss + u.loss_gradients for u in units))
    return {"sharded_state": state, "weights": weights, "gradients": gradients, "activations": activations,
            "total": state + weights + gradients + activations}


def pipeline_step(model: ModelShape, config: ZeroPPConfig | None, topology: Topology, workload: Workload,
                  machine: Machine, degree: int, microbatch_size: int = 1) -> PipelineStep:
    """One step of ``model`` under pipeline degree ``degree`` x FSDP on each stage ([Note:
    pipeline parallel in the plan]); ``config`` None for torchtitan's own FSDP2."""
    config = config if config is not None else ZeroPPConfig()
    if config.hpz_partition_size > 1:
        raise ValueError(f"hpz_partition_size={config.hpz_partition_size} under pipeline parallel: a stage keeps its "
                         "units whole from forward to backward, so hpZ has no gather to serve; set it to 1")
    sequences = degree * workload.batch_per_rank
    if microbatch_size < 1 or sequences % microbatch_size:
        raise ValueError(f"microbatch size {microbatch_size} must divide the {sequences} sequences each stage rank "
                         f"trains per step ({degree} stages x {workload.batch_per_rank} per GPU)")
    group, stages = stage_topology(topology, degree), stage_models(model, degree)
    microbatches = sequences // microbatch_size
    work = dataclasses.replace(workload, batch_per_rank=sequences)
    forward_share = (1 / 4) if workload.activation_checkpointing else (1 / 3)
    computes = [unit_compute_s(stage, work, machine) for stage in stages]
    transfers = [_stage_transfers(stage, config, group, workload) for stage in stages]
    activation = microbatch_size * workload.context_length * model.embed_dim * workload.precision.gather_dtype.itemsize
    per_node = topology.ranks_per_node * activation
    send = machine.latency_s + per_node / machine.inter_node_bytes_per_s if degree > 1 else 0.0

    def slot(work_s: float, hidden_s: float) -> float:
        return max(work_s, hidden_s) + (1 - machine.overlap) * min(work_s, hidden_s)

    longest = max(sum(c) for c in computes) / microbatches
    forward_slot, backward_slot = slot(longest * forward_share, send), slot(longest * (1 - forward_share), send)
    pipe = (microbatches + degree - 1) * (forward_slot + backward_slot)
    gathers = 0.0
    for compute, unit_transfers in zip(computes, transfers):  # the warm-up's first microbatch meets each stage's
        gather = [sum(transfer_seconds(t, group, machine) for t in unit if t.op is Op.ALL_GATHER)
                  for unit in unit_transfers]
        forward = [c * forward_share / microbatches for c in compute]
        ahead = [slot(f, gather[i + 1] if i + 1 < len(gather) else 0.0) for i, f in enumerate(forward)]
        gathers += gather[0] + sum(ahead) - sum(forward)
    reduces = [sum(transfer_seconds(t, group, machine) for unit in unit_transfers for t in unit
                   if t.op is not Op.ALL_GATHER) for unit_transfers in transfers]
    finish = max(pipe - s * backward_slot + reduce for s, reduce in enumerate(reduces))
    optimizer = (max(sharded_parameters(stage, config, group, Layout()) for stage in stages)
                 * machine.update_s_per_parameter)
    sends = [activation * microbatches * topology.ranks_per_node * ((s > 0) + (s < degree - 1)) for s in range(degree)]
    cross = max(cross_node_bytes_per_node([t for unit in unit_transfers for t in unit], group, machine.backend)
                + sent for unit_transfers, sent in zip(transfers, sends))
    memories = [_stage_memory(stage, config, group, workload, microbatch_size, degree - s, s == degree - 1)
                for s, stage in enumerate(stages)]
    return PipelineStep(step_s=gathers + finish + optimizer, compute_s=longest * microbatches,
                        bubble_s=(degree - 1) * (forward_slot + backward_slot), gathers_s=gathers,
                        reduce_s=finish - pipe, sends_s=2 * send, optimizer_s=optimizer,
                        cross_node_bytes_per_node=cross, memory=max(memories, key=lambda m: m["total"]))


def pipeline_record(model: ModelShape, topology: Topology, workload: Workload, machine: Machine,
                    modes: tuple[str, ...], degree: int, microbatch_size: int = 1) -> dict[str, Any]:
    """Every mode that can run on a stage (1-D zeropp modes without hpZ), priced under pipeline
    degree ``degree``, beside 1-D ZeRO-3 (``degree`` 1's layout) on the same cluster and batch."""
    from zeropp.tools.plan.cost import step_time

    kept = [m for m in modes if MODES[m].system is System.ZEROPP and not MODES[m].hpz
            and MODES[m].tensor_parallel == 1]
    if "zero3" not in kept:
        kept.insert(0, "zero3")
    rows = []
    for name in kept:
        step = pipeline_step(model, MODES[name].config(topology.ranks_per_node), topology, workload, machine, degree,
                             microbatch_size)
        rows.append({"mode": name, **dataclasses.asdict(step)})
    base = rows[0]["step_s"]
    flat = step_time(model, MODES["zero3"].config(topology.ranks_per_node), topology, workload, machine, Layout())
    for row in rows:
        row["speedup_vs_zero3"] = base / row["step_s"]
        row["speedup_vs_one_dimensional_zero3"] = flat.step_s / row["step_s"]
    return {"model": model.name, "num_parameters": model.num_parameters, "gpus": topology.world_size,
            "num_nodes": topology.num_nodes, "gpus_per_node": topology.ranks_per_node, "machine": machine.name,
            "inter_node_gbit": machine.inter_node_bytes_per_s / GBIT, "pipeline_parallel": degree,
            "microbatch_size": microbatch_size, "microbatches": degree * workload.batch_per_rank // microbatch_size,
            "batch_per_gpu": workload.batch_per_rank, "context": workload.context_length,
            "activation_checkpointing": workload.activation_checkpointing,
            "one_dimensional_zero3_step_s": flat.step_s,
            "left_out": [m for m in modes if m not in kept], "modes": rows}


def format_pipeline(record: dict[str, Any]) -> str:
    """The table ``zeropp plan --pipeline-parallel`` prints."""
    head = (f"{record['model']}: {record['num_parameters'] / 1e9:.2f}B parameters on {record['gpus']} GPUs "
            f"({record['num_nodes']} nodes x {record['gpus_per_node']}), {record['machine']}; pipeline "
            f"{record['pipeline_parallel']} x FSDP {record['gpus'] // record['pipeline_parallel']}, "
            f"{record['microbatches']} microbatches of {record['microbatch_size']} (1F1B); 1-D ZeRO-3 "
            f"{record['one_dimensional_zero3_step_s']:.3f} s")
    lines = [head, f"{'mode':<9}{'step s':>9}{'x zero3':>8}{'x 1-D':>7}{'compute s':>10}{'bubble s':>9}"
                   f"{'gathers s':>10}{'reduce s':>9}{'x-node GB/node':>15}{'memory GB':>10}"]
    for row in record["modes"]:
        lines.append(f"{row['mode']:<9}{row['step_s']:>9.3f}{row['speedup_vs_zero3']:>8.2f}"
                     f"{row['speedup_vs_one_dimensional_zero3']:>7.2f}{row['compute_s']:>10.3f}{row['bubble_s']:>9.3f}"
                     f"{row['gathers_s']:>10.3f}{row['reduce_s']:>9.3f}"
                     f"{row['cross_node_bytes_per_node'] / 1e9:>15.2f}{row['memory']['total'] / 1e9:>10.1f}")
    if record["left_out"]:
        lines.append(f"not priced under pipeline parallel: {', '.join(record['left_out'])} (hpZ, HSDP, tensor "
                     "parallel, DeepSpeed)")
    return "\n".join(lines)

