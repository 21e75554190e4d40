"""Benchmarks that measure zeropp components and write JSON results (run via ``zeropp bench``)."""
