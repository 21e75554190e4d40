"""One rank of a benchmark training job; ``zeropp bench comm|step`` launch it on every rank.

Run under torchrun (locally, or one torchrun per node through ``zeropp launch``)::

    python -m zeropp.tools.bench.worker --modes zero3,all --out record.json [--wire]

It builds the demo GPT once per mode (same initial weights), shards each copy the way its mode
says, and trains them in turns: warm-up steps, then timed steps (forward, backward, AdamW) on
Shakespeare, the modes interleaved step by step so a shared machine's changing load hits every
mode alike. Rank 0 writes one JSON record with, per mode: each step's time (slowest rank), the
ledger's per-step bytes of every rank, the hpZ secondary copy, and with ``--wire`` (on the
emulated cluster) what the inter-node links and every node's loopback carried, per step. Peak RSS
is per process: it belongs to a mode only when the job runs one mode.

[Note: timed window]
Each timed step runs in a window: all ranks meet (a barrier), rank 0 reads the link counters and
each node's first rank its loopback counter, the readings are gathered, the ledger is cleared,
the step runs, and the ranks meet and read again. The barrier comes before the reading: a rank
finishes its step when its own receives are done, while two other ranks may still be sending to
each other; once every rank has entered the barrier, every byte of the step has been received,
so none of it spills into the next window (which belongs to another mode). Start-up (rendezvous,
building the models, warm-up) is left out and the meetings' own bytes are a few hundred per
window, so the counter deltas are the bytes of that one training step. A rank's step time is its
own forward-to-optimizer time; the step's time is the slowest rank's.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import statistics
import time
import warnings
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

import zeropp
from zeropp.fsdp.access import unit_layout
from zeropp.fsdp.comms import CountingAllGather, CountingReduceScatter, all_gather_strings
from zeropp.fsdp.ledger import COUNTS, GroupInfo, Op
from zeropp.setup.sharding import select_units
from zeropp.techniques.hpz import keep_decoded_secondary_copies, secondary_copy_bytes
from zeropp.tools.data import CharCorpus
from zeropp.tools.models import GPT, GPTConfig
from zeropp.tools.modes import BASELINE, MODES, Mode, System, check_modes

BENCH_MODES = ("zero3", "hsdp", "qwz", "hpz", "qgz", "all")
"""The modes ``zeropp bench comm|step`` train by default (names of ``zeropp.tools.modes.MODES``, any
of which the worker accepts): ZeRO-3, FSDP2's hybrid sharding, each ZeRO++ technique, all three."""

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    """One benchmark job. Defaults: a 25.3M-parameter GPT, bf16 compute and gathers, fp32 reduce."""

    modes: tuple[str, ...] = BENCH_MODES
    """Modes to train, in turns (names of ``zeropp.tools.modes.MODES``)."""
    warmup_steps: int = 1
    """Untimed steps per mode first (lazy initialisation, allocator warm-up)."""
    steps: int = 3
    """Timed steps per mode."""
    batch_size: int = 16
    """Global batch (sequences), split evenly over the ranks."""
    context_length: int = 64
    num_layers: int = 8
    embed_dim: int = 512
    num_heads: int = 8
    param_dtype: str = "bfloat16"
    """Dtype of compute and of the weight all-gathers (FSDP2 mixed precision)."""
    reduce_dtype: str = "float32"
    """Dtype of the gradient reduction (torchtitan's default: fp32)."""
    lr: float = 3e-4
    seed: int = 0
    wire: bool = False
    """Read the emulated cluster's link counters and each node's loopback around every timed step."""
    unit_comm_calls: int = 0
    """After training, time this many calls of each comm on one transformer block's unit: the
    quantized all-gather (qwZ) and reduce-scatter (qgZ) of mode ``all`` against the plain ones
    of ``zero3`` (needs both modes)."""

    def __post_init__(self) -> None:
        check_modes(self.modes, MODES)
        for name in ("param_dtype", "reduce_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of {list(DTYPES)}")
        if self.steps < 1 or self.warmup_steps < 0:
            raise ValueError(f"steps={self.steps} must be >= 1 and warmup_steps={self.warmup_steps} >= 0")

    def worker_args(self) -> list[str]:
        """The command-line arguments of ``main`` that give this config."""
        args = []
        for name, value in asdict(self).items():
            flag = f"--{name.replace('_', '-')}"
            if isinstance(value, bool):
                args += [flag] if value else []
            else:
                args += [flag, ",".join(value) if isinstance(value, tuple) else str(value)]
        return args


def shard_hsdp(model: nn.Module, topology: zeropp.Topology, mp: MixedPrecisionPolicy,
               count_all_reduce: bool = True) -> None:
    """FSDP2 hybrid sharding: shard inside each node, replicate across nodes.

    Its all-gathers and reduce-scatters (intra-node) go through zeropp's counting comms; the
    gradient all-reduce across nodes is FSDP2's own, counted by its all-reduce hook
    (``count_all_reduce``; off when zeropp takes the all-reduce over), which sees each unit's
    reduced gradient shard: an all-reduce of B bytes over N ranks is counted as a
    reduce-scatter plus an all-gather, B/N bytes owed to each peer twice (the ledger's rule).
    """
    mesh = init_device_mesh("cpu", (topology.num_nodes, topology.ranks_per_node),
                            mesh_dim_names=("replicate", "shard"))
    replicate_ranks = dist.get_process_group_ranks(mesh.get_group("replicate"))
    replicate = GroupInfo.of(topology, replicate_ranks, dist.get_rank(), str(dist.get_backend()))
    ledger = zeropp.comm_ledger()

    def count(reduced: torch.Tensor) -> None:
        if replicate.size > 1:
            nbytes = reduced.numel() * reduced.element_size()
            ledger.record(Op.ALL_REDUCE, replicate, nbytes // replicate.size, reduced.dtype, "hsdp")

    for module in [*select_units(model, None), model]:
        fully_shard(module, mesh=mesh, reshard_after_forward=True, mp_policy=mp)
        assert isinstance(module, FSDPModule)
        module.set_custom_all_gather(CountingAllGather(topology))
        module.set_custom_reduce_scatter(CountingReduceScatter(topology))
        if count_all_reduce:
            module.set_all_reduce_hook(count)


def shard_tensor_parallel(model: GPT, topology: zeropp.Topology, mp: MixedPrecisionPolicy, degree: int) -> None:
    """Tensor parallel over ``degree`` ranks of each node (every block's MLP: ``fc`` split by
    columns, ``proj`` by rows; attention and norms replicated, as torchtitan leaves its norms),
    then FSDP2 over the data-parallel sub-mesh, one unit per block and the root: torchtitan's 2-D
    layout. Every rank of a tensor parallel group trains on the same rows
    (``Trainer.data_parallel``)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if topology.ranks_per_node % degree:
        raise ValueError(f"tensor parallel degree {degree} must divide the {topology.ranks_per_node} ranks per node")
    mesh = init_device_mesh("cpu", (topology.world_size // degree, degree), mesh_dim_names=("dp_shard", "tp"))
    for block in model.blocks:
        parallelize_module(block.mlp, mesh["tp"], {"fc": ColwiseParallel(), "proj": RowwiseParallel()})
    for module in [*select_units(model, None), model]:
        fully_shard(module, mesh=mesh["dp_shard"], reshard_after_forward=True, mp_policy=mp)


def build_model(mode: str, config: WorkerConfig, vocab_size: int, topology: zeropp.Topology) -> nn.Module:
    """The GPT (the same initial weights for every mode and rank), sharded as ``mode`` says
    (``deepspeed``: unsharded here; ``DeepSpeedTrainer`` hands it to DeepSpeed)."""
    torch.manual_seed(config.seed)
    model = GPT(GPTConfig(vocab_size=vocab_size, context_length=config.context_length,
                          num_layers=config.num_layers, num_heads=config.num_heads,
                          embed_dim=config.embed_dim))
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[config.param_dtype], reduce_dtype=DTYPES[config.reduce_dtype])
    chosen = MODES[mode]
    if chosen.system is System.DEEPSPEED:
        return model
    config = chosen.config(topology.ranks_per_node, param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype)
    if chosen.system is System.HSDP:
        shard_hsdp(model, topology, mp, count_all_reduce=not chosen.options)
        if chosen.options:
            zeropp.enable(model, config, topology=topology)
    elif chosen.tensor_parallel > 1:
        shard_tensor_parallel(model, topology, mp, chosen.tensor_parallel)
        zeropp.enable(model, config, topology=topology)
    else:
        zeropp.shard(model, config, topology=topology)
        if chosen.decoded_secondary_copy:
            keep_decoded_secondary_copies(model)
    return model


class Trainer:
    """One mode's model and optimizer, and the batch rows this rank trains on."""

    def __init__(self, model: nn.Module, corpus: CharCorpus, config: WorkerConfig, tensor_parallel: int = 1) -> None:
        self.model, self.corpus, self.config = model, corpus, config
        self.optimizer = self.build_optimizer()
        rank, num_ranks = dist.get_rank() // tensor_parallel, dist.get_world_size() // tensor_parallel
        self.rows = slice(rank * config.batch_size // num_ranks, (rank + 1) * config.batch_size // num_ranks)
        """The global batch's rows this rank's data-parallel index trains on (a tensor parallel
        group's ranks share them)."""

    def step(self, step: int) -> tuple[float, float]:
        """One training step on the global batch ``step``; this rank's time (s) and local loss."""
        x, y = self.corpus.batch_at("train", step, self.config.batch_size, self.config.context_length,
                                    self.config.seed)
        started = time.perf_counter()
        loss = self.forward_backward_step(x[self.rows], y[self.rows])
        return time.perf_counter() - started, loss.item()

    def build_optimizer(self) -> Any:
        return torch.optim.AdamW(self.model.parameters(), lr=self.config.lr, weight_decay=0.0)

    def secondary_copy_bytes(self) -> int:
        """Bytes of hpZ's secondary copy this rank holds between a unit's forward and backward."""
        return secondary_copy_bytes(self.model)

    def forward_backward_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        _, loss = self.model(x, y)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss


class InBackwardTrainer(Trainer):
    """A ``gather_ahead`` mode: the same AdamW, stepped per unit in backward, the next forward's
    gathers started there (``zeropp.optimizer_in_backward``). The step ends when those gathers
    have arrived: the modes train in turns, and bytes still on the link would slow the next
    mode's step; training on, the next forward would overlap the last of them."""

    def build_optimizer(self) -> Any:
        return zeropp.optimizer_in_backward(self.model, torch.optim.AdamW, lr=self.config.lr, weight_decay=0.0,
                                            gather_ahead=True)

    def forward_backward_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        _, loss = self.model(x, y)
        loss.backward()
        self.optimizer.wait_ahead()
        return loss


def build_trainer(mode: Mode, model: nn.Module, corpus: CharCorpus, config: WorkerConfig,
                  topology: zeropp.Topology) -> Trainer:
    """The trainer of ``mode``."""
    if mode.system is System.DEEPSPEED:
        return DeepSpeedTrainer(model, corpus, config, mode.deepspeed_options(topology.ranks_per_node))
    return (InBackwardTrainer if mode.gather_ahead else Trainer)(model, corpus, config, mode.tensor_parallel)


def deepspeed_config(config: WorkerConfig, world_size: int,
                     zero_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """DeepSpeed ZeRO-3 matching the FSDP2 modes: gathers in ``param_dtype`` (bf16 keeps fp32
    master weights in the optimizer, as FSDP2's mixed precision does), gradient reduction in
    ``reduce_dtype``; no gradient clipping (DeepSpeed clips at norm 1.0 unless told otherwise,
    which moves Adam's updates where |grad| is near eps); ``zero_options`` in
    ``zero_optimization`` (a mode's ``deepspeed_options``); everything else at DeepSpeed's defaults."""
    if config.batch_size % world_size:
        raise ValueError(f"deepspeed mode: batch_size={config.batch_size} must be a multiple of the "
                         f"world size {world_size} (DeepSpeed needs equal micro-batches)")
    return {
        "train_batch_size": config.batch_size,
        "train_micro_batch_size_per_gpu": config.batch_size // world_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 3, **(zero_options or {})},
        "bf16": {"enabled": config.param_dtype == "bfloat16"},
        "communication_data_type": {"float32": "fp32", "bfloat16": "bf16"}[config.reduce_dtype],
        "steps_per_print": 2**31 - 1,
    }


def import_deepspeed() -> Any:
    """DeepSpeed for the peer modes (DS_ACCELERATOR=cpu without CUDA). On CPU its backend would
    compile a shared-memory all-reduce at its first initialisation (a C++ build of one to three
    minutes on a small machine, then cached) that only its inference all-reduce calls; ZeRO-3's
    collectives never do, so the peer runs without it and its steps are unchanged."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    try:
        import deepspeed
        import deepspeed.ops
    except ImportError as error:
        raise RuntimeError("mode 'deepspeed' needs DeepSpeed: DS_BUILD_OPS=0 pip install "
                           "--no-build-isolation deepspeed==0.19.8") from error
    deepspeed.utils.logger.setLevel(logging.WARNING)
    if os.environ["DS_ACCELERATOR"] == "cpu":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


class DeepSpeedTrainer(Trainer):
    """DeepSpeed ZeRO-3 on the same model, optimizer and batches (DS_ACCELERATOR=cpu without CUDA;
    the process group is the one already initialised, gloo here)."""

    def __init__(self, model: nn.Module, corpus: CharCorpus, config: WorkerConfig,
                 zero_options: Mapping[str, Any] | None = None) -> None:
        deepspeed = import_deepspeed()
        super().__init__(model, corpus, config)
        self.model, self.optimizer, *_ = deepspeed.initialize(
            model=model, optimizer=self.optimizer,
            config=deepspeed_config(config, dist.get_world_size(), zero_options))
        self.held_secondary_bytes: int | None = None

    def forward_backward_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        _, loss = self.model(x, y)
        held = deepspeed_secondary_bytes(self.model.module)
        self.held_secondary_bytes = held if self.held_secondary_bytes is None else min(held, self.held_secondary_bytes)
        self.model.backward(loss)
        self.model.step()
        return loss

    def secondary_copy_bytes(self) -> int:
        """The fewest bytes of DeepSpeed's hpZ secondary partitions this rank held after any
        forward, the copy every step holds (DeepSpeed builds them as it releases each module's
        weights in forward, and drops them all at the optimizer step)."""
        return self.held_secondary_bytes or 0


def deepspeed_secondary_bytes(module: nn.Module) -> int:
    """Bytes of DeepSpeed's hpZ secondary partitions (``ds_secondary_tensor``) this rank holds now."""
    tensors = [getattr(p, "ds_secondary_tensor", None) for p in module.parameters()]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def loopback_bytes() -> int:
    """Bytes this network namespace's loopback has sent: on an emulated node, the traffic between
    its own ranks (they reach each other's address through ``lo``)."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, fields = line.partition(":")
        if name.strip() == "lo":
            return int(fields.split()[8])
    raise RuntimeError("/proc/net/dev has no 'lo' line")


def read_counters(topology: zeropp.Topology) -> dict[str, Any]:
    """What this rank reads at a window edge: rank 0 the links' bytes sent by each node, a
    node's first rank its loopback."""
    from zeropp.tools.cluster import Cluster

    rank, counters = dist.get_rank(), {}
    if rank == 0:
        cluster = Cluster.current()
        if cluster is None:
            raise RuntimeError("--wire needs the emulated cluster (run under `zeropp launch`); none is up")
        counters["links"] = {str(node): c["tx_bytes"] for node, c in cluster.link_bytes().items()}
    if topology.local_rank_of(rank) == 0:
        counters["loopback"] = loopback_bytes()
    return counters


def gather_json(value: Any) -> list[Any]:
    """Every rank's JSON-able ``value`` in rank order (also a meeting point of all ranks)."""
    return [json.loads(text) for text in all_gather_strings(json.dumps(value))]


class Window:
    """Per-step bytes of one mode, summed over its timed steps (see [Note: timed window])."""

    def __init__(self, topology: zeropp.Topology, wire: bool) -> None:
        self.topology, self.wire = topology, wire
        self.ledger_rows: dict[tuple, dict[str, int]] = defaultdict(lambda: dict.fromkeys(COUNTS, 0))
        self.links: dict[str, int] = defaultdict(int)
        self.loopback: dict[str, int] = defaultdict(int)

    def read(self) -> list[Any]:
        """Every rank's counter reading, taken once all ranks have met (see [Note: timed window])."""
        dist.barrier()
        return gather_json(read_counters(self.topology) if self.wire else None)

    def open(self) -> list[Any]:
        before = self.read()
        zeropp.comm_ledger().reset()
        return before

    def close(self, before: list[Any]) -> None:
        for row in zeropp.comm_ledger().rows():
            key = tuple(row[k] for k in ("phase", "op", "kind", "group_size", "dtype", "technique"))
            for count in COUNTS:
                self.ledger_rows[key][count] += row[count]
        after = self.read()
        if self.wire:
            for node, sent in after[0]["links"].items():
                self.links[node] += sent - before[0]["links"][node]
            for node in range(self.topology.num_nodes):
                first = node * self.topology.ranks_per_node
                self.loopback[str(node)] += after[first]["loopback"] - before[first]["loopback"]

    def ledger_per_step(self, num_steps: int) -> dict[str, Any]:
        """This rank's ledger rows and totals (overall, by op / group / technique) per step."""
        rows = [{"phase": k[0], "op": k[1], "kind": k[2], "group_size": k[3], "dtype": k[4],
                 "technique": k[5], **{c: v / num_steps for c, v in counts.items()}}
                for k, counts in sorted(self.ledger_rows.items())]
        out: dict[str, Any] = {"total": {c: sum(r[c] for r in rows) for c in COUNTS}, "rows": rows}
        for name, field in (("by_op", "op"), ("by_group", "kind"), ("by_technique", "technique")):
            out[name] = {value: {c: sum(r[c] for r in rows if r[field] == value) for c in COUNTS}
                         for value in sorted({r[field] for r in rows})}
        return out

    def wire_per_step(self, num_steps: int) -> dict[str, Any] | None:
        """Bytes each node's link sent and its loopback carried, per step (None without ``wire``)."""
        if not self.wire:
            return None
        links = {node: sent / num_steps for node, sent in self.links.items()}
        loopback = {node: sent / num_steps for node, sent in self.loopback.items()}
        return {"links_tx_bytes": links, "cross_node_bytes": sum(links.values()),
                "loopback_bytes": loopback, "intra_node_bytes": sum(loopback.values())}


def train_interleaved(trainers: dict[str, Trainer], windows: dict[str, Window],
                      config: WorkerConfig) -> dict[str, dict[str, list[float]]]:
    """Warm-up, then timed steps; each round runs one step of every mode, the order rotating by
    one each round so no mode always runs first. This rank's times and losses per mode."""
    modes = list(trainers)
    for step in range(config.warmup_steps):
        for mode in modes:
            trainers[mode].step(step)
    results = {mode: {"times": [], "losses": []} for mode in modes}
    for i in range(config.steps):
        for mode in modes[i % len(modes):] + modes[:i % len(modes)]:
            before = windows[mode].open()
            seconds, loss = trainers[mode].step(config.warmup_steps + i)
            windows[mode].close(before)
            results[mode]["times"].append(seconds)
            results[mode]["losses"].append(loss)
    return results


def run(config: WorkerConfig) -> dict[str, Any] | None:
    """Train and measure on this rank; rank 0 returns the record, the others None."""
    topology = zeropp.Topology.from_env()
    corpus = CharCorpus.shakespeare()
    models = {mode: build_model(mode, config, corpus.vocab_size, topology) for mode in config.modes}
    trainers = {mode: build_trainer(MODES[mode], model, corpus, config, topology) for mode, model in models.items()}
    windows = {mode: Window(topology, config.wire) for mode in config.modes}
    results = train_interleaved(trainers, windows, config)
    unit_comms = time_unit_comms(models, config.unit_comm_calls) if config.unit_comm_calls else None
    mine = {mode: {**results[mode], "ledger": windows[mode].ledger_per_step(config.steps),
                   "secondary_copy_bytes": trainers[mode].secondary_copy_bytes()} for mode in config.modes}
    ranks = gather_json({"modes": mine, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})
    if dist.get_rank() != 0:
        return None
    return {
        "config": asdict(config),
        "topology": {"num_nodes": topology.num_nodes, "ranks_per_node": topology.ranks_per_node,
                     "world_size": topology.world_size},
        "num_parameters": sum(p.numel() for p in next(iter(models.values())).parameters()),
        "unit_comms": unit_comms,
        "peak_rss_mb": [r["peak_rss_mb"] for r in ranks],
        "modes": {mode: mode_record(mode, [r["modes"][mode] for r in ranks], windows[mode], config.steps)
                  for mode in config.modes},
    }


def time_unit_comms(models: dict[str, nn.Module], calls: int) -> dict[str, Any]:
    """Median time (slowest rank) of one call of each comm of the first transformer block's unit
    (the root's where the blocks are not units of their own):
    ``all``'s quantized all-gather (qwZ, world group) and two-hop reduce-scatter (qgZ) against
    ``zero3``'s plain ones, on the same unit, sizes and dtypes, the four calls interleaved."""
    if not {"all", BASELINE} <= models.keys():
        raise ValueError(f"timing the unit comms needs modes 'all' and {BASELINE!r}; got {sorted(models)}")
    world, world_size = dist.group.WORLD, dist.get_world_size()
    units = {mode: [m for m in models[mode].modules() if isinstance(m, FSDPModule)] for mode in ("all", BASELINE)}
    unit_index = 1 if len(units["all"]) > 1 else 0  # modules() order: the root, then the first block
    comms = {mode: zeropp.sharded_comms(models[mode]) for mode in units}
    layout = unit_layout(units["all"][unit_index])
    chunk = sum(layout.padded_numels) // world_size
    gather_dtype, reduce_dtype = layout.gather_dtypes[0], torch.float32
    generator = torch.Generator().manual_seed(dist.get_rank())
    shard = torch.randn(chunk, generator=generator).to(gather_dtype)
    gradient = torch.randn(chunk * world_size, generator=generator)
    gathered = torch.empty(chunk * world_size, dtype=gather_dtype)
    reduced = torch.empty(chunk, dtype=reduce_dtype)
    calls_of = {
        "qwz_all_gather": lambda: comms["all"].all_gathers[unit_index](gathered, shard, world),
        "plain_all_gather": lambda: comms[BASELINE].all_gathers[unit_index](gathered, shard, world),
        "qgz_reduce_scatter": lambda: comms["all"].reduce_scatters[unit_index](
            reduced, gradient, world, dist.ReduceOp.AVG),
        "plain_reduce_scatter": lambda: comms[BASELINE].reduce_scatters[unit_index](
            reduced, gradient, world, dist.ReduceOp.AVG),
    }
    times: dict[str, list[float]] = {name: [] for name in calls_of}
    with zeropp.comm_ledger().suspended():
        for _ in range(calls + 1):  # the first round warms up
            for name, call in calls_of.items():
                dist.barrier()
                started = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - started)
    per_rank = gather_json({name: values[1:] for name, values in times.items()})
    medians = {name: statistics.median(max(r[name][i] for r in per_rank) for i in range(calls))
               for name in calls_of}
    return {"unit": f"{type(units['all'][unit_index]).__name__} #{unit_index}", "parameters": len(layout.names),
            "chunk_numel": chunk, "gather_dtype": str(gather_dtype).removeprefix("torch."),
            "reduce_dtype": str(reduce_dtype).removeprefix("torch."), "calls": calls,
            "median_s": medians,
            "all_gather_ratio": medians["qwz_all_gather"] / medians["plain_all_gather"],
            "reduce_scatter_ratio": medians["qgz_reduce_scatter"] / medians["plain_reduce_scatter"]}


def mode_record(mode: str, ranks: list[dict[str, Any]], window: Window, num_steps: int) -> dict[str, Any]:
    """One mode's results from every rank's (``window``: rank 0's, which holds the counters)."""
    step_times = [max(r["times"][i] for r in ranks) for i in range(num_steps)]
    return {
        "mode": mode,
        "step_times_s": step_times,
        "median_step_s": statistics.median(step_times),
        "losses": [statistics.fmean(r["losses"][i] for r in ranks) for i in range(num_steps)],
        "ledger_per_step": None if MODES[mode].system is System.DEEPSPEED else [r["ledger"] for r in ranks],
        "secondary_copy_bytes": [r["secondary_copy_bytes"] for r in ranks],
        "wire_per_step": window.wire_per_step(num_steps),
    }


def build_parser() -> argparse.ArgumentParser:
    """``--out`` and one flag per ``WorkerConfig`` field (``--modes zero3,all``, ``--wire``)."""
    parser = argparse.ArgumentParser(description="zeropp benchmark training job (run under torchrun)")
    parser.add_argument("--out", type=Path, required=True, help="where rank 0 writes the JSON record")
    for name, default in asdict(WorkerConfig()).items():
        flag = f"--{name.replace('_', '-')}"
        if isinstance(default, bool):
            parser.add_argument(flag, action="store_true")
        elif isinstance(default, tuple):
            parser.add_argument(flag, type=lambda text: tuple(text.split(",")), default=default)
        else:
            parser.add_argument(flag, type=type(default), default=default)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = vars(build_parser().parse_args(argv))
    out = args.pop("out")
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    dist.init_process_group("gloo")
    try:
        record = run(WorkerConfig(**args))
        if record is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(record, indent=2) + "\n")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
