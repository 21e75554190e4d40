"""One real rank of a large job at Llama-3-8B's shapes, on this GPU.

``zeropp bench scale``'s rank ([Note: one real rank of a large job] in
``zeropp.tools.bench.scale_rank``) with its tensors and kernels on the GPU: PyTorch's fake process
group makes this process rank 0 of 64 or 1,024 ranks, 8 to a node, whose collectives return at
once. It sets up a 2-layer slice of Llama-3-8B (the real embedding, norm and head) under ZeRO-3,
each technique and all three, in bf16 with fp32 reduction, and trains it: so the step time is
this GPU's kernels with no network (the codes' kernels at full size included), the peak is the
CUDA allocator's beside ``zeropp plan``'s prediction for the same rank and FSDP2's memory
tracker's, and zeropp's share is the time its own Python frames take in a profiled step.

Every run is one part, the most telling first (ZeRO-3 and all three at both sizes), in one
process: a rank's set-up and teardown of the fake process group leave nothing behind. The
smoke form trains a narrow Llama at 16 ranks on the CPU.
"""

from __future__ import annotations

import gc
import importlib.util
from typing import Any

import torch

from zeropp.tools.check.record import Context, Record, Skip
from zeropp.tools.check.report import parts_table, table

RUNS = ((64, "zero3"), (64, "all"), (1024, "zero3"), (1024, "all"), (64, "qwz"), (64, "qgz"), (64, "hpz"),
        (1024, "qwz"), (1024, "qgz"), (1024, "hpz"))
SMOKE_RUNS = ((16, "zero3"), (16, "all"), (16, "qwz"), (16, "qgz"), (16, "hpz"))
SLICE_LAYERS = 2
TIMED_STEPS = 3
LEAST_RUN_S = 5.0
"""A run is not started on a GPU with less of the allotment left than this."""


def run(context: Context, record: Record) -> None:
    from zeropp.tools.bench import scale
    from zeropp.tools.bench.scale_rank import RunConfig
    from zeropp.tools.bench.scale_rank import run as run_rank

    if importlib.util.find_spec("transformers") is None:
        with record.part("llama"):
            raise Skip("needs transformers, whose Llama gives the shapes")
    model = "narrow" if context.smoke else "llama3-8b"
    shapes = {SLICE_LAYERS: scale.model_shape(model, SLICE_LAYERS)}
    for world_size, mode in SMOKE_RUNS if context.smoke else RUNS:
        with record.part(f"W={world_size} {mode}") as part:
            context.need(LEAST_RUN_S)
            config = RunConfig(world_size=world_size, rank=0, mode=mode, model=model, num_layers=SLICE_LAYERS,
                               device=context.device, timed_steps=1 if context.smoke else TIMED_STEPS)
            part.update(figures(scale.row("first", run_rank(config), shapes)))
            part["checks"] = {"zeropp plan's peak within 10% of the tracker's":
                              abs(part["plan_over_tracked"] - 1) <= scale.TOLERANCE}
        gc.collect()
        if context.device == "cuda":
            torch.cuda.empty_cache()


def figures(row: dict[str, Any]) -> dict[str, Any]:
    """What the table shows of one ``zeropp bench scale`` row."""
    out = {"world_size": row["world_size"], "mode": row["mode"], "model": row["config"]["model"],
           "device": row["config"]["device"], "setup_s": row["setup_s"], "profiled_step_s": row["step_s"],
           "step_s": row["plain_step_s"], "zeropp_python_s": row["zeropp_python_s"],
           "zeropp_share": row["zeropp_python_s"] / row["step_s"], "process_groups": row["process_groups"],
           "tracked_peak_bytes": row["peak_bytes"], "predicted_bytes": row["predicted"]["total"],
           "plan_over_tracked": row["predicted_over_measured"], "secondary_copy_bytes": row["secondary_copy_bytes"]}
    if "cuda_peak_bytes" in row:
        out["cuda_peak_bytes"] = row["cuda_peak_bytes"]
        out["plan_over_cuda_peak"] = row["predicted"]["total"] / row["cuda_peak_bytes"]
    return out


def summary(parts: dict[str, dict[str, Any]]) -> str:
    ran = [p for p in parts.values() if "step_s" in p]
    if not ran:
        return ""
    ratios = [p.get("plan_over_cuda_peak", p["plan_over_tracked"]) for p in ran]
    return (f"{len(ran)} runs; step {min(p['step_s'] for p in ran) * 1e3:.0f}-{max(p['step_s'] for p in ran) * 1e3:.0f}"
            f" ms; plan / measured peak {min(ratios):.2f}-{max(ratios):.2f}")


def markdown(parts: dict[str, dict[str, Any]]) -> list[str]:
    mib = 2**20
    header = ["W", "mode", "step ms", "profiled ms", "zeropp's share", "CUDA peak MiB", "tracked peak MiB", "plan MiB",
              "plan / CUDA peak", "plan / tracked", "set-up s", "groups"]
    rows = [[p["world_size"], p["mode"], f"{p['step_s'] * 1e3:.1f}", f"{p['profiled_step_s'] * 1e3:.1f}",
             f"{p['zeropp_share']:.1%}", f"{p['cuda_peak_bytes'] / mib:.0f}" if "cuda_peak_bytes" in p else "",
             f"{p['tracked_peak_bytes'] / mib:.0f}", f"{p['predicted_bytes'] / mib:.0f}",
             f"{p['plan_over_cuda_peak']:.3f}" if "plan_over_cuda_peak" in p else "", f"{p['plan_over_tracked']:.3f}",
             f"{p['setup_s']:.2f}", p["process_groups"]] for p in parts.values() if "step_s" in p]
    return [*parts_table(parts), "", *table(header, rows)]
