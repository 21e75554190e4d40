"""``zeropp.accelerate``, the name users import: accelerate's loops on a zeropp-sharded model."""

from zeropp.integrations.accelerate import attach, full_state_dict, is_zeropp_model

__all__ = ["attach", "full_state_dict", "is_zeropp_model"]
