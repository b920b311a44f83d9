// In-place CAL ascent step on lambda (docs/KERNELS.md "cal_step_"). One launch per call.
// One row slot (tx threads, see common.cuh) per row of lam: [B,T] lam -> rows of T entries, the
// p-norm reduced inside the slot; [B] lam -> rows of one entry (tx = 1, 256 rows per block), n = |lam|.
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "checks/cal_step.h"
#include "common.cuh"

namespace cat_fast {
namespace cuda {
namespace {

constexpr int kBlock = 256;

template <typename A>
__device__ __forceinline__ A abs_pow(A x, A p) {
  const A a = x < A(0) ? -x : x;
  if (p == A(1)) return a;
  if (p == A(2)) return a * a;
  return a == A(0) ? A(0) : acc_pow(a, p);
}

template <typename A>
__global__ void __launch_bounds__(kBlock) cal_step_kernel(A* __restrict__ lam, const A* __restrict__ grad, int64_t B,
                                                          int64_t L, A lr, A p, A lo, A hi) {
  __shared__ A s_red[kBlock / 32];
  const int64_t groups = (B + blockDim.y - 1) / blockDim.y;
  for (int64_t g = blockIdx.x; g < groups; g += gridDim.x) {  // uniform trip count in the block
    const int64_t r = g * blockDim.y + threadIdx.y;
    const bool valid = r < B;
    A* row = lam + (valid ? r : 0) * L;
    const A* grow = grad + (valid ? r : 0) * L;
    A n;
    if (L == 1) {
      const A v = valid ? row[0] : A(0);
      n = v < A(0) ? -v : v;
    } else {
      A part = A(0);
      if (valid && p != A(1)) {  // p == 1 never needs the norm
        for (int64_t j = threadIdx.x; j < L; j += blockDim.x) part += abs_pow(row[j], p);
      }
      const A total = group_reduce(part, SumOp{}, s_red);
      n = p == A(1) ? total : (p == A(2) ? acc_sqrt(total) : acc_pow(total, A(1) / p));
    }
    if (!valid) continue;
    for (int64_t j = threadIdx.x; j < L; j += blockDim.x) {
      const A v = row[j];
      A dnorm = A(0);  // 0 where lam == 0 (or, for p != 1, where the row norm is 0)
      if (v != A(0)) {
        const A sgn = v > A(0) ? A(1) : A(-1);
        if (p == A(1)) {
          dnorm = sgn;  // exactly sign(lam); the norm is not computed for p == 1
        } else if (n != A(0)) {
          const A ratio = (v < A(0) ? -v : v) / n;
          dnorm = sgn * (p == A(2) ? ratio : acc_pow(ratio, p - A(1)));
        }
      }
      row[j] = clamp_nan(v + lr * (grow[j] - dnorm), lo, hi);
    }
  }
}

template <typename A>
void launch(at::Tensor& lam, const at::Tensor& grad, double lr, double p, double lo, double hi, cudaStream_t stream) {
  const int64_t B = lam.size(0);
  const int64_t L = lam.dim() == 2 ? lam.size(1) : 1;
  const RowCfg cfg = row_cfg(L, kBlock);
  cal_step_kernel<A><<<grid_for((B + cfg.ty - 1) / cfg.ty), dim3(cfg.tx, cfg.ty), 0, stream>>>(
      lam.mutable_data_ptr<A>(), grad.const_data_ptr<A>(), B, L, static_cast<A>(lr), static_cast<A>(p),
      static_cast<A>(lo), static_cast<A>(hi));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Schema returns () (in place only): see docs/KERNELS.md.
void cal_step_(at::Tensor& lam, const at::Tensor& grad, double lr, double p, double lo, double hi) {
  checks::cal_step("cal_step_", at::kCUDA, lam, grad);
  const c10::cuda::CUDAGuard guard(lam.device());
  if (lam.numel() == 0) return;
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (lam.scalar_type() == at::kDouble) {
    launch<double>(lam, grad, lr, p, lo, hi, stream);
  } else {
    launch<float>(lam, grad, lr, p, lo, hi, stream);
  }
}

}  // namespace
}  // namespace cuda
}  // namespace cat_fast

TORCH_LIBRARY_IMPL(cat_fast, CUDA, m) {
  m.impl("cal_step_", &cat_fast::cuda::cal_step_);
}
