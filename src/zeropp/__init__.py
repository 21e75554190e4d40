"""zeropp: ZeRO++ (qwZ, hpZ, qgZ) on PyTorch FSDP2.

    model = zeropp.shard(model, zeropp.ZeroPPConfig(quantized_weights=True, hpz_partition_size=8,
                                                    quantized_gradients=True))
"""

from zeropp.config import ZeroPPConfig
from zeropp.engine import ZeroPPEngine, initialize
from zeropp.ledger import CommLedger, comm_ledger
from zeropp.shard import shard
from zeropp.topology import Topology

__all__ = ["CommLedger", "Topology", "ZeroPPConfig", "ZeroPPEngine", "comm_ledger", "initialize", "shard"]
__version__ = "0.1.0"
