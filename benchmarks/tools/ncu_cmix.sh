#!/usr/bin/env bash
# Nsight Compute sections of the cmix tile kernels at [64,512,1024] (per-sample lam, permutation partner),
# bfloat16 (default plan: cp.async tiles) and float32, forward and backward, 2nd call of each, with the warps'
# stall reasons (cycles per issued instruction). On a GPU machine with cat_fast built
# (`python setup.py build_ext --inplace`):
#   OUT=DIR bash benchmarks/tools/ncu_cmix.sh          (text reports in DIR/ncu_<dtype>.txt; default OUT=.)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-.}
mkdir -p "$OUT"
prof=$(mktemp --suffix=.py)
trap 'rm -f "$prof"' EXIT
cat > "$prof" <<'PY'
import sys, torch, cat_fast
from cat_fast.ops import cmix
dtype = getattr(torch, sys.argv[1])
B, T, D = 64, 512, 1024
g = torch.Generator(device="cuda").manual_seed(0)
h = torch.randn(B, T, D, device="cuda", dtype=dtype, generator=g).requires_grad_(True)
lam = torch.rand(B, device="cuda", generator=g).requires_grad_(True)
partner = torch.randperm(B, device="cuda", generator=g)
grad = torch.randn(B, T, D, device="cuda", dtype=dtype, generator=g)
for _ in range(2):
    out, _ = cmix(h, lam, partner)
    torch.autograd.grad(out, (h, lam), grad)
torch.cuda.synchronize()
PY
for dt in bfloat16 float32; do
  timeout 150 ncu --clock-control none -k "regex:cmix_(forward|backward)_tile" --launch-skip 2 --launch-count 2 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
    python3 "$prof" $dt > "$OUT/ncu_$dt.txt" 2>&1
  echo "ncu $dt rc=$?"
done
