"""``results.md``: the check's table, one row per section, then each section's own table."""

from __future__ import annotations

import importlib
from typing import Any

from zeropp.tools.check.sections import SECTIONS


def part_outcome(part: dict[str, Any]) -> str:
    """"passed", "FAILED: which checks", "skipped: why", "crashed: the error", or "stopped" for
    the part its section was stopped in."""
    status = part["status"]
    if status == "running":
        return "stopped (the section's allotment was spent)"
    if status == "failed":
        return "FAILED: " + ", ".join(name for name, ok in part["checks"].items() if not ok)
    if status in ("skipped", "timed_out", "crashed"):
        return f"{status}: {part['reason']}"
    return status


def section_outcome(entry: dict[str, Any]) -> str:
    if entry["status"] != "ran":
        return f"{entry['status']}: {entry['reason']}"
    failed = [name for name, part in entry["parts"].items() if part["status"] not in ("passed", "skipped")]
    return "passed" if not failed else f"FAILED ({', '.join(failed)})"


def verdict(results: dict[str, Any]) -> str:
    """One line: which sections passed, failed, were stopped or skipped."""
    counts: dict[str, list[str]] = {}
    for entry in results["sections"]:
        kind = {True: "passed", False: "failed", None: "skipped"}[entry["passed"]]
        counts.setdefault(kind, []).append(entry["name"])
    return "; ".join(f"{kind}: {', '.join(names)}" for kind, names in counts.items())


def summary(entry: dict[str, Any]) -> str:
    """The section's own one-line result (its module's ``summary``), or why there is none."""
    if not entry["parts"]:
        return ""
    return importlib.import_module(SECTIONS[entry["name"]].module).summary(entry["parts"])


def _gpu(gpu: dict[str, Any]) -> str:
    nominal = gpu["nominal_bandwidth_gbps"]
    return (f"{gpu['name']} ({gpu['memory_bytes'] / 2**30:.0f} GiB"
            + (f", {nominal:.0f} GB/s nominal)" if nominal else ")"))


def markdown(results: dict[str, Any]) -> str:
    machine = results["machine"]
    gpus = ", ".join(_gpu(gpu) for gpu in machine["gpus"]) or "none"
    lines = [f"# zeropp check ({results['form']} form)", "",
             f"`{' '.join(results['command'])}` on {results['started']}: torch {machine['torch']} "
             f"(CUDA {machine['cuda']}), Triton {machine['triton']}, GPUs: {gpus}; CPU: {machine['cpu']} "
             f"({machine['num_cpus']} cores).", "",
             f"Budget {results['budget_s']:.0f} s" + (f", wall time {results['wall_s']:.0f} s." if "wall_s" in results
                                                       else " (running)."), "",
             "| section | outcome | time (allotted) | result |", "|---|---|---|---|"]
    for entry in results["sections"]:
        timing = (f"{entry['elapsed_s']:.0f} s ({entry['allotted_s']:.0f} s)" if "elapsed_s" in entry else "")
        lines.append(f"| {entry['name']} | {section_outcome(entry)} | {timing} | {summary(entry)} |")
    for entry in results["sections"]:
        if entry["parts"]:
            module = importlib.import_module(SECTIONS[entry["name"]].module)
            lines += ["", f"## {entry['name']}", "", entry["summary"] + ".", "", *module.markdown(entry["parts"])]
    return "\n".join(lines) + "\n"


def table(header: list[str], rows: list[list[Any]]) -> list[str]:
    """A markdown table."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(str(cell) for cell in row) + " |" for row in rows)]


def parts_table(parts: dict[str, dict[str, Any]]) -> list[str]:
    """Each part's outcome and time."""
    return table(["part", "outcome", "time"],
                 [[name, part_outcome(part), f"{part['elapsed_s']:.1f} s" if "elapsed_s" in part else ""]
                  for name, part in parts.items()])
