"""The teacher as a Lightning predict job: top-k per batch, shards written by a callback.

`TopKPredictor.predict_step` runs the teacher's base model, projects only the trained
positions in chunks and returns their top-k ids and log-probs. `ShardWriter` (a
BasePredictionWriter) appends each batch to its shard's temp file and renames the file
when the shard's last batch is in; nothing else in the job touches the shards.
"""

from __future__ import annotations

import os

import lightning as L
import numpy as np
import pyarrow as pa
import torch
from lightning.pytorch.callbacks import BasePredictionWriter

from distill.cache.format import SCHEMA, shard_path, tmp_path
from distill.cache.topk import topk_logprobs
from distill.cache.verify import record_and_publish
from distill.core.constants import IGNORE_INDEX
from distill.data.shift import shift_flat, shift_labels
from distill.models.causal_lm import final_hidden_states, lm_head

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


class TopKPredictor(L.LightningModule):
    def __init__(self, model, top_k: int, temperature: float, dtype: str, vocab: int,
                 chunk: int | None = None):
        super().__init__()
        self.model = model.eval().requires_grad_(False)
        self.top_k, self.temperature, self.vocab, self.chunk = top_k, temperature, vocab, chunk
        self.value_dtype = DTYPES[dtype]

    def predict_step(self, batch: dict, batch_idx: int = 0) -> dict:
        hidden = final_hidden_states(self.model, batch["input_ids"],
                                     batch.get("attention_mask"), batch.get("position_ids"))
        weight, head = lm_head(self.model)
        head = head.rows(self.vocab)
        rows = (shift_labels(batch["labels"]) != IGNORE_INDEX).nonzero().squeeze(-1)  # trained
        ids, logprobs = topk_logprobs(shift_flat(hidden)[rows], weight[: self.vocab],
                                      self.top_k, self.temperature, head, self.chunk)
        return {"rows": rows.cpu(), "ids": ids.cpu(),
                "logprobs": logprobs.to(self.value_dtype).cpu()}


def batch_table(pred: dict, batch: dict, k: int) -> pa.Table:
    """One Arrow row per example of the batch (flat lists, see format.SCHEMA)."""
    width = batch["input_ids"].shape[1] - 1
    owner = pred["rows"].numpy() // width  # rows come sorted, so grouped by example
    counts = np.bincount(owner, minlength=len(batch["example_id"]))
    offsets = pa.array(np.concatenate([[0], np.cumsum(counts) * k]).astype(np.int32))
    bits = pred["logprobs"].view(torch.int16).numpy().view(np.uint16).reshape(-1)
    return pa.Table.from_arrays([
        pa.array(batch["example_id"], pa.string()),
        pa.array(batch["token_hash"], pa.uint64()),
        pa.ListArray.from_arrays(offsets, pa.array(pred["ids"].numpy().reshape(-1))),
        pa.ListArray.from_arrays(offsets, pa.array(bits)),
    ], schema=SCHEMA)


class ShardWriter(BasePredictionWriter):
    """Writes each rank's shards: temp file per shard, atomic rename when it is complete.

    Batches are buffered into record batches of about FLUSH_BYTES (fewer Arrow headers
    per token); the split points depend only on the shard's content, so a rewritten shard
    is byte-identical.
    """

    FLUSH_BYTES = 32 << 20

    def __init__(self, root, top_k: int):
        super().__init__(write_interval="batch")
        self.root, self.top_k = root, top_k
        self._sink = self._stream = self._tmp = None
        self._buffer: list[pa.Table] = []
        self.examples = self.tokens = self.shards = 0

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch,
                           batch_idx, dataloader_idx=0):
        final = shard_path(self.root, batch["cache_split"], batch["cache_shard"])
        if batch["cache_first"]:
            final.parent.mkdir(parents=True, exist_ok=True)
            self._tmp = tmp_path(final)  # a stale one from a killed run is overwritten
            self._sink = pa.OSFile(str(self._tmp), "wb")
            self._stream = pa.ipc.new_stream(self._sink, SCHEMA)
            self._buffer = []
        self._buffer.append(batch_table(prediction, batch, self.top_k))
        self.examples += len(batch["example_id"])
        self.tokens += len(prediction["rows"])
        if batch["cache_last"] or sum(t.nbytes for t in self._buffer) >= self.FLUSH_BYTES:
            self._stream.write_table(pa.concat_tables(self._buffer).combine_chunks())
            self._buffer = []
        if batch["cache_last"]:
            self._stream.close()
            self._sink.close()
            with open(self._tmp, "rb+") as f:
                os.fsync(f.fileno())
            record_and_publish(self._tmp, final)  # its sha256 first, then the shard
            self.shards += 1
            self._sink = self._stream = self._tmp = None
