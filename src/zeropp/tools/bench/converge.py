"""``zeropp converge``: does ZeRO++ train as well as ZeRO-3? Loss curves on real text, per mode.

The paper (§5) claims on-par accuracy with INT8 weights and INT4 gradients but shows no
numbers for the separate techniques. This harness trains the demo's char-level GPT on the
Shakespeare corpus once per mode of ``zeropp.tools.modes`` on ``num_nodes x ranks_per_node``
local ranks, every run with the same seed, the same initial weights and the same batches, and
once more in a single process without zeropp (plain PyTorch on the same global batches): the
reference that plain ZeRO-3 must match up to fp32 summation order.

Each distributed mode is one ``zeropp demo`` job (the demo's training loop, unchanged), run
through torchrun; its metrics land in ``<runs_dir>/<mode>/metrics.jsonl``. After every mode,
``<out_dir>/converge.json`` is rewritten with all modes finished so far, so an interrupted run
resumes by skipping them (a mode cut off midway restarts from step 0). Results are kept only
while the training settings stay the same; other settings start afresh.

Outputs: ``converge.json`` (per mode the train loss of every step, the validation loss every
``eval_every`` steps on fixed batches, the final validation loss and its difference from
ZeRO-3 in percent), ``converge.png`` and a printed table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from zeropp.tools.bench.paired import CONTROL, mean, std, verdict
from zeropp.tools.cluster.launch import launch_local
from zeropp.tools.data import CORPORA, CharCorpus
from zeropp.tools.demo import DemoConfig, build_optimizer, build_schedule
from zeropp.tools.jobs import config_flags
from zeropp.tools.models import GPT, GPTConfig
from zeropp.tools.modes import BASELINE, MODES, check_modes, parse_modes, zeropp_modes

DEFAULT_MODES = ("zero3", "qwz", "hpz", "qgz", "qgz_ef", "all", "all_ef", "qgz_int4", "all_int4")
"""ZeRO-3 first: the others are compared with it. The last two are the qgZ alternative
``grad_bits_intra=8``: INT8 on the fast intra-node hop, INT4 on the cross-node hop only. Any
mode of ``zeropp.tools.modes.zeropp_modes()`` can be asked for (``qgz_int8``, ``qgz_block32``, ...)."""
REFERENCE = "reference"
"""Name of the single-process run (no zeropp, no torch.distributed) in the results."""
TRAINING = {"batch_size": 64, "lr": 1e-3}
"""Changes to the demo's defaults: its lr 3e-3 (no warm-up) sits on the unigram plateau (val loss
~3.3) for 100+ steps; at 1e-3 and batch 64 the single-process run reached 2.16 in 400 steps
(2.36 at batch 32, 2.80 at lr 3e-3)."""
STEPS = 1000
"""Long enough for the loss to flatten under the cosine schedule (ZeRO-3: validation 1.760 at
step 850, 1.739 at 1000). At 300 steps the loss still fell ~0.02 per 25 steps, and a mode that
trails by a few steps showed twice its final gap (qgZ: +3.8% at 300, +1.7% at 1000)."""
TRAIN_LOSS_WINDOW = 50
"""Steps averaged for the final train loss (one step's loss is one batch: noisy)."""


def run(out_dir: str | Path = "benchmarks/results", *, steps: int = STEPS,
        modes: Sequence[str] = DEFAULT_MODES, eval_every: int = 50, eval_batches: int = 8,
        num_nodes: int = 2, ranks_per_node: int = 2, reference: bool = True,
        runs_dir: str | Path = "runs/converge", **training: Any) -> dict[str, Any]:
    """Train every mode not yet in ``<out_dir>/converge.json``, then write the JSON, PNG and table.

    ``training`` overrides other ``DemoConfig`` fields (batch_size, num_layers, lr, seed, ...;
    ``TRAINING`` by default). Returns the results dict that was written.
    """
    check_modes(modes, zeropp_modes())
    settings = DemoConfig(steps=steps, eval_every=eval_every, eval_batches=eval_batches,
                          **{**TRAINING, **training})
    out_path = Path(out_dir) / "converge.json"
    results = _resumable_results(out_path, settings, num_nodes, ranks_per_node)
    names = [*modes, *([REFERENCE] if reference else [])]
    for i, name in enumerate(names):
        done = results["modes"].get(name)
        if done is not None and done["zeropp_config"] == json.loads(json.dumps(_mode_config(name, ranks_per_node))):
            print(f"[{i + 1}/{len(names)}] {name}: already done (in {out_path}), skipped", flush=True)
            continue
        if done is not None:  # a mode whose settings changed since (a new default): its old run is not its run
            print(f"[{i + 1}/{len(names)}] {name}: {out_path} holds a run of other settings; training again",
                  flush=True)
        print(f"[{i + 1}/{len(names)}] {name}: training {steps} steps", flush=True)
        records = (train_reference(settings) if name == REFERENCE else
                   _train_mode(dataclasses.replace(settings, mode=name), Path(runs_dir) / name,
                               num_nodes, ranks_per_node))
        results["modes"][name] = summarize(name, records, ranks_per_node)
        _write_json(out_path, results)
    add_deltas(results["modes"])
    _write_json(out_path, results)
    plot(Path(out_dir) / "converge.png", results)
    print(table(results))
    print(f"\nwrote {out_path} and {Path(out_dir) / 'converge.png'}")
    return results


def run_seeds(out_dir: str | Path, seeds: Sequence[int], *, runs_dir: str | Path = "runs/converge",
              **kwargs: Any) -> dict[str, Any]:
    """``run`` once per seed into ``<out_dir>/seed_<k>`` (each resumable), then the statistics of
    every mode's final validation-loss delta against ZeRO-3 across the seeds:
    ``<out_dir>/converge_seeds.json``, ``converge_seeds.png`` and a printed table."""
    per_seed = {seed: run(Path(out_dir) / f"seed_{seed}", seed=seed, runs_dir=Path(runs_dir) / f"seed_{seed}",
                          **kwargs) for seed in seeds}
    summary = seed_statistics(per_seed)
    _write_json(Path(out_dir) / "converge_seeds.json", summary)
    plot_seeds(Path(out_dir) / "converge_seeds.png", summary)
    print(seeds_table(summary))
    return summary


def seed_statistics(per_seed: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Per mode run on every seed: each seed's delta against that seed's ZeRO-3 (same data, same
    initial weights), their mean and sample standard deviation, and where the control ``zero3_init``
    ran, the verdict on each mode's delta minus the control's (zeropp.tools.bench.paired). The noise
    floor: how much ZeRO-3's own final loss moves from seed to seed (standard deviation, in
    percent of its mean)."""
    seeds = sorted(per_seed)
    names = [name for name in per_seed[seeds[0]]["modes"] if all(name in per_seed[k]["modes"] for k in seeds)]
    modes = {}
    for name in names:
        deltas = [per_seed[k]["modes"][name]["val_delta_vs_zero3_percent"] for k in seeds]
        losses = [per_seed[k]["modes"][name]["final_val_loss"] for k in seeds]
        modes[name] = {"deltas_percent": deltas, "mean_percent": mean(deltas), "std_percent": std(deltas),
                       "final_val_losses": losses, "zeropp_config": per_seed[seeds[0]]["modes"][name]["zeropp_config"]}
        if CONTROL in names and name != CONTROL:
            control = [per_seed[k]["modes"][CONTROL]["val_delta_vs_zero3_percent"] for k in seeds]
            modes[name]["vs_control"] = verdict([d - c for d, c in zip(deltas, control)])
    baseline = [per_seed[k]["modes"][BASELINE]["final_val_loss"] for k in seeds if BASELINE in per_seed[k]["modes"]]
    floor = 100 * std(baseline) / mean(baseline) if len(baseline) > 1 else None
    settings = {key: value for key, value in per_seed[seeds[0]]["settings"].items() if key != "seed"}
    return {"settings": settings, "seeds": seeds, "zero3_seed_spread_percent": floor, "modes": modes}


def seeds_table(summary: dict[str, Any]) -> str:
    """Markdown: per mode the mean and standard deviation of its delta against ZeRO-3, and each seed's."""
    paired = CONTROL in summary["modes"]
    lines = [f"seeds {summary['seeds']}; ZeRO-3's final loss moves {summary['zero3_seed_spread_percent'] or 0:.2f}% "
             "(standard deviation) from seed to seed", "",
             "| mode | Δ vs ZeRO-3, mean ± std | per seed |" + (f" minus {CONTROL}'s Δ |" if paired else ""),
             "|---|---:|---|" + ("---|" if paired else "")]
    for name, entry in summary["modes"].items():
        per_seed = ", ".join(f"{d:+.2f}%" for d in entry["deltas_percent"])
        against = f" {entry['vs_control']['text'] if 'vs_control' in entry else '—'} |" if paired else ""
        lines.append(f"| {name} | {entry['mean_percent']:+.2f}% ± {entry['std_percent']:.2f} | {per_seed} |{against}")
    return "\n".join(lines)


def plot_seeds(path: Path, summary: dict[str, Any]) -> None:
    """Each mode's delta against ZeRO-3 per seed (dots) and mean ± standard deviation (bar)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [name for name in summary["modes"] if name != BASELINE]
    fig, ax = plt.subplots(figsize=(1.4 * len(names) + 2, 4))
    for i, name in enumerate(names):
        entry = summary["modes"][name]
        ax.bar(i, entry["mean_percent"], yerr=entry["std_percent"], color=f"C{i}", alpha=0.5, capsize=4)
        ax.plot([i] * len(entry["deltas_percent"]), entry["deltas_percent"], "k.", ms=6)
    ax.axhspan(-0.5, 0.5, color="grey", alpha=0.15, label="±0.5%")
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
    ax.set(ylabel="final val loss vs ZeRO-3 (%)", title=f"seeds {summary['seeds']}: mean ± std, dots per seed")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _resumable_results(path: Path, settings: DemoConfig, num_nodes: int, ranks_per_node: int) -> dict[str, Any]:
    """The results already in ``path`` if they were made with these settings, else a fresh dict."""
    wanted = {**dataclasses.asdict(settings), "num_nodes": num_nodes, "ranks_per_node": ranks_per_node}
    wanted.pop("mode")
    if path.exists():
        previous = json.loads(path.read_text())
        defaults = dataclasses.asdict(DemoConfig())  # fields added since the file was written
        if {**defaults, **previous.get("settings", {})} == {**defaults, **wanted}:
            previous["settings"] = wanted
            return previous
        print(f"{path} holds results of other settings; starting afresh", flush=True)
    return {"settings": wanted, "modes": {}}


def _train_mode(config: DemoConfig, run_dir: Path, num_nodes: int, ranks_per_node: int) -> list[dict]:
    """One ``zeropp.tools.demo`` job under torchrun; its per-step records."""
    args = ["--run-dir", str(run_dir), *config_flags(config)]
    code = launch_local("zeropp.tools.demo", args, num_nodes, ranks_per_node)
    if code != 0:
        raise RuntimeError(f"mode {config.mode!r} failed (torchrun exit code {code}); "
                           f"its output is above, its run directory {run_dir}")
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def train_reference(config: DemoConfig) -> list[dict]:
    """The demo's training in one process without zeropp: same model, seed, global batches,
    optimizer and schedule. Records as the demo's: step, loss, elapsed_s, val_loss."""
    torch.set_num_threads(1)  # as each rank: a shared machine, and comparable step times
    corpus = CharCorpus.named(config.corpus)
    torch.manual_seed(config.seed)
    model = GPT(GPTConfig(vocab_size=corpus.vocab_size, context_length=config.context_length,
                          num_layers=config.num_layers, num_heads=config.num_heads,
                          embed_dim=config.embed_dim))
    optimizer = build_optimizer(model, config)
    schedule = build_schedule(optimizer, config)
    records, started = [], time.perf_counter()
    for step in tqdm(range(config.steps), desc=f"{REFERENCE} training", unit="step"):
        x, y = corpus.batch_at("train", step, config.batch_size, config.context_length, config.seed)
        _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        record = {"step": step + 1, "loss": loss.item(), "elapsed_s": time.perf_counter() - started}
        if (step + 1) % config.eval_every == 0 or step + 1 == config.steps:
            record["val_loss"] = _evaluate(model, corpus, config)
        records.append(record)
    return records


@torch.no_grad()
def _evaluate(model: GPT, corpus: CharCorpus, config: DemoConfig) -> float:
    """Mean loss over the demo's fixed validation batches."""
    losses = [model(*corpus.batch_at("val", i, config.batch_size, config.context_length, config.seed))[1].item()
              for i in range(config.eval_batches)]
    return sum(losses) / len(losses)


def _mode_config(name: str, ranks_per_node: int) -> dict[str, Any] | None:
    """The mode's ``ZeroPPConfig`` as converge.json stores it (None for the single-process reference)."""
    return _config_dict(MODES[name].config(ranks_per_node)) if name in MODES else None


def summarize(name: str, records: list[dict], ranks_per_node: int) -> dict[str, Any]:
    """One mode's entry in converge.json: curves, final losses, time per step."""
    val = [[r["step"], r["val_loss"]] for r in records if "val_loss" in r]
    train = [r["loss"] for r in records]
    window = train[-TRAIN_LOSS_WINDOW:]
    return {
        "zeropp_config": _mode_config(name, ranks_per_node),
        "train_loss": train,
        "val_loss": val,
        "final_val_loss": val[-1][1],
        "final_train_loss_mean": sum(window) / len(window),
        "s_per_step": records[-1]["elapsed_s"] / len(records),
    }


def _config_dict(config: Any) -> dict[str, Any]:
    return {k: str(v) if isinstance(v, torch.dtype) else v for k, v in dataclasses.asdict(config).items()}


def add_deltas(modes: dict[str, dict[str, Any]]) -> None:
    """Each mode's final validation loss relative to ZeRO-3's, in percent (None without ZeRO-3)."""
    baseline = modes.get(BASELINE, {}).get("final_val_loss")
    for entry in modes.values():
        entry["val_delta_vs_zero3_percent"] = (
            None if baseline is None else 100 * (entry["final_val_loss"] - baseline) / baseline)


def table(results: dict[str, Any]) -> str:
    """Markdown table: one row per mode."""
    lines = ["| mode | final val loss | Δ vs ZeRO-3 | train loss (last 50 steps) | s/step |",
             "|---|---:|---:|---:|---:|"]
    for name, entry in results["modes"].items():
        delta = entry.get("val_delta_vs_zero3_percent")
        delta_text = "—" if delta is None else f"{delta:+.2f}%"
        lines.append(f"| {name} | {entry['final_val_loss']:.4f} | {delta_text} | "
                     f"{entry['final_train_loss_mean']:.4f} | {entry['s_per_step']:.3f} |")
    return "\n".join(lines)


def plot(path: Path, results: dict[str, Any]) -> None:
    """Left: train loss (moving average) and validation loss per mode. Right: each mode's
    validation loss relative to ZeRO-3 over the run, with the ±1% band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curves, deltas) = plt.subplots(1, 2, figsize=(13, 4.5))
    modes = results["modes"]
    baseline = dict(map(tuple, modes[BASELINE]["val_loss"])) if BASELINE in modes else None
    for i, (name, entry) in enumerate(modes.items()):
        color = f"C{i}"
        train = torch.tensor(entry["train_loss"])
        window = min(20, len(train))
        smooth = train.unfold(0, window, 1).mean(dim=1)
        curves.plot(range(window, len(train) + 1), smooth, color=color, lw=1, label=f"{name} train")
        steps, val = zip(*entry["val_loss"])
        curves.plot(steps, val, "o--", ms=3, color=color, label=f"{name} val")
        if baseline is not None:
            deltas.plot(steps, [100 * (v - baseline[s]) / baseline[s] for s, v in zip(steps, val)],
                        "o-", ms=3, color=color, label=name)
    curves.set(xlabel="step", ylabel="cross-entropy (nats/char)", title="loss (train: 20-step mean)")
    bottom, top = curves.get_ylim()
    if bottom < 3.5 < top:  # cut the first steps' high loss, so the flat end is readable
        curves.set_ylim(top=3.5)
    deltas.axhspan(-1, 1, color="grey", alpha=0.15, label="±1%")
    deltas.set(xlabel="step", ylabel="val loss vs ZeRO-3 (%)", title="validation loss relative to ZeRO-3")
    for ax in (curves, deltas):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _write_json(path: Path, results: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp_path = path.with_suffix(".json.partial")
    tmp_path.write_text(json.dumps(results, indent=1))
    tmp_path.replace(path)  # never a half-written file to resume from


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``zeropp converge`` options."""
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES),
                        help=f"comma-separated, among {', '.join(zeropp_modes())}")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--nodes", type=int, default=2, help="emulated nodes (default 2)")
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--no-reference", action="store_true", help="skip the single-process run")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--runs", default="runs/converge", help="per-mode run directories")
    parser.add_argument("--seed", type=int, default=0,
                        help="initial weights and data order (default 0; another seed shows the spread)")
    parser.add_argument("--seeds", type=lambda text: [int(k) for k in text.split(",")], default=None,
                        help="comma-separated: one run per seed under <out>/seed_<k>, then the mean and standard "
                             "deviation of each mode's delta (<out>/converge_seeds.json); replaces --seed")
    parser.add_argument("--corpus", default="shakespeare", choices=list(CORPORA),
                        help="training text (kjv: the King James Bible, mormon: the Book of Mormon; nothing here "
                             "was tuned on either)")
    parser.add_argument("--model", type=_model_shape, default=None, metavar="LAYERSxWIDTH",
                        help="the GPT's layers x width (heads: width / 32), e.g. 6x192; default the demo's 4x128")
    parser.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"],
                        help="sgd: momentum 0.9 (give --lr; the default 1e-3 suits AdamW)")
    parser.add_argument("--lr", type=float, default=TRAINING["lr"])
    parser.set_defaults(func=run_from_args)


def _model_shape(text: str) -> dict[str, int]:
    """``6x192`` -> the demo's shape fields (one head per 32 of width, at least one)."""
    layers, _, width = text.partition("x")
    if not (layers.isdigit() and width.isdigit()) or int(layers) < 1 or int(width) < 1:
        raise argparse.ArgumentTypeError(f"--model {text!r} must be LAYERSxWIDTH with positive integers, e.g. 6x192")
    return {"num_layers": int(layers), "embed_dim": int(width), "num_heads": max(1, int(width) // 32)}


def run_from_args(args: argparse.Namespace) -> int:
    """``zeropp converge``: ``run`` (or ``run_seeds``) with the parsed options."""
    options = dict(steps=args.steps, modes=parse_modes(args.modes, zeropp_modes()), eval_every=args.eval_every,
                   eval_batches=args.eval_batches, num_nodes=args.nodes, ranks_per_node=args.ranks_per_node,
                   reference=not args.no_reference, runs_dir=args.runs, corpus=args.corpus,
                   optimizer=args.optimizer, lr=args.lr, **(args.model or {}))
    if args.seeds is not None:
        run_seeds(args.out, args.seeds, **options)
    else:
        run(args.out, seed=args.seed, **options)
    return 0


def main(argv: list[str] | None = None) -> None:
    """``python -m zeropp.tools.bench.converge``: the command."""
    parser = argparse.ArgumentParser(prog="zeropp converge", description=__doc__.splitlines()[0])
    add_arguments(parser)
    raise SystemExit(run_from_args(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
