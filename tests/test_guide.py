"""docs/guide.md holds what the code says: the generated tables equal ``zeropp.tools.guide``'s, and every
config field, subcommand and environment variable zeropp reads is in it."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from zeropp.config import TrainingConfig, ZeroPPConfig
from zeropp.tools import cli, guide

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guide.md"
SOURCE = Path(__file__).resolve().parents[1] / "src" / "zeropp"


def test_the_generated_tables_are_current() -> None:
    text = GUIDE.read_text(encoding="utf-8")
    current = text[text.index(guide.BEGIN) + len(guide.BEGIN):text.index(guide.END)].strip()
    assert current == guide.generated(), "run: python -m zeropp.tools.guide --write docs/guide.md"


def test_every_field_subcommand_and_environment_variable_is_in_the_guide() -> None:
    text = GUIDE.read_text(encoding="utf-8")
    for cls in (ZeroPPConfig, TrainingConfig):
        docs = guide.field_docstrings(cls)
        for field in dataclasses.fields(cls):
            assert f"| `{field.name}` |" in text, field.name
            assert docs.get(field.name), f"{cls.__name__}.{field.name} has no docstring"
    for name in cli.COMMANDS:
        assert f"### `zeropp {name}`" in text, name
    read = {m for path in SOURCE.rglob("*.py") for m in re.findall(r'"(ZEROPP_[A-Z_]+)"', path.read_text())}
    assert read and all(f"`{name}`" in text for name in read), read
