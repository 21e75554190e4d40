"""zeropp at the world sizes users run: one real rank of a 384- and a 1,024-rank job on PyTorch's
fake process group (a narrow Llama, 8 ranks a node), at rank 0, a middle rank, the last and the
first whose shard of some parameter is empty. Its shard of every parameter is FSDP2's chunk of
that rank, hpZ adds no process group however deep the model, a training step runs, and the
step's peak memory (FSDP2's tracker) is what ``zeropp plan`` predicts for that rank."""

from __future__ import annotations

import argparse

import pytest
import torch

import zeropp
from distributed import run_fake_rank
from zeropp.tools.bench import scale
from zeropp.tools.bench.cli import _world_sizes
from zeropp.tools.bench.scale_rank import RunConfig, build_meta_llama
from zeropp.tools.modes import MODES

MODEL = "narrow"
"""Llama's parameter list at width 128: 64-row key and value projections, a 1,024-row vocabulary,
so ranks past 64 (and past 342 of 384) hold empty shards."""


def _shard(mode: str, layers: int, world_size: int) -> tuple[torch.nn.Module, dict[str, int]]:
    """The narrow Llama sharded in ``mode``; the new_group calls and process groups it took."""
    from zeropp.fsdp.access import counting_new_groups, num_process_groups

    llama, units = build_meta_llama(MODEL, layers)
    config = MODES[mode].config(8, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    before = num_process_groups()
    with counting_new_groups() as calls:
        zeropp.shard(llama, config, topology=zeropp.Topology.from_world(world_size, 8), units=units)
    return llama, {"new_group_calls": calls[0], "groups_added": num_process_groups() - before}


def _rank_worker(rank: int, world_size: int, depths: tuple[int, ...]) -> dict:
    """Group counts of ZeRO-3 and all three at each depth; then the deepest all-three model's
    shards, and one step under FSDP2's memory tracker."""
    from zeropp.tools.bench.scale_rank import Steps, create_optimizer_state, materialise

    groups = {}
    for mode in ("zero3", "all"):
        for layers in depths:
            llama, groups[(mode, layers)] = _shard(mode, layers, world_size)
    materialise(llama)
    steps = Steps(llama, RunConfig(world_size=world_size, rank=rank, mode="all", model=MODEL))
    create_optimizer_state(steps.optimizer, list(llama.parameters()))
    tracked = steps.tracked_step()
    rows = {name: p.to_local().shape[0] for name, p in llama.named_parameters()}
    return {"groups": groups, "rows": rows, **tracked}


def _fsdp2_rows(shape: tuple[int, ...], world_size: int, rank: int) -> int:
    """FSDP2's shard of dim 0 on ``rank``: its chunk of ``torch.chunk`` (fewer chunks than ranks
    when the rows do not fill them)."""
    chunks = torch.empty(shape[0], 0).chunk(world_size)
    return chunks[rank].shape[0] if rank < len(chunks) else 0


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1024])
def test_one_rank_of_a_large_job(world_size: int) -> None:
    """At every rank position: the shards are FSDP2's chunks (empty where expected); ZeRO-3 and
    all three take the same groups at 2 and 4 layers (the world, the node's and the peers'
    groups: W / 8 + 8 new_group calls, hpZ's node mesh made of them); a step runs, and its peak
    is ``zeropp plan``'s prediction for that rank within the bench's tolerance. (384 ranks: the
    quick bench's test runs every position there, with the same group and peak checks.)"""
    llama, _ = build_meta_llama(MODEL, 4)
    names = dict(llama.named_parameters())
    shape = scale.model_shape(MODEL, 4)
    positions = scale.rank_positions(shape, world_size)
    assert positions["empty"] == 64  # the key and value projections' 64 rows
    for position, rank in positions.items():
        depths = (2, 4) if position == "first" else (4,)
        result = run_fake_rank(_rank_worker, world_size, rank, depths, timeout=600)
        expected = {name: _fsdp2_rows(tuple(p.shape), world_size, rank) for name, p in names.items()}
        assert result["rows"] == expected, position
        empty = {name for name, rows in expected.items() if rows == 0}
        assert bool(empty) == (rank >= 64), position
        for (mode, layers), counts in result["groups"].items():
            assert counts == {"new_group_calls": world_size // 8 + 8, "groups_added": 2}, (mode, layers)
        plan = scale.predicted(shape, RunConfig(world_size=world_size, rank=rank, mode="all", model=MODEL,
                                                num_layers=4))
        assert abs(plan.total / result["peak_bytes"] - 1) <= scale.TOLERANCE, (position, plan, result["peak_bytes"])
        assert result["secondary_copy_bytes"] > 0


def test_rank_positions_find_the_first_empty_shard() -> None:
    """Llama-3-8B's key and value projections have 1,024 rows: at 384 ranks (chunks of 3) ranks
    342 on hold none, at 4,096 (chunks of 1) ranks 1,024 on. Its 128,256-row vocabulary in chunks
    of 126 fills only 1,018 of 1,024 ranks. At 64 every rank holds rows of every parameter."""
    shape = scale.model_shape("llama3-8b", 2)
    assert [scale.first_empty_rank(shape, w) for w in (64, 384, 1024, 4096)] == [None, 342, 1018, 1024]
    assert scale.rank_positions(shape, 384) == {"first": 0, "middle": 195, "last": 383, "empty": 342}


@pytest.mark.parametrize("text", ["64,12", "0", "64,,384", "x"])
def test_world_sizes_must_be_multiples_of_a_node(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="multiples of 8"):
        _world_sizes(text)


@pytest.mark.slow
def test_quick_bench_writes_its_table(tmp_path) -> None:
    """``zeropp bench scale --quick`` at one world size and mode: a process per run, the full
    model's set-up and the slice's step at every rank position, each beside the plan; the JSON
    and the chart are written."""
    result = scale.run(out_dir=str(tmp_path), quick=True, world_sizes=(384,), modes=("all",))
    records = result["records"]
    assert [(r["position"], r["layers"], r["step"]) for r in records] == [
        ("first", 4, False), ("first", 2, True), ("middle", 2, True), ("last", 2, True), ("empty", 2, True)]
    assert all(r["ran"] and r["new_group_calls"] == 384 // 8 + 8 for r in records)
    assert all(abs(r["predicted_over_measured"] - 1) <= scale.TOLERANCE for r in records if r["step"])
    assert (tmp_path / "bench_scale.json").exists() and (tmp_path / "bench_scale.png").exists()


@pytest.mark.slow
def test_the_plan_of_a_copy_kept_as_codes_holds_the_prefetched_codes_not_their_decoding() -> None:
    """Weight differences with the node copy as INT8 codes, at rank 0 of a 64-rank Llama-3-8B
    slice: the peak is a block's backward with the embedding's gather prefetched, which holds
    FSDP2's flat output and the node's codes; the decoded rows (one rank's, 125 MiB of the
    embedding) come only at the embedding's own wait. The plan counted them in flight and
    over-predicted the peak by 3.7%; it is within 1% of FSDP2's tracker."""
    config = RunConfig(world_size=64, rank=0, mode="all_delta_codes", model="llama3-8b", num_layers=2, step=True)
    row = scale.row("first", scale.launch(config), {2: scale.model_shape("llama3-8b", 2)})  # the bench's own run
    assert row["ran"], row
    assert row["predicted"]["moment"] == "backward LlamaDecoderLayer"
    assert abs(row["predicted_over_measured"] - 1) <= 0.01, (row["predicted"], row["peak_bytes"])
