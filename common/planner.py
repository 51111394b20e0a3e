"""A planner (lesson 16): which data, tensor, pipeline and context degrees to train a transformer with, and why.

Given a model, a cluster and a global batch, ``enumerate_configs`` lists every way to cut the devices into a mesh
``dp x tp x pp x cp`` (with a micro-batch size, a number of micro-batches, a recomputation mode and a ZeRO stage)
that the model's shapes allow. ``predict_memory`` and ``predict_step_time`` price each one with the course's own
formulas: bytes per parameter and ZeRO stages (lesson 06, ``common.memory``), activation bytes per layer
(lesson 13, ``common.activations``), the ring collectives' alpha-beta cost (lessons 01 and 09,
``common.scaling``), the tensor-parallel collectives (lessons 12-13), the pipeline bubble (lesson 11,
``common.pipeline``). ``rank_configs`` follows the Ultra-Scale Playbook's three steps (Hugging Face, 2025, "The
Ultra-Scale Playbook: Training LLMs on GPU Clusters", "Finding the best training configuration"):

1. fit memory: keep the configurations whose predicted memory per device is under the device's;
2. reach the global batch: every configuration enumerated takes exactly ``global_batch`` sequences per step,
   ``dp x micro_batch x micro_batches`` (gradient accumulation over the micro-batches);
3. maximise throughput: sort by predicted step time, fastest first.

The mesh is laid out as torchtitan lays it out: ``MESH_ORDER``, pipeline outermost, then data, then context, then
tensor innermost, so that consecutive ranks (one node's devices) share a tensor-parallel group first. A group
whose ranks all sit in one node talks over the intra-node link (NVLink, or loopback on the emulated cluster);
any other group crosses the inter-node link, which is then its bottleneck.

``measured_cluster`` prices a machine from what it measured: ``benchmarks/planner_check.py`` builds one for 2 emulated
nodes of 2 CPU processes and sets the planner's predictions beside measured step times and memory.

Every collective call also pays the cluster's fixed ``call_overhead`` (``collective_calls`` counts them as torch's
FSDP2, DTensor and pipelining make them): on the CPU machine it is milliseconds and dominates a small model.

What the model leaves out, on purpose (``NOTES`` prints it under every table): overlap of communication with
compute (every collective is counted as exposed, so the predicted step is an upper bound on what communication
costs), kernel efficiency (the compute rate is the device's peak: real kernels reach 30-60% of it, so predicted
times are lower bounds on compute), stragglers and network contention, the memory allocator's fragmentation and
the framework's own buffers.
"""

import itertools
import math
from dataclasses import dataclass, field

from common.activations import activation_bytes_per_layer
from common.memory import bytes_per_parameter, zero_bytes_per_rank
from common.pipeline import bubble_fraction_formula, transformer_stage_blocks
from common.tensor_parallel import mlp_all_reduce_bytes

MESH_ORDER = ("pp", "dp", "cp", "tp")  # outermost to innermost, as torchtitan's ParallelDims builds its mesh
LAYOUT = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # the same, with HSDP's replicas outside the shards
RECOMPUTE = ("none", "selective", "full")
SCHEDULES = ("1f1b", "gpipe")  # lesson 11: 1F1B holds at most p micro-batches' activations, GPipe all m of them
ZERO_STAGES = (0, 1, 2, 3)
VALUE_BYTES = {"fp32": 4, "mixed": 2}  # bytes of one activation value: fp32, or bf16/fp16 under mixed precision
NOTES = (
    "What this prediction ignores: communication overlapped with compute (all of it is counted as exposed);",
    "kernel efficiency (compute at the device's peak FLOP/s: real steps reach 30-60% of it, MFU);",
    "stragglers, network contention and congestion; the allocator's fragmentation and the framework's buffers;",
    "the framework's work per operation (DTensor's dispatch); the end stages' unequal compute; interleaved schedules.",
)


@dataclass(frozen=True)
class Model:
    """A decoder-only transformer: ``layers`` blocks of width ``hidden`` with ``heads`` attention heads (of which
    ``kv_heads`` key/value heads, grouped-query attention; None: as many as ``heads``), an MLP ``mlp_ratio x hidden``
    wide (``gated_mlp``: SwiGLU, three matrices instead of two), a vocabulary of ``vocab``, sequences of ``seq``.
    ``biases``: the linears and the norms have biases (GPT-2; Llama has none); ``learned_positions``: a position
    embedding table (GPT-2; Llama rotates instead); ``dropout``: dropouts on the embeddings, the attention
    probabilities and each block's two outputs (lesson 13's GPT). The head is not tied to the embedding."""

    name: str
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    mlp_ratio: float = 4.0
    kv_heads: int | None = None
    gated_mlp: bool = False
    dropout: bool = False
    biases: bool = False
    learned_positions: bool = False

    @property
    def ffn(self) -> int:
        """The MLP's inner width."""
        return round(self.mlp_ratio * self.hidden)

    @property
    def kv_dim(self) -> int:
        """The width of the keys (and of the values): ``hidden`` without grouped-query attention."""
        return self.hidden * (self.kv_heads or self.heads) // self.heads

    def layer_parameters(self) -> int:
        """Parameters of one block: the four attention projections, the MLP, the two norms."""
        h, kv, ffn, bias = self.hidden, self.kv_dim, self.ffn, int(self.biases)
        attention = 2 * h * h + 2 * h * kv + bias * (2 * h + 2 * kv)
        mlp = (3 if self.gated_mlp else 2) * h * ffn + bias * (ffn + h) * (not self.gated_mlp)
        return attention + mlp + 2 * (1 + bias) * h

    def embedding_parameters(self) -> int:
        """The token embedding, and the position embedding if the model learns one (the first stage's)."""
        return self.vocab * self.hidden + self.learned_positions * self.seq * self.hidden

    def head_parameters(self) -> int:
        """The final norm and the head, a linear to the vocabulary (the last stage's)."""
        return (1 + int(self.biases)) * self.hidden + self.hidden * self.vocab

    def num_parameters(self) -> int:
        """All parameters: N in the ``6 N`` FLOPs per token."""
        return self.layers * self.layer_parameters() + self.embedding_parameters() + self.head_parameters()


def gpt_model(vocab_size: int, context: int, d_model: int, num_heads: int, num_layers: int, dropout: float = 0.0):
    """The course's GPT (``common.gpt.GPT``, its arguments in its order) as the planner's ``Model``: GPT-2's
    shapes, biases on the linears and the norms, a learned position table, an MLP 4 times as wide."""
    return Model(f"GPT {num_layers} x {d_model}", num_layers, d_model, num_heads, vocab_size, context,
                 dropout=dropout > 0, biases=True, learned_positions=True)  # fmt: skip


@dataclass(frozen=True)
class Cluster:
    """``nodes`` machines of ``devices_per_node`` devices, each with ``memory_bytes`` and a compute rate of ``flops``
    (FLOP/s at the training precision). Links as lesson 09's alpha-beta model: a message of n bytes takes
    ``alpha + beta n`` seconds, ``intra_*`` inside a node, ``inter_*`` between nodes (each device's own share of
    the inter-node network). ``mask_bytes``: the bytes of one dropout-mask value (1 on a GPU; None: the
    activations' own dtype, as on a CPU, lesson 13). ``call_overhead``: seconds that every collective call costs
    on top of the link's alpha, the framework's fixed work per call (FSDP2's copy-in and copy-out and its hooks,
    gloo's dispatch from Python), which a fit of one bare all-reduce does not see: measured on the CPU machine
    (``benchmarks/planner_check.py``), 0 in the H100 presets, whose alphas are all the course has a source for."""

    name: str
    devices_per_node: int
    nodes: int
    memory_bytes: float
    flops: float
    intra_alpha: float
    intra_beta: float
    inter_alpha: float
    inter_beta: float
    mask_bytes: int | None = 1
    call_overhead: float = 0.0

    @property
    def devices(self) -> int:
        return self.devices_per_node * self.nodes


@dataclass(frozen=True)
class Training:
    """``global_batch`` sequences per optimizer step, in ``precision`` (``"fp32"`` or ``"mixed"``, lesson 06's
    names), with Adam (the only optimizer whose bytes lesson 06 counts)."""

    global_batch: int
    precision: str = "mixed"
    optimizer: str = "adam"


@dataclass(frozen=True)
class Config:
    """One way to train: degrees ``dp`` (data), ``tp`` (tensor, with sequence parallelism), ``pp`` (pipeline),
    ``cp`` (context); ``micro_batch`` sequences per micro-batch, ``micro_batches`` of them per step and data-parallel
    rank; ``recompute`` (``RECOMPUTE``); ``zero``, the ZeRO stage over the data and context ranks (3 = FSDP);
    ``replicas``: HSDP, the ``dp`` ranks as ``replicas`` copies of a ZeRO group of ``dp / replicas`` (x ``cp``)
    ranks, the replicas outermost as torchtitan's ``dp_replicate``; ``schedule`` (``SCHEDULES``), the pipeline's."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    micro_batch: int = 1
    micro_batches: int = 1
    recompute: str = "none"
    zero: int = 0
    replicas: int = 1
    schedule: str = "1f1b"

    def degrees(self) -> dict:
        return {"pp": self.pp, "dp": self.dp, "cp": self.cp, "tp": self.tp}

    @property
    def shard_group(self) -> int:
        """The ranks that ZeRO shards the model state over: the data and context ranks of one replica."""
        return self.dp // self.replicas * self.cp

    def describe(self) -> str:
        hsdp = f" hsdp{self.replicas}" if self.replicas > 1 else ""
        schedule = f" {self.schedule}" if self.schedule != "1f1b" and self.pp > 1 else ""
        return (
            f"dp{self.dp} tp{self.tp} pp{self.pp} cp{self.cp} mb{self.micro_batch}x{self.micro_batches} "
            f"{self.recompute} zero{self.zero}{hsdp}{schedule}"
        )


@dataclass
class Plan:
    """A configuration with its predicted memory per device and step time (the dicts of ``predict_memory`` and
    ``predict_step_time``)."""

    config: Config
    memory: dict = field(default_factory=dict)
    time: dict = field(default_factory=dict)


def pipeline_divides(layers: int, pp: int) -> bool:
    """Whether ``pp`` stages can hold ``layers`` blocks evenly: ``layers`` divides by ``pp``, or ``layers + 2`` does,
    the first and last stages taking one block fewer for the embedding and the head (Llama 3's 126 layers on 16
    stages: Dubey et al. 2024, "The Llama 3 Herd of Models", section 3.3.2), as long as those keep a block."""
    return layers % pp == 0 or (pp > 2 and (layers + 2) % pp == 0 and (layers + 2) // pp >= 2)


def problems(model: Model, cluster: Cluster, training: Training, config: Config) -> list[str]:
    """Why ``config`` cannot train ``model`` on ``cluster``: an empty list when it can (memory left aside)."""
    found = []
    product = config.dp * config.tp * config.pp * config.cp
    if min(config.dp, config.tp, config.pp, config.cp, config.micro_batch, config.micro_batches) < 1:
        found.append(f"every degree and batch figure must be at least 1 ({config.describe()})")
        return found
    if product != cluster.devices:
        found.append(
            f"the mesh dp {config.dp} x tp {config.tp} x pp {config.pp} x cp {config.cp} = {product} devices, but "
            f"{cluster.name} has {cluster.devices}"
        )
    for what, size in (("heads", model.heads), ("hidden size", model.hidden), ("kv heads", model.kv_heads)):
        if size and size % config.tp:
            found.append(f"tp {config.tp} does not divide the {what} {size}")
    if not pipeline_divides(model.layers, config.pp):
        found.append(f"pp {config.pp} does not divide the {model.layers} layers (nor {model.layers} + 2)")
    if config.cp > 1 and model.seq % (2 * config.cp):
        found.append(f"2 x cp = {2 * config.cp} does not divide the sequence of {model.seq} (load-balanced chunks)")
    if config.dp * config.micro_batch * config.micro_batches != training.global_batch:
        found.append(
            f"dp {config.dp} x micro-batch {config.micro_batch} x {config.micro_batches} micro-batches is not the "
            f"global batch of {training.global_batch}"
        )
    if config.recompute not in RECOMPUTE:
        found.append(f"recompute must be one of {RECOMPUTE}, not {config.recompute!r}")
    if config.zero not in ZERO_STAGES:
        found.append(f"zero must be one of {ZERO_STAGES}, not {config.zero!r}")
    if config.schedule not in SCHEDULES:
        found.append(f"schedule must be one of {SCHEDULES}, not {config.schedule!r}")
    if config.replicas < 1 or config.dp % config.replicas:
        found.append(f"{config.replicas} HSDP replicas do not divide dp {config.dp}")
    elif config.replicas > 1 and config.zero != 3:
        found.append(f"HSDP replicas are FSDP's (ZeRO-3), not ZeRO-{config.zero}'s")
    return found


def check(model: Model, cluster: Cluster, training: Training, config: Config) -> None:
    """Raise ``ValueError`` saying why, if ``config`` cannot train ``model`` on ``cluster`` (``problems``)."""
    if training.precision not in VALUE_BYTES:
        raise ValueError(f"precision must be one of {sorted(VALUE_BYTES)}, not {training.precision!r}")
    if training.optimizer != "adam":
        raise ValueError(f"the planner counts Adam's bytes only (lesson 06), not {training.optimizer!r}'s")
    found = problems(model, cluster, training, config)
    if found:
        raise ValueError(f"{config.describe()}: " + "; ".join(found))


def enumerate_configs(
    model: Model, cluster: Cluster, training: Training, recompute=RECOMPUTE, zero_stages=ZERO_STAGES
) -> list[Config]:
    """Every configuration whose mesh covers the cluster's devices exactly (dp x tp x pp x cp = devices) and that
    the shapes allow (``problems``): tp divides the heads and the hidden size, pp the layers, 2 cp the sequence, and
    dp x micro-batch the global batch, for every micro-batch size that does. Memory is not checked here."""
    devices, configs = cluster.devices, []
    divisors = [d for d in range(1, devices + 1) if devices % d == 0]
    for tp, pp, cp in itertools.product(divisors, repeat=3):
        if devices % (tp * pp * cp):
            continue
        dp = devices // (tp * pp * cp)
        if training.global_batch % dp:
            continue
        per_rank = training.global_batch // dp
        for micro_batch in (b for b in range(1, per_rank + 1) if per_rank % b == 0):
            for mode, zero in itertools.product(recompute, zero_stages):
                config = Config(dp, tp, pp, cp, micro_batch, per_rank // micro_batch, mode, zero)
                if not problems(model, cluster, training, config):
                    configs.append(config)
    return configs


# -- memory -----------------------------------------------------------------------------------------------------------


def stage_blocks(model: Model, pp: int) -> list[int]:
    """The blocks of each pipeline stage, first to last: ``common.pipeline.transformer_stage_blocks``, the layout
    that ``common.parallelize.pipeline_split`` cuts the course's GPT by (Llama 3's: when ``pp`` does not divide the
    layers, the end stages hold one block fewer, 6 blocks on 4 stages 1, 2, 2, 1)."""
    return transformer_stage_blocks(model.layers, pp)


def stage_layers(model: Model, pp: int) -> int:
    """The blocks on the fullest pipeline stage (``stage_blocks``)."""
    return max(stage_blocks(model, pp))


def device_parameters(model: Model, config: Config) -> float:
    """Parameters on the fullest device before ZeRO, cut by tp (the linears by Megatron's rule, lesson 12; the
    embedding and the head by the vocabulary; the norms, which tensor parallelism replicates, too: a small error).
    Each stage holds its blocks (``stage_blocks``), the first also the embeddings, the last the final norm and the
    head; with pp = 1 the one stage holds all of them. The fullest stage counts."""
    blocks, last = stage_blocks(model, config.pp), config.pp - 1
    held = [
        count * model.layer_parameters()
        + (stage == 0) * model.embedding_parameters()
        + (stage == last) * model.head_parameters()
        for stage, count in enumerate(blocks)
    ]
    return max(held) / config.tp


def sharded_parameters(model: Model, config: Config) -> float:
    """Parameters the fullest device holds between steps: ``device_parameters`` (pp's stage, cut by tp), then,
    under ZeRO-3 (FSDP), cut again over the shard group (``Config.shard_group``: the data ranks of one replica,
    times the context ranks). ZeRO 0-2 keep every parameter of the stage whole."""
    on_device = device_parameters(model, config)
    return on_device / config.shard_group if config.zero == 3 else on_device


def layer_activation_bytes(model: Model, micro_batch: int, seq: int, value_bytes: int, mask_bytes: int) -> dict:
    """What one block keeps for backward, on one device, before tensor parallelism: ``{"attention core": bytes that
    grow with the square of the sequence, "rest": the others}``. Lesson 13's formula term by term
    (``common.activations.activation_bytes_per_layer``, Korthikanti et al. 2022, section 4.1), adjusted for the
    model's shape: the MLP's two 4h-wide tensors scaled to its width (a SwiGLU MLP keeps four such tensors: the two
    projections' outputs, the SiLU's output and the product), and the keys and values to the kv heads."""
    terms = activation_bytes_per_layer(
        seq, micro_batch, model.hidden, model.heads, value_bytes, mask_bytes, dropout=model.dropout
    )
    wide = value_bytes * seq * micro_batch * model.ffn  # one (b, s, ffn) tensor
    mlp = terms["mlp"]
    mlp["GELU's input (4h wide)"] = wide * (3 if model.gated_mlp else 1)
    mlp["the second linear's input (4h wide)"] = wide
    kv_share = model.kv_dim / model.hidden
    attention = terms["attention"]
    for name in ("the keys, for q k^T", "the values, for the weighted sum"):
        attention[name] *= kv_share
    core = ("the softmax's output", "dropout mask on the probabilities", "the probabilities after dropout, for")
    squared = sum(size for name, size in attention.items() if name.startswith(core))
    total = sum(sum(part.values()) for part in terms.values())
    return {"attention core": squared, "rest": total - squared}


def activation_bytes(model: Model, cluster: Cluster, training: Training, config: Config) -> dict:
    """Activations on the fullest device (lesson 13's formula per block, lesson 11's micro-batches in flight):
    ``{"blocks", "embedding and loss", "in flight", "recompute buffer", "total"}`` in bytes.

    Per block, ``layer_activation_bytes`` at the sequence each context rank holds (s / cp; the attention core
    scores those queries against the whole sequence, so it is cp times that), divided by tp: tensor parallelism
    with sequence parallelism and Megatron's re-gather cuts every kept tensor by t (Korthikanti et al., section
    4.2.2). Recomputation (Korthikanti et al., section 5; lesson 13): ``selective`` drops the attention core (what
    a FlashAttention kernel also never keeps), ``full`` keeps each block's input only, and backward then holds
    one block's activations at a time (the recompute buffer).

    Around the blocks: the embedding's dropout mask (first stage); the final norm's input and statistics, the head's
    input and the loss's log-softmax over the vocabulary in fp32 (last stage; cut by tp as a vocabulary-parallel
    loss). Under 1F1B stage r holds ``min(m, p - r)`` micro-batches at once, the first ``min(m, p)``, the last
    one (lesson 11); under GPipe every stage holds all m, since every forward runs before any backward. The
    fullest stage counts."""
    value = VALUE_BYTES[training.precision]
    mask = cluster.mask_bytes or value
    b, s, t = config.micro_batch, model.seq // config.cp, config.tp
    layer = layer_activation_bytes(model, b, s, value, mask)
    whole = (layer["attention core"] * config.cp + layer["rest"]) / t
    kept = {"none": whole, "selective": layer["rest"] / t, "full": value * b * s * model.hidden / t}[config.recompute]
    sbh = b * s * model.hidden
    embedding = mask * sbh / t if model.dropout else 0
    loss = (2 * value * sbh + 8 * b * s + 4 * b * s * model.vocab) / t
    m, p = config.micro_batches, config.pp

    def stage(r: int, blocks: int) -> tuple:  # (blocks, around them, micro-batches held at once) of stage r
        around = embedding * (r == 0) + loss * (r == p - 1)
        if p == 1:  # gradient accumulation: one micro-batch at a time
            return blocks, around, 1
        return blocks, around, m if config.schedule == "gpipe" else min(m, p - r)  # GPipe holds all m

    stages = [stage(r, blocks) for r, blocks in enumerate(stage_blocks(model, p))]
    blocks, around, count = max(stages, key=lambda stage: (stage[0] * kept + stage[1]) * stage[2])
    buffer = whole if config.recompute == "full" else 0
    return {
        "blocks": blocks * kept * count,
        "embedding and loss": around * count,
        "in flight": count,
        "recompute buffer": buffer,
        "total": (blocks * kept + around) * count + buffer,
    }


def predict_memory(model: Model, cluster: Cluster, training: Training, config: Config) -> dict:
    """Bytes per device, by part: ``{"parameters", "gradients", "optimizer", "activations", "total"}``, on the
    fullest device (the fullest pipeline stage).

    The model state is lesson 06's (``common.memory.zero_bytes_per_rank``: Adam's 16 bytes per parameter, fp32 or
    mixed, each part divided by the ZeRO group where the stage shards it), for the parameters a device holds after
    tensor and pipeline parallelism (``device_parameters``); the ZeRO group is the data and context ranks of one
    replica together (``Config.shard_group``), as torchtitan shards FSDP over ``dp_shard x cp``. Under ZeRO-3 two
    blocks' parameters are also held whole: the one being computed and the next, prefetched. The activations are
    lesson 13's (``activation_bytes``)."""
    check(model, cluster, training, config)
    state = zero_bytes_per_rank(device_parameters(model, config), config.shard_group, config.zero, training.precision)
    parts = {part: state[part] for part in ("parameters", "gradients", "optimizer")}
    if config.zero == 3:  # the block being computed and the one prefetched, gathered whole (lessons 06 and 08)
        parts["parameters"] += (
            2 * model.layer_parameters() / config.tp * bytes_per_parameter(training.precision)["parameters"]
        )
    parts["activations"] = activation_bytes(model, cluster, training, config)["total"]
    return {**parts, "total": sum(parts.values())}


# -- time -------------------------------------------------------------------------------------------------------------


def link(cluster: Cluster, config: Config, dims: tuple[str, ...]) -> tuple[float, float, str]:
    """``(alpha, beta, "intra" or "inter")`` of the link that a group over the mesh dimensions ``dims`` crosses.

    The mesh is laid out in ``MESH_ORDER`` (tp innermost), with ``dp`` split into HSDP's ``dp_replicate`` outside
    ``dp_shard`` (``LAYOUT``): a group's ranks are ``stride`` apart, where ``stride`` is the product of the degrees
    inside its dimensions, and span ``stride x size`` consecutive ranks. When that span fits in a node, the group
    stays inside it; otherwise it crosses nodes, and the slower link sets its pace."""
    degrees = {"pp": config.pp, "dp_replicate": config.replicas, "dp_shard": config.dp // config.replicas}
    degrees |= {"cp": config.cp, "tp": config.tp}
    dims = tuple(part for dim in dims for part in (("dp_replicate", "dp_shard") if dim == "dp" else (dim,)))
    inner = LAYOUT[max(LAYOUT.index(dim) for dim in dims) + 1 :]
    span = math.prod(degrees[dim] for dim in inner) * math.prod(degrees[dim] for dim in dims)
    if span <= cluster.devices_per_node:
        return cluster.intra_alpha, cluster.intra_beta, "intra"
    return cluster.inter_alpha, cluster.inter_beta, "inter"


def ring_seconds(collective: str, nbytes: float, size: int, alpha: float, beta: float) -> float:
    """Seconds of a ring ``collective`` of a tensor of ``nbytes`` over ``size`` ranks (lesson 01's ring; lesson 09's
    model, ``common.scaling.fit_alpha_beta``'s docstring, after Patarasuk and Yuan 2009 and Thakur et al. 2005):
    an all-reduce takes ``2 (N - 1)`` steps of ``n / N`` bytes, a reduce-scatter or an all-gather ``N - 1``."""
    if size == 1:
        return 0.0
    steps = {"all_reduce": 2 * (size - 1), "reduce_scatter": size - 1, "all_gather": size - 1}[collective]
    return steps * (alpha + beta * nbytes / size)


def model_flops_per_token(model: Model) -> float:
    """FLOPs of one token's forward and backward, recomputation left out: ``6 N`` for the parameters (forward
    2 N, backward 4 N: Kaplan et al. 2020, section 2.1) plus ``12 L s h`` for the attention's scores and weighted
    sums, which no parameter counts (Chowdhery et al. 2022, "PaLM", appendix B: the model FLOPs of MFU)."""
    return 6 * model.num_parameters() + 12 * model.layers * model.seq * model.hidden


def collective_calls(model: Model, config: Config) -> dict:
    """Collective calls per optimizer step on a rank of the busiest stage, by part: ``{"tensor parallel", "context
    parallel", "pipeline p2p", "data parallel", "total"}``. Each costs ``Cluster.call_overhead`` on top of its bytes.
    The counts are those that torch's ``CommDebugMode`` counts in the composition (``benchmarks/planner_check.py``
    sets them side by side for every mesh it runs).

    - tensor parallel (with sequence parallelism), per block and micro-batch: an all-gather and a reduce-scatter
      around the attention and around the MLP, in forward and again in backward (8; ``full`` recomputation repeats
      forward's 4); per block and step, an all-reduce of each replicated norm parameter's gradient (2 norms, with
      their biases if the model has them). On the first stage, per micro-batch, each embedding's output is
      reduce-scattered along the sequence and its gradient gathered (2 per table). On the last, per micro-batch,
      the head's input is gathered and its gradient reduce-scattered, and ``loss_parallel`` all-reduces 3 times
      (the maximum, the sum of the exponentials, the target's logit); per step, the final norm's gradients.
    - context parallel (``common.context_parallel.ring_messages``), per block and micro-batch: ``cp - 1`` ring
      steps in forward, each passing on a key/value block; in backward ``cp - 1`` steps of key/value blocks again
      and ``cp`` of their gradients, the last one bringing each rank its own: ``3 cp - 2`` steps, each one grouped
      send and receive.
    - pipeline: per micro-batch, each neighbour stage's activation or gradient received and this stage's sent, one
      point-to-point call each: 2 on an end stage (an activation sent, a gradient received, or the other way), 4 on
      a middle stage.
    - data parallel, per FSDP unit (each block, and the root: the embeddings or the final norm and the head), as
      torch's FSDP2 runs them (``fully_shard``, ``reshard_after_forward=True``; the root stays gathered after its
      forward). Under a pipeline (``torch.distributed.pipelining`` turns FSDP's resharding after backward and its
      gradient sync off for every micro-batch but the last), ZeRO-3 gathers each block in every micro-batch's
      forward and once in backward, the root once, then reduce-scatters each unit once. Without a pipeline,
      gradient accumulation runs FSDP2's defaults: every micro-batch gathers each block in forward and again in
      backward, the root once, and reduce-scatters every unit. HSDP then all-reduces each unit's shard across the
      replicas, after each reduce-scatter. ZeRO-1/2 reduce-scatter and all-gather each unit once per step; ZeRO-0
      all-reduces it once (DDP's ``no_sync`` in gradient accumulation)."""
    m, p, norm = config.micro_batches, config.pp, 1 + int(model.biases)
    embeddings = 1 + int(model.learned_positions)

    def calls(stage: int, blocks: int) -> dict:
        first, last = stage == 0, stage == p - 1
        tensor = 0
        if config.tp > 1:  # around the blocks: the embeddings (first stage), the head and the loss (last stage)
            per_block = 8 + 4 * (config.recompute == "full")
            around_per_micro_batch = 2 * embeddings * first + (2 + 3) * last
            tensor = (blocks * per_block + around_per_micro_batch) * m + blocks * 2 * norm + norm * last
        units = blocks + 1
        if config.shard_group * config.replicas == 1:
            data = 0
        elif config.zero == 3 and p > 1:  # the gathers, then one reduce-scatter per unit, then HSDP's all-reduces
            data = blocks * (m + 1) + 1 + units + units * (config.replicas > 1)
        elif config.zero == 3:  # the same for each micro-batch, each block gathered in its forward and backward
            data = m * (blocks * 2 + 1 + units + units * (config.replicas > 1))
        else:
            data = units * (2 if config.zero else 1)
        ring = blocks * (3 * config.cp - 2) * m if config.cp > 1 else 0
        p2p = 2 * m * ((not first) + (not last))  # a receive and a send per neighbour and micro-batch
        found = {"tensor parallel": tensor, "context parallel": ring, "pipeline p2p": p2p, "data parallel": data}
        return {**found, "total": sum(found.values())}

    stages = stage_blocks(model, p)
    return max((calls(stage, blocks) for stage, blocks in enumerate(stages)), key=lambda found: found["total"])


def data_parallel_seconds(model: Model, cluster: Cluster, training: Training, config: Config) -> float:
    """Seconds of the data-parallel collectives of one step (``collective_calls``' data part), bytes and calls.

    ZeRO-3 under a pipeline all-gathers each block's parameters m + 1 times and the root's once, then
    reduce-scatters the gradients of all of them once, over the shard group; with HSDP replicas it also all-reduces
    the shard's gradients across them. Without a pipeline, FSDP2's gradient accumulation does all of that for each
    of the m micro-batches, each block gathered twice (``collective_calls``). ZeRO 0-2 reduce the gradients once
    per step, a ring all-reduce (ZeRO 1-2: reduce-scatter, then all-gather the updated parameters, the same
    bytes)."""
    per_parameter = bytes_per_parameter(training.precision)
    on_device = device_parameters(model, config)
    calls = collective_calls(model, config)["data parallel"] * cluster.call_overhead
    if config.zero != 3:
        alpha, beta, _ = link(cluster, config, ("dp", "cp"))
        reduced = ring_seconds("all_reduce", on_device * per_parameter["gradients"], config.dp * config.cp, alpha, beta)
        return reduced + calls
    alpha, beta, _ = link(cluster, config, ("dp_shard", "cp"))
    blocks = stage_layers(model, config.pp) * model.layer_parameters() / config.tp
    m, root = config.micro_batches, on_device - blocks
    # under a pipeline, one gradient sync per step; without, FSDP2 syncs (and re-gathers in backward) every micro-batch
    gathered, syncs = ((m + 1) * blocks + root, 1) if config.pp > 1 else (m * (2 * blocks + root), m)
    shards = config.shard_group
    seconds = ring_seconds("all_gather", gathered * per_parameter["parameters"], shards, alpha, beta)
    seconds += syncs * ring_seconds("reduce_scatter", on_device * per_parameter["gradients"], shards, alpha, beta)
    alpha, beta, _ = link(cluster, config, ("dp_replicate",))
    shard_bytes = on_device / shards * per_parameter["gradients"]
    return seconds + syncs * ring_seconds("all_reduce", shard_bytes, config.replicas, alpha, beta) + calls


def predict_step_time(model: Model, cluster: Cluster, training: Training, config: Config) -> dict:
    """Seconds of one optimizer step, by part, and what they give: ``{"compute", "tensor parallel", "context
    parallel", "pipeline p2p", "bubble", "data parallel", "total", "tokens per second", "mfu"}``; the six parts
    add up to the total. Every collective costs its bytes (lesson 09's ring) and, per call, the cluster's
    ``call_overhead`` (``collective_calls`` counts the calls).

    - compute: ``model_flops_per_token`` (``6 N``, plus the attention's scores), plus recomputation's extra
      forward (``full``: 2 N and the attention again; ``selective``: the attention core's ``4 s h`` per token and
      layer, Korthikanti et al. section 5), at the device's compute rate, shared by all devices.
    - tensor parallel (lessons 12-13): per block and micro-batch, two all-gathers and two reduce-scatters in
      forward and again in backward under sequence parallelism, the bytes of four all-reduces of the ``(b, s, h)``
      activation (``common.tensor_parallel.mlp_all_reduce_bytes``); ``full`` recomputation repeats forward's two.
    - context parallel (ring attention, Liu et al. 2023; lesson 14): per block and micro-batch, ``cp - 1`` ring
      steps passing this rank's keys and values on in forward; in backward ``cp - 1`` more of keys and values and
      ``cp`` of their gradients, each as large (``common.context_parallel.ring_messages``).
    - pipeline (lesson 11): ``(m + p - 1)`` slots of one micro-batch's work, of which ``p - 1`` idle
      (``common.pipeline.bubble_fraction_formula``: 1F1B's and GPipe's alike), each slot also sending an
      activation forward and a gradient back to the neighbouring stage.
    - data parallel (lessons 06 and 08): ``data_parallel_seconds``, FSDP's gathers per micro-batch included.

    Every collective is exposed: none is overlapped with compute (``NOTES``)."""
    check(model, cluster, training, config)
    value = VALUE_BYTES[training.precision]
    tokens = training.global_batch * model.seq
    n, attention = model.num_parameters(), 4 * model.layers * model.seq * model.hidden  # one forward's scores
    extra = {"none": 0, "full": 2 * n + attention, "selective": attention}[config.recompute]
    flops = (model_flops_per_token(model) + extra) * tokens
    compute = flops / cluster.flops / cluster.devices
    b, s, m, p = config.micro_batch, model.seq // config.cp, config.micro_batches, config.pp
    layers = stage_layers(model, p)
    calls = {part: count / m * cluster.call_overhead for part, count in collective_calls(model, config).items()}

    alpha, beta, _ = link(cluster, config, ("tp",))
    activation = mlp_all_reduce_bytes(b, s, model.hidden, value)
    collectives = 4 + 2 * (config.recompute == "full")
    tensor = layers * collectives * ring_seconds("all_reduce", activation, config.tp, alpha, beta)
    tensor += calls["tensor parallel"]

    alpha, beta, _ = link(cluster, config, ("cp",))
    kv_bytes = 2 * b * s * model.kv_dim * value / config.tp  # this rank's keys and values, its heads
    ring_steps = 3 * config.cp - 2  # forward cp - 1; backward cp - 1 key/value blocks and cp gradients
    context = layers * ring_steps * (alpha + beta * kv_bytes) if config.cp > 1 else 0.0
    context += calls["context parallel"]

    # pp is outermost, so the pp group spans every device: on several nodes some stage boundary crosses nodes, and
    # a micro-batch passes every boundary, so the slowest hop (inter-node) sets each slot's p2p cost
    alpha, beta, _ = link(cluster, config, ("pp",))
    p2p = 2 * (alpha + beta * b * s * model.hidden * value / config.tp) if p > 1 else 0.0
    p2p += calls["pipeline p2p"]

    slot = compute / m + tensor + context + p2p  # one micro-batch's forward and backward on one stage
    pipeline = slot * (m + p - 1)
    bubble = pipeline * bubble_fraction_formula(p, m)
    data = data_parallel_seconds(model, cluster, training, config)

    total = pipeline + data
    return {
        "compute": compute,
        "tensor parallel": tensor * m,
        "context parallel": context * m,
        "pipeline p2p": p2p * m,  # the other p - 1 slots' messages are in the bubble
        "bubble": bubble,
        "data parallel": data,
        "total": total,
        "tokens per second": tokens / total,
        "mfu": model_flops_per_token(model) * tokens / total / (cluster.devices * cluster.flops),
    }


def rank_configs(
    model: Model, cluster: Cluster, training: Training, recompute=RECOMPUTE, zero_stages=ZERO_STAGES
) -> list[Plan]:
    """The Ultra-Scale Playbook's three steps (module docstring): every configuration that fits the devices' memory
    and takes the global batch, fastest first (ties: less memory first). Raises ``ValueError`` when the shapes allow
    no mesh on this cluster, or when none fits, with the smallest memory found and the limit."""
    configs = enumerate_configs(model, cluster, training, recompute, zero_stages)
    if not configs:
        raise ValueError(
            f"no mesh of {cluster.devices} devices fits {model.name}'s shapes ({model.layers} layers, {model.heads} "
            f"heads, hidden {model.hidden}, sequence {model.seq}) with a global batch of {training.global_batch}"
        )
    plans = [Plan(config, predict_memory(model, cluster, training, config)) for config in configs]
    fitting = [plan for plan in plans if plan.memory["total"] <= cluster.memory_bytes]  # step 1
    if not fitting:
        smallest = min(plans, key=lambda plan: plan.memory["total"])
        raise ValueError(
            f"{model.name} fits no configuration on {cluster.name}: the smallest memory per device found is "
            f"{smallest.memory['total'] / 1e9:.3g} GB ({smallest.config.describe()}), over the limit of "
            f"{cluster.memory_bytes / 1e9:.3g} GB"
        )
    for plan in fitting:  # step 2 holds by construction: dp x micro_batch x micro_batches = global_batch
        plan.time = predict_step_time(model, cluster, training, plan.config)
    return sorted(fitting, key=lambda plan: (plan.time["total"], plan.memory["total"]))  # step 3


# -- a cluster priced from measurements ------------------------------------------------------------------------------


def measured_cluster(
    name: str,
    devices_per_node: int,
    nodes: int,
    memory_bytes: float,
    process_flops: float,
    intra_fit: dict,
    inter_fit: dict,
    cores: int,
    share: float | None = None,
    call_overhead: float = 0.0,
) -> Cluster:
    """A ``Cluster`` of CPU processes priced from what this machine measured (``benchmarks/planner_check.py``).

    - ``process_flops``: FLOP/s of one process alone, one thread. All ``devices`` processes share ``cores`` cores,
      so each gets ``share`` of that rate: the compute-sharing factor, stated here, not hidden. None:
      ``min(1, cores / devices)``, a machine that runs nothing else; a measured share also counts other jobs.
    - ``intra_fit``, ``inter_fit``: ``common.scaling.fit_alpha_beta``'s dicts of a two-rank ``dist.all_reduce``,
      inside a node (loopback) and between two nodes. A ring of two ranks takes 2 steps of n / 2 bytes, 2 alpha +
      beta n (``ring_seconds``): the link's alpha is half the fitted one, its beta the fitted one.
    - Between nodes every device of a node sends at once in the meshes where each rank's group crosses nodes, so a
      device's share of the link (``Cluster``'s ``inter_*``) is 1 / ``devices_per_node`` of it: beta times that.

    - ``call_overhead``: seconds per collective call beyond the link's alpha (``Cluster``), measured apart.

    Dropout masks take the activations' own dtype on a CPU (``mask_bytes=None``, lesson 13)."""
    share = min(1.0, cores / (devices_per_node * nodes)) if share is None else share
    return Cluster(
        name,
        devices_per_node,
        nodes,
        memory_bytes,
        process_flops * share,
        intra_alpha=intra_fit["alpha_s"] / 2,
        intra_beta=intra_fit["beta_s_per_byte"],
        inter_alpha=inter_fit["alpha_s"] / 2,
        inter_beta=inter_fit["beta_s_per_byte"] * devices_per_node,
        mask_bytes=None,
        call_overhead=call_overhead,
    )


# -- presets: published models and clusters, with the sources of their figures ---------------------------------------

H100_SXM = dict(  # NVIDIA H100 Tensor Core GPU datasheet, SXM5: bf16 dense (half of the 1,979 TFLOP/s with sparsity)
    devices_per_node=8,
    memory_bytes=80e9,  # 80 GB of HBM3
    flops=989e12,
    intra_alpha=5e-6,  # assumed: NCCL's latency for a small message over NVLink is a few microseconds
    intra_beta=1 / 450e9,  # NVLink 4: 900 GB/s per GPU in both directions together, 450 GB/s each way
    inter_alpha=10e-6,  # assumed: an RDMA message between nodes, about ten microseconds
    inter_beta=1 / 50e9,  # 400 Gbit/s per GPU (Llama 3's RoCE and torchtitan's Grand Teton hosts): 50 GB/s
)
MODELS = {
    # lesson 13's GPT (common.gpt.GPT with its defaults), the model whose memory tests/test_planner.py measures
    "lesson-13-gpt": Model("lesson-13-gpt", 4, 128, 4, 256, 128, dropout=True, biases=True, learned_positions=True),
    # Llama 3 8B and 405B: Dubey et al. 2024, "The Llama 3 Herd of Models", Table 3 (vocabulary: the released
    # tokenizer's 128,256 tokens); pre-training sequences of 8,192 tokens, then 131,072 for long context
    "llama3-8b": Model("llama3-8b", 32, 4096, 32, 128256, 8192, mlp_ratio=3.5, kv_heads=8, gated_mlp=True),
    "llama3-405b": Model("llama3-405b", 126, 16384, 128, 128256, 8192, mlp_ratio=3.25, kv_heads=8, gated_mlp=True),
    "llama3-405b-128k": Model(
        "llama3-405b-128k", 126, 16384, 128, 128256, 131072, mlp_ratio=3.25, kv_heads=8, gated_mlp=True
    ),
}
CLUSTERS = {
    "h100x8": Cluster("one node of 8 H100 SXM", nodes=1, **H100_SXM),
    "h100x16k": Cluster("2,048 nodes of 8 H100 SXM (16,384 GPUs)", nodes=2048, **H100_SXM),
}
# What those teams ran and report, for scripts/plan.py to set beside the planner's prediction of the same degrees.
PUBLISHED = {
    ("llama3-405b", "h100x16k"): {
        "global_batch": 2048,  # 16M tokens of 8,192
        "config": Config(dp=128, tp=8, pp=16, cp=1, micro_batch=1, micro_batches=16, zero=2),
        "reported": "Llama 3 405B, 16,384 H100s: TP 8, CP 1, PP 16, DP 128, batch 16 per DP rank, 400 TFLOP/s "
        "per GPU, 41% BF16 MFU (Dubey et al. 2024, Table 4; FSDP without resharding parameters after "
        "forward, ZeRO-2 here; interleaved 1F1B, which this planner does not model)",
    },
    ("llama3-405b-128k", "h100x16k"): {
        "global_batch": 128,  # 16M tokens of 131,072
        "config": Config(dp=8, tp=8, pp=16, cp=16, micro_batch=1, micro_batches=16, zero=2),
        "reported": "Llama 3 405B long context, 16,384 H100s: TP 8, CP 16, PP 16, DP 8, sequence 131,072, 380 "
        "TFLOP/s per GPU, 38% BF16 MFU (Dubey et al. 2024, Table 4)",
    },
    ("llama3-8b", "h100x8"): {
        "global_batch": 16,
        "config": Config(dp=8, micro_batch=2, micro_batches=1, recompute="selective", zero=3),
        "reported": "torchtitan, Llama 3.1 8B on 8 H100s: FSDP 8, local batch 2, selective recomputation, bf16: "
        "5,762 tokens/s per GPU, 82.4 GiB peak (pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, "
        "Table 1: H100s with 96 GB of HBM2e at 500 W)",
    },
}
