"""Random DAGs of linears, layer norms, activations, splits and cats: every fusion keeps the numerics."""

import operator

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp

from schedlang.graph.passes.horizontal import RULES

from .models import check_fusion

_ACTIVATIONS = [("function", torch.tanh), ("function", torch.relu), ("function", torch.sigmoid),
                ("function", F.gelu), ("function", F.silu), ("method", "tanh"), ("method", "relu"),
                ("module", nn.Tanh), ("module", nn.ReLU), ("module", nn.GELU), ("module", nn.SiLU)]


class _Builder:
    def __init__(self, draw):
        self.draw = draw
        self.root = nn.Module()
        self.graph = fx.Graph()
        self.values = []  # (node, width)
        self.consumed = set()
        self.k = 0

    def module(self, m):
        name = f"m{self.k}"
        self.k += 1
        self.root.add_module(name, m)
        return name

    def param(self, t):
        name = f"p{self.k}"
        self.k += 1
        self.root.register_parameter(name, nn.Parameter(t))
        return self.graph.get_attr(name)

    def use(self, node):
        self.consumed.add(node)
        return node

    def pick_group(self, min_size=1):
        """Values of one width, preferring the pieces of one split (where fusion happens)."""
        widths = sorted({w for _, w in self.values})
        width = self.draw(st.sampled_from(widths))
        same = [v for v in self.values if v[1] == width]
        size = self.draw(st.integers(min(min_size, len(same)), min(4, len(same))))
        start = self.draw(st.integers(0, len(same) - size))
        return width, same[start:start + size]

    def linear(self, x, width, out):
        if self.draw(st.booleans()):
            return self.graph.call_module(self.module(nn.Linear(width, out)), (x,))
        w = self.param(torch.randn(out, width) * 0.5)
        b = self.param(torch.randn(out)) if self.draw(st.booleans()) else None
        return self.graph.call_function(F.linear, (x, w, b))

    def layer_norm(self, x, width):
        if self.draw(st.booleans()):
            ln = nn.LayerNorm(width)
            with torch.no_grad():
                ln.weight.normal_(1.0, 0.3)
                ln.bias.normal_(0.0, 0.3)
            return self.graph.call_module(self.module(ln), (x,))
        w = self.param(torch.randn(width) * 0.3 + 1)
        return self.graph.call_function(F.layer_norm, (x, (width,), w, None, 1e-5))

    def activation(self, x, kind):
        form, op = kind
        if form == "function":
            return self.graph.call_function(op, (x,))
        if form == "method":
            return self.graph.call_method(op, (x,))
        return self.graph.call_module(self.module(op()), (x,))

    def step(self):
        op = self.draw(st.sampled_from(["fanout", "split", "split", "norms", "acts", "acts", "cat", "cat_recent",
                                        "linears", "add"]))
        if op == "fanout":  # parallel linears on one value
            x, width = self.pick_group(1)[1][0]
            outs = self.draw(st.lists(st.sampled_from([4, 6]), min_size=2, max_size=4))
            self.values += [(self.linear(self.use(x), width, o), o) for o in outs]
        elif op == "split":
            x, width = self.draw(st.sampled_from(self.values))
            parts = self.draw(st.sampled_from([p for p in (2, 3) if width % p == 0] or [1]))
            if parts == 1:
                return
            size = width // parts
            as_list = self.draw(st.booleans())
            s = self.graph.call_function(torch.split, (self.use(x), [size] * parts if as_list else size, -1))
            self.values += [(self.graph.call_function(operator.getitem, (s, i)), size) for i in range(parts)]
        elif op in ("norms", "acts", "linears"):
            width, group = self.pick_group(2)
            kind = self.draw(st.sampled_from(_ACTIVATIONS))
            out = self.draw(st.sampled_from([4, 6]))
            for x, _ in group:
                if op == "norms":
                    self.values.append((self.layer_norm(self.use(x), width), width))
                elif op == "acts":
                    self.values.append((self.activation(self.use(x), kind), width))
                else:
                    self.values.append((self.linear(self.use(x), width, out), out))
        elif op == "cat" and len(self.values) >= 2:
            chosen = self.draw(st.lists(st.sampled_from(self.values), min_size=2, max_size=4, unique_by=lambda v: v[0]))
            node = self.graph.call_function(torch.cat, ([self.use(x) for x, _ in chosen], -1))
            self.values.append((node, sum(w for _, w in chosen)))
        elif op == "cat_recent" and len(self.values) >= 2:  # the results of the last group, in order
            k = self.draw(st.integers(2, min(4, len(self.values))))
            chosen = self.values[-k:]
            node = self.graph.call_function(torch.cat, ([self.use(x) for x, _ in chosen], -1))
            self.values.append((node, sum(w for _, w in chosen)))
        elif op == "add":
            width, group = self.pick_group(2)
            if len(group) >= 2:
                a, b = group[0][0], group[1][0]
                self.values.append((self.graph.call_function(operator.add, (self.use(a), self.use(b))), width))


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_graphs_keep_outputs_and_gradients(data):
    torch.manual_seed(data.draw(st.integers(0, 2**16)))
    b = _Builder(data.draw)
    batch = data.draw(st.sampled_from([(3,), (2, 5)]))
    widths = data.draw(st.lists(st.sampled_from([4, 6, 12]), min_size=1, max_size=3))
    inputs = []
    for i, w in enumerate(widths):
        b.values.append((b.graph.placeholder(f"x{i}"), w))
        inputs.append(torch.randn(*batch, w))
    for _ in range(data.draw(st.integers(2, 10))):
        b.step()
    leaves = [v for v, _ in b.values if v not in b.consumed and v.op != "placeholder"]
    if not leaves:
        leaves = [b.values[-1][0]]
    b.graph.output(tuple(leaves))
    model = fx.GraphModule(b.root, b.graph)
    traced = fx.GraphModule(model, b.graph)
    if data.draw(st.booleans()):
        ShapeProp(traced).propagate(*inputs)
    rules = data.draw(st.one_of(st.none(), st.lists(st.sampled_from(list(RULES)), unique=True)))
    min_group_size = data.draw(st.sampled_from([2, 2, 3]))
    check_fusion(model, inputs, rules=rules, min_group_size=min_group_size, gm=traced, atol=1e-4, rtol=1e-4)
