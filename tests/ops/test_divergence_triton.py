"""The Triton row kernels (through linear_divergence) against the float64 oracle.

The small fp32 tests run everywhere: in Triton's interpreter on CPU (tests/ops/conftest.py),
on the GPU when there is one. The `gpu` tests use realistic sizes, bf16/fp16/fp32 inputs and
the per-dtype tolerances of tests/conftest.py.
"""

import pytest
import torch

from distill.losses import linear_divergence
from distill.ops.chunked import Tuning
from tests.conftest import TOLERANCES
from tests.losses.helpers import (
    assert_close,
    frozen_head_grads,
    make_inputs,
    row_tolerance,
    run_both,
)
from tests.oracle import assert_rows_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KINDS = [("forward_kl", {}), ("reverse_kl", {}), ("jsd", {"beta": 0.3})]
SMALL = dict(n=13, v=257, hs=24, ht=20, device=DEVICE)
# numpy (the interpreter) warns where the kernels take log(0) or 0/0 in a discarded branch
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")


# The op's two Triton paths: cuBLAS-style GEMMs and a full row kernel, each chunk folded
# alone; the stats-epilogue GEMM (pass 1 in the GEMM) with chunks folded two at a time.
PATHS = {"plain": Tuning(stats_gemm=False, fold_group=1),
         "stats+fold": Tuning(stats_gemm=True, fold_group=2)}
_PATH = {"tuning": None}  # the op_path of the running test


def _triton(**kw):
    return linear_divergence(**kw, backend="triton", tuning=_PATH["tuning"])


def _any_backend(**kw):
    return linear_divergence(**kw, tuning=_PATH["tuning"])


@pytest.fixture(params=list(PATHS))
def op_path(request):
    _PATH["tuning"] = PATHS[request.param]
    yield request.param
    _PATH["tuning"] = None


@pytest.mark.parametrize("kind,extra", KINDS)
@pytest.mark.parametrize("temperature,ce_weight", [(1.0, 0.0), (2.0, 0.5)])
def test_live_teacher(triton_kernels, op_path, kind, extra, temperature, ce_weight):
    x = make_inputs(**SMALL)
    got, ref = run_both(x, _triton, grad_scale=0.5, kind=kind, temperature=temperature,
                        ce_weight=ce_weight, temperature_squared=temperature != 1.0,
                        chunk_size=5, **extra)
    assert_close(got, ref, torch.float32)


@pytest.mark.parametrize("kind,extra", KINDS)
@pytest.mark.parametrize("sparse_mode", ["tail", "renormalize"])
def test_cached_topk(triton_kernels, op_path, kind, extra, sparse_mode):
    x = make_inputs(k=7, **SMALL)
    got, ref = run_both(x, _triton, grad_scale=1.7, kind=kind, sparse_mode=sparse_mode,
                        temperature=1.5, ce_weight=0.3, chunk_size=6, **extra)
    assert_close(got, ref, torch.float32)


@pytest.mark.parametrize("kind,extra", KINDS)
def test_several_folds(triton_kernels, op_path, kind, extra):
    """Chunks of 4 rows folded (2 at a time on the stats path): d weight is written by the
    first fold and accumulated by the next ones, including a short last chunk and fold."""
    x = make_inputs(n=43, v=203, hs=24, ht=16, ignore_frac=0.2, device=DEVICE)
    got, ref = run_both(x, _triton, grad_scale=0.7, kind=kind, ce_weight=0.2, chunk_size=4,
                        **extra)
    assert_close(got, ref, torch.float32)


@pytest.mark.parametrize("cached", [False, True])
def test_frozen_head_makes_no_weight_gradient(triton_kernels, op_path, cached):
    """LoRA's frozen LM head on the Triton paths: d hidden right, weight.grad None, and
    no tensor of the weight's shape is made (no fold buffer or GEMM for it either)."""
    x = make_inputs(n=13, v=61, hs=24, ht=20, k=5 if cached else None, device=DEVICE)
    kw = dict(kind="reverse_kl", ce_weight=0.3, temperature=1.5, chunk_size=4)
    loss, got, rec = frozen_head_grads(x, _triton, ("student_hidden",), **kw)
    ref_result = run_both(x, _triton, grad_scale=0.5, **kw)[1]
    ref_loss, ref = ref_result
    torch.testing.assert_close(loss.double().cpu(), ref_loss.cpu(), rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(got["student_hidden"].double().cpu(),
                               ref["student_hidden"].cpu(), rtol=1e-4, atol=1e-6)
    rtol = row_tolerance(torch.float32)
    scales = ref_result.row_scales(rtol, torch.float32)
    assert_rows_close(got["student_hidden"], ref["student_hidden"], rtol, 1e-30,
                      "student_hidden", scales["student_hidden"])
    assert got["student_weight"] is None and (61, 24) not in rec.shapes()
    _, _, both = frozen_head_grads(x, _triton, ("student_hidden", "student_weight"), **kw)
    assert (61, 24) in both.shapes()


def test_weights_every_row_trained_and_negative_grad_output(triton_kernels):
    x = make_inputs(ignore_frac=0.0, **SMALL)
    x["weights"] = torch.rand(13, device=DEVICE)
    got, ref = run_both(x, _triton, grad_scale=-2.0, kind="jsd", beta=0.6, temperature=0.7,
                        ce_weight=1.0)
    assert_close(got, ref, torch.float32)


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd"])
def test_sparse_with_k_equal_v_equals_dense(triton_kernels, kind):
    x = make_inputs(n=9, v=97, hs=16, ht=16, device=DEVICE)
    sparse, dense = _all_ids_cached_and_live(x, kind=kind, backend="triton")
    torch.testing.assert_close(sparse, dense, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_cached_targets_in_any_layout_when_every_row_trains(triton_kernels, backend):
    """No labels and no weights: every row trains and the op takes the cached targets as
    given, without gathering rows. int32 ids and column-major (non-contiguous) ids and
    log-probs give the loss and gradients of contiguous int64 ones, on both backends."""
    x = make_inputs(k=7, **SMALL)
    del x["labels"]
    ids, lps = x.pop("target_ids"), x.pop("target_logprobs")
    odd = dict(target_ids=ids.int().t().contiguous().t(),
               target_logprobs=lps.t().contiguous().t())
    assert not odd["target_ids"].is_contiguous() and not odd["target_logprobs"].is_contiguous()
    out = []
    for targets in (dict(target_ids=ids.long(), target_logprobs=lps), odd):
        hs = x["student_hidden"].clone().requires_grad_()
        ws = x["student_weight"].clone().requires_grad_()
        loss = linear_divergence(hs, ws, kind="forward_kl", backend=backend, **targets)
        loss.backward()
        out.append((loss.detach(), hs.grad, ws.grad))
    for a, b in zip(*out):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def _all_ids_cached_and_live(x, **kw):
    """(loss with all V ids cached as targets, loss with the live teacher they come from)."""
    n, v = x["student_hidden"].shape[0], x["student_weight"].shape[0]
    device = x["student_hidden"].device
    logp = torch.log_softmax(x["teacher_hidden"].float() @ x["teacher_weight"].float().T, -1)
    ids = torch.arange(v, device=device).expand(n, v).contiguous()
    student = (x["student_hidden"], x["student_weight"])
    sparse = linear_divergence(*student, target_ids=ids, target_logprobs=logp,
                               labels=x["labels"], **kw)
    dense = linear_divergence(*student, teacher_hidden=x["teacher_hidden"],
                              teacher_weight=x["teacher_weight"], labels=x["labels"], **kw)
    return sparse, dense


def test_rows_match_the_torch_rows(triton_kernels):
    """The kernel's own contract: loss, gradient (row-scaled) and cross-entropy per row."""
    from distill.ops.divergence_torch import rows_loss_and_grad as torch_rows
    from distill.ops.spec import DivergenceSpec

    zs, zt = torch.randn(6, 300, device=DEVICE) * 5, torch.randn(6, 300, device=DEVICE) * 5
    labels, scale = torch.randint(0, 300, (6,), device=DEVICE), torch.rand(6, device=DEVICE)
    spec = DivergenceSpec("reverse_kl", temperature=1.3, ce_weight=0.2)
    ce_a, ce_b = torch.empty(6, device=DEVICE), torch.empty(6, device=DEVICE)
    la, da = torch_rows(zs, zt, None, None, labels, spec, True, row_scale=scale, ce_out=ce_a)
    lb, db = triton_kernels.rows_loss_and_grad(zs.clone(), zt, None, None, labels, spec, True,
                                               row_scale=scale, ce_out=ce_b)
    torch.testing.assert_close(lb, la, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ce_b, ce_a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(db, da, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("temperature,untempered,tma_store,odd",
                         [(1.0, False, 0, 11), (0.7, True, 0, 11), (2.0, True, 2, 12),
                          (1.0, False, 1, 16), (1.0, False, 4, 20)])
def test_logits_gemm_stats_match_float64(triton_kernels, temperature, untempered, tma_store,
                                         odd):
    """The GEMM's logits and per-tile (max, sum of exp) on odd shapes, for each way of
    storing the logits (V = 3 BN + 11 has unaligned rows: per-thread stores then; the
    others are aligned, so the TMA stores run)."""
    from distill.ops import logits_gemm

    bn = logits_gemm.CONFIG["gemm"][1] if DEVICE == "cuda" else 64
    c, h, v = 37, 40, 3 * bn + odd  # partial row tile and partial last column tile
    hid, w = torch.randn(c, h, device=DEVICE), torch.randn(v, h, device=DEVICE) * 0.5
    z = torch.full((c, v), float("nan"), device=DEVICE)
    st = logits_gemm.logits_and_stats(hid, w, z, inv_t=1 / temperature, untempered=untempered,
                                      tma_store=tma_store)
    ref = hid.double() @ w.double().T
    torch.testing.assert_close(z.double(), ref, rtol=1e-5, atol=1e-5)
    nt = -(-v // bn)
    assert st.shape == (2 + 2 * untempered, c, nt)

    def tiles(x):
        return torch.nn.functional.pad(x, (0, nt * bn - v), value=float("-inf")).view(c, nt, bn)

    # each tile's max is of z itself (T > 0 keeps the order), its sums of exp((z - max) / T)
    sets = [1 / temperature] + ([1.0] if untempered else [])
    a = tiles(ref)
    m = a.amax(-1)
    for i, inv in enumerate(sets):
        torch.testing.assert_close(st[2 * i].double(), m, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(st[2 * i + 1].double(),
                                   ((a - m[..., None]) * inv).exp().sum(-1),
                                   rtol=1e-5, atol=1e-5)


def test_a_gemm_config_is_checked():
    with pytest.raises(ValueError, match=r"gemm_config=\(128, 256, 64, 8, 3\): give six"):
        Tuning(gemm_config=(128, 256, 64, 8, 3))
    with pytest.raises(ValueError, match="fold_group must be >= 1, got 0"):
        Tuning(fold_group=0)
    with pytest.raises(ValueError, match="row_fixup='argmax': use 'lane' or 'block'"):
        Tuning(row_fixup="argmax")
    with pytest.raises(ValueError, match=r"row_config=\(3000, 8\): give \(BLOCK, num_warps\)"):
        Tuning(row_config=(3000, 8))
    for bad in ((0, 8), (8, 4), (64, 3), (64, 64)):
        with pytest.raises(ValueError, match="BLOCK a power of two >= 16, num_warps"):
            Tuning(row_config=bad)
    with pytest.raises(ValueError, match="prefetch=1: give True or False"):
        Tuning(prefetch=1)


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd"])
def test_the_cached_prefetch_writes_the_same_16_bit_gradient_over_the_logits(
        triton_kernels, kind):
    """The cached kernel's bf16 gradient written over the fp32 logits (the op's default on
    CUDA) is the same with and without its loads one block ahead: 16-entry blocks, a row of
    257 (17 blocks, the last partial), K ids at the row's two ends and inside, a label."""
    from distill.ops.spec import DivergenceSpec

    g = torch.Generator().manual_seed(3)
    c, v, k = 6, 257, 5
    z = (torch.randn(c, v, generator=g) * 4).to(DEVICE)
    ids = torch.stack([torch.cat([torch.tensor([0, v - 1]), torch.randperm(v - 2, generator=g)
                                  [:k - 2] + 1]) for _ in range(c)]).to(DEVICE)
    lps = torch.log_softmax(torch.randn(c, k, generator=g), -1).sub(0.2).to(DEVICE)
    labels = torch.randint(0, v, (c,), generator=g).to(DEVICE)
    spec = DivergenceSpec(kind, ce_weight=0.3)
    w = torch.rand(c, generator=g).to(DEVICE)
    out = {}
    for prefetch in (True, False):
        zs = z.clone()
        loss, dz = triton_kernels.rows_loss_and_grad(
            zs, None, ids, lps, labels, spec, True, row_scale=w, grad_dtype=torch.bfloat16,
            row_config=(16, 4), prefetch=prefetch)
        assert dz.dtype == torch.bfloat16 and dz.untyped_storage().data_ptr() == (
            zs.untyped_storage().data_ptr())  # written over the logits
        out[prefetch] = (loss, dz.float())
    assert torch.equal(out[True][0], out[False][0])
    assert torch.equal(out[True][1], out[False][1])
    # and right: each row of d loss / d logits sums to zero, the K ids' entries are set
    assert out[True][1].sum(-1).abs().max() < 1e-2
    assert (out[True][1].gather(1, ids) != 0).all()


@pytest.mark.parametrize("row_fixup", ["lane", "block"])
@pytest.mark.parametrize("target,prefetch", [("live", True), ("cached", True),
                                             ("cached", False)])
def test_each_row_fixup_at_its_own_block(triton_kernels, row_fixup, target, prefetch):
    """Tuning.row_fixup and row_config reach the row kernels: a 16-entry block (17 blocks a
    row, the last partial) with each way of finding the largest logit; the cached kernel
    with and without its loads one block ahead."""
    x = make_inputs(**SMALL, k=None if target == "live" else 7)
    _PATH["tuning"] = Tuning(row_fixup=row_fixup, row_config=(16, 4), prefetch=prefetch)
    try:
        got, ref = run_both(x, _triton, grad_scale=0.5, kind="reverse_kl", ce_weight=0.3,
                            temperature=1.5, chunk_size=5)
    finally:
        _PATH["tuning"] = None
    assert_close(got, ref, torch.float32)


def test_a_gemm_config_reaches_the_kernel(triton_kernels):
    """Tuning.gemm_config is the tile config the stats GEMM runs (a small tile here: the
    interpreter runs whatever it is given, so a wrong one still gives the same numbers;
    what is checked is that the op takes it without error, on the stats path)."""
    x = make_inputs(**SMALL)
    _PATH["tuning"] = Tuning(stats_gemm=True, gemm_config=(16, 32, 16, 4, 2, 0))
    try:
        got, ref = run_both(x, _triton, kind="forward_kl", chunk_size=5)
    finally:
        _PATH["tuning"] = None
    assert_close(got, ref, torch.float32)


@pytest.mark.parametrize("value", [0.37, 1.0, -3.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_scale_in_place_reads_the_scale_on_the_device(triton_kernels, value, dtype):
    """backward's grad_output scaling: x * s (s == 1 leaves x as it is), several blocks
    per program (the grid-stride loop) and a partial last block."""
    xs = [torch.randn(n, device=DEVICE).to(dtype) for n in (1000, 7, 1, 0)]
    want = [(x.double() * value).to(dtype) for x in xs]
    before = [x.clone() for x in xs]
    triton_kernels.scale_(xs + [None], torch.tensor(value, device=DEVICE), programs=3,
                          block=64)
    for x, w, b in zip(xs, want, before):
        if value == 1.0:
            assert torch.equal(x, b)
        else:  # the product in fp32, rounded once more for fp16: one unit of the last place
            torch.testing.assert_close(x, w, rtol=torch.finfo(dtype).eps, atol=0)


def test_scale_in_place_refuses_strided_tensors(triton_kernels):
    x = torch.randn(8, 6, device=DEVICE).T
    with pytest.raises(ValueError, match="contiguous"):
        triton_kernels.scale_([x], torch.tensor(2.0, device=DEVICE))


def test_all_ignored_gives_zero(triton_kernels):
    x = make_inputs(**SMALL)
    hs = x["student_hidden"].requires_grad_(True)
    loss = _triton(student_hidden=hs, student_weight=x["student_weight"],
                   teacher_hidden=x["teacher_hidden"], teacher_weight=x["teacher_weight"],
                   labels=torch.full_like(x["labels"], -100))
    loss.backward()
    assert loss.item() == 0.0 and (hs.grad == 0).all()


# --------------------------------------------------------------------------- GPU only

def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


GPU_SHAPES = dict(n=300, v=32003, hs=256, ht=384, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kind,extra", KINDS)
@pytest.mark.parametrize("cached", [False, True])
def test_gpu_matches_the_oracle(op_path, dtype, kind, extra, cached):
    x = make_inputs(k=64 if cached else None, dtype=dtype, **GPU_SHAPES)
    got, ref = run_both(x, _any_backend, grad_scale=0.5, kind=kind, temperature=1.5,
                        ce_weight=0.2, chunk_size=128, **extra)
    assert_close(got, ref, dtype)
    if dtype != torch.float16:  # fp16's range: a token-weighted gradient has subnormals
        for name, g in got[1].items():  # tighter than assert_close's 10x
            assert _rel(g, ref[1][name]) < TOLERANCES[dtype][0], name


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd"])
def test_gpu_huge_logits(kind):
    """Logits spread over +-1e4: nothing overflows, the loss matches in relative terms."""
    x = make_inputs(logit_std=1e4, dtype=torch.float32, **GPU_SHAPES)
    got, ref = run_both(x, linear_divergence, kind=kind)
    assert torch.isfinite(got[0]) and got[0] > (0.5 if kind == "jsd" else 100)  # JSD <= ln 2
    torch.testing.assert_close(got[0].double(), ref[0], rtol=1e-4, atol=0)
    # Saturated JSD has true gradients ~1e-169, while fp32 rounding of d logits (entries of
    # size ~1, error ~eps) reaches the inputs through the other factor of each GEMM
    # (weights ~1e4 / sqrt(H)): the floor is eps * the L2 norm of that factor's columns.
    other = {"student_hidden": x["student_weight"], "student_weight": x["student_hidden"]}
    for name, g in got[1].items():
        floor = 8 * torch.finfo(torch.float32).eps * other[name].double().norm(dim=0).max()
        err = (g.double() - ref[1][name]).abs().max().item()
        assert torch.isfinite(g).all() and err <= 1e-2 * ref[1][name].abs().max() + floor, name


@pytest.mark.gpu
def test_gpu_ignored_chunks_sparse_equals_dense_and_fp32_weight_grad():
    x = make_inputs(dtype=torch.bfloat16, ignore_frac=0.0, **GPU_SHAPES)
    x["labels"][:200] = -100  # with chunk_size=64, whole chunks of the batch are ignored
    got, ref = run_both(x, linear_divergence, kind="jsd", chunk_size=64, fp32_weight_grad=True)
    assert_close(got, ref, torch.bfloat16)
    assert (got[1]["student_hidden"][:200] == 0).all()
    # K = V cached targets equal the dense teacher
    y = make_inputs(n=70, v=1000, hs=64, ht=64, device="cuda", dtype=torch.bfloat16)
    for kind in ("forward_kl", "reverse_kl", "jsd"):
        sparse, dense = _all_ids_cached_and_live(y, kind=kind)
        torch.testing.assert_close(sparse, dense, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_gpu_deterministic_and_in_place_gradient_matches_torch_rows():
    """dz written over the logits in bf16 (with barriers) equals the fp32 torch math."""
    from distill.ops import divergence_triton
    from distill.ops.divergence_torch import rows_loss_and_grad as torch_rows
    from distill.ops.spec import DivergenceSpec

    zs = torch.randn(64, 128256, device="cuda") * 6
    zt = torch.randn(64, 128256, device="cuda") * 6
    for kind in ("forward_kl", "reverse_kl", "jsd"):
        spec = DivergenceSpec(kind, ce_weight=0.1)
        labels = torch.randint(0, 128256, (64,), device="cuda")
        la, da = torch_rows(zs, zt, None, None, labels, spec, True)
        outs = [divergence_triton.rows_loss_and_grad(zs.clone(), zt, None, None, labels, spec,
                                                      True, grad_dtype=torch.bfloat16)
                for _ in range(2)]
        assert torch.equal(outs[0][1], outs[1][1]) and torch.equal(outs[0][0], outs[1][0])
        torch.testing.assert_close(outs[0][0], la, rtol=1e-5, atol=1e-5)
        assert _rel(outs[0][1].float(), da) < 1e-2


@pytest.mark.gpu
def test_gpu_every_row_trained_never_waits_for_the_gpu():
    """No labels, no weights (pretraining): neither forward nor backward synchronizes with
    the GPU (backward's grad_output is read by a kernel), and the gradients stay right."""
    x = make_inputs(dtype=torch.bfloat16, ignore_frac=0.0, **GPU_SHAPES)
    del x["labels"]
    leaves = {k: x[k].detach().clone().requires_grad_(True)
              for k in ("student_hidden", "student_weight")}
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host sync raises
    try:
        loss = linear_divergence(**{**x, **leaves}, kind="reverse_kl")
        (loss * 0.25).backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    got = (loss.detach(), {k: v.grad for k, v in leaves.items()})
    ref = run_both(x, linear_divergence, grad_scale=0.25, kind="reverse_kl")[1]
    assert_close(got, ref, torch.bfloat16)
