// CPU kernels and op schemas of crm_loss (crm_loss_forward, crm_loss_backward).
// Contract: docs/KERNELS.md "crm_loss"; CUDA kernels: csrc/cuda/crm_loss.cu.
// Every output element is written by exactly one thread with a fixed summation order, so results
// do not depend on the number of threads. Rows whose label == ignore_index: loss 0, zero gradients, not counted
// by the mean. Phi's subgradient goes to the first index of the row maximum (row_softmax's argmax).
#include <torch/library.h>

#include <vector>

#include "checks/crm_loss.h"
#include "kernel_utils.h"

TORCH_LIBRARY_FRAGMENT(cat_fast, m) {
  m.def("crm_loss_forward(Tensor logits, Tensor cf_logits, Tensor labels, float a1, float a2, int reduction, bool detach_weight, int ignore_index=-100) -> (Tensor, Tensor)");
  m.def("crm_loss_backward(Tensor grad, Tensor logits, Tensor cf_logits, Tensor labels, Tensor stats, float a1, float a2, int reduction, bool detach_weight, int ignore_index=-100) -> (Tensor, Tensor)");
}

namespace cat_fast {
namespace cpu {
namespace {

// Number of rows whose label is not ignore_index (the divisor of the mean).
int64_t count_kept(const int64_t* labels, int64_t B, int64_t ignore_index) {
  int64_t kept = 0;
  for (int64_t i = 0; i < B; ++i) kept += labels[i] != ignore_index;
  return kept;
}

std::tuple<at::Tensor, at::Tensor> crm_loss_forward(const at::Tensor& logits, const at::Tensor& cf_logits,
                                                    const at::Tensor& labels, double a1, double a2,
                                                    int64_t reduction, bool /*detach_weight: backward only*/,
                                                    int64_t ignore_index) {
  checks::crm_loss("crm_loss_forward", at::kCPU, logits, cf_logits, labels, reduction);
  const int64_t B = logits.size(0), C = logits.size(1);
  const auto acc_opts = logits.options().dtype(acc_dtype(logits.scalar_type()));
  at::Tensor stats = at::empty({B, 4}, acc_opts);
  at::Tensor per_row = at::empty({B}, acc_opts);
  at::Tensor loss = reduction == 0 ? per_row : at::empty(std::vector<int64_t>{}, acc_opts);
  CAT_FAST_DISPATCH_FLOATING(logits.scalar_type(), "crm_loss_forward", [&] {
    using acc_t = acc_type<scalar_t>;
    const scalar_t* zp = logits.const_data_ptr<scalar_t>();
    const scalar_t* cp = cf_logits.const_data_ptr<scalar_t>();
    const int64_t* yp = labels.const_data_ptr<int64_t>();
    acc_t* sp = stats.mutable_data_ptr<acc_t>();
    acc_t* lp = per_row.mutable_data_ptr<acc_t>();
    const acc_t lo = static_cast<acc_t>(a1), hi = static_cast<acc_t>(a2);
    at::parallel_for(0, B, row_grain(4 * C), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const scalar_t* z = zp + i * C;
        const int64_t y = yp[i];
        const bool ignored = y == ignore_index;  // loss 0, ce 0 in stats (w, phi, phi_cf as for any row)
        TORCH_CHECK(ignored || (y >= 0 && y < C), checks::label_out_of_range("crm_loss_forward", y, C));
        const RowSoftmax<acc_t> st = row_softmax<scalar_t>(z, C);
        const RowSoftmax<acc_t> sc = row_softmax<scalar_t>(cp + i * C, C);
        const acc_t phi = acc_t(1) / st.s;
        const acc_t phi_cf = acc_t(1) / sc.s;
        const acc_t w = std::min(std::max(phi / phi_cf, lo), hi);
        const acc_t ce = ignored ? acc_t(0) : st.m + std::log(st.s) - static_cast<acc_t>(z[y]);
        sp[i * 4 + 0] = w;
        sp[i * 4 + 1] = ce;
        sp[i * 4 + 2] = phi;
        sp[i * 4 + 3] = phi_cf;
        lp[i] = ignored ? acc_t(0) : w * ce;
      }
    });
    if (reduction != 0) {
      // Serial sum in row order (deterministic), in double; mean divides by the non-ignored rows (0 of them: NaN).
      double total = 0;
      for (int64_t i = 0; i < B; ++i) total += static_cast<double>(lp[i]);
      if (reduction == 1) total /= static_cast<double>(count_kept(yp, B, ignore_index));
      *loss.mutable_data_ptr<acc_t>() = static_cast<acc_t>(total);
    }
  });
  return {loss, stats};
}

std::tuple<at::Tensor, at::Tensor> crm_loss_backward(const at::Tensor& grad_in, const at::Tensor& logits,
                                                     const at::Tensor& cf_logits, const at::Tensor& labels,
                                                     const at::Tensor& stats_in, double a1, double a2,
                                                     int64_t reduction, bool detach_weight, int64_t ignore_index) {
  checks::crm_loss("crm_loss_backward", at::kCPU, logits, cf_logits, labels, reduction);
  checks::crm_loss_grad("crm_loss_backward", at::kCPU, grad_in, stats_in, logits, reduction);
  const int64_t B = logits.size(0), C = logits.size(1);
  const at::ScalarType acc_dt = acc_dtype(logits.scalar_type());
  const at::Tensor grad = as_contig(grad_in, acc_dt);
  const at::Tensor stats = as_contig(stats_in, acc_dt);
  at::Tensor grad_logits = at::empty_like(logits);
  at::Tensor grad_cf = at::empty_like(cf_logits);
  CAT_FAST_DISPATCH_FLOATING(logits.scalar_type(), "crm_loss_backward", [&] {
    using acc_t = acc_type<scalar_t>;
    const scalar_t* zp = logits.const_data_ptr<scalar_t>();
    const scalar_t* cp = cf_logits.const_data_ptr<scalar_t>();
    const int64_t* yp = labels.const_data_ptr<int64_t>();
    const acc_t* gp = grad.const_data_ptr<acc_t>();
    const acc_t* sp = stats.const_data_ptr<acc_t>();
    scalar_t* glp = grad_logits.mutable_data_ptr<scalar_t>();
    scalar_t* gcp = grad_cf.mutable_data_ptr<scalar_t>();
    const acc_t lo = static_cast<acc_t>(a1), hi = static_cast<acc_t>(a2);
    const acc_t g_scalar = reduction == 0 ? acc_t(0)
                           : reduction == 1 ? gp[0] / static_cast<acc_t>(count_kept(yp, B, ignore_index))
                                            : gp[0];
    at::parallel_for(0, B, row_grain(6 * C), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t y = yp[i];
        scalar_t* o = glp + i * C;
        scalar_t* oc = gcp + i * C;
        if (y == ignore_index) {  // ignored row: zero gradients
          for (int64_t c = 0; c < C; ++c) o[c] = oc[c] = static_cast<scalar_t>(0);
          continue;
        }
        const acc_t go = reduction == 0 ? gp[i] : g_scalar;
        const acc_t w = sp[i * 4 + 0], ce = sp[i * 4 + 1], phi = sp[i * 4 + 2], phi_cf = sp[i * 4 + 3];
        const acc_t ratio = phi / phi_cf;
        const bool active = !detach_weight && lo < ratio && ratio < hi;
        const scalar_t* z = zp + i * C;
        TORCH_CHECK(y >= 0 && y < C, checks::label_out_of_range("crm_loss_backward", y, C));
        const RowSoftmax<acc_t> st = row_softmax<scalar_t>(z, C);  // argmax: the FIRST index of the max
        const acc_t inv_s = acc_t(1) / st.s;
        const acc_t a = go * w;
        // d/dz of the weight term: go * ce / phi_cf * phi * (onehot(argmax) - p)
        const acc_t b = active ? go * ce / phi_cf * phi : acc_t(0);
        for (int64_t c = 0; c < C; ++c) {
          const acc_t p = std::exp(static_cast<acc_t>(z[c]) - st.m) * inv_s;
          const acc_t v = a * (p - (c == y ? acc_t(1) : acc_t(0))) + b * ((c == st.argmax ? acc_t(1) : acc_t(0)) - p);
          o[c] = static_cast<scalar_t>(v);
        }
        if (!active) {
          for (int64_t c = 0; c < C; ++c) oc[c] = static_cast<scalar_t>(0);
          continue;
        }
        // - go * ce * phi / phi_cf^2 * phi_cf * (onehot(argmax_cf) - p_cf)
        const scalar_t* zc = cp + i * C;
        const RowSoftmax<acc_t> sc = row_softmax<scalar_t>(zc, C);
        const acc_t inv_sc = acc_t(1) / sc.s;
        const acc_t bc = -go * ce * phi / (phi_cf * phi_cf) * phi_cf;
        for (int64_t c = 0; c < C; ++c) {
          const acc_t p = std::exp(static_cast<acc_t>(zc[c]) - sc.m) * inv_sc;
          oc[c] = static_cast<scalar_t>(bc * ((c == sc.argmax ? acc_t(1) : acc_t(0)) - p));
        }
      }
    });
  });
  return {grad_logits, grad_cf};
}

}  // namespace
}  // namespace cpu
}  // namespace cat_fast

TORCH_LIBRARY_IMPL(cat_fast, CPU, m) {
  m.impl("crm_loss_forward", &cat_fast::cpu::crm_loss_forward);
  m.impl("crm_loss_backward", &cat_fast::cpu::crm_loss_backward);
}
