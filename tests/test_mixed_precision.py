"""The number formats and the loss scaler behind lesson 05, on one process, and a guard against the old AMP API."""

import json
import os
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from common.distributed import ConfigurationError
from common.models import LeNet
from common.precision import check_precision
from tests.conftest import REPO, load_script

# Written in pieces so that this file does not match itself.
DEPRECATED = re.compile(r"\btorch\.cuda\." + r"amp\b|\bfrom\s+torch\.cuda\s+import\s+" + r"amp\b")
SKIPPED_FOLDERS = {".venv", "runs", ".git", "data", "__pycache__", ".ipynb_checkpoints"}


def code_lines(path):
    """The lines of code in a .py file or in a notebook's code cells; Markdown is prose and may name old APIs."""
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text())["cells"]
        return [line for cell in cells if cell["cell_type"] == "code" for line in "".join(cell["source"]).splitlines()]
    return path.read_text().splitlines()


def deprecated_amp_uses(root):
    files = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = sorted(name for name in subfolders if name not in SKIPPED_FOLDERS)  # never enter .venv
        files += [Path(folder) / name for name in sorted(names) if name.endswith((".py", ".ipynb"))]
    return [
        f"{path.relative_to(root)}: {line.strip()}"
        for path in files
        for line in code_lines(path)
        if DEPRECATED.search(line)
    ]


def test_no_code_in_the_repository_uses_the_deprecated_cuda_amp_module():
    assert deprecated_amp_uses(REPO) == []


def test_the_scan_finds_the_deprecated_module_in_code_and_ignores_it_in_prose(tmp_path):
    old = "torch.cuda." + "amp"
    (tmp_path / "train.py").write_text(f"import torch\nscaler = {old}.GradScaler()\n")
    (tmp_path / "lesson.ipynb").write_text(
        json.dumps(
            {
                "cells": [
                    {"cell_type": "markdown", "source": [f"Other tutorials use `{old}`."]},
                    {"cell_type": "code", "source": ["from torch.cuda import " + "amp\n"]},
                ]
            }
        )
    )
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / "vendored.py").write_text(f"{old}.autocast()\n")
    assert deprecated_amp_uses(tmp_path) == [
        "lesson.ipynb: from torch.cuda import " + "amp",
        f"train.py: scaler = {old}.GradScaler()",
    ]


def test_fp16_flushes_1e_8_to_zero_and_the_scaled_value_survives():
    assert torch.finfo(torch.float16).tiny == pytest.approx(6.1035e-05, rel=1e-4)  # the smallest *normal* fp16
    assert torch.tensor(1e-4).half().item() == pytest.approx(1e-4, rel=1e-3)  # above it: no underflow at all
    assert torch.tensor(1e-8).half().item() == 0.0  # below the smallest subnormal, 2**-24 = 6e-8: gone
    scale = 2.0**16
    survived = torch.tensor(1e-8 * scale).half()
    assert survived.float().item() / scale == pytest.approx(1e-8, rel=1e-3)
    assert torch.tensor(1e-8).bfloat16().item() == pytest.approx(1e-8, rel=1e-2)  # bf16 has fp32's range


def test_bf16_keeps_fewer_significant_bits_than_fp16():
    one_plus = torch.tensor(1 + 2**-9)  # needs 9 bits after the point: fp16 keeps 10, bf16 7
    assert one_plus.half().item() == 1 + 2**-9
    assert one_plus.bfloat16().item() == 1.0


def test_a_small_gradient_underflows_in_an_fp16_backward_unless_the_loss_is_scaled():
    def gradient(scale):
        # As under autocast: an fp32 weight, cast to fp16 for a product with an fp16 activation, an fp32 loss.
        w = torch.ones(1, requires_grad=True)
        x = torch.full((1,), 1e-4, dtype=torch.float16)
        loss = ((w.half() * x).float() * 1e-4).sum()
        # d(loss)/dw = 1e-4 * x = 1e-8 (times the scale): the product is computed in fp16, then cast to fp32
        (loss * scale).backward()
        return w.grad / scale

    assert gradient(1.0).item() == 0.0
    assert gradient(2.0**16).item() == pytest.approx(1e-8, rel=1e-2)


def test_the_scaler_skips_a_step_on_inf_halves_the_scale_and_grows_it_back():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    X = torch.randn(8, 4)

    def step(poison):
        optimizer.zero_grad()
        scaler.scale(model(X).square().mean()).backward()
        if poison:
            model.weight.grad[0, 0] = float("inf")
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(optimizer)
        scaler.update()
        return not all(torch.equal(b, p) for b, p in zip(before, model.parameters()))

    assert step(poison=True) is False and scaler.get_scale() == 512.0  # skipped: nothing moved, scale halved
    assert step(poison=False) is True and scaler.get_scale() == 512.0  # one good step: not yet
    assert step(poison=False) is True and scaler.get_scale() == 1024.0  # growth_interval good steps: doubled


@pytest.mark.parametrize("fused", [False, True])
def test_scaler_step_already_reads_the_inf_flag_on_the_host_and_each_get_scale_reads_the_scale_once_more(fused):
    # Every .item() copies a device tensor to the host: on a GPU, a wait for all the work queued before it.
    count_item_calls = load_script(REPO / "benchmarks/scaler_sync.py").count_item_calls
    torch.manual_seed(0)
    model = LeNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=fused)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(F.cross_entropy(model(torch.randn(4, 1, 28, 28)), torch.arange(4))).backward()
    reads = {}
    for name, call in (
        ("unscale_", lambda: scaler.unscale_(optimizer)),
        ("step", lambda: scaler.step(optimizer)),
        ("update", scaler.update),
        ("get_scale", scaler.get_scale),
    ):
        with count_item_calls() as calls:
            call()
        reads[name] = calls[0]
    # A non-fused optimizer: step() must know on the host whether to call optimizer.step(). A fused one is handed
    # the flag and skips inside its kernel: no read at all.
    assert reads == {"unscale_": 0, "step": 0 if fused else 1, "update": 0, "get_scale": 1}


def test_autocast_computes_in_low_precision_but_parameters_and_gradients_stay_fp32():
    torch.manual_seed(0)
    model = LeNet()
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        logits = model(torch.randn(4, 1, 28, 28))
        loss = F.cross_entropy(logits, torch.tensor([0, 1, 2, 3]))
    loss.backward()
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32  # the loss is on autocast's fp32 list
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert {p.grad.dtype for p in model.parameters()} == {torch.float32}  # so DDP all-reduces fp32 gradients


AUTOCAST_DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: CUDA autocast's op lists"),
        ],
    ),
]


@pytest.mark.parametrize("device", AUTOCAST_DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_computes_losses_in_fp32_but_softmax_and_sums_in_fp32_on_cuda_only(device, dtype):
    # The op lists differ per device (ATen's autocast_mode.cpp): CUDA puts softmax, log_softmax and sum on its
    # fp32 list; CPU's fp32 list holds the losses, and softmax and sums keep the low-precision dtype there.
    generator = torch.Generator().manual_seed(0)
    X, weight = torch.randn(4, 10, generator=generator), torch.randn(10, 10, generator=generator)
    X, weight, y = X.to(device), weight.to(device), torch.arange(4, device=device)
    with torch.autocast(device_type=device, dtype=dtype):
        logits = F.linear(X, weight)
        dtypes = {
            "linear": logits.dtype,
            "softmax": F.softmax(logits, dim=-1).dtype,
            "log_softmax": F.log_softmax(logits, dim=-1).dtype,
            "sum": logits.sum().dtype,
            "cross_entropy": F.cross_entropy(logits, y).dtype,
            "mse_loss": F.mse_loss(logits, torch.zeros_like(logits)).dtype,
        }
    fp32_on_cuda = torch.float32 if device == "cuda" else dtype
    assert dtypes == {
        "linear": dtype,
        "softmax": fp32_on_cuda,
        "log_softmax": fp32_on_cuda,
        "sum": fp32_on_cuda,
        "cross_entropy": torch.float32,
        "mse_loss": torch.float32,
    }


def test_the_mixed_precision_benchmark_names_the_cpu_capability_and_the_16_bit_flags_present_and_absent(tmp_path):
    describe_cpu = load_script(REPO / "benchmarks/mixed_precision.py").describe_cpu
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma f16c\n")
    assert describe_cpu(cpuinfo) == (
        f"cpu capability {torch.backends.cpu.get_cpu_capability()}; "
        "cpu flags present: avx2 fma f16c; "
        "absent: avx512f avx512_bf16 avx512_fp16 amx_bf16 amx_fp16"
    )
    assert "cpu flags unknown" in describe_cpu(tmp_path / "no_such_file")


def test_bf16_saves_more_for_backward_than_fp32_at_batch_1_and_less_at_batch_16():
    # autocast saves a bf16 copy of each weight it casts (2 bytes x 2.47 M parameters, whatever the batch), and
    # halves the float activations: the copies outweigh the halving at 1 image, not at 16. The lesson's figures,
    # rounded as benchmarks/mixed_precision.py prints them.
    from common.models import SimpleCNN

    saved_for_backward_mib = load_script(REPO / "benchmarks/mixed_precision.py").saved_for_backward_mib
    torch.manual_seed(0)
    net = SimpleCNN()
    saved = {}
    for batch_size in (1, 16):
        X, y = torch.randn(batch_size, *SimpleCNN.input_shape), torch.randint(0, 10, (batch_size,))
        saved[batch_size] = {
            precision: round(saved_for_backward_mib(net, X, y, precision), 1) for precision in ("fp32", "bf16")
        }
    assert saved == {1: {"fp32": 1.2, "bf16": 5.4}, 16: {"fp32": 19.5, "bf16": 16.2}}


def test_check_precision_accepts_what_this_cpu_runs():
    for precision in ("fp32", "bf16", "fp16"):
        check_precision(precision, torch.device("cpu"))  # PyTorch 2.14 autocasts both on CPU, and scales fp16
    with pytest.raises(ConfigurationError, match="unknown precision 'fp8'"):
        check_precision("fp8", torch.device("cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_fp16_on_a_device_that_cannot_run_it_stops_with_a_message_instead_of_running_in_fp32():
    with pytest.raises(ConfigurationError, match="--precision fp16 is not supported on cuda"):
        check_precision("fp16", torch.device("cuda"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_gradscaler_without_a_device_means_cuda_and_silently_switches_off_without_one():
    with pytest.warns(UserWarning, match="CUDA is not available"):
        scaler = torch.amp.GradScaler()  # what tutorials write: no device
    assert not scaler.is_enabled()
    loss = torch.tensor(2.0)
    assert scaler.scale(loss) is loss  # no scaling at all: fp16 gradients would underflow unnoticed


def test_fp16_rounds_to_the_nearest_number_at_both_ends_of_its_range():
    smallest = 2.0**-24  # the smallest fp16 subnormal, about 6e-8
    assert torch.tensor(3e-8).half().item() == smallest  # above 2**-25: rounds up, not to 0
    assert torch.tensor(5e-8).half().item() == smallest
    assert torch.tensor(2.9e-8).half().item() == 0.0  # below 2**-25, about 3e-8: 0
    assert torch.tensor(65519.0).half().item() == 65504.0  # the largest fp16, not inf
    assert torch.tensor(65520.0).half().item() == float("inf")


def test_bf16_keeps_fp32s_normal_range_but_not_all_of_its_subnormals():
    assert torch.finfo(torch.bfloat16).tiny == torch.finfo(torch.float32).tiny  # 1.18e-38, the smallest normal
    assert torch.tensor(2e-38).bfloat16().item() == pytest.approx(2e-38, rel=1e-2)
    assert torch.tensor(1e-8).bfloat16().item() == pytest.approx(1e-8, rel=1e-2)
    assert torch.tensor(1e-42).item() == pytest.approx(1e-42, rel=1e-2)  # an fp32 subnormal
    assert torch.tensor(1e-42).bfloat16().item() == 0.0  # below bf16's smallest subnormal, 2**-133


def test_an_update_below_1_512_of_a_weight_is_lost_in_bf16_and_kept_in_fp32():
    weights = torch.rand(1000, generator=torch.Generator().manual_seed(0)) * 100 + 1e-3
    update = 0.99 * weights / 512
    assert torch.equal((weights.bfloat16() + update.bfloat16()), weights.bfloat16())  # every update lost
    assert ((weights + update) != weights).all()  # fp32 keeps every one


def test_an_op_on_no_autocast_list_keeps_its_inputs_dtype_or_promotes_to_the_wider():
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        low, full = torch.randn(4, dtype=torch.bfloat16), torch.randn(4)
        assert low.mean().dtype == torch.bfloat16
        assert (low + full).dtype == torch.float32  # type promotion: the wider of the two


def test_autocast_casts_a_weight_once_per_autocast_region():
    def casts(output):
        """The cast nodes (ToCopyBackward) in the graph behind ``output``."""
        found, stack = [], [output.grad_fn]
        while stack:
            node = stack.pop()
            if node is not None:
                found += [node] if type(node).__name__.startswith("ToCopyBackward") else []
                stack += [child for child, _ in node.next_functions]
        return found

    weight, X = torch.randn(4, 4, requires_grad=True), torch.randn(2, 4)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        first, second = F.linear(X, weight), F.linear(X, weight)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        next_forward = F.linear(X, weight)
    assert len(casts(first)) == len(casts(second)) == len(casts(next_forward)) == 1
    assert casts(first)[0] is casts(second)[0]  # one cached bf16 copy for both ops of the region
    assert casts(next_forward)[0] is not casts(first)[0]  # the cache was dropped when the region exited


def test_on_inf_a_fused_optimizer_is_called_and_skips_the_update_inside():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    calls = []
    optimizer.register_step_pre_hook(lambda *_: calls.append(1))
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.randn(8, 4)).square().mean()).backward()
    model.weight.grad[0, 0] = float("inf")
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(optimizer)
    scaler.update()
    assert calls == [1]  # optimizer.step() ran: a non-fused optimizer would not have been called
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))  # but nothing moved
    assert scaler.get_scale() == 2.0**15


def test_clipping_an_inf_gradient_after_unscale_gives_nan_and_the_scaler_still_skips():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.randn(8, 4)).square().mean()).backward()
    model.weight.grad[0, 0] = float("inf")
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    assert model.weight.grad[0, 0].isnan() and (model.weight.grad.flatten()[1:] == 0).all()  # inf x 0, finite x 0
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(optimizer)
    scaler.update()
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters())) and scaler.get_scale() == 2.0**15


def test_dropout_keeps_a_float_mask_on_the_cpu():
    # The CPU's dropout keeps its scaled random mask in the input's dtype; CUDA's fused native_dropout keeps a bool
    # mask. So the count of what autograd keeps differs a little between a CPU and a GPU.
    kept = []
    X = torch.randn(8, 16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append((t.dtype, tuple(t.shape))) or t, lambda t: t):
        F.dropout(X, 0.5, training=True)
    assert kept == [(torch.float32, (8, 16))]
