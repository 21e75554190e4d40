"""How far ZeRO-3 fine-tuning takes SmolLM2-135M's held-out loss with more steps: the accuracy
grid's model, corpus, batches and held-out split (``zeropp accuracy --pretrained``), one ZeRO-3
run on 2 x 2 gloo ranks with the held-out loss every 30 steps, written as the fall from step 0.
It answers whether a cell can be made to move the model "far" (its held-out loss falling by a
quarter) by training longer, without the grid's cost of pairs.

    python benchmarks/held_out_fall.py --corpus shakespeare --steps 150 --lr 1e-4 \\
        --out benchmarks/results/held_out_fall/shakespeare_150_1e-4.json

bf16 compute by default (faster on CPUs with AVX-512 bf16; the fall, not a paired delta, is the
figure). A run stopped early still writes the evaluations it reached (``--summarize-only`` reads
the run directory again).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from zeropp.tools.bench import finetune
from zeropp.tools.cluster.launch import launch_local
from zeropp.tools.data.corpus import TEXTS
from zeropp.tools.jobs import config_flags

RUNS = Path("runs/held_out_fall")


def summarize(run_dir: Path, config: finetune.FinetuneConfig, corpus: str) -> dict:
    """The run's held-out losses and their fall from the first, from its metrics (complete or partial)."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        metrics = run_dir / "metrics.jsonl.partial"
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    evals = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    start = evals[0][1]
    return {"date": time.strftime("%Y-%m-%d"), "corpus": corpus, "mode": config.mode, "steps": config.steps,
            "lr": config.lr, "compute_dtype": config.compute_dtype, "batch_size": config.batch_size,
            "context_length": config.context_length, "eval_batches": config.eval_batches,
            "completed_steps": max(r["step"] for r in records),
            "evals": [{"step": step, "val_loss": loss, "fall_percent": 100 * (start - loss) / start}
                      for step, loss in evals]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", choices=sorted(TEXTS), default="shakespeare")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--compute-dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--summarize-only", action="store_true", help="read the run directory, do not train")
    args = parser.parse_args()
    config = finetune.FinetuneConfig(mode="zero3", steps=args.steps, batch_size=8, context_length=64, lr=args.lr,
                                     compute_dtype=args.compute_dtype, eval_every=30, eval_batches=16,
                                     eval_full_precision=0, seed=0)
    model_file, tokens_file = RUNS / "smollm2.pt", RUNS / "data" / f"{args.corpus}.pt"
    run_dir = RUNS / f"{args.corpus}_{args.steps}_{args.lr:g}"
    if not args.summarize_only:
        finetune.prepare_files(model_file, tokens_file, TEXTS[args.corpus])
        flags = ["--data-dir", str(RUNS), "--run-dir", str(run_dir), "--model-file", str(model_file),
                 "--tokens-file", str(tokens_file), "--no-progress", *config_flags(config)]
        code = launch_local("zeropp.tools.bench.finetune", flags, 2, 2)
        if code:
            print(f"the run exited with status {code}; writing the evaluations it reached")
    result = summarize(run_dir, config, args.corpus)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'step':>5} {'held-out loss':>14} {'fall':>7}")
    for row in result["evals"]:
        print(f"{row['step']:>5} {row['val_loss']:>14.4f} {row['fall_percent']:>6.1f}%")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
