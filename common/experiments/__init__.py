"""Harnesses of the notebooks and benchmarks: timings, spawned experiments and plots, apart from the mechanisms."""
