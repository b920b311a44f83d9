// CAL objective forward / backward (docs/KERNELS.md "cal_objective"). One launch per call.
// One row slot (tx threads, see common.cuh) per logits row; online softmax (max, sum exp, argmax)
// in a single read of the row, reduced in a fixed order inside the slot. Rows whose label == ignore_index: 0 and a
// zero gradient row. Phi's subgradient goes to the first index of the row maximum (SoftmaxOp keeps the smaller
// index on ties), as in the CPU kernels.
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <ATen/ops/empty.h>

#include "checks/cal_objective.h"
#include "common.cuh"

namespace cat_fast {
namespace cuda {
namespace {

constexpr int kBlock = 256;

// Online softmax state of row z (the identity where !valid), reduced over the row slot; every thread of the
// block must call it (group_reduce).
template <typename scalar_t>
__device__ __forceinline__ SoftmaxState<acc_t<scalar_t>> row_softmax_state(const scalar_t* __restrict__ z, int64_t C,
                                                                           bool valid,
                                                                           SoftmaxState<acc_t<scalar_t>>* s_red) {
  using A = acc_t<scalar_t>;
  SoftmaxState<A> st = softmax_identity<A>();
  if (valid) {
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) softmax_push(st, static_cast<A>(z[c]), static_cast<int>(c));
  }
  return group_reduce(st, SoftmaxOp{}, s_red);
}

// out[i] = gamma * (logsumexp(z_i) - z_i[y_i]) + eta * max softmax(z_i)
template <typename scalar_t>
__global__ void __launch_bounds__(kBlock) cal_objective_forward_kernel(const scalar_t* __restrict__ logits,
                                                                       const int64_t* __restrict__ labels,
                                                                       acc_t<scalar_t>* __restrict__ out, int64_t B,
                                                                       int64_t C, acc_t<scalar_t> gamma,
                                                                       acc_t<scalar_t> eta, int64_t ignore_index) {
  using A = acc_t<scalar_t>;
  __shared__ SoftmaxState<A> s_red[kBlock / 32];
  const int64_t groups = (B + blockDim.y - 1) / blockDim.y;
  for (int64_t g = blockIdx.x; g < groups; g += gridDim.x) {  // uniform trip count in the block
    const int64_t r = g * blockDim.y + threadIdx.y;
    const bool valid = r < B;
    const scalar_t* z = logits + (valid ? r : 0) * C;
    const SoftmaxState<A> st = row_softmax_state(z, C, valid, s_red);
    if (valid && threadIdx.x == 0) {
      const int64_t y = labels[r];
      if (y == ignore_index) {
        out[r] = A(0);
      } else {
        CAT_FAST_DEVICE_ASSERT(y >= 0 && y < C);
        const A lse = st.m + acc_log(st.s);
        out[r] = gamma * (lse - static_cast<A>(z[y])) + eta / st.s;
      }
    }
  }
}

// out[i,c] = grad_i * (gamma * (p_ic - [c==y_i]) + eta * pmax_i * ([c==argmax_i] - p_ic))
template <typename scalar_t>
__global__ void __launch_bounds__(kBlock) cal_objective_backward_kernel(const acc_t<scalar_t>* __restrict__ grad,
                                                                        const scalar_t* __restrict__ logits,
                                                                        const int64_t* __restrict__ labels,
                                                                        scalar_t* __restrict__ out, int64_t B,
                                                                        int64_t C, acc_t<scalar_t> gamma,
                                                                        acc_t<scalar_t> eta, int64_t ignore_index) {
  using A = acc_t<scalar_t>;
  __shared__ SoftmaxState<A> s_red[kBlock / 32];
  const int64_t groups = (B + blockDim.y - 1) / blockDim.y;
  for (int64_t g = blockIdx.x; g < groups; g += gridDim.x) {
    const int64_t r = g * blockDim.y + threadIdx.y;
    const bool valid = r < B;
    const scalar_t* z = logits + (valid ? r : 0) * C;
    const SoftmaxState<A> st = row_softmax_state(z, C, valid, s_red);
    if (!valid) continue;
    const int64_t y = labels[r];
    scalar_t* o = out + r * C;
    if (y == ignore_index) {
      for (int64_t c = threadIdx.x; c < C; c += blockDim.x) o[c] = static_cast<scalar_t>(A(0));
      continue;
    }
    CAT_FAST_DEVICE_ASSERT(y >= 0 && y < C);
    const A inv_s = A(1) / st.s;  // = pmax
    const A go = grad[r];
    const A k_ce = go * gamma;
    const A k_mx = go * eta * inv_s;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
      const A p = acc_exp(static_cast<A>(z[c]) - st.m) * inv_s;
      const A v = k_ce * (p - (c == y ? A(1) : A(0))) + k_mx * ((c == st.idx ? A(1) : A(0)) - p);
      o[c] = static_cast<scalar_t>(v);
    }
  }
}

template <typename scalar_t>
void launch_forward(const at::Tensor& logits, const at::Tensor& labels, at::Tensor& out, double gamma, double eta,
                    int64_t ignore_index, cudaStream_t stream) {
  using A = acc_t<scalar_t>;
  const int64_t B = logits.size(0), C = logits.size(1);
  const RowCfg cfg = class_row_cfg(C, kBlock);
  cal_objective_forward_kernel<scalar_t><<<grid_for((B + cfg.ty - 1) / cfg.ty), dim3(cfg.tx, cfg.ty), 0, stream>>>(
      logits.const_data_ptr<scalar_t>(), labels.const_data_ptr<int64_t>(), out.mutable_data_ptr<A>(), B, C,
      static_cast<A>(gamma), static_cast<A>(eta), ignore_index);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t>
void launch_backward(const at::Tensor& grad, const at::Tensor& logits, const at::Tensor& labels, at::Tensor& out,
                     double gamma, double eta, int64_t ignore_index, cudaStream_t stream) {
  using A = acc_t<scalar_t>;
  const int64_t B = logits.size(0), C = logits.size(1);
  const RowCfg cfg = class_row_cfg(C, kBlock);
  cal_objective_backward_kernel<scalar_t><<<grid_for((B + cfg.ty - 1) / cfg.ty), dim3(cfg.tx, cfg.ty), 0, stream>>>(
      grad.const_data_ptr<A>(), logits.const_data_ptr<scalar_t>(), labels.const_data_ptr<int64_t>(),
      out.mutable_data_ptr<scalar_t>(), B, C, static_cast<A>(gamma), static_cast<A>(eta), ignore_index);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor cal_objective_forward(const at::Tensor& logits, const at::Tensor& labels, double gamma, double eta,
                                 int64_t ignore_index) {
  checks::cal_objective("cal_objective_forward", at::kCUDA, logits, labels);
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t B = logits.size(0);
  auto out = at::empty({B}, logits.options().dtype(acc_scalar_type(logits.scalar_type())));
  if (B == 0) return out;
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "cal_objective_forward_cuda",
                                  [&] { launch_forward<scalar_t>(logits, labels, out, gamma, eta, ignore_index, stream); });
  return out;
}

at::Tensor cal_objective_backward(const at::Tensor& grad, const at::Tensor& logits, const at::Tensor& labels,
                                  double gamma, double eta, int64_t ignore_index) {
  checks::cal_objective("cal_objective_backward", at::kCUDA, logits, labels);
  checks::cal_objective_grad("cal_objective_backward", at::kCUDA, grad, logits);
  const c10::cuda::CUDAGuard guard(logits.device());
  auto out = at::empty(logits.sizes(), logits.options());
  if (out.numel() == 0) return out;
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "cal_objective_backward_cuda",
                                  [&] { launch_backward<scalar_t>(grad, logits, labels, out, gamma, eta, ignore_index, stream); });
  return out;
}

}  // namespace
}  // namespace cuda
}  // namespace cat_fast

TORCH_LIBRARY_IMPL(cat_fast, CUDA, m) {
  m.impl("cal_objective_forward", &cat_fast::cuda::cal_objective_forward);
  m.impl("cal_objective_backward", &cat_fast::cuda::cal_objective_backward);
}
