"""qgZ: the gradient reduce-scatter as two quantized all-to-all hops (ZeRO++ section 3.3), an
FSDP2 ``ReduceScatter`` comm, with optional error feedback and lower-error block codes
(``zeropp.codes.gradcode``: rotation, stochastic rounding, normal levels).

Intra-node first (the fast links carry the big exchange), then inter-node with what is left: a
rank sends (N - 1)/N x M/D x bits/8 bytes across nodes where a bf16 ring reduce-scatter sends
(W - 1)/W x M x 2. Between the hops the partial sums are reduced in fp32; then AVG divides by
the world size exactly (DeepSpeed's divides by the number of nodes) and PREMUL_SUM multiplies
by its factor (``comms`` [Note: the reductions FSDP2 asks for]).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from zeropp.codes.bounds import block_constant, coding_bound
from zeropp.codes.codec import ChunkCodec, Segment, segments_for
from zeropp.codes.gradcode import GradientCode
from zeropp.fsdp.comms import LateReduceScatter, Reduction, all_to_all, nbytes, reduce_scatter, reduction_of
from zeropp.fsdp.ledger import CommLedger
from zeropp.setup.topology import ProcessGroups, ShardGroups
from zeropp.techniques.audit import TECHNIQUE as AUDIT_TECHNIQUE
from zeropp.techniques.audit import Auditable, Request, Tally

WIDE_BITS = 8
"""Bits of ``grad_wide_parameters``' gradients on both hops ([Note: wide gradients])."""


def full_precision_gradients(names: Sequence[str], shapes: Sequence[torch.Size], patterns: Sequence[str],
                             below: int) -> list[bool]:
    """Which parameters' gradients qgZ sends unquantized: those whose name (as the model names
    them) matches a pattern, or with fewer than ``below`` elements. See [Note: full-precision
    gradients]."""
    return [shape.numel() < below or any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)
            for name, shape in zip(names, shapes, strict=True)]


def intra_node_send_order(num_nodes: int, ranks_per_node: int) -> torch.Tensor:
    """qgZ's remap: slot d*N + n of the intra-node send buffer holds chunk n*D + d, so local
    rank d receives, from every node peer, the N chunks owed to local index d on every node."""
    return torch.arange(num_nodes * ranks_per_node).view(num_nodes, ranks_per_node).t().reshape(-1)


@dataclass(frozen=True, eq=False)
class _Route:
    """One hop's rows among the group's ``size`` ranks: ``per_peer`` rows owed to each, this rank
    (``me``) keeping its own; with ``remap`` the rows owed to local rank d are rows d, D + d, ...
    ([Note: qgZ remap]), otherwise the ``per_peer`` consecutive rows at d * per_peer."""

    size: int
    me: int
    per_peer: int
    remap: bool
    _split_bytes: dict[int, list[int]] = field(default_factory=dict)

    @property
    def peers(self) -> range:
        return range(self.size)

    def rows_of(self, rows: torch.Tensor, peer: int) -> torch.Tensor:
        """The (per_peer, s) rows of ``rows`` owed to ``peer``: a view, never a copy."""
        if self.remap:
            return rows.view(self.per_peer, self.size, rows.shape[1])[:, peer]
        return rows[peer * self.per_peer:(peer + 1) * self.per_peer]

    def slot(self, peer: int) -> slice:
        """The packed rows to or from ``peer`` in the exchange's buffers, which hold no rows for this rank."""
        index = peer if peer < self.me else peer - 1
        return slice(index * self.per_peer, (index + 1) * self.per_peer)

    def split_bytes(self, row_bytes: int) -> list[int]:
        """The all-to-all's per-peer split for packed rows of ``row_bytes``, built once per size."""
        if row_bytes not in self._split_bytes:
            self._split_bytes[row_bytes] = [0 if peer == self.me else self.per_peer * row_bytes
                                            for peer in self.peers]
        return self._split_bytes[row_bytes]


@dataclass(frozen=True)
class _Exchange:
    """One hop's all-to-all, sent (and perhaps still in flight): what came back is ``received``
    once ``work`` (None when it ran synchronously) is waited for; ``own`` are the rows this rank
    kept (a view of its input), in the order of the route."""

    work: dist.Work | None
    received: torch.Tensor
    own: torch.Tensor
    route: _Route
    codec: ChunkCodec


class HierarchicalQuantizedReduceScatter(Auditable, LateReduceScatter):
    """qgZ: the gradient reduce-scatter as two quantized all-to-all hops, intra-node then
    inter-node, reduced in fp32 between them (ZeRO++ section 3.3). See [Note: qgZ remap].

    [Note: qgZ remap]
    FSDP2 hands over W = N x D chunks of S elements, chunk c owed to global rank c = n*D + d.
    Viewed as (N, D, S), the rows [:, d] are the N chunks owed to the ranks with local index d on
    every node; hop 1 sends them to local rank d, which sums what its node's D ranks sent (the
    partial sums for node n's rank d), and hop 2 sends partial n to node n over the inter-node
    group, where the N partials are summed: each rank ends with its own chunk's total. AVG then
    divides by W exactly, PREMUL_SUM multiplies by its factor. With one node or one rank per
    node, one hop vanishes.

    Each parameter's slice of a chunk is quantized on its own when the chunk is laid out as the
    unit's trainable parameters (the usual case); otherwise (a parameter without a gradient
    this step) the whole chunk is one run of blocks, still quantized with the same bound.

    [Note: qgZ own rows]
    In each hop a rank owes some rows to itself (hop 1: its share of its own gradient; hop 2:
    its own node's partial). Those never travel, so they are not quantized either: they enter
    the sum in fp32. This halves the codec's work on a 2 x 2 layout (1/D of hop 1, 1/N of hop
    2 in general), sends the same bytes to every peer, and only lowers the error (the bound in
    tests/test_qgz.py leaves those terms out). DeepSpeed quantizes every row, its own included.

    [Note: full-precision gradients]
    ``full_precision`` marks parameters whose gradients travel unquantized: their slices are raw
    segments of the same payload (``codec.segments_for``, as qwZ sends its unquantized
    parameters), so both hops still make one all-to-all each, and their sums are exact up to
    fp32 summation. Two reasons to spare a parameter. Per element, INT4 costs most where a block
    holds few elements or a few large ones: a LayerNorm's or a bias's slice of 8 to 64 elements
    has its own blocks, their scale set by one outlier. And a block code puts an error of up to
    half a step on entries whose true sum is zero or tiny (a token absent from every rank's
    batch, a feature no rank used), which Adam's per-coordinate normalisation turns into a
    full-size update; spared parameters see none. Their bytes: fp32 is 7.8x INT4's with fp32
    block scales, so sparing 0.1% of the elements adds 0.7% to the gradient bytes. When a chunk
    is not laid out as the unit's parameters (a parameter got no gradient this step), its
    parameters cannot be told apart, and the whole chunk travels unquantized if any parameter is
    spared: exact, never less precise than asked.

    [Note: wide gradients]
    ``wide`` marks parameters whose gradients are coded at ``WIDE_BITS`` (8) on both hops while the
    others take the hops' bits: their segments of the same payloads carry 8-bit codes, so the
    all-to-alls stay one per hop, and each segment's bound is its own width's. It is for the few
    parameters whose gradients carry the code's error (an embedding whose rows few tokens touch,
    norms, biases) at twice INT4's bytes for them rather than fp32's 7.8x. A chunk not laid out
    as the unit's parameters is coded at 8 bits whole if any parameter is wide.
    """

    technique = "qgZ"

    def __init__(self, groups: ProcessGroups | None, padded_numels: list[int], *, bits_intra: int,
                 bits_inter: int, block_size: int, error_feedback: bool = False,
                 code: GradientCode | None = None, seed: int = 0, full_precision: Sequence[bool] | None = None,
                 wide: Sequence[bool] | None = None, slice_bytes: int | None = None, shard: ShardGroups | None = None,
                 ledger: CommLedger | None = None) -> None:
        super().__init__(groups.topology if groups is not None else shard.placement, ledger)
        self.groups = shard if shard is not None else groups.shard_groups()
        """The unit's shard group on nodes: the world's, or a 2-D mesh's data-parallel group
        ([Note: shard groups on nodes] in ``zeropp.setup.topology``)."""
        self.placement = self.groups.placement
        """The shard group's nodes and ranks per node: what the two hops follow (``topology`` is
        the world's, which classifies each group's links in the ledger)."""
        self.padded_numels = padded_numels
        self.full_precision = list(full_precision) if full_precision is not None else [False] * len(padded_numels)
        """Per parameter of ``padded_numels``: its gradient travels unquantized ([Note: full-precision
        gradients])."""
        if len(self.full_precision) != len(padded_numels):
            raise ValueError(f"full_precision has {len(self.full_precision)} flags for {len(padded_numels)} "
                             "parameters; give one per entry of padded_numels")
        self.wide = list(wide) if wide else [False] * len(padded_numels)
        """Per parameter of ``padded_numels``: its gradient is coded at ``WIDE_BITS`` on both hops
        ([Note: wide gradients])."""
        if len(self.wide) != len(padded_numels):
            raise ValueError(f"wide has {len(self.wide)} flags for {len(padded_numels)} parameters; give one per "
                             "entry of padded_numels")
        self.bits_intra, self.bits_inter, self.block_size = bits_intra, bits_inter, block_size
        self.error_feedback = error_feedback
        self.code = code if code is not None else GradientCode()
        self.seed = seed
        """Seeds stochastic rounding's uniforms, with the rank and hop ([Note: stochastic rounding])."""
        self.slice_bytes = slice_bytes
        """Bound on one slice's fp32 rows (all ranks' rows of its columns); None: one slice
        ([Note: qgZ slices])."""
        self._residuals: dict[int, torch.Tensor] = {}  # hop -> fp32 quantization residual
        self._generators: dict[int, torch.Generator] = {}  # hop -> uniforms of stochastic rounding
        self._codecs: dict[tuple[int, int], ChunkCodec] = {}
        self._slices: dict[int, list[_Slice]] = {}
        self._routes: dict[tuple, _Route] = {}

    def codec(self, chunk_numel: int, bits: int) -> ChunkCodec:
        key = (chunk_numel, bits)
        if key not in self._codecs:
            world_size = self.placement.world_size
            grouped = self.code.grouped_scales
            if sum(self.padded_numels) == chunk_numel * world_size:
                quantized = [not spared for spared in self.full_precision]
                segments = segments_for(self.padded_numels, quantized, world_size, bits, grouped_scales=grouped)
                segments = [dataclasses.replace(segment, bits=max(segment.bits, WIDE_BITS))
                            if wide and segment.bits is not None else segment
                            for segment, wide in zip(segments, self.wide, strict=True)]
            else:  # parameters cannot be told apart ([Note: full-precision gradients], [Note: wide gradients])
                width = max(bits, WIDE_BITS) if any(self.wide) else bits
                segments = segments_for([chunk_numel], [not any(self.full_precision)], 1, width,
                                        grouped_scales=grouped)
            self._codecs[key] = ChunkCodec(segments, self.block_size, torch.float32, self.code)
        return self._codecs[key]

    def widen(self) -> None:
        """Code every parameter's gradients at ``WIDE_BITS`` on both hops from the next call on
        (the audit's per-unit error budget; [Note: wide gradients]). The residuals of error
        feedback are fp32 values, whatever the width, and carry over."""
        self.wide = [True] * len(self.padded_numels)
        self._codecs.clear()
        self._slices.clear()

    def _generator(self, hop: int, device: torch.device) -> torch.Generator | None:
        """Stochastic rounding's generator for a hop: seeded by (seed, global rank, hop), so each
        rank draws its own uniforms and a run with the same seed draws the same ones."""
        if self.code.rounding != "stochastic":
            return None
        if hop not in self._generators:
            rank_seed = (self.seed * 1_000_003 + dist.get_rank()) * 4 + hop
            self._generators[hop] = torch.Generator(device).manual_seed(rank_seed)
        return self._generators[hop]

    @property
    def residual_bytes(self) -> int:
        """Bytes held for error feedback (fp32 residuals of both hops)."""
        return sum(nbytes(r) for r in self._residuals.values())

    def reset_error_feedback(self) -> None:
        """Forget the residuals, e.g. after a loss scaler skipped a step on overflow."""
        self._residuals.clear()

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op: dist.ReduceOp, async_op: bool = False) -> dist.Work | None:
        topology = self.placement
        if group.size() != topology.world_size:
            raise ValueError(f"qgZ reduce-scatter runs on the unit's shard group ({topology.world_size} ranks), "
                             f"got a group of {group.size()}")
        reduction = reduction_of(op)
        chunk_numel = output_tensor.numel()
        rows = input_tensor.view(topology.world_size, chunk_numel)
        request = self.take_audit()
        if topology.num_nodes > 1 and self.finishes_late(output_tensor, op):
            # hop 2 crosses nodes: with ``overlap`` the last slice's may finish later ([Note: late reduce-scatter])
            pieces = self.slices(chunk_numel)
            if request is None and len(pieces) > 1:
                finish = self._reduce_pipelined(rows, pieces, output_tensor.view(-1), reduction, late=True)
            else:
                finish = self.start_late(output_tensor, rows, reduction, group, request)
            self.complete(finish, True)
            return None

        def reduce_every_slice() -> None:
            pieces = self.slices(chunk_numel)
            if request is None and len(pieces) > 1:
                self._reduce_pipelined(rows, pieces, output_tensor.view(-1), reduction)
                return
            tally = Tally()
            for piece in pieces:
                check = None if request is None else _SliceCheck(self, rows, piece, group)
                self._reduce_slice(rows, piece, output_tensor.view(-1), reduction, check)
                if check is not None:
                    check.finish(output_tensor.view(-1), reduction, tally)
            if request is not None:
                request.record(self.technique, tally)

        self.complete(reduce_every_slice, False)
        return None

    def start_late(self, output_tensor: torch.Tensor, rows: torch.Tensor, reduction: Reduction,
                   group: dist.ProcessGroup, request: Request | None = None) -> Callable[[], None]:
        """Run hop 1 and start hop 2 of the (W, S) ``rows`` in one slice; what it returns waits
        for hop 2 and writes ``output_tensor`` (and finishes the audit of ``request``)."""
        whole = self.slices(rows.shape[1], whole=True)[0]
        check = None if request is None else _SliceCheck(self, rows, whole, group)
        exchange = self._send(self._intra_node_hop(rows, whole, check), whole.inter, 2,
                              self.groups.inter_node_group, async_op=True, bounds=check and check.hop2_bounds)
        return functools.partial(self._finish_inter_node_hop, exchange, output_tensor, reduction, check, request)

    def slices(self, chunk_numel: int, whole: bool = False) -> list[_Slice]:
        """[Note: qgZ slices]
        Both hops run over column slices of the chunk: for each slice, hop 1 codes the slice of
        every row bound for another rank, exchanges, decodes and sums it into the slice of the
        partial sums, then hop 2 does the same with those, and the slice's output is written. The
        temporaries (the payloads sent and received, one source's decoded rows, the partial sums)
        are the slice's, not the chunk's; the rows sent are coded from views of the input. A
        slice starts where a block starts (a group of blocks, with grouped scales) within each
        parameter's segment, so every block is the one the unsliced call codes, and each element
        is summed in the same order: the output is bit for bit the unsliced one. Stochastic
        rounding draws its uniforms in one stream per hop, so it runs in one slice, as do units
        whose rows fit the bound. Several slices run as a pipeline ([Note: qgZ slices in a
        pipeline]); an audited call, one after the other (in one slice, if it may finish late)."""
        if whole or self.slice_bytes is None or self.code.rounding == "stochastic":
            return [self._whole(chunk_numel)]
        if chunk_numel not in self._slices:
            max_numel = max(1, self.slice_bytes // (4 * self.placement.world_size))
            intra, inter = (self.codec(chunk_numel, bits) for bits in (self.bits_intra, self.bits_inter))
            pieces = _cut(intra.segments, self.block_size, max_numel)
            self._slices[chunk_numel] = [
                _Slice(columns, *(ChunkCodec([_with_numel(s, n) for s, n in zip(codec.segments, counts) if n],
                                             self.block_size, torch.float32, self.code) for codec in (intra, inter)))
                for columns, counts in pieces]
        return self._slices[chunk_numel]

    def _whole(self, chunk_numel: int) -> _Slice:
        codecs = (self.codec(chunk_numel, bits) for bits in (self.bits_intra, self.bits_inter))
        return _Slice((0, chunk_numel), *codecs)

    def _reduce_slice(self, rows: torch.Tensor, piece: _Slice, out: torch.Tensor, reduction: Reduction,
                      check: _SliceCheck | None = None) -> None:
        """Both hops over one slice of columns, and its output ([Note: qgZ slices]); ``check``
        collects the bounds of the audit ([Note: the audit] in ``zeropp.techniques.audit``)."""
        start, stop = piece.columns
        partial = self._intra_node_hop(rows, piece, check)
        if self.placement.num_nodes > 1:
            exchange = self._send(partial, piece.inter, 2, self.groups.inter_node_group,
                                  columns=piece.columns, chunk_numel=rows.shape[1],
                                  bounds=check and check.hop2_bounds)
            partial = self._summed(exchange)
        self._write(partial.view(-1), out[start:stop], reduction)

    def _reduce_pipelined(self, rows: torch.Tensor, pieces: list[_Slice], out: torch.Tensor,
                          reduction: Reduction, late: bool = False) -> Callable[[], None] | None:
        """Both hops over every slice as a pipeline: see [Note: qgZ slices in a pipeline]. With
        ``late`` the last slice's hop 2 is left in flight, and what finishes it is returned.

        [Note: qgZ slices in a pipeline]
        One slice after the other, each hop's coding, all-to-all and decoding run in turn, so the
        link idles while the CPU codes and decodes, and the CPU while the bytes cross. Instead,
        at each turn k this rank codes slice k's rows and starts their hop-1 exchange; sums slice
        k-1's hop 1 and codes and starts its hop 2; and sums slice k-2's hop 2 into the output.
        Both exchanges run on the backend's threads while the next coding runs. Every slice's
        arithmetic is the one the serial loop runs (the same blocks, the same summation order,
        its own columns of the residuals), so the output is bit for bit the same; every rank
        issues each group's exchanges in slice order. In flight at once: the exchanges and
        partial sums of three slices instead of one. A call that may finish late ([Note: late
        reduce-scatter]) leaves only its last slice's hop 2 in flight when it returns, so its
        temporaries stay a few slices', not the unit's."""
        count, nodes = len(pieces), self.placement.num_nodes
        first: list[_Exchange | torch.Tensor | None] = [None] * count
        second: list[_Exchange | None] = [None] * count
        for k in range(count + 2):
            if k < count:
                first[k] = self._start_intra_node_hop(rows, pieces[k])
            if 0 <= (j := k - 1) < count:
                piece, hop1, first[j] = pieces[j], first[j], None
                partial = hop1 if isinstance(hop1, torch.Tensor) else self._summed(hop1)
                if nodes > 1:
                    second[j] = self._send(partial, piece.inter, 2, self.groups.inter_node_group, async_op=True,
                                           columns=piece.columns, chunk_numel=rows.shape[1])
                else:
                    self._write(partial.view(-1), out[piece.columns[0]:piece.columns[1]], reduction)
            if nodes > 1 and 0 <= (j := k - 2) < count:
                piece, hop2, second[j] = pieces[j], second[j], None
                columns = out[piece.columns[0]:piece.columns[1]]
                if late and j == count - 1:
                    return lambda: self._write(self._summed(hop2).view(-1), columns, reduction)
                self._write(self._summed(hop2).view(-1), columns, reduction)
        return None

    def _finish_inter_node_hop(self, exchange: _Exchange, output_tensor: torch.Tensor, reduction: Reduction,
                               check: _SliceCheck | None = None, request: Request | None = None) -> None:
        """Hop 2's end: sum the N partials received into this rank's chunk (and audit it)."""
        self._write(self._summed(exchange).view(-1), output_tensor.view(-1), reduction)
        if check is not None:
            tally = Tally()
            check.finish(output_tensor.view(-1), reduction, tally)
            request.record(self.technique, tally)

    def _write(self, total: torch.Tensor, output_tensor: torch.Tensor, reduction: Reduction) -> None:
        """The fp32 ``total`` reduced as asked (AVG divides by the shard group's size, PREMUL_SUM
        multiplies by its factor), in the output's dtype."""
        output_tensor.copy_(reduction.apply(total, self.placement.world_size))

    def _residual(self, hop: int, num_rows: int, chunk_numel: int, device: torch.device,
                  create: bool = False) -> torch.Tensor | None:
        """The hop's residual over all its rows and the whole chunk (its slices are columns of it)."""
        residual = self._residuals.get(hop)
        if residual is not None and residual.shape == (num_rows, chunk_numel):
            return residual
        if not create:
            return None
        self._residuals[hop] = torch.zeros((num_rows, chunk_numel), dtype=torch.float32, device=device)
        return self._residuals[hop]

    def _route(self, num_rows: int, group: dist.ProcessGroup, remap: bool) -> _Route:
        """Which rows this rank keeps and sends in a hop, planned once per shape and group."""
        key = (num_rows, id(group), remap)
        if key not in self._routes:
            self._routes[key] = _Route(group.size(), group.rank(), num_rows // group.size(), remap)
        return self._routes[key]

    def _send(self, rows: torch.Tensor, codec: ChunkCodec, hop: int, group: dist.ProcessGroup,
              remap: bool = False, async_op: bool = False, columns: tuple[int, int] | None = None,
              chunk_numel: int | None = None, bounds: torch.Tensor | None = None) -> _Exchange:
        """Start sending ``rows`` (k, s) to the group's ranks (k / size rows each, in the order of
        [Note: qgZ remap] with ``remap``); ``_summed`` gives the sum of what every rank sent.

        Each peer's rows are coded straight from ``rows`` (views, no copy) into its rows of the
        payload. Only the rows bound for other ranks are quantized; the block this rank owes
        itself stays in fp32 and never enters the collective, which sends it nothing (see
        [Note: qgZ own rows]). With error feedback a peer's rows and residual are added first
        (a copy of that peer's rows only). ``bounds`` (shaped as ``rows``, audited calls only)
        gains the bound of each coding's error, and of the residual it adds.
        """
        route = self._route(rows.shape[0], group, remap)
        if columns is None:  # the rows are whole chunks
            columns, chunk_numel = (0, rows.shape[1]), rows.shape[1]
        residual = None
        if self.error_feedback:
            residual = self._residual(hop, rows.shape[0], chunk_numel, rows.device, create=True)
            residual = residual[:, columns[0]:columns[1]]
        spared = rows.dtype != torch.float32 and any(segment.bits is None for segment in codec.segments)
        packed = torch.empty(((route.size - 1) * route.per_peer, codec.nbytes), dtype=torch.uint8, device=rows.device)
        generator, finite = self._generator(hop, rows.device), None
        for peer in route.peers:
            if peer == route.me:
                continue
            x = route.rows_of(rows, peer)
            if spared:
                x = x.float()  # spared gradients travel in fp32 ([Note: full-precision gradients])
            if residual is not None:
                if bounds is not None:
                    route.rows_of(bounds, peer).add_(block_constant(codec, route.rows_of(residual, peer).abs()))
                x = x.float() + route.rows_of(residual, peer)
            if bounds is not None:
                route.rows_of(bounds, peer).add_(coding_bound(codec, x))
            codec.encode(x, packed[route.slot(peer)], generator)
            if residual is not None:
                finite = self._keep_residual(x, packed[route.slot(peer)], codec, route.rows_of(residual, peer), finite)
        if finite is not None and not bool(finite):
            residual.zero_()  # a non-finite slice leaves no residual ([Note: qgZ slices])
        received = torch.empty_like(packed)
        work = all_to_all(received.view(-1), packed.view(-1), route.split_bytes(codec.nbytes),
                          group, self.recorder, self.technique, dtype=_payload_dtype(codec),
                          async_op=async_op)
        return _Exchange(work, received, route.rows_of(rows, route.me), route, codec)

    @staticmethod
    def _keep_residual(x: torch.Tensor, packed: torch.Tensor, codec: ChunkCodec, residual: torch.Tensor,
                       finite: torch.Tensor | None) -> torch.Tensor:
        """Error feedback: remember in ``residual`` what coding ``x`` into ``packed`` lost, to add
        it before the next call (the rows a rank keeps are exact, their residual stays zero);
        whether all of the slice's losses so far are finite."""
        decoded = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        codec.decode(packed, decoded)
        lost = decoded.neg_().add_(x)
        residual.copy_(lost)
        all_finite = lost.isfinite().all()
        return all_finite if finite is None else finite & all_finite

    @staticmethod
    def _summed(exchange: _Exchange) -> torch.Tensor:
        """The fp32 sum, over the group's ranks in order, of the rows each sent this rank: each
        source decoded into one reused buffer as it is added, so no more than one source's rows
        are ever decoded at once."""
        if exchange.work is not None:
            exchange.work.wait()
        route = exchange.route
        total = decoded = None
        for peer in route.peers:
            if peer == route.me:
                term = exchange.own
            else:
                if decoded is None:
                    decoded = torch.empty(exchange.own.shape, dtype=torch.float32, device=exchange.own.device)
                exchange.codec.decode(exchange.received[route.slot(peer)], decoded)
                term = decoded
            if total is None:
                total = term.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
            else:
                total.add_(term)
        return total

    def _start_intra_node_hop(self, rows: torch.Tensor, piece: _Slice) -> _Exchange | torch.Tensor:
        """Hop 1 of a slice started (``_intra_node_hop`` without the wait), or the slice's rows
        in fp32 where a node holds one rank."""
        start, stop = piece.columns
        if self.placement.ranks_per_node == 1:
            return rows[:, start:stop].float()
        return self._send(rows[:, start:stop], piece.intra, 1, self.groups.intra_node_group, remap=True,
                          async_op=True, columns=piece.columns, chunk_numel=rows.shape[1])

    def _intra_node_hop(self, rows: torch.Tensor, piece: _Slice, check: _SliceCheck | None = None) -> torch.Tensor:
        """Hop 1 over a slice of the (W, S) rows (row n*D + d owed to rank n*D + d): local rank d
        gets rows [:, d] from each node peer and sums them: the (N, s) partials, in fp32."""
        start, stop = piece.columns
        columns = rows[:, start:stop]
        if self.placement.ranks_per_node == 1:
            return columns.float()
        return self._summed(self._send(columns, piece.intra, 1, self.groups.intra_node_group, remap=True,
                                       columns=piece.columns, chunk_numel=rows.shape[1],
                                       bounds=check and check.bounds))


class _SliceCheck:
    """The audit of one slice ([Note: the audit] in ``zeropp.techniques.audit``): this rank's exact rows of
    the slice and, beside them, the bound of every coding of its rows in either hop, laid out as
    the rows whose output they affect (hop 1 codes rows of the input; hop 2 codes the partial of
    chunk n*D + d, for local index d). After the hops one fp32 reduce-scatter of both sums every
    rank's rows, giving this rank the exact output and its bound. Each row also carries the
    bound of fp32 summation in another order ([Note: block-constant bounds])."""

    def __init__(self, comm: HierarchicalQuantizedReduceScatter, rows: torch.Tensor, piece: _Slice,
                 group: dist.ProcessGroup) -> None:
        start, stop = piece.columns
        num_rows, width = rows.shape[0], stop - start
        self.comm, self.piece, self.group = comm, piece, group
        self.stack = torch.empty((num_rows, 2 * width), dtype=torch.float32, device=rows.device)
        self.stack[:, :width].copy_(rows[:, start:stop])
        self.bounds = self.stack[:, width:]
        self.bounds.copy_(block_constant(piece.intra, self.stack[:, :width].abs()).mul_(num_rows * 2.0 ** -23))
        placement = comm.placement
        local_index = group.rank() % placement.ranks_per_node
        self.hop2_bounds = self.bounds.view(placement.num_nodes, placement.ranks_per_node, width)[:, local_index]

    def finish(self, output: torch.Tensor, reduction: Reduction, tally: Tally) -> None:
        """The exact reduce-scatter of rows and bounds, and this rank's slice of ``output`` held against it."""
        start, stop = self.piece.columns
        width = stop - start
        reduced = self.stack.new_empty(2 * width)
        reduce_scatter(reduced, self.stack.view(-1), dist.ReduceOp.SUM, self.group, self.comm.recorder,
                       AUDIT_TECHNIQUE)
        size = self.comm.placement.world_size
        exact = reduction.apply(reduced[:width], size).view(1, -1)
        scale = 1.0 / size if reduction.kind == dist.ReduceOp.AVG else abs(reduction.factor or 1.0)
        rounding = 2.0 ** -23 + (0.0 if output.dtype == torch.float32 else torch.finfo(output.dtype).eps)
        bound = reduced[width:].view(1, -1).mul_(scale).add_(block_constant(self.piece.inter, exact.abs()),
                                                             alpha=rounding)
        tally.add(self.piece.inter, output[start:stop].view(1, -1), exact, bound)


@dataclass(frozen=True)
class _Slice:
    """Columns ``[start, stop)`` of a chunk and each hop's codec for them ([Note: qgZ slices])."""

    columns: tuple[int, int]
    intra: ChunkCodec
    inter: ChunkCodec


def _with_numel(segment: Segment, numel: int) -> Segment:
    return dataclasses.replace(segment, numel=numel)


def _cut(segments: Sequence[Segment], block_size: int, max_numel: int) -> list[tuple[tuple[int, int], list[int]]]:
    """Split a chunk's columns into slices of at most ``max_numel`` (at least one block, or group
    of blocks, each), each cut where a block (group) of a segment starts: per slice its columns
    and how many elements of each segment it holds."""
    pieces: list[tuple[tuple[int, int], list[int]]] = []
    counts, start, size = [0] * len(segments), 0, 0
    for index, segment in enumerate(segments):
        unit = 1 if segment.bits is None else block_size * segment.blocks_per_scale
        left = segment.numel
        while left:
            room = max(0, max_numel - size)
            take = left if left <= room else room // unit * unit
            if take == 0 and size == 0:
                take = min(left, unit)  # one block (group) larger than the bound: a slice of its own
            if take == 0:
                pieces.append(((start, start + size), counts))
                counts, start, size = [0] * len(segments), start + size, 0
                continue
            counts[index] += take
            size += take
            left -= take
    if size or not pieces:
        pieces.append(((start, start + size), counts))
    return pieces


def _payload_dtype(codec: ChunkCodec) -> str:
    """The ledger's name for a payload: its code's width, or float32 when nothing in it is quantized."""
    widths = {segment.bits for segment in codec.segments if segment.bits is not None}
    return f"int{max(widths)}" if widths else "float32"
