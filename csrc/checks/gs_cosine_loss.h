// Argument checks of gs_row_dots / gs_row_combine (docs/KERNELS.md "gs_row_dots"), shared by
// csrc/cpu/gs_cosine_loss.cpp and csrc/cuda/gs_cosine_loss.cu (csrc/checks/common.h says how).
#pragma once

#include "checks/common.h"

namespace cat_fast {
namespace checks {

// x [N,K], y like x.
inline void gs_cosine_loss(const char* op, DeviceType device, const at::Tensor& x, const at::Tensor& y) {
  input(op, "x", x, device, x);
  TORCH_CHECK(x.dim() == 2, message(op, ": x: expected a 2-D tensor [N, K], got shape ", x.sizes()));
  like(op, "y", y, device, x, "x");
}

// gs_row_combine's coef [N,4] of the accumulation dtype.
inline void gs_row_combine_coef(const char* op, DeviceType device, const at::Tensor& coef, const at::Tensor& x) {
  acc_input(op, "coef", coef, device, x);
  shape(op, "coef", coef, {x.size(0), 4}, "[N, 4]");
}

}  // namespace checks
}  // namespace cat_fast
