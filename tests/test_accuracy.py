"""``zeropp accuracy``: the perturbation controls and the paired verdict, checked without training."""

from __future__ import annotations

import pytest
import torch

from zeropp.codes.quant import dequantize, quantize
from zeropp.techniques.qgz import full_precision_gradients
from zeropp.tools.bench import accuracy, paired
from zeropp.tools.demo import perturb_initial_weights
from zeropp.tools.models import GPT, GPTConfig
from zeropp.tools.modes import MODES, QWZ_RELATIVE_ERROR


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=65))


def test_init_control_matches_qwz_relative_error() -> None:
    """``zero3_init`` perturbs each weight matrix by about as much, relatively, as qwZ's INT8
    round trip does (the constant's derivation), the same on every rank (a function of the
    seed), and leaves LayerNorms and biases, which qwZ codes exactly at init, alone."""
    assert MODES["zero3_init"].initial_weight_noise == QWZ_RELATIVE_ERROR
    model, again, before = _gpt(), _gpt(), _gpt()
    perturb_initial_weights(model, QWZ_RELATIVE_ERROR, seed=3)
    perturb_initial_weights(again, QWZ_RELATIVE_ERROR, seed=3)
    for (name, p), q, original in zip(model.named_parameters(), again.parameters(), before.parameters()):
        assert torch.equal(p, q), name
        if p.dim() < 2:
            assert torch.equal(p, original), name
            continue
        relative = ((p - original).norm() / original.norm()).item()
        flat = original.detach().flatten()
        data, scales = quantize(flat, 8, 256)
        qwz = ((dequantize(data, scales, 8, 256, flat.numel(), torch.float32) - flat).norm() / flat.norm()).item()
        assert relative == pytest.approx(QWZ_RELATIVE_ERROR, rel=0.1), name
        assert qwz == pytest.approx(QWZ_RELATIVE_ERROR, rel=0.1), name


def test_order_control_spares_every_gradient() -> None:
    """``zero3_order`` is qgZ with nothing quantized: only the summation order differs from ZeRO-3."""
    config = MODES["zero3_order"].config(ranks_per_node=2)
    assert config.quantized_gradients and config.grad_full_precision_parameters == ("*",)
    assert not config.quantized_weights and config.hpz_partition_size == 1


def test_full_precision_gradients_by_pattern_and_size() -> None:
    names = ["blocks.0.ln_1.weight", "blocks.0.attn.qkv.weight", "blocks.0.attn.qkv.bias", "blocks.0.mlp.fc.weight"]
    shapes = [torch.Size([128]), torch.Size([384, 128]), torch.Size([384]), torch.Size([512, 128])]
    assert full_precision_gradients(names, shapes, (), 1024) == [True, False, True, False]
    assert full_precision_gradients(names, shapes, ("blocks.0.*.qkv.*",), 0) == [
        False, True, True, False]
    assert full_precision_gradients(names, shapes, (), 0) == [False] * 4


def _results(losses: dict[str, float]) -> dict:
    return {"settings": {"steps": 10, "seed": 0},
            "modes": {name: {"final_val_loss": loss, "train_loss": [4.0, 3.0, loss]} for name, loss in losses.items()}}


def test_verdict_pairs_each_seed_with_its_control() -> None:
    """Deltas in percent of the same seed's ZeRO-3; the verdict on mode minus control per seed,
    with Student's t interval (4 degrees of freedom for 5 seeds)."""
    per_seed = {seed: _results({"zero3": 2.0, "zero3_init": 2.0 * (1 + c / 100), "all": 2.0 * (1 + d / 100)})
                for seed, (c, d) in enumerate([(0.1, 1.1), (-0.2, 0.8), (0.0, 1.0), (0.3, 1.3), (-0.2, 0.8)])}
    cell = accuracy.cell_verdict(per_seed)
    entry = cell["modes"]["all"]
    assert entry["deltas_percent"][3] == pytest.approx(1.3)
    assert entry["vs_control"]["differences_percent"] == pytest.approx([1.0] * 5)
    assert entry["vs_control"]["interval_percent"] == pytest.approx([1.0, 1.0])
    assert entry["vs_control"]["text"].startswith("costs 1.00% ± 0.00")
    noisy = paired.verdict([0.5, -0.3, 0.2, -0.4, 0.1])
    half = 2.776 * noisy["standard_error_percent"]  # t(0.975, 4 degrees of freedom)
    assert noisy["interval_percent"] == pytest.approx([0.02 - half, 0.02 + half])
    assert noisy["text"].startswith("indistinguishable from noise")
    assert paired.verdict([-1.0, -1.2, -0.8])["text"].startswith("better than the control by 1.00%")
    assert paired.verdict([0.4])["text"] == "too few seeds"


def test_signed_rank_p_counts_every_sign_pattern() -> None:
    """Against brute force over all 2^n sign patterns of the same mean ranks (ties included):
    five differences of one sign give the smallest two-sided p there is for five seeds, 2/32."""
    import itertools

    def brute_force(differences: list[float]) -> float:
        nonzero = [d for d in differences if d != 0]
        magnitudes = sorted(abs(d) for d in nonzero)
        rank = {m: sum(i + 1 for i, x in enumerate(magnitudes) if x == m) / magnitudes.count(m) for m in magnitudes}
        observed = sum(rank[abs(d)] for d in nonzero if d > 0)
        sums = [sum(rank[abs(d)] for d, sign in zip(nonzero, signs) if sign)
                for signs in itertools.product((0, 1), repeat=len(nonzero))]
        low, high = sum(x <= observed + 1e-9 for x in sums), sum(x >= observed - 1e-9 for x in sums)
        return min(1.0, 2 * min(low, high) / len(sums))

    assert paired.signed_rank_p([0.2, 1.0, 0.4, 3.0, 0.1]) == pytest.approx(2 / 32)
    generator = torch.Generator().manual_seed(0)
    for n in (3, 6, 9):
        for shift in (0.0, 0.7):
            differences = (torch.randn(n, generator=generator) + shift).tolist()
            differences[1] = -differences[0]  # a tied magnitude
            assert paired.signed_rank_p(differences) == pytest.approx(brute_force(differences))
    assert paired.signed_rank_p([0.0, 0.0]) == 1.0
    assert paired.verdict([1.0, -0.5, 2.0])["signed_rank_p"] == pytest.approx(brute_force([1.0, -0.5, 2.0]))


def test_pooled_verdict_takes_every_cell_and_seed() -> None:
    cells = {name: accuracy.cell_verdict({seed: _results({"zero3": 2.0, "zero3_init": 2.0, "all": 2.0 * (1 + d)})
                                          for seed, d in enumerate(values)})
             for name, values in {"a": [0.01, 0.02], "b": [0.0, 0.01, 0.02]}.items()}
    pooled = accuracy.pooled_verdict(cells)["all"]
    assert pooled["vs_control"]["n"] == 5 and pooled["vs_control"]["mean_percent"] == pytest.approx(1.2)
    assert pooled["delta_alone"]["differences_percent"] == pytest.approx([1.0, 2.0, 0.0, 1.0, 2.0])
    # the delta alone is against ZeRO-3 (0), not against the control
    below = accuracy.pooled_verdict({"a": accuracy.cell_verdict({seed: _results({"zero3": 2.0, "all": 2.0 * (1 - d)})
                                                                  for seed, d in enumerate([0.019, 0.02, 0.021])})})
    assert below["all"]["delta_alone"]["text"].startswith("better than ZeRO-3 by 2.00%")


def test_report_pools_each_setting_over_its_corpora(tmp_path) -> None:
    """``report`` reads every cell's seeds from disk; each setting pools the cells of its corpora
    (cells are named ``<corpus>_<setting>``), and the summary gives one row per mode."""
    import json

    deltas = {"kjv_demo": [1.0, 2.0], "mormon_demo": [0.0, 1.0, 2.0], "kjv_wide": [4.0, 6.0]}
    for cell, values in deltas.items():
        for seed, d in enumerate(values):
            results = _results({"zero3": 2.0, "zero3_init": 2.0, "all": 2.0 * (1 + d / 100)})
            results["settings"]["corpus"] = cell.split("_")[0]
            (tmp_path / cell / f"seed_{seed}").mkdir(parents=True)
            (tmp_path / cell / f"seed_{seed}" / "converge.json").write_text(json.dumps(results))
    result = accuracy.report(tmp_path)
    demo, wide = (result["by_setting"][name]["all"]["vs_control"] for name in ("demo", "wide"))
    assert demo["n"] == 5 and demo["mean_percent"] == pytest.approx(1.2)
    assert wide["differences_percent"] == pytest.approx([4.0, 6.0])
    assert result["pooled"]["all"]["vs_control"]["n"] == 7
    row = next(line for line in accuracy.summary_table(result).splitlines() if line.startswith("| all |"))
    # demo: 5 pairs, mean 1.2, t(0.975, 4) x standard error 1.04 -> a cost; wide: 2 pairs, t(0.975, 1) = 12.7
    # signed ranks: 4 nonzero differences of one sign, p = 2/16; 2 of one sign, p = 2/4
    assert row.split(" | ")[1:3] == ["costs: +1.20% [+0.16, +2.24] (5; signed-rank p 0.12)",
                                     "noise: +5.00% [-7.71, +17.71] (2; signed-rank p 0.5)"]
    assert json.loads((tmp_path / "accuracy.json").read_text())["by_setting"]["wide"]["all"]["vs_control"]["n"] == 2
    assert (tmp_path / "accuracy.png").stat().st_size > 0


def test_against_default_pairs_each_code_with_the_default_on_the_same_seed() -> None:
    """A code's Δ minus the default's, seed by seed and pooled over cells; seeds where either is
    missing, and the controls, are left out; the control need not have run."""
    losses = {"c": [(2.02, 2.00), (2.04, 2.02), (2.00, 2.01)], "d": [(2.06, 2.02), (2.00, None)]}
    cells = {}
    for name, runs in losses.items():
        per_seed = {}
        for seed, (default, scale8) in enumerate(runs):
            modes = {"zero3": 2.0, "zero3_order": 2.0, "all": default}
            if scale8 is not None:
                modes["all_scale8"] = scale8
            per_seed[seed] = _results(modes)
        cells[name] = accuracy.cell_verdict(per_seed)
    direct = accuracy.against_default(cells)
    assert list(direct) == ["all_scale8"]
    # (Δ_scale8 - Δ_all) in percent of ZeRO-3's 2.0: -1, -1, +0.5, -2
    assert direct["all_scale8"]["differences_percent"] == pytest.approx([-1.0, -1.0, 0.5, -2.0])
    assert direct["all_scale8"]["text"].startswith("indistinguishable")
    assert paired.verdict([-1.0, -1.2, -0.8], against="the default (all)")["text"].startswith(
        "better than the default (all) by 1.00%")


def test_largest_early_rise_finds_the_spike_within_the_early_steps() -> None:
    falling = [4.0 - 0.01 * step for step in range(300)]
    spiked = list(falling)
    spiked[10] += 0.5  # one step up by 0.5 above a curve falling 0.01 a step
    late = list(falling)
    late[200] += 2.0  # after EARLY_STEPS: not an early spike
    assert accuracy.largest_early_rise(spiked) == pytest.approx(0.49)
    assert accuracy.largest_early_rise(falling) == pytest.approx(-0.01)
    assert accuracy.largest_early_rise(late) == pytest.approx(-0.01)


def test_update_metrics_see_what_a_code_does_to_zero_entries() -> None:
    """On a stream whose every rank's gradient is zero at the same entries (scattered through
    blocks of nonzero ones), the plain code keeps them zero (round to nearest has a zero level),
    normal levels (no zero level) do not, and Adam turns what they put there into real steps;
    a spared parameter is exact, so only the quantized one's error remains."""
    from zeropp.tools.bench import qgz_updates
    from zeropp.tools.bench.qgz_error import OPTIONS

    world_size, numels = 4, [512, 4096]
    generator = torch.Generator().manual_seed(0)
    stream = []
    for _ in range(3):
        gradients = torch.randn(world_size, world_size, sum(numels) // world_size, generator=generator)
        gradients[..., 200:] *= (torch.arange(gradients.shape[-1] - 200) % 3 != 0)  # every third entry zero
        stream.append(gradients)
    plain = qgz_updates.measure(stream, numels, 2, qgz_updates.Case((4, 4), OPTIONS["plain"]))
    normal = qgz_updates.measure(stream, numels, 2, qgz_updates.Case((8, 4), OPTIONS["normal+scale8"]))
    spared = qgz_updates.measure(stream, numels, 2, qgz_updates.Case((4, 4), OPTIONS["plain"], spare_below=1024))
    assert plain["zero_entries"] == normal["zero_entries"] > 1000
    assert plain["zero_error"] == 0 and plain["zero_update"] == 0
    assert normal["zero_error"] > 0.01 and normal["zero_update"] > 0.1
    assert 0 < spared["relative_rms"] < plain["relative_rms"]
