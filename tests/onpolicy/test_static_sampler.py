"""The static sampler's decode loop, run eagerly on CPU (the GPU runs the same step as a CUDA
graph): greedy completions equal HF generate's, sampled ones follow its distribution, seeds,
eos, buckets and chunks never change a completion, padded head rows are never sampled, the
generation copy follows the student (LoRA merged) and a frozen model is used as it is."""

import pytest
import torch

from distill.onpolicy.draws import reference_probs
from distill.onpolicy.static_sampler import StaticSampler
from tests.onpolicy.helpers import EOS, PAD, PROMPTS, VOCAB, chi2_pvalue, hf, tiny


def sampler(temperature=0.0, top_p=1.0, max_new_tokens=12, eos=(EOS,), **kwargs):
    return StaticSampler(temperature, top_p, max_new_tokens, list(eos), PAD, VOCAB, **kwargs)


# the three ways a model decodes: as it is (frozen, in the dtype), through a plain copy, or
# through a copy with the fused decode modules (a trainable Llama-family student's default)
PATHS = {"frozen": ({}, False), "copy": ({"fused": False}, True), "fused": ({"fused": True}, True)}


def on_path(path: str, model):
    kwargs, trainable = PATHS[path]
    return kwargs, model.requires_grad_(trainable)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_equals_hf_generate(family, path):
    kwargs, model = on_path(path, tiny(family))
    s = sampler(**kwargs)
    assert s(model, PROMPTS, seed=0) == hf(model, PROMPTS)
    engine = s.engine(model)
    assert (engine.copy is not None) == (path != "frozen")
    assert (engine.copy is not None and engine.copy.fused) == (path == "fused")


def test_the_fused_copy_swaps_the_modules_and_keeps_one_copy_of_each_weight():
    from distill.onpolicy.fused_layers import FusedAttention, FusedMLP, FusedRMSNorm

    model = tiny("qwen2").train()  # q/k/v biases too
    s = sampler()
    s(model, PROMPTS, seed=0)
    gen = s.engine(model).model
    layer = gen.model.layers[0]
    assert isinstance(layer.self_attn, FusedAttention) and isinstance(layer.mlp, FusedMLP)
    assert isinstance(layer.input_layernorm, FusedRMSNorm)
    assert isinstance(gen.model.norm, FusedRMSNorm)
    q = layer.self_attn.hf.q_proj.weight
    assert q.data_ptr() == layer.self_attn.hf.fused_weight.data_ptr()  # a view of the fused
    assert layer.self_attn.hf.v_proj.bias.data_ptr() > layer.self_attn.hf.fused_bias.data_ptr()
    assert s.stats()["copy_bytes"] == sum(p.numel() for p in model.parameters()) * 4


@pytest.mark.parametrize("path", ["copy", "fused"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_stops_at_eos_like_hf(family, path):
    kwargs, model = on_path(path, tiny(family))
    free = hf(model, PROMPTS, max_new_tokens=10)
    eos = (free[0][3], free[2][1])  # tokens the model does write: some rows stop early
    got = sampler(max_new_tokens=10, eos=eos, **kwargs)(model, PROMPTS, seed=0)
    assert got == hf(model, PROMPTS, max_new_tokens=10, eos=eos)
    for row in got:
        assert all(t not in eos for t in row[:-1])
        assert len(row) == 10 or row[-1] in eos
    assert any(len(row) < 10 for row in got)


def test_decoding_stops_once_every_row_is_done():
    model = tiny()
    free = hf(model, PROMPTS, max_new_tokens=2)
    eos = sorted({row[1] for row in free} | {row[0] for row in free})  # all done by token 2
    s = sampler(max_new_tokens=40, eos=eos, check_every=4)
    got = s(model, PROMPTS, seed=0)
    assert all(len(row) <= 2 and row[-1] in eos for row in got)
    assert s.last["steps"] == [4]  # stopped at the first check, not after 40 tokens


def test_same_seed_same_completions_other_seed_others():
    model = tiny("qwen2")
    s = sampler(temperature=1.0, top_p=0.95, max_new_tokens=16)
    a, b, c = (s(model, PROMPTS, seed=seed) for seed in (5, 5, 6))
    assert a == b
    assert a != c


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("temperature,top_p", [(0.0, 1.0), (1.0, 1.0), (0.8, 0.7)])
def test_buckets_padding_rows_and_chunks_never_change_a_completion(temperature, top_p, path):
    kwargs, model = on_path(path, tiny())
    prompts = PROMPTS * 3  # 15 rows
    plain = sampler(temperature, top_p, 10, batch_buckets=(16,), prompt_buckets=(8,), **kwargs)
    want = plain(model, prompts, seed=11)
    for buckets in [dict(batch_buckets=(32,), prompt_buckets=(64,)),  # more padding
                    dict(batch_buckets=(4,), prompt_buckets=(7, 16)),  # 4 chunks of 4 rows
                    dict(batch_buckets=(2, 8), prompt_buckets=(4,))]:  # prompts past buckets
        got = sampler(temperature, top_p, 10, **buckets, **kwargs)(model, prompts, seed=11)
        assert got == want
    # a row's completion does not depend on the other rows of its window either
    alone = plain(model, prompts[:1], seed=11)
    assert alone == want[:1]


def test_sampling_follows_hf_generates_distribution():
    """Two tokens from one prompt, 3000 rows: the joint histogram of the static sampler and of
    HF generate both fit the exact distribution (chi-square); equal seeds do not give equal
    tokens across the two (different draws), only the same law."""
    model = tiny("llama", seed=3, initializer_range=0.05)  # flatter: many tokens in play
    temperature, top_p, rows = 0.9, 0.8, 3000
    prompt = [5, 6, 7, 8]
    with torch.no_grad():
        first = reference_probs(model(torch.tensor([prompt])).logits[:, -1, :VOCAB],
                                temperature, top_p)[0]
        support = first.nonzero().squeeze(-1)
        nxt = model(torch.tensor([prompt + [t] for t in support.tolist()])).logits
        second = reference_probs(nxt[:, -1, :VOCAB], temperature, top_p)
    joint = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    joint[support] = first[support, None] * second
    for got in (sampler(temperature, top_p, 2, eos=(VOCAB + 1,))(model, [prompt] * rows, seed=1),
                hf(model, [prompt] * rows, temperature=temperature, top_p=top_p,
                   max_new_tokens=2, seed=1, eos=(VOCAB + 1,))):
        counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
        for a, b in got:
            counts[a, b] += 1
        assert counts[joint == 0].sum() == 0  # outside the nucleus: never
        assert chi2_pvalue(counts.flatten(), joint.flatten()) > 1e-3
        assert chi2_pvalue(counts.sum(1), first) > 1e-3


def test_padded_head_rows_are_never_sampled():
    model = tiny()
    with torch.no_grad():  # make the padded rows the most likely tokens by far
        model.get_output_embeddings().weight[VOCAB:] *= 50
    for temperature, top_p in ((0.0, 1.0), (1.0, 1.0), (2.0, 0.99)):
        got = sampler(temperature, top_p, 12)(model, PROMPTS * 4, seed=2)
        assert max(max(row) for row in got) < VOCAB
    assert sampler()(model, PROMPTS, seed=0) == hf(model, PROMPTS)  # HF suppresses them too


def test_the_generation_copy_follows_the_trained_weights_in_place():
    model = tiny("qwen2")  # trainable: the sampler decodes on its own copy
    s = sampler()
    before = s(model, PROMPTS, seed=0)
    engine = s.engine(model)
    assert engine.copy is not None
    addresses = [p.data_ptr() for p in engine.model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # an optimizer step
    after = s(model, PROMPTS, seed=0)
    assert after != before
    assert after == hf(model, PROMPTS)
    assert [p.data_ptr() for p in engine.model.parameters()] == addresses
    assert s.engine(model) is engine


def test_a_tied_head_stays_tied_in_the_copy():
    model = tiny("qwen2", tie_word_embeddings=True).train()
    s = sampler()
    assert s(model, PROMPTS, seed=0) == hf(model, PROMPTS)
    gen = s.engine(model).model
    assert gen.get_output_embeddings().weight is gen.get_input_embeddings().weight
    assert s.stats()["copy_bytes"] == sum(p.numel() for p in model.parameters()) * 4
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(1.5)
    assert s(model, PROMPTS, seed=0) == hf(model, PROMPTS)


def test_lora_student_decodes_with_its_adapters_merged():
    pytest.importorskip("peft")
    from distill.models.lora import LoraConfig, apply_lora

    model = apply_lora(tiny("llama"), LoraConfig(**{"r": 4})).train()  # as in training
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)  # PEFT starts B at zero: make the adapter matter
    s = sampler()
    got = s(model, PROMPTS, seed=0)
    assert got == hf(model, PROMPTS)  # HF runs the adapters unmerged
    engine = s.engine(model)
    assert not any("lora" in n for n, _ in engine.model.named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name:
                p.mul_(-1)  # a step on the adapter alone
    again = s(model, PROMPTS, seed=0)
    assert model.training  # the student's mode is left as it was
    assert again != got and again == hf(model, PROMPTS)


def test_a_frozen_model_in_the_dtype_is_used_as_it_is():
    teacher = tiny("qwen2").requires_grad_(False)  # fp32 on CPU: the sampler's dtype there
    s = sampler(temperature=1.0)
    s(teacher, PROMPTS, seed=0)
    engine = s.engine(teacher)
    assert engine.copy is None and engine.model is teacher
    assert s.stats()["copy_bytes"] == 0
    assert teacher.config._attn_implementation == "sdpa"  # its own attention, restored
    assert not teacher.training


def test_student_and_teacher_share_one_sampler():
    student, teacher = tiny("llama", seed=1), tiny("llama", seed=2).requires_grad_(False)
    s = sampler()
    assert s(student, PROMPTS, seed=0) == hf(student, PROMPTS)
    assert s(teacher, PROMPTS, seed=1) == hf(teacher, PROMPTS)
    assert s(student, PROMPTS, seed=0) == hf(student, PROMPTS)


def test_bf16_weights_on_cpu_and_warmup():
    model = tiny()
    s = sampler(temperature=1.0, dtype=torch.bfloat16)
    s.warmup(model, [3, 20], prompt_len=9)  # eager on CPU: nothing to capture
    got = s(model, PROMPTS, seed=0)
    assert s.captures == 0 and s.recaptures == 0
    assert len(got) == len(PROMPTS) and all(0 < len(r) <= 12 for r in got)
    assert next(s.engine(model).model.parameters()).dtype == torch.bfloat16


def test_unsupported_models_and_settings_are_refused():
    sliding = tiny("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=0)
    with pytest.raises(ValueError, match="full-attention layers only"):
        sampler()(sliding, PROMPTS, seed=0)
    with pytest.raises(ValueError, match="top_p"):
        sampler(top_p=0.0)
    with pytest.raises(ValueError, match="at least one token"):
        sampler()(tiny(), [[5], []], seed=0)
    assert sampler()(tiny(), [], seed=0) == []


def test_other_layer_structures_decode_through_their_own_modules():
    model = tiny("llama", hidden_act="gelu").train()  # not LlamaMLP's silu: no fused MLP
    s = sampler()
    assert s(model, PROMPTS, seed=0) == hf(model, PROMPTS)
    assert s.engine(model).copy.fused is False
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not silu"):
        sampler(fused=True)(model, PROMPTS, seed=0)
