"""Where Triton kernels run in tests: CUDA tensors when there is a GPU, else CPU under the interpreter."""

import contextlib

import torch


@contextlib.contextmanager
def on_gpu_when_available():
    """Make CUDA torch's default device inside the block when a GPU is present (a no-op otherwise)."""
    if not torch.cuda.is_available():
        yield
        return
    torch.set_default_device("cuda")
    try:
        yield
    finally:
        torch.set_default_device("cpu")


def recorded_cuda_graphs() -> int:
    """How many CUDA graphs torch.compile's cudagraph trees recorded on this process's current GPU (0 when
    none): a compiled layer that silently fell back to launching its kernels one by one records none."""
    from torch._inductor.cudagraph_trees import get_manager

    manager = get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    if manager is None:
        return 0
    pending = [node for nodes in manager.roots.values() for node in nodes]
    count = 0
    while pending:
        node = pending.pop()
        count += 1
        pending.extend(child for children in node.children.values() for child in children)
    return count
