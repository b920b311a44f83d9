# Sourced at the start of every device (GPU machine) run: carried wheels, the CUDA build, logs in $OUT.
# Needs `carry: [".whl", ".minilm"]` (datasets wheels; the float16 MiniLM export).
# The device copy has no usable git history: the commit comes from .bench_commit (ignored; `git rev-parse HEAD >
# .bench_commit` before the call and carry it).
[ -f .bench_commit ] && export CAT_FAST_BENCH_COMMIT="$(cat .bench_commit)"
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 CAT_FAST_MINILM_DIR="$PWD/.minilm"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH="$PWD:/tmp/site"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
start=$(date +%s)
python3 setup.py build_ext --inplace -j 16 >"$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - start ))s" | tee -a "$OUT/gpu.txt"
python3 -c "import cat_fast, torch, triton, transformers; print('backends', cat_fast.backends(), cat_fast.ops.registry.load_errors(), 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
# step_rows SECONDS "SIZES" "METHODS": the step suite's rows by node id, sizes in the order given, within SECONDS (the
# deadline skips what is left; results survive in CAT_FAST_BENCH_JSONL); JSON in $OUT/step.json, the paired summary
# (ratios against the compiled plain step) in $OUT/summary.txt.
step_rows() {
  local ids=() size m
  for size in $2; do for m in $3; do ids+=("benchmarks/steps/test_bench_step.py::test_step[$size-$m]"); done; done
  CAT_FAST_BENCH_DEADLINE_STEP=$(( $(date +%s) + $1 )) timeout $(( $1 + 30 )) python3 -m pytest "${ids[@]}" -q \
    -p no:cacheprovider --benchmark-json "$OUT/step.json" > "$OUT/step.log" 2>&1; echo "rc=$?" >> "$OUT/step.log"
  python3 scripts/paired_summary.py "$OUT/step.json" | tee "$OUT/summary.txt"
}
