#!/usr/bin/env bash
# Device run: build, all GPU tests, kernel-only cmix, Nsight Compute stall reasons of the bf16 cmix backward,
# and repeated CAT-vs-plain paired steps at 64x256 (the target whose spread was unmeasured).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_setup.sh
timeout 200 python3 -m pytest tests/ops tests/test_backends.py -q -p no:cacheprovider -k "cuda or triton" -rf \
  >"$OUT/gpu_tests.txt" 2>&1
echo "op tests on GPU: rc=$? $(tail -1 "$OUT/gpu_tests.txt")"
timeout 170 python3 -m pytest tests/test_cal_graph.py tests/test_gpu_training.py tests/test_gs.py tests/test_cat.py \
  tests/test_models.py -q -p no:cacheprovider -rf >>"$OUT/gpu_tests.txt" 2>&1
echo "training API on GPU: rc=$? $(tail -1 "$OUT/gpu_tests.txt")"
grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.txt" | head -20
timeout 60 python3 benchmarks/kernel_only.py >"$OUT/kernel_only.txt" 2>&1; echo "kernel_only rc=$?"; head -16 "$OUT/kernel_only.txt"
if [ "${NCU:-1}" = 1 ]; then
cat > /tmp/cmix_prof.py <<'PY'
import torch, cat_fast
from cat_fast.ops import cmix
B, T, D = 64, 512, 1024
g = torch.Generator(device="cuda").manual_seed(0)
h = torch.randn(B, T, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
lam = torch.rand(B, device="cuda", generator=g).requires_grad_(True)
partner = torch.randperm(B, device="cuda", generator=g)
grad = torch.randn(B, T, D, device="cuda", dtype=torch.bfloat16, generator=g)
for _ in range(2):
    out, _ = cmix(h, lam, partner)
    torch.autograd.grad(out, (h, lam), grad)
torch.cuda.synchronize()
PY
timeout 120 ncu --clock-control none -k "regex:cmix_(forward|backward)_tile" --launch-skip 2 --launch-count 2 \
  --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
  --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
  python3 /tmp/cmix_prof.py > "$OUT/ncu_stalls.txt" 2>&1
echo "ncu rc=$?"
fi
for i in ${STEP_REPEATS:-1 2 3}; do
  timeout 120 python3 -m pytest benchmarks/test_bench_step.py -q -p no:cacheprovider -k "64x256-cat and not eager and not full" \
    --benchmark-json "$OUT/step_cat64_$i.json" >"$OUT/step_cat64_$i.log" 2>&1
  echo "step 64x256 cat run $i rc=$?"
  python3 - "$OUT/step_cat64_$i.json" <<'PY'
import json, sys
for b in json.load(open(sys.argv[1]))["benchmarks"]:
    e = b["extra_info"]
    print(b["name"], {k: round(v, 3) for k, v in e.items() if isinstance(v, float) and ("paired" in k or "ratio" in k or k.endswith("_ms"))})
PY
done
rm -f "$OUT/build.log"
