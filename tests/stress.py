"""``make test-stress``: the multi-rank tests, several rounds in a row, beside a CPU hog.

A flake in the harness (a rank that leaves while a peer still needs it, a store that goes away, a
timeout too tight for a loaded machine) shows only when the machine is busy. This runs every test
file that spawns gloo ranks (``run_distributed``) ``--rounds`` times, while ``--hogs`` processes
spin on the CPU beside it, and stops at the first round that fails. ``--all`` includes the tests
marked slow. Prints one line per round and writes them as JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import pathlib
import subprocess
import sys
import time

TESTS = pathlib.Path(__file__).parent


def multi_rank_files() -> list[str]:
    """The test files that spawn gloo ranks through the harness."""
    return sorted(str(path) for path in TESTS.glob("test_*.py")
                  if "run_distributed" in path.read_text(encoding="utf-8"))


def _spin() -> None:
    while True:
        pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hogs", type=int, default=os.cpu_count() or 1, help="spinning processes beside the tests")
    parser.add_argument("--all", action="store_true", help="also the tests marked slow")
    parser.add_argument("--out", default="stress.json")
    args = parser.parse_args()
    files = multi_rank_files()
    hogs = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.hogs)]
    for hog in hogs:
        hog.start()
    rounds = []
    try:
        for number in range(1, args.rounds + 1):
            start = time.monotonic()
            command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files,
                       *([] if args.all else ["-m", "not slow"])]
            done = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
            summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-500:]
            rounds.append({"round": number, "exit_code": done.returncode, "seconds": round(time.monotonic() - start, 1),
                           "summary": summary})
            print(f"round {number}: exit {done.returncode} in {rounds[-1]['seconds']} s: {summary}", flush=True)
            if done.returncode != 0:
                print(done.stdout[-20000:])
                break
    finally:
        for hog in hogs:
            hog.kill()
    record = {"files": [pathlib.Path(f).name for f in files], "hogs": args.hogs, "slow_included": args.all,
              "cpu_count": os.cpu_count(), "rounds": rounds}
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    return 0 if len(rounds) == args.rounds and all(r["exit_code"] == 0 for r in rounds) else 1


if __name__ == "__main__":
    sys.exit(main())
