"""The sections of ``zeropp check``, most valuable first, each with its share of the budget."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class Section:
    """One section: a module whose ``run(context, record)`` measures, and whose
    ``summary(parts)`` and ``markdown(parts)`` describe what it recorded."""

    name: str
    module: str
    share: float
    """Its fraction of the budget; what earlier sections leave unused passes on to it."""
    summary: str
    """What it proves or measures, for the table and ``--help``."""
    min_s: float
    """Less time than this left for it (GPU form): skipped, it could not finish its first part."""
    min_gpus: int = 0
    """GPUs it needs; with fewer it is skipped, saying so."""

    def unavailable(self, machine: dict[str, Any], smoke: bool) -> str | None:
        """Why this section cannot run on ``machine``, or None."""
        if not self.min_gpus:
            return None
        have = 0 if smoke else machine["num_gpus"]
        if have >= self.min_gpus:
            return None
        return (f"NCCL needs {self.min_gpus} GPUs, one per rank; this machine has {have}"
                + (" (the smoke form runs on the CPU)" if smoke and machine["num_gpus"] else ""))


SECTIONS: dict[str, Section] = {section.name: section for section in (
    Section(name="correctness", module="zeropp.tools.check.correctness", share=0.50, min_s=30.0,
            summary="pytest of the CUDA tests: the codec's bytes, Triton's kernels, every technique's multi-rank "
                    "run on CUDA tensors against the same run on the CPU"),
    Section(name="kernels", module="zeropp.tools.check.kernels", share=0.07, min_s=15.0,
            summary="encode/decode GB/s of every code at 2, 4 and 8 bits (torch path, Triton, C) against a "
                    "device copy of the same bytes"),
    Section(name="rank", module="zeropp.tools.check.rank", share=0.20, min_s=30.0,
            summary="one real rank of a 64- and a 1,024-rank job at Llama-3-8B shapes (fake process group, "
                    "bf16): step time, peak memory against zeropp plan, zeropp's share of the step"),
    Section(name="gpu_only", module="zeropp.tools.check.gpu_only", share=0.15, min_s=20.0,
            summary="what needs a GPU to mean anything: torch.compile of the blocks with qwZ, bf16 and fp16 "
                    "training end to end, CPU offload, torchao's float8 training"),
    Section(name="nccl", module="zeropp.tools.check.nccl", share=0.08, min_s=20.0, min_gpus=2,
            summary="qwZ, hpZ and qgZ on NCCL, one GPU per rank"),
)}
