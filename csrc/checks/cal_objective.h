// Argument checks of cal_objective_forward / cal_objective_backward (docs/KERNELS.md "cal_objective"), shared by
// csrc/cpu/cal_objective.cpp and csrc/cuda/cal_objective.cu (csrc/checks/common.h says how).
#pragma once

#include "checks/common.h"

namespace cat_fast {
namespace checks {

// logits [B,C], labels int64 [B]; backward (`grad` defined): grad [B] of the accumulation dtype.
inline void cal_objective(const char* op, DeviceType device, const at::Tensor& logits, const at::Tensor& labels,
                          const at::Tensor& grad = at::Tensor()) {
  class_logits(op, "logits", logits, device, logits);
  class_labels(op, labels, logits.size(0), device, logits);
  if (grad.defined()) loss_grad(op, grad, logits.size(0), 0, device, logits);
}

}  // namespace checks
}  // namespace cat_fast
