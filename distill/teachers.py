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
        self.model.eval()

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
            teacher_head=t["teacher_head"], labels=shift_flat(batch["labels"]),
            weights=weights, kind="forward_kl", vocab_size=vocab_size, return_components=True,
        )
        return parts["ce"]
