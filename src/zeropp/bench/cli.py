"""``zeropp bench quant|qgz-error|comm|step|generate|overhead|export``: the benchmarks' command-line options."""

from __future__ import annotations

import argparse

from zeropp.bench.worker import BENCH_MODES
from zeropp.modes import MODES, parse_modes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``zeropp bench``'s options; each benchmark takes the ones it names."""
    parser.add_argument("what", choices=["quant", "qgz-error", "comm", "step", "generate", "overhead", "export"])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--quick", action="store_true",
                        help="comm/step/overhead: a tiny model or few steps; qgz-error: 2x2 synthetic only (smoke run)")
    parser.add_argument("--modes", type=lambda text: parse_modes(text, MODES), default=None,
                        help=f"comm/step: comma-separated modes (default: {','.join(BENCH_MODES)}; step adds "
                             "'deepspeed' when DeepSpeed is installed)")
    parser.add_argument("--bandwidths", type=lambda text: tuple(text.split(",")), default=None,
                        help="step: comma-separated inter-node rates (default: unlimited,1gbit,100mbit)")
    parser.add_argument("--param-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="step: dtype of compute and weight gathers (float32 on CPUs without fast bf16)")
    parser.add_argument("--models", type=lambda text: tuple(text.split(",")), default=None,
                        help="overhead: comma-separated, from demo, gpt_6x96, gpt_25m (default: all three)")
    parser.set_defaults(func=run_from_args)


def run_from_args(args: argparse.Namespace) -> int:
    """Run the benchmark ``args.what`` with the parsed options."""
    if args.what == "quant":
        from zeropp.bench import quant

        quant.run(out_dir=args.out)
    elif args.what == "qgz-error":
        from zeropp.bench import qgz_error

        qgz_error.run(out_dir=args.out, quick=args.quick)
    elif args.what == "export":
        from zeropp.bench import export

        export.run(out_dir=args.out)
    elif args.what == "generate":
        from zeropp.bench import generate

        generate.run(out_dir=args.out, **({"bandwidths": args.bandwidths} if args.bandwidths else {}))
    elif args.what == "overhead":
        from zeropp.bench import overhead

        overhead.run(out_dir=args.out, quick=args.quick, **({"models": args.models} if args.models else {}))
    elif args.what == "comm":
        from zeropp.bench import comm

        comm.run(out_dir=args.out, quick=args.quick, **({"modes": args.modes} if args.modes else {}))
    else:
        from zeropp.bench import step

        step.run(out_dir=args.out, quick=args.quick, modes=args.modes, param_dtype=args.param_dtype,
                 **({"bandwidths": args.bandwidths} if args.bandwidths else {}))
    return 0
