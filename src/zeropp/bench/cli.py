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
    parser.add_argument("--model", type=_model_shape, default=None, metavar="LAYERSxWIDTH",
                        help="step: the GPT's layers x width (e.g. 4x256; heads: width / 64) instead of 8x512")
    parser.add_argument("--updates-only", action="store_true",
                        help="qgz-error: only the errors on zero and tiny entries and on Adam's update "
                             "(qgz_error_updates.json)")
    parser.add_argument("--no-memory", action="store_true",
                        help="step: skip the per-mode peak-RSS jobs")
    parser.add_argument("--models", type=lambda text: tuple(text.split(",")), default=None,
                        help="overhead: comma-separated, from demo, gpt_6x96, gpt_25m (default: all three)")
    parser.set_defaults(func=run_from_args)


def _model_shape(text: str) -> dict[str, int]:
    """``4x256`` -> the worker's shape fields (one head per 64 of width, at least one)."""
    layers, _, width = text.partition("x")
    if not (layers.isdigit() and width.isdigit()) or int(layers) < 1 or int(width) < 1:
        raise argparse.ArgumentTypeError(f"--model {text!r} must be LAYERSxWIDTH with positive integers, e.g. 4x256")
    return {"num_layers": int(layers), "embed_dim": int(width), "num_heads": max(1, int(width) // 64)}


def run_from_args(args: argparse.Namespace) -> int:
    """Run the benchmark ``args.what`` with the parsed options."""
    if args.what == "quant":
        from zeropp.bench import quant

        quant.run(out_dir=args.out)
    elif args.what == "qgz-error":
        from zeropp.bench import qgz_error

        qgz_error.run(out_dir=args.out, quick=args.quick, updates_only=args.updates_only)
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
                 model=args.model, memory_jobs=not args.no_memory,
                 **({"bandwidths": args.bandwidths} if args.bandwidths else {}))
    return 0
