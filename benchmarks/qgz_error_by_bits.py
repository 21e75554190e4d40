"""qgZ's reduce-scatter error by bits per hop: relative RMS error of the AVG result against the
exact fp64 mean, 2 nodes x 2 ranks on gloo, Gaussian gradients, 65536 elements per chunk,
block 256. Run from the repository root: ``.venv/bin/python benchmarks/qgz_error_by_bits.py``."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from distributed import run_distributed  # noqa: E402
from zeropp.qgz import HierarchicalQuantizedReduceScatter  # noqa: E402
from zeropp.topology import Topology, build_process_groups  # noqa: E402

CHUNK = 65536
BITS = ((4, 4), (8, 4), (4, 8), (8, 8))  # (intra-node hop, cross-node hop)


def _relative_errors(rank: int, world_size: int) -> list[float]:
    groups = build_process_groups(Topology(num_nodes=2, ranks_per_node=2))
    inputs = [torch.randn(world_size * CHUNK, generator=torch.Generator().manual_seed(r))
              for r in range(world_size)]
    exact = torch.stack(inputs).double().mean(0)[rank * CHUNK:(rank + 1) * CHUNK]
    errors = []
    for bits_intra, bits_inter in BITS:
        comm = HierarchicalQuantizedReduceScatter(groups, [world_size * CHUNK], bits_intra=bits_intra,
                                                  bits_inter=bits_inter, block_size=256)
        out = torch.empty(CHUNK)
        comm(out, inputs[rank].clone(), groups.mesh.get_group(), dist.ReduceOp.AVG)
        errors.append(((out.double() - exact).norm() / exact.norm()).item())
    return errors


if __name__ == "__main__":
    per_rank = run_distributed(_relative_errors, 4, env={"ZEROPP_RANKS_PER_NODE": "2"})
    print("bits (intra, inter)  relative RMS error, ranks 0..3")
    for i, bits in enumerate(BITS):
        print(f"{str(bits):<20} " + "  ".join(f"{errors[i]:.4f}" for errors in per_rank))
