"""The demo model zeropp trains: a small character-level GPT."""

from zeropp.tools.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
