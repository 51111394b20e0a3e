"""Composition (lesson 16): lesson 13's GPT on a mesh of pipeline x data x tensor ranks, applied by functions.

The model code (``common.gpt``) never imports ``torch.distributed``: each kind of parallelism is *applied* to it by
one function here, in the order torchtitan's ``pipeline_llama`` and ``parallelize_llama`` apply theirs:

    mesh = make_mesh(device_type, pp=2, dp=2, tp=2, world_size=8)    # dims pp, dp_replicate, dp_shard, tp
    stage, first_block = pipeline_split(gpt, stage_index, pp)        # 1. this stage's blocks (lesson 11)
    apply_tensor_parallel(stage, mesh["tp"])                         # 2. TP + SP + a vocabulary-parallel head (12-13)
                                                                     #    (context parallelism would come here, 14)
    apply_fsdp(stage, data_mesh(mesh))                               # 3. FSDP2 (or HSDP) over the data ranks (06)
    optimizer = torch.optim.AdamW(stage.parameters())                # after all of them: it sees the final shards

``parallelize`` does the three in that order. Why this order: the pipeline cut comes first because each stage is a
model of its own, which the other two then transform. Tensor parallelism comes before FSDP because FSDP shards
whatever parameters it finds: after tensor parallelism they are DTensors on the ``tp`` dim, and FSDP cuts them
again along the ``dp`` dim (norms and row-wise biases are ``Replicate`` on ``tp``; HSDP adds ``Replicate`` on
``dp_replicate``). The other way round, tensor parallelism would find FSDP's shards and not the weights its plan
names. The ``tp`` dim is innermost (neighbouring ranks): its collectives run in every block, so on a real cluster
they stay inside a node's fast links. The outer dims (``dp``, then ``pp``, torchtitan's order) cross nodes once
their groups span more than one node; Llama 3 put ``dp`` outermost instead.

Context parallelism (lesson 14, ``common.context_parallel``) is not applied here yet. In torchtitan it is not a
change to the model: a ``cp`` dim sits between ``dp`` and ``tp``, each batch's sequence is cut over it inside a
context manager around forward and backward (ring attention), and FSDP then shards over the flattened
``dp`` x ``cp`` dims, since the ``cp`` ranks hold the same weights. A ``cp`` degree would enter ``make_mesh``, the
step (``forward_backward``) and ``apply_fsdp``'s mesh.

``forward_backward`` runs one step's forward and backward on any mesh: through a ``torch.distributed.pipelining``
GPipe schedule over the ``pp`` dim when there is one, under ``loss_parallel`` when the head is cut by vocabulary.
``global_mean_loss`` and ``gathered_parameters`` bring the step's loss and the whole model back to every rank, for
the proof that the N-D run trains the same model as the 1-D FSDP control (torchtitan's "converging" check).
"""

import logging
import warnings
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from common.distributed import ConfigurationError
from common.gpt import GPT, next_token_loss
from common.pipeline import stage_bounds
from common.sequence_parallel import parallelize_gpt

# Outermost to innermost: the pipeline's messages cross the slowest links, tensor parallelism's the fastest. The data
# ranks are replicas (dp_replicate: each holds a whole copy of the shards, gradients all-reduced between them) of
# FSDP groups (dp_shard): HSDP, when there are several replicas.
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


def check_degrees(pp: int, dp: int, tp: int, world_size: int, replicas: int = 1, **shapes) -> None:
    """A ``ConfigurationError`` that says why, before any collective, when the degrees do not fit: their product
    must be the world size, ``replicas`` must divide ``dp``, and ``shapes`` (any of ``num_layers``,
    ``num_heads``, ``d_model``, ``context``, ``vocab_size``, ``batch_size`` (the global batch), ``microbatches``)
    must divide by them."""
    if pp * dp * tp != world_size:
        raise ConfigurationError(
            f"error: the mesh --pp {pp} x --dp {dp} x --tp {tp} needs {pp * dp * tp} processes, but "
            f"{world_size} were started: choose degrees whose product is {world_size}"
        )
    if dp % replicas:
        raise ConfigurationError(f"error: --replicas {replicas} does not divide --dp {dp}: HSDP's replicas are "
                                 f"groups of dp / replicas FSDP ranks")  # fmt: skip
    rules = [
        ("num_layers", pp, "every pipeline stage needs a block: --layers at least --pp", lambda n, k: n >= k),
        ("num_heads", tp, "each tensor-parallel rank takes whole heads: --heads divisible by --tp", None),
        ("d_model", tp, "the projections split by columns: --d-model divisible by --tp", None),
        ("vocab_size", tp, "the head splits the vocabulary: 256 divisible by --tp", None),
        ("context", tp, "sequence parallelism cuts the sequence: --context divisible by --tp", None),
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


def make_mesh(device_type: str, pp: int, dp: int, tp: int, world_size: int, replicas: int = 1) -> DeviceMesh:
    """The 4-D ``DeviceMesh`` ``MESH_DIMS`` of ``pp`` x ``replicas`` x ``dp / replicas`` x ``tp`` ranks (a degree
    of 1 is a dim of size 1): rank r's coordinates count in that order, the tensor-parallel ranks neighbours."""
    check_degrees(pp, dp, tp, world_size, replicas)
    return init_device_mesh(device_type, (pp, replicas, dp // replicas, tp), mesh_dim_names=MESH_DIMS)


def data_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The data ranks' mesh, for FSDP: 1-D ("dp_shard") with one replica, else 2-D ("dp_replicate", "dp_shard"),
    on which ``fully_shard`` is HSDP."""
    return mesh["dp_replicate", "dp_shard"] if mesh["dp_replicate"].size() > 1 else mesh["dp_shard"]


def data_rank(mesh: DeviceMesh) -> tuple[int, int]:
    """This rank's index among the data ranks, and their number: which share of the global batch it trains on."""
    replica, shard, shards = (
        mesh["dp_replicate"].get_local_rank(),
        mesh["dp_shard"].get_local_rank(),
        mesh["dp_shard"].size(),
    )
    return replica * shards + shard, mesh["dp_replicate"].size() * shards


def pipeline_split(gpt: GPT, stage: int, num_stages: int) -> tuple[GPT, int]:
    """``gpt`` cut to pipeline stage ``stage`` of ``num_stages`` (``common.pipeline.stage_bounds``: contiguous
    blocks, balanced by count), and the index of its first block in the whole model. The first stage keeps the
    embeddings, the last the final norm and the head; what a stage lacks becomes ``None``, which ``GPT.forward``
    reads as "activations in" or "activations out". Every rank builds the whole model first (the same seed, the
    same weights as the control), then drops what its stage does not hold, as torchtitan does."""
    start, stop = stage_bounds(len(gpt.blocks), num_stages)[stage]
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


def apply_fsdp(gpt: GPT, dp_mesh: DeviceMesh) -> GPT:
    """FSDP2 over ``dp_mesh`` (``data_mesh``): ``fully_shard`` on every block, then on the root (embeddings, norm,
    head), as lesson 06 does. On a 2-D mesh ("dp_replicate", "dp_shard") it is HSDP: shards within each replica,
    gradients all-reduced across the replicas. Returns ``gpt``."""
    for block in gpt.blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(gpt, mesh=dp_mesh)
    return gpt


def parallelize(gpt: GPT, mesh: DeviceMesh) -> tuple[GPT, int]:
    """``gpt`` on ``mesh`` (``make_mesh``): this rank's pipeline stage, tensor + sequence parallel, sharded over
    its data ranks, in torchtitan's order (common/parallelize.py's docstring says why); dims of size 1 are skipped.
    Returns the stage and the index of its first block."""
    # BEGIN LAB: apply the three parallelisms in torchtitan's order
    # pipeline_split, apply_tensor_parallel and apply_fsdp do one each; skip a dim of size 1 (mesh["tp"].size())
    # a stage's index is its rank on the pp dim: mesh["pp"].get_local_rank()
    first_block = 0
    if mesh["pp"].size() > 1:  # 1. each stage is a model of its own, which the others then transform
        gpt, first_block = pipeline_split(gpt, mesh["pp"].get_local_rank(), mesh["pp"].size())
    if mesh["tp"].size() > 1:  # 2. DTensors on the tp dim (context parallelism would follow here)
        apply_tensor_parallel(gpt, mesh["tp"])
    apply_fsdp(gpt, data_mesh(mesh))  # 3. last: FSDP shards the parameters it finds, TP's DTensors included
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
    one (the last stage's data x tensor ranks; the tensor ranks hold the same value). One all-reduce of
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
