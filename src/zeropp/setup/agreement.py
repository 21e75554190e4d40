"""Every rank's view of the set-up, compared before anything is sharded: see [Note: ranks that
disagree].

[Note: ranks that disagree]
zeropp's collectives assume every rank built the same thing: the same ``ZeroPPConfig``, the same
topology, the same parameters in the same units. A config read from a per-host file, an
environment variable set on one node, or a model built with another width on one rank breaks
that, and the first collective that differs aborts inside the backend ("collective mismatch",
a SIGABRT under gloo; a hang or mixed data under NCCL), naming nothing a user can act on. So
``zeropp.shard``, ``zeropp.enable`` (and ``zeropp.initialize`` through them) first compare the
views: each rank sends its host name (the topology check needs it) and a digest of its view in
one small all-gather; only if the digests differ do the ranks exchange the views themselves and
every rank raises the same ``ValueError``, naming the first entry that differs, its value on each
side and the ranks holding each. A view is an ordered list of (entry, value) pairs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import socket
from collections.abc import Sequence

from torch import nn

from zeropp._fsdp import fsdp_units, unit_layout
from zeropp.comms import all_gather_strings
from zeropp.config import ZeroPPConfig
from zeropp.topology import Topology

View = list[tuple[str, str]]
"""One rank's set-up as ordered (entry, value) pairs."""


def config_view(config: ZeroPPConfig, topology: Topology) -> View:
    """The config field by field, and the topology."""
    fields = [(f"ZeroPPConfig.{f.name}", repr(getattr(config, f.name))) for f in dataclasses.fields(config)]
    return [*fields, ("topology", f"{topology.num_nodes} nodes x {topology.ranks_per_node} ranks per node")]


def parameters_view(model: nn.Module) -> View:
    """Each parameter of a model not sharded yet: shape, dtype, trainable."""
    return [(f"parameter {name}", f"shape {tuple(p.shape)}, {p.dtype}, requires_grad={p.requires_grad}")
            for name, p in model.named_parameters()]


def units_view(model: nn.Module) -> View:
    """Each unit of a sharded model and its parameters (unsharded shape, dtype, trainable)."""
    names = {id(module): name or "the root" for name, module in model.named_modules()}
    view = []
    for unit in fsdp_units(model):
        layout = unit_layout(unit)
        view.append((f"unit {names[id(unit)]}", f"{len(layout.names)} parameters, sharded over "
                     f"{layout.shard_group_size} ranks"))
        view.extend((f"unit {names[id(unit)]} parameter {name}",
                     f"shape {tuple(shape)}, {dtype}, requires_grad={trainable}")
                    for name, shape, dtype, trainable in zip(layout.names, layout.shapes, layout.gather_dtypes,
                                                            layout.trainable))
    return view


def agree(view: View) -> list[str]:
    """Check that every rank holds the same ``view`` (one all-gather of a digest); return every
    rank's host name, in rank order. Raises the same ``ValueError`` on every rank otherwise."""
    text = json.dumps(view)
    digest = hashlib.sha256(text.encode()).hexdigest()
    gathered = [entry.split("\n", 1) for entry in all_gather_strings(f"{digest}\n{socket.gethostname()}")]
    if len({digest for digest, _ in gathered}) > 1:
        views = [[tuple(pair) for pair in json.loads(other)] for other in all_gather_strings(text)]
        raise ValueError(describe_disagreement(views))
    return [host for _, host in gathered]


def describe_disagreement(views: Sequence[View]) -> str:
    """The first entry on which the ranks' views differ, each value and the ranks holding it."""
    as_dicts = [dict(view) for view in views]
    keys = list(dict.fromkeys(key for view in views for key, _ in view))
    for key in keys:
        holders: dict[str, list[int]] = {}
        for rank, entries in enumerate(as_dicts):
            holders.setdefault(entries.get(key, "(absent)"), []).append(rank)
        if len(holders) > 1:
            sides = "; ".join(f"{value} on {_ranks(ranks)}" for value, ranks in holders.items())
            return (f"zeropp: the ranks disagree on {key}: {sides}. Every rank must shard the same model with "
                    "the same ZeroPPConfig and topology (check per-host config files and environment variables "
                    "such as ZEROPP_RANKS_PER_NODE and LOCAL_WORLD_SIZE)")
    return "zeropp: the ranks' views differ, but no entry does (a digest collision)"


def _ranks(ranks: list[int]) -> str:
    """``rank 3`` or ``ranks 0-2, 5``: runs of consecutive ranks written as ranges."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    text = ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)) for run in runs)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"
