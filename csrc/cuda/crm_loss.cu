// CRM loss forward / backward (docs/KERNELS.md "crm_loss"). Exactly one launch per call.
// One row slot (tx threads, see common.cuh) per row; online softmax of logits and cf_logits in one
// read each. reduction none: a grid over rows. mean/sum: blocks of 1024 threads (the same row slots
// whatever B, so row losses and stats do not depend on the path); each slot keeps its own running sum
// (double) of the row losses in row order and the block adds its slots in a fixed order (block_sum).
// Up to kSingleMaxGroups row groups and kSingleMaxRows rows: one block loops over all rows and writes the
// loss. Larger B:
// up to kMaxPartials blocks, each owning `chunk` consecutive row groups, write one partial (double)
// each; the block that increments the completion counter last adds the partials in a fixed order
// (block-index strided, then block_sum), writes the loss and resets the counter to 0. The summation
// order depends only on B and C (not on timing or the GPU model): deterministic, no float atomics. No
// memset per call: the counter, one per (device, stream), is zeroed once when made (completion_counter,
// common.cuh).
// ignore_index: rows whose label equals it give loss 0 (ce 0 in stats) and zero gradients; the mean divides by the
// number of the other rows (each slot counts them beside its running sum, each block's count is a second partial;
// the mean backward's blocks each count the labels first). Phi's subgradient goes to the first index of the row
// maximum (SoftmaxOp keeps the smaller index on ties), as in the CPU kernels.
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <ATen/ops/empty.h>

#include "checks/crm_loss.h"
#include "common.cuh"

namespace cat_fast {
namespace cuda {
namespace {

constexpr int kBlock = 256;              // grid-over-rows kernels
constexpr int kReduceBlock = 1024;       // the blocks of a mean/sum forward
constexpr int64_t kSingleMaxGroups = 4;  // mean/sum over at most this many row groups: one block, no counter
constexpr int64_t kSingleMaxRows = 1024; // ... and at most this many rows (one-thread rows: 1024 to a group)
constexpr int64_t kMaxPartials = 1024;   // most blocks (partial sums) of a multi-block mean/sum

template <typename scalar_t>
__global__ void __launch_bounds__(kReduceBlock) crm_loss_forward_kernel(
    const scalar_t* __restrict__ logits, const scalar_t* __restrict__ cf_logits, const int64_t* __restrict__ labels,
    acc_t<scalar_t>* __restrict__ loss, acc_t<scalar_t>* __restrict__ stats, double* __restrict__ partials,
    int* __restrict__ counter, int64_t B, int64_t C, int64_t chunk, acc_t<scalar_t> a1, acc_t<scalar_t> a2,
    int reduction, int64_t ignore_index) {
  using A = acc_t<scalar_t>;
  __shared__ SoftmaxState<A> s_red[kReduceBlock / 32];
  __shared__ double s_sum[kReduceBlock / 32];
  double running = 0.0;  // used by x == 0 of each slot when reduction != 0
  double kept = 0.0;     // ... and the number of its non-ignored rows
  const int64_t groups = (B + blockDim.y - 1) / blockDim.y;
  // none: grid-stride over row groups; mean/sum: `chunk` consecutive row groups per block
  const int64_t g_begin = reduction == 0 ? blockIdx.x : static_cast<int64_t>(blockIdx.x) * chunk;
  const int64_t g_end = reduction == 0 || g_begin + chunk > groups ? groups : g_begin + chunk;
  const int64_t g_step = reduction == 0 ? gridDim.x : 1;
  for (int64_t g = g_begin; g < g_end; g += g_step) {  // uniform trip count in the block
    const int64_t r = g * blockDim.y + threadIdx.y;
    const bool valid = r < B;
    const scalar_t* z = logits + (valid ? r : 0) * C;
    const scalar_t* zc = cf_logits + (valid ? r : 0) * C;
    SoftmaxState<A> st = softmax_identity<A>();
    SoftmaxState<A> sc = softmax_identity<A>();
    if (valid) {
      for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
        softmax_push(st, static_cast<A>(z[c]), static_cast<int>(c));
        softmax_push(sc, static_cast<A>(zc[c]), static_cast<int>(c));
      }
    }
    st = group_reduce(st, SoftmaxOp{}, s_red);
    sc = group_reduce(sc, SoftmaxOp{}, s_red);
    if (valid && threadIdx.x == 0) {
      const int64_t y = labels[r];
      const bool ignored = y == ignore_index;
      CAT_FAST_DEVICE_ASSERT(ignored || (y >= 0 && y < C));
      const A phi = A(1) / st.s;
      const A phi_cf = A(1) / sc.s;
      const A w = clamp_nan(phi / phi_cf, a1, a2);
      const A ce = ignored ? A(0) : st.m + acc_log(st.s) - static_cast<A>(z[y]);
      const A l = ignored ? A(0) : w * ce;
      A* s = stats + r * 4;
      s[0] = w;
      s[1] = ce;
      s[2] = phi;
      s[3] = phi_cf;
      if (reduction == 0) {
        loss[r] = l;
      } else {
        running += static_cast<double>(l);
        kept += ignored ? 0.0 : 1.0;
      }
    }
  }
  if (reduction == 0) return;
  double total = running, count = kept;
  if (!grid_sum2(total, count, partials, counter, s_sum)) return;  // thread (0,0) of the block with the sums goes on
  if (reduction == 1) total /= count;  // no non-ignored row (or B == 0) gives NaN, like F.cross_entropy
  loss[0] = static_cast<A>(total);
}

template <typename scalar_t>
__global__ void __launch_bounds__(kBlock) crm_loss_backward_kernel(
    const acc_t<scalar_t>* __restrict__ grad, const scalar_t* __restrict__ logits,
    const scalar_t* __restrict__ cf_logits, const int64_t* __restrict__ labels,
    const acc_t<scalar_t>* __restrict__ stats, scalar_t* __restrict__ grad_logits, scalar_t* __restrict__ grad_cf,
    int64_t B, int64_t C, acc_t<scalar_t> a1, acc_t<scalar_t> a2, int reduction, bool detach_weight,
    int64_t ignore_index) {
  using A = acc_t<scalar_t>;
  __shared__ SoftmaxState<A> s_red[kBlock / 32];
  __shared__ double s_sum[kBlock / 32];
  __shared__ double s_kept;
  A g_all = reduction == 0 ? A(0) : grad[0];
  if (reduction == 1) {  // mean: divide by the number of non-ignored rows, counted by every block (B label reads)
    const int t = threadIdx.y * blockDim.x + threadIdx.x;
    const int nt = blockDim.x * blockDim.y;
    double n = 0.0;
    for (int64_t k = t; k < B; k += nt) n += labels[k] != ignore_index ? 1.0 : 0.0;
    n = block_sum(n, s_sum);
    if (t == 0) s_kept = n;
    __syncthreads();
    g_all = g_all / static_cast<A>(s_kept);
  }
  const int64_t groups = (B + blockDim.y - 1) / blockDim.y;
  for (int64_t g = blockIdx.x; g < groups; g += gridDim.x) {  // uniform trip count in the block
    const int64_t r = g * blockDim.y + threadIdx.y;
    const bool valid = r < B;
    const int64_t rr = valid ? r : 0;
    const scalar_t* z = logits + rr * C;
    const scalar_t* zc = cf_logits + rr * C;
    const A* s = stats + rr * 4;
    const A w = s[0], ce = s[1], phi = s[2], phi_cf = s[3];
    const A ratio = phi / phi_cf;
    const int64_t y = labels[rr];
    const bool keep = y != ignore_index;
    const bool active = valid && keep && !detach_weight && a1 < ratio && ratio < a2;

    SoftmaxState<A> st = softmax_identity<A>();
    SoftmaxState<A> sc = softmax_identity<A>();
    if (valid) {
      for (int64_t c = threadIdx.x; c < C; c += blockDim.x) softmax_push(st, static_cast<A>(z[c]), static_cast<int>(c));
    }
    if (active) {
      for (int64_t c = threadIdx.x; c < C; c += blockDim.x) softmax_push(sc, static_cast<A>(zc[c]), static_cast<int>(c));
    }
    st = group_reduce(st, SoftmaxOp{}, s_red);  // every thread of the block calls both
    sc = group_reduce(sc, SoftmaxOp{}, s_red);
    if (!valid) continue;

    scalar_t* o = grad_logits + r * C;
    scalar_t* oc = grad_cf + r * C;
    if (!keep) {  // ignored row: zero gradients
      for (int64_t c = threadIdx.x; c < C; c += blockDim.x) o[c] = oc[c] = static_cast<scalar_t>(A(0));
      continue;
    }
    CAT_FAST_DEVICE_ASSERT(y >= 0 && y < C);
    const A go = reduction == 0 ? grad[r] : g_all;
    const A inv_s = A(1) / st.s;
    const A ka = go * w;
    const A kb = active ? go * ce / phi_cf * phi : A(0);  // go * ce / phi_cf * dphi, dphi = phi (oh - p)
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
      const A p = acc_exp(static_cast<A>(z[c]) - st.m) * inv_s;
      const A v = ka * (p - (c == y ? A(1) : A(0))) + kb * ((c == st.idx ? A(1) : A(0)) - p);
      o[c] = static_cast<scalar_t>(v);
    }
    if (!active) {
      for (int64_t c = threadIdx.x; c < C; c += blockDim.x) oc[c] = static_cast<scalar_t>(A(0));
      continue;
    }
    // - go * ce * phi / phi_cf^2 * dphi_cf, dphi_cf = phi_cf (oh_cf - p_cf)
    const A inv_sc = A(1) / sc.s;
    const A kc = -go * ce * phi / (phi_cf * phi_cf) * phi_cf;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
      const A p = acc_exp(static_cast<A>(zc[c]) - sc.m) * inv_sc;
      oc[c] = static_cast<scalar_t>(kc * ((c == sc.idx ? A(1) : A(0)) - p));
    }
  }
}

template <typename scalar_t>
void launch_forward(const at::Tensor& logits, const at::Tensor& cf_logits, const at::Tensor& labels, at::Tensor& loss,
                    at::Tensor& stats, double a1, double a2, int reduction, int64_t ignore_index,
                    const c10::cuda::CUDAStream& stream) {
  using A = acc_t<scalar_t>;
  const int64_t B = logits.size(0), C = logits.size(1);
  const bool reduce = reduction != 0;
  const RowCfg cfg = reduce ? class_row_cfg(C, kReduceBlock, kReduceBlock) : class_row_cfg(C, kBlock);
  const int64_t groups = (B + cfg.ty - 1) / cfg.ty;
  unsigned grid = 1;
  int64_t chunk = groups;
  at::Tensor partials, counter;
  if (!reduce) {
    grid = grid_for(groups);
    chunk = 0;
  } else if (groups > kSingleMaxGroups || B > kSingleMaxRows) {
    chunk = (groups + kMaxPartials - 1) / kMaxPartials;
    grid = static_cast<unsigned>((groups + chunk - 1) / chunk);
    partials = at::empty({2 * static_cast<int64_t>(grid)}, logits.options().dtype(at::kDouble));  // sums, counts
    counter = completion_counter(logits, stream);
  }
  crm_loss_forward_kernel<scalar_t><<<grid, dim3(cfg.tx, cfg.ty), 0, stream.stream()>>>(
      logits.const_data_ptr<scalar_t>(), cf_logits.const_data_ptr<scalar_t>(), labels.const_data_ptr<int64_t>(),
      loss.mutable_data_ptr<A>(), stats.mutable_data_ptr<A>(),
      partials.defined() ? partials.mutable_data_ptr<double>() : nullptr,
      counter.defined() ? counter.mutable_data_ptr<int>() : nullptr, B, C, chunk, static_cast<A>(a1),
      static_cast<A>(a2), reduction, ignore_index);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t>
void launch_backward(const at::Tensor& grad, const at::Tensor& logits, const at::Tensor& cf_logits,
                     const at::Tensor& labels, const at::Tensor& stats, at::Tensor& grad_logits, at::Tensor& grad_cf,
                     double a1, double a2, int reduction, bool detach_weight, int64_t ignore_index,
                     cudaStream_t stream) {
  using A = acc_t<scalar_t>;
  const int64_t B = logits.size(0), C = logits.size(1);
  const RowCfg cfg = class_row_cfg(C, kBlock);
  crm_loss_backward_kernel<scalar_t><<<grid_for((B + cfg.ty - 1) / cfg.ty), dim3(cfg.tx, cfg.ty), 0, stream>>>(
      grad.const_data_ptr<A>(), logits.const_data_ptr<scalar_t>(), cf_logits.const_data_ptr<scalar_t>(),
      labels.const_data_ptr<int64_t>(), stats.const_data_ptr<A>(), grad_logits.mutable_data_ptr<scalar_t>(),
      grad_cf.mutable_data_ptr<scalar_t>(), B, C, static_cast<A>(a1), static_cast<A>(a2), reduction, detach_weight,
      ignore_index);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

std::tuple<at::Tensor, at::Tensor> crm_loss_forward(const at::Tensor& logits, const at::Tensor& cf_logits,
                                                    const at::Tensor& labels, double a1, double a2,
                                                    int64_t reduction, bool /*detach_weight: backward only*/,
                                                    int64_t ignore_index) {
  checks::crm_loss("crm_loss_forward", at::kCUDA, logits, cf_logits, labels, reduction);
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t B = logits.size(0);
  const auto acc_opts = logits.options().dtype(acc_scalar_type(logits.scalar_type()));
  at::Tensor stats = at::empty({B, 4}, acc_opts);
  at::Tensor loss = reduction == 0 ? at::empty({B}, acc_opts) : at::empty(std::vector<int64_t>{}, acc_opts);
  if (reduction == 0 && B == 0) return {loss, stats};  // mean/sum of nothing still runs (writes 0 / NaN)
  const c10::cuda::CUDAStream stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "crm_loss_forward_cuda", [&] {
    launch_forward<scalar_t>(logits, cf_logits, labels, loss, stats, a1, a2, static_cast<int>(reduction), ignore_index,
                             stream);
  });
  return {loss, stats};
}

std::tuple<at::Tensor, at::Tensor> crm_loss_backward(const at::Tensor& grad, const at::Tensor& logits,
                                                     const at::Tensor& cf_logits, const at::Tensor& labels,
                                                     const at::Tensor& stats, double a1, double a2,
                                                     int64_t reduction, bool detach_weight, int64_t ignore_index) {
  checks::crm_loss("crm_loss_backward", at::kCUDA, logits, cf_logits, labels, reduction);
  checks::crm_loss_grad("crm_loss_backward", at::kCUDA, grad, stats, logits, reduction);
  const c10::cuda::CUDAGuard guard(logits.device());
  at::Tensor grad_logits = at::empty(logits.sizes(), logits.options());
  at::Tensor grad_cf = at::empty(cf_logits.sizes(), cf_logits.options());
  if (grad_logits.numel() == 0) return {grad_logits, grad_cf};
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "crm_loss_backward_cuda", [&] {
    launch_backward<scalar_t>(grad, logits, cf_logits, labels, stats, grad_logits, grad_cf, a1, a2,
                              static_cast<int>(reduction), detach_weight, ignore_index, stream);
  });
  return {grad_logits, grad_cf};
}

}  // namespace
}  // namespace cuda
}  // namespace cat_fast

TORCH_LIBRARY_IMPL(cat_fast, CUDA, m) {
  m.impl("crm_loss_forward", &cat_fast::cuda::crm_loss_forward);
  m.impl("crm_loss_backward", &cat_fast::cuda::crm_loss_backward);
}
