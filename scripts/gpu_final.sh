#!/usr/bin/env bash
# Device run: build, the whole GPU test suite (ops on cuda + triton, training API), kernel-only cmix timings.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_setup.sh
timeout 200 python3 -m pytest tests/ops tests/test_backends.py tests/test_gpu_training.py -q -p no:cacheprovider -rf >"$OUT/gpu_tests.log" 2>&1
echo "GPU tests: rc=$? $(tail -1 "$OUT/gpu_tests.log")"
grep -E "^FAILED" "$OUT/gpu_tests.log" | head
python3 benchmarks/kernel_only.py 2>&1 | tee "$OUT/kernel_only.log"
