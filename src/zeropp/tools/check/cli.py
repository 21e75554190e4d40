"""``zeropp check`` (``python -m zeropp.tools.check``): its options, and the run they ask for."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from zeropp.tools.check.sections import SECTIONS

GPU_BUDGET_S = 480.0
SMOKE_BUDGET_S = 90.0
RESULTS = Path("benchmarks/results/gpu")


def _sections(text: str) -> tuple[str, ...]:
    names = tuple(name for name in text.split(",") if name)
    unknown = [name for name in names if name not in SECTIONS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"--sections {text!r} must name sections from {', '.join(SECTIONS)}"
                                         + (f"; unknown: {', '.join(unknown)}" if unknown else ""))
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=None,
                        help=f"results folder (default: {RESULTS}/<GPU name>/, {RESULTS}/cpu-smoke/ without one)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help=f"total seconds, sections included (default: {GPU_BUDGET_S:.0f} on a GPU, "
                             f"{SMOKE_BUDGET_S:.0f} in the smoke form)")
    form = parser.add_mutually_exclusive_group()
    form.add_argument("--gpu", action="store_true", help="refuse to run without a CUDA GPU (no smoke form)")
    form.add_argument("--smoke", action="store_true",
                      help="the smoke form on the CPU (tiny shapes, few steps) even where a GPU is present; "
                           "the default without one")
    parser.add_argument("--sections", type=_sections, default=tuple(SECTIONS),
                        help=f"comma-separated sections to run, in their order (default: {','.join(SECTIONS)})")
    parser.set_defaults(func=run_from_args)


def run_from_args(args: argparse.Namespace) -> int:
    """Run the check; 0 when every section that ran passed, 1 otherwise, 2 when ``--gpu`` finds no GPU."""
    started = time.monotonic()
    from zeropp.tools.check.machine import describe, slug
    from zeropp.tools.check.runner import Runner

    machine = describe()
    if args.gpu and not machine["num_gpus"]:
        print("zeropp check --gpu: torch sees no CUDA GPU here (torch.cuda.is_available() is False); run without "
              "--gpu for the smoke form on the CPU", file=sys.stderr)
        return 2
    smoke = args.smoke or not machine["num_gpus"]
    budget_s = args.budget_s if args.budget_s is not None else SMOKE_BUDGET_S if smoke else GPU_BUDGET_S
    out = args.out if args.out is not None else RESULTS / slug(machine)
    gpus = ", ".join(gpu["name"] for gpu in machine["gpus"]) or "no GPU"
    print(f"zeropp check, {'smoke form on the CPU' if smoke else 'GPU form'} ({gpus}): budget {budget_s:.0f} s, "
          f"results in {out}/", flush=True)
    runner = Runner(out=out, budget_s=budget_s, smoke=smoke, selected=args.sections, machine=machine,
                    started=started, command=["zeropp", "check", *sys.argv[1:]])
    results = runner.run()
    return 0 if all(entry["passed"] is not False for entry in results["sections"]) else 1


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m zeropp.tools.check", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    sys.exit(args.func(args))
