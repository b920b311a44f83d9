// Argument checks of cal_step_ (docs/KERNELS.md "cal_step_"), shared by csrc/cpu/cal_step.cpp and
// csrc/cuda/cal_step.cu (csrc/checks/common.h says how).
#pragma once

#include "checks/common.h"

namespace cat_fast {
namespace checks {

// lam float32 / float64 [B] or [B,T], updated in place; grad of its shape (the CUDA kernel: its dtype, contiguous).
inline void cal_step(const char* op, DeviceType device, const at::Tensor& lam, const at::Tensor& grad) {
  input(op, "lam", lam, device, lam);
  TORCH_CHECK(lam.scalar_type() == at::kFloat || lam.scalar_type() == at::kDouble,
              message(op, ": lam: expected dtype float32 or float64, got ", lam.scalar_type()));
  TORCH_CHECK(lam.dim() == 1 || lam.dim() == 2,
              message(op, ": lam: expected a 1-D or 2-D tensor [B] or [B, T], got shape ", lam.sizes()));
  on_device(op, "grad", grad, device, lam);
  shape(op, "grad", grad, lam.sizes(), "the shape of lam");
  if (exact(device)) {  // the CPU kernel converts grad
    dtype(op, "grad", grad, lam.scalar_type(), "the dtype of lam");
    contiguous(op, "grad", grad);
  }
}

}  // namespace checks
}  // namespace cat_fast
