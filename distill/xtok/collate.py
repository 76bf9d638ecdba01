"""Batches of paired examples: the student's fields as `PadCollator` makes them, plus

    teacher_input_ids       (B, Tt)  the teacher's tokens, right-padded
    teacher_attention_mask  (B, Tt)
    teacher_labels          (B, Tt)  the teacher's own assistant labels (-100 elsewhere): its
                                     trained positions, for a cache job or its validation CE
    teacher_prompt_lengths  (B,)     teacher tokens before its first trained one (on-policy
                                     rows keep these and append the re-tokenized sample)
    xtok_spans              (S, 5)   [row, student lo, hi, teacher lo, hi): token indices
                                     (label coordinates) of every aligned span of the batch

A span list is independent of the padding width, so the loss turns it into rows of the two
flattened, shifted batches only once the widths are known (`flat_spans`). Packed rows
(position_ids) are refused: packing would have to pack the teacher rows alike and shift
each document's spans by its offsets on both sides.
"""

from __future__ import annotations

import torch

from distill.data.collate import PadCollator, padded_width

IGNORE_INDEX = -100


class PairCollator:
    """`caps`: the widest each side's padded rows may become (max_length, and the teacher's)."""

    def __init__(self, pad_token_id: int, teacher_pad_token_id: int, pad_to_multiple_of: int = 1,
                 caps: tuple[int | None, int | None] = (None, None)):
        self.student = PadCollator(pad_token_id, pad_to_multiple_of, cap=caps[0])
        self.teacher_pad, self.multiple, self.teacher_cap = (teacher_pad_token_id,
                                                             pad_to_multiple_of, caps[1])

    @property
    def multiple(self) -> int:
        return self._multiple

    @multiple.setter
    def multiple(self, value: int) -> None:  # both models' rows
        self._multiple = self.student.multiple = value

    def __call__(self, examples: list[dict]) -> dict:
        if "position_ids" in examples[0]:
            raise ValueError("cross-tokenizer batches cannot be packed yet: set "
                             "data.packing=false")
        batch = self.student(examples)
        longest = max(len(ex["teacher_input_ids"]) for ex in examples)
        width = padded_width(longest, self.multiple, self.teacher_cap)
        ids = torch.full((len(examples), width), self.teacher_pad, dtype=torch.long)
        attn = torch.zeros((len(examples), width), dtype=torch.long)
        t_labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
        prompt = torch.zeros(len(examples), dtype=torch.long)
        spans = []
        for b, ex in enumerate(examples):
            k = len(ex["teacher_input_ids"])
            ids[b, :k] = torch.as_tensor(ex["teacher_input_ids"])
            attn[b, :k] = 1
            labels = ex.get("teacher_labels") or [IGNORE_INDEX] * k
            t_labels[b, :k] = torch.as_tensor(labels)
            prompt[b] = next((j for j, y in enumerate(labels) if j and y != IGNORE_INDEX), k)
            spans += [(b, *s) for s in ex["xtok_spans"]]
        batch["teacher_input_ids"], batch["teacher_attention_mask"] = ids, attn
        batch["teacher_labels"] = t_labels
        batch["teacher_prompt_lengths"] = prompt
        batch["xtok_spans"] = torch.tensor(spans, dtype=torch.long).reshape(-1, 5)
        return batch


def flat_spans(batch: dict) -> torch.Tensor:
    """(S, 4) [student row lo, hi, teacher row lo, hi) in the flattened shifted batches
    (`distill.data.shift.shift_flat`): token k of row b is predicted by row
    b * (T - 1) + k - 1."""
    spans = batch["xtok_spans"]
    ts, tt = batch["input_ids"].shape[1], batch["teacher_input_ids"].shape[1]
    b, s_lo, s_hi, t_lo, t_hi = spans.unbind(1)
    return torch.stack([b * (ts - 1) + s_lo - 1, b * (ts - 1) + s_hi - 1,
                        b * (tt - 1) + t_lo - 1, b * (tt - 1) + t_hi - 1], 1)


def teacher_targets(batch: dict) -> torch.Tensor:
    """(B * (Tt - 1),) the token each flattened, shifted teacher row predicts."""
    return batch["teacher_input_ids"][:, 1:].reshape(-1)
