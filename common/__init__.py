"""Shared code of the multi-GPU training course, one idea per module.

What every script uses:

- ``common.distributed``: process-group set-up and teardown, ``is_main``/``print0``, ``set_seed``, reductions.
- ``common.launch``: scripts under ``torchrun`` (``torchrun_command``, ``launch``), and a function on N local
  processes whose results come back (``run_on_ranks``: tests, notebooks).
- ``common.cli``: argument types shared by the scripts, and the line of options a solution prints first.
- ``common.data``: data sets by name (``digits`` works offline) and loaders sharded over ranks.
- ``common.models``: ``LeNet``, ``SimpleCNN`` and ``DeepMLP`` (the sharding lessons' model).
- ``common.gpt``: a small GPT for lessons 13-16, built from lesson 12's transformer layer: its next-token loss and
  sampling.
- ``common.text``: real text without a network for that GPT: files read as bytes (by default PyTorch's own
  ``torch/nn/modules`` sources), split 90/10 into windows for next-byte prediction.
- ``common.training``: what every training script shares: its options, loaders, progress bar and epoch figures.
- ``common.metrics``: exact distributed evaluation, a run's summary and its JSON file, timing.
- ``common.reports``: what the measuring solutions write for people to read: tables, JSON and plots.
- ``common.checkpoint``: atomic, rank-0-only checkpoints, loaded with ``weights_only``.

What a lesson builds or shows:

- ``common.scratch`` (lesson 01): data parallelism from scratch in one process, the d2l way.
- ``common.collectives`` (01): all-reduce by hand (naive, ring) from point-to-point messages, one-bucket
  gradient averaging, and counters of DDP's all-reduces and of messages.
- ``common.data_parallel`` (02): what ``nn.DataParallel`` does in one forward pass, written out.
- ``common.ddp`` (03): DDP made visible: rank 0's weights at construction, gradient buckets, ``Join``.
- ``common.batchnorm`` (03): synchronized BatchNorm by hand (what ``nn.SyncBatchNorm`` computes), for CPUs, and
  BatchNorm's statistics across ranks and under DDP.
- ``common.precision`` (05): the ``--precision`` choices and a clear error where one cannot run.
- ``common.memory`` (06): bytes of model state per parameter and per ZeRO stage, what a rank holds, peak memory.
- ``common.fsdp`` (06): the plumbing around FSDP2 (mesh, options, mixed-precision policy), sharded (DCP)
  checkpoints, full state-dict export, and lesson 06's measurements (the sharding itself is in the solution).
- ``common.fault_tolerance`` (07): numbered, verified checkpoints for restarts, the newest valid one, RNG states.
- ``common.cluster`` (07): an emulated cluster on one machine: nodes as network namespaces joined by
  rate-limited links (``EmulatedCluster``, ``measure_link_rate``); ``scripts/cluster.py`` runs a script on it.
- ``common.debugging`` (07): collectives that ranks get wrong, and what ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` says.
- ``common.ddp_by_hand`` (08): DDP built by hand: naive, overlapped with gradient hooks, bucketed.
- ``common.zero_by_hand`` (08): ZeRO built by hand: sharded optimizer state (1), gradients (2), parameters (3).
- ``common.profiling`` (09): a training step in labelled regions, the profiler's traces (one per rank) and their
  breakdown: compute, communication, what backward hid of it, the bottleneck; HTA on GPU traces.
- ``common.data_loading`` (09): a data pipeline that starves training (PNG files, per-sample decode), and the
  loader options that feed it again, one at a time.
- ``common.monitoring`` (09): device use sampled by a thread (NVML or psutil), per-rank summaries, TensorBoard.
- ``common.scaling`` (09): strong and weak scaling efficiency, the latency-bandwidth model of an all-reduce.
- ``common.compression`` (10): DDP communication hooks by hand: all-reduce, bf16, PowerSGD with its state.
- ``common.pipeline`` (11): pipeline parallelism by hand: a model cut into stages, activations and gradients as
  point-to-point messages, the naive, GPipe and 1F1B schedules, and their bubble and activation memory, measured.
- ``common.tensor_parallel`` (12): tensor parallelism by hand (Megatron-LM): the f and g autograd functions,
  column- and row-parallel linears, the MLP and self-attention split by heads, a transformer layer, torch's DTensor
  version, and the 2-D mesh of data-parallel replicas x tensor-parallel ranks.
- ``common.activations`` (13): where a transformer layer's activation memory goes: the formula term by term, and
  two measurements (the tensors autograd saves, and the memory forward leaves alive).
- ``common.recompute`` (13): activation recomputation: by hand (an autograd function that replays the random
  state), torch's full ``checkpoint`` and its selective version, applied to a model's blocks.
- ``common.sequence_parallel`` (13): sequence parallelism by hand (all-gather and reduce-scatter as conjugate
  autograd functions, the split GPT), and torch's (``SequenceParallel``, a vocabulary-parallel head, ``loss_parallel``).
- ``common.context_parallel`` (14): context parallelism: blockwise attention with an online softmax, ring attention
  by hand (an autograd function passing key/value blocks with ``isend``/``irecv``), contiguous and zig-zag layouts,
  Llama 3's all-gather of keys and values, DeepSpeed-Ulysses' all-to-all over heads, and the GPT with its
  sequence split.
- ``common.moe`` (15): a mixture of experts in place of the MLP (top-k routing, Switch's balancing loss, capacity
  with dropping) and expert parallelism by hand (the counts exchanged, the uneven all-to-all as an autograd Function
  whose backward is the reverse exchange, the expert-major permutation), with and without data parallelism.
- ``common.parallelize`` (16): the GPT on a pipeline x data x context x tensor ``DeviceMesh``, applied by functions
  in torchtitan's order (the pipeline cut, tensor + sequence parallelism, lesson 14's ring attention over the context
  ranks, FSDP2 or HSDP over the data and context ranks), one step on any mesh, the whole model gathered back, for the
  proof that it trains the same model as 1-D FSDP.
- ``common.planner`` (16): which data, tensor, pipeline and context degrees to train with: every mesh the model's
  shapes allow, its memory per device and step time predicted with lessons 06-13's formulas, ranked by the
  Ultra-Scale Playbook's three steps; presets for Llama 3 on H100s (``scripts/plan.py`` prints the tables).

What the notebooks and benchmarks measure with them (timings, spawned experiments, plots), apart from the mechanism:

- ``common.experiments``: one module per lesson: ``ddp_by_hand`` (08: a bucket timeline), ``zero`` (08: live
  tensor bytes, ZeRO's memory per phase and ZeRO-3's time with and without prefetch), ``compression`` (10: a hook
  called on a bucket built by hand, error feedback's drift), ``pipeline`` (11: timed schedules, gradients against
  ``torch.distributed.pipelining``, the timeline plot), ``tensor_parallel`` (12: the notebook's measurements),
  ``activations`` (13: a layer's saved bytes against the formula, the recomputation table, sequence parallelism
  against tensor parallelism, memory per rank), ``context_parallel`` (14: the ring against SDPA, its messages,
  work and time per rank in each layout, the ring against the all-gather) and ``moe`` (15: the expert-parallel
  layer against the one-process one on every rank, the 2-D mesh, routing over training, dropping against the
  capacity factor, step times).
"""
