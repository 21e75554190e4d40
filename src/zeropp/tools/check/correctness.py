"""Correctness on CUDA: pytest of the tests that need a GPU to mean anything.

- ``test_cuda.py``: the torch path's scales and bytes on CUDA equal the CPU's; four gloo ranks
  sharing the GPU train ZeRO-3 and all three techniques as the same run does on the CPU;
- ``test_cuda_techniques.py``: every technique's multi-rank run on CUDA tensors against the CPU
  run (qwZ, hpZ with the coded copy, qgZ with each code, unused parameters, the optimizer in
  backward, generation mode, checkpoints);
- ``test_quant_triton.py``: the Triton kernels, compiled for this GPU, give the torch path's
  bytes bit for bit.

One pytest run over the three files, each test's outcome logged as it ends
(``zeropp.tools.check.pytest_log``), so a run stopped at its allotment keeps what it reached.
The smoke form runs the same files on the CPU without the tests marked slow: the CUDA tests
skip, saying why.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from zeropp.tools.check.processes import run_group
from zeropp.tools.check.pytest_log import LOG_ENV
from zeropp.tools.check.record import Context, Record, Skip
from zeropp.tools.check.report import parts_table, table

FILES = ("test_cuda.py", "test_cuda_techniques.py", "test_quant_triton.py")
DESELECTED = "not compile_for_hopper"
"""Compiling the kernels for sm_90 without a GPU: the GPU runs them compiled for itself."""


def run(context: Context, record: Record) -> None:
    tests = Path(context.tests)
    log = Path(context.folder) / "pytest.jsonl"
    log.unlink(missing_ok=True)
    if not tests.is_dir():
        with record.part("pytest"):
            raise Skip(f"no tests folder at {tests}: run zeropp check from the repository's root")
    command = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "zeropp.tools.check.pytest_log",
               "-p", "no:cacheprovider", "-k", DESELECTED, *(["-m", "not slow"] if context.smoke else []),
               *(str(tests / name) for name in FILES)]
    with open(Path(context.folder) / "pytest.out", "w") as out:
        status = run_group(command, context.seconds_left() - 1.0, cwd=tests.parent, stdout=out,
                           stderr=out, env={**os.environ, LOG_ENV: str(log)})
    events = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    for name in FILES:
        with record.part(name) as part:
            part.update(file_outcomes(events, name, stopped=status is None))
            part["checks"] = {"no test failed": part["failed"] + part["errors"] == 0,
                              "finished in time": part["running_when_stopped"] is None}
            part["pytest_exit_status"] = status
            if not part["reached"]:
                raise Skip("pytest was stopped at its allotment before this file" if status is None
                           else f"pytest ran no test of it (exit status {status}; see pytest.out)")


def file_outcomes(events: list[dict[str, Any]], name: str, stopped: bool) -> dict[str, Any]:
    """Counts of one test file's outcomes, its failures and skip reasons, and the test that was
    running when pytest was stopped (None if it was not, or not in this file)."""
    mine = [e for e in events if e["nodeid"].split("::")[0].endswith(name)]
    outcomes = [e for e in mine if e["event"] == "outcome"]
    counts = Counter(e["outcome"] for e in outcomes)
    started = [e["nodeid"] for e in mine if e["event"] == "start"]
    ended = {e["nodeid"] for e in outcomes}
    running = next((nodeid for nodeid in started if nodeid not in ended), None) if stopped else None
    return {"reached": bool(mine), "passed": counts["passed"], "failed": counts["failed"],
            "skipped": counts["skipped"], "errors": counts["error"], "running_when_stopped": running,
            "duration_s": sum(e["duration_s"] for e in outcomes),
            "failures": [[e["nodeid"], e.get("reason", "")] for e in outcomes if e["outcome"] in ("failed", "error")],
            "skip_reasons": dict(Counter(e.get("reason", "") for e in outcomes if e["outcome"] == "skipped"))}


def summary(parts: dict[str, dict[str, Any]]) -> str:
    counts = Counter()
    for part in parts.values():
        counts.update({k: part.get(k, 0) for k in ("passed", "failed", "errors", "skipped")})
    return (f"{counts['passed']} passed, {counts['failed']} failed, {counts['errors']} errors, "
            f"{counts['skipped']} skipped")


def markdown(parts: dict[str, dict[str, Any]]) -> list[str]:
    counts = table(["file", "passed", "failed", "errors", "skipped", "test time"],
                   [[name, p["passed"], p["failed"], p["errors"], p["skipped"], f"{p['duration_s']:.1f} s"]
                    for name, p in parts.items() if "passed" in p])
    lines = [*parts_table(parts), "", *counts, ""]
    for name, part in parts.items():
        for nodeid, reason in part.get("failures", []):
            lines.append(f"- FAILED `{nodeid}`: {reason.splitlines()[0] if reason else ''}")
        if part.get("running_when_stopped"):
            lines.append(f"- stopped in `{part['running_when_stopped']}`")
        for reason, count in part.get("skip_reasons", {}).items():
            lines.append(f"- {name}: {count} skipped: {reason}")
    return lines
