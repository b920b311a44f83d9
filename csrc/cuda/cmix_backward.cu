// CMIX backward kernels (the row kernel here, the tile kernel in cmix_backward_tile.cuh, its variants, the split
// sum) and their launch; design: csrc/cuda/cmix.cu, shared helpers: cmix_common.cuh.
#include "cmix_backward_tile.cuh"
#include "cmix_common.cuh"

namespace cat_fast {
namespace cuda {
namespace cmix_impl {

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

// ---------------------------------------------------------------- tile kernel variants
template <typename scalar_t>
using BwdTileKernel = void (*)(const scalar_t*, const scalar_t*, const acc_t<scalar_t>*, const int64_t*,
                               scalar_t*, acc_t<scalar_t>*, int, int64_t, int64_t, bool, int, int64_t, int);

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
// backward MINB = 2 (kBwdAsyncMinBlocks; also 3 at P = 4: 3 x (2 x 2 x 16 KiB + 6 KiB) of shared memory
// fits an sm_90 SM at B * W = 1024). nullptr where not instantiated.
constexpr int kBwdAsyncMinBlocks = 2;

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

// ================================================================ launchers
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

void backward(const at::Tensor& grad, const at::Tensor& h, const at::Tensor& lam, const at::Tensor& partner,
              at::Tensor& grad_h, at::Tensor& grad_lam, bool per_token, cudaStream_t stream) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, h.scalar_type(), "cmix_backward_cuda", [&] {
    launch_backward<scalar_t>(grad, h, lam, partner, grad_h, grad_lam, per_token, stream);
  });
}

}  // namespace cmix_impl
}  // namespace cuda
}  // namespace cat_fast
