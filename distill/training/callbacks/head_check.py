"""Refuse, at the first training batch, a model whose logits the loss would get wrong.

The loss never calls a model's forward: it rebuilds the logits from the final hidden
states, the LM-head weight and the extras `distill.models.causal_lm.lm_head` knows (bias, logit
scale, soft-capping). A family that post-processes its logits some other way would
silently train against the wrong distribution. So on the first batch, for the student
and a live teacher, a few positions of that rebuilt head are compared with the model's
own `forward().logits` (one short row slice: the check costs one tiny forward).
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info

from distill.models.causal_lm import final_hidden_states, lm_head
from distill.models.levers import compiler_stance

# Max |difference| as a fraction of the largest |logit|, by the lowest precision among
# hidden states, head weight and forward logits: bf16 rounds each logit (and each step of
# a soft-cap) to ~0.4%, while a missed scale or cap is off by tens of percent.
TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-3, torch.float16: 1e-2,
             torch.bfloat16: 3e-2}
_ORDER = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def head_mismatch(model, input_ids: torch.Tensor, vocab: int | None = None,
                  tolerance: float | None = None) -> str | None:
    """None when the loss's logits match `model(input_ids).logits`, else what differs.

    Runs in eval mode (dropout would make the two paths differ) under no_grad; the caller
    picks the autocast context, so both paths see the dtypes training will use.
    """
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            hidden = final_hidden_states(model, input_ids)  # (1, T, H)
            weight, head = lm_head(model)
            theirs = model(input_ids=input_ids, use_cache=False).logits  # (1, T, V')
            vocab = vocab or weight.shape[0]
            # fp32 outside autocast, as the fused loss takes its logits out of the GEMM
            with torch.autocast(hidden.device.type, enabled=False):
                ours = _fp32(head, vocab).logits(hidden.float(), weight[:vocab].float())
    finally:
        model.train(was_training)
    theirs_f = theirs[..., :vocab].float()
    dtype = min((hidden.dtype, weight.dtype, theirs.dtype), key=_ORDER.index)
    tol = tolerance if tolerance is not None else TOLERANCE[dtype]
    peak = theirs_f.abs().max().clamp_min(1e-12)
    err = ((ours - theirs_f).abs().max() / peak).item()
    if err <= tol:
        return None
    # a least-squares ratio names the usual culprit: a logit scale the loss does not apply
    ratio = ((ours * theirs_f).sum() / (ours * ours).sum().clamp_min(1e-30)).item()
    return (f"{type(model).__name__}: the loss's logits (final hidden states -> LM head "
            f"with bias={'yes' if head.bias is not None else 'no'}, scale={head.scale:g}, "
            f"softcap={head.softcap}) differ from the model's own forward().logits by "
            f"{err:.3g} of the largest logit (tolerance {tol:g} for {str(dtype)[6:]}); "
            f"forward's logits are about {ratio:.4g} x the loss's")


def _fp32(head, vocab):
    if head.bias is None:
        return head
    return type(head)(head.bias[:vocab].float(), head.scale, head.softcap)


class HeadCheck(L.Callback):
    """Compares the loss's logits with the model's own on `positions` tokens of the first
    training batch's first row, for the student and a live teacher; raises on a mismatch.

    `tolerance` overrides the dtype-aware one (a fraction of the largest |logit|).
    Remove it with `callbacks.head_check=null` only for a difference known to be harmless.
    """

    def __init__(self, positions: int = 16, tolerance: float | None = None):
        if positions < 1:
            raise ValueError(f"HeadCheck positions must be >= 1, got {positions}")
        self.positions, self.tolerance = positions, tolerance
        self.done = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.done:
            return
        self.done = True
        from lightning.pytorch.strategies import FSDPStrategy

        if isinstance(trainer.strategy, FSDPStrategy):  # sharded heads: no full weight here
            rank_zero_info("head check skipped under FSDP (the LM heads are sharded)")
            return
        ids = batch["input_ids"][:1, : self.positions]
        models = {"student": (pl_module.student, ids, pl_module.vocab_size)}
        teacher = getattr(pl_module.teacher, "model", None)
        if teacher is not None:  # a cached one has none
            # a teacher with its own tokenizer reads its own tokens (distill.xtok)
            t_ids = batch.get("teacher_input_ids", batch["input_ids"])[:1, : self.positions]
            vocab = getattr(pl_module.teacher, "vocab_size", pl_module.vocab_size)
            models["teacher"] = (teacher, t_ids, vocab)
        problems = []
        with trainer.precision_plugin.forward_context(), _uncompiled():
            for who, (model, tokens, vocab) in models.items():
                problem = head_mismatch(model, tokens, vocab, self.tolerance)
                if problem:
                    problems.append(f"{who} {problem}")
        if problems:
            raise RuntimeError(
                "the fused loss would not see these models' real logits:\n  "
                + "\n  ".join(problems) + "\ndistill applies an LM-head bias, a logit scale "
                "(Cohere's logit_scale, Granite's 1 / logits_scaling) and soft-capping "
                "(Gemma's final_logit_softcapping); this family's forward() does something "
                "else to its logits. Please report the model class; disabling the check "
                "(callbacks.head_check=null) trains against the wrong distribution.")
        rank_zero_info(f"head check passed for {', '.join(models)} "
                       f"({ids.shape[1]} positions)")


@contextmanager
def _uncompiled():
    """Compiled code runs eagerly inside (torch >= 2.6): the layers `speed.compile` compiled
    and transformers' flex_attention would otherwise be traced and compiled for a 16-token
    row, graphs the module drops before its first training forward
    (DistillModule._drop_earlier_traces): compile time spent for nothing at every start."""
    with warnings.catch_warnings():
        # flex_attention's one-time advice to compile it: it is compiled, but not here (torch
        # records the advice as given, so a later uncompiled call in this process gets none)
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        # older torch: traced here, dropped before the first step
        with compiler_stance("force_eager"):
            yield
