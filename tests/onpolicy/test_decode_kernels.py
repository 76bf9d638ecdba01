"""The fused decode kernels against their torch twins and the transformers modules they
replace: in Triton's interpreter on CPU (fp32), natively on a GPU; and they compile for an
H100/H200 (sm_90) on a machine without one (Triton's wheel ships ptxas)."""

import importlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama import modeling_llama

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"


@pytest.fixture
def kernels(monkeypatch):
    """distill.onpolicy.decode_kernels, its kernels interpreted when there is no GPU."""
    mod = importlib.import_module("distill.onpolicy.decode_kernels")
    if ON_GPU:
        return mod
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.standard.zeros, InterpretedFunction):  # decorated before: redo
        importlib.reload(tl.standard)
        importlib.reload(tl.random)
        importlib.reload(tl)
    return importlib.reload(mod)


def test_rms_norm_is_llamas(kernels):
    norm = modeling_llama.LlamaRMSNorm(200, eps=1e-5).to(DEVICE)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(7, 3, 200, device=DEVICE) * 3
    want = norm(x)
    torch.testing.assert_close(kernels.rms_norm_torch(x, norm.weight, 1e-5), want)
    torch.testing.assert_close(kernels.rms_norm_triton(x, norm.weight, 1e-5), want)


def test_silu_mul_is_llamas_mlp_activation(kernels):
    gate_up = torch.randn(5, 1, 2 * 1500, device=DEVICE)  # two blocks, the last one partial
    gate, up = gate_up.chunk(2, -1)
    want = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(kernels.silu_mul_torch(gate_up), want)
    torch.testing.assert_close(kernels.silu_mul_triton(gate_up), want)


def test_rope_write_is_llamas_rotary_and_a_cache_write(kernels):
    batch, heads, kv_heads, dim, length, pos = 3, 4, 2, 16, 9, 5
    config = LlamaConfig(hidden_size=heads * dim, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, max_position_embeddings=64)
    rotary = modeling_llama.LlamaRotaryEmbedding(config).to(DEVICE)
    positions = torch.tensor([[11], [3], [40]], device=DEVICE)
    qkv = torch.randn(batch, 1, (heads + 2 * kv_heads) * dim, device=DEVICE)
    cos, sin = rotary(qkv, positions)  # (B, 1, D)
    q, k, v = qkv.view(batch, 1, -1, dim).transpose(1, 2).split([heads, kv_heads, kv_heads], 1)
    q_want, k_want = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    for fn in (kernels.rope_write_torch, kernels.rope_write_triton):
        keys = torch.zeros(batch, kv_heads, length, dim, device=DEVICE)
        values = torch.zeros_like(keys)
        got = qkv.clone()
        fn(got, cos, sin, keys, values, torch.tensor(pos, device=DEVICE), heads, kv_heads)
        q_got = got.view(batch, 1, -1, dim).transpose(1, 2)[:, :heads]
        torch.testing.assert_close(q_got, q_want)
        torch.testing.assert_close(keys[:, :, pos: pos + 1], k_want)
        torch.testing.assert_close(values[:, :, pos: pos + 1], v)
        assert keys[:, :, :pos].abs().sum() == 0 and values[:, :, pos + 1:].abs().sum() == 0


SCRIPT = textwrap.dedent("""
    import json
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from distill.onpolicy import decode_kernels as k

    def build(fn, types, consts):
        sig = {n: "constexpr" if n in consts else types[n] for n in fn.arg_names}
        src = ASTSource(fn, sig, {(fn.arg_names.index(c),): v for c, v in consts.items()})
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})

    i32 = "i32"
    build(k._rms_norm_kernel, dict(x_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16",
          stride_x=i32, stride_o=i32, H=i32, eps="fp32"), dict(BLOCK=1024))
    build(k._silu_mul_kernel, dict(gu_ptr="*bf16", out_ptr="*bf16", stride_gu=i32,
          stride_o=i32, N=i32), dict(BLOCK=1024))
    build(k._rope_write_kernel, dict(qkv_ptr="*bf16", cos_ptr="*bf16", sin_ptr="*bf16",
          k_ptr="*bf16", v_ptr="*bf16", pos_ptr="*i64", stride_qkv=i32, stride_cs=i32,
          stride_kb=i32, stride_kh=i32, stride_kt=i32), dict(HQ=14, HKV=2, D=64, HALF=32))
    print(json.dumps("compiled"))
""")


@pytest.mark.skipif(ON_GPU, reason="on a GPU the kernels above compile for real")
def test_decode_kernels_compile_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                          text=True, timeout=600, cwd=root)
    if "ptxas" in proc.stderr and "not found" in proc.stderr:
        pytest.skip("this Triton install has no ptxas")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == "compiled"
