"""A/B timing of the op's internal variants, interleaved so clock drift hits all alike.

Each round times every variant once (CUDA events, grads cleared before each call), in a
new random order (a variant's predecessor biases it otherwise); the table gives the median
over rounds and the ratio to the GEMM floor timed in the same rounds. Variants set the op's
knobs (`distill.ops.chunked.Tuning`: stats GEMM, fold group, GEMM tile config, the row
kernels' largest-logit fixup and block) and chunk size. Also prints which ATen ops launch
the largest kernels (--ops).

    python bench/bench_variants.py --bt 4096 8192 --rounds 12
    python bench/bench_variants.py --bt 8192 --only default "fixup"   # the row fixups
    python bench/bench_variants.py --bt 2048 4096 --only default --with-compile
    python bench/bench_variants.py --bt 2048 16384 --only default --with-compile --lead-ms 30

By default each call starts on an idle device (synchronized after the last): the host's
launches and the clocks of a card that just idled are in its time. With --lead-ms every call
is queued behind that many ms of bf16 GEMMs instead, as a training step's loss follows the
models' kernels: the host's launches hide under them, and the card is under full load when
the call starts (a low-power spin ahead, `bench_loss.py --host`, leaves the card rested: even
the bare floor took 8-12% less time after one; docs/notes/kernels.md, "Eighth session").
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import bench_loss  # noqa: E402

from distill.losses import linear_divergence  # noqa: E402
from distill.ops.chunked import Tuning  # noqa: E402

DEFAULT = Tuning()
# the row kernels before the lane fixup: three block reductions per block, BLOCK 4096
BLOCK_FIXUP = Tuning(row_fixup="block", row_config=(4096, 8))
BEFORE_PREFETCH = Tuning(prefetch=False, row_config=(4096, 8))
# name -> (tuning, chunk_size or None, kind, cached?)
VARIANTS = {
    "default": (DEFAULT, None, "forward_kl", False),
    "fold 3 x 640": (Tuning(fold_group=3), 640, "forward_kl", False),
    # chunk sizes: 640 is what choose_chunk_size gives at V = 128256 (the default's path);
    # 512 folds 1024 rows per d hidden GEMM: 8 x 16 tiles of 128 x 256 at H = 4096, one wave
    # on 132 SMs, where 1280 rows make 160 tiles (two waves, the second a fifth full)
    "chunk 640 (the default's size)": (DEFAULT, 640, "forward_kl", False),
    "chunk 512 (1024 rows a fold)": (DEFAULT, 512, "forward_kl", False),
    "default again (same path: the noise)": (DEFAULT, None, "forward_kl", False),
    "GEMM 3 stages": (Tuning(gemm_config=(128, 256, 64, 8, 3, 0)), None, "forward_kl", False),
    "fixup block 4096x8 (previous default)": (BLOCK_FIXUP, None, "forward_kl", False),
    "fixup block 2048x8": (Tuning(row_fixup="block", row_config=(2048, 8)), None, "forward_kl",
                           False),
    "fixup lane 4096x8": (Tuning(row_config=(4096, 8)), None, "forward_kl", False),
    "default, reverse_kl": (DEFAULT, None, "reverse_kl", False),
    "fixup block 4096x8, reverse_kl": (BLOCK_FIXUP, None, "reverse_kl", False),
    "default, jsd": (DEFAULT, None, "jsd", False),
    "fixup block 4096x8, jsd": (BLOCK_FIXUP, None, "jsd", False),
    "cached, cuBLAS (default)": (DEFAULT, None, "forward_kl", True),
    "cached, fixup block": (Tuning(row_fixup="block"), None, "forward_kl", True),
    # the cached kernel's default is 2048 x 8 with the prefetch (4a7e6e1); before, 4096 x 8
    "cached, no prefetch, 4096x8 (before)": (BEFORE_PREFETCH, None, "forward_kl", True),
    "cached, prefetch 4096x8": (Tuning(row_config=(4096, 8)), None, "forward_kl", True),
    "cached, no prefetch, 2048x8": (Tuning(prefetch=False), None, "forward_kl", True),
    "cached, 8192x16": (Tuning(row_config=(8192, 16)), None, "forward_kl", True),
    "cached, reverse_kl": (DEFAULT, None, "reverse_kl", True),
    "cached, no prefetch, 4096x8 (before), reverse_kl": (BEFORE_PREFETCH, None, "reverse_kl",
                                                         True),
}


def make_fn(x, tuning, chunk, kind, cached):
    hs, ws = x["hs"], x["ws"]
    target = (dict(target_ids=x["ids"], target_logprobs=x["lps"]) if cached
              else dict(teacher_hidden=x["ht"], teacher_weight=x["wt"]))

    def fn():
        linear_divergence(hs, ws, kind=kind, chunk_size=chunk, tuning=tuning,
                          **target).backward()
    return fn


def add_gemm_configs(configs):
    """One forward_kl variant per GEMM tile config "BM,BN,BK,warps,stages,tma"."""
    for cfg in configs:
        tile = tuple(int(v) for v in cfg.split(","))
        VARIANTS[f"default, GEMM {cfg}"] = (Tuning(gemm_config=tile), None, "forward_kl",
                                             False)


def full_power_lead(ms: float, n: int = 8192):
    """A callable that queues ~`ms` of bf16 (n x n) @ (n x n) GEMMs on the device (none when
    ms <= 0), their count set from one timed GEMM."""
    if ms <= 0:
        return None
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(a)
    one = bench_loss._time(lambda: torch.mm(a, a, out=out), reps=5)
    count = max(1, round(ms / one))

    def lead():
        for _ in range(count):
            torch.mm(a, a, out=out)

    return lead


def run(bt, rounds, only, with_compile=False, lead_ms=0.0):
    x = bench_loss.make_inputs(bt)
    lead = full_power_lead(lead_ms)
    leaves = [x["hs"], x["ws"]]
    fns = {"GEMM floor (4 live)": lambda: bench_loss._gemm_floor(x, True),
           "GEMM floor (3 cached)": lambda: bench_loss._gemm_floor(x, False)}
    if with_compile:  # the anchor the forward KL target names, in the same shuffled rounds
        fns["torch.compile FKL (full logits)"] = lambda: bench_loss._compiled_fkl(
            x["hs"], x["ws"], x["ht"], x["wt"]).backward()
    for name, (tuning, chunk, kind, cached) in VARIANTS.items():
        if not only or any(s in name for s in only):
            fns[name] = make_fn(x, tuning, chunk, kind, cached)
    mem = {name: bench_loss.peak_mib(fn, leaves) for name, fn in fns.items()}
    times = {name: [] for name in fns}
    order = random.Random(bt)
    for _ in range(rounds):
        # a new order each round: what ran just before (a hot cuBLAS floor, say) slows
        # a variant through the card's power state, the same way every round if the
        # order were fixed (seen: one variant timed twice under two names, 3% apart)
        names = list(fns)
        order.shuffle(names)
        for name in names:
            times[name].append(bench_loss._time(
                fns[name], reps=1, before=lambda: bench_loss.clear_grads(leaves), warm=False,
                lead=lead))
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = []
    for name in fns:
        floor = med["GEMM floor (3 cached)" if "cached" in name else "GEMM floor (4 live)"]
        rows.append(dict(bt=bt, name=name, ms=round(med[name], 3),
                         ratio=round(med[name] / floor, 4), mib=round(mem[name], 1),
                         spread=round((max(times[name]) - min(times[name])) / med[name], 3)))
    return rows


def ops_table(bt):
    """Which ATen ops own the CUDA time of one distill live forward_kl call."""
    x = bench_loss.make_inputs(bt)
    fn = make_fn(x, DEFAULT, None, "forward_kl", False)
    fn()
    bench_loss.clear_grads([x["hs"], x["ws"]])
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts, record_shapes=True) as prof:
        fn()
        torch.cuda.synchronize()
    return prof.key_averages(group_by_input_shape=True).table(
        sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=30,
        max_shapes_column_width=60)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bt", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--only", nargs="*")
    p.add_argument("--ops", action="store_true")
    p.add_argument("--with-compile", action="store_true",
                   help="also time bench_loss's torch.compile forward KL in the same rounds")
    p.add_argument("--lead-ms", type=float, default=0.0,
                   help="queue this many ms of full-power bf16 GEMMs before each timed call "
                        "(0: start each call on an idle device)")
    p.add_argument("--gemm-config", nargs="*", default=[],
                   help="also time the default with these GEMM tile configs "
                        "(BM,BN,BK,warps,stages,tma)")
    p.add_argument("--out", type=Path, default=Path("bench_out/variants"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    add_gemm_configs(args.gemm_config)
    if args.ops:
        print(ops_table(args.bt[-1]))
    rows = [r for bt in args.bt
            for r in run(bt, args.rounds, args.only, args.with_compile, args.lead_ms)]
    (args.out / "variants.json").write_text(json.dumps(rows, indent=1))
    for r in rows:
        print(f"BT={r['bt']:6d} {r['name']:38s} {r['ms']:8.2f} ms {r['ratio']:6.3f}x "
              f"{r['mib']:7.0f} MiB  spread {r['spread']:.3f}")


if __name__ == "__main__":
    main()
