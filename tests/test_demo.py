"""``zeropp demo``: its comparison (the time to ZeRO-3's final loss, the measured accuracy cost read
from the committed verdict of ``zeropp accuracy --pretrained``), its two-panel picture, and its
schedule, which must not spike on two of the seeds it spiked on before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distributed import run_distributed
from zeropp.tools import demo

SHORT_STEPS = 40
"""The short form of the demo's training: past the warm-up and the steps after it, where the
spikes were (steps 9-16 of a 150-step run)."""


def _finished_run(run_dir, mode: str, val_losses: list[float], seconds_per_step: float) -> None:
    (run_dir / mode).mkdir(parents=True)
    records = [{"step": i + 1, "loss": loss, "val_loss": loss, "elapsed_s": seconds_per_step * (i + 1)}
               for i, loss in enumerate(val_losses)]
    (run_dir / mode / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    totals = {"bytes": 4e6, "cross_node_bytes": 2e6 if mode == "zero3" else 2e5,
              "backend_cross_node_bytes": 3e6 if mode == "zero3" else 3e5}
    (run_dir / mode / "comm.json").write_text(json.dumps({"total": totals}))


def test_the_comparison_states_the_time_to_zero3s_loss_and_the_measured_bound(tmp_path) -> None:
    rows = [r for r in json.loads(demo.VERDICT.read_text()) if r["mode"] == "all" and r["ci95_percent"]]
    row = max(rows, key=lambda r: r["ci95_percent"][1])  # the worst cell, not the friendliest
    bound = demo.measured_bound()
    low, high = row["ci95_percent"]
    assert f"{row['mean_delta_percent']:+.2f}%" in bound and f"[{low:+.2f}, {high:+.2f}]" in bound
    assert f"fine-tuned on {row['corpus']}, {row['setting']} settings, {row['pairs']} paired seeds" in bound
    # ZeRO-3 ends at 2.5 after 4 steps of 2 s (the target: 2.525); all three passes it at its third step of 0.5 s
    _finished_run(tmp_path, "zero3", [3.0, 2.8, 2.6, 2.5], 2.0)
    _finished_run(tmp_path, "all", [3.0, 2.7, 2.45, 2.4], 0.5)
    table = demo.compare(tmp_path, ["zero3", "all"], "100mbit", "2 nodes x 2 ranks")
    assert bound in table and "all 0.25x ZeRO-3's" in table
    assert "all came within 1% of ZeRO-3's final validation loss 2.5000 after 2 s of training, ZeRO-3 after 8 s: " \
        "5.3x sooner" in table, table
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["modes"]["all"]["to_target_s"] == 1.5 and summary["modes"]["zero3"]["to_target_s"] == 8.0
    assert summary["modes"]["zero3"]["total_s"] == 8.0
    assert summary["modes"]["all"]["backend_cross_node_mb_per_step"] == pytest.approx(0.3 / 4)
    assert (tmp_path / "loss.png").stat().st_size > 0


def test_a_run_that_never_comes_within_1_percent_of_zero3s_loss_says_so(tmp_path) -> None:
    _finished_run(tmp_path, "zero3", [3.0, 2.5], 1.0)
    _finished_run(tmp_path, "all", [3.0, 2.53], 0.5)  # 1.2% above
    table = demo.compare(tmp_path, ["zero3", "all"], None)
    assert "all did not come within 1% of ZeRO-3's final validation loss 2.5000 in its 1 s (it ended at 2.5300)" \
        in table, table


def test_no_verdict_no_line(tmp_path) -> None:
    """An installed package has no result files: the demo prints its table without the line."""
    assert demo.measured_bound(tmp_path / "verdict.json") is None
    (tmp_path / "verdict.json").write_text(json.dumps([{"mode": "zero3"}]))
    assert demo.measured_bound(tmp_path / "verdict.json") is None


def _spikes(losses: list[float], window: int = 10, tolerance: float = 0.2) -> list[tuple[int, float, float]]:
    """(step, loss, the previous ``window`` steps' minimum) for every step whose training loss
    exceeds that minimum by more than ``tolerance``."""
    return [(step + 1, loss, min(losses[step - window if step > window else 0:step]))
            for step, loss in enumerate(losses)
            if step and loss > (1 + tolerance) * min(losses[step - window if step > window else 0:step])]


def test_the_spike_check_can_fail() -> None:
    assert _spikes([3.4, 3.3, 3.3, 5.2, 3.3]) == [(4, 5.2, 3.3)]
    assert _spikes([4.0, 3.5, 3.6, 3.4, 3.9]) == []


def _short_demo(rank: int, world_size: int, seed: int, run_dir: str) -> dict[str, list[float]]:
    losses = {}
    for mode in ("zero3", "all"):
        config = demo.DemoConfig(mode=mode, steps=SHORT_STEPS, seed=seed, **demo.DEMO_SCHEDULE)
        losses[mode] = [record["loss"] for record in demo.train(config, Path(run_dir) / mode)]
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_the_demos_schedule_does_not_spike(seed: int, tmp_path) -> None:
    """Both modes on 2 x 2 gloo ranks with the schedule ``zeropp demo`` trains with: no step's
    training loss more than 20% above the previous ten steps' minimum (10 steps of warm-up to
    3e-3 without clipping spiked to 1.5-2x on each of these seeds: [Note: the demo's schedule])."""
    losses = run_distributed(_short_demo, 4, seed, str(tmp_path), env={"ZEROPP_RANKS_PER_NODE": "2"},
                             timeout=300)[0]
    for mode, curve in losses.items():
        assert len(curve) == SHORT_STEPS
        assert _spikes(curve) == [], f"{mode}, seed {seed}: spikes (step, loss, previous minimum) {_spikes(curve)}"
