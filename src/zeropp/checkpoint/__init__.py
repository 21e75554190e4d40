"""Checkpoints through ``torch.distributed.checkpoint`` (DCP): atomic, verified before use, never
unpickling arbitrary objects, loadable at another world size or with other ZeRO++ settings (the
state dict holds the full-precision parameters and optimizer state, sharded as DTensors; DCP
reshards them on load).

Layout of a checkpoint directory ``DIR``::

    DIR/latest             the newest complete tag, one line (replaced atomically, written last)
    DIR/<tag>/.metadata    DCP's index of the tensors (a pickle written by torch)
    DIR/<tag>/__*.distcp   DCP's data files
    DIR/<tag>/rank<r>.json per-rank state (RNG states)
    DIR/<tag>/zeropp.json  format, version, engine state, and the size and sha256 of every file
    DIR/.tmp-<tag>/        a save in progress, or one that failed or crashed: never read

[Note: atomic save]
Every rank writes into ``DIR/.tmp-<tag>``; after each stage the ranks exchange their errors
(``all_gather_strings``), so a failure on one rank stops all of them at the same point instead of
leaving peers waiting in a collective. Only when all files are written and hashed does rank 0
rename the directory to ``DIR/<tag>`` and then replace ``DIR/latest`` (write to a temporary
file, ``os.replace``). A crash at any point before that rename leaves ``latest`` and the
checkpoint it names untouched. Re-saving an existing tag moves the old one to ``.old-<tag>`` for
the moment between the two renames; a load that finds only ``.old-<tag>`` uses it.

[Note: optimizer state before the first step]
DCP's ``get_state_dict`` fills an optimizer that has no state yet by running ``step()`` with zero
gradients and lr 0: Adam's moments become zeros and its step count 1, which changes the next real
update (bias correction). Saving or loading must not change training, so an optimizer without
state is emptied again after the save, and after loading a checkpoint saved in that state.

[Note: pickle safety]
DCP (torch 2.13) reads ``.metadata`` with ``pickle.load`` and non-tensor entries (the
optimizer's ``param_groups``) with ``torch.load(weights_only=False)``; it offers no safe mode.
zeropp replaces both: ``.metadata`` goes through an unpickler whose ``find_class`` allows only
DCP's metadata dataclasses, ``torch.Size``, dtypes, layouts and paths, and non-tensor entries go
through ``torch.load(weights_only=True)`` (tensors already do). Before either runs, every file's
size and sha256 are checked against ``zeropp.json`` (plain JSON), so a truncated, garbled or
missing file is refused with its name before DCP reads anything.

Beside it in this package: ``tools`` (``zeropp checkpoint inspect`` / ``consolidate``), ``export``
(the weights in qwZ's 8-bit code, GGUF Q8_0 or safetensors int8) and ``llama_gguf`` (transformers'
Llama names and rotary row order against GGUF's).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.utils import CheckpointException

from zeropp.fsdp.access import EmptyStateDictLoadPlanner, set_element
from zeropp.fsdp.comms import all_gather_strings

FORMAT = "zeropp-checkpoint"
FORMAT_VERSION = 1
LATEST = "latest"
MANIFEST = "zeropp.json"
DCP_METADATA = ".metadata"
STAGING_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"


class CheckpointError(ValueError):
    """A checkpoint that cannot be saved or loaded; the message names the path and the problem."""


# ---------------------------------------------------------------------------------------------
# Reading DCP files without unpickling arbitrary objects (see [Note: pickle safety])

_SAFE_GLOBALS: dict[str, set[str]] = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
        "BytesStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata``: only the classes such a file holds can be constructed."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _SAFE_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")


def read_dcp_metadata(path: Path) -> Metadata:
    """DCP's index of the checkpoint at ``path``, read with the allow-list unpickler."""
    file = path / DCP_METADATA
    try:
        metadata = _MetadataUnpickler(io.BytesIO(file.read_bytes())).load()
    except Exception as error:  # any unpickling failure means the file is not DCP metadata
        problem = f"{type(error).__name__}: {error}"
        raise CheckpointError(f"{file}: not readable DCP metadata ({problem})") from error
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{file}: holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file reader with ``.metadata`` read through the allow-list unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_dcp_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _load_bytes_weights_only(planner: DefaultLoadPlanner, read_item: Any, value: io.BytesIO) -> None:
    """``DefaultLoadPlanner.load_bytes`` with ``weights_only=True`` (plain containers and numbers)."""
    obj = torch.load(value, weights_only=True)
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[read_item.dest_index.fqn], obj)
    else:
        planner.state_dict[read_item.dest_index.fqn] = obj


class SafeLoadPlanner(DefaultLoadPlanner):
    load_bytes = _load_bytes_weights_only


class SafeEmptyStateDictLoadPlanner(EmptyStateDictLoadPlanner):
    load_bytes = _load_bytes_weights_only


# ---------------------------------------------------------------------------------------------
# Verification: every file present, of the recorded size and hash, before anything is read


@dataclass(frozen=True)
class Manifest:
    """What ``zeropp.json`` records about one checkpoint."""

    path: Path
    world_size: int
    """Ranks that saved it (loading at another world size is fine)."""
    engine: dict[str, Any]
    """The engine's JSON state (steps, loss scaler, scheduler, client state)."""
    files: dict[str, dict[str, Any]]
    """File name -> {"bytes": size, "sha256": hex digest}."""
    optimizer_initialized: bool
    """Whether the optimizer had state (had stepped) when saved."""
    has_optimizer: bool = True
    """Whether it holds optimizer state (False: the model alone)."""


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_manifest(path: Path) -> Manifest:
    """Parse and check ``path/zeropp.json``; raise CheckpointError naming what is wrong."""
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    file = path / MANIFEST
    if not file.is_file():
        raise CheckpointError(f"{file} is missing: {path} is not a complete zeropp checkpoint "
                              "(a save that did not finish, or a checkpoint not written by zeropp)")
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{file}: not readable JSON ({error})") from error
    found = raw.get("format") if isinstance(raw, dict) else None
    if found != FORMAT:
        raise CheckpointError(f"{file}: not a zeropp checkpoint manifest (format {found!r}, "
                              f"expected {FORMAT!r})")
    if raw.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{file}: format version {raw.get('version')!r}; this zeropp reads "
                              f"version {FORMAT_VERSION}")
    files = raw.get("files")
    if not isinstance(files, dict) or not all(_is_file_entry(name, entry) for name, entry in files.items()):
        raise CheckpointError(f"{file}: 'files' must map plain file names to {{'bytes': int, 'sha256': str}}")
    try:
        return Manifest(path, int(raw["world_size"]), dict(raw["engine"]), files,
                        bool(raw["optimizer_initialized"]), bool(raw.get("has_optimizer", True)))
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointError(f"{file}: entry {error} is missing or malformed") from error


def _is_file_entry(name: Any, entry: Any) -> bool:
    return (isinstance(name, str) and name not in ("", ".", "..") and Path(name).name == name
            and isinstance(entry, dict) and isinstance(entry.get("bytes"), int)
            and isinstance(entry.get("sha256"), str))


def verify(path: Path, *, share: tuple[int, int] = (0, 1)) -> Manifest:
    """Check the checkpoint at ``path``: the manifest, every file's presence and size, the sha256
    of the files in this caller's ``share`` = (index, count) of the sorted names, and that DCP's
    metadata reads safely and points only at listed files. Raises CheckpointError."""
    manifest = read_manifest(path)
    names = sorted(manifest.files)
    for name in names:
        file, expected = path / name, manifest.files[name]["bytes"]
        if not file.is_file():
            raise CheckpointError(f"{file} is missing (listed in {path / MANIFEST})")
        size = file.stat().st_size
        if size != expected:
            raise CheckpointError(f"{file} has {size} bytes, {expected} were written: "
                                  f"{'truncated' if size < expected else 'altered'}")
    index, count = share
    for name in names[index::count]:
        if _sha256(path / name) != manifest.files[name]["sha256"]:
            raise CheckpointError(f"{path / name}: content differs from what was written "
                                  "(sha256 mismatch): the file is corrupted")
    if DCP_METADATA not in manifest.files:
        raise CheckpointError(f"{path / MANIFEST} does not list DCP's {DCP_METADATA}")
    metadata = read_dcp_metadata(path)
    for info in metadata.storage_data.values():
        if info.relative_path not in manifest.files:
            raise CheckpointError(f"{path / DCP_METADATA} refers to {info.relative_path!r}, "
                                  f"which {path / MANIFEST} does not list")
    return manifest


# ---------------------------------------------------------------------------------------------
# Finding checkpoints


def read_latest(directory: Path) -> str | None:
    """The tag in ``directory/latest``, or None when there is no such file."""
    file = Path(directory) / LATEST
    if not file.is_file():
        return None
    tag = file.read_text(encoding="utf-8").strip()
    check_tag(tag, f"the tag in {file}")
    return tag


def check_tag(tag: str, what: str = "tag") -> None:
    """A tag names a directory inside the checkpoint directory: a plain, visible name."""
    if not isinstance(tag, str) or not tag or Path(tag).name != tag or tag.startswith(".") or tag == LATEST:
        raise CheckpointError(f"{what}={tag!r} is not a valid checkpoint tag; use a plain name "
                              "without '/', not starting with '.', other than 'latest'")


def resolve(directory: str | os.PathLike[str], tag: str | None = None) -> Path | None:
    """The checkpoint a (directory, tag) pair names: ``directory`` itself if it holds one
    (a manifest or DCP metadata) and no tag is given, else ``directory/<tag or latest>``; None
    when ``latest`` is missing. Falls back to ``.old-<tag>`` (see [Note: atomic save])."""
    directory = Path(directory)
    if tag is None and ((directory / MANIFEST).is_file() or (directory / DCP_METADATA).is_file()):
        return directory  # one checkpoint's own directory (verify reports a missing manifest)
    if tag is None:
        tag = read_latest(directory)
        if tag is None:
            return None
    check_tag(tag)
    path = directory / tag
    if not path.exists() and (directory / f"{OLD_PREFIX}{tag}").is_dir():
        return directory / f"{OLD_PREFIX}{tag}"
    return path


# ---------------------------------------------------------------------------------------------
# Saving and loading with a process group (every rank calls these)


def _agree(stage: str, path: Path, action: Callable[[], Any]) -> Any:
    """Run ``action`` on this rank, then learn every rank's outcome; if any failed, raise the
    same CheckpointError on all ranks (so none waits for a peer that gave up)."""
    result, error = None, None
    try:
        result = action()
        message = ""
    except Exception as caught:  # reported to every rank, re-raised below
        error = caught
        message = str(caught) if isinstance(caught, CheckpointError) else f"{type(caught).__name__}: {caught}"
    messages = all_gather_strings(message)
    if any(messages):
        raise CheckpointError(f"{path}: {stage} failed on {_by_rank(enumerate(messages))}") from error
    return result


def _by_rank(messages: Iterable[tuple[int, str]]) -> str:
    """"rank 0, 1: message; rank 3: other message": each distinct message once."""
    ranks: dict[str, list[str]] = {}
    for rank, text in messages:
        if text:
            ranks.setdefault(text, []).append(str(rank))
    return "; ".join(f"rank {', '.join(numbers)}: {text}" for text, numbers in ranks.items())


def _dcp_failures(error: CheckpointException) -> str:
    """DCP's per-rank exceptions, without its tracebacks (kept in the exception chain)."""
    failures = sorted(error.failures.items())
    return _by_rank((rank, f"{type(exc).__name__}: {exc}") for rank, (exc, _) in failures)


def _write_json(file: Path, value: Any) -> None:
    """Write JSON via a temporary file and ``os.replace`` (never a half-written file)."""
    temporary = file.with_name(file.name + ".partial")
    with open(temporary, "w", encoding="utf-8") as stream:
        json.dump(value, stream, allow_nan=False, sort_keys=True)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(temporary, file)


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fresh_directory(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)


def _hash_share(path: Path, rank: int, world_size: int) -> str:
    names = sorted(p.name for p in path.iterdir() if p.is_file())
    return json.dumps({name: {"bytes": (path / name).stat().st_size, "sha256": _sha256(path / name)}
                       for name in names[rank::world_size]})


def _commit(directory: Path, staging: Path, tag: str) -> None:
    """Rank 0: move the finished checkpoint into place, then point ``latest`` at it."""
    final, old = directory / tag, directory / f"{OLD_PREFIX}{tag}"
    _fsync_directory(staging)  # the files' names are durable before the directory is renamed
    if final.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
    os.replace(staging, final)
    _fsync_directory(directory)
    temporary = directory / f"{LATEST}.partial"
    temporary.write_text(tag + "\n", encoding="utf-8")
    with open(temporary, "rb") as stream:
        os.fsync(stream.fileno())
    os.replace(temporary, directory / LATEST)
    _fsync_directory(directory)
    if old.exists():
        shutil.rmtree(old)


def save(directory: str | os.PathLike[str], tag: str, *, model: nn.Module,
         optimizer: torch.optim.Optimizer | None, engine_state: dict[str, Any] | None = None,
         rank_state: dict[str, Any] | None = None) -> Path:
    """Save model and optimizer (DCP, sharded; the model alone when ``optimizer`` is None),
    ``engine_state`` (JSON, rank 0's) and each rank's ``rank_state`` (JSON) as ``directory/tag``,
    atomically (see [Note: atomic save]). Every rank must call it; the directory must be on a
    filesystem all ranks share."""
    engine_state = {} if engine_state is None else engine_state
    rank_state = {} if rank_state is None else rank_state
    check_tag(tag)
    directory = Path(directory)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    staging = directory / f"{STAGING_PREFIX}{tag}"
    try:
        json.dumps(engine_state, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{directory / tag}: the engine state (client_state included) must be "
                              f"JSON-serialisable (dict/list/str/int/float/bool/None): {error}") from error
    tags = all_gather_strings(tag)
    if len(set(tags)) != 1:
        raise CheckpointError(f"{directory}: the ranks passed different tags {tags}; "
                              "pass the same tag on every rank")
    _agree("creating the staging directory", staging,
           lambda: _fresh_directory(staging) if rank == 0 else None)
    optimizer_initialized = optimizer is not None and bool(optimizer.state)
    try:
        try:
            dcp.save(_state(model, optimizer), storage_writer=FileSystemWriter(staging))
        except CheckpointException as error:  # raised on every rank when any rank failed
            failures = _dcp_failures(error)
            raise CheckpointError(f"{staging}: writing the DCP checkpoint failed on {failures}") from error
        finally:
            if optimizer is not None and not optimizer_initialized:
                optimizer.state.clear()  # see [Note: optimizer state before the first step]
        _agree("writing per-rank state", staging,
               lambda: _write_json(staging / f"rank{rank}.json", rank_state))
        shares = _agree("hashing files", staging, lambda: _hash_share(staging, rank, world_size))
        files = {name: entry for share in all_gather_strings(shares)
                 for name, entry in json.loads(share).items()}
        manifest = {"format": FORMAT, "version": FORMAT_VERSION, "world_size": world_size,
                    "torch_version": torch.__version__, "optimizer_initialized": optimizer_initialized,
                    "has_optimizer": optimizer is not None,
                    "engine": engine_state, "files": files}
        _agree("writing the manifest", staging,
               lambda: _write_json(staging / MANIFEST, manifest) if rank == 0 else None)
        _agree("committing", directory / tag,
               lambda: _commit(directory, staging, tag) if rank == 0 else None)
    except CheckpointError:
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    return directory / tag


@dataclass(frozen=True)
class Loaded:
    """A checkpoint loaded into a model and optimizer: where from, and the JSON states."""

    path: Path
    engine_state: dict[str, Any]
    rank_state: dict[str, Any] | None
    """This rank's saved state, or None if the checkpoint was saved by fewer ranks."""
    saved_world_size: int


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """What DCP saves or loads: the model's sharded state, and the optimizer's where given."""
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def load(directory: str | os.PathLike[str], tag: str | None, *, model: nn.Module,
         optimizer: torch.optim.Optimizer | None) -> Loaded | None:
    """Verify, then load ``directory/<tag or latest>`` into ``model`` and ``optimizer`` (any
    world size, any ZeRO++ setting; the model alone when ``optimizer`` is None). Returns None
    when no tag is given and ``latest`` is missing. Every rank must call it; all raise the same
    CheckpointError on a bad checkpoint."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    path = _agree("finding the checkpoint", Path(directory), lambda: resolve(directory, tag))
    if path is None:
        return None
    manifest = _agree("verifying", path, lambda: verify(path, share=(rank, world_size)))
    if optimizer is not None and not manifest.has_optimizer:
        raise CheckpointError(f"{path} holds the model alone (saved without an optimizer); load it "
                              "with optimizer=None, or resume from a checkpoint saved with the optimizer")
    state = _state(model, optimizer)
    try:
        dcp.load(state, storage_reader=SafeReader(path), planner=SafeLoadPlanner())
    except CheckpointException as error:
        failures = _dcp_failures(error)
        raise CheckpointError(f"{path}: DCP failed to load it into this model and optimizer (a "
                              f"different model or optimizer type, or a forged entry): {failures}") from error
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        if not manifest.optimizer_initialized:
            optimizer.state.clear()  # see [Note: optimizer state before the first step]
    rank_file = path / f"rank{rank}.json"
    rank_state = None
    if rank_file.name in manifest.files:
        rank_state = json.loads(rank_file.read_text(encoding="utf-8"))
    return Loaded(path, manifest.engine, rank_state, manifest.world_size)
