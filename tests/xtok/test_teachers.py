"""Live, cached and on-policy teachers with tiny real models, end to end through the batch."""

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from distill.cache.cross import write_cache
from distill.cache.format import CacheMismatch
from distill.data.chat import ChatEncoder
from distill.data.shift import shift_flat, shift_labels
from distill.models.causal_lm import final_hidden_states, lm_head
from distill.xtok import PairCollator, PairEncoder, VocabMap, cross_tokenizer_divergence
from distill.xtok.collate import flat_spans
from distill.xtok.onpolicy import Retokenizer
from distill.xtok.teachers import CachedCrossTeacher, LiveCrossTeacher
from tests.xtok.families import FAMILIES, make_family_tokenizer
from tests.xtok.reference import reference_loss
from tests.xtok.test_pairing import MESSAGES

CHATS = [MESSAGES,
         [{"role": "user", "content": "Add 12 and 30."},
          {"role": "assistant", "content": "12 + 30 = 42, so the answer is 42."}],
         [{"role": "user", "content": "Say hello."},
          {"role": "assistant", "content": "Hello there! How are you today?"}]]
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=256)


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {name: make_family_tokenizer(name, root / name) for name in FAMILIES}


def model(family, vocab, seed):
    torch.manual_seed(seed)
    if family == "qwen":
        return Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, **SMALL)).eval()
    if family == "llama3":
        return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, **SMALL)).eval()
    cfg = Gemma2Config(vocab_size=vocab, head_dim=16, final_logit_softcapping=5.0, **SMALL)
    return Gemma2ForCausalLM(cfg).eval()


def batch_of(toks, student, teacher, with_offsets=False):
    enc = PairEncoder(ChatEncoder(toks[student]), ChatEncoder(toks[teacher]), with_offsets)
    examples = []
    for i, chat in enumerate(CHATS):
        [ex] = enc.examples(chat)
        examples.append({**ex, "example_id": f"chat:{i}"})
    collate = PairCollator(toks[student].pad_token_id, toks[teacher].pad_token_id)
    vmap = VocabMap.build(toks[student], toks[teacher], enc.special_equivalents())
    return examples, collate(examples), vmap


def student_side(student, batch):
    hidden = final_hidden_states(student, batch["input_ids"], batch["attention_mask"])
    h = shift_flat(hidden).detach().requires_grad_()
    w = lm_head(student)[0].detach().clone().requires_grad_()
    return h, w


def oracle_with_full_logits(teacher, batch, h, w, vmap, **kw):
    """The oracle, on the teacher's full HF logits (its head extras applied by HF itself)."""
    logits = teacher(input_ids=batch["teacher_input_ids"],
                     attention_mask=batch["teacher_attention_mask"]).logits
    logp = torch.log_softmax(shift_flat(logits).double() / kw.get("temperature", 1.0), -1)
    h2, w2 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    pairs = list(zip(vmap.student_ids.tolist(), vmap.teacher_ids.tolist()))
    loss = reference_loss(h2, w2, logp, spans=flat_spans(batch),
                          labels=shift_labels(batch["labels"]),
                          teacher_targets=batch["teacher_input_ids"][:, 1:].reshape(-1),
                          pairs=pairs, **kw)
    loss.backward()
    return loss.detach(), h2.grad, w2.grad


@pytest.mark.parametrize("student,teacher", [("qwen", "llama3"), ("llama3", "qwen"),
                                             ("qwen", "gemma")])
def test_live_teacher_end_to_end(toks, student, teacher):
    _, batch, vmap = batch_of(toks, student, teacher)
    s_model = model(student, len(toks[student]), 0)
    t_model = model(teacher, len(toks[teacher]), 1)
    live = LiveCrossTeacher.from_model(t_model, toks[teacher])
    live.check_tokenizer(toks[teacher])
    targets = live.targets(batch)
    h, w = student_side(s_model, batch)
    kw = dict(mode="hybrid", kind="forward_kl", ce_weight=0.5, temperature=1.5)
    loss = cross_tokenizer_divergence(h, w, labels=shift_labels(batch["labels"]),
                                      vocab_map=vmap, **targets, **kw)
    loss.backward()
    ref = oracle_with_full_logits(t_model, batch, h, w, vmap, **kw)
    for a, b in zip((loss.detach(), h.grad, w.grad), ref):
        torch.testing.assert_close(a.double(), b, rtol=2e-5, atol=1e-6 * float(b.abs().max()))
    with pytest.raises(ValueError, match="another tokenizer"):
        live.check_tokenizer(toks[student])


def test_batch_spans_point_at_the_right_rows(toks):
    examples, batch, _ = batch_of(toks, "qwen", "llama3")
    labels = shift_labels(batch["labels"])
    t_targets = batch["teacher_input_ids"][:, 1:].reshape(-1)
    rows = flat_spans(batch).tolist()
    spans = [(b, *s) for b, ex in enumerate(examples) for s in ex["xtok_spans"]]
    assert len(rows) == len(spans)
    for (s_lo, s_hi, t_lo, t_hi), (b, a, e, c, d) in zip(rows, spans):
        assert labels[s_lo:s_hi].tolist() == examples[b]["input_ids"][a:e]
        assert t_targets[t_lo:t_hi].tolist() == examples[b]["teacher_input_ids"][c:d]
    for b, ex in enumerate(examples):
        k = len(ex["teacher_labels"])
        assert batch["teacher_labels"][b, :k].tolist() == ex["teacher_labels"]
    prompt = batch["teacher_prompt_lengths"].tolist()
    assert all(ex["teacher_labels"][p] != -100 and set(ex["teacher_labels"][1:p]) == {-100}
               for ex, p in zip(examples, prompt))



def test_pair_batches_padded_to_the_multiple_within_each_side_cap(toks):
    """Both sides' widths follow the loader's rule (distill.data.collate.padded_width); the
    spans stay those of the unpadded rows."""
    examples, plain, _ = batch_of(toks, "qwen", "llama3")
    s_n, t_n = plain["input_ids"].shape[1], plain["teacher_input_ids"].shape[1]
    collate = PairCollator(toks["qwen"].pad_token_id, toks["llama3"].pad_token_id, 1,
                           caps=(s_n + 3, t_n + 1))
    collate.multiple = 64  # what DistillDataModule.for_device("cuda") sets
    batch = collate(examples)
    # the next multiple of 64, or the student's cap where that is nearer
    assert batch["input_ids"].shape[1] == min(-(-s_n // 64) * 64, s_n + 3) > s_n - 1
    assert batch["teacher_input_ids"].shape[1] == min(-(-t_n // 64) * 64, t_n + 1)
    wide = PairCollator(toks["qwen"].pad_token_id, toks["llama3"].pad_token_id, 64,
                        caps=(None, t_n + 70))(examples)  # a cap that does not bind
    assert wide["teacher_input_ids"].shape[1] == -(-t_n // 64) * 64
    assert torch.equal(batch["xtok_spans"], plain["xtok_spans"])
    assert torch.equal(batch["teacher_input_ids"][:, :t_n], plain["teacher_input_ids"])
    assert not batch["teacher_attention_mask"][:, t_n:].any()

def test_cached_teacher_equals_live_and_refuses_mismatches(toks, tmp_path):
    examples, batch, vmap = batch_of(toks, "llama3", "qwen", with_offsets=True)
    t_model = model("qwen", len(toks["qwen"]), 1)
    vt = len(toks["qwen"])
    write_cache(tmp_path / "cache", examples, t_model, toks["qwen"], top_k=vt,
                temperature=2.0, teacher="tiny-qwen")
    cached = CachedCrossTeacher(tmp_path / "cache", toks["qwen"], top_k=vt, temperature=2.0)
    live = LiveCrossTeacher.from_model(t_model, toks["qwen"])
    s_model = model("llama3", len(toks["llama3"]), 0)
    out = []
    for teacher in (live, cached):
        h, w = student_side(s_model, batch)
        loss = cross_tokenizer_divergence(h, w, labels=shift_labels(batch["labels"]),
                                          vocab_map=vmap, mode="hybrid", temperature=2.0,
                                          **teacher.targets(batch))
        loss.backward()
        out.append((loss.detach(), h.grad, w.grad))
    for a, b in zip(*out):
        torch.testing.assert_close(a, b, rtol=5e-5, atol=1e-6 * float(b.abs().max()))
    with pytest.raises(CacheMismatch, match="teacher_tokenizer"):
        CachedCrossTeacher(tmp_path / "cache", toks["gemma"], top_k=vt, temperature=2.0)
    with pytest.raises(CacheMismatch, match="top_k"):
        CachedCrossTeacher(tmp_path / "cache", toks["qwen"], top_k=8, temperature=2.0)
    changed = dict(batch, teacher_input_ids=batch["teacher_input_ids"].clone())
    changed["teacher_input_ids"][1, 3] += 1
    with pytest.raises(CacheMismatch, match="teacher_ids"):
        cached.targets(changed)


def test_cached_top_k_trains(toks, tmp_path):
    examples, batch, vmap = batch_of(toks, "qwen", "llama3", with_offsets=True)
    write_cache(tmp_path / "c8", examples, model("llama3", len(toks["llama3"]), 1),
                toks["llama3"], top_k=8)
    cached = CachedCrossTeacher(tmp_path / "c8", toks["llama3"], top_k=8)
    s_model = model("qwen", len(toks["qwen"]), 0)
    hidden = final_hidden_states(s_model, batch["input_ids"], batch["attention_mask"])
    loss = cross_tokenizer_divergence(shift_flat(hidden), lm_head(s_model)[0],
                                      labels=shift_labels(batch["labels"]), vocab_map=vmap,
                                      mode="uld", ce_weight=1.0, **cached.targets(batch))
    loss.backward()
    grads = [p.grad for p in s_model.parameters() if p.grad is not None]
    assert torch.isfinite(loss) and grads and all(torch.isfinite(g).all() for g in grads)


def byte_tokens(tok, text):
    """The text as the student might sample it: one byte-level token per byte."""
    from distill.xtok.vocab import _byte_level_alphabet

    inv = {b: c for c, b in _byte_level_alphabet().items()}
    return [tok.convert_tokens_to_ids(inv[b]) for b in text.encode()]


def test_on_policy_student_samples_are_retokenized_for_the_teacher(toks):
    s_tok, t_tok = toks["qwen"], toks["llama3"]
    enc = PairEncoder(ChatEncoder(s_tok), ChatEncoder(t_tok))
    s_prompt, t_prompt = enc.prompt(MESSAGES[:2])
    retok = Retokenizer(s_tok, t_tok, FAMILIES["qwen"][3], FAMILIES["llama3"][3])
    text = "Sure, 579. Café 日本"
    stop = s_tok.convert_tokens_to_ids("<|im_end|>")
    sample = byte_tokens(s_tok, text) + [stop]  # far from its canonical tokenization
    ex = retok.student_sample(s_prompt, sample, t_prompt)
    assert ex["input_ids"] == s_prompt + sample  # trained on exactly what it sampled
    assert ex["labels"][len(s_prompt):] == sample
    assert t_tok.decode(ex["teacher_input_ids"][len(t_prompt):]) == text + "<|eot_id|>"
    covered = sum(b - a for a, b, _, _ in ex["xtok_spans"])
    assert covered == len(sample)
    # cut inside a character: the teacher sees U+FFFD there, which is in no span
    cut = byte_tokens(s_tok, text)[:-1]
    ex = retok.student_sample(s_prompt, cut, t_prompt)
    texts = [s_tok.decode(ex["input_ids"][a:b]) for a, b, _, _ in ex["xtok_spans"]]
    assert "".join(texts) == "Sure, 579. Café 日"
    # teacher-written rows: the student's own tokens of the teacher's text
    t_sample = t_tok(text, add_special_tokens=False)["input_ids"] + [
        t_tok.convert_tokens_to_ids("<|eot_id|>")]
    ex = retok.teacher_sample(t_prompt, t_sample, s_prompt)
    assert s_tok.decode(ex["input_ids"][len(s_prompt):]) == text + "<|im_end|>"
    assert ex["xtok_counts"][0] == ex["xtok_counts"][1]
