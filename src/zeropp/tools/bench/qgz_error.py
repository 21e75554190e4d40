"""``zeropp bench qgz-error``: how far qgZ's reduce-scatter lands from the exact mean, per option,
bit pair, data and layout, up to 48 nodes x 8 ranks.

qgZ's output for the rank (n, d) depends only on every rank's chunk owed to it: hop 1 codes, on
each node, the chunks of its D - 1 other ranks and sums them with the receiver's own (exact);
hop 2 codes the partial sums of the N - 1 other nodes and sums them with its own node's. So one
process can compute that rank's output for any N x D from W = N x D chunks, with the codec qgZ
uses (``ChunkCodec``): ``simulate``. On 2 x 2 it matches the gloo comm bit for bit (tested).

Measures per case: the relative RMS error ``||out - mean|| / ||mean||`` against the fp64 mean,
and the bias, the same ratio for the error averaged over ``trials`` runs on the same chunks
(stochastic rounding draws anew each run; rounding to nearest repeats itself, so its bias is its
error). Data: Gaussian, Student-t (nu = 3), and real gradients: the demo GPT's and SmolLM2's
(first two layers, with the real embedding and head), one micro-batch of Shakespeare per rank.
What a code does to zero and tiny entries, and to an Adam-normalised update, is measured by
``zeropp.tools.bench.qgz_updates`` (its ``updates`` rows).
Outputs: ``qgz_error.json``, ``qgz_error.png`` (error vs number of nodes) and printed tables.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zeropp.codes.codec import ChunkCodec, Segment, payload_bytes, segments_for
from zeropp.codes.gradcode import GradientCode

BLOCK_SIZE = 256


@dataclass(frozen=True)
class Option:
    """A gradient code and the block size it is measured at."""

    code: GradientCode
    block_size: int = BLOCK_SIZE

    def bits_per_element(self, bits: int) -> float:
        """Wire bits per element of a long segment at ``bits`` (codes and scales)."""
        numel = 1 << 20
        segment = Segment(numel, bits, grouped_scales=self.code.grouped_scales)
        return payload_bytes([segment], self.block_size, torch.float32) * 8 / numel


OPTIONS: dict[str, Option] = {
    "plain": Option(GradientCode()),
    "hadamard": Option(GradientCode(rotation="hadamard")),
    "stochastic": Option(GradientCode(rounding="stochastic")),
    "normal": Option(GradientCode(levels="normal")),
    "hadamard+normal": Option(GradientCode(rotation="hadamard", levels="normal")),
    "normal+scale8": Option(GradientCode(levels="normal", scale_bits=8), 64),
    "hadamard+normal+scale8": Option(GradientCode(rotation="hadamard", levels="normal", scale_bits=8), 64),
}
"""Block 256 with fp32 scales (4.125 bits per element at INT4), or block 64 with 8-bit scales
under an fp32 one per 16 blocks (4.156 bits, +0.8%): the same bytes within 1%."""
BIT_PAIRS = ((4, 4), (8, 4), (8, 8))
"""(intra-node, cross-node) bits; INT4/INT4 is DeepSpeed's and zeropp's default."""
LAYOUTS = ((2, 2), (2, 4), (4, 2), (48, 8))
NODE_SWEEP = ((2, 8), (4, 8), (8, 8), (16, 8), (48, 8))
"""Layouts of 8 ranks per node, for how the error grows with the number of nodes."""
CHUNK_NUMEL = {2: 65536, 4: 32768, 8: 16384, 16: 8192, 48: 4096}
"""Elements of the measured chunk, by number of nodes (W chunks of it are held at once)."""


GPT_SHAPES = {"gpt": (4, 128), "gpt_6x192": (6, 192), "gpt_4x96": (4, 96)}
"""Layers and width of the GPTs measured: the demo's, the convergence grid's wide setting (rows of
192: whole blocks of 64, not of 256), and a width of 96, whose rows share blocks of 64 too."""


def simulate(chunks: torch.Tensor, segments: Sequence[Segment], bits_intra: int, bits_inter: int,
             code: GradientCode, local_index: int, node: int, generator: torch.Generator | None = None,
             block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """qgZ's AVG output (fp32) for rank (``node``, ``local_index``) from ``chunks`` (N, D, S): row
    (n, d) is the chunk that rank n * D + d holds for this rank. Same codec, same order of sums."""
    num_nodes, ranks_per_node, numel = chunks.shape
    partials = chunks[:, local_index].float()
    if ranks_per_node > 1:
        others = [d for d in range(ranks_per_node) if d != local_index]
        decoded = _round_trip(chunks[:, others].reshape(-1, numel), segments, bits_intra, code, generator,
                              block_size).view(num_nodes, len(others), numel)
        rows = torch.empty((num_nodes, ranks_per_node, numel))
        rows[:, others], rows[:, local_index] = decoded, partials
        partials = rows.sum(dim=1)
    total = partials[node]
    if num_nodes > 1:
        others = [n for n in range(num_nodes) if n != node]
        rows = torch.empty((num_nodes, numel))
        rows[others] = _round_trip(partials[others], segments, bits_inter, code, generator, block_size)
        rows[node] = partials[node]
        total = rows.sum(dim=0)
    return total / (num_nodes * ranks_per_node)


def _round_trip(rows: torch.Tensor, segments: Sequence[Segment], bits: int, code: GradientCode,
                generator: torch.Generator | None, block_size: int) -> torch.Tensor:
    codec = ChunkCodec([Segment(s.numel, None if s.bits is None else bits, grouped_scales=code.grouped_scales)
                        for s in segments], block_size, torch.float32, code)
    packed = torch.empty((len(rows), codec.nbytes), dtype=torch.uint8)
    codec.encode(rows.contiguous(), packed, generator)
    decoded = torch.empty(rows.shape, dtype=torch.float32)
    codec.decode(packed, decoded)
    return decoded


def synthetic_chunks(distribution: str, num_nodes: int, ranks_per_node: int, numel: int,
                     seed: int = 0) -> torch.Tensor:
    """(N, D, S) chunks, independent per rank: "gaussian" or "student_t" (nu = 3)."""
    generator = torch.Generator().manual_seed(seed)
    shape = (num_nodes, ranks_per_node, numel)
    if distribution == "gaussian":
        return torch.randn(shape, generator=generator)
    normal = torch.randn(shape, generator=generator, dtype=torch.float64)
    chi2 = torch.randn((*shape, 3), generator=generator, dtype=torch.float64).pow(2).sum(-1)
    return (normal / (chi2 / 3).sqrt()).float()


def gradient_chunks(model_name: str, world_size: int) -> tuple[torch.Tensor, list[Segment]]:
    """(W, S) real gradient chunks, one per rank: its gradient on its own micro-batch, cut as FSDP2
    cuts a unit holding every parameter, and the chunk owed to rank 0; and the chunk's segments
    (one per parameter)."""
    gradients = _gradients(model_name, world_size)
    numels = [g.numel() for g in gradients[0]]
    padded = [-(-n // (world_size * 8)) * world_size * 8 for n in numels]
    segments = segments_for(padded, [True] * len(padded), world_size, 4)
    rows = []
    for per_parameter in gradients:
        pieces = [torch.nn.functional.pad(g.flatten(), (0, p - g.numel()))[:p // world_size]
                  for g, p in zip(per_parameter, padded)]
        rows.append(torch.cat(pieces))
    return torch.stack(rows), segments


def _gradients(model_name: str, world_size: int, step: int = 0) -> list[list[torch.Tensor]]:
    """Each rank's gradients (one list per rank, one tensor per parameter) on its micro-batch of
    ``step`` (the same initial weights at every step)."""
    from zeropp.tools.data import CharCorpus

    torch.manual_seed(0)
    if model_name in GPT_SHAPES:
        from zeropp.tools.models import GPT, GPTConfig

        corpus = CharCorpus.shakespeare()
        num_layers, embed_dim = GPT_SHAPES[model_name]
        model = GPT(GPTConfig(vocab_size=corpus.vocab_size, context_length=64, num_layers=num_layers,
                              num_heads=embed_dim // 32, embed_dim=embed_dim))

        def loss(rank: int) -> torch.Tensor:
            return model(*corpus.batch_at("train", step * world_size + rank, 16, 64, 0))[1]
    else:
        from zeropp.tools.data.corpus import shakespeare_text
        from zeropp.tools.models.smollm import load_smollm2

        model, tokenizer = load_smollm2(num_layers=2)
        tokens = torch.tensor(tokenizer.encode(shakespeare_text()[:200_000]).ids)

        def loss(rank: int) -> torch.Tensor:
            index = step * world_size + rank
            window = tokens[index * 33:(index + 1) * 33][None]
            return model(input_ids=window[:, :-1], labels=window[:, :-1].clone()).loss
    model.train()
    result = []
    for rank in range(world_size):
        model.zero_grad(set_to_none=True)
        loss(rank).backward()
        result.append([p.grad.detach().clone() for p in model.parameters() if p.grad is not None])
    return result


def measure(chunks: torch.Tensor, segments: Sequence[Segment], bits: tuple[int, int], option: Option,
            trials: int) -> dict[str, float]:
    """Relative RMS error and bias of rank (0, 0)'s output against the fp64 mean of ``chunks``."""
    exact = chunks.double().mean(dim=(0, 1))
    code = option.code
    generator = torch.Generator().manual_seed(1) if code.rounding == "stochastic" else None
    runs = trials if generator is not None else 1
    errors = [simulate(chunks, segments, *bits, code, 0, 0, generator, option.block_size).double() - exact
              for _ in range(runs)]
    norm = exact.norm()
    return {"relative_rms": (sum(e.norm() for e in errors) / runs / norm).item(),
            "relative_bias": (sum(errors).div(runs).norm() / norm).item()}


def run(out_dir: str | Path = "benchmarks/results", *, quick: bool = False, trials: int = 8) -> dict[str, Any]:
    """Every case; writes ``qgz_error.json`` and ``qgz_error.png`` under ``out_dir`` (the updates'
    part, ``zeropp.tools.bench.qgz_updates``, writes its own file)."""
    started = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    layouts = ((2, 2),) if quick else LAYOUTS
    data: dict[str, Callable[[int, int], tuple[torch.Tensor, list[Segment]]]] = {
        name: _synthetic(name, quick) for name in ("gaussian", "student_t")}
    if not quick:
        data.update(gpt=_real("gpt"), smollm2=_real("smollm2"))
    rows = []
    for name, make in data.items():
        for num_nodes, ranks_per_node in layouts:
            if name == "smollm2" and num_nodes * ranks_per_node > 8:
                continue  # a SmolLM2 backward per rank: 384 of them would take most of an hour here
            chunks, segments = make(num_nodes, ranks_per_node)
            for bits in BIT_PAIRS:
                for option, settings in OPTIONS.items():
                    rows.append({"data": name, "layout": f"{num_nodes}x{ranks_per_node}", "bits": list(bits),
                                 "option": option, **measure(chunks, segments, bits, settings, trials)})
                    print(_row_text(rows[-1]), flush=True)
    sweep = [] if quick else _node_sweep(trials)
    options = {name: {"code": str(o.code), "block_size": o.block_size,
                      "cross_node_bits_per_element": o.bits_per_element(4)} for name, o in OPTIONS.items()}
    results = {"options": options, "trials": trials, "rows": rows, "node_sweep": sweep, "updates": [],
               "spared_bytes": [], "seconds": time.perf_counter() - started}
    (out / "qgz_error.json").write_text(json.dumps(results, indent=1))
    if sweep:
        plot(out / "qgz_error.png", sweep)
    print(table(rows))
    print(f"\nwrote {out / 'qgz_error.json'}")
    return results


def _synthetic(distribution: str, quick: bool) -> Callable[[int, int], tuple[torch.Tensor, list[Segment]]]:
    def make(num_nodes: int, ranks_per_node: int) -> tuple[torch.Tensor, list[Segment]]:
        numel = 8192 if quick else CHUNK_NUMEL[num_nodes]
        return synthetic_chunks(distribution, num_nodes, ranks_per_node, numel), [Segment(numel, 4)]
    return make


def _real(model_name: str) -> Callable[[int, int], tuple[torch.Tensor, list[Segment]]]:
    def make(num_nodes: int, ranks_per_node: int) -> tuple[torch.Tensor, list[Segment]]:
        rows, segments = gradient_chunks(model_name, num_nodes * ranks_per_node)
        return rows.view(num_nodes, ranks_per_node, -1), segments
    return make


def _node_sweep(trials: int) -> list[dict[str, Any]]:
    """Gaussian chunks, 8 ranks per node, 2 to 48 nodes: INT4/INT4 plain and the options at 8/4."""
    rows = []
    for num_nodes, ranks_per_node in NODE_SWEEP:
        numel = CHUNK_NUMEL[num_nodes]
        chunks = synthetic_chunks("gaussian", num_nodes, ranks_per_node, numel)
        for bits, option in (((4, 4), "plain"), ((8, 4), "plain"), ((8, 4), "hadamard+normal"),
                             ((4, 4), "hadamard+normal"), ((8, 4), "normal+scale8")):
            rows.append({"num_nodes": num_nodes, "ranks_per_node": ranks_per_node, "bits": list(bits),
                         "option": option, **measure(chunks, [Segment(numel, 4)], bits, OPTIONS[option], trials)})
            print(_row_text({**rows[-1], "data": "gaussian", "layout": f"{num_nodes}x{ranks_per_node}"}), flush=True)
    return rows


def _row_text(row: dict[str, Any]) -> str:
    return (f"{row['data']:<10} {row['layout']:<5} {row['bits'][0]}/{row['bits'][1]} {row['option']:<16} "
            f"rms {row['relative_rms']:.4f}  bias {row['relative_bias']:.4f}")


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: relative RMS error per data, layout and bits (rows) and option (columns),
    with each option's ratio to plain INT4/INT4 on the same data and layout."""
    options = list(OPTIONS)
    lines = ["| data | layout | bits | " + " | ".join(options) + " |", "|---|---|---|" + "---:|" * len(options)]
    index = {(r["data"], r["layout"], tuple(r["bits"]), r["option"]): r["relative_rms"] for r in rows}
    for data, layout, bits in dict.fromkeys((r["data"], r["layout"], tuple(r["bits"])) for r in rows):
        base = index[(data, layout, (4, 4), "plain")]
        cells = [f"{index[(data, layout, bits, o)]:.4f} ({index[(data, layout, bits, o)] / base:.2f}x)"
                 for o in options]
        lines.append(f"| {data} | {layout} | {bits[0]}/{bits[1]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(path: Path, sweep: list[dict[str, Any]]) -> None:
    """Relative RMS error against the number of nodes (8 ranks per node), per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for bits, option in dict.fromkeys((tuple(r["bits"]), r["option"]) for r in sweep):
        points = [(r["num_nodes"], r["relative_rms"]) for r in sweep
                  if tuple(r["bits"]) == bits and r["option"] == option]
        ax.plot(*zip(*points), "o-", label=f"INT{bits[0]}/INT{bits[1]} {option}")
    nodes = sorted({r["num_nodes"] for r in sweep})
    ax.set(xscale="log", xlabel="nodes (8 ranks each)", ylabel="relative RMS error vs exact mean",
           title="qgZ reduce-scatter error, Gaussian gradients")
    ax.set_xticks(nodes, [str(n) for n in nodes])
    ax.minorticks_off()
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
