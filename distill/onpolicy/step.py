"""The on-policy part of a training step: at a window's first micro-batch, rewrite the
window with samples (the student's, and the teacher's for `teacher_fraction` of them)."""

from __future__ import annotations

from distill.data.collate import width_multiple
from distill.data.windows import WindowInfo
from distill.models.causal_lm import config_positions
from distill.onpolicy.config import OnPolicyConfig
from distill.onpolicy.rollout import RolloutStats, rollout, window_seed
from distill.onpolicy.samplers import HFSampler, SamplingSettings, stop_tokens


def make_sampler(name: str, settings: SamplingSettings, device_type: str):
    """`loss.on_policy.sampler`: auto (static on CUDA, hf elsewhere), hf or static."""
    if name == "hf" or (name == "auto" and device_type != "cuda"):
        return HFSampler(settings)
    from distill.onpolicy.static_sampler import StaticSampler

    s = settings
    return StaticSampler(s.temperature, s.top_p, s.max_new_tokens, s.eos_token_ids,
                         s.pad_token_id, s.vocab_size)


class OnPolicyStep:
    """`cross` (a distill.xtok CrossSetup): the teacher has its own tokenizer; each sample
    is re-tokenized for the other model (distill.xtok.rollout). `pad_to_multiple_of`: the
    run's `data.pad_to_multiple_of`, which the rewritten rows follow (null: per device)."""

    def __init__(self, cfg: OnPolicyConfig, student, teacher_model, *, vocab_size,
                 eos_token_id=None, cross=None, pad_to_multiple_of: int | None = None):
        if teacher_model is None:
            raise ValueError(f"loss.on_policy.fraction={cfg.fraction} needs a live teacher to "
                             "score the student's samples; a cached teacher only knows the "
                             "dataset's tokens. Use a live teacher (teacher.kind=live) or "
                             "set loss.on_policy.fraction=0")
        self.cfg, self.teacher, self.pad_to_multiple_of = cfg, teacher_model, pad_to_multiple_of
        # the widest a rewritten row is padded to (the student's positions)
        self.positions = config_positions(student.config)
        self.eos = stop_tokens(student, eos_token_id)
        pad = student.config.pad_token_id
        self.pad = pad if pad is not None else self.eos[0]
        self.vocab_size = vocab_size
        self.cross = cross
        # the teacher stops at its own tokens (another tokenizer: its own stop tokens too)
        self.teacher_eos, self.teacher_pad, self.teacher_vocab = self.eos, self.pad, vocab_size
        if cross is not None:
            tok = cross.teacher_tokenizer
            self.teacher_eos = stop_tokens(teacher_model, tok.eos_token_id)
            self.teacher_pad = tok.pad_token_id if tok.pad_token_id is not None else \
                self.teacher_eos[0]
            self.teacher_vocab = len(tok)
        self._samplers: dict = {}

    def _sampler(self, who: str, device_type: str):
        if who not in self._samplers:
            student = who == "student"
            t = self.cfg.temperature if student else self.cfg.teacher_t
            settings = SamplingSettings(t, self.cfg.top_p, self.cfg.max_new_tokens,
                                        self.eos if student else self.teacher_eos,
                                        self.pad if student else self.teacher_pad,
                                        self.vocab_size if student else self.teacher_vocab)
            self._samplers[who] = make_sampler(self.cfg.sampler, settings, device_type)
        return self._samplers[who]

    def __call__(self, student, info: WindowInfo, rank: int) -> RolloutStats:
        """Rewrites `info`'s window in place (`info.rolled`); returns what was sampled."""
        device = next(student.parameters()).device.type
        seed = window_seed(self.cfg.seed, info.epoch, info.number, rank)
        samplers = (self._sampler("student", device), student,
                    self._sampler("teacher", device), self.teacher)
        if self.cross is not None:  # a distill.xtok CrossSetup
            rolled, stats = self.cross.rollout(info.batches, self.cfg, seed, *samplers,
                                               eos=self.eos)
        else:
            rolled, stats = rollout(info.batches, self.cfg, seed, self.pad, self.eos,
                                    *samplers,
                                    multiple=width_multiple(self.pad_to_multiple_of, device),
                                    cap=self.positions)
        info.rolled = rolled
        return stats

    @property
    def samplers(self) -> dict:
        return self._samplers
