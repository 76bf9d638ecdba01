"""Teachers give the loss its targets for a batch: live hidden states or cached top-k.

Both return the keyword arguments of `linear_divergence` for the batch's flattened,
shifted positions (position t of a row predicts token t + 1).
"""

from __future__ import annotations

import torch

from distill.losses import linear_divergence
from distill.models import final_hidden_states, lm_head, load_causal_lm


def shift_flat(x: torch.Tensor) -> torch.Tensor:
    """(B, T, ...) -> (B * (T - 1), ...): drop the last position, which predicts nothing."""
    return x[:, :-1].reshape(-1, *x.shape[2:])


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """(B, T) -> (B * (T - 1),): position t is trained on token t + 1 (HF-aligned labels)."""
    return labels[:, 1:].reshape(-1)


class LiveTeacher(torch.nn.Module):
    """A frozen causal LM run beside the student on the same input_ids, under no_grad.

    Only its base model runs; the loss receives its last hidden state and LM-head weight,
    so the teacher's logits are never built either.
    """

    def __init__(self, name_or_path: str, dtype: str = "float32",
                 attn_implementation: str | None = None, tokenizer: str | None = None):
        super().__init__()
        self.name_or_path = name_or_path
        self.tokenizer_path = tokenizer or name_or_path  # checked against the student's
        self.model = load_causal_lm(name_or_path, dtype=dtype,
                                    attn_implementation=attn_implementation)
        self.model.requires_grad_(False)
        self.eval()

    @classmethod
    def from_model(cls, model) -> LiveTeacher:
        """A teacher around a model already in memory (benchmarks build theirs with random
        weights); no tokenizer to check it against."""
        teacher = cls.__new__(cls)
        torch.nn.Module.__init__(teacher)
        teacher.name_or_path, teacher.tokenizer_path = type(model).__name__, None
        teacher.model = model.requires_grad_(False)
        return teacher.eval()

    def train(self, mode: bool = True):
        # Lightning puts the whole LightningModule in train mode; the teacher stays in eval.
        return super().train(False)

    @torch.no_grad()
    def targets(self, batch: dict) -> dict:
        hidden = final_hidden_states(self.model, batch["input_ids"],
                                     batch.get("attention_mask"), batch.get("position_ids"))
        weight, head = lm_head(self.model)
        return {"teacher_hidden": shift_flat(hidden), "teacher_weight": weight,
                "teacher_head": head}

    @torch.no_grad()
    def cross_entropy_sum(self, batch: dict, weights: torch.Tensor, vocab_size=None):
        """sum_i w_i * CE_i of the teacher on the batch's labels (for val perplexity)."""
        t = self.targets(batch)
        _, parts = linear_divergence(
            t["teacher_hidden"], t["teacher_weight"], teacher_hidden=t["teacher_hidden"],
            teacher_weight=t["teacher_weight"], student_head=t["teacher_head"],
            teacher_head=t["teacher_head"], labels=shift_labels(batch["labels"]),
            weights=weights, kind="forward_kl", vocab_size=vocab_size, return_components=True,
        )
        return parts["ce"]


class CachedTeacher(torch.nn.Module):
    """Top-k teacher log-probs read from the offline cache: no teacher model is loaded.

    The cache must have been written for this run: its teacher, K and temperature are
    checked here, its tokenizer, max length and data fingerprints by `check_data`, and
    every example's tokens when its batch is served. The loss applies `sparse_mode`
    (tail bucket or renormalize) to the returned (N, K) targets.
    """

    model = None  # nothing to run, evaluate or checkpoint

    def __init__(self, dir: str, teacher: str, top_k: int, temperature: float = 1.0,
                 sparse_mode: str = "tail"):
        super().__init__()
        from distill.cache.reader import TeacherCache  # the cache imports this module

        if sparse_mode not in ("tail", "renormalize"):
            raise ValueError(f"sparse_mode must be 'tail' or 'renormalize', got {sparse_mode!r}")
        self.cache = TeacherCache(dir)
        self.cache.expect("teacher", str(teacher))
        self.cache.expect("top_k", int(top_k))
        self.cache.expect("temperature", float(temperature))
        self.sparse_mode = sparse_mode

    def check_data(self, datamodule, tokenizer) -> None:
        """Refuse a cache written for another tokenizer, max length or data."""
        from distill.cache.plan import describe

        self.cache.check_tokenizer(tokenizer)
        self.cache.expect("max_length", int(datamodule.max_length))
        datamodule.setup("fit")
        # the cache is per example: packed rows are checked by the examples they hold
        train = getattr(datamodule, "train_examples", None) or datamodule.train_set
        for split, ds in (("train", train), ("val", datamodule.val_set)):
            if ds is not None:
                self.cache.check_split(split, describe(ds).fingerprint)

    def prefetch_in(self, datamodule) -> None:
        """Read each batch's targets in the DataLoader's collate: in its workers when
        data.num_workers > 0, so the cache is read ahead of training, and on CPU tensors
        either way, so the step needs no host sync."""
        datamodule.collate = TargetsCollate(datamodule.collate, self.cache)

    @torch.no_grad()
    def targets(self, batch: dict) -> dict:
        if "target_ids" in batch:  # read by the loader (prefetch_in)
            ids, logprobs = batch["target_ids"], batch["target_logprobs"]
        else:
            ids, logprobs = self.cache.batch_targets(batch)
        device = batch["input_ids"].device
        return {"target_ids": ids.to(device, non_blocking=True),
                "target_logprobs": logprobs.to(device, non_blocking=True)}


class TargetsCollate:
    """A collate function followed by the batch's cached targets (picklable, for workers)."""

    def __init__(self, collate, cache):
        self.collate, self.cache = collate, cache

    def __call__(self, examples):
        batch = self.collate(examples)
        batch["target_ids"], batch["target_logprobs"] = self.cache.batch_targets(batch)
        return batch
