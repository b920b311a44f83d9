// Argument checks of cal_objective_forward / cal_objective_backward (docs/KERNELS.md "cal_objective"), shared by
// csrc/cpu/cal_objective.cpp and csrc/cuda/cal_objective.cu (csrc/checks/common.h says how).
#pragma once

#include "checks/common.h"

namespace cat_fast {
namespace checks {

// logits [B,C], labels int64 [B].
inline void cal_objective(const char* op, DeviceType device, const at::Tensor& logits, const at::Tensor& labels) {
  class_logits(op, "logits", logits, device, logits);
  class_labels(op, labels, logits.size(0), device, logits);
}

// The backward's grad [B] of the accumulation dtype.
inline void cal_objective_grad(const char* op, DeviceType device, const at::Tensor& grad, const at::Tensor& logits) {
  loss_grad(op, grad, logits.size(0), 0, device, logits);
}

}  // namespace checks
}  // namespace cat_fast
