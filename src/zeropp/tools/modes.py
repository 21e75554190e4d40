"""Named configurations: the one registry behind ``--modes`` of ``zeropp demo``, ``converge``,
``finetune`` and ``bench``, so each configuration has one name everywhere.

A mode is a system (zeropp itself, FSDP2's own hybrid sharding, or DeepSpeed ZeRO-3 as a peer)
and, for zeropp, the ``ZeroPPConfig`` options. hpZ's secondary partition always spans the whole
node (``hpz_partition_size`` = ranks per node), so a mode means the same on any layout.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from zeropp.config import ZeroPPConfig


class System(str, enum.Enum):
    """What trains the model in a mode."""

    ZEROPP = "zeropp"
    """``zeropp.shard`` with the mode's config (plain ZeRO-3 when it asks for no technique)."""
    HSDP = "hsdp"
    """FSDP2's hybrid sharding: shard inside each node, replicate across nodes."""
    DEEPSPEED = "deepspeed"
    """DeepSpeed ZeRO-3 (an optional dependency), the peer zeropp is measured against."""


@dataclass(frozen=True, kw_only=True)
class Mode:
    """One named configuration."""

    name: str
    summary: str
    """One line for tables and ``--help``."""
    system: System = System.ZEROPP
    options: Mapping[str, Any] = field(default_factory=dict)
    """``ZeroPPConfig`` fields, besides hpZ's size (DeepSpeed: entries of its ``zero_optimization``)."""
    hpz: bool = False
    """hpZ on, over the whole node (for DeepSpeed: ``zero_hpz_partition_size`` = ranks per node)."""
    initial_weight_noise: float = 0.0
    """A control, not a technique: the initial weight matrices are multiplied by (1 + this x
    N(0, 1)), elementwise, the same on every rank, before sharding ([Note: perturbation controls])."""
    gather_ahead: bool = False
    """The optimizer steps each unit in backward and the next forward's gathers start right after
    (``zeropp.optimizer_in_backward(..., gather_ahead=True)``): the training loop calls no
    ``optimizer.step()``, so only harnesses written for it take such a mode."""
    tensor_parallel: int = 1
    """Tensor parallel degree inside the node (the GPT's MLPs, Megatron's column then row split),
    FSDP over the data-parallel sub-mesh across it: torchtitan's 2-D layout. 1: none."""
    decoded_secondary_copy: bool = False
    """hpZ keeps FSDP2's decoded secondary copy instead of qwZ's codes
    (``zeropp.techniques.hpz.keep_decoded_secondary_copies``): the same training bit for bit, to compare the
    two copies' step time and memory in one run."""

    def config(self, ranks_per_node: int, **overrides: Any) -> ZeroPPConfig:
        """The ``ZeroPPConfig`` of this mode on nodes of ``ranks_per_node`` ranks; ``overrides``
        are further fields (dtypes, block size, ...). An HSDP mode's is what ``zeropp.enable``
        adds to FSDP2's hybrid sharding."""
        if self.system is System.DEEPSPEED:
            raise ValueError(f"mode {self.name!r} runs {self.system.value}, not zeropp: it has no ZeroPPConfig")
        hpz = {"hpz_partition_size": ranks_per_node} if self.hpz else {}
        return ZeroPPConfig(**{**self.options, **hpz, **overrides})

    def deepspeed_options(self, ranks_per_node: int) -> dict[str, Any]:
        """The entries of DeepSpeed's ``zero_optimization`` this mode sets on nodes of
        ``ranks_per_node`` ranks (its hpZ over the node: ``zero_hpz_partition_size``)."""
        if self.system is not System.DEEPSPEED:
            raise ValueError(f"mode {self.name!r} runs {self.system.value}, not deepspeed: it has no DeepSpeed options")
        hpz = {"zero_hpz_partition_size": ranks_per_node} if self.hpz else {}
        return {**self.options, **hpz}


QWZ_RELATIVE_ERROR = 7.0e-3
"""The relative RMS error qwZ's INT8 code puts on a Gaussian weight matrix (blocks of 256, absmax
scaling): a step of absmax/127, an error uniform within half a step (RMS step/sqrt(12)), and the
absmax of 256 Gaussian values about 3.08 standard deviations (RMS over blocks), so
3.08 / (127 x 3.46) = 7.0e-3; measured on the demo GPT's initial matrices: 6.8e-3 to 7.2e-3."""
_ALL = {"quantized_weights": True, "quantized_gradients": True}
_SERIAL = {"overlap": False}
"""The baselines run FSDP2's own schedule, on CPU every collective in turn, whatever ``overlap``'s
default (``hsdp`` is FSDP2's alone, without zeropp)."""
_ROTNORM = {"grad_bits_intra": 8, "grad_rotation": "hadamard", "grad_levels": "normal"}
"""qgZ's lowest-error option with fp32 block scales at DeepSpeed's cross-node bytes."""
_SCALE8 = {"grad_bits_intra": 8, "grad_levels": "normal", "grad_block_size": 64, "grad_scale_bits": 8}
"""qgZ's lowest-error option on Gaussian gradients: normal levels on blocks of 64 whose scales
travel in 8 bits, at DeepSpeed's cross-node bytes +0.8% (``zeropp bench qgz-error``)."""
_SPARE_SMALL = {"grad_full_precision_below": 1024}
"""qgZ sends the gradients of parameters under 1024 elements unquantized: LayerNorms and most biases
up to a width of 512 (below 1% of the gradient bytes from a width of 512 up; 5.7% on the demo GPT)."""
_DEEPSPEED_RESHARD = {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0,
                      "stage3_max_reuse_distance": 0}
"""DeepSpeed ZeRO-3 options that make it hold weights as FSDP2 does: every parameter partitioned
(by default those under 1e5 elements stay whole on every rank), and released after its forward.
By default DeepSpeed prefetches up to 5e7 elements along the recorded trace and keeps weights it
will use again within 1e9 elements: on a model smaller than that, every weight stays whole from
the second forward to its backward, nothing is gathered in backward and hpZ makes no copy."""
MODES: dict[str, Mode] = {mode.name: mode for mode in (
    Mode(name="zero3", summary="ZeRO-3: FSDP2 with its own collectives (counted), each in turn as FSDP2 runs "
         "them on CPU", options=_SERIAL),
    Mode(name="zero3_init", summary="control: ZeRO-3 from initial weights perturbed by qwZ's relative error",
         initial_weight_noise=QWZ_RELATIVE_ERROR),
    Mode(name="zero3_order", summary="control: ZeRO-3 whose gradient sums run in another fp32 order "
         "(qgZ's two hops, nothing quantized)",
         options={"quantized_gradients": True, "grad_full_precision_parameters": ("*",)}),
    Mode(name="hsdp", summary="FSDP2 hybrid sharding (replicate across nodes)", system=System.HSDP),
    Mode(name="hsdp_quantized", summary="hsdp, its cross-node gradient all-reduce in INT4 "
         "(quantized_replica_gradients)", system=System.HSDP, options={"quantized_replica_gradients": True}),
    Mode(name="hsdp_quantized_overlap", summary="hsdp_quantized, overlap named (the default)",
         system=System.HSDP, options={"quantized_replica_gradients": True, "overlap": True}),
    Mode(name="tp_zero3", summary="tensor parallel 2 inside the node x ZeRO-3 across (FSDP2's collectives, counted)",
         options=_SERIAL, tensor_parallel=2),
    Mode(name="tp_qwz_qgz", summary="tp_zero3 with qwZ and qgZ on the data-parallel sub-mesh", options=_ALL,
         tensor_parallel=2),
    Mode(name="deepspeed", summary="DeepSpeed ZeRO-3", system=System.DEEPSPEED),
    Mode(name="deepspeed_reshard", summary="DeepSpeed ZeRO-3 resharding as FSDP2 does (see _DEEPSPEED_RESHARD)",
         system=System.DEEPSPEED, options=_DEEPSPEED_RESHARD),
    Mode(name="deepspeed_hpz", summary="deepspeed_reshard with DeepSpeed's hpZ (zero_hpz_partition_size)",
         system=System.DEEPSPEED, options=_DEEPSPEED_RESHARD, hpz=True),
    Mode(name="qwz", summary="qwZ: INT8 weight all-gather", options={"quantized_weights": True}),
    Mode(name="qnw", summary="INT8 all-gather of frozen weights only",
         options={"quantized_nontrainable_weights": True}),
    Mode(name="qnw4", summary="INT4 all-gather of frozen weights only",
         options={"quantized_nontrainable_weights": True, "weight_bits": 4}),
    Mode(name="qnw2", summary="INT2 all-gather of frozen weights only",
         options={"quantized_nontrainable_weights": True, "weight_bits": 2}),
    Mode(name="qnw4_block32", summary="INT4 all-gather of frozen weights only, 32-element blocks",
         options={"quantized_nontrainable_weights": True, "weight_bits": 4, "block_size": 32}),
    Mode(name="qnw4_asym32", summary="INT4 all-gather of frozen weights only, asymmetric code, 32-element blocks",
         options={"quantized_nontrainable_weights": True, "weight_bits": 4, "block_size": 32,
                  "weight_code": "asymmetric"}),
    Mode(name="qnw2_asym32", summary="INT2 all-gather of frozen weights only, asymmetric code, 32-element blocks",
         options={"quantized_nontrainable_weights": True, "weight_bits": 2, "block_size": 32,
                  "weight_code": "asymmetric"}),
    Mode(name="qnw2_block32", summary="INT2 all-gather of frozen weights only, 32-element blocks",
         options={"quantized_nontrainable_weights": True, "weight_bits": 2, "block_size": 32}),
    Mode(name="hpz", summary="hpZ: secondary weight partition inside the node", hpz=True),
    Mode(name="qgz", summary="qgZ: two-hop gradient all-to-all, INT8 inside the node, INT4 across",
         options={"quantized_gradients": True}),
    Mode(name="qgz_ef", summary="qgZ with error feedback",
         options={"quantized_gradients": True, "error_feedback": True}),
    Mode(name="qgz_int8", summary="qgZ, INT8 on both hops",
         options={"quantized_gradients": True, "grad_bits_intra": 8, "grad_bits_inter": 8}),
    Mode(name="qgz_int4", summary="qgZ with DeepSpeed's code: INT4 on both hops",
         options={"quantized_gradients": True, "grad_bits_intra": 4}),
    Mode(name="qgz_sr", summary="qgZ with stochastic rounding",
         options={"quantized_gradients": True, "grad_rounding": "stochastic"}),
    Mode(name="qgz_rotnorm", summary="qgZ, INT8 intra-node, INT4 cross-node with rotation and normal levels",
         options={"quantized_gradients": True, **_ROTNORM}),
    Mode(name="qgz_scale8", summary="qgZ, INT8 intra-node, INT4 cross-node with normal levels on blocks of 64 "
         "with 8-bit scales", options={"quantized_gradients": True, **_SCALE8}),
    Mode(name="qgz_block32", summary="qgZ with 32-element blocks",
         options={"quantized_gradients": True, "block_size": 32}),
    Mode(name="qgz_spare", summary="qgZ, parameters under 1024 elements in full precision",
         options={"quantized_gradients": True, **_SPARE_SMALL}),
    Mode(name="qwz_qgz", summary="qwZ and qgZ without hpZ (what expert parallel and 2-D meshes take)",
         options=_ALL),
    Mode(name="all", summary="qwZ + hpZ + qgZ", options=_ALL, hpz=True),
    Mode(name="all_delta", summary="all three, hpZ's node copy kept from step to step and refreshed by 4-bit weight "
         "differences (every gather inside the node)", options={**_ALL, "weight_deltas": True}, hpz=True),
    Mode(name="all_delta8", summary="all_delta with 8-bit weight differences",
         options={**_ALL, "weight_deltas": True, "delta_bits": 8}, hpz=True),
    Mode(name="all_delta_g8", summary="all_delta with qgZ at 8 bits on both hops: the gradients' bytes that weight "
         "differences save on the weights", options={**_ALL, "weight_deltas": True, "grad_bits_inter": 8}, hpz=True),
    Mode(name="all_delta_rotnorm", summary="all_delta with qgZ as in qgz_rotnorm: weight differences for qwZ's "
         "share, the rotation with normal levels for the gradients'", options={**_ALL, "weight_deltas": True,
                                                                               **_ROTNORM}, hpz=True),
    Mode(name="all_delta_codes", summary="all_delta with the node copy kept as qwZ's INT8 codes",
         options={**_ALL, "weight_deltas": True, "delta_reference": "codes"}, hpz=True),
    Mode(name="hpz_delta", summary="hpZ with its node copy refreshed by 4-bit weight differences (no qwZ, no qgZ)",
         options={"weight_deltas": True}, hpz=True),
    Mode(name="all_spare", summary="all three, qgZ sparing parameters under 1024 elements",
         options={**_ALL, **_SPARE_SMALL}, hpz=True),
    Mode(name="all_ef", summary="all three, qgZ with error feedback", options={**_ALL, "error_feedback": True},
         hpz=True),
    Mode(name="all_wide_embed", summary="all three, qgZ coding the embedding's and norms' gradients at 8 bits on "
         "both hops (grad_wide_parameters)",
         options={**_ALL, "grad_wide_parameters": ("*embed*", "*norm*")}, hpz=True),
    Mode(name="all_spare_embed", summary="all three, qgZ sending the embedding's and norms' gradients unquantized "
         "(what 8 bits for them could win at most)",
         options={**_ALL, "grad_full_precision_parameters": ("*embed*", "*norm*")},
         hpz=True),
    Mode(name="all_budget", summary="all three, qgZ at 8 bits on both hops for the units whose 4-bit error the "
         "first step's audit finds above 0.18 (grad_error_budget; about a third of SmolLM2-135M's units)",
         options={**_ALL, "audit_every": 1_000_000, "grad_error_budget": 0.18}, hpz=True),
    Mode(name="all_int4", summary="all three, qgZ with DeepSpeed's code: INT4 on both hops (the default until "
         "INT8 inside the node)", options={**_ALL, "grad_bits_intra": 4}, hpz=True),
    Mode(name="all_rotnorm", summary="all three, qgZ as in qgz_rotnorm", options={**_ALL, **_ROTNORM}, hpz=True),
    Mode(name="all_scale8", summary="all three, qgZ as in qgz_scale8", options={**_ALL, **_SCALE8}, hpz=True),
    Mode(name="all_w6", summary="all three, qwZ with 6-bit weights", options={**_ALL, "weight_bits": 6}, hpz=True),
    Mode(name="all_audit", summary="all three, the audit checking one unit every step (audit_every=1)",
         options={**_ALL, "audit_every": 1}, hpz=True),
    Mode(name="all_decoded_copy", summary="all three, hpZ's copy decoded as FSDP2 keeps it, not as qwZ's codes",
         options=_ALL, hpz=True, decoded_secondary_copy=True),
    Mode(name="all_serial", summary="all three, every collective in turn (overlap=False)",
         options={**_ALL, **_SERIAL}, hpz=True),
    Mode(name="zero3_overlap", summary="ZeRO-3, its gathers and reduce-scatters beside compute",
         options={"overlap": True}),
    Mode(name="all_overlap", summary="all three, overlap named (the default)",
         options={**_ALL, "overlap": True}, hpz=True),
    Mode(name="all_hier", summary="all three, qwZ gathering across nodes then inside them",
         options={**_ALL, "hierarchical_gather": True}, hpz=True),
    Mode(name="all_hier_overlap", summary="all_hier, overlap named (the default)",
         options={**_ALL, "hierarchical_gather": True, "overlap": True}, hpz=True),
    Mode(name="all_ahead",
         summary="all three, each unit's optimizer step in backward, its next gather started there",
         options={**_ALL, "overlap": True}, hpz=True, gather_ahead=True),
)}
"""Every mode by name. ``zero3`` is the baseline every comparison is made against.

[Note: perturbation controls]
Two short trainings from the same start on the same batches drift apart after any perturbation,
however harmless, and their final losses differ by that drift. So a technique's delta against
ZeRO-3 on one seed holds its cost and the drift together; the controls measure the drift alone,
with perturbations that cost nothing in expectation: ``zero3_init`` multiplies the initial weight
matrices by (1 + QWZ_RELATIVE_ERROR x noise) once (1-D parameters, LayerNorms and biases, start
at exact values that qwZ codes exactly, so they are left alone); ``zero3_order`` sums the
gradients in another fp32 order (qgZ's two hops with every gradient unquantized), the smallest
perturbation there is. ``zeropp converge`` compares each technique's paired delta with theirs."""

BASELINE = "zero3"


def zeropp_modes() -> tuple[str, ...]:
    """The modes that ``zeropp.shard`` trains with an ordinary optimizer loop on a 1-D mesh (demo,
    converge, finetune accept only these)."""
    return tuple(name for name, mode in MODES.items()
                 if mode.system is System.ZEROPP and not mode.gather_ahead and mode.tensor_parallel == 1)


def check_modes(names: Iterable[str], allowed: Iterable[str]) -> tuple[str, ...]:
    """``names`` as a tuple, or a ``ValueError`` naming the unknown ones and what is allowed."""
    names, allowed = tuple(names), tuple(allowed)
    unknown = [name for name in names if name not in allowed]
    if not names or unknown or len(set(names)) != len(names):
        raise ValueError(f"modes={list(names)} must be distinct names from {list(allowed)}"
                         + (f"; unknown: {unknown}" if unknown else ""))
    return names


def parse_modes(text: str, allowed: Iterable[str]) -> tuple[str, ...]:
    """A comma-separated ``--modes`` value, checked against ``allowed``."""
    return check_modes([name for name in text.split(",") if name], allowed)
