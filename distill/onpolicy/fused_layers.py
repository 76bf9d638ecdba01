"""Fused decode modules for the generation copy of a Llama-family student (Llama, Qwen2).

`install(model)` swaps, in the sampler's own copy only (never in the student), each RMSNorm
for `FusedRMSNorm`, each attention for `FusedAttention` and each MLP for `FusedMLP`. The q,
k, v projections then read one fused weight and the gate and up projections another; the
original Linear weights become views into them, so the copy is refreshed through the
original names and costs no extra memory. A one-token step of a layer is then about eleven
kernels instead of about fifty (decode_kernels.py says why that matters).

Only the one-token decode step takes the fused path; a longer input (the prefill) runs the
original transformers module, which the fused one keeps. The fused step writes k and v into
the `PoolCache` itself, at the cache's `write` index (a device scalar the sampler advances),
so its write position is the sampler's, not the StaticLayer's counter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from distill.onpolicy.decode_kernels import rms_norm, rope_write, silu_mul

FAMILIES = ("llama", "qwen2")
_ATTENTION_PARTS = {"q_proj", "k_proj", "v_proj", "o_proj"}
_MLP_PARTS = {"gate_proj", "up_proj", "down_proj", "act_fn"}


def supported(model) -> str | None:
    """None when `model` has the layer structure these modules implement, else why not."""
    config = model.config
    if config.model_type not in FAMILIES:
        return f"model_type {config.model_type!r} is not one of {FAMILIES}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} is not silu"
    for layer in model.model.layers:
        if {n for n, _ in layer.self_attn.named_children()} != _ATTENTION_PARTS:
            return "an attention with other parts than q/k/v/o projections"
        if {n for n, _ in layer.mlp.named_children()} != _MLP_PARTS or layer.mlp.down_proj.bias \
                is not None or layer.mlp.gate_proj.bias is not None:
            return "an MLP other than gate/up/down without bias"
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if not type(norm).__name__.endswith("RMSNorm") or \
                    not hasattr(norm, "variance_epsilon"):
                return f"a norm {type(norm).__name__} that is not Llama's RMSNorm"
    dim = layer.self_attn.head_dim
    if dim & (dim - 1) or dim < 16:
        return f"head_dim {dim} is not a power of two >= 16"
    return None


def install(model) -> dict[str, torch.Tensor]:
    """Swap in the fused modules; returns {original parameter name: tensor} to refresh."""
    targets = dict(model.named_parameters())  # names as the student has them
    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        _fuse(targets, prefix + "self_attn.", attn, ("q_proj", "k_proj", "v_proj"))
        _fuse(targets, prefix + "mlp.", mlp, ("gate_proj", "up_proj"))
        layer.self_attn = FusedAttention(attn)
        layer.mlp = FusedMLP(mlp)
        layer.input_layernorm = FusedRMSNorm(layer.input_layernorm)
        layer.post_attention_layernorm = FusedRMSNorm(layer.post_attention_layernorm)
    model.model.norm = FusedRMSNorm(model.model.norm)
    return targets


def _fuse(targets: dict, prefix: str, module, parts: tuple[str, ...]) -> None:
    """One tensor for the weights (and biases) of `parts`, the Linears holding views of it."""
    for kind in ("weight", "bias"):
        pieces = [getattr(getattr(module, p), kind) for p in parts]
        if pieces[0] is None:
            continue
        fused = torch.empty((sum(t.shape[0] for t in pieces), *pieces[0].shape[1:]),
                            dtype=pieces[0].dtype, device=pieces[0].device)
        start = 0
        for p, t in zip(parts, pieces):
            view = nn.Parameter(fused[start: start + t.shape[0]], requires_grad=False)
            setattr(getattr(module, p), kind, view)
            targets[f"{prefix}{p}.{kind}"] = view
            start += t.shape[0]
        setattr(module, f"fused_{kind}", fused)  # a plain tensor: not a second parameter


class FusedRMSNorm(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.variance_epsilon

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class FusedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up as one GEMM."""

    def __init__(self, mlp):
        super().__init__()
        self.hf = mlp

    def forward(self, x):
        return self.hf.down_proj(silu_mul(F.linear(x, self.hf.fused_weight)))


class FusedAttention(nn.Module):
    """One decode token: fused q|k|v GEMM, rotary + cache write in one kernel, SDPA on the
    key/value heads (GQA folded into the query axis), o_proj. Longer inputs: the original."""

    def __init__(self, attn):
        super().__init__()
        self.hf = attn
        config = attn.config
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.layer_idx = attn.layer_idx

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        write = getattr(cache, "write", None)
        if hidden_states.shape[1] != 1 or write is None:
            return self.hf(hidden_states, position_embeddings=position_embeddings,
                           attention_mask=attention_mask, **kwargs)
        batch, dim = hidden_states.shape[0], self.hf.head_dim
        qkv = F.linear(hidden_states, self.hf.fused_weight,
                       getattr(self.hf, "fused_bias", None))  # (B, 1, (Hq + 2 Hkv) * D)
        layer = cache.layers[self.layer_idx]
        cos, sin = position_embeddings
        rope_write(qkv, cos, sin, layer.keys, layer.values, write, self.heads, self.kv_heads)
        q = qkv[..., : self.heads * dim].view(batch, self.kv_heads, -1, dim)
        out = F.scaled_dot_product_attention(q, layer.keys, layer.values,
                                             attn_mask=attention_mask, scale=self.hf.scaling)
        return self.hf.o_proj(out.reshape(batch, 1, self.heads * dim)), None
