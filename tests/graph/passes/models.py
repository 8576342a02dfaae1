"""Models and a numerics checker shared by the horizontal-fusion tests."""

from __future__ import annotations

import copy
from typing import Dict, Optional, Sequence

import torch
from torch import fx, nn

from schedlang.graph.passes.horizontal import fused_parameter_sources, horizontal_fuse


def randomize(model: nn.Module) -> nn.Module:
    """Give every parameter fresh random values (LayerNorm starts at ones/zeros otherwise)."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.5 + (1.0 if p.dim() == 1 else 0.0))
    return model


class SplitLayerNormTanhCat(nn.Module):
    """Seed case 1: an embedding output cut into N features, LayerNorm + tanh each, concatenated."""

    def __init__(self, n=5, d=8, list_sizes=False):
        super().__init__()
        self.n, self.d, self.list_sizes = n, d, list_sizes
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(n))

    def forward(self, x):
        pieces = torch.split(x, [self.d] * self.n, -1) if self.list_sizes else x.split(self.d, -1)
        return torch.cat([torch.tanh(self.norms[i](pieces[i])) for i in range(self.n)], -1)


class EmbeddingChain(nn.Module):
    """Seed case 1 as a recommendation model writes it: N embedding bags make one (B, N*D) tensor,
    ``torch.split(x, D, dim=1)`` cuts it into features, LayerNorm + an activation each, concatenated.

    Traced without shapes, nothing says the last piece of the split is whole (``dim=1`` need not
    be the dim the layer norm normalizes), so the rules must guard it.
    """

    def __init__(self, n=7, d=13, rows=11, form="function", activation=torch.tanh):
        super().__init__()
        self.n, self.d, self.form, self.activation = n, d, form, activation
        self.bags = nn.ModuleList(nn.EmbeddingBag(rows, d, mode="sum") for _ in range(n))
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(n))

    def forward(self, indices, offsets):
        x = torch.cat([bag(indices, offsets) for bag in self.bags], 1)
        if self.form == "method":
            pieces = x.split(self.d, 1)
        elif self.form == "sizes":
            pieces = torch.split(x, [self.d] * self.n, dim=1)
        else:
            pieces = torch.split(x, self.d, dim=1)
        return torch.cat([self.activation(self.norms[i](pieces[i])) for i in range(self.n)], dim=1)


class SplitAlongRows(nn.Module):
    """N pieces of ``x.split(D, 1)`` of a (B, W, E) tensor, LayerNorm(E) + tanh each, concatenated.

    The last piece really is shorter when W < N*D; when W > N*D the rest of ``x`` is not used.
    """

    def __init__(self, n=7, d=13, e=6):
        super().__init__()
        self.n, self.d = n, d
        self.norms = nn.ModuleList(nn.LayerNorm(e) for _ in range(n))

    def forward(self, x):
        pieces = torch.split(x, self.d, dim=1)
        return torch.cat([torch.tanh(self.norms[i](pieces[i])) for i in range(self.n)], 1)


def embedding_inputs(batch=5, rows=11, per_sample=3):
    """Random (indices, offsets) for ``EmbeddingChain``: ``per_sample`` rows for each of ``batch`` samples."""
    indices = torch.randint(0, rows, (batch * per_sample,))
    offsets = torch.arange(0, batch * per_sample, per_sample)
    return [indices, offsets]


class ParallelBranches(nn.Module):
    """Seed case 2: N parallel Linear -> LayerNorm -> ReLU branches on one input."""

    def __init__(self, n=4, d_in=6, d=8, concat=False):
        super().__init__()
        self.concat = concat
        self.linears = nn.ModuleList(nn.Linear(d_in, d) for _ in range(n))
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(n))

    def forward(self, x):
        outs = [torch.relu(norm(lin(x))) for lin, norm in zip(self.linears, self.norms)]
        return torch.cat(outs, -1) if self.concat else tuple(outs)


class BranchesOnPieces(nn.Module):
    """N parallel Linear -> LayerNorm -> GELU branches, each on its own piece of the input."""

    def __init__(self, n=3, d_in=5, d=7):
        super().__init__()
        self.d_in = d_in
        self.linears = nn.ModuleList(nn.Linear(d_in, d) for _ in range(n))
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(n))
        self.act = nn.GELU()

    def forward(self, x):
        pieces = x.split(self.d_in, -1)
        outs = [self.act(self.norms[i](self.linears[i](pieces[i]))) for i in range(len(self.linears))]
        return torch.cat(outs, -1)


class DependentLinears(nn.Module):
    """A chain of equal-shape linears: no two may be fused (each needs the previous one)."""

    def __init__(self, d=6, depth=3):
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(d, d) for _ in range(depth))

    def forward(self, x):
        for lin in self.linears:
            x = lin(x)
        return x


def run_with_grads(model: nn.Module, inputs: Sequence[torch.Tensor], grad_seed: int = 1):
    """Outputs (flattened), input gradients and parameter gradients after one backward pass."""
    inputs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    model.zero_grad(set_to_none=True)
    out = model(*inputs)
    outs = [out] if isinstance(out, torch.Tensor) else list(out)
    gen = torch.Generator().manual_seed(grad_seed)
    loss = sum((o * torch.randn(o.shape, generator=gen, dtype=o.dtype).to(o.device)).sum() for o in outs)
    loss.backward()
    return [o.detach() for o in outs], [x.grad for x in inputs if x.requires_grad]


def assert_close_scaled(actual, expected, atol, rtol):
    """assert_close with ``atol`` scaled by the largest magnitude of ``expected`` (as Verify does).

    Gradients can be large (a layer norm over few values amplifies them); a fixed absolute
    tolerance would then ask for more digits than the dtype has.
    """
    if actual is None or expected is None:  # no gradient on either side (an unused input or parameter)
        assert actual is None and expected is None, (actual, expected)
        return
    scale = max(1.0, expected.detach().abs().max().item()) if expected.numel() else 1.0
    torch.testing.assert_close(actual, expected, atol=atol * scale, rtol=rtol)


def check_fusion(model: nn.Module, inputs: Sequence[torch.Tensor], rules=None, min_group_size: int = 2,
                 atol: float = 1e-5, rtol: float = 1.3e-6, gm: Optional[fx.GraphModule] = None,
                 example_inputs: Optional[Sequence[torch.Tensor]] = None):
    """Trace, fuse, and compare outputs, input gradients and every parameter gradient.

    A fused parameter's gradient is compared slice by slice with the gradients of the
    originals it was built from. Returns (fused GraphModule, report).
    """
    traced = gm if gm is not None else fx.symbolic_trace(model)
    fused = copy.deepcopy(traced)
    report = horizontal_fuse(fused, rules=rules, min_group_size=min_group_size, example_inputs=example_inputs)
    fused.graph.lint()
    compare_with_model(model, fused, inputs, atol, rtol)
    return fused, report


def compare_with_model(model: nn.Module, fused: fx.GraphModule, inputs: Sequence[torch.Tensor],
                       atol: float = 1e-5, rtol: float = 1.3e-6) -> None:
    """Outputs, input gradients and every parameter gradient of ``fused`` against ``model``'s."""
    ref_out, ref_in_grads = run_with_grads(model, inputs)
    out, in_grads = run_with_grads(fused, inputs)
    assert len(out) == len(ref_out)
    for a, b in zip(out, ref_out):
        assert_close_scaled(a, b, atol, rtol)
    for a, b in zip(in_grads, ref_in_grads):
        assert_close_scaled(a, b, atol, rtol)
    compare_parameters(model, fused, atol, rtol)


def compare_parameters(model: nn.Module, fused: fx.GraphModule, atol: float = 1e-5, rtol: float = 1.3e-6) -> None:
    """Every original parameter of ``model``, and its gradient, against where ``fused`` holds it (itself, or its
    slice of a fused parameter); every original must be accounted for."""
    originals = dict(model.named_parameters())
    fused_info = fused_parameter_sources(fused)
    covered = set()
    for name, p in fused.named_parameters():
        if name in fused_info:
            info = fused_info[name]
            for src in info.sources:
                covered.add(src.name)
                torch.testing.assert_close(src.take(p.detach()), originals[src.name].detach(), atol=0, rtol=0)
                assert_close_scaled(src.take(p.grad), originals[src.name].grad, atol, rtol)
        else:
            covered.add(name)
            assert_close_scaled(p.grad, originals[name].grad, atol, rtol)
    assert covered == set(originals), f"parameters not accounted for: {set(originals) - covered}"


def count_calls(gm: fx.GraphModule) -> Dict[str, int]:
    """How many nodes call each op, by a readable name (module class, function or method name)."""
    counts: Dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op == "call_module":
            key = type(gm.get_submodule(n.target)).__name__
        elif n.op == "call_function":
            key = getattr(n.target, "__name__", str(n.target))
        elif n.op == "call_method":
            key = n.target
        else:
            continue
        counts[key] = counts.get(key, 0) + 1
    return counts
