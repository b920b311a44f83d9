// CPU kernels and op schemas of gs_cosine_loss primitives (gs_row_dots, gs_row_combine).
// Contract: docs/KERNELS.md "gs_cosine_loss primitives"; CUDA kernels: csrc/cuda/gs_cosine_loss.cu.
// Every output element is written by exactly one thread with a fixed summation order, so results
// do not depend on the number of threads.
#include <torch/library.h>

#include "checks/gs_cosine_loss.h"
#include "kernel_utils.h"

TORCH_LIBRARY_FRAGMENT(cat_fast, m) {
  m.def("gs_row_dots(Tensor x, Tensor y) -> Tensor");
  m.def("gs_row_combine(Tensor x, Tensor y, Tensor coef) -> (Tensor, Tensor)");
}

namespace cat_fast {
namespace cpu {
namespace {

at::Tensor gs_row_dots(const at::Tensor& x, const at::Tensor& y) {
  checks::gs_cosine_loss("gs_row_dots", at::kCPU, x, y);
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
  checks::gs_cosine_loss("gs_row_combine", at::kCPU, x, y);
  checks::gs_row_combine_coef("gs_row_combine", at::kCPU, coef_in, x);
  const int64_t N = x.size(0), K = x.size(1);
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
  m.impl("gs_row_dots", &cat_fast::cpu::gs_row_dots);
  m.impl("gs_row_combine", &cat_fast::cpu::gs_row_combine);
}
