"""zeropp: ZeRO++ (qwZ, hpZ, qgZ) on PyTorch FSDP2.

    model = zeropp.shard(model, zeropp.ZeroPPConfig(quantized_weights=True, hpz_partition_size=8,
                                                    quantized_gradients=True))

The public names are imported on first use, so ``import zeropp`` (and the ``zeropp`` command's
``--help``) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {
    "AuditRow": "zeropp.techniques.audit",
    "CommLedger": "zeropp.fsdp.ledger",
    "Topology": "zeropp.setup.topology",
    "ZeroPPConfig": "zeropp.config",
    "ZeroPPEngine": "zeropp.engine",
    "audit_report": "zeropp.techniques.audit",
    "comm_ledger": "zeropp.fsdp.ledger",
    "enable": "zeropp.setup.sharding",
    "explain": "zeropp.setup.explain",
    "generation_mode": "zeropp.techniques.hpz",
    "initialize": "zeropp.engine",
    "offload_optimizer": "zeropp.fsdp.offload",
    "optimizer_in_backward": "zeropp.fsdp.stepping",
    "refresh_weights": "zeropp.techniques.deltas",
    "save_full_weights": "zeropp.checkpoint.full",
    "shard": "zeropp.setup.sharding",
    "sharded_comms": "zeropp.setup.sharding",
}
__all__ = sorted(_PUBLIC)
__version__ = "0.2.0"


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'zeropp' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value
