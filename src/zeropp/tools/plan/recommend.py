"""``zeropp plan --recommend``: the configuration to train a model with on a cluster.

Every candidate (ZeRO-3, HSDP, each technique, all three with each hpZ size that divides the
node, qgZ's intra-node hop at 4 or 8 bits, 6-bit weights) is priced by the cost model; those that
do not fit in memory drop out, and the fastest of the rest wins, unless a candidate that quantizes
less is within ``ACCURACY_MARGIN`` of it: measured accuracy (docs/results.md) is worth a few percent. Among
candidates equally lossy and that close, the one that holds the least memory wins.
"""

from __future__ import annotations

from dataclasses import dataclass

from zeropp.config import ZeroPPConfig
from zeropp.setup.topology import Topology
from zeropp.tools.plan.cost import Machine, StepTime, Workload, memory, step_time
from zeropp.tools.plan.memory import RankMemory
from zeropp.tools.plan.model import ModelShape

ACCURACY_MARGIN = 0.03
"""A less lossy candidate within 3% of the fastest one's step time is preferred."""


@dataclass(frozen=True)
class Candidate:
    """One configuration, priced."""

    name: str
    config: ZeroPPConfig | None
    """None: FSDP2's HSDP."""
    lossiness: int
    """0 exact (ZeRO-3, HSDP, hpZ), 1 one quantized collective, 2 two, 3 two plus 6-bit weights."""
    step: StepTime
    memory: RankMemory


def candidate_configs(ranks_per_node: int) -> list[tuple[str, ZeroPPConfig | None, int]]:
    """(name, config, lossiness) of every configuration considered on nodes of ``ranks_per_node``."""
    node = ranks_per_node
    both = {"quantized_weights": True, "quantized_gradients": True}
    configs: list[tuple[str, ZeroPPConfig | None, int]] = [
        ("zero3", ZeroPPConfig(), 0),
        ("hsdp", None, 0),
        ("qwz", ZeroPPConfig(quantized_weights=True), 1),
        ("qgz", ZeroPPConfig(quantized_gradients=True), 1),
        ("qwz+qgz", ZeroPPConfig(**both), 2),
    ]
    for size in [s for s in range(2, node + 1) if node % s == 0]:
        configs.append((f"hpz{size}", ZeroPPConfig(hpz_partition_size=size), 0))
        configs.append((f"all (hpZ {size})", ZeroPPConfig(**both, hpz_partition_size=size), 2))
    if node > 1:
        configs.append(("all, qgZ INT8 intra-node",
                        ZeroPPConfig(**both, hpz_partition_size=node, grad_bits_intra=8), 2))
        configs.append(("all, 6-bit weights", ZeroPPConfig(**both, hpz_partition_size=node, weight_bits=6), 3))
        configs.append(("all, two-hop weight gather",
                        ZeroPPConfig(**both, hpz_partition_size=node, hierarchical_gather=True), 2))
    return configs


def price(model: ModelShape, topology: Topology, workload: Workload, machine: Machine) -> list[Candidate]:
    """Every candidate's predicted step time and memory."""
    return [Candidate(name, config, lossiness, step_time(model, config, topology, workload, machine),
                      memory(model, config, topology, workload))
            for name, config, lossiness in candidate_configs(topology.ranks_per_node)]


@dataclass(frozen=True)
class Recommendation:
    choice: Candidate
    baseline: Candidate
    """ZeRO-3, priced on the same cluster (it may not fit)."""
    ranked: list[Candidate]
    """Those that fit, fastest first."""
    reason: str


def recommend(model: ModelShape, topology: Topology, workload: Workload, machine: Machine) -> Recommendation:
    """The configuration to use, or a ``ValueError`` when none fits in ``machine.memory_bytes``."""
    priced = price(model, topology, workload, machine)
    fitting = sorted((c for c in priced if c.memory.total <= machine.memory_bytes), key=lambda c: c.step.step_s)
    if not fitting:
        least = min(priced, key=lambda c: c.memory.total)
        raise ValueError(
            f"{model.name} does not fit on {topology.world_size} GPUs of {machine.memory_bytes / 1e9:.0f} GB in any "
            f"configuration: the smallest ({least.name}) needs {least.memory.total / 1e9:.1f} GB per GPU "
            f"at its peak ({least.memory.moment}: {(least.memory.parameters + least.memory.optimizer) / 1e9:.1f} "
            f"sharded state, {least.memory.activations / 1e9:.1f} activations, "
            f"{(least.memory.gathered + least.memory.reduce_buffers) / 1e9:.1f} gathered units and comm buffers); "
            "use more GPUs"
            + (", a smaller batch per GPU" if workload.batch_per_rank > 1 else "")
            + ("" if workload.activation_checkpointing else ", or activation checkpointing"))
    fastest = fitting[0]
    choice = min((c for c in fitting if c.step.step_s <= fastest.step.step_s * (1 + ACCURACY_MARGIN)),
                 key=lambda c: (c.lossiness, c.memory.total))
    baseline = next(c for c in priced if c.name == "zero3")
    return Recommendation(choice, baseline, fitting, _reason(choice, fastest, baseline, machine, fitting))


def _reason(choice: Candidate, fastest: Candidate, baseline: Candidate, machine: Machine,
            fitting: list[Candidate]) -> str:
    step = choice.step
    parts = [f"{choice.name}: {step.step_s:.3f} s per step predicted, {baseline.step.step_s / step.step_s:.2f}x "
             f"ZeRO-3's speed; {choice.memory.total / 1e9:.1f} of {machine.memory_bytes / 1e9:.0f} GB per GPU"]
    exposed = step.exposed_s / step.step_s
    parts.append(f"communication left exposed: {exposed:.0%} of the step")
    if choice is not fastest:
        parts.append(f"{fastest.name} is {choice.step.step_s / fastest.step.step_s - 1:.1%} faster but quantizes "
                     "more; accuracy is worth that")
    if choice.lossiness == 0 and exposed < 0.05:
        parts.append("communication already hides behind compute: quantizing would cost accuracy for nothing")
    if choice.config is not None and choice.config.hpz_partition_size > 1:
        parts.append(f"hpZ's secondary copies hold {choice.memory.secondary_copy / 1e9:.1f} GB per GPU at the "
                     "step's peak")
    if choice.config is not None and choice.config.weight_bits < 8:
        parts.append(f"{choice.config.weight_bits}-bit weights: measured within 1% of ZeRO-3 on the GPT "
                     "(docs/results.md, accuracy); check on your model, or take the 8-bit candidate "
                     f"({_slowdown(choice, 'all (hpZ', fitting)})")
    if choice.config is not None and choice.config.hierarchical_gather:
        parts.append(f"hierarchical_gather: the weight gather crosses each node link once per chunk "
                     f"({_slowdown(choice, 'all (hpZ', fitting)} with the ring)")
    if choice.config is not None and (choice.config.quantized_weights or choice.config.quantized_gradients):
        parts.append(f"block size {choice.config.block_size}: its fp32 scales add {4 / choice.config.block_size:.1%} "
                     "of a byte per element; larger blocks save little of that and widen the error bound")
    return "; ".join(parts)


def _slowdown(choice: Candidate, prefix: str, fitting: list[Candidate]) -> str:
    """How much slower the fastest fitting candidate named ``prefix...`` is than ``choice``."""
    others = [c for c in fitting if c.name.startswith(prefix)]
    if not others:
        return "none fits"
    other = min(others, key=lambda c: c.step.step_s)
    return f"{other.name}: {other.step.step_s / choice.step.step_s - 1:+.0%} step time"
