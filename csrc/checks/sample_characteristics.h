// Argument checks of sample_characteristics_forward / _backward (docs/KERNELS.md "sample_characteristics"), shared
// by csrc/cpu/sample_characteristics.cpp and csrc/cuda/sample_characteristics.cu (csrc/checks/common.h says how).
#pragma once

#include "checks/common.h"

namespace cat_fast {
namespace checks {

// logits [B,C] (C >= 2: the margin), labels int64 [B], features [B,H] (H >= 1), class_weights [C,H], features and
// class_weights of the dtype of logits.
inline void sample_characteristics(const char* op, DeviceType device, const at::Tensor& logits,
                                   const at::Tensor& labels, const at::Tensor& features,
                                   const at::Tensor& class_weights) {
  class_logits(op, "logits", logits, device, logits);
  TORCH_CHECK(logits.size(1) >= 2,
              message(op, ": logits: expected at least two classes (the margin), got shape ", logits.sizes()));
  class_labels(op, labels, logits.size(0), device, logits);
  input(op, "features", features, device, logits);
  TORCH_CHECK(features.dim() == 2 && features.size(0) == logits.size(0) && features.size(1) >= 1,
              message(op, ": features: expected shape [B, H] = [", logits.size(0), ", H], H >= 1, got ",
                      features.sizes()));
  input(op, "class_weights", class_weights, device, logits);
  shape(op, "class_weights", class_weights, {logits.size(1), features.size(1)}, "[C, H]");
  dtype(op, "features", features, logits.scalar_type(), "the dtype of logits");
  dtype(op, "class_weights", class_weights, logits.scalar_type(), "the dtype of logits");
}

// The forward's class_stats [C,3] of the accumulation dtype.
inline void sample_characteristics_stats(const char* op, DeviceType device, const at::Tensor& class_stats,
                                         const at::Tensor& logits) {
  input(op, "class_stats", class_stats, device, logits);
  dtype(op, "class_stats", class_stats, acc_of(logits.scalar_type()), "the accumulation dtype");
  shape(op, "class_stats", class_stats, {logits.size(1), 3}, "[C, 3]");
}

// The backward's grad [B, columns] of the accumulation dtype.
inline void sample_characteristics_grad(const char* op, DeviceType device, const at::Tensor& grad,
                                        const at::Tensor& logits, int64_t columns) {
  acc_input(op, "grad", grad, device, logits);
  shape(op, "grad", grad, {logits.size(0), columns}, "[B, 10]: one row of characteristics per row");
}

}  // namespace checks
}  // namespace cat_fast
