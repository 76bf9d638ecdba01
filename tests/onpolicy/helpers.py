"""Tiny Llama / Qwen2 models from config classes, and the HF `generate` reference.

The reference is `generate` with `top_k=0` (no top-k, exactly as configured), as
HFSampler calls it: transformers reads `top_k=None` as its default of 50.
"""

from __future__ import annotations

import torch
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

EOS, PAD = 3, 0
HEAD_ROWS, VOCAB = 97, 90  # the head has 7 padded rows past the tokenizer's vocabulary
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [15], [16, 17], [18, 19, 20, 21, 22]]


def tiny(family: str = "llama", seed: int = 0, **overrides):
    """A 2-layer GQA model with peaked logits (init 0.2: greedy has no near-ties)."""
    torch.manual_seed(seed)
    cls, config = {"llama": (LlamaForCausalLM, LlamaConfig),
                   "qwen2": (Qwen2ForCausalLM, Qwen2Config)}[family]
    cfg = dict(vocab_size=HEAD_ROWS, hidden_size=64, intermediate_size=128,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               initializer_range=0.2, eos_token_id=EOS, pad_token_id=PAD,
               max_position_embeddings=512)
    return cls(config(**{**cfg, **overrides})).eval()


def hf(model, prompts, *, temperature=0.0, top_p=1.0, max_new_tokens=12, seed=0,
       eos=(EOS,), vocab=VOCAB):
    """HF generate on left-padded prompts, exactly as configured (no top_k), cut at eos."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    rows = model.get_output_embeddings().weight.shape[0]
    greedy = temperature == 0
    config = GenerationConfig(
        do_sample=not greedy, temperature=None if greedy else temperature,
        top_p=None if greedy else top_p, top_k=0, max_new_tokens=max_new_tokens,
        eos_token_id=list(eos), pad_token_id=PAD,
        suppress_tokens=list(range(vocab, rows)) or None)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=attn, generation_config=config)
    completions = []
    for row in out[:, width:].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        completions.append(row[:end])
    return completions


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson's chi-square goodness of fit; cells expected below `min_expected` pooled."""
    counts, probs = counts.double(), probs.double() / probs.sum()
    expected = counts.sum() * probs
    big = expected >= min_expected
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = torch.tensor(float(len(obs) - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))
