"""qwZ: the quantized weight all-gather (ZeRO++ section 3.1), an FSDP2 ``AllGather`` comm.

Each rank's chunk of a unit's flat parameter buffer travels block-quantized (data and scales
in one uint8 payload, see ``zeropp.codes.codec``), and every rank's chunk, its own included, is
decoded into the output, so all ranks compute with the same weights: ``dequantize(quantize(
shard))`` of every shard. FSDP2 calls the same comm for the backward all-gather. With hpZ the
secondary copy that gather reads is kept as the payload rows the forward received, and travels
as such ([Note: hpZ's copy as qwZ's codes] in ``zeropp.techniques.hpz``); any other gather on an
intra-node group sends the chunk in full precision unless asked.
"""

from __future__ import annotations

import fnmatch
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from zeropp.codes.bounds import coding_bound
from zeropp.codes.codec import ChunkCodec, segments_for
from zeropp.fsdp.access import AllGather, UnitLayout
from zeropp.fsdp.comms import Completion, GatherAhead, RecordedComm, Started, all_gather, buffered
from zeropp.fsdp.ledger import CommLedger, GroupKind
from zeropp.setup.topology import ProcessGroups, Topology
from zeropp.techniques.audit import Auditable, Request, Tally, exact_gather_rows
from zeropp.techniques.hpz_mesh import NodeCopy

if TYPE_CHECKING:
    from zeropp.techniques.hpz import CodedSecondaryCopy

QUANTIZABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def quantized_parameters(layout: UnitLayout, weights: bool, nontrainable_weights: bool,
                         unquantized: tuple[str, ...] = ()) -> list[bool]:
    """Which of a unit's parameters qwZ quantizes: every floating-point one (``weights``) or the
    frozen ones (``nontrainable_weights``), except those whose name (``layout.names``: as the
    model names them) matches a pattern of ``unquantized``. Integer and bool parameters travel as they are; a
    floating-point dtype the codec does not take is refused, naming the parameter."""
    flags = []
    for name, shape, dtype, trainable in zip(layout.names, layout.shapes, layout.gather_dtypes, layout.trainable):
        wanted = weights or (nontrainable_weights and not trainable)
        wanted = wanted and not any(fnmatch.fnmatchcase(name, pattern) for pattern in unquantized)
        if wanted and dtype.is_floating_point and dtype not in QUANTIZABLE_DTYPES:
            raise ValueError(
                f"qwZ cannot quantize parameter {name!r} (shape {tuple(shape)}, {dtype}): the codec takes "
                f"{', '.join(map(str, QUANTIZABLE_DTYPES))}; cast the model (e.g. model.float()) or gather in "
                "one of them (MixedPrecisionPolicy param_dtype / ZeroPPConfig param_dtype)")
        flags.append(wanted and dtype in QUANTIZABLE_DTYPES)
    return flags


def has_two_hops(topology: Topology) -> bool:
    """Whether a world gather with ``hierarchical_gather`` takes two hops: there are several
    nodes, and several ranks in each ([Note: two-hop gather]); otherwise it is the ring."""
    return topology.num_nodes > 1 and topology.ranks_per_node > 1


class QuantizedAllGather(RecordedComm, GatherAhead, Auditable, AllGather):
    """qwZ's all-gather of one unit.

    Each parameter's slice is quantized on its own (a scale never spans two tensors).
    ``quantized`` says which parameters are (all of them for qwZ; the frozen ones for quantized
    non-trainable weights); the others travel in their own precision inside the same payload.
    ``asymmetric`` codes them with ``zeropp.codes.weightcode`` instead of ``quant``'s symmetric code.
    ``dtypes`` are the parameters' gather dtypes: a unit that mixes them is gathered by FSDP2 as
    bytes, and coded per parameter in its own dtype ([Note: mixed-dtype units]). With
    ``two_hop`` (the process groups) a gather over the world runs in two hops ([Note: two-hop
    gather]). ``secondary_codes``: the unit's hpZ copy kept as payload rows, which the gather
    from it sends ([Note: hpZ's copy as qwZ's codes] in ``zeropp.techniques.hpz``).

    [Note: two-hop gather]
    gloo's (and NCCL's) ring all-gather over the world has one edge out of each node, and that
    edge carries every chunk but one: (W - 1)/W of the payload per node link, where a node
    needs only the (N - 1)/N that lives on other nodes. With ``hierarchical_gather`` the world
    gather runs as two all-gathers: first among the ranks of one local index across the nodes
    (each rank's chunk crosses to each other node once: (N - 1)/N per node link, spread over
    the node's D ranks), then inside the node, each rank passing on the N chunks it holds.
    Rank n*D + d's chunk arrives at row [d, n] of the node gather; the rows are put back in
    rank order before decoding, so the output is bit-identical to the ring's. On 2 nodes that
    is 1/2 of the payload per node link instead of 3/4 (2 x 2) or 15/16 (2 x 8); at 24 nodes
    the two differ by 4%.
    """

    technique = "qwZ"

    def __init__(self, topology: Topology, padded_numels: list[int], quantized: list[bool], *,
                 bits: int, block_size: int, asymmetric: bool = False, quantize_intra_node: bool = False,
                 dtypes: list[torch.dtype] | None = None, two_hop: ProcessGroups | None = None,
                 ledger: CommLedger | None = None) -> None:
        super().__init__(topology, ledger)
        self.two_hop = two_hop
        self.padded_numels, self.quantized, self.dtypes = padded_numels, quantized, dtypes
        self.bits, self.block_size, self.asymmetric = bits, block_size, asymmetric
        self.quantize_intra_node = quantize_intra_node
        self.secondary_codes: CodedSecondaryCopy | NodeCopy | None = None
        self._codecs: dict[tuple[int, torch.dtype], ChunkCodec] = {}
        self._regrouped: dict[tuple[int, torch.dtype, int], ChunkCodec] = {}

    def codec(self, group_size: int, dtype: torch.dtype) -> ChunkCodec:
        """The codec of one chunk when the unit's parameters are split over ``group_size`` ranks."""
        key = (group_size, dtype)
        if key not in self._codecs:
            segments = segments_for(self.padded_numels, self.quantized, group_size, self.bits, self.dtypes,
                                    self.asymmetric)
            self._codecs[key] = ChunkCodec(segments, self.block_size, dtype)
        return self._codecs[key]

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, async_op: bool = False) -> dist.Work | None:
        return self.gather(output_tensor, input_tensor, group, async_op)

    def start(self, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool,
              output_tensor: torch.Tensor | None) -> Started:
        info = self.group_info(group)
        codes = self.secondary_codes.take(info.size) if self.secondary_codes is not None else None
        if codes is not None and isinstance(self.secondary_codes, NodeCopy):
            return self._gather_node_codes(codes, input_tensor, async_op)
        if codes is not None:
            return self._gather_codes(codes, input_tensor, group, info.size, async_op)
        if info.kind is GroupKind.INTRA and not self.quantize_intra_node:
            if output_tensor is None:
                output_tensor = input_tensor.new_empty(input_tensor.numel() * info.size)
            work = all_gather(output_tensor, input_tensor, group, self.recorder, "hpZ", async_op=async_op)
            return work, buffered(output_tensor)
        codec = self.codec(info.size, input_tensor.dtype)
        if codec.numel != input_tensor.numel():
            raise RuntimeError(f"qwZ all-gather got a chunk of {input_tensor.numel()} elements, but the "
                               f"unit's parameters make chunks of {codec.numel} on {info.size} ranks")
        request = None if codec.byte_mode else self.take_audit()
        exact = None if request is None else exact_gather_rows(input_tensor, group, info.size, self.recorder)
        send = torch.empty((1, codec.nbytes), dtype=torch.uint8, device=input_tensor.device)
        codec.encode(input_tensor.view(1, -1), send)
        if self.two_hop is not None and info.size == self.topology.world_size and has_two_hops(self.topology):
            work, completion = self._gather_in_two_hops(send, codec, async_op)
        else:
            received = torch.empty((info.size, codec.nbytes), dtype=torch.uint8, device=input_tensor.device)
            work = all_gather(received.view(-1), send.view(-1), group, self.recorder, self.technique,
                              dtype=f"int{self.bits}", async_op=async_op)
            completion = Completion(received, lambda output: self._decode(received, codec, output))
        if request is not None:  # [Note: the audit]
            completion = completion.followed_by(lambda output: self._check(request, codec, output, exact))
        return work, completion

    def _check(self, request: Request, codec: ChunkCodec, output_tensor: torch.Tensor, exact: torch.Tensor) -> None:
        """The audit of one gather: the decoded weights against the exact ones, within the code's bound."""
        tally = Tally()
        tally.add(codec, output_tensor.view(len(exact), -1), exact,
                  coding_bound(codec, exact, out_dtype=output_tensor.dtype))
        request.record(self.technique, tally)

    def _decode(self, received: torch.Tensor, codec: ChunkCodec, output_tensor: torch.Tensor) -> None:
        """Decode every rank's payload row into the output, and hand the rows to hpZ's copy."""
        codec.decode(received, output_tensor.view(len(received), -1))
        if self.secondary_codes is not None:
            self.secondary_codes.received(received, codec)

    def _gather_codes(self, codes: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                      group_size: int, async_op: bool) -> Started:
        """The gather from hpZ's copy kept as codes: each rank sends its regrouped payload row,
        and the group's rows decode straight into FSDP2's layout over ``group_size`` ranks
        ([Note: hpZ's copy as qwZ's codes]). FSDP2's input (built from placeholders) is not read."""
        copy = self.secondary_codes
        codec = self.regrouped_codec(copy.group_size, copy.rows_per_copy, input_tensor.dtype)
        if codec.numel != input_tensor.numel() or codec.nbytes != codes.numel():
            raise RuntimeError(f"hpZ's gather from codes got a chunk of {input_tensor.numel()} elements and "
                               f"{codes.numel()} bytes of codes; the unit's codes make {codec.numel} elements and "
                               f"{codec.nbytes} bytes")
        received = torch.empty((group_size, codec.nbytes), dtype=torch.uint8, device=codes.device)
        work = all_gather(received.view(-1), codes.view(-1), group, self.recorder, "hpZ", dtype=f"int{self.bits}",
                          async_op=async_op)
        return work, Completion(received, lambda output: codec.decode(received, output.view(group_size, -1)))

    def _gather_node_codes(self, codes: torch.Tensor, input_tensor: torch.Tensor, async_op: bool) -> Started:
        """Backward's gather on a 2-D mesh, from the rows hpZ keeps on the node ([Note: hpZ on a
        2-D mesh] in ``zeropp.techniques.hpz_mesh``): the node's ranks' rows, in index order, are the forward's
        S payload rows. FSDP2's input is not read."""
        copy = self.secondary_codes
        codec = self.codec(copy.group_size, input_tensor.dtype)
        received = torch.empty((copy.group_size, codec.nbytes), dtype=torch.uint8, device=codes.device)
        work = all_gather(received.view(-1), codes.view(-1), copy.node_group, self.recorder, "hpZ",
                          dtype=f"int{self.bits}", async_op=async_op)
        return work, Completion(received, lambda output: codec.decode(received, output.view(copy.group_size, -1)))

    def regrouped_codec(self, group_size: int, rows_per_chunk: int, dtype: torch.dtype) -> ChunkCodec:
        """The codec of chunks joining ``rows_per_chunk`` of the chunks over ``group_size`` ranks
        (``ChunkCodec.regrouped``): hpZ's copy as codes."""
        key = (group_size, dtype, rows_per_chunk)
        if key not in self._regrouped:
            self._regrouped[key] = self.codec(group_size, dtype).regrouped(rows_per_chunk)
        return self._regrouped[key]

    def _gather_in_two_hops(self, send: torch.Tensor, codec: ChunkCodec, async_op: bool) -> Started:
        """The world gather across nodes, then inside the node: see [Note: two-hop gather]. The
        first hop may run asynchronously; the second (inside the node) and the decode run when
        the output is written."""
        groups, num_nodes, ranks_per_node = self.two_hop, self.topology.num_nodes, self.topology.ranks_per_node
        across = torch.empty((num_nodes, codec.nbytes), dtype=torch.uint8, device=send.device)
        work = all_gather(across.view(-1), send.view(-1), groups.inter_node_group, self.recorder, self.technique,
                          dtype=f"int{self.bits}", async_op=async_op)

        def finish(output_tensor: torch.Tensor) -> None:
            node = torch.empty((ranks_per_node, num_nodes, codec.nbytes), dtype=torch.uint8, device=send.device)
            all_gather(node.view(-1), across.view(-1), groups.intra_node_group, self.recorder, self.technique,
                       dtype=f"int{self.bits}")
            in_rank_order = node.transpose(0, 1).reshape(num_nodes * ranks_per_node, codec.nbytes)
            self._decode(in_rank_order, codec, output_tensor)

        return work, Completion(across, finish)
