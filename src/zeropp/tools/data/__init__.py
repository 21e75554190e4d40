"""The training corpora (Shakespeare's works; the King James Bible), one token per character."""

from zeropp.tools.data.corpus import CORPORA, CharCorpus, book_of_mormon_text, kjv_text, shakespeare_text

__all__ = ["CORPORA", "CharCorpus", "book_of_mormon_text", "kjv_text", "shakespeare_text"]
