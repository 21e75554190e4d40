"""``zeropp.torchtitan``, the module torchtitan's ``--module`` names: ZeRO++ in torchtitan's config functions."""

from zeropp.integrations.torchtitan import SPMD_BACKEND, ZeroPPParallelize, llama3_debugmodel, with_zeropp

__all__ = ["SPMD_BACKEND", "ZeroPPParallelize", "llama3_debugmodel", "with_zeropp"]
