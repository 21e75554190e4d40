"""``zeropp rlhf``: an RLHF-style loop on a sharded policy, under ZeRO-3 and under ZeRO++.

Each iteration every rank samples completions of its own prompts with the demo GPT's KV-cache
sampler (``no_grad`` forwards, one per token: inside ``zeropp.generation_mode`` when the mode
uses hpZ, so the weights cross nodes once per iteration), scores them with a fixed reward (the
fraction of a target character in the completion), and takes one REINFORCE step with the batch
mean reward as the baseline: loss = -mean((r - mean r) * sum of the completion's log-probs).
Generation and training time are measured separately per iteration.

Outputs ``<out_dir>/rlhf.json`` (per mode: reward, generation and training seconds per iteration)
and ``rlhf.png`` (the reward curves), and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import zeropp
from zeropp.fsdp.comms import all_reduce_mean
from zeropp.tools.cluster.launch import launch_local
from zeropp.tools.data import CharCorpus
from zeropp.tools.jobs import config_flags, run_rank_job
from zeropp.tools.models import GPT, GPTConfig
from zeropp.tools.modes import MODES, parse_modes, zeropp_modes


@dataclass(frozen=True, kw_only=True)
class RLHFConfig:
    """One RLHF run (one mode) on every rank."""

    mode: str = "zero3"
    iterations: int = 40
    prompts_per_rank: int = 8
    prompt_length: int = 8
    completion_length: int = 24
    target: str = "e"
    """The character whose share of the completion is the reward."""
    lr: float = 3e-3
    temperature: float = 1.0
    num_layers: int = 2
    embed_dim: int = 64
    num_heads: int = 4
    seed: int = 0


def reward(completions: torch.Tensor, target_id: int) -> torch.Tensor:
    """The fraction of ``target_id`` in each completion (B, L) -> (B,)."""
    return (completions == target_id).float().mean(dim=1)


def completion_log_prob(model: torch.nn.Module, tokens: torch.Tensor, prompt_length: int) -> torch.Tensor:
    """The sum of log-probabilities of each row's completion tokens under ``model`` (B,)."""
    logits, _ = model(tokens[:, :-1])
    log_probs = F.log_softmax(logits.float(), dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return log_probs[:, prompt_length - 1:].sum(dim=1)


def train(config: RLHFConfig, run_dir: Path) -> list[dict[str, float]]:
    """The loop on this rank; rank 0 writes ``run_dir/metrics.jsonl``."""
    rank = dist.get_rank()
    corpus = CharCorpus.shakespeare()
    torch.manual_seed(config.seed)
    model = GPT(GPTConfig(vocab_size=corpus.vocab_size, context_length=config.prompt_length + config.completion_length,
                          num_layers=config.num_layers, num_heads=config.num_heads, embed_dim=config.embed_dim))
    topology = zeropp.Topology.from_env()
    mode = MODES[config.mode]
    zeropp.shard(model, mode.config(topology.ranks_per_node), topology=topology)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0)
    target_id = int(corpus.encode(config.target)[0])
    generator = torch.Generator().manual_seed(config.seed * 1000 + rank)
    records = []
    for iteration in range(config.iterations):
        prompts = corpus.batch_at("train", iteration, config.prompts_per_rank * dist.get_world_size(),
                                  config.prompt_length, config.seed)[0]
        prompts = prompts[rank * config.prompts_per_rank:(rank + 1) * config.prompts_per_rank]
        started = time.perf_counter()
        with zeropp.generation_mode(model) if mode.hpz else contextlib.nullcontext():
            tokens = model.generate(prompts, config.completion_length, temperature=config.temperature,
                                    generator=generator)
        generated = time.perf_counter()
        rewards = reward(tokens[:, config.prompt_length:], target_id)
        mean_reward = all_reduce_mean(rewards.mean(), topology)
        advantage = rewards - mean_reward
        loss = -(advantage * completion_log_prob(model, tokens, config.prompt_length)).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        records.append({"iteration": iteration + 1, "reward": mean_reward,
                        "generate_s": generated - started, "train_s": time.perf_counter() - generated})
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def run(out_dir: str | Path = "benchmarks/results", *, modes: tuple[str, ...] = ("zero3", "all"),
        num_nodes: int = 2, ranks_per_node: int = 2, runs_dir: str | Path = "runs/rlhf", **settings: Any
        ) -> dict[str, Any]:
    """Run every mode as a torchrun job on local ranks; write ``rlhf.json`` and ``rlhf.png``."""
    results: dict[str, Any] = {"settings": {**asdict(RLHFConfig(**settings)), "num_nodes": num_nodes,
                                            "ranks_per_node": ranks_per_node}, "modes": {}}
    results["settings"].pop("mode")
    for mode in modes:
        run_dir = Path(runs_dir) / mode
        args = ["--run-dir", str(run_dir), *config_flags(RLHFConfig(mode=mode, **settings))]
        code = launch_local("zeropp.tools.bench.rlhf", args, num_nodes, ranks_per_node)
        if code:
            raise RuntimeError(f"mode {mode!r} failed (torchrun exit code {code}); its output is above")
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        results["modes"][mode] = summarize(records)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rlhf.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(out / "rlhf.png", results)
    print(table(results))
    print(f"\nwrote {out / 'rlhf.json'} and {out / 'rlhf.png'}")
    return results


def summarize(records: list[dict[str, float]]) -> dict[str, Any]:
    window = max(1, len(records) // 5)
    return {"reward": [r["reward"] for r in records], "generate_s": [r["generate_s"] for r in records],
            "train_s": [r["train_s"] for r in records],
            "first_reward": sum(r["reward"] for r in records[:window]) / window,
            "last_reward": sum(r["reward"] for r in records[-window:]) / window}


def table(results: dict[str, Any]) -> str:
    lines = ["| mode | reward, first fifth | reward, last fifth | generate s/iter | train s/iter |",
             "|---|---:|---:|---:|---:|"]
    for name, entry in results["modes"].items():
        gen, trn = (sum(entry[k][1:]) / max(1, len(entry[k]) - 1) for k in ("generate_s", "train_s"))
        lines.append(f"| {name} | {entry['first_reward']:.3f} | {entry['last_reward']:.3f} | {gen:.3f} | {trn:.3f} |")
    return "\n".join(lines)


def plot(path: Path, results: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, entry in results["modes"].items():
        ax.plot(range(1, len(entry["reward"]) + 1), entry["reward"], label=name)
    ax.set_xlabel("iteration")
    ax.set_ylabel(f"reward (share of {results['settings']['target']!r})")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``zeropp rlhf``'s options."""
    defaults = RLHFConfig()
    parser.add_argument("--modes", type=lambda text: parse_modes(text, zeropp_modes()), default=("zero3", "all"))
    parser.add_argument("--iterations", type=int, default=defaults.iterations)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--runs", default="runs/rlhf")
    parser.set_defaults(func=run_from_args)


def run_from_args(args: argparse.Namespace) -> int:
    run(args.out, modes=args.modes, num_nodes=args.nodes, ranks_per_node=args.ranks_per_node, runs_dir=args.runs,
        iterations=args.iterations)
    return 0


def main(argv: list[str] | None = None) -> None:
    """One rank of a run (``zeropp rlhf`` launches it under torchrun)."""
    run_rank_job("zeropp RLHF job (run under torchrun)", RLHFConfig, train, argv)


if __name__ == "__main__":
    main()
