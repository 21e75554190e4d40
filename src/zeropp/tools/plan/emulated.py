"""``zeropp plan --calibrate``: fit the emulated cluster's constants on two small models'
measured steps, then predict ``zeropp bench step`` of the 25M GPT, every mode and link rate.

The measurements are ``zeropp bench step`` records (``bench_step.json``): the calibration jobs
train GPTs of 4 x 256 and 6 x 384 (short steps; two sizes, so that compute splits into its
FLOPs and its elementwise work, see [Note: calibration]), the validation job the 25M GPT
(8 x 512), which the fit never sees; steps with zeropp's ``overlap`` add one constant ([Note:
overlap on a CPU backend]). With ``benchmarks/collective_rates.py``'s JSON each
collective's bytes are priced at its own measured cost per byte (``serial_cost``). Results:
``plan_calibration.json`` and ``.png``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from zeropp.config import ZeroPPConfig
from zeropp.setup.topology import Topology
from zeropp.tools.cluster.netns import parse_bandwidth
from zeropp.tools.models import GPTConfig
from zeropp.tools.modes import MODES, System
from zeropp.tools.plan import model as model_shape
from zeropp.tools.plan.calibrate import LINEAR, Fit, Measurement, fit
from zeropp.tools.plan.cost import Workload
from zeropp.tools.plan.traffic import Precision

SHAKESPEARE_VOCAB = 84
"""Distinct characters of the Shakespeare corpus, the benchmark GPT's vocabulary."""
TOLERANCE = 0.15
"""The predictions' target: within 15% of the measured step time."""


def measurements(bench_step: dict[str, Any]) -> list[Measurement]:
    """One ``Measurement`` per (mode, link rate) of a ``bench_step.json`` (peers without a
    ledger, such as DeepSpeed, are left out: the model describes zeropp's and FSDP2's comms)."""
    config = bench_step["config"]
    gpt = GPTConfig(vocab_size=SHAKESPEARE_VOCAB, context_length=config["context_length"],
                    num_layers=config["num_layers"], num_heads=config["num_heads"], embed_dim=config["embed_dim"])
    shape = model_shape.gpt(gpt)
    if shape.num_parameters != config["num_parameters"]:
        raise ValueError(f"the record's model has {config['num_parameters']} parameters, the GPT built from its "
                         f"config {shape.num_parameters}: was it trained on another corpus?")
    topology = Topology(num_nodes=config["num_nodes"], ranks_per_node=config["ranks_per_node"])
    precision = Precision(gather_dtype=getattr(torch, config["param_dtype"]),
                          reduce_dtype=getattr(torch, config["reduce_dtype"]))
    workload = Workload(batch_per_rank=config["batch_size"] // topology.world_size,
                        context_length=config["context_length"], precision=precision)
    out = []
    for record in bench_step["records"]:
        mode = MODES[record["mode"]]
        if mode.system is System.DEEPSPEED:
            continue
        zeropp_config = mode.config(topology.ranks_per_node)
        if mode.system is System.HSDP and zeropp_config == ZeroPPConfig():
            zeropp_config = None  # FSDP2's own HSDP, the plan's convention (``layout.layout_for``)
        rate = parse_bandwidth(record["bandwidth"])
        out.append(Measurement(model=shape, config=zeropp_config, workload=workload, topology=topology,
                               link_bytes_per_s=None if rate is None else rate / 8, step_s=record["median_step_s"],
                               label=f"{shape.name} {record['mode']} {record['bandwidth']}"))
    return out


def compare(fitted: Fit, measured: Sequence[Measurement]) -> list[dict[str, Any]]:
    """Predicted against measured step time, one row per measurement."""
    rows = []
    for m in measured:
        predicted = fitted.predict(m)
        rows.append({"label": m.label, "measured_s": m.step_s, "predicted_s": predicted,
                     "error": (predicted - m.step_s) / m.step_s, "within_tolerance": abs(predicted - m.step_s)
                     <= TOLERANCE * m.step_s})
    return rows


def serial_cost(collective_rates: dict[str, Any]) -> dict[str, float]:
    """``Machine.serial_cost`` from ``benchmarks/collective_rates.py``'s JSON: each collective's
    sending rate at the largest size timed, relative to the reduce-scatter over the world."""
    largest = max(row["output_mb"] for row in collective_rates["rows"])
    rates = {f"{row['op']}/{row['group']}": row["sent_mb_per_s"] for row in collective_rates["rows"]
             if row["output_mb"] == largest}
    if "reduce_scatter/world" not in rates:
        raise ValueError("collective rates must time reduce_scatter over the world (the reference); "
                         f"got {sorted(rates)}")
    return {kind: rates["reduce_scatter/world"] / rate for kind, rate in rates.items()}


def calibrate(calibration: Sequence[dict[str, Any]], validation: Sequence[dict[str, Any]],
              collective_rates: dict[str, Any] | None = None, optimizer_rate: dict[str, Any] | None = None
              ) -> dict[str, Any]:
    """Fit on the ``calibration`` records and predict the ``validation`` ones (``bench_step.json``s);
    with ``collective_rates``, each collective's bytes are weighted by its measured cost
    (``serial_cost``), else one sending rate prices them all; with ``optimizer_rate``
    (``benchmarks/optimizer_rate.py``'s JSON) the optimizer's cost per parameter is the measured
    one, else fitted."""
    fitted_on = [m for record in calibration for m in measurements(record)]
    predicted_for = [m for record in validation for m in measurements(record)]
    weights = serial_cost(collective_rates) if collective_rates is not None else {}
    update = optimizer_rate["update_s_per_parameter"] if optimizer_rate is not None else None
    fitted = fit(fitted_on, weights, update)
    constants = dict(zip(LINEAR, fitted.coefficients, strict=True))
    return {
        "constants": {
            "flops_per_s": _inverse(constants["flops"]),
            "activation_s_per_element": constants["activation_elements"],
            "latency_s": constants["calls"],
            "codec_elements_per_s": _inverse(constants["coded_elements"]),
            "update_s_per_parameter": constants["sharded_parameters"],
            "send_bytes_per_s": fitted.send_bytes_per_s,
            "link_efficiency": fitted.link_efficiency,
            "threads_overlap": fitted.overlap,
        },
        "serial_cost": weights,
        "fitted": compare(fitted, fitted_on),
        "predicted": compare(fitted, predicted_for),
        "tolerance": TOLERANCE,
        "summary": {
            "fitted_within_tolerance": _within(compare(fitted, fitted_on)),
            "predicted_within_tolerance": _within(compare(fitted, predicted_for)),
            "all_sizes_fitted_together_within_tolerance": _within(compare(
                fit([*fitted_on, *predicted_for], weights, update), [*fitted_on, *predicted_for])),
        },
    }


def _within(rows: list[dict[str, Any]]) -> str:
    return f"{sum(row['within_tolerance'] for row in rows)} of {len(rows)}"


def _inverse(x: float) -> float | None:
    return 1.0 / x if x > 0 else None


def format_table(result: dict[str, Any]) -> str:
    lines = [f"{'':<10}{'step':<34}{'measured s':>11}{'predicted s':>12}{'error':>8}"]
    for part in ("fitted", "predicted"):
        for row in result[part]:
            lines.append(f"{part:<10}{row['label']:<34}{row['measured_s']:>11.3f}{row['predicted_s']:>12.3f}"
                         f"{row['error']:>+8.1%}")
    lines.append("within 15%: " + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in result["summary"].items()))
    c = result["constants"]
    lines.append("constants: " + ", ".join(f"{k}={v:.3g}" if v is not None else f"{k}=none" for k, v in c.items()))
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """Predicted against measured step time, log-log, the 15% band shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 5.5))
    everything = [r for part in ("fitted", "predicted") for r in result[part]]
    low = min(min(r["measured_s"], r["predicted_s"]) for r in everything) * 0.8
    high = max(max(r["measured_s"], r["predicted_s"]) for r in everything) * 1.2
    line = [low, high]
    ax.plot(line, line, "k-", lw=0.8)
    ax.fill_between(line, [v * (1 - TOLERANCE) for v in line], [v * (1 + TOLERANCE) for v in line],
                    color="grey", alpha=0.2, label="within 15%")
    for part, marker in (("fitted", "o"), ("predicted", "s")):
        for model in dict.fromkeys(r["label"].split(" ")[1] for r in result[part]):
            rows = [r for r in result[part] if r["label"].split(" ")[1] == model]
            ax.scatter([r["measured_s"] for r in rows], [r["predicted_s"] for r in rows], marker=marker,
                       label=f"GPT {model} ({'fitted' if part == 'fitted' else 'predicted, not fitted'})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured step time (s), zeropp bench step")
    ax.set_ylabel("predicted step time (s), zeropp plan")
    ax.set_title("emulated 2x2 cluster, every mode, three link rates")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(calibration_paths: Sequence[Path], validation_paths: Sequence[Path], out_dir: Path,
        collective_rates_path: Path | None = None, optimizer_rate_path: Path | None = None) -> dict[str, Any]:
    """Calibrate on some ``bench_step.json``s, predict others; print, write JSON and PNG."""
    for path in [*calibration_paths, *validation_paths]:
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist: measure it with zeropp bench step --model LAYERSxWIDTH "
                                    "--param-dtype float32 --no-memory --out <its folder> (docs/measurements.md)")
    if collective_rates_path is not None and not collective_rates_path.is_file():
        raise FileNotFoundError(f"{collective_rates_path} does not exist: measure it with zeropp launch --nodes 2 "
                                "--nproc-per-node 2 --bandwidth unlimited -- benchmarks/collective_rates.py --out "
                                f"{collective_rates_path}")
    if optimizer_rate_path is not None and not optimizer_rate_path.is_file():
        raise FileNotFoundError(f"{optimizer_rate_path} does not exist: measure it with python "
                                f"benchmarks/optimizer_rate.py --out {optimizer_rate_path}")
    rates = json.loads(collective_rates_path.read_text()) if collective_rates_path is not None else None
    optimizer = json.loads(optimizer_rate_path.read_text()) if optimizer_rate_path is not None else None
    result = calibrate([json.loads(p.read_text()) for p in calibration_paths],
                       [json.loads(p.read_text()) for p in validation_paths], rates, optimizer)
    result["calibration_records"] = [str(p) for p in calibration_paths]
    result["validation_records"] = [str(p) for p in validation_paths]
    result["collective_rates"] = str(collective_rates_path) if collective_rates_path is not None else None
    result["optimizer_rate"] = str(optimizer_rate_path) if optimizer_rate_path is not None else None
    print(format_table(result))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "plan_calibration.json").write_text(json.dumps(result, indent=2))
    plot(result, out_dir / "plan_calibration.png")
    print(f"wrote {out_dir / 'plan_calibration.json'} and plan_calibration.png")
    return result
