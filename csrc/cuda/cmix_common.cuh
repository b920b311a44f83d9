// Private header of the CMIX CUDA kernels (design: csrc/cuda/cmix.cu), shared by
//   cmix.cu           the ops: argument checks, outputs, registration;
//   cmix_forward.cu   the forward row and tile kernels and their launch;
//   cmix_backward.cu  the backward row kernel, the backward launch (its tile kernel: cmix_backward_tile.cuh);
//   cmix_plan.cu      the CAT_FAST_CMIX_PLAN tuning overrides and the device queries.
// Here: the tile helpers both tile kernels use, the tile plan and occupancy queries, the override settings.
#pragma once

#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <ATen/ops/empty.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common.cuh"

namespace cat_fast {
namespace cuda {
namespace cmix_impl {

// The two directions (cmix_forward.cu, cmix_backward.cu), called by the ops of cmix.cu after their checks.
void forward(const at::Tensor& h, const at::Tensor& lam, const at::Tensor& partner, at::Tensor& out, bool per_token,
             cudaStream_t stream);
void backward(const at::Tensor& grad, const at::Tensor& h, const at::Tensor& lam, const at::Tensor& partner,
              at::Tensor& grad_h, at::Tensor& grad_lam, bool per_token, cudaStream_t stream);

constexpr int kBlock = 256;
constexpr int kMatchCap = 8;  // partner matches of one row kept in shared memory

// ================================================================ tile kernels
constexpr int kTileThreads = 256;  // most threads of a tile block
constexpr int kTileMaxRows = 256;  // largest batch B of the tile path
constexpr int kFwdRowsPerThread = 8;  // default forward tile: B * W <= 8 * 256 packs (32 KiB of shared memory)
constexpr int kBwdRowsPerThread = 4;  // default backward tile: 2 x B * W <= 2 x 4 * 256 packs (32 KiB)

template <typename scalar_t, int V>
using PackT = Pack<scalar_t, V>;

template <typename scalar_t, int V>
__device__ __forceinline__ void widen(const PackT<scalar_t, V>& p, acc_t<scalar_t> (&out)[V]) {
  if constexpr (std::is_same<scalar_t, c10::BFloat16>::value) {
    // bfloat16 is the upper half of a float: one shift or mask per element from each 32-bit word (the
    // element-wise conversion spends a byte permute and a multiply on every odd element). Exact either way.
    static_assert(V % 2 == 0 && sizeof(PackT<scalar_t, V>) == 2 * V, "bfloat16 packs of 32-bit words");
    uint32_t words[V / 2];
    memcpy(words, &p, sizeof(words));
#pragma unroll
    for (int k = 0; k < V / 2; ++k) {
      out[2 * k] = __uint_as_float(words[k] << 16);
      out[2 * k + 1] = __uint_as_float(words[k] & 0xffff0000u);
    }
  } else {
#pragma unroll
    for (int e = 0; e < V; ++e) out[e] = static_cast<acc_t<scalar_t>>(p.v[e]);
  }
}

template <typename scalar_t, int V>
__device__ __forceinline__ PackT<scalar_t, V> narrow(const acc_t<scalar_t> (&in)[V]) {
  PackT<scalar_t, V> p;
  if constexpr (std::is_same<scalar_t, c10::BFloat16>::value || std::is_same<scalar_t, c10::Half>::value) {
    // Two elements per conversion instruction (round to nearest even, as the element-wise cast).
    static_assert(V % 2 == 0 && sizeof(PackT<scalar_t, V>) == 2 * V, "16-bit packs of 32-bit words");
    uint32_t words[V / 2];
#pragma unroll
    for (int k = 0; k < V / 2; ++k) {
      if constexpr (std::is_same<scalar_t, c10::BFloat16>::value) {
        const __nv_bfloat162 w = __floats2bfloat162_rn(in[2 * k], in[2 * k + 1]);
        memcpy(&words[k], &w, sizeof(w));
      } else {
        const __half2 w = __floats2half2_rn(in[2 * k], in[2 * k + 1]);
        memcpy(&words[k], &w, sizeof(w));
      }
    }
    memcpy(&p, words, sizeof(words));
  } else {
#pragma unroll
    for (int e = 0; e < V; ++e) p.v[e] = static_cast<scalar_t>(in[e]);
  }
  return p;
}

// One 16-byte pack from shared memory as a single 128-bit load (a member-wise copy of a Pack of
// 16-bit types would become eight 16-bit loads).
template <typename scalar_t, int V>
__device__ __forceinline__ PackT<scalar_t, V> lds_pack(const PackT<scalar_t, V>* base, int idx) {
  static_assert(sizeof(PackT<scalar_t, V>) == sizeof(uint4), "16-byte packs");
  const uint4 raw = reinterpret_cast<const uint4*>(base)[idx];
  PackT<scalar_t, V> p;
  memcpy(&p, &raw, sizeof(raw));
  return p;
}

// Dynamic shared memory of the tile kernels: the B x W pack tiles (16-byte aligned).
extern __shared__ __align__(16) unsigned char cmix_tile_smem[];

// The work of one thread of a tile block (w_log2 = log2 W): the pack columns j, j + W, ..., j + (K-1) W of the
// chunk and the rows b = r, r + R, r + 2R, ...; `slot` is its shared-memory slot of (row r, column j) and
// `qstride` the slots between rows b and b + R (threadIdx.x and blockDim.x when K == 1).
template <int K>
struct TileLanes {
  int W, WK, j, r, R, slot, qstride;  // WK: packs per tile row
  __device__ __forceinline__ explicit TileLanes(int w_log2)
      : W(1 << w_log2),
        WK(W * K),
        j(static_cast<int>(threadIdx.x) & (W - 1)),
        r(static_cast<int>(threadIdx.x) >> w_log2),
        R(static_cast<int>(blockDim.x) >> w_log2),
        slot(K == 1 ? static_cast<int>(threadIdx.x) : r * WK + j),
        qstride(K == 1 ? static_cast<int>(blockDim.x) : R * WK) {}

  // fn(q, kk, shared slot, global pack index) for each of this thread's packs of token t in the chunk whose
  // first column is jj - j: rows r + q R < B (q < P), columns jj + kk W < Dv (kk < K), of [B, T, Dv] packs.
  template <int P, typename Fn>
  __device__ __forceinline__ void for_each_pack(int B, int64_t T, int64_t Dv, int64_t t, int64_t jj, Fn&& fn) const {
    const int64_t row_step = int64_t(R) * T * Dv;  // packs between rows b and b + R of one token
#pragma unroll
    for (int kk = 0; kk < K; ++kk) {
      if (jj + kk * W < Dv) {
        const int64_t o = (r * T + t) * Dv + jj + kk * W;
#pragma unroll
        for (int q = 0; q < P; ++q) {
          if (r + q * R < B) fn(q, kk, slot + q * qstride + kk * W, o + q * row_step);
        }
      }
    }
  }
};

// s_part[k] = partner[k] for the B rows of the batch (each checked to be a row of it).
__device__ __forceinline__ void load_partners(const int64_t* __restrict__ partner, int B, int* s_part) {
  for (int k = threadIdx.x; k < B; k += blockDim.x) {
    const int64_t p = partner[k];
    CAT_FAST_DEVICE_ASSERT(p >= 0 && p < B);
    s_part[k] = static_cast<int>(p);
  }
}

// cp.async (sm_80+) global -> shared copies of the ASYNC tile kernels (CAT_FAST_CMIX_PLAN fwd_async /
// bwd_async): 16-byte packs bypass L1 (.cg); the lam values (4 or 8 bytes) go through .ca. Below sm_80
// (host side never selects the ASYNC kernels there; this keeps them correct if it did, or if the code
// were JIT-compiled from older PTX) they are plain synchronous copies, which the kernels' barrier
// placement makes equally correct. One commit group per tile; at most one group outstanding.
template <typename T>
__device__ __forceinline__ void cp_async_copy(T* smem, const T* gmem) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8 || sizeof(T) == 16, "cp.async sizes");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  if constexpr (sizeof(T) == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem) : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(dst), "l"(gmem), "n"(sizeof(T)) : "memory");
  }
#else
  if constexpr (sizeof(T) == 16) {
    *reinterpret_cast<uint4*>(smem) = *reinterpret_cast<const uint4*>(gmem);
  } else {
    *smem = *gmem;
  }
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Waits for all of this thread's committed copies (a __syncthreads must follow before other threads read them).
__device__ __forceinline__ void cp_async_wait_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
#endif
}

// Tile geometry for a batch of B rows of Dv packs: rows_per_thread = P of the kernel, packs = K.
struct TilePlan {
  int w_log2;      // W = 1 << w_log2 lanes per row chunk (<= 32: one aligned lane segment of a warp)
  int packs;       // K pack columns per thread and row: a chunk is W * K packs
  int threads;     // block size: a multiple of 32 and of W, >= B
  int64_t chunks;  // chunks per token position, ceil(Dv / (W * K))
  size_t smem;     // bytes of one B x (W * K) pack tile
};

// w_force (CAT_FAST_CMIX_PLAN): a power of two <= 32 used instead of the heuristic W, unless it would
// need more than rows_per_thread rows a thread (then the heuristic W is kept).
template <typename scalar_t, int V>
bool plan_tiles(int64_t B, int64_t Dv, int rows_per_thread, TilePlan& plan, int packs = 1, int w_force = 0) {
  if (B < 1 || B > kTileMaxRows || Dv < 1 || packs < 1) return false;
  const int64_t K = packs;
  int64_t w = 32;
  while (w > 1 && w * K / 2 >= Dv) w /= 2;  // no wider than the row
  while (w > 1 && B * w > int64_t(rows_per_thread) * kTileThreads) w /= 2;  // <= rows_per_thread rows a thread
  // a narrower chunk when the last one would leave more than 1/8 of the row's packs padding
  while (w > 4 && Dv % (w * K) != 0 && ((Dv + w * K - 1) / (w * K) * (w * K) - Dv) * 8 > Dv) w /= 2;
  if (w_force >= 1 && w_force <= 32 && (w_force & (w_force - 1)) == 0 &&
      B * w_force <= int64_t(rows_per_thread) * kTileThreads) {
    w = w_force;
  }
  const int64_t rows = B < kTileThreads / w ? B : kTileThreads / w;  // rows in flight per pass
  const int64_t threads = (rows * w + 31) / 32 * 32;                  // <= kTileThreads
  if (B > (threads / w) * rows_per_thread) return false;              // not reached for B <= kTileMaxRows
  int w_log2 = 0;
  while ((int64_t(1) << w_log2) < w) ++w_log2;
  plan.w_log2 = w_log2;
  plan.packs = packs;
  plan.threads = static_cast<int>(threads);
  plan.chunks = (Dv + w * K - 1) / (w * K);
  plan.smem = static_cast<size_t>(B * w * K) * sizeof(Pack<scalar_t, V>);
  return true;
}

// Blocks of `kernel` (threads, smem) resident per SM (0: it cannot run so); the occupancy query is
// cached per (kernel, device, threads, smem). strict: a failing query raises, else it reads as 0.
template <typename Kernel>
int blocks_per_sm(Kernel kernel, int threads, size_t smem, bool strict = true) {
  static std::mutex mutex;
  static std::map<std::tuple<const void*, int, int, size_t>, int> cache;
  const int device = c10::cuda::current_device();
  const auto key = std::make_tuple(reinterpret_cast<const void*>(kernel), device, threads, smem);
  std::lock_guard<std::mutex> lock(mutex);
  const auto found = cache.find(key);
  if (found != cache.end()) return found->second;
  int per_sm = 0;
  if (strict) {
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
  } else if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem) != cudaSuccess) {
    (void)cudaGetLastError();
    per_sm = 0;
  }
  cache.emplace(key, per_sm);
  return per_sm;
}

int64_t sm_count();  // cmix_plan.cu

// Blocks of `kernel` (threads, smem) resident on the whole (current) device at once.
template <typename Kernel>
int64_t resident_blocks(Kernel kernel, int threads, size_t smem) {
  const int per_sm = blocks_per_sm(kernel, threads, smem);
  return int64_t(per_sm > 0 ? per_sm : 1) * sm_count();
}

// Whether `kernel` can be launched with `smem` bytes of dynamic shared memory on the current device
// (static + dynamic <= the opt-in limit per block); raises the kernel's dynamic shared memory limit
// (needed above 48 KiB) when it is below `smem`. Never raises; cached per (kernel, device, smem).
template <typename Kernel>
bool dynamic_smem_ok(Kernel kernel, size_t smem) {
  static std::mutex mutex;
  static std::map<std::tuple<const void*, int, size_t>, bool> cache;
  const int device = c10::cuda::current_device();
  const auto key = std::make_tuple(reinterpret_cast<const void*>(kernel), device, smem);
  std::lock_guard<std::mutex> lock(mutex);
  const auto found = cache.find(key);
  if (found != cache.end()) return found->second;
  cudaFuncAttributes attr;
  bool ok = cudaFuncGetAttributes(&attr, reinterpret_cast<const void*>(kernel)) == cudaSuccess;
  if (ok && smem > static_cast<size_t>(attr.maxDynamicSharedSizeBytes)) {
    const size_t optin = at::cuda::getDeviceProperties(device)->sharedMemPerBlockOptin;
    ok = attr.sharedSizeBytes + smem <= optin &&
         cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel), cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(smem)) == cudaSuccess;
  }
  if (!ok) (void)cudaGetLastError();
  cache.emplace(key, ok);
  return ok;
}

// ================================================================ tuning overrides
// CAT_FAST_CMIX_PLAN (its keys: cmix_plan.cu), read once per process.
struct PlanOverride {
  int fwd_w = 0, bwd_w = 0, fwd_rows = 0, bwd_rows = 0, fwd_packs = 0, bwd_packs = 0, bwd_minb = 0;
  int fwd_bps = 0, bwd_bps = 0, bwd_split = 0;
  int fwd_async = 0, bwd_async = 0;
  double fill = -1.0;  // < 0: default
  bool verbose = false;
  bool fwd() const { return fwd_w || fwd_rows || fwd_packs || fwd_bps || fwd_async; }
  bool bwd() const {
    return bwd_w || bwd_rows || bwd_packs || bwd_minb || bwd_bps || bwd_split || bwd_async || fill >= 0;
  }
};

PlanOverride parse_plan(const char* env);           // cmix_plan.cu
const PlanOverride& plan_override();                // cmix_plan.cu
void print_plan_once(const std::string& line);      // cmix_plan.cu: one line per distinct plan description
bool device_has_cp_async();                         // cmix_plan.cu: compute capability 8.0+

// The plan used when CAT_FAST_CMIX_PLAN is not set. 16-bit dtypes take the cp.async tile kernels with 4 rows
// per thread in the forward (benchmarks/tools/cmix_sweep.py on an H200 at [64,512,1024] bf16: fwd+bwd 75.4 % of
// copy bandwidth against 71.6 % for the register-staged kernels); fp32 keeps the register-staged kernels
// (88 %, no async variant faster). Devices below sm_80 fall back to the register-staged kernels.
template <typename scalar_t>
const PlanOverride& plan_for() {
  const char* env = std::getenv("CAT_FAST_CMIX_PLAN");
  if ((env != nullptr && *env != 0) || sizeof(scalar_t) != 2) return plan_override();
  static const PlanOverride half = parse_plan("fwd_async=1,fwd_rows=4,bwd_async=1");
  return half;
}

// tiles: the shared tiles of plan.smem bytes a block of the launch holds.
template <typename scalar_t>
std::string plan_line(const char* op, int64_t B, int64_t T, int64_t D, const TilePlan& plan, int tiles, int P,
                      int minb, int per_sm, int64_t grid, int64_t work, int64_t S, const std::string& source) {
  char buf[512];
  std::snprintf(buf, sizeof(buf),
                "cat_fast cmix plan: %s %s [%lld,%lld,%lld]: W=%d K=%d rows=%d minb=%d threads=%d smem=%zu "
                "blocks/SM=%d grid=%lld %s=%lld S=%lld (%s)",
                op, c10::toString(c10::CppTypeToScalarType<scalar_t>::value), static_cast<long long>(B),
                static_cast<long long>(T), static_cast<long long>(D), 1 << plan.w_log2, plan.packs, P, minb,
                plan.threads, tiles * plan.smem, per_sm, static_cast<long long>(grid), S > 0 ? "units" : "tiles",
                static_cast<long long>(work), static_cast<long long>(S > 0 ? S : 1), source.c_str());
  return buf;
}

constexpr const char* kNoTilePlan = "no tile plan";  // B > kTileMaxRows: the row kernels, as by default

template <typename scalar_t>
std::string plan_note(const char* op, int64_t B, int64_t T, int64_t D, const std::string& why) {
  char buf[512];
  std::snprintf(buf, sizeof(buf), "cat_fast cmix plan: %s %s [%lld,%lld,%lld]: override not applied (%s), default plan",
                op, c10::toString(c10::CppTypeToScalarType<scalar_t>::value), static_cast<long long>(B),
                static_cast<long long>(T), static_cast<long long>(D), why.c_str());
  return buf;
}

// __launch_bounds__ min blocks: forward 4 (64 registers) up to 8 packs of loads a thread, else 2;
// backward (2 tiles) 2 up to 4 packs per tile a thread, else 1 (bwd_minb overrides where instantiated).
constexpr int fwd_min_blocks(int P, int K) { return P * K <= 8 ? 4 : 2; }
constexpr int bwd_default_min_blocks(int P, int K) { return P * K >= 8 ? 1 : 2; }

// The tile settings of one direction under CAT_FAST_CMIX_PLAN, the defaults where a key is unset.
struct TileOverride {
  const char* op;   // "forward" or "backward"
  const char* key;  // "fwd" or "bwd": the prefix of the direction's CAT_FAST_CMIX_PLAN keys
  int w;            // W forced on plan_tiles, 0: the heuristic W
  int P;            // rows per thread
  int K;            // packs
  int bps;          // cap on the resident blocks per SM, 0: none
  bool async;
};

// Fits the override's tile `kernel` (`tiles` shared tiles of plan.smem bytes a block) to a batch of B rows of
// D elements: sets plan and per_sm (resident blocks per SM, capped to t.bps). False where it does not fit
// (verbose: noted on stderr, unless there is no tile plan at all, as by default).
template <typename scalar_t, int V, typename Kernel>
bool fit_override_tiles(const TileOverride& t, bool verbose, Kernel kernel, int tiles, int64_t B, int64_t T,
                        int64_t D, TilePlan& plan, int& per_sm) {
  const std::string key = t.key;
  std::string why;
  if (t.async && !device_has_cp_async()) {
    why = key + "_async needs compute capability 8.0+";
  } else if (kernel == nullptr) {
    why = (t.async ? key + "_async: " : "") + key + "_rows/" + key + "_packs not instantiated for this dtype";
  } else if (!plan_tiles<scalar_t, V>(B, D / V, t.P, plan, t.K, t.w)) {
    why = kNoTilePlan;
  } else if (!dynamic_smem_ok(kernel, tiles * plan.smem)) {
    why = "shared memory over the device limit";
  } else if ((per_sm = blocks_per_sm(kernel, plan.threads, tiles * plan.smem, /*strict=*/false)) < 1) {
    why = "no resident block";
  }
  if (!why.empty()) {
    if (verbose && why != kNoTilePlan) print_plan_once(plan_note<scalar_t>(t.op, B, T, D, why));
    return false;
  }
  if (t.bps > 0 && t.bps < per_sm) per_sm = t.bps;
  return true;
}

// The source of an override's plan line: "override", async, `notes`, and a forced W that plan_tiles did not take.
std::string override_source(const TileOverride& t, const TilePlan& plan, const std::string& notes = "");

// Launches the row kernel `kernel` with `args` over `rows` rows of `units` work items, a row slot a row.
template <typename Kernel, typename... Args>
void launch_rows(Kernel kernel, int64_t rows, int64_t units, cudaStream_t stream, Args... args) {
  const RowCfg cfg = row_cfg(units, kBlock);
  const dim3 block(cfg.tx, cfg.ty);
  const unsigned grid = grid_for((rows + cfg.ty - 1) / cfg.ty);
  kernel<<<grid, block, 0, stream>>>(args...);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace cmix_impl
}  // namespace cuda
}  // namespace cat_fast
