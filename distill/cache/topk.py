"""Top-k teacher log-probabilities of the trained positions, chunk by chunk.

Only the trained rows are projected, and only `chunk x V` fp32 logits exist at a time:
a 4096-token sequence against a 128k vocabulary would otherwise need 2 GiB per sequence.
"""

from __future__ import annotations

import torch

from distill.ops.chunked import project
from distill.ops.spec import HeadTransform

# fp32 logits per chunk, in bytes
CHUNK_BUDGET_BYTES = {"cuda": 1 << 30, "cpu": 64 << 20}


def chunk_rows(vocab: int, device: torch.device) -> int:
    budget = CHUNK_BUDGET_BYTES["cuda" if device.type == "cuda" else "cpu"]
    return max(1, budget // (4 * vocab))


@torch.no_grad()
def topk_logprobs(hidden: torch.Tensor, weight: torch.Tensor, k: int, temperature: float = 1.0,
                  head: HeadTransform | None = None, chunk: int | None = None):
    """(M, H) hidden states, (V, H) LM head -> ids (M, K) int32, log-probs (M, K) fp32.

    log-probs are of softmax(logits / temperature) over the V rows, sorted falling.
    """
    m, vocab = hidden.shape[0], weight.shape[0]
    if not 0 < k <= vocab:
        raise ValueError(f"top_k must be in [1, vocab={vocab}], got {k}")
    ids = torch.empty((m, k), dtype=torch.int32, device=hidden.device)
    logprobs = torch.empty((m, k), dtype=torch.float32, device=hidden.device)
    chunk = chunk or chunk_rows(vocab, hidden.device)
    buf = torch.empty((min(chunk, m), vocab), dtype=torch.float32, device=hidden.device)
    for start in range(0, m, chunk):  # autocast off: logits stay fp32 out of the GEMM
        stop = min(m, start + chunk)
        with torch.autocast(hidden.device.type, enabled=False):
            z, _ = project(hidden[start:stop], weight, head, buf[: stop - start])  # (c, V)
        if temperature != 1.0:
            z /= temperature
        lse = torch.logsumexp(z, dim=-1, keepdim=True)
        top, idx = torch.topk(z, k, dim=-1, sorted=True)
        logprobs[start:stop] = top - lse
        ids[start:stop] = idx.to(torch.int32)
    return ids, logprobs
