"""A whole training step (forward, backward, optimizer step) captured in one CUDA graph and replayed.

A training step of a mid-sized model issues thousands of kernel launches. When the host takes
about as long to issue them as the GPU takes to run them (GPT-2 medium at batch 8 on an H100 is
such a case: the host issues a step in 58 ms of its 59), the GPU waits on Python. A CUDA graph
records the launches once and replays them with one call, so the host cost of a step becomes a few
copies of the inputs and one replay.

What a step may do, because a graph replays fixed kernels on fixed addresses:

* the same shapes every step (the inputs are copied into buffers captured once);
* no host synchronization inside the step (``.item()``, printing a tensor, data-dependent shapes);
* an optimizer whose state lives on the device: ``torch.optim.AdamW(fused=True, capturable=True)``
  or :class:`schedlang.optim.FusedAdamW`; a learning rate that changes must be a 0-d device tensor;
* autocast with ``cache_enabled=False`` (the cast cache would keep tensors from the capture);
* no torch.compile'd region whose guards change under capture. Some transformers releases (5.17
  among them) build the causal attention mask while a graph is captured where they leave it to SDPA
  outside the capture, so a compiled HF layer would compile again (which cannot happen inside a
  capture). ``schedlang.models.optimize_model`` keeps the answer of outside the capture for calls
  without a padding mask (:mod:`schedlang.models.capture_masks`), so an optimized HF model's whole
  step can be captured; a batch with a padding mask still builds its mask under capture. Otherwise,
  ``optimize_model(sch, compile="layers-cudagraphs")`` replays each compiled layer from CUDA graphs
  while the model's own Python stays eager.

A float8 model (``optimize_model(sch, float8="tensorwise")``, compiled with ``compile="layers"``) is captured
the same way: its scales are computed on the device. On LLaMA-1.1B in float8 on an H200 the captured step took
102.0 to 104.6 ms, 0.2 to 0.9 ms less than per-layer graphs in the same runs
(``bench/results/2026-11-28-llama-1gpu-fp8-analysis.md``).

The first ``warmup`` calls run eagerly (on a side stream, as CUDA graph capture requires:
compilation, autotuning and lazily created optimizer state happen there); the next call captures
and replays; later calls only replay. Every call is a real training step on its inputs.
Without CUDA the step always runs eagerly, so the same script runs on a CPU.

Example::

    def loss_and_backward(ids, labels):
        with torch.autocast("cuda", torch.bfloat16, cache_enabled=False):
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        return loss

    step = schedlang.CapturedStep(loss_and_backward, optimizer)
    for ids, labels in batches:
        loss = step(ids, labels)       # the loss of this step (a buffer the next step overwrites)
"""

from __future__ import annotations

import logging
from typing import Any, Callable, List, Optional

import torch

from .errors import ScheduleTypeError, ScheduleValueError

logger = logging.getLogger("schedlang.captured_step")

__all__ = ["CapturedStep"]


def _capturable(optimizer: torch.optim.Optimizer) -> bool:
    from .optim.base import FusedOptimizer

    if isinstance(optimizer, FusedOptimizer):
        return True  # its step count and every other state tensor live on the parameters' device
    return bool(optimizer.defaults.get("capturable", False))


class CapturedStep:
    """``loss_and_backward(*inputs) -> loss`` plus ``optimizer.step()``, replayed from a CUDA graph.

    Arguments:
        loss_and_backward: computes the loss of a batch and calls ``backward`` on it; returns the loss.
        optimizer: stepped after each backward (inside the graph); its gradients are set to None
            before each eager step and before the capture, so the graph writes them afresh.
        warmup: eager steps before the capture (at least 1: optimizer state and compiled code must
            exist before they can be captured).
    """

    def __init__(self, loss_and_backward: Callable[..., torch.Tensor], optimizer: torch.optim.Optimizer,
                 warmup: int = 3):
        if not callable(loss_and_backward):
            raise ScheduleTypeError(f"CapturedStep: loss_and_backward must be a callable (inputs) -> loss, got "
                                    f"{type(loss_and_backward).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ScheduleTypeError(f"CapturedStep: optimizer must be a torch.optim.Optimizer, got "
                                    f"{type(optimizer).__name__}")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ScheduleValueError(f"CapturedStep: warmup must be an int >= 1 (eager steps before the capture), "
                                     f"got {warmup!r}")
        self.loss_and_backward = loss_and_backward
        self.optimizer = optimizer
        self.warmup = warmup
        self.calls = 0
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self._static_inputs: List[Any] = []
        self._static_loss: Optional[torch.Tensor] = None
        self._side_stream: Optional[torch.cuda.Stream] = None

    @property
    def captured(self) -> bool:
        """Whether the step is now replayed from a graph."""
        return self.graph is not None

    def __call__(self, *inputs: Any) -> torch.Tensor:
        self.calls += 1
        on_cuda = torch.cuda.is_available() and any(
            isinstance(x, torch.Tensor) and x.is_cuda for x in inputs)
        if not on_cuda:
            return self._eager(inputs)
        if self.graph is not None:
            self._check_like_captured(inputs)
            for static, x in zip(self._static_inputs, inputs):
                if isinstance(static, torch.Tensor):
                    static.copy_(x, non_blocking=True)
            self.graph.replay()
            return self._static_loss
        if self.calls <= self.warmup:
            return self._eager_on_side_stream(inputs)
        return self._capture(inputs)

    # ------------------------------------------------------------------------------------------- eager
    def _eager(self, inputs) -> torch.Tensor:
        loss = self.loss_and_backward(*inputs)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    def _eager_on_side_stream(self, inputs) -> torch.Tensor:
        # warm-up work runs on a side stream, so that nothing it leaves (cuBLAS workspaces, allocator
        # blocks of the default stream) ties the capture to the default stream
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream()
        self._side_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._side_stream):
            loss = self._eager(inputs)
        torch.cuda.current_stream().wait_stream(self._side_stream)
        return loss

    # ----------------------------------------------------------------------------------------- capture
    def _capture(self, inputs) -> torch.Tensor:
        if not _capturable(self.optimizer):
            raise ScheduleValueError(
                f"CapturedStep: {type(self.optimizer).__name__} keeps its step count on the host, so a captured "
                "step would replay the first step's update forever: use torch.optim.AdamW(..., capturable=True) "
                "(with fused=True) or schedlang.optim.FusedAdamW")
        self._static_inputs = [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in inputs]
        torch.cuda.synchronize()
        self.optimizer.zero_grad(set_to_none=True)  # backward writes fresh gradients from the graph's pool
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                loss = self.loss_and_backward(*self._static_inputs)
                self.optimizer.step()
        except RuntimeError as e:
            chain, cause = [], e
            while cause is not None:
                chain.append(f"{type(cause).__name__}: {cause}")
                cause = cause.__cause__ or cause.__context__
            if any("BackendCompilerFailed" in c or "compil" in c.split(":")[0].lower() for c in chain):
                raise ScheduleValueError(
                    "CapturedStep: a compiled region compiled again while the step was being captured (its guards "
                    "failed under capture: some transformers versions build attention masks differently while a "
                    "CUDA graph is captured, which schedlang.models.optimize_model prevents for batches without a "
                    "padding mask); use a step without torch.compile inside it, or replay the compiled layers from "
                    "CUDA graphs with optimize_model(sch, compile='layers-cudagraphs'): "
                    f"{chain[-1][:300]}") from e
            raise ScheduleValueError(
                "CapturedStep: the step cannot be captured in a CUDA graph (a host synchronization such as "
                f".item(), a data-dependent shape, or an autocast cast cache inside it?): {e}") from e
        self.graph, self._static_loss = graph, loss
        logger.info("captured the training step in a CUDA graph after %d eager step(s)", self.warmup)
        # capturing records the kernels without running them: run this step now
        self.graph.replay()
        return self._static_loss

    def _check_like_captured(self, inputs) -> None:
        if len(inputs) != len(self._static_inputs):
            raise ScheduleValueError(f"CapturedStep: the step was captured with {len(self._static_inputs)} inputs, "
                                     f"got {len(inputs)}; pass the same inputs every step, or make a new CapturedStep")
        for i, (static, x) in enumerate(zip(self._static_inputs, inputs)):
            if isinstance(static, torch.Tensor):
                if not isinstance(x, torch.Tensor) or x.shape != static.shape or x.dtype != static.dtype:
                    got = f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
                    raise ScheduleValueError(
                        f"CapturedStep: input {i} was captured as {tuple(static.shape)} {static.dtype}, got {got}: a "
                        "captured step replays fixed shapes; make a new CapturedStep for another shape")
            elif x != static:
                raise ScheduleValueError(f"CapturedStep: input {i} was captured as {static!r}, got {x!r}: non-tensor "
                                         "inputs are part of the captured step and cannot change")
