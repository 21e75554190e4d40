"""The laboratory around the library: the ``zeropp`` command (``cli``), the demo, the named
configurations (``modes``), benchmarks (``bench``), the cost model (``plan``), the emulated
cluster (``cluster``), and the models and corpora they train (``models``, ``data``). The library
(everything in ``zeropp`` outside this package) never imports it."""
