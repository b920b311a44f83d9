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
// registers before the current tile is computed from shared memory. Each thread owns a fixed pack
// column j of the chunk and the rows b = r, r + R, r + 2R, ... (r = thread / W, R = threads / W).
//   forward:  tile sequence u = (t, c), c fastest, grid-strided over blocks.
//   backward: a unit is (t, split s): the chunks [c0(s), c1(s)) of token t, walked in order by one
//             block, so grad_lam[b,t] (a dot product over d) is reduced inside the block: per thread
//             over its packs in chunk order, then over the W lanes of the row by a fixed xor
//             butterfly. One launch when T is large enough to fill the GPU (S = 1 split). For small T
//             the d chunks are split over S blocks, each writing its partial dot products to a
//             [S,B,T] workspace that a second tiny kernel sums in split order (2 launches).
//   The matches {i : partner[i] == k} of every row k are built once per block, in increasing i
//   (the summation order of grad_h), as a CSR list in shared memory.
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

#include <map>
#include <mutex>
#include <tuple>

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
constexpr int kFwdRowsPerThread = 8;  // forward tile: B * W <= 8 * 256 packs (32 KiB of shared memory)
constexpr int kBwdRowsPerThread = 4;  // backward tile: 2 x B * W <= 2 x 4 * 256 packs (32 KiB)

template <typename scalar_t, int V>
using PackT = Pack<scalar_t, V>;

template <typename scalar_t, int V>
__device__ __forceinline__ void widen(const PackT<scalar_t, V>& p, acc_t<scalar_t> (&out)[V]) {
#pragma unroll
  for (int e = 0; e < V; ++e) out[e] = static_cast<acc_t<scalar_t>>(p.v[e]);
}

template <typename scalar_t, int V>
__device__ __forceinline__ PackT<scalar_t, V> narrow(const acc_t<scalar_t> (&in)[V]) {
  PackT<scalar_t, V> p;
#pragma unroll
  for (int e = 0; e < V; ++e) p.v[e] = static_cast<scalar_t>(in[e]);
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

// out[i,t,:] = lam_it * h[partner[i],t,:] + (1 - lam_it) * h[i,t,:], tile by tile.
// blockDim.x = threads = a multiple of 32 and of W = 1 << w_log2; shared memory B * W packs.
// (64 registers, no spills at 4 blocks of 256 per SM: up to 4 x 32 KiB of loads in flight per SM.)
template <typename scalar_t, int V, int P>
__global__ void __launch_bounds__(kTileThreads, 4) cmix_forward_tile_kernel(
    const scalar_t* __restrict__ h, const acc_t<scalar_t>* __restrict__ lam, const int64_t* __restrict__ partner,
    scalar_t* __restrict__ out, int B, int64_t T, int64_t D, bool lam_per_token, int w_log2, int64_t chunks,
    int64_t tiles) {
  using A = acc_t<scalar_t>;
  using Pk = PackT<scalar_t, V>;
  __shared__ int s_part[kTileMaxRows];
  __shared__ A s_lam[kTileMaxRows];
  Pk* s_h = reinterpret_cast<Pk*>(cmix_tile_smem);

  const int tid = threadIdx.x;
  const int W = 1 << w_log2;
  const int j = tid & (W - 1);        // pack column of the chunk owned by this thread
  const int r = tid >> w_log2;        // first row owned by this thread
  const int R = blockDim.x >> w_log2; // row stride
  const int64_t Dv = D / V;
  const int64_t row_step = int64_t(R) * T * Dv;  // packs between rows b and b + R of one token
  const Pk* __restrict__ hv = reinterpret_cast<const Pk*>(h);
  Pk* __restrict__ ov = reinterpret_cast<Pk*>(out);

  for (int k = tid; k < B; k += blockDim.x) {
    const int64_t p = partner[k];
    CAT_FAST_DEVICE_ASSERT(p >= 0 && p < B);
    s_part[k] = static_cast<int>(p);
  }

  int64_t u = blockIdx.x;  // grid <= tiles
  Pk regs[P];
  A lam_r = A(0);
  // Issues the loads of tile u: this thread's packs of h, and lam[tid, t] (blockDim.x >= B).
  auto load = [&](int64_t tile) {
    const int64_t t = tile / chunks;
    const int64_t jj = (tile - t * chunks) * W + j;
    if (jj < Dv) {
      const Pk* src = hv + (r * T + t) * Dv + jj;
#pragma unroll
      for (int q = 0; q < P; ++q) {
        if (r + q * R < B) regs[q] = src[q * row_step];
      }
    }
    if (tid < B) lam_r = lam[lam_per_token ? tid * T + t : tid];
  };
  load(u);

  while (true) {
    const int64_t t = u / chunks;
    const int64_t jj = (u - t * chunks) * W + j;
    const bool col_ok = jj < Dv;  // the same for every row of this thread (and for its partner rows)
    __syncthreads();              // the previous tile's readers are done with s_h / s_lam
    if (col_ok) {
#pragma unroll
      for (int q = 0; q < P; ++q) {
        if (r + q * R < B) s_h[tid + q * blockDim.x] = regs[q];  // = s_h[b * W + j], b = r + q * R
      }
    }
    if (tid < B) s_lam[tid] = lam_r;
    __syncthreads();

    const int64_t next = u + gridDim.x;
    if (next < tiles) load(next);  // in flight while this tile is computed and stored

    if (col_ok) {
      Pk* dst = ov + (r * T + t) * Dv + jj;
#pragma unroll
      for (int q = 0; q < P; ++q) {
        const int b = r + q * R;
        if (b < B) {
          const A l = s_lam[b];
          const A keep = A(1) - l;
          A a[V], x[V], c[V];
          widen<scalar_t, V>(lds_pack<scalar_t, V>(s_h, s_part[b] * W + j), a);
          widen<scalar_t, V>(lds_pack<scalar_t, V>(s_h, tid + q * blockDim.x), x);
#pragma unroll
          for (int e = 0; e < V; ++e) c[e] = l * a[e] + keep * x[e];
          dst[q * row_step] = narrow<scalar_t, V>(c);
        }
      }
    }
    if (next >= tiles) break;
    u = next;
  }
}

// Backward over units (t, s): chunks [c0(s), c1(s)) of token t with c0(s) = s * chunks / S.
//   grad_h[k,t,:] = (1 - lam_kt) grad[k,t,:] + sum_{i : partner[i]==k, i ascending} lam_it grad[i,t,:]
//   lam_out[s, k, t] = sum over the unit's d of (h[partner[k],t,d] - h[k,t,d]) grad[k,t,d]
// (lam_out is grad_lam itself when S == 1, else the [S,B,T] workspace of cmix_lam_split_sum_kernel.)
// Shared memory: grad tile then h tile, B * W packs each. (~105-127 registers, no spills: 2 blocks of
// 256 per SM, each with its next chunk's 32 KiB of loads in flight; 3 blocks per SM would spill.)
template <typename scalar_t, int V, int P>
__global__ void __launch_bounds__(kTileThreads, 2) cmix_backward_tile_kernel(
    const scalar_t* __restrict__ grad, const scalar_t* __restrict__ h, const acc_t<scalar_t>* __restrict__ lam,
    const int64_t* __restrict__ partner, scalar_t* __restrict__ grad_h, acc_t<scalar_t>* __restrict__ lam_out, int B,
    int64_t T, int64_t D, bool lam_per_token, int w_log2, int64_t chunks, int S) {
  using A = acc_t<scalar_t>;
  using Pk = PackT<scalar_t, V>;
  __shared__ int s_part[kTileMaxRows];
  __shared__ int s_fill[kTileMaxRows];     // match counts, then fill cursors
  __shared__ int s_off[kTileMaxRows + 1];  // CSR offsets of the matches of each row
  __shared__ int s_list[kTileMaxRows];     // matches, increasing i within each row
  __shared__ A s_lam[kTileMaxRows];
  const int tid = threadIdx.x;
  const int W = 1 << w_log2;
  const int j = tid & (W - 1);
  const int r = tid >> w_log2;
  const int R = blockDim.x >> w_log2;
  Pk* s_g = reinterpret_cast<Pk*>(cmix_tile_smem);
  Pk* s_h = s_g + B * W;
  const int64_t Dv = D / V;
  const int64_t units = T * S;
  const int64_t row_step = int64_t(R) * T * Dv;  // packs between rows b and b + R of one token
  const Pk* __restrict__ gv = reinterpret_cast<const Pk*>(grad);
  const Pk* __restrict__ hv = reinterpret_cast<const Pk*>(h);
  Pk* __restrict__ ghv = reinterpret_cast<Pk*>(grad_h);

  // ---- matches of every row, once per block (warp 0; B <= 256 so at most 8 rounds of 32).
  for (int k = tid; k < B; k += blockDim.x) {
    const int64_t p = partner[k];
    CAT_FAST_DEVICE_ASSERT(p >= 0 && p < B);
    s_part[k] = static_cast<int>(p);
    s_fill[k] = 0;
  }
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
    for (int k = k0; k < k1; ++k) {
      const int cnt = s_fill[k];
      s_off[k] = run;
      s_fill[k] = run;  // fill cursor
      run += cnt;
    }
    if (lane == 31) s_off[B] = incl;  // == B
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
  // (the first __syncthreads of the loop below publishes s_off / s_list)

  int64_t u = blockIdx.x;  // grid <= units
  int64_t t = u / S;
  int s = static_cast<int>(u - t * S);
  int64_t c = s * chunks / S;
  int64_t c_end = (s + 1) * chunks / S;

  Pk gr[P], hr[P];
  A lam_r = A(0);
  auto load = [&](int64_t tt, int64_t cc) {
    const int64_t jj = cc * W + j;
    if (jj < Dv) {
      const int64_t o = (r * T + tt) * Dv + jj;
#pragma unroll
      for (int q = 0; q < P; ++q) {
        if (r + q * R < B) {
          gr[q] = gv[o + q * row_step];
          hr[q] = hv[o + q * row_step];
        }
      }
    }
    if (tid < B) lam_r = lam[lam_per_token ? tid * T + tt : tid];
  };
  load(t, c);

  A gl[P];
#pragma unroll
  for (int q = 0; q < P; ++q) gl[q] = A(0);

  while (true) {
    const int64_t jj = c * W + j;
    const bool col_ok = jj < Dv;
    __syncthreads();  // the previous chunk's readers are done with the tiles / s_lam
    if (col_ok) {
#pragma unroll
      for (int q = 0; q < P; ++q) {
        if (r + q * R < B) {  // slot b * W + j, b = r + q * R
          s_g[tid + q * blockDim.x] = gr[q];
          s_h[tid + q * blockDim.x] = hr[q];
        }
      }
    }
    if (tid < B) s_lam[tid] = lam_r;
    __syncthreads();

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
    if (more) load(nt, nc);  // in flight while this chunk is computed and stored

    if (col_ok) {
      Pk* dst = ghv + (r * T + t) * Dv + jj;
#pragma unroll
      for (int q = 0; q < P; ++q) {
        const int b = r + q * R;
        if (b < B) {
          const A lk = s_lam[b];
          const A keep = A(1) - lk;
          A g0[V], a[V], x[V], acc[V];
          widen<scalar_t, V>(lds_pack<scalar_t, V>(s_g, tid + q * blockDim.x), g0);
          widen<scalar_t, V>(lds_pack<scalar_t, V>(s_h, s_part[b] * W + j), a);
          widen<scalar_t, V>(lds_pack<scalar_t, V>(s_h, tid + q * blockDim.x), x);
          A dot = A(0);
#pragma unroll
          for (int e = 0; e < V; ++e) {
            acc[e] = keep * g0[e];
            dot += (a[e] - x[e]) * g0[e];
          }
          gl[q] += dot;
          const int m1 = s_off[b + 1];
          for (int m = s_off[b]; m < m1; ++m) {
            const int i = s_list[m];
            const A li = s_lam[i];
            A gi[V];
            widen<scalar_t, V>(lds_pack<scalar_t, V>(s_g, i * W + j), gi);
#pragma unroll
            for (int e = 0; e < V; ++e) acc[e] += li * gi[e];
          }
          dst[q * row_step] = narrow<scalar_t, V>(acc);
        }
      }
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

// Tile geometry for a batch of B rows of Dv packs, rows_per_thread = P of the kernel.
struct TilePlan {
  int w_log2;      // W = 1 << w_log2 packs per row chunk (<= 32: one aligned lane segment of a warp)
  int threads;     // block size: a multiple of 32 and of W, >= B
  int64_t chunks;  // chunks per token position, ceil(Dv / W)
  size_t smem;     // bytes of one B x W pack tile
};

template <typename scalar_t, int V>
bool plan_tiles(int64_t B, int64_t Dv, int rows_per_thread, TilePlan& plan) {
  if (B < 1 || B > kTileMaxRows || Dv < 1) return false;
  int64_t w = 32;
  while (w > 1 && w / 2 >= Dv) w /= 2;  // no wider than the row
  while (w > 1 && B * w > int64_t(rows_per_thread) * kTileThreads) w /= 2;  // <= rows_per_thread rows a thread
  // a narrower chunk when the last one would leave more than 1/8 of the row's packs padding
  while (w > 4 && Dv % w != 0 && ((Dv + w - 1) / w * w - Dv) * 8 > Dv) w /= 2;
  const int64_t rows = B < kTileThreads / w ? B : kTileThreads / w;  // rows in flight per pass
  const int64_t threads = (rows * w + 31) / 32 * 32;                  // <= kTileThreads
  if (B > (threads / w) * rows_per_thread) return false;              // not reached for B <= kTileMaxRows
  int w_log2 = 0;
  while ((int64_t(1) << w_log2) < w) ++w_log2;
  plan.w_log2 = w_log2;
  plan.threads = static_cast<int>(threads);
  plan.chunks = (Dv + w - 1) / w;
  plan.smem = static_cast<size_t>(B * w) * sizeof(Pack<scalar_t, V>);
  return true;
}

// Blocks of `kernel` (threads, smem) resident on the whole (current) device at once; the occupancy
// query is cached per (kernel, device, threads, smem).
template <typename Kernel>
int64_t resident_blocks(Kernel kernel, int threads, size_t smem) {
  static std::mutex mutex;
  static std::map<std::tuple<const void*, int, int, size_t>, int64_t> cache;
  const int device = c10::cuda::current_device();
  const auto key = std::make_tuple(reinterpret_cast<const void*>(kernel), device, threads, smem);
  std::lock_guard<std::mutex> lock(mutex);
  const auto found = cache.find(key);
  if (found != cache.end()) return found->second;
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
  const int64_t resident =
      int64_t(per_sm > 0 ? per_sm : 1) * at::cuda::getDeviceProperties(device)->multiProcessorCount;
  cache.emplace(key, resident);
  return resident;
}

// ================================================================ launchers
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

  TilePlan plan;
  if (vec && plan_tiles<scalar_t, V>(B, D / V, kFwdRowsPerThread, plan)) {
    auto kernel = cmix_forward_tile_kernel<scalar_t, V, kFwdRowsPerThread>;
    const int64_t tiles = T * plan.chunks;
    const int64_t resident = resident_blocks(kernel, plan.threads, plan.smem);
    const unsigned grid = grid_for(tiles < resident ? tiles : resident);
    kernel<<<grid, plan.threads, plan.smem, stream>>>(hp, lp, pp, op, static_cast<int>(B), T, D, per_token,
                                                       plan.w_log2, plan.chunks, tiles);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }

  const RowCfg cfg = row_cfg(vec ? D / V : D, kBlock);
  const dim3 block(cfg.tx, cfg.ty);
  const unsigned grid = grid_for((B * T + cfg.ty - 1) / cfg.ty);
  if (vec) {
    cmix_forward_kernel<scalar_t, V><<<grid, block, 0, stream>>>(hp, lp, pp, op, B, T, D, per_token);
  } else {
    cmix_forward_kernel<scalar_t, 1><<<grid, block, 0, stream>>>(hp, lp, pp, op, B, T, D, per_token);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
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

  TilePlan plan;
  if (vec && plan_tiles<scalar_t, V>(B, D / V, kBwdRowsPerThread, plan)) {
    auto kernel = cmix_backward_tile_kernel<scalar_t, V, kBwdRowsPerThread>;
    const size_t smem = 2 * plan.smem;  // grad tile + h tile
    const int64_t resident = resident_blocks(kernel, plan.threads, smem);
    // One unit per token position (grad_lam reduced in the block, one launch) unless the T units
    // fill the resident blocks badly (fill = units / (waves * resident) < 3/4: few or ragged waves);
    // then the chunks of a token are split over S blocks (the smallest S that fills to 3/4, else the
    // best fill) and a second tiny kernel sums the S partial dot products.
    auto fill = [&](int64_t s) {
      const int64_t units = T * s;
      return double(units) / double((units + resident - 1) / resident * resident);
    };
    int64_t S = 1;
    if (fill(1) < 0.75) {
      double best = fill(1);
      for (int64_t s = 2; s <= plan.chunks; ++s) {
        const double f = fill(s);
        if (f > best) {
          best = f;
          S = s;
        }
        if (f >= 0.75) break;
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
    kernel<<<grid, plan.threads, smem, stream>>>(gp, hp, lp, pp, ghp, lam_out, static_cast<int>(B), T, D,
                                                  per_token, plan.w_log2, plan.chunks, static_cast<int>(S));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (S > 1) {
      const int64_t n = B * T;
      cmix_lam_split_sum_kernel<A><<<grid_for((n + 255) / 256), 256, 0, stream>>>(lam_out, glp, n,
                                                                                   static_cast<int>(S));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    return;
  }

  const RowCfg cfg = row_cfg(vec ? D / V : D, kBlock);
  const dim3 block(cfg.tx, cfg.ty);
  const unsigned grid = grid_for((B * T + cfg.ty - 1) / cfg.ty);
  if (vec) {
    cmix_backward_kernel<scalar_t, V><<<grid, block, 0, stream>>>(gp, hp, lp, pp, ghp, glp, B, T, D, per_token);
  } else {
    cmix_backward_kernel<scalar_t, 1><<<grid, block, 0, stream>>>(gp, hp, lp, pp, ghp, glp, B, T, D, per_token);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
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
