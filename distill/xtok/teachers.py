"""Teachers with their own tokenizer: the keyword arguments of `cross_tokenizer_divergence`.

Both read a batch made by `distill.xtok.PairCollator` and return, for its flattened and
shifted rows: `spans`, `teacher_targets`, `teacher_vocab_size`, and the teacher itself,
live (`teacher_hidden`, `teacher_weight`, `teacher_head`) or cached (`teacher_topk_ids`,
`teacher_topk_logprobs`, `teacher_target_logprobs`).

- `LiveCrossTeacher` runs the frozen model on `teacher_input_ids` through the package's
  `LiveTeacher` (its base model only; the logits are never built).
- `CachedCrossTeacher` reads a cache written by `distill.cache.cross.write_cache`. The cache
  holds the teacher's own tokens, offsets and targets per example, keyed by example id,
  and no student tokens: one cache serves every student tokenizer, the alignment being
  recomputed by the data side. It refuses a cache written with another teacher tokenizer,
  top-k or temperature, and an example whose teacher tokens differ from the cache's.
"""

from __future__ import annotations

import torch

from distill.cache.cross import XtokCache
from distill.training.teachers import LiveTeacher
from distill.xtok.collate import flat_spans, teacher_targets


def teacher_view(batch: dict) -> dict:
    """The teacher's side of a paired batch, under the keys a single-tokenizer teacher reads."""
    return {"input_ids": batch["teacher_input_ids"],
            "attention_mask": batch.get("teacher_attention_mask")}


def _common(batch: dict, vocab: int) -> dict:
    return {"spans": flat_spans(batch).to(batch["input_ids"].device),
            "teacher_targets": teacher_targets(batch), "teacher_vocab_size": vocab}


class LiveCrossTeacher(torch.nn.Module):
    """A frozen causal LM run on its own tokenization of the batch."""

    def __init__(self, teacher: LiveTeacher, tokenizer):
        super().__init__()
        self.inner, self.tokenizer = teacher, tokenizer
        self.model = teacher.model
        self.vocab_size = len(tokenizer)

    @classmethod
    def from_pretrained(cls, name_or_path: str, tokenizer: str | None = None,
                        dtype: str = "float32", attn_implementation: str | None = None):
        from distill.models.causal_lm import load_tokenizer

        teacher = LiveTeacher(name_or_path, dtype=dtype, attn_implementation=attn_implementation)
        return cls(teacher, load_tokenizer(tokenizer or name_or_path))

    @classmethod
    def from_model(cls, model, tokenizer) -> LiveCrossTeacher:
        return cls(LiveTeacher.from_model(model), tokenizer)

    def train(self, mode: bool = True):
        return super().train(False)  # the teacher stays in eval mode

    def prepare(self, datamodule, tokenizer) -> None:
        """The data's teacher side was tokenized with this teacher's own tokenizer."""
        cross = getattr(datamodule, "cross", None)  # a distill.xtok CrossSetup
        if cross is None:
            raise ValueError("a cross-tokenizer teacher needs paired data (the teacher's own "
                             "tokens of each example): loss.cross_tokenizer builds them")
        self.check_tokenizer(cross.pair.teacher.tokenizer)

    def check_tokenizer(self, tokenizer) -> None:
        """The data's teacher tokenizer must be the teacher's own."""
        from distill.cache.format import tokenizer_hash

        if tokenizer_hash(tokenizer) != tokenizer_hash(self.tokenizer):
            name = getattr(self.tokenizer, "name_or_path", "?")
            raise ValueError("the data were tokenized for the teacher with another tokenizer "
                             f"than the teacher's own ({name}): set the teacher tokenizer of "
                             "the data to the teacher's")

    @torch.no_grad()
    def targets(self, batch: dict) -> dict:
        out = self.inner.targets(teacher_view(batch))
        return {**out, **_common(batch, self.vocab_size)}


class CachedCrossTeacher(torch.nn.Module):
    """The teacher's top-k log-probabilities read from a cross-tokenizer cache."""

    model = None  # nothing to run, evaluate or checkpoint

    def __init__(self, dir: str, tokenizer, top_k: int, temperature: float = 1.0):
        super().__init__()
        self.cache = XtokCache(dir)
        self.cache.expect_tokenizer(tokenizer)
        self.cache.expect("top_k", int(top_k))
        self.cache.expect("temperature", float(temperature))
        self.vocab_size = len(tokenizer)

    def prepare(self, datamodule, tokenizer) -> None:
        """Nothing to check ahead: each example's teacher tokens are checked against the
        cache's when its batch is served."""

    @torch.no_grad()
    def targets(self, batch: dict, split: str = "train") -> dict:
        out = _common(batch, self.vocab_size)
        ids, logprobs, own = self.cache.batch_targets(batch, split, out["spans"])
        device = batch["input_ids"].device
        return {**out, "teacher_topk_ids": ids.to(device),
                "teacher_topk_logprobs": logprobs.to(device),
                "teacher_target_logprobs": own.to(device)}
