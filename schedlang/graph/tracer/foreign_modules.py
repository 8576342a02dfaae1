"""Modules a traced forward calls but does not own.

A forward may call an ``nn.Module`` object that is no submodule of the module being traced: one held in a
global or a closure, or in a plain attribute that ``nn.Module`` does not register. transformers does this
when the ``kernels`` package is installed: ``use_kernel_forward_from_hub`` turns a function such as
``apply_rotary_pos_emb`` into a module-level ``nn.Module`` instance, and ``use_kernelized_func`` gives each
attention module private copies of it, kept out of ``_modules`` on purpose. Such a module has no path in the
traced module, so it cannot be a ``call_module`` node. The tracer traces through its forward when it can (the
graph then shows the operations, which ``find`` and ``fuse`` can match) and otherwise records one
``call_function`` node of :class:`OpaqueModuleCall`, which calls the very same object when the graph runs.
"""

from __future__ import annotations

import copy
import re
from typing import Any, Dict, List, Tuple

import torch.fx as fx
from torch import nn


class OpaqueModuleCall:
    """The ``call_function`` target that calls a module the traced module does not own.

    Equal (and equally named) for the same module object, so two traces of one forward give equal graphs.
    Deep copies of a graph share the module, as copies of the caller share a global or a closure.
    """

    def __init__(self, module: nn.Module):
        self.module = module
        kind = re.sub(r"\W", "_", type(module).__name__)
        # a name and a module of its own, as FX's code generation names a call_function target by them
        self.__name__ = self.__qualname__ = f"opaque_{kind}"
        self.__module__ = __name__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OpaqueModuleCall) and other.module is self.module

    def __hash__(self) -> int:
        return id(self.module)

    def __deepcopy__(self, memo: Dict[int, Any]) -> "OpaqueModuleCall":
        return self

    def __repr__(self) -> str:
        return f"OpaqueModuleCall({type(self.module).__qualname__} at {id(self.module):#x})"


def owns_state(module: nn.Module) -> bool:
    """Whether ``module`` holds parameters or buffers. Traced through, they would become constants of the
    traced module (its parameters, in its ``state_dict``); called opaquely they stay where eager keeps them."""
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


class GraphMark:
    """A point in a graph being traced, to go back to: the nodes added after it are erased and the names they took
    are free again (a forward traced to compare and then traced for good keeps the names a single trace gives)."""

    def __init__(self, graph: fx.Graph):
        self.graph = graph
        self.last = graph._root.prev  # the root sentinel when the graph is empty
        namespace = graph._graph_namespace
        self.names = {key: copy.copy(value) for key, value in vars(namespace).items()}

    def nodes_after(self) -> List[fx.Node]:
        nodes = []
        node = self.last.next
        while node is not self.graph._root:
            nodes.append(node)
            node = node.next
        return nodes

    def rewind(self, metas: Dict[fx.Node, Any]) -> None:
        for node in reversed(self.nodes_after()):
            metas.pop(node, None)
            self.graph.erase_node(node)
        vars(self.graph._graph_namespace).update({key: copy.copy(value) for key, value in self.names.items()})


def node_codes(nodes: List[fx.Node]) -> List[Tuple[str, str, str, str]]:
    """What ``nodes`` compute, with the nodes among them named by position: the same code for two traces of one
    forward, whatever names the graph gave their nodes."""
    position = {node: i for i, node in enumerate(nodes)}

    def ref(node: fx.Node) -> Any:
        return f"%{position[node]}" if node in position else node.name

    return [(n.op, str(n.target), repr(fx.node.map_arg(n.args, ref)), repr(fx.node.map_arg(n.kwargs, ref)))
            for n in nodes]
