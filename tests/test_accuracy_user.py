"""``zeropp accuracy --pretrained --model ... --text ...``: the paired-seed verdict on a user's own
model and text, run end to end on a tiny Llama with its own tokenizer on 2 x 2 gloo ranks, and
the clear errors for bad input."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zeropp.tools.bench import accuracy_cells, accuracy_pretrained
from zeropp.tools.cli import build_parser


def main(argv: list[str]) -> int:
    args = build_parser(argv).parse_args(argv)
    return args.func(args)

TEXT = "\n".join(f"line {i}: the quick brown fox {i % 7} jumps over the lazy dog {i % 11} again and again."
                 for i in range(600))


def _tiny_model(path: Path) -> None:
    """A 2-layer Llama of width 32 and a word-level tokenizer fitted to ``TEXT``, saved as a user's
    Hugging Face checkpoint directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator([TEXT], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=wrapped.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    LlamaForCausalLM(config).save_pretrained(path)
    wrapped.save_pretrained(path)


@pytest.fixture(scope="module")
def user_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model")
    _tiny_model(path)
    return path


@pytest.mark.slow
def test_a_users_model_and_text_get_a_verdict_per_config_and_a_recommendation(user_model, tmp_path, capsys) -> None:
    text = tmp_path / "mydata.txt"
    text.write_text(TEXT)
    out = tmp_path / "verdict"
    # 2 nodes of 1 rank: the protocol on half the processes (hpZ has no node to keep a copy in)
    args = ["accuracy", "--pretrained", "--model", str(user_model), "--text", str(text), "--steps", "4",
            "--nodes", "2", "--ranks-per-node", "1", "--seeds", "0,1", "--pretrained-modes", "all", "--out", str(out)]
    # under torchrun (how --device cuda runs) the runs train in-process on the launched ranks
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
               "zeropp.tools.cli", *args]
    assert subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600).returncode == 0
    rows = json.loads((out / "verdict.json").read_text())
    by_mode = {row["mode"]: row for row in rows}
    assert set(by_mode) == {"all"}
    for row in rows:
        assert row["cell"] == "mydata_present" and row["pairs"] == 2 and row["steps"] == 4
        assert set(row["per_seed_delta_percent"]) == {"0", "1"}
        low, high = row["ci95_percent"]
        assert low <= row["mean_delta_percent"] <= high
        assert row["zero3_held_out_fall_percent"] is not None
    assert by_mode["all"]["cross_node_mb_per_step"] == pytest.approx(accuracy_pretrained.cross_node_mb(
        json.loads((user_model / "config.json").read_text()), "all", accuracy_pretrained.Layout(2, 1), "float32"))
    advice = json.loads((out / "recommendation.json").read_text())
    assert advice["tolerance_percent"] == 0.3
    within = [c for c in advice["configs"] if c["upper_end_percent"] is not None and c["upper_end_percent"] <= 0.3]
    if within:
        fewest = min(within, key=lambda c: c["cross_node_mb_per_step"])
        assert advice["recommended"] == fewest["mode"]
    else:
        assert advice["recommended"] is None and "no config" in advice["reason"]
    (cell,) = json.loads((out / "cells.json").read_text())
    assert (cell["cell"], cell["best"], cell["default_ci95_percent"]) == ("mydata_present", "all", [low, high])
    # on CPU the command launches its own ranks: the same code on the same batches, so the same losses
    launched = tmp_path / "launched"
    assert main([*args[:-4], "--seeds", "0", "--pretrained-modes", "all", "--out", str(launched)]) == 0
    assert "recommendation (tolerance 0.3%)" in capsys.readouterr().out
    seed_0 = json.loads((launched / "verdict.json").read_text())[0]["per_seed_delta_percent"]
    assert seed_0 == pytest.approx({"0": by_mode["all"]["per_seed_delta_percent"]["0"]}, abs=1e-9)
    # resumable: every run is found, nothing trains again
    trained = {path: path.stat().st_mtime_ns for path in (out / "runs_work").rglob("metrics.jsonl")}
    assert len(trained) == 4  # 2 seeds x (zero3, all)
    assert main(args) == 0
    assert {path: path.stat().st_mtime_ns for path in (out / "runs_work").rglob("metrics.jsonl")} == trained


def _refused(argv: list[str], message: str, capsys) -> None:
    assert main(argv) == 2
    assert re.search(message, capsys.readouterr().err)


def test_a_missing_text_file_is_named(user_model, tmp_path, capsys) -> None:
    _refused(["accuracy", "--pretrained", "--model", str(user_model), "--text", str(tmp_path / "nothere.txt"),
              "--out", str(tmp_path / "out")], r"^zeropp accuracy: --text .*nothere\.txt: no such file", capsys)


def test_text_too_short_for_the_held_out_split_is_named(user_model, tmp_path, capsys) -> None:
    text = tmp_path / "short.txt"
    text.write_text("\n".join(TEXT.splitlines()[:190]))  # about 3,000 tokens: enough to train on, not to hold out
    _refused(["accuracy", "--pretrained", "--model", str(user_model), "--text", str(text), "--out",
              str(tmp_path / "out")], r"held-out \(last 10%\) part is \d+ tokens; a batch of 8 windows of 65 needs 520",
             capsys)


def test_a_model_that_does_not_load_is_named(tmp_path, capsys) -> None:
    text = tmp_path / "data.txt"
    text.write_text(TEXT)
    (tmp_path / "broken").mkdir()
    _refused(["accuracy", "--pretrained", "--model", str(tmp_path / "broken"), "--text", str(text), "--out",
              str(tmp_path / "out")], r"--model .*broken: does not load as a Hugging Face causal LM", capsys)


def test_model_without_text_and_cuda_outside_torchrun_are_refused(user_model, tmp_path, capsys) -> None:
    _refused(["accuracy", "--pretrained", "--model", str(user_model), "--out", str(tmp_path / "out")],
             "--model and --text go together", capsys)
    text = tmp_path / "data.txt"
    text.write_text(TEXT)
    _refused(["accuracy", "--pretrained", "--model", str(user_model), "--text", str(text), "--device", "cuda",
              "--out", str(tmp_path / "out")], "--device cuda runs one rank per GPU under torchrun", capsys)


def test_the_recommendation_takes_the_fewest_bytes_within_the_tolerance() -> None:
    def row(mode, interval, mb, cell="c"):
        return {"mode": mode, "cell": cell, "ci95_percent": interval, "cross_node_mb_per_step": mb}

    rows = [row("all", [0.1, 0.25], 10.0), row("all_delta", [0.05, 0.2], 6.0), row("all_ef", [0.0, 0.1], 12.0),
            row("zero3_order", [-0.01, 0.01], 40.0)]
    assert accuracy_cells.recommend(rows, 0.3)["recommended"] == "all_delta"
    # a config over the tolerance in one cell is out, whatever its bytes
    rows.append(row("all_delta", [0.2, 0.5], 6.0, cell="d"))
    assert accuracy_cells.recommend(rows, 0.3)["recommended"] == "all"
    advice = accuracy_cells.recommend(rows, 0.05)
    assert advice["recommended"] is None and "the closest is all_ef (95% upper end +0.10%;" in advice["reason"]
    # one pair has no interval: never recommended
    assert accuracy_cells.recommend([row("all", None, 1.0)], 0.3)["recommended"] is None
    # a config whose bytes differ by cell (a budget's widened units) is priced at its dearest cell
    budget = [row("all_budget", [0.0, 0.1], 5.0), row("all_budget", [0.0, 0.1], 11.0, cell="d")]
    assert accuracy_cells.recommend([*rows[:1], row("all", [0.1, 0.25], 10.0, cell="d"), *budget],
                                         0.3)["recommended"] == "all"
    # over cells, more cells with an interval come first; a cell of one pair rules out only by its mean
    def single(mode, mean, mb, cell):
        return {**row(mode, None, mb, cell), "mean_delta_percent": mean}

    grid = [row("all", [0.1, 0.2], 10.0), row("all", [0.1, 0.25], 10.0, cell="d"),
            row("all_budget", [0.0, 0.1], 9.0), single("all_delta", 0.1, 6.0, "d"), row("all_delta", [0.0, 0.1], 6.0)]
    advice = accuracy_cells.recommend(grid, 0.3)
    assert advice["recommended"] == "all" and "in the" not in advice["reason"]
    grid.append(row("all_delta", [0.0, 0.2], 6.0, cell="e"))
    assert accuracy_cells.recommend(grid, 0.3)["recommended"] == "all_delta"
    assert accuracy_cells.recommend([*grid, single("all_delta", 0.4, 6.0, "f")], 0.3)["recommended"] == "all"
    # none within: the closest is named by what rules it out, a pair's mean where its upper end is under
    ruled_out = [row("all", [0.1, 0.5], 10.0), row("all_rotnorm", [0.0, 0.22], 10.0),
                 single("all_rotnorm", 0.31, 10.0, "d")]
    reason = accuracy_cells.recommend(ruled_out, 0.3)["reason"]
    assert "the closest is all_rotnorm (95% upper end +0.22%, one pair's mean +0.31%" in reason
    assert "over by 0.01 points" in reason


def test_each_cell_states_the_default_and_the_lowest_upper_end_found() -> None:
    def row(mode, interval, mb, cell, pairs=3, mean=None):
        return {"mode": mode, "cell": cell, "ci95_percent": interval, "cross_node_mb_per_step": mb,
                "pairs": pairs, "mean_delta_percent": mean if interval is None else sum(interval) / 2}

    rows = [row("all", [0.1, 0.25], 85.6, "a"), row("all_delta", [0.0, 0.2], 34.7, "a"),
            row("all_ef", [0.0, 0.2], 85.6, "a"), row("zero3_order", [-0.3, -0.2], None, "a"),
            row("all", [-1.6, 2.3], 85.6, "b"), row("all_delta_g8", [-0.2, 0.5], 51.5, "b"),
            row("all", None, 85.6, "c", pairs=1, mean=0.9), row("all_rotnorm", None, 85.6, "c", pairs=1, mean=0.3)]
    a, b, c = accuracy_cells.per_cell(rows, 0.3)
    # within; the control is never the best; a tie in upper ends goes to the fewer bytes
    assert (a["default_within"], a["best"], a["best_gap_points"]) == (True, "all_delta", 0.0)
    # over: the lowest upper end found, and its gap over the tolerance
    assert (b["default_within"], b["best"], b["best_cross_node_mb_per_step"]) == (False, "all_delta_g8", 51.5)
    assert abs(b["best_gap_points"] - 0.2) < 1e-9
    # one pair is no interval, and nothing of one pair is the best
    assert (c["default_within"], c["default_mean_percent"], c["best"]) == (None, 0.9, None)
    text = accuracy_cells.cells_table([a, b, c], 0.3)
    assert ("| b | +0.35% [-1.60, +2.30] (3) | no | all_delta_g8: +0.15% [-0.20, +0.50] (3) | 51.5 "
            "| 0.20 points |") in text
    assert "| c | +0.90% — (1) | no interval | — | — | — |" in text


def test_the_plan_prices_each_config_for_the_users_model(user_model) -> None:
    """Bytes one rank sends across nodes per step, from ``zeropp.explain``'s plan (the ledger's
    bytes): all three under a quarter of ZeRO-3's, weight differences under 0.7x all three's (with
    8-bit gradients across nodes more, still under all three's), error
    feedback and the rotation with normal levels all three's bytes, the embedding's and norms'
    gradients at 8 bits more, and unquantized more again."""
    config = json.loads((user_model / "config.json").read_text())
    mb = {mode: accuracy_pretrained.cross_node_mb(config, mode, accuracy_pretrained.Layout(), "float32")
          for mode in ("zero3", "all", "all_delta", "all_delta_g8", "all_ef", "all_rotnorm", "all_wide_embed",
                       "all_spare_embed")}
    assert 0 < mb["all"] < mb["zero3"] / 4
    assert 0 < mb["all_delta"] < 0.7 * mb["all"]
    assert mb["all_delta"] < mb["all_delta_g8"] < mb["all"]  # 8-bit gradients, still under all three's bytes
    assert mb["all_ef"] == mb["all_rotnorm"] == mb["all"]
    assert mb["all"] < mb["all_wide_embed"] < mb["all_spare_embed"]
    # the budget's widened units, priced as the run's audit found them; none widened: all three's bytes
    assert accuracy_pretrained.cross_node_mb(config, "all_budget", accuracy_pretrained.Layout(), "float32") == mb["all"]
    widened = accuracy_pretrained.cross_node_mb(config, "all_budget", accuracy_pretrained.Layout(), "float32",
                                                ("the root",))
    assert mb["all"] < widened < mb["all_spare_embed"]
    records = [{"step": 1, "audit": [{"unit": "the root", "widened": True},
                                     {"unit": "model.layers.0", "widened": False}]}]
    assert accuracy_pretrained.widened_units(records) == ("the root",)
