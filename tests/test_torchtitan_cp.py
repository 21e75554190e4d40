"""zeropp on torchtitan's context parallel layout: the llama3 debug model (SDPA, fp32), context
parallel 2 x FSDP 2 on 2 nodes x 2 gloo ranks, built by torchtitan's own config, parallelize
function (its ``apply_cp_to_forward``) and weight init, its inputs sharded by its own
``prepare_context_parallel_input`` (head-tail load balancing), one forward and backward, against
torchtitan's own FSDP2 of the same layout.

torchtitan folds context parallel into the FSDP mesh: every unit is sharded over the four ranks
(``dp_shard x cp``), and the two ranks of a ``cp`` group, {0, 1} and {2, 3}, hold halves of the
same sequences, passing keys and values round by torch's ring attention. On CPU that ring needs a
kernel torch gives only CUDA: ``ring_attention_cpu`` hands it CPU's flash kernel, and the run
with context parallel equals the run without it (each rank a whole sequence) to fp32 rounding.

qgZ's bound comes from what each rank codes: its own unreduced gradient, read from FSDP2 in a
backward without gradient sync (each rank's gradient there already holds the other rank's share
of the ring's key and value gradients, so a contribution cannot be isolated by the loss).
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed.fsdp

import zeropp
from bounds import excess as bound_excess
from bounds import half_steps
from distributed import run_distributed

if sys.version_info < (3, 11) or not hasattr(torch.distributed.fsdp, "DataParallelMeshDims"):
    pytest.skip("torchtitan 0.3.0 needs Python >= 3.11 and torch >= 2.13", allow_module_level=True)

from test_torchtitan import _force_sum  # noqa: E402

TWO_BY_TWO = {"ZEROPP_RANKS_PER_NODE": "2"}
SEQ_LEN, SEQUENCES = 16, 4
"""Four sequences: two per context parallel group, or one per rank without context parallel."""
MODES = {"zero3": zeropp.ZeroPPConfig(), "hpz": zeropp.ZeroPPConfig(hpz_partition_size=2),
         "qwz": zeropp.ZeroPPConfig(quantized_weights=True),
         "both": zeropp.ZeroPPConfig(quantized_weights=True, quantized_gradients=True)}


def _trainer_config(context_parallel: int, config: zeropp.ZeroPPConfig | None):
    from torchtitan.config import ConfigManager
    from torchtitan.models.common.attention import ScaledDotProductAttention

    from zeropp.torchtitan import SPMD_BACKEND, ZeroPPParallelize

    local_batch = SEQUENCES * context_parallel // 4
    trainer_config = ConfigManager().parse_args(
        ["--module", "llama3", "--config", "llama3_debugmodel", "--training.mixed_precision_param", "float32",
         "--training.seq_len", str(SEQ_LEN), "--training.local_batch_size", str(local_batch),
         "--parallelism.spmd_backend", SPMD_BACKEND, "--parallelism.context_parallel_degree", str(context_parallel)])
    for layer in trainer_config.model_spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    if config is not None:
        spec = trainer_config.model_spec
        spec.parallelize_fn = ZeroPPParallelize(spec.parallelize_fn, config)
    return trainer_config


def _local_gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's unreduced gradient of every parameter, whole, after a backward without sync;
    taken out of FSDP2, which would otherwise add it into the next backward's reduction."""
    from torch.distributed.fsdp import FSDPModule

    names = {id(p): name for name, p in model.named_parameters()}
    gradients = {}
    for module in model.modules():
        if isinstance(module, FSDPModule) and (group := module._get_fsdp_state()._fsdp_param_group) is not None:
            for fsdp_param in group.fsdp_params:  # a unit is reached through its wrapper too: once
                if names[id(fsdp_param.sharded_param)] in gradients:
                    continue
                gradients[names[id(fsdp_param.sharded_param)]] = fsdp_param._unsharded_param.grad
                fsdp_param._unsharded_param.grad = None
    return gradients


def _run(context_parallel: int, config: zeropp.ZeroPPConfig | None, local: bool = False) -> dict:
    """One forward and backward on the four sequences: the global loss, this rank's gradient
    shards, the ledger and the explained plan; with ``local`` first this rank's unreduced
    gradients (a backward without gradient sync)."""
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.distributed.context_parallel import prepare_context_parallel_input

    import ring_attention_cpu
    from zeropp.tools.bench.layouts import build_parts

    ring_attention_cpu.install()
    trainer_config = _trainer_config(context_parallel, config)
    parallel_dims, _, (model,), _, _ = build_parts(trainer_config)
    if config is None:
        _force_sum(model)
    rank = torch.distributed.get_rank()
    tokens = torch.randint(0, trainer_config.model_spec.model.vocab_size, (SEQUENCES, SEQ_LEN + 1),
                           generator=torch.Generator().manual_seed(0))
    mine = tokens.view(4 // context_parallel, -1, SEQ_LEN + 1)[rank // context_parallel]

    def loss() -> torch.Tensor:
        inputs, labels = mine[:, :-1], mine[:, 1:]
        extra = {"positions": torch.arange(SEQ_LEN).expand(len(mine), SEQ_LEN)}
        if context_parallel > 1:
            inputs, labels, extra = prepare_context_parallel_input(
                inputs, labels, extra, parallel_dims.get_mesh("cp"), torch.device("cpu"),
                trainer_config.parallelism.context_parallel_load_balancer)
        return cross_entropy_loss(model(inputs, **extra), labels) / (SEQUENCES * SEQ_LEN)

    local_gradients = None
    if local:
        model.set_requires_gradient_sync(False)
        loss().backward()
        local_gradients = _local_gradients(model)
        model.set_requires_gradient_sync(True)
        model.zero_grad(set_to_none=True)
    explained = zeropp.explain(model) if config is not None else None
    zeropp.comm_ledger().reset()
    value = loss()
    value.backward()
    total = value.detach().clone()
    torch.distributed.all_reduce(total)
    return {"loss": total.item(), "grads": {n: p.grad.to_local().clone() for n, p in model.named_parameters()},
            "local": local_gradients, "ledger": zeropp.comm_ledger().summary()["by_technique"],
            "explained": None if explained is None else explained.by_technique(),
            "table": None if explained is None else str(explained),
            "cp": None if context_parallel == 1 else parallel_dims.get_mesh("cp").mesh.tolist()}


def _worker(rank: int, world_size: int) -> dict:
    unsplit = _run(1, None)
    reference = _run(2, None)
    runs = {name: _run(2, config, local=name == "qwz") for name, config in MODES.items()}
    weights, both = runs["qwz"], runs["both"]
    excess = {}
    for name, exact in weights["grads"].items():
        # every rank's rows coded at most twice (hop 1, and inside its node's partial, hop 2): twice
        # the sum over the ranks of each one's half steps on this rank's shard of the parameter
        steps = torch.cat([half_steps(chunk) for chunk in weights["local"][name].chunk(world_size)])
        torch.distributed.all_reduce(steps)
        excess[name] = bound_excess(both["grads"][name], exact, 2 * steps.chunk(world_size)[rank].view_as(exact),
                                    exact.abs())
    return {"losses": {"unsplit": unsplit["loss"], "reference": reference["loss"],
                       **{name: run["loss"] for name, run in runs.items()}},
            "unsplit_error": max(((reference["grads"][n] - g).abs() / (g.abs().max() + 1e-30)).max().item()
                                 for n, g in unsplit["grads"].items()),
            "exact": {name: all(torch.equal(runs[name]["grads"][n], g) for n, g in reference["grads"].items())
                      for name in ("zero3", "hpz")},
            "excess": excess, "max_error": max((both["grads"][n] - g).abs().max().item()
                                               for n, g in weights["grads"].items()),
            "ledger": both["ledger"], "explained": both["explained"], "table": both["table"],
            "cross_node_bytes": {name: sum(totals["cross_node_bytes"] for totals in runs[name]["ledger"].values())
                                 for name in ("zero3", "hpz")},
            "cp": reference["cp"]}


@pytest.fixture(scope="module")
def context_parallel() -> list[dict]:
    return run_distributed(_worker, 4, env=TWO_BY_TWO, timeout=600)


@pytest.mark.slow
def test_context_parallel_on_cpu_equals_the_unsplit_sequences(context_parallel: list[dict]) -> None:
    """torchtitan's CP 2 run (the ring on CPU's kernel) against the same four sequences without
    context parallel: the same loss and gradient shards to fp32 rounding (the attention's sums
    split in two and merged by log-sum-exp)."""
    for index, rank in enumerate(context_parallel):
        assert rank["cp"] == [[0, 1], [2, 3]][index // 2]
        assert rank["losses"]["reference"] == pytest.approx(rank["losses"]["unsplit"], rel=1e-6)
        assert rank["unsplit_error"] < 1e-5


@pytest.mark.slow
def test_context_parallel_zero3_and_hpz_are_torchtitans_fsdp2_bit_for_bit(context_parallel: list[dict]) -> None:
    for rank in context_parallel:
        for mode in ("zero3", "hpz"):
            assert rank["losses"][mode] == rank["losses"]["reference"] and rank["exact"][mode], mode


@pytest.mark.slow
def test_context_parallel_qwz_and_qgz_within_their_bounds(context_parallel: list[dict]) -> None:
    """The loss sees qwZ's weights alone; every gradient element within twice the sum over the
    ranks of their own unreduced gradient's INT4 half steps of qwZ's exact reduction; not exact."""
    for rank in context_parallel:
        assert rank["losses"]["both"] == rank["losses"]["qwz"] != rank["losses"]["reference"]
        over = {name: value for name, value in rank["excess"].items() if value > 0}
        assert not over, over
        assert rank["max_error"] > 0


@pytest.mark.slow
def test_context_parallel_explained_and_counted(context_parallel: list[dict]) -> None:
    """``explain`` shows the units over the four ranks of ``dp_shard x cp`` and its bytes are the
    ledger's; hpZ's backward gathers stay inside the node."""
    for rank in context_parallel:
        assert "ranks 0-3 on 2 nodes" in rank["table"], rank["table"]
        explained = {technique: totals["bytes"] for technique, totals in rank["explained"].items()}
        assert explained == {technique: totals["bytes"] for technique, totals in rank["ledger"].items()}
        assert rank["ledger"]["qgZ"]["bytes"] > 0 and rank["ledger"]["qwZ"]["bytes"] > 0
        # ZeRO-3 gathers each unit across the nodes twice, hpZ once (its backward inside the node)
        assert 0 < rank["cross_node_bytes"]["hpz"] < rank["cross_node_bytes"]["zero3"], rank["cross_node_bytes"]
