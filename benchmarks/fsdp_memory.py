"""What each rank holds under DDP, ZeRO-1 and FSDP2: model-state bytes, and on a GPU the peak of a training step.

    torchrun --standalone --nproc_per_node=2 benchmarks/fsdp_memory.py                    # CPU: 2 gloo ranks
    torchrun --standalone --nproc_per_node=1 benchmarks/fsdp_memory.py --width 4096 --depth 8  # one GPU: NCCL

Each strategy of ``common.fsdp.STRATEGIES`` wraps the same ``DeepMLP`` with lesson 06's ``shard_model`` and takes
one Adam step (``common.fsdp.measure_model_state``). The table shows, per rank (rank 0's figures; every rank holds
the same amount here), the parameters, gradients and Adam states held after the step, ZeRO's arithmetic for the
same stage (``common.memory.zero_bytes_per_rank``; fsdp-grad-op counts as stage 2, the fsdp-full rows as stage 3),
and on CUDA ``torch.cuda.max_memory_allocated`` over the step: activations, gathered blocks and temporary
buffers included, which the model state leaves out. With one rank nothing is divided: every strategy holds the
whole model, and only the gathering pattern differs.
"""

import json
from pathlib import Path

import torch

from common.cli import argument_parser, positive_int
from common.distributed import is_main, print0, setup_distributed, teardown_distributed
from common.fsdp import STRATEGIES, measure_model_state
from common.memory import zero_bytes_per_rank
from common.models import DeepMLP
from common.reports import run_header

ZERO_STAGE = {"ddp": 0, "zero1": 1, "fsdp-grad-op": 2, "fsdp-full": 3, "fsdp-full-root-resharded": 3}
MIB = 2**20


def parse_args(argv=None):
    parser = argument_parser(__doc__.splitlines()[0])
    parser.add_argument("--width", type=positive_int, default=512, help="DeepMLP width")
    parser.add_argument("--depth", type=positive_int, default=4, help="DeepMLP blocks")
    parser.add_argument("--batch-size", type=positive_int, default=32)
    parser.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    parser.add_argument("--json", type=Path, help="rank 0 also writes the rows and the set-up to this file")
    return parser.parse_args(argv)


def main(args):
    env = setup_distributed()
    try:
        num_parameters = sum(p.numel() for p in DeepMLP(width=args.width, depth=args.depth).parameters())
        where = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else "cpu"
        setup = (
            f"DeepMLP width {args.width} depth {args.depth} ({num_parameters / 1e6:.1f} M parameters), batch "
            f"{args.batch_size} per rank, one Adam step, {env.world_size} rank(s), {env.backend} on {where}"
        )
        print0(run_header())
        print0(setup)
        print0(
            f"{'strategy':>24} {'params MiB':>10} {'grads MiB':>9} {'Adam MiB':>8} {'total MiB':>9} "
            f"{'ZeRO MiB':>8} {'peak MiB':>8} {'gathers':>7}"
        )
        rows = []
        for strategy in args.strategies:
            held = measure_model_state(env, strategy, width=args.width, depth=args.depth, batch_size=args.batch_size)
            predicted = zero_bytes_per_rank(num_parameters, env.world_size, ZERO_STAGE[strategy])["total"]
            row = {
                "strategy": strategy,
                "parameters_mib": held["parameters"] / MIB,
                "gradients_mib": held["gradients"] / MIB,
                "optimizer_mib": held["optimizer"] / MIB,
                "total_mib": held["total"] / MIB,
                "zero_predicted_mib": predicted / MIB,
                "cuda_peak_mib": held.get("cuda_peak_mib"),
                "all_gathers": held["all_gathers"],
            }
            rows.append(row)
            peak = "-" if row["cuda_peak_mib"] is None else f"{row['cuda_peak_mib']:.0f}"
            print0(
                f"{strategy:>24} {row['parameters_mib']:>10.1f} {row['gradients_mib']:>9.1f} "
                f"{row['optimizer_mib']:>8.1f} {row['total_mib']:>9.1f} {row['zero_predicted_mib']:>8.1f} "
                f"{peak:>8} {row['all_gathers']:>7}"
            )
        if args.json and is_main():
            args.json.write_text(
                json.dumps(
                    {"setup": setup, "world_size": env.world_size, "num_parameters": num_parameters, "rows": rows},
                    indent=2,
                )
            )
    finally:
        teardown_distributed()


if __name__ == "__main__":
    main(parse_args())
