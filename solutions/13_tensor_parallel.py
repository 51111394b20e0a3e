"""Lab 13 (lesson 12): tensor parallelism by hand: a transformer layer's attention and MLP split over processes.

Every process builds the same small model with the same seed: the rows of an image are its tokens, embedded, then
one transformer layer (self-attention and an MLP, each with a residual), then a classifier head. The attention
block and the MLP are split Megatron-style over the processes (common/tensor_parallel.py): each rank keeps its
heads of the attention and its slice of the MLP's hidden features, and two all-reduces per block and step put the
results together (one forward, one backward). The embedding, the norms and the head are replicated. The processes
of one tensor-parallel group train on the same batches: tensor parallelism splits the layers, not the data.

With ``--data-parallel R`` the processes form a 2-D mesh: R replicas of the model, each split over world_size / R
processes, each replica on its own batches, the gradients averaged over the replicas (DDP over the data-parallel
group by hand; FSDP2 over it with ``--tp torch``). The script prints the all-reduces of the first training step,
checks at the end of every epoch that every tensor several ranks hold is the same on each of them (``copies_in_sync``:
each rank's own copy, no gather, and it says when no two ranks hold the same piece), and evaluates test accuracy.

    # CPU, 2 processes (gloo), digits: the blocks split by hand
    torchrun --standalone --nproc_per_node=2 solutions/13_tensor_parallel.py --dataset digits

    # the same split by torch's DTensor (parallelize_module with ColwiseParallel and RowwiseParallel)
    torchrun --standalone --nproc_per_node=2 solutions/13_tensor_parallel.py --dataset digits --tp torch

    # 2-D: 2 data-parallel replicas x 2 tensor-parallel processes, 32 samples per replica: the global batch of 64
    # of the first command, so the same training to float rounding; by torch: DTensor TP, FSDP2 over the replicas
    torchrun --standalone --nproc_per_node=4 solutions/13_tensor_parallel.py --dataset digits --data-parallel 2 \
        --batch-size 32
    torchrun --standalone --nproc_per_node=4 solutions/13_tensor_parallel.py --dataset digits --data-parallel 2 \
        --batch-size 32 --tp torch

    # 4 GPUs (NCCL is picked by itself), Fashion-MNIST: a head and a quarter of the MLP per GPU
    torchrun --standalone --nproc_per_node=4 solutions/13_tensor_parallel.py

labs/13_tensor_parallel.py leaves Megatron's f and g (their forward and backward) and the column and row split of
a linear's weight to you. ``--batch-size`` is every replica's batch, the same batch on each rank of it. Both
versions make two all-reduces forward and two backward per step (``--tp torch``: ``parallelize_block`` gives the
attention's q, k and v one shared input, whose gradient is all-reduced once, as behind the by-hand block's one f).
"""

import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.nn.parallel import DistributedDataParallel as DDP

from common.checkpoint import unwrap
from common.cli import options_line, positive_int
from common.collectives import count_collectives
from common.data import FirstBatches, load_data, make_loader
from common.distributed import ConfigurationError, print0, process_group, set_seed
from common.metrics import evaluate
from common.tensor_parallel import (
    TransformerBlock,
    data_and_tensor_parallel_mesh,
    mlp_all_reduce_bytes,
    parallelize_block,
)

# BEGIN LAB: apply the autograd Function (``.apply``), as Megatron's f or g
from common.tensor_parallel import copy_to_tensor_parallel, reduce_from_tensor_parallel  # noqa: F401  # isort: skip

# END LAB
# BEGIN LAB: Megatron's f and g, and the column and row split of a linear
from common.tensor_parallel import ColumnParallelLinear, RowParallelLinear  # noqa: F401  # isort: skip
from common.tensor_parallel import CopyToTensorParallel, ReduceFromTensorParallel  # noqa: F401  # isort: skip
from common.tensor_parallel import TensorParallelMLP, TensorParallelSelfAttention  # isort: skip

# END LAB
from common.training import progress_bar, training_arguments

INPUT_SHAPE = (1, 28, 28)  # (channels, height, width): 28 tokens (rows) of 28 pixels
D_MODEL, NUM_HEADS = 64, 4  # the MLP's hidden width is 4 * D_MODEL: both split into 1, 2 or 4 equal parts
TP_CHOICES = ("by-hand", "torch")


def parse_args(argv=None):
    parser = training_arguments(__doc__.splitlines()[0])
    parser.set_defaults(model="row-transformer")  # the script's own model: --model's choices are other scripts'
    parser.add_argument("--tp", choices=TP_CHOICES, default="by-hand", help="who splits the blocks")
    parser.add_argument(
        "--data-parallel",
        type=positive_int,
        default=1,
        help="replicas of the model (a 2-D mesh): each split over world size / this many processes",
    )
    return parser.parse_args(argv)


class RowTransformer(nn.Module):
    """An image as a sequence of its rows: each row embedded as a token, plus a learned position; one pre-norm
    transformer layer (attention, then the MLP, each added to its input); the tokens' mean; a linear head."""

    def __init__(self, num_classes: int, input_shape=INPUT_SHAPE, d_model=D_MODEL, num_heads=NUM_HEADS):
        super().__init__()
        channels, height, width = input_shape
        self.embed = nn.Linear(width, d_model)
        self.position = nn.Embedding(channels * height, d_model)
        self.layer = TransformerBlock(d_model, num_heads)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, images):
        X = self.embed(images.flatten(1, 2)) + self.position.weight  # (batch, channels * height, d_model)
        return self.head(self.layer(X).mean(dim=1))

    def replicated(self) -> nn.ModuleList:
        """The modules every rank holds whole: all but the two blocks that tensor parallelism splits."""
        layer = self.layer
        return nn.ModuleList([self.embed, self.position, layer.attention_norm, layer.mlp_norm, self.head])

    def split(self) -> nn.ModuleList:
        """The two blocks that tensor parallelism splits: each rank holds its shard of them."""
        return nn.ModuleList([self.layer.attention, self.layer.mlp])


def shard_by_hand(model: RowTransformer, mesh, env) -> nn.Module:
    """Replace the model's two blocks by this rank's shards of them over the mesh's tensor-parallel group
    (common.tensor_parallel); with several replicas, DDP over the data-parallel group averages the gradients."""
    tp = mesh["tp"]
    shard, size, group = tp.get_local_rank(), tp.size(), tp.get_group()
    model.layer.attention = TensorParallelSelfAttention.from_full(model.layer.attention, shard, size, group)
    model.layer.mlp = TensorParallelMLP.from_full(model.layer.mlp, shard, size, group)
    if mesh["dp"].size() == 1:
        return model
    return DDP(model, device_ids=env.device_ids, process_group=mesh["dp"].get_group())


def shard_with_torch(model: RowTransformer, mesh, env) -> nn.Module:
    """The same split by torch's DTensor on the mesh's tensor-parallel dimension (``parallelize_block``: q, k, v and
    the MLP's first linear by output features, the two output linears by input features); with several replicas,
    FSDP2 over the data-parallel dimension (as torchtitan does)."""
    from torch.distributed.fsdp import fully_shard

    parallelize_block(model.layer, mesh["tp"])
    return model if mesh["dp"].size() == 1 else fully_shard(model, mesh=mesh["dp"])


def main(args):
    with process_group(args.backend) as env:  # torchrun's RANK, WORLD_SIZE...; left on errors too
        train(args, env)


def train(args, env):
    print0(f"{env.summary} | {options_line(args)}")
    if args.model != "row-transformer":
        raise ConfigurationError("error: this script builds its own model (rows of an image as tokens): no --model")
    replicas = args.data_parallel
    if env.world_size % replicas:
        raise ConfigurationError(f"error: --data-parallel {replicas} does not divide the {env.world_size} processes")
    tp_size = env.world_size // replicas
    for what, size in (("num_heads", NUM_HEADS), ("the MLP's hidden features", 4 * D_MODEL)):
        if size % tp_size:
            raise ConfigurationError(f"error: {what}={size} do not split into {tp_size} equal parts")
    mesh = data_and_tensor_parallel_mesh(env.device.type, tp_size)  # (replicas, tp_size); rank r: shard r % tp_size
    data = load_data(args.dataset, args.data_dir, INPUT_SHAPE)
    # Each replica's own batches, the same on every rank of the replica: those ranks hold parts of one model, and
    # their all-reduces add up partial results of the same samples. Every rank tests on the whole test set.
    train_iter = FirstBatches(
        make_loader(data.train, args.batch_size, mesh["dp"].get_local_rank(), replicas, train=True, seed=args.seed),
        args.max_batches_per_epoch,
    )
    test_iter = make_loader(data.test, args.batch_size, rank=0, world_size=1, train=False)

    set_seed(args.seed)
    model = RowTransformer(data.num_classes).to(env.device)  # the same weights on every rank, then split
    net = (shard_by_hand if args.tp == "by-hand" else shard_with_torch)(model, mesh, env)
    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    print0(
        f"{replicas} replica(s) x tensor parallelism {args.tp} over {tp_size} rank(s): {NUM_HEADS // tp_size} of "
        f"{NUM_HEADS} heads and {4 * D_MODEL // tp_size} of the MLP's {4 * D_MODEL} hidden features per rank"
    )

    history = []
    for epoch in range(args.epochs):
        train_iter.sampler.set_epoch(epoch)
        loss_sum, batches, first_step = 0.0, 0, None
        started = time.perf_counter()
        for X, y in progress_bar(train_iter, f"epoch {epoch + 1}/{args.epochs}"):
            X, y = X.to(env.device), y.to(env.device)
            optimizer.zero_grad(set_to_none=True)
            if first_step is None:
                loss, first_step = counted_step(net, X, y, args.tp)
            else:
                loss = F.cross_entropy(net(X), y)
                loss.backward()
            optimizer.step()
            loss_sum, batches = loss_sum + loss.item(), batches + 1
        # every replica trains its own batches at once: the samples of one replica's epoch times the replicas
        samples_per_second = batches * args.batch_size * replicas / (time.perf_counter() - started)
        # The mean over the replicas, which trained on different batches: the loss of every sample of the epoch.
        train_loss = torch.tensor(loss_sum / max(batches, 1), device=env.device)
        dist.all_reduce(train_loss, group=mesh["dp"].get_group())
        train_loss = train_loss.item() / replicas
        history.append(report(epoch, args, env, mesh, net, test_iter, train_loss, first_step, samples_per_second))
    return history


def counted_step(model, X, y, tp: str):
    """One forward and backward, with the all-reduces of each counted: ``count_collectives`` for the by-hand
    blocks (dist.all_reduce), ``CommDebugMode`` for DTensor's (functional collectives, which dist does not see)."""
    counter = count_collectives if tp == "by-hand" else CommDebugMode
    with counter() as forward_log, warnings.catch_warnings():
        # CommDebugMode tracks modules with backward hooks, which hand FSDP2 (--data-parallel) its output as a view,
        # and FSDP2 warns against changing that view in place; the loss below reads it only.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        loss = F.cross_entropy(model(X), y)
    with counter() as backward_log:
        loss.backward()
    if tp == "by-hand":
        calls = {"forward": forward_log.calls, "backward": backward_log.calls}
        step = {
            f"{when} all-reduces": [call.bytes for call in log if call.name == "all_reduce"]
            for when, log in calls.items()
        }
    else:
        step = {
            f"{when} all-reduces": sum(count for op, count in log.get_comm_counts().items() if "all_reduce" in str(op))
            for when, log in (("forward", forward_log), ("backward", backward_log))
        }
    step["formula bytes"] = mlp_all_reduce_bytes(len(X), X.shape[1] * X.shape[2], D_MODEL, X.element_size())
    return loss, step


def same_on_every_rank(tensors, group) -> bool | None:
    """True when each of ``tensors``, as this rank holds it, is bit for bit the same on every rank of ``group``;
    False when a rank's differs; None when ``group`` has one rank, so that there is nothing to compare.

    A DTensor is compared by its local tensor, never gathered first: after a gather every rank holds the same whole
    tensor by construction, and the comparison could not fail. Every rank of ``group`` calls it (two all-reduces,
    the element-wise maximum and minimum over the ranks, equal only when all copies are)."""
    if dist.get_world_size(group) == 1:
        return None
    local = [tensor.to_local() if isinstance(tensor, DTensor) else tensor for tensor in tensors]
    flat = torch.cat([tensor.detach().reshape(-1) for tensor in local]).double()
    highest, lowest = flat.clone(), flat.clone()
    dist.all_reduce(highest, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN, group=group)
    return bool(torch.equal(highest, lowest))


def copies_in_sync(model: RowTransformer, mesh, tp: str) -> dict:
    """Whether the ranks that hold the same piece of a parameter hold the same values, for the replicated modules
    and for the split blocks: ``{"replicated": ..., "shards": ...}``, each True or None (no two ranks hold the same
    piece: nothing to compare). Raises ``RuntimeError`` on every rank when copies differ on any.

    Which ranks hold the same piece: by hand, the replicated modules are whole on every rank (compared over the
    world) and a block's shard ``r`` is on the rank of every replica with tensor-parallel rank ``r`` (over
    ``mesh["dp"]``: one rank when there is one replica). FSDP2 (``--tp torch`` with replicas) cuts every parameter
    over the replicas: a replicated module's piece is held by the ranks of one tensor-parallel group (``mesh["tp"]``),
    a split block's by one rank alone."""
    fsdp = tp == "torch" and mesh["dp"].size() > 1
    result = {
        "replicated": same_on_every_rank(
            list(model.replicated().parameters()), mesh["tp"].get_group() if fsdp else None
        ),
        "shards": None if fsdp else same_on_every_rank(list(model.split().parameters()), mesh["dp"].get_group()),
    }
    # Each rank compared over its own groups (a 2 x 2 mesh has two data-parallel groups): agree over the world, so
    # that every rank raises, none left waiting for the others in its next collective.
    device = next(model.parameters()).device
    differ = torch.tensor([same is False for same in result.values()], dtype=torch.int32, device=device)
    dist.all_reduce(differ, op=dist.ReduceOp.MAX)
    if differ.any():
        where = ", ".join(what for what, flag in zip(result, differ.tolist()) if flag)
        raise RuntimeError(f"copies differ across the ranks that hold them: {where}")
    return result


def describe_copies(in_sync: dict) -> str:
    """``copies_in_sync``'s answer in words: what was compared, or why nothing was."""
    words = {
        "replicated": "replicated parameters the same on every rank holding them",
        "shards": "each shard the same on every replica",
    }
    return ", ".join(
        f"{words[what]}: {'no two ranks hold the same piece' if same is None else same}"
        for what, same in in_sync.items()
    )


def report(epoch, args, env, mesh, net, test_iter, train_loss, first_step, samples_per_second):
    """Print and return the epoch's loss, the first step's all-reduces, ``copies_in_sync`` (which raises when
    copies differ), and the test accuracy (every rank computes the same outputs)."""
    in_sync = copies_in_sync(unwrap(net), mesh, args.tp)
    test = evaluate(net, test_iter, env.device)
    row = {"train loss": train_loss, "test accuracy": test["accuracy"], "replicas in sync": in_sync["replicated"]}
    row |= first_step
    row["shards in sync"] = in_sync["shards"]
    forward, backward = first_step["forward all-reduces"], first_step["backward all-reduces"]
    if args.tp == "by-hand":
        counted = f"{len(forward)} forward all-reduce(s) of {forward} bytes, {len(backward)} backward of {backward}"
    else:
        counted = f"{forward} forward all-reduce(s), {backward} backward (CommDebugMode counts calls, not bytes)"
    print0(
        f"epoch {epoch + 1}/{args.epochs}: train loss {train_loss:.4f} | test accuracy {test['accuracy']:.2%} | "
        f"{samples_per_second:,.0f} samples/s | "
        f"first step: {counted}; the formula: {first_step['formula bytes']} bytes each | {describe_copies(in_sync)}"
    )
    return row


if __name__ == "__main__":
    main(parse_args())
