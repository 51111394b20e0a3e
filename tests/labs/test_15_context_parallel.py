"""Lab 15: the online-softmax merge, and the ring's direction of messages.

Runs against solutions/15_context_parallel.py; with LAB_TARGET=labs, against your labs/15_context_parallel.py:

    LAB_TARGET=labs .venv/bin/python -m pytest tests/labs/test_15_context_parallel.py

First, in this one process: your ``merge`` gives ``BlockwiseAttention`` the output and gradients of
``F.scaled_dot_product_attention``. Then one spawn of 2 ranks, and of 3 in the slow run (with 2, the next rank
and the previous one are the same rank, and a ring in the wrong direction would pass): your ``RingAttention``
against SDPA, causal, in the zig-zag layout, and your ``ContextParallelGPT`` against the whole GPT. The script's
own training runs in tests/test_documented_commands.py (its first command, for 2 batches).
"""

from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from common.context_parallel import shard_sequence
from common.distributed import ConfigurationError, DistEnv
from common.experiments.activations import build_gpt, token_batch
from common.experiments.context_parallel import random_qkv
from common.gpt import next_token_loss
from common.launch import run_on_ranks
from tests.labs import load_lab

LAB = "15_context_parallel"
# What these tests call in the script: the functions and classes of common.context_parallel that the lab defines,
# with the same signatures; parse_args(argv) and train(args, env), the script's own run.
NEEDS = (
    "merge",
    "pass_along",
    "BlockwiseAttention",
    "RingAttention",
    "ContextParallelGPT",
    "parse_args",
    "train",
    "torch_context_parallel_loss",
)
CONFIG = dict(context=24, d_model=16, num_heads=2, num_layers=2, dropout=0.0)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_your_merge_makes_blockwise_attention_equal_sdpa_forward_and_every_gradient(causal):
    lab = load_lab(LAB, NEEDS)
    q, k, v, grad = random_qkv(batch=2, heads=2, seq=12, head_dim=8)
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    blocks = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*whole, is_causal=causal)
    got = lab.BlockwiseAttention.apply(*blocks, 5, causal)  # blocks of 5, 5 and 2 keys
    torch.testing.assert_close(got, expected, msg="the merged output must equal attention over all the keys")
    for a, b in zip(torch.autograd.grad(got, blocks, grad), torch.autograd.grad(expected, whole, grad)):
        torch.testing.assert_close(a, b)


def test_pytorchs_context_parallel_runs_backward_inside_its_context(monkeypatch):
    """On exit ``context_parallel`` removes its SDPA handler, so the script's ``--method torch`` must run backward
    inside the block. It needs 2 GPUs, so here a stand-in block records whether it is open when gradients arrive."""
    lab = load_lab(LAB, NEEDS)
    import torch.distributed.device_mesh as device_mesh
    import torch.distributed.tensor.experimental as experimental

    block = {"open": False}

    @contextmanager
    def stand_in(mesh, buffers, buffer_seq_dims):
        block["open"] = True
        yield
        block["open"] = False

    monkeypatch.setattr(device_mesh, "init_device_mesh", lambda *args, **kwargs: None)
    monkeypatch.setattr(experimental, "context_parallel", stand_in)
    gpt = build_gpt(CONFIG)
    tokens, targets = token_batch(CONFIG, 2)
    open_at_backward = []
    gpt.head.weight.register_hook(lambda grad: open_at_backward.append(block["open"]))
    loss = lab.torch_context_parallel_loss(gpt, tokens, targets, SimpleNamespace(world_size=1), backward=True)
    assert open_at_backward == [True], "backward ran after context_parallel had removed its handler"
    assert not loss.requires_grad


def lab_checks(env):
    lab = load_lab(LAB, NEEDS)
    q, k, v, grad = random_qkv(batch=2, heads=2, seq=12, head_dim=8)
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    reference = F.scaled_dot_product_attention(*whole, is_causal=True)
    expected = [reference.detach(), *torch.autograd.grad(reference, whole, grad)]

    def mine(t):
        return shard_sequence(t, env.rank, env.world_size, "zigzag", dim=2)

    local = [mine(t).requires_grad_() for t in (q, k, v)]
    out = lab.RingAttention.apply(*local, "zigzag", True, None)
    got = [out.detach(), *torch.autograd.grad(out, local, mine(grad))]
    result = {"ring": [(a - mine(b)).abs().max().item() for a, b in zip(got, expected)]}

    tokens, targets = token_batch(CONFIG, 2)
    gpt = build_gpt(CONFIG).double()
    whole_loss = next_token_loss(gpt(tokens), targets)
    share = lab.ContextParallelGPT(build_gpt(CONFIG).double(), env.rank, env.world_size, "zigzag").loss(tokens, targets)
    total = share.detach().clone()
    torch.distributed.all_reduce(total)
    result["loss difference"] = (total - whole_loss).abs().item()
    return result


# 3 ranks take 15 s on 2 cores: `make test-slow` runs them (a ring in the wrong direction fails there), `make test` 2.
@pytest.fixture(scope="module", params=[2, pytest.param(3, marks=pytest.mark.slow)], ids=lambda n: f"world{n}")
def results(request):
    return run_on_ranks(lab_checks, request.param, timeout=150)


@pytest.mark.timeout(200)
def test_your_ring_equals_sdpa_forward_and_every_gradient(results):
    for rank, result in enumerate(results):
        names = ("output", "q's gradient", "k's gradient", "v's gradient")
        for name, difference in zip(names, result["ring"]):
            assert difference < 1e-12, f"rank {rank}, {name}: {difference} (is each block merged, and from its owner?)"


@pytest.mark.timeout(200)
def test_your_context_parallel_gpt_gives_the_whole_gpts_loss(results):
    for result in results:
        assert result["loss difference"] < 1e-12, "the ranks' shares of the loss must add up to the mean"


def test_the_script_refuses_a_context_the_zigzag_layout_cannot_cut_before_reading_any_text():
    lab = load_lab(LAB, NEEDS)
    args = lab.parse_args(["--context", "20", "--text", "no/such/file.txt"])
    env = DistEnv(rank=0, local_rank=0, world_size=4, backend="gloo", device=torch.device("cpu"))
    with pytest.raises(ConfigurationError, match="--context 20: .* does not divide into 8 equal chunks"):
        lab.train(args, env)


def test_the_torch_method_refuses_a_cpu_and_says_which_kernels_its_handler_covers():
    lab = load_lab(LAB, NEEDS)
    env = DistEnv(rank=0, local_rank=0, world_size=2, backend="gloo", device=torch.device("cpu"))
    with pytest.raises(ConfigurationError, match="flash, memory-efficient and cuDNN"):
        lab.train(lab.parse_args(["--method", "torch", "--text", "no/such/file.txt"]), env)
