// Bias-model losses forward / backward (docs/KERNELS.md "bias_loss": kind 0 PoE, 1-4 reweighting, 5 learned-mixin
// +H, 6 confidence regularisation). Exactly one launch per call; CPU kernels and schemas: csrc/cpu/bias_loss.cpp.
// One row slot (tx threads, see common.cuh; one thread for C <= 8) per row; each row is read a few times (online
// softmax of u, then the sums that need its maximum: kind 5's entropy, kind 6's t^e sums), the rereads hitting L1/L2.
// Forward, every reduction (denom = Σ d is returned for all three): blocks of 1024 threads; each slot keeps double
// running sums of l and d in row order and the block adds its slots in a fixed order (block_sum). Up to
// kSingleMaxGroups row groups and kSingleMaxRows rows: one block loops over all rows. Larger B: up to kMaxPartials
// blocks, each owning `chunk` consecutive row groups, write two partials (double) each; the block that increments
// the completion counter (common.cuh, one per device and stream, shared with crm_loss) last adds the partials in a
// fixed order, writes denom and the loss and resets the counter to 0. The summation order depends only on B and C:
// deterministic, no float atomics, no host sync (mean's division happens on the device). Backward: a grid over rows;
// mean's scale grad / denom is read on the device. Rows whose label == ignore_index: l = 0, d = 0, zero gradient rows
// (their bias[y] is never read). Numerics as in the CPU kernels: max-subtracted exponentials in the acc dtype,
// log r_c = a_c - lse(a) formed directly, torch's softplus (threshold 20), pow(0, 0) = 1.
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <ATen/ops/empty.h>

#include <vector>

#include "checks/bias_loss.h"
#include "common.cuh"

namespace cat_fast {
namespace cuda {
namespace {

constexpr int kBlock = 256;              // the backward's grid over rows
constexpr int kReduceBlock = 1024;       // the blocks of the forward
constexpr int64_t kSingleMaxGroups = 4;  // at most this many row groups: one block, no counter
constexpr int64_t kSingleMaxRows = 1024; // ... and at most this many rows (one-thread rows: 1024 to a group)
constexpr int64_t kMaxPartials = 1024;   // most blocks (partial sums) of a multi-block forward

constexpr int kPoE = 0;           // l = lse(z + b) - (z + b)_y
constexpr int kLearnedMixin = 5;  // aux: the gate [B]
constexpr int kConfReg = 6;       // aux: the teacher's probabilities [B,C]
static_assert(kPoE == checks::kPoE && kLearnedMixin == checks::kLearnedMixin && kConfReg == checks::kConfReg,
              "the kinds of csrc/checks/bias_loss.h");

__device__ __forceinline__ float acc_log1p(float x) { return log1pf(x); }
__device__ __forceinline__ double acc_log1p(double x) { return log1p(x); }

// torch's softplus (beta 1, threshold 20) and its derivative (exp(x) / (exp(x) + 1) below the threshold).
template <typename A>
__device__ __forceinline__ A softplus(A x) {
  return x > A(20) ? x : acc_log1p(acc_exp(x));
}
template <typename A>
__device__ __forceinline__ A softplus_grad(A x) {
  if (x > A(20)) return A(1);
  const A e = acc_exp(x);
  return e / (e + A(1));
}

// Example weight of the reweighting kinds 1-4 from p_b = exp(b_y): 1 - p_b (kinds 1, 3) or 1 / p_b (kinds 2, 4).
template <typename A>
__device__ __forceinline__ A reweight(int kind, A pb) {
  return kind == 1 || kind == 3 ? A(1) - pb : A(1) / pb;
}

// t^e like std::pow for t >= 0, with pow(t, 0) = 1 and pow(0, e) = 0 (e > 0) / inf (e < 0) decided here: under
// --use_fast_math powf is __powf = exp2(e * log2(t)), which gives NaN for pow(0, 0).
template <typename A>
__device__ __forceinline__ A pow_t(A t, A e) {
  if (e == A(0)) return A(1);
  if (t == A(0)) return e > A(0) ? A(0) : (e < A(0) ? -neg_inf<A>() : e);  // e NaN: NaN
  return acc_pow(t, e);
}

// The row whose softmax the cross-entropy uses: u = z + b (kind 0), z + s b (kind 5, s = softplus(gate)), z.
template <typename A>
__device__ __forceinline__ A u_of(int kind, A z, A b, A s) {
  return kind == kPoE ? z + b : (kind == kLearnedMixin ? z + s * b : z);
}

template <typename A>
struct USoftmax {
  SoftmaxState<A> u;  // of u (the row above)
  SoftmaxState<A> a;  // of a = s b (kind 5 only)
};

// Pass 1 over a row (z, b; s as for u_of): the softmax statistics of u and, for kind 5, of a = s b, reduced over the
// slot. Every thread of the block calls it (kind is uniform: every thread makes the same group_reduce calls).
template <typename scalar_t, typename A>
__device__ __forceinline__ USoftmax<A> u_softmax(int kind, bool keep, const scalar_t* __restrict__ z,
                                                 const A* __restrict__ b, A s, int64_t C, SoftmaxState<A>* s_red) {
  SoftmaxState<A> st = softmax_identity<A>();
  SoftmaxState<A> sa = softmax_identity<A>();
  if (keep) {
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
      const A bc = kind == kPoE || kind == kLearnedMixin ? b[c] : A(0);  // the other kinds read only b[y]
      softmax_push(st, u_of(kind, static_cast<A>(z[c]), bc, s), static_cast<int>(c));
      if (kind == kLearnedMixin) softmax_push(sa, s * bc, static_cast<int>(c));
    }
  }
  st = group_reduce(st, SoftmaxOp{}, s_red);
  if (kind == kLearnedMixin) sa = group_reduce(sa, SoftmaxOp{}, s_red);
  return {st, sa};
}

template <typename scalar_t>
__global__ void __launch_bounds__(kReduceBlock) bias_loss_forward_kernel(
    const scalar_t* __restrict__ logits, const acc_t<scalar_t>* __restrict__ bias, const int64_t* __restrict__ labels,
    const acc_t<scalar_t>* __restrict__ aux, acc_t<scalar_t>* __restrict__ loss, acc_t<scalar_t>* __restrict__ denom,
    double* __restrict__ partials, int* __restrict__ counter, int64_t B, int64_t C, int64_t chunk, int kind,
    int reduction, acc_t<scalar_t> entropy_weight, int64_t ignore_index) {
  using A = acc_t<scalar_t>;
  __shared__ SoftmaxState<A> s_red[kReduceBlock / 32];
  __shared__ Vals<A, 2> s_vals[kReduceBlock / 32];
  __shared__ double s_sum[kReduceBlock / 32];
  double run_l = 0.0;  // used by x == 0 of each slot: Σ l of its rows, in row order
  double run_d = 0.0;  // ... and Σ d
  const int64_t groups = (B + blockDim.y - 1) / blockDim.y;
  const int64_t g_begin = static_cast<int64_t>(blockIdx.x) * chunk;  // `chunk` consecutive row groups per block
  const int64_t g_end = g_begin + chunk > groups ? groups : g_begin + chunk;
  for (int64_t g = g_begin; g < g_end; ++g) {  // uniform trip count in the block
    const auto [r, rr, y, valid, keep] = labeled_row(g, labels, B, C, ignore_index);
    const scalar_t* z = logits + rr * C;
    const A* b = bias + rr * C;
    const A s = kind == kLearnedMixin && keep ? softplus(aux[rr]) : A(0);
    const auto [st, sa] = u_softmax(kind, keep, z, b, s, C, s_red);  // pass 1
    // pass 2, sums that need the maximum: kind 5 Σ exp(a_c - ma) (ma - a_c); kind 6 Σ t^e (m - z_c) and Σ t^e
    Vals<A, 2> v;
    v.v[0] = v.v[1] = A(0);
    if (kind == kLearnedMixin || kind == kConfReg) {
      if (keep) {
        const A e = kind == kConfReg ? A(1) - acc_exp(b[y]) : A(0);
        for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
          if (kind == kLearnedMixin) {
            const A ac = s * b[c];
            v.v[0] += acc_exp(ac - sa.m) * (sa.m - ac);
          } else {
            const A te = pow_t(aux[rr * C + c], e);
            v.v[0] += te * (st.m - static_cast<A>(z[c]));
            v.v[1] += te;
          }
        }
      }
      v = group_reduce(v, SumOp{}, s_vals);
    }
    if (valid && threadIdx.x == 0) {
      A l = A(0), d = A(0);
      if (keep) {
        const A by = b[y];
        const A ce = (st.m - u_of(kind, static_cast<A>(z[y]), by, s)) + acc_log(st.s);  // lse(u) - u_y
        l = ce;
        d = A(1);
        if (kind >= 1 && kind <= 4) {
          const A w = reweight(kind, acc_exp(by));
          l = w * ce;
          d = kind <= 2 ? w : A(1);
        } else if (kind == kLearnedMixin) {  // + ew H(a), H(a) = Σ r_c (lse(a) - a_c)
          l = ce + entropy_weight * (v.v[0] / sa.s + acc_log(sa.s));
        } else if (kind == kConfReg) {  // lse(z) - Σ t~_c z_c = Σ t^e_c (m - z_c) / Σ t^e_c + log(s)
          l = v.v[0] / v.v[1] + acc_log(st.s);
        }
      }
      if (reduction == 0) loss[r] = l;
      run_l += static_cast<double>(l);
      run_d += static_cast<double>(d);
    }
  }
  double total = run_l, total_d = run_d;
  if (!grid_sum2(total, total_d, partials, counter, s_sum)) return;  // thread (0,0) of the block with the sums goes on
  denom[0] = static_cast<A>(total_d);
  if (reduction == 1) total /= total_d;  // Σ d == 0 (every row ignored, B == 0) gives NaN, like F.cross_entropy
  if (reduction != 0) loss[0] = static_cast<A>(total);
}

template <typename scalar_t>
__global__ void __launch_bounds__(kBlock) bias_loss_backward_kernel(
    const acc_t<scalar_t>* __restrict__ grad, const scalar_t* __restrict__ logits,
    const acc_t<scalar_t>* __restrict__ bias, const int64_t* __restrict__ labels,
    const acc_t<scalar_t>* __restrict__ aux, const acc_t<scalar_t>* __restrict__ denom,
    scalar_t* __restrict__ grad_logits, acc_t<scalar_t>* __restrict__ grad_aux, int64_t B, int64_t C, int kind,
    int reduction, acc_t<scalar_t> entropy_weight, int64_t ignore_index) {
  using A = acc_t<scalar_t>;
  __shared__ SoftmaxState<A> s_red[kBlock / 32];
  __shared__ Vals<A, 2> s_vals[kBlock / 32];
  __shared__ A s_acc[kBlock / 32];
  const A g_all = reduction == 0 ? A(0) : (reduction == 1 ? grad[0] / denom[0] : grad[0]);  // mean: grad / Σ d
  const int64_t groups = (B + blockDim.y - 1) / blockDim.y;
  for (int64_t g = blockIdx.x; g < groups; g += gridDim.x) {  // uniform trip count in the block
    const auto [r, rr, y, valid, keep] = labeled_row(g, labels, B, C, ignore_index);
    const scalar_t* z = logits + rr * C;
    const A* b = bias + rr * C;
    const A gate = kind == kLearnedMixin && keep ? aux[rr] : A(0);
    const A s = kind == kLearnedMixin && keep ? softplus(gate) : A(0);
    const auto [st, sa] = u_softmax(kind, keep, z, b, s, C, s_red);  // pass 1
    // pass 2: kind 5 Σ exp(a_c - ma) (ma - a_c) (for H); kind 6 Σ t^e
    const A e = kind == kConfReg && keep ? A(1) - acc_exp(b[y]) : A(0);
    Vals<A, 2> v;
    v.v[0] = v.v[1] = A(0);
    if (kind == kLearnedMixin || kind == kConfReg) {
      if (keep) {
        for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
          if (kind == kLearnedMixin) {
            const A ac = s * b[c];
            v.v[0] += acc_exp(ac - sa.m) * (sa.m - ac);
          } else {
            v.v[0] += pow_t(aux[rr * C + c], e);
          }
        }
      }
      v = group_reduce(v, SumOp{}, s_vals);
    }
    // pass 3: the gradient row (and kind 5's per-thread part of the gate's sum)
    A gsum = A(0);
    const A go = keep ? (reduction == 0 ? grad[r] : g_all) : A(0);
    if (valid) {
      scalar_t* o = grad_logits + r * C;
      if (!keep) {  // ignored row: zero gradients
        for (int64_t c = threadIdx.x; c < C; c += blockDim.x) o[c] = static_cast<scalar_t>(A(0));
      } else if (kind == kConfReg) {  // go (softmax(z) - t~)
        const A inv_s = A(1) / st.s;
        const A inv_t = A(1) / v.v[0];
        for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
          const A p = acc_exp(static_cast<A>(z[c]) - st.m) * inv_s;
          o[c] = static_cast<scalar_t>(go * (p - pow_t(aux[rr * C + c], e) * inv_t));
        }
      } else {  // k (softmax(u) - onehot(y)), k = go w for kinds 1-4, go otherwise
        const A inv_s = A(1) / st.s;
        const A k = kind >= 1 && kind <= 4 ? go * reweight(kind, acc_exp(b[y])) : go;
        // kind 5: H = Σ r_c (lse(a) - a_c); -log r_c = (ma - a_c) + log(sa)
        const A log_sa = kind == kLearnedMixin ? acc_log(sa.s) : A(0);
        const A inv_sa = kind == kLearnedMixin ? A(1) / sa.s : A(0);
        const A h = v.v[0] * inv_sa + log_sa;
        for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
          const A bc = kind == kPoE || kind == kLearnedMixin ? b[c] : A(0);
          const A q = acc_exp(u_of(kind, static_cast<A>(z[c]), bc, s) - st.m) * inv_s;
          const A oh = c == y ? A(1) : A(0);
          o[c] = static_cast<scalar_t>(k * (q - oh));
          if (kind == kLearnedMixin) {  // b_c (q_c - onehot(y)_c - ew r_c (log r_c + H))
            const A ac = s * bc;
            const A rc = acc_exp(ac - sa.m) * inv_sa;
            const A nlr = (sa.m - ac) + log_sa;
            gsum += bc * (q - oh - entropy_weight * rc * (h - nlr));
          }
        }
      }
    }
    if (kind == kLearnedMixin) {
      gsum = group_reduce(gsum, SumOp{}, s_acc);
      if (valid && threadIdx.x == 0) grad_aux[r] = keep ? go * softplus_grad(gate) * gsum : A(0);
    }
  }
}

template <typename scalar_t>
void launch_forward(const at::Tensor& logits, const at::Tensor& bias, const at::Tensor& labels, const at::Tensor& aux,
                    at::Tensor& loss, at::Tensor& denom, int kind, int reduction, double entropy_weight,
                    int64_t ignore_index, const c10::cuda::CUDAStream& stream) {
  using A = acc_t<scalar_t>;
  const int64_t B = logits.size(0), C = logits.size(1);
  const RowCfg cfg = class_row_cfg(C, kReduceBlock, kReduceBlock);
  const int64_t groups = (B + cfg.ty - 1) / cfg.ty;
  unsigned grid = 1;
  int64_t chunk = groups;
  at::Tensor partials, counter;
  if (groups > kSingleMaxGroups || B > kSingleMaxRows) {
    chunk = (groups + kMaxPartials - 1) / kMaxPartials;
    grid = static_cast<unsigned>((groups + chunk - 1) / chunk);
    partials = at::empty({2 * static_cast<int64_t>(grid)}, logits.options().dtype(at::kDouble));  // Σ l, Σ d
    counter = completion_counter(logits, stream);
  }
  const bool has_aux = kind == kLearnedMixin || kind == kConfReg;
  bias_loss_forward_kernel<scalar_t><<<grid, dim3(cfg.tx, cfg.ty), 0, stream.stream()>>>(
      logits.const_data_ptr<scalar_t>(), bias.const_data_ptr<A>(), labels.const_data_ptr<int64_t>(),
      has_aux ? aux.const_data_ptr<A>() : nullptr, loss.mutable_data_ptr<A>(), denom.mutable_data_ptr<A>(),
      partials.defined() ? partials.mutable_data_ptr<double>() : nullptr,
      counter.defined() ? counter.mutable_data_ptr<int>() : nullptr, B, C, chunk, kind, reduction,
      static_cast<A>(entropy_weight), ignore_index);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t>
void launch_backward(const at::Tensor& grad, const at::Tensor& logits, const at::Tensor& bias,
                     const at::Tensor& labels, const at::Tensor& aux, const at::Tensor& denom,
                     at::Tensor& grad_logits, at::Tensor& grad_aux, int kind, int reduction, double entropy_weight,
                     int64_t ignore_index, cudaStream_t stream) {
  using A = acc_t<scalar_t>;
  const int64_t B = logits.size(0), C = logits.size(1);
  const RowCfg cfg = class_row_cfg(C, kBlock);
  const bool has_aux = kind == kLearnedMixin || kind == kConfReg;
  bias_loss_backward_kernel<scalar_t><<<grid_for((B + cfg.ty - 1) / cfg.ty), dim3(cfg.tx, cfg.ty), 0, stream>>>(
      grad.const_data_ptr<A>(), logits.const_data_ptr<scalar_t>(), bias.const_data_ptr<A>(),
      labels.const_data_ptr<int64_t>(), has_aux ? aux.const_data_ptr<A>() : nullptr,
      reduction == 1 ? denom.const_data_ptr<A>() : nullptr, grad_logits.mutable_data_ptr<scalar_t>(),
      kind == kLearnedMixin ? grad_aux.mutable_data_ptr<A>() : nullptr, B, C, kind, reduction,
      static_cast<A>(entropy_weight), ignore_index);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

std::tuple<at::Tensor, at::Tensor> bias_loss_forward(const at::Tensor& logits, const at::Tensor& bias,
                                                     const at::Tensor& labels, const at::Tensor& aux, int64_t kind,
                                                     int64_t reduction, double entropy_weight, int64_t ignore_index) {
  checks::bias_loss("bias_loss_forward", at::kCUDA, logits, bias, labels, aux, kind, reduction);
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t B = logits.size(0);
  const auto acc_opts = logits.options().dtype(acc_scalar_type(logits.scalar_type()));
  at::Tensor loss = reduction == 0 ? at::empty({B}, acc_opts) : at::empty(std::vector<int64_t>{}, acc_opts);
  at::Tensor denom = at::empty(std::vector<int64_t>{}, acc_opts);
  // always one launch, B == 0 included: denom (0) and the mean (NaN) / sum (0) are written by the kernel
  const c10::cuda::CUDAStream stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "bias_loss_forward_cuda", [&] {
    launch_forward<scalar_t>(logits, bias, labels, aux, loss, denom, static_cast<int>(kind),
                             static_cast<int>(reduction), entropy_weight, ignore_index, stream);
  });
  return {loss, denom};
}

std::tuple<at::Tensor, at::Tensor> bias_loss_backward(const at::Tensor& grad, const at::Tensor& logits,
                                                      const at::Tensor& bias, const at::Tensor& labels,
                                                      const at::Tensor& aux, const at::Tensor& denom, int64_t kind,
                                                      int64_t reduction, double entropy_weight,
                                                      int64_t ignore_index) {
  checks::bias_loss("bias_loss_backward", at::kCUDA, logits, bias, labels, aux, kind, reduction);
  checks::bias_loss_grad("bias_loss_backward", at::kCUDA, grad, denom, logits, reduction);  // denom: read on the device
  const int64_t B = logits.size(0);
  const at::ScalarType acc_dt = acc_scalar_type(logits.scalar_type());
  const c10::cuda::CUDAGuard guard(logits.device());
  at::Tensor grad_logits = at::empty(logits.sizes(), logits.options());
  at::Tensor grad_aux = at::empty({kind == kLearnedMixin ? B : 0}, logits.options().dtype(acc_dt));
  if (grad_logits.numel() == 0) return {grad_logits, grad_aux};  // B == 0: nothing to write
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "bias_loss_backward_cuda", [&] {
    launch_backward<scalar_t>(grad, logits, bias, labels, aux, denom, grad_logits, grad_aux, static_cast<int>(kind),
                              static_cast<int>(reduction), entropy_weight, ignore_index, stream);
  });
  return {grad_logits, grad_aux};
}

}  // namespace
}  // namespace cuda
}  // namespace cat_fast

TORCH_LIBRARY_IMPL(cat_fast, CUDA, m) {
  m.impl("bias_loss_forward", &cat_fast::cuda::bias_loss_forward);
  m.impl("bias_loss_backward", &cat_fast::cuda::bias_loss_backward);
}
