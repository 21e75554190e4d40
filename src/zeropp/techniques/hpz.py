"""hpZ: the secondary weight partition inside each node (ZeRO++ section 3.2).

FSDP2 keeps, after a unit's forward, its weights sharded over the unit's post-forward mesh;
``zeropp.enable`` sets that mesh to hpZ's node partition (one mesh for every unit, [Note: one
node mesh] in ``zeropp.setup.topology``), so the backward all-gather runs over ``hpZ size`` ranks of
one node and never crosses a node boundary. This module holds what zeropp adds: the size
check, the hooks that keep the secondary copy from ever being stale, its reuse across the
``no_grad`` forwards of generation (``generation_mode``), the copy kept as qwZ's codes
(``CodedSecondaryCopy``), and its memory accounting. On a 2-D mesh, where FSDP2 keeps no copy,
zeropp keeps its own (``zeropp.techniques.hpz_mesh``).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from zeropp.codes.codec import ChunkCodec
from zeropp.fsdp.access import (
    CommGroup,
    comm_groups,
    fsdp_units,
    in_backward,
    post_forward_meshes,
    register_primary_shards,
    register_whole_parameters,
    release_secondary_shards,
    secondary_bytes_held,
    secondary_released,
    secondary_shard_rank,
    set_post_forward_meshes,
    shard_versions,
    then_after_forward,
    unit_layout,
    unsharded_bytes_held,
)
from zeropp.fsdp.after_step import on_step
from zeropp.setup.topology import Topology
from zeropp.techniques.deltas import weight_deltas_of

GENERATION_COPIES = ("node", "full")
"""What ``generation_mode`` keeps between forwards: hpZ's secondary partition inside the node
(parameters x bytes / hpZ size per rank), or every unit whole (parameters x bytes per rank)."""


def check_hpz(hpz_partition_size: int, topology: Topology, key: str = "hpz_partition_size") -> None:
    """hpZ's secondary partition must stay inside a node: its size must divide ranks per node
    (and so the world size). ``key``: what the user called the size (``ZeroPPConfig.key_of``)."""
    if topology.ranks_per_node % hpz_partition_size != 0:
        divisors = [d for d in range(1, topology.ranks_per_node + 1) if topology.ranks_per_node % d == 0]
        raise ValueError(
            f"{key}={hpz_partition_size} must divide the ranks per node "
            f"({topology.ranks_per_node}, layout {topology.num_nodes} nodes x "
            f"{topology.ranks_per_node}) so that the secondary partition stays inside a node; "
            f"allowed: {divisors} (1 = off, {topology.ranks_per_node} = the whole node)")


class SecondaryCopies:
    """hpZ's secondary copies of one sharded model: when they are dropped, and when generation
    reuses them. See [Note: hpZ secondary copies are never stale] and [Note: generation mode]."""

    def __init__(self, model: nn.Module) -> None:
        self.units = list(fsdp_units(model))
        self.groups = list(comm_groups(model))
        self.generating = 0
        """Open ``generation_mode`` contexts on this model."""
        self.copy = "node"
        """What the open contexts keep (``GENERATION_COPIES``)."""
        self._meshes: list = []
        """Each unit's post-forward mesh (hpZ's node groups), read when ``copy="full"`` clears them."""
        self._whole = False
        self._versions: tuple[int, ...] | None = None
        """The primary shards' version counters when the copies were last filled by a ``no_grad``
        forward in generation mode; None when no copy may be reused."""

    def before_forward(self) -> None:
        generating = self.generating and not torch.is_grad_enabled()
        if generating and self._reusable():
            if self._whole:
                for group in self.groups:
                    register_whole_parameters(group)
        else:
            self.drop()
        self._keep_whole(generating and self.copy == "full")

    def _keep_whole(self, whole: bool) -> None:
        """Let the next forward leave its units whole (``copy="full"``), or reshard them to hpZ's
        node groups again."""
        if whole != self._whole:
            if whole:
                self._meshes = post_forward_meshes(self.units)
            set_post_forward_meshes(self.units, None if whole else self._meshes)
            self._whole = whole

    def after_forward(self) -> None:
        for group in self.groups:
            register_primary_shards(group, whole=self._whole)
        if torch.is_grad_enabled():
            self._versions = None
        elif self.generating:
            self._versions = shard_versions(self.units)
        else:
            self.drop()

    def _reusable(self) -> bool:
        return self._versions is not None and self._versions == shard_versions(self.units)

    def forget(self) -> None:
        """The weights changed where the version counters may not show it (an optimizer step):
        the next ``no_grad`` forward fills the copies again."""
        self._versions = None

    def drop(self) -> None:
        drop_secondary_copies(self.units)
        self._versions = None

    def close(self) -> None:
        """The last ``generation_mode`` context has ended: back to hpZ, nothing held."""
        self._keep_whole(False)
        self.drop()


_COPIES: weakref.WeakKeyDictionary[nn.Module, SecondaryCopies] = weakref.WeakKeyDictionary()


class CodedSecondaryCopy:
    """One unit's secondary copy held as the qwZ codes it is decoded from.

    [Note: hpZ's copy as qwZ's codes]
    With qwZ the weights a unit's forward computes with are ``dequantize(quantize(shard))`` of
    every rank's shard, decoded from the payload rows the forward gather received, and hpZ's
    secondary copy is a slice of exactly those values: rank i of an hpZ group of h (of a unit
    sharded over S ranks) keeps 1/h of every parameter, which is the S/h world chunks
    i*S/h .. (i+1)*S/h - 1. So it keeps those S/h payload rows instead (codes and block
    scales; the parameters qwZ leaves unquantized ride in them in their own dtype): about half
    the bytes of a bf16 copy and a quarter of an fp32 one at 8 bits, and lossless, since
    decoding them again gives the same bits. The rows are kept regrouped parameter by
    parameter (``ChunkCodec.regroup_payload``), as FSDP2 lays out the unit's chunk over h ranks
    (each parameter's 1/h slice whole), so the backward's gather inside the node sends them
    and decodes what it receives straight into FSDP2's output (``ChunkCodec.regrouped``):
    half the bytes of a full-precision bf16 gather, the decode the forward's gather does, and
    weights bit-identical to the forward's.

    FSDP2 still makes its copy when it reshards after forward (a clone of this rank's slice of
    the gathered weights, one unit at a time); right after, the rows the forward gather
    received are kept and FSDP2's shards are released (``access.release_secondary_shards``),
    so between forward and backward the unit holds only the rows. The copy goes when FSDP2's
    would: a backward's gather takes it; a forward that gathers from it (generation's reuse, a
    unit called twice) keeps it for the shards it makes again; ``drop_secondary_copies`` drops
    it. A unit whose forward did not gather across the world (it stayed whole) keeps FSDP2's
    copy, and its gather runs as without codes. ``keep_decoded_secondary_copies`` goes back to
    FSDP2's decoded copy (the comparison tests make).
    """

    def __init__(self, unit: FSDPModule, group_size: int, partition_size: int, row_bytes: int) -> None:
        self.unit = unit
        self.group_size, self.partition_size = group_size, partition_size
        """Ranks the unit is sharded over (S), and in its hpZ group (h)."""
        self.rows_per_copy = group_size // partition_size
        """The S/h payload rows of the forward's gather the copy is made of."""
        self.copy_bytes = self.rows_per_copy * row_bytes
        """Bytes of the copy while held."""
        self._first_row = secondary_shard_rank(unit) * self.rows_per_copy
        self.enabled = True
        """False: keep FSDP2's decoded copy (``keep_decoded_secondary_copies``)."""
        self._arrived: torch.Tensor | None = None
        self._held: torch.Tensor | None = None
        then_after_forward(unit, self._after_forward)

    def received(self, rows: torch.Tensor, codec: ChunkCodec) -> None:
        """The payload rows (S, row bytes, rank order) of ``codec`` a forward gather of the unit
        decoded: keep this rank's secondary rows, regrouped, until FSDP2 reshards the unit."""
        if self.enabled and len(rows) == self.group_size and not in_backward():
            mine = rows[self._first_row:self._first_row + self.rows_per_copy]
            self._arrived = codec.regroup_payload(mine)

    def _after_forward(self) -> None:
        arrived, self._arrived = self._arrived, None
        if arrived is not None and release_secondary_shards(self.unit):
            self._held = arrived

    def take(self, group_size: int) -> torch.Tensor | None:
        """The copy to send (one regrouped payload row) for a gather over ``group_size`` ranks,
        if it is the gather from the secondary copy and the copy is held; a forward's gather
        keeps it for the next copy."""
        if group_size != self.partition_size or group_size == self.group_size:
            return None
        held, self._held = self._held, None
        if held is None and secondary_released(self.unit):
            raise RuntimeError("hpZ: a unit's secondary copy was released and its codes are gone; the gather "
                               "from it would read placeholders")
        if held is not None and not in_backward():
            self._arrived = held
        return held

    def drop(self) -> None:
        self._arrived = self._held = None

    @property
    def held_bytes(self) -> int:
        return 0 if self._held is None else self._held.numel()


_CODE_COPIES: weakref.WeakKeyDictionary[FSDPModule, dict[int, CodedSecondaryCopy]] = weakref.WeakKeyDictionary()
"""Each unit's copies kept as codes, by parameter group (``access.CommGroup``)."""


def _code_copies(units: Iterable[FSDPModule]) -> list[CodedSecondaryCopy]:
    return [copy for unit in units for copy in _CODE_COPIES.get(unit, {}).values()]


def keep_secondary_as_codes(unit: FSDPModule | CommGroup, row_bytes: int | None) -> CodedSecondaryCopy | None:
    """Hold the unit's (or parameter group's) hpZ secondary copy as qwZ's payload rows of
    ``row_bytes`` each ([Note: hpZ's copy as qwZ's codes]); None for one without a secondary
    copy, or with ``row_bytes`` None (its gathers are not qwZ's: FSDP2 keeps its copy)."""
    module, index = (unit.unit, unit.index) if isinstance(unit, CommGroup) else (unit, 0)
    if row_bytes is None or not has_secondary_copy(unit):
        if _CODE_COPIES.get(module, {}).pop(index, None) is not None:
            then_after_forward(unit, None)
        return None
    layout = unit_layout(unit)
    copy = _CODE_COPIES.setdefault(module, {})[index] = CodedSecondaryCopy(
        unit, layout.shard_group_size, layout.post_forward_group_size, row_bytes)
    return copy


def keep_decoded_secondary_copies(model: nn.Module) -> None:
    """From the next forward on, keep hpZ's secondary copies as FSDP2 makes them (the decoded
    weights, in the gather dtype) instead of qwZ's codes: the same training bit for bit, at about
    2x (bf16) or 4x (fp32) the copy's memory and, unless ``quantize_intra_node_weights``, the
    backward gather's bytes. For comparisons."""
    for copy in _code_copies(fsdp_units(model)):
        copy.enabled = False


def keep_secondary_copies_fresh(model: nn.Module) -> None:
    """Install the hooks of [Note: hpZ secondary copies are never stale] on a sharded root."""
    copies = _COPIES[model] = SecondaryCopies(model)
    model.register_forward_pre_hook(lambda *_: copies.before_forward(), prepend=True)
    model.register_forward_hook(lambda *_: copies.after_forward())
    model.register_load_state_dict_pre_hook(lambda *_: copies.drop())
    reference = weakref.ref(model)
    on_step(model, lambda _: _stepped(reference))


def _stepped(reference: weakref.ref[nn.Module]) -> None:
    """An optimizer over the model's parameters stepped: no copy made before may be reused. A
    foreach or fused optimizer (the default on GPUs) bumps no version counter of the DTensors it
    writes, so the versions alone would not tell (``zeropp.techniques.deltas``' [Note: one decision])."""
    model = reference()
    if model is not None and (copies := _COPIES.get(model)) is not None:
        copies.forget()


@contextmanager
def generation_mode(model: nn.Module, copy: str = "node") -> Iterator[None]:
    """[Note: generation mode]
    Generation (RLHF rollouts, evaluation loops) runs one ``no_grad`` forward per token with the
    same weights. Inside this context the first ``no_grad`` forward gathers each unit across
    nodes (INT8 under qwZ) and keeps a copy that later ``no_grad`` forwards gather from:

    - ``copy="node"``: hpZ's secondary copy (the unit's weights sharded over the ranks of one
      node: parameters x bytes / hpZ size per rank, or under qwZ its codes, [Note: hpZ's copy
      as qwZ's codes]); every later forward gathers inside the node;
    - ``copy="full"``: each unit whole (parameters x bytes per rank); later forwards gather
      nothing. Faster where even the node's gather costs (FSDP2 rebuilds the secondary shard
      of every parameter after every forward), for models whose weights fit on a rank.

    The copy is dropped, and the next forward gathers across nodes again, the moment the weights
    can have changed: an optimizer step (its step hook; a foreach or fused one bumps no version
    counter), a load, any in-place edit (each bumps a primary shard's version counter, checked
    before every forward), a training (grad-enabled) forward, which
    runs as hpZ always does; and when the context exits, which frees it. Needs a model sharded
    with hpZ (``hpz_partition_size > 1``): without hpZ FSDP2 keeps no copy to reuse. With
    ``weight_deltas`` every forward gathers from the node copy kept between steps already, with
    nothing sent across nodes until the next step: ``copy="node"`` has nothing to add (and
    ``copy="full"`` is refused: the node copy is what serves the forwards).
    """
    if copy not in GENERATION_COPIES:
        raise ValueError(f"generation_mode copy={copy!r} is not one of {GENERATION_COPIES}")
    copies = _COPIES.get(model)
    if copies is None and weight_deltas_of(model) is not None:
        if copy != "node":
            raise ValueError(f"generation_mode(copy={copy!r}) on a model with weight_deltas: its node copy, kept "
                             "between steps, serves every forward inside the node already; use copy='node'")
        yield  # nothing crosses nodes until the next step
        return
    if copies is None:
        raise ValueError(f"generation_mode needs a model sharded with hpZ (zeropp.shard or zeropp.enable with "
                         f"hpz_partition_size > 1); {type(model).__name__} keeps no secondary copy to reuse")
    if copies.generating and copy != copies.copy:
        raise ValueError(f"generation_mode(copy={copy!r}) inside generation_mode(copy={copies.copy!r}) on the "
                         "same model: nest contexts of one kind")
    copies.generating += 1
    copies.copy = copy
    try:
        yield
    finally:
        copies.generating -= 1
        if not copies.generating:
            copies.close()


def generate_in_generation_mode(model: nn.Module) -> None:
    """Make ``model.generate`` (HF's ``GenerationMixin.generate``, the demo GPT's sampler) run
    inside ``generation_mode(model)``, so sampling reuses the copy without asking; the copy is
    freed when ``generate`` returns. Inside an explicit context it keeps that context's copy.
    ``model.generate.without_generation_mode`` is the original. Safe for any caller: generation
    mode never serves stale weights, and a grad-enabled forward inside it runs as without it."""
    generate = getattr(model, "generate", None)
    if not callable(generate) or hasattr(generate, "without_generation_mode"):
        return

    @functools.wraps(generate)
    def generate_in_mode(*args: Any, **kwargs: Any) -> Any:
        copies = _COPIES[model]
        with generation_mode(model, copy=copies.copy if copies.generating else "node"):
            return generate(*args, **kwargs)

    generate_in_mode.without_generation_mode = generate  # type: ignore[attr-defined]
    model.generate = generate_in_mode


def held_secondary_copy_bytes(model: nn.Module) -> int:
    """Bytes of weights this rank holds beyond its primary shards right now: hpZ's secondary
    copies, and units kept whole by ``generation_mode(copy="full")`` (0 outside a
    forward-backward window and outside ``generation_mode``)."""
    units = list(fsdp_units(model))
    codes = sum(copy.held_bytes for copy in _code_copies(units))
    return secondary_bytes_held(units) + codes + unsharded_bytes_held(units)


def drop_secondary_copies(units: Sequence[FSDPModule]) -> None:
    """[Note: hpZ secondary copies are never stale]
    FSDP2 keeps a unit's post-forward (secondary) shards until its backward. A forward that has
    no backward (``no_grad`` evaluation, a forward whose loss is dropped) would leave them in
    place, and the next forward would gather weights from them even after an optimizer step or
    ``load_state_dict`` changed the primary shards. So every root forward starts from the
    primary shards, and a ``no_grad`` root forward drops its copies at once (no backward will
    use them). Resharding is idempotent and costs nothing when no copy is left.

    Between a forward and its backward FSDP2 registers the secondary shards as the module's
    parameters. A state dict taken then would hold secondary-mesh shards; a load
    (``load_state_dict``, DCP's ``set_model_state_dict``, a checkpoint load) would fail on the
    mesh mismatch or write into a copy the next forward discards (and FSDP2's post-load hook
    would adopt the secondary shard as the primary); an in-place edit would be lost. So after a
    grad-enabled root forward the primary shards are registered again (``access.
    register_primary_shards``): everything that reads or writes parameters sees the primary
    shards, the pending backward still gathers from the secondary data FSDP2 keeps, and the next
    forward gathers whatever was loaded."""
    for unit in units:
        unit.reshard()
    for copy in _code_copies(units):
        copy.drop()


def has_secondary_copy(unit: FSDPModule | CommGroup) -> bool:
    """Whether the unit keeps a secondary copy after forward (it was sharded with hpZ)."""
    layout = unit_layout(unit)
    return layout.post_forward_group_size < layout.shard_group_size


def generation_copy_bytes(model: nn.Module, copy: str = "node") -> int:
    """Bytes ``generation_mode(model, copy)`` holds per rank between forwards: hpZ's secondary
    copy (``secondary_copy_bytes``), or every unit's parameters whole in their gather dtype."""
    if copy == "node":
        return secondary_copy_bytes(model)
    return sum(shape.numel() * dtype.itemsize for group in comm_groups(model)
               for shape, dtype in zip(unit_layout(group).shapes, unit_layout(group).gather_dtypes))


def secondary_copy_bytes(model: nn.Module) -> int:
    """Bytes of hpZ's secondary copy on this rank, held between a unit's forward and its
    backward: each unit's parameters (in the gather dtype) split over its hpZ group, or, for a
    unit whose copy is kept as qwZ's codes, its payload rows ([Note: hpZ's copy as qwZ's
    codes]). 0 without hpZ."""
    total = 0
    for group in comm_groups(model):
        layout = unit_layout(group)
        if layout.post_forward_group_size == layout.shard_group_size:
            continue
        if (copy := _CODE_COPIES.get(group.unit, {}).get(group.index)) is not None and copy.enabled:
            total += copy.copy_bytes
            continue
        total += sum(numel // layout.post_forward_group_size * dtype.itemsize
                     for numel, dtype in zip(layout.padded_numels, layout.gather_dtypes))
    return total
