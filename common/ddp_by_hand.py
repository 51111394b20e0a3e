"""DDP built by hand (lesson 08): naive, overlapped with gradient hooks, bucketed.

``DistributedDataParallel`` does three things, and this module builds them one at a time, the way picotron's
``DataParallelNaive`` comes before its ``DataParallelBucket``. The design is DDP's, as Li et al. describe it in
"PyTorch Distributed: Experiences on Accelerating Data Parallel Training" (VLDB 2020):

- ``NaiveDDP``: rank 0's weights at construction; after ``backward()``, one blocking all-reduce per gradient, then
  divide by the world size. Correct, and slow: the network idles during backward and the CPU idles during the
  all-reduces, and many small messages each pay the full latency.
- ``OverlappedDDP``: a hook on every parameter starts an asynchronous all-reduce the moment its gradient is ready,
  while autograd is still computing the earlier layers' gradients (communication overlaps computation).
- ``BucketedDDP``: the gradients share a few flat buffers (buckets) of about ``bucket_cap_mb`` each; a bucket is
  all-reduced, as one message, once all its gradients are in. The gradients are views into their bucket, so the
  all-reduced bucket is already the gradients: nothing is copied back.
- ``assign_buckets``: which parameters share a bucket: DDP's rule, in reverse order of ``parameters()``.

Each wrapper is used like DDP, plus one call before the optimizer step (DDP hides it at the end of backward):

    net = BucketedDDP(model)          # broadcasts rank 0's parameters and buffers
    optimizer.zero_grad(set_to_none=True)   # before forward: BucketedDDP's forward points .grad at its buckets
    loss = F.cross_entropy(net(X), y)
    loss.backward()                   # OverlappedDDP/BucketedDDP start all-reduces here, from their hooks
    net.finish_gradient_synchronization()   # wait for them, divide by the world size
    optimizer.step()

What every wrapper handles:

- frozen parameters (``requires_grad=False``): no hook, no bucket, never all-reduced;
- tied parameters (one ``nn.Parameter`` used by two modules): ``parameters()`` yields it once, so it gets one hook
  and one slot. Autograd has one gradient accumulator per leaf tensor, and it runs once per backward, after the
  contributions of both uses have been added up: the hook fires once, with the whole gradient (checked in the
  tests). Its gradient is ready only when the earlier use's gradient is, late in backward for a tied embedding;
- parameters that get no gradient in a step: every rank still starts the same collectives in the same order
  (ranks pair collectives by their order, not by tensor: a rank that skipped one would pair the next gradient
  with another rank's skipped one, and hang or mix them up). A missing gradient is all-reduced as zeros. With
  ``find_unused_parameters=False`` (the default) the parameter then has a gradient of zeros (averaged: zero
  where no rank used it), which an optimizer with momentum or weight decay still acts on. With
  ``find_unused_parameters=True`` the wrapper adds one all-reduce per step of a mask "used on this rank", as DDP
  does; a parameter unused on every rank keeps ``grad = None``, as it would in one process, and the optimizer
  skips it. DDP finds unused parameters after the forward pass (by walking the autograd graph), so a bucket
  holding one still launches during backward; these builds find them when backward is over, and such a bucket
  launches in ``finish_gradient_synchronization``.

Also as DDP: the all-reduces start in one fixed order on every rank (reverse ``parameters()``), and the gradients
are summed, then divided by the world size (DDP too reduces with SUM, dividing each gradient on its way into the
bucket; and older PyTorch versions refuse ``ReduceOp.AVG`` on gloo). Unlike DDP: buffers
(BatchNorm's running statistics) are broadcast once, at construction, not before every forward; one
``backward()`` per ``finish_gradient_synchronization()`` (no ``no_sync`` for gradient accumulation).
"""

import torch
import torch.distributed as dist
from torch import nn


def require_process_group(what: str) -> None:
    """Raise a ``RuntimeError`` that says what to do when ``what`` is used without a process group."""
    if not dist.is_initialized():
        raise RuntimeError(
            f"{what} needs a process group, and there is none: run the script under torchrun "
            "(torchrun --standalone --nproc_per_node=2 script.py), and call torch.distributed.init_process_group() "
            "or enter common.distributed.process_group() before building it"
        )


def broadcast_parameters_and_buffers(module: nn.Module) -> None:
    """Copy rank 0's parameters and buffers to every rank, in place: what DDP's constructor does.

    Every replica must start from the same weights, or the same averaged gradients would move them to different
    places. A collective: call on every rank. (DDP packs them into 250 MB messages; one per tensor is enough here.)
    """
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor, src=0)


class HandMadeDDP(nn.Module):
    """What the three builds share: the process-group check, rank 0's weights, ``.module``, the forward pass, the
    trainable parameters (``trainable``, named in ``parameter_names``) and what becomes of unused ones."""

    def __init__(self, module: nn.Module, find_unused_parameters: bool = False):
        super().__init__()
        require_process_group(type(self).__name__)
        self.module = module
        self.find_unused_parameters = find_unused_parameters
        self.world_size = dist.get_world_size()
        broadcast_parameters_and_buffers(module)
        # named_parameters() yields a tied parameter once: one gradient, averaged once. Frozen ones are left out.
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        self.parameter_names = [name for name, _ in named]
        self.trainable = [p for _, p in named]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        """Leave every trainable parameter's gradient averaged over ranks; call after ``backward()``."""
        raise NotImplementedError

    def used_anywhere(self, used: list[bool]) -> list[bool] | None:
        """With ``find_unused_parameters``: which parameters got a gradient on at least one rank (``used``: on this
        one), by one all-reduce of a 0/1 mask, as DDP does. ``None`` without it. A collective: every rank calls it
        at the same point of the step."""
        if not self.find_unused_parameters:
            return None
        mask = torch.tensor(used, dtype=torch.int32, device=self.trainable[0].device)
        dist.all_reduce(mask)
        return [bool(count) for count in mask.tolist()]

    def forget_unused_gradients(self, used: list[bool] | None) -> None:
        """Give back ``grad = None`` to the parameters that no rank used (``used`` from ``used_anywhere``)."""
        for p, anywhere in zip(self.trainable, used or [True] * len(self.trainable)):
            if not anywhere:
                p.grad = None


class NaiveDDP(HandMadeDDP):
    """Data parallelism at its plainest: after ``backward()``, one blocking all-reduce per gradient, then divide.

    The all-reduces start only when backward is over, one at a time, one message per parameter: nothing overlaps,
    and each small message pays the network's full latency. "Not used in practice, but a good starting point"
    (picotron). See Li et al. 2020, section 3.2.1, for why DDP does better.
    """

    def finish_gradient_synchronization(self) -> None:
        """All-reduce every trainable parameter's gradient, one after the other, and divide by the world size."""
        used = self.used_anywhere([p.grad is not None for p in self.trainable])
        for i, p in enumerate(self.trainable):
            if used is not None and not used[i]:
                continue  # no rank used it: it keeps grad = None, as in one process
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # unused here, used elsewhere (or unknown): this rank adds zeros
            dist.all_reduce(p.grad)  # blocking: returns when every rank's gradient has been summed
            p.grad /= self.world_size


class OverlappedDDP(HandMadeDDP):
    """Start each gradient's all-reduce from a hook, the moment the gradient is ready, while backward goes on.

    ``register_post_accumulate_grad_hook`` runs a function right after autograd has accumulated a parameter's
    gradient into ``.grad``. It starts ``dist.all_reduce(p.grad, async_op=True)``, which returns a handle at once
    and communicates in the background while autograd computes the earlier layers' gradients.
    ``finish_gradient_synchronization`` waits on the handles, then divides by the world size: the gradients are
    not averaged, nor even complete, until it has run.

    The all-reduces start in one fixed order, reverse ``parameters()``: a hook whose gradient comes early starts
    its all-reduce with those of the gradients before it in that order. Models use their parameters roughly in
    the order they define them, so backward produces them in about reverse order, and in practice each all-reduce
    still starts the moment its gradient is ready. The fixed order is what keeps the ranks together: if one rank
    had no gradient for a parameter (a branch only its data takes), starting "whatever is ready" would pair
    different tensors across ranks.
    """

    def __init__(self, module: nn.Module, find_unused_parameters: bool = False):
        super().__init__(module, find_unused_parameters)
        self.launch_order = list(reversed(range(len(self.trainable))))  # indices into self.trainable
        self.ready = [False] * len(self.trainable)  # gradient i accumulated in this step
        self.next = 0  # position in launch_order of the next all-reduce to start
        self.handles = []  # one per started all-reduce, to wait on
        for i, p in enumerate(self.trainable):
            p.register_post_accumulate_grad_hook(lambda p, i=i: self.gradient_ready(i))

    def gradient_ready(self, i: int) -> None:
        """The hook: gradient ``i`` is in ``self.trainable[i].grad``; start every all-reduce that can start."""
        if self.ready[i]:
            raise RuntimeError(
                f"{self.parameter_names[i]}: a second gradient before finish_gradient_synchronization(); "
                "call it after every backward()"
            )
        # BEGIN LAB: start the all-reduces of ready gradients, in launch_order
        # Mark gradient i ready (self.ready), then go on from launch_order[self.next] while the gradients are
        # ready: dist.all_reduce(grad, async_op=True) returns a handle at once; keep the handles to wait on later.
        self.ready[i] = True
        while self.next < len(self.launch_order) and self.ready[self.launch_order[self.next]]:
            p = self.trainable[self.launch_order[self.next]]
            self.handles.append(dist.all_reduce(p.grad, async_op=True))
            self.next += 1
        # END LAB

    def finish_gradient_synchronization(self) -> None:
        """Start the all-reduces of gradients that never came (zeros), wait for all of them, divide."""
        used_here = list(self.ready)
        for i in self.launch_order:
            if not self.ready[i]:  # no gradient on this rank: all-reduce zeros, or the ranks fall out of step
                p = self.trainable[i]
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                self.gradient_ready(i)
        used = self.used_anywhere(used_here)  # after every gradient's all-reduce: the same place on every rank
        # BEGIN LAB: wait for the all-reduces, then divide by the world size
        # A handle's wait() returns once its all-reduce is done; only then does p.grad hold the sum.
        for handle in self.handles:
            handle.wait()
        for p in self.trainable:
            p.grad /= self.world_size
        # END LAB
        self.handles, self.ready, self.next = [], [False] * len(self.trainable), 0
        self.forget_unused_gradients(used)


def assign_buckets(parameters: list[torch.Tensor], bucket_cap_bytes: int) -> list[list[int]]:
    """Group ``parameters`` into buckets for all-reduce: lists of indices into ``parameters``, in launch order.

    DDP's rule (``compute_bucket_assignment_by_size`` in torch/csrc/distributed/c10d/reducer.cpp): go through the
    parameters in reverse order (about the order backward produces their gradients) and add each to the open
    bucket; a bucket closes as soon as its size reaches ``bucket_cap_bytes``, with the parameter that crossed the
    cap in it. So a bucket holds at least one parameter and may pass the cap by less than one parameter; the last
    bucket holds what is left. Example: four tensors of 400, 300, 300 and 200 bytes, cap 500: reverse order
    3, 2, 1, 0; [3, 2] (500 bytes, full), [1, 0] (700 bytes).

    DDP itself, for comparison: with ``find_unused_parameters=False`` (its default) the first backward runs with
    all gradients in one bucket, and from the second step on the buckets are rebuilt with this rule from the order
    gradients actually arrived in the first backward (for a sequential model, reverse ``parameters()``); with
    ``find_unused_parameters=True`` it cuts them once, at construction, and never rebuilds. DDP opens one bucket
    per dtype and device; all the parameters here share one. And DDP's first bucket (the last parameters) gets a
    cap of its own: 1 MiB (``dist._DEFAULT_FIRST_BUCKET_BYTES``) when ``bucket_cap_mb`` is left at its default, the
    same cap as the others when ``bucket_cap_mb`` is given (PyTorch 2.14, ``_BucketCapacityConfig`` in
    torch/nn/parallel/distributed.py). This function matches DDP given ``bucket_cap_mb``: one cap for all.
    """
    # BEGIN LAB: buckets in reverse order, each closed at the cap
    # Bytes of a tensor: numel() * element_size(). Remember the last, partly full bucket.
    buckets, bucket, size = [], [], 0
    for i in reversed(range(len(parameters))):
        bucket.append(i)
        size += parameters[i].numel() * parameters[i].element_size()
        if size >= bucket_cap_bytes:
            buckets.append(bucket)
            bucket, size = [], 0
    if bucket:
        buckets.append(bucket)
    return buckets
    # END LAB


class BucketedDDP(HandMadeDDP):
    """Gradients in flat buckets of about ``bucket_cap_mb`` MiB; one asynchronous all-reduce per complete bucket.

    Fewer, larger messages use the network far better than one per parameter (Li et al. 2020, figure 2: on their
    cluster, all-reducing 60 M parameters took several times longer in small pieces than as a few large
    buckets), and a bucket still starts while backward goes on, as soon as its last gradient is in.

    ``.buckets``: the parameters' names per bucket, in launch order (``assign_buckets``). Each bucket is one flat
    tensor, and each parameter's gradient is a view of its slice (DDP's ``gradient_as_bucket_view=True``), so
    the all-reduce of the bucket averages the gradients where they are: no copy back.

    ``optimizer.zero_grad()`` sets ``.grad`` to ``None`` (``set_to_none=True``, the default), which drops the
    views. Two places put them back: ``forward`` points every gradient that is ``None`` at its zeroed view (if
    ``zero_grad`` runs before the forward pass, backward then accumulates straight into the bucket, no copy); the
    hook copies a gradient that autograd put in a new tensor (``zero_grad`` between forward and backward) into its
    view, once, and points ``.grad`` at the view again. ``zero_grad(set_to_none=False)`` zeroes the views in
    place and keeps them. The buckets launch in their fixed order, as DDP's do, so every rank starts the same
    all-reduces in the same order. Parameters must be contiguous and share one dtype and device.
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0, find_unused_parameters: bool = False):
        super().__init__(module, find_unused_parameters)
        kinds = {(p.dtype, p.device) for p in self.trainable}
        if len(kinds) > 1:
            raise ValueError(f"BucketedDDP puts all gradients in buckets of one dtype and device, not {kinds}")
        self.bucket_cap_bytes = int(bucket_cap_mb * 2**20)  # MiB, as DDP counts them
        self.bucket_indices = assign_buckets(self.trainable, self.bucket_cap_bytes)
        self.buckets = [[self.parameter_names[i] for i in bucket] for bucket in self.bucket_indices]
        p0 = self.trainable[0]
        self.flat = [
            torch.zeros(sum(self.trainable[i].numel() for i in bucket), dtype=p0.dtype, device=p0.device)
            for bucket in self.bucket_indices
        ]
        self.bucket_of = [0] * len(self.trainable)  # parameter index -> bucket index
        self.views = [None] * len(self.trainable)  # parameter index -> its gradient's place in the bucket
        for b, bucket in enumerate(self.bucket_indices):
            offset = 0
            for i in bucket:
                numel = self.trainable[i].numel()
                self.views[i] = self.flat[b][offset : offset + numel].view_as(self.trainable[i])
                self.bucket_of[i], offset = b, offset + numel
        self.pending = [len(bucket) for bucket in self.bucket_indices]  # gradients each bucket still waits for
        self.ready = [False] * len(self.trainable)
        self.next_bucket = 0  # the next bucket to all-reduce: they start in order
        self.handles = []
        for i, p in enumerate(self.trainable):
            p.register_post_accumulate_grad_hook(lambda p, i=i: self.gradient_ready(i))

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled():
            for p, view in zip(self.trainable, self.views):
                if p.grad is None:  # zero_grad(set_to_none=True) dropped the view: backward will add into it
                    p.grad = view.zero_()
        return self.module(*args, **kwargs)

    def gradient_ready(self, i: int) -> None:
        """The hook: gradient ``i`` is complete; put it in its bucket and start every bucket that is complete."""
        if self.ready[i]:
            raise RuntimeError(
                f"{self.parameter_names[i]}: a second gradient before finish_gradient_synchronization(); "
                "call it after every backward()"
            )
        p, view = self.trainable[i], self.views[i]
        if p.grad.data_ptr() != view.data_ptr():  # autograd made a new tensor: one copy into the bucket
            view.copy_(p.grad)
            p.grad = view
        # BEGIN LAB: start the all-reduce of each complete bucket, in order
        # Mark gradient i ready and count it off its bucket: self.pending[b] counts the gradients bucket b still
        # waits for. Buckets start in order (self.next_bucket): a complete bucket waits for the ones before it,
        # so that every rank starts the same all-reduces in the same order.
        self.ready[i] = True
        self.pending[self.bucket_of[i]] -= 1
        while self.next_bucket < len(self.flat) and self.pending[self.next_bucket] == 0:
            self.handles.append(dist.all_reduce(self.flat[self.next_bucket], async_op=True))
            self.next_bucket += 1
        # END LAB

    def finish_gradient_synchronization(self) -> None:
        """Complete the buckets of gradients that never came (zeros), wait for every bucket, divide."""
        used_here = list(self.ready)
        for i in range(len(self.trainable)):
            if not self.ready[i]:  # no gradient on this rank: zeros in its slot, so that the bucket can start
                self.trainable[i].grad = self.views[i].zero_()
                self.gradient_ready(i)
        used = self.used_anywhere(used_here)  # after every bucket's all-reduce: the same place on every rank
        # BEGIN LAB: wait for the buckets, then divide by the world size
        # The gradients are views into the buckets: dividing a bucket divides its gradients.
        for handle in self.handles:
            handle.wait()
        for flat in self.flat:
            flat /= self.world_size
        # END LAB
        self.handles, self.ready, self.next_bucket = [], [False] * len(self.trainable), 0
        self.pending = [len(bucket) for bucket in self.bucket_indices]
        self.forget_unused_gradients(used)
