"""Generation on a sharded model: the demo GPT's KV-cache sampler, HF generate, and
``zeropp.generation_mode`` (gather inside the node while the weights do not change, never stale)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

import zeropp
from distributed import run_distributed
from models import VOCAB, global_batch, make_model, rows
from test_real_models import BLOCK, _expected_gather
from zeropp.fsdp.access import fsdp_units, post_forward_meshes
from zeropp.techniques.hpz import generation_copy_bytes, held_secondary_copy_bytes
from zeropp.tools.models.gpt import KVCache
from zeropp.tools.modes import MODES

TWO_BY_TWO = {"ZEROPP_RANKS_PER_NODE": "2"}


def _greedy_without_cache(model: torch.nn.Module, prompt: torch.Tensor, new: int) -> torch.Tensor:
    tokens = prompt
    for _ in range(new):
        logits, _ = model(tokens)
        tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tokens


def test_kv_cache_sampler_equals_full_recomputation() -> None:
    """Greedy decoding with the KV cache gives the tokens of recomputing every position each
    step; cached logits of a continued sequence equal a full forward's within fp32 rounding."""
    model = make_model("gpt")
    prompt = torch.randint(0, VOCAB, (3, 4), generator=torch.Generator().manual_seed(0))
    tokens = model.generate(prompt, 7, temperature=0)
    assert torch.equal(tokens, _greedy_without_cache(model, prompt, 7))
    cache = [KVCache() for _ in model.blocks]
    with torch.no_grad():
        parts = [model(tokens[:, :5], cache=cache)[0], model(tokens[:, 5:9], cache=cache)[0]]
        full = model(tokens[:, :9])[0]
    assert (torch.cat(parts, dim=1) - full).abs().max() <= 1e-5
    sampled = model.generate(prompt, 5, temperature=0.8, top_k=5, generator=torch.Generator().manual_seed(1))
    assert sampled.shape == (3, 9) and torch.equal(sampled[:, :4], prompt)
    with pytest.raises(ValueError, match="exceeds context_length=12"):
        model.generate(prompt, 9)


def _generate_worker(rank: int, world_size: int, mode: str, use_generation_mode: bool) -> dict:
    reference = make_model("gpt")
    quantized = MODES[mode].options.get("quantized_weights", False)
    if quantized:  # the weights qwZ computes with: dequantize(quantize(shard)) of every shard
        with torch.no_grad():
            for p in reference.parameters():
                p.copy_(_expected_gather(p, world_size, quantized=True))
    model = zeropp.shard(make_model("gpt"), MODES[mode].config(2, block_size=BLOCK))
    prompt = torch.randint(0, VOCAB, (2, 4), generator=torch.Generator().manual_seed(rank))
    expected = reference.generate(prompt, 8, temperature=0)
    ledger = zeropp.comm_ledger()
    ledger.reset()
    if use_generation_mode:
        with zeropp.generation_mode(model):
            tokens = model.generate(prompt, 8, temperature=0)
    else:  # without generation mode (generate of a model sharded with hpZ enters it by itself)
        tokens = getattr(model.generate, "without_generation_mode", model.generate)(prompt, 8, temperature=0)
    gathers = ledger.summary(op="all_gather")["total"]
    result = {"equal": torch.equal(tokens, expected), "cross_node_bytes": gathers["cross_node_bytes"]}
    if use_generation_mode:  # generate on its own: the same tokens and bytes, nothing held after
        ledger.reset()
        result["automatic_equal"] = torch.equal(model.generate(prompt, 8, temperature=0), expected)
        result["automatic_cross_node_bytes"] = ledger.summary(op="all_gather")["total"]["cross_node_bytes"]
        result["held_after"] = held_secondary_copy_bytes(model)
    return result


@pytest.mark.parametrize("mode,use_generation_mode", [
    ("zero3", False),
    pytest.param("hpz", True, marks=pytest.mark.slow),
    pytest.param("all", True, marks=pytest.mark.slow),
])
def test_sharded_greedy_tokens_equal_the_unsharded_model(mode: str, use_generation_mode: bool) -> None:
    """fp32 greedy decoding, 8 new tokens per row, 4 ranks (2x2), each with its own prompts:
    ZeRO-3 and hpZ in generation mode give exactly the unsharded model's tokens; all three
    (INT8 weights) exactly the tokens of the unsharded model holding qwZ's weights,
    dequantize(quantize(shard)) of every shard (the secondary copy keeps those values, so every
    later forward computes with them too). On this random tiny model the logits are so flat
    that INT8's ~0.4% weight error changes some argmaxes against the fp32 weights, so the
    quantized weights are the reference. Generation mode: after the first forward no byte
    crosses nodes (the 8 forwards' cross-node bytes are those of one); ``generate`` of a model
    sharded with hpZ enters it by itself (same tokens, same bytes, nothing held after)."""
    results = run_distributed(_generate_worker, 4, mode, use_generation_mode, env=TWO_BY_TWO)
    assert all(r["equal"] for r in results)
    if use_generation_mode:
        plain = run_distributed(_generate_worker, 4, mode, False, env=TWO_BY_TWO)
        for inside, outside in zip(results, plain):
            assert inside["cross_node_bytes"] * 8 <= outside["cross_node_bytes"] * 1.01
            assert inside["automatic_equal"] and inside["held_after"] == 0
            assert inside["automatic_cross_node_bytes"] == inside["cross_node_bytes"]


def _stale_worker(rank: int, world_size: int, copy: str) -> dict:
    torch.manual_seed(0)
    reference = make_model("gpt")
    model = zeropp.shard(make_model("gpt"), MODES["hpz"].config(2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, foreach=True)  # GPUs' default: no version bumped
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    prompt = torch.randint(0, VOCAB, (2, 4), generator=torch.Generator().manual_seed(rank))
    ledger = zeropp.comm_ledger()
    report = {}

    def check(name: str) -> None:
        ledger.reset()
        with torch.no_grad():
            ours, theirs = model(prompt)[0], reference(prompt)[0]
        gathers = ledger.summary(op="all_gather")["total"]
        report[name] = {"diff": (ours - theirs).abs().max().item(), "cross_node": gathers["cross_node_bytes"],
                        "gathered": gathers["bytes"]}

    meshes = post_forward_meshes(list(fsdp_units(model)))
    with zeropp.generation_mode(model, copy=copy):
        check("first")
        check("reused")
        report["held"] = held_secondary_copy_bytes(model)
        report["documented"] = generation_copy_bytes(model, copy)
        report["parameter_bytes"] = sum(p.numel() * 4 for p in reference.parameters())
        for p, q in zip(model.parameters(), reference.parameters()):  # an optimizer step
            p.grad = torch.full_like(p, 0.01)
            q.grad = torch.full_like(q, 0.01)
        optimizer.step(), reference_optimizer.step()
        optimizer.zero_grad(), reference_optimizer.zero_grad()
        check("after_step")
        donor = make_model("gpt", seed=7)  # a load
        set_model_state_dict(model, donor.state_dict(), options=StateDictOptions(full_state_dict=True))
        reference.load_state_dict(donor.state_dict())
        check("after_load")
        with torch.no_grad():  # an in-place edit through the public API
            for p, q in zip(model.parameters(), reference.parameters()):
                p.mul_(0.5), q.mul_(0.5)
        check("after_edit")
        x, y = (rows(t, rank, world_size) for t in global_batch(0, 8))
        model(x, y)[1].backward()  # a training forward (no step: same weights, copy dropped)
        model.zero_grad()
        check("after_training_forward")
        check("reused_again")
    report["held_after_exit"] = held_secondary_copy_bytes(model)
    # hpZ as before: every unit reshards after forward as it was sharded to
    after = post_forward_meshes(list(fsdp_units(model)))
    report["meshes_kept"] = len(after) == len(meshes) and all(a is b for a, b in zip(after, meshes))
    return report


@pytest.mark.parametrize("copy", ["node", pytest.param("full", marks=pytest.mark.slow)])
def test_generation_mode_is_never_stale_and_frees_its_copy(copy: str) -> None:
    """Inside generation_mode, between no_grad forwards: an optimizer step (a foreach one, which
    bumps no version counter of the DTensors it writes), a DCP load, an in-place edit and a
    training forward each make the next forward gather across nodes again and compute exactly
    what the unsharded model with the same weights computes; a forward with
    nothing changed gathers inside the node only (``copy="node"``) or nothing at all (``"full"``).
    The copy held is the documented parameters x bytes / ranks per node (or x bytes, whole),
    and leaving the context frees it."""
    for report in run_distributed(_stale_worker, 4, copy, env=TWO_BY_TWO):
        for name in ("first", "reused", "after_step", "after_load", "after_edit", "after_training_forward",
                     "reused_again"):
            assert report[name]["diff"] <= 1e-5, (name, report[name])
        refilled = ("first", "after_step", "after_load", "after_edit", "after_training_forward")
        assert all(report[name]["cross_node"] > 0 for name in refilled), report
        assert report["reused"]["cross_node"] == 0 and report["reused_again"]["cross_node"] == 0
        assert report["held"] == report["documented"] > 0
        assert report["held_after_exit"] == 0
        assert report["meshes_kept"]
        if copy == "full":
            assert report["documented"] == report["parameter_bytes"]
            assert report["reused"]["gathered"] == 0 and report["reused_again"]["gathered"] == 0
        else:
            assert report["parameter_bytes"] / 2 <= report["documented"] <= report["parameter_bytes"] / 2 * 1.05
            assert report["reused"]["gathered"] > 0


def _no_hpz_worker(rank: int, world_size: int) -> str:
    model = zeropp.shard(make_model("gpt"), MODES["qwz"].config(2))
    try:
        with zeropp.generation_mode(model):
            pass
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.slow
def test_generation_mode_without_hpz_says_what_is_needed() -> None:
    message = run_distributed(_no_hpz_worker, 4, env=TWO_BY_TWO)[0]
    assert "hpz_partition_size > 1" in message


def _hf_worker(rank: int, world_size: int, mode: str) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    reference = LlamaForCausalLM(config)
    model = LlamaForCausalLM(config)
    model.load_state_dict(reference.state_dict())
    zeropp.shard(model, MODES[mode].config(2))
    prompt = torch.randint(0, 48, (2, 5), generator=torch.Generator().manual_seed(rank))
    expected = reference.generate(prompt, max_new_tokens=8, do_sample=False)
    plain = model.generate(prompt, max_new_tokens=8, do_sample=False)
    with zeropp.generation_mode(model):
        reused = model.generate(prompt, max_new_tokens=8, do_sample=False)
    return {"plain": torch.equal(plain, expected), "reused": torch.equal(reused, expected)}


@pytest.mark.slow
def test_hf_generate_on_a_sharded_llama() -> None:
    """HF ``generate`` (greedy, DynamicCache) on a tiny random LlamaForCausalLM sharded with
    hpZ, fp32: the unsharded model's tokens, with and without generation mode."""
    pytest.importorskip("transformers")
    results = run_distributed(_hf_worker, 4, "hpz", env=TWO_BY_TWO)
    assert all(r["plain"] and r["reused"] for r in results), results


@pytest.mark.slow
def test_bench_generate_on_the_emulated_cluster(tmp_path) -> None:
    """A tiny ``zeropp bench generate`` at unlimited bandwidth: every mode reports tokens/s, and
    in generation mode all three send at most 0.1x ZeRO-3's cross-node bytes per token (the
    weights cross once per generation, INT8), with either copy."""
    from zeropp.tools.bench import generate
    from zeropp.tools.cluster import check_support
    from zeropp.tools.cluster.netns import list_namespaces

    reason = check_support()
    if reason is not None or list_namespaces():
        pytest.skip(reason or "another emulated cluster is up")
    config = generate.GenerateConfig(repeats=1, new_tokens=6, num_layers=1, embed_dim=64)
    results = generate.run(str(tmp_path), bandwidths=("unlimited",), config=config)["bandwidths"]["unlimited"]
    assert set(results) == set(generate.GENERATE_MODES)
    assert all(r["tokens_per_s"] > 0 for r in results.values())
    for mode in ("all", "all_full"):
        assert results[mode]["cross_node_bytes_per_token"] <= 0.1 * results["zero3"]["cross_node_bytes_per_token"]
    assert (tmp_path / "bench_generate.png").stat().st_size > 0


def test_generation_mode_refuses_an_unknown_copy() -> None:
    with pytest.raises(ValueError, match="copy='half' is not one of \\('node', 'full'\\)"):
        with zeropp.generation_mode(torch.nn.Linear(2, 2), copy="half"):
            pass
