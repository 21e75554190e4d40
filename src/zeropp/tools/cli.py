"""The ``zeropp`` command.

Every subcommand is registered the same way: a name, the module that implements it, the
function there that adds its options (and sets ``func``, what runs it), and one line of help.
A subcommand's module is imported only when that subcommand is chosen, so ``zeropp --help``
lists them without importing torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NamedTuple

from zeropp.tools.extras import require


class Command(NamedTuple):
    module: str
    add_arguments: str
    help: str
    needs: tuple[str, ...] = ()
    """Packages beyond the library's own that the subcommand imports."""
    extra: str = "tools"
    """The extra that installs them (``pip install 'zeropp[<extra>]'``)."""


_PLOTS = ("matplotlib", "tqdm")
"""What the benchmarks and the demo import beside the library: the ``tools`` extra."""


COMMANDS: dict[str, Command] = {
    "demo": Command("zeropp.tools.demo", "add_arguments",
                    "train the demo GPT on Shakespeare on local ranks, ZeRO-3 beside ZeRO++", _PLOTS),
    "bench": Command("zeropp.tools.bench.cli", "add_arguments", "benchmarks that print a table and write JSON",
                     _PLOTS),
    "converge": Command("zeropp.tools.bench.converge", "add_arguments", "loss curves of every mode on Shakespeare",
                        _PLOTS),
    "accuracy": Command("zeropp.tools.bench.accuracy", "add_arguments",
                        "does ZeRO++ cost accuracy? paired runs against perturbation controls, with a verdict",
                        _PLOTS),
    "finetune": Command("zeropp.tools.bench.finetune", "add_arguments",
                        "fine-tune SmolLM2-135M under ZeRO-3 and ZeRO++", (*_PLOTS, "gguf", "transformers"),
                        "finetune"),
    "rlhf": Command("zeropp.tools.bench.rlhf", "add_arguments",
                    "an RLHF loop (sample, reward, REINFORCE step) under ZeRO-3 and ZeRO++", _PLOTS),
    "plan": Command("zeropp.tools.plan.cli", "add_arguments",
                    "predict step time and memory of every mode on a cluster; recommend a configuration"),
    "checkpoint": Command("zeropp.checkpoint.tools", "add_arguments",
                          "inspect, consolidate or export (GGUF Q8_0, int8) a zeropp checkpoint"),
    "check": Command("zeropp.tools.check.cli", "add_arguments",
                     "prove zeropp on this GPU within a time budget: tests, kernels, a rank at scale, compile, "
                     "bf16/fp16, NCCL (a smoke form on the CPU)"),
    "cluster": Command("zeropp.tools.cluster.cli", "add_cluster_arguments",
                       "the emulated cluster: network namespaces + tc"),
    "launch": Command("zeropp.tools.cluster.cli", "add_launch_arguments",
                      "run a torchrun job with one torchrun per emulated node"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The parser, with the options of the subcommand ``argv`` names (if any) filled in."""
    parser = argparse.ArgumentParser(prog="zeropp", description="ZeRO++ on PyTorch FSDP2")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = next((arg for arg in argv if not arg.startswith("-")), None)
    for name, command in COMMANDS.items():
        sub = subparsers.add_parser(name, help=command.help, description=command.help)
        if name == chosen:
            require(f"zeropp {name}", command.extra, *command.needs)
            getattr(importlib.import_module(command.module), command.add_arguments)(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    sys.exit(args.func(args))


if __name__ == "__main__":
    main()
