"""``zeropp.hf``, the name users import: HF Trainer and TRL's trainers on a zeropp-sharded model."""

from __future__ import annotations

from typing import Any

from zeropp.integrations import hf as _hf
from zeropp.integrations.hf import ZeroPPRequest, ZeroPPSource, ZeroPPTrainer, prepare_model, sharding_root

__all__ = ["ZeroPPRequest", "ZeroPPSource", "ZeroPPTrainer", "prepare_model", "sharding_root"]


def __getattr__(name: str) -> Any:
    """``ZeroPPGRPOTrainer`` and ``ZeroPPSFTTrainer``, imported on first use (they need trl)."""
    return getattr(_hf, name)
