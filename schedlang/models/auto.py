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

With ``sequence_parallel=True`` (Megatron-SP) the activations between the blocks are split along
the sequence: the first layer keeps its rank's slice of the sequence, each block all-gathers its
input and reduce-scatters its row projection's output (instead of all-reducing it), every module
with weights that runs on the slices (the norms) gets its weight gradients summed over the group,
and the last layer's output is all-gathered again, so the final norm and the LM head see the
whole sequence. Attention blocks gather and scatter along the sequence (axis 1); MLP blocks work
token by token, so they gather and scatter along axis 0, which holds tokens both in
``(batch, seq, hidden)`` activations and in the ``(tokens, hidden)`` ones OPT's layer flattens to.
The sequence length must be divisible by the number of ranks (a clear error says so otherwise):
padding would change what a bidirectional encoder computes, so it is left to the caller.

:func:`apply_tensor_parallel` writes the plan as ``shard`` / ``sync`` steps, all-or-nothing. A family
whose layout the dataflow cannot find (BERT's attention spans two modules) or that wants other
options (LLaMA's gradient sums at the norms) adjusts the plan before applying it
(:mod:`schedlang.models.llama`, :mod:`~schedlang.models.gpt2`, :mod:`~schedlang.models.bert`).
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

from torch import nn

from ..distributed.shard_rules import find_shard_rule
from ..distributed.shard_rules.forward_code import first_parameter, is_projection, passes_first, projection_dataflow
from ..distributed.shard_rules.forward_code import child_inputs, projection_arguments
from ..distributed.shard_rules.generic_block import is_attention
from ..errors import ScheduleTypeError
from .moe import ExpertsPlan, apply_experts, find_experts
from .plan_checks import KEEP_WHOLE_RECIPE, UnsupportedModelError, block_findings, probe_parts, refusal_parts
from .shape_probe import probe_forward
from ._common import (base_and_prefix, finish_lm_head, gradient_summed, model_schedule, shard_column, shard_row,
                      shard_vocab_embedding)

__all__ = ["BlockPlan", "TensorParallelPlan", "plan_tensor_parallel", "layer_plan", "family_plan",
           "check_family_layout", "apply_tensor_parallel", "shard_auto"]

TUTORIAL = "tutorials/07_new_family.py"


@dataclasses.dataclass
class BlockPlan:
    """One column/row pair: ``columns`` (split along outputs) feed ``row`` (split along inputs).

    ``columns`` and ``row`` are paths under ``path`` (``"self.query"`` in BERT). Where the block's
    input is synchronized (the gradient summed under tensor parallelism, the sequence all-gathered
    under sequence parallelism) says ``grad_sync``: ``"block"`` on the input of the module at
    ``entry`` (a path under ``path``, ``""``: the block itself), ``"columns"`` on each column
    projection's input, ``"producer"`` on the output of the module at ``producer`` (a full path: the
    norm that computes the block's input), which keeps keyword pre-hooks out of the layer.
    """

    path: str
    kind: str  # "attention" | "mlp"
    columns: List[str]
    row: str
    grad_sync: str  # "block" | "columns" | "producer" (see above)
    #: modules with weights that run on this rank's part of the split activations (Qwen3's q_norm): their
    #: gradients are summed over the group
    summed: List[str] = dataclasses.field(default_factory=list)
    entry: str = ""
    producer: Optional[str] = None
    #: the attention module's own parameters with one entry per head, ``(name, axis)``: split with the heads
    head_params: List[Tuple[str, int]] = dataclasses.field(default_factory=list)
    #: why the block cannot be split correctly (None: it can); apply_tensor_parallel refuses such a block
    unsupported: Optional[str] = None

    def describe(self, sequence_parallel: bool = False) -> str:
        where = self.path or "<root>"
        what = "input all-gathered along the sequence" if sequence_parallel else "input gradient all-reduced"
        if self.grad_sync == "block":
            sync = f"its {what}" if not self.entry else f"the {what} at {self.entry}"
        elif self.grad_sync == "producer":
            sync = f"the {what} at the output of {self.producer}"
        else:
            sync = f"each column's {what}"
        out = "reduce-scattered along the sequence" if sequence_parallel else "all-reduced"
        summed = f"; weight gradients of {', '.join(self.summed)} summed" if self.summed else ""
        heads = f"; per-head {', '.join(n for n, _ in self.head_params)} split" if self.head_params else ""
        if self.unsupported:
            return f"{where} ({self.kind}): cannot be split: {self.unsupported}"
        return (f"{where} ({self.kind}): {', '.join(self.columns)} column-parallel -> {self.row} row-parallel "
                f"(output {out}), {sync}{summed}{heads}")


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
    #: install the vocabulary-parallel loss as the model's ``loss_function`` (split logits of a causal LM)
    vocab_parallel_loss: bool = True
    sequence_parallel: bool = False
    #: under sequence parallelism: the modules with weights in the first layer that run on sequence slices
    #: (their weight gradients summed over the group); the other layers alike
    sequence_sharded: List[str] = dataclasses.field(default_factory=list)
    #: modules of the first layer whose projections feed no other projection (routers, gates): kept whole
    kept_whole: List[str] = dataclasses.field(default_factory=list)
    #: the experts of mixture-of-experts blocks, of every layer: split like dense MLPs, or kept whole (and why)
    experts: List[ExpertsPlan] = dataclasses.field(default_factory=list, repr=False)

    def __str__(self) -> str:
        sp = self.sequence_parallel
        lines = [f"tensor-parallel plan for {self.model} ({self.schedule} schedule, {self.steps} steps"
                 f"{', sequence parallel' if sp else ''})"]
        if self.layers:
            lines.append(f"  layers: {self.layers} ({self.n_layers}), in each:")
            first = f"{self.layers}.0."
            lines += [f"    {b.describe(sp).replace(first, '', 1)}" if b.path.startswith(first) else
                      f"    the layer itself{b.describe(sp)[len(b.path):]}" for b in self.blocks]
            lines += [f"    {e.describe(first)}" for e in self.experts if e.path.startswith(first)]
            if self.kept_whole:
                lines.append(f"    kept whole (their projections feed no other one): "
                             f"{', '.join(p.replace(first, '', 1) for p in self.kept_whole)}")
            if sp:
                shown = ", ".join(p.replace(first, "", 1) for p in self.sequence_sharded) or "none"
                lines.append(f"    on sequence slices, weight gradients summed: {shown}")
                lines.append(f"  sequence parallel: {first[:-1]} keeps each rank's slice of the sequence, the "
                             f"output of {self.layers}.{self.n_layers - 1} is all-gathered")
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


def _blocks_of(model: nn.Module, layer_path: str, layer: nn.Module, kept_whole: Optional[List[str]] = None
               ) -> List[BlockPlan]:
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
        if not rows and not (is_attention(module) or _has_rule(module)):
            # a router or a gate: its projections feed no other one, so nothing pairs them; whole on every rank.
            # (An attention whose output projection sits in another module, as in BERT, is no such thing: the
            # check below refuses it, and a family override names its blocks.)
            if kept_whole is not None:
                kept_whole.append(path)
            continue
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
            found = block_findings(module, path, kind, cols, row, weighted, region)
            blocks.append(BlockPlan(path=path, kind=kind, columns=cols, row=row,
                                    grad_sync=_grad_sync(model, layer, sub_path, module, cols), summed=found.summed,
                                    head_params=found.head_params, unsupported=found.unsupported))
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


def plan_tensor_parallel(sch, gather_logits: bool = False, sequence_parallel: bool = False) -> TensorParallelPlan:
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
    kept_whole: List[str] = []
    per_layer = [_blocks_of(model, f"{layers_path}.{i}", layer, kept_whole) for i, layer in enumerate(layers)]
    plan = layer_plan(sch, layers_path, [b for bs in per_layer for b in bs], gather_logits, sequence_parallel)
    first = f"{layers_path}.0"
    prefix = f"{sch.path}." if sch.path else ""
    plan.kept_whole = [prefix + p for p in kept_whole if p == first or p.startswith(first + ".")]
    if not sequence_parallel:  # under sequence parallelism experts run on sequence slices, whole
        plan.experts = [dataclasses.replace(e, path=prefix + e.path) for i, layer in enumerate(layers)
                        for e in find_experts(f"{layers_path}.{i}", layer)]
    return plan


def layer_plan(sch, layers_path: str, blocks: List[BlockPlan], gather_logits: bool = False,
               sequence_parallel: bool = False) -> TensorParallelPlan:
    """A plan over the layers at ``layers_path`` (relative to ``sch``) with the given ``blocks`` (paths
    relative to ``sch``, of every layer), plus the vocabulary-parallel embedding and LM head the model's
    ``get_input_embeddings`` / ``get_output_embeddings`` name. For a family whose blocks the dataflow
    cannot find (BERT's attention spans two modules), which names them itself.

    Example::

        blocks = [BlockPlan(f"encoder.layer.{i}", "mlp", ["intermediate.dense"], "output.dense", "block",
                            entry="intermediate") for i in range(n)]
        apply_tensor_parallel(sch, layer_plan(sch, "encoder.layer", blocks))
    """
    model = sch.mod
    layers = model.get_submodule(layers_path)
    prefix = f"{sch.path}." if sch.path else ""
    first = f"{layers_path}.0"
    plan = TensorParallelPlan(model=type(model).__name__, schedule="automatic", layers=prefix + layers_path,
                              n_layers=len(layers), logits="gathered" if gather_logits else "split",
                              sequence_parallel=sequence_parallel)
    plan.all_blocks = [dataclasses.replace(b, path=prefix + b.path) for b in blocks]
    # the same objects: a family override that changes the first layer's blocks changes what the plan prints
    plan.blocks = [b for b, original in zip(plan.all_blocks, blocks)
                   if original.path == first or original.path.startswith(first + ".")]
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    emb = _safe(get_in)
    if isinstance(emb, nn.Embedding):
        plan.embedding = prefix + _path_of(model, emb)
    head = _safe(get_out)
    if isinstance(head, nn.Linear):
        plan.lm_head = prefix + _path_of(model, head)
    if sequence_parallel:
        plan.sequence_sharded = [prefix + p for p in _sequence_sharded(model, first, blocks)]
    return plan


def _sequence_sharded(model: nn.Module, layer_path: str, blocks: List[BlockPlan]) -> List[str]:
    """Modules with weights of the layer at ``layer_path`` outside its tensor-parallel regions (norms):
    under sequence parallelism they run on sequence slices. The blocks' projections, and the modules
    already summed over the heads (``BlockPlan.summed``), are not."""
    layer = model.get_submodule(layer_path)
    skip = set()
    for b in blocks:
        if b.path != layer_path and not b.path.startswith(layer_path + "."):
            continue
        block = model.get_submodule(b.path)
        skip |= {id(block.get_submodule(p)) for p in b.columns + [b.row] + list(b.summed)}
    out, stack = [], [(layer_path, layer)]
    while stack:
        path, module = stack.pop()
        if id(module) in skip:
            continue
        if path != layer_path and any(p.requires_grad for p in module.parameters(recurse=False)):
            out.append(path)
        for name, child in reversed(list(module.named_children())):
            if not name.startswith("_schedlang_"):
                stack.append((f"{path}.{name}", child))
    return out


def check_family_layout(sch, family: str, layers_name: str, expected) -> None:
    """Check that ``sch``'s model looks as a ``family`` model does: a ``layers_name`` ModuleList (within 4
    levels of ``sch``) whose layers hold, for each ``block_path -> (columns, row)`` of ``expected`` (``""``:
    the layer itself), those projections. A model that does not (a module replaced by another) gets an
    error naming the module, instead of a plan that differs from the family's.

    Example::

        check_family_layout(sch, "LLaMA", "layers", {"mlp": (["gate_proj", "up_proj"], "down_proj")})
    """
    base, _ = base_and_prefix(sch, layers_name, family)
    for layer in base[layers_name].child.values():
        for block_path, (columns, row) in expected.items():
            hint = "; for another layout, shard_model(sch) finds the plan from the model's code"
            if block_path and block_path not in layer:
                raise ScheduleTypeError(f"{layer.path}: expected '{block_path}' in a {family} layer, found "
                                        f"{', '.join(layer.child) or 'no submodules'}{hint}")
            block = layer[block_path] if block_path else layer
            if any(n not in block for n in columns + [row]):
                raise ScheduleTypeError(f"{block.path}: expected {', '.join(columns)} and {row} in a {family} "
                                        f"{block_path.rpartition('.')[2] or 'layer'}, found "
                                        f"{', '.join(block.child) or 'no submodules'}{hint}")
            for n in columns + [row]:
                if not is_projection(block[n].mod):
                    raise ScheduleTypeError(f"{block[n].path}: expected an nn.Linear or Conv1D, found "
                                            f"{type(block[n].mod).__name__}")


def family_plan(sch, family: str, layers_name: str, expected, gather_logits: bool = False,
                sequence_parallel: bool = False, name: str = "") -> TensorParallelPlan:
    """The automatic plan of a model of a known ``family`` (see :func:`check_family_layout` for
    ``layers_name`` and ``expected``), checked to pair its projections as ``expected`` says; ``name``
    names the schedule in the plan.

    Example::

        plan = family_plan(sch, "LLaMA", "layers", {"mlp": (["gate_proj", "up_proj"], "down_proj")})
    """
    check_family_layout(sch, family, layers_name, expected)
    plan = plan_tensor_parallel(sch, gather_logits=gather_logits, sequence_parallel=sequence_parallel)
    prefix = f"{plan.layers}.0."
    found = {(b.path[len(prefix):], tuple(b.columns), b.row) for b in plan.blocks}
    wanted = {(p, tuple(c), r) for p, (c, r) in expected.items()}
    if not wanted <= found:
        raise _cannot(sch.mod, f"its layers' projections pair up as {sorted(found)}, not as a {family} model's "
                               f"{sorted(wanted)}")
    plan.schedule = name or plan.schedule
    return plan


def _safe(fn):
    try:
        return fn() if callable(fn) else None
    except (NotImplementedError, AttributeError):
        return None


#: activations are (batch, seq, hidden): attention mixes along the sequence, so it gathers and scatters there
SEQUENCE_AXIS = 1
#: an MLP works token by token: axis 0 holds tokens in (batch, seq, hidden) and in flattened (tokens, hidden)
TOKEN_AXIS = 0


@model_schedule
def apply_tensor_parallel(sch, plan: TensorParallelPlan) -> TensorParallelPlan:
    """Write ``plan`` into ``sch`` as shard and sync steps (all-or-nothing); returns the plan.

    Example::

        plan = plan_tensor_parallel(sch)
        plan.embedding = None           # keep the embedding whole
        apply_tensor_parallel(sch, plan)
    """
    unsupported = [(b.path, b.unsupported) for b in plan.all_blocks if b.unsupported]
    if unsupported:  # before any step: nothing of the plan is written
        where, what = refusal_parts(unsupported)
        raise UnsupportedModelError(
            f"{where}: shard_model cannot split this block of {type(sch.root.mod).__name__}: {what}. To keep it whole "
            f"and split the rest, write: {KEEP_WHOLE_RECIPE} (both from schedlang.models.auto); or register a "
            f"schedule of your own with schedlang.models.register_family")
    before = len(sch.root.plan)
    root = sch.root
    # the split model runs once on fake tensors: a model that breaks split but ran whole is refused. Not under
    # sequence parallelism: the split of the sequence is a function the shape-only run leaves out, and its plan
    # splits the same blocks as the tensor-parallel one
    try:
        with root.atomic(nested_undo=False):  # nothing below catches a primitive's error: one undo for every step
            return _write_tensor_parallel(sch, root, plan, before, probe=not plan.sequence_parallel)
    except _SplitBreaks as broken:  # every step is undone: the model is whole again
        failure = broken.failure
    if probe_forward(root.mod) is not None:
        # the probe cannot run this model whole either (data-dependent shapes, say): only Verify can tell
        with root.atomic(nested_undo=False):
            return _write_tensor_parallel(sch, root, plan, before, probe=False)
    where, kind = probe_parts(plan, failure)
    raise UnsupportedModelError(
        f"{where}: shard_model cannot split {type(root.mod).__name__}: split over {root.world_size} ranks, its "
        f"{failure.module_type} raises {failure.error} (found by running the split model on fake tensors; no "
        f"step stays in the plan). To keep every {kind} block whole and split the rest, write: plan = "
        f"plan_tensor_parallel(sch); plan.all_blocks = [b for b in plan.all_blocks if b.kind != {kind!r}]; "
        f"apply_tensor_parallel(sch, plan) (both from schedlang.models.auto); or register a schedule of your own "
        f"with schedlang.models.register_family")


class _SplitBreaks(Exception):
    """The split model failed the shape probe (undoes the steps on its way out; see apply_tensor_parallel)."""

    def __init__(self, failure):
        super().__init__(failure.error)
        self.failure = failure


def _write_tensor_parallel(sch, root, plan: TensorParallelPlan, before: int, probe: bool) -> TensorParallelPlan:
    sp = plan.sequence_parallel
    if sp:
        _sequence_parallel_modules(root, plan)
    for block in plan.all_blocks:
        b = root[block.path]
        for c in block.columns:
            shard_column(b[c])
        shard_row(b[block.row])
        for name, axis in block.head_params:
            b.shard(name, axis=axis)
        for name in block.summed:
            b[name].replace(gradient_summed(b[name].mod, b.group))
        axis = SEQUENCE_AXIS if block.kind == "attention" else TOKEN_AXIS
        if sp:
            b[block.row].sync(mode="fwd_post", sync_op_or_fn="reduce_scatter", axis=axis)
        else:
            b[block.row].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
        for target, mode in _entries(root, b, block):
            if sp:  # each consumer holds a partial input gradient: the gather's backward reduce-scatters it
                target.sync(mode=mode, sync_op_or_fn="all_gather", axis=axis, tensor_parallel_output_grad=True)
            elif mode == "fwd_pre":
                target.sync(mode="bwd_post", sync_op_or_fn="all_reduce")
            else:
                from ..distributed.sequence_parallel import AllReduceGradient

                target.sync(mode="fwd_post", sync_op_or_fn=AllReduceGradient(target.group))
    for experts in plan.experts:
        apply_experts(root, experts)
    if sp:
        from ..distributed.sequence_parallel import split_sequence

        split_sequence(root[f"{plan.layers}.0"])
        # the last layer's output whole again: the final norm and the LM head see the whole sequence, and
        # the LM head's input gradient is summed (below), so the gather's backward only slices it
        root[f"{plan.layers}.{plan.n_layers - 1}"].sync(mode="fwd_post", sync_op_or_fn="all_gather",
                                                        axis=SEQUENCE_AXIS, tensor_parallel_output_grad=False)
    if plan.embedding:
        shard_vocab_embedding(root[plan.embedding])
    if plan.lm_head:
        finish_lm_head(root, root, "", False, plan.logits == "gathered", head_path=plan.lm_head,
                       install_loss=plan.vocab_parallel_loss)
    failure = probe_forward(root.mod) if probe else None
    if failure is not None:
        raise _SplitBreaks(failure)
    plan.steps = len(sch.root.plan) - before
    return plan


def _entries(root, b, block: BlockPlan):
    """``(schedule, mode)`` where the block's input is synchronized: ``fwd_pre`` on a module whose input it
    is, ``fwd_post`` on the module that produces it."""
    if block.grad_sync == "block":
        return [(b[block.entry] if block.entry else b, "fwd_pre")]
    if block.grad_sync == "producer":
        return [(root[block.producer], "fwd_post")]
    return [(b[c], "fwd_pre") for c in block.columns]


def _sequence_parallel_modules(root, plan: TensorParallelPlan) -> None:
    """Every layer's modules with weights outside the tensor-parallel regions run on sequence slices: the
    norms :mod:`~schedlang.distributed.sequence_parallel` knows get their sequence-parallel form, any other
    module a form whose weight gradients are summed over the group."""
    from ..distributed.sequence_parallel import make_sequence_parallel_norm

    first = f"{plan.layers}.0."
    for i in range(plan.n_layers):
        for path in plan.sequence_sharded:
            target = root[f"{plan.layers}.{i}.{path[len(first):]}"]
            try:
                new = make_sequence_parallel_norm(target.path, target.mod, group=target.group)
            except ScheduleTypeError:  # not a norm it knows: sum the gradients of the module's own weights
                new = gradient_summed(target.mod, target.group)
            target.replace(new)


def shard_auto(sch, sequence_parallel: bool = False, gather_logits: bool = False) -> TensorParallelPlan:
    """Find the tensor-parallel plan of ``sch``'s model and apply it; returns the plan.

    Arguments:
        sch: schedule of a HF model (a causal LM, or any model whose layers hold attention and MLP
            blocks of projections).
        sequence_parallel: also split the activations between the blocks along the sequence (norms,
            residuals, dropouts; see the module docstring). The sequence length must then be divisible
            by the number of ranks.
        gather_logits: all-gather the logits (full logits, HF's loss); by default they stay split along
            the vocabulary and the loss is the vocabulary-parallel one (``Verify`` compares each rank's
            slice of the logits with the original's).

    Example::

        with schedlang.Verify(sch, example_inputs=[ids]):
            print(shard_auto(sch, sequence_parallel=True))
    """
    return apply_tensor_parallel(sch, plan_tensor_parallel(sch, gather_logits=gather_logits,
                                                           sequence_parallel=sequence_parallel))
