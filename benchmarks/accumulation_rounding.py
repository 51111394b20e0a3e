"""How far apart "4 micro-batches of 16" and "one batch of 64" really are: float rounding, measured.

    python benchmarks/accumulation_rounding.py
    python benchmarks/accumulation_rounding.py --threads 2 --steps 60     # other kernels, other rounding

In exact arithmetic the two give the same gradient (lesson 04). In float32 they add the per-sample
contributions in another order: one backward sums 64 samples inside each matrix product; accumulation sums 16
per backward and adds four partial results into ``.grad``. Each order rounds differently, so the gradients
differ in their last bits; training then feeds each step's difference into the next weights, and the two runs
drift apart slowly. This script measures both, on one process, LeNet on digits, SGD lr 0.05 with momentum 0.9
as the solutions use:

1. one step from the same weights: the largest gradient difference, absolute and relative to the largest
   gradient element, and the share of gradient elements that are not bitwise equal;
2. the same training run both ways: the largest parameter difference and the loss difference after each
   checkpointed step.
"""

import torch
import torch.nn.functional as F

from common.cli import argument_parser, positive_int
from common.data import load_data
from common.models import LeNet
from common.reports import run_header

BATCH_SIZE, LR, MOMENTUM = 64, 0.05, 0.9


def parse_args(argv=None):
    parser = argument_parser(__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive_int, default=120, help="optimizer steps of the training run")
    parser.add_argument("--micro-steps", type=positive_int, default=4, help="micro-batches per batch of 64")
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=1,
        help="PyTorch threads: the kernels split their sums by thread, so this changes the rounding",
    )
    return parser.parse_args(argv)


def accumulate_gradient(model, X, y, micro_steps: int) -> torch.Tensor:
    """Leave the gradient of the mean loss over (X, y) in .grad from ``micro_steps`` backward calls; return the loss."""
    total = 0.0
    for X_micro, y_micro in zip(X.chunk(micro_steps), y.chunk(micro_steps)):
        loss = F.cross_entropy(model(X_micro), y_micro) / micro_steps  # .grad adds up: divide, as lesson 04 says
        loss.backward()
        total += loss.item()
    return total


def batches(steps: int):
    """``steps`` batches of 64 digits in a fixed shuffled order, repeating the data set as needed."""
    train = load_data("digits").train
    X, y = train.tensors
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    per_epoch = len(y) // BATCH_SIZE
    for step in range(steps):
        index = order[(step % per_epoch) * BATCH_SIZE : (step % per_epoch + 1) * BATCH_SIZE]
        yield X[index], y[index]


def one_step_difference(micro_steps: int) -> dict:
    """Gradients of one batch of 64 from the same weights, one backward against ``micro_steps`` backwards."""
    X, y = next(batches(1))
    grads = []
    for k in (1, micro_steps):
        torch.manual_seed(0)
        model = LeNet()
        accumulate_gradient(model, X, y, k)
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    difference = (grads[0] - grads[1]).abs()
    return {
        "max_abs": difference.max().item(),
        "max_grad": grads[0].abs().max().item(),
        "differing": (difference > 0).float().mean().item(),
    }


def training_drift(micro_steps: int, steps: int, report_at) -> list[dict]:
    """Train twice from the same weights on the same batches; the parameter and loss gaps after chosen steps."""
    runs = []
    for k in (1, micro_steps):
        torch.manual_seed(0)
        model = LeNet()
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        losses, snapshots = [], {}
        for step, (X, y) in enumerate(batches(steps), start=1):
            losses.append(accumulate_gradient(model, X, y, k))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step in report_at:
                snapshots[step] = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
        runs.append((losses, snapshots))
    (losses_whole, params_whole), (losses_micro, params_micro) = runs
    return [
        {
            "step": step,
            "max_param_diff": (params_whole[step] - params_micro[step]).abs().max().item(),
            "loss_whole": losses_whole[step - 1],
            "loss_micro": losses_micro[step - 1],
        }
        for step in report_at
    ]


def main(args):
    torch.set_num_threads(args.threads)  # fixed, so that a rerun rounds the same way
    first = one_step_difference(args.micro_steps)
    print(run_header(), flush=True)
    print(
        f"LeNet on digits, batch {BATCH_SIZE}: one backward against {args.micro_steps} micro-batches of "
        f"{BATCH_SIZE // args.micro_steps}, PyTorch {torch.__version__}, CPU, {args.threads} thread(s)"
    )
    print(
        f"one step, same weights: max |gradient difference| {first['max_abs']:.2e} "
        f"({first['max_abs'] / first['max_grad']:.1e} of the largest gradient element, {first['max_grad']:.2e}); "
        f"{first['differing']:.0%} of the elements differ"
    )
    report_at = sorted({1, 10, *range(20, args.steps + 1, 20), args.steps} & set(range(1, args.steps + 1)))
    print(f"{'step':>5} {'max |param diff|':>17} {'loss, one batch':>16} {'loss, accumulated':>18} {'|loss diff|':>12}")
    for row in training_drift(args.micro_steps, args.steps, report_at):
        print(
            f"{row['step']:>5} {row['max_param_diff']:>17.2e} {row['loss_whole']:>16.6f} {row['loss_micro']:>18.6f} "
            f"{abs(row['loss_whole'] - row['loss_micro']):>12.2e}"
        )


if __name__ == "__main__":
    main(parse_args())
