"""A model as the cost model sees it: its FSDP2 units' parameter shapes and the dimensions that
set its compute and activation memory, read from a real module built on the meta device (no
memory, any size), a ``GPTConfig``, or a Hugging Face config."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zeropp.tools.models import GPT, GPTConfig


@dataclass(frozen=True)
class UnitShape:
    """One FSDP2 unit: the parameters it gathers and reduces as one flat buffer."""

    name: str
    shapes: tuple[tuple[int, ...], ...]
    trainable: tuple[bool, ...]
    is_block: bool = True
    """One of the model's repeated blocks (its activations are a block's); False for the other
    units: the root, and the embedding, final norm or head where they are units of their own."""
    is_single_layer: bool = False
    """One layer in a unit of its own (a head, a final norm, an embedding), whose weight's
    gradient stays held until FSDP2's post-backward has returned, reduce-scatter included: for a
    layer applied to an input that needs a gradient, autograd's node yields the weight's gradient
    and the input's together and the input's triggers the post-backward; an embedding's input
    (token ids) needs none, so its post-backward runs from FSDP2's final callback, with the
    gradient still on the parameter."""
    experts: tuple[bool, ...] = ()
    """Per parameter: a routed expert's (dim 0 one row per expert, under a module named
    ``experts``), which expert parallelism shards over its own mesh ([Note: expert parallel in
    the plan] in ``zeropp.tools.plan.layout``); empty for a unit without."""

    @property
    def num_parameters(self) -> int:
        return sum(math.prod(shape) for shape in self.shapes)


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """What the cost model needs to know about a model."""

    name: str
    units: tuple[UnitShape, ...]
    """The repeated blocks in forward order, then the root (embeddings, final norm, head)."""
    num_layers: int
    embed_dim: int
    num_heads: int
    vocab_size: int
    num_trainable_scalars: int = 0
    """0-dim trainable parameters, kept whole on every rank (``zeropp.fsdp.scalars``)."""
    architecture: str = "gpt"
    """Whose block layout the activations follow: "gpt" (GPT-2: LayerNorm, 4x GELU MLP) or
    "llama" (RMSNorm, grouped-query attention, SwiGLU MLP)."""
    ffn_dim: int = 0
    """The MLP's inner width (Llama); GPT's is 4 x ``embed_dim``."""
    num_kv_heads: int = 0
    """Key and value heads (Llama's grouped-query attention); GPT has ``num_heads``."""
    num_experts: int = 0
    """Routed experts per MoE layer (0: a dense model)."""
    experts_per_token: int = 0
    """Experts each token is routed to (top-k)."""

    @property
    def num_parameters(self) -> int:
        return sum(unit.num_parameters for unit in self.units) + self.num_trainable_scalars

    @property
    def expert_parameters(self) -> int:
        """The routed experts' parameters, all layers."""
        return sum(math.prod(shape) for unit in self.units for shape, expert in zip(unit.shapes, unit.experts)
                   if expert)

    @property
    def active_parameters(self) -> int:
        """Parameters one token's forward multiplies by: all but the experts it is not routed to."""
        if not self.num_experts:
            return self.num_parameters
        unused = self.expert_parameters * (self.num_experts - self.experts_per_token) / self.num_experts
        return self.num_parameters - round(unused)

    def training_flops_per_token(self, context_length: int) -> float:
        """Forward and backward FLOPs per token: 6 per parameter the token meets (a multiply-add
        forward, two backward; an MoE's routed experts only top-k of E) plus attention's scores
        and weighted sums, 12 x layers x width x context (Kaplan et al. 2020, section 2.1;
        Narayanan et al. 2021, appendix)."""
        return 6.0 * self.active_parameters + 12.0 * self.num_layers * self.embed_dim * context_length

    def activation_bytes(self, batch: int, context_length: int, checkpointing: bool, itemsize: int = 2) -> float:
        """Activations a rank holds for backward with 16-bit compute (Korthikanti et al. 2022,
        section 4.1: 34 s b h + 5 a s^2 b bytes per layer) plus the fp32 logits; with full
        activation checkpointing only each layer's input (2 s b h bytes) and one layer's
        activations. Scaled by ``itemsize`` / 2 for other compute dtypes."""
        s, b, h, a = context_length, batch, self.embed_dim, self.num_heads
        per_layer = (34 * s * b * h + 5 * a * s * s * b) * itemsize / 2
        logits = 4 * s * b * self.vocab_size
        if checkpointing:
            return self.num_layers * s * b * h * itemsize + per_layer + logits
        return self.num_layers * per_layer + logits

    def block_activation_bytes(self, batch: int, context_length: int, itemsize: int = 2,
                               tensor_parallel: int = 1) -> float:
        """What one block saves for backward, on one rank of a tensor parallel group of
        ``tensor_parallel`` (t) ranks splitting its attention heads and MLP (Megatron's split, no
        sequence parallelism). GPT: Korthikanti et al.'s s b h (10 + 24 / t) + 5 a s^2 b / t bytes
        (16-bit; their section 4.2, equation 2: 34 s b h + 5 a s^2 b without tensor parallel), scaled by
        ``itemsize`` / 2. Llama (Hugging Face's, 16-bit compute, SDPA; counted from the tensors
        autograd saves): per token each RMSNorm keeps its fp32 input, its reciprocal root and two
        16-bit copies (8h + 4 bytes, whole on every rank), attention the rotated queries, keys and
        values, its output and fp32 log-sum-exp (4h + 4 h_kv + 4a, split), the SwiGLU MLP four
        tensors of its inner width (8f, split): 16h + 8 + (4h + 4 h_kv + 4a + 8f) / t bytes per
        token."""
        tokens, h, t = batch * context_length, self.embed_dim, tensor_parallel
        if self.architecture != "llama":
            return (10 * t * tokens * h + 24 * tokens * h + 5 * self.num_heads * context_length * tokens) * itemsize / (
                2 * t)
        kv_dim = self.num_kv_heads * h // self.num_heads
        return tokens * (t * (16 * h + 8) + 4 * h + 4 * kv_dim + 4 * self.num_heads + 8 * self.ffn_dim) / t

    def head_activation_bytes(self, batch: int, context_length: int, tensor_parallel: int = 1) -> float:
        """What the final norm and the loss save for backward: the fp32 log-probabilities over the
        vocabulary (4 V bytes per token; split by vocabulary over ``tensor_parallel`` ranks) and,
        for Llama, the final RMSNorm's 8h + 4 (whole)."""
        norm = 8 * self.embed_dim + 4 if self.architecture == "llama" else 0
        return batch * context_length * (4 * self.vocab_size + tensor_parallel * norm) / tensor_parallel


def from_module(model: nn.Module, units: list[nn.Module] | None = None, *, name: str, num_layers: int,
                embed_dim: int, num_heads: int, vocab_size: int, **dims: Any) -> ModelShape:
    """The unit layout ``zeropp.shard`` gives ``model`` (its default units, or ``units``), children
    first as FSDP2 claims parameters, reported in forward order with the root last. ``dims``:
    further ``ModelShape`` fields (``architecture``, ``ffn_dim``, ``num_kv_heads``)."""
    from zeropp.setup.sharding import default_units, select_units

    block_types = {type(block) for block in default_units(model)}
    claimed: set[int] = set()
    shapes = []
    for unit in [*select_units(model, units), model]:
        named = [(name, p) for name, p in unit.named_parameters() if id(p) not in claimed and p.dim() > 0]
        params = [p for _, p in named]
        claimed.update(id(p) for p in params)
        label = type(unit).__name__ if unit is not model else f"{type(model).__name__} (root)"
        single = unit is not model and not any(p.numel() for child in unit.children() for p in child.parameters())
        experts = tuple("experts" in name.split(".")[:-1] for name, _ in named)
        shapes.append(UnitShape(label, tuple(tuple(p.shape) for p in params), tuple(p.requires_grad for p in params),
                                is_block=unit is not model and type(unit) in block_types, is_single_layer=single,
                                experts=experts if any(experts) else ()))
    blocks, root = shapes[:-1][::-1], shapes[-1]
    scalars = sum(1 for p in model.parameters() if p.dim() == 0 and p.requires_grad)
    return ModelShape(name=name, units=(*blocks, root), num_layers=num_layers, embed_dim=embed_dim,
                      num_heads=num_heads, vocab_size=vocab_size, num_trainable_scalars=scalars, **dims)


def gpt(config: GPTConfig, name: str | None = None) -> ModelShape:
    """zeropp's GPT (GPT-2's layout: learned positions, LayerNorms, 4x MLP, biases)."""
    with torch.device("meta"):
        model = GPT(config)
    label = name or f"GPT {config.num_layers}x{config.embed_dim}"
    return from_module(model, name=label, num_layers=config.num_layers, embed_dim=config.embed_dim,
                       num_heads=config.num_heads, vocab_size=config.vocab_size)


def transformer(*, num_layers: int, embed_dim: int, num_heads: int, vocab_size: int = 50257,
                context_length: int = 2048, name: str | None = None) -> ModelShape:
    """A GPT-2 style decoder of the given size (the layout of Megatron-DeepSpeed's GPT models)."""
    config = GPTConfig(vocab_size=vocab_size, context_length=context_length, num_layers=num_layers,
                       num_heads=num_heads, embed_dim=embed_dim)
    return gpt(config, name)


def hf(config: Any, name: str | None = None) -> ModelShape:
    """A Hugging Face causal LM from its config (``transformers.PretrainedConfig``), built on the
    meta device; units are its decoder layers, as ``zeropp.shard`` picks them."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return hf_module(model, name=name)


LLAMA_LAYOUTS = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")
"""Hugging Face model types whose blocks are Llama's (RMSNorm, grouped-query attention, SwiGLU;
an MoE's routed SwiGLU experts in place of the MLP)."""


def hf_module(model: nn.Module, units: list[nn.Module] | None = None, name: str | None = None) -> ModelShape:
    """A Hugging Face causal LM (on the meta device or not), sharded in ``units`` (default: its
    decoder layers, as ``zeropp.shard`` picks them). An MoE's activations count each token's
    top-k experts' inner width as its MLP's."""
    config = model.config
    llama = config.model_type in LLAMA_LAYOUTS
    num_experts = getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0) or 0
    top_k = getattr(config, "num_experts_per_tok", 0) or 0 if num_experts else 0
    ffn = config.moe_intermediate_size * top_k if num_experts and hasattr(config, "moe_intermediate_size") \
        else getattr(config, "intermediate_size", 0)
    dims: dict[str, Any] = {"architecture": "llama", "ffn_dim": ffn,
                            "num_kv_heads": config.num_key_value_heads} if llama else {}
    if num_experts:
        dims.update(num_experts=num_experts, experts_per_token=top_k)
    return from_module(model, units, name=name or type(model).__name__, num_layers=config.num_hidden_layers,
                       embed_dim=config.hidden_size, num_heads=config.num_attention_heads,
                       vocab_size=config.vocab_size, **dims)

