"""``zeropp bench layouts``: step time and cross-node bytes of torchtitan's expert parallel and
pipeline parallel layouts on the emulated cluster, torchtitan's own FSDP2 beside zeropp's qwZ + qgZ
on the same layout, model, batches and ranks.

Each layout is one job of torchtitan's own model, config, parallelize and pipelining functions
(``python -m zeropp.tools.bench.layouts --layout ep``), both systems built in it and trained in
turns, step by step, in the windows of ``zeropp bench step`` ([Note: timed window]):

- ``ep``: the qwen3 MoE debug model cut to 2 blocks of 8 routed experts (top 2; the debug config's
  64 experts make 80M parameters, minutes a step at 100 Mbit/s), expert parallel 2 on 2 nodes x 2
  ranks. Expert parallel is inside a node (``ep`` = {0, 1}, {2, 3}), so the token exchanges stay
  there; the experts are sharded across the nodes (``efsdp`` = {0, 2}, {1, 3}), the rest of each block
  over all four ranks. hpZ is left out: a node holds one rank of each expert group.
- ``pp``: the llama3 debug model, pipeline 2 x FSDP 2 on 4 nodes of one rank, schedule 1F1B with
  4 microbatches: each stage's FSDP group spans two nodes (as a 70B job's 16-rank stages span two
  8-GPU nodes), and the stages' activations cross between nodes too. hpZ is refused on a stage.

Both run fp32 on CPU (SDPA attention) with AdamW. The wire counts everything that crosses the
links, the token exchanges and the pipeline's sends included; zeropp's ledger says what of it is
whose (torchtitan's token exchanges under ``ep_tokens``; the pipeline's sends are not counted).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import zeropp
from zeropp.tools.bench.comm import exclusive_cluster, launch_job
from zeropp.tools.bench.quant import _machine as machine_info
from zeropp.tools.bench.worker import Window, gather_json

BASELINE = "torchtitan"
SYSTEMS: dict[str, zeropp.ZeroPPConfig | None] = {
    BASELINE: None,  # torchtitan's own parallelize: FSDP2's collectives
    "qwz_qgz": zeropp.ZeroPPConfig(quantized_weights=True, quantized_gradients=True),
}
"""What trains each layout: torchtitan alone, or with zeropp's qwZ and qgZ (``with_zeropp``)."""


@dataclasses.dataclass(frozen=True)
class Layout:
    """One torchtitan layout of the benchmark."""

    module: str
    config: str
    num_nodes: int
    ranks_per_node: int
    arguments: tuple[str, ...]
    """torchtitan command-line options that set the layout."""
    num_layers: int | None = None
    """Keep the first this many blocks (None: all)."""
    num_experts: int | None = None
    top_k: int | None = None


LAYOUTS = {
    "ep": Layout("qwen3", "qwen3_moe_debug", 2, 2, ("--parallelism.expert_parallel_degree", "2"),
                 num_layers=2, num_experts=8, top_k=2),
    "pp": Layout("llama3", "llama3_debugmodel", 4, 1,
                 ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B")),
}
BANDWIDTHS = ("unlimited", "100mbit")
LOCAL_BATCH, SEQ_LEN = 4, 64
"""Per data-parallel rank: 4 sequences of 64 tokens (under pipeline parallel, 4 microbatches of one)."""


def with_experts(moe: Any, num_experts: int, top_k: int) -> Any:
    """An MoE layer's config with ``num_experts`` routed experts, ``top_k`` per token."""
    routed, router = moe.routed_experts, moe.router
    routed = dataclasses.replace(
        routed, inner_experts=dataclasses.replace(routed.inner_experts, num_experts=num_experts),
        token_dispatcher=dataclasses.replace(routed.token_dispatcher, num_experts=num_experts, top_k=top_k))
    router = dataclasses.replace(router, num_experts=num_experts, top_k=top_k,
                                 gate=dataclasses.replace(router.gate, out_features=num_experts))
    return dataclasses.replace(moe, num_experts=num_experts, routed_experts=routed, router=router)


def trainer_config(layout: Layout, config: zeropp.ZeroPPConfig | None) -> Any:
    """torchtitan's config of ``layout``, loaded as its command line loads it, fp32 with SDPA
    attention on CPU; with zeropp's parallelize function (``config``) or torchtitan's own (None)."""
    from torchtitan.config import ConfigManager
    from torchtitan.models.common.attention import ScaledDotProductAttention

    from zeropp.integrations.torchtitan import SPMD_BACKEND, with_zeropp

    loaded = ConfigManager().parse_args(
        ["--module", layout.module, "--config", layout.config, "--training.mixed_precision_param", "float32",
         "--training.seq_len", str(SEQ_LEN), "--training.local_batch_size", str(LOCAL_BATCH),
         "--training.disable_cuda_graphs", "--parallelism.spmd_backend", SPMD_BACKEND, *layout.arguments])
    model = loaded.model_spec.model
    model.layers = model.layers[:layout.num_layers]
    for i, layer in enumerate(model.layers):
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        if layout.num_experts is not None and getattr(layer, "moe", None) is not None:
            model.layers[i] = dataclasses.replace(layer, moe=with_experts(layer.moe, layout.num_experts,
                                                                            layout.top_k))
    return loaded if config is None else with_zeropp(loaded, config)


class _Loss:
    """torchtitan's loss: the sum over the tokens over the global token count (returned with
    None as a pipeline schedule's loss function returns it)."""

    def __init__(self, global_tokens: int) -> None:
        self.global_tokens = global_tokens

    def __call__(self, pred: torch.Tensor, labels: torch.Tensor, **kwargs: object) -> tuple[torch.Tensor, None]:
        from torchtitan.components.loss import cross_entropy_loss  # the sum; vocabulary-parallel under TP

        return cross_entropy_loss(pred, labels) / self.global_tokens, None


def _force_sum(parts: Sequence[torch.nn.Module]) -> None:
    """torchtitan asks FSDP2 for PREMUL_SUM(1.0), which gloo cannot run; forced sums ask for SUM
    (the same sums: torchtitan's plain FSDP2 on gloo)."""
    from torch.distributed.fsdp import FSDPModule

    for part in parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)


def build_parts(loaded: Any, loss_fn: Callable | None = None) -> tuple[Any, Any, list[torch.nn.Module], bool, bool]:
    """What torchtitan's Trainer does to get its model on this process group (trainer.py): the
    meta model, cut into stages by the model spec's pipelining function under pipeline parallel
    (its schedule calling ``loss_fn``), each part parallelized, moved to the CPU and initialised
    from seed 0. Returns the parallel dims, the schedule (None without pipeline parallel), the
    parts, and whether they hold the first and the last stage."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    dist_utils.set_spmd_backend(loaded.parallelism.spmd_backend)
    parallel_dims_module.device_type = "cpu"  # torchtitan's meshes default to CUDA
    parallel_dims = ParallelDims.from_config(loaded.parallelism, dist.get_world_size())
    spec, model_config = loaded.model_spec, loaded.model_spec.model
    model_config.update_from_config(config=loaded)
    with torch.device("meta"):
        model = model_config.build()
    options = dict(parallel_dims=parallel_dims, training=loaded.training, parallelism=loaded.parallelism,
                   compile_config=loaded.compile, ac_config=loaded.activation_checkpoint,
                   dump_folder=loaded.dump_folder)
    if parallel_dims.pp_enabled:
        schedule, parts, first, last = spec.pipelining_fn(
            model, **options, device=torch.device("cpu"), model_config=model_config,
            parallelize_fn=spec.parallelize_fn, loss_fn=loss_fn)
    else:
        schedule, parts, first, last = None, [spec.parallelize_fn(model, **options)], True, True
    torch.manual_seed(0)
    for part in parts:
        part.to_empty(device="cpu")
        with torch.no_grad():
            part.init_weights(buffer_device=None)
        part.train()
    return parallel_dims, schedule, parts, first, last


def build(layout: Layout, config: zeropp.ZeroPPConfig | None) -> tuple[Callable[[int], float], list[torch.nn.Module]]:
    """``layout``'s model built, sharded and initialised as torchtitan's Trainer does it, and a
    training step (forward and backward, through the pipeline schedule under pipeline parallel,
    then AdamW): step(i) trains on batch i and returns this rank's share of the global loss."""
    loaded = trainer_config(layout, config)
    pipeline = loaded.parallelism.pipeline_parallel_degree
    batches = dist.get_world_size() // pipeline
    loss = _Loss(batches * LOCAL_BATCH * SEQ_LEN)
    parallel_dims, schedule, parts, first, last = build_parts(loaded, loss)
    batch = parallel_dims.get_mesh("fsdp").get_local_rank() if schedule is not None else dist.get_rank()
    if config is None:
        _force_sum(parts)
    optimizers = loaded.optimizer.build(model_parts=parts)
    vocab = loaded.model_spec.model.vocab_size

    def step(index: int) -> float:
        tokens = torch.randint(0, vocab, (batches, LOCAL_BATCH, SEQ_LEN + 1),
                               generator=torch.Generator().manual_seed(index))[batch]
        if schedule is None:
            value = loss(parts[0](tokens[:, :-1]), tokens[:, 1:])[0]
            value.backward()
        else:
            losses: list[torch.Tensor] = []
            schedule.step(*((tokens[:, :-1],) if first else ()), target=tokens[:, 1:] if last else None,
                          losses=losses if last else None, return_outputs=False)
            value = torch.stack(losses).sum() if last else torch.zeros(())
        optimizers.step()
        optimizers.zero_grad()
        return value.item()

    return step, parts


def measure(layout_name: str, steps: int, warmup_steps: int, wire: bool) -> dict[str, Any] | None:
    """Both systems on this rank, trained in turns; rank 0 returns the record, the others None."""
    layout, topology = LAYOUTS[layout_name], zeropp.Topology.from_env()
    built = {name: build(layout, config) for name, config in SYSTEMS.items()}
    windows = {name: Window(topology, wire) for name in SYSTEMS}
    times: dict[str, list[float]] = {name: [] for name in SYSTEMS}
    losses: dict[str, list[float]] = {name: [] for name in SYSTEMS}
    names = list(SYSTEMS)
    for i in range(warmup_steps):
        for name in names:
            built[name][0](i)
    for i in range(steps):
        for name in names[i % 2:] + names[:i % 2]:  # neither system always first
            before = windows[name].open()
            started = time.perf_counter()
            losses[name].append(built[name][0](warmup_steps + i))
            times[name].append(time.perf_counter() - started)
            windows[name].close(before)
    ranks = gather_json({name: {"times": times[name], "losses": losses[name],
                                "ledger": windows[name].ledger_per_step(steps)} for name in SYSTEMS})
    if dist.get_rank() != 0:
        return None
    systems = {}
    for name in SYSTEMS:
        step_times = [max(r[name]["times"][i] for r in ranks) for i in range(steps)]
        ledger = [r[name]["ledger"] for r in ranks]
        systems[name] = {
            "step_times_s": step_times, "median_step_s": statistics.median(step_times),
            "losses": [sum(r[name]["losses"][i] for r in ranks) for i in range(steps)],
            "ledger_cross_node_bytes": {technique: sum(r["by_technique"].get(technique, {}).get("cross_node_bytes", 0)
                                                       for r in ledger)
                                        for technique in sorted({t for r in ledger for t in r["by_technique"]})},
            "wire_per_step": windows[name].wire_per_step(steps)}
    parts = built[BASELINE][1]
    return {"layout": layout_name, "definition": dataclasses.asdict(layout),
            "topology": {"num_nodes": topology.num_nodes, "ranks_per_node": topology.ranks_per_node},
            "num_parameters_rank0": sum(p.numel() for part in parts for p in part.parameters()),
            "steps": steps, "warmup_steps": warmup_steps, "systems": systems}


def rows_of(record: dict[str, Any], bandwidth: str) -> list[dict[str, Any]]:
    """The table's rows of one job: each system's median step and cross-node MB per step (the
    wire), against torchtitan's in the same job."""
    systems, rows = record["systems"], []
    base = systems[BASELINE]
    for name, measured in systems.items():
        wire = measured["wire_per_step"]
        cross = None if wire is None else wire["cross_node_bytes"]
        base_cross = None if base["wire_per_step"] is None else base["wire_per_step"]["cross_node_bytes"]
        rows.append({"layout": record["layout"], "bandwidth": bandwidth, "system": name,
                     "median_step_s": measured["median_step_s"],
                     "vs_torchtitan": measured["median_step_s"] / base["median_step_s"],
                     "cross_node_mb": None if cross is None else cross / 1e6,
                     "cross_node_vs_torchtitan": None if cross is None or not base_cross else cross / base_cross,
                     "ledger_cross_node_mb": {k: v / 1e6 for k, v in measured["ledger_cross_node_bytes"].items()}})
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'layout':<7}{'bandwidth':<11}{'system':<12}{'step s':>8}{'x tt':>7}{'x-node MB':>11}{'x tt':>7}"
             "  zeropp's ledger, cross-node MB"]
    for r in rows:
        mb = "n/a" if r["cross_node_mb"] is None else f"{r['cross_node_mb']:.1f}"
        ratio = "n/a" if r["cross_node_vs_torchtitan"] is None else f"{r['cross_node_vs_torchtitan']:.3f}"
        ledger = ", ".join(f"{k} {v:.1f}" for k, v in r["ledger_cross_node_mb"].items() if v)
        lines.append(f"{r['layout']:<7}{r['bandwidth']:<11}{r['system']:<12}{r['median_step_s']:>8.2f}"
                     f"{r['vs_torchtitan']:>7.3f}{mb:>11}{ratio:>7}  {ledger}")
    return "\n".join(lines)


def run(out_dir: str = "benchmarks/results", layouts: Sequence[str] = tuple(LAYOUTS),
        bandwidths: Sequence[str] = BANDWIDTHS, steps: int = 3, warmup_steps: int = 1) -> dict[str, Any]:
    """Every layout at every bandwidth on the emulated cluster: print the table, write
    ``bench_layouts.json``."""
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown:
        raise ValueError(f"layouts {unknown} are not among {list(LAYOUTS)}")
    started, rows, records = time.perf_counter(), [], []
    for bandwidth in bandwidths:
        for name in layouts:
            layout = LAYOUTS[name]
            with exclusive_cluster(layout.num_nodes, bandwidth):
                record, result = launch_job(
                    "zeropp.tools.bench.layouts", ["--layout", name, "--steps", str(steps), "--warmup-steps",
                                                   str(warmup_steps), "--wire"],
                    layout.num_nodes, layout.ranks_per_node, f"of the {name} layout", master_port=29512)
            records.append({**record, "bandwidth": bandwidth, "elapsed_s": result.elapsed_s})
            rows += rows_of(record, bandwidth)
            print(format_table(rows_of(record, bandwidth)), flush=True)
    result = {"date": time.strftime("%Y-%m-%d"), "machine": machine_info(torch.device("cpu")),
              "systems": {name: None if c is None else dataclasses.asdict(c) for name, c in SYSTEMS.items()},
              "local_batch": LOCAL_BATCH, "seq_len": SEQ_LEN, "elapsed_s": time.perf_counter() - started,
              "records": records, "rows": rows}
    print("\n" + format_table(rows))
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "bench_layouts.json")
    with open(path, "w") as file:
        json.dump(result, file, indent=2)
    print(f"\nwrote {path}")
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="one job of zeropp bench layouts (run under torchrun)")
    parser.add_argument("--layout", choices=list(LAYOUTS), required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup-steps", type=int, default=1)
    parser.add_argument("--wire", action="store_true", help="read the emulated cluster's link counters")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    dist.init_process_group("gloo")
    try:
        record = measure(args.layout, args.steps, args.warmup_steps, args.wire)
        if record is not None:
            args.out.write_text(json.dumps(record, indent=2))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
