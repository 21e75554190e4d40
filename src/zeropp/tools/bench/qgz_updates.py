"""What a gradient code does to the entries Adam magnifies: those whose true mean is zero or tiny.

Part of ``zeropp bench qgz-error``. A code's RMS error is dominated by the large entries; but
Adam divides each entry's update by the root of its own running second moment, so an error on
an entry whose true gradient is zero (the embedding row of a character absent from every
rank's batch) or tiny (a feature no rank used much) becomes an update of full size, on every
step, in a direction the data never asked for. Per code, on the real gradients of several steps
(the same weights, the next batches of the same stream), measured over every rank's output:

- ``relative_rms``: ``||out - mean|| / ||mean||`` over all entries, as the rest of the benchmark;
- ``zero_entries`` and ``zero_error``: how many entries have an exact zero mean, and the RMS of
  the code's output there relative to the RMS of the mean over all entries (0 when the code
  keeps a zero a zero);
- ``small_relative_rms``: the error on the 10% smallest nonzero entries by magnitude, relative
  to their own RMS;
- ``update_error``: ``||u(out) - u(mean)|| / ||u(mean)||`` with ``u(g) = g_T / sqrt(v + eps)``,
  ``v`` the mean of ``g_t ** 2`` over the steps (Adam's second moment, bias-corrected, over a
  short stream), ``eps = 1e-8``; and ``zero_update``: the mean ``|u(out)|`` on the exact-zero
  entries, where ``u(mean)`` is 0 (1 is a full-size Adam step).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zeropp.codes.codec import Segment
from zeropp.tools.bench.qgz_error import OPTIONS, Option, _gradients, simulate

STEPS = 4
"""Gradients per stream: enough for a second moment that is not one step's square."""
ADAM_EPS = 1e-8
SPARE_BELOW = 1024
"""The ``grad_full_precision_below`` measured (modes ``qgz_spare``, ``all_spare``)."""


@dataclass(frozen=True)
class Case:
    """A code as a mode runs it: hop widths, the block code, and which parameters it spares."""

    bits: tuple[int, int]
    option: Option
    spare_below: int = 0


CASES = {
    "plain 4/4 (default)": Case((4, 4), OPTIONS["plain"]),
    "plain 8/4": Case((8, 4), OPTIONS["plain"]),
    f"plain 4/4, spare < {SPARE_BELOW}": Case((4, 4), OPTIONS["plain"], SPARE_BELOW),
    "normal+scale8 8/4 (all_scale8)": Case((8, 4), OPTIONS["normal+scale8"]),
    "hadamard+normal 8/4 (all_rotnorm)": Case((8, 4), OPTIONS["hadamard+normal"]),
}
LAYOUTS = {"gpt": ((2, 2), (4, 8)), "gpt_6x192": ((2, 2),), "gpt_4x96": ((2, 2),), "smollm2": ((2, 2),)}
"""2 x 2 is the convergence grid's layout; SmolLM2 takes one backward per rank and step (slow)."""


def stream(model_name: str, world_size: int, steps: int = STEPS) -> tuple[list[torch.Tensor], list[int]]:
    """Per step, every rank's gradient as (W ranks, W chunks, S): chunk c of a rank is its slice
    of every parameter owed to rank c (each parameter padded to a multiple of 8 W, as FSDP2 pads
    dim 0); and the parameters' numels."""
    per_step, numels = [], []
    for step in range(steps):
        gradients = _gradients(model_name, world_size, step)
        numels = [g.numel() for g in gradients[0]]
        padded = [-(-n // (world_size * 8)) * world_size * 8 for n in numels]
        ranks = [torch.cat([torch.nn.functional.pad(g.flatten(), (0, p - g.numel())).view(world_size, -1)
                            for g, p in zip(per_rank, padded)], dim=1) for per_rank in gradients]
        per_step.append(torch.stack(ranks))
    return per_step, numels


def segments(numels: Sequence[int], world_size: int, spare_below: int) -> list[Segment]:
    """The chunk's segments: one per parameter, quantized (4 bits; the hop sets the width) or spared."""
    return [Segment(-(-n // (world_size * 8)) * 8, None if n < spare_below else 4) for n in numels]


def outputs(gradients: torch.Tensor, num_nodes: int, case: Case, chunk_segments: list[Segment]) -> torch.Tensor:
    """qgZ's AVG output of every rank (W, S), from (W ranks, W chunks, S) gradients."""
    ranks_per_node = gradients.shape[0] // num_nodes
    result = []
    for owner in range(gradients.shape[0]):
        chunks = gradients[:, owner].reshape(num_nodes, ranks_per_node, -1)
        result.append(simulate(chunks, chunk_segments, *case.bits, case.option.code, owner % ranks_per_node,
                               owner // ranks_per_node, block_size=case.option.block_size))
    return torch.stack(result)


def measure(per_step: list[torch.Tensor], numels: Sequence[int], num_nodes: int, case: Case) -> dict[str, float]:
    """The module's metrics for one code over a stream of steps."""
    world_size = per_step[0].shape[0]
    chunk_segments = segments(numels, world_size, case.spare_below)
    exact = [g.double().mean(dim=0).flatten() for g in per_step]
    coded = [outputs(g, num_nodes, case, chunk_segments).double().flatten() for g in per_step]
    last, out = exact[-1], coded[-1]
    zero = last == 0
    magnitude = last.abs().masked_fill(zero, float("inf"))
    small = magnitude <= magnitude.kthvalue(max(1, int(0.1 * int((~zero).sum())))).values
    rms = last.pow(2).mean().sqrt()
    update_exact, update_coded = _adam_update(exact), _adam_update(coded)
    return {"relative_rms": ((out - last).norm() / last.norm()).item(),
            "zero_entries": int(zero.sum()),
            "zero_error": (out[zero].pow(2).mean().sqrt() / rms).item() if zero.any() else 0.0,
            "small_relative_rms": ((out - last)[small].norm() / last[small].norm()).item(),
            "update_error": ((update_coded - update_exact).norm() / update_exact.norm()).item(),
            "zero_update": update_coded[zero].abs().mean().item() if zero.any() else 0.0}


def _adam_update(gradients: list[torch.Tensor]) -> torch.Tensor:
    """The last step's ``g / sqrt(v + eps)``, ``v`` the mean of the squares over the stream."""
    second_moment = torch.stack(gradients).pow(2).mean(dim=0)
    return gradients[-1] / (second_moment + ADAM_EPS).sqrt()


def run() -> list[dict[str, Any]]:
    """Every model, layout and case; one row each, printed as it comes."""
    rows = []
    for model_name, layouts in LAYOUTS.items():
        for num_nodes, ranks_per_node in layouts:
            per_step, numels = stream(model_name, num_nodes * ranks_per_node)
            for name, case in CASES.items():
                rows.append({"data": model_name, "layout": f"{num_nodes}x{ranks_per_node}", "case": name,
                             **measure(per_step, numels, num_nodes, case)})
                print(row_text(rows[-1]), flush=True)
    return rows


def row_text(row: dict[str, Any]) -> str:
    return (f"{row['data']:<8} {row['layout']:<5} {row['case']:<36} rms {row['relative_rms']:.4f}  "
            f"zeros {row['zero_entries']} at {row['zero_error']:.4f}  small10 {row['small_relative_rms']:.3f}  "
            f"adam {row['update_error']:.4f}  adam@zero {row['zero_update']:.3f}")


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: one line per data, layout and case."""
    lines = ["| data | layout | code | relative RMS | exact-zero entries: output RMS | smallest 10%: relative "
             "error | Adam update error | Adam step on zero entries |", "|---|---|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['data']} | {r['layout']} | {r['case']} | {r['relative_rms']:.4f} | {r['zero_error']:.4f} "
              f"({r['zero_entries']}) | {r['small_relative_rms']:.3f} | {r['update_error']:.4f} | "
              f"{r['zero_update']:.3f} |" for r in rows]
    return "\n".join(lines)


SMOLLM2_SHAPE = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                 "num_attention_heads": 9, "num_key_value_heads": 3, "tie_word_embeddings": True}
"""SmolLM2-135M's shape (its GGUF file's header), for byte counts without loading its weights."""


def spared_byte_cost(spare_below: int = SPARE_BELOW) -> list[dict[str, Any]]:
    """Per model shape: the share of parameters spared by ``grad_full_precision_below`` and the
    gradient bytes qgZ sends at INT4 with and without sparing them (fp32 instead of 4.125 bits)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from zeropp.codes.codec import payload_bytes
    from zeropp.tools.models import GPT, GPTConfig

    with torch.device("meta"):
        models = {"demo GPT 4x128": GPT(GPTConfig(vocab_size=65)),
                  "GPT 8x512 (bench step)": GPT(GPTConfig(vocab_size=65, num_layers=8, num_heads=8, embed_dim=512)),
                  "SmolLM2-135M": LlamaForCausalLM(LlamaConfig(**SMOLLM2_SHAPE))}
    rows = []
    for name, model in models.items():
        numels = [p.numel() for p in model.parameters()]
        plain = payload_bytes([Segment(n, 4) for n in numels], 256, torch.float32)
        spared = payload_bytes([Segment(n, None if n < spare_below else 4) for n in numels], 256, torch.float32)
        rows.append({"model": name, "parameters": sum(numels), "spared_parameters": sum(n for n in numels
                                                                                        if n < spare_below),
                     "int4_bytes": plain, "spared_bytes": spared, "extra_percent": 100 * (spared / plain - 1)})
    return rows


def write(out_dir: str | Path = "benchmarks/results") -> dict[str, Any]:
    """``run`` and ``spared_byte_cost`` into ``<out_dir>/qgz_error_updates.json``; prints the table."""
    started = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = {"updates": run(), "spared_bytes": spared_byte_cost(), "seconds": time.perf_counter() - started}
    (out / "qgz_error_updates.json").write_text(json.dumps(results, indent=1))
    print(table(results["updates"]))
    return results


def add_to(results: dict[str, Any], path: Path) -> None:
    """The updates' rows and the spared parameters' byte cost added to ``zeropp bench qgz-error``'s
    results, rewritten to ``path``."""
    results.update(updates=run(), spared_bytes=spared_byte_cost())
    path.write_text(json.dumps(results, indent=1))
    print(table(results["updates"]))
