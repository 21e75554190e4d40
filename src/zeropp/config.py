"""zeropp's configuration: the ZeRO++ switches, the DeepSpeed training keys, and the JSON reader.

Every rule is a *checker*, ``(key, value) -> normalised value`` raising ``ValueError``, kept in one
table per dataclass. ``__post_init__`` runs the table over the fields; the DeepSpeed reader runs the
same checkers under the dotted key the user wrote (``zero_optimization.zero_hpz_partition_size``),
so each rule has one implementation and every error names the key, the value and what is allowed.
Checks that need the topology or the model (hpZ divides the ranks per node, a unit's sharding)
live with the topology and the sharding; they and the cross-field checks here call each field by
``key_of``, so a config read from DeepSpeed is refused in the keys the user wrote.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import reprlib
from collections.abc import Callable, Mapping
from dataclasses import InitVar, dataclass, field
from typing import Any, NoReturn

import torch

from zeropp.codes.gradcode import LEVELS, ROTATIONS, ROUNDINGS, SCALE_BITS, GradientCode
from zeropp.codes.quant import min_block_size
from zeropp.codes.weightcode import CODES as WEIGHT_CODES

logger = logging.getLogger("zeropp")

Checker = Callable[[str, Any], Any]
"""Checks the value found under a (dotted) key; returns it normalised or raises ValueError."""


def _reject(key: str, value: object, allowed: str) -> NoReturn:
    hint = ""
    if isinstance(value, str) and value == "auto":
        hint = ("; 'auto' is a Hugging Face Trainer placeholder: zeropp.hf.ZeroPPTrainer fills it in the keys "
                "Trainer owns (batch sizes, clipping, optimizer and scheduler parameters, bf16/fp16); "
                "elsewhere give a concrete value")
    raise ValueError(f"{key}={reprlib.repr(value)} is not allowed; expected {allowed}{hint}")


def _checker(
    allowed: str, accept: Callable[[Any], bool], convert: Callable[[Any], Any] = lambda v: v
) -> Checker:
    """A checker accepting ``value`` when ``accept(value)`` holds; it returns ``convert(value)``."""

    def check(key: str, value: Any) -> Any:
        if not accept(value):
            _reject(key, value, allowed)
        return convert(value)

    return check


def _is_int(value: Any) -> bool:
    """A JSON integer: an int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    """A finite JSON number (int or float, not bool) that converts to float without overflow."""
    return (_is_int(value) or isinstance(value, float)) and -1e308 < value < 1e308


def _optional(check: Checker) -> Checker:
    """``check``, letting None (the key was not given) through."""
    return lambda key, value: None if value is None else check(key, value)


_BOOL = _checker("a bool (true or false)", lambda v: isinstance(v, bool))
_POSITIVE_INT = _checker("an int >= 1", lambda v: _is_int(v) and v >= 1)
_NON_NEGATIVE_INT = _checker("an int >= 0", lambda v: _is_int(v) and v >= 0)
_NON_NEGATIVE = _checker("a finite number >= 0", lambda v: _is_real(v) and v >= 0, float)
_POSITIVE = _checker("a finite number > 0", lambda v: _is_real(v) and v > 0, float)
_WEIGHT_BITS = _checker("an int from 2 to 8", lambda v: _is_int(v) and 2 <= v <= 8)
_GRAD_BITS = _checker("2, 4 or 8", lambda v: _is_int(v) and v in (2, 4, 8))
_GRAD_ROTATION = _checker(" or ".join(map(repr, ROTATIONS)), lambda v: v in ROTATIONS)
_GRAD_ROUNDING = _checker(" or ".join(map(repr, ROUNDINGS)), lambda v: v in ROUNDINGS)
_GRAD_LEVELS = _checker(" or ".join(map(repr, LEVELS)), lambda v: v in LEVELS)
_GRAD_SCALE_BITS = _checker(" or ".join(map(str, SCALE_BITS)), lambda v: _is_int(v) and v in SCALE_BITS)
_BLOCK_SIZE = _checker("a power of two from 8 to 65536", lambda v: _is_int(v) and 8 <= v <= 65536 and v & (v - 1) == 0)
_PATTERNS = _checker("a list of parameter-name patterns (strings, fnmatch style)",
                     lambda v: isinstance(v, (list, tuple)) and all(isinstance(p, str) and p for p in v), tuple)
_WEIGHT_CODE = _checker(" or ".join(map(repr, WEIGHT_CODES)), lambda v: v in WEIGHT_CODES)
OFFLOAD_DEVICES = ("none", "cpu", "optimizer")
_OFFLOAD = _checker(" or ".join(map(repr, OFFLOAD_DEVICES)), lambda v: v in OFFLOAD_DEVICES)
_SECTION = _checker("a JSON object {...}", lambda v: isinstance(v, dict))
_DTYPE = _checker(
    "None (keep the model's dtype), torch.float32, torch.bfloat16 or torch.float16",
    lambda v: v is None or v in (torch.float32, torch.bfloat16, torch.float16),
)
_BETAS = _checker(
    "a list of two numbers, each in [0, 1)",
    lambda v: isinstance(v, (list, tuple)) and len(v) == 2
    and all(_is_real(beta) and 0 <= beta < 1 for beta in v),
    lambda v: (float(v[0]), float(v[1])),
)


@dataclass(frozen=True, kw_only=True)
class _KeyedConfig:
    """A config whose errors call each field what the user called it: see ``key_of``."""

    input_keys: InitVar[Mapping[str, str] | None] = None
    """The key each field was read from, by field name (``hpz_partition_size`` ->
    ``zero_optimization.zero_hpz_partition_size``); the DeepSpeed reader sets it, and a field not in
    it is called by its name. Not a setting: configs that differ only here are equal."""

    def __post_init__(self, input_keys: Mapping[str, str] | None) -> None:
        object.__setattr__(self, "_input_keys", dict(input_keys or {}))

    def key_of(self, name: str) -> str:
        """What the user called field ``name``: the DeepSpeed key it was read from, or the field
        name for a config built directly. Every error raised from a field's value names it so,
        here and in the checks that run later (``zeropp.techniques.hpz.check_hpz``, ``zeropp.setup.sharding``)."""
        return self._input_keys.get(name, name)


def _check_fields(config: _KeyedConfig, checks: Mapping[str, Checker]) -> None:
    """Run each field's checker under the field's key and store the normalised value (for
    ``__post_init__``)."""
    for name, check in checks.items():
        object.__setattr__(config, name, check(config.key_of(name), getattr(config, name)))


def _check_params(key: str, params: Any, checks: Mapping[str, Checker]) -> dict[str, Any]:
    """Check every entry of the object ``params``; a name without a checker is an error."""
    for name, value in _SECTION(key, params).items():
        if name not in checks:
            raise ValueError(f"{key}.{name}={reprlib.repr(value)} is not allowed; "
                             f"{key} accepts only {', '.join(checks)}")
    return {name: checks[name](f"{key}.{name}", value) for name, value in params.items()}


def _check_type_name(key: str, value: Any, names: Mapping[str, Any], any_case: bool) -> str:
    """The spelling of ``value`` among ``names``, matched ignoring case if ``any_case``."""
    for name in names:
        if value == name or (any_case and isinstance(value, str) and value.lower() == name.lower()):
            return name
    _reject(key, value, "one of " + ", ".join(names) + (" (any case)" if any_case else ""))


_ZEROPP_CHECKS: dict[str, Checker] = {
    **dict.fromkeys(("quantized_weights", "quantized_nontrainable_weights", "quantized_gradients",
                     "quantize_intra_node_weights", "error_feedback", "low_bit_trainable_weights", "overlap",
                     "hierarchical_gather", "offload_pin_memory", "quantized_replica_gradients", "audit_fallback",
                     "weight_deltas"),
                    _BOOL),
    "delta_bits": _WEIGHT_BITS,
    "delta_reference": _checker("'weights' or 'codes'", lambda v: v in ("weights", "codes")),
    "delta_block_size": _optional(_BLOCK_SIZE),
    "offload": _OFFLOAD,
    "hpz_partition_size": _POSITIVE_INT,
    "block_size": _BLOCK_SIZE,
    "grad_block_size": _optional(_BLOCK_SIZE),
    "grad_slice_bytes": _optional(_POSITIVE_INT),
    "audit_every": _NON_NEGATIVE_INT,
    "grad_error_budget": _NON_NEGATIVE,
    "weight_bits": _WEIGHT_BITS,
    "weight_code": _WEIGHT_CODE,
    "unquantized_parameters": _PATTERNS,
    "grad_full_precision_parameters": _PATTERNS,
    "grad_full_precision_below": _NON_NEGATIVE_INT,
    "grad_wide_parameters": _PATTERNS,
    **dict.fromkeys(("grad_bits_intra", "grad_bits_inter"), _GRAD_BITS),
    "grad_rotation": _GRAD_ROTATION,
    "grad_rounding": _GRAD_ROUNDING,
    "grad_levels": _GRAD_LEVELS,
    "grad_scale_bits": _GRAD_SCALE_BITS,
    **dict.fromkeys(("param_dtype", "reduce_dtype"), _DTYPE),
}


@dataclass(frozen=True, kw_only=True)
class ZeroPPConfig(_KeyedConfig):
    """Which ZeRO++ techniques to apply on top of FSDP2, and how (docs/design.md: qwZ, hpZ, qgZ)."""

    quantized_weights: bool = False
    """qwZ: block-quantize the forward weight all-gather (DeepSpeed zero_quantized_weights)."""
    quantized_nontrainable_weights: bool = False
    """qwZ for frozen parameters too (DeepSpeed zero_quantized_nontrainable_weights)."""
    hpz_partition_size: int = 1
    """hpZ: ranks sharing the post-forward secondary copy; 1 = off (zero_hpz_partition_size)."""
    quantized_gradients: bool = False
    """qgZ: two-hop quantized all-to-all reduce-scatter (DeepSpeed zero_quantized_gradients), over
    each unit's shard group (on a 2-D mesh its data-parallel sub-mesh)."""
    quantized_replica_gradients: bool = False
    """HSDP (units sharded on a (replicate, shard) mesh): the gradients' reduction across the
    replicas, HSDP's cross-node traffic, as a quantized reduce-scatter and all-gather at
    ``grad_bits_inter`` bits instead of FSDP2's all-reduce in the reduce dtype; every replica
    decodes the same codes, so replicas never drift apart. See zeropp.techniques.replicas [Note: the
    replicas' reduction]."""
    block_size: int = 256
    """Consecutive elements sharing one quantization scale; a power of two from 8 to 65536."""
    weight_bits: int = 8
    """Bits per weight element in the qwZ all-gather: 2 to 8. The ZeRO++ paper pretrains with 8
    or 6 and fine-tunes frozen weights with 4 or 2; below 4 on trainable weights needs
    ``low_bit_trainable_weights``. ``block_size * weight_bits`` must be a multiple of 32."""
    weight_code: str = "symmetric"
    """qwZ's block code: "symmetric" (levels on [-absmax, absmax], one fp32 scale per block) or
    "asymmetric" (all 2**weight_bits levels from the block's minimum to its maximum, an fp32
    scale and center per block; at 4 bits and block_size 32, llama.cpp's Q4_1 levels, so a
    frozen base read from a Q4_1 file travels without loss). See zeropp.codes.weightcode."""
    unquantized_parameters: tuple[str, ...] = ()
    """fnmatch patterns of parameter names (as ``model.named_parameters()`` spells them) that qwZ
    gathers in their own precision where it would quantize them, e.g. ``("*embed_tokens*",)``:
    QLoRA's convention of a 4-bit base whose embedding and output head stay in 16 bits. The
    cost model (``zeropp plan``) prices every parameter as quantized."""
    low_bit_trainable_weights: bool = False
    """Allow ``weight_bits`` below 4 with ``quantized_weights`` (which quantizes the weights being
    trained, not only frozen ones): an explicit opt-in, since 2 bits leave three levels per block."""
    grad_bits_intra: int = 8
    """Bits per gradient element on qgZ's intra-node hop: 2, 4 or 8. 8 (the default) cuts this hop's
    error 16-fold on the fast link and leaves the cross-node hop, the bytes qgZ exists to cut, at
    ``grad_bits_inter``: the cross-node bytes are DeepSpeed's. Fine-tuning SmolLM2-135M, it took the
    cost of all three techniques from +0.39% to +0.16% of the held-out loss (docs/results.md,
    "Accuracy on a pretrained model"). 4 is DeepSpeed's code (``zero_quantized_gradients``)."""
    grad_bits_inter: int = 4
    """Bits per gradient element on qgZ's inter-node hop: 2, 4 or 8."""
    weight_deltas: bool = False
    """Keep hpZ's node copy of the weights from step to step and refresh it with each step's
    ``delta_bits`` differences instead of gathering the weights across nodes: after a step each
    rank codes the difference between its new shard and what the nodes hold, the ranks of its
    local index on the other nodes decode it into their copy, and every gather, forward and
    backward, runs inside the node from the copy. Every node's copy is the same bit for bit; it
    lies within half a step of the last difference's code of the weights (a closed loop: the next
    difference carries the last one's rounding). A load, ``load_state_dict``, any edit of the
    weights outside the optimizer step and ``zeropp.refresh_weights`` send the weights whole
    instead. Needs hpZ over whole nodes (``hpz_partition_size`` = ranks per node); replaces qwZ's
    forward gather. See zeropp.techniques.deltas [Note: weight differences]."""
    delta_bits: int = 4
    """Bits per element of ``weight_deltas``' differences: 2 to 8."""
    delta_block_size: int | None = None
    """Elements sharing one scale in ``weight_deltas``' code; None takes ``block_size``."""
    delta_reference: str = "weights"
    """How ``weight_deltas`` keeps its node copy: "weights" (in the gather dtype: the forward sees
    the weights within the last difference's half step) or "codes" (as qwZ's INT8 codes, as hpZ
    keeps its copy under qwZ: half a bf16 copy's memory and its node gathers' bytes, and the
    forward sees INT8's error on top). See zeropp.techniques.deltas [Note: the copy as codes]."""
    quantize_intra_node_weights: bool = False
    """qwZ: also quantize all-gathers inside a node (default: full precision). hpZ's backward
    gather sends the codes its copy is kept as either way ([Note: hpZ's copy as qwZ's codes])."""
    error_feedback: bool = False
    """qgZ keeps each hop's quantization residual and adds it back at the next step."""
    grad_rotation: str = "none"
    """qgZ: "hadamard" rotates each whole gradient block by a randomized Hadamard matrix before
    coding (same bytes; lower error for heavy-tailed blocks). See zeropp.codes.gradcode."""
    grad_rounding: str = "nearest"
    """qgZ: "stochastic" rounds gradients without bias, at twice the variance of "nearest"."""
    grad_levels: str = "uniform"
    """qgZ: "normal" codes 2- and 4-bit hops with levels fitted to Gaussian blocks (same bytes;
    0.6x the mean square error on them); 8-bit hops stay evenly spaced."""
    grad_block_size: int | None = None
    """qgZ: elements sharing one scale in the gradient code; None takes ``block_size``."""
    grad_full_precision_parameters: tuple[str, ...] = ()
    """qgZ: fnmatch patterns of parameter names (as ``model.named_parameters()`` spells them) whose
    gradients travel unquantized, in the reduce dtype, inside the same all-to-all payloads, e.g.
    ``("*ln*", "*.bias")``: their reduction is exact up to fp32 summation. See zeropp.techniques.qgz
    [Note: full-precision gradients]."""
    grad_full_precision_below: int = 0
    """qgZ: parameters with fewer elements than this (unsharded) send their gradients unquantized,
    as ``grad_full_precision_parameters`` does; 0 = none. LayerNorm weights and biases are tiny in
    bytes (under 0.5% of a GPT's) and carry most of INT4's error per element ([Note: full-precision
    gradients])."""
    grad_wide_parameters: tuple[str, ...] = ()
    """qgZ: fnmatch patterns of parameter names whose gradients travel at 8 bits on both hops (the
    others at ``grad_bits_intra`` and ``grad_bits_inter``), inside the same payloads, e.g.
    ``("*embed*", "*norm*")``: a middle way between the default code and
    ``grad_full_precision_parameters`` (twice INT4's bytes for them instead of 7.8x), for the
    parameters where the audit or the accuracy verdict finds the error. Needs the plain block code,
    as sparing does. See zeropp.techniques.qgz [Note: wide gradients]."""
    grad_scale_bits: int = 32
    """qgZ: 8 sends each gradient block's scale as an 8-bit code under one fp32 scale per 16
    blocks, so ``grad_block_size=64`` costs 4.156 bits per element at INT4 where blocks of 256
    with fp32 scales cost 4.125 (+0.8%), with a quarter of the elements per scale. See
    zeropp.codes.gradcode [Note: grouped scales]."""
    grad_slice_bytes: int | None = 64 * 2**20
    """qgZ: run both hops over column slices of each unit's gradients, each slice's fp32 rows (all
    ranks' rows of its columns) at most this many bytes, so that the coding buffers, payloads and
    decoded rows are a slice's, not the unit's; the gradients are bit for bit the same. None: one
    slice. The default keeps qgZ's peak within 2.5% of ZeRO-3's at Llama-3-8B's shapes on 64 and 384
    ranks (docs/results.md, "qgZ's memory") while each slice's all-to-all still moves megabytes.
    See zeropp.techniques.qgz [Note: qgZ slices]."""
    overlap: bool = True
    """Run communication beside compute where FSDP2 has no streams to do it (gloo on CPU): each
    unit gathers the next ones while it computes (FSDP2's explicit prefetching, asynchronous
    gathers, qwZ decoding when the gather is waited for), each reduce-scatter's cross-node part
    finishes while the next unit's backward computes (at the latest when backward ends), and the
    next forward's first gathers start when the optimizer step ends. Same bytes, same values bit
    for bit; up to two more units' gathers in flight and one reduce-scatter. False runs every
    collective in turn, as FSDP2 does on CPU (docs/decisions.md, "Overlap")."""
    hierarchical_gather: bool = False
    """qwZ: gather over the world in two hops, across nodes among the ranks of one local index,
    then inside the node: a node link carries (N - 1)/N of the payload instead of a ring's
    (W - 1)/W (1/2 instead of 15/16 on 2 nodes of 8). Same values; one more collective per
    gather (inside the node)."""
    offload: str = "none"
    """Where the sharded training state lives: "none" (the device); "cpu": FSDP2's
    ``CPUOffloadPolicy``, parameter and gradient shards and the optimizer's state and step on the
    host, each unit's shard copied to the device just before its gathers (qwZ codes the copy, hpZ's
    copy stays on the device) and its reduced gradient shard copied back (DeepSpeed's
    ``zero_optimization.offload_param``, with or without ``offload_optimizer``, ``{"device": "cpu"}``);
    "optimizer": the parameter shards stay on the device and an fp32 master of each and the
    optimizer's state and step live on the host (``zeropp.fsdp.offload.HostOptimizer``; DeepSpeed's
    ``offload_optimizer`` alone, ZeRO-Offload). ``zeropp.initialize`` and ``ZeroPPTrainer`` move
    their optimizer there; a plain loop wraps its own: ``zeropp.offload_optimizer(optimizer)``."""
    offload_pin_memory: bool = True
    """With ``offload="cpu"``: keep the host shards in page-locked memory (where CUDA is present),
    so the copies to and from the device run asynchronously (DeepSpeed's ``pin_memory``)."""
    audit_every: int = 0
    """Every this many training forwards (micro-batches), one unit, in rotation, runs its next qwZ
    gather and qgZ reduce-scatter beside the exact full-precision collective and records the
    error against the bound its codes allow (``zeropp.audit_report()``; the engine, the HF Trainer
    and Lightning log it); a unit beyond its bound is named in a warning. 0 = off. Its cost, and
    how to turn it on in each stack: docs/guide.md, "The live audit". See zeropp.techniques.audit [Note: the audit]."""
    audit_fallback: bool = False
    """With ``audit_every``: a unit whose error exceeds its bound switches to exact collectives
    (FSDP2's own) from the next training forward on, for the rest of the run."""
    grad_error_budget: float = 0.0
    """qgZ, with ``audit_every``: the relative error (``||coded - exact|| / ||exact||`` of a unit's
    reduced gradient, as the audit measures it) a unit may carry. The first training forward audits
    every unit's qgZ, and the audit's rotation goes on from there; a unit found above the budget
    codes its gradients at 8 bits on both hops (as ``grad_wide_parameters`` does for its parameters)
    from the next training forward on, for the rest of the run. It spends cross-node bytes only on
    the units whose gradients the 4-bit code fits worst. 0 = off. See zeropp.techniques.audit
    [Note: a per-unit error budget]."""
    param_dtype: torch.dtype | None = None
    """Dtype of compute and of the weight all-gathers (mixed precision); None keeps the model's."""
    reduce_dtype: torch.dtype | None = None
    """Dtype of the gradient reduction; None keeps the gradients' dtype."""

    def __post_init__(self, input_keys: Mapping[str, str] | None) -> None:
        super().__post_init__(input_keys)
        _check_fields(self, _ZEROPP_CHECKS)
        self._check_bits()
        key = self.key_of
        if self.grad_full_precision_parameters and not self.quantized_gradients:
            raise ValueError(f"{key('grad_full_precision_parameters')}={list(self.grad_full_precision_parameters)} "
                             "chooses gradients qgZ leaves unquantized, but qgZ is off: set "
                             f"{key('quantized_gradients')}=true or leave it empty")
        if self.grad_wide_parameters and not self.quantized_gradients:
            raise ValueError(f"{key('grad_wide_parameters')}={list(self.grad_wide_parameters)} chooses gradients "
                             f"qgZ codes at 8 bits, but qgZ is off: set {key('quantized_gradients')}=true or leave it "
                             "empty")
        if self.grad_wide_parameters and self.quantized_gradients and not self.gradient_code.is_plain:
            raise ValueError(f"{key('grad_wide_parameters')}={list(self.grad_wide_parameters)} codes some gradients "
                             "at 8 bits, which the plain block code does and the lower-error codes do not "
                             f"({key('grad_rotation')}={self.grad_rotation!r}, {key('grad_rounding')}="
                             f"{self.grad_rounding!r}, {key('grad_levels')}={self.grad_levels!r}, "
                             f"{key('grad_scale_bits')}={self.grad_scale_bits}): leave those at their defaults")
        spares = self.grad_full_precision_parameters or self.grad_full_precision_below
        if spares and self.quantized_gradients and not self.gradient_code.is_plain:
            raise ValueError(f"{key('grad_full_precision_parameters')}={list(self.grad_full_precision_parameters)} / "
                             f"{key('grad_full_precision_below')}={self.grad_full_precision_below} send some "
                             "gradients unquantized, which the plain block code does and the lower-error codes do "
                             f"not ({key('grad_rotation')}={self.grad_rotation!r}, "
                             f"{key('grad_rounding')}={self.grad_rounding!r}, {key('grad_levels')}="
                             f"{self.grad_levels!r}, {key('grad_scale_bits')}={self.grad_scale_bits}): "
                             "leave those at their defaults, or spare no parameter")
        if self.audit_fallback and not self.audit_every:
            raise ValueError(f"{key('audit_fallback')}=true switches a unit the audit finds beyond its bound to exact "
                             f"collectives, but the audit is off: set {key('audit_every')} to a number of steps "
                             "(e.g. 100), or leave audit_fallback false")
        self._check_error_budget()
        if self.weight_deltas and self.hpz_partition_size == 1:
            raise ValueError(f"{key('weight_deltas')}=true keeps hpZ's node copy of the weights from step to step, "
                             f"but hpZ is off: set {key('hpz_partition_size')} to the ranks per node (e.g. 8), or "
                             f"leave {key('weight_deltas')} false")
        if self.hierarchical_gather and not self.quantizes_weights:
            raise ValueError(f"{key('hierarchical_gather')}=true changes qwZ's weight gather, which is off: set "
                             f"{key('quantized_weights')}=true or {key('quantized_nontrainable_weights')}=true, "
                             f"or leave {key('hierarchical_gather')} false")

    def _check_error_budget(self) -> None:
        """The budget widens qgZ's codes, unit by unit, on what the audit measures."""
        if not self.grad_error_budget:
            return
        key, budget = self.key_of, f"{self.key_of('grad_error_budget')}={self.grad_error_budget}"
        if not self.quantized_gradients:
            raise ValueError(f"{budget} widens qgZ's gradient codes, but qgZ is off: set "
                             f"{key('quantized_gradients')}=true, or leave the budget at 0")
        if not self.audit_every:
            raise ValueError(f"{budget} acts on the audit's measured error, but the audit is off: set "
                             f"{key('audit_every')} to a number of steps (e.g. 100), or leave the budget at 0")
        if not self.gradient_code.is_plain:
            raise ValueError(f"{budget} codes a unit's gradients at 8 bits, which the plain block code does and "
                             f"the lower-error codes do not ({key('grad_rotation')}={self.grad_rotation!r}, "
                             f"{key('grad_rounding')}={self.grad_rounding!r}, {key('grad_levels')}="
                             f"{self.grad_levels!r}, {key('grad_scale_bits')}={self.grad_scale_bits}): leave those "
                             "at their defaults, or the budget at 0")

    def _check_bits(self) -> None:
        """Each code width fits the block size, and 2- or 3-bit trainable weights are asked for."""
        key = self.key_of
        widths = {"weight_bits": self.weight_bits} if self.quantizes_weights else {}
        if self.quantized_gradients:
            widths.update(grad_bits_intra=self.grad_bits_intra, grad_bits_inter=self.grad_bits_inter)
        if self.weight_deltas:
            widths.update(delta_bits=self.delta_bits)
        for bits_name, bits in widths.items():
            size_name, size = {"weight_bits": ("block_size", self.block_size),
                               "delta_bits": self._delta_block_key}.get(bits_name, self._grad_block_key)
            if size < min_block_size(bits):
                raise ValueError(f"{key(size_name)}={size} is not allowed with {key(bits_name)}={bits}: a block's "
                                 f"codes must fill whole 4-byte words; allowed: {key(size_name)} >= "
                                 f"{min_block_size(bits)}")
        if self.quantized_weights and self.weight_bits < 4 and not self.low_bit_trainable_weights:
            raise ValueError(
                f"{key('weight_bits')}={self.weight_bits} with {key('quantized_weights')}=true is not allowed: it "
                f"would quantize the weights being trained to {2 ** self.weight_bits - 1} levels per block, and the "
                "ZeRO++ paper uses 2 and 3 bits only for frozen weights. Allowed: "
                f"{key('weight_bits')} >= 4; or {key('quantized_nontrainable_weights')} alone (frozen weights, "
                f"e.g. a LoRA base); or {key('low_bit_trainable_weights')}=true to train through the coarse code "
                "anyway")

    @property
    def _delta_block_key(self) -> tuple[str, int]:
        return ("block_size", self.block_size) if self.delta_block_size is None else \
            ("delta_block_size", self.delta_block_size)

    @property
    def deltas_block_size(self) -> int:
        """The block size of ``weight_deltas``' code."""
        return self._delta_block_key[1]

    @property
    def _grad_block_key(self) -> tuple[str, int]:
        return ("block_size", self.block_size) if self.grad_block_size is None else \
            ("grad_block_size", self.grad_block_size)

    @property
    def gradient_block_size(self) -> int:
        """Elements per scale in qgZ's gradient code: ``grad_block_size``, or ``block_size``."""
        return self._grad_block_key[1]

    @property
    def gradient_code(self) -> GradientCode:
        """qgZ's block code options as one value."""
        return GradientCode(rotation=self.grad_rotation, rounding=self.grad_rounding, levels=self.grad_levels,
                            scale_bits=self.grad_scale_bits)

    @property
    def quantizes_weights(self) -> bool:
        """Whether qwZ codes any weights (all of them, or the frozen ones)."""
        return self.quantized_weights or self.quantized_nontrainable_weights

    @classmethod
    def from_deepspeed(cls, config: dict[str, Any] | str | os.PathLike[str]) -> ZeroPPConfig:
        """The ZeRO++ part of a DeepSpeed config (a dict or the path of a JSON file)."""
        return parse_deepspeed(config).zeropp


_ADAM_PARAMS: dict[str, Checker] = {
    "lr": _NON_NEGATIVE, "betas": _BETAS, "eps": _POSITIVE, "weight_decay": _NON_NEGATIVE,
    **dict.fromkeys(("amsgrad", "adam_w_mode", "torch_adam"), _BOOL),
}
_OPTIMIZER_PARAMS: dict[str, dict[str, Checker]] = {
    "AdamW": _ADAM_PARAMS,
    "Adam": _ADAM_PARAMS,
    "SGD": {"lr": _NON_NEGATIVE, "momentum": _NON_NEGATIVE, "dampening": _NON_NEGATIVE,
            "weight_decay": _NON_NEGATIVE, "nesterov": _BOOL},
}
_DEEPSPEED_ONLY_OPTIMIZER_PARAMS = ("adam_w_mode", "torch_adam")


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """DeepSpeed's ``optimizer`` section: a torch.optim optimizer over the local shards."""

    type: str
    """AdamW, Adam or SGD (any case in the input; stored in this spelling)."""
    params: dict[str, Any] = field(default_factory=dict)
    """The arguments given (numbers as float, betas as a tuple); see ``torch_kwargs``."""

    def __post_init__(self) -> None:
        name = _check_type_name("optimizer.type", self.type, _OPTIMIZER_PARAMS, any_case=True)
        object.__setattr__(self, "type", name)
        params = _check_params("optimizer.params", self.params, _OPTIMIZER_PARAMS[name])
        object.__setattr__(self, "params", params)

    @property
    def torch_class_name(self) -> str:
        """The torch.optim class DeepSpeed builds; its "Adam" is AdamW unless adam_w_mode=false."""
        if self.type == "Adam" and not self.params.get("adam_w_mode", True):
            return "Adam"
        return "SGD" if self.type == "SGD" else "AdamW"

    def torch_kwargs(self) -> dict[str, Any]:
        """Arguments for ``torch_class_name``: DeepSpeed-only switches dropped, and for the Adam
        family DeepSpeed's default weight_decay of 0 made explicit (torch.optim.AdamW defaults
        to 0.01; DeepSpeed passes that default through only with torch_adam)."""
        kwargs = {name: value for name, value in self.params.items()
                  if name not in _DEEPSPEED_ONLY_OPTIMIZER_PARAMS}
        if self.type != "SGD" and not self.params.get("torch_adam", False):
            kwargs.setdefault("weight_decay", 0.0)
        return kwargs


_REQUIRED = object()
"""Stands for the default of a scheduler parameter that has none."""
_WARMUP_TYPE = _checker(
    '"log" or "linear"', lambda v: isinstance(v, str) and v in ("log", "linear"))
_WARMUP_PARAMS: dict[str, tuple[Checker, Any]] = {
    "warmup_min_lr": (_NON_NEGATIVE, 0.0),
    "warmup_max_lr": (_NON_NEGATIVE, 0.001),
    "warmup_num_steps": (_NON_NEGATIVE_INT, 1000),
    "warmup_type": (_WARMUP_TYPE, "log"),
}
_SCHEDULER_PARAMS: dict[str, dict[str, tuple[Checker, Any]]] = {
    "WarmupLR": _WARMUP_PARAMS,
    "WarmupDecayLR": {**_WARMUP_PARAMS, "total_num_steps": (_POSITIVE_INT, _REQUIRED)},
    "WarmupCosineLR": {
        "total_num_steps": (_POSITIVE_INT, _REQUIRED),
        "warmup_min_ratio": (_NON_NEGATIVE, 0.0),
        "warmup_num_steps": (_NON_NEGATIVE_INT, 1000),
        "cos_min_ratio": (_NON_NEGATIVE, 0.0001),
        "warmup_type": (_WARMUP_TYPE, "log"),
    },
}


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """DeepSpeed's ``scheduler`` section: one of DeepSpeed's warmup learning-rate schedules."""

    type: str
    """WarmupLR, WarmupDecayLR or WarmupCosineLR (exact spelling, as DeepSpeed requires)."""
    params: dict[str, Any] = field(default_factory=dict)
    """The schedule's parameters, DeepSpeed's defaults filled in for those not given."""

    def __post_init__(self) -> None:
        name = _check_type_name("scheduler.type", self.type, _SCHEDULER_PARAMS, any_case=False)
        table = _SCHEDULER_PARAMS[name]
        params = _check_params("scheduler.params", self.params,
                               {param: check for param, (check, _) in table.items()})
        for param, (_, default) in table.items():
            if default is _REQUIRED and param not in params:
                raise ValueError(f"scheduler.params.{param} is missing; {name} requires it")
            params.setdefault(param, default)
        object.__setattr__(self, "type", name)
        object.__setattr__(self, "params", params)


_TRAINING_CHECKS: dict[str, Checker] = {
    **dict.fromkeys(("train_batch_size", "train_micro_batch_size_per_gpu",
                     "gradient_accumulation_steps"), _optional(_POSITIVE_INT)),
    **dict.fromkeys(("gradient_clipping", "loss_scale"), _NON_NEGATIVE),
    **dict.fromkeys(("bf16", "fp16", "wall_clock_breakdown", "gather_16bit_weights_on_model_save"), _BOOL),
    "initial_scale_power": _checker("an int from 0 to 127 (2**power is a finite float32)",
                                    lambda v: _is_int(v) and 0 <= v <= 127),
    **dict.fromkeys(("loss_scale_window", "hysteresis", "steps_per_print"), _POSITIVE_INT),
    "min_loss_scale": _POSITIVE,
    "optimizer": _checker("an OptimizerConfig or None",
                          lambda v: v is None or isinstance(v, OptimizerConfig)),
    "scheduler": _checker("a SchedulerConfig or None",
                          lambda v: v is None or isinstance(v, SchedulerConfig)),
}


@dataclass(frozen=True, kw_only=True)
class TrainingConfig(_KeyedConfig):
    """The top-level DeepSpeed training keys that the zeropp engine acts on."""

    train_batch_size: int | None = None
    """Samples per optimizer step over all ranks; None if not given (see ``resolve_batch``)."""
    train_micro_batch_size_per_gpu: int | None = None
    """Samples per rank per forward/backward; None if not given."""
    gradient_accumulation_steps: int | None = None
    """Micro-steps per optimizer step; None if not given."""
    gradient_clipping: float = 0.0
    """Clip the global gradient norm to this value; 0 = no clipping."""
    bf16: bool = False
    """Train in bfloat16 (DeepSpeed bf16.enabled)."""
    fp16: bool = False
    """Train in float16 with loss scaling (DeepSpeed fp16.enabled)."""
    loss_scale: float = 0.0
    """fp16 static loss scale; 0 = dynamic loss scaling."""
    initial_scale_power: int = 16
    """fp16 dynamic loss scaling starts at 2**initial_scale_power."""
    loss_scale_window: int = 1000
    """fp16: steps without overflow before the dynamic scale doubles."""
    hysteresis: int = 2
    """fp16: overflows tolerated before the dynamic scale halves."""
    min_loss_scale: float = 1.0
    """fp16: the dynamic scale never drops below this."""
    optimizer: OptimizerConfig | None = None
    """The optimizer to build, or None when the caller brings its own."""
    scheduler: SchedulerConfig | None = None
    """The learning-rate schedule to build, or None."""
    steps_per_print: int = 10
    """Log progress every this many optimizer steps."""
    wall_clock_breakdown: bool = False
    """Time forward, backward and step separately and log the breakdown."""
    gather_16bit_weights_on_model_save: bool = False
    """Saving the model (``save_16bit_model``, Trainer's ``save_model``) gathers the full weights
    and writes them as one loadable model; False writes only the sharded checkpoint (DeepSpeed's
    ``zero_optimization.stage3_gather_16bit_weights_on_model_save``, False by default there too)."""

    def __post_init__(self, input_keys: Mapping[str, str] | None) -> None:
        super().__post_init__(input_keys)
        _check_fields(self, _TRAINING_CHECKS)
        if self.bf16 and self.fp16:
            raise ValueError(f"{self.key_of('bf16')}=True and {self.key_of('fp16')}=True are both set; "
                             "enable at most one")

    def resolve_batch(self, world_size: int) -> tuple[int, int, int]:
        """(train_batch_size, micro batch per rank, accumulation steps) on ``world_size`` ranks:
        the one not given is filled in as DeepSpeed does, then train = micro * accum * world."""
        _POSITIVE_INT("world_size", world_size)
        train = self.train_batch_size
        micro = self.train_micro_batch_size_per_gpu
        accum = self.gradient_accumulation_steps
        train_key, micro_key, accum_key = map(self.key_of, (
            "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"))
        given = f"{train_key}={train}, {micro_key}={micro}, {accum_key}={accum}, world_size={world_size}"
        if train is not None and micro is not None:
            accum = accum or train // (micro * world_size)
        elif train is not None:
            accum = accum or 1
            micro = train // (accum * world_size)
        elif micro is not None:
            accum = accum or 1
            train = micro * accum * world_size
        else:
            raise ValueError(f"{given}: set {train_key} or {micro_key}")
        if micro < 1 or accum < 1 or train != micro * accum * world_size:
            raise ValueError(f"{given}: {train_key} must equal {micro_key} * {accum_key} * world_size, "
                             "each at least 1")
        return train, micro, accum


@dataclass(frozen=True)
class DeepSpeedConfig:
    """A DeepSpeed config as zeropp understands it."""

    zeropp: ZeroPPConfig
    """The ZeRO++ techniques and their settings."""
    training: TrainingConfig
    """The engine's training settings."""
    ignored_keys: tuple[str, ...]
    """Dotted names of keys present that zeropp reads but does not act on, or does not know."""


_FIELD_CHECKS = {"zeropp": _ZEROPP_CHECKS, "training": _TRAINING_CHECKS}
_DEEPSPEED_KEYS: dict[str, tuple[str, str]] = {
    # dotted DeepSpeed key -> (config, field); the field's checker does the checking
    **{key: ("training", key) for key in (
        "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
        "gradient_clipping", "steps_per_print", "wall_clock_breakdown")},
    "zero_optimization.zero_quantized_weights": ("zeropp", "quantized_weights"),
    "zero_optimization.zero_quantized_nontrainable_weights":
        ("zeropp", "quantized_nontrainable_weights"),
    "zero_optimization.zero_hpz_partition_size": ("zeropp", "hpz_partition_size"),
    "zero_optimization.zero_quantized_gradients": ("zeropp", "quantized_gradients"),
    "zero_optimization.stage3_gather_16bit_weights_on_model_save":
        ("training", "gather_16bit_weights_on_model_save"),
    **{f"zero_optimization.zeropp.{name}": ("zeropp", name) for name in (
        "block_size", "weight_bits", "weight_code", "unquantized_parameters", "grad_full_precision_parameters",
        "grad_full_precision_below", "grad_wide_parameters", "grad_bits_intra", "grad_bits_inter",
        "quantize_intra_node_weights", "error_feedback", "low_bit_trainable_weights", "grad_rotation",
        "grad_rounding", "grad_levels", "grad_block_size", "grad_scale_bits", "overlap", "hierarchical_gather",
        "grad_slice_bytes", "quantized_replica_gradients", "audit_every", "audit_fallback", "grad_error_budget",
        "weight_deltas",
        "delta_bits", "delta_block_size", "delta_reference")},
    "bf16.enabled": ("training", "bf16"),
    "fp16.enabled": ("training", "fp16"),
    **{f"fp16.{name}": ("training", name) for name in (
        "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale")},
}
_INPUT_KEYS: dict[str, dict[str, str]] = {
    config: {field_name: key for key, (where, field_name) in _DEEPSPEED_KEYS.items() if where == config}
    for config in _FIELD_CHECKS}
"""Per config, each field's DeepSpeed key: what a config read from DeepSpeed calls its fields."""
_OFFLOAD_SECTIONS = ("zero_optimization.offload_param", "zero_optimization.offload_optimizer")
_INPUT_KEYS["zeropp"].update(offload="zero_optimization.offload_param.device",
                             offload_pin_memory="zero_optimization.offload_param.pin_memory")
_OFFLOAD_DEVICE = _checker("'cpu' or 'none' ('nvme', ZeRO-Infinity's offload to NVMe, is not implemented)",
                           lambda v: v in ("cpu", "none"))
_OFFLOAD_TUNING = ("buffer_count", "buffer_size", "max_in_cpu", "fast_init", "pipeline", "pipeline_read",
                   "pipeline_write", "nvme_path")
"""DeepSpeed's offload buffers and NVMe pipeline: nothing to size under FSDP2's offload."""
_CHECKED_NOT_ACTED_ON: dict[str, Checker] = {
    # FSDP2 sizes, buckets and overlaps communication per sharded unit by itself
    "zero_optimization.reduce_bucket_size": _NON_NEGATIVE,
    "zero_optimization.stage3_prefetch_bucket_size": _NON_NEGATIVE,
    **dict.fromkeys(("zero_optimization.overlap_comm", "zero_optimization.contiguous_gradients",
                     "zero_optimization.reduce_scatter"), _BOOL),
}
_SIZED_BY_FSDP2 = {
    *_CHECKED_NOT_ACTED_ON, *(f"zero_optimization.{name}" for name in (
        "sub_group_size", "stage3_max_live_parameters", "stage3_max_reuse_distance",
        "stage3_param_persistence_threshold", "allgather_bucket_size", "allgather_partitions",
        "round_robin_gradients", "elastic_checkpoint")),
    *(f"{section}.{name}" for section in _OFFLOAD_SECTIONS for name in _OFFLOAD_TUNING),
}
"""Ignored keys that size or schedule DeepSpeed's own buffers, prefetching and overlap, which
FSDP2 does per sharded unit: named in their own warning, apart from keys that would change
memory or numerics ([Note: ignored keys])."""
_STAGE_KEY = "zero_optimization.stage"
_STAGE = _checker("3 (zeropp implements ZeRO-3 only)", lambda v: _is_int(v) and v == 3)
_SECTIONS = ("zero_optimization", "zero_optimization.zeropp", "bf16", "fp16")
_OWN_SECTION = "zero_optimization.zeropp"
"""zeropp's namespace: an unknown key there is an error, not an ignored key."""
_TYPED_SECTIONS: dict[str, type[OptimizerConfig] | type[SchedulerConfig]] = {
    "optimizer": OptimizerConfig, "scheduler": SchedulerConfig}

_REPORTED_IGNORED_KEYS: set[str] = set()
"""Ignored keys this process has already warned about, so reading a config again stays quiet."""


@dataclass
class _Draft:
    """What the reader has gathered: keyword arguments for both configs, and the keys it skips."""

    zeropp: dict[str, Any] = field(default_factory=dict)
    training: dict[str, Any] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)
    offload: dict[str, tuple[str, bool | None]] = field(default_factory=dict)
    """Offload section -> (device, pin_memory or None when not given)."""


def _read_section(draft: _Draft, section: dict[Any, Any], prefix: str) -> None:
    """Check each key of ``section`` (whose dotted name starts with ``prefix``) into ``draft``."""
    for name, value in section.items():
        key = f"{prefix}{name}"
        if "." in str(name) and prefix != _OWN_SECTION + ".":  # it would pose as a nested key
            draft.ignored.append(key)
        elif key in _SECTIONS:
            _read_section(draft, _SECTION(key, value), key + ".")
        elif key in _DEEPSPEED_KEYS:
            config, field_name = _DEEPSPEED_KEYS[key]
            getattr(draft, config)[field_name] = _FIELD_CHECKS[config][field_name](key, value)
        elif key in _TYPED_SECTIONS:
            draft.training[key] = _read_typed_section(draft, key, _SECTION(key, value))
        elif key in _OFFLOAD_SECTIONS:
            draft.offload[key] = _read_offload_section(draft, key, _SECTION(key, value))
        elif key == _STAGE_KEY:
            _STAGE(key, value)
        elif prefix == _OWN_SECTION + ".":
            allowed = [k.removeprefix(prefix) for k in _DEEPSPEED_KEYS if k.startswith(prefix)]
            raise ValueError(f"{key}={reprlib.repr(value)} is not a zeropp option; "
                             f"{_OWN_SECTION} accepts only {', '.join(allowed)}")
        else:
            if key in _CHECKED_NOT_ACTED_ON:
                _CHECKED_NOT_ACTED_ON[key](key, value)
            draft.ignored.append(key)


def _read_typed_section(
    draft: _Draft, key: str, section: dict[Any, Any]
) -> OptimizerConfig | SchedulerConfig:
    """Build the optimizer or scheduler config from ``type`` and ``params``; skip other keys."""
    if "type" not in section:
        names = _OPTIMIZER_PARAMS if key == "optimizer" else _SCHEDULER_PARAMS
        raise ValueError(f"{key}.type is missing; expected one of {', '.join(names)}")
    draft.ignored.extend(f"{key}.{name}" for name in section if name not in ("type", "params"))
    return _TYPED_SECTIONS[key](type=section["type"], params=section.get("params", {}))


def _read_offload_section(draft: _Draft, key: str, section: dict[Any, Any]) -> tuple[str, bool | None]:
    """An offload section's device and pin_memory; its buffer sizes are ignored (named apart,
    see ``_SIZED_BY_FSDP2``), and any other key (``ratio``: a partial offload) is refused."""
    for name, value in section.items():
        if name in _OFFLOAD_TUNING:
            draft.ignored.append(f"{key}.{name}")
        elif name == "ratio" and _is_real(value) and value == 1:
            pass  # DeepSpeed's default: all of it
        elif name == "ratio":
            raise ValueError(f"{key}.ratio={reprlib.repr(value)} asks for a partial offload, which zeropp does "
                             "not implement; set it to 1 (everything) or leave it out")
        elif name not in ("device", "pin_memory"):
            raise ValueError(f"{key}.{name}={reprlib.repr(value)} is not supported; {key} accepts device "
                             f"('cpu' or 'none'), pin_memory, ratio 1, and DeepSpeed's buffer sizes (ignored: "
                             f"{', '.join(_OFFLOAD_TUNING)})")
    device = _OFFLOAD_DEVICE(f"{key}.device", section.get("device", "none"))
    pin = section.get("pin_memory")
    return device, None if pin is None else _BOOL(f"{key}.pin_memory", pin)


def _resolve_offload(draft: _Draft) -> None:
    """[Note: DeepSpeed's offload keys]
    ``offload_param`` and ``offload_optimizer`` with device "cpu" (Hugging Face's stock ZeRO-3 file
    sets both) are FSDP2's ``CPUOffloadPolicy``: parameter and gradient shards and the optimizer
    step on the host. ``offload_param`` alone gets the same (FSDP2 steps the optimizer where the
    shards are, so its state moves to the host as well: less device memory than asked, never
    more). ``offload_optimizer`` alone (ZeRO-Offload: weights on the device, the optimizer and its
    fp32 master on the host) has no FSDP2 policy: it is ``offload="optimizer"``, zeropp's own
    ``HostOptimizer`` ([Note: the optimizer on the host])."""
    param, optimizer = (draft.offload.get(key, ("none", None)) for key in _OFFLOAD_SECTIONS)
    if param[0] == "cpu":
        draft.zeropp["offload"] = "cpu"
    elif optimizer[0] == "cpu":
        draft.zeropp["offload"] = "optimizer"
    pins = [pin for device, pin in (param, optimizer) if device == "cpu" and pin is not None]
    if pins:
        draft.zeropp["offload_pin_memory"] = any(pins)


def load_deepspeed(config: dict[str, Any] | str | os.PathLike[str]) -> dict[Any, Any]:
    """A DeepSpeed config as a dict: given directly, or read from a JSON file (nothing checked
    beyond its being a JSON object)."""
    if isinstance(config, dict):
        return config
    if not isinstance(config, (str, os.PathLike)):
        _reject("config", config, "a dict or the path of a JSON file")
    path = pathlib.Path(config)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as error:  # JSONDecodeError is a ValueError
        message = f"DeepSpeed config {str(path)!r} is not readable JSON: {error}"
        raise ValueError(message) from error
    if not isinstance(raw, dict):
        raise ValueError(f"DeepSpeed config {str(path)!r} holds a JSON {type(raw).__name__} at "
                         "the top level; expected a JSON object {...}")
    return raw


def _report_ignored(keys: list[str]) -> None:
    """[Note: ignored keys]
    Name the ignored keys this process has not named before, in two warnings: those that size
    DeepSpeed's own buffers and overlap (FSDP2 does that per unit, so nothing is lost), and the
    rest, which under DeepSpeed could change memory or numerics and here do nothing."""
    new_keys = [key for key in keys if key not in _REPORTED_IGNORED_KEYS]
    _REPORTED_IGNORED_KEYS.update(new_keys)
    sized = [key for key in new_keys if key in _SIZED_BY_FSDP2]
    other = [key for key in new_keys if key not in _SIZED_BY_FSDP2]
    if sized:
        logger.warning("zeropp does not act on these DeepSpeed config keys, which size DeepSpeed's buffers, "
                       "prefetching and overlap (FSDP2 gathers, reduces and overlaps per sharded unit): %s",
                       ", ".join(sized))
    if other:
        logger.warning("zeropp does not implement these DeepSpeed config keys; under DeepSpeed they may change "
                       "memory or numerics, here they do nothing: %s", ", ".join(other))


def parse_deepspeed(config: dict[str, Any] | str | os.PathLike[str]) -> DeepSpeedConfig:
    """Read a DeepSpeed config (a dict, or the path of a JSON file) into zeropp's configs.

    Raises ValueError, and only ValueError, for what zeropp cannot honour: a wrong type or value,
    a ZeRO stage other than 3, an unresolved "auto", bf16 and fp16 both enabled. Keys zeropp does
    not act on are listed in ``ignored_keys`` and named in one warning per process.
    """
    raw = load_deepspeed(config)
    draft = _Draft()
    _read_section(draft, raw, "")
    _resolve_offload(draft)
    if "stage" not in raw.get("zero_optimization", {}):
        raise ValueError(f"{_STAGE_KEY} is missing; zeropp implements ZeRO-3 only, so set it to 3")
    if draft.training.get("bf16"):
        draft.zeropp["param_dtype"] = torch.bfloat16
    elif draft.training.get("fp16"):
        draft.zeropp["param_dtype"] = torch.float16
    parsed = DeepSpeedConfig(zeropp=ZeroPPConfig(**draft.zeropp, input_keys=_INPUT_KEYS["zeropp"]),
                             training=TrainingConfig(**draft.training, input_keys=_INPUT_KEYS["training"]),
                             ignored_keys=tuple(draft.ignored))
    _report_ignored(draft.ignored)
    return parsed
