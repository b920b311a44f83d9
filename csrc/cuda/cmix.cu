// CMIX forward / backward (docs/KERNELS.md "cmix").
//
// Both kernels walk the B*T rows in (t, b) order (b fastest): the blocks in flight at any moment
// cover a few token positions for the whole batch, so the partner rows h[partner[i], t, :] and
// grad[i, t, :] they re-read are L2 hits and DRAM sees each input row about once.
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <ATen/ops/empty.h>

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

template <typename scalar_t>
void launch_forward(const at::Tensor& h, const at::Tensor& lam, const at::Tensor& partner, at::Tensor& out,
                    bool per_token, cudaStream_t stream) {
  using A = acc_t<scalar_t>;
  constexpr int V = vec16<scalar_t>();
  const int64_t B = h.size(0), T = h.size(1), D = h.size(2);
  const bool vec = D % V == 0 && aligned16(h.data_ptr()) && aligned16(out.data_ptr());
  const RowCfg cfg = row_cfg(vec ? D / V : D, kBlock);
  const dim3 block(cfg.tx, cfg.ty);
  const unsigned grid = grid_for((B * T + cfg.ty - 1) / cfg.ty);
  const scalar_t* hp = h.const_data_ptr<scalar_t>();
  const A* lp = lam.const_data_ptr<A>();
  const int64_t* pp = partner.const_data_ptr<int64_t>();
  scalar_t* op = out.mutable_data_ptr<scalar_t>();
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
  const RowCfg cfg = row_cfg(vec ? D / V : D, kBlock);
  const dim3 block(cfg.tx, cfg.ty);
  const unsigned grid = grid_for((B * T + cfg.ty - 1) / cfg.ty);
  const scalar_t* gp = grad.const_data_ptr<scalar_t>();
  const scalar_t* hp = h.const_data_ptr<scalar_t>();
  const A* lp = lam.const_data_ptr<A>();
  const int64_t* pp = partner.const_data_ptr<int64_t>();
  scalar_t* ghp = grad_h.mutable_data_ptr<scalar_t>();
  A* glp = grad_lam.mutable_data_ptr<A>();
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
