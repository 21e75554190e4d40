"""FSDP2's plumbing: the one module that reaches FSDP2's private state (``access``), the recorded
collectives and their ledger, and what zeropp runs beside FSDP2's own step (the optimizer in
backward, offload, 0-dim parameters, gradients some ranks lack)."""
