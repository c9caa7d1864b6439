"""Benchmarks: speed and peak memory of attention mechanisms (``speed``, ``memory``).

Submodules are imported on use (``from attnlab.bench.speed import bench_sparse``), so
importing this package costs nothing.
"""
