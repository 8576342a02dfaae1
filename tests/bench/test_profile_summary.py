"""bench/profile_summary.py: kernel kinds, busy time over overlapping streams, per-step figures."""

import json

import pytest


def _kernel(name, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


@pytest.mark.parametrize("name, kind", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
    ("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NTN", "gemm"),
    ("triton_tem_fused_mm_0", "gemm"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3", "attention"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits>", "attention"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "optimizer"),
    ("triton_poi_fused__to_copy_add_mul_0", "inductor"),
    ("_rms_norm_forward_kernel", "schedlang"),
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda>", "cast_copy"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>", "eager_reduce"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::AUnaryFunctor<float>>", "eager_elementwise"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "collective"),
    ("something_unheard_of", "other"),
])
def test_kernel_kinds(bench, name, kind):
    assert bench("profile_summary").kind_of(name) == kind


def test_summary_per_step_with_overlap(bench, tmp_path):
    ps = bench("profile_summary")
    # 2 steps over 0..1000 us; the GEMM and the NCCL kernel overlap for 100 us on two streams
    events = [_kernel("sm90_xmma_gemm_x", 0, 300), _kernel("ncclDevKernel_AllReduce", 200, 200),
              _kernel("triton_poi_fused_add_0", 500, 100), _kernel("Memset (Device)", 700, 50, cat="gpu_memset"),
              _kernel("sm90_xmma_gemm_x", 900, 100),
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5000}]  # host ops do not count
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    s = ps.summarize(path, steps=2)
    assert s["span_ms"] == pytest.approx(0.5)  # 1000 us over 2 steps
    assert s["gpu_busy_ms"] == pytest.approx((400 + 100 + 50 + 100) / 2e3)
    assert s["kernel_ms"] == pytest.approx((300 + 200 + 100 + 50 + 100) / 2e3)
    assert s["idle_share"] == pytest.approx(1 - 650 / 1000)
    assert s["by_kind_ms"] == {"gemm": 0.2, "collective": 0.1, "inductor": 0.05, "memset": 0.025}
    assert s["top_kernels"][0] == {"name": "sm90_xmma_gemm_x", "kind": "gemm", "calls": 1.0, "ms": 0.2}
    table = ps.markdown([s, s])
    assert "| gemm | 0.2 | 0.2 |" in table


def test_trace_without_kernels_is_refused(bench, tmp_path):
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps([{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5}]))
    with pytest.raises(ValueError, match="no GPU kernels"):
        bench("profile_summary").summarize(path, steps=1)
