// CPU kernels and op schemas of cmix (cmix_forward, cmix_backward).
// Contract: docs/KERNELS.md "cmix"; CUDA kernels: csrc/cuda/cmix.cu.
// Every output element is written by exactly one thread with a fixed summation order, so results
// do not depend on the number of threads.
#include <torch/library.h>

#include <vector>

#include "checks/cmix.h"
#include "kernel_utils.h"

TORCH_LIBRARY_FRAGMENT(cat_fast, m) {
  m.def("cmix_forward(Tensor h, Tensor lam, Tensor partner) -> Tensor");
  m.def("cmix_backward(Tensor grad, Tensor h, Tensor lam, Tensor partner) -> (Tensor, Tensor)");
}

namespace cat_fast {
namespace cpu {
namespace {

struct LamIndex {
  // lam index of (i, t) = i * sb + t * st; [B] lam: (1, 0), [B,T] lam: (T, 1).
  int64_t sb, st;
};

LamIndex check_cmix(const char* op, const at::Tensor& h, const at::Tensor& lam, const at::Tensor& partner) {
  checks::cmix(op, at::kCPU, h, lam, partner);
  return lam.dim() == 1 ? LamIndex{1, 0} : LamIndex{h.size(1), 1};
}

at::Tensor cmix_forward(const at::Tensor& h, const at::Tensor& lam_in, const at::Tensor& partner) {
  const LamIndex li = check_cmix("cmix_forward", h, lam_in, partner);
  const at::Tensor lam = as_contig(lam_in, acc_dtype(h.scalar_type()));
  const int64_t B = h.size(0), T = h.size(1), D = h.size(2);
  at::Tensor out = at::empty_like(h);
  CAT_FAST_DISPATCH_FLOATING(h.scalar_type(), "cmix_forward", [&] {
    using acc_t = acc_type<scalar_t>;
    const scalar_t* hp = h.const_data_ptr<scalar_t>();
    const acc_t* lp = lam.const_data_ptr<acc_t>();
    const int64_t* pp = partner.const_data_ptr<int64_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, B * T, row_grain(D), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int64_t i = r / T, t = r % T;
        const acc_t l = lp[i * li.sb + t * li.st];
        const acc_t one_m_l = acc_t(1) - l;
        const scalar_t* self = hp + r * D;
        const scalar_t* other = hp + (pp[i] * T + t) * D;
        scalar_t* o = op + r * D;
        for (int64_t d = 0; d < D; ++d) {
          o[d] = static_cast<scalar_t>(l * static_cast<acc_t>(other[d]) + one_m_l * static_cast<acc_t>(self[d]));
        }
      }
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> cmix_backward(const at::Tensor& grad, const at::Tensor& h, const at::Tensor& lam_in,
                                                 const at::Tensor& partner) {
  const LamIndex li = check_cmix("cmix_backward", h, lam_in, partner);
  checks::cmix_grad("cmix_backward", at::kCPU, grad, h);
  const at::ScalarType acc_dt = acc_dtype(h.scalar_type());
  const at::Tensor lam = as_contig(lam_in, acc_dt);
  const int64_t B = h.size(0), T = h.size(1), D = h.size(2);
  at::Tensor grad_h = at::empty_like(h);
  at::Tensor grad_lam = at::empty({B, T}, h.options().dtype(acc_dt));

  // Inverse of partner as CSR: rows i with partner[i] == k, ascending in i (fixed summation order).
  const int64_t* pp = partner.const_data_ptr<int64_t>();
  std::vector<int64_t> offs(B + 1, 0), src(B);
  for (int64_t i = 0; i < B; ++i) ++offs[pp[i] + 1];
  for (int64_t k = 0; k < B; ++k) offs[k + 1] += offs[k];
  {
    std::vector<int64_t> fill(offs.begin(), offs.end() - 1);
    for (int64_t i = 0; i < B; ++i) src[fill[pp[i]]++] = i;
  }

  CAT_FAST_DISPATCH_FLOATING(h.scalar_type(), "cmix_backward", [&] {
    using acc_t = acc_type<scalar_t>;
    const scalar_t* gp = grad.const_data_ptr<scalar_t>();
    const scalar_t* hp = h.const_data_ptr<scalar_t>();
    const acc_t* lp = lam.const_data_ptr<acc_t>();
    scalar_t* ghp = grad_h.mutable_data_ptr<scalar_t>();
    acc_t* glp = grad_lam.mutable_data_ptr<acc_t>();
    at::parallel_for(0, B * T, row_grain(2 * D), [&](int64_t begin, int64_t end) {
      std::vector<acc_t> buf(D);
      for (int64_t r = begin; r < end; ++r) {
        const int64_t k = r / T, t = r % T;
        const scalar_t* g = gp + r * D;
        // grad_lam[k,t] = sum_d (h[partner[k],t,d] - h[k,t,d]) * grad[k,t,d]
        {
          const scalar_t* self = hp + r * D;
          const scalar_t* other = hp + (pp[k] * T + t) * D;
          acc_t s[4] = {0, 0, 0, 0};
          int64_t d = 0;
          for (; d + 4 <= D; d += 4) {
            for (int j = 0; j < 4; ++j) {
              s[j] += (static_cast<acc_t>(other[d + j]) - static_cast<acc_t>(self[d + j])) *
                      static_cast<acc_t>(g[d + j]);
            }
          }
          for (; d < D; ++d) {
            s[0] += (static_cast<acc_t>(other[d]) - static_cast<acc_t>(self[d])) * static_cast<acc_t>(g[d]);
          }
          glp[r] = (s[0] + s[1]) + (s[2] + s[3]);
        }
        // grad_h[k,t,:] = (1 - lam_kt) grad[k,t,:] + sum_{i: partner[i]==k} lam_it grad[i,t,:]
        scalar_t* o = ghp + r * D;
        const acc_t one_m_l = acc_t(1) - lp[k * li.sb + t * li.st];
        const int64_t j0 = offs[k], j1 = offs[k + 1];
        if (j0 == j1) {
          for (int64_t d = 0; d < D; ++d) o[d] = static_cast<scalar_t>(one_m_l * static_cast<acc_t>(g[d]));
          continue;
        }
        for (int64_t d = 0; d < D; ++d) buf[d] = one_m_l * static_cast<acc_t>(g[d]);
        for (int64_t j = j0; j < j1; ++j) {
          const int64_t i = src[j];
          const acc_t l = lp[i * li.sb + t * li.st];
          const scalar_t* gi = gp + (i * T + t) * D;
          for (int64_t d = 0; d < D; ++d) buf[d] += l * static_cast<acc_t>(gi[d]);
        }
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<scalar_t>(buf[d]);
      }
    });
  });
  return {grad_h, grad_lam};
}

}  // namespace
}  // namespace cpu
}  // namespace cat_fast

TORCH_LIBRARY_IMPL(cat_fast, CPU, m) {
  m.impl("cmix_forward", &cat_fast::cpu::cmix_forward);
  m.impl("cmix_backward", &cat_fast::cpu::cmix_backward);
}
