"""The training corpora (Shakespeare's works; the King James Bible), one token per character."""

from zeropp.data.corpus import CORPORA, CharCorpus, kjv_text, shakespeare_text

__all__ = ["CORPORA", "CharCorpus", "kjv_text", "shakespeare_text"]
