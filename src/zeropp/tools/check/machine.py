"""What ``zeropp check`` runs on: the versions, the CPU, and each GPU torch sees."""

from __future__ import annotations

import os
import platform
import re
from typing import Any

import torch


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as cpuinfo:
            names = [line.split(":", 1)[1].strip() for line in cpuinfo if "model name" in line]
        if names:
            return names[0]
    return platform.processor()


def describe() -> dict[str, Any]:
    """Versions, CPU and GPUs of this machine, as the results record them."""
    cpu = cpu_name()
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _triton_version(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu,
        "num_cpus": os.cpu_count(),
        "num_gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "gpus": [_gpu(index) for index in range(torch.cuda.device_count())] if torch.cuda.is_available() else [],
    }


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def _gpu(index: int) -> dict[str, Any]:
    """One GPU's name, capability, memory and nominal memory bandwidth (where torch reports the
    memory's clock and bus width: two transfers per clock, as HBM and GDDR count them)."""
    props = torch.cuda.get_device_properties(index)
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", None), getattr(props, "memory_bus_width", None)
    return {
        "name": props.name,
        "capability": f"{props.major}.{props.minor}",
        "memory_bytes": props.total_memory,
        "multiprocessors": props.multi_processor_count,
        "nominal_bandwidth_gbps": 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9 if clock_khz and bus_bits else None,
    }


def slug(machine: dict[str, Any]) -> str:
    """The results folder's name for this machine: the first GPU's name in lower case with
    dashes ("nvidia-h100-80gb-hbm3"), or "cpu-smoke" without a GPU."""
    if not machine["gpus"]:
        return "cpu-smoke"
    return re.sub(r"[^a-z0-9]+", "-", machine["gpus"][0]["name"].lower()).strip("-")
