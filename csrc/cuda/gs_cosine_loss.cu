// gs_cosine_loss primitives (docs/KERNELS.md "gs_cosine_loss primitives").
// One row slot (tx threads, see common.cuh) per row of x / y, 16-byte packs when K allows.
//   gs_row_dots:    out[i] = (x_i.y_i, x_i.x_i, y_i.y_i), reduced in a fixed order inside the slot.
//   gs_row_combine: u_i = c0 x_i + c1 y_i, v_i = c2 x_i + c3 y_i, one pass (read 2 rows, write 2).
// Fewer rows than 2 per SM, each >= 2048 packs: rows cut into runs, one block per (row, run); gs_row_dots then
// writes per-run partials and a second small kernel adds them per row in run order (2 launches).
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <ATen/ops/empty.h>

#include "checks/gs_cosine_loss.h"
#include "common.cuh"

namespace cat_fast {
namespace cuda {
namespace {

constexpr int kBlock = 256;

// Adds this thread's share of (x.y, x.x, y.y) over packs [begin, end) of one row to acc.
template <typename scalar_t, int V>
__device__ __forceinline__ void add_row_dots(const scalar_t* __restrict__ xr, const scalar_t* __restrict__ yr,
                                             int64_t begin, int64_t end, Vals<acc_t<scalar_t>, 3>& acc) {
  using A = acc_t<scalar_t>;
  for (int64_t j = begin + threadIdx.x; j < end; j += blockDim.x) {
    A a[V], b[V];
    load_acc<scalar_t, V>(xr, j, a);
    load_acc<scalar_t, V>(yr, j, b);
#pragma unroll
    for (int e = 0; e < V; ++e) {
      acc.v[0] += a[e] * b[e];
      acc.v[1] += a[e] * a[e];
      acc.v[2] += b[e] * b[e];
    }
  }
}

// This thread's share of packs [begin, end) of one row: u = c[0] x + c[1] y, v = c[2] x + c[3] y.
template <typename scalar_t, int V>
__device__ __forceinline__ void combine_row(const scalar_t* __restrict__ xr, const scalar_t* __restrict__ yr,
                                            const acc_t<scalar_t>* __restrict__ c, scalar_t* __restrict__ ur,
                                            scalar_t* __restrict__ vr, int64_t begin, int64_t end) {
  using A = acc_t<scalar_t>;
  const A c0 = c[0], c1 = c[1], c2 = c[2], c3 = c[3];
  for (int64_t j = begin + threadIdx.x; j < end; j += blockDim.x) {
    A a[V], b[V], ou[V], ov[V];
    load_acc<scalar_t, V>(xr, j, a);
    load_acc<scalar_t, V>(yr, j, b);
#pragma unroll
    for (int e = 0; e < V; ++e) {
      ou[e] = c0 * a[e] + c1 * b[e];
      ov[e] = c2 * a[e] + c3 * b[e];
    }
    store_acc<scalar_t, V>(ur, j, ou);
    store_acc<scalar_t, V>(vr, j, ov);
  }
}

template <typename scalar_t, int V>
__global__ void __launch_bounds__(kBlock) gs_row_dots_kernel(const scalar_t* __restrict__ x,
                                                             const scalar_t* __restrict__ y,
                                                             acc_t<scalar_t>* __restrict__ out, int64_t N, int64_t K) {
  using A = acc_t<scalar_t>;
  __shared__ Vals<A, 3> s_red[kBlock / 32];
  const int64_t groups = (N + blockDim.y - 1) / blockDim.y;
  const int64_t Kv = K / V;
  for (int64_t g = blockIdx.x; g < groups; g += gridDim.x) {  // uniform trip count in the block
    const int64_t r = g * blockDim.y + threadIdx.y;
    const bool valid = r < N;
    Vals<A, 3> acc = {{A(0), A(0), A(0)}};
    if (valid) add_row_dots<scalar_t, V>(x + r * K, y + r * K, 0, Kv, acc);
    acc = group_reduce(acc, SumOp{}, s_red);
    if (valid && threadIdx.x == 0) {
      A* o = out + r * 3;
      o[0] = acc.v[0];
      o[1] = acc.v[1];
      o[2] = acc.v[2];
    }
  }
}

template <typename scalar_t, int V>
__global__ void __launch_bounds__(kBlock) gs_row_combine_kernel(const scalar_t* __restrict__ x,
                                                                const scalar_t* __restrict__ y,
                                                                const acc_t<scalar_t>* __restrict__ coef,
                                                                scalar_t* __restrict__ u, scalar_t* __restrict__ v,
                                                                int64_t N, int64_t K) {
  const int64_t groups = (N + blockDim.y - 1) / blockDim.y;
  const int64_t Kv = K / V;
  for (int64_t g = blockIdx.x; g < groups; g += gridDim.x) {
    const int64_t r = g * blockDim.y + threadIdx.y;
    if (r >= N) continue;
    const int64_t off = r * K;
    combine_row<scalar_t, V>(x + off, y + off, coef + r * 4, u + off, v + off, 0, Kv);
  }
}

// Few long rows (token-level GS: N = B rows of T*D): one row per block would leave most SMs idle, so each
// row is cut into `chunks` runs of `chunk` packs, one block (256 threads) per (row, run).
template <typename scalar_t, int V>
__global__ void __launch_bounds__(kBlock) gs_row_dots_chunk_kernel(const scalar_t* __restrict__ x,
                                                                   const scalar_t* __restrict__ y,
                                                                   acc_t<scalar_t>* __restrict__ partial, int64_t K,
                                                                   int64_t chunks, int64_t chunk) {
  using A = acc_t<scalar_t>;
  __shared__ Vals<A, 3> s_red[kBlock / 32];
  const int64_t unit = blockIdx.x;
  const int64_t r = unit / chunks;
  const int64_t Kv = K / V;
  const int64_t begin = (unit - r * chunks) * chunk;
  const int64_t end = begin + chunk < Kv ? begin + chunk : Kv;
  Vals<A, 3> acc = {{A(0), A(0), A(0)}};
  add_row_dots<scalar_t, V>(x + r * K, y + r * K, begin, end, acc);
  acc = group_reduce(acc, SumOp{}, s_red);
  if (threadIdx.x == 0) {
    A* o = partial + unit * 3;
    o[0] = acc.v[0];
    o[1] = acc.v[1];
    o[2] = acc.v[2];
  }
}

// out[r, k] = sum over the runs of row r, in run order (deterministic).
template <typename A>
__global__ void gs_row_dots_sum_kernel(const A* __restrict__ partial, A* __restrict__ out, int64_t N, int64_t chunks) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= N * 3) return;
  const int64_t r = i / 3, k = i - r * 3;
  A total = A(0);
  for (int64_t c = 0; c < chunks; ++c) total += partial[(r * chunks + c) * 3 + k];
  out[i] = total;
}

template <typename scalar_t, int V>
__global__ void __launch_bounds__(kBlock) gs_row_combine_chunk_kernel(const scalar_t* __restrict__ x,
                                                                      const scalar_t* __restrict__ y,
                                                                      const acc_t<scalar_t>* __restrict__ coef,
                                                                      scalar_t* __restrict__ u, scalar_t* __restrict__ v,
                                                                      int64_t K, int64_t chunks, int64_t chunk) {
  const int64_t unit = blockIdx.x;
  const int64_t r = unit / chunks;
  const int64_t Kv = K / V;
  const int64_t begin = (unit - r * chunks) * chunk;
  const int64_t end = begin + chunk < Kv ? begin + chunk : Kv;
  const int64_t off = r * K;
  combine_row<scalar_t, V>(x + off, y + off, coef + r * 4, u + off, v + off, begin, end);
}

// Runs per row for the chunked kernels: 1 (the row-slot kernels) unless the rows are too few to fill the device
// (< 2 per SM) and long (>= 2048 packs); then about 4 blocks per SM in total, each run >= 1024 packs.
struct Chunking {
  int64_t chunks = 1;
  int64_t chunk = 0;  // packs per run
};

inline Chunking chunking(int64_t N, int64_t units) {
  Chunking c;
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  if (N <= 0 || N >= 2 * sms || units < 2048) return c;
  int64_t chunks = (4 * sms + N - 1) / N;
  const int64_t most = (units + 1023) / 1024;
  chunks = chunks < most ? chunks : most;
  if (chunks <= 1) return c;
  c.chunk = (units + chunks - 1) / chunks;
  c.chunks = (units + c.chunk - 1) / c.chunk;
  return c;
}

template <typename scalar_t>
void launch_dots(const at::Tensor& x, const at::Tensor& y, at::Tensor& out, cudaStream_t stream) {
  using A = acc_t<scalar_t>;
  constexpr int V = vec16<scalar_t>();
  const int64_t N = x.size(0), K = x.size(1);
  const bool vec = K % V == 0 && aligned16(x.data_ptr()) && aligned16(y.data_ptr());
  const RowCfg cfg = row_cfg(vec ? K / V : K, kBlock);
  const dim3 block(cfg.tx, cfg.ty);
  const unsigned grid = grid_for((N + cfg.ty - 1) / cfg.ty);
  const scalar_t* xp = x.const_data_ptr<scalar_t>();
  const scalar_t* yp = y.const_data_ptr<scalar_t>();
  A* op = out.mutable_data_ptr<A>();
  const Chunking ch = chunking(N, vec ? K / V : K);
  if (ch.chunks > 1) {
    at::Tensor partial = at::empty({N * ch.chunks, 3}, out.options());
    A* pp = partial.mutable_data_ptr<A>();
    const unsigned units = static_cast<unsigned>(N * ch.chunks);
    if (vec) {
      gs_row_dots_chunk_kernel<scalar_t, V><<<units, kBlock, 0, stream>>>(xp, yp, pp, K, ch.chunks, ch.chunk);
    } else {
      gs_row_dots_chunk_kernel<scalar_t, 1><<<units, kBlock, 0, stream>>>(xp, yp, pp, K, ch.chunks, ch.chunk);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const unsigned sum_grid = static_cast<unsigned>((N * 3 + kBlock - 1) / kBlock);
    gs_row_dots_sum_kernel<A><<<sum_grid, kBlock, 0, stream>>>(pp, op, N, ch.chunks);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  if (vec) {
    gs_row_dots_kernel<scalar_t, V><<<grid, block, 0, stream>>>(xp, yp, op, N, K);
  } else {
    gs_row_dots_kernel<scalar_t, 1><<<grid, block, 0, stream>>>(xp, yp, op, N, K);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t>
void launch_combine(const at::Tensor& x, const at::Tensor& y, const at::Tensor& coef, at::Tensor& u, at::Tensor& v,
                    cudaStream_t stream) {
  using A = acc_t<scalar_t>;
  constexpr int V = vec16<scalar_t>();
  const int64_t N = x.size(0), K = x.size(1);
  const bool vec = K % V == 0 && aligned16(x.data_ptr()) && aligned16(y.data_ptr()) && aligned16(u.data_ptr()) &&
                   aligned16(v.data_ptr());
  const RowCfg cfg = row_cfg(vec ? K / V : K, kBlock);
  const dim3 block(cfg.tx, cfg.ty);
  const unsigned grid = grid_for((N + cfg.ty - 1) / cfg.ty);
  const scalar_t* xp = x.const_data_ptr<scalar_t>();
  const scalar_t* yp = y.const_data_ptr<scalar_t>();
  const A* cp = coef.const_data_ptr<A>();
  scalar_t* up = u.mutable_data_ptr<scalar_t>();
  scalar_t* vp = v.mutable_data_ptr<scalar_t>();
  const Chunking ch = chunking(N, vec ? K / V : K);
  if (ch.chunks > 1) {
    const unsigned units = static_cast<unsigned>(N * ch.chunks);
    if (vec) {
      gs_row_combine_chunk_kernel<scalar_t, V><<<units, kBlock, 0, stream>>>(xp, yp, cp, up, vp, K, ch.chunks, ch.chunk);
    } else {
      gs_row_combine_chunk_kernel<scalar_t, 1><<<units, kBlock, 0, stream>>>(xp, yp, cp, up, vp, K, ch.chunks, ch.chunk);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  if (vec) {
    gs_row_combine_kernel<scalar_t, V><<<grid, block, 0, stream>>>(xp, yp, cp, up, vp, N, K);
  } else {
    gs_row_combine_kernel<scalar_t, 1><<<grid, block, 0, stream>>>(xp, yp, cp, up, vp, N, K);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor gs_row_dots(const at::Tensor& x, const at::Tensor& y) {
  checks::gs_cosine_loss("gs_row_dots", at::kCUDA, x, y);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t N = x.size(0);
  at::Tensor out = at::empty({N, 3}, x.options().dtype(acc_scalar_type(x.scalar_type())));
  if (N == 0) return out;
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "gs_row_dots_cuda",
                                  [&] { launch_dots<scalar_t>(x, y, out, stream); });
  return out;
}

std::tuple<at::Tensor, at::Tensor> gs_row_combine(const at::Tensor& x, const at::Tensor& y, const at::Tensor& coef) {
  checks::gs_cosine_loss("gs_row_combine", at::kCUDA, x, y);
  checks::gs_row_combine_coef("gs_row_combine", at::kCUDA, coef, x);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor u = at::empty(x.sizes(), x.options());
  at::Tensor v = at::empty(x.sizes(), x.options());
  if (u.numel() == 0) return {u, v};
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "gs_row_combine_cuda",
                                  [&] { launch_combine<scalar_t>(x, y, coef, u, v, stream); });
  return {u, v};
}

}  // namespace
}  // namespace cuda
}  // namespace cat_fast

TORCH_LIBRARY_IMPL(cat_fast, CUDA, m) {
  m.impl("gs_row_dots", &cat_fast::cuda::gs_row_dots);
  m.impl("gs_row_combine", &cat_fast::cuda::gs_row_combine);
}
