"""The ZeRO++ paper's evaluation, reproduced on paper, and a projection to H100 clusters
(``zeropp plan --paper``).

[Note: the paper's setup]
Wang et al., "ZeRO++" (ICLR 2024) and its DeepSpeed blog: 384 V100 SXM3 32 GB GPUs, 16 per node
(NVSwitch), nodes joined by InfiniBand at 400 Gbit/s per node (four 100 Gbit/s links; "high
bandwidth") or 100 Gbit/s (one link; "low bandwidth"); GPT models of 18B to 138B parameters (the
18B one: 40 layers, width 6144, sequence 512, as in DeepSpeed's ZeRO++ tutorial) trained with
1k or 2k tokens per GPU, fp16, activation checkpointing. Its figures: 4x less cross-node volume
(3M to 0.75M); 28-36% more throughput at 400 Gbit/s with 1k tokens per GPU and 24-29% with 2k;
about 2x (up to 2.2x) at 100 Gbit/s; 2.16x at 384 GPUs (the abstract's headline; its model and
bandwidth are not stated beside it, and it sits with the low-bandwidth figures).

Machine constants (``V100_DGX2``): NVSwitch at 120 GB/s per GPU and direction (what NCCL's
bus bandwidth reaches of the 150 GB/s of six NVLink 2 links); InfiniBand at 90% of line rate;
52 TFLOP/s sustained per GPU, the best rate the paper reports (ZeRO++ at 41.6% of the V100's
125 TFLOP/s); 10 us per collective call and 2 us per ring step; to the host PCIe Gen3 x16, about
12 GB/s each way with pinned buffers (15.75 GB/s on the wire). How much of the prefetched
communication DeepSpeed's ZeRO-3 actually overlaps is the one constant the paper does not give;
the tables show both bounds (``overlap`` 1 and 0).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from zeropp.setup.topology import Topology
from zeropp.tools.modes import MODES
from zeropp.tools.plan import model as model_shape
from zeropp.tools.plan.cost import GBIT, Machine, Workload, achieved_flops, cross_node_bytes_per_node, memory, step_time
from zeropp.tools.plan.model import ModelShape
from zeropp.tools.plan.traffic import Precision, step_transfers

V100_DGX2 = Machine(name="DGX-2 (16 x V100 SXM3 32 GB), InfiniBand", ranks_per_node=16,
                    inter_node_bytes_per_s=0.9 * 400 * GBIT, intra_node_bytes_per_s=120e9, latency_s=10e-6,
                    hop_latency_s=2e-6, flops_per_s=52e12, codec_elements_per_s=100e9, memory_bytes=32e9,
                    host_device_bytes_per_s=12e9)
H100_NODE = Machine(name="8 x H100 SXM 80 GB, NVLink 4", ranks_per_node=8, inter_node_bytes_per_s=0.9 * 3200 * GBIT,
                    intra_node_bytes_per_s=360e9, latency_s=10e-6, hop_latency_s=2e-6, flops_per_s=400e12,
                    codec_elements_per_s=400e9, memory_bytes=80e9, host_device_bytes_per_s=50e9)
"""H100: 400 TFLOP/s sustained (40% of 989 dense bf16), NCCL's ~360 GB/s of NVLink 4's 450 GB/s
per direction, 8 x 400 Gbit/s InfiniBand per node (one NIC per GPU) unless changed; to the host
PCIe Gen5 x16, about 50 GB/s each way with pinned buffers (63 GB/s on the wire)."""

FP16 = Precision(gather_dtype=torch.float16, reduce_dtype=torch.float16)
"""The paper's traffic: fp16 weights and fp16 gradients (DeepSpeed's ZeRO-3 reduces in fp16)."""

PAPER_MODELS = {
    "18B": dict(num_layers=40, embed_dim=6144, num_heads=32),
    "138B": dict(num_layers=76, embed_dim=12288, num_heads=96),
}
"""GPT sizes: the tutorial's 18B, and a 138B of GPT-3's width (12 x 76 x 12288^2 = 137.7B)."""

PAPER_CLAIMS = [
    {"claim": "400 Gbit/s, 1k tokens per GPU: +28-36%", "gbit": 400, "tokens": 1024, "low": 1.28, "high": 1.36},
    {"claim": "400 Gbit/s, 2k tokens per GPU: +24-29%", "gbit": 400, "tokens": 2048, "low": 1.24, "high": 1.29},
    {"claim": "100 Gbit/s, 1k tokens per GPU: about 2x, up to 2.2x", "gbit": 100, "tokens": 1024, "low": 1.8,
     "high": 2.2},
    {"claim": "100 Gbit/s, 2k tokens per GPU: about 2x, up to 2.2x", "gbit": 100, "tokens": 2048, "low": 1.8,
     "high": 2.2},
]
"""The paper's throughput figures at 384 GPUs (speed-up of ZeRO++ over ZeRO-3), as ranges."""

CONTEXT = 512


def paper_model(size: str) -> ModelShape:
    return model_shape.transformer(**PAPER_MODELS[size], context_length=CONTEXT, name=f"GPT-{size}")


def speedup(shape: ModelShape, topology: Topology, workload: Workload, machine: Machine,
            mode: str = "all", baseline: str = "zero3") -> dict[str, float]:
    """Step times of ``baseline`` and ``mode`` and their ratio, with the TFLOP/s per GPU of each."""
    out = {}
    for name in (baseline, mode):
        config = MODES[name].config(topology.ranks_per_node)
        out[f"{name}_step_s"] = step_time(shape, config, topology, workload, machine).step_s
        out[f"{name}_tflops"] = achieved_flops(shape, config, topology, workload, machine) / 1e12
    out["speedup"] = out[f"{baseline}_step_s"] / out[f"{mode}_step_s"]
    return out


def volume_ratio(shape: ModelShape, topology: Topology, precision: Precision) -> dict[str, float]:
    """Cross-node bytes per node per step of ZeRO-3 and of all three, from the step's collectives."""
    volumes = {}
    for name in ("zero3", "all"):
        config = MODES[name].config(topology.ranks_per_node)
        transfers = [t for unit in step_transfers(shape, config, topology, precision) for t in unit]
        volumes[name] = cross_node_bytes_per_node(transfers, topology)
    parameters_bytes = shape.num_parameters * precision.gather_dtype.itemsize
    return {"zero3_bytes": volumes["zero3"], "all_bytes": volumes["all"],
            "zero3_in_model_copies": volumes["zero3"] / parameters_bytes,
            "all_in_model_copies": volumes["all"] / parameters_bytes, "ratio": volumes["zero3"] / volumes["all"]}


def paper_table(num_gpus: int = 384) -> list[dict[str, Any]]:
    """Each paper claim against the model, for both paper models and both overlap bounds."""
    topology = Topology(num_nodes=num_gpus // V100_DGX2.ranks_per_node, ranks_per_node=V100_DGX2.ranks_per_node)
    rows = []
    for size in PAPER_MODELS:
        shape = paper_model(size)
        for claim in PAPER_CLAIMS:
            workload = Workload(batch_per_rank=claim["tokens"] // CONTEXT, context_length=CONTEXT, precision=FP16,
                                activation_checkpointing=True)
            row = {"model": shape.name, "claim": claim["claim"], "paper_low": claim["low"],
                   "paper_high": claim["high"], "gpus": num_gpus}
            for overlap in (1.0, 0.0):
                machine = dataclasses.replace(V100_DGX2, inter_node_bytes_per_s=0.9 * claim["gbit"] * GBIT,
                                              overlap=overlap)
                result = speedup(shape, topology, workload, machine)
                row[f"overlap_{overlap:g}"] = result
            mem = memory(shape, MODES["all"].config(topology.ranks_per_node), topology, workload)
            row["all_memory_gb"] = mem.total / 1e9
            rows.append(row)
    return rows


def h100_projection(gpu_counts: tuple[int, ...] = (64, 256, 1024, 4096),
                    node_gbits: tuple[float, ...] = (3200, 200, 100), size: str = "70B",
                    overlap: float = 1.0) -> list[dict[str, Any]]:
    """ZeRO++ (all three) over ZeRO-3 on H100 nodes: speed-up by GPUs and per-node bandwidth for
    a 70B-class GPT (80 x 8192, sequence 2048, one sequence per GPU, activation checkpointing)."""
    shape = model_shape.transformer(num_layers=80, embed_dim=8192, num_heads=64, context_length=2048,
                                    name="GPT-64B (80 x 8192)") if size == "70B" else paper_model(size)
    workload = Workload(batch_per_rank=1, context_length=2048, precision=Precision(), activation_checkpointing=True)
    rows = []
    for gbit in node_gbits:
        machine = dataclasses.replace(H100_NODE, inter_node_bytes_per_s=0.9 * gbit * GBIT, overlap=overlap)
        for gpus in gpu_counts:
            topology = Topology(num_nodes=gpus // machine.ranks_per_node, ranks_per_node=machine.ranks_per_node)
            result = speedup(shape, topology, workload, machine)
            mem = {name: memory(shape, MODES[name].config(topology.ranks_per_node), topology, workload).total / 1e9
                   for name in ("zero3", "all")}
            rows.append({"model": shape.name, "gpus": gpus, "node_gbit": gbit, "overlap": overlap, **result,
                         "zero3_memory_gb": mem["zero3"], "all_memory_gb": mem["all"]})
    return rows
