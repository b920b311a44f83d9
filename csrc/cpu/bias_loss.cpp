// CPU kernels and op schemas of bias_loss (bias_loss_forward, bias_loss_backward): the bias-model losses of
// docs/METHODS.md §4 behind one op pair, `kind` selecting the loss (`checks::BiasLossKind`: 0 PoE, 1-4 reweighting,
// 5 learned-mixin +H, 6 confidence regularisation). Contract: docs/KERNELS.md "bias_loss"; argument checks:
// csrc/checks/bias_loss.h; CUDA kernels: csrc/cuda/bias_loss.cu.
// Every output element is written by exactly one thread with a fixed summation order, and the batch sums (Σ l,
// Σ d) run serially in row order (in double) after the parallel row pass, so results do not depend on the number
// of threads. Rows whose label == ignore_index: l = 0, d = 0, zero gradient rows (their bias[y] is never read).
// Per row, in the acc dtype: max-subtracted exponentials; log r_c = a_c - lse(a) of kind 5 is formed directly (never
// the log of an underflowed probability); softplus and its derivative are torch's (threshold 20).
#include <torch/library.h>

#include <vector>

#include "checks/bias_loss.h"
#include "kernel_utils.h"

TORCH_LIBRARY_FRAGMENT(cat_fast, m) {
  m.def("bias_loss_forward(Tensor logits, Tensor bias, Tensor labels, Tensor aux, int kind, int reduction, float entropy_weight, int ignore_index=-100) -> (Tensor, Tensor)");
  m.def("bias_loss_backward(Tensor grad, Tensor logits, Tensor bias, Tensor labels, Tensor aux, Tensor denom, int kind, int reduction, float entropy_weight, int ignore_index=-100) -> (Tensor, Tensor)");
}

namespace cat_fast {
namespace cpu {
namespace {

using checks::kConfReg;       // aux: the teacher's probabilities [B,C]
using checks::kLearnedMixin;  // aux: the gate [B]
using checks::kPoE;           // l = lse(z + b) - (z + b)_y

inline bool is_reweighted(int64_t kind) {
  return kind >= checks::kReweightedOneMinus && kind <= checks::kReweightedInverseBatch;
}

// torch's softplus (beta 1, threshold 20) and its derivative (exp(x) / (exp(x) + 1) below the threshold).
template <typename A>
inline A softplus(A x) {
  return x > A(20) ? x : std::log1p(std::exp(x));
}
template <typename A>
inline A softplus_grad(A x) {
  if (x > A(20)) return A(1);
  const A e = std::exp(x);
  return e / (e + A(1));
}

// Example weight of the reweighting kinds from p_b = exp(b_y): 1 - p_b (the one-minus kinds) or 1 / p_b.
template <typename A>
inline A reweight(int64_t kind, A pb) {
  return kind == checks::kReweightedOneMinus || kind == checks::kReweightedOneMinusBatch ? A(1) - pb : A(1) / pb;
}

// max m and s = sum_c exp(v(c) - m) of a row given elementwise by v (c = 0..C-1, C >= 1), in increasing c.
template <typename A, typename F>
inline void max_sumexp(const F& v, int64_t C, A& m, A& s) {
  m = v(0);
  for (int64_t c = 1; c < C; ++c) m = std::max(m, v(c));
  s = 0;
  for (int64_t c = 0; c < C; ++c) s += std::exp(v(c) - m);
}

// One row of the op: the logits row z, the bias row b (log-probabilities) and, for kind 5, s = softplus(gate_i).
// u(c) is the row whose softmax the loss's cross-entropy uses: z + b (kind 0), z + s b (kind 5), z (others).
template <typename scalar_t, typename A>
struct Row {
  const scalar_t* z;
  const A* b;
  int64_t kind;
  A s;
  A zc(int64_t c) const { return static_cast<A>(z[c]); }
  A a(int64_t c) const { return s * b[c]; }
  A u(int64_t c) const { return kind == kPoE ? zc(c) + b[c] : kind == kLearnedMixin ? zc(c) + a(c) : zc(c); }
};

std::tuple<at::Tensor, at::Tensor> bias_loss_forward(const at::Tensor& logits, const at::Tensor& bias,
                                                     const at::Tensor& labels, const at::Tensor& aux, int64_t kind,
                                                     int64_t reduction, double entropy_weight, int64_t ignore_index) {
  checks::bias_loss("bias_loss_forward", at::kCPU, logits, bias, labels, aux, kind, reduction);
  const int64_t B = logits.size(0), C = logits.size(1);
  const auto acc_opts = logits.options().dtype(acc_dtype(logits.scalar_type()));
  at::Tensor per_row = at::empty({B}, acc_opts);
  at::Tensor loss = reduction == 0 ? per_row : at::empty(std::vector<int64_t>{}, acc_opts);
  at::Tensor denom = at::empty(std::vector<int64_t>{}, acc_opts);
  CAT_FAST_DISPATCH_FLOATING(logits.scalar_type(), "bias_loss_forward", [&] {
    using acc_t = acc_type<scalar_t>;
    const scalar_t* zp = logits.const_data_ptr<scalar_t>();
    const acc_t* bp = bias.const_data_ptr<acc_t>();
    const int64_t* yp = labels.const_data_ptr<int64_t>();
    const acc_t* xp = kind == kLearnedMixin || kind == kConfReg ? aux.const_data_ptr<acc_t>() : nullptr;
    acc_t* lp = per_row.mutable_data_ptr<acc_t>();
    std::vector<acc_t> dv(static_cast<size_t>(B));
    acc_t* dp = dv.data();
    const acc_t ew = static_cast<acc_t>(entropy_weight);
    at::parallel_for(0, B, row_grain(4 * C), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t y = yp[i];
        if (y == ignore_index) {  // l = 0, d = 0
          lp[i] = dp[i] = acc_t(0);
          continue;
        }
        TORCH_CHECK(y >= 0 && y < C, checks::label_out_of_range("bias_loss_forward", y, C));
        const Row<scalar_t, acc_t> row{zp + i * C, bp + i * C, kind, kind == kLearnedMixin ? softplus(xp[i]) : acc_t(0)};
        acc_t m, s;  // softmax statistics of u
        max_sumexp<acc_t>([&](int64_t c) { return row.u(c); }, C, m, s);
        const acc_t ce = (m - row.u(y)) + std::log(s);  // lse(u) - u_y
        acc_t l = ce, d = acc_t(1);
        if (is_reweighted(kind)) {
          const acc_t w = reweight(kind, std::exp(row.b[y]));
          l = w * ce;
          d = kind <= checks::kReweightedInverse ? w : acc_t(1);  // Σ w·CE / Σ w, else / N
        } else if (kind == kLearnedMixin) {
          // H(a) = sum_c r_c (lse(a) - a_c) = sum_c exp(a_c - ma) (ma - a_c) / sa + log(sa)
          acc_t ma, sa;
          max_sumexp<acc_t>([&](int64_t c) { return row.a(c); }, C, ma, sa);
          acc_t h = 0;
          for (int64_t c = 0; c < C; ++c) {
            const acc_t ac = row.a(c);
            h += std::exp(ac - ma) * (ma - ac);
          }
          h = h / sa + std::log(sa);
          l = ce + ew * h;
        } else if (kind == kConfReg) {
          // lse(z) - sum_c t~_c z_c = sum_c t^e_c (m - z_c) / sum_c t^e_c + log(s)
          const acc_t e = acc_t(1) - std::exp(row.b[y]);
          const acc_t* t = xp + i * C;
          acc_t tsum = 0, x = 0;
          for (int64_t c = 0; c < C; ++c) {
            const acc_t te = std::pow(t[c], e);
            tsum += te;
            x += te * (m - row.zc(c));
          }
          l = x / tsum + std::log(s);
        }
        lp[i] = l;
        dp[i] = d;
      }
    });
    // Serial sums in row order (deterministic), in double; mean = Σ l / Σ d (NaN when Σ d = 0).
    double total = 0, total_d = 0;
    for (int64_t i = 0; i < B; ++i) {
      total += static_cast<double>(lp[i]);
      total_d += static_cast<double>(dp[i]);
    }
    *denom.mutable_data_ptr<acc_t>() = static_cast<acc_t>(total_d);
    if (reduction != 0) {
      if (reduction == 1) total /= total_d;
      *loss.mutable_data_ptr<acc_t>() = static_cast<acc_t>(total);
    }
  });
  return {loss, denom};
}

std::tuple<at::Tensor, at::Tensor> bias_loss_backward(const at::Tensor& grad_in, const at::Tensor& logits,
                                                      const at::Tensor& bias, const at::Tensor& labels,
                                                      const at::Tensor& aux, const at::Tensor& denom_in, int64_t kind,
                                                      int64_t reduction, double entropy_weight,
                                                      int64_t ignore_index) {
  checks::bias_loss("bias_loss_backward", at::kCPU, logits, bias, labels, aux, kind, reduction);
  checks::bias_loss_grad("bias_loss_backward", at::kCPU, grad_in, denom_in, logits, reduction);
  const int64_t B = logits.size(0), C = logits.size(1);
  const at::ScalarType acc_dt = acc_dtype(logits.scalar_type());
  const at::Tensor grad = as_contig(grad_in, acc_dt);
  at::Tensor grad_logits = at::empty_like(logits);
  at::Tensor grad_aux = at::empty({kind == kLearnedMixin ? B : 0}, logits.options().dtype(acc_dt));
  CAT_FAST_DISPATCH_FLOATING(logits.scalar_type(), "bias_loss_backward", [&] {
    using acc_t = acc_type<scalar_t>;
    const scalar_t* zp = logits.const_data_ptr<scalar_t>();
    const acc_t* bp = bias.const_data_ptr<acc_t>();
    const int64_t* yp = labels.const_data_ptr<int64_t>();
    const acc_t* xp = kind == kLearnedMixin || kind == kConfReg ? aux.const_data_ptr<acc_t>() : nullptr;
    const acc_t* gp = grad.const_data_ptr<acc_t>();
    scalar_t* glp = grad_logits.mutable_data_ptr<scalar_t>();
    acc_t* gap = kind == kLearnedMixin ? grad_aux.mutable_data_ptr<acc_t>() : nullptr;
    const acc_t ew = static_cast<acc_t>(entropy_weight);
    const acc_t g_scalar = reduction == 0   ? acc_t(0)
                           : reduction == 1 ? gp[0] / as_contig(denom_in, acc_dt).const_data_ptr<acc_t>()[0]
                                            : gp[0];
    at::parallel_for(0, B, row_grain(6 * C), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t y = yp[i];
        scalar_t* o = glp + i * C;
        if (y == ignore_index) {  // ignored row: zero gradients
          for (int64_t c = 0; c < C; ++c) o[c] = static_cast<scalar_t>(0);
          if (gap != nullptr) gap[i] = acc_t(0);
          continue;
        }
        TORCH_CHECK(y >= 0 && y < C, checks::label_out_of_range("bias_loss_backward", y, C));
        const acc_t go = reduction == 0 ? gp[i] : g_scalar;
        const acc_t gate = kind == kLearnedMixin ? xp[i] : acc_t(0);
        const Row<scalar_t, acc_t> row{zp + i * C, bp + i * C, kind, kind == kLearnedMixin ? softplus(gate) : acc_t(0)};
        acc_t m, s;  // softmax statistics of u
        max_sumexp<acc_t>([&](int64_t c) { return row.u(c); }, C, m, s);
        const acc_t inv_s = acc_t(1) / s;
        if (kind == kConfReg) {  // go (softmax(z) - t~)
          const acc_t e = acc_t(1) - std::exp(row.b[y]);
          const acc_t* t = xp + i * C;
          acc_t tsum = 0;
          for (int64_t c = 0; c < C; ++c) tsum += std::pow(t[c], e);
          const acc_t inv_t = acc_t(1) / tsum;
          for (int64_t c = 0; c < C; ++c) {
            const acc_t p = std::exp(row.u(c) - m) * inv_s;
            o[c] = static_cast<scalar_t>(go * (p - std::pow(t[c], e) * inv_t));
          }
          continue;
        }
        // kinds 0-5: k (softmax(u) - onehot(y)), k = go w for kinds 1-4, go otherwise
        const acc_t k = is_reweighted(kind) ? go * reweight(kind, std::exp(row.b[y])) : go;
        for (int64_t c = 0; c < C; ++c) {
          const acc_t q = std::exp(row.u(c) - m) * inv_s;
          o[c] = static_cast<scalar_t>(k * (q - (c == y ? acc_t(1) : acc_t(0))));
        }
        if (kind != kLearnedMixin) continue;
        // gate: go softplus'(gate) sum_c b_c (q_c - onehot(y)_c - ew r_c (log r_c + H)), log r_c = -(lse(a) - a_c)
        acc_t ma, sa;
        max_sumexp<acc_t>([&](int64_t c) { return row.a(c); }, C, ma, sa);
        const acc_t log_sa = std::log(sa);
        const acc_t inv_sa = acc_t(1) / sa;
        acc_t h = 0;
        for (int64_t c = 0; c < C; ++c) {
          const acc_t ac = row.a(c);
          h += std::exp(ac - ma) * (ma - ac);
        }
        h = h * inv_sa + log_sa;
        acc_t sum = 0;
        for (int64_t c = 0; c < C; ++c) {
          const acc_t ac = row.a(c);
          const acc_t q = std::exp(row.u(c) - m) * inv_s;
          const acc_t r = std::exp(ac - ma) * inv_sa;
          const acc_t nlr = (ma - ac) + log_sa;  // -log r_c
          sum += row.b[c] * (q - (c == y ? acc_t(1) : acc_t(0)) - ew * r * (h - nlr));
        }
        gap[i] = go * softplus_grad(gate) * sum;
      }
    });
  });
  return {grad_logits, grad_aux};
}

}  // namespace
}  // namespace cpu
}  // namespace cat_fast

TORCH_LIBRARY_IMPL(cat_fast, CPU, m) {
  m.impl("bias_loss_forward", &cat_fast::cpu::bias_loss_forward);
  m.impl("bias_loss_backward", &cat_fast::cpu::bias_loss_backward);
}
