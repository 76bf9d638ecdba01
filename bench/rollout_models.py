"""Random-weight models for the rollout bench and the GPU check: the public student shapes
of bench/bench_train_steps.py (Qwen2.5-0.5B, Llama-3.2-1B), and small GQA models whose
peaked logits (init 0.2) leave greedy decoding no near-ties to flip."""

from __future__ import annotations

import random

import torch

from bench.harness import on_path

on_path()
from bench_train_steps import LLAMA, QWEN, TINY  # noqa: E402  (one copy of the shapes)

STUDENTS = {"qwen2.5-0.5b": ("qwen2", QWEN), "llama-3.2-1b": ("llama", LLAMA),
            "tiny": ("qwen2", TINY)}  # tiny: the benches' CPU dry runs
EOS = 2


def classes(family: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    return {"qwen2": (Qwen2Config, Qwen2ForCausalLM),
            "llama": (LlamaConfig, LlamaForCausalLM)}[family]


def student(name: str, device="cuda"):
    """A student of a public shape in fp32 (the trainable master weights), trainable."""
    family, spec = STUDENTS[name]
    config_cls, model_cls = classes(family)
    config = config_cls(**spec["student"], **spec["common"], eos_token_id=EOS, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        model = model_cls(config)
    return model.train()


def small(family: str, device="cuda", vocab: int = 1024, seed: int = 0, **overrides):
    """A 4-layer GQA model (8 query heads, 2 key/value heads), fp32, eval mode."""
    config_cls, model_cls = classes(family)
    cfg = dict(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
               num_attention_heads=8, num_key_value_heads=2, initializer_range=0.2,
               eos_token_id=EOS, pad_token_id=0, max_position_embeddings=1024)
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_cls(config_cls(**{**cfg, **overrides}))
    return model.eval()


def bf16_weights(model):
    """`model` with its parameters in bf16 and its buffers as they are: `model.to(bf16)` would
    round the fp32 rotary tables too (positions drift), which no bf16 checkpoint load does."""
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    return model


def prompts(count: int, length: int | tuple[int, int], vocab: int, seed: int = 0):
    """`count` prompts of random ids in [10, vocab); a (lo, hi) length draws each length."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        n = length if isinstance(length, int) else rng.randint(*length)
        out.append([rng.randrange(10, vocab) for _ in range(n)])
    return out


def weight_bytes(model, dtype_bytes: int = 2) -> int:
    """Bytes a decode step reads from the weights (every parameter once; a tied head once)."""
    return sum(p.numel() for p in model.parameters()) * dtype_bytes


def kv_bytes_per_token(model, dtype_bytes: int = 2) -> int:
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * dtype_bytes
