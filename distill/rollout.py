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
    student sample; 0 is plain teacher-forced distillation. Rows without any label (prompt
    only) have nothing to teacher-force, so with fraction > 0 they are always sampled.
    """

    fraction: float = 0.0
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


def prompt_length(labels: torch.Tensor, real: int, ignore_index: int = IGNORE_INDEX) -> int:
    """Tokens before the first trained label (labels[t] is token t, predicted at t - 1);
    all `real` tokens for a row without labels."""
    trained = (labels[1:real] != ignore_index).nonzero()
    return int(trained[0]) + 1 if len(trained) else real


def rollout(batches: list[dict], sampler, model, cfg: OnPolicy, seed: int, pad_id: int,
            eos_ids: list[int], ignore_index: int = IGNORE_INDEX,
            ) -> tuple[list[dict], RolloutStats]:
    """The window's micro-batches with the chosen rows rewritten by the student.

    One sampler call covers the whole window, so the completions do not depend on how the
    window is split into micro-batches. Each batch gains `sampled` (B,) bool.
    """
    start = time.perf_counter()
    rows = []  # (batch index, row index, token ids, labels, prompt length)
    for b, batch in enumerate(batches):
        if "position_ids" in batch:
            raise ValueError("on-policy distillation samples one completion per row, and "
                             "packed rows hold several examples: set data.packing=false")
        attn = batch.get("attention_mask")
        for i in range(batch["input_ids"].shape[0]):
            real = int(attn[i].sum()) if attn is not None else batch["input_ids"].shape[1]
            if attn is not None and not bool(attn[i, :real].all()):
                raise ValueError("on-policy rollouts need right-padded rows (attention_mask "
                                 "1 then 0); this batch is padded on the left")
            labels = batch["labels"][i, :real]
            rows.append((b, i, batch["input_ids"][i, :real], labels,
                         prompt_length(labels, real, ignore_index)))
    g = torch.Generator().manual_seed(seed)
    draw = torch.rand(len(rows), generator=g)
    chosen = [k for k, r in enumerate(rows)
              if r[4] == len(r[3]) or float(draw[k]) < cfg.fraction]
    completions = sampler(model, [rows[k][2][: rows[k][4]].tolist() for k in chosen],
                          seed=seed) if chosen else []
    new = {k: c for k, c in zip(chosen, completions)}
    stats = RolloutStats(rows=len(chosen))
    for c in completions:
        stats.lengths.append(len(c))
        stats.tokens += len(c)
        stats.cut += int(not c or c[-1] not in eos_ids)
    out = []
    for b, batch in enumerate(batches):
        members = [(k, r) for k, r in enumerate(rows) if r[0] == b]
        built = [_rewritten(r, new.get(k), ignore_index) for k, r in members]
        out.append(_collate(batch, built, [k in new for k, _ in members], pad_id,
                            ignore_index))
    stats.seconds = time.perf_counter() - start
    return out, stats


def _rewritten(row, completion, ignore_index):
    _, _, ids, labels, plen = row
    if completion is None:
        return ids.tolist(), labels.tolist()
    return (ids[:plen].tolist() + completion, [ignore_index] * plen + list(completion))


def _collate(batch: dict, built: list, sampled: list[bool], pad_id: int, ignore_index: int):
    width = max(len(ids) for ids, _ in built)
    n = len(built)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    labels = torch.full((n, width), ignore_index, dtype=torch.long)
    attn = torch.zeros((n, width), dtype=torch.long)
    for i, (row, lab) in enumerate(built):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        labels[i, : len(lab)] = torch.tensor(lab, dtype=torch.long)
        attn[i, : len(row)] = 1
    out = {k: v for k, v in batch.items() if k not in WIDTH_KEYS}
    out.update(input_ids=ids, attention_mask=attn, labels=labels,
               sampled=torch.tensor(sampled, dtype=torch.bool))
    return out
