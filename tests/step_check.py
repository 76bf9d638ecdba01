"""The first optimizer step of a `train(cfg)` run, recomputed on its own.

End-to-end runs used to check only that their loss was finite. `FirstStep` (a callback
added to the run's own) records what the run's first optimizer step trains on: float64
copies of the student and the live teacher as they were at the start, the window's
micro-batches, and the `train/loss` the run logged. `first_step_loss` recomputes that loss
sharing nothing with the fused path: each document alone through the model's own
`forward().logits` (so packing, hidden states and LM-head quirks are checked too), the
divergence and CE of tests/oracle.py, the mean over the window's trained positions
(valid_tokens). A cached teacher's targets are the teacher model's own top-k, recomputed
here, so the cache's writer and reader are checked with them.
"""

from __future__ import annotations

import copy

import lightning as L
import torch

from tests.oracle import oracle_per_token

# A cache stores fp16 log-probs (~5e-4 relative each); measured on the tiny sharp teacher's
# K = 8 cache: 4e-5 (forward KL), 6e-5 (JSD), 7e-4 (reverse KL, which weighs the tail
# bucket that the rounding of the top-k shifts most)
CACHED_RTOL = 2e-3


class FirstStep(L.Callback):
    def __init__(self):
        self.batches: list[dict] = []
        self.loss: float | None = None

    def on_train_start(self, trainer, pl_module):
        self.k = trainer.accumulate_grad_batches
        self.student = copy.deepcopy(pl_module.student).double().eval()
        teacher = getattr(pl_module.teacher, "model", None)
        self.teacher = None if teacher is None else copy.deepcopy(teacher).double().eval()
        self.vocab = pl_module.vocab_size

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 0 and len(self.batches) < self.k:
            self.batches.append({k: v.detach().cpu().clone() if torch.is_tensor(v) else v
                                 for k, v in batch.items() if k != "window"})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.loss is None and trainer.global_step == 1:
            self.loss = float(trainer.callback_metrics["train/loss"])


def record_first_step(monkeypatch) -> FirstStep:
    """A FirstStep that the next `train(cfg)` adds to its callbacks."""
    import distill.run.assemble

    rec, build = FirstStep(), distill.run.assemble.build_callbacks
    monkeypatch.setattr(distill.run.assemble, "build_callbacks",
                        lambda *a, **kw: [*build(*a, **kw), rec])
    return rec


def documents(batch: dict):
    """(input_ids, labels) of every document of a micro-batch, each alone: one per row
    (its attended tokens), or, in packed rows, where `position_ids` restart at 0."""
    attn = batch.get("attention_mask")
    for i, row in enumerate(batch["input_ids"]):
        n = int(attn[i].sum()) if attn is not None else len(row)
        starts = [0]
        if "position_ids" in batch:
            starts = (batch["position_ids"][i, :n] == 0).nonzero().flatten().tolist()
        for a, b in zip(starts, [*starts[1:], n]):
            yield row[a:b], batch["labels"][i, a:b]


@torch.no_grad()
def first_step_loss(rec: FirstStep, loss, cached_teacher=None, top_k=None) -> float:
    """float64 train/loss of the recorded first step under `loss` (the run's `loss:` config):
    sum over the window's trained positions of divergence + ce_weight * CE over their
    number. `cached_teacher` (a model, with `top_k`) gives the targets of a cached run."""
    assert loss.normalization == "valid_tokens", "recomputed for valid_tokens only"
    assert len(rec.batches) == rec.k and rec.loss is not None, "the first step was not seen"
    t = loss.temperature
    total, count = 0.0, 0
    for batch in rec.batches:
        for ids, labels in documents(batch):
            target = labels[1:]
            rows = target != -100
            if not rows.any():
                continue
            zs = rec.student(input_ids=ids[None]).logits[0, :-1, :rec.vocab][rows]
            kw = dict(labels=target[rows], kind=loss.kind, beta=loss.beta, temperature=t,
                      temperature_squared=loss.temperature_squared,
                      divergence_weight=loss.divergence_weight, sparse_mode=loss.sparse_mode)
            if cached_teacher is None:
                zt = rec.teacher(input_ids=ids[None]).logits[0, :-1, :rec.vocab][rows]
                div, ce = oracle_per_token(zs, zt, **kw)
            else:
                zt = cached_teacher(input_ids=ids[None]).logits[0, :-1, :rec.vocab][rows]
                top = torch.log_softmax(zt.double() / t, -1).topk(top_k, dim=-1)
                div, ce = oracle_per_token(zs, target_ids=top.indices,
                                           target_logprobs=top.values, **kw)
            total += float((div + loss.ce_weight * ce).sum())
            count += int(rows.sum())
    return total / max(count, 1)


def assert_first_step_loss(rec: FirstStep, loss, rtol: float = 1e-5, **kw) -> float:
    """The logged first-step loss against first_step_loss; returns the recomputed one."""
    want = first_step_loss(rec, loss, **kw)
    assert abs(rec.loss - want) <= rtol * abs(want) + 1e-7, (rec.loss, want)
    return want
