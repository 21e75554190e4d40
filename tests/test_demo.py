"""``zeropp demo``'s comparison states the default's measured accuracy cost beside its curves,
read from the committed verdict of ``zeropp accuracy --pretrained``."""

from __future__ import annotations

import json

from zeropp.tools import demo


def _finished_run(run_dir, mode: str, losses: list[float]) -> None:
    (run_dir / mode).mkdir(parents=True)
    records = [{"step": i + 1, "loss": loss, "val_loss": loss, "elapsed_s": 0.5 * (i + 1)}
               for i, loss in enumerate(losses)]
    (run_dir / mode / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    totals = {"bytes": 4e6, "cross_node_bytes": 2e6, "backend_cross_node_bytes": 3e6}
    (run_dir / mode / "comm.json").write_text(json.dumps({"total": totals}))


def test_the_comparison_states_the_measured_bound(tmp_path) -> None:
    rows = json.loads(demo.VERDICT.read_text())
    row = next(r for r in rows if r["mode"] == "all")
    bound = demo.measured_bound()
    low, high = row["ci95_percent"]
    assert f"{row['mean_delta_percent']:+.2f}%" in bound and f"[{low:+.2f}, {high:+.2f}]" in bound
    assert f"{row['pairs']} paired seeds" in bound
    _finished_run(tmp_path, "zero3", [3.0, 2.5])
    _finished_run(tmp_path, "all", [3.0, 2.51])
    table = demo.compare(tmp_path, ["zero3", "all"], "100mbit")
    assert bound in table and "all 1.00x ZeRO-3's" in table
    assert (tmp_path / "loss.png").stat().st_size > 0


def test_no_verdict_no_line(tmp_path) -> None:
    """An installed package has no result files: the demo prints its table without the line."""
    assert demo.measured_bound(tmp_path / "verdict.json") is None
    (tmp_path / "verdict.json").write_text(json.dumps([{"mode": "zero3"}]))
    assert demo.measured_bound(tmp_path / "verdict.json") is None
