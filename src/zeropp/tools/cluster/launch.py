"""Launchers: a torchrun job on the emulated cluster, one torchrun per node as on a real
cluster (``launch``), and a job of several declared nodes on this machine (``launch_local``).

Node ``k`` runs ``torchrun --nnodes N --node-rank k --nproc-per-node D --master-addr 10.77.0.1
--master-port P CMD`` inside its namespace (static rendezvous on node 0's address, as under SLURM),
under its own hostname ``zpp-n{k}``. Ranks of one node talk over its loopback; ranks of different
nodes over the shaped links, which count every byte that crosses them.

[Note: teardown] Every torchrun starts in its own process group. When one exits non-zero, the
others are stopped (SIGTERM to their groups: torchrun forwards it to its workers, which it starts
as leaders of process groups of their own), then SIGKILL for anything still running in a node's namespace after a
grace period; the same happens on SIGINT / SIGTERM to the launcher. A cluster the launcher built is
then removed unless ``keep``; one that was already up stays up.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

from zeropp.setup.topology import RANKS_PER_NODE_ENV
from zeropp.tools.cluster.netns import (
    NODE_INTERFACE,
    Cluster,
    ClusterError,
    format_bandwidth,
    namespace_pids,
    node_address,
    node_namespace,
    parse_bandwidth,
    stop_processes,
)

MASTER_PORT = 29500
STOP_GRACE_S = 15.0
"""How long torchrun gets to stop its workers after SIGTERM before everything left is killed."""


class LaunchResult(NamedTuple):
    """What a launch returns: the exit code and what crossed the inter-node links."""

    exit_code: int
    """0, or the first non-zero torchrun exit code (128 + signal number if the launcher was stopped)."""
    link_bytes: dict[int, dict[str, int]]
    """Per node, ``tx_bytes`` / ``rx_bytes`` its link carried during the run, as Ethernet frames."""
    elapsed_s: float
    """From starting the nodes' torchruns to the last one stopping."""
    bandwidth_bits: int | None
    """The links' rate during the run (None: unlimited)."""


class _Stopped(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by signal {signum}")
        self.signum = signum


def script_arguments(command: list[str]) -> tuple[str, list[str]]:
    """The interpreter to run torchrun with, and torchrun's trailing arguments for ``command``.

    ``script.py args`` and ``-m module args`` run under Python; a leading ``python`` (bare name:
    the launcher's own interpreter; a path: that interpreter) is dropped; anything else is an
    executable (torchrun's ``--no-python``).
    """
    interpreter = sys.executable
    if command and Path(command[0]).name.startswith("python") and not command[0].endswith(".py"):
        interpreter = command[0] if "/" in command[0] else sys.executable
        command = command[1:]
    if not command or command == ["-m"]:
        raise ValueError(f"launch needs a command after '--': a script, '-m module' or an executable; "
                         f"got {command!r}")
    if command[0] == "-m" or command[0].endswith(".py"):
        return interpreter, command
    return interpreter, ["--no-python", *command]


def node_command(node: int, num_nodes: int, nproc_per_node: int, command: list[str],
                 master_port: int = MASTER_PORT) -> list[str]:
    """The command line that runs ``node``'s torchrun in its namespace under its own hostname."""
    interpreter, tail = script_arguments(command)
    hostname = node_namespace(node)
    set_hostname = 'echo "$0" > /proc/sys/kernel/hostname && exec "$@"'
    return ["ip", "netns", "exec", node_namespace(node), "unshare", "--uts", "sh", "-c", set_hostname, hostname,
            interpreter, "-m", "torch.distributed.run", f"--nnodes={num_nodes}", f"--node-rank={node}",
            f"--nproc-per-node={nproc_per_node}", f"--master-addr={node_address(0)}",
            f"--master-port={master_port}", *tail]


def rank_environment() -> dict[str, str]:
    """The launcher's environment plus what every rank needs on the emulated cluster."""
    return {**os.environ, "GLOO_SOCKET_IFNAME": NODE_INTERFACE, "OMP_NUM_THREADS": "1"}


def launch(command: list[str], num_nodes: int, nproc_per_node: int, bandwidth: str | None = None,
           keep: bool = False, master_port: int = MASTER_PORT) -> LaunchResult:
    """Run ``command`` on ``num_nodes`` x ``nproc_per_node`` ranks; see [Note: teardown].

    ``bandwidth`` (tc syntax) limits the links; None leaves a running cluster's limit as it is and
    builds a new one unlimited.
    """
    if isinstance(nproc_per_node, bool) or not isinstance(nproc_per_node, int) or nproc_per_node < 1:
        raise ValueError(f"nproc_per_node must be a positive int, got {nproc_per_node!r}")
    commands = [node_command(k, num_nodes, nproc_per_node, command, master_port) for k in range(num_nodes)]
    cluster: Cluster | None = None
    built, nodes, before, after = False, [], {}, {}
    started = time.perf_counter()
    with _signals_raise():
        try:
            cluster, built = _cluster_for(num_nodes, bandwidth)
            print(f"zeropp launch: {num_nodes} nodes x {nproc_per_node} ranks, inter-node links "
                  f"{format_bandwidth(cluster.bandwidth_bits)}", flush=True)
            before, started = cluster.link_bytes(), time.perf_counter()
            for node_argv in commands:
                nodes.append(subprocess.Popen(node_argv, env=rank_environment(), start_new_session=True))
            exit_code = _wait(nodes)
        except _Stopped as stop:
            print(f"zeropp launch: stopped by {signal.Signals(stop.signum).name}, stopping every node",
                  file=sys.stderr, flush=True)
            exit_code = 128 + stop.signum
        finally:
            _ignore_signals()
            elapsed = time.perf_counter() - started
            if cluster is not None:
                try:
                    _stop_nodes(nodes, cluster.num_nodes)
                    after = cluster.link_bytes() if before else {}
                finally:
                    if built and not keep:
                        cluster.down()
    delta = {node: {key: after[node][key] - before[node][key] for key in after[node]} for node in after}
    return LaunchResult(exit_code, delta, elapsed, cluster.bandwidth_bits if cluster else None)


def _cluster_for(num_nodes: int, bandwidth: str | None) -> tuple[Cluster, bool]:
    """The running cluster (re-limited if ``bandwidth`` is given) or a new one; and whether it is new."""
    cluster = Cluster.current()
    if cluster is None:
        cluster = Cluster(num_nodes, bandwidth)
        cluster.up()
        return cluster, True
    if cluster.num_nodes != num_nodes:
        raise ClusterError(f"a cluster of {cluster.num_nodes} nodes is up but --nodes is {num_nodes}: "
                           f"run `zeropp cluster down` or launch with --nodes {cluster.num_nodes}")
    if bandwidth is not None:
        cluster.set_bandwidth(parse_bandwidth(bandwidth))
    return cluster, False


def _wait(nodes: list[subprocess.Popen]) -> int:
    """Wait for every node's torchrun; the first non-zero exit code seen, else 0."""
    while True:
        codes = [node.poll() for node in nodes]
        failed = [(node, code) for node, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            node, code = failed[0]
            print(f"zeropp launch: node {node} exited with {code}, stopping the others",
                  file=sys.stderr, flush=True)
            return code
        if all(code == 0 for code in codes):
            return 0
        time.sleep(0.1)


def _stop_nodes(nodes: list[subprocess.Popen], num_nodes: int) -> None:
    """SIGTERM every running torchrun's group, wait, then kill whatever still runs in a node namespace."""
    running = [node for node in nodes if node.poll() is None]
    for node in running:
        try:
            os.killpg(node.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + STOP_GRACE_S
    while any(node.poll() is None for node in running) and time.monotonic() < deadline:
        time.sleep(0.1)
    stop_processes({pid for k in range(num_nodes) for pid in namespace_pids(node_namespace(k))}, 0.0)
    for node in nodes:
        node.wait()


@contextmanager
def _signals_raise() -> Iterator[None]:
    """Within the block, SIGINT and SIGTERM raise ``_Stopped`` once; handlers restored after."""
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}

    def stop(signum: int, frame: object) -> None:
        _ignore_signals()
        raise _Stopped(signum)

    for signum in previous:
        signal.signal(signum, stop)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _ignore_signals() -> None:
    """Teardown must not be interrupted half-way."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)


def launch_local(module: str, module_args: list[str], num_nodes: int, ranks_per_node: int) -> int:
    """Run ``python -m module`` on num_nodes x ranks_per_node local processes through torchrun,
    declaring the layout with ``ZEROPP_RANKS_PER_NODE`` (one machine standing in for several
    nodes, without link limits); returns torchrun's exit code."""
    env = {**os.environ, RANKS_PER_NODE_ENV: str(ranks_per_node), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={num_nodes * ranks_per_node}", "-m", module, *module_args]
    return subprocess.call(command, env=env)
