"""The models, batches and step kinds that bench/bench_train.py times.

A step is what Lightning's automatic optimization runs for one micro-batch with K = W = 1:
DistillModule.training_step under bf16 autocast, backward, gradient clipping at norm 1, the
AdamW step (fp32 state on fp32 master weights), zero_grad.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from distill.data.masks import batch_masks, local_step_counts
from distill.training.module import DistillModule
from distill.training.normalization import token_weights
from distill.training.optim import adamw
from distill.training.teachers import LiveTeacher

K_CACHED = 64
LLAMA = dict(student=dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                          num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                          tie_word_embeddings=True),
             teacher=dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                          num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                          tie_word_embeddings=False),
             common=dict(vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5,
                         max_position_embeddings=8192))
QWEN = dict(student=dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2,
                         tie_word_embeddings=True),
            teacher=dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                         num_attention_heads=28, num_key_value_heads=4,
                         tie_word_embeddings=False),
            common=dict(vocab_size=151936, rope_theta=1e6, rms_norm_eps=1e-6,
                        max_position_embeddings=8192))
TINY = dict(student=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=True),
            teacher=dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=False),
            common=dict(vocab_size=300, max_position_embeddings=256))


# --- models and batches -----------------------------------------------------------------
def build(pair: str, run):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    spec = TINY if run.args.tiny else {"llama": LLAMA, "qwen": QWEN}[pair]
    cfg_cls, model_cls = ((Qwen2Config, Qwen2ForCausalLM) if pair == "qwen"
                          else (LlamaConfig, LlamaForCausalLM))
    torch.manual_seed(0)
    with torch.device(run.device):
        student = model_cls(cfg_cls(**spec["common"], **spec["student"])).float()
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16 if run.cuda else torch.float32)
        try:
            teacher_model = model_cls(cfg_cls(**spec["common"], **spec["teacher"]))
        finally:
            torch.set_default_dtype(default)
    return student, live_teacher(teacher_model)


def live_teacher(model) -> LiveTeacher:
    """A LiveTeacher around a model built here (LiveTeacher loads from a path)."""
    return LiveTeacher.from_model(model)


class TargetsOnDevice(torch.nn.Module):
    """A cached teacher whose top-k targets are already tensors: in the batch (from a
    prefetching loader) or fixed ones."""

    model = None

    def __init__(self, ids=None, logprobs=None):
        super().__init__()
        self.ids, self.logprobs = ids, logprobs

    def targets(self, batch):
        if "target_ids" in batch:
            return {"target_ids": batch["target_ids"], "target_logprobs": batch["target_logprobs"]}
        return {"target_ids": self.ids, "target_logprobs": self.logprobs}


def make_batch(rows: int, seq: int, vocab: int, device) -> dict:
    g = torch.Generator().manual_seed(rows)
    ids = torch.randint(0, vocab, (rows, seq), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    return {k: v.to(device) for k, v in batch.items()}


@torch.no_grad()
def top_k_targets(teacher: LiveTeacher, batch: dict, vocab: int, k: int = K_CACHED):
    """The teacher's top-k log-probs of every shifted position, in row slices."""
    t = teacher.targets(batch)
    ids, lps = [], []
    for s in range(0, len(t["teacher_hidden"]), 2048):
        z = (t["teacher_hidden"][s:s + 2048] @ t["teacher_weight"][:vocab].T).float()
        top = torch.log_softmax(z, -1).topk(k, -1)
        ids.append(top.indices.int())
        lps.append(top.values)
    return torch.cat(ids), torch.cat(lps)


# --- steps --------------------------------------------------------------------------------
def make_module(student, teacher, vocab: int, lr: float = 1e-5) -> DistillModule:
    # the runs' own optimizer (optimizer=adamw_grouped)
    module = DistillModule(student, teacher, loss={"kind": "forward_kl"},
                           optimizer=functools.partial(adamw, lr=lr, weight_decay=0.01),
                           vocab_size=vocab)
    module.optimizer = module.configure_optimizers()
    return module


def autocast(run):
    return torch.autocast(run.device.type, torch.bfloat16, enabled=run.cuda)


def optimizer_step(module) -> None:
    torch.nn.utils.clip_grad_norm_(module.student.parameters(), 1.0)
    module.optimizer.step()
    module.optimizer.zero_grad(set_to_none=True)


def distill_step(module, batch, run):
    """DistillModule.training_step's work for K = W = 1 (the step's counts are the batch's
    own), without Lightning around it: the objective, backward, the optimizer."""
    def step():
        masks = batch_masks(batch)
        weights = token_weights(module.cfg.normalization, masks,
                                local_step_counts(masks)).flatten()
        with autocast(run):
            loss, _, _ = module.objective.train(module.student, batch, weights)
        loss.backward()
        optimizer_step(module)
    return step


def loader_step(module, batch, run, ids, lps, workers: int):
    """Cached targets that travel with their batch through a prefetching DataLoader."""
    from torch.utils.data import DataLoader

    cpu = {k: v.cpu() for k, v in batch.items()}
    cpu.update(target_ids=ids.cpu(), target_logprobs=lps.cpu())
    loader = DataLoader(_Repeat(cpu), batch_size=None, num_workers=workers,
                        pin_memory=run.cuda, prefetch_factor=4 if workers else None,
                        persistent_workers=bool(workers))
    it = iter(loader)
    inner = distill_step(module, batch, run)

    def step():
        got = next(it)
        batch.update({k: v.to(run.device, non_blocking=True) for k, v in got.items()})
        inner()
    return step


class _Repeat(torch.utils.data.Dataset):
    def __init__(self, batch):
        self.batch = batch

    def __len__(self):
        return 1 << 20

    def __getitem__(self, i):
        return {k: v.clone() for k, v in self.batch.items()}


def full_logits_step(module, batch, run):
    """The plain HF way: both models' full logits, torch forward KL over valid positions."""
    student, teacher = module.student, module.teacher.model
    n = int((batch["labels"][:, 1:] != -100).sum())

    def step():
        with autocast(run):
            zs = student(input_ids=batch["input_ids"], use_cache=False).logits[:, :-1]
            with torch.no_grad():
                zt = teacher(input_ids=batch["input_ids"], use_cache=False).logits[:, :-1]
            v = module.vocab_size
            loss = F.kl_div(torch.log_softmax(zs[..., :v].float(), -1),
                            torch.log_softmax(zt[..., :v].float(), -1),
                            log_target=True, reduction="sum") / n
        loss.backward()
        optimizer_step(module)
    return step


def teacher_step(module, batch, run):
    def step():
        with autocast(run):
            module.teacher.targets(batch)
    return step


