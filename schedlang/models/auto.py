"""An automatic tensor-parallel plan for HF models of any family.

:func:`plan_tensor_parallel` finds, without running the model, what Megatron-style tensor
parallelism needs:

* the transformer layers: the largest ``nn.ModuleList`` of same-class modules holding projections;
* in each layer, the *blocks*: a module whose ``forward`` calls projection children (``nn.Linear``
  or HF ``Conv1D``) where some are called on values computed from others. Following the names
  of ``forward`` (:func:`~schedlang.distributed.shard_rules.forward_code.projection_dataflow`)
  gives the pairs: q/k/v -> attention -> output projection, up/gate -> activation -> down. The
  projections fed by no sibling are split column-wise, the one they feed row-wise;
* whether a block is an attention (its forward reads head counts or sizes; the generic shard rule
  then keeps its head attributes local) or an MLP;
* where the input gradient of a block is summed: on the block's input when every column
  projection reads it directly and the caller passes it first, else on each column projection;
* the input embedding and the LM head (``get_input_embeddings`` / ``get_output_embeddings``):
  vocabulary parallel, with the vocabulary-parallel loss (or all-gathered logits).

:func:`apply_tensor_parallel` writes the plan as ``shard`` / ``sync`` steps, all-or-nothing.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional

from torch import nn

from ..distributed.shard_rules import find_shard_rule
from ..distributed.shard_rules.forward_code import first_parameter, is_projection, passes_first, projection_dataflow
from ..distributed.shard_rules.forward_code import child_inputs, projection_arguments
from ..distributed.shard_rules.generic_block import is_attention
from ..errors import ScheduleTypeError, ScheduleValueError
from ._common import (finish_lm_head, gradient_summed, model_schedule, shard_column, shard_row,
                      shard_vocab_embedding)

__all__ = ["BlockPlan", "TensorParallelPlan", "plan_tensor_parallel", "apply_tensor_parallel", "shard_auto"]

TUTORIAL = "tutorials/07_new_family.py"


@dataclasses.dataclass
class BlockPlan:
    """One column/row pair: ``columns`` (split along outputs) feed ``row`` (split along inputs)."""

    path: str
    kind: str  # "attention" | "mlp"
    columns: List[str]
    row: str
    grad_sync: str  # "block": bwd_post on the block; "columns": bwd_post on each column projection
    #: modules with weights that run on this rank's part of the split activations (Qwen3's q_norm): their
    #: gradients are summed over the group
    summed: List[str] = dataclasses.field(default_factory=list)

    def describe(self) -> str:
        where = self.path or "<root>"
        sync = "its input gradient all-reduced" if self.grad_sync == "block" else \
            "each column's input gradient all-reduced"
        summed = f"; weight gradients of {', '.join(self.summed)} summed" if self.summed else ""
        return (f"{where} ({self.kind}): {', '.join(self.columns)} column-parallel -> {self.row} row-parallel "
                f"(output all-reduced), {sync}{summed}")


@dataclasses.dataclass
class TensorParallelPlan:
    """What a tensor-parallel schedule does to a model; ``str()`` is a readable description."""

    model: str
    schedule: str  # "automatic" or the family schedule's name
    layers: str = ""
    blocks: List[BlockPlan] = dataclasses.field(default_factory=list)  # of the first layer; the others alike
    n_layers: int = 0
    embedding: Optional[str] = None
    lm_head: Optional[str] = None
    logits: str = "split"  # "split" (vocabulary-parallel loss) or "gathered"
    steps: int = 0
    all_blocks: List[BlockPlan] = dataclasses.field(default_factory=list, repr=False)  # of every layer

    def __str__(self) -> str:
        lines = [f"tensor-parallel plan for {self.model} ({self.schedule} schedule, {self.steps} steps)"]
        if self.layers:
            lines.append(f"  layers: {self.layers} ({self.n_layers}), in each:")
            first = f"{self.layers}.0."
            lines += [f"    {b.describe().replace(first, '', 1)}" if b.path.startswith(first) else
                      f"    the layer itself{b.describe()[len(b.path):]}" for b in self.blocks]
        if self.embedding:
            lines.append(f"  {self.embedding}: vocabulary-parallel embedding (lookups all-reduced)")
        if self.lm_head:
            how = "logits all-gathered" if self.logits == "gathered" else "logits split, vocabulary-parallel loss"
            lines.append(f"  {self.lm_head}: vocabulary-parallel LM head ({how})")
        return "\n".join(lines)


def _path_of(root: nn.Module, target: Optional[nn.Module]) -> Optional[str]:
    if target is None:
        return None
    for path, m in root.named_modules():
        if m is target:
            return path
    return None


def _layer_list(root: nn.Module):
    best, best_size = None, -1
    for path, m in root.named_modules():
        if not isinstance(m, nn.ModuleList) or len(m) == 0:
            continue
        if len({type(x) for x in m}) != 1 or not any(is_projection(x) for x in m[0].modules()):
            continue
        size = sum(p.numel() for p in m.parameters())
        if size > best_size:
            best, best_size = (path, m), size
    return best


def _cannot(model: nn.Module, why: str) -> ScheduleTypeError:
    name = type(model).__name__
    return ScheduleTypeError(
        f"<root>: no ready-made schedule for {name}, and the automatic plan cannot handle it: {why}. Write a "
        f"schedule for the family ({TUTORIAL} shows how) and register it with "
        f"schedlang.models.register_family({name.split('For')[0]!r}, fn)")


def _blocks_of(model: nn.Module, layer_path: str, layer: nn.Module) -> List[BlockPlan]:
    blocks = []
    for sub_path, module in layer.named_modules():
        names = [n for n, c in module.named_children() if is_projection(c)]
        if not names:
            continue
        path = f"{layer_path}.{sub_path}" if sub_path else layer_path
        flows = projection_dataflow(type(module), names)
        if flows is None:
            raise _cannot(model, f"the source of {type(module).__name__}.forward ({path}) cannot be read")
        missing = [n for n in names if n not in flows]
        if missing:
            raise _cannot(model, f"{path}: {type(module).__name__}.forward never calls {', '.join(missing)}")
        columns = [n for n in names if not flows[n]]
        rows = [n for n in names if flows[n]]
        for row in rows:
            if not flows[row] <= set(columns):
                raise _cannot(model, f"{path}.{row} is computed from {', '.join(sorted(flows[row]))}, not only from "
                                     "projections of the block's input")
        fed = {c for row in rows for c in flows[row]}
        unfed = [c for c in columns if c not in fed]
        if unfed:
            raise _cannot(model, f"{path}: {', '.join(unfed)} feed(s) no other projection of "
                                 f"{type(module).__name__}, so no column/row pair holds them")
        shared = [c for c in columns if sum(c in flows[r] for r in rows) > 1]
        if shared:
            raise _cannot(model, f"{path}: {', '.join(shared)} feed(s) several projections")
        kind = "attention" if is_attention(module) or _has_rule(module) else "mlp"
        weighted = [n for n, c in module.named_children()
                    if n not in names and any(True for _ in c.parameters()) and not n.startswith("_schedlang_")]
        region = child_inputs(type(module), names, weighted) or {}
        for row in rows:
            cols = [c for c in columns if c in flows[row]]
            summed = [f"{n}.{p}" if p else n for n in weighted if region.get(n, frozenset()) & set(cols) and row not in region.get(n, ())
                      for p, m in getattr(module, n).named_modules() if any(True for _ in m.parameters(False))]
            blocks.append(BlockPlan(path=path, kind=kind, columns=cols, row=row,
                                    grad_sync=_grad_sync(model, layer, sub_path, module, cols), summed=summed))
    if not blocks:
        raise _cannot(model, f"no column/row projection pair found in {layer_path}")
    return blocks


def _has_rule(module: nn.Module) -> bool:
    rule = find_shard_rule(module)
    return rule is not None and "Attention" in rule.__name__


def _grad_sync(model, layer, sub_path, module, columns) -> str:
    """"block" when a ``bwd_post`` sync on the block's first tensor input sums the right gradient."""
    if not sub_path:
        return "columns"  # the layer itself: its input also feeds the residual, whose gradient is whole
    param = first_parameter(type(module))
    args = projection_arguments(type(module), columns)
    direct = param is not None and all(
        args.get(c) and all(getattr(a, "id", None) == param for a in args[c]) for c in columns)
    if not direct:
        return "columns"
    parent_path, _, name = sub_path.rpartition(".")
    parent = layer.get_submodule(parent_path) if parent_path else layer
    return "block" if passes_first(type(parent), name, param) else "columns"


def plan_tensor_parallel(sch, gather_logits: bool = False) -> TensorParallelPlan:
    """The automatic tensor-parallel plan for ``sch``'s model (nothing is applied); ScheduleTypeError if
    the model's structure cannot be found.

    Example::

        print(plan_tensor_parallel(schedlang.create_schedule(OPTForCausalLM(config))))
    """
    model = sch.mod
    found = _layer_list(model)
    if found is None:
        raise _cannot(model, "no ModuleList of same-class layers holding projections")
    layers_path, layers = found
    prefix = f"{sch.path}." if sch.path else ""
    plan = TensorParallelPlan(model=type(model).__name__, schedule="automatic", layers=prefix + layers_path,
                              n_layers=len(layers), logits="gathered" if gather_logits else "split")
    per_layer = [_blocks_of(model, f"{layers_path}.{i}", layer) for i, layer in enumerate(layers)]
    plan.blocks = [dataclasses.replace(b, path=prefix + b.path) for b in per_layer[0]]
    plan.all_blocks = [dataclasses.replace(b, path=prefix + b.path) for bs in per_layer for b in bs]
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    emb = _safe(get_in)
    if isinstance(emb, nn.Embedding):
        plan.embedding = prefix + _path_of(model, emb)
    head = _safe(get_out)
    if isinstance(head, nn.Linear):
        plan.lm_head = prefix + _path_of(model, head)
    return plan


def _safe(fn):
    try:
        return fn() if callable(fn) else None
    except (NotImplementedError, AttributeError):
        return None


@model_schedule
def apply_tensor_parallel(sch, plan: TensorParallelPlan) -> TensorParallelPlan:
    """Write ``plan`` into ``sch`` as shard and sync steps (all-or-nothing); returns the plan."""
    before = len(sch.root.plan)
    root = sch.root
    for block in plan.all_blocks:
        b = root[block.path]
        for c in block.columns:
            shard_column(b[c])
        shard_row(b[block.row])
        for name in block.summed:
            b[name].replace(gradient_summed(b[name].mod, b.group))
        b[block.row].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
        if block.grad_sync == "block":
            b.sync(mode="bwd_post", sync_op_or_fn="all_reduce")
        else:
            for c in block.columns:
                b[c].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
    if plan.embedding:
        shard_vocab_embedding(root[plan.embedding])
    if plan.lm_head:
        finish_lm_head(root, root, "", False, plan.logits == "gathered", head_path=plan.lm_head)
    plan.steps = len(sch.root.plan) - before
    return plan


def shard_auto(sch, sequence_parallel: bool = False, gather_logits: bool = False) -> TensorParallelPlan:
    """Find the tensor-parallel plan of ``sch``'s model and apply it; returns the plan.

    Arguments:
        sch: schedule of a HF model (a causal LM, or any model whose layers hold attention and MLP
            blocks of projections).
        sequence_parallel: not supported by the automatic plan (the family schedules of LLaMA, GPT-2
            and BERT have it).
        gather_logits: all-gather the logits (full logits, HF's loss, what ``Verify`` compares); by
            default they stay split along the vocabulary and the loss is the vocabulary-parallel one.

    Example::

        with schedlang.Verify(sch, example_inputs=[ids]):
            print(shard_auto(sch, gather_logits=True))
    """
    if sequence_parallel:
        raise ScheduleValueError(
            f"{sch.path or '<root>'}: sequence_parallel=True is not supported by the automatic plan for "
            f"{type(sch.mod).__name__}; the LLaMA, GPT-2 and BERT schedules have it (see {TUTORIAL} to write one)")
    return apply_tensor_parallel(sch, plan_tensor_parallel(sch, gather_logits=gather_logits))
