"""A per-rank job's command line from its config dataclass: the launcher writes one flag per
field (``config_flags``) and the job reads them back (``add_config_flags``), so a config crosses
torchrun unchanged. Fields are numbers and strings."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist


def config_flags(config: Any) -> list[str]:
    """``--field-name value`` for every field of a dataclass instance."""
    flags = []
    for name, value in dataclasses.asdict(config).items():
        flags += [f"--{name.replace('_', '-')}", str(value)]
    return flags


def add_config_flags(parser: argparse.ArgumentParser, config_type: type) -> None:
    """One option per field of ``config_type``, typed and defaulted like the field's default."""
    for name, default in dataclasses.asdict(config_type()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)


def run_rank_job(description: str, config_type: type, train: Callable[[Any, Path], Any],
                 argv: list[str] | None = None) -> None:
    """One rank of a job launched under torchrun: ``--run-dir`` and the config's flags, then
    ``train(config, run_dir)`` inside a gloo process group (the demo models live on the CPU)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--run-dir", type=Path, required=True)
    add_config_flags(parser, config_type)
    args = vars(parser.parse_args(argv))
    run_dir = args.pop("run_dir")
    dist.init_process_group("gloo")
    try:
        train(config_type(**args), run_dir)
    finally:
        dist.destroy_process_group()
