"""qgZ: the hierarchical quantized reduce-scatter is the exact mean within a proven bound."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

import zeropp
from distributed import run_distributed
from models import train_on_corpus
from zeropp.codes import gradcode
from zeropp.codes.codec import Segment
from zeropp.codes.gradcode import GradientCode
from zeropp.codes.quant import error_bound, quantize
from zeropp.setup.topology import Topology, build_process_groups
from zeropp.techniques.qgz import HierarchicalQuantizedReduceScatter, intra_node_send_order
from zeropp.tools.bench.qgz_error import simulate

BLOCK = 32
TWO_BY_TWO = {"ZEROPP_RANKS_PER_NODE": "2"}


@pytest.mark.parametrize("num_nodes,ranks_per_node", list(itertools.product(range(1, 9), repeat=2)))
def test_remap_delivers_every_chunk_to_its_owner(num_nodes: int, ranks_per_node: int) -> None:
    """Simulate both hops over all N x D ranks with symbolic chunks (no process group): each rank
    must end with exactly the chunk owed to it, from every rank once."""
    world = num_nodes * ranks_per_node
    order = intra_node_send_order(num_nodes, ranks_per_node).tolist()
    assert sorted(order) == list(range(world))
    # hop 1: rank (n, d) sends its send-buffer block j (N slots) to local rank j of its node
    after_hop1 = {}
    for n, d in itertools.product(range(num_nodes), range(ranks_per_node)):
        received = [[] for _ in range(num_nodes)]  # per slot n2: (source rank, chunk) pairs
        for source_d in range(ranks_per_node):
            source = n * ranks_per_node + source_d
            block = order[d * num_nodes:(d + 1) * num_nodes]
            for slot, chunk in enumerate(block):
                received[slot].append((source, chunk))
        after_hop1[(n, d)] = received
    # hop 2: partial slot n2 goes to node n2 (same local index)
    for n, d in itertools.product(range(num_nodes), range(ranks_per_node)):
        me = n * ranks_per_node + d
        contributions = [pair for n_src in range(num_nodes) for pair in after_hop1[(n_src, d)][n]]
        assert sorted(source for source, _ in contributions) == list(range(world))
        assert {chunk for _, chunk in contributions} == {me}


def _segment_bound(x: torch.Tensor, bits: int, segments: list[int]) -> torch.Tensor:
    """Per-element quantization bound scale/2 of ``x`` quantized segment by segment."""
    parts, offset = [], 0
    for numel in segments:
        piece = x[offset:offset + numel]
        offset += numel
        _, scales = quantize(piece, bits, BLOCK)
        parts.append(error_bound(scales, BLOCK, numel))
    return torch.cat(parts)


def _blockwise_max(values: torch.Tensor, segments: list[int]) -> torch.Tensor:
    """Each element replaced by the max of ``values`` over its quantization block."""
    parts, offset = [], 0
    for numel in segments:
        piece = torch.nn.functional.pad(values[offset:offset + numel], (0, -numel % BLOCK))
        offset += numel
        parts.append(piece.view(-1, BLOCK).amax(dim=1).repeat_interleave(BLOCK)[:numel])
    return torch.cat(parts)


def reference_and_bound(inputs: list[torch.Tensor], topology: Topology, rank: int, segments: list[int],
                        bits_intra: int, bits_inter: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact fp32 sum of chunk ``rank`` over all ranks, and the bound on qgZ's error for it.

    Hop 1: node n's partial is the sum of its D ranks' chunk, each quantized once except the
    one its receiver (local index of ``rank``) holds itself: error e1(n) <= sum over the other
    ranks of scale/2 (scale of that rank's block). Hop 2 requantizes the partial of every node
    but ``rank``'s own, whose block absmax is at most the exact partial's plus e1, so e2(n) <=
    (absmax + max e1) / qmax / 2. The total error is sum over nodes of e1 + e2, plus fp32
    summation rounding.
    """
    chunk = inputs[0].numel() // topology.world_size
    mine = [x[rank * chunk:(rank + 1) * chunk].float() for x in inputs]
    exact = torch.stack(mine).double().sum(0)
    bound = torch.zeros(chunk, dtype=torch.float64)
    local_index, my_node = rank % topology.ranks_per_node, rank // topology.ranks_per_node
    for node in range(topology.num_nodes):
        ranks = topology.node_ranks(node)
        partial = sum(mine[r].double() for r in ranks)
        e1 = torch.zeros(chunk, dtype=torch.float64)
        for r in ranks:
            if r != ranks[local_index]:  # the receiver's own rows are not quantized
                e1 += _segment_bound(mine[r], bits_intra, segments).double()
        if node != my_node:
            qmax = 2 ** (bits_inter - 1) - 1
            absmax = _blockwise_max(partial.abs() + e1, segments)
            e2 = absmax / qmax / 2
        else:
            e2 = torch.zeros(chunk, dtype=torch.float64)
        bound += e1 + e2
    rounding = 1e-6 * sum(m.double().abs() for m in mine) + 1e-30
    return exact, bound + rounding


LAYOUTS = {4: [(1, 4), (4, 1), (2, 2)], 6: [(2, 3), (3, 2)], 8: [(2, 4)]}
CODES = [GradientCode(rotation="hadamard", levels="normal"), GradientCode(rotation="hadamard", rounding="stochastic"),
         GradientCode(levels="normal", scale_bits=8)]


def _block_factors(values: torch.Tensor, segments: list[int], bits: int,
                   code: GradientCode) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block of ``values`` (rows, chunk): the block's absmax in level units, taken after the
    rotation where whole blocks are rotated (a Hadamard matrix with the code's signs, built here),
    and the factor sqrt(n) x (half a level gap, or a whole one for stochastic rounding) that
    turns it into the L2 bound on one coding's error. Shapes (rows, num_blocks), (num_blocks,)."""
    gap = gradcode.max_level_gap(bits, BLOCK, code)
    per_element = (gap if code.rounding == "stochastic" else gap / 2) * (
        1.0 if code.levels == "normal" and bits in gradcode.NORMAL_LEVEL_BITS else 1 / (2 ** (bits - 1) - 1))
    hadamard = torch.ones(1, 1, dtype=torch.float64)
    while hadamard.shape[0] < BLOCK:
        hadamard = torch.kron(torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64), hadamard)
    rotation = gradcode._rotation(BLOCK, "cpu")[:, :1].double().sign() * hadamard / BLOCK ** 0.5
    absmaxes, factors, offset = [], [], 0
    for numel in segments:
        for start in range(0, numel, BLOCK):
            block = values[:, offset + start:offset + min(start + BLOCK, numel)].double()
            if block.shape[1] == BLOCK and code.rotation == "hadamard":
                block = block @ rotation
            absmaxes.append(block.abs().amax(dim=1))
            factors.append(block.shape[1] ** 0.5 * per_element)
        offset += numel
    return torch.stack(absmaxes, dim=1), torch.tensor(factors, dtype=torch.float64)


def _scale_absmax(absmax: torch.Tensor, segments: list[int], code: GradientCode) -> torch.Tensor:
    """``absmax`` (rows, num_blocks) raised to what the code's scale covers: with 8-bit scales
    one step (2**(1/32)) above it, plus the floor 2**(-254/32) under its group's largest
    (a group is 16 blocks of one segment; here each segment is one group)."""
    if not code.grouped_scales:
        return absmax
    parts, first = [], 0
    for numel in segments:
        group = absmax[:, first:first + -(-numel // BLOCK)]
        parts.append(group * 2 ** (1 / 32) * (1 + 1e-6) + group.amax(dim=1, keepdim=True) * 2 ** (-254 / 32))
        first += group.shape[1]
    return torch.cat(parts, dim=1)


def _blocks_l2(values: torch.Tensor, segments: list[int]) -> torch.Tensor:
    """Per block of the flat ``values``: its L2 norm (num_blocks,)."""
    norms, offset = [], 0
    for numel in segments:
        norms += [values[offset + start:offset + min(start + BLOCK, numel)].double().norm()
                  for start in range(0, numel, BLOCK)]
        offset += numel
    return torch.stack(norms)


def reference_and_block_bound(inputs: list[torch.Tensor], topology: Topology, rank: int, segments: list[int],
                              bits_intra: int, bits_inter: int,
                              code: GradientCode) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact sum of chunk ``rank`` and, per block, the L2 bound on qgZ's error with ``code``:
    hop 1 adds at most the bound of each row that travels; hop 2 codes the partial, whose absmax
    (rotated or not) exceeds the exact partial's by at most the hop-1 error's L2 norm."""
    chunk = inputs[0].numel() // topology.world_size
    mine = torch.stack([x[rank * chunk:(rank + 1) * chunk].double() for x in inputs])
    local_index, my_node = rank % topology.ranks_per_node, rank // topology.ranks_per_node
    total = torch.zeros(len(_blocks_l2(mine[0], segments)), dtype=torch.float64)
    for node in range(topology.num_nodes):
        ranks = topology.node_ranks(node)
        senders = [r for r in ranks if r != ranks[local_index]]
        e1 = torch.zeros_like(total)
        if senders:
            absmax, factor = _block_factors(mine[senders], segments, bits_intra, code)
            e1 = (_scale_absmax(absmax, segments, code) * factor).sum(0)
        total += e1
        if node != my_node:
            absmax, factor = _block_factors(mine[ranks].sum(0, keepdim=True), segments, bits_inter, code)
            total += factor * _scale_absmax(absmax + e1, segments, code)[0]
    rounding = 1e-5 * _blocks_l2(mine.abs().sum(0), segments) + 1e-30
    return mine.sum(0), total + rounding


def _qgz_worker(rank: int, world_size: int) -> list[dict]:
    results = []
    chunk, segments = 100, [60, 40]  # two parameters' slices per chunk
    for num_nodes, ranks_per_node in LAYOUTS[world_size]:
        topology = Topology(num_nodes=num_nodes, ranks_per_node=ranks_per_node)
        groups = build_process_groups(topology)
        for bits_intra, bits_inter, dtype in [(4, 4, torch.float32), (8, 4, torch.bfloat16), (8, 2, torch.float32)]:
            comm = HierarchicalQuantizedReduceScatter(
                groups, [world_size * s for s in segments], bits_intra=bits_intra,
                bits_inter=bits_inter, block_size=BLOCK)
            inputs = [torch.randn(world_size * chunk, generator=torch.Generator().manual_seed(r)).to(dtype)
                      for r in range(world_size)]
            inputs[0][7] = 30.0  # an outlier, in the block of chunk 0 only
            out = torch.empty(chunk, dtype=dtype)
            comm(out, inputs[rank].clone(), groups.mesh.get_group(), dist.ReduceOp.AVG)
            exact, bound = reference_and_bound(inputs, topology, rank, segments, bits_intra, bits_inter)
            # the output dtype rounds the mean once more: half an ulp
            ulp = exact.abs() / world_size * (2 ** -8 if dtype == torch.bfloat16 else 2 ** -23)
            error = (out.double() - exact / world_size).abs()
            excess = (error - (bound / world_size + ulp)).max().item()
            results.append({"layout": (num_nodes, ranks_per_node), "dtype": str(dtype),
                            "excess": excess, "max_error": error.max().item(),
                            "max_bound": (bound / world_size).max().item()})
        for label, op, factor in [("SUM", dist.ReduceOp.SUM, 1.0),  # the other ops FSDP2 asks for
                                  ("PREMUL_SUM(1)", dist._make_nccl_premul_sum(1.0), 1.0),
                                  ("PREMUL_SUM(1/3)", dist._make_nccl_premul_sum(1 / 3), 1 / 3)]:
            comm = HierarchicalQuantizedReduceScatter(groups, [world_size * s for s in segments], bits_intra=4,
                                                      bits_inter=4, block_size=BLOCK)
            inputs = [torch.randn(world_size * chunk, generator=torch.Generator().manual_seed(r))
                      for r in range(world_size)]
            inputs[0][7] = 30.0
            out = torch.empty(chunk)
            comm(out, inputs[rank].clone(), groups.mesh.get_group(), op)
            exact, bound = reference_and_bound(inputs, topology, rank, segments, 4, 4)
            # the factor scales the sum and its bound; the product rounds once more (an ulp is ample)
            error = (out.double() - factor * exact).abs()
            excess = (error - factor * (bound + exact.abs() * 2 ** -23)).max().item()
            results.append({"layout": (num_nodes, ranks_per_node), "dtype": label, "excess": excess,
                            "max_error": error.max().item(), "max_bound": (factor * bound).max().item()})
        for code in CODES:
            comm = HierarchicalQuantizedReduceScatter(groups, [world_size * s for s in segments], bits_intra=4,
                                                      bits_inter=4, block_size=BLOCK, code=code, seed=3)
            inputs = [torch.randn(world_size * chunk, generator=torch.Generator().manual_seed(r))
                      for r in range(world_size)]
            inputs[0][7] = 30.0
            out = torch.empty(chunk)
            comm(out, inputs[rank].clone(), groups.mesh.get_group(), dist.ReduceOp.AVG)
            exact, bound = reference_and_block_bound(inputs, topology, rank, segments, 4, 4, code)
            error = _blocks_l2(out.double() - exact / world_size, segments)
            results.append({"layout": (num_nodes, ranks_per_node), "dtype": str(code),
                            "excess": (error - bound / world_size).max().item(), "max_error": error.max().item(),
                            "max_bound": (bound / world_size).max().item()})
            again = torch.empty(chunk)  # a fresh comm with the same seed draws the same uniforms
            HierarchicalQuantizedReduceScatter(groups, [world_size * s for s in segments], bits_intra=4, bits_inter=4,
                                               block_size=BLOCK, code=code, seed=3)(
                again, inputs[rank].clone(), groups.mesh.get_group(), dist.ReduceOp.AVG)
            simulated = simulate(torch.stack([x[rank * chunk:(rank + 1) * chunk] for x in inputs]).view(
                num_nodes, ranks_per_node, chunk), [Segment(s, 4) for s in segments], 4, 4, code,
                rank % ranks_per_node, rank // ranks_per_node, torch.Generator().manual_seed(0), block_size=BLOCK)
            results.append({"reproducible": torch.equal(out, again), "code": str(code),
                            "simulated": torch.equal(out, simulated) if code.rounding == "nearest" else None})
        results += _spared_cases(groups, topology, rank, world_size, chunk, segments)
        results += _wide_cases(groups, topology, rank, world_size, chunk, segments)
        # AVG is the mean, not ranks-per-node times it (DeepSpeed's bug): all-ones gradients
        ones = torch.ones(world_size * chunk)
        out = torch.empty(chunk)
        comm(out, ones, groups.mesh.get_group(), dist.ReduceOp.AVG)
        summed = torch.empty(chunk)
        comm(summed, ones, groups.mesh.get_group(), dist.ReduceOp.SUM)
        results.append({"layout": (num_nodes, ranks_per_node), "mean_of_ones": out.tolist(),
                        "sum_of_ones": summed.tolist()})
    return results


def _spared_cases(groups, topology: Topology, rank: int, world_size: int, chunk: int,
                  segments: list[int]) -> list[dict]:
    """qgZ with the first parameter's gradient spared (sent unquantized), then every one: per
    element, the excess of the error over its bound, spared elements bounded by fp32 summation
    alone ([Note: full-precision gradients])."""
    results = []
    cases = [([True, False], torch.float32), ([True, False], torch.bfloat16), ([True, True], torch.float32)]
    for spared, dtype in cases:
        comm = HierarchicalQuantizedReduceScatter(groups, [world_size * s for s in segments], bits_intra=4,
                                                  bits_inter=4, block_size=BLOCK, full_precision=spared)
        inputs = [torch.randn(world_size * chunk, generator=torch.Generator().manual_seed(10 + r)).to(dtype)
                  for r in range(world_size)]
        inputs[0][7] = 30.0
        out = torch.empty(chunk, dtype=dtype)
        comm(out, inputs[rank].clone(), groups.mesh.get_group(), dist.ReduceOp.AVG)
        exact, bound = reference_and_bound(inputs, topology, rank, segments, 4, 4)
        mine = torch.stack([x[rank * chunk:(rank + 1) * chunk].double() for x in inputs])
        rounding = 1e-6 * mine.abs().sum(0)  # fp32 sums of world_size terms, in any order
        is_spared = torch.cat([torch.full((numel,), flag) for numel, flag in zip(segments, spared)])
        bound = torch.where(is_spared, rounding, bound) / world_size
        ulp = exact.abs() / world_size * (2 ** -8 if dtype == torch.bfloat16 else 2 ** -23)
        error = (out.double() - exact / world_size).abs()
        results.append({"spared": spared, "dtype": str(dtype), "spared_excess": (error - bound - ulp).max().item(),
                        "quantized_error": error[~is_spared].max().item() if not all(spared) else None})
    return results


def _wide_cases(groups, topology: Topology, rank: int, world_size: int, chunk: int,
                segments: list[int]) -> list[dict]:
    """qgZ at INT4/INT4 with the first parameter's gradient coded at 8 bits on both hops
    ([Note: wide gradients]): per element, the excess of the error over its own width's bound."""
    comm = HierarchicalQuantizedReduceScatter(groups, [world_size * s for s in segments], bits_intra=4,
                                              bits_inter=4, block_size=BLOCK, wide=[True, False])
    plain = HierarchicalQuantizedReduceScatter(groups, [world_size * s for s in segments], bits_intra=4,
                                               bits_inter=4, block_size=BLOCK)
    inputs = [torch.randn(world_size * chunk, generator=torch.Generator().manual_seed(20 + r))
              for r in range(world_size)]
    out = torch.empty(chunk)
    comm(out, inputs[rank].clone(), groups.mesh.get_group(), dist.ReduceOp.AVG)
    exact, bound4 = reference_and_bound(inputs, topology, rank, segments, 4, 4)
    _, bound8 = reference_and_bound(inputs, topology, rank, segments, 8, 8)
    is_wide = torch.cat([torch.full((numel,), flag) for numel, flag in zip(segments, [True, False])])
    error = (out.double() - exact / world_size).abs()
    bound = torch.where(is_wide, bound8, bound4) / world_size
    return [{"wide_excess": (error - bound).max().item(), "wide_error": error[is_wide].max().item(),
             "int4_bound_there": (bound4[is_wide] / world_size).max().item(),
             "payload_bytes": (comm.codec(chunk, 4).nbytes, plain.codec(chunk, 4).nbytes)}]


@pytest.mark.parametrize("world_size", [pytest.param(w, marks=[pytest.mark.slow] * (w > 4)) for w in sorted(LAYOUTS)])
def test_hierarchical_reduce_scatter_within_bound(world_size: int) -> None:
    """Against the exact fp32 mean for layouts 1x4, 4x1, 2x2, 2x3, 3x2, 2x4, INT4/INT4 and
    INT8/INT4, fp32 and bf16: every element within the two-hop bound of reference_and_bound; the
    same for the sum (SUM, PREMUL_SUM(1.0)) and a third of it (PREMUL_SUM(1/3)), the bound
    scaled alike; with
    the lower-error codes (rotation with normal levels, rotation with stochastic rounding, normal
    levels with 8-bit block scales), every
    block within the L2 bound of reference_and_block_bound; with a parameter's gradient spared
    (fp32, bf16) or all of them, spared elements within fp32 summation of the exact mean; with a
    parameter's gradient coded at 8 bits (``wide``), its elements within INT8's bound."""
    all_ranks = run_distributed(_qgz_worker, world_size)
    worst: dict = {}  # (layout, dtype) -> (max error, max bound) over the ranks; shown with -s
    for r in (r for rank_results in all_ranks for r in rank_results if "excess" in r):
        key = (r["layout"], r["dtype"])
        error, bound = worst.get(key, (0.0, 0.0))
        worst[key] = (max(error, r["max_error"]), max(bound, r["max_bound"]))
    print(worst)
    for rank_results in all_ranks:
        for r in rank_results:
            if "wide_excess" in r:  # wide gradients within INT8's bound, far below INT4's; the others INT4's
                assert r["wide_excess"] <= 0, r
                assert 0 < r["wide_error"] < r["int4_bound_there"] / 4, r
                wide_bytes, plain_bytes = r["payload_bytes"]
                assert wide_bytes > plain_bytes, r
            elif "spared" in r:  # spared gradients exact up to fp32 summation, the others within the bound
                assert r["spared_excess"] <= 0, r
                assert r["quantized_error"] is None or r["quantized_error"] > 1e-3, r
            elif "reproducible" in r:  # stochastic rounding replays with its seed; the benchmark's
                assert r["reproducible"], r  # one-process simulation is the comm, bit for bit
                assert r["simulated"] in (True, None), r
            elif "excess" in r:
                assert r["excess"] <= 0, r
                assert r["max_error"] > 0, "no quantization error at all: was anything quantized?"
            else:
                assert r["mean_of_ones"] == pytest.approx([1.0] * 100, abs=1e-6), r["layout"]
                assert r["sum_of_ones"] == pytest.approx([float(world_size)] * 100, rel=1e-6)


def _own_rows_worker(rank: int, world_size: int, num_nodes: int) -> bool:
    topology = Topology(num_nodes=num_nodes, ranks_per_node=world_size // num_nodes)
    groups = build_process_groups(topology)
    comm = HierarchicalQuantizedReduceScatter(groups, [world_size * 100], bits_intra=4, bits_inter=4,
                                              block_size=BLOCK, error_feedback=True)
    # Every rank sends zeros, except for the chunk it owns: no row that travels carries anything.
    gradient = torch.zeros(world_size, 100)
    gradient[rank] = torch.randn(100, generator=torch.Generator().manual_seed(rank))
    out = torch.empty(100)
    results = []
    for _ in range(2):  # the second call adds error feedback's residuals: zero for kept rows
        comm(out, gradient.view(-1).clone(), groups.mesh.get_group(), dist.ReduceOp.SUM)
        results.append(torch.equal(out, gradient[rank]))
    return all(results)


@pytest.mark.parametrize("num_nodes", [pytest.param(1, marks=pytest.mark.slow), 2,
                                       pytest.param(4, marks=pytest.mark.slow)])
def test_qgz_keeps_a_ranks_own_rows_exact(num_nodes: int) -> None:
    """A rank's own share never travels, so it is summed unquantized: with every travelling row
    zero (quantized exactly), each rank's output equals its own chunk bit for bit. Quantizing
    the own rows too (DeepSpeed's way) would round them to 4 bits."""
    assert run_distributed(_own_rows_worker, 4, num_nodes) == [True] * 4


def _train_qgz_worker(rank: int, world_size: int, steps: int) -> dict:
    modes = {"zero3": zeropp.ZeroPPConfig(),
             "qgz": zeropp.ZeroPPConfig(quantized_gradients=True),
             "qgz_ef": zeropp.ZeroPPConfig(quantized_gradients=True, error_feedback=True)}
    return {name: train_on_corpus(config, steps, rank, world_size) for name, config in modes.items()}


@pytest.mark.slow
def test_qgz_trains_like_zero3_and_cuts_cross_node_gradient_bytes() -> None:
    """2x2, GPT on Shakespeare, 100 steps, fp32 (bf16 gradients take qgZ's path too, see
    test_field_failures; bf16 matmuls are slow on CPU): final validation loss within 2% of
    ZeRO-3's (1% with error feedback). Cross-node gradient bytes: per element of the flat
    gradient ZeRO-3 sends (N - 1)/N x 4 bytes across nodes, qgZ (N - 1)/N / D x (0.5 + 4/256)
    (INT4 codes and an fp32 scale per 256, on the inter-node hop only): 0.064x on 2x2, which
    padding each parameter to whole blocks and 4-byte alignment raise on this small model; the
    bound allows about twice that, 0.135x."""
    r = run_distributed(_train_qgz_worker, 4, 100, env=TWO_BY_TWO, timeout=600)[0]
    base = r["zero3"]["val_loss"]
    print({name: run["val_loss"] for name, run in r.items()})
    assert base < r["zero3"]["losses"][0] - 1.0, "ZeRO-3 did not learn: the comparison proves little"
    assert abs(r["qgz"]["val_loss"] - base) <= 0.02 * base
    assert abs(r["qgz_ef"]["val_loss"] - base) <= 0.01 * base
    zero3_rs = r["zero3"]["ledger"]["by_phase"]["backward"]
    zero3_cross = r["zero3"]["ledger"]["by_op"]["reduce_scatter"]["cross_node_bytes"]
    qgz_cross = r["qgz"]["ledger"]["by_op"]["all_to_all"]["cross_node_bytes"]
    assert "reduce_scatter" not in r["qgz"]["ledger"]["by_op"], "a reduce-scatter fell back to full precision"
    assert qgz_cross <= 0.135 * zero3_cross, qgz_cross / zero3_cross
    assert zero3_rs["calls"] > 0


def _order_control_worker(rank: int, world_size: int, steps: int) -> dict:
    from zeropp.tools.modes import MODES

    return {name: train_on_corpus(MODES[name].config(ranks_per_node=2), steps, rank, world_size)
            for name in ("zero3", "zero3_order", "qgz")}


def test_order_control_trains_as_zero3_up_to_summation_order() -> None:
    """``zero3_order`` (qgZ, every gradient spared) on 2x2: its losses follow ZeRO-3's within fp32
    summation noise (1e-5 relative over 6 steps) where INT4 qgZ's move by more than 1e-4; its
    gradients travel in two fp32 all-to-alls, no reduce-scatter."""
    r = run_distributed(_order_control_worker, 4, 6, env=TWO_BY_TWO)[0]
    base = torch.tensor(r["zero3"]["losses"])
    assert torch.allclose(torch.tensor(r["zero3_order"]["losses"]), base, rtol=1e-5, atol=0)
    assert (torch.tensor(r["qgz"]["losses"]) - base).abs().max() > 1e-4 * base.max()
    by_op = r["zero3_order"]["ledger"]["by_op"]
    assert "reduce_scatter" not in by_op and by_op["all_to_all"]["calls"] > 0


def _sliced_worker(rank: int, world_size: int) -> list[dict]:
    """Each case's output with and without slices, on every layout of this world size."""
    results = []
    chunk, segments = 1000, [600, 37, 363]  # a long, a short and a medium parameter slice per chunk
    cases = [dict(bits_intra=4, bits_inter=4), dict(bits_intra=8, bits_inter=4),
             dict(bits_intra=4, bits_inter=4, code=GradientCode(levels="normal", scale_bits=8)),
             dict(bits_intra=4, bits_inter=4, code=GradientCode(rotation="hadamard", levels="normal")),
             dict(bits_intra=4, bits_inter=4, full_precision=[False, True, False]),
             dict(bits_intra=4, bits_inter=4, error_feedback=True)]
    for num_nodes, ranks_per_node in LAYOUTS[world_size]:
        groups = build_process_groups(Topology(num_nodes=num_nodes, ranks_per_node=ranks_per_node))
        for case, (dtype, op) in itertools.product(cases, [(torch.float32, dist.ReduceOp.AVG),
                                                           (torch.bfloat16, dist.ReduceOp.SUM)]):
            outputs, slices = [], 0
            # ~3 blocks of 32 per slice at 4+ ranks; the grouped code's unit is 16 blocks, one per slice
            for slice_bytes in (None, 3 * BLOCK * 4 * world_size):
                comm = HierarchicalQuantizedReduceScatter(groups, [world_size * s for s in segments],
                                                          block_size=BLOCK, slice_bytes=slice_bytes, **case)
                out = []
                for step in range(2):  # error feedback carries a residual into the second call
                    inputs = torch.randn(world_size * chunk, generator=torch.Generator().manual_seed(rank + 10 * step))
                    inputs[7] = 30.0
                    result = torch.empty(chunk, dtype=dtype)
                    comm(result, inputs.to(dtype), groups.mesh.get_group(), op)
                    out.append(result)
                outputs.append(torch.stack(out))
                slices = max(slices, len(comm.slices(chunk)))
            results.append({"case": f"{(num_nodes, ranks_per_node)} {case} {dtype}", "slices": slices,
                            "equal": torch.equal(outputs[0], outputs[1])})
    return results


@pytest.mark.parametrize("world_size", [pytest.param(w, marks=[pytest.mark.slow] * (w > 4)) for w in sorted(LAYOUTS)])
def test_slices_give_the_unsliced_gradients_bit_for_bit(world_size: int) -> None:
    """qgZ over column slices of a few blocks, run as a pipeline ([Note: qgZ slices], [Note: qgZ
    slices in a pipeline]), against the same comm in one slice, on the layouts 1x4, 4x1, 2x2,
    2x3, 3x2, 2x4: INT4/INT4, INT8/INT4, normal levels with 8-bit block scales, rotation with
    normal levels, a spared parameter, error feedback over two calls; fp32 with AVG and bf16
    with SUM. Every output is equal bit for bit, and every case did
    run in several slices."""
    for rank_results in run_distributed(_sliced_worker, world_size):
        for result in rank_results:
            assert result["slices"] > 1 and result["equal"], result


def _train_sliced(rank: int, world_size: int) -> dict:
    import dataclasses

    from models import global_batch, make_model, rows
    from zeropp.tools.modes import MODES

    losses = {}
    for slice_bytes, overlap in ((None, False), (4 * BLOCK * 4 * world_size, False),
                                 (4 * BLOCK * 4 * world_size, True)):
        config = dataclasses.replace(MODES["all"].config(2), grad_slice_bytes=slice_bytes, block_size=BLOCK,
                                     overlap=overlap)
        model = zeropp.shard(make_model("gpt"), config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses[slice_bytes, overlap] = []
        for step in range(3):
            x, y = (rows(t, rank, world_size) for t in global_batch(step, 4 * world_size))
            loss = model(x, y)[1]
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[slice_bytes, overlap].append(loss.item())
    sliced = max(len(c.slices(sum(c.padded_numels) // world_size))
                 for c in zeropp.sharded_comms(model).qgz)
    return {"unsliced": losses[None, False], "sliced": losses[4 * BLOCK * 4 * world_size, False],
            "sliced, late": losses[4 * BLOCK * 4 * world_size, True], "most_slices": sliced}


def test_grad_slice_bytes_trains_bit_for_bit_as_one_slice() -> None:
    """``ZeroPPConfig.grad_slice_bytes`` through ``zeropp.shard``: all three techniques on 2 x 2
    train the GPT to the same losses, bit for bit, with slices of 4 blocks as in one slice, and
    with ``overlap`` too (each unit's last slice finishing late, [Note: qgZ slices in a pipeline])."""
    result = run_distributed(_train_sliced, 4, env=TWO_BY_TWO)[0]
    assert result["most_slices"] > 1
    assert result["sliced"] == result["unsliced"] == result["sliced, late"], result
