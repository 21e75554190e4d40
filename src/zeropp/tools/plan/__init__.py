"""The cost model: what a step of each mode sends, how long it takes and what it holds, on any
cluster (``zeropp plan``)."""
