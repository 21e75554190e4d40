"""The ``zeropp`` command."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path


def launch_local(module: str, module_args: list[str], num_nodes: int, ranks_per_node: int) -> int:
    """Run ``python -m module`` on num_nodes x ranks_per_node local processes through torchrun,
    declaring the layout with ZEROPP_RANKS_PER_NODE (one machine standing in for several)."""
    env = {**os.environ, "ZEROPP_RANKS_PER_NODE": str(ranks_per_node), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={num_nodes * ranks_per_node}", "-m", module, *module_args]
    return subprocess.call(command, env=env)


def _demo(args: argparse.Namespace) -> int:
    from zeropp.demo import MODES, compare

    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        print(f"zeropp demo: unknown mode(s) {unknown}; choose from {sorted(MODES)}", file=sys.stderr)
        return 2
    run_dir = Path(args.runs) / time.strftime("%Y%m%d-%H%M%S")
    for mode in modes:
        module_args = ["--run-dir", str(run_dir / mode), "--mode", mode, "--steps", str(args.steps)]
        print(f"\nzeropp demo: {args.nodes} nodes x {args.ranks_per_node} ranks (local processes), "
              f"mode {mode}, {args.steps} steps -> {run_dir / mode}", flush=True)
        code = launch_local("zeropp.demo", module_args, args.nodes, args.ranks_per_node)
        if code:
            return code
    print("\n" + compare(run_dir, modes))
    print(f"\nloss curves: {run_dir / 'loss.png'}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    if args.what == "quant":
        from zeropp.bench import quant

        quant.run(out_dir=args.out)
    elif args.what == "comm":
        from zeropp.bench import comm

        comm.run(out_dir=args.out, quick=args.quick, **({"modes": args.modes} if args.modes else {}))
    else:
        from zeropp.bench import step

        step.run(out_dir=args.out, quick=args.quick, modes=args.modes, param_dtype=args.param_dtype,
                 **({"bandwidths": args.bandwidths} if args.bandwidths else {}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from zeropp.demo import MODES

    parser = argparse.ArgumentParser(prog="zeropp", description="ZeRO++ on PyTorch FSDP2")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train the demo GPT on Shakespeare on local ranks")
    demo.add_argument("--modes", default="zero3,all",
                      help=f"comma-separated, from {sorted(MODES)} (default: ZeRO-3 and all three ZeRO++)")
    demo.add_argument("--steps", type=int, default=300)
    demo.add_argument("--nodes", type=int, default=2, help="emulated nodes (default 2)")
    demo.add_argument("--ranks-per-node", type=int, default=2)
    demo.add_argument("--runs", default="runs", help="parent folder of the run directory")
    demo.set_defaults(func=_demo)
    bench = sub.add_parser("bench", help="benchmarks that print a table and write JSON")
    bench.add_argument("what", choices=["quant", "comm", "step"])
    bench.add_argument("--out", default="benchmarks/results")
    bench.add_argument("--quick", action="store_true", help="comm/step: a tiny model, one step (smoke run)")
    bench.add_argument("--modes", type=lambda text: tuple(text.split(",")), default=None,
                       help="comm/step: comma-separated worker modes (default: all of them; step adds "
                            "'deepspeed' when DeepSpeed is installed)")
    bench.add_argument("--bandwidths", type=lambda text: tuple(text.split(",")), default=None,
                       help="step: comma-separated inter-node rates (default: unlimited,1gbit,100mbit)")
    bench.add_argument("--param-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                       help="step: dtype of compute and weight gathers (float32 on CPUs without fast bf16)")
    bench.set_defaults(func=_bench)
    from zeropp.bench import converge, finetune
    from zeropp.checkpoint_tools import add_commands as add_checkpoint_commands
    from zeropp.cluster.cli import add_commands as add_cluster_commands

    for name, module, text in [("converge", converge, "loss curves of every mode on Shakespeare"),
                               ("finetune", finetune, "fine-tune SmolLM2-135M under ZeRO-3 and ZeRO++")]:
        command = sub.add_parser(name, help=text)
        module.add_arguments(command)
        command.set_defaults(func=module.run_from_args)
    add_cluster_commands(sub)
    add_checkpoint_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    sys.exit(args.func(args))
