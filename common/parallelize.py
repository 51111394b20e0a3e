"""Composition (lesson 16): lesson 13's GPT on a mesh of pipeline x data x context x tensor ranks, applied by functions.

The model code (``common.gpt``) never imports ``torch.distributed``: each kind of parallelism is *applied* to it by
one function here, in the order torchtitan's ``pipeline_llama`` and ``parallelize_llama`` apply theirs:

    mesh = make_mesh(device_type, pp=2, dp=2, tp=2, world_size=16, cp=2)  # dims pp, dp_replicate, dp_shard, cp, tp
    stage, first_block = pipeline_split(gpt, stage_index, pp)        # 1. this stage's blocks (lesson 11)
    apply_tensor_parallel(stage, mesh["tp"])                         # 2. TP + SP + a vocabulary-parallel head (12-13)
    apply_context_parallel(stage, mesh["cp"])                        # 3. ring attention over the cp ranks (14)
    apply_fsdp(stage, data_mesh(mesh))                               # 4. FSDP2 (or HSDP) over the data x cp ranks (06)
    optimizer = torch.optim.AdamW(stage.parameters())                # after all of them: it sees the final shards

``parallelize`` does the four in that order. Why this order: the pipeline cut comes first because each stage is a
model of its own, which the others then transform. Tensor parallelism comes before FSDP because FSDP shards
whatever parameters it finds: after tensor parallelism they are DTensors on the ``tp`` dim, and FSDP cuts them
again along the data dim (norms and row-wise biases are ``Replicate`` on ``tp``; HSDP adds ``Replicate`` on
``dp_replicate``). The other way round, tensor parallelism would find FSDP's DTensors on the data mesh, and
``distribute_tensor`` refuses to move a DTensor to another mesh (a ``ValueError``). Context parallelism changes no
parameter: it changes how each attention mixes its projections (ring attention, ``SelfAttention.attend``) and which
positions the first stage embeds (``GPT.positions``: this GPT learns a position table, so a rank's tokens must look
up the rows of the positions they really sit at). It comes after tensor parallelism, so that the ring carries
only this rank's ``num_heads / tp`` heads, and before FSDP, which must know that the ``cp`` ranks share weights.

FSDP shards over the ``dp_shard`` and ``cp`` dims flattened into one (``DeviceMesh._flatten``, as torchtitan does;
torch 2.14 has no public name for it). The ``cp`` ranks hold the same weights, and each computed the gradient of
its own share of the tokens: averaged over ``dp`` x ``cp`` ranks, those are the gradient of the global batch's mean
loss, since every share is the same size and the ring's backward has brought each key's and value's gradient home
to the rank whose keys they are. The ``cp`` ranks of one data rank train on the same sequences, each on
its zig-zag positions (``context_share``): rank c of N holds chunks c and 2N - 1 - c of 2N, so that under the
causal mask every rank does the same work (lesson 14).

The ring is the course's own (``common.context_parallel.context_parallel_attend``), swapped in through
``SelfAttention.attend``.
torch's ``torch.distributed.tensor.experimental.context_parallel`` shards the buffers it is given along the sequence
(on any device, head-tail: the same zig-zag) and swaps ``F.scaled_dot_product_attention`` for a ring written only
for the CUDA SDPA kernels (flash, memory-efficient, cuDNN: torch 2.14's ``_context_parallel/_attention.py``). The
course's attention is its own matmul and softmax (``common.tensor_parallel.attend``), not SDPA, so torch's ring
would never reach it, on any device. The ``cp`` dim sits between the data dims and ``tp``: it talks
in every block, as ``tp`` does, but only to its ring neighbours, and its messages can overlap the computation.

The ``tp`` dim is innermost (neighbouring ranks): its collectives run in every block, so on a real cluster they
stay inside a node's fast links. The outer dims (``dp``, then ``pp``, torchtitan's order) cross nodes once their
groups span more than one node; Llama 3 put ``dp`` outermost instead.

``forward_backward`` runs one step's forward and backward on any mesh: through a ``torch.distributed.pipelining``
GPipe schedule over the ``pp`` dim when there is one, under ``loss_parallel`` when the head is cut by vocabulary.
``global_mean_loss`` and ``gathered_parameters`` bring the step's loss and the whole model back to every rank, for
the proof that the N-D run trains the same model as the 1-D FSDP control (torchtitan's "converging" check).
"""

import logging
import warnings
from contextlib import nullcontext
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from common.context_parallel import context_parallel_attend, shard_positions
from common.distributed import ConfigurationError
from common.gpt import GPT, next_token_loss
from common.pipeline import transformer_stage_blocks
from common.sequence_parallel import parallelize_gpt

# Outermost to innermost: the pipeline's messages cross the slowest links, tensor parallelism's the fastest. The data
# ranks are replicas (dp_replicate: each holds a whole copy of the shards, gradients all-reduced between them) of
# FSDP groups (dp_shard): HSDP, when there are several replicas. The context ranks (cp) of a data rank share its
# sequences, each holding its zig-zag share of every sequence's positions.
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
LAYOUT = "zigzag"  # how the cp ranks cut a sequence (common.context_parallel.shard_pieces)


def check_degrees(pp: int, dp: int, tp: int, world_size: int, replicas: int = 1, cp: int = 1, **shapes) -> None:
    """A ``ConfigurationError`` that says why, before any collective, when the degrees do not fit: their product
    must be the world size, ``replicas`` must divide ``dp``, and ``shapes`` (any of ``num_layers``,
    ``num_heads``, ``d_model``, ``context``, ``vocab_size``, ``batch_size`` (the global batch), ``microbatches``)
    must divide by them. The context: into 2 ``cp`` zig-zag chunks, then each ``cp`` rank's share by ``tp``."""
    if pp * dp * cp * tp != world_size:
        raise ConfigurationError(
            f"error: the mesh --pp {pp} x --dp {dp} x --cp {cp} x --tp {tp} needs {pp * dp * cp * tp} processes, "
            f"but {world_size} were started: choose degrees whose product is {world_size}"
        )
    if dp % replicas:
        raise ConfigurationError(f"error: --replicas {replicas} does not divide --dp {dp}: HSDP's replicas are "
                                 f"groups of dp / replicas FSDP ranks")  # fmt: skip
    rules = [
        ("num_layers", pp, "every pipeline stage needs a block: --layers at least --pp", lambda n, k: n >= k),
        ("num_heads", tp, "each tensor-parallel rank takes whole heads: --heads divisible by --tp", None),
        ("d_model", tp, "the projections split by columns: --d-model divisible by --tp", None),
        ("vocab_size", tp, "the head splits the vocabulary: 256 divisible by --tp", None),
        (
            "context",
            2 * cp if cp > 1 else 1,
            "the zig-zag layout cuts it into 2 x cp chunks: --context divisible by 2 x --cp",
            None,
        ),
        ("context", cp * tp, "sequence parallelism cuts a cp rank's share: --context / --cp divisible by --tp", None),
        ("batch_size", dp, "each data rank takes an equal share: --batch-size divisible by --dp", None),
    ]
    for name, degree, why, fits in rules:
        if name in shapes and not (fits or (lambda n, k: n % k == 0))(shapes[name], degree):
            raise ConfigurationError(f"error: {name} {shapes[name]} does not fit degree {degree}: {why}")
    if pp > 1 and "batch_size" in shapes and "microbatches" in shapes:
        if (shapes["batch_size"] // dp) % shapes["microbatches"]:
            raise ConfigurationError(
                f"error: a data rank's {shapes['batch_size'] // dp} sequences do not split into "
                f"{shapes['microbatches']} micro-batches: --batch-size / --dp divisible by --microbatches"
            )


def make_mesh(
    device_type: str, pp: int, dp: int, tp: int, world_size: int, replicas: int = 1, cp: int = 1
) -> DeviceMesh:
    """The 5-D ``DeviceMesh`` ``MESH_DIMS`` of ``pp`` x ``replicas`` x ``dp / replicas`` x ``cp`` x ``tp`` ranks (a
    degree of 1 is a dim of size 1): rank r's coordinates count in that order, the tensor-parallel ranks
    neighbours."""
    check_degrees(pp, dp, tp, world_size, replicas, cp)
    return init_device_mesh(device_type, (pp, replicas, dp // replicas, cp, tp), mesh_dim_names=MESH_DIMS)


def data_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP shards over: the data ranks, and the context ranks with them when ``cp`` > 1 (``dp_shard``
    and ``cp`` flattened into one dim, ``"dp_shard_cp"``, as torchtitan does). 1-D with one replica, else 2-D
    (``"dp_replicate"`` first), on which ``fully_shard`` is HSDP."""
    replicated = mesh["dp_replicate"].size() > 1
    if mesh["cp"].size() == 1:
        return mesh["dp_replicate", "dp_shard"] if replicated else mesh["dp_shard"]
    # the cp ranks hold the same weights: one FSDP group with the data ranks. Flattening has no public name in
    # torch 2.14 (torchtitan calls the same); slicing "dp_shard_cp" back out of the root mesh is deprecated there,
    # so HSDP joins the two 1-D meshes instead.
    shard = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    return DeviceMesh._concatenate([mesh["dp_replicate"], shard]) if replicated else shard


def data_rank(mesh: DeviceMesh) -> tuple[int, int]:
    """This rank's index among the data ranks, and their number: which share of the global batch it trains on. The
    ``cp`` ranks of a data rank share it (``context_share`` then cuts each sequence)."""
    replica, shard, shards = (
        mesh["dp_replicate"].get_local_rank(),
        mesh["dp_shard"].get_local_rank(),
        mesh["dp_shard"].size(),
    )
    return replica * shards + shard, mesh["dp_replicate"].size() * shards


def context_share(sequences: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """This rank's positions of ``sequences`` (batch, context), tokens or targets: its zig-zag share on the ``cp``
    dim (``shard_positions``), in the order ``GPT.positions`` embeds them. All of them without a ``cp`` dim."""
    cp = mesh["cp"]
    if cp.size() == 1:
        return sequences
    return sequences[:, shard_positions(sequences.shape[1], cp.get_local_rank(), cp.size(), LAYOUT)]


def pipeline_split(gpt: GPT, stage: int, num_stages: int) -> tuple[GPT, int]:
    """``gpt`` cut to pipeline stage ``stage`` of ``num_stages`` (contiguous blocks, as many as
    ``common.pipeline.transformer_stage_blocks`` gives it: the planner's layout, Llama 3's lighter end stages when
    the blocks do not divide evenly), and the index of its first block in the whole model. The first stage keeps the
    embeddings, the last the final norm and the head; what a stage lacks becomes ``None``, which ``GPT.forward``
    reads as "activations in" or "activations out". Every rank builds the whole model first (the same seed, the
    same weights as the control), then drops what its stage does not hold, as torchtitan does."""
    sizes = transformer_stage_blocks(len(gpt.blocks), num_stages)
    start = sum(sizes[:stage])
    stop = start + sizes[stage]
    gpt.blocks = nn.ModuleList(gpt.blocks[start:stop])  # renumbered from 0: names map back with ``start``
    if stage > 0:
        gpt.token = gpt.position = None
    if stage < num_stages - 1:
        gpt.norm = gpt.head = None
    return gpt, start


def apply_tensor_parallel(gpt: GPT, tp_mesh: DeviceMesh) -> GPT:
    """Lesson 13's tensor + sequence parallelism of ``gpt`` on the 1-D ``tp_mesh``: ``parallelize_gpt``'s plan
    itself. On a pipeline stage some of the modules it names are gone (the first stage has no head): torch skips
    those entries with a warning, which is expected here and silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Parallelize plan key")
        return parallelize_gpt(gpt, tp_mesh)


def apply_context_parallel(gpt: GPT, cp_mesh: DeviceMesh) -> GPT:
    """Lesson 14's context parallelism of ``gpt`` on the 1-D ``cp_mesh``: every attention mixes its projections by
    ring attention over the ``cp`` ranks (``context_parallel_attend``, zig-zag, causal), on the heads this rank
    holds (after tensor parallelism, ``num_heads / tp``), and the first stage embeds this rank's zig-zag positions of a
    ``gpt.context``-long sequence (``GPT.positions``). No parameter changes: feed it ``context_share``'s tokens.
    torch's ``context_parallel`` swaps only ``F.scaled_dot_product_attention``, ringed on CUDA's SDPA kernels, which
    this GPT never calls; this ring replaces the GPT's own ``attend`` and runs on CPU and gloo too.
    Returns ``gpt``."""
    group, rank, size = cp_mesh.get_group(), cp_mesh.get_local_rank(), cp_mesh.size()
    for block in gpt.blocks:
        block.attention.attend = partial(context_parallel_attend, group=group, layout=LAYOUT)
    device = next(gpt.parameters()).device
    gpt.positions = shard_positions(gpt.context, rank, size, LAYOUT).to(device)
    return gpt


def apply_fsdp(gpt: GPT, dp_mesh: DeviceMesh) -> GPT:
    """FSDP2 over ``dp_mesh`` (``data_mesh``): ``fully_shard`` on every block, then on the root (embeddings, norm,
    head), as lesson 06 does. On a 2-D mesh ("dp_replicate", "dp_shard") it is HSDP: shards within each replica,
    gradients all-reduced across the replicas. With context parallelism the shard dim is ``"dp_shard_cp"``: the
    gradients are averaged over the data and context ranks together. Returns ``gpt``."""
    for block in gpt.blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(gpt, mesh=dp_mesh)
    return gpt


def parallelize(gpt: GPT, mesh: DeviceMesh) -> tuple[GPT, int]:
    """``gpt`` on ``mesh`` (``make_mesh``): this rank's pipeline stage, tensor + sequence parallel, context parallel,
    sharded over its data and context ranks, in torchtitan's order (common/parallelize.py's docstring says why);
    dims of size 1 are skipped. Returns the stage and the index of its first block."""
    # BEGIN LAB: apply the four parallelisms in torchtitan's order
    # lesson 16, section 1; pipeline_split, apply_tensor_parallel, apply_context_parallel and apply_fsdp do one each;
    # skip pp, tp and cp where their dim has one rank (mesh["tp"].size()), but FSDP always runs, over data_mesh(mesh);
    # a stage's index is its rank on the pp dim; first_block comes from pipeline_split (0 without a pipeline)
    first_block = 0
    if mesh["pp"].size() > 1:  # 1. each stage is a model of its own, which the others then transform
        gpt, first_block = pipeline_split(gpt, mesh["pp"].get_local_rank(), mesh["pp"].size())
    if mesh["tp"].size() > 1:  # 2. DTensors on the tp dim
        apply_tensor_parallel(gpt, mesh["tp"])
    if mesh["cp"].size() > 1:  # 3. after tp: the ring carries this rank's heads only
        apply_context_parallel(gpt, mesh["cp"])
    apply_fsdp(gpt, data_mesh(mesh))  # 4. last: FSDP shards the parameters it finds, over the data and cp ranks
    # END LAB
    return gpt, first_block


def loss_context(mesh: DeviceMesh):
    """``loss_parallel`` where the head is cut by vocabulary (tp > 1): the loss, and its backward, on logits that
    no rank holds whole."""
    return loss_parallel() if mesh["tp"].size() > 1 else nullcontext()


def make_schedule(stage_model: GPT, mesh: DeviceMesh, microbatches: int, device: torch.device):
    """A GPipe schedule (``torch.distributed.pipelining``) of ``stage_model`` over the ``pp`` dim, with
    ``next_token_loss`` on the last stage; ``None`` without a pipeline. GPipe scales the gradients by
    1 / ``microbatches``: the mean of the micro-batches' mean losses, which is the batch's mean loss."""
    if mesh["pp"].size() == 1:
        return None
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    pp = mesh["pp"]
    stage = PipelineStage(stage_model, pp.get_local_rank(), pp.size(), device, group=pp.get_group())
    return ScheduleGPipe(stage, microbatches, loss_fn=next_token_loss, scale_grads=True)


def forward_backward(model: GPT, schedule, mesh: DeviceMesh, tokens, targets) -> float | None:
    """One step's forward and backward of this data rank's ``tokens`` and ``targets``; the gradients are then
    FSDP's, averaged over the data ranks. Returns this rank's mean loss, or ``None`` on a pipeline stage that does
    not compute it (all but the last)."""
    with loss_context(mesh):
        if schedule is None:
            loss = next_token_loss(model(tokens), targets)
            loss.backward()
            return (loss.full_tensor() if isinstance(loss, DTensor) else loss).item()
        stage = mesh["pp"].get_local_rank()
        losses = [] if stage == mesh["pp"].size() - 1 else None
        inputs = (tokens,) if stage == 0 else ()
        schedule.step(*inputs, target=targets if losses is not None else None, losses=losses)
    if losses is None:
        return None
    return torch.stack([(x.full_tensor() if isinstance(x, DTensor) else x).detach() for x in losses]).mean().item()


def global_mean_loss(local: float | None, mesh: DeviceMesh, device: torch.device) -> float:
    """The step's loss over the whole global batch, the same on every rank: the mean over the ranks that computed
    one (the last stage's data x context x tensor ranks; the tensor ranks hold the same value, each context rank the
    mean over its equal share of the tokens). One all-reduce of
    (sum, count) in float64 over the world."""
    pair = torch.tensor([local or 0.0, 0.0 if local is None else 1.0], dtype=torch.float64, device=device)
    dist.all_reduce(pair)  # gloo has no AVG: sum, then divide
    return (pair[0] / pair[1]).item()


def gathered_parameters(model: GPT, first_block: int) -> dict[str, torch.Tensor]:
    """Every parameter of the whole model, gathered whole onto every rank (on the CPU), under the whole GPT's names:
    each stage gathers its DTensors over its data and tensor ranks (``full_tensor``), then the stages exchange
    theirs (``all_gather_object``). A collective: every rank calls it."""
    mine = {}
    # FSDP's shards of TP's shards come back in two all-gathers, which torch logs as slow on every rank: exact here.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    for name, parameter in model.named_parameters():
        whole = parameter.full_tensor() if isinstance(parameter, DTensor) else parameter
        if name.startswith("blocks."):
            index, rest = name.removeprefix("blocks.").split(".", 1)
            name = f"blocks.{int(index) + first_block}.{rest}"
        mine[name] = whole.detach().cpu()
    stages = [None] * dist.get_world_size()
    dist.all_gather_object(stages, mine)
    return {name: tensor for stage in stages for name, tensor in stage.items()}


def differences(control: dict, run: dict) -> dict[str, float]:
    """How far ``run`` ended from ``control`` (each ``{"losses": [...], "parameters": {name: tensor}}``, as the
    solution's ``train`` returns them): the largest difference of a step's loss, and of any element of any final
    parameter. A parameter that one of them lacks, or a different number of steps, is a ``ValueError``."""
    if len(control["losses"]) != len(run["losses"]) or control["parameters"].keys() != run["parameters"].keys():
        missing = sorted(control["parameters"].keys() ^ run["parameters"].keys())
        raise ValueError(f"the runs differ in steps or parameters: {len(control['losses'])} vs "
                         f"{len(run['losses'])} steps, parameters in one only: {missing}")  # fmt: skip
    loss = max(abs(a - b) for a, b in zip(control["losses"], run["losses"]))
    parameters = control["parameters"]
    parameter = max((parameters[name] - run["parameters"][name]).abs().max().item() for name in parameters)
    return {"loss": loss, "parameter": parameter}
