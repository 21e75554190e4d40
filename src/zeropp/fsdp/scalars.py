"""0-dim parameters (a learned temperature, a gate, CLIP's ``logit_scale``).

FSDP2 refuses to shard a parameter without a dimension; DeepSpeed ZeRO-3 accepts them, so a model
moving from DeepSpeed may have some. zeropp keeps each one whole on every rank, outside FSDP2
(``fully_shard(..., ignored_params=...)``): rank 0's value is broadcast once when the model is
sharded, and every backward averages its gradient over the world with one all-reduce of its 4
bytes, so every rank holds the same value and the same gradient and a stock optimizer keeps them
equal. Averaging after each backward is also right under gradient accumulation: the sum is
linear, and what was averaged before is already equal on every rank. Both collectives are
counted in the ledger (technique ``scalars``).

Consequences: the scalar's gradient is a plain tensor beside FSDP2's DTensor gradients, so a norm
over all gradients must count it once, not once per rank (``zeropp.initialize`` does);
``torch.nn.utils.clip_grad_norm_`` over a mix of DTensors and plain tensors is torch's to refuse.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from zeropp.fsdp.comms import Recorder, all_reduce_sum, broadcast
from zeropp.setup.topology import Topology


def scalar_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The 0-dim parameters of ``model`` (each once, shared ones included)."""
    return [p for p in model.parameters() if p.dim() == 0]


def replicate_scalars(scalars: list[nn.Parameter], topology: Topology) -> None:
    """Make every rank's scalars rank 0's, and average their gradients after every backward."""
    recorder = Recorder(topology)
    for scalar in scalars:
        with torch.no_grad():
            broadcast(scalar.data, 0, None, recorder, "scalars")
        if scalar.requires_grad:
            scalar.register_post_accumulate_grad_hook(lambda p: _average_grad(p, recorder))


def _average_grad(scalar: nn.Parameter, recorder: Recorder) -> None:
    all_reduce_sum(scalar.grad, None, recorder, "scalars")
    scalar.grad.div_(dist.get_world_size())
