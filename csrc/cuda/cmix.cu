// CMIX forward / backward (docs/KERNELS.md "cmix").
//
// Two kernel families.
//
// Tile kernels (the main path: B <= kTileMaxRows, D a multiple of the 16-byte pack width, 16-byte
// aligned pointers). A tile is one token position t and one chunk of W packs (W * 16 bytes) of the
// feature dimension, for ALL B rows of the batch: the block loads h[:, t, chunk] (and grad[:, t, chunk]
// in the backward) once into shared memory, so the partner rows h[partner[i], t, chunk] and the
// grad rows of the matches of a row come from shared memory instead of a second global read. DRAM
// traffic is the minimum: forward reads h and writes out (2N bytes, N = size of h); backward reads
// grad and h and writes grad_h (3N) plus the [B,T] grad_lam. Blocks are persistent (grid <= resident
// blocks) and software-pipelined: the 16-byte loads of the block's next tile are issued into
// registers before the current tile is computed from shared memory (optional, CAT_FAST_CMIX_PLAN
// fwd_async / bwd_async, sm_80+: issued as cp.async copies into a second shared-memory stage instead, so
// no registers hold prefetched data; same arithmetic, same results). Each thread owns a fixed pack
// column j of the chunk and the rows b = r, r + R, r + 2R, ... (r = thread / W, R = threads / W).
//   forward:  tile sequence u = (t, c), c fastest, grid-strided over blocks.
//   backward: a unit is (t, split s): the chunks [c0(s), c1(s)) of token t, walked in order by one
//             block, so grad_lam[b,t] (a dot product over d) is reduced inside the block: per thread
//             over its packs in chunk order, then over the W lanes of the row by a fixed xor
//             butterfly. One launch when T is large enough to fill the GPU (S = 1 split). For small T
//             the d chunks are split over S blocks, each writing its partial dot products to a
//             [S,B,T] workspace that a second tiny kernel sums in split order (2 launches).
//   The matches {i : partner[i] == k} of every row k are built once per block, in increasing i
//   (the summation order of grad_h), as a CSR list in shared memory. When every row has exactly one
//   match (a permutation, CAT's default) a block-uniform flag selects the same arithmetic without the
//   match loop, so the loads and math of a thread's rows are straight-line code.
//
// Row kernels (fallback: B > kTileMaxRows, D not a multiple of the pack width, misaligned pointers).
// Both walk the B*T rows in (t, b) order (b fastest): the blocks in flight at any moment cover a few
// token positions for the whole batch, so the partner rows h[partner[i], t, :] and grad[i, t, :]
// they re-read are mostly L2 hits.
//
// Numerics are the same in both families: every output element is computed in the accumulation
// type from the same products in the same order (grad_h: (1 - lam_k) g_k, then + lam_i g_i over the
// matches i in increasing order), except the order of the d-sum of grad_lam. Everything is
// deterministic (no float atomics, fixed reduction orders).
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
namespace {

constexpr int kBlock = 256;
constexpr int kMatchCap = 8;  // partner matches of one row kept in shared memory

// out[i,t,:] = lam_it * h[partner[i],t,:] + (1 - lam_it) * h[i,t,:]
template <typename scalar_t, int V>
__global__ void __launch_bounds__(kBlock) cmix_forward_kernel(const scalar_t* __restrict__ h,
                                                              const acc_t<scalar_t>* __restrict__ lam,
                                                              const int64_t* __restrict__ partner,
                                                              scalar_t* __restrict__ out, int64_t B, int64_t T,
                                                              int64_t D, bool lam_per_token) {
  using A = acc_t<scalar_t>;
  const int64_t rows = B * T;
  const int64_t groups = (rows + blockDim.y - 1) / blockDim.y;
  const int64_t Dv = D / V;
  for (int64_t g = blockIdx.x; g < groups; g += gridDim.x) {
    const int64_t r = g * blockDim.y + threadIdx.y;
    if (r >= rows) continue;
    const int64_t t = r / B;
    const int64_t i = r - t * B;
    const int64_t p = partner[i];
    CAT_FAST_DEVICE_ASSERT(p >= 0 && p < B);
    const A l = lam[lam_per_token ? i * T + t : i];
    const A keep = A(1) - l;
    const scalar_t* hi = h + (i * T + t) * D;
    const scalar_t* hp = h + (p * T + t) * D;
    scalar_t* o = out + (i * T + t) * D;
    for (int64_t j = threadIdx.x; j < Dv; j += blockDim.x) {
      A a[V], b[V], c[V];
      load_acc<scalar_t, V>(hp, j, a);
      load_acc<scalar_t, V>(hi, j, b);
#pragma unroll
      for (int e = 0; e < V; ++e) c[e] = l * a[e] + keep * b[e];
      store_acc<scalar_t, V>(o, j, c);
    }
  }
}

// One row slot per output row (k, t):
//   grad_h[k,t,:]  = (1 - lam_kt) grad[k,t,:] + sum_{i : partner[i]==k, i ascending} lam_it grad[i,t,:]
//   grad_lam[k,t]  = sum_d (h[partner[k],t,d] - h[k,t,d]) grad[k,t,d]
// The matches i of each row are found once per row by a ballot scan of `partner` (in increasing i,
// so the summation order is fixed) and kept in shared memory; rows with more than kMatchCap
// matches fall back to scanning `partner` inline (same order, same result).
template <typename scalar_t, int V>
__global__ void __launch_bounds__(kBlock) cmix_backward_kernel(const scalar_t* __restrict__ grad,
                                                               const scalar_t* __restrict__ h,
                                                               const acc_t<scalar_t>* __restrict__ lam,
                                                               const int64_t* __restrict__ partner,
                                                               scalar_t* __restrict__ grad_h,
                                                               acc_t<scalar_t>* __restrict__ grad_lam, int64_t B,
                                                               int64_t T, int64_t D, bool lam_per_token) {
  using A = acc_t<scalar_t>;
  __shared__ int s_match[kBlock][kMatchCap];  // indexed by row slot (ty <= kBlock)
  __shared__ int s_count[kBlock];
  __shared__ A s_red[kBlock / 32];

  const int tx = blockDim.x;
  const int x = threadIdx.x;
  const int y = threadIdx.y;
  const int lane = (y * tx + x) & 31;
  const int64_t rows = B * T;
  const int64_t groups = (rows + blockDim.y - 1) / blockDim.y;
  const int64_t Dv = D / V;

  for (int64_t g = blockIdx.x; g < groups; g += gridDim.x) {  // uniform trip count in the block
    const int64_t r = g * blockDim.y + y;
    const bool valid = r < rows;
    const int64_t t = valid ? r / B : 0;
    const int64_t k = valid ? r - t * B : -1;  // k = -1 matches nothing

    // ---- matches of row k: ordered ballot compaction over partner[0..B)
    const int seg = tx < 32 ? tx : 32;  // lanes of the slot that scan
    if (x < seg) {                      // whole warps (tx >= 32) or all lanes (tx < 32)
      const unsigned seg_mask = seg == 32 ? kFullMask : (((1u << seg) - 1u) << (lane - x));
      const unsigned lt_mask = (1u << lane) - 1u;
      int count = 0;
      for (int64_t i0 = 0; i0 < B; i0 += seg) {  // same trip count for every lane of the warp
        const int64_t i = i0 + x;
        const bool hit = i < B && partner[i] == k;
        const unsigned m = __ballot_sync(kFullMask, hit) & seg_mask;
        if (hit) {
          const int pos = count + __popc(m & lt_mask);
          if (pos < kMatchCap) s_match[y][pos] = static_cast<int>(i);
        }
        count += __popc(m);
      }
      if (x == 0) s_count[y] = count;
    }
    __syncthreads();
    const int count = s_count[y];

    A gl = A(0);
    if (valid) {
      const int64_t p = partner[k];
      CAT_FAST_DEVICE_ASSERT(p >= 0 && p < B);
      const A lk = lam[lam_per_token ? k * T + t : k];
      const A keep = A(1) - lk;
      const int64_t row_k = (k * T + t) * D;
      const scalar_t* gk = grad + row_k;
      const scalar_t* hk = h + row_k;
      const scalar_t* hp = h + (p * T + t) * D;
      scalar_t* ghk = grad_h + row_k;
      for (int64_t j = x; j < Dv; j += tx) {
        A g0[V], a[V], b[V], acc[V];
        load_acc<scalar_t, V>(gk, j, g0);
        load_acc<scalar_t, V>(hp, j, a);
        load_acc<scalar_t, V>(hk, j, b);
#pragma unroll
        for (int e = 0; e < V; ++e) {
          acc[e] = keep * g0[e];
          gl += (a[e] - b[e]) * g0[e];
        }
        if (count <= kMatchCap) {
          for (int m = 0; m < count; ++m) {
            const int64_t i = s_match[y][m];
            const A li = lam[lam_per_token ? i * T + t : i];
            A gi[V];
            load_acc<scalar_t, V>(grad + (i * T + t) * D, j, gi);
#pragma unroll
            for (int e = 0; e < V; ++e) acc[e] += li * gi[e];
          }
        } else {
          for (int64_t i = 0; i < B; ++i) {
            if (partner[i] != k) continue;
            const A li = lam[lam_per_token ? i * T + t : i];
            A gi[V];
            load_acc<scalar_t, V>(grad + (i * T + t) * D, j, gi);
#pragma unroll
            for (int e = 0; e < V; ++e) acc[e] += li * gi[e];
          }
        }
        store_acc<scalar_t, V>(ghk, j, acc);
      }
    }
    gl = group_reduce(gl, SumOp{}, s_red);  // also orders s_match reuse across iterations
    if (valid && x == 0) grad_lam[k * T + t] = gl;
    __syncthreads();  // s_match / s_count are rewritten by the next iteration
  }
}

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

// out[i,t,:] = lam_it * h[partner[i],t,:] + (1 - lam_it) * h[i,t,:], tile by tile.
// blockDim.x = threads = a multiple of 32 and of W = 1 << w_log2; a tile is B rows x W*K packs, shared
// memory B * W * K packs. Each thread owns the K pack columns j, j + W, ..., j + (K-1) W of the chunk
// (each load instruction of a warp stays W consecutive packs of a row) and up to P rows.
// Default instantiation P = 8, K = 1, MINB = 4 (64 registers, no spills at 4 blocks of 256 per SM: up to
// 4 x 32 KiB of loads in flight per SM); the others exist for CAT_FAST_CMIX_PLAN tuning.
// ASYNC (CAT_FAST_CMIX_PLAN fwd_async=1): the next tile is copied global -> shared by cp.async into a
// second shared stage (2 x B * W * K packs, lam double-buffered too) instead of through registers; per
// tile: wait for its copies, one barrier (which also retires the readers of the other stage), issue the
// next tile's copies into the other stage, compute. Same arithmetic, bitwise the same results.
template <typename scalar_t, int V, int P, int K, int MINB, bool ASYNC = false>
__global__ void __launch_bounds__(kTileThreads, MINB) cmix_forward_tile_kernel(
    const scalar_t* __restrict__ h, const acc_t<scalar_t>* __restrict__ lam, const int64_t* __restrict__ partner,
    scalar_t* __restrict__ out, int B, int64_t T, int64_t D, bool lam_per_token, int w_log2, int64_t chunks,
    int64_t tiles) {
  using A = acc_t<scalar_t>;
  using Pk = PackT<scalar_t, V>;
  __shared__ int s_part[kTileMaxRows];
  __shared__ A s_lam_buf[(ASYNC ? 2 : 1) * kTileMaxRows];
  Pk* const s_base = reinterpret_cast<Pk*>(cmix_tile_smem);
  Pk* s_h = s_base;
  A* s_lam = s_lam_buf;

  const int tid = threadIdx.x;
  const TileLanes<K> lanes(w_log2);
  const int W = lanes.W, WK = lanes.WK, j = lanes.j, r = lanes.r, R = lanes.R;
  const int slot = lanes.slot, qstride = lanes.qstride;
  const int64_t Dv = D / V;
  const int64_t row_step = int64_t(R) * T * Dv;  // packs between rows b and b + R of one token
  const Pk* __restrict__ hv = reinterpret_cast<const Pk*>(h);
  Pk* __restrict__ ov = reinterpret_cast<Pk*>(out);

  load_partners(partner, B, s_part);

  int64_t u = blockIdx.x;  // grid <= tiles
  int stage = 0;           // ASYNC: shared stage of tile u
  // ASYNC: issues (and commits) the cp.async copies of tile `tile` into shared stage st.
  auto issue = [&](int64_t tile, int st) {
    const int64_t t = tile / chunks;
    const int64_t jj = (tile - t * chunks) * WK + j;
    Pk* dh = s_base + st * (B * WK);
    lanes.template for_each_pack<P>(B, T, Dv, t, jj, [&](int, int, int d, int64_t g) { cp_async_copy(dh + d, hv + g); });
    if (tid < B) cp_async_copy(s_lam_buf + st * kTileMaxRows + tid, lam + (lam_per_token ? tid * T + t : tid));
    cp_async_commit();
  };
  Pk regs[P][K];
  A lam_r = A(0);
  // Issues the loads of tile u: this thread's packs of h, and lam[tid, t] (blockDim.x >= B).
  auto load = [&](int64_t tile) {
    const int64_t t = tile / chunks;
    const int64_t jj = (tile - t * chunks) * WK + j;
    lanes.template for_each_pack<P>(B, T, Dv, t, jj, [&](int q, int kk, int, int64_t g) { regs[q][kk] = hv[g]; });
    if (tid < B) lam_r = lam[lam_per_token ? tid * T + t : tid];
  };
  if constexpr (ASYNC) {
    issue(u, 0);
  } else {
    load(u);
  }

  while (true) {
    const int64_t t = u / chunks;
    const int64_t jj = (u - t * chunks) * WK + j;
    if constexpr (ASYNC) {
      cp_async_wait_all();  // this thread's copies of tile u (the only group outstanding)
      __syncthreads();      // everyone's copies of tile u landed; the previous tile's readers are done
      s_h = s_base + stage * (B * WK);
      s_lam = s_lam_buf + stage * kTileMaxRows;
    } else {
      __syncthreads();  // the previous tile's readers are done with s_h / s_lam
      lanes.template for_each_pack<P>(B, T, Dv, t, jj, [&](int q, int kk, int d, int64_t) { s_h[d] = regs[q][kk]; });
      if (tid < B) s_lam[tid] = lam_r;
      __syncthreads();
    }

    const int64_t next = u + gridDim.x;
    if (next < tiles) {  // in flight while this tile is computed and stored
      if constexpr (ASYNC) {
        issue(next, stage ^ 1);
      } else {
        load(next);
      }
    }

#pragma unroll
    for (int kk = 0; kk < K; ++kk) {
      if (jj + kk * W < Dv) {
        Pk* dst = ov + (r * T + t) * Dv + jj + kk * W;
#pragma unroll
        for (int q = 0; q < P; ++q) {
          const int b = r + q * R;
          if (b < B) {
            const A l = s_lam[b];
            const A keep = A(1) - l;
            A a[V], x[V], c[V];
            widen<scalar_t, V>(lds_pack<scalar_t, V>(s_h, s_part[b] * WK + kk * W + j), a);
            widen<scalar_t, V>(lds_pack<scalar_t, V>(s_h, slot + q * qstride + kk * W), x);
#pragma unroll
            for (int e = 0; e < V; ++e) c[e] = l * a[e] + keep * x[e];
            dst[q * row_step] = narrow<scalar_t, V>(c);
          }
        }
      }
    }
    if (next >= tiles) break;
    u = next;
    if constexpr (ASYNC) stage ^= 1;
  }
}

// Backward over units (t, s): chunks [c0(s), c1(s)) of token t with c0(s) = s * chunks / S.
//   grad_h[k,t,:] = (1 - lam_kt) grad[k,t,:] + sum_{i : partner[i]==k, i ascending} lam_it grad[i,t,:]
//   lam_out[s, k, t] = sum over the unit's d of (h[partner[k],t,d] - h[k,t,d]) grad[k,t,d]
// (lam_out is grad_lam itself when S == 1, else the [S,B,T] workspace of cmix_lam_split_sum_kernel.)
// Shared memory: grad tile then h tile, B * W * K packs each; thread columns as in the forward tile kernel.
// Default instantiation P = 4, K = 1, MINB = 2 (~105-127 registers, no spills: 2 blocks of 256 per SM,
// each with its next chunk's 32 KiB of loads in flight; 3 blocks per SM would spill); the others exist
// for CAT_FAST_CMIX_PLAN tuning. The dot product of a row is summed per thread over its chunks in order
// and, within a chunk, over its K columns in order, then over the W lanes.
// ASYNC (CAT_FAST_CMIX_PLAN bwd_async=1): the next chunk's grad and h tiles are copied global -> shared by
// cp.async into a second shared stage (2 stages x (grad tile + h tile) = 4 x B * W * K packs; lam
// double-buffered too), so no registers hold prefetched data. Per chunk: wait for its copies, one barrier
// (which also retires the readers of the other stage), issue the next chunk's copies into the other
// stage, compute from shared memory exactly as below (bitwise the same results).
template <typename scalar_t, int V, int P, int K, int MINB, bool ASYNC = false>
__global__ void __launch_bounds__(kTileThreads, MINB) cmix_backward_tile_kernel(
    const scalar_t* __restrict__ grad, const scalar_t* __restrict__ h, const acc_t<scalar_t>* __restrict__ lam,
    const int64_t* __restrict__ partner, scalar_t* __restrict__ grad_h, acc_t<scalar_t>* __restrict__ lam_out, int B,
    int64_t T, int64_t D, bool lam_per_token, int w_log2, int64_t chunks, int S) {
  using A = acc_t<scalar_t>;
  using Pk = PackT<scalar_t, V>;
  __shared__ int s_part[kTileMaxRows];
  __shared__ int s_fill[kTileMaxRows];     // match counts, then fill cursors
  __shared__ int s_off[kTileMaxRows + 1];  // CSR offsets of the matches of each row
  __shared__ int s_list[kTileMaxRows];     // matches, increasing i within each row
  __shared__ int s_one_match;              // 1: every row has exactly one match (partner is a permutation)
  __shared__ A s_lam_buf[(ASYNC ? 2 : 1) * kTileMaxRows];
  A* s_lam = s_lam_buf;
  const int tid = threadIdx.x;
  const TileLanes<K> lanes(w_log2);
  const int W = lanes.W, WK = lanes.WK, j = lanes.j, r = lanes.r, R = lanes.R;
  const int slot = lanes.slot, qstride = lanes.qstride;
  Pk* const s_base = reinterpret_cast<Pk*>(cmix_tile_smem);
  Pk* s_g = s_base;
  Pk* s_h = s_g + B * WK;
  const int64_t Dv = D / V;
  const int64_t units = T * S;
  const int64_t row_step = int64_t(R) * T * Dv;  // packs between rows b and b + R of one token
  const Pk* __restrict__ gv = reinterpret_cast<const Pk*>(grad);
  const Pk* __restrict__ hv = reinterpret_cast<const Pk*>(h);
  Pk* __restrict__ ghv = reinterpret_cast<Pk*>(grad_h);

  // ---- matches of every row, once per block (warp 0; B <= 256 so at most 8 rounds of 32).
  load_partners(partner, B, s_part);
  for (int k = tid; k < B; k += blockDim.x) s_fill[k] = 0;
  __syncthreads();
  if (tid < 32) {
    const int lane = tid;
    const unsigned lt_mask = (1u << lane) - 1u;
    for (int i0 = 0; i0 < B; i0 += 32) {  // counts
      const int i = i0 + lane;
      const int p = i < B ? s_part[i] : -1 - lane;  // padding lanes match nobody
      const unsigned peers = __match_any_sync(kFullMask, p);
      if (i < B && (peers & lt_mask) == 0) s_fill[p] += __popc(peers);  // lowest lane of each value
      __syncwarp();
    }
    // exclusive scan of the counts: lane owns rows [lane * per, lane * per + per)
    const int per = (B + 31) / 32;
    const int k0 = lane * per < B ? lane * per : B;
    const int k1 = k0 + per < B ? k0 + per : B;
    int local = 0;
    for (int k = k0; k < k1; ++k) local += s_fill[k];
    int incl = local;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(kFullMask, incl, o);
      if (lane >= o) incl += v;
    }
    int run = incl - local;
    bool one_match = true;
    for (int k = k0; k < k1; ++k) {
      const int cnt = s_fill[k];
      one_match = one_match && cnt == 1;
      s_off[k] = run;
      s_fill[k] = run;  // fill cursor
      run += cnt;
    }
    if (lane == 31) s_off[B] = incl;  // == B
    one_match = __all_sync(kFullMask, one_match);
    if (lane == 0) s_one_match = one_match ? 1 : 0;
    __syncwarp();
    for (int i0 = 0; i0 < B; i0 += 32) {  // fill, in increasing i
      const int i = i0 + lane;
      const int p = i < B ? s_part[i] : -1 - lane;
      const unsigned peers = __match_any_sync(kFullMask, p);
      if (i < B) s_list[s_fill[p] + __popc(peers & lt_mask)] = i;
      __syncwarp();
      if (i < B && (peers & lt_mask) == 0) s_fill[p] += __popc(peers);
      __syncwarp();
    }
  }
  // (the first __syncthreads of the loop below publishes s_off / s_list / s_one_match)

  int64_t u = blockIdx.x;  // grid <= units
  int64_t t = u / S;
  int s = static_cast<int>(u - t * S);
  int64_t c = s * chunks / S;
  int64_t c_end = (s + 1) * chunks / S;

  int stage = 0;  // ASYNC: shared stage of the chunk (t, c)
  // ASYNC: issues (and commits) the cp.async copies of chunk cc of token tt into shared stage st
  // (grad tile at st * 2 * B * WK, h tile after it).
  auto issue = [&](int64_t tt, int64_t cc, int st) {
    Pk* dg = s_base + st * (2 * B * WK);
    Pk* dh = dg + B * WK;
    lanes.template for_each_pack<P>(B, T, Dv, tt, cc * WK + j, [&](int, int, int d, int64_t g) {
      cp_async_copy(dg + d, gv + g);
      cp_async_copy(dh + d, hv + g);
    });
    if (tid < B) cp_async_copy(s_lam_buf + st * kTileMaxRows + tid, lam + (lam_per_token ? tid * T + tt : tid));
    cp_async_commit();
  };
  Pk gr[P][K], hr[P][K];
  A lam_r = A(0);
  auto load = [&](int64_t tt, int64_t cc) {
    lanes.template for_each_pack<P>(B, T, Dv, tt, cc * WK + j, [&](int q, int kk, int, int64_t g) {
      gr[q][kk] = gv[g];
      hr[q][kk] = hv[g];
    });
    if (tid < B) lam_r = lam[lam_per_token ? tid * T + tt : tid];
  };
  if constexpr (ASYNC) {
    issue(t, c, 0);
  } else {
    load(t, c);
  }

  A gl[P];
#pragma unroll
  for (int q = 0; q < P; ++q) gl[q] = A(0);

  while (true) {
    const int64_t jj = c * WK + j;
    if constexpr (ASYNC) {
      cp_async_wait_all();  // this thread's copies of chunk (t, c) (the only group outstanding)
      __syncthreads();      // everyone's copies landed; the previous chunk's readers are done with the other stage
      s_g = s_base + stage * (2 * B * WK);
      s_h = s_g + B * WK;
      s_lam = s_lam_buf + stage * kTileMaxRows;
    } else {
      __syncthreads();  // the previous chunk's readers are done with the tiles / s_lam
      lanes.template for_each_pack<P>(B, T, Dv, t, jj, [&](int q, int kk, int d, int64_t) {
        s_g[d] = gr[q][kk];
        s_h[d] = hr[q][kk];
      });
      if (tid < B) s_lam[tid] = lam_r;
      __syncthreads();
    }

    // next chunk of this block: the unit's next chunk, or the first chunk of its next unit
    int64_t nu = u, nt = t, nc = c + 1, nce = c_end;
    int ns = s;
    if (nc == c_end) {
      nu = u + gridDim.x;
      nt = nu / S;
      ns = static_cast<int>(nu - nt * S);
      nc = ns * chunks / S;
      nce = (ns + 1) * chunks / S;
    }
    const bool more = nu < units;
    if (more) {  // in flight while this chunk is computed and stored
      if constexpr (ASYNC) {
        issue(nt, nc, stage ^ 1);
      } else {
        load(nt, nc);
      }
    }

    // One match per row (a permutation, CAT's default) is the same arithmetic without the match loop, so the
    // P rows' shared-memory loads and math are independent straight-line code the compiler can interleave.
    auto compute = [&](auto one_match_tag) {
      constexpr bool kOneMatch = decltype(one_match_tag)::value;
#pragma unroll
      for (int kk = 0; kk < K; ++kk) {
        if (jj + kk * W < Dv) {  // the same for every row of this thread (and for its partner / match rows)
          Pk* dst = ghv + (r * T + t) * Dv + jj + kk * W;
          const int col = kk * W + j;  // column of the tile
#pragma unroll
          for (int q = 0; q < P; ++q) {
            const int b = r + q * R;
            if (b < B) {
              const A lk = s_lam[b];
              const A keep = A(1) - lk;
              A g0[V], a[V], x[V], acc[V];
              widen<scalar_t, V>(lds_pack<scalar_t, V>(s_g, slot + q * qstride + kk * W), g0);
              widen<scalar_t, V>(lds_pack<scalar_t, V>(s_h, s_part[b] * WK + col), a);
              widen<scalar_t, V>(lds_pack<scalar_t, V>(s_h, slot + q * qstride + kk * W), x);
              A dot = A(0);
#pragma unroll
              for (int e = 0; e < V; ++e) {
                acc[e] = keep * g0[e];
                dot += (a[e] - x[e]) * g0[e];
              }
              gl[q] += dot;
              auto add_match = [&](int i) {
                const A li = s_lam[i];
                A gi[V];
                widen<scalar_t, V>(lds_pack<scalar_t, V>(s_g, i * WK + col), gi);
#pragma unroll
                for (int e = 0; e < V; ++e) acc[e] += li * gi[e];
              };
              if constexpr (kOneMatch) {
                add_match(s_list[b]);  // s_off[b] == b
              } else {
                const int m1 = s_off[b + 1];
                for (int m = s_off[b]; m < m1; ++m) add_match(s_list[m]);
              }
              dst[q * row_step] = narrow<scalar_t, V>(acc);
            }
          }
        }
      }
    };
    if (s_one_match) {
      compute(std::true_type{});
    } else {
      compute(std::false_type{});
    }

    if (c + 1 == c_end) {  // last chunk of the unit (uniform over the block): reduce over the W lanes of each row
#pragma unroll
      for (int q = 0; q < P; ++q) {
        A v = gl[q];
        for (int o = W >> 1; o > 0; o >>= 1) v += shfl_xor(v, o);
        const int b = r + q * R;
        if (j == 0 && b < B) lam_out[(static_cast<int64_t>(s) * B + b) * T + t] = v;
        gl[q] = A(0);
      }
    }
    if (!more) break;
    u = nu;
    t = nt;
    s = ns;
    c = nc;
    c_end = nce;
    if constexpr (ASYNC) stage ^= 1;
  }
}

// grad_lam[x] = sum_{s = 0..S-1} ws[s, x], in split order.
template <typename A>
__global__ void cmix_lam_split_sum_kernel(const A* __restrict__ ws, A* __restrict__ grad_lam, int64_t n, int S) {
  for (int64_t x = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; x < n;
       x += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    A v = ws[x];
    for (int s = 1; s < S; ++s) v += ws[s * n + x];
    grad_lam[x] = v;
  }
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

int64_t sm_count() {
  return at::cuda::getDeviceProperties(c10::cuda::current_device())->multiProcessorCount;
}

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
// CAT_FAST_CMIX_PLAN="key=value,key=value,..." (',' or ';' between items; any subset), read once per
// process, for tuning the tile plan without rebuilding (benchmarks/tools/cmix_sweep.py). Keys:
//   fwd_w, bwd_w          W, lanes per row chunk: 1, 2, 4, 8, 16, 32. Used when B * W <= rows * 256,
//                         else the heuristic W (for the rows per thread in use) is kept.
//   fwd_rows, bwd_rows    P, the rows per thread the kernel is compiled for: 2, 4, 8.
//   fwd_packs, bwd_packs  K, 16-byte pack columns per thread and row (a chunk is W * K packs): 1, 2.
//   bwd_minb              min blocks per SM of the backward's __launch_bounds__ (register cap): 1, 2, 3
//                         where instantiated for (P, K) (see backward_tile_kernel_for), else the default
//                         (2 for P * K <= 4, 1 for P * K = 8).
//   fwd_bps, bwd_bps      at most this many resident blocks per SM (grid cap): 1..64.
//   bwd_split             S, d-splits per token (capped to the chunks), instead of the fill rule.
//   fill                  the fill threshold of the split rule: [0, 1].
//   fwd_async, bwd_async  1: the cp.async double-buffered tile kernels (ASYNC above; sm_80+, float /
//                         bfloat16 / half, K = 1, P = 4 or 8): twice the shared memory of the tile
//                         (forward 2 x B * W * 16 bytes, backward 4 x B * W * 16 bytes), no register
//                         prefetch. bwd_minb: 2, or 3 at P = 4. 0: the register-prefetch kernels (default).
//   verbose               1: print the plan of each (op, dtype, shape) once to stderr.
// float / bfloat16 / half have every (P, K) variant; double only the default kernels. Malformed or
// out-of-range items are ignored (one note on stderr); an override that does not fit a launch
// (variant not instantiated, shared memory over the device limit, no resident block) falls back to
// the default plan for that launch. Unset or empty: the default plan, unchanged.
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

std::string trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  const size_t e = s.find_last_not_of(" \t\r\n");
  return s.substr(b, e - b + 1);
}

bool parse_int(const std::string& v, long lo, long hi, int& out) {
  if (v.empty()) return false;
  char* end = nullptr;
  errno = 0;
  const long x = std::strtol(v.c_str(), &end, 10);
  if (errno != 0 || end == v.c_str() || *end != '\0' || x < lo || x > hi) return false;
  out = static_cast<int>(x);
  return true;
}

bool parse_one_of(const std::string& v, std::initializer_list<int> allowed, int& out) {
  int x = 0;
  if (!parse_int(v, INT32_MIN, INT32_MAX, x)) return false;
  for (int a : allowed) {
    if (x == a) {
      out = x;
      return true;
    }
  }
  return false;
}

bool parse_unit(const std::string& v, double& out) {
  if (v.empty()) return false;
  char* end = nullptr;
  errno = 0;
  const double x = std::strtod(v.c_str(), &end);
  if (errno != 0 || end == v.c_str() || *end != '\0' || !std::isfinite(x) || x < 0.0 || x > 1.0) return false;
  out = x;
  return true;
}

PlanOverride parse_plan(const char* env) {
  PlanOverride o;
  if (env == nullptr) return o;
  const std::string spec(env);
  std::string bad;
  size_t pos = 0;
  while (pos <= spec.size()) {
    size_t end = spec.find_first_of(",;", pos);
    if (end == std::string::npos) end = spec.size();
    const std::string item = trim(spec.substr(pos, end - pos));
    pos = end + 1;
    if (item.empty()) continue;
    const size_t eq = item.find('=');
    const std::string key = trim(item.substr(0, eq));
    const std::string val = eq == std::string::npos ? "" : trim(item.substr(eq + 1));
    bool ok = false;
    int flag = 0;
    if (key == "fwd_w") ok = parse_one_of(val, {1, 2, 4, 8, 16, 32}, o.fwd_w);
    else if (key == "bwd_w") ok = parse_one_of(val, {1, 2, 4, 8, 16, 32}, o.bwd_w);
    else if (key == "fwd_rows") ok = parse_one_of(val, {2, 4, 8}, o.fwd_rows);
    else if (key == "bwd_rows") ok = parse_one_of(val, {2, 4, 8}, o.bwd_rows);
    else if (key == "fwd_packs") ok = parse_one_of(val, {1, 2}, o.fwd_packs);
    else if (key == "bwd_packs") ok = parse_one_of(val, {1, 2}, o.bwd_packs);
    else if (key == "bwd_minb") ok = parse_one_of(val, {1, 2, 3}, o.bwd_minb);
    else if (key == "fwd_bps") ok = parse_int(val, 1, 64, o.fwd_bps);
    else if (key == "bwd_bps") ok = parse_int(val, 1, 64, o.bwd_bps);
    else if (key == "bwd_split") ok = parse_int(val, 1, 1 << 20, o.bwd_split);
    else if (key == "fill") ok = parse_unit(val, o.fill);
    else if (key == "fwd_async") ok = parse_one_of(val, {0, 1}, o.fwd_async);
    else if (key == "bwd_async") ok = parse_one_of(val, {0, 1}, o.bwd_async);
    else if (key == "verbose") {
      ok = parse_one_of(val, {0, 1}, flag);
      if (ok) o.verbose = flag == 1;
    }
    if (!ok) bad += (bad.empty() ? "" : ", ") + item;
  }
  if (!bad.empty()) std::fprintf(stderr, "cat_fast: CAT_FAST_CMIX_PLAN: ignored %s\n", bad.c_str());
  return o;
}

const PlanOverride& plan_override() {
  static const PlanOverride o = parse_plan(std::getenv("CAT_FAST_CMIX_PLAN"));
  return o;
}

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

// One line per distinct plan description (verbose=1).
void print_plan_once(const std::string& line) {
  static std::mutex mutex;
  static std::set<std::string> seen;
  std::lock_guard<std::mutex> lock(mutex);
  if (seen.insert(line).second) {
    std::fprintf(stderr, "%s\n", line.c_str());
    std::fflush(stderr);
  }
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

// ---------------------------------------------------------------- tile kernel variants
template <typename scalar_t>
using FwdTileKernel = void (*)(const scalar_t*, const acc_t<scalar_t>*, const int64_t*, scalar_t*, int, int64_t,
                               int64_t, bool, int, int64_t, int64_t);
template <typename scalar_t>
using BwdTileKernel = void (*)(const scalar_t*, const scalar_t*, const acc_t<scalar_t>*, const int64_t*,
                               scalar_t*, acc_t<scalar_t>*, int, int64_t, int64_t, bool, int, int64_t, int);

// __launch_bounds__ min blocks: forward 4 (64 registers) up to 8 packs of loads a thread, else 2;
// backward (2 tiles) 2 up to 4 packs per tile a thread, else 1 (bwd_minb overrides where instantiated).
constexpr int fwd_min_blocks(int P, int K) { return P * K <= 8 ? 4 : 2; }
constexpr int bwd_default_min_blocks(int P, int K) { return P * K >= 8 ? 1 : 2; }

// The instantiated (P, K) of the forward; nullptr where not instantiated. Default first.
template <typename scalar_t, int V>
FwdTileKernel<scalar_t> forward_tile_kernel_for(int P, int K) {
#define CAT_FAST_CMIX_FWD(P_, K_) \
  if (P == P_ && K == K_) return cmix_forward_tile_kernel<scalar_t, V, P_, K_, fwd_min_blocks(P_, K_)>;
  CAT_FAST_CMIX_FWD(kFwdRowsPerThread, 1)
  if constexpr (!std::is_same<scalar_t, double>::value) {  // tuning alternatives
    CAT_FAST_CMIX_FWD(2, 1)
    CAT_FAST_CMIX_FWD(4, 1)
    CAT_FAST_CMIX_FWD(2, 2)
    CAT_FAST_CMIX_FWD(4, 2)
    CAT_FAST_CMIX_FWD(8, 2)
  }
#undef CAT_FAST_CMIX_FWD
  return nullptr;
}

// The instantiated (P, K, MINB) of the backward; nullptr where not instantiated. Default first. MINB
// choices by packs a thread and tile P * K: 2 -> {2, 3}, 4 -> {1, 2}, 8 -> {1, 2}. (sm_90 ptxas: no
// spills, except (8, 1, 2) for the 16-bit types: 24 bytes. (4, 2, 2) and (8, 1, 2) run 2 blocks of 2 x
// 32 KiB tiles per SM at B * W = 2048 packs, twice the default's loads in flight; 3 blocks per SM at
// P * K = 4 would spill.)
template <typename scalar_t, int V>
BwdTileKernel<scalar_t> backward_tile_kernel_for(int P, int K, int M) {
#define CAT_FAST_CMIX_BWD(P_, K_, M_) \
  if (P == P_ && K == K_ && M == M_) return cmix_backward_tile_kernel<scalar_t, V, P_, K_, M_>;
  CAT_FAST_CMIX_BWD(kBwdRowsPerThread, 1, 2)
  if constexpr (!std::is_same<scalar_t, double>::value) {  // tuning alternatives
    CAT_FAST_CMIX_BWD(2, 1, 2)
    CAT_FAST_CMIX_BWD(2, 1, 3)
    CAT_FAST_CMIX_BWD(4, 1, 1)
    CAT_FAST_CMIX_BWD(2, 2, 1)
    CAT_FAST_CMIX_BWD(2, 2, 2)
    CAT_FAST_CMIX_BWD(8, 1, 1)
    CAT_FAST_CMIX_BWD(4, 2, 1)
    CAT_FAST_CMIX_BWD(8, 1, 2)
    CAT_FAST_CMIX_BWD(4, 2, 2)
  }
#undef CAT_FAST_CMIX_BWD
  return nullptr;
}

// The cp.async (ASYNC) variants: float / bfloat16 / half only, K = 1, P = 4 (default rows) or 8;
// forward MINB as fwd_min_blocks, backward MINB = 2 (kBwdAsyncMinBlocks; also 3 at P = 4: 3 x (2 x 2 x
// 16 KiB + 6 KiB) of shared memory fits an sm_90 SM at B * W = 1024). nullptr where not instantiated.
constexpr int kBwdAsyncMinBlocks = 2;

template <typename scalar_t, int V>
FwdTileKernel<scalar_t> forward_tile_async_kernel_for(int P, int K) {
  if constexpr (!std::is_same<scalar_t, double>::value) {
#define CAT_FAST_CMIX_FWD_ASYNC(P_, K_) \
  if (P == P_ && K == K_) return cmix_forward_tile_kernel<scalar_t, V, P_, K_, fwd_min_blocks(P_, K_), true>;
    CAT_FAST_CMIX_FWD_ASYNC(kFwdRowsPerThread, 1)
    CAT_FAST_CMIX_FWD_ASYNC(4, 1)
#undef CAT_FAST_CMIX_FWD_ASYNC
  }
  return nullptr;
}

template <typename scalar_t, int V>
BwdTileKernel<scalar_t> backward_tile_async_kernel_for(int P, int K, int M) {
  if constexpr (!std::is_same<scalar_t, double>::value) {
#define CAT_FAST_CMIX_BWD_ASYNC(P_, K_, M_) \
  if (P == P_ && K == K_ && M == M_) return cmix_backward_tile_kernel<scalar_t, V, P_, K_, M_, true>;
    CAT_FAST_CMIX_BWD_ASYNC(kBwdRowsPerThread, 1, kBwdAsyncMinBlocks)
    CAT_FAST_CMIX_BWD_ASYNC(kBwdRowsPerThread, 1, 3)
    CAT_FAST_CMIX_BWD_ASYNC(8, 1, kBwdAsyncMinBlocks)
#undef CAT_FAST_CMIX_BWD_ASYNC
  }
  return nullptr;
}

// Whether the current device runs cp.async (compute capability 8.0+).
bool device_has_cp_async() {
  return at::cuda::getDeviceProperties(c10::cuda::current_device())->major >= 8;
}

// ================================================================ launchers
template <typename scalar_t>
void run_forward_tiles(FwdTileKernel<scalar_t> kernel, const TilePlan& plan, int64_t resident, const scalar_t* hp,
                       const acc_t<scalar_t>* lp, const int64_t* pp, scalar_t* op, int64_t B, int64_t T, int64_t D,
                       bool per_token, cudaStream_t stream, int64_t& grid_out, int stages = 1) {
  const int64_t tiles = T * plan.chunks;
  const unsigned grid = grid_for(tiles < resident ? tiles : resident);
  kernel<<<grid, plan.threads, stages * plan.smem, stream>>>(hp, lp, pp, op, static_cast<int>(B), T, D, per_token,
                                                     plan.w_log2, plan.chunks, tiles);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  grid_out = grid;
}

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
std::string override_source(const TileOverride& t, const TilePlan& plan, const std::string& notes = "") {
  std::string source = t.async ? "override, async" : "override";
  source += notes;
  if (t.w && (1 << plan.w_log2) != t.w) source += std::string(", ") + t.key + "_w ignored: B * W > rows * 256";
  return source;
}

// The forward tile launch under CAT_FAST_CMIX_PLAN; false (nothing launched) where it does not apply.
template <typename scalar_t, int V>
bool launch_forward_override(const PlanOverride& ov, const scalar_t* hp, const acc_t<scalar_t>* lp,
                             const int64_t* pp, scalar_t* op, int64_t B, int64_t T, int64_t D, bool per_token,
                             cudaStream_t stream) {
  const TileOverride t{"forward", "fwd", ov.fwd_w, ov.fwd_rows ? ov.fwd_rows : kFwdRowsPerThread,
                       ov.fwd_packs ? ov.fwd_packs : 1, ov.fwd_bps, ov.fwd_async == 1};
  const int stages = t.async ? 2 : 1;  // shared tile stages
  auto kernel = t.async ? forward_tile_async_kernel_for<scalar_t, V>(t.P, t.K)
                        : forward_tile_kernel_for<scalar_t, V>(t.P, t.K);
  TilePlan plan;
  int per_sm = 0;
  if (!fit_override_tiles<scalar_t, V>(t, ov.verbose, kernel, stages, B, T, D, plan, per_sm)) return false;
  int64_t grid = 0;
  run_forward_tiles<scalar_t>(kernel, plan, int64_t(per_sm) * sm_count(), hp, lp, pp, op, B, T, D, per_token, stream,
                              grid, stages);
  if (ov.verbose) {
    print_plan_once(plan_line<scalar_t>("forward", B, T, D, plan, stages, t.P, fwd_min_blocks(t.P, t.K), per_sm, grid,
                                        T * plan.chunks, 0, override_source(t, plan)));
  }
  return true;
}

// Launches the row kernel `kernel` with `args` over `rows` rows of `units` work items, a row slot a row.
template <typename Kernel, typename... Args>
void launch_rows(Kernel kernel, int64_t rows, int64_t units, cudaStream_t stream, Args... args) {
  const RowCfg cfg = row_cfg(units, kBlock);
  const dim3 block(cfg.tx, cfg.ty);
  const unsigned grid = grid_for((rows + cfg.ty - 1) / cfg.ty);
  kernel<<<grid, block, 0, stream>>>(args...);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t>
void launch_forward(const at::Tensor& h, const at::Tensor& lam, const at::Tensor& partner, at::Tensor& out,
                    bool per_token, cudaStream_t stream) {
  using A = acc_t<scalar_t>;
  constexpr int V = vec16<scalar_t>();
  const int64_t B = h.size(0), T = h.size(1), D = h.size(2);
  const bool vec = D % V == 0 && aligned16(h.data_ptr()) && aligned16(out.data_ptr());
  const scalar_t* hp = h.const_data_ptr<scalar_t>();
  const A* lp = lam.const_data_ptr<A>();
  const int64_t* pp = partner.const_data_ptr<int64_t>();
  scalar_t* op = out.mutable_data_ptr<scalar_t>();

  if (vec) {
    const PlanOverride& ov = plan_for<scalar_t>();
    if (ov.fwd() && launch_forward_override<scalar_t, V>(ov, hp, lp, pp, op, B, T, D, per_token, stream)) return;
    TilePlan plan;
    if (plan_tiles<scalar_t, V>(B, D / V, kFwdRowsPerThread, plan)) {
      auto kernel = cmix_forward_tile_kernel<scalar_t, V, kFwdRowsPerThread, 1, fwd_min_blocks(kFwdRowsPerThread, 1)>;
      const int64_t resident = resident_blocks(kernel, plan.threads, plan.smem);
      int64_t grid = 0;
      run_forward_tiles<scalar_t>(kernel, plan, resident, hp, lp, pp, op, B, T, D, per_token, stream, grid);
      if (ov.verbose) {
        print_plan_once(plan_line<scalar_t>("forward", B, T, D, plan, 1, kFwdRowsPerThread,
                                            fwd_min_blocks(kFwdRowsPerThread, 1), static_cast<int>(resident / sm_count()),
                                            grid, T * plan.chunks, 0, "default"));
      }
      return;
    }
  }

  auto kernel = vec ? cmix_forward_kernel<scalar_t, V> : cmix_forward_kernel<scalar_t, 1>;
  launch_rows(kernel, B * T, vec ? D / V : D, stream, hp, lp, pp, op, B, T, D, per_token);
}

// The backward tile launch(es). One unit per token position (grad_lam reduced in the block, one launch)
// unless the T units fill the resident blocks badly (fill = units / (waves * resident) < threshold, 3/4
// by default: few or ragged waves); then the chunks of a token are split over S blocks (the smallest S
// that fills to the threshold, else the best fill) and a second tiny kernel sums the S partial dot
// products. split > 0 (CAT_FAST_CMIX_PLAN bwd_split) sets S directly (capped to the chunks).
template <typename scalar_t>
void run_backward_tiles(BwdTileKernel<scalar_t> kernel, const TilePlan& plan, int64_t resident, double threshold,
                        int split, const scalar_t* gp, const scalar_t* hp, const acc_t<scalar_t>* lp,
                        const int64_t* pp, scalar_t* ghp, acc_t<scalar_t>* glp, const at::Tensor& grad_lam,
                        int64_t B, int64_t T, int64_t D, bool per_token, cudaStream_t stream, int64_t& grid_out,
                        int64_t& S_out, int stages = 1) {
  using A = acc_t<scalar_t>;
  const size_t smem = 2 * stages * plan.smem;  // grad tile + h tile, per stage
  auto fill = [&](int64_t s) {
    const int64_t units = T * s;
    return double(units) / double((units + resident - 1) / resident * resident);
  };
  int64_t S = 1;
  if (split > 0) {
    S = split < plan.chunks ? split : plan.chunks;
  } else if (fill(1) < threshold) {
    double best = fill(1);
    for (int64_t s = 2; s <= plan.chunks; ++s) {
      const double f = fill(s);
      if (f > best) {
        best = f;
        S = s;
      }
      if (f >= threshold) break;
    }
  }
  const int64_t units = T * S;
  const unsigned grid = grid_for(units < resident ? units : resident);
  at::Tensor ws;
  A* lam_out = glp;
  if (S > 1) {
    ws = at::empty({S, B, T}, grad_lam.options());
    lam_out = ws.mutable_data_ptr<A>();
  }
  kernel<<<grid, plan.threads, smem, stream>>>(gp, hp, lp, pp, ghp, lam_out, static_cast<int>(B), T, D, per_token,
                                                plan.w_log2, plan.chunks, static_cast<int>(S));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (S > 1) {
    const int64_t n = B * T;
    cmix_lam_split_sum_kernel<A><<<grid_for((n + 255) / 256), 256, 0, stream>>>(lam_out, glp, n,
                                                                                 static_cast<int>(S));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  grid_out = grid;
  S_out = S;
}

constexpr double kBwdFillThreshold = 0.75;

// The backward tile launch under CAT_FAST_CMIX_PLAN; false (nothing launched) where it does not apply.
template <typename scalar_t, int V>
bool launch_backward_override(const PlanOverride& ov, const scalar_t* gp, const scalar_t* hp,
                              const acc_t<scalar_t>* lp, const int64_t* pp, scalar_t* ghp, acc_t<scalar_t>* glp,
                              const at::Tensor& grad_lam, int64_t B, int64_t T, int64_t D, bool per_token,
                              cudaStream_t stream) {
  const TileOverride t{"backward", "bwd", ov.bwd_w, ov.bwd_rows ? ov.bwd_rows : kBwdRowsPerThread,
                       ov.bwd_packs ? ov.bwd_packs : 1, ov.bwd_bps, ov.bwd_async == 1};
  const int stages = t.async ? 2 : 1;  // shared stages of (grad tile, h tile)
  const int M_default = t.async ? kBwdAsyncMinBlocks : bwd_default_min_blocks(t.P, t.K);
  int M = ov.bwd_minb ? ov.bwd_minb : M_default;
  std::string minb_note;
  auto kernel_for = [&](int m) {
    return t.async ? backward_tile_async_kernel_for<scalar_t, V>(t.P, t.K, m)
                   : backward_tile_kernel_for<scalar_t, V>(t.P, t.K, m);
  };
  auto kernel = kernel_for(M);
  if (kernel == nullptr && ov.bwd_minb) {
    M = M_default;
    kernel = kernel_for(M);
    minb_note = ", bwd_minb ignored: not instantiated";
  }
  TilePlan plan;
  int per_sm = 0;
  if (!fit_override_tiles<scalar_t, V>(t, ov.verbose, kernel, 2 * stages, B, T, D, plan, per_sm)) return false;
  const double threshold = ov.fill >= 0 ? ov.fill : kBwdFillThreshold;
  int64_t grid = 0, S = 1;
  run_backward_tiles<scalar_t>(kernel, plan, int64_t(per_sm) * sm_count(), threshold, ov.bwd_split, gp, hp, lp, pp,
                               ghp, glp, grad_lam, B, T, D, per_token, stream, grid, S, stages);
  if (ov.verbose) {
    print_plan_once(plan_line<scalar_t>("backward", B, T, D, plan, 2 * stages, t.P, M, per_sm, grid, T * S, S,
                                        override_source(t, plan, minb_note)));
  }
  return true;
}

template <typename scalar_t>
void launch_backward(const at::Tensor& grad, const at::Tensor& h, const at::Tensor& lam, const at::Tensor& partner,
                     at::Tensor& grad_h, at::Tensor& grad_lam, bool per_token, cudaStream_t stream) {
  using A = acc_t<scalar_t>;
  constexpr int V = vec16<scalar_t>();
  const int64_t B = h.size(0), T = h.size(1), D = h.size(2);
  const bool vec =
      D % V == 0 && aligned16(h.data_ptr()) && aligned16(grad.data_ptr()) && aligned16(grad_h.data_ptr());
  const scalar_t* gp = grad.const_data_ptr<scalar_t>();
  const scalar_t* hp = h.const_data_ptr<scalar_t>();
  const A* lp = lam.const_data_ptr<A>();
  const int64_t* pp = partner.const_data_ptr<int64_t>();
  scalar_t* ghp = grad_h.mutable_data_ptr<scalar_t>();
  A* glp = grad_lam.mutable_data_ptr<A>();

  if (vec) {
    const PlanOverride& ov = plan_for<scalar_t>();
    if (ov.bwd() &&
        launch_backward_override<scalar_t, V>(ov, gp, hp, lp, pp, ghp, glp, grad_lam, B, T, D, per_token, stream)) {
      return;
    }
    TilePlan plan;
    if (plan_tiles<scalar_t, V>(B, D / V, kBwdRowsPerThread, plan)) {
      constexpr int M = bwd_default_min_blocks(kBwdRowsPerThread, 1);
      auto kernel = cmix_backward_tile_kernel<scalar_t, V, kBwdRowsPerThread, 1, M>;
      const int64_t resident = resident_blocks(kernel, plan.threads, 2 * plan.smem);
      int64_t grid = 0, S = 1;
      run_backward_tiles<scalar_t>(kernel, plan, resident, kBwdFillThreshold, 0, gp, hp, lp, pp, ghp, glp, grad_lam,
                                   B, T, D, per_token, stream, grid, S);
      if (ov.verbose) {
        print_plan_once(plan_line<scalar_t>("backward", B, T, D, plan, 2, kBwdRowsPerThread, M,
                                            static_cast<int>(resident / sm_count()), grid, T * S, S, "default"));
      }
      return;
    }
  }

  auto kernel = vec ? cmix_backward_kernel<scalar_t, V> : cmix_backward_kernel<scalar_t, 1>;
  launch_rows(kernel, B * T, vec ? D / V : D, stream, gp, hp, lp, pp, ghp, glp, B, T, D, per_token);
}

void check_common(const char* op, const at::Tensor& h, const at::Tensor& lam, const at::Tensor& partner) {
  TORCH_CHECK(h.is_cuda() && lam.is_cuda() && partner.is_cuda(), op, ": all tensors must be CUDA tensors");
  TORCH_CHECK(lam.device() == h.device() && partner.device() == h.device(), op, ": tensors on different devices");
  TORCH_CHECK(h.dim() == 3, op, ": h must have shape [B,T,D], got ", h.sizes());
  const int64_t B = h.size(0), T = h.size(1);
  TORCH_CHECK((lam.dim() == 1 && lam.size(0) == B) || (lam.dim() == 2 && lam.size(0) == B && lam.size(1) == T),
              op, ": lam must have shape [B] or [B,T], got ", lam.sizes());
  TORCH_CHECK(lam.scalar_type() == acc_scalar_type(h.scalar_type()), op, ": lam must have the accumulation dtype ",
              acc_scalar_type(h.scalar_type()), ", got ", lam.scalar_type());
  TORCH_CHECK(partner.scalar_type() == at::kLong && partner.dim() == 1 && partner.size(0) == B, op,
              ": partner must be int64 of shape [B]");
  TORCH_CHECK(h.is_contiguous() && lam.is_contiguous() && partner.is_contiguous(), op,
              ": inputs must be contiguous");
  TORCH_CHECK(B <= INT32_MAX, op, ": batch too large");
}

at::Tensor cmix_forward(const at::Tensor& h, const at::Tensor& lam, const at::Tensor& partner) {
  check_common("cmix_forward", h, lam, partner);
  const c10::cuda::CUDAGuard guard(h.device());
  auto out = at::empty(h.sizes(), h.options());
  const int64_t B = h.size(0), T = h.size(1), D = h.size(2);
  if (out.numel() == 0) return out;
  const bool per_token = lam.dim() == 2;
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, h.scalar_type(), "cmix_forward_cuda", [&] {
    launch_forward<scalar_t>(h, lam, partner, out, per_token, stream);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> cmix_backward(const at::Tensor& grad, const at::Tensor& h, const at::Tensor& lam,
                                                 const at::Tensor& partner) {
  check_common("cmix_backward", h, lam, partner);
  TORCH_CHECK(grad.is_cuda() && grad.device() == h.device(), "cmix_backward: grad must be on the device of h");
  TORCH_CHECK(grad.sizes() == h.sizes(), "cmix_backward: grad must have the shape of h");
  TORCH_CHECK(grad.scalar_type() == h.scalar_type(), "cmix_backward: grad must have the dtype of h");
  TORCH_CHECK(grad.is_contiguous(), "cmix_backward: grad must be contiguous");
  const c10::cuda::CUDAGuard guard(h.device());
  const int64_t B = h.size(0), T = h.size(1), D = h.size(2);
  auto grad_h = at::empty(h.sizes(), h.options());
  auto grad_lam = at::empty({B, T}, h.options().dtype(acc_scalar_type(h.scalar_type())));
  if (B * T == 0) return {grad_h, grad_lam};
  const bool per_token = lam.dim() == 2;
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, h.scalar_type(), "cmix_backward_cuda", [&] {
    launch_backward<scalar_t>(grad, h, lam, partner, grad_h, grad_lam, per_token, stream);
  });
  return {grad_h, grad_lam};
}

}  // namespace
}  // namespace cuda
}  // namespace cat_fast

TORCH_LIBRARY_IMPL(cat_fast, CUDA, m) {
  m.impl("cmix_forward", &cat_fast::cuda::cmix_forward);
  m.impl("cmix_backward", &cat_fast::cuda::cmix_backward);
}
