"""schedlang.utils, logger, initialization, tracer, pipeline and framework_dialect under Slapo's names."""

import logging

import pytest
import torch
from torch import fx, nn

import schedlang as slapo
from schedlang.utils import common, report, versions


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x):
        return torch.relu(self.fc(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = Block()
        self.layers = nn.ModuleList([Block(), Block()])
        self.post = nn.Linear(6, 6, bias=False)

    def forward(self, x):
        x = self.pre(x)
        for layer in self.layers:
            x = layer(x)
        return self.post(x)


def test_hooks_are_listed_moved_and_checked_for_fusion():
    a, b = nn.Linear(3, 3), nn.Linear(3, 3)
    pre = a.register_forward_pre_hook(lambda m, args: None)
    a.register_forward_hook(lambda m, args, out: out * 2)
    assert [len(v) for v in common.get_hooks(a).values()] == [1, 1, 0]
    assert common.has_hook(a, "fwd_post") and not common.has_hook(b, "bwd_post")
    common.transfer_hooks(a, b, ["fwd_post"])
    x = torch.randn(2, 3)
    torch.testing.assert_close(b(x), 2 * nn.functional.linear(x, b.weight, b.bias))
    pre.remove()
    assert not common.has_hook(a, "fwd_pre")
    with pytest.raises(ValueError, match="unknown hook kind 'fwd'"):
        common.has_hook(a, "fwd")

    sch = slapo.create_schedule(Net())
    sch.trace(flatten=True)
    sch.mod.get_submodule("layers.0.fc").register_forward_hook(lambda m, i, o: o)
    sub = sch.find(lambda x: torch.relu(slapo.call_module(r"layers\.0\.fc", x)))
    with pytest.raises(ValueError, match=r"the first module layers\.0\.fc has a fwd_post hook"):
        common.transfer_hooks_for_fusion(sch, sub, nn.Identity())


def test_module_kinds_optional_imports_and_versions():
    model = Net()
    assert common.is_module_list(model.layers) and not common.is_module_list(model.pre)
    assert not common.is_module_list(nn.Sequential(nn.ReLU()))
    assert common.is_lambda_function(lambda: 0) and not common.is_lambda_function(len)
    assert common.importlib_or_none("json") is not None and common.importlib_or_none("no_such_pkg_x") is None
    assert versions.is_torch_version(">=", "2.0") and not versions.is_torch_version("<", "1.0")
    with pytest.raises(ValueError, match="unknown operation '=>': valid are >, >="):
        versions.compare_versions("torch", "=>", "2.0")
    with pytest.raises(KeyError, match="package 'no_such_pkg_x' is not installed"):
        versions.compare_versions("no_such_pkg_x", ">", "1")


def test_decoder_tflops_counts_dense_attention_and_head_flops():
    # 1 sample/s of 4 tokens, 2 layers, h=8, V=10 on 2 devices: 4 * (72*64*2 + 12*4*8*2 + 6*10*8) / 2
    assert report.calc_decoder_tflops(1.0, 2, 4, 2, 8, 10) * 1e12 == pytest.approx(4 * (9216 + 768 + 480) / 2)
    assert report.calc_decoder_tflops(1.0, 1, 4, 2, 8, 10, ckpt_all=True) * 1e12 == \
        pytest.approx(4 * (96 * 64 * 2 + 16 * 4 * 8 * 2 + 6 * 10 * 8))
    with pytest.raises(ValueError, match="num_gpus must be positive, got 0"):
        report.calc_decoder_tflops(1.0, 0, 4, 2, 8, 10)


def test_memory_and_profile_reports_are_logged_not_printed(caplog, capsys):
    with caplog.at_level(logging.INFO, logger="schedlang"):
        assert report.report_memory("step 1", report_gc=True) >= 0.0
        table = report.profile_perf(nn.Linear(6, 6), [torch.randn(3, 6)], backward=True)
    assert "addmm" in table or "linear" in table
    assert "step 1 host memory used" in caplog.text
    assert capsys.readouterr().out == ""


def test_memory_report_skips_tensors_of_symbolic_shape(caplog, monkeypatch):
    # torch.compile with dynamic shapes keeps fake tensors whose sizes are symbols: they hold no memory, and
    # adding their symbolic sizes up broke the report once their shape environment was gone
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    dynamic = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.DYNAMIC])
    symbolic = FakeTensorMode(shape_env=ShapeEnv()).from_tensor(torch.randn(3, 5), symbolic_context=dynamic)
    assert type(symbolic.numel()) is not int
    real = torch.randn(7, 11)
    monkeypatch.setattr(report.gc, "get_objects", lambda: [real, symbolic, "not a tensor"])
    with caplog.at_level(logging.INFO, logger="schedlang"):
        report.report_memory("after compile", report_gc=True)
    assert "after compile live tensors: 1 (77 elements)" in caplog.text


def test_logger_lives_under_schedlang_and_takes_ranks(caplog):
    log = slapo.get_logger("train")
    assert log.logger.name == "schedlang.train" and slapo.get_logger("train") is log
    with caplog.at_level(logging.INFO, logger="schedlang.train"):
        log.info("hello %d", 3, ranks=[0])
    assert "hello 3" in caplog.text


def test_init_on_device_and_init_empty_weights_enable_flag():
    with slapo.initialization.init_on_device("meta"):
        lin = nn.Linear(4, 4)
    assert lin.weight.is_meta
    with slapo.init_empty_weights(enable=False):
        assert not nn.Linear(2, 2).weight.is_meta
    with slapo.init_empty_weights():
        assert nn.Linear(2, 2).weight.is_meta
    with slapo.initialization.init_on_device("meta", include_buffers=True):
        bn = nn.BatchNorm1d(3)
    assert bn.running_mean.is_meta


def test_tracer_keeps_leaves_named_by_class_and_makes_hf_inputs():
    from schedlang.tracer import generate_hf_tracer_inputs, is_fx_tracable, trace

    model = Net()
    gm = trace(model, leaf_modules=["Block"], flatten=True)
    assert {n.target for n in gm.graph.nodes if n.op == "call_module"} == {"pre", "layers.0", "layers.1", "post"}
    x = torch.randn(3, 6)
    torch.testing.assert_close(gm(x), model(x))
    assert not is_fx_tracable(slapo.op.Print()) and is_fx_tracable(model)
    with pytest.raises(TypeError, match="unknown tracer 'jit'"):
        trace(model, tracer="jit")

    from transformers import GPT2Config, GPT2LMHeadModel

    gpt = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
    concrete, dummy = generate_hf_tracer_inputs(gpt, is_top=True)
    assert list(dummy) == ["input_ids"] and concrete["use_cache"] is None
    assert dummy["input_ids"].shape == (2, 8) and int(dummy["input_ids"].max()) < 50
    assert gpt(**dummy).logits.shape == (2, 8, 50)


def test_pipeline_partition_ties_and_targets():
    from schedlang.framework_dialect import FrameworkUnavailableError, build_with_target, get_dialect_cls
    from schedlang.pipeline import analyze_pipeline_module, analyze_tie_weights, generate_pipeline_partition

    model = Net()
    model.post.weight = model.pre.fc.weight  # tied across the cut
    sch = slapo.create_schedule(model)
    with pytest.raises(ValueError, match="needs cut_pipeline_stage"):
        generate_pipeline_partition(sch)
    sch["layers.0"].cut_pipeline_stage()
    parts = generate_pipeline_partition(sch, example_inputs=(torch.randn(3, 6),))
    assert [n for n in parts.child] == ["submod_0", "submod_1"]
    assert parts["submod_1"].metadata["partition_idx"] == 1
    x = torch.randn(3, 6)
    torch.testing.assert_close(parts.mod(x), model(x))
    args, names, _ = analyze_pipeline_module(parts.mod)
    assert names == {0: "submod_0", 1: "submod_1"} and args[0] == ["x"]
    (places,) = analyze_tie_weights(parts.mod, True).values()
    assert places == {("pre.fc.weight", 0), ("post.weight", 1)}
    (places,) = analyze_tie_weights(model, False).values()
    assert places == {("pre.fc.weight", 0), ("post.weight", 0)}

    plain = slapo.create_schedule(Net())
    built, opt = build_with_target(plain, None)
    assert opt is None and isinstance(built, Net)
    with pytest.raises(KeyError, match="no runtime_engine dialect for target 'mxnet'"):
        build_with_target(plain, "mxnet")
    if slapo.utils.importlib_or_none("deepspeed") is None:
        with pytest.raises(FrameworkUnavailableError, match=r"needs DeepSpeed, which is not installed\. .*"
                                                            r"schedlang\.build\(sch, optimizer=\.\.\., pipeline="):
            build_with_target(plain, "deepspeed")
    assert get_dialect_cls("log_parser", "megatron").parse_log(
        "iteration 10 | elapsed time per iteration (ms): 250.0 | max allocated: 2048.0")[1:3] == (4.0, 2.0)
    assert isinstance(parts.mod.submod_0, fx.GraphModule)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_report_memory_gives_the_gpu_memory_allocated_now():
    from schedlang.utils.report import report_memory

    big = torch.empty(64, 2**20, dtype=torch.uint8, device="cuda")  # 64 MiB
    del big  # a peak, gone again: what is allocated now does not include it
    before = report_memory("before")
    with slapo.init_empty_weights():
        torch.nn.Linear(4096, 4096)
    assert report_memory("after an empty model") == before
    held = torch.empty(16, 2**20, dtype=torch.uint8, device="cuda")
    assert report_memory("holding 16 MiB") - before >= 16
    del held
