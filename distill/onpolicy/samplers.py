"""Samplers: prompts (token ids) in, one completion per prompt out (token ids).

The interface is one call, `sampler(model, prompts, *, seed) -> completions`: a completion
ends with an eos token when the model stopped, and the same seed gives the same
completions. `HFSampler` is the student's own `generate` (KV cache, eval mode, no grad);
on CUDA the default is the static-cache CUDA-graph sampler (`static_sampler.py`). An
inference engine would be a third class with the same call: a vLLM sampler would hold an
`LLM` built from the student's config, copy the student's weights into it before each
rollout, and call `llm.generate(prompt_token_ids, SamplingParams(temperature, top_p,
max_tokens, seed))`. Nothing else in the package would change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from distill.data.collate import pad


class Sampler(Protocol):
    def __call__(self, model, prompts: list[list[int]], *, seed: int) -> list[list[int]]: ...


@dataclass
class SamplingSettings:
    """What every sampler needs to know besides the model."""

    temperature: float  # 0: greedy
    top_p: float
    max_new_tokens: int
    eos_token_ids: list[int]
    pad_token_id: int
    vocab_size: int | None = None  # ids past the tokenizer (padded head rows) never sampled


class HFSampler:
    """The model's own `generate`: left-padded prompts, dynamic KV cache, eval mode."""

    def __init__(self, settings: SamplingSettings):
        self.settings = settings

    def __call__(self, model, prompts, *, seed):
        from transformers import GenerationConfig

        s = self.settings
        device = next(model.parameters()).device
        ids, attn = pad(prompts, s.pad_token_id, side="left")
        rows = model.get_output_embeddings().weight.shape[0]
        suppress = list(range(s.vocab_size, rows)) if s.vocab_size else []
        greedy = s.temperature == 0
        config = GenerationConfig(
            do_sample=not greedy, temperature=None if greedy else s.temperature,
            top_p=None if greedy else s.top_p, top_k=0,  # 0: no top-k (None is 50)
            max_new_tokens=s.max_new_tokens, eos_token_id=s.eos_token_ids,
            pad_token_id=s.pad_token_id, suppress_tokens=suppress or None)
        was_training = model.training
        model.eval()
        devices = [device] if device.type == "cuda" else []
        try:
            # generate draws from the global generators and takes none of its own
            with torch.no_grad(), torch.random.fork_rng(devices=devices):
                torch.manual_seed(seed)
                out = model.generate(input_ids=ids.to(device), attention_mask=attn.to(device),
                                     generation_config=config)
        finally:
            model.train(was_training)
        width = ids.shape[1]
        return [until_eos(row, s.eos_token_ids) for row in out[:, width:].tolist()]


def until_eos(tokens: list[int], eos: list[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def stop_tokens(model, tokenizer_eos: int | None) -> list[int]:
    """Every token a sample stops at: the model's generation_config eos (chat models list
    their end-of-turn token there), its config's, and the tokenizer's."""
    eos: list[int] = []
    for found in (getattr(model.generation_config, "eos_token_id", None),
                  model.config.eos_token_id, tokenizer_eos):
        for t in [found] if isinstance(found, int) else list(found or []):
            eos += [t] if t not in eos else []
    if not eos:
        raise ValueError("on-policy sampling needs a stop token: neither the student's "
                         "config nor its generation_config nor the tokenizer has an "
                         "eos_token_id; set one in the student's config.json")
    return eos
