"""A small decoder-only character-level GPT, the demo model that zeropp trains and benchmarks.

Every parameter is an ordinary ``nn.Parameter`` inside a standard module and the model holds no
buffers, so ``fully_shard`` can be applied to each entry of ``GPT.blocks`` and then to the root.
There is no dropout: a training step is a deterministic function of the weights and the batch, which
lets the tests compare sharded training against a single-process run.

Initialization: every ``nn.Linear`` and ``nn.Embedding`` weight is drawn from N(0, 0.02²), every
bias is zero, and LayerNorms start as the identity (weight one, bias zero). The model takes no seed;
the caller seeds torch (``torch.manual_seed``) before constructing it.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

INIT_STD = 0.02
"""Standard deviation of the normal distribution every weight matrix is drawn from."""


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of a GPT."""

    vocab_size: int = 128
    """Number of distinct tokens (characters for the Shakespeare corpus)."""
    context_length: int = 64
    """Longest sequence the model accepts; also the number of learned position embeddings."""
    num_layers: int = 4
    """Number of transformer blocks."""
    num_heads: int = 4
    """Attention heads per block; must divide ``embed_dim``."""
    embed_dim: int = 128
    """Width of the residual stream."""
    tie_embeddings: bool = False
    """Use the token embedding matrix as the output projection (one shared Parameter)."""

    def __post_init__(self) -> None:
        if self.embed_dim % self.num_heads != 0:
            raise ValueError(
                f"embed_dim={self.embed_dim} is not divisible by num_heads={self.num_heads}; "
                "choose num_heads among the divisors of embed_dim"
            )


@dataclass
class KVCache:
    """One block's keys and values of the tokens seen so far, (B, H, T, C/H) each, for sampling."""

    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def extend(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new positions; return every position's keys and values."""
        if self.keys is not None:
            keys, values = torch.cat([self.keys, keys], dim=2), torch.cat([self.values, values], dim=2)
        self.keys, self.values = keys, values
        return keys, values


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which position t attends to positions 0..t only."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.qkv = nn.Linear(config.embed_dim, 3 * config.embed_dim)
        self.proj = nn.Linear(config.embed_dim, config.embed_dim)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        batch_size, seq_len, embed_dim = x.shape
        # (B, T, 3C) -> three tensors of shape (B, H, T, C/H)
        q, k, v = (
            t.view(batch_size, seq_len, self.num_heads, -1).transpose(1, 2)
            for t in self.qkv(x).split(embed_dim, dim=2)
        )
        past = 0 if cache is None else cache.length
        if cache is not None:
            k, v = cache.extend(k, v)
        if past == 0:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # new position i (at past + i) sees positions 0..past + i
            visible = torch.ones(seq_len, past + seq_len, dtype=torch.bool, device=x.device).tril(past)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=visible)
        return self.proj(y.transpose(1, 2).reshape(batch_size, seq_len, embed_dim))


class MLP(nn.Module):
    """Position-wise feed-forward network, 4x wide with GELU."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.embed_dim, 4 * config.embed_dim)
        self.proj = nn.Linear(4 * config.embed_dim, config.embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(config.embed_dim)
        self.attn = CausalSelfAttention(config)
        self.mlp_norm = nn.LayerNorm(config.embed_dim)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cache)
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """Token + position embeddings, ``num_layers`` blocks, a final LayerNorm and a linear head."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.embed_dim)
        self.position_embedding = nn.Embedding(config.context_length, config.embed_dim)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.num_layers)])
        self.final_norm = nn.LayerNorm(config.embed_dim)
        self.lm_head = nn.Linear(config.embed_dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.token_embedding.weight
        self.apply(_init_weights)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, cache: list[KVCache] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (B, T, vocab_size) for token ids ``idx`` (B, T), and the mean cross-entropy
        against ``targets`` (B, T) when they are given (computed in fp32 whatever the dtype).
        With ``cache`` (one ``KVCache`` per block), ``idx`` continues the cached tokens."""
        past = 0 if cache is None else cache[0].length
        seq_len = idx.shape[1]
        if past + seq_len > self.config.context_length:
            raise ValueError(
                f"sequence length {past + seq_len} exceeds context_length={self.config.context_length}"
            )
        positions = torch.arange(past, past + seq_len, device=idx.device)
        x = self.token_embedding(idx) + self.position_embedding(positions)
        for i, block in enumerate(self.blocks):
            x = block(x) if cache is None else block(x, cache[i])
        logits = self.lm_head(self.final_norm(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        return logits, loss

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Continue ``prompt`` (B, T) by ``max_new_tokens`` sampled tokens; returns (B, T + new).

        One forward over the prompt fills a KV cache, then one single-token forward per new token.
        ``temperature`` 0 is greedy decoding; ``top_k`` keeps the k likeliest tokens. On a
        sharded model every rank must call it with the same ``max_new_tokens`` (each forward
        gathers weights collectively)."""
        if prompt.shape[1] + max_new_tokens > self.config.context_length:
            raise ValueError(f"prompt length {prompt.shape[1]} + max_new_tokens={max_new_tokens} exceeds "
                             f"context_length={self.config.context_length}")
        cache = [KVCache() for _ in self.blocks]
        tokens, step_input = prompt, prompt
        for _ in range(max_new_tokens):
            logits, _ = self(step_input, cache=cache)
            step_input = _sample(logits[:, -1].float(), temperature, top_k, generator)
            tokens = torch.cat([tokens, step_input], dim=1)
        return tokens

    def num_parameters(self) -> int:
        """Number of distinct parameter elements (a tied matrix counts once)."""
        return sum(p.numel() for p in self.parameters())


def _sample(logits: torch.Tensor, temperature: float, top_k: int | None,
            generator: torch.Generator | None) -> torch.Tensor:
    """One token id per row (B, 1) from last-position logits (B, vocab)."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
