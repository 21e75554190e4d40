"""How a mode lays its ranks out beside its ``ZeroPPConfig``: sharded over the whole world (1-D),
tensor parallel inside each node with FSDP over the data-parallel ranks across (torchtitan's 2-D
mesh), or FSDP2's hybrid sharding (HSDP: sharded inside a node, replicated across nodes); and what
follows from that for the cost model: the shapes one tensor parallel rank holds, the shard group
as placed on nodes, and the link class of each group.

[Note: 2-D layouts in the plan]
With ``W`` = N nodes x D ranks and tensor parallel degree t (dividing D), a unit's data-parallel
group holds the W / t ranks of one tensor parallel index, D / t of them on each node (the mesh
(dp_shard, tp) built data parallel first, as ``zeropp.setup.topology``'s [Note: shard groups on nodes]
requires). FSDP2 shards one tensor parallel rank's parameters over that group, so a rank holds
1/t of the parameters, in shards over W / t ranks: every gather and reduce-scatter runs on the
group and crosses nodes whenever N > 1 (all of it when t = D: one rank per node). qwZ
quantizes those gathers, in one ring (its two-hop gather needs the whole world); qgZ's two hops
follow the group's placement (D / t ranks inside the node, then N nodes; one quantized all-to-all
across nodes when t = D); hpZ is refused (FSDP2 cannot reshard DTensor parameters to a smaller
mesh, DESIGN's 2-D meshes).

HSDP shards each unit over the D / t data-parallel ranks of one node and keeps one replica per
node: gathers and reduce-scatter stay inside the node (qgZ is its first hop only; qwZ sends them
in full precision unless ``quantize_intra_node_weights``), and the reduced shard is reduced
across the N replicas: FSDP2's all-reduce in the reduce dtype, or with
``quantized_replica_gradients`` the replicas' all-to-all and all-gather in ``grad_bits_inter``
bits (``zeropp.techniques.replicas``' [Note: the replicas' reduction]).

[Note: tensor parallel in the plan]
The plan splits every block the usual Megatron way (Shoeybi et al. 2019, section 3) as far as
shapes tell: a matrix whose dim 0 is the model width and dim 1 wider (the MLP's down projection)
is row parallel, split along dim 1; every other matrix of a block is column parallel, split along
dim 0 (queries, keys, values, the MLP's up and gate projections; and the square attention output
projection, row parallel in Megatron: the same elements, and the same FSDP2 padding wherever the
width is a multiple of t x the data-parallel size). A block's 1-D parameters of the model's width
(norms, the row parallel layers' biases) stay whole on every tensor parallel rank; other 1-D ones
(the column parallel layers' biases) are split. Outside the blocks, matrices with a row per
vocabulary entry (the embedding, the head) are split by vocabulary (Megatron's vocab parallel
embedding, output layer and cross entropy); the rest (position embeddings, the final norm) stay
whole. No sequence parallelism. A split that does not divide gives rank 0 the larger part
(``torch.chunk``). The demo GPT's ``tp_*`` modes split only its MLPs (``zeropp.tools.modes``): the
plan prices the layout a large model would use, not that demo.

Each tensor parallel group trains on the same sequences, so with the global batch the same in
every mode it trains t x ``Workload.batch_per_rank`` of them: its ranks compute the same FLOPs as a
1-D rank (each matrix product split t ways over t times the tokens), and hold activations for t
times the sequences, of which the split layers keep 1/t (``ModelShape.block_activation_bytes``).
Its own collectives are all-reduces inside the node (``traffic.tensor_parallel_transfers``).

[Note: expert parallel in the plan]
torchtitan's expert parallel of degree e (dividing the world) on W = N x D ranks, FSDP over
the whole world: the EP groups are e consecutive ranks (inside a node when e divides D), each
holding E / e of a layer's E routed experts; FSDP2 shards those over the W / e ranks of one EP
index (``dp_shard_mod_ep``: D / e ranks on each of the N nodes when e divides D, else one rank on
each of W / e nodes), and the rest of each block over the world, as two parameter groups of
one unit, each with its own gather and reduce-scatter (``Layout.parts``; on dim 1 where the
group outnumbers a rank's experts, as torchtitan's ``shard_placement_fn`` does). Each MoE layer sends
every token's top-k routed copies to the ranks holding their experts and the outputs back:
two all-to-alls over the EP group forward and two backward (two more with activation
checkpointing), in the gather dtype, routing taken as uniform (``traffic.expert_parallel_transfers``);
they run between the layer's products, in its compute's time, as tensor parallel's all-reduces
do. Not priced with tensor parallel, HSDP or hpZ (hpZ's copy of the experts needs several of
their group's ranks on a node; zeropp refuses it where a node holds one), nor the token
buffers' memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from zeropp.config import ZeroPPConfig
from zeropp.fsdp.ledger import GroupKind
from zeropp.setup.topology import Topology
from zeropp.tools.plan.model import ModelShape, UnitShape


@dataclass(frozen=True, kw_only=True)
class Layout:
    """How a mode's ranks are laid out beside its ``ZeroPPConfig`` ([Note: 2-D layouts in the
    plan]); the default is zeropp's 1-D sharding over the whole world."""

    tensor_parallel: int = 1
    """Tensor parallel degree t inside each node, dividing the ranks per node ([Note: tensor
    parallel in the plan]); FSDP shards each unit over the W / t ranks of one tensor parallel
    index. 1: none."""
    hsdp: bool = False
    """FSDP2's hybrid sharding: each unit sharded over its data-parallel ranks on one node,
    replicated across the nodes, the reduced gradient shards reduced across the replicas."""
    expert_parallel: int = 1
    """Expert parallel degree e: the routed experts sharded over their own mesh ([Note: expert
    parallel in the plan]). 1: none."""

    def __post_init__(self) -> None:
        for name in ("tensor_parallel", "expert_parallel"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Layout.{name} must be a positive int, got {value!r}")
        if self.expert_parallel > 1 and (self.tensor_parallel > 1 or self.hsdp):
            raise ValueError(f"Layout.expert_parallel={self.expert_parallel} is priced over FSDP on the whole world "
                             f"only, not with tensor_parallel={self.tensor_parallel} or hsdp={self.hsdp}")

    @property
    def is_one_dimensional(self) -> bool:
        """Every unit sharded over the whole world (no tensor parallel, no replicas, no experts' mesh)."""
        return self.tensor_parallel == 1 and not self.hsdp and self.expert_parallel == 1

    def expert_group(self, topology: Topology) -> Topology:
        """The ranks the routed experts are sharded over, as placed on nodes ([Note: expert
        parallel in the plan])."""
        e, world, per_node = self.expert_parallel, topology.world_size, topology.ranks_per_node
        if world % e:
            raise ValueError(f"Layout.expert_parallel={e} must divide the {world} ranks")
        if per_node % e == 0:
            return Topology(num_nodes=topology.num_nodes, ranks_per_node=per_node // e)
        if e % per_node == 0:
            return Topology(num_nodes=world // e, ranks_per_node=1)
        raise ValueError(f"Layout.expert_parallel={e} must divide the {per_node} ranks per node or be a multiple "
                         "of them")

    def parts(self, unit: UnitShape, topology: Topology) -> list[tuple[UnitShape, Topology]]:
        """``unit`` as the parameter groups FSDP2 keeps for it, each with the ranks it is sharded
        over: the unit itself, or under expert parallel its experts (E / e of them, on
        ``expert_group``) apart from the rest (on the world)."""
        shard = self.shard_group(topology)
        if self.expert_parallel == 1 or not any(unit.experts):
            return [(unit, shard)]
        rest = [i for i, expert in enumerate(unit.experts) if not expert]
        experts = [i for i, expert in enumerate(unit.experts) if expert]
        for i in experts:
            if unit.shapes[i][0] % self.expert_parallel:
                raise ValueError(f"Layout.expert_parallel={self.expert_parallel} must divide the "
                                 f"{unit.shapes[i][0]} experts of {unit.name}")
        group = self.expert_group(topology)
        local = [(unit.shapes[i][0] // self.expert_parallel, *unit.shapes[i][1:]) for i in experts]
        # torchtitan shards the experts on dim 1 where its group outnumbers them (no padded dim 0):
        # the same elements, padded along dim 1, written here with that dim first
        local = [(s[1], s[0], *s[2:]) if group.world_size > s[0] and len(s) > 1 else s for s in local]
        dense = replace(unit, shapes=tuple(unit.shapes[i] for i in rest),
                        trainable=tuple(unit.trainable[i] for i in rest), experts=())
        routed = UnitShape(f"{unit.name} experts", tuple(tuple(s) for s in local),
                           tuple(unit.trainable[i] for i in experts), is_block=False,
                           experts=(True,) * len(experts))
        return [(dense, shard), (routed, group)]

    def part_index(self, rank: int, topology: Topology, part: UnitShape) -> int:
        """``rank``'s index in ``part``'s shard group (``parts``)."""
        if any(part.experts) and self.expert_parallel > 1:
            return rank // self.expert_parallel
        return self.shard_index(rank, topology)

    def shard_group(self, topology: Topology) -> Topology:
        """The ranks a unit is sharded over (its gathers' and reduce-scatter's group), as placed
        on nodes: D / t ranks on each of the N nodes, or on one node under HSDP."""
        per_node, rest = divmod(topology.ranks_per_node, self.tensor_parallel)
        if rest:
            raise ValueError(f"Layout.tensor_parallel={self.tensor_parallel} must divide the "
                             f"{topology.ranks_per_node} ranks per node")
        return Topology(num_nodes=1 if self.hsdp else topology.num_nodes, ranks_per_node=per_node)

    def num_replicas(self, topology: Topology) -> int:
        """Copies of each shard group across nodes: one per node under HSDP, else 1."""
        return topology.num_nodes if self.hsdp else 1

    def shard_index(self, rank: int, topology: Topology) -> int:
        """``rank``'s index in its shard group (ranks numbered node by node, the tensor parallel
        index fastest)."""
        return rank // self.tensor_parallel % self.shard_group(topology).world_size

    def local_units(self, model: ModelShape) -> tuple[UnitShape, ...]:
        """``model``'s units as one tensor parallel rank holds them, before FSDP2 shards them."""
        if self.tensor_parallel == 1:
            return model.units
        return tuple(tensor_parallel_unit(unit, model, self.tensor_parallel) for unit in model.units)


def tensor_parallel_unit(unit: UnitShape, model: ModelShape, degree: int) -> UnitShape:
    """``unit``'s parameters on one rank of a tensor parallel group of ``degree`` ranks ([Note:
    tensor parallel in the plan])."""
    return replace(unit, shapes=tuple(_split(shape, unit.is_block, model, degree) for shape in unit.shapes))


def _split(shape: tuple[int, ...], in_block: bool, model: ModelShape, degree: int) -> tuple[int, ...]:
    width = model.embed_dim
    if in_block and len(shape) == 2 and shape[0] == width and shape[1] > width:
        return shape[0], math.ceil(shape[1] / degree)  # row parallel
    if in_block and (len(shape) >= 2 or shape[0] != width) or not in_block and shape[0] == model.vocab_size:
        return math.ceil(shape[0] / degree), *shape[1:]  # column parallel, vocab parallel
    return shape


def layout_for(config: ZeroPPConfig | None, layout: Layout | None = None) -> Layout:
    """``layout``, or the one ``config`` implies: HSDP for ``None`` (FSDP2's own hybrid sharding,
    the plan's convention) and for ``quantized_replica_gradients`` (which only HSDP has), else
    1-D. A ``ValueError`` for what the layout cannot run: hpZ or offload on a 2-D layout, the
    replicas' reduction without replicas."""
    if layout is None:
        return Layout(hsdp=config is None or config.quantized_replica_gradients)
    if config is None or layout.is_one_dimensional and not config.quantized_replica_gradients:
        return layout
    if config.hpz_partition_size > 1 and layout.expert_parallel > 1:
        raise ValueError(f"hpz_partition_size={config.hpz_partition_size} with expert parallel is not priced "
                         "(the experts' copy needs several of their group's ranks on a node): set hpz_partition_size=1")
    if config.hpz_partition_size > 1 and not layout.is_one_dimensional:
        raise ValueError(f"hpz_partition_size={config.hpz_partition_size} needs every unit sharded over the whole "
                         f"world; {layout} shards them over a sub-mesh: set hpz_partition_size=1")
    if config.offload != "none" and not layout.is_one_dimensional:
        raise ValueError(f"offload={config.offload!r} is priced on a 1-D layout only, not {layout}: set offload='none'")
    if config.quantized_replica_gradients and not layout.hsdp:
        raise ValueError(f"quantized_replica_gradients=True reduces across HSDP's replicas; {layout} has none: "
                         "use Layout(hsdp=True) or leave the option off")
    return layout


def group_kind(topology: Topology, num_nodes: int, ranks_per_node: int) -> GroupKind:
    """The ledger's link class (``zeropp.fsdp.ledger.group_kind``) of a group of ``ranks_per_node`` ranks
    on each of ``num_nodes`` nodes of ``topology``."""
    if num_nodes * ranks_per_node == topology.world_size:
        return GroupKind.WORLD
    if num_nodes == 1:
        return GroupKind.INTRA
    if ranks_per_node == 1:
        return GroupKind.INTER
    return GroupKind.MIXED
