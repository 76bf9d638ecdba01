"""Without a GPU the Triton kernels run in Triton's interpreter, on CPU fp32 tensors.

Triton decides at decoration time whether a function is interpreted, for its own
`triton.language` helpers (tl.zeros, tl.sum, ...) as for our kernels. The variable is set
here; if triton was imported before (lightning imports it, so the whole suite in one
process does), `triton_kernels` re-decorates both by reloading the modules.
"""

import importlib
import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture
def triton_kernels(monkeypatch):
    """distill.ops.divergence_triton, interpreted on CPU, with small blocks there."""
    mod = importlib.import_module("distill.ops.divergence_triton")
    if not ON_GPU:
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(tl.standard.zeros, InterpretedFunction):
            importlib.reload(tl.standard)
            importlib.reload(tl.random)
            importlib.reload(tl)
        if not isinstance(mod._live_fwd_kernel, InterpretedFunction):
            # the device functions first, then the kernels that call them
            for name in ("distill.ops.triton_math", "distill.ops.sparse_triton"):
                importlib.reload(importlib.import_module(name))
            mod = importlib.reload(mod)
        gemm = importlib.import_module("distill.ops.logits_gemm")
        if not isinstance(gemm._logits_stats_kernel, InterpretedFunction):
            gemm = importlib.reload(gemm)
        monkeypatch.setitem(gemm.CONFIG, "gemm", (16, 64, 16, 4, 2))
        # several blocks per row and a partial last one, at vocabularies of a few hundred
        monkeypatch.setitem(mod.CONFIG, "live", (64, 4))
        monkeypatch.setitem(mod.CONFIG, "sparse", (64, 4))
    return mod
