"""``zeropp check``'s runner: each section in a process of its own, within its allotment of the
budget (``zeropp.tools.check.budget``), progress printed as parts finish, and every result in
one folder: ``results.json``, ``results.md`` and each section's log under ``logs/``.

A section's process is started with setsid, so stopping it stops what it started too (the
ranks it spawned, pytest's ranks): nothing of a stopped section keeps the GPU busy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import zeropp
from zeropp.tools.check import budget, report
from zeropp.tools.check.processes import kill_sid
from zeropp.tools.check.record import Context, read_parts
from zeropp.tools.check.sections import SECTIONS, Section

SMOKE_MIN_S = 2.0
"""The least allotment a section starts with in the smoke form."""
WRITE_MARGIN_S = 2.0
"""A section is told to end this long before the runner stops it, to write its last part."""
POLL_S = 0.5


class Runner:
    """One ``zeropp check``: the sections in order, each timed and recorded."""

    def __init__(self, *, out: Path, budget_s: float, smoke: bool, selected: Sequence[str],
                 machine: dict[str, Any], started: float, command: list[str]) -> None:
        self.out, self.budget_s, self.smoke, self.selected = out, budget_s, smoke, tuple(selected)
        self.started = started
        self.device = "cpu" if smoke else "cuda"
        self.results: dict[str, Any] = {
            "command": command, "form": "smoke" if smoke else "gpu", "device": self.device, "budget_s": budget_s,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine, "sections": []}

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def say(self, text: str) -> None:
        print(f"[{self.elapsed():6.1f} s] {text}", flush=True)

    def run(self) -> dict[str, Any]:
        (self.out / "logs").mkdir(parents=True, exist_ok=True)
        runnable = [s for s in SECTIONS.values() if self._reason_not_to_run(s) is None]
        for section in SECTIONS.values():
            reason = self._reason_not_to_run(section)
            if reason is None:
                shares = [s.share for s in runnable[runnable.index(section):]]
                allotted = budget.allotment(shares, self.budget_s, self.elapsed())
                reason = budget.too_little(allotted, SMOKE_MIN_S if self.smoke else section.min_s)
            entry = self._skipped(section, reason) if reason else self._run_section(section, allotted)
            self.results["sections"].append(entry)
            self._write()
        self.results["wall_s"] = self.elapsed()
        self.results["within_budget"] = self.results["wall_s"] <= self.budget_s + WRITE_MARGIN_S
        self._write()
        self.say(f"done: {report.verdict(self.results)}; wrote {self.out / 'results.json'} and results.md")
        return self.results

    def _reason_not_to_run(self, section: Section) -> str | None:
        if section.name not in self.selected:
            return f"not selected (--sections {','.join(self.selected)})"
        return section.unavailable(self.results["machine"], self.smoke)

    def _skipped(self, section: Section, reason: str) -> dict[str, Any]:
        self.say(f"{section.name}: skipped: {reason}")
        return {"name": section.name, "summary": section.summary, "status": "skipped", "reason": reason,
                "passed": None, "parts": {}}

    def _run_section(self, section: Section, allotted: float) -> dict[str, Any]:
        """Run ``section`` in its own process (setsid); stop it when ``allotted`` is spent."""
        folder = self.out / section.name
        folder.mkdir(parents=True, exist_ok=True)
        record_path = folder / "record.json"
        record_path.unlink(missing_ok=True)
        context = Context(device=self.device, smoke=self.smoke, deadline=time.time() + allotted - WRITE_MARGIN_S,
                          folder=str(folder), num_gpus=self.results["machine"]["num_gpus"],
                          tests=str(tests_folder()))
        self.say(f"{section.name}: started, {allotted:.0f} s allotted")
        start = self.elapsed()
        log_path = self.out / "logs" / f"{section.name}.log"
        with open(log_path, "w") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "zeropp.tools.check.section", section.name, context.to_json(), str(record_path)],
                stdout=log, stderr=subprocess.STDOUT, env=child_environment(), start_new_session=True)
            timed_out = self._wait(process, section.name, record_path, start + allotted)
        parts = read_parts(record_path)
        entry = {"name": section.name, "summary": section.summary, "allotted_s": allotted,
                 "elapsed_s": self.elapsed() - start, "parts": parts, "log": str(log_path.relative_to(self.out))}
        if timed_out:
            entry.update(status="timed_out", reason=f"stopped at its allotment of {allotted:.0f} s", passed=False)
        elif process.returncode != 0:
            entry.update(status="crashed", reason=f"exit status {process.returncode}; see {entry['log']}", passed=False)
        else:
            entry.update(status="ran", reason=None, passed=all(p["status"] in ("passed", "skipped")
                                                               for p in parts.values()))
        self.say(f"{section.name}: {report.section_outcome(entry)} in {entry['elapsed_s']:.0f} s")
        return entry

    def _wait(self, process: subprocess.Popen, name: str, record_path: Path, stop_at: float) -> bool:
        """Wait for ``process`` and print its parts as they finish; stop its processes at
        ``stop_at`` (seconds since the start). True when it was stopped."""
        shown: set[str] = set()
        while True:
            try:
                process.wait(timeout=max(0.0, min(POLL_S, stop_at - self.elapsed())))
                finished = True
            except subprocess.TimeoutExpired:
                finished = False
            for part, entry in read_parts(record_path).items():
                if entry["status"] != "running" and part not in shown:
                    shown.add(part)
                    self.say(f"{name} | {part}: {report.part_outcome(entry)} ({entry['elapsed_s']:.1f} s)")
            if finished or self.elapsed() >= stop_at:
                stop_tree(process)
                return not finished

    def _write(self) -> None:
        (self.out / "results.json").write_text(json.dumps(self.results, indent=1, default=str))
        (self.out / "results.md").write_text(report.markdown(self.results))


def stop_tree(process: subprocess.Popen) -> None:
    """Kill every process under ``process``'s sid: itself if it still runs, and whatever it
    left behind (a multiprocessing fork server, ranks, pytest and its ranks)."""
    kill_sid(process.pid)
    process.wait()


def tests_folder() -> Path:
    """The tests of the source tree zeropp runs from (``PYTHONPATH=src`` or an editable install),
    else those of the working directory."""
    beside = Path(zeropp.__file__).resolve().parents[2] / "tests"
    return beside if beside.is_dir() else Path.cwd() / "tests"


def child_environment() -> dict[str, str]:
    """This environment, with the zeropp being run first on the import path (a section imports
    the same zeropp, installed or not) and without Triton's interpreter (a GPU runs the kernels
    compiled)."""
    source = str(Path(zeropp.__file__).resolve().parents[1])
    paths = [source, *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != source)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    env.pop("TRITON_INTERPRET", None)
    return env
