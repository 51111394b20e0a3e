"""Lab 09: DDP built by hand: the hooks of the overlapped build, the buckets of the bucketed one.

Runs against solutions/09_ddp_by_hand.py; with LAB_TARGET=labs, against your labs/09_ddp_by_hand.py:

    LAB_TARGET=labs .venv/bin/python -m pytest tests/labs/test_09_ddp_by_hand.py

The lab file is loaded inside each spawned process (by path), since a process can only run what it imports. The
model and the training loop are tests/test_ddp_by_hand.py's: a net with a tied weight, a frozen layer, a branch
only rank 0 uses and a layer nobody uses.
"""

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from common.launch import run_on_ranks
from common.models import DeepMLP
from tests.conftest import lab_path, torchrun
from tests.labs import load_lab
from tests.test_ddp_by_hand import BATCH, SMALL_CAP_MB, TiedNet, counted_step, make_optimizer, train

LAB = "09_ddp_by_hand"
# What these tests call in the script: OverlappedDDP(module, find_unused_parameters=False) and
# BucketedDDP(module, bucket_cap_mb=25.0, find_unused_parameters=False), each with .module, forward and
# finish_gradient_synchronization() (BucketedDDP also .buckets: parameter names per bucket); and
# assign_buckets(parameters, bucket_cap_bytes) -> lists of indices. The training run goes through the command line.
NEEDS = ("OverlappedDDP", "BucketedDDP", "assign_buckets")


def test_assign_buckets_goes_in_reverse_order_and_closes_a_bucket_at_the_cap():
    assign_buckets = load_lab(LAB, NEEDS).assign_buckets
    tensors = [torch.zeros(n) for n in (100, 75, 75, 50)]  # 400, 300, 300 and 200 bytes
    assert assign_buckets(tensors, 500) == [[3, 2], [1, 0]]
    assert assign_buckets(tensors, 501) == [[3, 2, 1], [0]]
    assert assign_buckets(tensors, 1) == [[3], [2], [1], [0]]
    assert assign_buckets(tensors, 10**9) == [[3, 2, 1, 0]]


def lab_builds(env) -> dict:
    lab = load_lab(LAB, NEEDS)
    mine = slice(env.rank * BATCH, (env.rank + 1) * BATCH)
    torch.manual_seed(0)
    reference = TiedNet()
    results = {"one process": train(reference, make_optimizer("adam", reference.parameters()), slice(None))}
    torch.manual_seed(env.rank)
    ddp = DDP(TiedNet(), find_unused_parameters=True)
    results["ddp"] = train(ddp, make_optimizer("adam", ddp.parameters()), mine)
    for name, make in {
        "overlapped": lambda model, find: lab.OverlappedDDP(model, find_unused_parameters=find),
        "bucketed": lambda model, find: lab.BucketedDDP(model, bucket_cap_mb=SMALL_CAP_MB, find_unused_parameters=find),
    }.items():
        for find_unused in (False, True):
            torch.manual_seed(env.rank)  # the wrapper must broadcast rank 0's weights
            net = make(TiedNet(), find_unused)
            optimizer = make_optimizer("adam", net.parameters())
            results[f"{name}/{find_unused}"] = train(net, optimizer, mine, net.finish_gradient_synchronization)
        torch.manual_seed(0)
        net = make(DeepMLP(width=256, depth=3), False)
        generator = torch.Generator().manual_seed(env.rank)
        X, y = torch.randn(16, 1, 28, 28, generator=generator), torch.randint(0, 10, (16,), generator=generator)
        results[f"{name} step"] = counted_step(net, X, y)
        results[f"{name} step"]["gradient_bytes"] = sum(p.numel() * 4 for p in net.parameters())
        results[f"{name} step"]["buckets"] = getattr(net, "buckets", None)
    return results


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(lab_builds, 2, timeout=120)


@pytest.mark.parametrize("build", ["overlapped/False", "overlapped/True", "bucketed/False", "bucketed/True"])
def test_your_ddp_on_two_shards_equals_one_process_and_torch_ddp(results, build):
    for rank in results:
        mine = rank[build]["parameters"]
        torch.testing.assert_close(mine, results[0]["one process"]["parameters"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(mine, rank["ddp"]["parameters"], rtol=0, atol=0)
    # find_unused_parameters=True: the layer no rank used keeps grad None, as in one process.
    assert results[0][build]["grad_is_none"]["never.weight"] == build.endswith("True")


def test_your_overlapped_ddp_starts_every_all_reduce_during_backward(results):
    for rank in results:
        step = rank["overlapped step"]
        assert step["count"] == 10 and all(step["async"]), "one async all-reduce per parameter"
        assert step["bytes"] == step["gradient_bytes"]
        assert step["started_before_backward_returned"] == 10, "start each all-reduce from the parameter's hook"


def test_your_bucketed_ddp_starts_one_all_reduce_per_bucket_during_backward(results):
    for rank in results:
        step = rank["bucketed step"]
        assert step["count"] == len(step["buckets"]) == 9, "one all-reduce per bucket (1000-byte cap: 9 buckets)"
        assert step["bytes"] == step["gradient_bytes"] and all(step["async"])
        assert step["started_before_backward_returned"] == 9, "start a bucket from the hook that completes it"


def test_the_script_trains_with_your_bucketed_ddp_and_keeps_the_replicas_identical():
    run = torchrun(
        lab_path(LAB),
        *("--dataset", "digits", "--epochs", "1", "--max-batches-per-epoch", "3", "--num-workers", "0"),
        *("--bucket-cap-mb", "0.05"),
        nproc=2,
        timeout=120,
    )
    assert run.returncode == 0, run.output
    assert "one training step: 3 all-reduce(s), 0.492 MiB of gradients" in run.stdout
    assert "model replicas identical on all 2 rank(s): True" in run.stdout
