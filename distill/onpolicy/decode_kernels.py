"""Triton kernels of the static sampler's fused decode step, and their torch twins.

A decode step of a small model is hundreds of tiny kernels, not bytes: transformers' Llama
layer launches about fifty per token (an RMSNorm is seven, the rotary embedding ten), so
even inside a CUDA graph a 0.5B model's step costs a few microseconds per kernel times a
thousand. These kernels merge each of those runs into one. Each rounds where transformers'
modules round (to the model dtype after every op), so it returns what the modules return;
the torch twins are that math written the modules' way, run on CPU and used as the oracle.

- rms_norm: LlamaRMSNorm. x * rsqrt(mean(x^2) + eps) in fp32, to the dtype, times weight.
- rope_write: one token's rotary embedding applied to q in place and to k, then k and v
  written into the KV cache at the write position (a device scalar, read by the kernel).
- silu_mul: silu(gate) * up from one fused [gate | up] projection.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr,  # (R, H) rows, (H,) weight, (R, H) out
                     stride_x, stride_o, H, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / H + eps)
    y = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)  # HF: .to(input dtype) first
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_write_kernel(qkv_ptr,  # (B, (HQ + 2 HKV) * D): one token's q | k | v per row
                       cos_ptr, sin_ptr,  # (B, D) each
                       k_ptr, v_ptr,  # (B, HKV, L, D) views of the cache (same strides)
                       pos_ptr,  # () int64: the cache index this token is written to
                       stride_qkv, stride_cs, stride_kb, stride_kh, stride_kt,
                       HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                       HALF: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)  # q heads, then k heads, then v heads
    dt = qkv_ptr.dtype.element_ty
    offs = tl.arange(0, HALF)
    src = qkv_ptr + b * stride_qkv + h * D
    x1 = tl.load(src + offs).to(tl.float32)
    x2 = tl.load(src + HALF + offs).to(tl.float32)
    pos = tl.load(pos_ptr)
    if h < HQ + HKV:
        c1 = tl.load(cos_ptr + b * stride_cs + offs).to(tl.float32)
        c2 = tl.load(cos_ptr + b * stride_cs + HALF + offs).to(tl.float32)
        s1 = tl.load(sin_ptr + b * stride_cs + offs).to(tl.float32)
        s2 = tl.load(sin_ptr + b * stride_cs + HALF + offs).to(tl.float32)
        # x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1], rounded op by op
        o1 = ((x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)).to(dt)
        o2 = ((x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)).to(dt)
        if h < HQ:
            tl.store(src + offs, o1)
            tl.store(src + HALF + offs, o2)
        else:
            dst = k_ptr + b * stride_kb + (h - HQ) * stride_kh + pos * stride_kt
            tl.store(dst + offs, o1)
            tl.store(dst + HALF + offs, o2)
    else:
        dst = v_ptr + b * stride_kb + (h - HQ - HKV) * stride_kh + pos * stride_kt
        tl.store(dst + offs, x1.to(dt))
        tl.store(dst + HALF + offs, x2.to(dt))


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr,  # (R, 2 N) [gate | up], (R, N)
                     stride_gu, stride_o, N, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    dt = out_ptr.dtype.element_ty
    g = tl.load(gu_ptr + row * stride_gu + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + N + offs, mask=mask, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)  # F.silu, to the dtype, then times up
    tl.store(out_ptr + row * stride_o + offs, (s * u).to(dt), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """(..., H) -> (..., H) in x's dtype, as LlamaRMSNorm."""
    return (rms_norm_triton if x.is_cuda else rms_norm_torch)(x, weight, eps)


def rope_write(qkv, cos, sin, keys, values, pos, heads: int, kv_heads: int) -> None:
    """qkv (B, 1, (heads + 2 kv_heads) * D): q rotated in place; rotated k and v written to
    keys / values (B, kv_heads, L, D) at index `pos` (() int64 device tensor)."""
    fn = rope_write_triton if qkv.is_cuda else rope_write_torch
    fn(qkv, cos, sin, keys, values, pos, heads, kv_heads)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(..., 2 I) [gate | up] -> (..., I): silu(gate) * up, as LlamaMLP."""
    return (silu_mul_triton if gate_up.is_cuda else silu_mul_torch)(gate_up)


def rms_norm_triton(x, weight, eps):
    H = x.shape[-1]
    rows = x.reshape(-1, H)
    out = torch.empty_like(rows)
    block = triton.next_power_of_2(H)
    _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, rows.stride(0), out.stride(0), H,
                                       eps, BLOCK=block, num_warps=4 if block <= 2048 else 8)
    return out.view(x.shape)


def rms_norm_torch(x, weight, eps):
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rope_write_triton(qkv, cos, sin, keys, values, pos, heads, kv_heads):
    batch, dim = qkv.shape[0], keys.shape[-1]
    flat, cos2, sin2 = qkv.view(batch, -1), cos.reshape(batch, dim), sin.reshape(batch, dim)
    _rope_write_kernel[(batch, heads + 2 * kv_heads)](
        flat, cos2, sin2, keys, values, pos, flat.stride(0), cos2.stride(0), keys.stride(0),
        keys.stride(1), keys.stride(2), HQ=heads, HKV=kv_heads, D=dim, HALF=dim // 2,
        num_warps=1)


def rope_write_torch(qkv, cos, sin, keys, values, pos, heads, kv_heads):
    batch, dim = qkv.shape[0], keys.shape[-1]
    flat = qkv.view(batch, heads + 2 * kv_heads, dim)
    qk = flat[:, : heads + kv_heads]
    half = dim // 2
    rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
    c, s = cos.reshape(batch, 1, dim), sin.reshape(batch, 1, dim)
    qk.copy_(qk * c + rotated * s)  # LlamaAttention's apply_rotary_pos_emb
    at = pos.view(1)
    keys.index_copy_(2, at, flat[:, heads: heads + kv_heads, None])
    values.index_copy_(2, at, flat[:, heads + kv_heads:, None])


def silu_mul_triton(gate_up):
    inter = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * inter)
    out = torch.empty((rows.shape[0], inter), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(rows.shape[0], triton.cdiv(inter, block))](
        rows, out, rows.stride(0), out.stride(0), inter, BLOCK=block, num_warps=4)
    return out.view(*gate_up.shape[:-1], inter)


def silu_mul_torch(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
