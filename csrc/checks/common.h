// Argument checks of the kernel ops, written once per op and shared by its CPU and CUDA kernels: csrc/checks/<op>.h
// holds one function per kernel op (or family), called first by csrc/cpu/<op>.cpp and csrc/cuda/<op>*.cu with the
// backend's device type. They guard direct `torch.ops.cat_fast.*` calls; the Python wrappers check the user-facing
// arguments before that (cat_fast/ops/validate.py, ValueError / TypeError), and a message here has their form:
// "<op>: <argument>: expected ..., got ...". Where the contract lets the CPU kernels convert a tensor (dtype, layout)
// the CUDA kernels read it as given and `exact(device)` requires it. Host code only: included by .cpp and .cu files.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>
#include <c10/util/Exception.h>

#include <cstdint>

namespace cat_fast {
namespace checks {

using c10::DeviceType;

// Whether the backend reads every tensor as given (CUDA) rather than converting some (CPU, `as_contig`).
inline bool exact(DeviceType device) {
  return device != DeviceType::CPU;
}

// The accumulation dtype of a `t` input: float64 for float64, float32 otherwise.
inline at::ScalarType acc_of(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

// `t` (argument `name`) is a tensor of the backend's device type, on the device of `first` (the op's first tensor).
inline void on_device(const char* op, const char* name, const at::Tensor& t, DeviceType device,
                      const at::Tensor& first) {
  TORCH_CHECK(t.device().type() == device && t.device() == first.device(), op, ": ", name, ": expected a ",
              c10::DeviceTypeName(device), " tensor on the device of the first tensor argument (", first.device(),
              "), got one on ", t.device());
}

inline void contiguous(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, ": expected a contiguous tensor, got strides ", t.strides());
}

// A tensor every backend reads as given: on the device, contiguous.
inline void input(const char* op, const char* name, const at::Tensor& t, DeviceType device, const at::Tensor& first) {
  on_device(op, name, t, device, first);
  contiguous(op, name, t);
}

inline void dtype(const char* op, const char* name, const at::Tensor& t, at::ScalarType expected, const char* what) {
  TORCH_CHECK(t.scalar_type() == expected, op, ": ", name, ": expected dtype ", expected, " (", what, "), got ",
              t.scalar_type());
}

inline void shape(const char* op, const char* name, const at::Tensor& t, at::IntArrayRef expected, const char* what) {
  TORCH_CHECK(t.sizes() == expected, op, ": ", name, ": expected shape ", expected, " (", what, "), got ", t.sizes());
}

// A tensor of the accumulation dtype of `first` that the CPU kernels convert (dtype, layout) and the CUDA kernels
// read as given.
inline void acc_input(const char* op, const char* name, const at::Tensor& t, DeviceType device,
                      const at::Tensor& first) {
  on_device(op, name, t, device, first);
  if (exact(device)) {
    dtype(op, name, t, acc_of(first.scalar_type()), "the accumulation dtype");
    contiguous(op, name, t);
  }
}

// Logits [B, C] read as given: C >= 1 unless B == 0; the CUDA kernels index a row with int32 (C < 2^31).
inline void class_logits(const char* op, const char* name, const at::Tensor& t, DeviceType device,
                         const at::Tensor& first) {
  input(op, name, t, device, first);
  TORCH_CHECK(t.dim() == 2, op, ": ", name, ": expected a 2-D tensor [B, C], got shape ", t.sizes());
  TORCH_CHECK(t.size(1) >= 1 || t.size(0) == 0, op, ": ", name, ": expected at least one class (C >= 1), got shape ",
              t.sizes());
  TORCH_CHECK(device == DeviceType::CPU || t.size(1) <= INT32_MAX, op, ": ", name,
              ": expected fewer than 2^31 classes, got ", t.size(1));
}

// Labels int64 [rows] read as given (their values are checked by the kernels or the Python wrappers).
inline void class_labels(const char* op, const at::Tensor& t, int64_t rows, DeviceType device,
                         const at::Tensor& first) {
  input(op, "labels", t, device, first);
  dtype(op, "labels", t, at::kLong, "class indices");
  TORCH_CHECK(t.dim() == 1 && t.size(0) == rows, op, ": labels: expected shape [", rows, "] (one per row), got ",
              t.sizes());
}

// `reduction` of a loss: 0 none, 1 mean, 2 sum.
inline void reduction_code(const char* op, int64_t value) {
  TORCH_CHECK(value >= 0 && value <= 2, op, ": reduction: expected 0 (none), 1 (mean) or 2 (sum), got ", value);
}

// The incoming gradient of a loss: [rows] for reduction none, [] otherwise; the CUDA kernels read it as given.
inline void loss_grad(const char* op, const at::Tensor& grad, int64_t rows, int64_t reduction, DeviceType device,
                      const at::Tensor& first) {
  acc_input(op, "grad", grad, device, first);
  TORCH_CHECK(reduction == 0 ? grad.numel() == rows : grad.numel() == 1, op, ": grad: expected shape [", rows,
              "] for reduction none, [] otherwise, got ", grad.sizes());
}

}  // namespace checks
}  // namespace cat_fast
