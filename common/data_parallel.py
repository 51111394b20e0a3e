"""What ``nn.DataParallel`` does in one forward pass, written out so that it runs on any device, CPUs included.

``nn.DataParallel(module)(X)`` on N GPUs, in one process:

1. scatter: split ``X`` into N chunks along the batch dimension and copy chunk i to GPU i;
2. replicate: copy the module's parameters and buffers from GPU 0 to every GPU, again at every forward;
3. parallel_apply: run replica i on chunk i, one Python thread per GPU;
4. gather: concatenate the outputs on GPU 0, where the loss is computed.

The copies in step 2 are recorded by autograd, so ``loss.backward()`` runs backward through every replica on
its own GPU and sums the replicas' gradients into the original parameters on GPU 0. The optimizer then updates
the parameters there, and the next forward replicates them again. Without GPUs, ``nn.DataParallel`` does none
of this: it calls the module on the whole batch.
"""

from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn
from torch.func import functional_call


def data_parallel_forward(module: nn.Module, X: torch.Tensor, devices: list) -> torch.Tensor:
    """The forward pass of ``nn.DataParallel(module, device_ids=devices)``, by hand; the output is on
    ``devices[0]``. Several entries of ``devices`` may name the same device, to show the steps on a CPU."""
    chunks = [chunk.to(device) for chunk, device in zip(X.chunk(len(devices)), devices)]  # 1. scatter
    state = {**dict(module.named_parameters()), **dict(module.named_buffers())}

    def run_replica(chunk, device):
        replica = {name: tensor.to(device) for name, tensor in state.items()}  # 2. replicate (autograd sees it)
        return functional_call(module, replica, (chunk,))

    with ThreadPoolExecutor(len(chunks)) as threads:  # 3. parallel_apply: threads, so the GIL is shared
        outputs = list(threads.map(run_replica, chunks, devices[:len(chunks)]))
    return torch.cat([output.to(devices[0]) for output in outputs])  # 4. gather on the first device
