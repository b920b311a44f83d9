#!/usr/bin/env bash
# Device call on 1 GPU (issue 23), after gpu_session8.sh on the warm machine: where the GPU time of the captured
# steps goes at 64x256 against the reduce-overhead-compiled plain step (kernels by kind: gemm, attention,
# norm, elementwise, adam), to decide which elementwise work to fuse.
set -uo pipefail
cd "$(dirname "$0")/.."
ls cat_fast/_C*.so > /dev/null 2>&1 || source scripts/device_setup.sh  # a warm machine keeps the build
[ -n "${CAT_FAST_MINILM_DIR:-}" ] || export CAT_FAST_MINILM_DIR="$PWD/.minilm" PYTHONPATH="$PWD:/tmp/site"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
for size in 64x256 32x128; do
  timeout 200 python3 benchmarks/tools/profile_step.py --size $size --steps 3 \
    plain_compiled_ro plain_fast_captured cat_captured > "$OUT/profile-$size.txt" 2>&1
  echo "rc=$?" >> "$OUT/profile-$size.txt"; grep -E "^== |by kind|rc=" "$OUT/profile-$size.txt"
done
