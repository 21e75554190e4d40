"""README.md's figures are the result files' (``python -m zeropp.tools.readme --write`` writes them):
a result file changed without the README written again, or a generated figure edited by hand,
fails here, so in CI."""

from __future__ import annotations

import json
import pathlib

from zeropp.tools import readme

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_readmes_figures_are_the_result_files() -> None:
    current = (ROOT / "README.md").read_text()
    assert current == readme.generated(current, ROOT), "run: python -m zeropp.tools.readme --write"


def test_a_changed_result_file_changes_the_readme(tmp_path: pathlib.Path) -> None:
    """The check can fail: the same README against a result file whose figure moved."""
    source = ROOT / "benchmarks" / "results" / "bench_step.json"
    data = json.loads(source.read_text())
    for record in data["records"]:
        if record["mode"] == "all":
            record["median_step_s"] *= 1.5
    moved = tmp_path / "benchmarks" / "results" / "bench_step.json"
    moved.parent.mkdir(parents=True)
    moved.write_text(json.dumps(data))
    current = (ROOT / "README.md").read_text()
    assert readme.results_table(tmp_path) != readme.results_table(ROOT)
    assert readme.generated(current, tmp_path) != current
