"""A teacher cache for cross-tokenizer distillation: the teacher's view of each example only.

    metadata.json        format, teacher, teacher_tokenizer (hash), teacher_vocab, top_k,
                         temperature, splits
    <split>.arrow        one row per example (Arrow IPC):
        example_id       string
        teacher_ids      list<int32>   the teacher's tokens of its own rendering
        teacher_offsets  list<int32>   2 per token: byte range in that rendering
        positions        list<int32>   n trained teacher tokens k (row k - 1 predicts k)
        topk_ids         list<int32>   n * K, by falling probability
        topk_logprobs    list<float>   n * K at the cache's temperature
        target_logprobs  list<float>   n: log p of token k itself (in the top-k or not)

Nothing here depends on the student: alignment is the data side's, at training time, from
the same teacher tokens (checked per example). A trained teacher token costs 8K + 8 bytes.
This is the format `distill.cache` would grow for the cross-tokenizer case (its shards,
hashes and predict job are unchanged by it); the writer below is the single-process one the
tests use.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from distill.cache.format import CacheMismatch, tokenizer_hash, write_json_atomic
from distill.models.causal_lm import final_hidden_states, lm_head
from distill.ops.chunked import project
from distill.ops.divergence_torch import log_softmax
from distill.ops.spec import HeadTransform

FORMAT = "distill-xtok-teacher-cache"
VERSION = 1
SCHEMA = pa.schema([
    ("example_id", pa.string()),
    ("teacher_ids", pa.list_(pa.int32())),
    ("teacher_offsets", pa.list_(pa.int32())),
    ("positions", pa.list_(pa.int32())),
    ("topk_ids", pa.list_(pa.int32())),
    ("topk_logprobs", pa.list_(pa.float32())),
    ("target_logprobs", pa.list_(pa.float32())),
])
IGNORE_INDEX = -100


def _positions(labels) -> list[int]:
    return [k for k, y in enumerate(labels) if k and y != IGNORE_INDEX]


@torch.no_grad()
def _example_rows(model, ex: dict, top_k: int, temperature: float, vocab: int):
    device = next(model.parameters()).device
    ids = torch.tensor([ex["teacher_input_ids"]], device=device)
    hidden = final_hidden_states(model, ids)[0]  # (T, H)
    weight, head = lm_head(model)
    if head.bias is not None:
        head = HeadTransform(head.bias[:vocab], head.scale, head.softcap)
    pos = torch.tensor(_positions(ex["teacher_labels"]), dtype=torch.long, device=device)
    z = torch.empty((len(pos), vocab), dtype=torch.float32, device=device)
    z, _ = project(hidden[pos - 1], weight[:vocab], head, z)
    logp = log_softmax(z / temperature)
    top = logp.topk(top_k, -1)
    own = logp.gather(1, ids[0, pos][:, None]).squeeze(1)
    return pos.cpu(), top.indices.cpu(), top.values.cpu(), own.cpu()


def write_cache(root, examples: list[dict], model, tokenizer, *, top_k: int,
                temperature: float = 1.0, split: str = "train", teacher: str = "") -> Path:
    """Run the teacher on each paired example (its `teacher_input_ids`, `teacher_labels`,
    `teacher_offsets`, `example_id`) and write `split`. One example at a time: the
    reference writer; the Lightning predict job would batch and shard the same rows."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    vocab = len(tokenizer)
    cols = {name: [] for name in SCHEMA.names}
    model.eval()
    for ex in examples:
        pos, ids, lps, own = _example_rows(model, ex, top_k, temperature, vocab)
        cols["example_id"].append(str(ex["example_id"]))
        cols["teacher_ids"].append(list(ex["teacher_input_ids"]))
        cols["teacher_offsets"].append([v for ab in ex.get("teacher_offsets", []) for v in ab])
        cols["positions"].append(pos.tolist())
        cols["topk_ids"].append(ids.reshape(-1).tolist())
        cols["topk_logprobs"].append(lps.reshape(-1).tolist())
        cols["target_logprobs"].append(own.tolist())
    table = pa.Table.from_pydict(cols, schema=SCHEMA)
    tmp = root / f"{split}.arrow.tmp"
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, SCHEMA) as writer:
        writer.write_table(table)
    tmp.replace(root / f"{split}.arrow")
    meta_path = root / "metadata.json"
    meta = XtokCache.read_meta(root) if meta_path.exists() else {
        "format": FORMAT, "version": VERSION, "teacher": teacher,
        "teacher_tokenizer": tokenizer_hash(tokenizer), "teacher_vocab": vocab,
        "top_k": top_k, "temperature": float(temperature), "splits": {}}
    meta["splits"][split] = len(examples)
    write_json_atomic(meta_path, meta)
    return root


class XtokCache:
    """Reads a cross-tokenizer cache; every check names the field that differs."""

    def __init__(self, root):
        self.root = Path(root)
        self.meta = self.read_meta(self.root)
        if self.meta.get("format") != FORMAT:
            raise ValueError(f"{self.root} is not a cross-tokenizer teacher cache (format "
                             f"{self.meta.get('format')!r}); write one with "
                             "distill.cache.cross.write_cache")
        self._splits: dict[str, dict] = {}

    @staticmethod
    def read_meta(root: Path) -> dict:
        import json

        path = Path(root) / "metadata.json"
        if not path.exists():
            raise FileNotFoundError(f"no teacher cache at {root} (metadata.json missing)")
        return json.loads(path.read_text())

    def expect(self, field: str, value) -> None:
        if self.meta.get(field) != value:
            raise CacheMismatch(field, self.meta.get(field), value, str(self.root),
                                f"re-run the caching job with {field}={value!r}, or configure "
                                f"the run as the cache was written")

    def expect_tokenizer(self, tokenizer) -> None:
        """Refuse a cache written with another teacher tokenizer than the configured one."""
        self.expect("teacher_tokenizer", tokenizer_hash(tokenizer))
        self.expect("teacher_vocab", len(tokenizer))

    def split(self, name: str) -> dict:
        if name not in self._splits:
            path = self.root / f"{name}.arrow"
            if not path.exists():
                raise FileNotFoundError(f"the teacher cache {self.root} has no split {name!r}")
            with pa.memory_map(str(path)) as f:
                table = pa.ipc.open_file(f).read_all()
            rows = table.to_pylist()
            self._splits[name] = {r["example_id"]: r for r in rows}
        return self._splits[name]

    def batch_targets(self, batch: dict, split: str, spans: torch.Tensor):
        """(Nt, K) ids, (Nt, K) log-probs, (Nt,) own-token log-probs for the flattened,
        shifted teacher rows of a batch; zeros where nothing was cached."""
        records = self.split(split)
        ids_b = batch["teacher_input_ids"]
        b, width = ids_b.shape
        k = int(self.meta["top_k"])
        n = b * (width - 1)
        top_ids = torch.zeros((n, k), dtype=torch.long)
        top_lp = torch.zeros((n, k), dtype=torch.float32)
        own = torch.zeros(n, dtype=torch.float32)
        cached = torch.zeros(n, dtype=torch.bool)
        for row, eid in enumerate(batch["example_id"]):
            rec = records.get(str(eid))
            if rec is None:
                raise KeyError(f"example {eid!r} is not in the teacher cache's {split!r} split")
            length = int(batch["teacher_attention_mask"][row].sum())
            if rec["teacher_ids"] != ids_b[row, :length].tolist():
                raise CacheMismatch("teacher_ids", f"{len(rec['teacher_ids'])} tokens",
                                    f"{length} tokens", f"{self.root} example {eid!r}",
                                    "the teacher's tokens of this example changed since the "
                                    "cache was written (data, chat template or tokenizer): "
                                    "re-run the caching job")
            pos = torch.tensor(rec["positions"], dtype=torch.long)
            at = row * (width - 1) + pos - 1
            top_ids[at] = torch.tensor(np.asarray(rec["topk_ids"]).reshape(-1, k))
            top_lp[at] = torch.tensor(np.asarray(rec["topk_logprobs"], dtype=np.float32)
                                      .reshape(-1, k))
            own[at] = torch.tensor(rec["target_logprobs"], dtype=torch.float32)
            cached[at] = True
        needed = torch.cat([torch.arange(int(lo), int(hi)) for lo, hi in spans[:, 2:].tolist()]
                           or [torch.zeros(0, dtype=torch.long)])
        if not bool(cached[needed].all()):
            raise ValueError("a span covers teacher positions the cache holds nothing for "
                             "(the teacher's trained positions changed): re-run the caching job")
        return top_ids, top_lp, own
