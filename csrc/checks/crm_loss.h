// Argument checks of crm_loss_forward / crm_loss_backward (docs/KERNELS.md "crm_loss"), shared by
// csrc/cpu/crm_loss.cpp and csrc/cuda/crm_loss.cu (csrc/checks/common.h says how).
#pragma once

#include "checks/common.h"

namespace cat_fast {
namespace checks {

// logits [B,C], cf_logits like logits, labels int64 [B], reduction 0 / 1 / 2.
inline void crm_loss(const char* op, DeviceType device, const at::Tensor& logits, const at::Tensor& cf_logits,
                     const at::Tensor& labels, int64_t reduction) {
  class_logits(op, "logits", logits, device, logits);
  like(op, "cf_logits", cf_logits, device, logits, "logits");
  class_labels(op, labels, logits.size(0), device, logits);
  reduction_code(op, reduction);
}

// The backward's own inputs: grad ([B] or []) and the forward's stats [B,4], both of the accumulation dtype.
inline void crm_loss_grad(const char* op, DeviceType device, const at::Tensor& grad, const at::Tensor& stats,
                          const at::Tensor& logits, int64_t reduction) {
  loss_grad(op, grad, logits.size(0), reduction, device, logits);
  acc_input(op, "stats", stats, device, logits);
  shape(op, "stats", stats, {logits.size(0), 4}, "[B, 4]: the forward's stats");
}

}  // namespace checks
}  // namespace cat_fast
