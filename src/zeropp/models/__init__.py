"""The demo model zeropp trains: a small character-level GPT."""

from zeropp.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
