"""ZeRO by hand (common.zero_by_hand) against one process and against PyTorch's own, on gloo.

Two process groups in all: world size 2 trains every stage side by side (and PyTorch's ZeroRedundancyOptimizer and
FSDP2 on the same data), counts one step's collectives and measures memory; world size 4 measures memory and
checks the stages again. Each returns many figures; the tests below only assert.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from common.collectives import count_collectives
from common.fsdp import full_parameters
from common.launch import run_on_ranks
from common.models import DeepMLP
from common.zero_by_hand import (
    ZeRO1Optimizer,
    ZeRO2Optimizer,
    ZeRO3Model,
    gather_full_parameters,
    model_state_bytes,
    partition_by_size,
)

STEPS, BATCH, LR = 4, 12, 0.01
STAGES = ("zero1", "zero2", "zero3")


class TiedNet(nn.Module):
    """Two blocks between a stem and a head that share their weight (tied), and a frozen bias in a block.
    Width 5: a block has 30 parameters (29 trainable), which divides by neither 4 nor 8: the flat buffers pad."""

    def __init__(self, width: int = 5):
        super().__init__()
        self.stem = nn.Linear(width, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(width, width)
        self.head.weight = self.stem.weight  # tied: one parameter, in the root unit
        self.blocks[1][0].bias.requires_grad_(False)  # frozen: never stepped, never sharded

    def forward(self, X):
        X = torch.tanh(self.stem(X))
        for block in self.blocks:
            X = block(X)
        return self.head(X)


def tied_net():
    torch.manual_seed(0)
    return TiedNet()


def batches(env, steps=STEPS):
    """``steps`` global batches; this rank's share of each (rank r takes samples r, r + N, ...)."""
    generator = torch.Generator().manual_seed(1)
    X, y = torch.randn(steps, BATCH, 5, generator=generator), torch.randint(0, 5, (steps, BATCH), generator=generator)
    if env is None:
        return list(zip(X, y))
    return [(X[s][env.rank :: env.world_size], y[s][env.rank :: env.world_size]) for s in range(steps)]


def train(net, optimizer, data):
    for X, y in data:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(net(X), y).backward()
        optimizer.step()


def parameters_of(net, stage):
    """Every parameter whole, in the original module's order (named_parameters)."""
    if stage == "zero3":
        return list(gather_full_parameters(net).values())
    return [p.detach().clone() for p in net.parameters()]


def reference(optimizer_class, **options):
    """One process on the whole batch, with the plain optimizer."""
    net = tied_net()
    train(net, optimizer_class([p for p in net.parameters() if p.requires_grad], **options), batches(None))
    return [p.detach().clone() for p in net.parameters()]


def build(stage, optimizer_class, compute_dtype=None, **options):
    if stage == "zero1":
        net = DDP(tied_net())
        return net, ZeRO1Optimizer(net.parameters(), optimizer_class, **options)
    if stage == "zero2":
        net = tied_net()
        return net, ZeRO2Optimizer(net, optimizer_class, **options)
    model = tied_net()  # units: the blocks; the root unit holds the stem and the head, which share a weight
    net = ZeRO3Model(model, units=list(model.blocks), compute_dtype=compute_dtype)
    return net, optimizer_class(net.parameters(), **options)


def fsdp2(env, reshard_after_forward):
    model = tied_net()
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward)
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    train(model, optimizer, batches(env))
    return full_parameters(model)


def one_step_collectives(net, optimizer, env):
    X, y = batches(env, 1)[0]
    with count_collectives() as log:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(net(X), y).backward()
        optimizer.step()
    return {name: [log.count(name), log.bytes(name)] for name in ("all_gather_single", "reduce_scatter_single",
                                                                   "broadcast", "all_reduce")}  # fmt: skip


def big_model_state(env, stage):
    """What a rank holds between steps of a model with many similar tensors, after two Adam steps."""
    torch.manual_seed(0)
    model = DeepMLP(width=256, depth=16)
    if stage == "zero1":
        net = DDP(model)
        optimizer = ZeRO1Optimizer(net.parameters(), torch.optim.Adam, lr=LR)
    else:
        net = ZeRO3Model(model, units=list(model.blocks))
        optimizer = torch.optim.Adam(net.parameters(), lr=LR)
    X, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    for _ in range(2):
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(net(X), y).backward()
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model_state_bytes(net, optimizer)


def every_stage(env):
    results = {"world_size": env.world_size}
    for stage in STAGES:
        net, optimizer = build(stage, torch.optim.Adam, lr=LR)
        train(net, optimizer, batches(env))
        results[stage] = parameters_of(net, stage)
        results[f"{stage}_collectives"] = one_step_collectives(net, optimizer, env)
    for stage in ("zero1", "zero2"):
        net, optimizer = build(stage, torch.optim.SGD, lr=0.1, momentum=0.9)
        train(net, optimizer, batches(env))
        results[f"{stage}_sgd"] = parameters_of(net, stage)

    net = DDP(tied_net())
    train(net, ZeroRedundancyOptimizer(net.parameters(), torch.optim.Adam, lr=LR), batches(env))
    results["torch_zero1"] = parameters_of(net, "zero1")
    results["fsdp2_full"] = fsdp2(env, True)
    results["fsdp2_grad_op"] = fsdp2(env, False)

    net, optimizer = build("zero3", torch.optim.Adam, compute_dtype=torch.bfloat16, lr=LR)
    train(net, optimizer, batches(env))
    results["zero3_bf16"] = parameters_of(net, "zero3")
    results["zero3_bf16_shard_dtypes"] = sorted({str(p.dtype) for p in net.parameters() if p.requires_grad})
    results["zero3_bf16_collectives"] = one_step_collectives(net, optimizer, env)
    for stage in ("zero1", "zero3"):
        results[f"{stage}_memory"] = big_model_state(env, stage)
    parameters = list(DeepMLP().parameters())
    index = {p: i for i, p in enumerate(parameters)}
    torch_shares = ZeroRedundancyOptimizer(parameters, torch.optim.Adam)._partition_parameters()
    results["torch_shares"] = [sorted(index[p] for group in groups for p in group["params"]) for groups in torch_shares]
    return results


@pytest.fixture(scope="module")
def runs():
    return {world_size: run_on_ranks(every_stage, world_size, timeout=120) for world_size in (2, 4)}


@pytest.fixture(scope="module")
def expected():
    return {
        "adam": reference(torch.optim.Adam, lr=LR),
        "sgd": reference(torch.optim.SGD, lr=0.1, momentum=0.9),
    }


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("stage", STAGES)
def test_each_stage_on_shards_of_the_batch_equals_one_process_on_the_whole_batch(runs, expected, stage, world_size):
    for rank in runs[world_size]:
        torch.testing.assert_close(rank[stage], expected["adam"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stage", ("zero1", "zero2"))
def test_sgd_with_momentum_equals_one_process_too(runs, expected, stage):
    for rank in runs[2]:
        torch.testing.assert_close(rank[f"{stage}_sgd"], expected["sgd"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world_size", [2, 4])
def test_zero1_equals_torch_zero_redundancy_optimizer(runs, world_size):
    for rank in runs[world_size]:
        torch.testing.assert_close(rank["zero1"], rank["torch_zero1"], rtol=0, atol=0)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("stage, fsdp", [("zero3", "fsdp2_full"), ("zero2", "fsdp2_grad_op")])
def test_zero2_and_zero3_equal_fsdp2_on_the_same_data(runs, world_size, stage, fsdp):
    for rank in runs[world_size]:
        torch.testing.assert_close(rank[stage], rank[fsdp], rtol=1e-5, atol=1e-6)


def padded(numel, world_size):
    return math.ceil(numel / world_size) * world_size


def unit_sizes():
    """Trainable elements per unit of TiedNet: its two blocks (the second has a frozen bias), then the root."""
    net = tied_net()
    blocks = [sum(p.numel() for p in block.parameters() if p.requires_grad) for block in net.blocks]
    root = net.stem.weight.numel() + net.stem.bias.numel() + net.head.bias.numel()  # the tied weight once
    return blocks, root


@pytest.mark.parametrize("world_size", [2, 4])
def test_zero2_step_is_one_reduce_scatter_of_the_gradients_and_one_all_gather_of_the_parameters(runs, world_size):
    blocks, root = unit_sizes()
    total = padded(sum(blocks) + root, world_size) * 4  # fp32 bytes of the padded flat buffer
    for rank in runs[world_size]:
        counts = rank["zero2_collectives"]
        assert counts["reduce_scatter_single"] == [1, total]
        assert counts["all_gather_single"] == [1, total]
        assert counts["broadcast"][0] == counts["all_reduce"][0] == 0


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("dtype_bytes", [4, 2])
def test_zero3_gathers_the_root_once_and_each_unit_twice_and_reduce_scatters_each_unit_once(
    runs, world_size, dtype_bytes
):
    blocks, root = unit_sizes()
    gathered = padded(root, world_size) + 2 * sum(padded(size, world_size) for size in blocks)
    reduced = padded(root, world_size) + sum(padded(size, world_size) for size in blocks)
    key = "zero3_collectives" if dtype_bytes == 4 else "zero3_bf16_collectives"
    for rank in runs[world_size]:
        counts = rank[key]
        assert counts["all_gather_single"] == [1 + 2 * len(blocks), gathered * dtype_bytes]  # bf16: half the bytes
        assert counts["reduce_scatter_single"] == [1 + len(blocks), reduced * 4]  # gradients always in fp32
        assert counts["broadcast"][0] == counts["all_reduce"][0] == 0


def test_zero1_broadcasts_each_trainable_parameter_once_from_its_owner(runs):
    net = tied_net()
    trainable = [p for p in net.parameters() if p.requires_grad]
    for rank in runs[2]:
        assert rank["zero1_collectives"]["broadcast"] == [len(trainable), 4 * sum(p.numel() for p in trainable)]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("stage, part", [("zero1", "optimizer"), ("zero3", "parameters")])
def test_memory_per_rank_is_at_most_1_05_of_an_even_share(runs, world_size, stage, part):
    model = DeepMLP(width=256, depth=16)
    numel = sum(p.numel() for p in model.parameters())
    total = {"optimizer": 8 * numel, "parameters": 4 * numel}[part]  # Adam's two fp32 states; fp32 values
    held = [rank[f"{stage}_memory"][part] for rank in runs[world_size]]
    assert max(held) <= 1.05 * total / world_size, held
    assert sum(held) >= total, "every byte is somewhere"


def test_zero3_with_bf16_compute_trains_close_to_fp32_and_keeps_fp32_shards(runs, expected):
    for rank in runs[2]:
        assert rank["zero3_bf16_shard_dtypes"] == ["torch.float32"]
        torch.testing.assert_close([p.float() for p in rank["zero3_bf16"]], expected["adam"], rtol=0.05, atol=5e-3)


@pytest.mark.parametrize("world_size", [2, 4])
def test_partition_by_size_gives_the_shares_of_zero_redundancy_optimizer(runs, world_size):
    shares = partition_by_size(list(DeepMLP().parameters()), world_size)
    assert sorted(i for share in shares for i in share) == list(range(len(list(DeepMLP().parameters()))))
    assert shares == runs[world_size][0]["torch_shares"]


def test_a_parameter_shared_by_two_units_is_a_value_error_that_names_it(monkeypatch):
    monkeypatch.setattr("torch.distributed.is_initialized", lambda: True)
    monkeypatch.setattr("torch.distributed.get_world_size", lambda: 1)
    monkeypatch.setattr("torch.distributed.get_rank", lambda: 0)
    monkeypatch.setattr("torch.distributed.broadcast", lambda tensor, src: None)
    net = tied_net()
    with pytest.raises(ValueError, match=r"'head.weight'|'stem.weight'.*one unit"):
        ZeRO3Model(net, units=[net.stem, net.head])


@pytest.mark.parametrize("make", [
    lambda: ZeRO1Optimizer(tied_net().parameters(), torch.optim.Adam),
    lambda: ZeRO2Optimizer(tied_net(), torch.optim.Adam),
    lambda: ZeRO3Model(tied_net()),
])  # fmt: skip
def test_without_a_process_group_each_stage_says_it_needs_one(make):
    with pytest.raises(RuntimeError, match="needs a process group"):
        make()
