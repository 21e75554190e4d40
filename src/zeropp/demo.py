"""The demo job: train the char-level GPT on Shakespeare with zeropp, one process per rank.

Run under torchrun (``zeropp demo`` launches it): the same code path for 1 and N ranks. Each
rank takes its rows of the same global batch; rank 0 logs the global loss, writes
``metrics.jsonl`` and a loss-curve PNG into the run directory, and prints the ledger's table.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

import zeropp
from zeropp.cluster.launch import launch_local
from zeropp.comms import all_gather_strings, all_reduce_mean
from zeropp.data import CharCorpus
from zeropp.jobs import run_rank_job
from zeropp.models import GPT, GPTConfig
from zeropp.modes import MODES, check_modes, parse_modes, zeropp_modes


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """One demo run. Defaults train in a few minutes on 4 CPU ranks."""

    mode: str = "zero3"
    """A mode of ``zeropp.modes`` that zeropp trains (``zeropp_modes()``)."""
    steps: int = 300
    """Optimizer steps."""
    batch_size: int = 32
    """Global batch (sequences), split evenly over the ranks."""
    context_length: int = 64
    """Characters per sequence."""
    num_layers: int = 4
    embed_dim: int = 128
    num_heads: int = 4
    lr: float = 3e-3
    """AdamW learning rate (cosine decay to 10% over the run, no warm-up)."""
    eval_every: int = 50
    """Steps between validation losses (and at the last step)."""
    eval_batches: int = 4
    seed: int = 0
    """Model init and data order; every mode with the same seed sees the same batches."""


def train(config: DemoConfig, run_dir: Path) -> list[dict]:
    """Train on this rank; returns the metric records (rank 0 also writes them, with the
    communication of every rank summed)."""
    check_modes([config.mode], zeropp_modes())
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if config.batch_size % world_size:
        raise ValueError(f"batch_size={config.batch_size} must be a multiple of the world size {world_size}")
    corpus = CharCorpus.shakespeare()
    torch.manual_seed(config.seed)
    model = GPT(GPTConfig(vocab_size=corpus.vocab_size, context_length=config.context_length,
                          num_layers=config.num_layers, num_heads=config.num_heads,
                          embed_dim=config.embed_dim))
    topology = zeropp.Topology.from_env()
    zeropp.shard(model, MODES[config.mode].config(topology.ranks_per_node), topology=topology)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, config.steps, eta_min=config.lr / 10)
    local = slice(rank * config.batch_size // world_size, (rank + 1) * config.batch_size // world_size)
    ledger = zeropp.comm_ledger()
    ledger.reset()
    records, started = [], time.perf_counter()
    for step in tqdm(range(config.steps), disable=rank != 0, desc=f"{config.mode} training", unit="step"):
        x, y = corpus.batch_at("train", step, config.batch_size, config.context_length, config.seed)
        _, loss = model(x[local], y[local])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        ledger.step()
        with ledger.suspended():
            record = {"step": step + 1, "loss": all_reduce_mean(loss.detach(), topology),
                      "elapsed_s": time.perf_counter() - started}
            if (step + 1) % config.eval_every == 0 or step + 1 == config.steps:
                record["val_loss"] = evaluate(model, corpus, config, local, topology)
        records.append(record)
    every_rank = [json.loads(text) for text in all_gather_strings(json.dumps(ledger.export()))]
    if rank == 0:
        write_outputs(run_dir, config, records, zeropp.CommLedger.combined(every_rank))
    return records


@torch.no_grad()
def evaluate(model: torch.nn.Module, corpus: CharCorpus, config: DemoConfig, local: slice,
             topology: zeropp.Topology) -> float:
    """Mean validation loss over fixed batches (the same for every mode and step)."""
    losses = []
    for i in range(config.eval_batches):
        x, y = corpus.batch_at("val", i, config.batch_size, config.context_length, config.seed)
        losses.append(all_reduce_mean(model(x[local], y[local])[1], topology))
    return sum(losses) / len(losses)


def write_outputs(run_dir: Path, config: DemoConfig, records: list[dict], ledger: zeropp.CommLedger) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(asdict(config), indent=2))
    with open(run_dir / "metrics.jsonl", "w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    (run_dir / "comm.json").write_text(json.dumps(ledger.summary(), indent=2))
    plot_losses(run_dir / "loss.png", {config.mode: records})
    last = records[-1]
    print(f"\nfinal train loss {last['loss']:.4f}, validation loss {last.get('val_loss', float('nan')):.4f}, "
          f"{last['elapsed_s'] / len(records):.3f} s/step")
    print(ledger.table())
    print(f"\nwrote {run_dir}/metrics.jsonl, loss.png, comm.json")


def plot_losses(path: Path, runs: dict[str, list[dict]]) -> None:
    """Train (line) and validation (markers) loss per step, one colour per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (name, records) in enumerate(runs.items()):
        color = f"C{i}"
        ax.plot([r["step"] for r in records], [r["loss"] for r in records], color=color, lw=1, label=f"{name} train")
        val = [r for r in records if "val_loss" in r]
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o--", color=color, label=f"{name} val")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/char)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def compare(run_dir: Path, modes: list[str]) -> str:
    """A side-by-side table of finished demo runs (``run_dir/<mode>``) and one PNG of their curves."""
    runs, lines = {}, ["communication summed over all ranks (x-node: direct sends; backend: what the "
                       "backend's algorithm sends across nodes)",
                       f"{'mode':<8}{'train loss':>11}{'val loss':>10}{'s/step':>8}{'MB/step sent':>14}"
                       f"{'MB/step x-node':>16}{'backend':>9}"]
    for mode in modes:
        records = [json.loads(line) for line in open(run_dir / mode / "metrics.jsonl")]
        comm = json.loads((run_dir / mode / "comm.json").read_text())["total"]
        runs[mode], last, steps = records, records[-1], len(records)
        lines.append(f"{mode:<8}{last['loss']:>11.4f}{last.get('val_loss', float('nan')):>10.4f}"
                     f"{last['elapsed_s'] / steps:>8.3f}{comm['bytes'] / steps / 1e6:>14.3f}"
                     f"{comm['cross_node_bytes'] / steps / 1e6:>16.3f}"
                     f"{comm['backend_cross_node_bytes'] / steps / 1e6:>9.3f}")
    plot_losses(run_dir / "loss.png", runs)
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``zeropp demo``'s options: which modes, how long, on how many local ranks."""
    parser.add_argument("--modes", type=lambda text: parse_modes(text, zeropp_modes()), default=("zero3", "all"),
                        help=f"comma-separated, from {', '.join(zeropp_modes())} (default: ZeRO-3 and all three "
                             "ZeRO++ techniques)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--nodes", type=int, default=2, help="emulated nodes (default 2)")
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--runs", default="runs", help="parent folder of the run directory")
    parser.set_defaults(func=run_from_args)


def run_from_args(args: argparse.Namespace) -> int:
    """``zeropp demo``: one torchrun job per mode on local ranks, then the side-by-side table."""
    run_dir = Path(args.runs) / time.strftime("%Y%m%d-%H%M%S")
    for mode in args.modes:
        module_args = ["--run-dir", str(run_dir / mode), "--mode", mode, "--steps", str(args.steps)]
        print(f"\nzeropp demo: {args.nodes} nodes x {args.ranks_per_node} ranks (local processes), "
              f"mode {mode}, {args.steps} steps -> {run_dir / mode}", flush=True)
        code = launch_local("zeropp.demo", module_args, args.nodes, args.ranks_per_node)
        if code:
            return code
    print("\n" + compare(run_dir, list(args.modes)))
    print(f"\nloss curves: {run_dir / 'loss.png'}")
    return 0


def main(argv: list[str] | None = None) -> None:
    """One rank of a demo run (``zeropp demo`` launches it under torchrun)."""
    run_rank_job("zeropp demo training job (run under torchrun)", DemoConfig, train, argv)


if __name__ == "__main__":
    main()
