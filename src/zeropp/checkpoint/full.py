"""The whole model gathered from its shards and written as safetensors by rank 0, for a process
without zeropp (``from_pretrained``, llama.cpp's converters, any safetensors reader).

Every rank takes part: each parameter's shards are gathered exactly (the full-precision sharded
parameters, never qwZ's codes), one parameter at a time, and rank 0 writes it and lets it go.

[Note: streaming the consolidated model]
A safetensors file is an 8-byte header length, a JSON header naming every tensor's dtype, shape
and byte range, then the tensors' bytes in that order. Every shape and dtype is known from the
sharded state dict before anything is gathered, so rank 0 writes the header first and then each
tensor as it arrives: it never holds more than one gathered parameter (at most one unit's worth)
beyond the file's own buffer, where building the state dict first would hold the whole model.
Files are split into shards of at most ``max_shard_bytes`` (a larger tensor gets a file of its
own) with the index transformers reads, and each file is written under a temporary name and
renamed into place, so an interrupted save never leaves a truncated file under the final name.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from zeropp.fsdp.comms import all_gather_strings

SAFETENSORS_NAME = "model.safetensors"
INDEX_SUFFIX = ".index.json"
DEFAULT_MAX_SHARD_BYTES = 50 * 1000**3
"""transformers' default ``max_shard_size`` (50GB)."""

_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


@dataclass(frozen=True)
class Entry:
    """One tensor of the consolidated model: its name, its full shape and dtype, and the state
    dict value it is gathered from (a sharded ``DTensor`` or a tensor every rank holds whole)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    value: torch.Tensor

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * self.dtype.itemsize


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def tied_names(model: nn.Module) -> dict[str, str]:
    """State dict names whose tensor is a parameter or buffer already named earlier in the state
    dict (a causal LM's head tied to its embedding) -> that earlier name. Found by the modules'
    own objects, the same on every rank."""
    objects = {name: id(tensor) for name, tensor in [*model.named_parameters(remove_duplicate=False),
                                                      *model.named_buffers(remove_duplicate=False)]}
    first: dict[int, str] = {}
    tied = {}
    for name in model.state_dict():
        if name not in objects:
            continue
        earlier = first.setdefault(objects[name], name)
        if earlier != name:
            tied[name] = earlier
    return tied


def entries(state_dict: dict[str, Any], dtype: torch.dtype | None = None,
            tied: dict[str, str] | None = None) -> list[Entry]:
    """The tensors of ``state_dict`` to write, in its order, each stored tensor once: a name in
    ``tied`` (a weight tied to an earlier one) is left out, as transformers leaves it out.
    Floating tensors are written as ``dtype`` when given."""
    chosen = []
    for name, value in state_dict.items():
        if not isinstance(value, torch.Tensor) or name in (tied or {}):
            continue
        out_dtype = dtype if dtype is not None and value.is_floating_point() else value.dtype
        if out_dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{name}: dtype {out_dtype} has no safetensors code; "
                             f"safetensors stores {', '.join(map(str, _SAFETENSORS_DTYPES))}")
        chosen.append(Entry(name, tuple(value.shape), out_dtype, value))
    return chosen


def plan_files(chosen: list[Entry], max_shard_bytes: int,
               filename: str = SAFETENSORS_NAME) -> list[tuple[str, list[Entry]]]:
    """Split the entries in order into files of at most ``max_shard_bytes`` each (a tensor larger
    than that gets a file of its own), named as transformers names its shards; one file keeps
    ``filename``."""
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes={max_shard_bytes}; expected a positive number of bytes")
    groups: list[list[Entry]] = [[]]
    size = 0
    for entry in chosen:
        if groups[-1] and size + entry.nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(entry)
        size += entry.nbytes
    if len(groups) == 1:
        return [(filename, groups[0])]
    stem, suffix = os.path.splitext(filename)
    return [(f"{stem}-{i + 1:05d}-of-{len(groups):05d}{suffix}", group) for i, group in enumerate(groups)]


def header(group: list[Entry], metadata: dict[str, str] | None = None) -> bytes:
    """The safetensors header of a file holding ``group`` in order: its 8-byte length, then the
    JSON, padded with spaces to a multiple of 8 bytes as the format's writers do."""
    described: dict[str, Any] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for entry in group:
        described[entry.name] = {"dtype": _SAFETENSORS_DTYPES[entry.dtype], "shape": list(entry.shape),
                                 "data_offsets": [offset, offset + entry.nbytes]}
        offset += entry.nbytes
    text = json.dumps(described, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


@torch.no_grad()
def gathered(entry: Entry) -> torch.Tensor:
    """``entry``'s full tensor on every rank of its mesh, in its output dtype, on the CPU."""
    value = entry.value.full_tensor() if isinstance(entry.value, DTensor) else entry.value
    return value.detach().to(device="cpu", dtype=entry.dtype).contiguous()


class _Files:
    """Rank ``writer_rank``'s side of a save: one file open at a time, written under a temporary
    name and renamed into place once complete. The first failure to write (a full disk, a
    missing permission) is kept, not raised, so this rank goes on gathering with its peers and
    every rank raises it together at the end instead of leaving the others waiting."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.failure: str | None = None
        self.written: list[Path] = []
        self._stream: BinaryIO | None = None
        self._partial: Path | None = None

    def attempt(self, action: Any) -> None:
        if self.failure is None:
            try:
                action()
            except OSError as error:
                self.failure = f"writing {self._partial or self.directory} failed: {error}"
                self.close()

    def open(self, filename: str, group: list[Entry]) -> None:
        def begin() -> None:
            self._partial = self.directory / (filename + ".partial")
            self._stream = open(self._partial, "wb")
            self._stream.write(header(group))
        self.attempt(begin)

    def write(self, tensor: torch.Tensor) -> None:
        self.attempt(lambda: self._stream.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy())))

    def commit(self) -> None:
        def finish() -> None:
            self._stream.flush()
            os.fsync(self._stream.fileno())
            self._stream.close()
            final = self._partial.with_name(self._partial.name.removesuffix(".partial"))
            os.replace(self._partial, final)
            self.written.append(final)
            self._stream = self._partial = None
        self.attempt(finish)

    def close(self) -> None:
        """Close and remove a file left unfinished (what cannot be removed stays: the failure
        being reported already names it)."""
        stream, partial = self._stream, self._partial
        self._stream = self._partial = None
        if stream is not None:
            stream.close()
        if partial is not None and stream is not None:  # this save opened it: remove it
            try:
                partial.unlink(missing_ok=True)
            except OSError:
                pass


def _write_index(plan: list[tuple[str, list[Entry]]], directory: Path, filename: str) -> Path:
    index = {"metadata": {"total_size": sum(e.nbytes for _, group in plan for e in group)},
             "weight_map": {e.name: name for name, group in plan for e in group}}
    path = directory / (os.path.splitext(filename)[0] + ".safetensors" + INDEX_SUFFIX)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(partial, path)
    return path


def _remove_stale(directory: Path, filename: str, keep: list[str]) -> None:
    """Remove the files an earlier save of another shard count left beside the new ones, so a
    reader never mixes shards of two saves."""
    stem, suffix = os.path.splitext(filename)
    for path in directory.glob(f"{stem}*{suffix}*"):
        if path.name not in keep and (path.name == filename or path.name.startswith(f"{stem}-")
                                      or path.name == f"{stem}{suffix}{INDEX_SUFFIX}"):
            path.unlink()


def save_full_weights(model: nn.Module | dict[str, Any], directory: str | os.PathLike[str], *,
                      filename: str = SAFETENSORS_NAME, dtype: torch.dtype | None = None,
                      max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, writer_rank: int = 0) -> list[Path]:
    """Gather the full weights of ``model`` (or of a state dict of sharded ``DTensor`` and whole
    tensors) and write them as safetensors under ``directory``: ``filename``, or numbered shards
    with a ``.index.json`` when the model exceeds ``max_shard_bytes``. Every rank must call it;
    rank ``writer_rank`` writes (see [Note: streaming the consolidated model]) and gets the paths
    it wrote, the others get an empty list. Floating tensors are cast to ``dtype`` when given.
    A failure to write raises ``OSError`` on every rank."""
    if isinstance(model, dict):
        chosen = entries(model, dtype)
    else:
        chosen = entries(model.state_dict(), dtype, tied_names(model))
    plan = plan_files(chosen, max_shard_bytes, filename)
    directory = Path(directory)
    distributed = dist.is_initialized()
    files = _Files(directory) if not distributed or dist.get_rank() == writer_rank else None
    if files is not None:
        files.attempt(lambda: directory.mkdir(parents=True, exist_ok=True))
    try:
        for name, group in plan:
            if files is not None:
                files.open(name, group)
            for entry in group:
                tensor = gathered(entry)
                if files is not None:
                    files.write(tensor)
                del tensor
            if files is not None:
                files.commit()
        if files is not None and len(plan) > 1:
            files.attempt(lambda: files.written.append(_write_index(plan, directory, filename)))
        if files is not None:
            files.attempt(lambda: _remove_stale(directory, filename, [p.name for p in files.written]))
    finally:
        if files is not None:
            files.close()
    failure = files.failure if files is not None else None
    if distributed:
        failure = next((f for f in all_gather_strings(failure or "") if f), None)
    if failure:
        raise OSError(f"saving the full model to {directory}: {failure}")
    return files.written if files is not None else []
