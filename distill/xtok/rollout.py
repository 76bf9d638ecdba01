"""On-policy rollouts across tokenizers: the window's chosen rows rewritten by samples, each
re-tokenized for the other model and aligned (distill.xtok.onpolicy.Retokenizer).

The draws are the one-tokenizer rollout's (same seed, same rows chosen, same share written
by the teacher). The student samples after its own prompt, in its own tokens, and is trained
on exactly those; the teacher samples after its own prompt (its template's rendering of the
same messages), with its own stop tokens, and the student is trained on its own tokens of
that text. Rows not chosen keep their paired tokens and spans.
"""

from __future__ import annotations

import time

import torch

from distill.onpolicy.config import OnPolicyConfig
from distill.onpolicy.rollout import RolloutStats, prompt_length


def _rows(batches: list[dict]):
    """Per row: (batch index, student ids, labels, teacher ids, teacher labels, teacher
    prompt length, the row's spans)."""
    out = []
    for b, batch in enumerate(batches):
        s_len = batch["attention_mask"].sum(1).tolist()
        t_len = batch["teacher_attention_mask"].sum(1).tolist()
        spans = batch["xtok_spans"].tolist()
        for r in range(batch["input_ids"].shape[0]):
            out.append((b, batch["input_ids"][r, :s_len[r]].tolist(),
                        batch["labels"][r, :s_len[r]].tolist(),
                        batch["teacher_input_ids"][r, :t_len[r]].tolist(),
                        batch["teacher_labels"][r, :t_len[r]].tolist(),
                        int(batch["teacher_prompt_lengths"][r]),
                        [s[1:] for s in spans if s[0] == r]))
    return out


def cross_rollout(batches: list[dict], cfg: OnPolicyConfig, seed: int, retok, collate,
                  student_sampler, student, teacher_sampler, teacher, student_eos: list[int],
                  ) -> tuple[list[dict], RolloutStats]:
    start = time.perf_counter()
    rows = _rows(batches)
    g = torch.Generator().manual_seed(seed)
    draw, who = torch.rand(2, len(rows), generator=g).tolist()
    plens = [prompt_length(r[2]) for r in rows]
    chosen = [k for k, r in enumerate(rows) if plens[k] == len(r[1]) or draw[k] < cfg.fraction]
    by_teacher = [who[k] < cfg.teacher_fraction for k in chosen]
    s_prompts = [rows[k][1][:plens[k]] for k in chosen]
    t_prompts = [rows[k][3][:rows[k][5]] for k in chosen]
    completions: list = [None] * len(chosen)
    for src, sampler, model, prompts in ((False, student_sampler, student, s_prompts),
                                         (True, teacher_sampler, teacher, t_prompts)):
        idx = [i for i, t in enumerate(by_teacher) if t == src]
        if idx:
            done = sampler(model, [prompts[i] for i in idx], seed=seed + src)
            for i, c in zip(idx, done):
                completions[i] = c
    built = [dict(input_ids=r[1], labels=r[2], teacher_input_ids=r[3], teacher_labels=r[4],
                  xtok_spans=r[6], writer=0) for r in rows]
    for i, k in enumerate(chosen):
        if by_teacher[i]:
            ex = retok.teacher_sample(t_prompts[i], completions[i], s_prompts[i])
        else:
            ex = retok.student_sample(s_prompts[i], completions[i], t_prompts[i])
        built[k] = {**ex, "writer": 2 if by_teacher[i] else 1}
    stats = RolloutStats(rows=len(chosen), lengths=[len(c) for c in completions],
                         examples=[(s_prompts[i], completions[i], by_teacher[i])
                                   for i in range(len(chosen))])
    stats.tokens = sum(stats.lengths)
    stats.cut = sum(not c or (c[-1] not in student_eos and not t)
                    for c, t in zip(completions, by_teacher))
    out = []
    for b, batch in enumerate(batches):
        mine = [x for x, r in zip(built, rows) if r[0] == b]
        new = collate(mine)
        writer = torch.tensor([x["writer"] for x in mine])
        new.update({k: v for k, v in batch.items() if k not in new and k not in
                    ("sampled", "by_teacher")},
                   sampled=writer != 0, by_teacher=writer == 2)
        out.append(new)
    stats.seconds = time.perf_counter() - start
    return out, stats
