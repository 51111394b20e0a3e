"""What notebook 08 and the tests of lesson 08 time with common.ddp_by_hand: when each bucket's all-reduce started and
ended against one backward pass (for a plot)."""

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common.collectives import wrapped_dist_functions
from common.ddp_by_hand import BucketedDDP


def bucket_timeline(env, bucket_cap_mb: float = 0.5, width: int = 512, depth: int = 4, batch_size: int = 64) -> dict:
    """One training step of ``BucketedDDP`` on ``DeepMLP(width, depth)``, timed: when each gradient was ready and
    when each bucket's all-reduce started and ended, against the backward pass. Run it on every rank
    (``common.launch.run_on_ranks(bucket_timeline, 2)``); each rank returns its own times.

    Returns ``{"backward_ms": when backward() returned, "finish_ms": when finish_gradient_synchronization()
    returned, "gradients": [{"parameter", "ready_ms"}, ...], "buckets": [{"index", "parameters", "bytes",
    "started_ms", "ended_ms"}, ...]}``, every time in milliseconds from the start of ``backward()``. A bucket
    "ends" when its all-reduce completes (its future's callback), not when ``wait()`` is called. One warm-up step
    runs first (allocations, gloo's connections).
    """
    from common.models import DeepMLP

    torch.manual_seed(0)
    model = DeepMLP(width=width, depth=depth).to(env.device)
    names = {p: name for name, p in model.named_parameters()}
    gradients = []
    for p in model.parameters():  # registered before the wrapper's hooks, so they run first
        p.register_post_accumulate_grad_hook(lambda p: gradients.append((names[p], time.perf_counter())))
    net = BucketedDDP(model, bucket_cap_mb=bucket_cap_mb)
    generator = torch.Generator().manual_seed(env.rank)
    X = torch.randn(batch_size, *DeepMLP.input_shape, generator=generator).to(env.device)
    y = torch.randint(0, 10, (batch_size,), generator=generator).to(env.device)
    buckets = {flat.data_ptr(): b for b, flat in enumerate(net.flat)}
    timed, callbacks = [], []

    def timing(name, all_reduce):
        def timed_all_reduce(tensor, *args, **kwargs):
            entry = {"index": buckets.get(tensor.data_ptr()), "started": time.perf_counter()}
            work = all_reduce(tensor, *args, **kwargs)
            timed.append(entry)
            # The callback runs when the all-reduce completes; the future that then() returns, once it has run.
            callbacks.append(
                work.get_future().then(lambda future, entry=entry: entry.update(ended=time.perf_counter()))
            )
            return work

        return timed_all_reduce

    for step in range(2):
        gradients.clear()
        loss = F.cross_entropy(net(X), y)
        dist.barrier()  # both ranks start backward together
        with wrapped_dist_functions(("all_reduce",) if step == 1 else (), timing):  # step 0: the untimed warm-up
            start = time.perf_counter()
            loss.backward()
            backward_end = time.perf_counter()
            net.finish_gradient_synchronization()
            finish_end = time.perf_counter()
    for callback in callbacks:
        callback.wait()
    ms = lambda t: (t - start) * 1e3  # noqa: E731
    return {
        "backward_ms": ms(backward_end),
        "finish_ms": ms(finish_end),
        "gradients": [{"parameter": name, "ready_ms": ms(t)} for name, t in gradients],
        "buckets": [
            {
                "index": entry["index"],
                "parameters": net.buckets[entry["index"]],
                "bytes": net.flat[entry["index"]].numel() * net.flat[entry["index"]].element_size(),
                "started_ms": ms(entry["started"]),
                "ended_ms": ms(entry["ended"]),
            }
            for entry in timed
            if entry["index"] is not None
        ],
    }
