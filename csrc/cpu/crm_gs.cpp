// CPU kernels: crm_loss_forward, crm_loss_backward, gs_row_dots, gs_row_combine.
// Contracts: docs/KERNELS.md. Every output element is written by exactly one thread with a fixed
// summation order, so results do not depend on the number of threads.
#include <torch/library.h>

#include <vector>

#include "kernel_utils.h"

namespace cat_fast {
namespace cpu {
namespace {

// ---------------------------------------------------------------------------------------------
// crm_loss

void check_crm(const char* op, const at::Tensor& logits, const at::Tensor& cf_logits, const at::Tensor& labels,
               int64_t reduction) {
  check_cpu_contig(logits, op, "logits");
  check_cpu_contig(cf_logits, op, "cf_logits");
  TORCH_CHECK(logits.dim() == 2, op, ": logits must have shape [B,C], got ", logits.sizes());
  TORCH_CHECK(cf_logits.sizes() == logits.sizes(), op, ": cf_logits must have the shape of logits");
  TORCH_CHECK(cf_logits.scalar_type() == logits.scalar_type(), op, ": cf_logits must have the dtype of logits");
  TORCH_CHECK(logits.size(1) >= 1 || logits.size(0) == 0, op, ": logits need at least one class");
  check_labels(labels, logits.size(0), op);
  TORCH_CHECK(reduction >= 0 && reduction <= 2, op, ": reduction must be 0 (none), 1 (mean) or 2 (sum)");
}

std::tuple<at::Tensor, at::Tensor> crm_loss_forward(const at::Tensor& logits, const at::Tensor& cf_logits,
                                                    const at::Tensor& labels, double a1, double a2,
                                                    int64_t reduction, bool /*detach_weight: backward only*/) {
  check_crm("crm_loss_forward", logits, cf_logits, labels, reduction);
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
        TORCH_CHECK(y >= 0 && y < C, "crm_loss_forward: label ", y, " out of [0, ", C, ")");
        const RowSoftmax<acc_t> st = row_softmax<scalar_t>(z, C);
        const RowSoftmax<acc_t> sc = row_softmax<scalar_t>(cp + i * C, C);
        const acc_t phi = acc_t(1) / st.s;
        const acc_t phi_cf = acc_t(1) / sc.s;
        const acc_t w = std::min(std::max(phi / phi_cf, lo), hi);
        const acc_t ce = st.m + std::log(st.s) - static_cast<acc_t>(z[y]);
        sp[i * 4 + 0] = w;
        sp[i * 4 + 1] = ce;
        sp[i * 4 + 2] = phi;
        sp[i * 4 + 3] = phi_cf;
        lp[i] = w * ce;
      }
    });
    if (reduction != 0) {
      // Serial sum in row order (deterministic), in double.
      double total = 0;
      for (int64_t i = 0; i < B; ++i) total += static_cast<double>(lp[i]);
      if (reduction == 1) total /= static_cast<double>(B);
      *loss.mutable_data_ptr<acc_t>() = static_cast<acc_t>(total);
    }
  });
  return {loss, stats};
}

std::tuple<at::Tensor, at::Tensor> crm_loss_backward(const at::Tensor& grad_in, const at::Tensor& logits,
                                                     const at::Tensor& cf_logits, const at::Tensor& labels,
                                                     const at::Tensor& stats_in, double a1, double a2,
                                                     int64_t reduction, bool detach_weight) {
  check_crm("crm_loss_backward", logits, cf_logits, labels, reduction);
  const int64_t B = logits.size(0), C = logits.size(1);
  const at::ScalarType acc_dt = acc_dtype(logits.scalar_type());
  TORCH_CHECK(reduction == 0 ? grad_in.numel() == B : grad_in.numel() == 1,
              "crm_loss_backward: grad must have shape [B] for reduction none, [] otherwise");
  TORCH_CHECK(stats_in.dim() == 2 && stats_in.size(0) == B && stats_in.size(1) == 4,
              "crm_loss_backward: stats must have shape [B,4]");
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
                           : reduction == 1 ? static_cast<acc_t>(gp[0] / static_cast<acc_t>(B))
                                            : gp[0];
    at::parallel_for(0, B, row_grain(6 * C), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const acc_t go = reduction == 0 ? gp[i] : g_scalar;
        const acc_t w = sp[i * 4 + 0], ce = sp[i * 4 + 1], phi = sp[i * 4 + 2], phi_cf = sp[i * 4 + 3];
        const acc_t ratio = phi / phi_cf;
        const bool active = !detach_weight && lo < ratio && ratio < hi;
        const scalar_t* z = zp + i * C;
        const int64_t y = yp[i];
        TORCH_CHECK(y >= 0 && y < C, "crm_loss_backward: label ", y, " out of [0, ", C, ")");
        const RowSoftmax<acc_t> st = row_softmax<scalar_t>(z, C);
        const acc_t inv_s = acc_t(1) / st.s;
        const acc_t a = go * w;
        // d/dz of the weight term: go * ce / phi_cf * phi * (onehot(argmax) - p)
        const acc_t b = active ? go * ce / phi_cf * phi : acc_t(0);
        scalar_t* o = glp + i * C;
        for (int64_t c = 0; c < C; ++c) {
          const acc_t p = std::exp(static_cast<acc_t>(z[c]) - st.m) * inv_s;
          const acc_t v = a * (p - (c == y ? acc_t(1) : acc_t(0))) + b * ((c == st.argmax ? acc_t(1) : acc_t(0)) - p);
          o[c] = static_cast<scalar_t>(v);
        }
        scalar_t* oc = gcp + i * C;
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

// ---------------------------------------------------------------------------------------------
// gs_cosine_loss primitives

void check_xy(const char* op, const at::Tensor& x, const at::Tensor& y) {
  check_cpu_contig(x, op, "x");
  check_cpu_contig(y, op, "y");
  TORCH_CHECK(x.dim() == 2, op, ": x must have shape [N,K], got ", x.sizes());
  TORCH_CHECK(y.sizes() == x.sizes(), op, ": y must have the shape of x");
  TORCH_CHECK(y.scalar_type() == x.scalar_type(), op, ": y must have the dtype of x");
}

at::Tensor gs_row_dots(const at::Tensor& x, const at::Tensor& y) {
  check_xy("gs_row_dots", x, y);
  const int64_t N = x.size(0), K = x.size(1);
  at::Tensor out = at::empty({N, 3}, x.options().dtype(acc_dtype(x.scalar_type())));
  CAT_FAST_DISPATCH_FLOATING(x.scalar_type(), "gs_row_dots", [&] {
    using acc_t = acc_type<scalar_t>;
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* yp = y.const_data_ptr<scalar_t>();
    acc_t* op = out.mutable_data_ptr<acc_t>();
    at::parallel_for(0, N, row_grain(2 * K), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const scalar_t* a = xp + i * K;
        const scalar_t* b = yp + i * K;
        // One pass, 4 partial sums per dot in a fixed order.
        acc_t xy[4] = {0, 0, 0, 0}, xx[4] = {0, 0, 0, 0}, yy[4] = {0, 0, 0, 0};
        int64_t k = 0;
        for (; k + 4 <= K; k += 4) {
          for (int j = 0; j < 4; ++j) {
            const acc_t u = static_cast<acc_t>(a[k + j]), v = static_cast<acc_t>(b[k + j]);
            xy[j] += u * v;
            xx[j] += u * u;
            yy[j] += v * v;
          }
        }
        for (; k < K; ++k) {
          const acc_t u = static_cast<acc_t>(a[k]), v = static_cast<acc_t>(b[k]);
          xy[0] += u * v;
          xx[0] += u * u;
          yy[0] += v * v;
        }
        op[i * 3 + 0] = (xy[0] + xy[1]) + (xy[2] + xy[3]);
        op[i * 3 + 1] = (xx[0] + xx[1]) + (xx[2] + xx[3]);
        op[i * 3 + 2] = (yy[0] + yy[1]) + (yy[2] + yy[3]);
      }
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> gs_row_combine(const at::Tensor& x, const at::Tensor& y, const at::Tensor& coef_in) {
  check_xy("gs_row_combine", x, y);
  const int64_t N = x.size(0), K = x.size(1);
  TORCH_CHECK(coef_in.dim() == 2 && coef_in.size(0) == N && coef_in.size(1) == 4,
              "gs_row_combine: coef must have shape [N,4], got ", coef_in.sizes());
  const at::Tensor coef = as_contig(coef_in, acc_dtype(x.scalar_type()));
  at::Tensor u = at::empty_like(x);
  at::Tensor v = at::empty_like(x);
  CAT_FAST_DISPATCH_FLOATING(x.scalar_type(), "gs_row_combine", [&] {
    using acc_t = acc_type<scalar_t>;
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* yp = y.const_data_ptr<scalar_t>();
    const acc_t* cp = coef.const_data_ptr<acc_t>();
    scalar_t* up = u.mutable_data_ptr<scalar_t>();
    scalar_t* vp = v.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, N, row_grain(4 * K), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const acc_t c0 = cp[i * 4 + 0], c1 = cp[i * 4 + 1], c2 = cp[i * 4 + 2], c3 = cp[i * 4 + 3];
        const scalar_t* a = xp + i * K;
        const scalar_t* b = yp + i * K;
        scalar_t* uo = up + i * K;
        scalar_t* vo = vp + i * K;
        for (int64_t k = 0; k < K; ++k) {
          const acc_t s = static_cast<acc_t>(a[k]), t = static_cast<acc_t>(b[k]);
          uo[k] = static_cast<scalar_t>(c0 * s + c1 * t);
          vo[k] = static_cast<scalar_t>(c2 * s + c3 * t);
        }
      }
    });
  });
  return {u, v};
}

}  // namespace
}  // namespace cpu
}  // namespace cat_fast

TORCH_LIBRARY_IMPL(cat_fast, CPU, m) {
  m.impl("crm_loss_forward", &cat_fast::cpu::crm_loss_forward);
  m.impl("crm_loss_backward", &cat_fast::cpu::crm_loss_backward);
  m.impl("gs_row_dots", &cat_fast::cpu::gs_row_dots);
  m.impl("gs_row_combine", &cat_fast::cpu::gs_row_combine);
}
