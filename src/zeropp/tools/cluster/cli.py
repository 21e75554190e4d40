"""``zeropp cluster up|down|status|bytes`` and ``zeropp launch``: the emulated cluster's commands."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from zeropp.tools.cluster.launch import launch
from zeropp.tools.cluster.netns import (
    Cluster,
    ClusterError,
    check_support,
    format_bandwidth,
    node_address,
    node_namespace,
    parse_bandwidth,
    remove_leftovers,
)


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    """``zeropp cluster up|down|status|bytes``."""
    actions = parser.add_subparsers(dest="cluster_command", required=True)
    up = actions.add_parser("up", help="build N nodes joined by a bridge, links limited to --bandwidth")
    up.add_argument("--nodes", type=int, required=True)
    up.add_argument("--bandwidth", "--inter-node-bandwidth", type=_bandwidth, default=None,
                    help="per-link rate in tc syntax (100mbit, 1gbit) or 'unlimited' (default)")
    up.set_defaults(func=_up)
    actions.add_parser("down", help="remove every zpp- namespace and what runs in it").set_defaults(func=_down)
    actions.add_parser("status", help="nodes, addresses, link rate and bytes").set_defaults(func=_status)
    counters = actions.add_parser("bytes", help="bytes each node's link has carried since up")
    counters.add_argument("--json", action="store_true", help="print JSON instead of a table")
    counters.set_defaults(func=_bytes)


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """``zeropp launch --nodes N --nproc-per-node D [options] -- CMD ...``."""
    parser.usage = "zeropp launch --nodes N --nproc-per-node D [options] -- CMD ..."
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--nproc-per-node", type=int, required=True)
    parser.add_argument("--bandwidth", "--inter-node-bandwidth", type=_bandwidth, default=None,
                        help="per-link rate in tc syntax; default: a running cluster's, else unlimited")
    parser.add_argument("--keep", action="store_true", help="leave a cluster this launch built up afterwards")
    parser.add_argument("--master-port", type=int, default=29500)
    parser.add_argument("--bytes-json", type=Path, help="also write the per-link byte counts here")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="script.py ARGS, -m module ARGS, or an executable")
    parser.set_defaults(func=_launch)


def _bandwidth(text: str) -> str:
    try:
        parse_bandwidth(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def _supported() -> bool:
    reason = check_support()
    if reason is not None:
        print(f"zeropp: cannot build an emulated cluster here: {reason}", file=sys.stderr)
    return reason is None


def _up(args: argparse.Namespace) -> int:
    if not _supported():
        return 2
    try:
        cluster = Cluster(args.nodes, args.bandwidth)
        cluster.up()
    except (ClusterError, ValueError) as error:
        print(f"zeropp cluster up: {error}", file=sys.stderr)
        return 1
    print(f"up: {cluster.num_nodes} nodes ({', '.join(_node_names(cluster))}), links "
          f"{format_bandwidth(cluster.bandwidth_bits)}")
    return 0


def _down(args: argparse.Namespace) -> int:
    removed = remove_leftovers()
    print(f"removed {', '.join(removed)}" if removed else "no zpp- namespaces to remove")
    return 0


def _status(args: argparse.Namespace) -> int:
    cluster = _current()
    if cluster is None:
        return 1
    print(f"{cluster.num_nodes} nodes, links {format_bandwidth(cluster.bandwidth_bits)}")
    print(format_link_bytes(cluster.link_bytes(), names=_node_names(cluster)))
    return 0


def _bytes(args: argparse.Namespace) -> int:
    cluster = _current()
    if cluster is None:
        return 1
    counts = cluster.link_bytes()
    print(json.dumps(counts, indent=2) if args.json else format_link_bytes(counts))
    return 0


def _current() -> Cluster | None:
    try:
        cluster = Cluster.current()
    except ClusterError as error:
        print(f"zeropp cluster: {error}", file=sys.stderr)
        return None
    if cluster is None:
        print("no emulated cluster is up (zeropp cluster up --nodes N)", file=sys.stderr)
    return cluster


def _node_names(cluster: Cluster) -> list[str]:
    return [f"{node_namespace(k)} {node_address(k)}" for k in range(cluster.num_nodes)]


def format_link_bytes(counts: dict[int, dict[str, int]], names: list[str] | None = None) -> str:
    """A table of bytes sent and received per node link, with the total."""
    names = names or [f"node {k}" for k in counts]
    width = max(len(name) for name in [*names, "total"])
    rows = [f"{'link':<{width}}  {'sent (B)':>14}  {'received (B)':>14}"]
    for name, node in zip(names, counts):
        rows.append(f"{name:<{width}}  {counts[node]['tx_bytes']:>14,}  {counts[node]['rx_bytes']:>14,}")
    total_tx, total_rx = (sum(c[key] for c in counts.values()) for key in ("tx_bytes", "rx_bytes"))
    rows.append(f"{'total':<{width}}  {total_tx:>14,}  {total_rx:>14,}")
    return "\n".join(rows)


def _launch(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not _supported():
        return 2
    try:
        result = launch(command, args.nodes, args.nproc_per_node, args.bandwidth, keep=args.keep,
                        master_port=args.master_port)
    except (ClusterError, ValueError) as error:
        print(f"zeropp launch: {error}", file=sys.stderr)
        return 1
    if result.link_bytes:
        print(f"\ninter-node link bytes during the run ({result.elapsed_s:.1f} s, as Ethernet frames):")
        print(format_link_bytes(result.link_bytes))
    if args.bytes_json is not None:
        record = {"num_nodes": args.nodes, "nproc_per_node": args.nproc_per_node,
                  "bandwidth_bits_per_s": result.bandwidth_bits, "command": command,
                  "exit_code": result.exit_code, "elapsed_s": result.elapsed_s,
                  "links": {str(node): counts for node, counts in result.link_bytes.items()}}
        args.bytes_json.parent.mkdir(parents=True, exist_ok=True)
        args.bytes_json.write_text(json.dumps(record, indent=2) + "\n")
    return result.exit_code
