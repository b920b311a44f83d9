// CMIX forward kernels (the row kernel, the tile kernel and its variants) and their launch; design:
// csrc/cuda/cmix.cu, shared helpers: cmix_common.cuh.
#include "cmix_common.cuh"

namespace cat_fast {
namespace cuda {
namespace cmix_impl {

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

// ---------------------------------------------------------------- tile kernel variants
template <typename scalar_t>
using FwdTileKernel = void (*)(const scalar_t*, const acc_t<scalar_t>*, const int64_t*, scalar_t*, int, int64_t,
                               int64_t, bool, int, int64_t, int64_t);

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

// The cp.async (ASYNC) variants: float / bfloat16 / half only, K = 1, P = 4 (default rows) or 8;
// forward MINB as fwd_min_blocks. nullptr where not instantiated.
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

void forward(const at::Tensor& h, const at::Tensor& lam, const at::Tensor& partner, at::Tensor& out, bool per_token,
             cudaStream_t stream) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, h.scalar_type(), "cmix_forward_cuda", [&] {
    launch_forward<scalar_t>(h, lam, partner, out, per_token, stream);
  });
}

}  // namespace cmix_impl
}  // namespace cuda
}  // namespace cat_fast
