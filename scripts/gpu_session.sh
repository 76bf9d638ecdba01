#!/usr/bin/env bash
# One device call's worth of kernel work (issue 3): GPU tests, the GEMM variants, and the
# loss benchmark under each path of the op. Logs under $OUT (or ./bench_out).
set -u
out=${OUT:-bench_out}
mkdir -p "$out"
python3 -m pytest -q -m gpu tests/ops > "$out/gpu_tests.log" 2>&1
tail -3 "$out/gpu_tests.log"
python3 scripts/bench_gemm.py --out "$out/gemm" > "$out/gemm.log" 2>&1
grep -E "cublas|C=.*:" "$out/gemm.log"
grep -E "stats" "$out/gemm.log" | sort -k8 -n | head -12
for cfg in "0 1" "0 4" "1 1" "1 4"; do
  set -- $cfg
  DISTILL_STATS_GEMM=$1 DISTILL_FOLD_GROUP=$2 python3 scripts/bench_loss.py --bt ${BTS:-4096 8192 16384} \
    --only "GEMM floor" "distill" --out "$out/loss_s$1_g$2" > "$out/loss_s$1_g$2.log" 2>&1
  echo "== stats=$1 fold_group=$2"; grep -E "^\| (GEMM|distill)" "$out/loss_s$1_g$2.log"
done
