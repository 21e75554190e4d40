"""``zeropp plan --paper``: the ZeRO++ paper's figures predicted by the cost model, a bandwidth
sweep, and the H100 projection; a table, ``plan_paper.json`` and ``plan_paper.png``."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from zeropp.setup.topology import Topology
from zeropp.tools.plan import scale
from zeropp.tools.plan.cost import GBIT, Workload
from zeropp.tools.plan.traffic import Precision

TOLERANCE = 0.15
BANDWIDTHS_GBIT = (50, 100, 200, 400, 800, 1600)


def claim_verdict(predicted: float, low: float, high: float) -> float:
    """Relative distance of a predicted ratio from the paper's range (0 inside it)."""
    if low <= predicted <= high:
        return 0.0
    edge = low if predicted < low else high
    return (predicted - edge) / edge


def bandwidth_sweep(size: str = "18B", num_gpus: int = 384) -> list[dict[str, Any]]:
    """All three over ZeRO-3 at each per-node bandwidth, 1k and 2k tokens per GPU, both overlap bounds."""
    shape = scale.paper_model(size)
    topology = Topology(num_nodes=num_gpus // 16, ranks_per_node=16)
    rows = []
    for tokens in (1024, 2048):
        workload = Workload(batch_per_rank=tokens // scale.CONTEXT, context_length=scale.CONTEXT,
                            precision=scale.FP16, activation_checkpointing=True)
        for gbit in BANDWIDTHS_GBIT:
            for overlap in (1.0, 0.0):
                machine = dataclasses.replace(scale.V100_DGX2, inter_node_bytes_per_s=0.9 * gbit * GBIT,
                                              overlap=overlap)
                rows.append({"tokens_per_gpu": tokens, "node_gbit": gbit, "overlap": overlap,
                             **scale.speedup(shape, topology, workload, machine)})
    return rows


def per_technique(size: str = "18B", gbit: float = 100, tokens: int = 1024) -> dict[str, dict[str, float]]:
    """Each technique alone over ZeRO-3 at 384 V100s (both overlap bounds)."""
    shape = scale.paper_model(size)
    topology = Topology(num_nodes=24, ranks_per_node=16)
    workload = Workload(batch_per_rank=tokens // scale.CONTEXT, context_length=scale.CONTEXT, precision=scale.FP16,
                        activation_checkpointing=True)
    out = {}
    for overlap in (1.0, 0.0):
        machine = dataclasses.replace(scale.V100_DGX2, inter_node_bytes_per_s=0.9 * gbit * GBIT, overlap=overlap)
        out[f"overlap_{overlap:g}"] = {mode: scale.speedup(shape, topology, workload, machine, mode)["speedup"]
                                       for mode in ("qwz", "hpz", "qgz", "all")}
    return out


def run(out_dir: Path) -> dict[str, Any]:
    topology = Topology(num_nodes=24, ranks_per_node=16)
    volumes = {size: scale.volume_ratio(scale.paper_model(size), topology, scale.FP16) for size in scale.PAPER_MODELS}
    claims = scale.paper_table()
    for row in claims:
        for bound in ("overlap_1", "overlap_0"):
            row[bound]["distance_from_claim"] = claim_verdict(row[bound]["speedup"], row["paper_low"],
                                                              row["paper_high"])
    h100 = [*scale.h100_projection(overlap=1.0), *scale.h100_projection(overlap=0.0)]
    result = {"machines": {"v100": dataclasses.asdict(scale.V100_DGX2), "h100": dataclasses.asdict(scale.H100_NODE)},
              "volume": volumes, "claims": claims, "per_technique_100gbit_1k": per_technique(),
              "bandwidth_sweep": bandwidth_sweep(), "h100": h100, "tolerance": TOLERANCE,
              "h100_precision": str(Precision())}
    print(format_tables(result))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "plan_paper.json").write_text(json.dumps(result, indent=2, default=str))
    plot(result, out_dir / "plan_paper.png")
    print(f"wrote {out_dir / 'plan_paper.json'} and plan_paper.png")
    return result


def format_tables(result: dict[str, Any]) -> str:
    lines = ["cross-node bytes per node per step at 384 V100 (in fp16 model copies M):"]
    for size, v in result["volume"].items():
        lines.append(f"  GPT-{size}: ZeRO-3 {v['zero3_in_model_copies']:.3f} M, all three "
                     f"{v['all_in_model_copies']:.3f} M ({v['ratio']:.2f}x less)")
    lines.append(f"{'model':<10}{'paper claim at 384 GPUs':<52}{'ideal overlap':>14}{'none':>7}"
                 f"{'ZeRO-3 TF':>11}{'ZeRO++ TF':>11}")
    for row in result["claims"]:
        ideal, serial = row["overlap_1"], row["overlap_0"]
        lines.append(f"{row['model']:<10}{row['claim']:<52}{ideal['speedup']:>13.2f}x{serial['speedup']:>6.2f}x"
                     f"{serial['zero3_tflops']:>6.1f}-{ideal['zero3_tflops']:<4.1f}"
                     f"{serial['all_tflops']:>6.1f}-{ideal['all_tflops']:<4.1f}")
    lines.append("H100 projection (GPT 80 x 8192, 2k tokens per GPU): all three over ZeRO-3, ideal / no overlap")
    by_key = {(r["node_gbit"], r["gpus"], r["overlap"]): r for r in result["h100"]}
    gpus = sorted({r["gpus"] for r in result["h100"]})
    lines.append(f"{'node Gbit/s':<12}" + "".join(f"{g:>14}" for g in gpus))
    for gbit in sorted({r["node_gbit"] for r in result["h100"]}, reverse=True):
        cells = [f"{by_key[(gbit, g, 1.0)]['speedup']:.2f} / {by_key[(gbit, g, 0.0)]['speedup']:.2f}" for g in gpus]
        lines.append(f"{gbit:<12g}" + "".join(f"{c:>14}" for c in cells))
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """Speed-up against per-node bandwidth (384 V100s) and against GPUs (H100 nodes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, tokens in enumerate((1024, 2048)):
        for overlap, style in ((1.0, "-"), (0.0, "--")):
            rows = [r for r in result["bandwidth_sweep"] if r["tokens_per_gpu"] == tokens and r["overlap"] == overlap]
            left.plot([r["node_gbit"] for r in rows], [r["speedup"] for r in rows], style, color=f"C{i}",
                      marker="o", label=f"{tokens // 1024}k tokens/GPU, {'ideal' if overlap else 'no'} overlap")
    for claim in scale.PAPER_CLAIMS:
        color = "C0" if claim["tokens"] == 1024 else "C1"
        left.plot([claim["gbit"]] * 2, [claim["low"], claim["high"]], color=color, lw=6, alpha=0.35)
    left.set_xscale("log", base=2)
    left.set_xticks(BANDWIDTHS_GBIT, [str(b) for b in BANDWIDTHS_GBIT])
    left.set_xlabel("inter-node bandwidth per node (Gbit/s)")
    left.set_ylabel("all three / ZeRO-3 throughput")
    left.set_title("GPT-18B, 384 V100 (24 x 16); bars: the paper's figures")
    for i, gbit in enumerate(sorted({r["node_gbit"] for r in result["h100"]}, reverse=True)):
        for overlap, style in ((1.0, "-"), (0.0, "--")):
            rows = [r for r in result["h100"] if r["node_gbit"] == gbit and r["overlap"] == overlap]
            right.plot([r["gpus"] for r in rows], [r["speedup"] for r in rows], style, color=f"C{i}", marker="o",
                       label=f"{gbit:g} Gbit/s per node, {'ideal' if overlap else 'no'} overlap")
    right.set_xscale("log", base=2)
    gpus = sorted({r["gpus"] for r in result["h100"]})
    right.set_xticks(gpus, [str(g) for g in gpus])
    right.set_xlabel("H100 GPUs (8 per node)")
    right.set_title("GPT 80 x 8192, 2k tokens per GPU")
    for ax in (left, right):
        ax.axhline(1.0, color="black", lw=0.8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
