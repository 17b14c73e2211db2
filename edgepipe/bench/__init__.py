"""Benchmark helpers (peer engines behind one interface); used by ``benchmarks/``, not by the product."""
