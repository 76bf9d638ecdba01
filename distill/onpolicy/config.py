"""`loss.on_policy:` settings: which rows are rewritten by samples, and how they are drawn."""

from __future__ import annotations

from dataclasses import dataclass

from distill.core.rules import choice, integer, number, setting

SAMPLERS = ("auto", "hf", "static")


@dataclass(frozen=True)
class OnPolicyConfig:
    """`fraction` (GKD's lambda) is the chance that a row with labels is replaced by a
    sample; 0 is plain teacher-forced distillation. Rows without any label (prompt only)
    have nothing to teacher-force, so with fraction > 0 they are always sampled.
    `teacher_fraction` is the chance that a sampled row's completion is written by the
    teacher instead of the student (GKD's mixed data; 1: every completion is the teacher's,
    which with the divergence is supervised KD and with CE alone is SeqKD; 0 is purely
    on-policy). The teacher scores every token either way."""

    fraction: float = setting(0.0, number(0, strict=False, hi=1,
                                          what=" (0: teacher-forced only)"))
    teacher_fraction: float = setting(0.0, number(0, strict=False, hi=1))
    temperature: float = setting(1.0, number(0, strict=False, what=" (0: greedy)"))
    # the teacher's own sampling temperature (null: `temperature`); SeqKD answers greedily
    teacher_temperature: float | None = setting(None, number(0, strict=False, null=True,
                                                             what=" (0: greedy)"))
    top_p: float = setting(1.0, number(0, strict=True, hi=1))
    max_new_tokens: int = setting(32, integer(1))
    seed: int = setting(0, integer(0, what=" (with epoch, step and rank: the samples of a "
                                           "step are reproducible)"))
    # auto: the static-cache CUDA-graph sampler on CUDA, transformers' generate on CPU
    sampler: str = setting("auto", choice(SAMPLERS))

    @property
    def samples(self) -> bool:
        return self.fraction > 0

    @property
    def teacher_t(self) -> float:
        return self.temperature if self.teacher_temperature is None else self.teacher_temperature
