"""``zeropp bench quant|qgz-error|comm|step|layouts|generate|overhead|export|scale``: the benchmarks'
command-line options."""

from __future__ import annotations

import argparse
from pathlib import Path

from zeropp.tools.bench.worker import BENCH_MODES
from zeropp.tools.modes import MODES, parse_modes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``zeropp bench``'s options; each benchmark takes the ones it names."""
    parser.add_argument("what", choices=["quant", "qgz-error", "comm", "step", "layouts", "generate", "overhead",
                                                "export", "scale"])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--quick", action="store_true",
                        help="comm/step/overhead: a tiny model or few steps; qgz-error: 2x2 synthetic only; scale: a "
                             "narrow Llama at 384 and 1024 ranks (smoke run)")
    parser.add_argument("--modes", type=lambda text: parse_modes(text, MODES), default=None,
                        help=f"comm/step: comma-separated modes (default: {','.join(BENCH_MODES)}; step adds "
                             "hsdp_quantized, all_serial and 'deepspeed' when DeepSpeed is installed); scale: "
                             "zeropp modes (default: zero3,qwz,hpz,qgz,all)")
    parser.add_argument("--bandwidths", type=lambda text: tuple(text.split(",")), default=None,
                        help="step, layouts: comma-separated inter-node rates (default: unlimited,1gbit,100mbit; "
                             "layouts: unlimited,100mbit)")
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
    parser.add_argument("--world-sizes", type=_world_sizes, default=None,
                        help="scale: comma-separated world sizes, multiples of 8 (default: 64,384,1024,4096)")
    parser.add_argument("--no-full", action="store_true", help="scale: skip the full model's set-up runs")
    parser.set_defaults(func=run_from_args)


def _world_sizes(text: str) -> tuple[int, ...]:
    sizes = tuple(int(w) for w in text.split(",") if w.isdigit())
    if not sizes or len(sizes) != len(text.split(",")) or any(w < 8 or w % 8 for w in sizes):
        raise argparse.ArgumentTypeError(f"--world-sizes {text!r} must be comma-separated multiples of 8 (8 ranks "
                                         "per node), e.g. 64,384")
    return sizes


def _model_shape(text: str) -> dict[str, int]:
    """``4x256`` -> the worker's shape fields (one head per 64 of width, at least one)."""
    layers, _, width = text.partition("x")
    if not (layers.isdigit() and width.isdigit()) or int(layers) < 1 or int(width) < 1:
        raise argparse.ArgumentTypeError(f"--model {text!r} must be LAYERSxWIDTH with positive integers, e.g. 4x256")
    return {"num_layers": int(layers), "embed_dim": int(width), "num_heads": max(1, int(width) // 64)}


def run_from_args(args: argparse.Namespace) -> int:
    """Run the benchmark ``args.what`` with the parsed options."""
    if args.what == "quant":
        from zeropp.tools.bench import quant

        quant.run(out_dir=args.out)
    elif args.what == "qgz-error" and args.updates_only:
        from zeropp.tools.bench import qgz_updates

        qgz_updates.write(args.out)
    elif args.what == "qgz-error":
        from zeropp.tools.bench import qgz_error

        results = qgz_error.run(out_dir=args.out, quick=args.quick)
        if not args.quick:  # the updates' part, into the same file
            from zeropp.tools.bench import qgz_updates

            qgz_updates.add_to(results, Path(args.out) / "qgz_error.json")
    elif args.what == "export":
        from zeropp.tools.bench import export

        export.run(out_dir=args.out)
    elif args.what == "generate":
        from zeropp.tools.bench import generate

        generate.run(out_dir=args.out, **({"bandwidths": args.bandwidths} if args.bandwidths else {}))
    elif args.what == "overhead":
        from zeropp.tools.bench import overhead

        overhead.run(out_dir=args.out, quick=args.quick, **({"models": args.models} if args.models else {}))
    elif args.what == "scale":
        from zeropp.tools.bench import scale

        scale.run(out_dir=args.out, quick=args.quick, world_sizes=args.world_sizes, modes=args.modes,
                  full=not args.no_full)
    elif args.what == "layouts":
        from zeropp.tools.bench import layouts

        layouts.run(out_dir=args.out, **({"bandwidths": args.bandwidths} if args.bandwidths else {}))
    elif args.what == "comm":
        from zeropp.tools.bench import comm

        comm.run(out_dir=args.out, quick=args.quick, **({"modes": args.modes} if args.modes else {}))
    else:
        from zeropp.tools.bench import step

        step.run(out_dir=args.out, quick=args.quick, modes=args.modes, param_dtype=args.param_dtype,
                 model=args.model, memory_jobs=not args.no_memory,
                 **({"bandwidths": args.bandwidths} if args.bandwidths else {}))
    return 0
