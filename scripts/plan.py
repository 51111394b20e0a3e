"""Rank the ways to train a preset model on a preset cluster (lesson 16's planner, ``common.planner``).

    python scripts/plan.py --model llama3-405b --cluster h100x16k
    python scripts/plan.py --model llama3-405b-128k --cluster h100x16k
    python scripts/plan.py --model llama3-8b --cluster h100x8 --top 8

Prints the planner's three steps (fit memory, reach the global batch, maximise throughput), the fastest
configurations with their predicted memory and step time part by part, and, where a team published how it trained
this model on this hardware, the same degrees as the planner predicts them next to what the team reports.
"""

import argparse
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.planner import (  # noqa: E402  (the repository's root is on the path only from the line above)
    CLUSTERS,
    MODELS,
    NOTES,
    PUBLISHED,
    RECOMPUTE,
    Training,
    enumerate_configs,
    predict_memory,
    predict_step_time,
    rank_configs,
)

MEMORY_PARTS = ("parameters", "gradients", "optimizer", "activations", "total")
TIME_PARTS = ("compute", "tensor parallel", "context parallel", "pipeline p2p", "bubble", "data parallel", "total")
HEADER = (
    f"{'#':>4} {'dp':>4} {'tp':>3} {'pp':>3} {'cp':>3} {'mb x m':>8} {'recompute':>9} {'zero':>4} | "
    "GB: param  grad   opt   act total | s: comp    tp    cp   p2p bubble   dp total | tok/s/dev   MFU"
)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="llama3-8b")
    parser.add_argument("--cluster", choices=sorted(CLUSTERS), default="h100x8")
    parser.add_argument("--global-batch", type=int, help="sequences per step (default: the published run's)")
    parser.add_argument("--precision", choices=("mixed", "fp32"), default="mixed")
    parser.add_argument("--top", type=int, default=10, help="rows of the ranked table")
    parser.add_argument(
        "--every-stage", action="store_true", help="a row per ZeRO stage (default: the least memory of equal times)"
    )
    return parser.parse_args()


def row(rank, config, memory: dict, time: dict | None, devices: int) -> str:
    """One line of the table: the configuration, memory in GB (10^9 bytes) and time in seconds, part by part."""
    head = (
        f"{rank:>4} {config.dp:>4} {config.tp:>3} {config.pp:>3} {config.cp:>3} "
        f"{f'{config.micro_batch}x{config.micro_batches}':>8} {config.recompute:>9} {config.zero:>4} | "
    )
    memory_text = " ".join(f"{memory[part] / 1e9:5.1f}" for part in MEMORY_PARTS)
    if time is None:
        return head + f"    {memory_text} | (does not fit)"
    time_text = " ".join(f"{time[part]:5.2f}" for part in TIME_PARTS)
    per_device = time["tokens per second"] / devices
    return head + f"    {memory_text} |    {time_text} | {per_device:9,.0f} {time['mfu']:5.1%}"


def main(args):
    model, cluster = MODELS[args.model], CLUSTERS[args.cluster]
    published = PUBLISHED.get((args.model, args.cluster))
    global_batch = args.global_batch or (published["global_batch"] if published else cluster.devices)
    training = Training(global_batch, args.precision)
    print(
        f"model {model.name}: {model.num_parameters() / 1e9:.2f} B parameters, {model.layers} layers, hidden "
        f"{model.hidden}, {model.heads} heads ({model.kv_heads or model.heads} kv), MLP {model.ffn}, vocabulary "
        f"{model.vocab}, sequence {model.seq}"
    )
    print(
        f"cluster {cluster.name}: {cluster.devices} devices, {cluster.memory_bytes / 1e9:.0f} GB and "
        f"{cluster.flops / 1e12:.0f} TFLOP/s each; intra-node {1 / cluster.intra_beta / 1e9:.0f} GB/s, "
        f"alpha {cluster.intra_alpha * 1e6:.0f} us; inter-node {1 / cluster.inter_beta / 1e9:.0f} GB/s per device, "
        f"alpha {cluster.inter_alpha * 1e6:.0f} us"
    )
    tokens = global_batch * model.seq
    print(f"training: {global_batch} sequences ({tokens:,} tokens) per step, {args.precision} precision, Adam")
    print("mesh order, outermost to innermost: pp, dp, cp, tp (torchtitan's); groups within a node use NVLink\n")

    plans = rank_configs(model, cluster, training)
    print(
        f"step 1, fit memory: {len(enumerate_configs(model, cluster, training))} configurations enumerated, "
        f"{len(plans)} fit in {cluster.memory_bytes / 1e9:.0f} GB"
    )
    print(f"step 2, reach the global batch: each takes dp x micro-batch x micro-batches = {global_batch}")
    shown, seen = [], set()
    for rank, plan in enumerate(plans, start=1):
        same_time = (plan.config.dp, plan.config.tp, plan.config.pp, plan.config.cp, plan.config.micro_batch)
        same_time += (plan.config.recompute, plan.time["total"])
        if args.every_stage or same_time not in seen:  # ZeRO 0-2 often tie: keep the one with the least memory
            seen.add(same_time)
            shown.append((rank, plan))
    print(f"step 3, maximise throughput: the fastest, {'every' if args.every_stage else 'one'} ZeRO stage per time\n")
    print(HEADER)
    for rank, plan in shown[: args.top]:
        print(row(rank, plan.config, plan.memory, plan.time, cluster.devices))

    if published:
        print(f"\npublished: {published['reported']}")
        print("the same degrees, as this planner predicts them, for each recomputation mode:")
        print(HEADER)
        ranks = {plan.config: rank for rank, plan in enumerate(plans, start=1)}
        for mode in RECOMPUTE:
            config = replace(published["config"], recompute=mode)
            memory = predict_memory(model, cluster, training, config)
            fits = memory["total"] <= cluster.memory_bytes
            time = predict_step_time(model, cluster, training, config) if fits else None
            print(row(ranks.get(config, "-"), config, memory, time, cluster.devices))
    print()
    for note in NOTES:
        print(note)


if __name__ == "__main__":
    main(parse_args())
