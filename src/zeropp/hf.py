"""``zeropp.hf``, the name users import: HF Trainer and TRL's trainers on a zeropp-sharded model."""

from __future__ import annotations

from typing import Any

from zeropp.integrations.hf import ZeroPPRequest, ZeroPPSource, ZeroPPTrainer, prepare_model, sharding_root

__all__ = ["ZeroPPRequest", "ZeroPPSource", "ZeroPPTrainer", "prepare_model", "sharding_root"]


_TRL_TRAINERS = ("ZeroPPGRPOTrainer", "ZeroPPSFTTrainer")


def __getattr__(name: str) -> Any:
    """``ZeroPPGRPOTrainer`` and ``ZeroPPSFTTrainer``, imported on first use (they need trl)."""
    if name in _TRL_TRAINERS:
        from zeropp.integrations import hf_trl

        return getattr(hf_trl, name)
    raise AttributeError(f"module 'zeropp.hf' has no attribute {name!r}")
