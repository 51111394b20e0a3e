"""What the notebooks and benchmarks run around a lesson's mechanism: timing harnesses, spawned experiments, plots.

Each parallelism module in ``common/`` holds only what its lesson teaches and a lab copies; the experiments that
measure it live here, one module per lesson."""
