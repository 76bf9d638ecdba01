"""The normalization proof's pieces, shared by the one-process tests and the DDP worker.

Micro-batches with very different valid-token counts (SFT with long prompts, CPT with none
masked, micro-batches with no valid token at all), a fit that records the student's
gradient at every optimizer step (SGD with lr=0, so every step sees the initial weights),
and the one-pass float64 reference: the step's data padded into one batch, the models' own
`forward().logits`, the divergence of the independent oracle (tests/oracle.py), the loss
weighted by the policy's definition written out here from the design table.
"""

from __future__ import annotations

import copy
import functools

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from distill.data import StepWindows
from distill.models.causal_lm import load_causal_lm
from distill.training.callbacks import StepTokenCounter
from distill.training.module import DistillModule
from distill.training.teachers import LiveTeacher
from tests.oracle import assert_rows_close, oracle_per_token

LOSS = {"kind": "jsd", "beta": 0.3, "ce_weight": 0.2}
N_MICRO = 7  # micro-batches per rank and epoch: K=3 -> windows 3, 3, 1; K=4 -> 4, 3
PAD = 0
EMPTY = 5  # the micro-batch with no valid token on every rank


def micro_batches(rank: int, vocab: int) -> list[dict]:
    """Rank `rank`'s micro-batches. The sixth (EMPTY) has no valid token on every rank:
    with K = 1 its step trains nothing, with K = 3 and 4 it sits inside a window; the last
    one, alone in K = 3's short last window, is a real SFT micro-batch, and K = 4's short
    last window holds it with the empty one. Rank 0's second micro-batch is empty too."""
    g = torch.Generator().manual_seed(100 + rank)
    specs = [("sft", 2, 40), ("empty", 1, 20) if rank == 0 else ("cpt", 3, 12),
             ("cpt", 2, 24), ("sft", 3, 30), ("cpt", 1, 8), ("empty", 1, 10), ("sft", 2, 16)]
    return [_batch(kind, rows, width, vocab, g) for kind, rows, width in specs]


def _batch(kind: str, rows: int, width: int, vocab: int, g) -> dict:
    ids = torch.randint(7, vocab, (rows, width), generator=g)
    attn = torch.ones(rows, width, dtype=torch.long)
    labels = ids.clone()
    for r in range(rows):
        length = width - int(torch.randint(0, width // 3, (), generator=g)) if r else width
        ids[r, length:], attn[r, length:], labels[r, length:] = PAD, 0, -100
        if kind == "sft":  # a long masked prompt, then a short answer
            labels[r, : length - int(torch.randint(2, 6, (), generator=g))] = -100
        elif kind == "empty":
            labels[r] = -100
    return {"input_ids": ids, "attention_mask": attn, "labels": labels}


def windows(n: int, k: int) -> list[range]:
    return [range(s, min(s + k, n)) for s in range(0, n, k)]


class CountingBatches(Dataset):
    """Ready-made micro-batches that count how often each is loaded."""

    def __init__(self, batches: list[dict]):
        self.batches, self.loads = batches, [0] * len(batches)

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> dict:
        self.loads[i] += 1
        return self.batches[i]


class GradCapture(L.Callback):
    """The student's gradient at each optimizer step (after the data-parallel average)."""

    def __init__(self):
        self.steps: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.steps.append({n: p.grad.detach().clone() for n, p in
                           pl_module.student.named_parameters() if p.grad is not None})


@functools.lru_cache(maxsize=2)
def models(assets_dir: str):
    student = load_causal_lm(f"{assets_dir}/student")
    teacher = LiveTeacher(f"{assets_dir}/teacher")
    return student, teacher


@functools.lru_cache(maxsize=2)
def float64_models(assets_dir: str):
    student, teacher = models(assets_dir)
    return student, copy.deepcopy(student).double(), copy.deepcopy(teacher.model).double()


def make_module(assets_dir: str, policy: str, lr: float = 0.0) -> DistillModule:
    student, teacher = models(assets_dir)
    student = copy.deepcopy(student)
    return DistillModule(student, teacher, loss={**LOSS, "normalization": policy},
                         optimizer=functools.partial(torch.optim.SGD, lr=lr),
                         vocab_size=student.config.vocab_size)


def trainer(k: int, devices: int = 1, callbacks=(), **kw) -> L.Trainer:
    kw = {"max_epochs": 1, "logger": False, "enable_checkpointing": False, **kw}
    return L.Trainer(accelerator="cpu", devices=devices,
                     strategy="ddp" if devices > 1 else "auto", accumulate_grad_batches=k,
                     enable_progress_bar=False, enable_model_summary=False,
                     use_distributed_sampler=False, callbacks=[StepTokenCounter(), *callbacks],
                     **kw)


class LoadWatch(L.Callback):
    """The lookahead loads each micro-batch once and runs at most one window ahead."""

    def __init__(self, data: CountingBatches, k: int):
        self.data, self.k = data, k

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        loaded = sum(self.data.loads) - trainer.current_epoch * len(self.data)
        assert 0 <= loaded - (batch_idx + 1) < self.k, (loaded, batch_idx, self.k)


def fit_grads(module, batches: list[dict], k: int, devices: int = 1, epochs: int = 1):
    """Fit over `batches` and return the gradient of every optimizer step."""
    capture, data = GradCapture(), CountingBatches(batches)
    t = trainer(k, devices, [capture, LoadWatch(data, k)], max_epochs=epochs)
    t.fit(module, train_dataloaders=StepWindows.from_loader(DataLoader(data, batch_size=None), k))
    assert data.loads == [epochs] * len(batches)
    return capture.steps


# --- the one-pass reference ---------------------------------------------------------------
def policy_weights(policy: str, valid, real, micro_batch, n_micro: int) -> torch.Tensor:
    """(rows, T-1) weights of the step's one batch, from the design table's definitions."""
    valid = valid.double()
    if policy == "valid_tokens":
        return valid / max(valid.sum().item(), 1)
    if policy == "all_tokens":
        return valid / max(real.sum().item(), 1)
    if policy == "sequence_mean":  # each row is one sequence here (no packing)
        per_row = valid.sum(1, keepdim=True)
        n_seq = int((per_row > 0).sum())
        return valid / (per_row.clamp_min(1) * max(n_seq, 1))
    if policy == "micro_batch_valid_tokens":  # the mean of the micro-batches' means
        w = torch.zeros_like(valid)
        for m in micro_batch.unique():
            rows = micro_batch == m
            w[rows] = valid[rows] / max(valid[rows].sum().item(), 1) / n_micro
        return w
    raise ValueError(policy)


def model_logits(model, ids, attn, vocab: int) -> torch.Tensor:
    """(rows, T - 1, vocab) float64 logits of the model's own forward at the positions that
    predict a next token (the tokenizer's rows of the head)."""
    return model(input_ids=ids, attention_mask=attn).logits[:, :-1, :vocab]


def per_token_loss(zs, zt, labels, loss=LOSS, ce=None) -> torch.Tensor:
    """(N,) divergence + CE weight * CE of each position from float64 logits (N, V), by the
    oracle; 0 where the label is -100. `ce` (N,) per-position CE weights (default the
    loss's ce_weight everywhere)."""
    rows = (labels != -100).nonzero().squeeze(-1)
    div, xent = oracle_per_token(zs[rows], zt[rows], labels=labels[rows], kind=loss["kind"],
                                 beta=loss["beta"], temperature=loss.get("temperature", 1.0))
    c = loss["ce_weight"] if ce is None else ce[rows]
    return torch.zeros(len(labels), dtype=zs.dtype).index_put((rows,), div + c * xent)


def padded_step(step: list[dict]):
    """(input_ids, attention_mask, labels, micro-batch of each row) of the step's
    micro-batches padded into one batch."""
    width = max(b["input_ids"].shape[1] for b in step)

    def cat(key, value):
        return torch.cat([torch.nn.functional.pad(b[key], (0, width - b[key].shape[1]),
                                                  value=value) for b in step])

    micro = torch.cat([torch.full((len(b["input_ids"]),), i) for i, b in enumerate(step)])
    return cat("input_ids", PAD), cat("attention_mask", 0), cat("labels", -100), micro


def reference_grads(assets_dir: str, step: list[dict], policies) -> dict[str, dict]:
    """{policy: {param: grad}} of the step's loss, computed in one float64 pass over all
    of the step's micro-batches (padded into one batch)."""
    student, s, t = float64_models(assets_dir)
    ids, attn, labels, micro = padded_step(step)
    v = student.config.vocab_size
    zs = model_logits(s, ids, attn, v)  # (rows, T-1, V)
    with torch.no_grad():
        zt = model_logits(t, ids, attn, v)
    target = labels[:, 1:]
    per_token = per_token_loss(zs.flatten(0, 1), zt.flatten(0, 1), target.flatten())
    valid = (target != -100) & attn[:, 1:].bool()
    real = attn[:, 1:].bool() & attn[:, :-1].bool()
    params = dict(s.named_parameters())
    out = {}
    for policy in policies:
        w = policy_weights(policy, valid, real, micro, len(step)).flatten()
        grads = torch.autograd.grad((w * per_token).sum(), list(params.values()),
                                    retain_graph=True, allow_unused=True)
        out[policy] = {n: torch.zeros_like(p) if g is None else g
                       for (n, p), g in zip(params.items(), grads)}
    return out


def assert_grads_match(got: dict, want: dict, rtol: float = 1e-5) -> None:
    """fp32 gradients against the float64 reference, for every parameter of the student:
    rtol 1e-5 on each tensor, with an atol of rtol times the tensor's largest entry (entries
    near zero carry only rounding); and row by row (an embedding row is one token, a
    linear layer's row one output unit), each row within 10 rtol of its own norm plus the
    tensor's rounding floor, so that a few wrong small rows show."""
    assert want and set(got) == set(want), (set(want) - set(got), set(got) - set(want))
    for name, g in got.items():
        ref = want[name]
        scale = ref.abs().max().item()
        torch.testing.assert_close(g.double(), ref, rtol=rtol, atol=rtol * scale + 1e-12,
                                   msg=lambda m, name=name: f"{name}: {m}")
        rows = ref.reshape(len(ref), -1) if ref.dim() else ref.reshape(1)
        floor = rtol * scale * (rows.shape[-1] ** 0.5 if rows.dim() > 1 else 1.0)
        assert_rows_close(g, ref, 10 * rtol, 0.1 * floor + 1e-12, name)
