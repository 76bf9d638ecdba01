"""The row kernels compile for an H100/H200 (sm_90) on a machine without a GPU.

The interpreter runs the kernels' math but not their lowering: a loop-carried value that
changes type, a scalar store with a mask, a reduction with indices can pass there and fail
to compile for the GPU. Triton's wheel ships ptxas, so compiling to a cubin needs no
device. Runs in a subprocess: this suite sets TRITON_INTERPRET=1 for everything else.
Both row fixups (distill.ops.spec.ROW_FIXUPS), each at its default live block; the cached
kernel with its prefetch at its default block, and without it at 4096.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

SCRIPT = textwrap.dedent("""
    import itertools, json
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from distill.ops import divergence_triton, sparse_triton

    COMMON = dict(loss_ptr="*fp32", ce_ptr="*fp32", labels_ptr="*i64", scale_ptr="*fp32",
                  V="i32", stride_s="i32", stride_d="i32", inv_t="fp32", beta="fp32",
                  ce_weight="fp32", factor="fp32")
    SPARSE = dict(COMMON, zs_ptr="*fp32", ids_ptr="*i64", lp_ptr="*bf16", K="i32",
                  stride_i="i32", stride_l="i32", tail_floor="fp32")
    LIVE = dict(COMMON, zs_ptr="*fp32", zt_ptr="*fp32", sts_ptr="*fp32", NT="i32",
                plane_s="i32", stt_ptr="*fp32", plane_t="i32", stride_t="i32")

    def build(fn, types, consts):
        sig = {n: "constexpr" if n in consts else types[n] for n in fn.arg_names}
        src = ASTSource(fn, sig, {(fn.arg_names.index(k),): v for k, v in consts.items()})
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})

    done = []
    for kind, ce, lane in itertools.product((0, 1, 2), (False, True), (False, True)):
        flags = dict(KIND=kind, HAS_CE=ce, CE_GRAD=ce, CE_SEP=ce, WRITE_CE=ce,
                     HAS_SCALE=True, NEED_GRAD=True, ALIAS=ce, LANE=lane)
        build(sparse_triton._sparse_fwd_kernel, dict(SPARSE, dz_ptr="*bf16" if ce else "*fp32"),
              dict(flags, RENORM=kind == 1, HAS_TAIL=True, BLOCK_K=64, PREFETCH=lane,
                   BLOCK=divergence_triton.CONFIG["sparse"][0] if lane else 4096))
        build(divergence_triton._live_fwd_kernel, dict(LIVE, dz_ptr="*bf16" if ce else "*fp32"),
              dict(flags, STATS=ce, BLOCK=2048 if lane else 4096, BLOCK_T=512))
        done.append([kind, ce, lane])
    print(json.dumps(done))
""")


def ptxas_for_sm90() -> str | None:
    """The ptxas Triton compiles sm_90 cubins with, or None where this install has none.

    Asked of Triton before compiling, so that the compile's own failure is never read as a
    missing tool: whatever goes wrong once ptxas is there fails the test."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        tool = get_ptxas(90)
    except (ImportError, RuntimeError, OSError):
        return None
    path = getattr(tool, "path", None)
    return path if path and os.access(path, os.X_OK) else None


@pytest.mark.slow  # >10 s on a 2-core CPU (make test runs it)
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests compile them for real")
def test_row_kernels_compile_for_sm90(tmp_path):
    if ptxas_for_sm90() is None:
        pytest.skip("this Triton install has no ptxas for sm_90")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # a real compile, not a cached cubin
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                          text=True, timeout=600, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(json.loads(proc.stdout.strip().splitlines()[-1])) == 12
