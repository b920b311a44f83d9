// Shared device helpers of the cat_fast CUDA kernels (csrc/cuda/*.cu).
//
// Device-side index validation
// ----------------------------
// The Python wrappers validate `partner` and `labels` before any kernel runs (doing that on the
// device would need a host synchronisation), so the kernels trust them by default. Build with
// -DCAT_FAST_DEVICE_CHECKS (install with CAT_FAST_DEVICE_CHECKS=1, see setup.py) to turn on
// CUDA_KERNEL_ASSERT device asserts for out-of-range partner / label indices; a failing assert
// aborts the kernel and surfaces as a CUDA error on the next synchronising call. Off by default.
//
// Row layout used by most kernels
// -------------------------------
// A block is blockDim = (tx, ty): ty "row slots" of tx threads each. A row slot owns one row of the
// problem at a time (a (b,t) row of cmix, a class row of the losses, ...). tx is either a power of
// two <= 32 (several row slots share one warp, reductions use shuffles inside the slot's aligned
// lane segment) or a multiple of 32 (row slot = whole warps, reductions go through shared memory).
// All reductions have a fixed order, so every kernel is deterministic run to run.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/macros/Macros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <utility>

#ifdef CAT_FAST_DEVICE_CHECKS
#define CAT_FAST_DEVICE_ASSERT(cond) CUDA_KERNEL_ASSERT(cond)
#else
#define CAT_FAST_DEVICE_ASSERT(cond) ((void)0)
#endif

namespace cat_fast {
namespace cuda {

constexpr unsigned kFullMask = 0xffffffffu;

// ---------------------------------------------------------------- accumulation type
template <typename T>
struct AccType {
  using type = float;
};
template <>
struct AccType<double> {
  using type = double;
};
template <typename T>
using acc_t = typename AccType<T>::type;

inline at::ScalarType acc_scalar_type(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

// Math in the accumulation type (float versions become the fast intrinsics under --use_fast_math).
__device__ __forceinline__ float acc_exp(float x) { return expf(x); }
__device__ __forceinline__ double acc_exp(double x) { return exp(x); }
__device__ __forceinline__ float acc_log(float x) { return logf(x); }
__device__ __forceinline__ double acc_log(double x) { return log(x); }
__device__ __forceinline__ float acc_pow(float x, float y) { return powf(x, y); }
__device__ __forceinline__ double acc_pow(double x, double y) { return pow(x, y); }
__device__ __forceinline__ float acc_sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double acc_sqrt(double x) { return sqrt(x); }

// -inf without std::numeric_limits (a host constexpr: needs --expt-relaxed-constexpr, which the
// CMake build does not pass).
template <typename A>
__device__ __forceinline__ A neg_inf();
template <>
__device__ __forceinline__ float neg_inf<float>() {
  return __int_as_float(0xff800000u);
}
template <>
__device__ __forceinline__ double neg_inf<double>() {
  return __longlong_as_double(static_cast<long long>(0xfff0000000000000ull));
}

// NaN-propagating clamp (like torch.clamp): NaN stays NaN.
template <typename A>
__device__ __forceinline__ A clamp_nan(A x, A lo, A hi) {
  return x < lo ? lo : (x > hi ? hi : x);
}

// ---------------------------------------------------------------- vectorised memory access
// Pack<T, V>: V consecutive elements, aligned to their total size; V * sizeof(T) == 16 gives one
// 128-bit load/store (ld.global.v4 / st.global.v4).
template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

template <typename T>
constexpr int vec16() {
  return 16 / static_cast<int>(sizeof(T));
}

inline bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

// Loads pack j of a row (pointer to the row start, in elements) and widens it to acc.
template <typename T, int V>
__device__ __forceinline__ void load_acc(const T* __restrict__ row, int64_t j, acc_t<T> (&out)[V]) {
  const Pack<T, V> p = reinterpret_cast<const Pack<T, V>*>(row)[j];
#pragma unroll
  for (int e = 0; e < V; ++e) out[e] = static_cast<acc_t<T>>(p.v[e]);
}

template <typename T, int V>
__device__ __forceinline__ void store_acc(T* __restrict__ row, int64_t j, const acc_t<T> (&in)[V]) {
  Pack<T, V> p;
#pragma unroll
  for (int e = 0; e < V; ++e) p.v[e] = static_cast<T>(in[e]);
  reinterpret_cast<Pack<T, V>*>(row)[j] = p;
}

// ---------------------------------------------------------------- shuffles / reductions
__device__ __forceinline__ float shfl_xor(float v, int o) { return __shfl_xor_sync(kFullMask, v, o); }
__device__ __forceinline__ double shfl_xor(double v, int o) { return __shfl_xor_sync(kFullMask, v, o); }
__device__ __forceinline__ int shfl_xor(int v, int o) { return __shfl_xor_sync(kFullMask, v, o); }

template <typename A, int N>
struct Vals {
  A v[N];
};
template <typename A, int N>
__device__ __forceinline__ Vals<A, N> shfl_xor(const Vals<A, N>& x, int o) {
  Vals<A, N> r;
#pragma unroll
  for (int k = 0; k < N; ++k) r.v[k] = shfl_xor(x.v[k], o);
  return r;
}

struct SumOp {
  template <typename A>
  __device__ __forceinline__ A operator()(A a, A b) const {
    return a + b;
  }
  template <typename A, int N>
  __device__ __forceinline__ Vals<A, N> operator()(const Vals<A, N>& a, const Vals<A, N>& b) const {
    Vals<A, N> r;
#pragma unroll
    for (int k = 0; k < N; ++k) r.v[k] = a.v[k] + b.v[k];
    return r;
  }
};

// Online softmax state of (part of) a row: running max m, sum s of exp(z - m), first index of the max.
template <typename A>
struct SoftmaxState {
  A m;
  A s;
  int idx;
};

template <typename A>
__device__ __forceinline__ SoftmaxState<A> softmax_identity() {
  return {neg_inf<A>(), A(0), INT32_MAX};
}

template <typename A>
__device__ __forceinline__ SoftmaxState<A> shfl_xor(const SoftmaxState<A>& x, int o) {
  return {shfl_xor(x.m, o), shfl_xor(x.s, o), shfl_xor(x.idx, o)};
}

// Adds element z (at index c) to the state; elements of one thread arrive in increasing c.
template <typename A>
__device__ __forceinline__ void softmax_push(SoftmaxState<A>& st, A z, int c) {
  if (z != z || st.m != st.m) {  // NaN: sticky in m and s (a NaN first in its thread's slice was dropped before)
    if (st.m == st.m) {
      st.m = z;
      st.s = z;
      st.idx = c;  // torch.argmax's choice: the NaN
    }
    return;
  }
  if (z > st.m) {
    st.s = (st.m == neg_inf<A>() ? A(0) : st.s * acc_exp(st.m - z)) + A(1);
    st.m = z;
    st.idx = c;
  } else if (st.m > neg_inf<A>()) {
    st.s += acc_exp(z - st.m);  // z == -inf adds 0; NaN z propagates through s
  }
}

struct SoftmaxOp {
  template <typename A>
  __device__ __forceinline__ SoftmaxState<A> operator()(const SoftmaxState<A>& a, const SoftmaxState<A>& b) const {
    SoftmaxState<A> r;
    r.m = a.m > b.m ? a.m : b.m;
    r.s = (a.m == r.m ? a.s : a.s * acc_exp(a.m - r.m)) + (b.m == r.m ? b.s : b.s * acc_exp(b.m - r.m));
    r.idx = a.m > b.m ? a.idx : (b.m > a.m ? b.idx : (a.idx < b.idx ? a.idx : b.idx));
    return r;
  }
};

// Reduces `v` over the tx = blockDim.x threads of the calling thread's row slot and returns the
// result to every thread of the slot. EVERY thread of the block must call it (it may
// __syncthreads). `smem` must hold one S per warp of the block. Fixed reduction order.
template <typename S, typename Op>
__device__ __forceinline__ S group_reduce(S v, Op op, S* smem) {
  const int tx = blockDim.x;
  if (tx <= 32) {  // power of two: the slot is an aligned lane segment of one warp
    for (int o = tx >> 1; o > 0; o >>= 1) v = op(v, shfl_xor(v, o));
    return v;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, shfl_xor(v, o));
  const int wpr = tx >> 5;  // warps per row slot
  const int base = threadIdx.y * wpr;
  __syncthreads();  // smem may still be read by a previous call
  if ((threadIdx.x & 31) == 0) smem[base + (threadIdx.x >> 5)] = v;
  __syncthreads();
  S r = smem[base];
  for (int w = 1; w < wpr; ++w) r = op(r, smem[base + w]);
  return r;
}

// Sum of v over all threads of the block, valid in thread (0,0); fixed order. Every thread of the block
// must call it. smem: one double per warp.
__device__ __forceinline__ double block_sum(double v, double* smem) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += shfl_xor(v, o);
  const int t = threadIdx.y * blockDim.x + threadIdx.x;
  const int warps = static_cast<int>(blockDim.x * blockDim.y) >> 5;
  __syncthreads();  // smem may still be read by a previous call
  if ((t & 31) == 0) smem[t >> 5] = v;
  __syncthreads();
  double r = 0.0;
  if (t == 0) {
    for (int w = 0; w < warps; ++w) r += smem[w];
  }
  return r;
}

// ---------------------------------------------------------------- rows of class logits
// The row of row group g that the calling thread's slot owns, and its label. Rows at or past B (the padding slots of
// the last group) are not `valid`: they read row 0 (`rr`) and take label ignore_index. `keep`: a valid row whose
// label is not ignore_index (then in [0, C): the Python wrappers check it, CAT_FAST_DEVICE_CHECKS asserts it).
struct LabeledRow {
  int64_t r;
  int64_t rr;
  int64_t y;
  bool valid;
  bool keep;
};

__device__ __forceinline__ LabeledRow labeled_row(int64_t g, const int64_t* __restrict__ labels, int64_t B, int64_t C,
                                                  int64_t ignore_index) {
  LabeledRow row;
  row.r = g * blockDim.y + threadIdx.y;
  row.valid = row.r < B;
  row.rr = row.valid ? row.r : 0;
  row.y = row.valid ? labels[row.rr] : ignore_index;
  row.keep = row.valid && row.y != ignore_index;
  CAT_FAST_DEVICE_ASSERT(!row.keep || (row.y >= 0 && row.y < C));
  return row;
}

// ---------------------------------------------------------------- multi-block reductions
// Completion counter of the multi-block mean/sum reductions (crm_loss, bias_loss): 0 before every launch, since
// each launch's last block sets it back to 0. One per (device, stream), shared by the ops (launches on one stream
// run in order; launches on different streams may overlap and must not share one). Made once (at::zeros: one
// memset, on the first call only) and never freed (the map is leaked so it outlives the caching allocator). During
// CUDA-graph capture a fresh zeroed counter is used instead: a captured memset only runs at replay, so a persistent
// counter made then would not be zeroed for eager calls. `inline`: one map for the whole library.
inline at::Tensor completion_counter(const at::Tensor& like, const c10::cuda::CUDAStream& stream) {
  const auto opts = like.options().dtype(at::kInt);
  if (c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None) {
    return at::zeros({1}, opts);
  }
  static std::mutex mutex;
  static auto* counters = new std::map<std::pair<int, int64_t>, at::Tensor>();
  const std::lock_guard<std::mutex> lock(mutex);
  at::Tensor& counter = (*counters)[{static_cast<int>(stream.device_index()), static_cast<int64_t>(stream.id())}];
  if (!counter.defined()) counter = at::zeros({1}, opts);
  return counter;
}

// Adds x and y (one double each per thread) over the whole grid in a fixed order: the end of the multi-block mean/sum
// reductions (crm_loss, bias_loss). Each block adds its threads' values (block_sum); a single block has the totals.
// Otherwise each block writes its two partials (partials[blockIdx.x], partials[gridDim.x + blockIdx.x], L2) and
// counts itself on `counter` (completion_counter); the block that counts last reads all partials (block-strided,
// then block_sum) and sets the counter back to 0 for the next launch on its stream. Every thread of the block must
// call it. Returns true in thread (0,0) of the block that holds the totals (then in x and y), false elsewhere.
// smem: one double per warp.
__device__ __forceinline__ bool grid_sum2(double& x, double& y, double* __restrict__ partials,
                                          int* __restrict__ counter, double* smem) {
  __shared__ bool s_last;
  const bool lead = threadIdx.x == 0 && threadIdx.y == 0;
  x = block_sum(x, smem);
  y = block_sum(y, smem);
  if (gridDim.x > 1) {  // the block that finishes last adds the partials of all blocks
    if (lead) {
      partials[blockIdx.x] = x;
      partials[gridDim.x + blockIdx.x] = y;
      __threadfence();  // the partial is visible before the count says so
      s_last = atomicAdd(counter, 1) == static_cast<int>(gridDim.x) - 1;
      if (s_last) __threadfence();
    }
    __syncthreads();
    if (!s_last) return false;
    const int t = threadIdx.y * blockDim.x + threadIdx.x;
    const int nt = blockDim.x * blockDim.y;
    double px = 0.0, py = 0.0;
    for (int k = t; k < static_cast<int>(gridDim.x); k += nt) {
      px += __ldcg(partials + k);  // L2, not a stale L1
      py += __ldcg(partials + gridDim.x + k);
    }
    x = block_sum(px, smem);
    y = block_sum(py, smem);
    if (lead) *counter = 0;  // ready for the next launch on this stream
  }
  return lead;
}

// ---------------------------------------------------------------- launch configuration
struct RowCfg {
  int tx;  // threads per row slot
  int ty;  // row slots per block
};

// units: work items per row (packs or elements); block: target threads per block;
// max_tx: most threads a single row gets.
inline RowCfg row_cfg(int64_t units, int block = 256, int max_tx = 256) {
  RowCfg c;
  if (units <= 32) {
    int tx = 1;
    while (tx < units) tx <<= 1;
    c.tx = tx;
  } else {
    const int64_t iters = (units + max_tx - 1) / max_tx;
    const int64_t per = (units + iters - 1) / iters;
    c.tx = static_cast<int>((per + 31) / 32 * 32);
  }
  c.ty = block / c.tx > 0 ? block / c.tx : 1;
  return c;
}

// Logits rows of a few classes (C <= kThreadRowMax) get one thread each: a slot of the next power of two
// would idle lanes and spend shuffle reductions on 2-8 values (a 3-class row took 4 lanes).
constexpr int64_t kThreadRowMax = 8;

inline RowCfg class_row_cfg(int64_t C, int block = 256, int max_tx = 256) {
  return C <= kThreadRowMax ? RowCfg{1, block} : row_cfg(C, block, max_tx);
}

inline unsigned grid_for(int64_t groups, int64_t cap = (int64_t(1) << 20)) {
  if (groups < 1) groups = 1;
  return static_cast<unsigned>(groups < cap ? groups : cap);
}

}  // namespace cuda
}  // namespace cat_fast
