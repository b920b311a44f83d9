// CLP's per-sample characteristics, forward / backward (docs/KERNELS.md "sample_characteristics"; the math:
// docs/METHODS.md §5.1). Exactly one launch per call; CPU kernels and schemas: csrc/cpu/sample_characteristics.cpp.
// Forward: one row slot (tx threads, common.cuh) per row reads the logits row (online softmax of all logits and the
// largest other logit with its first index), the features row and the label's weight row in one pass, then the
// logits row again (Σ (1 - p)², Σ p log p, L1/L2 hits); thread 0 of the slot writes the 10 columns.
// Backward: ONE launch over `row groups + C` work items, grid-stride. A row-group item writes the logits' gradient
// rows of its rows (and zero feature-gradient rows for ignored rows). Class item c: the block's warps take the rows
// i labelled c (warp w the rows i = w mod warps), reduce f_i . W_c and |f_i|^2 inside the warp (fixed xor order),
// write grad_features_i and the row's two coefficients (alpha_i, beta_i) to a workspace; after __syncthreads each
// thread owns columns j of grad W_c = Σ_i alpha_i f_ij + (Σ_i beta_i) W_cj and sums over the rows in increasing i.
// Deterministic, no atomics, no host sync. Rows whose label == ignore_index: zero output rows, zero gradients.
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <ATen/ops/empty.h>

#include "checks/sample_characteristics.h"
#include "common.cuh"

namespace cat_fast {
namespace cuda {
namespace {

constexpr int kBlock = 256;
constexpr int kColumns = 10;

// The calling thread's part of pass 1 over a logits row z with label y: the softmax state of all logits (st) and of
// the logits other than z_y (so: the largest other logit, its first index).
template <typename scalar_t, typename A>
__device__ __forceinline__ void push_logits(const scalar_t* __restrict__ z, int64_t C, int64_t y, SoftmaxState<A>& st,
                                            SoftmaxState<A>& so) {
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    const A zc = static_cast<A>(z[c]);
    softmax_push(st, zc, static_cast<int>(c));
    if (c != y) softmax_push(so, zc, static_cast<int>(c));
  }
}

template <typename scalar_t>
__global__ void __launch_bounds__(kBlock) sample_characteristics_forward_kernel(
    const scalar_t* __restrict__ logits, const int64_t* __restrict__ labels, const scalar_t* __restrict__ features,
    const scalar_t* __restrict__ weights, const acc_t<scalar_t>* __restrict__ stats, acc_t<scalar_t>* __restrict__ out,
    int64_t B, int64_t C, int64_t H, acc_t<scalar_t> eps, int64_t ignore_index) {
  using A = acc_t<scalar_t>;
  __shared__ SoftmaxState<A> s_red[kBlock / 32];
  __shared__ Vals<A, 3> s_vals[kBlock / 32];
  const int64_t groups = (B + blockDim.y - 1) / blockDim.y;
  for (int64_t g = blockIdx.x; g < groups; g += gridDim.x) {  // uniform trip count in the block
    const auto [r, rr, y, valid, keep] = labeled_row(g, labels, B, C, ignore_index);
    const scalar_t* z = logits + rr * C;
    // pass 1: softmax statistics of the row, the largest other logit (first index), f . W_y, |f|^2, |W_y|^2
    SoftmaxState<A> st = softmax_identity<A>();
    SoftmaxState<A> so = softmax_identity<A>();
    Vals<A, 3> dv;
    dv.v[0] = dv.v[1] = dv.v[2] = A(0);
    if (keep) {
      push_logits(z, C, y, st, so);
      const scalar_t* f = features + rr * H;
      const scalar_t* w = weights + y * H;
      for (int64_t j = threadIdx.x; j < H; j += blockDim.x) {
        const A fj = static_cast<A>(f[j]);
        const A wj = static_cast<A>(w[j]);
        dv.v[0] += fj * wj;
        dv.v[1] += fj * fj;
        dv.v[2] += wj * wj;
      }
    }
    st = group_reduce(st, SoftmaxOp{}, s_red);
    so = group_reduce(so, SoftmaxOp{}, s_red);
    dv = group_reduce(dv, SumOp{}, s_vals);
    // pass 2: Σ (1 - p)², Σ p log p with log p = (z - m) - log s
    const A log_s = keep ? acc_log(st.s) : A(0);
    const A inv_s = keep ? A(1) / st.s : A(0);
    Vals<A, 3> pv;
    pv.v[0] = pv.v[1] = pv.v[2] = A(0);
    if (keep) {
      for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
        const A d = static_cast<A>(z[c]) - st.m;
        const A p = acc_exp(d) * inv_s;
        pv.v[0] += (A(1) - p) * (A(1) - p);
        pv.v[1] += p * (d - log_s);
      }
    }
    pv = group_reduce(pv, SumOp{}, s_vals);
    if (valid && threadIdx.x == 0) {
      A* o = out + r * kColumns;
      if (!keep) {
        for (int k = 0; k < kColumns; ++k) o[k] = A(0);
      } else {
        const A zy = static_cast<A>(z[y]);
        const A loss = (st.m - zy) + log_s;
        const A margin = (acc_exp(zy - st.m) - acc_exp(so.m - st.m)) * inv_s;
        const A nf = acc_sqrt(dv.v[1]);
        const A nw = acc_sqrt(dv.v[2]);
        const A* s = stats + y * 3;
        o[0] = loss;
        o[1] = margin;
        o[2] = acc_sqrt(pv.v[0]);
        o[3] = dv.v[0] / ((nf > eps ? nf : eps) * (nw > eps ? nw : eps));
        o[4] = pv.v[1];
        o[5] = s[0];
        o[6] = s[1];
        o[7] = nw;
        o[8] = loss - s[1];
        o[9] = margin - s[2];
      }
    }
  }
}

template <typename A>
__device__ __forceinline__ A warp_sum(A v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += shfl_xor(v, o);
  return v;
}

// One row group: the logits' gradient rows (row slots as in the forward) and zero feature-gradient rows for the
// ignored rows of the group. Every thread of the block calls it (group_reduce).
template <typename scalar_t>
__device__ __forceinline__ void backward_rows(
    int64_t g, const acc_t<scalar_t>* __restrict__ grad, const scalar_t* __restrict__ logits,
    const int64_t* __restrict__ labels, scalar_t* __restrict__ grad_logits, scalar_t* __restrict__ grad_features,
    int64_t B, int64_t C, int64_t H, int64_t ignore_index, SoftmaxState<acc_t<scalar_t>>* s_red,
    Vals<acc_t<scalar_t>, 3>* s_vals) {
  using A = acc_t<scalar_t>;
  const auto [r, rr, y, valid, keep] = labeled_row(g, labels, B, C, ignore_index);
  const scalar_t* z = logits + rr * C;
  SoftmaxState<A> st = softmax_identity<A>();
  SoftmaxState<A> so = softmax_identity<A>();
  if (keep) push_logits(z, C, y, st, so);
  st = group_reduce(st, SoftmaxOp{}, s_red);
  so = group_reduce(so, SoftmaxOp{}, s_red);
  const A log_s = keep ? acc_log(st.s) : A(0);
  const A inv_s = keep ? A(1) / st.s : A(0);
  Vals<A, 3> pv;  // Σ p², Σ (1 - p)², Σ p log p
  pv.v[0] = pv.v[1] = pv.v[2] = A(0);
  if (keep) {
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
      const A d = static_cast<A>(z[c]) - st.m;
      const A p = acc_exp(d) * inv_s;
      pv.v[0] += p * p;
      pv.v[1] += (A(1) - p) * (A(1) - p);
      pv.v[2] += p * (d - log_s);
    }
  }
  pv = group_reduce(pv, SumOp{}, s_vals);
  if (!valid) return;
  if (!keep) {
    scalar_t* gz = grad_logits + r * C;
    scalar_t* gf = grad_features + r * H;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) gz[c] = static_cast<scalar_t>(A(0));
    for (int64_t j = threadIdx.x; j < H; j += blockDim.x) gf[j] = static_cast<scalar_t>(A(0));
    return;
  }
  const A* gr = grad + r * kColumns;
  const A a = gr[0] + gr[8];  // the loss's gradient
  const A b = gr[1] + gr[9];  // the margin's
  const A g2 = gr[2] / acc_sqrt(pv.v[1]);
  const A g4 = gr[4];
  const int64_t k = so.idx;  // INT32_MAX when every other logit is -inf: then p_k = 0, no term
  const A py = acc_exp(static_cast<A>(z[y]) - st.m) * inv_s;
  const A pk = acc_exp(so.m - st.m) * inv_s;
  const A margin = py - pk;
  // a (p_c - 1[c=y]) + b (p_y 1[c=y] - p_k 1[c=k] - margin p_c) + g2 p_c (p_c - Σp²)/‖1-p‖ + g4 p_c (log p_c - Σ p log p)
  scalar_t* gz = grad_logits + r * C;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    const A d = static_cast<A>(z[c]) - st.m;
    const A p = acc_exp(d) * inv_s;
    A v = p * (a - b * margin + g2 * (p - pv.v[0]) + g4 * ((d - log_s) - pv.v[2]));
    if (c == y) v += b * py - a;
    if (c == k) v -= b * pk;
    gz[c] = static_cast<scalar_t>(v);
  }
}

// Class c: its rows' feature gradients and the weight gradient row c. Every thread of the block calls it.
template <typename scalar_t>
__device__ __forceinline__ void backward_class(
    int64_t c, const acc_t<scalar_t>* __restrict__ grad, const int64_t* __restrict__ labels,
    const scalar_t* __restrict__ features, const scalar_t* __restrict__ weights,
    scalar_t* __restrict__ grad_features, scalar_t* __restrict__ grad_weights, acc_t<scalar_t>* coef, int64_t B,
    int64_t H, acc_t<scalar_t> eps, int64_t ignore_index) {
  using A = acc_t<scalar_t>;
  const int t = threadIdx.y * blockDim.x + threadIdx.x;
  const int nt = blockDim.x * blockDim.y;  // a multiple of 32
  const int lane = t & 31;
  const int warp = t >> 5;
  const int warps = nt >> 5;
  const scalar_t* wc = weights + c * H;
  A ww = A(0);
  for (int64_t j = lane; j < H; j += 32) {
    const A wj = static_cast<A>(wc[j]);
    ww += wj * wj;
  }
  const A nw = acc_sqrt(warp_sum(ww));  // every warp has it
  const A nwc = nw > eps ? nw : eps;
  for (int64_t i = warp; i < B; i += warps) {
    const int64_t y = labels[i];  // uniform in the warp
    if (y != c || y == ignore_index) continue;
    const scalar_t* f = features + i * H;
    A dot = A(0), ff = A(0);
    for (int64_t j = lane; j < H; j += 32) {
      const A fj = static_cast<A>(f[j]);
      dot += fj * static_cast<A>(wc[j]);
      ff += fj * fj;
    }
    dot = warp_sum(dot);
    ff = warp_sum(ff);
    const A nf = acc_sqrt(ff);
    const A nfc = nf > eps ? nf : eps;
    const A* gr = grad + i * kColumns;
    const A cosine = dot / (nfc * nwc);
    const A alpha = gr[3] / (nfc * nwc);
    const A gamma = nf >= eps ? -gr[3] * cosine / (nfc * nf) : A(0);  // a clamped norm passes no gradient
    const A beta = (nw >= eps ? -gr[3] * cosine / (nwc * nw) : A(0)) + (nw > A(0) ? gr[7] / nw : A(0));
    scalar_t* gf = grad_features + i * H;
    for (int64_t j = lane; j < H; j += 32) {
      gf[j] = static_cast<scalar_t>(alpha * static_cast<A>(wc[j]) + gamma * static_cast<A>(f[j]));
    }
    if (lane == 0) {
      coef[2 * i] = alpha;
      coef[2 * i + 1] = beta;
    }
  }
  __syncthreads();  // the coefficients written by this block's warps are visible to the whole block
  scalar_t* gw = grad_weights + c * H;
  for (int64_t j0 = 0; j0 < H; j0 += nt) {
    const int64_t j = j0 + t;
    A sum = A(0), beta = A(0);
    bool any = false;
    for (int64_t i = 0; i < B; ++i) {
      const int64_t y = labels[i];
      if (y != c || y == ignore_index) continue;
      any = true;
      beta += coef[2 * i + 1];
      if (j < H) sum += coef[2 * i] * static_cast<A>(features[i * H + j]);
    }
    if (j < H) gw[j] = static_cast<scalar_t>(any ? sum + beta * static_cast<A>(wc[j]) : A(0));
  }
}

template <typename scalar_t>
__global__ void __launch_bounds__(kBlock) sample_characteristics_backward_kernel(
    const acc_t<scalar_t>* __restrict__ grad, const scalar_t* __restrict__ logits, const int64_t* __restrict__ labels,
    const scalar_t* __restrict__ features, const scalar_t* __restrict__ weights, scalar_t* __restrict__ grad_logits,
    scalar_t* __restrict__ grad_features, scalar_t* __restrict__ grad_weights, acc_t<scalar_t>* coef, int64_t B,
    int64_t C, int64_t H, acc_t<scalar_t> eps, int64_t ignore_index) {
  using A = acc_t<scalar_t>;
  __shared__ SoftmaxState<A> s_red[kBlock / 32];
  __shared__ Vals<A, 3> s_vals[kBlock / 32];
  const int64_t groups = (B + blockDim.y - 1) / blockDim.y;
  for (int64_t item = blockIdx.x; item < groups + C; item += gridDim.x) {  // uniform in the block
    if (item < groups) {
      backward_rows<scalar_t>(item, grad, logits, labels, grad_logits, grad_features, B, C, H, ignore_index, s_red,
                              s_vals);
    } else {
      backward_class<scalar_t>(item - groups, grad, labels, features, weights, grad_features, grad_weights, coef, B,
                               H, eps, ignore_index);
    }
  }
}

at::Tensor sample_characteristics_forward(const at::Tensor& logits, const at::Tensor& labels,
                                          const at::Tensor& features, const at::Tensor& class_weights,
                                          const at::Tensor& class_stats, double eps, int64_t ignore_index) {
  const char* op = "sample_characteristics_forward";
  checks::sample_characteristics(op, at::kCUDA, logits, labels, features, class_weights);
  checks::sample_characteristics_stats(op, at::kCUDA, class_stats, logits);
  const int64_t B = logits.size(0), C = logits.size(1), H = features.size(1);
  const at::ScalarType acc = acc_scalar_type(logits.scalar_type());
  const c10::cuda::CUDAGuard guard(logits.device());
  at::Tensor out = at::empty({B, kColumns}, logits.options().dtype(acc));
  if (B == 0) return out;
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const RowCfg cfg = row_cfg(C > H ? C : H, kBlock, kBlock);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "sample_characteristics_forward_cuda",
                                  [&] {
    using A = acc_t<scalar_t>;
    sample_characteristics_forward_kernel<scalar_t>
        <<<grid_for((B + cfg.ty - 1) / cfg.ty), dim3(cfg.tx, cfg.ty), 0, stream>>>(
            logits.const_data_ptr<scalar_t>(), labels.const_data_ptr<int64_t>(), features.const_data_ptr<scalar_t>(),
            class_weights.const_data_ptr<scalar_t>(), class_stats.const_data_ptr<A>(), out.mutable_data_ptr<A>(), B,
            C, H, static_cast<A>(eps), ignore_index);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> sample_characteristics_backward(
    const at::Tensor& grad, const at::Tensor& logits, const at::Tensor& labels, const at::Tensor& features,
    const at::Tensor& class_weights, double eps, int64_t ignore_index) {
  const char* op = "sample_characteristics_backward";
  checks::sample_characteristics(op, at::kCUDA, logits, labels, features, class_weights);
  checks::sample_characteristics_grad(op, at::kCUDA, grad, logits, kColumns);
  const int64_t B = logits.size(0), C = logits.size(1), H = features.size(1);
  const at::ScalarType acc = acc_scalar_type(logits.scalar_type());
  const c10::cuda::CUDAGuard guard(logits.device());
  at::Tensor grad_logits = at::empty(logits.sizes(), logits.options());
  at::Tensor grad_features = at::empty(features.sizes(), features.options());
  at::Tensor grad_weights = at::empty(class_weights.sizes(), class_weights.options());
  at::Tensor coef = at::empty({2 * B}, logits.options().dtype(acc));  // per row: alpha, beta
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const RowCfg cfg = class_row_cfg(C, kBlock);
  const int64_t groups = (B + cfg.ty - 1) / cfg.ty;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "sample_characteristics_backward_cuda",
                                  [&] {
    using A = acc_t<scalar_t>;
    sample_characteristics_backward_kernel<scalar_t><<<grid_for(groups + C), dim3(cfg.tx, cfg.ty), 0, stream>>>(
        grad.const_data_ptr<A>(), logits.const_data_ptr<scalar_t>(), labels.const_data_ptr<int64_t>(),
        features.const_data_ptr<scalar_t>(), class_weights.const_data_ptr<scalar_t>(),
        grad_logits.mutable_data_ptr<scalar_t>(), grad_features.mutable_data_ptr<scalar_t>(),
        grad_weights.mutable_data_ptr<scalar_t>(), B > 0 ? coef.mutable_data_ptr<A>() : nullptr, B, C, H,
        static_cast<A>(eps), ignore_index);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {grad_logits, grad_features, grad_weights};
}

}  // namespace
}  // namespace cuda
}  // namespace cat_fast

TORCH_LIBRARY_IMPL(cat_fast, CUDA, m) {
  m.impl("sample_characteristics_forward", &cat_fast::cuda::sample_characteristics_forward);
  m.impl("sample_characteristics_backward", &cat_fast::cuda::sample_characteristics_backward);
}
