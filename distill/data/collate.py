"""Pad a list of tokenized examples into one batch dict of tensors (right padding)."""

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
        for i, ex in enumerate(examples):
            k = len(ex["input_ids"])
            input_ids[i, :k] = torch.as_tensor(ex["input_ids"])
            labels[i, :k] = torch.as_tensor(ex["labels"])
            attention_mask[i, :k] = 1
        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
        if "example_id" in examples[0]:
            batch["example_id"] = [ex["example_id"] for ex in examples]
        return batch
