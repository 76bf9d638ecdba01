"""Sequence packing: several tokenized examples per row, each with its own position ids.

Rows are filled in dataset order (next fit) up to `max_length` tokens, within each
`datasets.map` batch of examples (1000 by default: the last row of each is left as it is).
A row keeps each document's labels as they were and restarts `position_ids` at 0 where a
document begins. Hugging Face models given `position_ids` and no attention mask then attend
only within a document (transformers' packed-sequence masks for sdpa / eager / flex;
flash-attention's varlen path, see `distill.models.causal_lm.final_hidden_states`), and
`distill.data.masks.batch_masks` drops the position that would predict the next
document's first token.

Cost: under sdpa or eager the per-document mask is a dense (B, 1, T, T) boolean tensor
(512 MiB at B = 8, T = 8192), and a custom mask keeps sdpa off its flash kernel. At long
rows packing pays off with `attn_implementation=flash_attention_2`.
"""

from __future__ import annotations

import datasets


def pack_rows(batch: dict, max_length: int) -> dict:
    """`datasets.map(batched=True)` function: a batch of examples -> a batch of packed rows."""
    rows = {"input_ids": [], "labels": [], "position_ids": [], "example_ids": []}
    ids = batch.get("example_id") or [None] * len(batch["input_ids"])
    current = None
    for tokens, labels, eid in zip(batch["input_ids"], batch["labels"], ids):
        if len(tokens) > max_length:
            raise ValueError(f"an example of {len(tokens)} tokens is longer than the packed "
                             f"row ({max_length}): tokenize with the same max_length")
        if current is None or len(current["input_ids"]) + len(tokens) > max_length:
            current = {k: [] for k in rows}
            for k in rows:
                rows[k].append(current[k])
        current["input_ids"].extend(tokens)
        current["labels"].extend(labels)
        current["position_ids"].extend(range(len(tokens)))
        current["example_ids"].append(eid if eid is not None else "")
    return rows


def pack_dataset(ds: datasets.Dataset, max_length: int, batch_size: int = 1000):
    """The packed rows of a tokenized dataset (input_ids, labels[, example_id])."""
    if len(ds) == 0:
        return ds
    return ds.map(pack_rows, batched=True, batch_size=batch_size,
                  remove_columns=ds.column_names, fn_kwargs={"max_length": max_length},
                  desc="packing")
