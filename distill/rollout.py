"""On-policy rollouts: the student writes the completions it is then trained on.

GKD (Agarwal et al., 2024): with on-policy distillation the student samples completions
for the batch's prompts and the live teacher scores every sampled token, so the student
learns on the prefixes it produces itself, not only on the dataset's. A row's prompt is
its tokens before the first trained label (a prompt-only row: all its tokens); the sampled
tokens become the row's labels, the prompt stays masked.

`rollout` turns one optimizer step's window of micro-batches into their on-policy version.
The StepTokenCounter calls it (through `DistillModule.rollout_window`) before counting the
window, so the step's token counts, and with them the normalization, are exact.

Sampling stands behind a small interface, `Sampler`: prompts (token ids) in, completions
(token ids) out. `HFSampler` runs the student's own `generate` (KV cache, eval mode, no
grad). An inference engine can stand behind the same call: a vLLM sampler would hold an
`LLM` built from the student's config, copy the student's weights into it before each
rollout (`llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights`,
or a weight-sync collective when the engine runs on other GPUs), and call
`llm.generate(prompt_token_ids, SamplingParams(temperature, top_p, max_tokens, seed))`.
Nothing else in the package would change.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

IGNORE_INDEX = -100
WIDTH_KEYS = ("input_ids", "attention_mask", "labels")


@dataclass(frozen=True)
class OnPolicy:
    """`loss.on_policy`: the share of rows the student rewrites, and how it samples.

    `fraction` (GKD's lambda) is the chance that a row with labels is replaced by a
    sample; 0 is plain teacher-forced distillation. Rows without any label (prompt only)
    have nothing to teacher-force, so with fraction > 0 they are always sampled.
    `teacher_fraction` is the chance that a sampled row's completion is written by the
    teacher instead of the student (GKD's mixed data; 1 is sequence-level KD on the
    teacher's answers, 0 is purely on-policy). Either way the teacher scores every token.
    """

    fraction: float = 0.0
    teacher_fraction: float = 0.0
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    max_new_tokens: int = 32
    seed: int = 0  # combined with (epoch, step, rank): a resumed run samples the same

    @classmethod
    def from_config(cls, cfg: dict | None) -> OnPolicy:
        cfg = dict(cfg or {})
        unknown = set(cfg) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"loss.on_policy has no key(s) {sorted(unknown)}: the keys are "
                             f"{', '.join(cls.__dataclass_fields__)}")
        out = cls(**cfg)
        checks = [
            ("fraction", 0 <= out.fraction <= 1, "a number in [0, 1]"),
            ("teacher_fraction", 0 <= out.teacher_fraction <= 1, "a number in [0, 1]"),
            ("temperature", out.temperature >= 0, ">= 0 (0 samples greedily)"),
            ("top_p", 0 < out.top_p <= 1, "in (0, 1]"),
            ("max_new_tokens", isinstance(out.max_new_tokens, int) and out.max_new_tokens >= 1,
             "an integer >= 1"),
        ]
        for key, ok, allowed in checks:
            if isinstance(getattr(out, key), bool) or not ok:
                raise ValueError(f"loss.on_policy.{key}={getattr(out, key)!r} is out of range: "
                                 f"it must be {allowed}")
        return out


def check_config(cfg) -> None:
    """Before anything loads: the on-policy settings are valid, and a run that samples has a
    live teacher (a cached one knows only the dataset's tokens, not the student's)."""
    loss = cfg.get("loss") or {}
    on_policy = OnPolicy.from_config(loss.get("on_policy"))
    samples = on_policy.fraction > 0 and float(loss.get("divergence_weight", 1.0)) != 0.0
    target = str((cfg.get("teacher") or {}).get("_target_", ""))
    if samples and target.endswith("CachedTeacher"):
        raise ValueError(NEEDS_LIVE_TEACHER.format(on_policy.fraction))


NEEDS_LIVE_TEACHER = ("loss.on_policy.fraction={} needs a live teacher to score the student's "
               "samples; a cached teacher only knows the dataset's tokens. Use a live teacher "
               "(teacher=demo or teacher=hf) or set loss.on_policy.fraction=0")


class Sampler(Protocol):
    """Prompts in (token ids), one completion per prompt out (token ids, ending with the eos
    token when the model stopped). `seed` fixes the draws: same seed, same completions."""

    def __call__(self, model, prompts: list[list[int]], *, seed: int) -> list[list[int]]: ...


@dataclass
class HFSampler:
    """The student's own `generate`: left-padded prompts, KV cache, eval mode, no grad."""

    temperature: float
    top_p: float
    max_new_tokens: int
    eos_token_ids: list[int]
    pad_token_id: int
    vocab_size: int | None = None  # ids past the tokenizer (padded head rows) never sampled

    def __call__(self, model, prompts, *, seed):
        from transformers import GenerationConfig

        device = next(model.parameters()).device
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            attn[i, width - len(p):] = 1
        rows = model.get_output_embeddings().weight.shape[0]
        suppress = list(range(self.vocab_size, rows)) if self.vocab_size else []
        greedy = self.temperature == 0
        config = GenerationConfig(
            do_sample=not greedy, temperature=None if greedy else self.temperature,
            top_p=None if greedy else self.top_p, top_k=None,
            max_new_tokens=self.max_new_tokens, eos_token_id=self.eos_token_ids,
            pad_token_id=self.pad_token_id, suppress_tokens=suppress or None)
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), _seeded(seed, device):
                out = model.generate(input_ids=ids.to(device), attention_mask=attn.to(device),
                                     generation_config=config)
        finally:
            model.train(was_training)
        return [_until_eos(row, self.eos_token_ids) for row in out[:, width:].tolist()]


class _seeded:
    """The global generators of CPU and the model's device set to `seed`, restored after:
    `generate` draws from them and takes no generator of its own."""

    def __init__(self, seed: int, device: torch.device):
        self.seed, self.cuda = seed, device.type == "cuda"
        self.device = device

    def __enter__(self):
        self.cpu_state = torch.random.get_rng_state()
        torch.random.default_generator.manual_seed(self.seed)
        if self.cuda:
            self.cuda_state = torch.cuda.get_rng_state(self.device)
            torch.cuda.default_generators[self.device.index or 0].manual_seed(self.seed)

    def __exit__(self, *exc):
        torch.random.set_rng_state(self.cpu_state)
        if self.cuda:
            torch.cuda.set_rng_state(self.cuda_state, self.device)


def _until_eos(tokens: list[int], eos: list[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def window_seed(base: int, epoch: int, step: int, rank: int) -> int:
    """One seed per (run seed, epoch, step in the epoch, rank): independent of K's split of
    the window into micro-batches, and the same again when a run resumes."""
    h = base
    for x in (epoch, step, rank):
        h = (h * 1_000_003 + x + 1) % (1 << 62)
    return h


@dataclass
class RolloutStats:
    rows: int = 0  # sampled rows
    tokens: int = 0  # sampled tokens (the trained positions of those rows)
    cut: int = 0  # completions stopped by max_new_tokens, not by an eos
    seconds: float = 0.0
    lengths: list[int] = field(default_factory=list)


def prompt_length(labels: list[int], ignore_index: int = IGNORE_INDEX) -> int:
    """Tokens before the first trained label of a row's real tokens (labels[t] is token t,
    predicted at t - 1); all of them for a row without labels."""
    for t in range(1, len(labels)):
        if labels[t] != ignore_index:
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


def rollout(batches: list[dict], sampler, model, cfg: OnPolicy, seed: int, pad_id: int,
            eos_ids: list[int], ignore_index: int = IGNORE_INDEX, teacher=None,
            ) -> tuple[list[dict], RolloutStats]:
    """The window's micro-batches with the chosen rows rewritten by the student (`model`),
    or by `teacher` for a `cfg.teacher_fraction` share of them.

    One sampler call per model covers the whole window, so the completions do not depend on
    how the window is split into micro-batches. Each batch gains `sampled` (B,) bool.
    """
    start = time.perf_counter()
    rows = _rows(batches)
    plens = [prompt_length(lab, ignore_index) for _, _, lab in rows]
    g = torch.Generator().manual_seed(seed)
    draw, who = torch.rand(2, len(rows), generator=g).tolist()
    chosen = [k for k, (_, ids, _) in enumerate(rows)
              if plens[k] == len(ids) or draw[k] < cfg.fraction]
    by_teacher = [who[k] < cfg.teacher_fraction for k in chosen]
    if any(by_teacher) and teacher is None:
        raise ValueError("loss.on_policy.teacher_fraction > 0 needs the teacher model")
    prompts = [rows[k][1][: plens[k]] for k in chosen]
    completions: list = [None] * len(chosen)
    for src, model_ in ((False, model), (True, teacher)):
        idx = [i for i, t in enumerate(by_teacher) if t == src]
        if idx:
            done = sampler(model_, [prompts[i] for i in idx], seed=seed + src)
            for i, c in zip(idx, done):
                completions[i] = c
    stats = RolloutStats(rows=len(chosen), lengths=[len(c) for c in completions])
    stats.tokens = sum(stats.lengths)
    stats.cut = sum(not c or c[-1] not in eos_ids for c in completions)
    built = [(ids, lab, 0) for _, ids, lab in rows]  # 0: dataset, 1: student, 2: teacher
    for k, p, c, t in zip(chosen, prompts, completions, by_teacher):
        built[k] = (p + list(c), [ignore_index] * len(p) + list(c), 2 if t else 1)
    out = []
    for b, batch in enumerate(batches):
        out.append(_collate(batch, [x for x, r in zip(built, rows) if r[0] == b], pad_id,
                            ignore_index))
    stats.seconds = time.perf_counter() - start
    return out, stats


def _collate(batch: dict, built: list, pad_id: int, ignore_index: int) -> dict:
    """Right-padded tensors from (ids, labels, source) rows; other keys kept as they are.
    `sampled` (B,) marks generated rows, `by_teacher` (B,) those the teacher wrote."""
    width = max(len(ids) for ids, _, _ in built)
    ids = torch.tensor([r + [pad_id] * (width - len(r)) for r, _, _ in built])
    labels = torch.tensor([lab + [ignore_index] * (width - len(lab)) for _, lab, _ in built])
    attn = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r, _, _ in built])
    out = {k: v for k, v in batch.items() if k not in WIDTH_KEYS}
    source = torch.tensor([s for _, _, s in built])
    out.update(input_ids=ids, attention_mask=attn, labels=labels, sampled=source > 0,
               by_teacher=source == 2)
    return out
