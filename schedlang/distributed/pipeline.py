"""Pipeline stages: split a built model after its ``cut_pipeline_stage`` modules and run the stages
with ``torch.distributed.pipelining`` on the ``pp`` ranks.

How an unchanged model is split
-------------------------------
A transformers model's ``forward`` does more than call its layers in a row: it builds the causal
mask, the rotary embeddings and position ids, slices hidden states and wraps the result in a
``ModelOutput``. Cutting it by hand would mean rewriting that forward per model family. Instead
the whole model is traced once, at build, with schedlang's hierarchy-keeping tracer
(:mod:`schedlang.graph.tracer`), keeping every module that is *not* an enclosing module of a cut
as a ``call_module`` leaf: for cuts after ``model.layers.1`` and ``model.layers.3`` of a LLaMA, only
``LlamaForCausalLM.forward`` and ``LlamaModel.forward`` are traced through, and ``embed_tokens``,
``rotary_emb``, every decoder layer, ``norm`` and ``lm_head`` stay calls of the original module
objects. The graph is then partitioned in execution order: stage ``k`` holds everything after the
``k``-th cut node up to and including the ``(k+1)``-th. ``torch.distributed.pipelining.pipeline``
(``torch.export``) was the alternative; it turns the model into exported graph modules, which
do not keep the original module objects with their forward hooks (tensor-parallel local views,
sync ops) and instance-level forwards (activation checkpointing), so the contract below could
not hold.

Why this keeps tensor and data parallelism working: a stage module is an ``fx.GraphModule``
whose submodules are the *original* module objects at their *original* paths (intermediate
containers re-created, ``model.layers`` stays an ``nn.ModuleList`` holding only this stage's
layers). So ``stage.state_dict()`` has exactly the original keys for the tensors the stage holds,
with the very same tensor objects (DTensor parameters included), forward hooks (tensor-parallel
local views, sync ops, activation checkpointing) still run because the leaves are called as
modules, and ``fully_shard`` on ``model.layers.3`` or on the stage root works by path. Only the
traced-through enclosing modules (``model``, ``model.layers``) are never called, so data
parallelism must wrap the layers and the stage root, not those (checked: a fully_shard or
replicate on one of them raises :class:`~schedlang.errors.PipelineError`).

What crosses a stage boundary
-----------------------------
``PipelineStage`` sends tensors, from each stage to the next only. A value computed in stage
``i`` and used in stage ``j > i + 1`` (the rotary ``(cos, sin)`` pair, the mask, position ids)
is relayed by the stages in between. Tuples are sent element by element and rebuilt. Values that
carry no gradient are sent as float tensors and converted back in the receiving stage: integer
tensors (position ids; exact up to 2**53), boolean masks, ``None`` (an empty tensor: the HF
mask builders return ``None`` at run time when SDPA can use ``is_causal``, so the mask is "a
tensor or None" and crosses as such) and Python numbers. An int (GPT-2 sends its output shape)
travels in the *shape* of an empty tensor, because torch's stages infer shapes before the first
step by sending zero-filled tensors, so a size sent as data would read 0 there; a float travels
as data (a float that decides a shape would break that inference). Such values are wired to
the stage output with zero gradients, because torch 2.11's stages expect a gradient for every
received tensor and torch 2.13's for every output that requires one; both then agree. Non-tensor
values that are not graph values (``None`` arguments, Python constants) are already folded into
the consumer's code by the tracer. Anything else (a cache object, a dict) makes the build fail
with an error naming the value and the cut.

The model output
----------------
The last stage returns one tensor: ``.logits`` of a transformers model output (the model is
called with only its main input, ``input_ids``, and ``use_cache=False``), the first element of a
tuple output, or a plain tensor output. ``loss_fn(output, target)`` gets it per microbatch.

Gradient scaling
----------------
torch's schedules are built with ``scale_grads=False`` and :meth:`PipelinedModel.step` divides
every local parameter's gradient by ``n_microbatches`` once after the schedule's backward
(torch's own ``scale_grads`` would divide a parameter that two local stages share twice). With a
``loss_fn`` that returns the mean loss of its microbatch and equal-sized microbatches, the
gradient after ``step`` is the gradient of the mean loss over the full batch, as if the unsplit
model had run on it once. Gradients accumulate in ``.grad`` like ``backward``: zero them between
steps (the division applies to what ``.grad`` holds).

Tied weights
------------
A parameter that two stages use (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``) is
kept correct: each pp rank holding one of those stages keeps the tensor under its own name in
its stage module (the same object when both stages are on one rank), the copies start equal
(the lowest holder's values are sent to the others at build) and after every step the holders
add their gradients (point-to-point over the pp group, summed in rank order, so every copy gets
the same total and takes the same optimizer step). FSDP on a tied weight held by two stages of
one rank is not supported.

Limits
------
* The ZeroBubble schedule with ``fully_shard`` is refused: measured on torch 2.13 (gloo) its
  later steps drift from one process, while ZeroBubble alone or with ``replicate``, and the
  other schedules with ``fully_shard``, agree.
* The enclosing modules that are traced through run as code of the stage modules: their own
  forward hooks do not run, and ``fully_shard`` / ``replicate`` on them is refused.
* Every rank builds the whole model before keeping its stages; the other stages' tensors are
  freed only when nothing else (the schedule) refers to the full model.
* For a model that is not a transformers model, pass ``example_inputs`` (in ``options``) so that
  what crosses each cut is known at build; otherwise it is checked when the stages run.

Example::

    sch = schedlang.create_schedule(model, mesh=make_mesh(pp=2))
    sch["model.layers.1"].cut_pipeline_stage()
    model, opt = schedlang.build(sch, optimizer=torch.optim.AdamW, lr=1e-3,
                                 pipeline={"schedule": "1F1B", "n_microbatches": 4, "loss_fn": loss_fn})
    losses = []
    model.step(input_ids, target=labels, losses=losses)   # losses filled on the last stage
    opt.step(); opt.zero_grad()
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import logging
import numbers
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx
from torch import nn

from ..errors import PipelineError, SchedlangError

__all__ = ["SCHEDULES", "build_pipeline", "split_model", "PipelinedModel"]

logger = logging.getLogger("schedlang.distributed.pipeline")

#: the schedules ``options["schedule"]`` accepts; the second group holds several stages per rank
SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B", "ZeroBubble")
_MULTI_STAGE = ("Interleaved1F1B", "ZeroBubble")
_OPTION_KEYS = ("schedule", "n_microbatches", "loss_fn", "example_inputs")


# ------------------------------------------------------------------------------------------------ run-time helpers
# These functions are called by the generated stage code.

def _send_grad_value(value, where: str):
    """A gradient-carrying activation leaving a stage: a float tensor, sent as it is."""
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        raise PipelineError(f"{where} is {_kind_of(value)} at run time, but was traced as a floating-point tensor; "
                            "pipeline stages can only send tensors across a cut: move the cut")
    if torch.is_grad_enabled() and not value.requires_grad:
        # an output that takes no gradient still gets one from the next stage (torch expects a
        # gradient for every float activation); give it a leaf to land on
        return value.detach().requires_grad_(True)
    return value.clone() if value._is_view() else value  # outputs may be detached in place


_FLOAT_OF = {torch.bool: torch.float32, torch.uint8: torch.float32, torch.int8: torch.float32,
             torch.int16: torch.float32, torch.int32: torch.float64, torch.int64: torch.float64}


def _send_plain_value(value, device: torch.device, where: str):
    """A value without gradient leaving a stage: as a float tensor (an empty one for None)."""
    if value is None:
        out = torch.zeros(0, dtype=torch.float32, device=device)
    elif isinstance(value, torch.Tensor):
        out = value.detach()
        if not out.is_floating_point():
            out = out.to(_FLOAT_OF.get(out.dtype, torch.float64))
        if out.dim() == 1 and out.numel() == 0:
            raise PipelineError(f"{where} is an empty 1-D tensor, which stands for None between pipeline stages; "
                                "move the cut")
    else:
        raise PipelineError(f"{where} is {_kind_of(value)} at run time, but was traced as a tensor or None; pipeline "
                            "stages can only send tensors across a cut: move the cut")
    return out.requires_grad_(True) if torch.is_grad_enabled() else out


def _send_number(value, device: torch.device, where: str):
    """A Python number leaving a stage. An int (a size, mostly) travels in the *shape* of an empty
    tensor, ``(0, |n|, n < 0)``: torch's stages infer shapes before the first step by sending
    zero-filled tensors of the right shapes, so a size sent as data would read 0 there."""
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        value = value.item()
    if isinstance(value, numbers.Integral):
        n = int(value)
        out = torch.empty((0, abs(n), int(n < 0)), dtype=torch.float32, device=device)
    elif isinstance(value, numbers.Real):
        out = torch.tensor(float(value), dtype=torch.float64, device=device)
    else:
        raise PipelineError(f"{where} is {_kind_of(value)} at run time, but was traced as a Python number; move the "
                            "cut")
    return out.requires_grad_(True) if torch.is_grad_enabled() else out


def _recv_plain_value(buffer: torch.Tensor, dtype: torch.dtype):
    if buffer.dim() == 1 and buffer.numel() == 0:
        return None
    out = buffer.detach()
    return out if out.dtype == dtype else out.to(dtype)


def _recv_number(buffer: torch.Tensor, kind: str):
    if kind == "float":
        return float(buffer.detach().item())
    n = buffer.shape[1] * (-1 if buffer.shape[2] else 1)
    return bool(n) if kind == "bool" else n


def _make_tuple(*items):
    return tuple(items)


def _make_list(*items):
    return list(items)


def _make_size(*items):
    return torch.Size(items)


def _relay(buffer: torch.Tensor) -> torch.Tensor:
    """A received value sent on to the next stage: a copy (stage outputs must not be the inputs or
    views of them; the zero-bubble schedules detach outputs in place)."""
    return buffer.clone()


# Every tensor a stage receives must get a gradient in backward (torch's stages send one back per
# received tensor), also the ones used without a gradient path (masks, position ids). Intermediate
# stages gather them into one extra 0-d output, the anchor, which the next stage receives like any
# other tensor; the last stage hangs its received tensors on its output. Backward gives them zeros.

class _AnchorScalar(torch.autograd.Function):
    @staticmethod
    def forward(ctx, *buffers):
        ctx.metas = [(b.shape, b.dtype, b.device) for b in buffers]
        return torch.zeros((), dtype=torch.float32, device=buffers[0].device)

    @staticmethod
    def backward(ctx, grad):
        return tuple(torch.zeros(s, dtype=d, device=dev) for s, d, dev in ctx.metas)


class _AnchorOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, *buffers):
        ctx.metas = [(b.shape, b.dtype, b.device) for b in buffers]
        return out.view_as(out)  # the last stage's output: never detached in place by torch

    @staticmethod
    def backward(ctx, grad):
        return (grad,) + tuple(torch.zeros(s, dtype=d, device=dev) for s, d, dev in ctx.metas)


def _anchor_scalar(*buffers):
    if torch.is_grad_enabled():
        return _AnchorScalar.apply(*buffers)
    return torch.zeros((), dtype=torch.float32, device=buffers[0].device)


def _anchor_output(out, *buffers):
    if not isinstance(out, torch.Tensor) or not out.is_floating_point():
        raise PipelineError(f"the model output is {_kind_of(out)} at run time; the last pipeline stage must return a "
                            "floating-point tensor")
    return _AnchorOutput.apply(out, *buffers) if torch.is_grad_enabled() else out


def _kind_of(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).replace('torch.', '')} tensor of shape {tuple(value.shape)}"
    if value is None:
        return "None"
    return f"a {type(value).__name__}"


# ------------------------------------------------------------------------------------------------ tracing
def _enclosing_paths(cut_paths: Sequence[str]) -> List[str]:
    out = set()
    for path in cut_paths:
        parts = path.split(".")
        for k in range(1, len(parts)):
            out.add(".".join(parts[:k]))
    return sorted(out, key=lambda p: (p.count("."), p))


def _leaf_paths(model: nn.Module, enclosing: Sequence[str]) -> List[str]:
    """Children of the root and of the enclosing modules that do not enclose a cut themselves."""
    inner = set(enclosing)
    leaves = []
    for owner in [""] + list(enclosing):
        module = model.get_submodule(owner) if owner else model
        for name, _ in module.named_children():
            full = f"{owner}.{name}" if owner else name
            if full not in inner:
                leaves.append(full)
    return leaves


@contextlib.contextmanager
def _local_tensors(model: nn.Module):
    """Tensor-parallel modules hold their local shards instead of DTensors while the model is traced
    (what their forward pre-hooks do at run time), so example values can be computed."""
    from . import dtensor_params as dp

    modules = [m for m in model.modules() if m.__dict__.get(dp.LOCAL_VIEW_ATTR) is not None]
    for m in modules:
        dp._swap_in_local(m, ())
    try:
        yield
    finally:
        for m in modules:
            dp._swap_back(m, (), None)


def _trace(model: nn.Module, cut_paths: Sequence[str]) -> fx.GraphModule:
    from ..graph import tracer as T

    enclosing = _enclosing_paths(cut_paths)
    leaves = _leaf_paths(model, enclosing)
    logger.debug("tracing %s through %s; leaves %s", type(model).__name__, ["<root>"] + enclosing, leaves)
    try:
        with _local_tensors(model):
            return T.trace_module(model, flatten=True, leaf_modules=leaves)
    except SchedlangError as e:
        raise PipelineError(f"cannot split {type(model).__name__} into pipeline stages after {', '.join(cut_paths)}: "
                            f"its forward could not be traced down to the cut modules: {e}") from e


_UNKNOWN = object()


def _examples(gm: fx.GraphModule, model: nn.Module, example_inputs: Optional[Sequence[Any]] = None
              ) -> Dict[fx.Node, Any]:
    """Example value (fake tensors) of every node, ``_UNKNOWN`` where it cannot be computed.

    Leaf modules run their class forward on fake inputs (their children's hooks run; sync ops only
    shape their output), so that the kinds of the values crossing a cut are known: tensor or
    tuple, dtype, whether they carry a gradient.
    """
    from ..graph import tracer as T

    fake_mode = T._new_fake_mode()
    values: Dict[fx.Node, Any] = {}
    is_hf = T.is_hf_model(model)

    def ex(a):
        return fx.node.map_aggregate(a, lambda x: values.get(x, _UNKNOWN) if isinstance(x, fx.Node) else x)

    def unknown(a) -> bool:
        found = []
        fx.node.map_aggregate(a, lambda x: found.append(x) if x is _UNKNOWN else None)
        return bool(found)

    device = next((t.device for t in model.parameters()), torch.device("cpu"))
    if device.type == "meta":
        device = torch.device("cpu")
    given = {}
    if example_inputs is not None:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        given = {n: fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t
                 for n, t in zip(placeholders, example_inputs)}
    with _local_tensors(model), T._shape_only_syncs(), fake_mode, torch.enable_grad():
        for node in gm.graph.nodes:
            value = _UNKNOWN
            try:
                if node in given:
                    value = given[node]
                elif node.op == "placeholder":
                    if is_hf and node.target in ("input_ids",):
                        value = torch.zeros(T.EXAMPLE_BATCH, T.EXAMPLE_SEQUENCE, dtype=torch.long, device=device)
                elif node.op == "get_attr":
                    value = _lookup(gm, node.target)
                elif node.op != "output":
                    args, kwargs = ex(node.args), ex(node.kwargs)
                    if not unknown((args, kwargs)):
                        if node.op == "call_module":
                            m = gm.get_submodule(node.target)
                            value = type(m).forward(m, *args, **kwargs)
                        elif node.op == "call_function":
                            value = node.target(*args, **kwargs)
                        else:
                            value = getattr(args[0], node.target)(*args[1:], **kwargs)
            except Exception as e:  # an example is a help, not a requirement: the run-time checks stay
                logger.debug("no example value for %s: %s", node.name, e)
                value = _UNKNOWN
            values[node] = value
    return values


def _lookup(root: Any, target: str) -> Any:
    obj = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


# ------------------------------------------------------------------------------------------------ partition
@dataclasses.dataclass
class _Leaf:
    kind: str  # "grad" (float activation), "plain" (tensor or None without gradient), "number"
    info: Any = None  # dtype for "plain", python type name for "number"


def _structure(example: Any, where: str):
    """How a value crosses a cut: a _Leaf, ("seq", type, [children]) or ("const", value)."""
    if example is _UNKNOWN:
        return _Leaf("grad")  # checked at run time
    if isinstance(example, torch.Tensor):
        if example.is_floating_point() and example.requires_grad:
            return _Leaf("grad")
        return _Leaf("plain", example.dtype)
    if example is None:
        return ("const", None)
    if isinstance(example, bool):
        return _Leaf("number", "bool")
    if isinstance(example, int):
        return _Leaf("number", "int")
    if isinstance(example, float):
        return _Leaf("number", "float")
    if isinstance(example, (tuple, list)) and type(example) in (tuple, list, torch.Size):
        return ("seq", type(example), [_structure(e, f"{where}[{i}]") for i, e in enumerate(example)])
    raise PipelineError(f"{where} is a {type(example).__name__}; only tensors, tuples or lists of tensors, None and "
                        "Python numbers can cross a pipeline stage boundary: move the cut")


def _leaves_of(structure) -> List[_Leaf]:
    if isinstance(structure, _Leaf):
        return [structure]
    if structure[0] == "seq":
        return [leaf for child in structure[2] for leaf in _leaves_of(child)]
    return []


@dataclasses.dataclass
class _Split:
    gm: fx.GraphModule
    order: List[fx.Node]                # computing nodes (no get_attr), in execution order
    stage_of: Dict[fx.Node, int]
    live: List[List[fx.Node]]           # live[b]: values that cross boundary b (after stage b)
    structure: Dict[fx.Node, Any]
    output: fx.Node
    inputs: List[fx.Node]
    cut_nodes: List[fx.Node]
    n_stages: int


def _model_output(gm: fx.GraphModule, values) -> fx.Node:
    """The node of the tensor the last stage returns (``.logits`` of an HF output)."""
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    value = out_node.args[0]
    for _ in range(4):
        if isinstance(value, fx.Node) and value.op == "call_function" and isinstance(value.target, type) and \
                not issubclass(value.target, torch.Tensor):
            fields = value.kwargs
            key = next((k for k in ("logits", "last_hidden_state", "prediction_logits") if
                        isinstance(fields.get(k), fx.Node)), None)
            if key is None:
                key = next((k for k, v in fields.items() if isinstance(v, fx.Node)), None)
            if key is None:
                break
            value = fields[key]
            continue
        if isinstance(value, (tuple, list)) and value:
            value = value[0]
            continue
        if isinstance(value, dict) and value:
            value = value.get("logits", next(iter(value.values())))
            continue
        break
    if not isinstance(value, fx.Node):
        raise PipelineError(f"the output of {type(gm).__name__} holds no tensor the last pipeline stage could return "
                            f"(got {value!r})")
    example = values.get(value, _UNKNOWN)
    if example is not _UNKNOWN and not isinstance(example, torch.Tensor):
        raise PipelineError(f"the model output '{value.name}' is a {type(example).__name__}, not a tensor; the last "
                            "pipeline stage returns one tensor (the logits)")
    return value


def _partition(model: nn.Module, cut_paths: Sequence[str], example_inputs=None) -> _Split:
    gm = _trace(model, cut_paths)
    values = _examples(gm, model, example_inputs)
    graph = gm.graph
    out_node = next(n for n in graph.nodes if n.op == "output")
    result = _model_output(gm, values)
    out_node.args = (result,)
    graph.eliminate_dead_code()
    input_names = set(getattr(gm, "_schedlang_input_names", ()) or ())
    inputs = []
    for node in list(graph.nodes):
        if node.op != "placeholder":
            continue
        if node.target in input_names or (not input_names and not node.args):
            inputs.append(node)
        elif not node.users:
            graph.erase_node(node)
        else:  # a specialized argument still read: its traced default
            node.replace_all_uses_with(node.args[0] if node.args else None)
            graph.erase_node(node)
    order = [n for n in graph.nodes if n.op not in ("get_attr", "output")]
    position = {n: i for i, n in enumerate(order)}

    cut_nodes = []
    for path in cut_paths:
        calls = [n for n in order if n.op == "call_module" and n.target == path]
        if not calls:
            raise PipelineError(
                f"{path}: cannot end a pipeline stage here: the model's forward does not call this module as one "
                f"step of its data flow (it is never called, or only inside another module); cut after a module the "
                f"forward of {type(model).__name__} (or of a module enclosing the cut) calls directly")
        if len(calls) > 1:
            raise PipelineError(f"{path}: cannot end a pipeline stage here: the forward calls this module "
                                f"{len(calls)} times, so no single point of the data flow is 'after' it; cut after a "
                                "module that runs once")
        cut_nodes.append(calls[0])
    cut_nodes.sort(key=position.__getitem__)
    cut_positions = [position[n] for n in cut_nodes]
    n_stages = len(cut_nodes) + 1
    stage_of = {n: bisect.bisect_left(cut_positions, position[n]) for n in order}
    if stage_of[result] < n_stages - 1:
        raise PipelineError(f"{cut_nodes[-1].target}: nothing runs after this module (the model output is computed "
                            f"before it), so the last pipeline stage would be empty; remove this cut")
    for s in range(1, n_stages - 1):
        if not any(stage_of[n] == s and n.op in ("call_module", "call_function", "call_method") for n in order):
            raise PipelineError(f"{cut_nodes[s].target}: nothing runs between the cut after "
                                f"'{cut_nodes[s - 1].target}' and this one, so that stage would be empty; remove one")

    last_use: Dict[fx.Node, int] = {}
    for n in order:
        users = [stage_of[u] if u.op != "output" else n_stages - 1 for u in n.users]
        last_use[n] = max(users, default=stage_of[n])
    live = [[n for n in order if stage_of[n] <= b < last_use[n]] for b in range(n_stages - 1)]
    structure = {}
    for b, crossing in enumerate(live):
        for n in crossing:
            if n not in structure:
                where = f"the value '{n.name}' (computed by {_describe(n)}), used after the cut after " \
                        f"'{cut_nodes[b].target}',"
                structure[n] = _structure(values.get(n, _UNKNOWN), where)
    for b, crossing in enumerate(live):
        if not any(_leaves_of(structure[n]) for n in crossing):
            raise PipelineError(f"{cut_nodes[b].target}: no tensor crosses this cut, so the stages after it do not "
                                "depend on the ones before; cut where an activation flows")
    return _Split(gm, order, stage_of, live, structure, result, inputs, cut_nodes, n_stages)


def _describe(node: fx.Node) -> str:
    if node.op == "call_module":
        return f"module '{node.target}'"
    if node.op == "placeholder":
        return f"input '{node.target}'"
    return f"{getattr(node.target, '__name__', node.target)}()"


# ------------------------------------------------------------------------------------------------ stage modules
def _stage_graph(split: _Split, s: int, device: torch.device) -> fx.Graph:
    g = fx.Graph()
    env: Dict[fx.Node, Any] = {}
    attrs: Dict[str, fx.Node] = {}
    last = s == split.n_stages - 1
    received: Dict[fx.Node, List[fx.Node]] = {}
    buffers: List[fx.Node] = []

    def arg(x: fx.Node):
        if x.op == "get_attr":
            if x.target not in attrs:
                attrs[x.target] = g.get_attr(x.target)
            return attrs[x.target]
        return env[x]

    if s == 0:
        for p in split.inputs:
            env[p] = g.node_copy(p, arg)
    else:
        for v in split.live[s - 1]:
            phs = [g.placeholder(f"{v.name}_{i}") for i in range(len(_leaves_of(split.structure[v])))]
            received[v] = phs
            buffers.extend(phs)
        if s > 1:
            buffers.append(g.placeholder("_pipeline_anchor"))
        for v, phs in received.items():
            if any(split.stage_of.get(u, split.n_stages - 1) == s for u in v.users):
                env[v] = _rebuild(g, split.structure[v], iter(phs))
    for n in split.order:
        if split.stage_of[n] == s and n.op != "placeholder":
            env[n] = g.node_copy(n, arg)
    if last:
        out = env[split.output]
        if buffers:
            out = g.call_function(_anchor_output, (out, *buffers))
        g.output(out)
        return g
    leaves: List[fx.Node] = []
    boundary = split.cut_nodes[s].target
    for v in split.live[s]:
        if v in received:
            leaves.extend(g.call_function(_relay, (ph,)) for ph in received[v])
            continue
        for node, _ in _emit(g, split.structure[v], env[v], device, v.name, f"(computed by {_describe(v)}), "
                             f"sent after '{boundary}',"):
            leaves.append(node)
    if buffers:
        leaves.append(g.call_function(_anchor_scalar, tuple(buffers)))
    g.output(tuple(leaves))
    return g


def _emit(g: fx.Graph, structure, value, device, label: str, context: str):
    """(node, leaf) for every tensor sent for ``value``."""
    if isinstance(structure, _Leaf):
        where = f"the value '{label}' {context}"
        if structure.kind == "grad":
            yield g.call_function(_send_grad_value, (value, where)), structure
        elif structure.kind == "plain":
            yield g.call_function(_send_plain_value, (value, device, where)), structure
        else:
            yield g.call_function(_send_number, (value, device, where)), structure
        return
    if structure[0] == "seq":
        for i, child in enumerate(structure[2]):
            item = g.call_function(_getitem, (value, i))
            yield from _emit(g, child, item, device, f"{label}[{i}]", context)


def _getitem(value, index):
    return value[index]


def _rebuild(g: fx.Graph, structure, phs):
    if isinstance(structure, _Leaf):
        ph = next(phs)
        if structure.kind == "grad":
            return ph
        if structure.kind == "plain":
            return g.call_function(_recv_plain_value, (ph, structure.info))
        return g.call_function(_recv_number, (ph, structure.info))
    if structure[0] == "seq":
        items = [_rebuild(g, child, phs) for child in structure[2]]
        make = {tuple: _make_tuple, list: _make_list, torch.Size: _make_size}[structure[1]]
        return g.call_function(make, tuple(items))
    return structure[1]


def _stage_module(split: _Split, model: nn.Module, s: int, device: torch.device) -> fx.GraphModule:
    graph = _stage_graph(split, s, device)
    root: Dict[str, Any] = {}
    for node in graph.nodes:
        if node.op in ("get_attr", "call_module"):
            root[node.target] = _resolve(split.gm, model, node.target)
    stage = fx.GraphModule(root, graph, class_name="StageModule")
    for node in graph.nodes:
        if node.op == "get_attr" and isinstance(root[node.target], torch.Tensor):
            owner_path, _, name = node.target.rpartition(".")
            owner = stage.get_submodule(owner_path)
            if name in owner._buffers and not _persistent(model, node.target):
                owner._non_persistent_buffers_set.add(name)
    _restore_containers(stage, model)
    stage._schedlang_stage_index = s
    return stage


def _resolve(gm: fx.GraphModule, model: nn.Module, target: str) -> Any:
    try:
        return _lookup(model, target)
    except AttributeError:
        return _lookup(gm, target)  # a constant the tracer made (a config object, a literal tensor)


def _persistent(model: nn.Module, target: str) -> bool:
    owner_path, _, name = target.rpartition(".")
    try:
        owner = model.get_submodule(owner_path) if owner_path else model
    except AttributeError:
        return False
    if name in owner._parameters:
        return True
    return name in owner._buffers and name not in owner._non_persistent_buffers_set


def _restore_containers(stage: nn.Module, model: nn.Module) -> None:
    """Intermediate modules FX made plain get their container type back (``model.layers`` stays a
    ``ModuleList``, holding this stage's layers under their original indices)."""
    paths = sorted((p for p, _ in stage.named_modules() if p), key=lambda p: -p.count("."))
    for path in paths:
        new = stage.get_submodule(path)
        if type(new) is not nn.Module or new._parameters or new._buffers:
            continue
        try:
            orig = model.get_submodule(path)
        except AttributeError:
            continue
        for kind in (nn.ModuleList, nn.ModuleDict, nn.Sequential):
            if isinstance(orig, kind):
                container = kind()
                for key in orig._modules:
                    if key in new._modules:
                        container.add_module(key, new._modules[key])
                parent_path, _, name = path.rpartition(".")
                parent = stage.get_submodule(parent_path) if parent_path else stage
                parent._modules[name] = container
                break


def _attach_unused_state(stages: List[fx.GraphModule], model: nn.Module, enclosing: Sequence[str]) -> None:
    """Tensors no stage's code uses (a module the forward never calls) go to stage 0, so that the
    stages' state dicts together still hold every tensor of the model."""
    held = set()
    for stage in stages:
        held.update(id(t) for t in stage.parameters())
        held.update(id(t) for t in stage.buffers())
    inner = set(enclosing) | {""}
    first = stages[0]
    for owner_path, module in model.named_modules():
        for store, is_param in ((module._parameters, True), (module._buffers, False)):
            for name, t in store.items():
                if t is None or id(t) in held:
                    continue
                path = f"{owner_path}.{name}" if owner_path else name
                # the outermost module below the traced-through ones that owns it moves as a whole
                parts = owner_path.split(".") if owner_path else []
                for k in range(len(parts) + 1):
                    prefix = ".".join(parts[:k])
                    if prefix not in inner:
                        break
                else:
                    prefix = None
                if prefix is not None and prefix not in inner:
                    sub = model.get_submodule(prefix)
                    _place(first, prefix, sub)
                    held.update(id(x) for x in sub.parameters())
                    held.update(id(x) for x in sub.buffers())
                    logger.info("%s: not used by the forward; kept by pipeline stage 0", prefix)
                else:
                    owner = _ensure_path(first, owner_path)
                    if is_param:
                        owner.register_parameter(name, t)
                    else:
                        owner.register_buffer(name, t, persistent=name not in module._non_persistent_buffers_set)
                    held.add(id(t))
                    logger.info("%s: not used by the forward; kept by pipeline stage 0", path)


def _ensure_path(root: nn.Module, path: str) -> nn.Module:
    module = root
    for part in path.split(".") if path else ():
        if part not in module._modules:
            module.add_module(part, nn.Module())
        module = module._modules[part]
    return module


def _place(root: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    _ensure_path(root, parent_path)._modules[name] = module


def _check_cut_paths(model: nn.Module, cut_paths: Sequence[str]) -> List[str]:
    if isinstance(cut_paths, str) or not isinstance(cut_paths, (list, tuple)):
        raise PipelineError(f"cut_paths must be a list of module paths, got {cut_paths!r}")
    if not cut_paths:
        raise PipelineError("no pipeline stage is cut: mark boundaries with sch[path].cut_pipeline_stage()")
    seen = set()
    for path in cut_paths:
        if not isinstance(path, str) or not path:
            raise PipelineError(f"{path!r}: a cut must name a submodule (the root cannot end a stage)")
        if path in seen:
            raise PipelineError(f"{path}: cut twice; each module can end one pipeline stage")
        seen.add(path)
        try:
            model.get_submodule(path)
        except AttributeError:
            raise PipelineError(f"{path}: no such submodule in {type(model).__name__} to end a pipeline stage "
                                "after") from None
    return list(cut_paths)


def split_model(model: nn.Module, cut_paths: Sequence[str], device: Optional[torch.device] = None,
                example_inputs: Optional[Sequence[Any]] = None) -> List[fx.GraphModule]:
    """All stage modules of ``model`` cut after ``cut_paths`` (see the module docstring), in order.

    Stage 0 takes the model's inputs; stage ``k`` takes the tensors stage ``k - 1`` returns (a
    tuple); the last returns the output tensor. ``example_inputs`` (only their shapes and dtypes
    count) tell what crosses the cuts of a model that is not a transformers model; without them
    that is checked when the stages run. Running the stages in a chain computes the model::

        stages = split_model(model, ["model.layers.1"])
        logits = stages[1](*stages[0](input_ids))
    """
    cut_paths = _check_cut_paths(model, cut_paths)
    if device is None:
        device = next((t.device for t in model.parameters()), torch.device("cpu"))
    split = _partition(model, cut_paths, example_inputs)
    stages = [_stage_module(split, model, s, device) for s in range(split.n_stages)]
    _attach_unused_state(stages, model, _enclosing_paths(cut_paths))
    return stages


# ------------------------------------------------------------------------------------------------ options and layout
def _check_options(options: Any) -> Dict[str, Any]:
    if not isinstance(options, dict):
        raise PipelineError(f"pipeline options must be a dict {{'schedule': ..., 'n_microbatches': N, 'loss_fn': fn}}, "
                            f"got {options!r}")
    unknown = sorted(set(options) - set(_OPTION_KEYS))
    if unknown:
        raise PipelineError(f"unknown pipeline option(s) {', '.join(map(repr, unknown))}: valid options are "
                            f"{', '.join(map(repr, _OPTION_KEYS))}")
    schedule = options.get("schedule", "1F1B")
    if schedule not in SCHEDULES:
        raise PipelineError(f"unknown pipeline schedule {schedule!r}: valid schedules are "
                            f"{', '.join(map(repr, SCHEDULES))}")
    n = options.get("n_microbatches")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise PipelineError(f"pipeline option 'n_microbatches' must be a positive int, got {n!r}")
    loss_fn = options.get("loss_fn")
    if not callable(loss_fn):
        raise PipelineError(f"pipeline option 'loss_fn' must be a callable fn(output, target) -> scalar loss, got "
                            f"{loss_fn!r}")
    examples = options.get("example_inputs")
    if examples is not None and (isinstance(examples, torch.Tensor) or not isinstance(examples, (tuple, list))):
        raise PipelineError(f"pipeline option 'example_inputs' must be a tuple of example model inputs, got "
                            f"{type(examples).__name__}")
    return {"schedule": schedule, "n_microbatches": n, "loss_fn": loss_fn, "example_inputs": examples}


def _check_layout(n_stages: int, pp_size: int, opts: Dict[str, Any], cut_paths: Sequence[str]) -> int:
    schedule, n = opts["schedule"], opts["n_microbatches"]
    cuts = f"{len(cut_paths)} cut{'s' if len(cut_paths) != 1 else ''} ({', '.join(cut_paths)}) make {n_stages} stages"
    if n_stages % pp_size:
        raise PipelineError(f"{cuts}, which do not divide over the {pp_size} pp ranks: every rank must hold the same "
                            f"number of stages; cut {pp_size - 1} times for one stage per rank, {2 * pp_size - 1} "
                            "for two")
    per_rank = n_stages // pp_size
    if schedule not in _MULTI_STAGE and per_rank != 1:
        raise PipelineError(f"{cuts} for {pp_size} pp ranks ({per_rank} per rank), but the {schedule} schedule runs "
                            f"one stage per rank: cut {pp_size - 1} time(s), or use a multi-stage schedule "
                            f"({', '.join(_MULTI_STAGE)})")
    if schedule in _MULTI_STAGE and per_rank < 2:
        raise PipelineError(f"{cuts} for {pp_size} pp ranks (1 per rank), but the {schedule} schedule interleaves "
                            f"several stages per rank: cut {2 * pp_size - 1} times (2 stages per rank), or use "
                            "1F1B or GPipe")
    if schedule == "1F1B" and n < n_stages:
        raise PipelineError(f"the 1F1B schedule needs at least as many microbatches as stages: n_microbatches={n} < "
                            f"{n_stages} stages")
    if schedule in _MULTI_STAGE:
        rounds = max(1, n // pp_size)
        if n % rounds:
            raise PipelineError(f"the {schedule} schedule runs microbatches in rounds of the {pp_size} pp ranks: "
                                f"n_microbatches={n} must be a multiple of {rounds} (use a multiple of {pp_size})")
    return per_rank


def _pp_group(pp_group_or_mesh):
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise PipelineError("pipeline stages need torch.distributed to be initialized (one process per pp rank, e.g. "
                            "under torchrun)")
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover
        DeviceMesh = ()
    if DeviceMesh and isinstance(pp_group_or_mesh, DeviceMesh):
        if pp_group_or_mesh.ndim != 1:
            raise PipelineError(f"the pipeline mesh must be 1-D (the 'pp' dimension), got dimensions "
                                f"{pp_group_or_mesh.mesh_dim_names}")
        group = pp_group_or_mesh.get_group()
    elif pp_group_or_mesh is None:
        group = dist.group.WORLD
    elif isinstance(pp_group_or_mesh, dist.ProcessGroup):
        group = pp_group_or_mesh
    else:
        raise PipelineError(f"the pp ranks must be given as a 1-D DeviceMesh or a ProcessGroup, got "
                            f"{type(pp_group_or_mesh).__name__}")
    return group, dist.get_rank(group), dist.get_world_size(group)


# ------------------------------------------------------------------------------------------------ the model
@dataclasses.dataclass
class _Tied:
    names: List[str]          # every name under which some stage holds it, in stage order
    param: Optional[nn.Parameter]  # this rank's copy, or None
    holders: List[int]        # pp ranks holding a copy, ascending


def _tied_parameters(stages: List[nn.Module], rank_of_stage: Callable[[int], int]) -> List[_Tied]:
    by_id: Dict[int, Dict[int, Tuple[str, nn.Parameter]]] = {}
    for s, stage in enumerate(stages):
        for name, p in stage.named_parameters(remove_duplicate=False):
            by_id.setdefault(id(p), {}).setdefault(s, (name, p))
    tied = []
    for per_stage in by_id.values():
        if len(per_stage) < 2:
            continue
        names = [per_stage[s][0] for s in sorted(per_stage)]
        holders = sorted({rank_of_stage(s) for s in per_stage})
        param = next(iter(per_stage.values()))[1]
        tied.append(_Tied(names, param, holders))
    tied.sort(key=lambda t: t.names[0])
    return tied


def _local(t: torch.Tensor) -> torch.Tensor:
    from .dtensor_params import local_tensor

    return local_tensor(t)


def _like(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a tensor placed like ``p`` (a DTensor with ``p``'s placement, or plain)."""
    from .dtensor_params import is_dtensor

    if not is_dtensor(p):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def _exchange(tensor: torch.Tensor, holders: List[int], me: int, group) -> List[torch.Tensor]:
    """Every holder's copy of ``tensor`` (this rank's own at its place), by point-to-point over ``group``."""
    import torch.distributed as dist

    peers = [r for r in holders if r != me]
    received = {r: torch.empty_like(tensor) for r in peers}
    ops = []
    for r in peers:
        peer = dist.get_global_rank(group, r)
        ops.append(dist.P2POp(dist.isend, tensor, peer, group))
        ops.append(dist.P2POp(dist.irecv, received[r], peer, group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return [tensor if r == me else received[r] for r in holders]


class PipelinedModel(nn.Module):
    """This rank's pipeline stages and the torch schedule that runs them.

    ``stage_modules`` (an ``nn.ModuleList``) holds this rank's stage modules, each keeping the
    original model's names for its tensors; ``stages`` the ``PipelineStage`` objects and
    ``schedule`` the torch schedule. Train with :meth:`step`; calling the model directly is an
    error (a pipeline needs every pp rank to take part).

    Example::

        losses = []
        out = model.step(input_ids, target=labels, losses=losses)   # logits on the last stage, else None
        optimizer.step(); optimizer.zero_grad()
    """

    def __init__(self, stage_modules: Sequence[nn.Module], stages: Sequence[Any], schedule: Any,
                 stage_indices: Sequence[int], n_stages: int, group, pp_rank: int, pp_size: int,
                 schedule_name: str, n_microbatches: int, tied: Sequence[_Tied]):
        super().__init__()
        self.stage_modules = nn.ModuleList(stage_modules)
        self.stages = list(stages)
        self.schedule = schedule
        self.stage_indices = list(stage_indices)
        self.n_stages = n_stages
        self.pp_group = group
        self.pp_rank = pp_rank
        self.pp_size = pp_size
        self.schedule_name = schedule_name
        self.n_microbatches = n_microbatches
        self._tied = list(tied)

    @property
    def is_first(self) -> bool:
        """Whether this rank holds the first stage (it takes the inputs)."""
        return 0 in self.stage_indices

    @property
    def is_last(self) -> bool:
        """Whether this rank holds the last stage (it computes the loss and returns the output)."""
        return self.n_stages - 1 in self.stage_indices

    def forward(self, *args, **kwargs):
        raise PipelineError("a PipelinedModel cannot be called like the model: every pp rank must take part in each "
                            "step; use model.step(inputs, target=labels, losses=[]) on every rank")

    def step(self, *inputs, target=None, losses: Optional[list] = None):
        """One schedule step over a full batch: forward and backward of every microbatch.

        ``inputs`` go to the first stage (split into ``n_microbatches`` along dim 0; other ranks
        may pass them or not), ``target`` to the last stage's ``loss_fn``; the last stage appends
        one loss per microbatch to ``losses``. Gradients end up as the gradient of the mean loss
        over the full batch (see the module docstring). Returns the last stage's output (the
        microbatch outputs concatenated) on the rank holding it, else None.
        """
        if self.is_first:
            if not inputs:
                raise PipelineError(f"pp rank {self.pp_rank} holds the first pipeline stage: step() needs the model "
                                    "inputs, e.g. model.step(input_ids, target=labels)")
            for i, x in enumerate(inputs):
                if isinstance(x, torch.Tensor) and (x.dim() == 0 or x.shape[0] % self.n_microbatches):
                    raise PipelineError(f"input {i} has shape {tuple(x.shape)}: its batch dimension (dim 0) must "
                                        f"divide into n_microbatches={self.n_microbatches} equal microbatches")
        if self.is_last:
            if target is None:
                raise PipelineError(f"pp rank {self.pp_rank} holds the last pipeline stage: step() needs target= for "
                                    "the loss")
            if isinstance(target, torch.Tensor) and (target.dim() == 0 or target.shape[0] % self.n_microbatches):
                raise PipelineError(f"target has shape {tuple(target.shape)}: its batch dimension (dim 0) must "
                                    f"divide into n_microbatches={self.n_microbatches} equal microbatches")
        if losses is not None and not isinstance(losses, list):
            raise PipelineError(f"losses must be a list (the last stage appends one loss per microbatch), got "
                                f"{type(losses).__name__}")
        # torch 2.11 checks every microbatch against the first one's strides: hand it contiguous inputs
        args = tuple(x.contiguous() if isinstance(x, torch.Tensor) else x for x in inputs) if self.is_first else ()
        out = self.schedule.step(*args, target=target if self.is_last else None,
                                 losses=losses if self.is_last else None)
        self._finish_gradients()
        return out if self.is_last else None

    @torch.no_grad()
    def _finish_gradients(self) -> None:
        seen = set()
        for module in self.stage_modules:
            for p in module.parameters():
                if id(p) in seen or p.grad is None:
                    continue
                seen.add(id(p))
                p.grad.div_(self.n_microbatches)
        for tied in self._tied:
            p = tied.param
            if p is None:
                continue
            grad = _local(p.grad) if p.grad is not None else torch.zeros_like(_local(p))
            copies = _exchange(grad.contiguous(), tied.holders, self.pp_rank, self.pp_group)
            total = copies[0].clone()
            for c in copies[1:]:
                total.add_(c)
            if p.grad is None:
                p.grad = _like(p, total)
            else:
                _local(p.grad).copy_(total)

    def __repr__(self) -> str:
        lines = [f"PipelinedModel(schedule={self.schedule_name}, n_microbatches={self.n_microbatches}, "
                 f"pp_rank={self.pp_rank}/{self.pp_size}, stages={self.stage_indices} of {self.n_stages}"]
        for index, module in zip(self.stage_indices, self.stage_modules):
            top = [n for n, _ in module.named_children() if not n.startswith("_schedlang_const")]
            n_params = sum(p.numel() for p in module.parameters())
            lines.append(f"  stage {index}: {', '.join(top) or 'no submodules'} ({n_params} parameters)")
        if self._tied:
            lines.append("  tied: " + "; ".join(" = ".join(t.names) + f" on pp ranks {t.holders}" for t in self._tied))
        return "\n".join(lines) + "\n)"


def _schedule(name: str, stages: List[Any], n: int, loss_fn: Callable):
    from torch.distributed import pipelining as pp

    def loss(output, target):
        value = loss_fn(output, target)
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            raise PipelineError(f"loss_fn must return a scalar tensor, got {_kind_of(value)}")
        return value

    if name == "GPipe":
        return pp.ScheduleGPipe(stages[0], n, loss_fn=loss, scale_grads=False)
    if name == "1F1B":
        return pp.Schedule1F1B(stages[0], n, loss_fn=loss, scale_grads=False)
    if name == "Interleaved1F1B":
        return pp.ScheduleInterleaved1F1B(stages, n, loss_fn=loss, scale_grads=False)
    return pp.ScheduleInterleavedZeroBubble(stages, n, loss_fn=loss, scale_grads=False)


def _data_parallel_wrapped(module: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return False
    if isinstance(module, FSDPModule):
        return True
    try:  # the composable replicate (DDP) keeps its state in a registry
        from torch.distributed._composable_state import _get_module_state
    except ImportError:  # pragma: no cover
        return False
    return _get_module_state(module) is not None


def _check_prepared_stage(stage: nn.Module, index: int, enclosing: Sequence[str], schedule: str) -> None:
    """What ``prepare_stage`` did must still work in a stage."""
    for path in enclosing:
        try:
            module = stage.get_submodule(path)
        except AttributeError:
            continue
        if _data_parallel_wrapped(module):
            raise PipelineError(f"{path}: this module encloses a pipeline cut, so its forward is split across stages "
                                "and never called as a whole; data parallelism (fully_shard / replicate) on it would "
                                "never gather or reduce anything: apply it to its layers and to the root instead")
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        FSDPModule = ()
    if schedule == "ZeroBubble" and FSDPModule and any(isinstance(m, FSDPModule) for m in stage.modules()):
        # measured (torch 2.13, gloo): the losses of later steps drift from one process, while
        # ZeroBubble alone, ZeroBubble with replicate, and Interleaved1F1B with fully_shard agree
        raise PipelineError(f"stage {index}: the ZeroBubble schedule computes weight gradients apart from input "
                            "gradients, which FSDP2 (fully_shard) does not reduce correctly here; use Interleaved1F1B "
                            "with fully_shard, or replicate with ZeroBubble")


def build_pipeline(model: nn.Module, cut_paths: Sequence[str], pp_group_or_mesh, options: dict,
                   device: torch.device, prepare_stage: Optional[Callable[[nn.Module], None]] = None
                   ) -> PipelinedModel:
    """Split ``model`` after ``cut_paths`` and run this rank's stages with torch's pipeline schedules.

    ``cut_paths``: the plan's ``cut_pipeline_stage`` paths (any order; sorted by execution
    order); ``n`` cuts make ``n + 1`` stages, spread over the ``P`` ranks of ``pp_group_or_mesh``
    (a 1-D ``DeviceMesh`` or a ``ProcessGroup``; None: the world) in loops: stage ``s`` on rank
    ``s % P``. ``options``: ``{"schedule": "1F1B" | "GPipe" | "Interleaved1F1B" | "ZeroBubble",
    "n_microbatches": N, "loss_fn": fn(output, target) -> scalar}``, optionally ``"example_inputs"``
    (a tuple like the model's inputs, for models other than transformers). ``device``: where the model
    and its stages live. ``prepare_stage(stage_module)`` runs on each local stage module after
    the split and before its ``PipelineStage`` is made (data parallelism goes here).

    Every rank must call this with the same model structure and arguments.

    Example::

        pipe = build_pipeline(model, ["model.layers.1"], dist.group.WORLD,
                              {"schedule": "GPipe", "n_microbatches": 4, "loss_fn": loss_fn},
                              torch.device("cpu"))
        pipe.step(input_ids, target=labels, losses=losses)
    """
    from torch.distributed.pipelining import PipelineStage

    opts = _check_options(options)
    cut_paths = _check_cut_paths(model, cut_paths)
    group, pp_rank, pp_size = _pp_group(pp_group_or_mesh)
    n_stages = len(cut_paths) + 1
    _check_layout(n_stages, pp_size, opts, cut_paths)
    device = torch.device(device)
    split = _partition(model, cut_paths, opts["example_inputs"])
    order = [n.target for n in split.cut_nodes]
    all_stages = [_stage_module(split, model, s, device) for s in range(n_stages)]
    enclosing = _enclosing_paths(cut_paths)
    _attach_unused_state(all_stages, model, enclosing)
    local = [s for s in range(n_stages) if s % pp_size == pp_rank]
    tied = _tied_parameters(all_stages, lambda s: s % pp_size)
    kept = {id(p) for s in local for p in all_stages[s].parameters()}
    my_tied = []
    for t in tied:
        if pp_rank not in t.holders:
            continue
        mine = t.param if id(t.param) in kept else None
        my_tied.append(_Tied(t.names, mine, t.holders))
        if len(t.holders) > 1:
            with torch.no_grad():  # the copies start from the lowest holder's values
                value = _local(mine.data).contiguous()
                copies = _exchange(value, t.holders, pp_rank, group)
                if copies[0] is not value:
                    _local(mine.data).copy_(copies[0])
            logger.info("tied parameter %s held by pp ranks %s: gradients are summed every step",
                        " = ".join(t.names), t.holders)
    my_tied = [t for t in my_tied if len(t.holders) > 1]
    modules, stages = [], []
    for s in local:
        module = all_stages[s]
        if prepare_stage is not None:
            prepare_stage(module)
            _check_prepared_stage(module, s, enclosing, opts["schedule"])
        modules.append(module)
        stages.append(PipelineStage(module, s, n_stages, device, group=group))
    schedule = _schedule(opts["schedule"], stages, opts["n_microbatches"], opts["loss_fn"])
    logger.info("pp rank %d/%d: stages %s of %d (cuts after %s), %s with %d microbatches", pp_rank, pp_size, local,
                n_stages, ", ".join(order), opts["schedule"], opts["n_microbatches"])
    return PipelinedModel(modules, stages, schedule, local, n_stages, group, pp_rank, pp_size, opts["schedule"],
                          opts["n_microbatches"], my_tied)
