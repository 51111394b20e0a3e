"""The hand-made allreduces of common/collectives.py post exactly the messages lesson 01 says they do."""

import pytest
import torch

from common.collectives import count_messages, naive_all_reduce, ring_all_reduce
from common.launch import run_on_ranks

NUMEL = 1200  # divides by 2 and 4: every ring chunk holds S/N bytes


def messages_per_rank(env):
    tensor = torch.ones(NUMEL)
    counts = {}
    for name, all_reduce in (("naive", naive_all_reduce), ("ring", ring_all_reduce)):
        with count_messages() as count:
            all_reduce(tensor)
        counts[name] = [count.sends, count.receives, count.bytes_sent, count.bytes_received]
    counts["sum"] = tensor[0].item()  # the counting wrappers pass every message through
    return counts


# 3 ranks: tests/test_benchmarks.py counts them through the benchmark; 4 ranks on 2 cores take 20 s: a slow drill
@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_naive_posts_2_n_minus_1_messages_on_rank_0_and_the_ring_4_n_minus_1_of_s_over_n_on_every_rank(world_size):
    N, S = world_size, NUMEL * 4
    ranks = run_on_ranks(messages_per_rank, world_size, timeout=120)
    assert ranks[0]["naive"] == [N - 1, N - 1, (N - 1) * S, (N - 1) * S]  # 2(N-1)·S through rank 0's link
    for rank in ranks[1:]:
        assert rank["naive"] == [1, 1, S, S]
    for rank in ranks:  # 2(N-1) sends and 2(N-1) receives of S/N bytes each: 2(N-1)/N·S each way
        assert rank["ring"] == [2 * (N - 1), 2 * (N - 1), 2 * (N - 1) * S // N, 2 * (N - 1) * S // N]
        assert rank["sum"] == N * N  # naive made every element N, the ring summed those: N·N
