"""Pipeline stages (``cut_pipeline_stage`` + ``build(pipeline=...)``) on 2 gloo ranks.

Every layout trains a tiny LLaMA (or GPT-2, whose output head shares the embedding) for 4 fp32 SGD
steps and must give the losses of one process running the unsplit model on the same full batch,
and its gradients on the first step. One spawned run does all the layouts (spawning is the slow
part); the tests below read its results. The splitting itself is checked in one process with
``split_model``.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import schedlang
from schedlang.distributed.launch import run_distributed
from schedlang.distributed.pipeline import PipelinedModel, build_pipeline, split_model
from tests.helpers.hf_models import gpt2, llama, token_batches

transformers = pytest.importorskip("transformers")

VOCAB, BATCH, SEQ, STEPS, LR = 256, 8, 12, 4, 0.2
TOL = dict(rtol=1e-5, atol=1e-5)
GRAD_TOL = dict(rtol=1e-4, atol=1e-6)


def _llama(seed=0, layers=4):
    return llama(seed, num_hidden_layers=layers)


def _gpt2(seed=0):
    return gpt2(seed, n_layer=4)


def _loss_fn(logits, labels):
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten())


def _batches(seed):
    """The same random batch every step, so that the loss falls when every stage learns."""
    (tokens,) = token_batches(1, BATCH, SEQ, VOCAB, seed)
    return [(tokens[:, :-1], tokens[:, 1:])] * STEPS


def _reference(model, batches):
    """One process, the unsplit model, full batches: losses and the first step's gradients."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], None
    for ids, labels in batches:
        loss = _loss_fn(model(input_ids=ids, use_cache=False).logits, labels)
        loss.backward()
        if grads is None:
            grads = {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses, grads


def _train(rank, make, cuts, schedule, n_microbatches, seed, from_meta=False):
    """``from_meta``: the model is made on the meta device and built by each rank; the reference is the whole
    model built from meta with the same seed in one process."""
    batches = _batches(seed)
    allocated = []
    if from_meta:
        from schedlang.materialize import Materializer

        with schedlang.init_empty_weights():
            model = make(seed)
        made = {n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if not t.is_meta}
        store = Materializer._store

        def recorded(self, module, name, old, is_param, value):
            store(self, module, name, old, is_param, value)
            allocated.append(id((module._parameters if is_param else module._buffers)[name]))
    else:
        model = make(seed)
    sch = schedlang.create_schedule(model)
    for path in cuts:
        sch[path].cut_pipeline_stage()
    with mock.patch.object(Materializer, "_store", recorded) if from_meta else contextlib.nullcontext():
        torch.manual_seed(seed)
        pipe, opt = schedlang.build(sch, optimizer=torch.optim.SGD, lr=LR, pipeline={
            "schedule": schedule, "n_microbatches": n_microbatches, "loss_fn": _loss_fn})
    assert isinstance(pipe, PipelinedModel)
    if from_meta:
        with schedlang.init_empty_weights():
            whole = make(seed)
        torch.manual_seed(seed)
        model = schedlang.build(schedlang.create_schedule(whole), device="cpu")[0]
        # the rank allocated its own stages' tensors and nothing else (transformers makes the rotary frequencies
        # for real even under init_empty_weights), with the values of the whole build
        held = {id(t): n for m in pipe.stage_modules for n, t in list(m.named_parameters()) + list(m.named_buffers())}
        assert all(i in held for i in allocated)
        assert sorted(held[i] for i in set(allocated)) == sorted(n for n in held.values() if n not in made)
        assert len(set(allocated)) < len(list(model.parameters()))  # not the whole model
        reference = model.state_dict()
        for m in pipe.stage_modules:
            for n, t in m.state_dict().items():
                assert torch.equal(t, reference[n]), n
    losses, grads = [], None
    for ids, labels in batches:
        mb_losses = []
        out = pipe.step(ids, target=labels, losses=mb_losses)
        assert (out is None) != pipe.is_last
        if pipe.is_last:
            assert out.shape == (BATCH, SEQ, VOCAB) and len(mb_losses) == n_microbatches
            losses.append(torch.stack(mb_losses).mean().item())
        if grads is None:
            grads = {n: p.grad.clone() for m in pipe.stage_modules for n, p in m.named_parameters()}
        opt.step()
        opt.zero_grad()
    ref_losses, ref_grads = _reference(model, batches)
    state = {n: t.detach().clone() for m in pipe.stage_modules for n, t in m.state_dict().items()}
    return {"losses": losses, "ref_losses": ref_losses, "grads": grads,
            "ref_grads": {n: ref_grads[n] for n in grads}, "state": state, "repr": repr(pipe),
            "stages": pipe.stage_indices, "keys": set(model.state_dict())}


def _layout_error(options, cuts):
    model = _llama(layers=4)
    try:
        build_pipeline(model, cuts, None, options, torch.device("cpu"))
    except schedlang.PipelineError as e:
        return str(e)
    return None


def _errors(rank):
    opts = {"schedule": "1F1B", "n_microbatches": 4, "loss_fn": _loss_fn}
    out = {
        "not_divisible": _layout_error(opts, ["model.layers.0", "model.layers.1"]),
        "one_per_rank": _layout_error(opts, ["model.layers.0", "model.layers.1", "model.layers.2"]),
        "multi_needs_two": _layout_error(dict(opts, schedule="Interleaved1F1B"), ["model.layers.1"]),
        "too_few_microbatches": _layout_error(dict(opts, n_microbatches=1), ["model.layers.1"]),
    }
    pipe = build_pipeline(_llama(), ["model.layers.1"], None, dict(opts, n_microbatches=2), torch.device("cpu"))
    for name, call in (("call", lambda: pipe(torch.zeros(2, 3, dtype=torch.long))),
                       ("uneven", lambda: pipe.step(torch.zeros(3, 4, dtype=torch.long),
                                                    target=torch.zeros(3, 4, dtype=torch.long)))):
        try:
            call()
            out[name] = None
        except schedlang.PipelineError as e:
            out[name] = str(e)
    return out


def _all_layouts(rank, world):
    llama = ["model.layers.1"]
    four = ["model.layers.2", "model.layers.0", "model.layers.1"]  # any order: sorted by execution order
    return {
        "GPipe": _train(rank, _llama, llama, "GPipe", 4, seed=1),
        "1F1B": _train(rank, _llama, llama, "1F1B", 2, seed=2),
        "Interleaved1F1B": _train(rank, _llama, four, "Interleaved1F1B", 4, seed=3),
        "ZeroBubble": _train(rank, _llama, four, "ZeroBubble", 2, seed=4),
        "gpt2": _train(rank, _gpt2, ["transformer.h.1"], "1F1B", 2, seed=5),
        "meta": _train(rank, _llama, four, "Interleaved1F1B", 4, seed=7, from_meta=True),
        "meta_gpt2": _train(rank, _gpt2, ["transformer.h.1"], "1F1B", 2, seed=8, from_meta=True),
        "errors": _errors(rank),
    }


def _to_numpy(value):
    # tensors sent back from a spawned rank through its queue must not share memory with it
    if isinstance(value, torch.Tensor):
        return value.numpy()
    if isinstance(value, dict):
        return {k: _to_numpy(v) for k, v in value.items()}
    return value


def _from_numpy(value):
    if isinstance(value, dict):
        return {k: _from_numpy(v) for k, v in value.items()}
    return torch.from_numpy(value) if type(value).__module__ == "numpy" else value


def _all_layouts_numpy(rank, world):
    return _to_numpy(_all_layouts(rank, world))


@pytest.fixture(scope="module")
def results():
    return [_from_numpy(r) for r in run_distributed(_all_layouts_numpy, world_size=2, timeout=240)]


def _check_layout(results, name):
    first, last = results[0][name], results[1][name]
    assert first["losses"] == []  # only the last stage computes the loss
    torch.testing.assert_close(torch.tensor(last["losses"]), torch.tensor(last["ref_losses"]), **TOL)
    assert last["ref_losses"][-1] < last["ref_losses"][0] - 0.1  # it learns
    for r in results:
        for n, g in r[name]["grads"].items():
            torch.testing.assert_close(g, r[name]["ref_grads"][n], **GRAD_TOL, msg=lambda m: f"{name} {n}: {m}")
    # together the ranks hold every tensor once, under the original names
    held = [set(r[name]["state"]) for r in results]
    assert held[0] | held[1] == first["keys"]
    return held


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_two_stages_train_like_one_process(results, schedule):
    held = _check_layout(results, schedule)
    assert not held[0] & held[1]
    assert "model.embed_tokens.weight" in held[0] and "model.layers.1.mlp.up_proj.weight" in held[0]
    assert {"model.layers.2.self_attn.q_proj.weight", "model.norm.weight", "lm_head.weight"} <= held[1]
    assert [r[schedule]["stages"] for r in results] == [[0], [1]]


@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "ZeroBubble"])
def test_four_stages_two_per_rank_train_like_one_process(results, schedule):
    held = _check_layout(results, schedule)
    assert not held[0] & held[1]
    assert [r[schedule]["stages"] for r in results] == [[0, 2], [1, 3]]
    assert "model.layers.2.mlp.up_proj.weight" in held[0] and "model.layers.3.mlp.up_proj.weight" in held[1]
    assert "stage 0: model" in results[0][schedule]["repr"] and "Interleaved" in results[0]["Interleaved1F1B"]["repr"]


def test_gpt2_tied_embedding_and_head_on_two_ranks_sum_their_gradients(results):
    held = _check_layout(results, "gpt2")
    assert held[0] & held[1] == set()
    assert "transformer.wte.weight" in held[0] and "lm_head.weight" in held[1]
    # the reference gradient is the sum of both uses; each copy got it, and the copies stay equal
    wte, head = results[0]["gpt2"], results[1]["gpt2"]
    torch.testing.assert_close(wte["grads"]["transformer.wte.weight"], wte["ref_grads"]["transformer.wte.weight"],
                               **GRAD_TOL)
    torch.testing.assert_close(head["grads"]["lm_head.weight"], wte["grads"]["transformer.wte.weight"], **GRAD_TOL)
    torch.testing.assert_close(wte["state"]["transformer.wte.weight"], head["state"]["lm_head.weight"], **TOL)
    assert "tied: transformer.wte.weight = lm_head.weight on pp ranks [0, 1]" in wte["repr"]


def test_a_meta_model_is_allocated_stage_by_stage_with_the_values_of_a_whole_build(results):
    """Built from the meta device, each rank allocates its own stages' tensors only (checked in the rank: the
    tensors the materializer allocated are exactly those its stages hold, equal to the whole model built from meta
    with the same seed), and trains like one process; GPT-2's tied embedding and head still start equal and get
    the summed gradient."""
    held = _check_layout(results, "meta")
    assert not held[0] & held[1]
    assert [r["meta"]["stages"] for r in results] == [[0, 2], [1, 3]]
    held = _check_layout(results, "meta_gpt2")
    wte, head = results[0]["meta_gpt2"], results[1]["meta_gpt2"]
    torch.testing.assert_close(head["grads"]["lm_head.weight"], wte["grads"]["transformer.wte.weight"], **GRAD_TOL)
    torch.testing.assert_close(wte["state"]["transformer.wte.weight"], head["state"]["lm_head.weight"], **TOL)


@pytest.mark.parametrize("key,message", [
    ("not_divisible", r"^pipeline: 2 cuts \(model\.layers\.0, model\.layers\.1\) make 3 stages, which do not divide over the 2 "
                      r"pp ranks: every rank must hold the same number of stages; cut 1 times for one stage per rank, "
                      r"3 for two$"),
    ("one_per_rank", r"^pipeline: 3 cuts .* make 4 stages for 2 pp ranks \(2 per rank\), but the 1F1B schedule runs one stage "
                     r"per rank: cut 1 time\(s\), or use a multi-stage schedule \(Interleaved1F1B, ZeroBubble\)$"),
    ("multi_needs_two", r"^pipeline: 1 cut \(model\.layers\.1\) make 2 stages for 2 pp ranks \(1 per rank\), but the "
                        r"Interleaved1F1B schedule interleaves several stages per rank: cut 3 times"),
    ("too_few_microbatches", r"^pipeline: the 1F1B schedule needs at least as many microbatches as stages: n_microbatches=1 < 2 "
                             r"stages$"),
    ("call", r"^pipeline: a PipelinedModel cannot be called like the model: .*use model\.step\(inputs, target=labels, "
             r"losses=\[\]\) on every rank$"),
    ("uneven", r"has shape \(3, 4\): its batch dimension \(dim 0\) must divide into n_microbatches=2 equal "
               r"microbatches$"),
])
def test_pinned_errors_on_two_ranks(results, key, message):
    import re

    for r in results:
        assert r["errors"][key] is not None and re.search(message, r["errors"][key]), r["errors"][key]


def _pipeline_over_tensor_parallel(rank, world):
    """pp=2 x tp=2: DTensor parameters with local-view hooks, traced and split as they are."""
    from torch.distributed.tensor import DTensor

    from schedlang.distributed.mesh import make_mesh
    from schedlang.models import shard_model

    batches = _batches(6)[:3]
    model = _llama(6)
    sch = schedlang.create_schedule(model, mesh=make_mesh(pp=2, tp=2, device_type="cpu"))
    shard_model(sch, gather_logits=True)
    sch["model.layers.1"].cut_pipeline_stage()
    pipe, opt = schedlang.build(sch, optimizer=torch.optim.SGD, lr=LR, pipeline={
        "schedule": "1F1B", "n_microbatches": 2, "loss_fn": _loss_fn})
    stage = pipe.stage_modules[0]
    params = dict(stage.named_parameters())
    assert all(isinstance(t, DTensor) for t in params.values())
    assert all(t is params[k] for k, t in stage.state_dict(keep_vars=True).items() if k in params)
    losses, grads = [], None
    for ids, labels in batches:
        mb = []
        pipe.step(ids, target=labels, losses=mb)
        losses += [torch.stack(mb).mean().item()] if mb else []
        if grads is None:
            grads = {n: p.grad.full_tensor() for n, p in sorted(params.items())}
        opt.step()
        opt.zero_grad()
    ref_losses, ref_grads = _reference(model, batches)
    return _to_numpy({"losses": losses, "ref_losses": ref_losses, "grads": grads,
                      "ref_grads": {n: ref_grads[n] for n in grads}})


def test_pipeline_over_tensor_parallel_layers_trains_like_one_process():
    results = [_from_numpy(r) for r in run_distributed(_pipeline_over_tensor_parallel, world_size=4, timeout=240)]
    assert [len(r["losses"]) for r in results] == [0, 0, 3, 3]  # mesh (pp, tp): ranks 2, 3 hold the last stage
    for r in results:
        if r["losses"]:
            torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["ref_losses"]), **TOL)
        for n, g in r["grads"].items():
            torch.testing.assert_close(g, r["ref_grads"][n], **GRAD_TOL, msg=lambda m: f"{n}: {m}")


# ------------------------------------------------------------------------------------------------ one process
def test_split_stages_chain_to_the_model_and_keep_names_and_tensors():
    model = _llama()
    stages = split_model(model, ["model.layers.2", "model.layers.0"])
    ids = torch.randint(0, VOCAB, (3, 7))
    ref = model(input_ids=ids, use_cache=False).logits
    out = stages[2](*stages[1](*stages[0](ids)))
    torch.testing.assert_close(out, ref, **TOL)
    grad = torch.randn_like(ref)
    ref_grads = {n: g for n, g in zip(
        [n for n, _ in model.named_parameters()],
        torch.autograd.grad(ref, list(model.parameters()), grad))}
    out.backward(grad)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[n], **GRAD_TOL, msg=lambda m: f"{n}: {m}")
    originals = dict(model.state_dict(keep_vars=True))
    seen = set()
    for stage in stages:
        own = stage.state_dict(keep_vars=True)
        assert not seen & set(own)
        seen |= set(own)
        assert all(t is originals[k] for k, t in own.items())
        assert isinstance(stage.model.layers, nn.ModuleList)
    assert seen == set(originals)
    assert list(stages[1].model.layers._modules) == ["1", "2"]
    assert list(stages[1].model.layers) == [model.model.layers[1], model.model.layers[2]]


class _Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        self.unused = nn.Linear(6, 2)
        self.scale = nn.Parameter(torch.ones(6))

    def forward(self, x):
        return self.b(torch.relu(self.a(self.a(x)))) * self.scale


class _ReturnsDict(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        return {"h": self.lin(x)}


class _DictFlow(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = _ReturnsDict()
        self.b = nn.Linear(6, 6)

    def forward(self, x):
        return self.b(self.a(x)["h"])


def test_a_value_that_is_not_a_tensor_cannot_cross_a_cut():
    with pytest.raises(schedlang.PipelineError,
                       match=r"^pipeline: the value 'a' \(computed by module 'a'\), used after the cut after 'a', is a dict; "
                             r"only tensors, tuples or lists of tensors, None and Python numbers can cross a pipeline "
                             r"stage boundary: move the cut$"):
        split_model(_DictFlow(), ["a"], example_inputs=(torch.randn(2, 6),))
    stages = split_model(_DictFlow(), ["a"])  # no example: found when the stage runs
    with pytest.raises(schedlang.PipelineError,
                       match=r"^pipeline: the value 'a' \(computed by module 'a'\), sent after 'a', is a dict at run time, but "
                             r"was traced as a floating-point tensor; pipeline stages can only send tensors across a "
                             r"cut: move the cut$"):
        stages[0](torch.randn(2, 6))


def test_split_a_plain_model_keeps_unused_and_root_tensors():
    model = _Twice()
    stages = split_model(model, ["b"])
    x = torch.randn(5, 6)
    torch.testing.assert_close(stages[1](*stages[0](x)), model(x))
    assert set(stages[0].state_dict()) == {"a.weight", "a.bias", "b.weight", "b.bias", "unused.weight",
                                           "unused.bias"}
    assert set(stages[1].state_dict()) == {"scale"} and stages[1].scale is model.scale


@pytest.mark.parametrize("cuts,message", [
    (["a"], r"^a: cannot end a pipeline stage here: the forward calls this module 2 times, so no single point of "
            r"the data flow is 'after' it; cut after a module that runs once$"),
    (["unused"], r"^unused: cannot end a pipeline stage here: the model's forward does not call this module as one "
                 r"step of its data flow"),
    (["nothing"], r"^nothing: no such submodule in _Twice to end a pipeline stage after; "
                  r"cut_pipeline_stage\(\) must be called on a submodule's path$"),
    (["b", "b"], r"^b: cut twice"),
    ([], r"^pipeline: no pipeline stage is cut"),
])
def test_split_errors(cuts, message):
    with pytest.raises(schedlang.PipelineError, match=message):
        split_model(_Twice(), cuts)


def test_cut_after_the_output_leaves_an_empty_stage():
    with pytest.raises(schedlang.PipelineError, match=r"^lm_head: nothing runs after this module .* the last "
                                                      r"pipeline stage would be empty; remove this cut$"):
        split_model(_llama(layers=2), ["lm_head"])


@pytest.mark.parametrize("options,message", [
    ({"schedule": "Zigzag", "n_microbatches": 2, "loss_fn": _loss_fn},
     r"^pipeline: unknown schedule 'Zigzag': valid schedules are '1F1B', 'GPipe', 'Interleaved1F1B', 'ZeroBubble'$"),
    ({"n_microbatches": 0, "loss_fn": _loss_fn}, r"^pipeline: option 'n_microbatches' must be a positive int, got 0$"),
    ({"n_microbatches": 2, "loss_fn": None}, r"^pipeline: option 'loss_fn' must be a callable"),
    ({"n_microbatches": 2, "loss_fn": _loss_fn, "chunks": 2},
     r"^pipeline: unknown option\(s\) 'chunks': valid options are 'schedule', 'n_microbatches', 'loss_fn', "
     r"'example_inputs'$"),
])
def test_option_errors(options, message):
    with pytest.raises(schedlang.PipelineError, match=message):
        build_pipeline(_llama(layers=2), ["model.layers.0"], None, options, torch.device("cpu"))
