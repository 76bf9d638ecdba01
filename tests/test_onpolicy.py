"""On-policy rollouts: config checks, how rows are rewritten, the HF sampler (KV cache,
seeds, modes), the cached-teacher refusal and the CE-only arm that never samples."""

from __future__ import annotations

import functools

import pytest
import torch

from distill.core.rules import ConfigError, parse
from distill.models.causal_lm import load_causal_lm
from distill.onpolicy.config import OnPolicyConfig
from distill.onpolicy.rollout import prompt_length, rollout, window_seed
from distill.onpolicy.samplers import HFSampler, SamplingSettings
from distill.training.module import DistillModule
from distill.training.teachers import LiveTeacher

EOS = 3


@pytest.mark.parametrize("cfg,message", [
    ({"fraction": 1.5}, "loss.on_policy.fraction=1.5: must be a finite number >= 0 and <= 1"),
    ({"fraction": -0.1}, "loss.on_policy.fraction=-0.1: must be a finite number >= 0"),
    ({"top_p": 0.0}, "loss.on_policy.top_p=0.0: must be a finite number > 0 and <= 1"),
    ({"temperature": -1.0}, "loss.on_policy.temperature=-1.0: must be a finite number >= 0"),
    ({"max_new_tokens": 0}, "loss.on_policy.max_new_tokens=0: must be an integer >= 1"),
    ({"max_new_tokens": True}, "loss.on_policy.max_new_tokens=True: must be an integer >= 1"),
    ({"fractoin": 0.5}, r"loss.on_policy.fractoin: unknown key \(did you mean "
                        r"loss.on_policy.fraction\?\)"),
])
def test_bad_on_policy_settings_are_refused(cfg, message):
    with pytest.raises(ConfigError, match=message):
        parse(OnPolicyConfig, cfg, "loss.on_policy.")


def test_prompt_is_everything_before_the_first_trained_label():
    assert prompt_length([-100, -100, -100, 7, 8, -100, 9]) == 3
    assert prompt_length([-100] * 5) == 5  # prompt only: every token
    assert prompt_length([4, 5, 6]) == 1  # CPT: position 0 predicts nothing; the first token


class TableSampler:
    """Deterministic completions that depend on the prompt and the seed only; records calls."""

    def __init__(self, max_new_tokens=4):
        self.calls, self.max_new_tokens = [], max_new_tokens

    def __call__(self, model, prompts, *, seed):
        self.calls.append((prompts, seed))
        out = []
        for p in prompts:
            n = (sum(p) + seed) % (self.max_new_tokens + 1) + 1  # 1..max+1 tokens
            tokens = [10 + (t + seed) % 20 for t in range(n)]
            out.append(tokens[: self.max_new_tokens] if n > self.max_new_tokens
                       else tokens[:-1] + [EOS])
        return out


def _window():
    sft = {"input_ids": torch.tensor([[1, 5, 6, 7, 8, 0], [1, 5, 7, 9, 0, 0]]),
           "attention_mask": torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]]),
           "labels": torch.tensor([[-100, -100, -100, 7, 8, -100],
                                   [-100, -100, 7, 9, -100, -100]]),
           "example_id": ["a", "b"]}
    prompts = {"input_ids": torch.tensor([[1, 6, 6, 2], [1, 7, 3, 0]]),
               "attention_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]),
               "labels": torch.full((2, 4), -100)}
    return [sft, prompts]



def test_rewritten_rows_are_padded_to_the_width_multiple_and_capped():
    """The rollout's batches take the loader's width rule (distill.data.collate): their
    longest row rounded up to `multiple`, never past `cap` unless a row is longer."""
    cfg = OnPolicyConfig(fraction=1.0, max_new_tokens=4)
    plain, _ = rollout(_window(), cfg, 13, 0, [EOS], TableSampler(), None)
    padded, _ = rollout(_window(), cfg, 13, 0, [EOS], TableSampler(), None, multiple=8)
    capped, _ = rollout(_window(), cfg, 13, 0, [EOS], TableSampler(), None, multiple=8, cap=7)
    for a, b, c in zip(plain, padded, capped):
        n = a["input_ids"].shape[1]
        assert n == int(a["attention_mask"].sum(1).max())  # multiple=1: the longest row
        assert b["input_ids"].shape[1] == -(-n // 8) * 8 and c["input_ids"].shape[1] == max(n, 7)
        for got in (b, c):
            assert torch.equal(got["input_ids"][:, :n], a["input_ids"])
            assert torch.equal(got["labels"][:, :n], a["labels"])
            assert not got["attention_mask"][:, n:].any() and (got["labels"][:, n:] == -100).all()

# TableSampler at seed 13 (4 new tokens at most): [1, 5, 6] and [1, 6, 6, 2] end with an eos,
# [1, 5] and [1, 7, 3] are cut; the two prompt-only rows are always sampled, so every
# fraction's rollout has both kinds of ending
ENDS_WITH_EOS = {(1, 5, 6): True, (1, 5): False, (1, 6, 6, 2): True, (1, 7, 3): False}


@pytest.mark.parametrize("fraction", [0.0, 0.3, 1.0])  # none, one, both of the SFT rows
def test_rollout_rewrites_the_chosen_rows(fraction):
    sampler, window = TableSampler(), _window()
    cfg = OnPolicyConfig(fraction=fraction, max_new_tokens=4)
    out, stats = rollout(window, cfg, 13, 0, [EOS], sampler, None)
    g = torch.Generator().manual_seed(13)
    draw = torch.rand(4, generator=g).tolist()
    chosen = [draw[0] < fraction, draw[1] < fraction, True, True]  # prompt-only rows: always
    assert chosen[:2] == {0.0: [False, False], 0.3: [True, False], 1.0: [True, True]}[fraction]
    assert len(sampler.calls) == 1  # one call for the whole window
    prompts = [[1, 5, 6], [1, 5], [1, 6, 6, 2], [1, 7, 3]]
    assert sampler.calls[0][0] == [p for p, c in zip(prompts, chosen) if c]
    comps = sampler(None, [p for p, c in zip(prompts, chosen) if c], seed=13)
    assert [c[-1] == EOS for c in comps] == [ENDS_WITH_EOS[tuple(p)]
                                             for p, c in zip(prompts, chosen) if c]
    completions = iter(comps)
    originals = [(window[0], 0), (window[0], 1), (window[1], 0), (window[1], 1)]
    got_rows = [(out[0], 0), (out[0], 1), (out[1], 0), (out[1], 1)]
    for (src, i), (dst, j), prompt, c in zip(originals, got_rows, prompts, chosen):
        real = int(dst["attention_mask"][j].sum())
        ids, labels = dst["input_ids"][j, :real].tolist(), dst["labels"][j, :real].tolist()
        assert dst["attention_mask"][j, :real].all() and not dst["attention_mask"][j, real:].any()
        assert (dst["labels"][j, real:] == -100).all()
        assert bool(dst["sampled"][j]) == c
        if c:
            comp = next(completions)
            assert ids == prompt + comp
            assert labels == [-100] * len(prompt) + comp
        else:
            n = int(src["attention_mask"][i].sum())
            assert ids == src["input_ids"][i, :n].tolist()
            assert labels == src["labels"][i, :n].tolist()
    assert out[0]["example_id"] == ["a", "b"]
    assert stats.rows == sum(chosen) and stats.tokens == sum(len(c) for c in comps)
    assert 0 < stats.cut < len(comps)  # both kinds of ending, at every fraction
    assert stats.cut == sum(not ENDS_WITH_EOS[tuple(p)] for p, c in zip(prompts, chosen) if c)


def test_rollout_refuses_packed_and_left_padded_rows():
    window = _window()
    packed = [{**window[0], "position_ids": torch.zeros_like(window[0]["input_ids"])}]
    with pytest.raises(ValueError, match="set data.packing=false"):
        rollout(packed, OnPolicyConfig(fraction=1.0), 0, 0, [EOS], TableSampler(), None)
    left = [{**window[1], "attention_mask": torch.tensor([[0, 1, 1, 1], [1, 1, 1, 0]])}]
    with pytest.raises(ValueError, match="need right-padded rows"):
        rollout(left, OnPolicyConfig(fraction=1.0), 0, 0, [EOS], TableSampler(), None)


def test_window_seed_depends_on_every_part():
    seeds = {window_seed(b, e, s, r) for b in (0, 1) for e in (0, 1) for s in (0, 7)
             for r in (0, 1)}
    assert len(seeds) == 16
    assert window_seed(3, 1, 2, 0) == window_seed(3, 1, 2, 0)


@functools.lru_cache(maxsize=1)
def _student(path: str):
    return load_causal_lm(path)


def _sampler(model, temperature=1.0, top_p=1.0, n=6, vocab=None):
    return HFSampler(SamplingSettings(temperature, top_p, n, [model.config.eos_token_id], 0,
                                      vocab))


def test_sampler_is_seeded_restores_modes_and_rng(tiny_assets):
    model = _student(str(tiny_assets["student"]))
    model.train()
    prompts = [[1, 5, 9, 12], [1, 7], [4, 4, 4, 4, 4, 4, 4]]
    sample = _sampler(model)
    rng = torch.random.get_rng_state()
    a, b, c = sample(model, prompts, seed=5), sample(model, prompts, seed=5), \
        sample(model, prompts, seed=6)
    assert a == b and a != c
    assert torch.equal(rng, torch.random.get_rng_state())  # the global stream is untouched
    assert model.training and all(p.grad is None for p in model.parameters())
    for row in a:
        eos = model.config.eos_token_id
        assert 1 <= len(row) <= 6 and eos not in row[:-1]


def test_sampler_draws_only_from_the_top_p_nucleus(tiny_assets):
    """top_p: every sampled token is in the smallest set of the model's most likely next
    tokens holding top_p of the mass (computed here from the model's own logits); without
    it (top_p=1) the same draws leave that set."""
    model = _student(str(tiny_assets["student"]))
    prompt = [1, 5, 9, 12]
    with torch.no_grad():
        probs = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].double(), -1)
    order = probs.argsort(descending=True)
    inside = int((probs[order].cumsum(0) < 0.2).sum()) + 1
    nucleus = set(order[:inside].tolist())
    assert 1 < len(nucleus) < len(probs) // 2
    firsts = {row[0] for row in _sampler(model, top_p=0.2, n=1)(model, [prompt] * 64, seed=3)}
    assert firsts <= nucleus and len(firsts) > 1
    free = {row[0] for row in _sampler(model, top_p=1.0, n=1)(model, [prompt] * 64, seed=3)}
    assert not free <= nucleus


def test_a_sample_ends_at_its_first_stop_token(tiny_assets):
    """A completion stops at the first of its stop tokens (the stop token kept, nothing
    after it), whatever the other rows of the batch still write. Seeded draws: a row is the
    same up to its stop whichever tokens stop it."""
    model = _student(str(tiny_assets["student"]))
    prompts = [[1, 5, 9, 12], [1, 7], [4, 4, 4, 4, 4, 4, 4]]
    eos = model.config.eos_token_id

    def sample(stops):
        return HFSampler(SamplingSettings(1.0, 1.0, 6, stops, 0))(model, prompts, seed=4)

    free = sample([eos])
    # a token first written after the start of a row, before its end: made a stop token
    row, j = next((r, j) for r in free for j in range(1, len(r) - 1)
                  if r[j] not in r[:j] and eos not in r[:j + 1])
    stop = row[j]
    got = sample([eos, stop])

    def cut(tokens):
        ends = [i for i, t in enumerate(tokens) if t in (eos, stop)]
        return tokens[: ends[0] + 1] if ends else tokens

    assert got == [cut(f) for f in free]
    assert row[:j + 1] in got  # that row stopped there, before max_new_tokens


def _greedy_without_cache(model, prompt, n, eos):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1]
            ids.append(int(logits.argmax()))
            if ids[-1] == eos:
                break
    return ids[len(prompt):]


def test_greedy_sampler_with_kv_cache_matches_a_loop_without_cache(tiny_assets):
    model = _student(str(tiny_assets["student"]))
    torch.manual_seed(0)
    with torch.no_grad():  # a sharper model, so greedy paths are not all one token
        for p in model.parameters():
            p.mul_(4)
    try:
        prompts = [[1, 5, 9, 12, 30], [1, 7], [4, 40, 4, 41, 4, 42, 4]]
        got = _sampler(model, temperature=0.0, n=8)(model, prompts, seed=0)
        eos = model.config.eos_token_id
        assert got == [_greedy_without_cache(model, p, 8, eos) for p in prompts]
        assert len({tuple(g) for g in got}) > 1
    finally:
        with torch.no_grad():
            for p in model.parameters():
                p.div_(4)


def test_sampler_never_draws_ids_past_the_tokenizer(tiny_assets):
    model = _student(str(tiny_assets["student"]))
    vocab = 12  # pretend the head's later rows are padding
    out = _sampler(model, n=16, vocab=vocab)(model, [[1, 2, 3]] * 8, seed=1)
    assert all(t < vocab for row in out for t in row[:-1] if t != model.config.eos_token_id)
    assert max(t for row in out for t in row) < max(vocab, model.config.eos_token_id + 1)


def _module(tiny_assets, teacher, **loss):
    student = load_causal_lm(str(tiny_assets["student"]))
    return DistillModule(student, teacher, loss={"kind": "reverse_kl", **loss},
                         optimizer=functools.partial(torch.optim.SGD, lr=0.0),
                         vocab_size=student.config.vocab_size)


def test_on_policy_needs_a_live_teacher(tiny_assets):
    class Cached(torch.nn.Module):
        model = None

    with pytest.raises(ValueError, match="needs a live teacher to score the student's samples"):
        _module(tiny_assets, Cached(), on_policy={"fraction": 0.5})
    _module(tiny_assets, Cached(), on_policy={"fraction": 0.0})  # teacher-forced: fine


def test_on_policy_with_cached_teacher_fails_at_start(compose_cfg):
    from distill.train import train

    with pytest.raises(ValueError, match="needs a live teacher"):
        train(compose_cfg("+experiment=offline_fkl", "loss.on_policy.fraction=1.0"))


class SpyTeacher(LiveTeacher):
    calls = 0

    def targets(self, batch):
        SpyTeacher.calls += 1
        return super().targets(batch)


def test_ce_only_with_the_students_own_samples_is_refused(tiny_assets):
    """CE-only trains nothing on the student's own samples (no divergence, no CE on them):
    the combination is refused, pointing to ce_only and seqkd."""
    teacher = SpyTeacher(str(tiny_assets["teacher"]))
    with pytest.raises(ConfigError, match=r"the student's own samples would train nothing.*"
                       r"\+baseline=ce_only.*\+baseline=seqkd"):
        _module(tiny_assets, teacher, on_policy={"fraction": 1.0}, divergence_weight=0.0,
                ce_weight=1.0)


def test_ce_only_arm_never_samples_nor_runs_the_teacher(tiny_assets):
    teacher = SpyTeacher(str(tiny_assets["teacher"]))
    module = _module(tiny_assets, teacher, on_policy={"fraction": 0.0}, divergence_weight=0.0,
                     ce_weight=1.0)
    assert not module.rewrites_windows and module.onpolicy is None
    window = _window()
    batch = {k: v for k, v in window[0].items() if k != "example_id"}
    batch["input_ids"] = batch["input_ids"] + 10
    batch["labels"] = torch.where(batch["labels"] >= 0, batch["input_ids"], -100)
    weights = (batch["labels"][:, 1:] != -100).flatten().float()
    SpyTeacher.calls = 0
    loss, parts, _ = module.objective.train(module.student, batch, weights)
    assert SpyTeacher.calls == 0
    # the loss is the plain cross-entropy of the labels, in float64
    with torch.no_grad():
        logits = module.student(batch["input_ids"],
                                attention_mask=batch["attention_mask"]).logits.double()
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1),
                                           batch["labels"][:, 1:].flatten(), reduction="sum")
    torch.testing.assert_close(loss.double(), ce, rtol=1e-5, atol=1e-6)


def test_teacher_fraction_lets_the_teacher_write_some_samples():
    class BySource(TableSampler):
        def __call__(self, model, prompts, *, seed):
            self.calls.append((model, prompts, seed))
            return [[40 if model == "teacher" else 41, EOS] for _ in prompts]

    window = [{"input_ids": torch.tensor([[1, 6, 6, 2]] * 8),
               "attention_mask": torch.ones(8, 4, dtype=torch.long),
               "labels": torch.full((8, 4), -100)}]
    for share in (0.0, 0.5, 1.0):
        sampler = BySource()
        cfg = OnPolicyConfig(fraction=1.0, teacher_fraction=share)
        out, _ = rollout(window, cfg, 5, 0, [EOS], sampler, "student", sampler, "teacher")
        who = torch.rand(2, 8, generator=torch.Generator().manual_seed(5))[1] < share
        assert torch.equal(out[0]["by_teacher"], who) and out[0]["sampled"].all()
        assert out[0]["input_ids"][:, 4].tolist() == [40 if w else 41 for w in who]
        assert [c[0] for c in sampler.calls] == [m for m, n in (("student", (~who).sum()),
                                                                ("teacher", who.sum())) if n]
    with pytest.raises(ValueError, match="teacher_fraction > 0 needs the teacher model"):
        rollout(window, OnPolicyConfig(fraction=1.0, teacher_fraction=1.0), 5, 0, [EOS],
                BySource(), "student")


@pytest.mark.gpu
def test_on_policy_trains_on_the_gpu_under_bf16_autocast(compose_cfg, tmp_path):
    """The rollout runs under the training autocast on the GPU; the step is finite and logs
    the rollout/train split."""
    import pandas as pd

    from distill.train import train

    out = tmp_path / "gpu"
    summary = train(compose_cfg("+experiment=onpolicy_rkl", "trainer=gpu",
                                "trainer.max_steps=4", "loss.on_policy.teacher_fraction=0",
                                out=out))
    assert summary["global_step"] == 4
    df = pd.read_csv(next(out.glob("logs/version_*/metrics.csv")))
    for key in ("train/loss", "time/rollout_s", "time/train_s", "rollout/mean_length",
                "rollout/cut_fraction", "rollout/teacher_logprob"):
        values = torch.tensor(df[key].dropna().tolist())
        assert len(values) == 4 and torch.isfinite(values).all(), key


def test_on_policy_without_the_counter_is_an_error(tiny_assets):
    import lightning as L
    from torch.utils.data import DataLoader

    module = _module(tiny_assets, LiveTeacher(str(tiny_assets["teacher"])),
                     on_policy={"fraction": 1.0})
    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False)
    with pytest.raises(RuntimeError, match="samples each step's window before it trains it, "
                       "and this train loader hands out no windows"):
        trainer.fit(module, train_dataloaders=DataLoader(_window()[:1], batch_size=None))


@pytest.mark.parametrize("setting,expected", [(None, 1), (8, 8)])  # on the CPU
def test_the_step_pads_rewritten_rows_as_the_run_asks(setting, expected, monkeypatch):
    """OnPolicyStep hands the rollout data.pad_to_multiple_of (null: the device's rule) and
    the student's positions as the cap."""
    import distill.onpolicy.step as step_mod
    from distill.data.windows import Window, WindowInfo
    from distill.onpolicy.step import OnPolicyStep
    from tests.test_levers import tiny_llama

    seen = {}

    def fake_rollout(batches, cfg, seed, pad, eos, *samplers, multiple, cap):
        seen.update(multiple=multiple, cap=cap)
        return batches, None

    monkeypatch.setattr(step_mod, "rollout", fake_rollout)
    student = tiny_llama()
    step = OnPolicyStep(OnPolicyConfig(fraction=1.0), student, tiny_llama(seed=1),
                        vocab_size=97, eos_token_id=2, pad_to_multiple_of=setting)
    window = Window(_window(), None)
    info = WindowInfo(epoch=0, number=0, start=0, index=0, size=2, first=True, window=window,
                      owner=None)
    step(student, info, 0)
    assert student.config.max_position_embeddings == 64
    assert seen == {"multiple": expected, "cap": 64}
