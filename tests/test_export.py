"""Export in qwZ's 8-bit code: Q8_0 keeps qwZ's bound, safetensors-int8 is qwZ's code bit for bit,
and a real zeropp checkpoint of a tiny Llama becomes a GGUF that the ``gguf`` package and
llama.cpp read back (SmolLM2's figures: ``zeropp bench export``)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from distributed import run_distributed
from zeropp.checkpoint import export
from zeropp.codes import quant
from zeropp.tools.cli import main as zeropp_main

FP32_UNIT_ROUNDOFF = 2.0**-24


def _weights(seed: int, shape: tuple[int, ...], log2_magnitude: int) -> torch.Tensor:
    """Heavy-tailed values with a zero block and a near-zero block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randn(shape, generator=g) * 2) * 2.0**log2_magnitude
    flat = x.view(-1)
    flat[:32] = 0
    flat[32:64] *= 2.0**-30
    return x


def _within_bound(x: torch.Tensor, decoded: torch.Tensor, scale_per_element: torch.Tensor) -> bool:
    """|x - decoded| <= scale / 2, plus fp32 rounding of the division and product
    ((2 * 127 + 1) * scale * 2**-24, see zeropp.codes.quant.error_bound)."""
    slack = scale_per_element * (255 * FP32_UNIT_ROUNDOFF) + 2.0**-149
    return bool(((x.double() - decoded.double()).abs() <= scale_per_element.double() / 2 + slack).all())


@pytest.mark.parametrize(("seed", "log2_magnitude"), [(0, 0), (1, -20), (2, 10), (3, -3)])
def test_q8_0_is_qwz_code_with_the_scale_rounded_up_to_fp16(seed: int, log2_magnitude: int) -> None:
    x = _weights(seed, (48, 96), log2_magnitude)
    codes, scales = export.q8_0("w", x)
    assert codes.dtype == torch.int8 and scales.dtype == torch.float16 and scales.numel() == x.numel() // 32
    assert int(codes.abs().max()) <= 127
    absmax = x.view(-1, 32).abs().amax(dim=1)
    qwz_scales = quant._block_scales(x.view(-1, 32).clone(), 8)
    assert bool((scales.float() >= qwz_scales).all()), "an fp16 scale below absmax / 127 could clip"
    one_step_down = scales.nextafter(torch.full_like(scales, -torch.inf)).float()
    assert bool(((one_step_down < qwz_scales) | (scales == 0)).all()), "not the nearest fp16 at or above"
    assert bool((scales[absmax == 0] == 0).all()) and bool((codes.view(-1, 32)[absmax == 0] == 0).all())
    decoded = export.decode_blocks(codes, scales, 32, tuple(x.shape))
    assert _within_bound(x, decoded, scales.float().repeat_interleave(32).view(x.shape))


def test_q8_0_refuses_what_it_cannot_hold() -> None:
    with pytest.raises(ValueError, match=r"'w' holds NaN or inf"):
        export.q8_0("w", torch.tensor([[1.0, float("nan")] * 16]))
    with pytest.raises(ValueError, match=r"'w' has a block whose absmax / 127 exceeds fp16's largest"):
        export.q8_0("w", torch.full((1, 32), 1e8))
    with pytest.raises(ValueError, match=r"'w' \(shape \(2, 40\)\).*multiple of 32"):
        export.q8_0("w", torch.ones(2, 40))


def test_safetensors_int8_holds_qwz_codes_and_the_layout(tmp_path: Path) -> None:
    from safetensors import safe_open

    state = {"embed.weight": _weights(0, (100, 24), 0), "proj.weight": _weights(1, (24, 24), -5).bfloat16(),
             "norm.weight": torch.rand(24), "step": torch.tensor(7)}
    out = export.save_safetensors_int8(state, tmp_path / "model.safetensors", block_size=64)
    assert not (tmp_path / "model.safetensors.partial").exists()
    with safe_open(str(out), framework="pt") as file:
        layout = json.loads(file.metadata()[export.INT8_LAYOUT_KEY])
        assert layout["block_size"] == 64 and set(layout["quantized"]) == {"embed.weight", "proj.weight"}
        for name in layout["quantized"]:
            codes, scales = file.get_tensor(name), file.get_tensor(name + ".scales")
            data, expected_scales = quant.quantize(state[name].reshape(-1), 8, 64)
            assert codes.dtype == torch.int8 and codes.shape == state[name].shape
            assert torch.equal(codes.view(-1), data[:codes.numel()].view(torch.int8))
            assert torch.equal(scales, expected_scales)
        assert torch.equal(file.get_tensor("norm.weight"), state["norm.weight"])
    loaded = export.load_safetensors_int8(out)
    assert loaded["step"].item() == 7 and loaded["proj.weight"].dtype == torch.bfloat16
    for name in ("embed.weight", "proj.weight"):
        data, scales = quant.quantize(state[name].reshape(-1), 8, 64)
        expected = quant.dequantize(data, scales, 8, 64, state[name].numel(), state[name].dtype)
        assert torch.equal(loaded[name].view(-1), expected)


needs_gguf = pytest.mark.skipif(importlib.util.find_spec("gguf") is None,
                                reason="GGUF export needs the gguf package: pip install gguf")
PROMPT_IDS = [5, 17, 200, 3, 99, 64, 128, 7, 250, 31, 0, 42]


def _tiny_llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                       rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                       tie_word_embeddings=True, bos_token_id=0, eos_token_id=1, pad_token_id=1)


def _write_template(path: Path, config) -> None:
    """A GGUF holding only the tiny Llama's metadata and a byte-level vocabulary, as a model's
    own GGUF file would (for SmolLM2: the file it was read from)."""
    import gguf

    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    tokens = [f"<{i}>" if i < 32 else chr(i + 256) for i in range(config.vocab_size - 1)]
    writer.add_token_list([*tokens, tokens[32] + tokens[33]])  # llama.cpp wants at least one merge
    writer.add_token_types([gguf.TokenType.NORMAL] * config.vocab_size)
    writer.add_token_merges([f"{tokens[32]} {tokens[33]}"])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_pad_token_id(config.pad_token_id)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _save_checkpoint(rank: int, world_size: int, model_file: str, directory: str) -> bool:
    """Shard the saved model with zeropp (qwZ on) and write a zeropp checkpoint of it."""
    from transformers import LlamaConfig

    import zeropp
    from zeropp.checkpoint import save
    from zeropp.tools.models.smollm import llama_from_state

    saved = torch.load(model_file, mmap=True)
    model = llama_from_state(LlamaConfig(**saved["config"]), saved["state"])
    model = zeropp.shard(model, zeropp.ZeroPPConfig(quantized_weights=True))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    save(directory, "exported", model=model, optimizer=optimizer, engine_state={"global_steps": 0}, rank_state={})
    return True


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A tiny random Llama, a two-rank zeropp checkpoint of it, and both exports made by the CLI."""
    from transformers import LlamaForCausalLM

    root = tmp_path_factory.mktemp("export")
    torch.manual_seed(0)
    config = _tiny_llama_config()
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # llama.cpp's Q8_0 x Q8_0 dot products need realistic magnitudes, not init's 0.02
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0, parameter.shape[1] ** -0.5)
    torch.save({"config": config.to_dict(), "state": model.state_dict()}, root / "model.pt")
    _write_template(root / "template.gguf", config)
    assert run_distributed(_save_checkpoint, 2, str(root / "model.pt"), str(root / "ckpt"), timeout=300) == [True] * 2
    for fmt, name in (("gguf-q8_0", "model.gguf"), ("safetensors-int8", "model.safetensors")):
        with pytest.raises(SystemExit) as done:
            zeropp_main(["checkpoint", "export", str(root / "ckpt"), str(root / name), "--format", fmt,
                         "--template", str(root / "template.gguf")])
        assert done.value.code in (0, None)
    return {"model": model, "gguf": root / "model.gguf", "template": root / "template.gguf",
            "safetensors": root / "model.safetensors", "ckpt": root / "ckpt"}


@needs_gguf
def test_gguf_export_reads_back_within_qwz_bound(exported: dict) -> None:
    """The gguf package's own reader and Q8_0 decoder see every matrix in Q8_0 within qwZ's bound
    of the checkpoint's weights (Q/K rows in llama.cpp's order), vectors in fp32 exactly, the
    tokenizer and hyper-parameters of the template, and the layer count of the checkpoint."""
    import gguf
    from gguf.quants import dequantize

    from zeropp.checkpoint.llama_gguf import gguf_name, permute_rotary_rows

    state, config = exported["model"].state_dict(), exported["model"].config
    reader = gguf.GGUFReader(exported["gguf"])
    assert reader.fields["llama.block_count"].contents() == config.num_hidden_layers
    assert reader.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q8_0
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == config.vocab_size
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    assert "output.weight" not in tensors  # tied to the embedding, as in the template
    assert len(tensors) == len(state) - 1
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    for name, weight in state.items():
        if name == "lm_head.weight":
            continue
        tensor = tensors[gguf_name(name)]
        decoded = dequantize(tensor.data, tensor.tensor_type).reshape(tuple(reversed([int(d) for d in tensor.shape])))
        expected = weight.float().numpy()
        if name.split(".")[-2] in heads:
            expected = permute_rotary_rows(expected, heads[name.split(".")[-2]])
        if weight.dim() == 1:
            assert tensor.tensor_type == gguf.GGMLQuantizationType.F32 and np.array_equal(decoded, expected)
            continue
        assert tensor.tensor_type == gguf.GGMLQuantizationType.Q8_0, name
        codes, scales = export.q8_0(name, torch.from_numpy(expected))
        ours = export.decode_blocks(codes, scales, 32, expected.shape).numpy()
        assert np.array_equal(decoded, ours), f"{name}: gguf decodes other values than code * d"
        per_element = scales.float().repeat_interleave(32).view(expected.shape)
        assert _within_bound(torch.from_numpy(expected), torch.from_numpy(decoded), per_element), name


@needs_gguf
def test_safetensors_export_of_a_checkpoint_decodes_within_bound(exported: dict) -> None:
    state = exported["model"].state_dict()
    loaded = export.load_safetensors_int8(exported["safetensors"])
    assert set(loaded) == set(state)
    for name, weight in state.items():
        if weight.dim() == 1:
            assert torch.equal(loaded[name], weight)
            continue
        _, scales = quant.quantize(weight.reshape(-1), 8, 256)
        scale_per_element = quant.error_bound(scales, 256, weight.numel()).view(weight.shape) * 2
        assert _within_bound(weight, loaded[name], scale_per_element)


@needs_gguf
def test_export_refuses_a_template_of_another_model(exported: dict, tmp_path: Path) -> None:
    state = dict(exported["model"].state_dict())
    state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"][:100]
    with pytest.raises(ValueError, match=r"256 tokens of width 64, but the model's embedding is \(100, 64\)"):
        export.save_gguf_q8_0(state, tmp_path / "x.gguf", exported["template"])
    assert not list(tmp_path.iterdir()), "a failed export left a file behind"


LLAMA_CPP_LOGIT_TOLERANCE = 0.2
"""Largest |logit difference| allowed between llama.cpp on the Q8_0 file and transformers on the
same decoded weights, for the tiny model's logits (up to about 3.6). llama.cpp's CPU matmuls
also quantize the activations to 8-bit blocks (its Q8_0 x Q8_0 dot product), which transformers
does not; measured: 0.058 at most, 0.013 on average."""


@needs_gguf
@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                    reason="the llama.cpp comparison needs llama-cpp-python: pip install llama-cpp-python")
def test_llama_cpp_runs_the_export_like_the_decoded_model(exported: dict) -> None:
    """llama.cpp loads the exported GGUF; its next-token logits on a prompt match transformers'
    Llama holding the decoded Q8_0 weights, and the argmax agrees at every position."""
    import gguf
    from llama_cpp import Llama

    from zeropp.tools.models.smollm import llama_from_gguf

    ids = PROMPT_IDS
    decoded_model = llama_from_gguf(gguf.GGUFReader(exported["gguf"]))
    with torch.no_grad():
        reference = decoded_model(torch.tensor([ids])).logits[0].numpy()
    engine = Llama(model_path=str(exported["gguf"]), n_ctx=128, logits_all=True, n_threads=1, verbose=False)
    engine.eval(ids)
    logits = np.asarray(engine.scores[:len(ids)])
    assert float(np.abs(logits - reference).max()) <= LLAMA_CPP_LOGIT_TOLERANCE
    assert np.array_equal(logits.argmax(axis=1), reference.argmax(axis=1))
