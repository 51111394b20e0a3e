"""What ``nn.DataParallel`` does in one forward pass, written out so that it runs on any device, CPUs included.

``nn.DataParallel(module)(X)`` on N GPUs, in one process:

1. scatter: split ``X`` into N chunks along the batch dimension and copy chunk i to GPU i (``X`` may be on any
   device, the CPU included);
2. replicate: copy the module's parameters and buffers from GPU 0 to every GPU, again at every forward, into N
   new module objects (replica 0 too), one per GPU;
3. parallel_apply: run replica i on chunk i, one Python thread per GPU;
4. gather: concatenate the outputs on GPU 0, where the loss is computed.

The copies in steps 1, 2 and 4 are recorded by autograd, so ``loss.backward()`` scatters the output's gradient
back to the GPUs (the mirror of the gather), runs backward through every replica on its own GPU and sums the
replicas' gradients into the original parameters on GPU 0. The optimizer then updates the parameters there, and
the next forward replicates them again. Without GPUs, ``nn.DataParallel`` does none of this: it calls the module
on the whole batch.

On a CPU, ``tensor.to("cpu")`` returns the tensor itself, so with ``devices=["cpu", "cpu"]`` every replica shares
the original tensors; ``devices=["cpu:0", "cpu:1"]`` makes real copies that autograd records, as between GPUs.
"""

import copy
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn
from torch.func import functional_call


def replicate(module: nn.Module, device) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """One replica of ``module`` on ``device``: a new module object of its own, and copies of the parameters and
    buffers on ``device``, made with ``tensor.to(device)`` so that autograd leads their gradients back.

    Each thread needs a module object of its own: ``functional_call`` swaps the given tensors into the module's
    attributes for the call and back afterwards, so two threads sharing one module would run with each other's
    tensors. The new object holds the original's parameter and buffer tensors, not copies of them; the forward
    uses only the copies on ``device``.
    """
    state = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    shell = copy.deepcopy(module, memo={id(tensor): tensor for tensor in state.values()})
    return shell, {name: tensor.to(device) for name, tensor in state.items()}


def data_parallel_forward(module: nn.Module, X: torch.Tensor, devices: list) -> torch.Tensor:
    """The forward pass of ``nn.DataParallel(module, device_ids=devices)``, by hand; the output is on
    ``devices[0]``. Several entries of ``devices`` may name the same device, to show the steps on a CPU."""
    chunks = [chunk.to(device) for chunk, device in zip(X.chunk(len(devices)), devices)]  # 1. scatter
    replicas = [replicate(module, device) for device in devices[: len(chunks)]]  # 2. replicate (autograd sees it)

    def run_replica(replica, chunk):
        shell, tensors = replica
        return functional_call(shell, tensors, (chunk,))

    with ThreadPoolExecutor(len(chunks)) as threads:  # 3. parallel_apply: threads, so the GIL is shared
        outputs = list(threads.map(run_replica, replicas, chunks))
    return torch.cat([output.to(devices[0]) for output in outputs])  # 4. gather on the first device
