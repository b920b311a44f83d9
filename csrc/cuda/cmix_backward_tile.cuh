// The CMIX backward tile kernel (design: csrc/cuda/cmix.cu); private to cmix_backward.cu, which instantiates and
// launches it.
#pragma once

#include "cmix_common.cuh"

namespace cat_fast {
namespace cuda {
namespace cmix_impl {

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

}  // namespace cmix_impl
}  // namespace cuda
}  // namespace cat_fast
