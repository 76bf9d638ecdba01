"""Pad a list of tokenized examples (or packed rows) into one batch dict (right padding)."""

from __future__ import annotations

import torch

from distill.data.tokenize import IGNORE_INDEX


class PadCollator:
    def __init__(self, pad_token_id: int, pad_to_multiple_of: int = 1):
        self.pad_token_id = pad_token_id
        self.multiple = pad_to_multiple_of

    def __call__(self, examples: list[dict]) -> dict:
        longest = max(len(ex["input_ids"]) for ex in examples)
        width = -(-longest // self.multiple) * self.multiple
        n = len(examples)
        input_ids = torch.full((n, width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((n, width), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((n, width), dtype=torch.long)
        packed = "position_ids" in examples[0]
        if packed:  # the padding after a packed row is one more document of its own
            position_ids = torch.arange(width).repeat(n, 1)
        for i, ex in enumerate(examples):
            k = len(ex["input_ids"])
            input_ids[i, :k] = torch.as_tensor(ex["input_ids"])
            labels[i, :k] = torch.as_tensor(ex["labels"])
            attention_mask[i, :k] = 1
            if packed:
                position_ids[i, :k] = torch.as_tensor(ex["position_ids"])
                position_ids[i, k:] = torch.arange(width - k)
        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
        if packed:
            batch["position_ids"] = position_ids
        for key in ("example_id", "example_ids"):
            if key in examples[0]:
                batch[key] = [ex[key] for ex in examples]
        return batch
