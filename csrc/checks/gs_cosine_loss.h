// Argument checks of gs_row_dots / gs_row_combine (docs/KERNELS.md "gs_row_dots"), shared by
// csrc/cpu/gs_cosine_loss.cpp and csrc/cuda/gs_cosine_loss.cu (csrc/checks/common.h says how).
#pragma once

#include "checks/common.h"

namespace cat_fast {
namespace checks {

// x [N,K], y like x; gs_row_combine (`coef` defined): coef [N,4] of the accumulation dtype.
inline void gs_cosine_loss(const char* op, DeviceType device, const at::Tensor& x, const at::Tensor& y,
                           const at::Tensor& coef = at::Tensor()) {
  input(op, "x", x, device, x);
  input(op, "y", y, device, x);
  TORCH_CHECK(x.dim() == 2, op, ": x: expected a 2-D tensor [N, K], got shape ", x.sizes());
  shape(op, "y", y, x.sizes(), "the shape of x");
  dtype(op, "y", y, x.scalar_type(), "the dtype of x");
  if (!coef.defined()) return;
  acc_input(op, "coef", coef, device, x);
  shape(op, "coef", coef, {x.size(0), 4}, "[N, 4]");
}

}  // namespace checks
}  // namespace cat_fast
