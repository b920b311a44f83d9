// CPU kernels and op schemas of cal_step_.
// Contract: docs/KERNELS.md "cal_step_"; CUDA kernels: csrc/cuda/cal_step.cu.
// Every output element is written by exactly one thread with a fixed summation order, so results
// do not depend on the number of threads.
#include <torch/library.h>

#include "checks/cal_step.h"
#include "kernel_utils.h"

TORCH_LIBRARY_FRAGMENT(cat_fast, m) {
  m.def("cal_step_(Tensor(a!) lam, Tensor grad, float lr, float p, float lo, float hi) -> ()");
}

namespace cat_fast {
namespace cpu {
namespace {

void cal_step_(at::Tensor& lam, const at::Tensor& grad_in, double lr, double p, double lo, double hi) {
  checks::cal_step("cal_step_", at::kCPU, lam, grad_in);
  const at::Tensor grad = as_contig(grad_in, lam.scalar_type());
  const int64_t B = lam.size(0);
  const int64_t T = lam.dim() == 2 ? lam.size(1) : 1;
  const bool per_sample = lam.dim() == 1;
  AT_DISPATCH_FLOATING_TYPES(lam.scalar_type(), "cal_step_", [&] {
    using acc_t = scalar_t;
    acc_t* lp = lam.mutable_data_ptr<acc_t>();
    const acc_t* gp = grad.const_data_ptr<acc_t>();
    const acc_t lr_ = static_cast<acc_t>(lr), lo_ = static_cast<acc_t>(lo), hi_ = static_cast<acc_t>(hi);
    const acc_t p_ = static_cast<acc_t>(p);
    const bool p_is_1 = p == 1.0, p_is_2 = p == 2.0;
    auto sign = [](acc_t x) { return x > 0 ? acc_t(1) : (x < 0 ? acc_t(-1) : acc_t(0)); };
    at::parallel_for(0, B, row_grain(4 * T), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        acc_t* x = lp + i * T;
        const acc_t* g = gp + i * T;
        // Row norm n (not needed for p == 1, where dnorm = sign(lam) exactly).
        acc_t n = 0;
        if (!p_is_1) {
          if (per_sample) {
            n = std::abs(x[0]);
          } else if (p_is_2) {
            for (int64_t t = 0; t < T; ++t) n += x[t] * x[t];
            n = std::sqrt(n);
          } else {
            // Scaled by the largest |x| so that |x|^p neither overflows nor underflows.
            acc_t mx = 0;
            for (int64_t t = 0; t < T; ++t) mx = std::max(mx, std::abs(x[t]));
            if (mx > 0) {
              acc_t s = 0;
              for (int64_t t = 0; t < T; ++t) s += std::pow(std::abs(x[t]) / mx, p_);
              n = mx * std::pow(s, acc_t(1) / p_);
            }
          }
        }
        for (int64_t t = 0; t < T; ++t) {
          const acc_t v = x[t];
          acc_t dnorm;
          if (p_is_1) {
            dnorm = sign(v);
          } else if (v == 0 || n == 0) {
            dnorm = 0;
          } else if (p_is_2) {
            dnorm = v / n;
          } else {
            dnorm = sign(v) * std::pow(std::abs(v) / n, p_ - acc_t(1));
          }
          const acc_t u = v + lr_ * (g[t] - dnorm);
          x[t] = std::min(std::max(u, lo_), hi_);
        }
      }
    });
  });
  
}

}  // namespace
}  // namespace cpu
}  // namespace cat_fast

TORCH_LIBRARY_IMPL(cat_fast, CPU, m) {
  m.impl("cal_step_", &cat_fast::cpu::cal_step_);
}
