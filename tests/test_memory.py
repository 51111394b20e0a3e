"""The memory arithmetic of lesson 06: bytes per parameter, what each ZeRO stage divides, what a rank holds."""

import pytest
import torch
from torch import nn

from common.memory import bytes_per_parameter, local_bytes, training_state_bytes, zero_bytes_per_rank


def test_adam_holds_16_bytes_per_parameter_in_fp32_and_in_zeros_mixed_precision():
    assert bytes_per_parameter("fp32") == {"parameters": 4, "gradients": 4, "optimizer": 8, "total": 16}
    assert bytes_per_parameter("mixed") == {"parameters": 2, "gradients": 2, "optimizer": 12, "total": 16}
    with pytest.raises(ValueError):
        bytes_per_parameter("fp16")


def test_the_zero_papers_example_7_5_billion_parameters_on_64_ranks():
    # ZeRO paper (SC20), figure 1: Psi = 7.5 B, N = 64, K = 12; it prints 120, 31.4, 16.6 and 1.9 GB per device
    psi, n = 7.5e9, 64
    figures = [zero_bytes_per_rank(psi, n, stage, "mixed")["total"] / 1e9 for stage in range(4)]
    assert figures == pytest.approx([120, 31.40625, 16.640625, 1.875])  # the exact arithmetic, in GB
    assert [round(figure, 1) for figure in figures] == [120, 31.4, 16.6, 1.9]  # as the figure rounds them


def test_each_stage_divides_one_more_part_by_the_world_size():
    rows = {stage: zero_bytes_per_rank(1000, 4, stage) for stage in range(4)}
    assert rows[0] == {"parameters": 4000, "gradients": 4000, "optimizer": 8000, "total": 16000}
    assert rows[1]["optimizer"] == 2000 and rows[1]["gradients"] == 4000
    assert rows[2]["gradients"] == 1000 and rows[2]["parameters"] == 4000
    assert rows[3] == {"parameters": 1000, "gradients": 1000, "optimizer": 2000, "total": 4000}
    with pytest.raises(ValueError):
        zero_bytes_per_rank(1000, 4, 4)


def test_a_70b_model_does_not_fit_the_source_s_numbers():
    # The source's "DDP per GPU: 140 + 140 + 280 GB" for LLaMA-70B: ZeRO's accounting gives 1120 GB per replica
    replica = zero_bytes_per_rank(70e9, 4, stage=0, precision="mixed")
    assert replica["total"] / 1e9 == pytest.approx(1120)
    assert zero_bytes_per_rank(70e9, 4, stage=3, precision="mixed")["total"] / 1e9 == pytest.approx(280)


def test_what_an_adam_step_leaves_on_one_process():
    model = nn.Linear(10, 5)  # 55 parameters
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 10)).sum().backward()
    assert training_state_bytes(model, optimizer)["optimizer"] == 0  # Adam creates its states on the first step
    optimizer.step()
    held = training_state_bytes(model, optimizer)
    assert held["parameters"] == held["gradients"] == 55 * 4
    assert held["optimizer"] == 55 * 8 + 2 * 4  # exp_avg and exp_avg_sq, plus one fp32 step counter per tensor
    assert local_bytes([None, torch.zeros(3, dtype=torch.bfloat16)]) == 6
