"""An emulated cluster on one Linux machine: network namespaces, veth pairs, a bridge and tc.

Node ``k`` is the namespace ``zpp-n{k}`` with its own loopback (the unshaped intra-node link) and
one interface ``eth0`` at ``10.77.0.{k+1}/24``. Every ``eth0`` is one end of a veth pair whose other
end, ``n{k}``, is a port of the bridge ``br0`` in the switch namespace ``zpp-sw``. No interface
or address is created in the caller's namespace, so the cluster's addresses exist only inside it
and its traffic never leaves it; the one file outside is each node's hosts file under
/etc/netns/zpp-n{k}. [Note: shaping] explains how the inter-node bandwidth is set and measured.

Every change is a checked ``ip`` / ``tc`` call: a failure raises ``ClusterError`` naming the
command and its stderr. Every name starts with ``zpp-``, so ``remove_leftovers`` can find a
crashed run's namespaces.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

NAMESPACE_PREFIX = "zpp-"
SWITCH_NAMESPACE = "zpp-sw"
BRIDGE = "br0"
NODE_INTERFACE = "eth0"
"""The node side of its link; ``GLOO_SOCKET_IFNAME`` names it so gloo binds its address."""
MAX_NODES = 250
"""Node addresses are 10.77.0.1 ... 10.77.0.250 in one /24."""
NETNS_ETC = Path("/etc/netns")
CLUSTER_LOCK = Path(tempfile.gettempdir()) / "zeropp-cluster.lock"
"""Held while a cluster is built (benchmarks) or used (tests): the namespace names are fixed, so
one emulated cluster at a time on a machine."""
"""``ip netns exec NAME`` bind-mounts the files of /etc/netns/NAME over /etc: each node's hosts file."""

# [Note: shaping]
# A qdisc sees only what leaves an interface, so each link has one per end: on the node's eth0 (what
# the node sends) and on the switch port n{k} (what it receives). With a bandwidth they are tbf:
# veth hands TCP segments of up to 64 KB to the qdisc (segmentation offload) and tbf must split or
# drop a packet larger than its bucket, so the burst must be at least 64 KB or throughput collapses; it
# grows with the rate so the bucket holds a few milliseconds of traffic, and the queue holds
# LATENCY_MS of traffic before tbf drops. Without one they are pfifo, which only counts.
# Those two qdiscs' byte counters are the ground truth for inter-node traffic: everything a node
# sends to or receives from another node passes them, loopback traffic between ranks of one node
# never does. They count what a real wire carries: every 1448-byte TCP payload as a 1514-byte
# Ethernet frame, however large the offload segments were (the veth's own counters count an
# offload segment's headers once, so their overhead changes with the rate). Replacing a qdisc
# (a new bandwidth) restarts its counters.
MIN_BURST_BYTES = 64 * 1024
BURST_SECONDS = 0.004
LATENCY_MS = 100

_SI = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_IEC = {"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_RATE = re.compile(r"(\d+(?:\.\d+)?)\s*(|k|m|g|t|ki|mi|gi|ti)(bit|bps)", re.IGNORECASE)


class ClusterError(RuntimeError):
    """An ``ip`` or ``tc`` call failed, or the cluster is not in the state an action needs."""


def parse_bandwidth(text: str | None) -> int | None:
    """Bits per second of a tc-style rate (``100mbit``, ``1gbit``, ``500kbit``, ``10mbps`` = bytes/s),
    or None for no limit (``None``, ``unlimited``, ``none``)."""
    if text is None or text.strip().lower() in ("unlimited", "none"):
        return None
    match = _RATE.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"bandwidth {text!r} is not a rate: use tc syntax such as 100mbit, 1gbit, "
                         f"500kbit, 10mbps (bytes/s), or 'unlimited'")
    number, prefix, unit = match.groups()
    prefix = prefix.lower()
    bits = float(number) * (_IEC.get(prefix) or _SI[prefix]) * (8 if unit.lower() == "bps" else 1)
    if bits < 8000:
        raise ValueError(f"bandwidth {text!r} is below 8kbit; give a positive rate of at least 8kbit")
    return int(bits)


def format_bandwidth(bits_per_s: int | None) -> str:
    """A rate for people: ``100 Mbit/s``, ``1 Gbit/s``, ``unlimited``."""
    if bits_per_s is None:
        return "unlimited"
    for scale, unit in ((10**9, "Gbit/s"), (10**6, "Mbit/s"), (10**3, "kbit/s")):
        if bits_per_s >= scale:
            return f"{bits_per_s / scale:g} {unit}"
    return f"{bits_per_s} bit/s"


def node_namespace(node: int) -> str:
    return f"{NAMESPACE_PREFIX}n{node}"


def node_address(node: int) -> str:
    """The IPv4 address of ``node``'s eth0 (node 0 hosts torchrun's rendezvous)."""
    return f"10.77.0.{node + 1}"


def run_checked(command: list[str]) -> str:
    """Run one ``ip`` / ``tc`` command; its stdout, or ``ClusterError`` with the command and stderr."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise ClusterError(f"`{' '.join(command)}` could not run: {error}") from None
    if done.returncode != 0:
        raise ClusterError(f"`{' '.join(command)}` failed (exit {done.returncode}): {done.stderr.strip()}")
    return done.stdout


def check_support() -> str | None:
    """Why an emulated cluster cannot be built here, or None if it can.

    Tries what ``Cluster.up`` needs in a throwaway namespace: creating it, a veth pair and a tbf qdisc.
    """
    if os.geteuid() != 0:
        return "the emulated cluster needs root (network namespaces, veth and tc); run as root"
    missing = [tool for tool in ("ip", "tc", "unshare") if shutil.which(tool) is None]
    if missing:
        return f"the emulated cluster needs iproute2 and util-linux; not on PATH: {', '.join(missing)}"
    probe = f"{NAMESPACE_PREFIX}probe{os.getpid()}"
    try:
        run_checked(["ip", "netns", "add", probe])
    except ClusterError as error:
        return f"network namespaces are not permitted here (a container without CAP_SYS_ADMIN?): {error}"
    try:
        run_checked(["ip", "-n", probe, "link", "add", "probe0", "type", "veth", "peer", "name", "probe1"])
        run_checked(["tc", "-n", probe, "qdisc", "add", "dev", "probe0", "root", *_link_qdisc(10**9)])
    except ClusterError as error:
        return f"veth pairs or the tbf qdisc are not available: {error}"
    finally:
        run_checked(["ip", "netns", "del", probe])
    return None


def _link_qdisc(bits_per_s: int | None) -> list[str]:
    """The qdisc for one end of a link (see [Note: shaping])."""
    if bits_per_s is None:
        return ["pfifo"]
    burst = max(MIN_BURST_BYTES, int(bits_per_s / 8 * BURST_SECONDS))
    return ["tbf", "rate", f"{bits_per_s}bit", "burst", str(burst), "latency", f"{LATENCY_MS}ms"]


def list_namespaces() -> list[str]:
    """Every namespace whose name starts with ``zpp-``: a cluster's, or a crashed run's leftovers."""
    names = [line.split()[0] for line in run_checked(["ip", "netns", "list"]).splitlines() if line.strip()]
    return sorted(name for name in names if name.startswith(NAMESPACE_PREFIX))


def remove_leftovers(grace_s: float = 3.0) -> list[str]:
    """Stop the processes still inside ``zpp-`` namespaces and delete the namespaces, which removes
    their veths and the bridge, and their hosts files. Returns the names removed."""
    names = list_namespaces()
    stop_processes({pid for name in names for pid in namespace_pids(name)}, grace_s)
    for name in names:
        run_checked(["ip", "netns", "del", name])
    for folder in NETNS_ETC.glob(f"{NAMESPACE_PREFIX}*"):
        shutil.rmtree(folder)
    return names


def namespace_pids(namespace: str) -> set[int]:
    """Processes running in ``namespace``."""
    return {int(pid) for pid in run_checked(["ip", "netns", "pids", namespace]).split()}


def stop_processes(pids: set[int], grace_s: float) -> None:
    """SIGTERM ``pids``, then SIGKILL those still alive after ``grace_s`` seconds."""
    _signal_all(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while pids and time.monotonic() < deadline:
        time.sleep(0.1)
        pids = {pid for pid in pids if _alive(pid)}
    _signal_all(pids, signal.SIGKILL)


def _signal_all(pids: set[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class Cluster:
    """``num_nodes`` namespaces on a bridge, inter-node links limited to ``bandwidth`` (tc syntax,
    None = unlimited). ``with Cluster(2, "100mbit") as cluster:`` builds it and always removes it."""

    def __init__(self, num_nodes: int, bandwidth: str | None = None) -> None:
        if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or not 1 <= num_nodes <= MAX_NODES:
            raise ValueError(f"num_nodes must be an int in [1, {MAX_NODES}], got {num_nodes!r}")
        self.num_nodes = num_nodes
        self.bandwidth_bits = parse_bandwidth(bandwidth)

    def __repr__(self) -> str:
        return f"Cluster(num_nodes={self.num_nodes}, bandwidth={format_bandwidth(self.bandwidth_bits)!r})"

    def __enter__(self) -> Cluster:
        self.up()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.down()

    def up(self) -> None:
        """Build the switch and every node; on any failure remove what was built and re-raise."""
        existing = list_namespaces()
        if existing:
            raise ClusterError(f"namespaces {existing} already exist (a cluster is up, or a crashed run "
                               f"left them): run `zeropp cluster down` first")
        try:
            self._add_switch()
            for node in range(self.num_nodes):
                self._add_node(node)
            self._write_hosts_files()
            self.set_bandwidth(self.bandwidth_bits)
        except BaseException:
            remove_leftovers()
            raise

    def down(self) -> None:
        """Remove every ``zpp-`` namespace (and stop what still runs in them)."""
        remove_leftovers()

    def _add_switch(self) -> None:
        sw = ["ip", "-n", SWITCH_NAMESPACE]
        run_checked(["ip", "netns", "add", SWITCH_NAMESPACE])
        run_checked([*sw, "link", "add", BRIDGE, "type", "bridge"])
        run_checked([*sw, "link", "set", BRIDGE, "addrgenmode", "none"])
        run_checked([*sw, "link", "set", BRIDGE, "up"])

    def _add_node(self, node: int) -> None:
        """The node's namespace, loopback up, and its veth from eth0 to the bridge port n{node}.

        ``addrgenmode none`` keeps IPv6 link-local chatter off the links, so their counters hold
        only what the ranks send (and ARP).
        """
        namespace, port = node_namespace(node), f"n{node}"
        sw, ns = ["ip", "-n", SWITCH_NAMESPACE], ["ip", "-n", namespace]
        run_checked(["ip", "netns", "add", namespace])
        run_checked([*ns, "link", "set", "lo", "up"])
        run_checked([*sw, "link", "add", port, "type", "veth", "peer", "name", NODE_INTERFACE,
                     "netns", namespace])
        run_checked([*sw, "link", "set", port, "addrgenmode", "none"])
        run_checked([*sw, "link", "set", port, "master", BRIDGE, "up"])
        run_checked([*ns, "link", "set", NODE_INTERFACE, "addrgenmode", "none"])
        run_checked([*ns, "addr", "add", f"{node_address(node)}/24", "dev", NODE_INTERFACE])
        run_checked([*ns, "link", "set", NODE_INTERFACE, "up"])

    def _write_hosts_files(self) -> None:
        """Every node resolves every node's name (``zpp-n{k}``, also its hostname under the launcher)."""
        lines = ["127.0.0.1 localhost", "::1 localhost"]
        for k in range(self.num_nodes):  # the IPv4-mapped form answers reverse look-ups on IPv6 sockets
            lines += [f"{node_address(k)} {node_namespace(k)}", f"::ffff:{node_address(k)} {node_namespace(k)}"]
        for node in range(self.num_nodes):
            folder = NETNS_ETC / node_namespace(node)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text("\n".join(lines) + "\n")

    def set_bandwidth(self, bits_per_s: int | None) -> None:
        """Limit every link, both directions, to ``bits_per_s`` (None: no limit); restarts the counters."""
        for node in range(self.num_nodes):
            for namespace, device in _link_ends(node):
                run_checked(["tc", "-n", namespace, "qdisc", "replace", "dev", device, "root",
                             *_link_qdisc(bits_per_s)])
        self.bandwidth_bits = bits_per_s

    def link_bytes(self) -> dict[int, dict[str, int]]:
        """Per node, the bytes its link has carried since ``up`` (or the last ``set_bandwidth``) as
        Ethernet frames: ``tx_bytes`` sent by the node, ``rx_bytes`` delivered to it."""
        counts = {}
        for node in range(self.num_nodes):
            sent, received = (_root_qdisc(namespace, device, stats=True)["bytes"]
                              for namespace, device in _link_ends(node))
            counts[node] = {"tx_bytes": sent, "rx_bytes": received}
        return counts

    @classmethod
    def current(cls) -> Cluster | None:
        """The cluster that is up now (node count and bandwidth read back), or None if none is.

        Raises ``ClusterError`` for ``zpp-`` namespaces that do not form a whole cluster."""
        names = list_namespaces()
        if not names:
            return None
        num_nodes = sum(1 for name in names if re.fullmatch(rf"{NAMESPACE_PREFIX}n\d+", name))
        if num_nodes == 0 or names != sorted([SWITCH_NAMESPACE, *map(node_namespace, range(num_nodes))]):
            raise ClusterError(f"namespaces {names} do not form a cluster (a crashed run's leftovers?): "
                               f"run `zeropp cluster down`")
        cluster = cls(num_nodes)
        qdisc = _root_qdisc(node_namespace(0), NODE_INTERFACE)
        cluster.bandwidth_bits = int(qdisc["options"]["rate"]) * 8 if qdisc["kind"] == "tbf" else None
        return cluster


def _link_ends(node: int) -> tuple[tuple[str, str], tuple[str, str]]:
    """(namespace, device) of the qdiscs that carry what ``node`` sends, and what it receives."""
    return (node_namespace(node), NODE_INTERFACE), (SWITCH_NAMESPACE, f"n{node}")


def _root_qdisc(namespace: str, device: str, stats: bool = False) -> dict:
    """The root qdisc of ``device`` in ``namespace`` as tc's JSON (``kind``, ``options``, ``bytes`` ...)."""
    command = ["tc", "-n", namespace, *(["-s"] if stats else []), "-j", "qdisc", "show", "dev", device]
    qdiscs = json.loads(run_checked(command) or "[]")
    root = next((q for q in qdiscs if q.get("root")), None)
    if root is None:
        raise ClusterError(f"`{' '.join(command)}` shows no root qdisc: is the cluster up?")
    return root
