"""The CUDA path (cuBLAS GEMMs with fp32 out, bf16 operands under autocast) against the
float64 oracle. Skipped without a GPU."""

import pytest
import torch

from distill.xtok import cross_tokenizer_divergence
from tests.conftest import TOLERANCES
from tests.xtok.helpers import as_dtype, make_case
from tests.xtok.test_loss import oracle

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("mode,kind", [("uld", "reverse_kl"), ("hybrid", "forward_kl"),
                                       ("hybrid", "reverse_kl"), ("hybrid", "jsd")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_oracle(mode, kind, dtype):
    x, vmap = make_case(ns=300, nt=290, vs=1271, vt=1031, hs=64, ht=48, pairs=700)
    kw = dict(mode=mode, kind=kind, temperature=1.5, ce_weight=0.3)
    # the oracle on the inputs as the GPU sees them (rounded to dtype)
    x = as_dtype(as_dtype(x, dtype), torch.float64)
    ref = oracle(x, vmap, grad_scale=0.5, **kw)
    cuda = {k: v.cuda() for k, v in as_dtype(x, dtype).items()}
    h = cuda["student_hidden"].requires_grad_()
    w = cuda["student_weight"].float().requires_grad_()  # fp32 master weight
    rest = {k: v for k, v in cuda.items() if k not in ("student_hidden", "student_weight")}
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        loss = cross_tokenizer_divergence(h, w, vocab_map=vmap, chunk_size=64, **rest, **kw)
    (loss * 0.5).backward()
    rtol, atol = TOLERANCES[dtype]
    for a, b in zip((loss, h.grad, w.grad), ref):
        torch.testing.assert_close(a.detach().double().cpu(), b, rtol=rtol,
                                   atol=atol * float(b.abs().max()))
