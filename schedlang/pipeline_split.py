"""Split a model traced level by level (``trace_until``) into pipeline stages, as Slapo does.

Every cut is a ``call_module`` node in the graph of its nearest traced ancestor. Starting at the
root, the graph of each traced module that holds cuts (itself or below) is split with
``torch.fx.passes.split_module``: its nodes get stage ids in graph order, a cut ending a stage.
A traced child holding cuts is split first, with stage ids continuing the parent's, and its
pieces (``submod_<stage>``) take its place in the parent's graph; its last piece runs on in the
stage that follows it unless the child itself is cut. The root's split gives the stages.

The model's working graphs are not changed: each split level works on a copy of its graph, and
the leaf modules (the parameters) are shared with the schedule's model.
"""

from __future__ import annotations

import copy
import operator
from typing import Any, Dict, List, Sequence, Set, Tuple

from torch import fx, nn
from torch.fx.passes.split_module import split_module

from .errors import PipelineError

__all__ = ["split_traced"]


def _traced_owner(root: fx.GraphModule, cut: str) -> Tuple[str, str]:
    """``(owner path, target)``: the nearest traced ancestor of ``cut`` whose graph calls it, and the
    call's target there."""
    parts = cut.split(".")
    for k in range(len(parts) - 1, -1, -1):
        owner = ".".join(parts[:k])
        try:
            module = root.get_submodule(owner) if owner else root
        except AttributeError:
            continue
        if not isinstance(module, fx.GraphModule):
            continue
        target = ".".join(parts[k:])
        if any(n.op == "call_module" and n.target == target for n in module.graph.nodes):
            return owner, target
    raise PipelineError(f"{cut}: cut_pipeline_stage() marks a module that no traced graph calls; trace the model "
                        f"down to its parent first (sch.trace_until('{cut.rpartition('.')[0]}'))")


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class _Splitter:
    def __init__(self, root: fx.GraphModule, cuts: Sequence[str]):
        self.root = root
        #: owner path -> targets cut in its graph
        self.cut_targets: Dict[str, Set[str]] = {}
        for cut in cuts:
            owner, target = _traced_owner(root, cut)
            self.cut_targets.setdefault(owner, set()).add(target)

    def holds_cuts(self, path: str) -> bool:
        return any(owner == path or owner.startswith(path + ".") for owner in self.cut_targets) if path else True

    def split(self, path: str, gm: fx.GraphModule, start: int) -> Tuple[fx.GraphModule, int]:
        """``gm`` (at ``path``) split into pieces ``submod_<stage>``, stages from ``start``; returns the
        split module and the stage of what follows it (its last piece's, plus one if its last call is cut)."""
        if gm._forward_pre_hooks or gm._forward_hooks:
            raise PipelineError(f"{path or '<root>'}: a traced module holding pipeline cuts has forward hooks, which "
                                "splitting it would drop; move the hooks (e.g. a sync) to a module inside a stage")
        graph = copy.deepcopy(gm.graph)
        work = fx.GraphModule(gm, graph)
        cut = self.cut_targets.get(path, set())
        stage_of: Dict[fx.Node, int] = {}
        stage = start
        for node in list(graph.nodes):
            if node.op in ("placeholder", "output"):
                continue
            child_path = _join(path, node.target) if node.op == "call_module" else None
            child = work.get_submodule(node.target) if child_path is not None else None
            if isinstance(child, fx.GraphModule) and self.holds_cuts(child_path):
                pieces, last = self.split(child_path, child, stage)
                for new, piece_stage in _inline(work, node, pieces, child, child_path, stage):
                    stage_of[new] = piece_stage
                stage = last
            else:
                stage_of[node] = stage
            if node.op == "call_module" and node.target in cut:
                stage += 1
        split = split_module(work, None, lambda n: stage_of[n], keep_original_order=True)
        split.graph.eliminate_dead_code()
        split.delete_all_unused_submodules()
        split.recompile()
        return split, stage


def _bind(call: fx.Node, pieces: fx.GraphModule, original: fx.GraphModule, child_path: str) -> Dict[fx.Node, Any]:
    """The value each placeholder of ``pieces`` takes at ``call``: positional, by name, collected
    into ``*args`` / ``**kwargs``, or its default."""
    placeholders = [n for n in pieces.graph.nodes if n.op == "placeholder"]
    positional = [p for p in placeholders if not p.target.startswith("*")]
    var_args = next((p for p in placeholders if p.target.startswith("*") and not p.target.startswith("**")), None)
    var_kwargs = next((p for p in placeholders if p.target.startswith("**")), None)
    env: Dict[fx.Node, Any] = {}
    if len(call.args) > len(positional) and var_args is None:
        raise PipelineError(f"{child_path}: called with {len(call.args)} positional arguments but its graph takes "
                            f"{len(positional)}; valid calls pass at most {len(positional)}")
    for p, value in zip(positional, call.args):
        env[p] = value
    if var_args is not None:
        env[var_args] = tuple(call.args[len(positional):])
    by_name = {p.target: p for p in positional}
    rest = {}
    for name, value in call.kwargs.items():
        if name in by_name:
            env[by_name[name]] = value
        else:
            rest[name] = value
    if var_kwargs is not None:
        env[var_kwargs] = rest
    # without **kwargs, a keyword the graph does not take was specialized when tracing: its value is in the graph
    defaults = {p.target: p.args for p in original.graph.nodes if p.op == "placeholder"}
    for p in positional:
        if p not in env:
            default = p.args or defaults.get(p.target, ())
            if not default:
                raise PipelineError(f"{child_path}: its input '{p.target}' gets no value from the call in its "
                                    f"parent's graph; valid calls pass every input without a default")
            env[p] = default[0]
    return env


def _inline(work: fx.GraphModule, call: fx.Node, pieces: fx.GraphModule, original: fx.GraphModule,
            child_path: str, first_stage: int) -> List[Tuple[fx.Node, int]]:
    """Replace ``call`` in ``work``'s graph by the graph of ``pieces`` (its submodules moved into
    ``work`` under their names); returns each new node with its stage."""
    graph = work.graph
    env = _bind(call, pieces, original, child_path)
    new_nodes: List[Tuple[fx.Node, int]] = []
    stage = first_stage
    output: Any = None
    with graph.inserting_before(call):
        for node in pieces.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                output = fx.node.map_arg(node.args[0], lambda n: env[n])
                continue
            if node.op in ("call_module", "get_attr"):
                _adopt(work, node.target, pieces, child_path)
            if node.op == "call_module":
                stage = int(node.target.rpartition("_")[2])
            new = graph.node_copy(node, lambda n: env[n])
            env[node] = new
            new_nodes.append((new, stage))
    if isinstance(output, fx.Node):
        call.replace_all_uses_with(output)
    else:
        for user in list(call.users):
            if user.op == "call_function" and user.target is operator.getitem and isinstance(
                    user.args[1], (int, str)) and not isinstance(output, (str, bytes)):
                user.replace_all_uses_with(output[user.args[1]])
                graph.erase_node(user)
        if call.users:
            with graph.inserting_before(call):
                packed = graph.call_function(_same, (output,))
            new_nodes.append((packed, stage))
            call.replace_all_uses_with(packed)
    graph.erase_node(call)
    return new_nodes


def _same(value):
    """The value itself: gives a tuple or dict that a split module returns one node in its parent."""
    return value


def _lookup(root: nn.Module, target: str) -> Any:
    value: Any = root
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _adopt(work: fx.GraphModule, target: str, pieces: fx.GraphModule, child_path: str) -> None:
    """Put the attribute ``target`` of ``pieces`` (a piece, or a constant its graph reads) into ``work``."""
    value = _lookup(pieces, target)
    try:
        existing = _lookup(work, target)
    except AttributeError:
        existing = None
    if existing is not None and existing is not value:
        raise PipelineError(f"{child_path}: its split piece '{target}' clashes with an attribute of the same name in "
                            "its parent; rename that attribute (the split names its pieces submod_<stage>)")
    if existing is None:
        owner_path, _, name = target.rpartition(".")
        owner = work
        for part in owner_path.split(".") if owner_path else ():
            if not hasattr(owner, part):
                owner.add_module(part, nn.Module())
            owner = getattr(owner, part)
        if isinstance(value, nn.Module):
            owner.add_module(name, value)
        else:
            setattr(owner, name, value)


def split_traced(root: fx.GraphModule, cuts: Sequence[str]) -> fx.GraphModule:
    """``root`` (a traced model) split after ``cuts``: a ``GraphModule`` whose children ``submod_0``
    ... are the stages."""
    splitter = _Splitter(root, cuts)
    split, _ = splitter.split("", root, 0)
    return split
