#!/usr/bin/env bash
# Device run: CUDA build, every GPU test (ops on cuda + triton, CUDA-graph CAT, training API, GS), kernel-only
# cmix timings with their correctness check, and CRM at a million rows. Logs under $OUT (few files: only
# a handful come back).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_setup.sh
timeout 240 python3 -m pytest tests/ops tests/test_backends.py -q -p no:cacheprovider -k "cuda or triton" -rf \
  >"$OUT/tests.log" 2>&1
echo "op tests on GPU: rc=$? $(tail -1 "$OUT/tests.log")"
timeout 150 python3 -m pytest tests/test_cal_graph.py tests/test_gpu_training.py tests/test_gs.py -q -p no:cacheprovider \
  -rf >>"$OUT/tests.log" 2>&1
echo "training API on GPU: rc=$? $(tail -1 "$OUT/tests.log")"
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -30
timeout 120 python3 benchmarks/kernel_only.py >"$OUT/kernel_only.txt" 2>&1; echo "kernel_only rc=$?"
cat "$OUT/kernel_only.txt" | tail -40
timeout 60 python3 - <<'PY' 2>&1 | tee -a "$OUT/kernel_only.txt"
import torch, triton.testing, cat_fast
from cat_fast.ops import crm_loss
for B in (32, 4096, 1048576):
    z = torch.randn(B, 3, device="cuda"); zc = torch.randn(B, 3, device="cuda"); y = torch.randint(3, (B,), device="cuda")
    for backend in ("cuda", "triton", "reference"):
        with cat_fast.use_backend(backend):
            ms = triton.testing.do_bench(lambda: crm_loss(z, zc, y), warmup=10, rep=50)
        print(f"crm_loss forward B={B} C=3 fp32 {backend}: {ms * 1e3:.1f} us (op call)")
PY
