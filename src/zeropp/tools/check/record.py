"""A section's side of ``zeropp check``: the context the runner hands it and the record it
writes as it goes.

A section runs in a process of its own (``python -m zeropp.tools.check.section``), which the
runner stops when the section's share of the budget is spent. So the record is rewritten after
every part (atomically: the runner reads it while the section runs), and a section stopped
midway leaves the parts it finished.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import traceback
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, kw_only=True)
class Context:
    """What a section is told by the runner."""

    device: str
    """"cuda" (the GPU form) or "cpu" (the smoke form)."""
    smoke: bool
    """Tiny shapes and few steps: proves the code path, measures nothing."""
    deadline: float
    """``time.time()`` by which the section must have written its last part."""
    folder: str
    """The section's own folder under the results folder (logs, pytest's log)."""
    num_gpus: int
    tests: str
    """The repository's tests folder (the correctness section runs pytest on it)."""

    def seconds_left(self) -> float:
        return self.deadline - time.time()

    def need(self, gpu_s: float, smoke_s: float = 1.0) -> float:
        """The seconds left, if at least ``gpu_s`` (``smoke_s`` in the smoke form); else ``Skip``."""
        left, least = self.seconds_left(), smoke_s if self.smoke else gpu_s
        if left < least:
            raise Skip(f"the section's allotment is spent: {max(left, 0):.0f} s left, {least:.0f} s needed")
        return left

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Context:
        return cls(**json.loads(text))


class Skip(Exception):
    """Raised in a part that cannot run here; its message is the reason."""


class Record:
    """The parts of one section, in the order they ran, each with a status: "passed" (every
    check held), "failed" (some did not), "skipped" (with the reason), "timed_out" (it did not
    finish within what was left of the allotment), "crashed" (with the error), or "running" (the
    part the section was stopped in)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.parts: dict[str, dict[str, Any]] = {}
        self.write()

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[dict[str, Any]]:
        """Run one part: the body fills the yielded dict (figures, and ``checks``: name -> bool)."""
        entry: dict[str, Any] = {"status": "running", "checks": {}}
        self.parts[name] = entry
        self.write()
        started = time.perf_counter()
        try:
            yield entry
        except Skip as reason:
            entry.update(status="skipped", reason=str(reason))
        except TimeoutError as error:  # ranks that did not answer within what was left of the allotment
            entry.update(status="timed_out", reason=str(error))
        except Exception as error:  # a crash is a result: record it, go on with the next part
            entry.update(status="crashed", reason=f"{type(error).__name__}: {error}"[:2000],
                         traceback=traceback.format_exc()[-4000:])
        else:
            entry["status"] = "passed" if all(entry["checks"].values()) else "failed"
        finally:
            entry["elapsed_s"] = time.perf_counter() - started
            self.write()

    def write(self) -> None:
        partial = self.path.with_suffix(".partial")
        partial.write_text(json.dumps({"parts": self.parts}, indent=1, default=str))
        os.replace(partial, self.path)


def read_parts(path: Path) -> dict[str, dict[str, Any]]:
    """The parts a section has recorded so far (none before its first write)."""
    try:
        return json.loads(path.read_text())["parts"]
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
