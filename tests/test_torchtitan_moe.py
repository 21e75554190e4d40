"""zeropp on torchtitan's expert parallel layout: the qwen3 MoE debug model (cut to 2 blocks of 8
experts), built by torchtitan's own config, ``parallelize_qwen3`` and weight init, expert parallel 2
on 2 nodes x 2 gloo ranks (CPU, fp32, SDPA), alone and with tensor parallel 2, one forward and
backward, against torchtitan's own FSDP2 of the same layout.

torchtitan shards each block with a per-parameter mesh (``shard_placement_fn``): the routed
experts over ``efsdp`` = {0, 2}, {1, 3} (one rank per node; ``ep`` = {0, 1}, {2, 3} inside the
nodes), the rest of the block over the whole ``fsdp`` mesh. FSDP2 keeps the two as two parameter
groups of one unit, each with its own gather and reduce-scatter: zeropp plans and installs each
(``zeropp.fsdp.access.CommGroup``). The experts are most of the bytes.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
import torch.distributed.fsdp

import zeropp
from bounds import contributions_excess
from distributed import run_distributed

if sys.version_info < (3, 11) or not hasattr(torch.distributed.fsdp, "DataParallelMeshDims"):
    pytest.skip("torchtitan 0.3.0 needs Python >= 3.11 and torch >= 2.13", allow_module_level=True)

from test_torchtitan import CPU_OVERRIDES, _build, _force_sum  # noqa: E402

TWO_BY_TWO = {"ZEROPP_RANKS_PER_NODE": "2"}
EXPERT_PARALLEL = ["--parallelism.expert_parallel_degree", "2", "--training.disable_cuda_graphs"]
LAYOUTS = {"ep": EXPERT_PARALLEL, "ep_tp": [*EXPERT_PARALLEL, "--parallelism.tensor_parallel_degree", "2"]}
"""Expert parallel 2 alone, and with tensor parallel 2 (tensor parallel inside each node, so the
data-parallel ranks are one per node; expert parallel borrows the tensor parallel ranks, so the
experts' shard group is again one rank per node)."""
LOCAL_BATCH, SEQ_LEN, NUM_LAYERS, NUM_EXPERTS, TOP_K = 2, 16, 2, 8, 2


def _trainer_config(config: zeropp.ZeroPPConfig | None, layout: str = "ep", extra: tuple[str, ...] = ()):
    """torchtitan's qwen3 MoE debug config with ``layout``'s parallelism and the ``extra`` flags,
    loaded as its command line loads it; its parallelize function wrapped by zeropp's (``config``)
    or not (None)."""
    from torchtitan.config import ConfigManager
    from torchtitan.models.common.attention import ScaledDotProductAttention

    from zeropp.tools.bench.layouts import with_experts
    from zeropp.torchtitan import SPMD_BACKEND, ZeroPPParallelize

    trainer_config = ConfigManager().parse_args(["--module", "qwen3", "--config", "qwen3_moe_debug", *CPU_OVERRIDES,
                                                 "--parallelism.spmd_backend", SPMD_BACKEND, *LAYOUTS[layout], *extra])
    model = trainer_config.model_spec.model
    # the debug model's 8 blocks of 64 experts hold 300M parameters: 2 blocks of 8 experts, top 2, hold 13.6M
    model.layers = [dataclasses.replace(layer, moe=with_experts(layer.moe, NUM_EXPERTS, TOP_K))
                    for layer in model.layers[:NUM_LAYERS]]
    for layer in model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    if config is not None:
        spec = trainer_config.model_spec
        spec.parallelize_fn = ZeroPPParallelize(spec.parallelize_fn, config)
    return trainer_config


def _tokens(vocab: int, batch: int) -> torch.Tensor:
    return torch.randint(0, vocab, (4, LOCAL_BATCH, SEQ_LEN + 1), generator=torch.Generator().manual_seed(0))[batch]


def _run(config: zeropp.ZeroPPConfig | None, world_size: int, contributions: bool = False, layout: str = "ep"
         ) -> dict:
    """One forward and backward: loss, this rank's gradient shards, the ledger, the plan's bytes;
    with ``contributions`` first each data-parallel rank's batch's gradients alone (the others
    weighed 0.0). A tensor parallel group (consecutive ranks) trains on one batch."""
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.distributed import utils as dist_utils

    trainer_config = _trainer_config(config, layout)
    dist_utils.set_spmd_backend(trainer_config.parallelism.spmd_backend)
    model = _build(trainer_config, world_size)
    if config is None:
        _force_sum(model)
    vocab, rank = trainer_config.model_spec.model.vocab_size, torch.distributed.get_rank()
    tensor_parallel = trainer_config.parallelism.tensor_parallel_degree
    batch, batches = rank // tensor_parallel, world_size // tensor_parallel

    def loss_of(weight: float) -> torch.Tensor:
        tokens = _tokens(vocab, batch)
        return cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:]) / (batches * LOCAL_BATCH * SEQ_LEN) * weight

    parts = []
    for part in range(batches if contributions else 0):
        loss_of(float(part == batch)).backward()
        parts.append({n: p.grad.to_local().clone() for n, p in model.named_parameters()})
        model.zero_grad(set_to_none=True)
    explained = zeropp.explain(model) if config is not None else None
    zeropp.comm_ledger().reset()
    loss = loss_of(1.0)
    loss.backward()
    total = loss.detach().clone() / tensor_parallel  # each tensor parallel rank holds its batch's whole loss
    torch.distributed.all_reduce(total)
    return {"loss": total.item(), "grads": {n: p.grad.to_local().clone() for n, p in model.named_parameters()},
            "contributions": parts, "ledger": zeropp.comm_ledger().summary()["by_technique"],
            "explained": None if explained is None else explained.by_technique(),
            "table": None if explained is None else str(explained)}


def _refusal(config: zeropp.ZeroPPConfig, world_size: int, layout: str) -> str:
    """The error ``config`` is refused with on ``layout``, or "accepted"."""
    try:
        _run(config, world_size, layout=layout)
    except ValueError as error:
        return str(error)
    return "accepted"


def _worker(rank: int, world_size: int, layout: str) -> dict:
    reference = _run(None, world_size, layout=layout)
    zero3 = _run(zeropp.ZeroPPConfig(), world_size, layout=layout)
    weights = _run(zeropp.ZeroPPConfig(quantized_weights=True), world_size, contributions=True, layout=layout)
    both = _run(zeropp.ZeroPPConfig(quantized_weights=True, quantized_gradients=True), world_size, layout=layout)
    # each rank's contribution is coded at most twice: as a row (hop 1, INT8 or INT4) and inside its
    # node's partial (hop 2, INT4)
    excess = contributions_excess(both["grads"], weights["grads"], weights["contributions"], hops=2)
    hpz = _refusal(zeropp.ZeroPPConfig(hpz_partition_size=2), world_size, layout)
    deltas = _refusal(zeropp.ZeroPPConfig(hpz_partition_size=2, weight_deltas=True), world_size, layout)
    return {"losses": {k: r["loss"] for k, r in (("reference", reference), ("zero3", zero3), ("qwz", weights),
                                                   ("both", both))},
            "zero3_equal": all(torch.equal(zero3["grads"][n], g) for n, g in reference["grads"].items()),
            "excess": excess, "max_error": max((both["grads"][n] - g).abs().max().item()
                                               for n, g in weights["grads"].items()),
            "ledger": both["ledger"], "explained": both["explained"], "table": both["table"], "hpz": hpz,
            "deltas": deltas}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def moe(request) -> list[dict]:
    return run_distributed(_worker, 4, request.param, env=TWO_BY_TWO, timeout=600)


@pytest.mark.slow
def test_expert_parallel_zero3_path_is_torchtitans_fsdp2_bit_for_bit(moe: list[dict]) -> None:
    for rank in moe:
        assert rank["losses"]["zero3"] == rank["losses"]["reference"] and rank["zero3_equal"]


@pytest.mark.slow
def test_expert_parallel_qwz_and_qgz_within_their_bounds(moe: list[dict]) -> None:
    """The loss sees qwZ's weights alone (the same as qwZ's run); every gradient element within
    twice the sum of each rank's contribution's INT4 half steps (each contribution coded as a
    row, INT8 or INT4, and inside a partial, INT4) of the exact reduction's; not exact."""
    for rank in moe:
        assert rank["losses"]["both"] == rank["losses"]["qwz"] != rank["losses"]["reference"]
        over = {name: value for name, value in rank["excess"].items() if value > 0}
        assert not over, over
        assert rank["max_error"] > 0


@pytest.mark.slow
def test_expert_parallel_plan_and_ledger(moe: list[dict]) -> None:
    """``explain`` shows each block's two groups (the experts over one rank per node) and its
    bytes are the ledger's; the ledger counts torchtitan's token exchanges apart; hpZ, which has
    no node partition to keep for the experts, is refused by name, and so are weight differences,
    which keep their copy in that partition."""
    for index, rank in enumerate(moe):
        ledger = {technique: totals["bytes"] for technique, totals in rank["ledger"].items()}
        explained = {technique: totals["bytes"] for technique, totals in rank["explained"].items()}
        assert explained == {k: v for k, v in ledger.items() if k != "ep_tokens"}
        assert ledger["ep_tokens"] > 0 and ledger["qgZ"] > 0 and ledger["qwZ"] > 0
        assert "layers.0 #1" in rank["table"], rank["table"]
        experts = "ranks 0,2" if index % 2 == 0 else "ranks 1,3"  # efsdp: one rank of each node
        assert f"{experts} on 2 nodes" in rank["table"], rank["table"]
        assert "hpz_partition_size=2" in rank["hpz"] and "no partition" in rank["hpz"], rank["hpz"]
        assert rank["deltas"] == rank["hpz"]
