"""Shared by the multi-tensor kernel tests: shapes, a launch configuration that exercises
chunking, and stepping torch.optim beside a reference."""

import torch

#: irregular shapes: a matrix, a long vector, a single element, a 3-D tensor
SHAPES = [(7, 13), (1000,), (1,), (3, 5, 7)]
#: small chunks and blocks: several chunks per tensor, full blocks and a masked tail
SMALL = {"chunk_size": 256, "block_size": 64, "num_warps": 4}


def step_torch_optim(optimizer: torch.optim.Optimizer, params) -> list:
    """One step of ``optimizer`` over ``params`` with fresh random gradients, which it returns
    (for the reference under test to take the same step)."""
    grads = [torch.randn(p.shape) for p in params]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    optimizer.step()
    return grads
