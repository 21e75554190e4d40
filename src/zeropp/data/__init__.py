"""The training corpus: Shakespeare's works, one token per character."""

from zeropp.data.corpus import CharCorpus, shakespeare_text

__all__ = ["CharCorpus", "shakespeare_text"]
