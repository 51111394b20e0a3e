"""Shared code of the multi-GPU training course.

- ``common.distributed``: process-group set-up and teardown, ``is_main``/``print0``, ``set_seed``, reductions.
- ``common.data``: data sets by name (``digits`` works offline) and loaders sharded over ranks.
- ``common.models``: ``LeNet``, ``SimpleCNN`` and ``DeepMLP`` (the sharding lessons' model).
- ``common.batchnorm``: synchronized BatchNorm by hand (what ``nn.SyncBatchNorm`` computes), for CPUs.
- ``common.metrics``: exact distributed evaluation.
- ``common.checkpoint``: atomic, rank-0-only checkpoints and JSON files.
- ``common.precision``: the ``--precision`` choices and a clear error where one cannot run.
- ``common.memory``: bytes of model state per parameter and per ZeRO stage, and what a rank holds.
- ``common.fsdp``: FSDP2 applied to a model, sharded (DCP) checkpoints, full state-dict export.
- ``common.launch``: run a function on N local processes (tests, notebooks).
- ``common.cli``: argument types shared by the scripts.
"""
