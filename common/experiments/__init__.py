"""Harness code for the notebooks and benchmarks: spawned experiment functions, measurements, timing, plots."""
