"""``zeropp plan``'s modes table: each mode's predicted step, memory and cross-node bytes, as
text or JSON, each priced on its layout (``zeropp.tools.plan.layout``: 1-D, HSDP, tensor parallel x
FSDP). With offload the rows add host memory and the host-device copies, and the memory column is
the device's ([Note: CPU offload in a step] and [Note: the optimizer on the host in a step] in
``zeropp.tools.plan.offload``); 2-D layouts are priced without offload only."""

from __future__ import annotations

import dataclasses
from typing import Any

from zeropp.config import ZeroPPConfig
from zeropp.setup.topology import Topology
from zeropp.tools.modes import MODES, Mode, System
from zeropp.tools.plan.cost import Machine, Workload, cross_node_bytes_per_node, memory, step_time
from zeropp.tools.plan.layout import Layout, layout_for
from zeropp.tools.plan.model import ModelShape
from zeropp.tools.plan.offload import host_memory, step_copies
from zeropp.tools.plan.traffic import expert_parallel_transfers, step_transfers


def mode_layout(mode: Mode, expert_parallel: int = 1) -> Layout | None:
    """The layout ``mode`` trains on: HSDP's, its tensor parallel degree's, or 1-D; with
    ``expert_parallel`` the experts on their own mesh, None for a mode that cannot have it
    priced (HSDP, tensor parallel, hpZ: [Note: expert parallel in the plan])."""
    if expert_parallel > 1:
        if mode.system is System.HSDP or mode.tensor_parallel > 1 or mode.hpz:
            return None
        return Layout(expert_parallel=expert_parallel)
    return Layout(tensor_parallel=mode.tensor_parallel, hsdp=mode.system is System.HSDP)


def mode_configs(modes: tuple[str, ...], ranks_per_node: int, offload: str = "none",
                 pin_memory: bool = True, expert_parallel: int = 1) -> dict[str, tuple[ZeroPPConfig | None, Layout]]:
    """The configurations to price by mode name, with their layouts: zeropp's 1-D ones with
    ``offload`` (``ZeroPPConfig.offload``); the 2-D ones only without offload: FSDP2's own HSDP
    (config None), HSDP with zeropp's options, tensor parallel x FSDP; with ``expert_parallel``
    those without hpZ on the experts' layout, without offload; DeepSpeed's never."""
    configs: dict[str, tuple[ZeroPPConfig | None, Layout]] = {}
    for name in modes:
        mode = MODES[name]
        layout = mode_layout(mode, expert_parallel)
        if mode.system is System.DEEPSPEED or layout is None or (offload != "none" and not layout.is_one_dimensional):
            continue
        if layout.is_one_dimensional:
            configs[name] = (mode.config(ranks_per_node, offload=offload, offload_pin_memory=pin_memory), layout)
        else:
            fsdp2_own = mode.system is System.HSDP and not mode.options
            configs[name] = (None if fsdp2_own else mode.config(ranks_per_node), layout)
    return configs


def mode_row(name: str, shape: ModelShape, config: ZeroPPConfig | None, topology: Topology, workload: Workload,
             machine: Machine, baseline_s: float, layout: Layout | None = None) -> dict[str, Any]:
    """One mode's predictions on rank 0: seconds, and bytes per rank (cross-node: per node);
    ``layout``: see ``zeropp.tools.plan.layout.layout_for``."""
    step = step_time(shape, config, topology, workload, machine, layout)
    tokens = expert_parallel_transfers(shape, topology, layout_for(config, layout), workload.precision,
                                       workload.batch_per_rank, workload.context_length,
                                       workload.activation_checkpointing)
    transfers = [t for unit in [*step_transfers(shape, config, topology, workload.precision, layout), *tokens]
                 for t in unit]
    device = memory(shape, config, topology, workload, layout=layout)
    host = host_memory(shape, config, topology)
    copies = step_copies(shape, config, topology)
    return {"mode": name, "step_s": step.step_s, "speedup_vs_zero3": baseline_s / step.step_s,
            "compute_s": step.compute_s, "exposed_s": step.exposed_s, "communication_s": step.communication_s,
            "host_copy_s": step.host_copy_s,
            "cross_node_bytes_per_node": cross_node_bytes_per_node(transfers, topology),
            "device_memory": {**dataclasses.asdict(device), "total": device.total},
            "host_memory": {**dataclasses.asdict(host), "total": host.total},
            "host_to_device_bytes": sum(c.to_device for c in copies),
            "device_to_host_bytes": sum(c.to_host for c in copies)}


def plan_record(shape: ModelShape, topology: Topology, workload: Workload, machine: Machine, modes: tuple[str, ...],
                offload: str = "none", pin_memory: bool = True, expert_parallel: int = 1) -> dict[str, Any]:
    """Every mode's row, and what they were priced on; ``speedup_vs_zero3`` is against ZeRO-3
    with the same offload (and expert parallel). ``offload_pin_memory`` says whether the host
    memory priced is pinned: ``pin_memory`` but with ``offload="optimizer"``, whose host tensors
    are pageable."""
    if expert_parallel > 1 and not shape.num_experts:
        raise ValueError(f"--expert-parallel={expert_parallel}: {shape.name} has no routed experts")
    if expert_parallel > 1 and offload != "none":
        raise ValueError(f"--expert-parallel={expert_parallel} is priced without offload, not --offload={offload}")
    configs = mode_configs(modes, topology.ranks_per_node, offload, pin_memory, expert_parallel)
    zero3, zero3_layout = mode_configs(("zero3",), topology.ranks_per_node, offload, pin_memory,
                                       expert_parallel)["zero3"]
    baseline_s = step_time(shape, zero3, topology, workload, machine, zero3_layout).step_s
    return {"model": shape.name, "num_parameters": shape.num_parameters, "active_parameters": shape.active_parameters,
            "expert_parallel": expert_parallel, "gpus": topology.world_size,
            "num_nodes": topology.num_nodes, "gpus_per_node": topology.ranks_per_node, "machine": machine.name,
            "batch_per_gpu": workload.batch_per_rank, "context": workload.context_length,
            "activation_checkpointing": workload.activation_checkpointing, "offload": offload,
            "offload_pin_memory": pin_memory and offload != "optimizer",
            "host_device_bytes_per_s": machine.host_device_bytes_per_s,
            "left_out": [name for name in modes if name not in configs and MODES[name].system is not System.DEEPSPEED],
            "modes": [mode_row(name, shape, config, topology, workload, machine, baseline_s, layout)
                      for name, (config, layout) in configs.items()]}


def format_record(record: dict[str, Any]) -> str:
    """The table ``zeropp plan`` prints: one row per mode; with offload, host memory (GB), the
    bytes copied to and from the device per step (GB) and their time as if nothing overlapped."""
    offload = record["offload"] != "none"
    width = max([10, *(len(row["mode"]) + 1 for row in record["modes"])])
    head = (f"{record['model']}: {record['num_parameters'] / 1e9:.2f}B parameters on {record['gpus']} GPUs "
            f"({record['num_nodes']} nodes x {record['gpus_per_node']}), {record['machine']}")
    if record.get("expert_parallel", 1) > 1:
        head += (f"; {record['active_parameters'] / 1e9:.2f}B active per token, expert parallel "
                 f"{record['expert_parallel']}")
    columns = (f"{'mode':<{width}}{'step s':>9}{'x zero3':>8}{'compute s':>10}{'exposed s':>10}{'x-node GB/node':>15}"
               f"{'device GB' if offload else 'memory GB':>10}")
    if offload:
        memory_kind = "pinned" if record["offload_pin_memory"] else "pageable"
        head += (f"; offload {record['offload']}, {memory_kind} host memory, host<->device "
                 f"{record['host_device_bytes_per_s'] / 1e9:g} GB/s each way per GPU")
        columns += f"{'host GB':>9}{'H2D GB':>9}{'D2H GB':>9}{'copy s':>8}"
    lines = [head, columns]
    for row in record["modes"]:
        line = (f"{row['mode']:<{width}}{row['step_s']:>9.3f}{row['speedup_vs_zero3']:>8.2f}{row['compute_s']:>10.3f}"
                f"{row['exposed_s']:>10.3f}{row['cross_node_bytes_per_node'] / 1e9:>15.2f}"
                f"{row['device_memory']['total'] / 1e9:>10.1f}")
        if offload:
            line += (f"{row['host_memory']['total'] / 1e9:>9.1f}{row['host_to_device_bytes'] / 1e9:>9.2f}"
                     f"{row['device_to_host_bytes'] / 1e9:>9.2f}{row['host_copy_s']:>8.3f}")
        lines.append(line)
    if record["left_out"] and record.get("expert_parallel", 1) > 1:
        lines.append(f"not priced with expert parallel: {', '.join(record['left_out'])} (HSDP, tensor parallel, hpZ)")
    elif record["left_out"]:
        lines.append(f"not priced with offload: {', '.join(record['left_out'])} (2-D layouts: HSDP, tensor parallel)")
    return "\n".join(lines)
