"""The live audit: a job measures its own compression error against the bound its codes allow.

[Note: the audit]
With ``ZeroPPConfig.audit_every = N``, every N-th training forward (a grad-enabled forward of the
model in training mode, one per micro-batch) arms one unit, in rotation over the units with a
quantized collective: its next qwZ weight gather and its next qgZ gradient reduce-scatter each
run the exact collective beside the quantized one (the full-precision all-gather of the same
shards; the full-precision reduce-scatter, in fp32, of the same gradients) and hold the
quantized result against it:

- the error, ``||quantized - exact||_2``, and the bound its codes allow, derived from the exact
  values alone ([Note: block-constant bounds] in ``zeropp.codes.bounds``); for qgZ every coding of
  both hops adds its bound, which travels in the exact reduce-scatter beside the gradients;
- per block, the error must not exceed the block's bound. A block over its bound is not noise:
  the codes were corrupted, or the code is wrong.

The numbers of all ranks are summed in one all-reduce over the world, so every rank records the
same row (``AuditRow``: unit, technique, step, relative error, relative bound) and takes the same
decision. A unit over its bound is named in a warning; with ``audit_fallback`` it switches to
exact collectives (FSDP2's own, counted; hpZ keeps FSDP2's decoded copy) from the next training
forward on, for the rest of the run, and its row says so. The quantized results are what the
step uses, untouched: with no fault, the audit changes no number. Its bytes are booked under
"audit" in the ledger; on an audited step it holds one unit's exact gather, or one qgZ slice's
exact rows and bounds (twice the slice in fp32).

[Note: a per-unit error budget]
With ``grad_error_budget = e``, qgZ's bits follow what the audit measures, unit by unit: the first
training forward arms every unit's qgZ reduce-scatter (one exact fp32 reduce-scatter of the whole
model, once), the rotation goes on every ``audit_every`` forwards, and a unit whose qgZ row's
relative error is above ``e`` codes its gradients at 8 bits on both hops (``grad_wide_parameters``'
codes, [Note: wide gradients] in ``zeropp.techniques.qgz``) from the next training forward on, for
the rest of the run. The row is summed over the world, so every rank widens the same units at the
same forward and the payloads stay the same size on every rank. Widening never reverts: a unit's
gradients do not get easier to code as training goes on, and a unit that went back and forth
would change its bytes from step to step. The row says it (``widened``); ``zeropp.explain``
prices the bits the job started with, and the ledger counts what the widened units send.

Not audited: hpZ's backward gathers from its copy (their input is FSDP2's placeholders; they
send the forward's codes, so they are bit for bit the weights the forward's gather was checked
on), the replicas' reduction of quantized HSDP, and units gathered as bytes (mixed dtypes).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from zeropp.codes.bounds import block_norms, relative_norm
from zeropp.codes.codec import ChunkCodec
from zeropp.fsdp.comms import Recorder, all_gather, all_reduce_sum

logger = logging.getLogger("zeropp")

TECHNIQUE = "audit"
"""The ledger's name for the audit's exact collectives."""


@dataclass(frozen=True)
class AuditRow:
    """One audited collective: how far the quantized result was from the exact one."""

    unit: str
    """The unit's path in the model ("the root" for the root)."""
    technique: str
    """"qwZ" (the weight gather), "qgZ" (the gradient reduce-scatter) or "deltas" (the node copy
    of ``weight_deltas`` against the master shards: ``zeropp.techniques.deltas``)."""
    step: int
    """The training forward (1, 2, ...: micro-batches, counted by the audit) it ran in."""
    relative_error: float
    """``||quantized - exact|| / ||exact||`` over every rank's result."""
    bound: float
    """``||bound|| / ||exact||``: the relative error the codes allow at most."""
    within_bound: bool
    """Whether every block's error stayed within its bound."""
    fell_back: bool = False
    """The unit switched to exact collectives after this row (``audit_fallback``)."""
    widened: bool = False
    """The unit's gradients travel at 8 bits on both hops after this row (``grad_error_budget``,
    [Note: a per-unit error budget])."""


@dataclass
class Tally:
    """Sums of squares over the blocks of one audited result, and how many blocks broke their bound."""

    error_sq: float = 0.0
    exact_sq: float = 0.0
    bound_sq: float = 0.0
    violations: int = 0

    def add(self, codec: ChunkCodec, result: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor) -> None:
        """Compare ``result`` with ``exact`` (rows shaped as ``codec`` codes them) block by block,
        against the block-constant ``bound``. A block whose exact values are not finite is left
        out, and counts as broken unless the result's block is not finite either."""
        error = block_norms(codec, result.float() - exact.float())
        norms = block_norms(codec, exact)
        bounds = block_norms(codec, bound)
        finite = torch.isfinite(norms) & torch.isfinite(bounds)
        over = error > bounds * (1 + 1e-5) + 1e-30  # False where the error is NaN
        broken = (finite & (over | ~torch.isfinite(error))) | (~finite & torch.isfinite(error))
        self.error_sq += error[finite].double().square().sum().item()
        self.exact_sq += norms[finite].double().square().sum().item()
        self.bound_sq += bounds[finite].double().square().sum().item()
        self.violations += int(broken.sum().item())


@dataclass
class Request:
    """One armed collective: the audit it reports to, the unit and the step."""

    audit: Audit
    unit_index: int
    step: int

    def record(self, technique: str, tally: Tally) -> AuditRow:
        """Sum the tally over the world (every rank calls this for the same collective), record
        the row and return it (the same on every rank)."""
        return self.audit.record(self, technique, tally)


@dataclass
class AuditedUnit:
    """A unit whose collectives the audit checks, and how it falls back to exact ones."""

    name: str
    comms: list[Auditable]
    """Its qwZ all-gather and qgZ reduce-scatter, those it has."""
    fall_back: Callable[[], None]
    """Install exact collectives on the unit (run between training steps, on every rank)."""
    widen: Callable[[], None] | None = None
    """Code the unit's qgZ gradients at 8 bits on both hops (None: it has no qgZ)."""


class Auditable:
    """A comm the audit can arm: it checks its next quantized collective against the exact one."""

    technique: str
    """What the audit's rows call it: "qwZ", "qgZ" or "deltas"."""
    audit_request: Request | None = None

    def take_audit(self) -> Request | None:
        request, self.audit_request = self.audit_request, None
        return request


@dataclass
class Audit:
    """One model's audit ([Note: the audit])."""

    every: int
    fallback: bool
    units: list[AuditedUnit]
    recorder: Recorder
    rows: list[AuditRow] = field(default_factory=list)
    passes: int = 0
    """Training forwards seen."""
    audits: int = 0
    """Units armed so far (the rotation's position)."""
    error_budget: float = 0.0
    """``grad_error_budget`` ([Note: a per-unit error budget]); 0: off."""
    fallen: set[int] = field(default_factory=set)
    """Units that fell back (or will, at the next training forward)."""
    widened: set[int] = field(default_factory=set)
    """Units whose qgZ codes at 8 bits (or will, from the next training forward)."""
    _pending: list[int] = field(default_factory=list)
    _pending_widen: list[int] = field(default_factory=list)

    def before_forward(self, model: nn.Module) -> None:
        """The root's forward pre-hook: count training forwards, install pending fallbacks, arm
        the next unit every ``every`` of them."""
        if not (model.training and torch.is_grad_enabled()):
            return
        while self._pending:
            self.units[self._pending.pop()].fall_back()
        while self._pending_widen:
            if (index := self._pending_widen.pop()) not in self.fallen:
                self.units[index].widen()
        self.passes += 1
        if self.passes == 1 and self.error_budget:
            self._arm_every_gradient_code()
        candidates = [i for i in range(len(self.units)) if i not in self.fallen]
        if self.passes % self.every or not candidates:
            return
        index = candidates[self.audits % len(candidates)]
        self.audits += 1
        for comm in self.units[index].comms:
            comm.audit_request = Request(self, index, self.passes)

    def _arm_every_gradient_code(self) -> None:
        """Arm every unit's qgZ for this forward ([Note: a per-unit error budget])."""
        for index, unit in enumerate(self.units):
            for comm in unit.comms:
                if comm.technique == "qgZ":
                    comm.audit_request = Request(self, index, self.passes)

    def record(self, request: Request, technique: str, tally: Tally) -> AuditRow:
        totals = torch.tensor([tally.error_sq, tally.exact_sq, tally.bound_sq, tally.violations],
                              dtype=torch.float64)
        all_reduce_sum(totals, None, self.recorder, TECHNIQUE)
        error_sq, exact_sq, bound_sq, violations = totals.tolist()
        unit = self.units[request.unit_index]
        within = violations == 0
        falls_back = not within and self.fallback and request.unit_index not in self.fallen
        relative_error = relative_norm(error_sq, exact_sq)
        widens = (technique == "qgZ" and unit.widen is not None and relative_error > self.error_budget > 0
                  and request.unit_index not in self.widened | self.fallen and not falls_back)
        row = AuditRow(unit.name, technique, request.step, relative_error, relative_norm(bound_sq, exact_sq),
                       within, falls_back, widens)
        self.rows.append(row)
        if widens:
            self.widened.add(request.unit_index)
            self._pending_widen.append(request.unit_index)
            logger.info("zeropp audit: unit %r's qgZ error %.3g (relative) is above grad_error_budget=%.3g: its "
                        "gradients travel at 8 bits on both hops from the next step on", unit.name, relative_error,
                        self.error_budget)
        if within:
            return row
        then = ("it uses exact collectives from the next step on (audit_fallback)" if falls_back else
                "set audit_fallback=true to switch such a unit to exact collectives")
        logger.warning("zeropp audit: unit %r's %s at step %d is off by %.3g (relative), beyond the %.3g its "
                       "codes allow, in %d block(s): its codes were corrupted or the code is wrong; %s",
                       unit.name, technique, request.step, row.relative_error, row.bound, int(violations), then)
        if falls_back:
            self.fallen.add(request.unit_index)
            self._pending.append(request.unit_index)
        return row


_AUDITS: weakref.WeakKeyDictionary[nn.Module, Audit] = weakref.WeakKeyDictionary()
_HOOKED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
"""Roots that carry the audit's pre-forward hook (added once; it runs the root's current audit)."""


def install_audit(model: nn.Module, audit: Audit | None) -> None:
    """Make ``audit`` the model's (None: no audit)."""
    if audit is None:
        _AUDITS.pop(model, None)
        return
    _AUDITS[model] = audit
    if model not in _HOOKED:
        model.register_forward_pre_hook(_before_forward, prepend=True)  # before FSDP2 gathers, prefetches included
        _HOOKED.add(model)


def _before_forward(model: nn.Module, *_: object) -> None:
    if (audit := _AUDITS.get(model)) is not None:
        audit.before_forward(model)


def audit_report(model: nn.Module | None = None) -> list[AuditRow]:
    """The audit's rows so far ([Note: the audit]): of the audited models in ``model`` (the
    model itself or its submodules: a wrapper such as a PEFT model or a LightningModule), or
    of every audited model of this process. Empty when ``audit_every`` is off."""
    if model is None:
        audits = list(_AUDITS.values())
    else:
        audits = [audit for module in model.modules() if (audit := _AUDITS.get(module)) is not None]
    return [row for audit in audits for row in audit.rows]


def audit_log_line(row: AuditRow) -> str:
    """One row as a log line."""
    state = "within its bound" if row.within_bound else "BEYOND its bound"
    after = ("; fell back to exact collectives" if row.fell_back else
             "; its gradients go to 8 bits (grad_error_budget)" if row.widened else "")
    return (f"zeropp audit: step {row.step} unit {row.unit!r} {row.technique}: relative error "
            f"{row.relative_error:.3g}, bound {row.bound:.3g}, {state}{after}")


def audit_metrics(rows: Sequence[AuditRow]) -> dict[str, float]:
    """The newest row of each technique as flat metrics for a training logger:
    ``zeropp/audit/<technique>/relative_error``, ``.../bound`` and ``.../over_bound`` (0 or 1)."""
    metrics: dict[str, float] = {}
    for row in rows:
        prefix = f"zeropp/audit/{row.technique}"
        metrics.update({f"{prefix}/relative_error": row.relative_error, f"{prefix}/bound": row.bound,
                        f"{prefix}/over_bound": float(not row.within_bound)})
    return metrics


class ReportCursor:
    """The rows of a model's audit not yet handed out: what a logger has not logged."""

    def __init__(self, model: nn.Module) -> None:
        self._model = weakref.ref(model)
        self._seen = 0

    def new_rows(self) -> list[AuditRow]:
        model = self._model()
        rows = audit_report(model) if model is not None else []
        fresh, self._seen = rows[self._seen:], len(rows)
        return fresh


def exact_gather_rows(input_tensor: torch.Tensor, group: dist.ProcessGroup, group_size: int,
                      recorder: Recorder) -> torch.Tensor:
    """The full-precision all-gather of ``input_tensor`` over ``group``: (group_size, numel)."""
    exact = input_tensor.new_empty((group_size, input_tensor.numel()))
    all_gather(exact.view(-1), input_tensor.reshape(-1), group, recorder, TECHNIQUE)
    return exact
