"""On-policy rollouts: the student writes the completions it is then trained on.

GKD (Agarwal et al., 2024): with on-policy distillation the student samples completions
for the batch's prompts and the live teacher scores every sampled token, so the student
learns on the prefixes it produces itself, not only on the dataset's. A row's prompt is
its tokens before the first trained label (a prompt-only row: all its tokens); the sampled
tokens become the row's labels, the prompt stays masked.

`rollout` turns one optimizer step's window of micro-batches into their on-policy version.
The module calls it at the window's first micro-batch, before the window's tokens are
counted, so the normalization is exact. One sampler call per model covers the whole
window, so the completions do not depend on how the window is split into micro-batches.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from distill.core.constants import IGNORE_INDEX
from distill.data.collate import pad, padded_width
from distill.onpolicy.config import OnPolicyConfig

WIDTH_KEYS = ("input_ids", "attention_mask", "labels")
DATASET, STUDENT, TEACHER = 0, 1, 2  # who wrote a row


@dataclass
class RolloutStats:
    rows: int = 0  # sampled rows
    tokens: int = 0  # sampled tokens (the trained positions of those rows)
    cut: int = 0  # completions stopped by max_new_tokens, not by an eos
    seconds: float = 0.0
    lengths: list[int] = field(default_factory=list)
    examples: list[tuple[list[int], list[int], bool]] = field(default_factory=list)


def window_seed(base: int, epoch: int, step: int, rank: int) -> int:
    """One seed per (run seed, epoch, step in the epoch, rank): independent of K's split of
    the window into micro-batches, and the same again when a run resumes."""
    h = base
    for x in (epoch, step, rank):
        h = (h * 1_000_003 + x + 1) % (1 << 62)
    return h


def prompt_length(labels: list[int]) -> int:
    """Tokens before the first trained label of a row's real tokens (labels[t] is token t,
    predicted at t - 1); all of them for a row without labels."""
    for t in range(1, len(labels)):
        if labels[t] != IGNORE_INDEX:
            return t
    return len(labels)


def _rows(batches: list[dict]) -> list[tuple[int, list[int], list[int]]]:
    """(batch index, token ids, labels) of every row's real tokens, as plain lists."""
    rows = []
    for b, batch in enumerate(batches):
        if "position_ids" in batch:
            raise ValueError("on-policy distillation samples one completion per row, and "
                             "packed rows hold several examples: set data.packing=false")
        ids, labels = batch["input_ids"].tolist(), batch["labels"].tolist()
        attn = batch.get("attention_mask")
        lengths = [len(r) for r in ids] if attn is None else attn.sum(1).tolist()
        right = attn is None or bool((attn.bool() == (torch.arange(attn.shape[1])[None]
                                                      < attn.sum(1, keepdim=True))).all())
        if not right:
            raise ValueError("on-policy rollouts need right-padded rows (attention_mask "
                             "1 then 0); this batch is padded on the left")
        rows += [(b, r[:n], lab[:n]) for r, lab, n in zip(ids, labels, lengths)]
    return rows


def rollout(batches: list[dict], cfg: OnPolicyConfig, seed: int, pad_id: int,
            eos_ids: list[int], student_sampler, student, teacher_sampler=None,
            teacher=None, multiple: int = 1,
            cap: int | None = None) -> tuple[list[dict], RolloutStats]:
    """The window's micro-batches with the chosen rows rewritten by the student, or by the
    teacher for a `cfg.teacher_fraction` share of them. Each batch gains `sampled` (B,) bool
    (a sample) and `by_teacher` (B,) bool (the teacher's); its width is its longest row
    rounded up to `multiple` (distill.data.collate.width_multiple says why), never past
    `cap` (the student's positions) unless the row itself is."""
    start = time.perf_counter()
    rows = _rows(batches)
    plens = [prompt_length(lab) for _, _, lab in rows]
    g = torch.Generator().manual_seed(seed)
    draw, who = torch.rand(2, len(rows), generator=g).tolist()
    chosen = [k for k, (_, ids, _) in enumerate(rows)
              if plens[k] == len(ids) or draw[k] < cfg.fraction]
    by_teacher = [who[k] < cfg.teacher_fraction for k in chosen]
    if any(by_teacher) and teacher is None:
        raise ValueError("loss.on_policy.teacher_fraction > 0 needs the teacher model")
    prompts = [rows[k][1][: plens[k]] for k in chosen]
    completions: list = [None] * len(chosen)
    for src, sampler, model in ((False, student_sampler, student),
                                (True, teacher_sampler, teacher)):
        idx = [i for i, t in enumerate(by_teacher) if t == src]
        if idx:
            done = sampler(model, [prompts[i] for i in idx], seed=seed + src)
            for i, c in zip(idx, done):
                completions[i] = c
    stats = RolloutStats(rows=len(chosen), lengths=[len(c) for c in completions],
                         examples=list(zip(prompts, completions, by_teacher)))
    stats.tokens = sum(stats.lengths)
    stats.cut = sum(not c or c[-1] not in eos_ids for c in completions)
    built = [(ids, lab, DATASET) for _, ids, lab in rows]
    for k, p, c, t in zip(chosen, prompts, completions, by_teacher):
        built[k] = (p + list(c), [IGNORE_INDEX] * len(p) + list(c), TEACHER if t else STUDENT)
    out = []
    for b, batch in enumerate(batches):
        out.append(_collate(batch, [x for x, r in zip(built, rows) if r[0] == b], pad_id,
                            multiple, cap))
    stats.seconds = time.perf_counter() - start
    return out, stats


def _collate(batch: dict, built: list, pad_id: int, multiple: int = 1,
             cap: int | None = None) -> dict:
    """Right-padded tensors from (ids, labels, writer) rows; other keys kept as they are."""
    width = padded_width(max((len(r) for r, _, _ in built), default=0), multiple, cap)
    ids, attn = pad([r for r, _, _ in built], pad_id, width)
    labels, _ = pad([lab for _, lab, _ in built], IGNORE_INDEX, width)
    out = {k: v for k, v in batch.items() if k not in WIDTH_KEYS}
    source = torch.tensor([s for _, _, s in built])
    out.update(input_ids=ids, attention_mask=attn, labels=labels, sampled=source != DATASET,
               by_teacher=source == TEACHER)
    return out
