"""zeropp on torchtitan's pipeline parallel layout: the llama3 debug model cut into stages by
torchtitan's own ``pipeline_llm`` (its parallelize function applied to each stage's part, its
schedule built from the config), pipeline 2 x FSDP 2 on 4 gloo ranks, one training step through
the schedule, against torchtitan's own FSDP2 of the same layout.

The world mesh is ``(pp, fsdp)`` = 2 x 2, pipeline outermost: pipeline rank 0 is ranks {0, 1},
pipeline rank 1 is {2, 3}, each stage's units sharded over its two ranks. With one rank per node
(``ZEROPP_RANKS_PER_NODE=1``) every shard group spans two nodes, so qwZ's gathers and qgZ's
reduce-scatter cross them (qgZ is one INT4 hop). Two of torchtitan's schedules: 1F1B (one stage a
rank) and Interleaved1F1B (two a rank, torchtitan's default). torchtitan keeps every stage's
units whole between forward and backward under pipeline parallelism (its "default" reshard
policy), so each microbatch after the first gathers nothing.

The exact reference for qgZ is the run with qwZ alone, and its bound comes from each
data-parallel rank's own contribution: a step in which only that rank's loss counts.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch
import torch.distributed.fsdp

import zeropp
from bounds import contributions_excess
from distributed import run_distributed

if sys.version_info < (3, 11) or not hasattr(torch.distributed.fsdp, "DataParallelMeshDims"):
    pytest.skip("torchtitan 0.3.0 needs Python >= 3.11 and torch >= 2.13", allow_module_level=True)

from test_torchtitan import CPU_OVERRIDES, _force_sum  # noqa: E402

ONE_RANK_PER_NODE = {"ZEROPP_RANKS_PER_NODE": "1"}
SCHEDULES = ("1F1B", "Interleaved1F1B")
LOCAL_BATCH, SEQ_LEN = 4, 16
"""Four microbatches of one sequence per data-parallel rank (torchtitan's microbatch size, 1)."""
QWZ = zeropp.ZeroPPConfig(quantized_weights=True)
QWZ_QGZ = zeropp.ZeroPPConfig(quantized_weights=True, quantized_gradients=True)


def _trainer_config(schedule: str, config: zeropp.ZeroPPConfig | None):
    """torchtitan's llama3 debug config with pipeline 2 and ``schedule``, loaded as its command
    line loads it: torchtitan's own FSDP2 (``config`` None) or zeropp's with ``config``."""
    from torchtitan.config import ConfigManager
    from torchtitan.models.common.attention import ScaledDotProductAttention

    module = "llama3" if config is None else "zeropp.torchtitan"
    backend = ["--parallelism.spmd_backend", "partial_dtensor"] if config is None else []
    trainer_config = ConfigManager().parse_args(
        ["--module", module, "--config", "llama3_debugmodel", *CPU_OVERRIDES, *backend,
         "--training.local_batch_size", str(LOCAL_BATCH), "--training.seq_len", str(SEQ_LEN),
         "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", schedule,
         "--training.disable_cuda_graphs"])
    if config is not None:
        spec = trainer_config.model_spec
        spec.parallelize_fn = dataclasses.replace(spec.parallelize_fn, config=config)
    for layer in trainer_config.model_spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return trainer_config


class _Loss:
    """torchtitan's loss as its schedule calls it: the sum over a microbatch's tokens over the
    global token count (so the gradients are summed), times ``weight``."""

    def __init__(self, global_tokens: int) -> None:
        self.global_tokens, self.weight = global_tokens, 1.0

    def __call__(self, pred: torch.Tensor, labels: torch.Tensor, **kwargs: object) -> tuple[torch.Tensor, None]:
        loss = torch.nn.functional.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(), reduction="sum")
        return loss / self.global_tokens * self.weight, None


def _build(trainer_config, world_size: int, loss: _Loss):
    """What torchtitan's Trainer does under pipeline parallelism (trainer.py): the meta model cut
    by the model spec's ``pipelining_fn``, each part parallelized, moved and initialised."""
    from zeropp.tools.bench.layouts import build_parts

    assert torch.distributed.get_world_size() == world_size
    _, schedule, parts, first, last = build_parts(trainer_config, loss)
    return schedule, parts, first, last


def _run(trainer_config, world_size: int, contributions: bool = False) -> dict:
    """One training step of torchtitan's ``trainer_config`` (pipeline 2, outermost) through its
    schedule, then the same step again (no optimizer step between: the same weights): the global
    loss of each, this rank's gradient shards, the second step's ledger (a schedule's first step
    also runs the stages once to infer their shapes, which gathers and, on the last stage, reduces
    once more), the explained plan; with ``contributions`` first each data-parallel rank's step
    alone (the others' loss weighed 0.0), one step each."""
    from zeropp.torchtitan import ZeroPPParallelize

    zeropp_run = isinstance(trainer_config.model_spec.parallelize_fn, ZeroPPParallelize)
    num_batches = world_size // 2
    loss = _Loss(num_batches * LOCAL_BATCH * SEQ_LEN)
    schedule, parts, first, last = _build(trainer_config, world_size, loss)
    if not zeropp_run:
        for part in parts:
            _force_sum(part)
    batch = torch.distributed.get_rank() % num_batches  # the data-parallel rank inside the stage
    tokens = torch.randint(0, trainer_config.model_spec.model.vocab_size, (num_batches, LOCAL_BATCH, SEQ_LEN + 1),
                           generator=torch.Generator().manual_seed(0))[batch]

    def step() -> float:
        losses: list[torch.Tensor] = []
        inputs = (tokens[:, :-1],) if first else ()
        schedule.step(*inputs, target=tokens[:, 1:] if last else None, losses=losses if last else None,
                      return_outputs=False)
        total = torch.stack(losses).sum().detach() if last else torch.zeros(())
        torch.distributed.all_reduce(total)
        return total.item()

    def gradients() -> dict[str, torch.Tensor]:
        return {f"{i}.{name}": p.grad.to_local().clone() for i, part in enumerate(parts)
                for name, p in part.named_parameters()}

    parts_grads = []
    for part_index in range(num_batches if contributions else 0):
        loss.weight = float(part_index == batch)
        step()
        parts_grads.append(gradients())
        for part in parts:
            part.zero_grad(set_to_none=True)
    loss.weight = 1.0
    explained = [zeropp.explain(part) for part in parts] if zeropp_run else None
    zeropp.comm_ledger().reset()
    total = step()
    warm = zeropp.comm_ledger().summary()["by_technique"]
    for part in parts:
        part.zero_grad(set_to_none=True)
    zeropp.comm_ledger().reset()
    again = step()  # the same weights (no optimizer step): the same loss and gradients
    ledger = zeropp.comm_ledger().summary()["by_technique"]
    return {"loss": total, "again": again, "grads": gradients(), "contributions": parts_grads, "ledger": ledger,
            "warm": warm,
            "explained": None if explained is None else [e.by_technique() for e in explained],
            "tables": None if explained is None else [str(e) for e in explained],
            "names": [[name for name, _ in part.named_parameters()] for part in parts]}


def _worker(rank: int, world_size: int) -> dict:
    results = {}
    for schedule in SCHEDULES:
        reference = _run(_trainer_config(schedule, None), world_size)
        zero3 = _run(_trainer_config(schedule, zeropp.ZeroPPConfig()), world_size)
        weights = _run(_trainer_config(schedule, QWZ), world_size, contributions=True)
        both = _run(_trainer_config(schedule, QWZ_QGZ), world_size)
        # one hop across the two nodes: each rank's contribution coded once, INT4, as a row
        excess = contributions_excess(both["grads"], weights["grads"], weights["contributions"], hops=1)
        results[schedule] = {
            "losses": {"reference": reference["loss"], "zero3": zero3["loss"], "qwz": weights["loss"],
                       "both": both["loss"]},
            "zero3_equal": zero3["grads"].keys() == reference["grads"].keys() and all(
                torch.equal(zero3["grads"][n], g) for n, g in reference["grads"].items()),
            "excess": excess, "max_error": max((both["grads"][n] - g).abs().max().item()
                                               for n, g in weights["grads"].items()),
            "ledger": both["ledger"], "warm": both["warm"], "again": both["again"], "explained": both["explained"],
            "tables": both["tables"],
            "names": both["names"]}
    os.environ["ZEROPP_RANKS_PER_NODE"] = "2"  # a node holds a stage's two ranks: hpZ's partition fits
    try:
        for refused, config in (("hpz", zeropp.ZeroPPConfig(hpz_partition_size=2)),
                                ("audit", zeropp.ZeroPPConfig(audit_every=10))):
            try:
                _run(_trainer_config("1F1B", config), world_size)
                results[refused] = "accepted"
            except ValueError as error:
                results[refused] = str(error)
    finally:
        os.environ.update(ONE_RANK_PER_NODE)
    return results


@pytest.fixture(scope="module")
def pipeline() -> list[dict]:
    return run_distributed(_worker, 4, env=ONE_RANK_PER_NODE, timeout=900)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pipeline_zero3_path_is_torchtitans_fsdp2_bit_for_bit(pipeline: list[dict], schedule: str) -> None:
    for rank in pipeline:
        result = rank[schedule]
        assert result["losses"]["zero3"] == result["losses"]["reference"] and result["zero3_equal"]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pipeline_qwz_and_qgz_within_their_bounds(pipeline: list[dict], schedule: str) -> None:
    """The loss sees qwZ's weights alone (qgZ changes only gradients); every gradient element of
    qwZ + qgZ within the sum of each data-parallel rank's contribution's INT4 half steps of qwZ's
    exact reduction (one hop: each contribution coded once); not exact."""
    for rank in pipeline:
        result = rank[schedule]
        assert result["losses"]["both"] == result["losses"]["qwz"] != result["losses"]["reference"]
        over = {name: value for name, value in result["excess"].items() if value > 0}
        assert not over, over
        assert result["max_error"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pipeline_stages_explained_and_counted(pipeline: list[dict], schedule: str) -> None:
    """Each rank holds its pipeline rank's stages (one with 1F1B, two interleaved), every stage's
    units sharded over the two ranks of its pipeline rank, one per node; ``explain`` of the parts
    adds up to the ledger's bytes for a step after the first, with no presence exchange (the
    schedule reduces outside autograd); the first step's ledger holds more (shape inference)."""
    for index, rank in enumerate(pipeline):
        result = rank[schedule]
        assert result["again"] == result["losses"]["both"]
        assert result["warm"]["qwZ"]["bytes"] > result["ledger"]["qwZ"]["bytes"]
        assert len(result["names"]) == (1 if schedule == "1F1B" else 2)
        group = "ranks 0,1" if index < 2 else "ranks 2,3"
        assert all(f"{group} on 2 nodes" in table for table in result["tables"]), result["tables"]
        explained: dict[str, int] = {}
        for part in result["explained"]:
            for technique, totals in part.items():
                explained[technique] = explained.get(technique, 0) + totals["bytes"]
        ledger = {technique: totals["bytes"] for technique, totals in result["ledger"].items()}
        assert explained == ledger
        assert ledger["qgZ"] > 0 and ledger["qwZ"] > 0
    first = pipeline[0]["1F1B"]["names"][0]
    assert any(name.startswith("tok_embeddings") for name in first)
    assert not any(name.startswith("tok_embeddings") for name in pipeline[2]["1F1B"]["names"][0])


@pytest.mark.slow
def test_pipeline_refuses_hpz_and_the_audit_by_name(pipeline: list[dict]) -> None:
    """Under pipeline parallelism torchtitan keeps a stage's units whole from forward to backward:
    hpZ has nothing to serve, and says so; the audit sums its findings over the world, whose stages
    audit different units, and says so."""
    for rank in pipeline:
        assert "hpz_partition_size=2" in rank["hpz"] and "pipeline stage" in rank["hpz"], rank["hpz"]
        assert "audit_every=10" in rank["audit"] and "pipeline stage" in rank["audit"], rank["audit"]


def test_a_stage_refuses_what_spans_the_world() -> None:
    """On a pipeline stage's part: hpZ, the audit and trainable 0-dim parameters are refused, each
    naming what to change; qwZ and qgZ are not."""
    from zeropp.setup.plan import _pipeline_refusals

    assert _pipeline_refusals(QWZ_QGZ, scalars=False) == []
    hpz, audit, scalars = _pipeline_refusals(zeropp.ZeroPPConfig(hpz_partition_size=2, audit_every=5), scalars=True)
    assert "hpz_partition_size=2" in hpz and "Set hpz_partition_size=1" in hpz
    assert "audit_every=5" in audit and "Set audit_every=0" in audit
    assert "0-dim parameters" in scalars and "shape [1]" in scalars
