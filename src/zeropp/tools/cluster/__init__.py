"""The emulated cluster: nodes as network namespaces joined by bandwidth-limited links, and a
launcher that runs one torchrun per node (``zeropp cluster ...``, ``zeropp launch ...``)."""

from zeropp.tools.cluster.launch import LaunchResult, launch
from zeropp.tools.cluster.netns import Cluster, ClusterError, check_support, parse_bandwidth

__all__ = ["Cluster", "ClusterError", "LaunchResult", "check_support", "launch", "parse_bandwidth"]
