"""Every Slapo module path and public name resolves under schedlang (``import schedlang as slapo``)."""

import importlib

import pytest

# Slapo's public surface (module -> names), DeepSpeed's internal pipeline helpers left out
SURFACE = {
    "build": ["build"],
    "checkpoint": ["checkpoint", "CheckpointFunctionWithRNGTracker"],
    "env": ["setup"],
    "initialization": ["init_empty_weights", "init_on_device"],
    "logger": ["get_logger"],
    "pattern": ["Pattern", "ModulePattern", "call_module"],
    "pipeline": ["propagate_partition", "add_partition_notation", "analyze_pipeline_module", "analyze_tie_weights",
                 "generate_pipeline_partition", "build_pipeline_model"],
    "random": ["CudaRNGStatesTracker", "get_cuda_rng_tracker", "model_parallel_cuda_manual_seed",
               "is_random_seed_set", "set_random_seed"],
    "schedule": ["create_schedule", "Schedule"],
    "tracer": ["is_fx_tracable", "fix_hf_module", "generate_hf_tracer_inputs", "trace_submodule", "trace"],
    "verify": ["Verify"],
    "version": ["__version__"],
    "autotune": [],
    "autotune.tune": ["must_fix", "Symbol", "Space", "Database", "parse_args", "convert_nargs_to_dict",
                      "run_training_script", "tune", "load_config", "parse_log", "main"],
    "framework_dialect": ["get_all_dialects", "get_dialect_cls"],
    "framework_dialect.registry": ["register_framework_dialect", "get_all_dialects", "get_dialect_cls"],
    "framework_dialect.deepspeed": [],
    "framework_dialect.deepspeed.engine": ["init_ds_engine"],
    "framework_dialect.deepspeed.utils": ["DeepSpeedLogParser"],
    "framework_dialect.megatron": [],
    "framework_dialect.megatron.utils": ["MegatronLogParser"],
    "model_schedule": ["apply_schedule"],
    "model_schedule.api": ["apply_schedule"],
    "model_schedule.registry": ["get_schedule", "register_schedule"],
    "model_schedule.albert": [], "model_schedule.bert": [], "model_schedule.gpt2": [], "model_schedule.gpt_neo": [],
    "model_schedule.opt": [], "model_schedule.roberta": [], "model_schedule.t5": [],
    "model_schedule.llama": [],
    "op": ["FlashAttention", "FlashAttentionOp", "ParallelCrossEntropy", "FusedQKV", "LinearWithSeparateBias",
           "LinearWithSyncFunc", "FusedMLP", "Print"],
    "op.attention": ["warning_once", "flash_attn_ref", "xformers_ref", "validate_sm_version",
                     "get_xfoemers_attn_op_by_name", "FlashAttentionOp", "FlashAttention"],
    "op.cross_entropy": ["vocab_range_from_per_partition_vocab_size", "vocab_parallel_cross_entropy",
                         "ParallelCrossEntropy"],
    "op.fused_bias": ["BiasGeLUFunction", "new_gelu", "bias_new_gelu", "bias_dropout"],
    "op.linear": ["FusedQKV", "LinearWithSeparateBias", "LinearWithSyncFunc", "LinearWithAct", "LinearWithDropout"],
    "op.mlp": ["FusedMLP"],
    "op.utils": ["Print"],
    "sharding": ["reduce_forward_output", "reduce_backward_grad", "scatter_forward_output",
                 "all_gather_forward_output", "reduce_scatter_forward_output"],
    "sharding.reshard_ops": ["parse_reshard", "identity", "reshard_RR_to_RS", "reshard_RR_to_SR", "reshard_RS_to_RR",
                             "reshard_RS_to_SR", "reshard_SR_to_RR", "reshard_SR_to_RS"],
    "sharding.shard_ops": ["dispatch_shard_method_cls", "apply_shard_method", "apply_sync_method",
                           "register_shard_method", "new_or_get_tied_param", "ShardMethod", "ShardLinear",
                           "ShardConv2d", "ShardConv1D"],
    "sharding.sync_ops": ["all_gather_along_dim", "reduce_scatter_along_dim", "scatter_along_dim",
                          "all_gather_forward_output", "reduce_scatter_forward_output", "scatter_forward_output",
                          "reduce_forward_output", "reduce_backward_grad"],
    "utils": [],
    "utils.common": ["get_hooks", "has_hook", "transfer_hooks", "transfer_hooks_for_fusion", "transfor_param_tags",
                     "is_lambda_function", "is_module_list", "importlib_or_none"],
    "utils.mapping": ["MAPPING_FROM_FUNCTIONAL_TO_MODULE"],
    "utils.report": ["report_memory", "profile_perf", "calc_decoder_tflops"],
    "utils.versions": ["compare_versions", "is_torch_version"],
}

# names Slapo scripts reach as attributes of the package
TOP_LEVEL = ["create_schedule", "build", "Verify", "init_empty_weights", "get_logger", "set_random_seed",
             "get_cuda_rng_tracker", "is_random_seed_set", "Symbol", "Space", "Database", "register_primitive",
             "list_primitives", "__version__", "op", "pattern", "sharding", "random", "pipeline", "utils",
             "model_schedule", "autotune", "framework_dialect", "tracer", "initialization", "logger"]


@pytest.mark.parametrize("module", sorted(SURFACE))
def test_slapo_module_path_and_names_resolve(module):
    mod = importlib.import_module(f"schedlang.{module}")
    missing = [name for name in SURFACE[module] if not hasattr(mod, name)]
    assert not missing, f"schedlang.{module} lacks {missing}"


def test_slapo_top_level_names_resolve():
    import schedlang as slapo

    missing = [name for name in TOP_LEVEL if not hasattr(slapo, name)]
    assert not missing
    assert slapo.op.FusedQKV is importlib.import_module("schedlang.op.linear").FusedQKV
    assert slapo.version.__version__ == slapo.__version__


def test_unknown_top_level_name_still_raises_attribute_error():
    import schedlang

    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        schedlang.not_a_name
