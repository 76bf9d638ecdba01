"""Padding: one helper for every padded tensor of the package, and the batch collator.

`pad` is used wherever rows of token ids become a tensor: the collator (right padding),
the rollout's rewritten rows, and the samplers' and the evaluation's prompts (left padding,
so every prompt ends where generation begins).
"""

from __future__ import annotations

import torch

from distill.core.constants import IGNORE_INDEX


def pad(rows: list, value: int, width: int | None = None, side: str = "right"):
    """(len(rows), width) int64 tensor of the rows padded with `value` on `side`, and the
    (len(rows), width) attention mask (1 on the rows' own tokens)."""
    width = max((len(r) for r in rows), default=0) if width is None else width
    out = torch.full((len(rows), width), value, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        k = len(row)
        where = slice(0, k) if side == "right" else slice(width - k, width)
        out[i, where] = torch.as_tensor(row, dtype=torch.long)
        mask[i, where] = 1
    return out, mask


# sdpa's cuDNN kernel, the one torch picks on Hopper GPUs, builds a graph for each new
# sequence length: 0.5-0.9 s a pass on the H200 (docs/benchmarks.md, the unpacked run). Rows
# padded to a multiple of this meet at most max_length / 64 widths in a run, not one a batch.
CUDA_WIDTH_MULTIPLE = 64


def width_multiple(setting: int | None, device_type: str) -> int:
    """`data.pad_to_multiple_of` as a run uses it: null is CUDA_WIDTH_MULTIPLE where the
    batches go to a CUDA device, 1 elsewhere."""
    if setting is not None:
        return setting
    return CUDA_WIDTH_MULTIPLE if device_type == "cuda" else 1


def padded_width(longest: int, multiple: int, cap: int | None = None) -> int:
    """`longest` rounded up to `multiple`, never past `cap` (a model's rows may not be
    longer than the run's max_length) unless `longest` itself is."""
    width = -(-longest // multiple) * multiple
    return width if cap is None else max(longest, min(width, cap))


class PadCollator:
    """Tokenized examples (or packed rows) -> one right-padded batch dict, `cap` the widest
    a padded batch may become (data.max_length)."""

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int = 1, cap: int | None = None):
        self.pad_token_id = pad_token_id
        self.multiple, self.cap = pad_to_multiple_of, cap

    def __call__(self, examples: list[dict]) -> dict:
        longest = max(len(ex["input_ids"]) for ex in examples)
        width = padded_width(longest, self.multiple, self.cap)
        input_ids, attention_mask = pad([ex["input_ids"] for ex in examples],
                                        self.pad_token_id, width)
        labels, _ = pad([ex["labels"] for ex in examples], IGNORE_INDEX, width)
        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
        if "position_ids" in examples[0]:
            # the padding after a packed row is one more document of its own
            position_ids = torch.arange(width).repeat(len(examples), 1)
            for i, ex in enumerate(examples):
                k = len(ex["input_ids"])
                position_ids[i, :k] = torch.as_tensor(ex["position_ids"])
                position_ids[i, k:] = torch.arange(width - k)
            batch["position_ids"] = position_ids
        for key in ("example_id", "example_ids"):
            if key in examples[0]:
                batch[key] = [ex[key] for ex in examples]
        return batch
