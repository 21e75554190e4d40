"""``zeropp converge`` end to end on a tiny model: what it writes, and that a rerun resumes."""

from __future__ import annotations

import json
import math

import pytest

from zeropp.tools.bench import converge

STEPS = 4
TINY = {"num_layers": 2, "embed_dim": 32, "num_heads": 2, "batch_size": 8, "context_length": 16}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("converge")
    converge.run(out_dir, steps=STEPS, modes=("zero3", "qgz"), eval_every=2, eval_batches=1,
                 runs_dir=out_dir / "runs", **TINY)
    return out_dir, json.loads((out_dir / "converge.json").read_text())


@pytest.mark.slow
def test_json_has_every_mode_with_curves_and_deltas(results) -> None:
    out_dir, written = results
    assert written["settings"]["steps"] == STEPS and written["settings"]["num_nodes"] == 2
    assert list(written["modes"]) == ["zero3", "qgz", converge.REFERENCE]
    for entry in written["modes"].values():
        assert len(entry["train_loss"]) == STEPS
        assert [step for step, _ in entry["val_loss"]] == [2, 4]
        assert entry["final_val_loss"] == entry["val_loss"][-1][1]
        assert all(math.isfinite(loss) for loss in entry["train_loss"])
    zero3 = written["modes"]["zero3"]["final_val_loss"]
    qgz = written["modes"]["qgz"]
    assert written["modes"]["zero3"]["val_delta_vs_zero3_percent"] == 0
    assert qgz["val_delta_vs_zero3_percent"] == pytest.approx(100 * (qgz["final_val_loss"] - zero3) / zero3)
    assert written["modes"]["qgz"]["zeropp_config"]["quantized_gradients"] is True
    assert (out_dir / "converge.png").stat().st_size > 0


@pytest.mark.slow
def test_first_loss_matches_single_process_reference(results) -> None:
    """Step 1's loss is computed from the initial weights, which every run shares: the 4 ranks'
    mean of 4 row-block means equals the reference's mean up to fp32 rounding (~1e-7 relative)."""
    _, written = results
    reference = written["modes"][converge.REFERENCE]["train_loss"][0]
    for mode in ("zero3", "qgz"):
        assert written["modes"][mode]["train_loss"][0] == pytest.approx(reference, rel=1e-5)


@pytest.mark.slow
def test_rerun_skips_finished_modes(results, monkeypatch) -> None:
    out_dir, written = results

    def must_not_train(*args, **kwargs):
        raise AssertionError("a finished mode was trained again")

    monkeypatch.setattr(converge, "_train_mode", must_not_train)
    monkeypatch.setattr(converge, "train_reference", must_not_train)
    older = json.loads((out_dir / "converge.json").read_text())  # as written before these fields existed
    del older["settings"]["corpus"], older["settings"]["optimizer"]
    (out_dir / "converge.json").write_text(json.dumps(older))
    again = converge.run(out_dir, steps=STEPS, modes=("zero3", "qgz"), eval_every=2, eval_batches=1,
                         runs_dir=out_dir / "runs", **TINY)
    assert again["modes"]["qgz"]["train_loss"] == written["modes"]["qgz"]["train_loss"]


def test_unknown_mode_is_named() -> None:
    with pytest.raises(ValueError, match="'nope'"):
        converge.run("unused", modes=("zero3", "nope"))


def _seed_results(seed: int, losses: dict[str, float]) -> dict:
    modes = {name: {"final_val_loss": loss, "zeropp_config": None} for name, loss in losses.items()}
    converge.add_deltas(modes)
    return {"settings": {"steps": 10, "seed": seed}, "modes": modes}


def test_seed_statistics_pair_each_mode_with_its_seeds_zero3() -> None:
    """Deltas are taken per seed against that seed's ZeRO-3, then averaged: +1%, +2%, +3% give
    mean 2 and sample standard deviation 1; a mode missing on one seed is left out; the noise
    floor is ZeRO-3's own spread (losses 1.9, 2.0, 2.1: std 0.1 = 5% of the mean)."""
    per_seed = {k: _seed_results(k, {"zero3": base, "all": base * (1.01 + 0.01 * k)})
                for k, base in enumerate((1.9, 2.0, 2.1))}
    per_seed[1]["modes"]["qgz"] = per_seed[1]["modes"]["all"]
    summary = converge.seed_statistics(per_seed)
    assert list(summary["modes"]) == ["zero3", "all"] and summary["seeds"] == [0, 1, 2]
    assert summary["modes"]["all"]["mean_percent"] == pytest.approx(2.0)
    assert summary["modes"]["all"]["std_percent"] == pytest.approx(1.0)
    assert summary["modes"]["zero3"]["std_percent"] == 0
    assert summary["zero3_seed_spread_percent"] == pytest.approx(5.0)
    assert "seed" not in summary["settings"]
    assert "| all | +2.00% ± 1.00 | +1.00%, +2.00%, +3.00% |" in converge.seeds_table(summary)


def test_seed_statistics_set_each_mode_beside_the_control() -> None:
    """With ``zero3_init`` among the modes, each mode's per-seed delta minus the control's gets
    the paired verdict (Student's t interval over the seeds)."""
    per_seed = {seed: _seed_results(seed, {"zero3": 2.0, "zero3_init": 2.0 * (1 + c / 100), "all": 2.0 * (1 + d / 100)})
                for seed, (c, d) in enumerate([(0.5, 0.6), (-0.5, -0.3), (0.2, 0.1)])}
    summary = converge.seed_statistics(per_seed)
    assert summary["modes"]["all"]["vs_control"]["differences_percent"] == pytest.approx([0.1, 0.2, -0.1])
    assert "vs_control" not in summary["modes"]["zero3_init"]
    assert "| all | +0.13% ± 0.45 | +0.60%, -0.30%, +0.10% | indistinguishable from noise" in (
        converge.seeds_table(summary))
