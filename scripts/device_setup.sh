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
