#!/usr/bin/env bash
# Device call on 1 GPU (issue 23), for the next session: the first-token layer's one-matmul keys and values in CAT's
# input-only passes (layers.first_token.INPUT_ONLY_KEY_VALUE, off by default, built and tested on the CPU only):
# (1) its GPU tests and the fast layers'; (2) CAT captured at 32x128 and 64x256 beside the compiled plain step, off
# (step.json) and on (step-on.json, the same machine); (3) CAT's kernels at 64x256, m = 9, with it on (kernels.tgz).
# At most 8 files come back: gpu.txt, tests.log, step.json, summary.txt, step-on.json, summary-on.txt, diag.txt,
# kernels.tgz.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
timeout 150 python3 -m pytest tests/layers tests/models tests/objectives/test_cat.py tests/test_step.py -q \
  -p no:cacheprovider > "$OUT/tests.log" 2>&1; echo "rc=$?" >> "$OUT/tests.log"
grep -E "passed|failed|FAILED|rc=" "$OUT/tests.log" | tail -8
step_rows 150 "32x128 64x256" "plain_compiled_ro cat_captured"
ids=("benchmarks/steps/test_bench_step.py::test_step[32x128-cat_captured]"
     "benchmarks/steps/test_bench_step.py::test_step[64x256-cat_captured]")
timeout 100 python3 -c "import sys, pytest, cat_fast.layers.first_token as f; f.INPUT_ONLY_KEY_VALUE = True; \
sys.exit(pytest.main(sys.argv[1:]))" "${ids[@]}" -q -p no:cacheprovider --benchmark-json "$OUT/step-on.json" \
  > "$OUT/diag.txt" 2>&1; echo "rc=$?" >> "$OUT/diag.txt"
python3 scripts/paired_summary.py "$OUT/step-on.json" | tee "$OUT/summary-on.txt"
timeout 60 python3 -c "import sys, runpy, cat_fast.layers.first_token as f; f.INPUT_ONLY_KEY_VALUE = True; \
sys.argv = ['profile_step.py', '--size', '64x256', '--cat-layer', '9', '--dump', '$OUT/kernels', 'cat_captured']; \
runpy.run_path('benchmarks/tools/profile_step.py', run_name='__main__')" >> "$OUT/diag.txt" 2>&1
grep -E "^== |by kind" "$OUT/diag.txt"
tar czf "$OUT/kernels.tgz" -C "$OUT" kernels && rm -rf "$OUT/kernels" "$OUT/build.log" "$OUT/step.log"
