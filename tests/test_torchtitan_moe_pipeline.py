"""zeropp on torchtitan's expert parallel x pipeline parallel layout, on 8 gloo ranks: the qwen3
MoE debug model (cut to 2 blocks of 8 experts, one block a stage) with expert parallel 2 and
pipeline 2 (1F1B), 4 nodes x 2 ranks, built by torchtitan's own config, ``pipeline_llm``,
``parallelize_qwen3`` and weight init; one training step through the schedule, against
torchtitan's own FSDP2 of the same layout.

The world mesh is ``(pp, fsdp)`` = 2 x 4: stage 0 on ranks 0-3 (nodes 0 and 1), stage 1 on ranks
4-7. Inside a stage, expert parallel takes pairs of consecutive ranks (a node), so each block's
routed experts are sharded over one rank of each node (``efsdp`` = {0, 2}, {1, 3} on stage 0) and
the rest of the block over the stage's four ranks: both groups span two nodes, and on 4 ranks
(``test_torchtitan_moe``) the experts' group would be one rank. The tokens' all-to-alls stay
inside a node.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed.fsdp

import zeropp
from bounds import contributions_excess
from distributed import run_distributed

if sys.version_info < (3, 11) or not hasattr(torch.distributed.fsdp, "DataParallelMeshDims"):
    pytest.skip("torchtitan 0.3.0 needs Python >= 3.11 and torch >= 2.13", allow_module_level=True)

from test_torchtitan_moe import _trainer_config  # noqa: E402
from test_torchtitan_pipeline import LOCAL_BATCH, QWZ, QWZ_QGZ, SEQ_LEN, _run  # noqa: E402

WORLD_SIZE = 8
FOUR_BY_TWO = {"ZEROPP_RANKS_PER_NODE": "2"}
PIPELINE = ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B",
            "--training.local_batch_size", str(LOCAL_BATCH), "--training.seq_len", str(SEQ_LEN))


def _worker(rank: int, world_size: int) -> dict:
    runs = {}
    for name, config in (("reference", None), ("zero3", zeropp.ZeroPPConfig()), ("qwz", QWZ), ("both", QWZ_QGZ)):
        runs[name] = _run(_trainer_config(config, "ep", PIPELINE), world_size, contributions=name == "qwz")
    weights, both = runs["qwz"], runs["both"]
    # each rank's contribution is coded at most twice: as a row (hop 1) and inside its node's
    # partial (hop 2, INT4; the experts' group, one rank a node, has one hop only)
    excess = contributions_excess(both["grads"], weights["grads"], weights["contributions"], hops=2)
    return {"losses": {name: run["loss"] for name, run in runs.items()},
            "zero3_equal": runs["zero3"]["grads"].keys() == runs["reference"]["grads"].keys() and all(
                torch.equal(runs["zero3"]["grads"][n], g) for n, g in runs["reference"]["grads"].items()),
            "excess": excess, "max_error": max((both["grads"][n] - g).abs().max().item()
                                               for n, g in weights["grads"].items()),
            "again": both["again"], "ledger": both["ledger"], "explained": both["explained"],
            "tables": both["tables"], "names": both["names"]}


@pytest.fixture(scope="module")
def moe_pipeline() -> list[dict]:
    return run_distributed(_worker, WORLD_SIZE, env=FOUR_BY_TWO, timeout=900)


@pytest.mark.slow
def test_expert_and_pipeline_parallel_zero3_path_is_torchtitans_fsdp2_bit_for_bit(moe_pipeline: list[dict]) -> None:
    for rank in moe_pipeline:
        assert rank["losses"]["zero3"] == rank["losses"]["reference"] and rank["zero3_equal"]


@pytest.mark.slow
def test_expert_and_pipeline_parallel_qwz_and_qgz_within_their_bounds(moe_pipeline: list[dict]) -> None:
    """The loss sees qwZ's weights alone; every gradient element within twice the sum of each
    data-parallel rank's contribution's INT4 half steps of qwZ's exact reduction; not exact."""
    for rank in moe_pipeline:
        assert rank["losses"]["both"] == rank["losses"]["qwz"] != rank["losses"]["reference"]
        over = {name: value for name, value in rank["excess"].items() if value > 0}
        assert not over, over
        assert rank["max_error"] > 0


@pytest.mark.slow
def test_expert_and_pipeline_parallel_stages_explained_and_counted(moe_pipeline: list[dict]) -> None:
    """Each rank holds one stage of one block; ``explain`` shows its experts over one rank of
    each of its stage's two nodes and the rest over the stage's four ranks, and its bytes are the
    ledger's for a step after the first; the ledger counts torchtitan's token exchanges apart."""
    for index, rank in enumerate(moe_pipeline):
        assert rank["again"] == rank["losses"]["both"]
        table, = rank["tables"]
        stage = 4 * (index // 4)
        experts = ",".join(str(stage + offset + index % 2) for offset in (0, 2))
        assert f"ranks {experts} on 2 nodes" in table, table
        assert f"ranks {stage}-{stage + 3} on 2 nodes" in table, table
        assert "layers.0 #1" in table if index < 4 else "layers.1 #1" in table, table
        explained = {technique: totals["bytes"] for technique, totals in rank["explained"][0].items()}
        ledger = {technique: totals["bytes"] for technique, totals in rank["ledger"].items()}
        assert explained == {k: v for k, v in ledger.items() if k != "ep_tokens"}
        assert ledger["ep_tokens"] > 0 and ledger["qgZ"] > 0 and ledger["qwZ"] > 0
