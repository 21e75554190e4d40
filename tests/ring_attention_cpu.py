"""torch's context-parallel ring attention with CPU's flash kernel, for the tests on gloo CPU ranks.

torch (2.13) runs context parallel's SDPA path by giving DTensor's dispatcher a handler for each
of its CUDA attention kernels (flash, efficient, cuDNN), which runs its ring attention
(``_templated_ring_attention``: keys and values passed round the ``cp`` group, the partial outputs
merged by their log-sum-exp) on the local shards. On CPU, SDPA calls
``_scaled_dot_product_flash_attention_for_cpu`` instead, which has no handler. ``install`` gives
it and its backward the same ring, with the CPU kernel as the attention op; everything else
(torchtitan's sequence sharding and load balancing, the ring's exchanges and merge) is torch's
and torchtitan's own.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental._context_parallel import _attention as context_parallel

aten = torch.ops.aten
SEQ_DIM = 2
"""SDPA's (batch, heads, sequence, head dim) layout."""


def _attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, is_causal: bool,
               dropout_p: float = 0.0, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, dropout_p, is_causal, scale=scale)


def _attention_backward(*, grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        out: torch.Tensor, logsumexp: torch.Tensor, is_causal: bool, dropout_p: float = 0.0,
                        scale: float | None = None) -> tuple[torch.Tensor, ...]:
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(grad_out, query, key, value, out, logsumexp,
                                                                      dropout_p, is_causal, scale=scale)


def _local(tensor: Any) -> Any:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _forward_handler(op_call: Any, args: tuple, kwargs: dict) -> tuple[DTensor, DTensor]:
    query, key, value = args[:3]
    dropout_p = args[3] if len(args) > 3 else kwargs.get("dropout_p", 0.0)
    is_causal = args[4] if len(args) > 4 else kwargs.get("is_causal", False)
    if kwargs.get("attn_mask") is not None:
        raise NotImplementedError("the CPU ring attention takes no attn_mask (torchtitan's SDPA path passes none)")
    mesh, placements = query.device_mesh, query.placements
    out, logsumexp = context_parallel._templated_ring_attention(
        mesh.get_group(), SEQ_DIM, _attention, _local(query), _local(key), _local(value),
        is_causal=is_causal, dropout_p=dropout_p, scale=kwargs.get("scale"))
    return (DTensor.from_local(out, mesh, placements, run_check=False),
            DTensor.from_local(logsumexp, mesh, placements, run_check=False))


def _backward_handler(op_call: Any, args: tuple, kwargs: dict) -> tuple[DTensor, ...]:
    grad_out, query, key, value, out, logsumexp, dropout_p, is_causal = args[:8]
    mesh, placements = query.device_mesh, query.placements
    grads = context_parallel._templated_ring_attention_backward(
        mesh.get_group(), SEQ_DIM, _attention_backward, _local(grad_out), "grad_out", _local(query), _local(key),
        _local(value), _local(out), _local(logsumexp), is_causal, dropout_p=dropout_p, scale=kwargs.get("scale"))
    return tuple(DTensor.from_local(grad, mesh, placements, run_check=False) for grad in grads[:3])


def install() -> None:
    """Route the CPU flash kernel, forward and backward, on context-parallel DTensors to the ring."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    handlers[aten._scaled_dot_product_flash_attention_for_cpu.default] = _forward_handler
    handlers[aten._scaled_dot_product_flash_attention_for_cpu_backward.default] = _backward_handler
