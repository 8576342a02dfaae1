"""Graph-level scheduling: hierarchy-keeping tracing, pattern matching, subgraph rewrites.

* :mod:`~schedlang.graph.tracer` - ``trace_module``: FX graphs of one submodule, children
  kept as their own graphs, working on transformers 5.x models;
* :mod:`~schedlang.graph.pattern` - ``find_nodes`` (regex over module names) and
  ``find_subgraphs`` (pattern functions matched by dataflow), ``call_module``;
* :mod:`~schedlang.graph.subgraph` - check, replace, fuse and checkpoint found subgraphs,
  and encode them for plans;
* :mod:`~schedlang.graph.passes` - horizontal-fusion rules.

Example::

    from schedlang.graph import trace_module, find_subgraphs
    gm = trace_module(mlp, flatten=True)
    print(find_subgraphs(gm, lambda x, b: F.gelu(x + b)))
"""

from .pattern import call_module, find_nodes, find_subgraphs, graph_modules, trace_pattern
from .subgraph import (CheckpointedSubgraph, checkpoint_subgraph, decode_subgraphs, encode_subgraphs,
                       extract_subgraph, fuse_subgraphs, replace_subgraphs, require_traced, validate_subgraphs)
from .tracer import PH, ModeDependentCall, ModuleAttributes, TracedModule, register_leaf_function, trace_module

__all__ = [
    "PH", "ModeDependentCall", "ModuleAttributes", "TracedModule", "register_leaf_function", "trace_module",
    "call_module", "find_nodes", "find_subgraphs", "graph_modules", "trace_pattern",
    "CheckpointedSubgraph", "checkpoint_subgraph", "decode_subgraphs", "encode_subgraphs", "extract_subgraph",
    "fuse_subgraphs", "replace_subgraphs", "require_traced", "validate_subgraphs",
]
