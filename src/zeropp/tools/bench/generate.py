"""``zeropp bench generate``: generation speed and the RLHF iteration on the emulated cluster.

On 2 nodes x 2 ranks at each inter-node bandwidth, one job per bandwidth samples completions with
the demo GPT's KV-cache sampler under each mode, in turns: ZeRO-3, qwZ, hpZ and all three (the
hpZ modes inside ``zeropp.generation_mode``: the weights cross nodes once per generation, then
every token's forward gathers inside the node; ``all_full`` keeps every unit whole instead, so
later forwards gather nothing), and DeepSpeed ZeRO-3 when installed (the GPT's
``generate`` called through ``engine.module``, as a DeepSpeed user would). Per mode: tokens per second over all
ranks (the slowest rank's time), cross-node bytes per generated token (the ledger's backend
figure over all ranks; DeepSpeed's bypass the ledger), and one RLHF-style iteration (generate,
then one REINFORCE step: ``zeropp.tools.bench.rlhf``) split into generation and training time.

Outputs ``bench_generate.json`` and ``bench_generate.png`` under ``out_dir`` and a table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

GENERATE_MODES = ("zero3", "qwz", "hpz", "all", "all_full")
FULL_COPY = "_full"
"""A mode name ending so (``all_full``) generates inside ``generation_mode(copy="full")``: every
unit kept whole after the one cross-node fill, instead of hpZ's copy inside the node."""


def sharding_mode(mode: str) -> str:
    """The ``zeropp.tools.modes`` name a benchmark mode shards with."""
    return mode.removesuffix(FULL_COPY)
BANDWIDTHS = ("unlimited", "1gbit", "100mbit")


@dataclass(frozen=True, kw_only=True)
class GenerateConfig:
    """One benchmark job (every mode, one bandwidth)."""

    modes: tuple[str, ...] = GENERATE_MODES
    prompts_per_rank: int = 4
    prompt_length: int = 8
    new_tokens: int = 24
    repeats: int = 3
    """Timed generations per mode (after one untimed)."""
    num_layers: int = 4
    embed_dim: int = 256
    num_heads: int = 4
    seed: int = 0


def build(mode: str, config: GenerateConfig, vocab_size: int, topology: Any) -> tuple[torch.nn.Module, Any]:
    """The policy GPT sharded as ``mode`` says, and its optimizer (DeepSpeed's engine for the peer)."""
    import zeropp
    from zeropp.tools.models import GPT, GPTConfig
    from zeropp.tools.modes import MODES, System

    torch.manual_seed(config.seed)
    model = GPT(GPTConfig(vocab_size=vocab_size, context_length=config.prompt_length + config.new_tokens,
                          num_layers=config.num_layers, num_heads=config.num_heads, embed_dim=config.embed_dim))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if MODES[sharding_mode(mode)].system is System.DEEPSPEED:
        from zeropp.tools.bench.worker import import_deepspeed

        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # the policy runs on CPU tensors
        deepspeed = import_deepspeed()
        ds_config = {"train_micro_batch_size_per_gpu": config.prompts_per_rank, "gradient_clipping": 0.0,
                     "zero_optimization": {"stage": 3}}
        engine, optimizer, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        return engine, engine
    zeropp.shard(model, MODES[sharding_mode(mode)].config(topology.ranks_per_node), topology=topology)
    return model, optimizer


def _generate(model: torch.nn.Module, mode: str, prompts: torch.Tensor, config: GenerateConfig,
              generator: torch.Generator) -> torch.Tensor:
    import zeropp
    from zeropp.tools.modes import MODES

    policy = getattr(model, "module", model)  # DeepSpeed's engine wraps the GPT
    copy = "full" if mode.endswith(FULL_COPY) else "node"
    with zeropp.generation_mode(model, copy=copy) if MODES[sharding_mode(mode)].hpz else contextlib.nullcontext():
        return policy.generate(prompts, config.new_tokens, temperature=1.0, generator=generator)


def measure_mode(mode: str, config: GenerateConfig) -> dict[str, Any]:
    """This rank's figures for one mode: generation seconds per repeat, the ledger's cross-node
    bytes of one generation, and one RLHF iteration's generation and training seconds."""
    import zeropp
    from zeropp.tools.bench.rlhf import completion_log_prob, reward
    from zeropp.tools.data import CharCorpus

    topology = zeropp.Topology.from_env()
    corpus = CharCorpus.shakespeare()
    model, optimizer = build(mode, config, corpus.vocab_size, topology)
    rank = dist.get_rank()
    prompts = corpus.batch_at("train", rank, config.prompts_per_rank, config.prompt_length, config.seed)[0]
    generator = torch.Generator().manual_seed(rank)
    ledger = zeropp.comm_ledger()
    _generate(model, mode, prompts, config, generator)  # warm-up
    seconds, cross_node = [], []
    for _ in range(config.repeats):
        ledger.reset()
        dist.barrier()
        started = time.perf_counter()
        _generate(model, mode, prompts, config, generator)
        seconds.append(time.perf_counter() - started)
        cross_node.append(ledger.summary()["total"]["backend_cross_node_bytes"])
    dist.barrier()
    started = time.perf_counter()
    tokens = _generate(model, mode, prompts, config, generator)
    generated = time.perf_counter()
    rewards = reward(tokens[:, config.prompt_length:], int(corpus.encode("e")[0]))
    loss = -((rewards - rewards.mean()) * completion_log_prob(model, tokens, config.prompt_length)).mean()
    if hasattr(model, "backward"):  # DeepSpeed's engine
        model.backward(loss)
        model.step()
    else:
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    dist.barrier()
    return {"generate_s": seconds, "cross_node_bytes": cross_node,
            "rlhf_generate_s": generated - started, "rlhf_train_s": time.perf_counter() - generated}


def worker_main(argv: list[str] | None = None) -> None:
    """One rank of a job: every mode in turn; rank 0 writes the merged record."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--config", required=True, help="GenerateConfig as JSON")
    args = parser.parse_args(argv)
    config = GenerateConfig(**{k: tuple(v) if isinstance(v, list) else v
                               for k, v in json.loads(args.config).items()})
    dist.init_process_group("gloo")
    try:
        torch.set_num_threads(1)
        mine = {mode: measure_mode(mode, config) for mode in config.modes}
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        if dist.get_rank() == 0:
            args.out.write_text(json.dumps(merge(everyone, config), indent=1))
    finally:
        dist.destroy_process_group()


def merge(ranks: list[dict[str, Any]], config: GenerateConfig) -> dict[str, Any]:
    """Per mode over all ranks: tokens/s from the slowest rank's median time, cross-node bytes
    per token summed over ranks, the RLHF iteration's split (slowest rank)."""
    world = len(ranks)
    tokens = world * config.prompts_per_rank * config.new_tokens
    out = {}
    for mode in config.modes:
        per_rank = [r[mode] for r in ranks]
        seconds = statistics.median(max(r["generate_s"][i] for r in per_rank) for i in range(config.repeats))
        cross = statistics.median(sum(r["cross_node_bytes"][i] for r in per_rank) for i in range(config.repeats))
        out[mode] = {"tokens_per_s": tokens / seconds, "seconds_per_generation": seconds,
                     "cross_node_bytes_per_token": cross / tokens if mode != "deepspeed" else None,
                     "rlhf_generate_s": max(r["rlhf_generate_s"] for r in per_rank),
                     "rlhf_train_s": max(r["rlhf_train_s"] for r in per_rank)}
    return out


def run(out_dir: str = "benchmarks/results", *, bandwidths: tuple[str, ...] = BANDWIDTHS,
        config: GenerateConfig | None = None) -> dict[str, Any]:
    """One cluster job per bandwidth; write the JSON and PNG, print the table."""
    from zeropp.tools.bench.comm import NUM_NODES, RANKS_PER_NODE, exclusive_cluster, machine_info
    from zeropp.tools.bench.step import deepspeed_available
    from zeropp.tools.cluster import launch

    config = config or GenerateConfig(modes=GENERATE_MODES + (("deepspeed",) if deepspeed_available() else ()))
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "machine": machine_info(torch.device("cpu")),
                               "config": asdict(config), "bandwidths": {}}
    for bandwidth in bandwidths:
        limit = None if bandwidth == "unlimited" else bandwidth
        with exclusive_cluster(NUM_NODES, limit), tempfile.TemporaryDirectory(prefix="zeropp-generate-") as folder:
            out = Path(folder) / "record.json"
            command = ["python", "-m", "zeropp.tools.bench.generate", "--worker", "--out", str(out),
                       "--config", json.dumps(asdict(config))]
            result = launch(command, NUM_NODES, RANKS_PER_NODE, master_port=29512)
            if result.exit_code != 0 or not out.exists():
                raise RuntimeError(f"the generate job at {bandwidth} failed (exit {result.exit_code})")
            results["bandwidths"][bandwidth] = json.loads(out.read_text())
        print(f"{bandwidth}: done", flush=True)
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    (path / "bench_generate.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(path / "bench_generate.png", results)
    print(table(results))
    return results


def table(results: dict[str, Any]) -> str:
    lines = ["| bandwidth | mode | tokens/s (x ZeRO-3) | cross-node B/token (x ZeRO-3) | RLHF iteration: "
             "generate s | train s |", "|---|---|---:|---:|---:|---:|"]
    for bandwidth, modes in results["bandwidths"].items():
        base = modes["zero3"]
        for mode, r in modes.items():
            cross = r["cross_node_bytes_per_token"]
            cross_text = "n/a" if cross is None else (
                f"{cross:,.0f} ({cross / base['cross_node_bytes_per_token']:.3f})")
            lines.append(f"| {bandwidth} | {mode} | {r['tokens_per_s']:.1f} "
                         f"({r['tokens_per_s'] / base['tokens_per_s']:.2f}) | {cross_text} | "
                         f"{r['rlhf_generate_s']:.2f} | {r['rlhf_train_s']:.2f} |")
    return "\n".join(lines)


def plot(path: Path, results: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bandwidths = list(results["bandwidths"])
    modes = list(next(iter(results["bandwidths"].values())))
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        ratios = [results["bandwidths"][b][mode]["tokens_per_s"]
                  / results["bandwidths"][b]["zero3"]["tokens_per_s"] for b in bandwidths]
        ax.bar([x + i * width for x in range(len(bandwidths))], ratios, width, label=mode)
    ax.axhline(2.0, color="grey", linestyle="--", linewidth=1, label="2x ZeRO-3")
    ax.set_xticks([x + width * (len(modes) - 1) / 2 for x in range(len(bandwidths))], bandwidths)
    ax.set_ylabel("generation tokens/s, x ZeRO-3")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--worker"]:
        worker_main(sys.argv[2:])
