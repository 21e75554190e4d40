"""``zeropp check``: the GPU check's smoke form runs every section on the CPU within its budget
and records each one; the budget passes unused time on, never takes a later section's share, and
skips what it cannot fit."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import zeropp
from zeropp.tools.check import budget, nccl
from zeropp.tools.check.machine import describe, slug
from zeropp.tools.check.ranks import run_ranks
from zeropp.tools.check.runner import WRITE_MARGIN_S, Runner
from zeropp.tools.check.sections import SECTIONS

SMOKE_BUDGET_S = 90.0
STATUSES = {"ran", "skipped", "timed_out", "crashed"}
PART_STATUSES = {"passed", "failed", "skipped", "timed_out", "crashed"}


def test_allotment_passes_unused_time_on_but_never_takes_later_shares() -> None:
    shares = [0.5, 0.3, 0.2]
    assert budget.allotment(shares, 100.0, 0.0) == 50.0
    assert budget.allotment(shares[1:], 100.0, 20.0) == 60.0  # the first left 30 s of its share unused
    assert budget.allotment(shares[1:], 100.0, 75.0) == 25.0  # it overran into nothing but its own
    assert budget.allotment(shares[2:], 100.0, 100.0) == 0.0
    assert budget.too_little(0.5, 2.0) == "the budget is spent: 0 s left for it, it needs at least 2 s"
    assert budget.too_little(2.0, 2.0) is None


def test_a_spent_budget_skips_every_section_with_the_reason(tmp_path: Path) -> None:
    machine = describe()
    runner = Runner(out=tmp_path, budget_s=1.0, smoke=True, selected=tuple(SECTIONS), machine=machine,
                    started=time.monotonic() - 1.5, command=["zeropp", "check", "--budget-s", "1"])
    results = runner.run()
    assert [s["name"] for s in results["sections"]] == list(SECTIONS)
    for section in results["sections"]:
        assert section["status"] == "skipped" and section["passed"] is None
        expected = "NCCL needs 2 GPUs" if section["name"] == "nccl" else "the budget is spent"
        assert section["reason"].startswith(expected), section
    assert json.loads((tmp_path / "results.json").read_text())["sections"] == results["sections"]
    assert "| correctness | skipped: the budget is spent" in (tmp_path / "results.md").read_text()


def test_every_section_imports_without_a_gpu() -> None:
    """The GPU-only code paths (NCCL ranks, CUDA timing) at least import here."""
    for section in SECTIONS.values():
        module = importlib.import_module(section.module)
        assert callable(module.run) and callable(module.summary) and callable(module.markdown), section.name
    assert abs(sum(section.share for section in SECTIONS.values()) - 1.0) < 1e-9


def test_results_folder_is_named_after_the_gpu() -> None:
    assert slug({"gpus": [{"name": "NVIDIA H100 80GB HBM3"}]}) == "nvidia-h100-80gb-hbm3"
    assert slug({"gpus": []}) == "cpu-smoke"


@pytest.mark.slow
def test_the_nccl_sections_ranks_train_every_mode_on_cpu_ranks() -> None:
    """The NCCL section's rank function, on 4 gloo CPU ranks as 2 nodes x 2 (a GPU machine gives
    it NCCL and one GPU per rank): every mode trains, and the first losses agree as it checks."""
    node_size = nccl.ranks_per_node(4)
    results = run_ranks(nccl.nccl_rank, 4, nccl.MODES_RUN, node_size, "cpu", backend="gloo", timeout_s=300,
                        env={"ZEROPP_RANKS_PER_NODE": str(node_size)})
    first = {mode: results[0][mode]["losses"][0] for mode in nccl.MODES_RUN}
    for mode in nccl.MODES_RUN:
        assert results[0][mode]["losses"][-1] < first[mode], mode
        assert abs(first[mode] - first["zero3"]) <= nccl.FIRST_LOSS_RTOL[mode] * first["zero3"], mode


@pytest.mark.slow
def test_smoke_form_runs_every_section_within_its_budget(tmp_path: Path) -> None:
    """The command a GPU machine runs, in its CPU form: every section recorded with a status
    (and the reason where it did not run), every part's outcome, the wall time within the budget,
    the markdown table. No part fails or crashes; on a loaded machine one may run out of time."""
    source = str(Path(zeropp.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": source, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "zeropp.tools.check", "--smoke", "--budget-s", str(SMOKE_BUDGET_S),
               "--out", str(tmp_path)]
    done = subprocess.run(command, env=env, cwd=Path(source).parent, capture_output=True, text=True,
                          timeout=SMOKE_BUDGET_S + 60)
    assert done.returncode in (0, 1), done.stdout + done.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["form"] == "smoke" and results["budget_s"] == SMOKE_BUDGET_S
    assert results["wall_s"] <= SMOKE_BUDGET_S + WRITE_MARGIN_S and results["within_budget"]
    assert [s["name"] for s in results["sections"]] == list(SECTIONS)
    for section in results["sections"]:
        assert section["status"] in STATUSES, section
        assert section["status"] != "crashed", (section, (tmp_path / section["log"]).read_text()[-3000:])
        if section["status"] != "ran":
            assert section["reason"], section
        for name, part in section["parts"].items():
            stopped_in = {"running"} if section["status"] == "timed_out" else set()
            assert part["status"] in PART_STATUSES | stopped_in, (section["name"], name, part)
            assert part["status"] not in ("crashed", "failed"), (section["name"], name, part)
    assert next(s for s in results["sections"] if s["name"] == "nccl")["reason"].startswith("NCCL needs 2 GPUs")
    markdown = (tmp_path / "results.md").read_text()
    assert all(f"| {name} |" in markdown for name in SECTIONS)
