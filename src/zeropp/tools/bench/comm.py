"""``zeropp bench comm``: per-step bytes of every mode by link class, from the ledger and the wire.

Each mode trains the benchmark GPT alone on a 2-node x 2-rank emulated cluster (unlimited links)
through ``zeropp launch``; the worker counts every timed step's bytes three ways:

- the ledger's direct sends: what each collective must move (``zeropp.fsdp.ledger``);
- the ledger's backend figure: what gloo's algorithms send, which is what the wire should show
  (see [Note: gloo on the wire]);
- the wire: what the inter-node links' qdiscs carried (Ethernet frames) and what each node's
  loopback carried between its own ranks.

[Note: gloo on the wire]
Measured on this cluster (torch 2.13, gloo, 2 nodes x 2 ranks, a chunk of c bytes per rank;
total over the links, frames / 1.046):
- all_gather on the world: 6c cross the nodes, not the 8c of direct sends. Gloo runs a ring over
  the ranks in order; each rank passes (W-1) chunks to the next, and only the ring edges that
  leave a node (N of the W) cross. The ledger's direct sends count each chunk once per remote
  *rank*; the ring sends some chunks across once for two remote ranks (and others back across).
- reduce_scatter on the world: 12c, not 8c. Gloo has no reduce-scatter: it all-reduces the whole
  W*c input with a ring (each rank sends 2(W-1)c to the next) and keeps its chunk.
- all_to_all (qgZ's hops): exactly the direct sends. all_reduce on an inter-node group of 2
  (HSDP): the ring equals the ledger's reduce-scatter + all-gather.
- Frames: each 1448-byte TCP payload is a 1514-byte frame, so the wire reads 4.6% above payload;
  ACKs add almost nothing. Loopback counts IP packets of up to 64 KB: ~0.1% above payload.
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from zeropp.tools.bench.quant import _machine as machine_info
from zeropp.tools.bench.worker import BENCH_MODES, WorkerConfig
from zeropp.tools.cluster import Cluster, ClusterError, LaunchResult, launch
from zeropp.tools.cluster.netns import CLUSTER_LOCK, list_namespaces

NUM_NODES, RANKS_PER_NODE = 2, 2
FRAME_OVERHEAD = 1514 / 1448
"""Wire bytes per payload byte on the inter-node links: a full TCP segment in an Ethernet frame."""
QUICK_MODEL = {"num_layers": 2, "embed_dim": 128, "num_heads": 4}
"""A 0.43M-parameter GPT for smoke runs (``quick``)."""


@contextmanager
def exclusive_cluster(num_nodes: int, bandwidth: str | None, wait_s: float = 900.0) -> Iterator[Cluster]:
    """A cluster of our own for the block, removed after it. Waits (up to ``wait_s``) while another
    cluster is up; holds ``CLUSTER_LOCK`` only while building, so cluster tests that start meanwhile
    skip ("another cluster is up") instead of waiting for a whole benchmark."""
    deadline = time.monotonic() + wait_s
    with open(CLUSTER_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        while list_namespaces():
            if time.monotonic() > deadline:
                raise ClusterError(f"namespaces {list_namespaces()} stayed up for {wait_s:.0f} s: another "
                                   f"cluster is in use (or left over: `zeropp cluster down`)")
            time.sleep(5)
        cluster = Cluster(num_nodes, bandwidth)
        cluster.up()
    try:
        yield cluster
    finally:
        cluster.down()


def launch_job(module: str, args: list[str], num_nodes: int, ranks_per_node: int, what: object,
               master_port: int = 29511) -> tuple[dict[str, Any], LaunchResult]:
    """Run ``python -m module --out <file> args`` on the running cluster; the JSON record its rank 0
    writes and the launch result (``what``: the job, for the error)."""
    with tempfile.TemporaryDirectory(prefix="zeropp-bench-") as folder:
        out = Path(folder) / "record.json"
        result = launch(["python", "-m", module, "--out", str(out), *args], num_nodes, ranks_per_node,
                        master_port=master_port)
        if result.exit_code != 0 or not out.exists():
            raise RuntimeError(f"the benchmark job {what} failed (exit {result.exit_code})")
        return json.loads(out.read_text()), result


def launch_worker(config: WorkerConfig, num_nodes: int, ranks_per_node: int,
                  master_port: int = 29511) -> tuple[dict[str, Any], LaunchResult]:
    """Run the worker on the running cluster; its record and the launch result."""
    return launch_job("zeropp.tools.bench.worker", config.worker_args(), num_nodes, ranks_per_node, config.modes,
                      master_port)


def link_classes(record: dict[str, Any]) -> dict[str, Any]:
    """One mode's per-step bytes (all ranks together), cross-node and intra-node: the ledger's
    direct sends, the ledger's backend figure, and the wire."""
    direct = {"cross_node": 0.0, "intra_node": 0.0}
    backend = {"cross_node": 0.0, "intra_node": 0.0}
    by_op: dict[str, dict[str, float]] = {}
    for rank_ledger in record["ledger_per_step"]:
        for row in rank_ledger["rows"]:
            direct["cross_node"] += row["cross_node_bytes"]
            direct["intra_node"] += row["bytes"] - row["cross_node_bytes"]
            backend["cross_node"] += row["backend_cross_node_bytes"]
            backend["intra_node"] += row["backend_bytes"] - row["backend_cross_node_bytes"]
            op = by_op.setdefault(f"{row['phase']} {row['op']} {row['kind']} {row['dtype']}",
                                  {"direct_cross_node": 0.0, "backend_cross_node": 0.0})
            op["direct_cross_node"] += row["cross_node_bytes"]
            op["backend_cross_node"] += row["backend_cross_node_bytes"]
    out: dict[str, Any] = {"ledger": backend, "ledger_direct": direct, "by_op": by_op}
    wire = record["wire_per_step"]
    if wire is not None:
        out["wire"] = {"cross_node": wire["cross_node_bytes"], "intra_node": wire["intra_node_bytes"]}
        out["wire_vs_ledger"] = {k: _ratio(out["wire"][k], backend[k]) for k in backend}
        out["wire_vs_direct"] = {k: _ratio(out["wire"][k], direct[k]) for k in direct}
    return out


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def run_each_mode(modes: Sequence[str], config: WorkerConfig, bandwidth: str | None = None
                  ) -> dict[str, dict[str, Any]]:
    """Train every mode in a job of its own on a fresh 2 x 2 cluster; per mode: the worker's
    record plus the job's peak RSS per rank and the launcher's whole-run link bytes."""
    records = {}
    with exclusive_cluster(NUM_NODES, bandwidth):
        for mode in modes:
            record, result = launch_worker(
                replace(config, modes=(mode,)), NUM_NODES, RANKS_PER_NODE)
            records[mode] = {**record["modes"][mode], "num_parameters": record["num_parameters"],
                             "peak_rss_mb": record["peak_rss_mb"], "job_elapsed_s": result.elapsed_s,
                             "job_link_tx_bytes": {str(n): c["tx_bytes"] for n, c in result.link_bytes.items()}}
    return records


def format_table(rows: dict[str, dict[str, Any]]) -> str:
    """Per-step MB (all ranks) by link class: the ledger (backend figure, and direct sends), the
    wire, and wire / ledger."""
    head = (f"{'mode':<6}{'x-node ledger':>14}{'direct':>9}{'wire':>9}{'wire/ledger':>12}"
            f"{'intra ledger':>13}{'direct':>9}{'loopback':>9}{'lo/ledger':>10}")
    lines = ["per-step MB over all ranks (ledger: what gloo's algorithms send; direct: the direct "
             "sends; wire: link frames / loopback packets)", head]
    for mode, r in rows.items():
        mb = lambda x: f"{x / 1e6:.1f}" if x is not None else "n/a"  # noqa: E731
        ratio = lambda x: f"{x:.3f}" if x is not None else "n/a"  # noqa: E731
        wire = r.get("wire", {"cross_node": None, "intra_node": None})
        vs = r.get("wire_vs_ledger", {"cross_node": None, "intra_node": None})
        lines.append(
            f"{mode:<6}{mb(r['ledger']['cross_node']):>14}{mb(r['ledger_direct']['cross_node']):>9}"
            f"{mb(wire['cross_node']):>9}{ratio(vs['cross_node']):>12}"
            f"{mb(r['ledger']['intra_node']):>13}{mb(r['ledger_direct']['intra_node']):>9}"
            f"{mb(wire['intra_node']):>9}{ratio(vs['intra_node']):>10}")
    return "\n".join(lines)


def run(out_dir: str = "benchmarks/results", modes: Sequence[str] = BENCH_MODES, steps: int = 2,
        warmup_steps: int = 1, quick: bool = False) -> dict[str, Any]:
    """Measure every mode's per-step bytes, print the table and write ``bench_comm.json``.

    ``quick``: the 0.43M-parameter model and one timed step (a smoke run of the whole path).
    """
    config = WorkerConfig(modes=tuple(modes), steps=1 if quick else steps, warmup_steps=warmup_steps,
                          wire=True, **(QUICK_MODEL if quick else {}))
    started = time.perf_counter()
    records = run_each_mode(modes, config)
    rows = {mode: {**link_classes(record),
                   "peak_rss_mb": record["peak_rss_mb"],
                   "secondary_copy_bytes": record["secondary_copy_bytes"],
                   "median_step_s": record["median_step_s"],
                   "job_link_tx_bytes": record["job_link_tx_bytes"]} for mode, record in records.items()}
    result = {
        "machine": machine_info(torch.device("cpu")),
        "config": {**asdict(config), "num_nodes": NUM_NODES, "ranks_per_node": RANKS_PER_NODE,
                   "bandwidth": "unlimited", "num_parameters": next(iter(records.values()))["num_parameters"],
                   "frame_overhead": FRAME_OVERHEAD, "elapsed_s": time.perf_counter() - started},
        "modes": rows,
        "records": records,
    }
    print(format_table(rows))
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "bench_comm.json")
    with open(path, "w") as file:
        json.dump(result, file, indent=2)
    print(f"\nwrote {path}")
    return result
