"""Where ranks live: nodes x ranks per node, and the process groups that follow from it.

zeropp assumes torchrun's layout: global rank = node * ranks_per_node + local rank, so the
ranks of one node are contiguous. Everything hierarchical (hpZ's intra-node gather, qgZ's two
hops, the ledger's cross-node byte count) is derived from this one description.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

logger = logging.getLogger("zeropp")

RANKS_PER_NODE_ENV = "ZEROPP_RANKS_PER_NODE"


@dataclass(frozen=True)
class Topology:
    """``num_nodes`` nodes of ``ranks_per_node`` ranks each, ranks node-contiguous."""

    num_nodes: int
    """Number of nodes (machines); traffic between them is what ZeRO++ reduces."""
    ranks_per_node: int
    """Ranks on each node; they talk over the fast intra-node link."""

    def __post_init__(self) -> None:
        for name in ("num_nodes", "ranks_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Topology.{name} must be a positive int, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.ranks_per_node

    def node_of(self, rank: int) -> int:
        """The node that global ``rank`` sits on."""
        return rank // self.ranks_per_node

    def local_rank_of(self, rank: int) -> int:
        """The index of global ``rank`` inside its node."""
        return rank % self.ranks_per_node

    def node_ranks(self, node: int) -> list[int]:
        """Global ranks of one node: the members of that node's intra-node group."""
        start = node * self.ranks_per_node
        return list(range(start, start + self.ranks_per_node))

    def peer_ranks(self, local_rank: int) -> list[int]:
        """Global ranks with the same local index on every node: one inter-node group."""
        return [node * self.ranks_per_node + local_rank for node in range(self.num_nodes)]

    @classmethod
    def from_world(cls, world_size: int, ranks_per_node: int) -> Topology:
        """The topology of ``world_size`` ranks, ``ranks_per_node`` to a node."""
        if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be a positive int, got {ranks_per_node!r}")
        if world_size % ranks_per_node != 0:
            raise ValueError(
                f"world size {world_size} is not a multiple of ranks_per_node={ranks_per_node}; "
                f"ranks per node must divide the world size (divisors: {_divisors(world_size)})"
            )
        return cls(num_nodes=world_size // ranks_per_node, ranks_per_node=ranks_per_node)

    @classmethod
    def from_env(cls, ranks_per_node: int | None = None, world_size: int | None = None) -> Topology:
        """Read the layout the launcher set up.

        Ranks per node: the argument, else ``ZEROPP_RANKS_PER_NODE`` (lets one machine declare
        "2 nodes x 2"), else torchrun's ``LOCAL_WORLD_SIZE``, else the whole world on one node.
        World size: the argument, else the initialised process group, else ``WORLD_SIZE``.
        """
        if world_size is None:
            world_size = dist.get_world_size() if dist.is_initialized() else _int_env("WORLD_SIZE", 1)
        if ranks_per_node is None:
            for name in (RANKS_PER_NODE_ENV, "LOCAL_WORLD_SIZE"):
                if os.environ.get(name):
                    ranks_per_node = _int_env(name, 0)
                    break
            else:
                ranks_per_node = world_size
        return cls.from_world(world_size, ranks_per_node)


def _int_env(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} must be an integer") from None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_hosts(topology: Topology, hostnames: Sequence[str]) -> None:
    """Check the claimed layout against the hosts the ranks really run on.

    A claimed node spread over several hosts is an error: its "intra-node" traffic would cross
    machines. Several claimed nodes on one host is allowed (an emulated cluster) and logged.
    """
    if len(hostnames) != topology.world_size:
        raise ValueError(f"got {len(hostnames)} hostnames for a world of {topology.world_size} ranks")
    host_of_node: dict[int, str] = {}
    for rank, host in enumerate(hostnames):
        node = topology.node_of(rank)
        if host_of_node.setdefault(node, host) != host:
            raise ValueError(
                f"claimed node {node} (ranks {topology.node_ranks(node)}) spans hosts "
                f"{sorted({hostnames[r] for r in topology.node_ranks(node)})}; with "
                f"ranks_per_node={topology.ranks_per_node} each node's ranks must share one host. "
                f"Set {RANKS_PER_NODE_ENV} (or LOCAL_WORLD_SIZE) to the real number of ranks per host"
            )
    if len(set(host_of_node.values())) < topology.num_nodes:
        logger.info(
            "zeropp: %d claimed nodes run on %d host(s): an emulated multi-node layout",
            topology.num_nodes,
            len(set(host_of_node.values())),
        )


def check_world_size(topology: Topology) -> None:
    """The topology has as many ranks as the initialised process group."""
    if dist.get_world_size() != topology.world_size:
        raise ValueError(
            f"topology {topology.num_nodes} nodes x {topology.ranks_per_node} ranks = "
            f"{topology.world_size} ranks, but the process group has {dist.get_world_size()}"
        )


@dataclass(frozen=True)
class ShardGroups:
    """A unit's shard group (the ranks its reduce-scatter runs over) as placed on nodes: qgZ's
    two hops run inside it. The whole world for a 1-D mesh; the data-parallel sub-mesh of a
    tensor parallel x FSDP mesh, or the shard group of HSDP, for a 2-D one ([Note: shard groups
    on nodes])."""

    placement: Topology
    """The group's ranks, in group order: ``num_nodes`` nodes of ``ranks_per_node`` each."""
    ranks: tuple[int, ...]
    """The global ranks of the group, in group order."""
    intra_node_group: dist.ProcessGroup | None
    """The group's ranks on this rank's node; None with one per node."""
    inter_node_group: dist.ProcessGroup | None
    """The group's ranks with this rank's index on every node it spans; None on one node."""


@dataclass(frozen=True)
class ProcessGroups:
    """The groups one rank needs, built once and passed explicitly to whatever communicates."""

    topology: Topology
    mesh: DeviceMesh
    """1-D mesh over the world: FSDP2's shard group."""
    intra_node_group: dist.ProcessGroup
    """This rank's node (size ranks_per_node)."""
    inter_node_group: dist.ProcessGroup
    """Ranks with this rank's local index on every node (size num_nodes)."""
    hpz_mesh: DeviceMesh | None = None
    """hpZ's 2-D (replicas x partition) mesh, shared by every unit of a model: each row is one
    secondary partition inside a node; None without hpZ. See [Note: one node mesh]."""
    _shard_groups: dict[tuple[tuple[int, ...], ...], ShardGroups] = field(default_factory=dict, repr=False)

    def shard_groups(self, layout: Sequence[Sequence[int]] | None = None) -> ShardGroups:
        """This rank's shard group placed on nodes, among the groups of ``layout`` (every shard
        group of a mesh, each its global ranks in group order; None: the world), built once per
        layout. Every rank must call it with the same layouts in the same order (it may create
        groups: ``new_group`` is collective over the world)."""
        world = tuple(range(self.topology.world_size))
        layout = (world,) if layout is None else tuple(tuple(ranks) for ranks in layout)
        if layout not in self._shard_groups:
            if layout == (world,):
                self._shard_groups[layout] = ShardGroups(self.topology, world, self.intra_node_group,
                                                         self.inter_node_group)
            else:
                self._shard_groups[layout] = build_shard_groups(self.topology, layout)
        return self._shard_groups[layout]


def build_process_groups(topology: Topology, device_type: str = "cpu", hpz_partition_size: int = 1) -> ProcessGroups:
    """Create the world mesh, this rank's intra- and inter-node groups and, with hpZ
    (``hpz_partition_size > 1``), hpZ's node mesh.

    Every rank must call this in the same order (``new_group`` is collective over the world).
    """
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call dist.init_process_group first")
    check_world_size(topology)
    rank = dist.get_rank()
    mesh = init_device_mesh(device_type, (topology.world_size,))
    intra = _new_groups([topology.node_ranks(n) for n in range(topology.num_nodes)], rank)
    inter = _new_groups([topology.peer_ranks(d) for d in range(topology.ranks_per_node)], rank)
    hpz_mesh = _hpz_mesh(topology, hpz_partition_size, intra, inter, device_type)
    return ProcessGroups(topology, mesh, intra, inter, hpz_mesh)


def _hpz_mesh(topology: Topology, hpz_partition_size: int, intra: dist.ProcessGroup, inter: dist.ProcessGroup,
              device_type: str) -> DeviceMesh | None:
    """[Note: one node mesh]
    hpZ keeps each unit's weights sharded over ``hpz_partition_size`` ranks of a node between
    forward and backward. FSDP2 builds that post-forward mesh itself when a unit is sharded with
    an int ``reshard_after_forward``: a new DeviceMesh, and so two new process groups (W / hpZ +
    hpZ ``new_group`` calls), for every unit; a 32-layer model on NCCL would hold 64 extra
    communicators. zeropp shards with ``reshard_after_forward=True`` and gives every unit this
    one mesh instead (``access.set_post_forward_mesh``): rows are the partitions, columns the
    ranks holding the same slice. When the partition is the whole node it is made of the groups
    zeropp already has (rows: the intra-node groups, columns: the inter-node groups), so hpZ adds
    no process group at all; a partition smaller than the node takes one 2-D mesh per model.
    A partition of the whole world (one node) is the primary shard itself: there is no
    secondary copy to keep, so hpZ is plain ZeRO-3 there and no mesh is set (a post-forward
    mesh of the world would make FSDP2 hold a second, compute-dtype shard after forward)."""
    world_size = topology.world_size
    if hpz_partition_size in (1, world_size):
        return None
    if hpz_partition_size == topology.ranks_per_node:
        layout = torch.arange(world_size).view(topology.num_nodes, topology.ranks_per_node)
        return DeviceMesh.from_group([inter, intra], device_type, mesh=layout,
                                     mesh_dim_names=("hpz_replica", "hpz_partition"))
    return init_device_mesh(device_type, (world_size // hpz_partition_size, hpz_partition_size),
                            mesh_dim_names=("hpz_replica", "hpz_partition"))


def place_on_nodes(world: Topology, ranks: Sequence[int]) -> Topology:
    """[Note: shard groups on nodes]
    qgZ's two hops need a group laid out as the world is: N nodes of the same number D' of its
    ranks. A group's ranks are in ascending global order (``new_group`` sorts them), so they
    fill its nodes one after the other; what is left to check is the count per node. A tensor
    parallel x FSDP mesh (``init_device_mesh(.., ("dp_shard", "tp"))``, as torchtitan builds it)
    gives that: with TP degree t dividing the node's D ranks, the data-parallel group holds D / t
    ranks of each node (one per node when TP fills it: qgZ is then one quantized all-to-all
    across nodes). HSDP's shard group inside a node is one node of D ranks (hop 1 only). A group
    with more ranks on some nodes than others is refused, with its layout."""
    nodes = [world.node_of(rank) for rank in ranks]
    spanned = list(dict.fromkeys(nodes))
    per_node = len(ranks) // len(spanned)
    if nodes != [node for node in spanned for _ in range(per_node)] or len(set(ranks)) != len(ranks):
        raise ValueError(
            f"the group of ranks {list(ranks)}, on nodes {nodes} (nodes of {world.ranks_per_node} ranks): qgZ "
            "needs a group to hold the same number of ranks on each node it spans (build the mesh with "
            "init_device_mesh, the data-parallel dimensions first)")
    return Topology(num_nodes=len(spanned), ranks_per_node=per_node)


def build_shard_groups(world: Topology, layout: Sequence[Sequence[int]]) -> ShardGroups:
    """The groups of ``layout`` (every shard group of a mesh, each a list of global ranks) placed
    on nodes, with the intra- and inter-node groups of each; this rank's. Collective: every rank
    creates every group, in the same order."""
    rank = dist.get_rank()
    placements = [place_on_nodes(world, ranks) for ranks in layout]
    intra_lists, inter_lists = [], []
    for ranks, placement in zip(layout, placements):
        rows = [list(ranks[n * placement.ranks_per_node:(n + 1) * placement.ranks_per_node])
                for n in range(placement.num_nodes)]
        if placement.ranks_per_node > 1:
            intra_lists += rows
        if placement.num_nodes > 1:
            inter_lists += [list(column) for column in zip(*rows)]
    intra = _new_groups(intra_lists, rank) if intra_lists else None
    inter = _new_groups(inter_lists, rank) if inter_lists else None
    (mine, placement), = [(ranks, p) for ranks, p in zip(layout, placements) if rank in ranks]
    return ShardGroups(placement, tuple(mine), intra if placement.ranks_per_node > 1 else None,
                       inter if placement.num_nodes > 1 else None)


def _new_groups(rank_lists: list[list[int]], rank: int) -> dist.ProcessGroup:
    """Create every group in ``rank_lists`` (all ranks must) and return the one holding ``rank``."""
    mine = None
    for ranks in rank_lists:
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    assert mine is not None, f"rank {rank} is in none of {rank_lists}"
    return mine


def device_type_of(module: torch.nn.Module) -> str:
    """The device type FSDP should use for ``module`` ("cpu" or "cuda"/...): its parameters'; for a
    model still on the meta device (to be materialised with ``to_empty`` after sharding), the
    machine's accelerator where there is one, else "cpu"."""
    for tensor in module.parameters():
        if tensor.device.type != "meta":
            return tensor.device.type
    if torch.accelerator.is_available():
        return torch.accelerator.current_accelerator().type
    return "cpu"
