"""The set-up: from a model, a config and the topology to one plan, checked on every rank, then
installed on FSDP2's units (``zeropp.shard``, ``zeropp.enable``)."""
