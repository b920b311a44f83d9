// CPU kernels and op schemas of cal_objective (cal_objective_forward, cal_objective_backward).
// Contract: docs/KERNELS.md "cal_objective"; CUDA kernels: csrc/cuda/cal_objective.cu.
// Every output element is written by exactly one thread with a fixed summation order, so results
// do not depend on the number of threads. Rows whose label == ignore_index: 0 and a zero gradient row. Phi's
// subgradient goes to the first index of the row maximum (row_softmax's argmax).
#include <torch/library.h>

#include "checks/cal_objective.h"
#include "kernel_utils.h"

TORCH_LIBRARY_FRAGMENT(cat_fast, m) {
  m.def("cal_objective_forward(Tensor logits, Tensor labels, float gamma, float eta, int ignore_index=-100) -> Tensor");
  m.def("cal_objective_backward(Tensor grad, Tensor logits, Tensor labels, float gamma, float eta, int ignore_index=-100) -> Tensor");
}

namespace cat_fast {
namespace cpu {
namespace {

at::Tensor cal_objective_forward(const at::Tensor& logits, const at::Tensor& labels, double gamma, double eta,
                                 int64_t ignore_index) {
  checks::cal_objective("cal_objective_forward", at::kCPU, logits, labels);
  const int64_t B = logits.size(0), C = logits.size(1);
  at::Tensor out = at::empty({B}, logits.options().dtype(acc_dtype(logits.scalar_type())));
  CAT_FAST_DISPATCH_FLOATING(logits.scalar_type(), "cal_objective_forward", [&] {
    using acc_t = acc_type<scalar_t>;
    const scalar_t* zp = logits.const_data_ptr<scalar_t>();
    const int64_t* yp = labels.const_data_ptr<int64_t>();
    acc_t* op = out.mutable_data_ptr<acc_t>();
    const acc_t g = static_cast<acc_t>(gamma), e = static_cast<acc_t>(eta);
    at::parallel_for(0, B, row_grain(4 * C), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const scalar_t* z = zp + i * C;
        const int64_t y = yp[i];
        if (y == ignore_index) {  // ignored row: 0
          op[i] = acc_t(0);
          continue;
        }
        TORCH_CHECK(y >= 0 && y < C, checks::label_out_of_range("cal_objective_forward", y, C));
        const RowSoftmax<acc_t> st = row_softmax<scalar_t>(z, C);
        const acc_t ce = st.m + std::log(st.s) - static_cast<acc_t>(z[y]);
        op[i] = g * ce + e / st.s;
      }
    });
  });
  return out;
}

at::Tensor cal_objective_backward(const at::Tensor& grad_in, const at::Tensor& logits, const at::Tensor& labels,
                                  double gamma, double eta, int64_t ignore_index) {
  checks::cal_objective("cal_objective_backward", at::kCPU, logits, labels);
  checks::cal_objective_grad("cal_objective_backward", at::kCPU, grad_in, logits);
  const int64_t B = logits.size(0), C = logits.size(1);
  const at::Tensor grad = as_contig(grad_in, acc_dtype(logits.scalar_type()));
  at::Tensor out = at::empty_like(logits);
  CAT_FAST_DISPATCH_FLOATING(logits.scalar_type(), "cal_objective_backward", [&] {
    using acc_t = acc_type<scalar_t>;
    const scalar_t* zp = logits.const_data_ptr<scalar_t>();
    const int64_t* yp = labels.const_data_ptr<int64_t>();
    const acc_t* gp = grad.const_data_ptr<acc_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    const acc_t g = static_cast<acc_t>(gamma), e = static_cast<acc_t>(eta);
    at::parallel_for(0, B, row_grain(4 * C), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const scalar_t* z = zp + i * C;
        const int64_t y = yp[i];
        scalar_t* o = op + i * C;
        if (y == ignore_index) {  // ignored row: zero gradient
          for (int64_t c = 0; c < C; ++c) o[c] = static_cast<scalar_t>(0);
          continue;
        }
        TORCH_CHECK(y >= 0 && y < C, checks::label_out_of_range("cal_objective_backward", y, C));
        const RowSoftmax<acc_t> st = row_softmax<scalar_t>(z, C);  // st.argmax: the FIRST index of the max
        const acc_t inv_s = acc_t(1) / st.s;  // = pmax
        const acc_t gi = gp[i];
        const acc_t e_pmax = e * inv_s;
        for (int64_t c = 0; c < C; ++c) {
          const acc_t p = std::exp(static_cast<acc_t>(z[c]) - st.m) * inv_s;
          const acc_t v = g * (p - (c == y ? acc_t(1) : acc_t(0))) +
                          e_pmax * ((c == st.argmax ? acc_t(1) : acc_t(0)) - p);
          o[c] = static_cast<scalar_t>(gi * v);
        }
      }
    });
  });
  return out;
}

}  // namespace
}  // namespace cpu
}  // namespace cat_fast

TORCH_LIBRARY_IMPL(cat_fast, CPU, m) {
  m.impl("cal_objective_forward", &cat_fast::cpu::cal_objective_forward);
  m.impl("cal_objective_backward", &cat_fast::cpu::cal_objective_backward);
}
