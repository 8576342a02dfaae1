"""Random subgraphs mixing full, per-row, per-column and scalar inputs with pointwise ops
and last-dimension reductions: the generated forward and backward against PyTorch in
float64. Catches broadcasting and gradient-reduction mistakes that hand-written cases
miss."""

import operator
import random

import pytest
import torch
import torch.fx
import torch.nn.functional as F

from .utils import check_fused

INPUT_SHAPES = {"x": (3, 4, 11), "y": (3, 4, 11), "bias": (11,), "row": (3, 4, 1), "scale": ()}


def _random_graph(seed: int) -> torch.fx.GraphModule:
    rng = random.Random(seed)
    graph = torch.fx.Graph()
    pool = [graph.placeholder(name) for name in INPUT_SHAPES]
    spans_cols = {node: INPUT_SHAPES[node.name][-1:] == (11,) for node in pool}

    def pick():
        # prefer recent values so that chains get deep
        return pool[-1 - min(int(rng.expovariate(0.5)), len(pool) - 1)]

    def add(node, cols):
        pool.append(node)
        spans_cols[node] = cols

    for _ in range(rng.randint(3, 8)):
        a, b = pick(), rng.choice(pool)
        cols = spans_cols[a] or spans_cols[b]
        choice = rng.randrange(9)
        if choice == 0:
            add(graph.call_function(rng.choice([operator.add, operator.sub, operator.mul]), (a, b)), cols)
        elif choice == 1:  # a / (1 + b^2): a denominator away from zero
            sq = graph.call_function(operator.mul, (b, b))
            add(graph.call_function(operator.truediv, (a, graph.call_function(operator.add, (sq, 1.0)))), cols)
        elif choice == 2:
            fn = rng.choice([torch.tanh, torch.sigmoid, F.silu, torch.erf])
            add(graph.call_function(fn, (a,)), spans_cols[a])
        elif choice == 3:
            add(graph.call_function(F.gelu, (a,), {"approximate": rng.choice(["none", "tanh"])}), spans_cols[a])
        elif choice == 4:  # exp of a bounded value
            add(graph.call_function(torch.exp, (graph.call_function(torch.tanh, (a,)),)), spans_cols[a])
        elif choice == 5 and spans_cols[a]:
            add(graph.call_method(rng.choice(["mean", "sum"]), (a, -1), {"keepdim": True}), False)
        elif choice == 6 and spans_cols[a]:
            add(graph.call_function(F.softmax, (a,), {"dim": -1}), True)
        elif choice == 7 and spans_cols[a]:
            add(graph.call_function(F.layer_norm, (a, (11,)), {"eps": 1e-3}), True)
        else:  # rsqrt(a^2 + 1)
            sq = graph.call_function(operator.mul, (a, a))
            add(graph.call_function(torch.rsqrt, (graph.call_function(operator.add, (sq, 1.0)),)), spans_cols[a])
    computed = pool[len(INPUT_SHAPES):]
    outputs = [computed[-1]] + rng.sample(computed[:-1], k=min(len(computed) - 1, rng.randint(0, 2)))
    # every input reaches an output, so every gradient is checked
    total = outputs[0]
    for node in pool[:len(INPUT_SHAPES)]:
        total = graph.call_function(operator.add, (total, graph.call_function(operator.mul, (node, 0.5))))
    outputs[0] = total
    graph.output(tuple(outputs) if len(outputs) > 1 else outputs[0])
    return torch.fx.GraphModule(torch.nn.Module(), graph)


@pytest.mark.parametrize("seed", range(40))
def test_random_program(seed):
    gm = _random_graph(seed)
    inputs = [torch.randn(shape) for shape in INPUT_SHAPES.values()]
    check_fused(gm, inputs, name=f"Random{seed}", tol=dict(rtol=1e-4, atol=1e-4))
