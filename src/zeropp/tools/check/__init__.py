"""``zeropp check``: zeropp proven on this machine's GPU in one command, within a time budget.

Sections, most valuable first (``sections.SECTIONS``): correctness (pytest of the CUDA tests),
kernels (the codec's GB/s against a copy), rank (one real rank of a 64- and a 1,024-rank
Llama-3-8B job), gpu_only (torch.compile, bf16, fp16, offload) and nccl (with two GPUs or more).
Each runs in a process of its own within its share of the budget (``budget``, ``runner``);
everything lands in one folder: ``results.json``, ``results.md`` and the logs. Without a GPU
the same command runs every section in a smoke form on the CPU, which the tests run, so the
GPU form never rots.

Needs only torch, Triton and pytest (and transformers for the rank section): nothing here
imports an optional package at module level.
"""
