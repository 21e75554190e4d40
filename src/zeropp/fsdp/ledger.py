"""Per-collective byte accounting: what every collective zeropp issues moves, by link class.

[Note: what a byte count means]
Every collective is counted twice:

- ``bytes`` / ``cross_node_bytes``, direct sends: a collective on a group of ``g`` ranks in
  which this rank owes ``c`` bytes to each peer (all-gather: its chunk; reduce-scatter /
  all-to-all: the chunk owed to that peer) "sends" ``c * (g - 1)`` bytes, and the part
  addressed to peers on other nodes crosses a node boundary. An all-reduce counts as a
  reduce-scatter plus an all-gather. This is what the collective must move, whatever the
  backend's algorithm: the figure to compare designs with.
- ``backend_bytes`` / ``backend_cross_node_bytes``: what the backend's own algorithm sends
  from this rank, the figure the links carry. For gloo (measured on the emulated cluster, see
  ``zeropp.tools.bench.comm``): all-gather and all-reduce are rings over the group's ranks in order,
  each rank sending ``(g - 1) c`` (all-reduce: twice that) to its successor; reduce-scatter is a
  ring all-reduce of the whole ``g c`` input, ``2 (g - 1) c``; all-to-all sends directly. A
  ring's bytes cross nodes exactly when this rank's successor is on another node. For other
  backends (NCCL picks rings and trees per topology) this equals the direct sends.

The ledger only aggregates (bounded memory however long training runs) and never synchronises
a device, so counting does not destroy overlap.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from zeropp.fsdp.access import in_backward
from zeropp.setup.topology import Topology


class GroupKind(str, Enum):
    """Which link class a process group spans."""

    WORLD = "world"
    INTRA = "intra"
    INTER = "inter"
    MIXED = "mixed"


class Op(str, Enum):
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    ALL_REDUCE = "all_reduce"
    BROADCAST = "broadcast"


def group_kind(topology: Topology, group_ranks: list[int]) -> GroupKind:
    """Classify a group: the whole world, one node, one rank per node, or something else."""
    if len(group_ranks) == topology.world_size:
        return GroupKind.WORLD
    nodes = [topology.node_of(r) for r in group_ranks]
    if len(set(nodes)) == 1:
        return GroupKind.INTRA
    if len(set(nodes)) == len(nodes):
        return GroupKind.INTER
    return GroupKind.MIXED


@dataclass(frozen=True)
class GroupInfo:
    """What the ledger needs to know about one process group, computed once per group."""

    kind: GroupKind
    size: int
    num_remote_peers: int
    """Members of the group on a node other than this rank's."""
    successor_is_remote: bool = False
    """Whether the next rank of the group (in group order, wrapping) is on another node."""
    backend: str = "gloo"

    @classmethod
    def of(cls, topology: Topology, group_ranks: list[int], rank: int, backend: str = "gloo") -> GroupInfo:
        my_node = topology.node_of(rank)
        remote = sum(topology.node_of(r) != my_node for r in group_ranks)
        successor = group_ranks[(group_ranks.index(rank) + 1) % len(group_ranks)]
        return cls(group_kind(topology, group_ranks), len(group_ranks), remote,
                   topology.node_of(successor) != my_node, backend)

    def backend_sends(self, op: Op, bytes_per_peer: int, direct: int, direct_cross: int) -> tuple[int, int]:
        """(bytes, cross-node bytes) the backend's algorithm sends from this rank, given the
        direct-send counts; see [Note: what a byte count means]."""
        if self.backend != "gloo" or op in (Op.ALL_TO_ALL, Op.BROADCAST):
            return direct, direct_cross
        rounds = 1 if op is Op.ALL_GATHER else 2  # reduce-scatter and all-reduce: a ring all-reduce
        sent = rounds * bytes_per_peer * (self.size - 1)
        return sent, sent if self.successor_is_remote else 0


def direct_sends(op: Op, group: GroupInfo, bytes_per_peer: int) -> tuple[int, int]:
    """(bytes, cross-node bytes) a collective sends from this rank, counted as direct sends: see
    [Note: what a byte count means]. ``zeropp.explain`` prices a plan with the same arithmetic."""
    factor = 2 if op is Op.ALL_REDUCE else 1
    return factor * bytes_per_peer * (group.size - 1), factor * bytes_per_peer * group.num_remote_peers


@dataclass(frozen=True)
class _Key:
    op: Op
    kind: GroupKind
    group_size: int
    dtype: str
    phase: str
    technique: str


COUNTS = ("calls", "bytes", "cross_node_bytes", "backend_bytes", "backend_cross_node_bytes")
"""What the ledger counts per row; see [Note: what a byte count means]."""


@dataclass
class _Totals:
    calls: int = 0
    bytes: int = 0
    cross_node_bytes: int = 0
    backend_bytes: int = 0
    backend_cross_node_bytes: int = 0

    def add(self, other: _Totals) -> None:
        for name in COUNTS:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in COUNTS}


def current_phase() -> str:
    """"backward" while autograd runs a backward pass (FSDP's backward gathers), else "forward"."""
    return "backward" if in_backward() else "forward"


class CommLedger:
    """Aggregated byte counts of every collective this process issued since the last reset."""

    def __init__(self) -> None:
        self._totals: dict[_Key, _Totals] = defaultdict(_Totals)
        self.num_steps = 0
        self._suspended = False
        self.ranks = 1
        """How many ranks' records this ledger sums (1: this process's own; see ``combined``)."""

    @contextmanager
    def suspended(self) -> Iterator[None]:
        """Leave out what runs inside (logging, evaluation) from the training step's figures."""
        previous, self._suspended = self._suspended, True
        try:
            yield
        finally:
            self._suspended = previous

    def record(
        self,
        op: Op,
        group: GroupInfo,
        bytes_per_peer: int,
        dtype: torch.dtype,
        technique: str,
        phase: str | None = None,
    ) -> None:
        """Count one collective in which this rank owes ``bytes_per_peer`` to each group peer;
        ``phase``: the phase it belongs to, when not the one running."""
        if self._suspended:
            return
        sent, cross = direct_sends(op, group, bytes_per_peer)
        backend_sent, backend_cross = group.backend_sends(op, bytes_per_peer, sent, cross)
        key = _Key(op, group.kind, group.size, str(dtype).removeprefix("torch."), phase or current_phase(), technique)
        self._totals[key].add(_Totals(1, sent, cross, backend_sent, backend_cross))

    def record_sends(self, op: Op, group: GroupInfo, bytes_to_each: list[int], remote: list[bool], dtype: torch.dtype,
                     technique: str, phase: str | None = None) -> None:
        """Count one collective of uneven splits (an expert-parallel token exchange): this rank
        sends ``bytes_to_each[i]`` to the group's i-th rank, which sits on another node where
        ``remote[i]``. ``phase``: where it runs, when not now (the backward exchange a forward
        implies)."""
        if self._suspended:
            return
        sent = sum(bytes_to_each)
        cross = sum(count for count, far in zip(bytes_to_each, remote) if far)
        key = _Key(op, group.kind, group.size, str(dtype).removeprefix("torch."), phase or current_phase(), technique)
        self._totals[key].add(_Totals(1, sent, cross, sent, cross))

    def step(self) -> None:
        """Mark the end of a training step (for per-step averages in ``table``)."""
        self.num_steps += 1

    def reset(self) -> None:
        self._totals.clear()
        self.num_steps = 0

    def export(self) -> dict[str, Any]:
        """This ledger as JSON-able data (for gathering every rank's at one place)."""
        return {"num_steps": self.num_steps, "rows": self.rows()}

    @classmethod
    def combined(cls, exports: Sequence[dict[str, Any]]) -> CommLedger:
        """One ledger holding the sum of several (``export``) ledgers, e.g. every rank's, so
        that bytes a rank's own view leaves out (the cross-node edges of a ring in which this
        rank only talks to its node neighbour) are counted. Its ``num_steps`` is the ranks'
        (they must agree: every rank marks the same steps)."""
        steps = {export["num_steps"] for export in exports}
        if len(steps) != 1:
            raise ValueError(f"the ledgers marked different numbers of steps {sorted(steps)}; combine ledgers "
                             "of the same steps (one per rank)")
        ledger = cls()
        ledger.num_steps = steps.pop()
        ledger.ranks = len(exports)
        for export in exports:
            for row in export["rows"]:
                key = _Key(Op(row["op"]), GroupKind(row["kind"]), row["group_size"], row["dtype"], row["phase"],
                           row["technique"])
                ledger._totals[key].add(_Totals(*(row[count] for count in COUNTS)))
        return ledger

    def summary(self, **match: str) -> dict[str, Any]:
        """Totals, by op and by group kind; ``match`` filters records (e.g. ``phase="backward"``).

        Returns ``{"total": {...}, "by_op": {op: {...}}, "by_group": {kind: {...}},
        "by_phase": {...}, "by_technique": {...}}``, each inner dict holding the ``COUNTS`` of
        this rank: ``calls``, direct-send ``bytes`` and ``cross_node_bytes``, and the backend's
        ``backend_bytes`` and ``backend_cross_node_bytes``.
        """
        total = _Totals()
        groups: dict[str, dict[str, _Totals]] = {
            name: defaultdict(_Totals) for name in ("by_op", "by_group", "by_phase", "by_technique")
        }
        for key, t in self._totals.items():
            fields = _key_fields(key)
            if any(fields[name] != value for name, value in match.items()):
                continue
            total.add(t)
            for name, field in (("by_op", "op"), ("by_group", "kind"), ("by_phase", "phase"),
                                ("by_technique", "technique")):
                groups[name][fields[field]].add(t)
        out: dict[str, Any] = {"total": total.as_dict()}
        out.update({name: {k: v.as_dict() for k, v in sorted(g.items())} for name, g in groups.items()})
        return out

    def report(self) -> dict[str, dict[str, float]]:
        """Per-step totals per technique (``fsdp``, ``qwZ``, ``hpZ``, ``qgZ``, ...), averaged over
        the steps marked with ``step``."""
        steps = max(self.num_steps, 1)
        return {technique: {name: value / steps for name, value in totals.items()}
                for technique, totals in self.summary()["by_technique"].items()}

    def rows(self) -> list[dict[str, Any]]:
        """One dict per distinct (op, group, dtype, phase, technique), sorted for printing."""
        rows = [{**_key_fields(k), **t.as_dict()} for k, t in self._totals.items()]
        return sorted(rows, key=lambda r: (r["phase"], r["op"], r["kind"], r["technique"]))

    def table(self) -> str:
        """A printable per-step table (totals divided by the steps marked with ``step``)."""
        steps = max(self.num_steps, 1)
        header = f"{'phase':<9}{'op':<15}{'group':<7}{'size':>5} {'dtype':<9}{'technique':<11}" \
                 f"{'calls':>7}{'MB sent':>10}{'MB x-node':>11}{'backend x-node':>15}"
        whose = "this rank" if self.ranks == 1 else f"summed over all {self.ranks} ranks"
        lines = [f"communication per step ({whose}, {steps} step(s) averaged; MB sent and x-node: "
                 "direct sends; backend x-node: what the backend's algorithm sends across nodes)", header]
        t = self.summary()["total"]
        for r in [*self.rows(), {**t, "phase": "total", "op": "", "kind": "", "group_size": "",
                                 "dtype": "", "technique": ""}]:
            lines.append(
                f"{r['phase']:<9}{r['op']:<15}{r['kind']:<7}{r['group_size']:>5} {r['dtype']:<9}"
                f"{r['technique']:<11}{r['calls'] / steps:>7.1f}{r['bytes'] / steps / 1e6:>10.3f}"
                f"{r['cross_node_bytes'] / steps / 1e6:>11.3f}{r['backend_cross_node_bytes'] / steps / 1e6:>15.3f}"
            )
        return "\n".join(lines)


def _key_fields(key: _Key) -> dict[str, Any]:
    return {"op": key.op.value, "kind": key.kind.value, "group_size": key.group_size,
            "dtype": key.dtype, "phase": key.phase, "technique": key.technique}


_LEDGER = CommLedger()


def comm_ledger() -> CommLedger:
    """This process's ledger (one per process; every zeropp comm records into it)."""
    return _LEDGER
