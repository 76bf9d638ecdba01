"""Input checks for `linear_divergence`: clear errors instead of silent garbage.

Checks that need the data (label range, finite log-probs) cost one small reduction each;
they run once per call, not per chunk.
"""

from __future__ import annotations

import math

import torch


def _fail(msg: str):
    raise ValueError(msg)


def check_inputs(hs, ws, ht, wt, ids, lps, labels, weights, spec, vocab_size, ignore_index,
                 ce_rows=None) -> int:
    """Validate shapes, devices and values; return the vocabulary size the loss uses."""
    if hs.dim() != 2 or ws.dim() != 2:
        _fail(f"student_hidden must be (N, H) and student_weight (V, H); got "
              f"{tuple(hs.shape)} and {tuple(ws.shape)} (flatten batch and time first)")
    if hs.shape[1] != ws.shape[1]:
        _fail(f"student hidden size {hs.shape[1]} != student_weight columns {ws.shape[1]}")
    n = hs.shape[0]
    live, cached = ht is not None or wt is not None, ids is not None or lps is not None
    if live == cached:
        _fail("give exactly one target: teacher_hidden + teacher_weight (live teacher) or "
              "target_ids + target_logprobs (cached teacher)")
    rows = [ws.shape[0]]
    tensors = {"student_hidden": hs, "student_weight": ws}
    if live:
        if ht is None or wt is None:
            _fail("a live teacher needs both teacher_hidden and teacher_weight")
        if ht.dim() != 2 or ht.shape[0] != n or wt.dim() != 2 or ht.shape[1] != wt.shape[1]:
            _fail(f"teacher_hidden must be (N={n}, Ht) and teacher_weight (V, Ht); got "
                  f"{tuple(ht.shape)} and {tuple(wt.shape)}")
        rows.append(wt.shape[0])
        tensors.update(teacher_hidden=ht, teacher_weight=wt)
    else:
        if ids is None or lps is None:
            _fail("cached targets need both target_ids and target_logprobs")
        if ids.shape != lps.shape or ids.dim() != 2 or ids.shape[0] != n:
            _fail(f"target_ids and target_logprobs must both be (N={n}, K); got "
                  f"{tuple(ids.shape)} and {tuple(lps.shape)}")
        tensors.update(target_ids=ids, target_logprobs=lps)
    vocab = _vocab(rows, vocab_size)
    if labels is not None:
        tensors["labels"] = labels
    elif spec.ce_weight or ce_rows is not None:
        _fail("ce_weight > 0 needs labels (the hard targets of the cross-entropy)")
    for name, t in (("weights", weights), ("ce_weight", ce_rows)):
        if t is not None:
            if t.shape != (n,):
                _fail(f"{name} must be a number or (N={n},), got {tuple(t.shape)}")
            tensors[name] = t
    _same_device(tensors)  # before the checks of the values, which combine tensors
    if cached:
        _check_cached(ids, lps, vocab)
    if labels is not None:
        _check_labels(labels, n, vocab, ignore_index)
    if ce_rows is not None and bool((ce_rows < 0).any() | ~torch.isfinite(ce_rows).all()):
        _fail("per-position ce_weight values must be finite and >= 0")
    return vocab


def check_ce_inputs(hidden, weight, labels, weights, vocab_size, ignore_index) -> int:
    """`linear_cross_entropy`'s inputs; returns the vocabulary size it uses."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        _fail(f"hidden must be (N, H) and weight (V, H); got {tuple(hidden.shape)} and "
              f"{tuple(weight.shape)} (flatten batch and time first)")
    n = hidden.shape[0]
    vocab = _vocab([weight.shape[0]], vocab_size)
    _check_labels(labels, n, vocab, ignore_index)
    tensors = {"hidden": hidden, "weight": weight, "labels": labels}
    if weights is not None:
        if weights.shape != (n,):
            _fail(f"weights must be (N={n},), got {tuple(weights.shape)}")
        tensors["weights"] = weights
    _same_device(tensors)
    return vocab


def _check_labels(labels, n: int, vocab: int, ignore_index: int) -> None:
    if labels.shape != (n,):
        _fail(f"labels must be (N={n},), got {tuple(labels.shape)}")
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
    if bool(bad.any()):
        _fail(f"labels out of range: {int(labels[bad][0])} is neither ignore_index "
              f"({ignore_index}) nor a token id in [0, {vocab})")


def _same_device(tensors: dict) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        _fail(f"all inputs must be on one device, got {devices}")


def _vocab(rows: list[int], vocab_size: int | None) -> int:
    if vocab_size is None:
        if len(set(rows)) > 1:
            _fail(f"student and teacher LM heads have {rows[0]} and {rows[1]} rows: pass "
                  "vocab_size=len(tokenizer) to use the shared first rows (padding rows "
                  "differ), or check that both models use the same tokenizer")
        return rows[0]
    if vocab_size > min(rows):
        _fail(f"vocab_size={vocab_size} exceeds an LM head's rows {rows}: the models do not "
              "share this tokenizer's vocabulary")
    return vocab_size


def _check_cached(ids, lps, vocab):
    if ids.shape[1] > vocab:
        _fail(f"K={ids.shape[1]} cached ids per position exceeds the vocabulary size {vocab}")
    if ids.dtype not in (torch.int32, torch.int64):
        _fail(f"target_ids must be int32 or int64, got {ids.dtype}")
    # -inf is a zero probability (a one-hot or masked teacher); NaN and +inf are not.
    # Both flags come back in one transfer: one wait for the device, not two.
    bad_ids, bad_lps = torch.stack([((ids < 0) | (ids >= vocab)).any(),
                                    (torch.isnan(lps) | (lps == math.inf)).any()]).tolist()
    if bad_ids:
        _fail(f"target_ids out of range [0, {vocab}): the cache was written with another "
              "tokenizer or vocabulary")
    if bad_lps:
        _fail("target_logprobs has NaN or +inf values: the teacher cache is corrupt "
              "(rebuild it with distill-cache)")
