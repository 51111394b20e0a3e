"""Lab 13 (lesson 12): tensor parallelism by hand: a transformer layer's attention and MLP split over processes.

Every process builds the same small model with the same seed: the rows of an image are its tokens, embedded, then
one transformer layer (self-attention and an MLP, each with a residual), then a classifier head. The attention
block and the MLP are split Megatron-style over all the processes (common/tensor_parallel.py): each rank keeps its
heads of the attention and its slice of the MLP's hidden features, and two all-reduces per block and step put the
results together (one forward, one backward). The embedding, the norms and the head are replicated. Every process
trains on the same batches: tensor parallelism splits the layers, not the data. The script prints the all-reduces
of the first training step, checks at the end that the replicated parameters are the same on every rank, and
evaluates test accuracy.

    # CPU, 2 processes (gloo), digits: the blocks split by hand
    torchrun --standalone --nproc_per_node=2 solutions/13_tensor_parallel.py --dataset digits

    # the same split by torch's DTensor (parallelize_module with ColwiseParallel and RowwiseParallel)
    torchrun --standalone --nproc_per_node=2 solutions/13_tensor_parallel.py --dataset digits --tp torch

    # 4 GPUs (NCCL is picked by itself), Fashion-MNIST: a head and a quarter of the MLP per GPU
    torchrun --standalone --nproc_per_node=4 solutions/13_tensor_parallel.py

labs/13_tensor_parallel.py leaves Megatron's f and g (their forward and backward) and the column and row split of
a linear's weight to you. ``--batch-size`` is every rank's batch, the same batch on every rank. With ``--tp torch``
the backward pass makes four all-reduces, not two: the attention's q, k and v are three modules there, and each
all-reduces its input's gradient, where the by-hand block stacks them into one column-parallel linear behind one f.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.debug import CommDebugMode

from common.collectives import count_collectives
from common.data import FirstBatches, load_data, make_loader
from common.distributed import ConfigurationError, print0, process_group, replicas_in_sync, set_seed
from common.metrics import evaluate
from common.tensor_parallel import FeedForward, SelfAttention, mlp_all_reduce_bytes, parallelize_feed_forward

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
    return parser.parse_args(argv)


class RowTransformer(nn.Module):
    """An image as a sequence of its rows: each row embedded as a token, plus a learned position; one pre-norm
    transformer layer (attention, then the MLP, each added to its input); the tokens' mean; a linear head."""

    def __init__(self, num_classes: int, input_shape=INPUT_SHAPE, d_model=D_MODEL, num_heads=NUM_HEADS):
        super().__init__()
        channels, height, width = input_shape
        self.embed = nn.Linear(width, d_model)
        self.position = nn.Embedding(channels * height, d_model)
        self.attention_norm = nn.LayerNorm(d_model)
        self.attention = SelfAttention(d_model, num_heads)
        self.mlp_norm = nn.LayerNorm(d_model)
        self.mlp = FeedForward(d_model)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, images):
        X = self.embed(images.flatten(1, 2)) + self.position.weight  # (batch, channels * height, d_model)
        X = X + self.attention(self.attention_norm(X))
        X = X + self.mlp(self.mlp_norm(X))
        return self.head(X.mean(dim=1))

    def replicated(self) -> nn.ModuleList:
        """The modules every rank holds whole: all but the two blocks that tensor parallelism splits."""
        return nn.ModuleList([module for name, module in self.named_children() if name not in ("attention", "mlp")])


def shard_by_hand(model: RowTransformer, env) -> None:
    """Replace the model's two blocks by this rank's shards of them (common.tensor_parallel)."""
    model.attention = TensorParallelSelfAttention.from_full(model.attention, env.rank, env.world_size)
    model.mlp = TensorParallelMLP.from_full(model.mlp, env.rank, env.world_size)


def shard_with_torch(model: RowTransformer, env) -> None:
    """The same split by torch's DTensor on a 1-D mesh of every rank: the MLP by ``parallelize_feed_forward``, the
    attention's q, k and v by output features (whole heads per rank) and ``out`` by input features."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh(env.device.type, (env.world_size,))
    parallelize_feed_forward(model.mlp, mesh)
    plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "out": RowwiseParallel()}
    parallelize_module(model.attention, mesh, plan)


def main(args):
    with process_group(args.backend) as env:  # torchrun's RANK, WORLD_SIZE...; left on errors too
        train(args, env)


def train(args, env):
    print0(f"{env.summary} | " + " ".join(f"--{key.replace('_', '-')}={value}" for key, value in vars(args).items()))
    if args.model != "row-transformer":
        raise ConfigurationError("error: this script builds its own model (rows of an image as tokens): no --model")
    for what, size in (("num_heads", NUM_HEADS), ("the MLP's hidden features", 4 * D_MODEL)):
        if size % env.world_size:
            raise ConfigurationError(f"error: {what}={size} do not split into {env.world_size} equal parts")
    data = load_data(args.dataset, args.data_dir, INPUT_SHAPE)
    # The same batches on every rank, for training and for testing: the ranks hold parts of one model, and their
    # all-reduces add up partial results of the same samples.
    train_iter = FirstBatches(
        make_loader(data.train, args.batch_size, rank=0, world_size=1, train=True, seed=args.seed),
        args.max_batches_per_epoch,
    )
    test_iter = make_loader(data.test, args.batch_size, rank=0, world_size=1, train=False)

    set_seed(args.seed)
    model = RowTransformer(data.num_classes).to(env.device)  # the same weights on every rank, then split
    (shard_by_hand if args.tp == "by-hand" else shard_with_torch)(model, env)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    print0(
        f"tensor parallelism {args.tp} over {env.world_size} rank(s): {NUM_HEADS // env.world_size} of {NUM_HEADS} "
        f"heads and {4 * D_MODEL // env.world_size} of the MLP's {4 * D_MODEL} hidden features per rank"
    )

    history = []
    for epoch in range(args.epochs):
        train_iter.sampler.set_epoch(epoch)
        loss_sum, batches, first_step = 0.0, 0, None
        for X, y in progress_bar(train_iter, f"epoch {epoch + 1}/{args.epochs}"):
            X, y = X.to(env.device), y.to(env.device)
            optimizer.zero_grad(set_to_none=True)
            if first_step is None:
                loss, first_step = counted_step(model, X, y, args.tp)
            else:
                loss = F.cross_entropy(model(X), y)
                loss.backward()
            optimizer.step()
            loss_sum, batches = loss_sum + loss.item(), batches + 1
        history.append(report(epoch, args, env, model, test_iter, loss_sum / max(batches, 1), first_step))
    return history


def counted_step(model, X, y, tp: str):
    """One forward and backward, with the all-reduces of each counted: ``count_collectives`` for the by-hand
    blocks (dist.all_reduce), ``CommDebugMode`` for DTensor's (functional collectives, which dist does not see)."""
    counter = count_collectives if tp == "by-hand" else CommDebugMode
    with counter() as forward_log:
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


def report(epoch, args, env, model, test_iter, train_loss, first_step):
    """Print and return the epoch's loss, the first step's all-reduces, whether the replicated parameters are the
    same on every rank, and the test accuracy (every rank computes the same outputs)."""
    in_sync = replicas_in_sync(model.replicated())
    test = evaluate(model, test_iter, env.device)
    row = {"train loss": train_loss, "test accuracy": test["accuracy"], "replicas in sync": in_sync, **first_step}
    forward, backward = first_step["forward all-reduces"], first_step["backward all-reduces"]
    if args.tp == "by-hand":
        counted = f"{len(forward)} forward all-reduce(s) of {forward} bytes, {len(backward)} backward of {backward}"
    else:
        counted = f"{forward} forward all-reduce(s), {backward} backward (CommDebugMode counts calls, not bytes)"
    print0(
        f"epoch {epoch + 1}/{args.epochs}: train loss {train_loss:.4f} | test accuracy {test['accuracy']:.2%} | "
        f"first step: {counted}; the formula: {first_step['formula bytes']} bytes each | "
        f"replicated parameters the same on every rank: {in_sync}"
    )
    return row


if __name__ == "__main__":
    main(parse_args())
