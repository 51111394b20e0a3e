"""What counting skipped steps with ``scaler.get_scale()`` costs: host-device waits per step, counted and timed.

    python benchmarks/scaler_sync.py                     # CUDA if there is a GPU, else CPU
    python benchmarks/scaler_sync.py --device cuda --model simplecnn --batch-size 256

``torch.amp.GradScaler`` runs its bookkeeping on the device: the scale and the inf/NaN flag are device tensors.
Reading one on the host (``.item()``) makes the host wait until the device has finished all the work queued
before it. ``scaler.step(optimizer)`` already reads the inf flag once per step with a non-fused optimizer (it
must know whether to call ``optimizer.step()``); ``scaler.get_scale()`` reads the scale, one more wait per call.
Three ways to run the same fp16 training step, taking turns round after round:

- "no skip count": scale, backward, step, update, zero_grad;
- "get_scale after update": read the scale once per step, after update(), and compare it with the previous one;
- "get_scale before and after": read it before step() and after update() (lesson 05's loop).

The script counts the ``.item()`` calls per step of each (exact: it wraps ``torch.Tensor.item``), and times
the steps: median over rounds of each round's median step, with the smallest and largest round. On a CPU there
is no device queue: every operation has finished when its call returns, so ``.item()`` waits for nothing and the
times show only what the calls cost in Python; what a wait costs shows on a GPU, where it stops the host from
queueing the next step's work while the device is still busy. On a CPU the forward runs in fp32 (fp16 is slow
there, lesson 05): the scaler's calls are the same whatever the forward's dtype.
"""

import statistics
import time
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from common.cli import argument_parser, positive_int
from common.metrics import synchronize
from common.models import MODELS
from common.reports import run_header

VARIANTS = ("no skip count", "get_scale after update", "get_scale before and after")


def parse_args(argv=None):
    parser = argument_parser(__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda if there is a GPU, else cpu")
    parser.add_argument("--model", choices=list(MODELS), default="lenet")
    parser.add_argument("--batch-size", type=positive_int, default=64)
    parser.add_argument("--steps", type=positive_int, default=20, help="timed steps per variant and round")
    parser.add_argument("--rounds", type=positive_int, default=5, help="the variants take turns; medians")
    return parser.parse_args(argv)


@contextmanager
def count_item_calls():
    """Count ``Tensor.item()`` calls inside the block, including those inside PyTorch's Python code."""
    calls = [0]
    original = torch.Tensor.item

    def counting_item(tensor):
        calls[0] += 1
        return original(tensor)

    torch.Tensor.item = counting_item
    try:
        yield calls
    finally:
        torch.Tensor.item = original


def make_step(net, optimizer, scaler, X, y, variant: str):
    """One training step of ``variant``; returns a function that runs it and returns whether it was skipped."""
    dtype = torch.float16 if X.device.type == "cuda" else torch.float32
    last_scale = [scaler.get_scale()]

    def step() -> bool:
        with torch.autocast(device_type=X.device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = F.cross_entropy(net(X), y)
        scaler.scale(loss).backward()
        skipped = False
        if variant == "get_scale before and after":
            before = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            skipped = scaler.get_scale() < before
        else:
            scaler.step(optimizer)
            scaler.update()
            if variant == "get_scale after update":  # S changes only in update(): the last reading is "before"
                scale = scaler.get_scale()
                skipped, last_scale[0] = scale < last_scale[0], scale
        optimizer.zero_grad(set_to_none=True)
        return skipped

    return step


def main(args):
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(0)
    model_class = MODELS[args.model]
    X = torch.randn(args.batch_size, *model_class.input_shape, device=device)
    y = torch.randint(0, 10, (args.batch_size,), device=device)
    steps = {}
    for variant in VARIANTS:
        net = model_class().to(device)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)  # non-fused, as in the solutions
        scaler = torch.amp.GradScaler(device.type)
        steps[variant] = make_step(net, optimizer, scaler, X, y, variant)
        for _ in range(3):  # warm-up: kernels chosen, gradients and momentum allocated
            steps[variant]()
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    print(run_header(), flush=True)
    print(
        f"{args.model}, batch {args.batch_size}, GradScaler, forward in "
        f"{'fp16' if device.type == 'cuda' else 'fp32'}, SGD (non-fused), one process on {where}, "
        f"PyTorch {torch.__version__}; median of {args.rounds} rounds of {args.steps} steps"
    )

    items = {}
    for variant in VARIANTS:
        with count_item_calls() as calls:
            steps[variant]()
        items[variant] = calls[0]
    rounds = {variant: [] for variant in VARIANTS}
    for _ in range(args.rounds):
        for variant in VARIANTS:
            times = []
            for _ in range(args.steps):
                synchronize(device)
                start = time.perf_counter()
                steps[variant]()
                synchronize(device)  # the whole step, device work included
                times.append(time.perf_counter() - start)
            rounds[variant].append(statistics.median(times))
    print(f"{'variant':>27} {'.item() per step':>16} {'ms/step':>8} {'spread':>15} {'vs no skip count':>17}")
    base = statistics.median(rounds["no skip count"])
    for variant in VARIANTS:
        median = statistics.median(rounds[variant])
        print(
            f"{variant:>27} {items[variant]:>16} {median * 1e3:>8.3f} "
            f"{min(rounds[variant]) * 1e3:>7.3f}-{max(rounds[variant]) * 1e3:<7.3f} "
            f"{(median - base) * 1e3:>+14.3f} ms"
        )

    scaler = torch.amp.GradScaler(device.type)
    scaler.scale(torch.ones((), device=device))  # creates the scale tensor on the device
    calls = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        for _ in range(1000):
            scaler.get_scale()
        calls.append((time.perf_counter() - start) / 1000)
    print(
        f"one get_scale() with nothing queued: {statistics.median(calls) * 1e6:.1f} us "
        f"(spread {min(calls) * 1e6:.1f}-{max(calls) * 1e6:.1f})"
    )


if __name__ == "__main__":
    main(parse_args())
