"""What the notebooks and benchmarks run around a lesson's mechanism: timing harnesses, spawned experiments, plots."""
