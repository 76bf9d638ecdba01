"""The GPU benchmarks' CPU-checkable parts: every script imports (a stale import only shows
on the GPU otherwise), and the helpers that turn measurements into tables."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.stem for p in (ROOT / "bench").glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_benchmark_imports(name):
    importlib.import_module(f"bench.{name}")


def test_gemm_configs_parse():
    from bench.bench_gemm import parse_config

    assert parse_config("128,256,64,8,4,0") == ((128, 256, 64, 8, 4), 0)
    with pytest.raises(SystemExit, match="give BM,BN,BK,warps,stages,tma_store"):
        parse_config("128,256,64")


def test_kernel_groups_per_step():
    from bench.profile_step import kernel_groups

    def kernel(name, ts, dur, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}

    trace = {"traceEvents": [
        kernel("nvjet_sm90_tst_192x192_64x4_1x2_h_bz_coopB_TNN", 0, 3000),
        kernel("_logits_stats_kernel", 3000, 1000),
        kernel("_live_fwd_kernel", 4000, 500),
        kernel("triton_poi_fused__unsafe_view_mul_silu_4", 4500, 300),
        kernel("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 4800, 400),
        kernel("void at::native::vectorized_elementwise_kernel<4>", 5200, 200),
        kernel("Memset (Device)", 5400, 100, cat="gpu_memset"),
        kernel("nvjet_sm90_tst_192x192_64x4_1x2_h_bz_coopB_TNN", 6000, 3000),  # 500 us idle
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 9000},  # host: not counted
    ]}
    got = kernel_groups(trace, steps=2)
    assert got["per_step_ms"] == {"GEMM (cuBLAS / CUTLASS)": 3.0,
                                  "distill loss: logits GEMM + stats": 0.5,
                                  "distill loss: row kernels": 0.25,
                                  "attention": 0.2, "inductor fused (triton_*)": 0.15,
                                  "elementwise (eager)": 0.1, "copies / fills": 0.05}
    assert got["busy_ms_per_step"] == 4.25 and got["span_ms_per_step"] == 4.5
