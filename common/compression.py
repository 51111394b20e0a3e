"""Gradient compression with DDP communication hooks (lesson 10): all-reduce, bf16 and PowerSGD, by hand.

``DistributedDataParallel`` all-reduces each bucket of gradients as it fills. ``ddp.register_comm_hook(state,
hook)`` replaces that all-reduce by ``hook(state, bucket)``, called once per bucket and per step, which must
start the communication and return a ``torch.futures.Future`` whose value is the bucket's new contents (the
averaged gradients). DDP waits for the futures at the end of ``backward()`` and copies the values into ``.grad``.
What a hook sees (``torch.distributed.GradBucket``):

- ``bucket.buffer()``: the bucket as one flat tensor, every gradient of the bucket laid end to end;
- ``bucket.gradients()``: one view of that buffer per parameter, in its parameter's shape (writing into a view
  writes into the buffer);
- ``bucket.parameters()``: the parameters, in the same order; ``bucket.index()``: which bucket (0 is the first to
  fill, the end of the model); ``bucket.is_last()``: the last bucket of the step.

The hooks here are the ones in ``torch/distributed/algorithms/ddp_comm_hooks``, rebuilt to be read:

- ``allreduce_hook_by_hand``: what DDP does without a hook (``default_hooks.allreduce_hook``);
- ``bf16_compress_hook_by_hand``: send bfloat16, half the bytes (``default_hooks.bf16_compress_hook``);
- ``PowerSGDByHand`` and ``powersgd_hook_by_hand``: rank-r compression of every weight matrix, PowerSGD
  (Vogels, Karimireddy and Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
  Optimization", NeurIPS 2019), step for step as ``powerSGD_hook.powerSGD_hook`` does it;
- ``compression_ratio``: how many times fewer elements PowerSGD sends for one matrix.

Used like torch's::

    state = PowerSGDByHand(matrix_approximation_rank=2, start_powerSGD_iter=10)
    ddp.register_comm_hook(state, powersgd_hook_by_hand)
    ddp.register_comm_hook(None, bf16_compress_hook_by_hand)    # or this: the state is the process group

One hook per DDP model, registered once, before the first backward pass. DDP inspects the hook: annotations, if any,
must be ``bucket: dist.GradBucket`` and ``-> torch.futures.Future[torch.Tensor]``; and it checks a hook *named*
``bf16_compress_hook`` (or ``bf16_compress_wrapper_hook``) against how torch was built: refused unless torch has
CUDA or ROCm and NCCL 2.10+ (or XPU with XCCL). The course's torch is a CUDA build, so even a CPU with gloo passes
the check (and gloo runs the hook); a CPU-only build refuses it.

Where each all-reduce starts. torch's ``powerSGD_hook`` chains its three all-reduces per bucket through futures: the
second and third start in the callback of the one before, on whichever thread completes it. With gloo and several
buckets in flight, nothing fixes the order in which a rank starts them, and gloo pairs collectives by the order in
which they start: two ranks can pair the wrong messages. tests/test_compression.py shows what gloo does then (two
swapped all-reduces of one size add the wrong tensors silently; of different sizes, the process aborts); no test
runs torch's hook into it, and the course avoids it. NCCL completes its futures when the work is queued on the
stream (``Work.get_future``'s documentation: the value is ordered by CUDA streams, not yet computed), so the
callbacks run at once, in order, there. So on gloo, give torch's hook one bucket (a ``bucket_cap_mb`` above the
model's gradient size). ``powersgd_hook_by_hand`` starts all three from the hook itself, which DDP calls bucket
after bucket in the same order on every rank, and waits for the P's and the Q's there: any number of buckets, on
any backend, at the price of blocking backward for two all-reduces per bucket. torch's hook waits too on NCCL:
its callbacks run inside the hook call, each waits on the all-reduce it starts, and the last calls
``torch.cuda.synchronize``. Only on gloo does torch's hook return at once.

The callback here does element-wise work only. When it also computed P Q^T, the replicas of an in-process test
drifted apart in 2 of about 6 runs, and in none of 8 since. The likely cause: a matrix product in a callback runs on
the main thread on one rank and on a gloo thread on another, whose intra-op thread settings can differ (torchrun's
OMP_NUM_THREADS=1 reaches every thread; torch.set_num_threads(1) in a process, not necessarily), and a product split
over other threads can round differently. Element-wise work gives the same bits on any thread.

A checkpoint saves the hook's state with the model's (``state.state_dict(ddp.module)``, and
``state.load_state_dict(saved, ddp.module)`` on resuming): PowerSGD's error feedback and warm start are memory,
and a run resumed without it is a different run.
"""

import math

import numpy as np
import torch
import torch.distributed as dist


def _group_and_size(process_group):
    """The group to communicate in (``None``: every process, as torch's hooks read it) and its size."""
    group = process_group if process_group is not None else dist.group.WORLD
    return group, dist.get_world_size(group)


def allreduce_hook_by_hand(process_group, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's own communication, as a hook: average the bucket over the ranks (``default_hooks.allreduce_hook``).

    Divide first, then sum: the same average, and in a narrow dtype (fp16) the sum of undivided gradients could
    overflow. The all-reduce is asynchronous: the hook returns at once, and the future's ``then`` callback turns the
    list the all-reduce's future holds into the one tensor DDP expects. It runs when that future completes: on gloo
    when the sum has arrived, on NCCL as soon as the all-reduce is queued, its GPU work ordered after the sum by CUDA
    streams (the documentation of ``Work.get_future`` and ``Future.then``).
    The baseline that compression (Vogels et al. 2019) is measured against: the whole bucket travels.
    """
    group, world_size = _group_and_size(process_group)
    buffer = bucket.buffer()
    buffer.div_(world_size)
    work = dist.all_reduce(buffer, group=group, async_op=True)  # in place: the buffer will hold the sum
    return work.get_future().then(lambda fut: fut.value()[0])


def bf16_compress_hook_by_hand(process_group, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Send the bucket in bfloat16: half the bytes of float32 (``default_hooks.bf16_compress_hook``).

    The cast is the compression; the division by the world size comes after it, in bfloat16, as torch does it
    (so the two are bit for bit the same). bfloat16 keeps float32's exponent range (no overflow, unlike fp16) and
    8 bits of significand (7 stored): each gradient is rounded to 2 or 3 significant decimal digits, and the sum is
    rounded again.
    The ``then`` callback decompresses: it copies the bfloat16 sum back into the float32 buffer, in place, so no
    second float32 bucket is allocated. A much weaker compression than PowerSGD's (Vogels et al. 2019), and one
    that needs no state: 2x, whatever the shapes.
    """
    group, world_size = _group_and_size(process_group)
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(world_size)
    work = dist.all_reduce(compressed, group=group, async_op=True)

    def decompress(fut):
        buffer.copy_(fut.value()[0])  # bfloat16 -> the buffer's dtype, into the buffer DDP reads
        return buffer

    return work.get_future().then(decompress)


def compression_ratio(shape, rank: int) -> float:
    """How many times fewer elements PowerSGD sends for a gradient of ``shape``: ``n*m / (r*(n+m))``.

    The gradient is seen as an ``n x m`` matrix, ``n = shape[0]`` and ``m`` the rest (a conv weight
    ``(out, in, kh, kw)`` is ``out x in*kh*kw``), as torch's hook views it. It is sent as ``P`` (``n x r``) and
    ``Q`` (``m x r``): ``r*(n+m)`` elements instead of ``n*m`` (Vogels et al. 2019). ``r`` is ``rank``, capped at
    ``min(n, m)``, as the hook caps it. A bias ``(n,)`` is ``n x 1``: ratio ``n/(n+1)`` < 1, never worth it.
    """
    n = shape[0]
    m = math.prod(shape) // n
    r = min(n, m, rank)
    return n * m / (r * (n + m))


def orthogonalize(matrix: torch.Tensor, epsilon: float = 0.0) -> None:
    """Make the columns of ``matrix`` (``n x r``) orthonormal, in place, by Gram-Schmidt, as torch's
    ``_orthogonalize_gram_schmidt`` does: normalise column i, then remove its direction from the columns after it.

    ``epsilon`` is added to each norm: 0 (torch's default) divides a zero column by zero, giving NaN; a tiny value
    (1e-8) avoids that for gradients that can be all zero. The result spans the same space as the input's columns,
    which is all PowerSGD needs (Vogels et al. 2019, Algorithm 1).
    """
    for i in range(matrix.shape[1]):
        column = matrix[:, i : i + 1]
        column /= torch.linalg.vector_norm(column, dim=0, keepdim=True) + epsilon
        if i + 1 < matrix.shape[1]:
            rest = matrix[:, i + 1 :]
            rest -= torch.sum(column * rest, dim=0, keepdim=True) * column  # each later column minus its projection


class PowerSGDByHand:
    """The state PowerSGD keeps between steps and buckets, and its settings (torch's ``PowerSGDState``).

    Settings, with torch's names and defaults:

    - ``matrix_approximation_rank`` (r): each matrix is sent as ``P`` (``n x r``) and ``Q`` (``m x r``);
    - ``start_powerSGD_iter``: plain all-reduce for that many steps first (the early steps are the most sensitive
      to gradient error). torch requires at least 2 with error feedback or warm start, because DDP rebuilds its
      buckets after the first step and torch's per-bucket memory would then be misplaced; the memory here follows
      the parameters and would not be, but the rule is kept so that the same settings mean the same in both;
    - ``min_compression_rate``: a matrix is compressed only if ``r*(n+m) * min_compression_rate < n*m``
      (strictly: ``compression_ratio > min_compression_rate``); the others, and so every bias, travel
      uncompressed, all in one all-reduce;
    - ``use_error_feedback``: add what compression lost last step to this step's gradient (Vogels et al. 2019,
      Algorithm 2): the error is not dropped but sent later, which is what keeps rank 1 or 2 converging;
    - ``warm_start``: start each step's power iteration from the last step's ``Q`` (a single power-iteration step
      per training step then refines the same subspace over time, Vogels et al. 2019 section 3); without it,
      a fresh random ``Q`` every step;
    - ``random_seed``: seeds the random ``Q`` s. Every rank draws the same ``Q`` (same seed, same draws), so no
      ``Q`` is ever sent for initialisation;
    - ``orthogonalization_epsilon``: see ``orthogonalize``.

    State, per parameter (``bucket.parameters()`` names the parameter of each gradient): ``errors`` (its error, in
    its shape) and ``qs`` (its ``Q``, ``m x r``, for a compressed matrix); ``matrix_orders``, the order in which a
    bucket's matrices get their random ``Q`` s; ``iteration``, the steps done (counted on the last bucket);
    ``rng``, which draws the seed of each fresh ``Q``. torch keeps errors and ``Q`` s per bucket, as flat tensors
    in the bucket's layout; why not here, see ``state_dict``.

    Byte counters (this rank's all-reduce inputs, not counting what the all-reduce algorithm itself moves, which
    is about twice that for a ring): ``bucket_bytes[index] = (sent, plain)`` for each bucket's latest call,
    ``plain`` being what ``allreduce_hook`` would have sent; ``bytes_sent_per_step`` and ``plain_bytes_per_step``,
    one entry per finished step.
    """

    def __init__(
        self,
        process_group=None,
        matrix_approximation_rank: int = 1,
        start_powerSGD_iter: int = 1_000,
        min_compression_rate: float = 2,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        orthogonalization_epsilon: float = 0.0,
        random_seed: int = 0,
    ):
        if (use_error_feedback or warm_start) and start_powerSGD_iter <= 1:
            raise ValueError(
                "start_powerSGD_iter must be at least 2 with use_error_feedback or warm_start, as torch's "
                "PowerSGDState requires: DDP rebuilds its buckets after the first step"
            )
        self.process_group = process_group
        self.matrix_approximation_rank = matrix_approximation_rank
        self.start_powerSGD_iter = start_powerSGD_iter
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.orthogonalization_epsilon = orthogonalization_epsilon
        # torch draws each step's seed from NumPy's generator; the same here, so that both draw the same Q's.
        self.rng = np.random.RandomState(random_seed)
        self.errors: dict[torch.Tensor, torch.Tensor] = {}  # parameter -> its error
        self.qs: dict[torch.Tensor, torch.Tensor] = {}  # parameter -> its Q
        self.matrix_orders: dict[frozenset, list[torch.Tensor]] = {}  # a bucket's matrices -> their order
        self.iteration = 0
        self.bucket_bytes: dict[int, tuple[int, int]] = {}
        self.bytes_sent_per_step: list[int] = []
        self.plain_bytes_per_step: list[int] = []
        self._step_bytes = [0, 0]  # (sent, plain) of the step in progress

    def count_bytes(self, bucket, sent_elements: int) -> None:
        """Record a bucket's bytes, and close the step's totals on the last bucket."""
        buffer = bucket.buffer()
        sent, plain = sent_elements * buffer.element_size(), buffer.numel() * buffer.element_size()
        self.bucket_bytes[bucket.index()] = (sent, plain)
        self._step_bytes[0] += sent
        self._step_bytes[1] += plain
        if bucket.is_last():
            self.bytes_sent_per_step.append(self._step_bytes[0])
            self.plain_bytes_per_step.append(self._step_bytes[1])
            self._step_bytes = [0, 0]

    def finish_bucket(self, bucket) -> None:
        """Count a step as done when its last bucket is."""
        if bucket.is_last():
            self.iteration += 1

    def state_dict(self, model: torch.nn.Module) -> dict:
        """What a checkpoint needs to resume bit for bit: the iteration, the errors and ``Q`` s by parameter name
        (``model``: the module DDP wraps, ``ddp.module``, which names them), and the generator's state. Tensors,
        numbers and dicts only: ``torch.load(weights_only=True)`` reads it back.

        Why by parameter, when torch keeps flat tensors per bucket: DDP's first step puts every parameter in one
        bucket, in ``parameters()`` order (unless ``find_unused_parameters``); then it rebuilds its buckets in the
        order the gradients became ready (about the reverse), capped by ``bucket_cap_mb``. A DDP
        model built to resume runs its first step in the first layout, so torch's memory, saved in the second,
        lands on the wrong gradients for that step: torch's ``PowerSGDState``, pickled and restored, resumes
        near the uninterrupted run, not on it (tested). The saved ``matrix_orders`` make the fresh ``Q`` s (no warm
        start) go to the same matrices, as long as the buckets of DDP's first step hold the same matrices as the
        rebuilt ones (they do for a model in one bucket); with warm start, resuming is exact whatever the buckets.
        """
        names = {parameter: name for name, parameter in model.named_parameters()}
        _, keys, position, has_gauss, cached_gaussian = self.rng.get_state()
        return {
            "iteration": self.iteration,
            "errors": {names[parameter]: error.clone() for parameter, error in self.errors.items()},
            "qs": {names[parameter]: q.clone() for parameter, q in self.qs.items()},
            "matrix_orders": [[names[parameter] for parameter in order] for order in self.matrix_orders.values()],
            "rng": {
                "keys": torch.from_numpy(keys.astype(np.int64)),
                "position": int(position),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached_gaussian),
            },
        }

    def load_state_dict(self, state: dict, model: torch.nn.Module) -> None:
        """Restore what ``state_dict`` saved onto ``model``'s parameters (settings and byte counters are not saved)."""
        parameters = dict(model.named_parameters())
        self.iteration = state["iteration"]
        self.errors = {parameters[name]: error.clone() for name, error in state["errors"].items()}
        self.qs = {parameters[name]: q.clone() for name, q in state["qs"].items()}
        orders = [[parameters[name] for name in order] for order in state["matrix_orders"]]
        self.matrix_orders = {frozenset(order): order for order in orders}
        rng = state["rng"]
        keys = rng["keys"].cpu().numpy().astype(np.uint32)
        self.rng.set_state(("MT19937", keys, rng["position"], rng["has_gauss"], rng["cached_gaussian"]))


def _worth_compressing(n: int, m: int, r: int, min_compression_rate: float) -> bool:
    """torch's ``_should_compress``: P and Q, times the required rate, must be smaller than the matrix."""
    return r * (n + m) * min_compression_rate < n * m


def powersgd_hook_by_hand(state: PowerSGDByHand, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """PowerSGD (Vogels et al. 2019, Algorithm 1 with error feedback): each weight matrix M (n x m) is sent as
    P (n x r) and Q (m x r), r*(n+m) numbers instead of n*m. The steps and their order are those of torch's
    ``powerSGD_hook``, so the results and the bytes compare:

    1. before ``start_powerSGD_iter`` steps: plain all-reduce (``allreduce_hook_by_hand``);
    2. error feedback: add last step's error to each gradient, and keep a copy of the sum (M);
    3. view every gradient as a matrix ``tensor.view(n, -1)``; those worth compressing (``min_compression_rate``)
       are compressed, the rest are concatenated and all-reduced as they are, in one message. A bias ``(n,)`` is
       ``n x 1``, never worth it when ``min_compression_rate >= 1`` (below 1, torch compresses it, and so does this);
    4. Q: last step's (warm start) or fresh Gaussian numbers; orthogonalised either way;
    5. P = M Q for every matrix, into one flat tensor; all-reduce it (sum over ranks: P = (sum M_i) Q);
    6. orthogonalise each P (Gram-Schmidt): an orthonormal basis of the column space M's sum mostly lives in;
    7. Q = M^T P for every matrix, into one flat tensor; all-reduce it and divide by the world size (the mean);
    8. M_approx = P Q^T, written into the gradient: the mean gradient projected onto P's columns. If the summed
       gradient has rank exactly r, this is the mean gradient itself. If its rank is below r, Gram-Schmidt's extra
       columns are rounding noise, not orthogonal to the others, and the result can be far off (torch's QR path,
       r > 2 in float32, does not have this problem);
    9. the new error = M - M_approx, for every gradient (the uncompressed ones too: local value minus mean).

    Where torch's hook and this one differ: for r > 2 torch orthogonalises with QR (Householder), this always with
    Gram-Schmidt; the columns can differ in sign, P Q^T = P P^T (mean M) does not, so the gradients agree to
    rounding. The memory (errors, Q's) follows parameters, not bucket positions (see ``PowerSGDByHand.state_dict``).
    Torch's ``batch_tensors_with_same_shape`` is not here (a speed option; the results are the same).

    The error is computed against the *mean* approximation, as torch and the authors' code do. The paper's
    Algorithm 2 takes each rank's error before the exchange, from its own compressed gradient: for PowerSGD, this
    rank's own P Q_i^T, with Q_i = M_i^T P before the all-reduce. Those errors would differ per rank but sum over
    ranks to the same.
    """
    group, world_size = _group_and_size(state.process_group)
    buffer = bucket.buffer()
    if state.iteration < state.start_powerSGD_iter:
        state.count_bytes(bucket, buffer.numel())
        state.finish_bucket(bucket)
        return allreduce_hook_by_hand(group, bucket)

    gradients, parameters = bucket.gradients(), bucket.parameters()  # views of the buffer, and whose they are
    wanted = None
    if state.use_error_feedback:
        # BEGIN LAB: error feedback: add each error to its gradient; keep copies of the sums
        # state.errors maps a parameter to its error (absent at the first compressed step); the copies go in
        # `wanted`, a list in the order of `gradients`, for computing the new errors at the end.
        for gradient, parameter in zip(gradients, parameters):
            if parameter in state.errors:
                gradient.add_(state.errors[parameter])
        wanted = [gradient.clone() for gradient in gradients]  # M = gradient + error: the new error comes from it
        # END LAB

    # Which gradients to compress: each seen as n x m (a conv weight's trailing dimensions flattened).
    matrices, uncompressed = [], []  # matrices: (parameter, n x m view of its gradient)
    for gradient, parameter in zip(gradients, parameters):
        matrix = gradient.view(gradient.shape[0], -1)  # a view: writing into it writes into the bucket
        n, m = matrix.shape
        if _worth_compressing(n, m, min(n, m, state.matrix_approximation_rank), state.min_compression_rate):
            matrices.append((parameter, matrix))
        else:
            uncompressed.append(gradient)
    # The order of the matrices decides which random numbers each fresh Q gets. torch's: the bucket's order,
    # grouped by shape (first appearance first; a stable sort). A resumed run's first step sees DDP's first-step
    # layout (parameters() order), not the rebuilt one the run had when it was saved: the order these matrices
    # had last time, saved with the state, hands the same numbers to the same matrices.
    key = frozenset(parameter for parameter, _ in matrices)
    if key in state.matrix_orders:
        position = {parameter: i for i, parameter in enumerate(state.matrix_orders[key])}
        matrices.sort(key=lambda pair: position[pair[0]])
    else:
        first_seen = {}
        for _, matrix in matrices:
            first_seen.setdefault(matrix.shape, len(first_seen))
        matrices.sort(key=lambda pair: first_seen[pair[1].shape])
        state.matrix_orders[key] = [parameter for parameter, _ in matrices]
    ranks = [min(*matrix.shape, state.matrix_approximation_rank) for _, matrix in matrices]

    # One flat tensor for all P's and one for all Q's: two all-reduces per bucket, whatever its number of matrices.
    ps_flat = buffer.new_empty(sum(matrix.shape[0] * r for (_, matrix), r in zip(matrices, ranks)))
    qs_flat = buffer.new_empty(sum(matrix.shape[1] * r for (_, matrix), r in zip(matrices, ranks)))
    ps, qs = [], []
    p_offset = q_offset = 0
    for (_, matrix), r in zip(matrices, ranks):
        n, m = matrix.shape
        ps.append(ps_flat[p_offset : p_offset + n * r].view(n, r))
        qs.append(qs_flat[q_offset : q_offset + m * r].view(m, r))
        p_offset, q_offset = p_offset + n * r, q_offset + m * r

    if state.warm_start and all(parameter in state.qs for parameter, _ in matrices):
        for q, (parameter, _) in zip(qs, matrices):
            q.copy_(state.qs[parameter])  # last step's Q
    else:
        # One seed per bucket and step, drawn from the state's generator: the same on every rank.
        generator = torch.Generator().manual_seed(int(state.rng.randint(1_000_000_000)))
        for q in qs:
            q.copy_(torch.randn(q.shape, generator=generator, dtype=q.dtype))
    for q in qs:
        orthogonalize(q, state.orthogonalization_epsilon)

    # The products use a copy of each matrix: BLAS rounds differently at different memory alignments, and the
    # offset of a gradient in its bucket changes with DDP's layout (see PowerSGDByHand.state_dict). A fresh tensor
    # is always aligned the same way, so a resumed run computes bit for bit what an uninterrupted one does.
    operands = [matrix.clone() for _, matrix in matrices]
    # BEGIN LAB: P = M Q for every matrix, into its view in ps_flat
    # torch.matmul(a, b, out=view) writes into the view, and so into the flat tensor the all-reduce sends.
    for operand, q, p in zip(operands, qs, ps):
        torch.matmul(operand, q, out=p)  # P = M Q
    # END LAB

    uncompressed_flat = torch.cat([tensor.view(-1) for tensor in uncompressed]) if uncompressed else buffer[:0]
    state.count_bytes(bucket, uncompressed_flat.numel() + ps_flat.numel() + qs_flat.numel())

    # Three all-reduces, all started here in the hook, which DDP calls bucket after bucket in the same order on
    # every rank (see the module docstring for why not from a future's callback): the P's and the Q's, each waited
    # for, since the next product needs its sum; then the uncompressed tensors, which travel while backward goes on.
    dist.all_reduce(ps_flat, group=group)  # P = the sum of the M_i Q
    # BEGIN LAB: orthogonalise every P; then Q = M^T P, into its view in qs_flat
    for p in ps:
        orthogonalize(p, state.orthogonalization_epsilon)
    for operand, p, q in zip(operands, ps, qs):
        torch.matmul(operand.t(), p, out=q)  # Q = M^T P, with this rank's M
    # END LAB
    dist.all_reduce(qs_flat, group=group)  # the sum of the M_i^T P
    # BEGIN LAB: the mean Q; each matrix becomes P Q^T, in the bucket; keep Q for a warm start
    qs_flat.div_(world_size)  # the mean of the M_i^T P
    for (parameter, matrix), p, q in zip(matrices, ps, qs):
        matrix.copy_(p @ q.t())  # M_approx = P Q^T, into the bucket
        if state.warm_start:
            state.qs[parameter] = q  # next step starts from it
    # END LAB
    work = dist.all_reduce(uncompressed_flat, group=group, async_op=True)

    def unpack_uncompressed_and_keep_errors(fut):
        # Runs on whichever thread completes the all-reduce: element-wise work only, which gives the same bits on
        # any thread (a matrix product here could take another kernel on another thread, and the ranks drift).
        averaged = fut.value()[0].div_(world_size)
        offset = 0
        for tensor in uncompressed:
            tensor.copy_(averaged[offset : offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()
        if state.use_error_feedback:
            # BEGIN LAB: each gradient's new error
            # its copy in `wanted` minus what the bucket now holds, into state.errors
            for gradient, parameter, before in zip(gradients, parameters, wanted):
                state.errors[parameter] = before - gradient  # what compression (and averaging) changed: sent later
            # END LAB
        state.finish_bucket(bucket)
        return buffer

    return work.get_future().then(unpack_uncompressed_and_keep_errors)
