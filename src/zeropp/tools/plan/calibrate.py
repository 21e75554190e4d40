"""Fitting the machine constants of the emulated cluster (gloo on CPU) from measured step times.

[Note: calibration]
Without overlap ([Note: overlap]) a step's time is compute, plus every collective's call latency,
transfer and codec work, plus the optimizer. Seven constants: seconds per FLOP, per activation
element (layers x tokens x width), per collective call, per coded element and per sharded
parameter updated enter linearly; the CPU's sending rate and the link's efficiency (its rate over
the nominal one) enter through each transfer's max(CPU time, link time). The fit searches the two
nonlinear ones on a log grid, refined twice around the best point, and for each solves the five
linear ones by least squares on relative errors (each equation divided by its measured time, so
a 20 s step does not outweigh a 0.2 s one), every constant non-negative: a coefficient that comes
out negative is dropped and the rest refitted until none is. Compute is the same in every mode of
one model, so separating FLOPs from elementwise work needs two model sizes at least.

Steps run with zeropp's ``overlap`` are priced by [Note: overlap on a CPU backend] in
``zeropp.tools.plan.cost`` from the same constants and one more, the part of the shorter of
CPU and link time that runs beside the other: fitted on those steps (on a grid of 0.01) once
the seven are fitted on the steps without it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from zeropp.config import ZeroPPConfig
from zeropp.setup.topology import Topology
from zeropp.tools.plan.cost import (
    Machine,
    Workload,
    activation_elements,
    link_bytes,
    overlapped_step,
    sharded_parameters,
    step_flops,
    weighted_sends,
)
from zeropp.tools.plan.model import ModelShape
from zeropp.tools.plan.traffic import step_transfers

LINEAR = ("flops", "activation_elements", "calls", "coded_elements", "sharded_parameters")
"""The constants a step time is linear in (seconds per each), in ``Fit.coefficients`` order."""
SEND_RATES = np.logspace(6, 11, 51)
"""The CPU sending rates searched first (bytes/s)."""
LINK_EFFICIENCIES = np.linspace(0.3, 1.5, 49)
"""The link efficiencies searched first (achieved over nominal rate)."""


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """One measured step: a mode (``config``; None for HSDP) of ``model`` at a link rate."""

    model: ModelShape
    config: ZeroPPConfig | None
    workload: Workload
    topology: Topology
    link_bytes_per_s: float | None
    """The inter-node rate the links were set to (None: no limit)."""
    step_s: float
    label: str = ""


@dataclass(frozen=True)
class _Amounts:
    """One measured step's amounts: the linear features, per collective the bytes this rank
    sends and the seconds its node link needs at the nominal rate (0 without a limit), and
    whether its collectives run beside compute (``overlap``)."""

    linear: np.ndarray
    sent: np.ndarray
    link_seconds: np.ndarray
    overlapped: bool = False


def overlapped(m: Measurement) -> bool:
    """Whether ``m``'s collectives run beside compute on the backend's threads (zeropp's ``overlap``)."""
    return m.config is not None and m.config.overlap


def amounts(m: Measurement, serial_cost: Mapping[str, float]) -> _Amounts:
    """``sent`` is weighted by each collective's ``serial_cost`` (bytes at the reference rate)."""
    transfers = [t for unit in step_transfers(m.model, m.config, m.topology, m.workload.precision) for t in unit
                 if t.group_size > 1 and not t.background]
    linear = np.array([step_flops(m.model, m.workload), activation_elements(m.model, m.workload), len(transfers),
                       sum(t.coded_elements for t in transfers), sharded_parameters(m.model, m.config, m.topology)])
    sent = np.array([weighted_sends(t, "gloo", serial_cost) for t in transfers], dtype=np.float64)
    link = np.zeros(len(transfers))
    if m.link_bytes_per_s is not None:
        link = np.array([link_bytes(t, m.topology, "gloo")[1] for t in transfers]) / m.link_bytes_per_s
    return _Amounts(linear, sent, link, overlapped(m))


def _transfer_seconds(a: _Amounts, send_rate: float, efficiency: float) -> float:
    """The collectives' share of a step without ``overlap``: each takes the longer of its CPU and
    its link time, one after the other."""
    return float(np.maximum(a.sent / send_rate, a.link_seconds / efficiency).sum())


def _step_seconds(a: _Amounts, coefficients: np.ndarray, send_rate: float, efficiency: float,
                  overlap: float) -> float:
    """A step's time: without ``overlap`` the work plus each collective's longer of CPU and link
    time; with it the longer of the CPU's work and the link's (the optimizer on the link's side
    too) plus the part of the shorter that ``overlap`` leaves (``1 - overlap``), see [Note:
    overlap on a CPU backend]."""
    work = float(a.linear @ coefficients)
    if not a.overlapped:
        return work + _transfer_seconds(a, send_rate, efficiency)
    update = float(a.linear[LINEAR.index("sharded_parameters")] * coefficients[LINEAR.index("sharded_parameters")])
    return overlapped_step(work + float(a.sent.sum()) / send_rate, float(a.link_seconds.sum()) / efficiency + update,
                           overlap)


@dataclass(frozen=True)
class Fit:
    """Fitted constants and how well they explain the measurements."""

    coefficients: tuple[float, ...]
    """Seconds per unit of each of ``LINEAR``."""
    send_bytes_per_s: float
    link_efficiency: float
    relative_errors: tuple[float, ...]
    """(predicted - measured) / measured of every measurement fitted."""
    serial_cost: Mapping[str, float] = field(default_factory=dict)
    """The measured relative cost per sent byte of each collective (``Machine.serial_cost``)."""
    overlap: float = 1.0
    """The part of the shorter of CPU and link time that runs beside the other in steps with
    zeropp's ``overlap`` (``Machine.threads_overlap``; 1 where no such step was fitted)."""

    def machine(self, topology: Topology, link_bytes_per_s: float | None, name: str = "emulated cluster") -> Machine:
        """The fitted cluster at one link rate, for ``zeropp.tools.plan.cost``."""
        per_flop, per_activation, per_call, per_element, per_parameter = self.coefficients
        inf = float("inf")
        link = inf if link_bytes_per_s is None else link_bytes_per_s * self.link_efficiency
        return Machine(name=name, ranks_per_node=topology.ranks_per_node, inter_node_bytes_per_s=link,
                       intra_node_bytes_per_s=inf, latency_s=per_call, flops_per_s=_inverse(per_flop),
                       activation_s_per_element=per_activation, codec_elements_per_s=_inverse(per_element),
                       overlap=0.0, serial_bytes_per_s=self.send_bytes_per_s, update_s_per_parameter=per_parameter,
                       serial_cost=dict(self.serial_cost), backend="gloo", threads_overlap=self.overlap)

    def predict(self, m: Measurement) -> float:
        return _step_seconds(amounts(m, self.serial_cost), np.array(self.coefficients), self.send_bytes_per_s,
                             self.link_efficiency, self.overlap)


def _inverse(x: float) -> float:
    return 1.0 / x if x > 0 else float("inf")


def _linear_fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares of ``x @ c ~ y`` on relative errors (rows already divided by
    the measured times), by dropping the most negative coefficient until none is."""
    scale = np.where(np.abs(x).max(axis=0) > 0, np.abs(x).max(axis=0), 1.0)  # columns of comparable size
    active = [i for i in range(x.shape[1]) if x[:, i].any()]
    coefficients = np.zeros(x.shape[1])
    while active:
        solution, *_ = np.linalg.lstsq(x[:, active] / scale[active], y, rcond=None)
        if (solution >= 0).all():
            coefficients[active] = solution / scale[active]
            break
        active.pop(int(np.argmin(solution)))
    return coefficients


OVERLAPS = np.linspace(0.0, 1.0, 101)
"""The overlap fractions searched for steps with ``overlap``."""


def fit(measurements: Sequence[Measurement], serial_cost: Mapping[str, float] | None = None,
        update_s_per_parameter: float | None = None) -> Fit:
    """The constants that best explain ``measurements``, see [Note: calibration]; ``serial_cost``:
    each collective's measured cost per sent byte relative to the rest (``Machine.serial_cost``;
    one rate for all without it). The steps without ``overlap`` give the seven constants; then
    those with it, if any, give the one fraction of [Note: overlap on a CPU backend].
    ``update_s_per_parameter``: the optimizer's cost per sharded parameter measured on the host
    (``benchmarks/optimizer_rate.py``), kept as it is instead of fitted: on small models its share
    of a step is too small to separate, and a layout whose ranks update more parameters (HSDP's
    shard of half the model where ZeRO-3's is a quarter) then reads fast."""
    serial_cost = dict(serial_cost or {})
    fixed = LINEAR.index("sharded_parameters")
    plain = [m for m in measurements if not overlapped(m)]
    if len(plain) < len(LINEAR) + 2:
        raise ValueError(f"calibration needs at least {len(LINEAR) + 2} measured steps without overlap (one per "
                         f"constant), got {len(plain)}")
    y = np.array([m.step_s for m in measurements])
    if not np.all(np.isfinite(y)) or np.any(y <= 0):
        raise ValueError(f"measured step times must be positive and finite, got {y.tolist()}")
    y = np.array([m.step_s for m in plain])
    steps = [amounts(m, serial_cost) for m in plain]
    x = np.stack([a.linear for a in steps]) / y[:, None]

    x_fitted = x.copy()
    if update_s_per_parameter is not None:
        x_fitted[:, fixed] = 0.0  # not fitted: its share of each step is taken off first

    def solve(send_rate: float, efficiency: float) -> tuple[float, np.ndarray]:
        rest = 1 - np.array([_transfer_seconds(a, send_rate, efficiency) for a in steps]) / y
        if update_s_per_parameter is not None:
            rest = rest - x[:, fixed] * update_s_per_parameter
        coefficients = _linear_fit(x_fitted, rest)
        if update_s_per_parameter is not None:
            coefficients[fixed] = update_s_per_parameter
            rest = rest + x[:, fixed] * update_s_per_parameter
        return float(np.square(x @ coefficients - rest).sum()), coefficients

    rates, efficiencies = SEND_RATES, LINK_EFFICIENCIES
    for _ in range(3):  # the grid, then two finer ones around its best point
        best = min(((solve(r, e)[0], r, e) for r in rates for e in efficiencies), key=lambda t: t[0])
        _, rate, efficiency = best
        rate_step, efficiency_step = rates[1] / rates[0], efficiencies[1] - efficiencies[0]
        rates = rate * np.logspace(-1, 1, 21, base=rate_step)
        efficiencies = efficiency + np.linspace(-1, 1, 21) * efficiency_step
    _, coefficients = solve(rate, efficiency)
    with_overlap = [(amounts(m, serial_cost), m.step_s) for m in measurements if overlapped(m)]
    overlap = 1.0
    if with_overlap:
        overlap = float(min(OVERLAPS, key=lambda o: sum(
            (_step_seconds(a, coefficients, rate, efficiency, o) / step_s - 1) ** 2 for a, step_s in with_overlap)))
    fitted = Fit(tuple(float(c) for c in coefficients), float(rate), float(efficiency), (), serial_cost, overlap)
    errors = tuple((fitted.predict(m) - m.step_s) / m.step_s for m in measurements)
    return replace(fitted, relative_errors=errors)
