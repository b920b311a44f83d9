// Argument checks of the kernel ops, written once per op and shared by its CPU and CUDA kernels: csrc/checks/<op>.h
// holds one function per kernel op (or family), called first by csrc/cpu/<op>.cpp and csrc/cuda/<op>*.cu with the
// backend's device type. They guard direct `torch.ops.cat_fast.*` calls; the Python wrappers check the user-facing
// arguments before that (cat_fast/ops/validate.py, ValueError / TypeError), and a message here has their form:
// "<op>: <argument>: expected ..., got ...". Where the contract lets the CPU kernels convert a tensor (dtype, layout)
// the CUDA kernels read it as given and `exact(device)` requires it. Host code only: included by .cpp and .cu files.
// Every message is one string made by `message` (below), never streamed.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <type_traits>

namespace cat_fast {
namespace checks {

using c10::DeviceType;

// ---------------------------------------------------------------- messages
// TORCH_CHECK(cond, a, b, ...) streams its arguments through a std::ostringstream compiled into this library; where
// the libstdc++ loaded at run time differs from the compiler's, streaming a number there crashed the process. So a
// check passes one string, message(parts...), built without iostreams, each part written as `operator<<` writes it:
// strings as they are, integers in decimal, doubles as printf's "%g" (the stream default: 6 significant digits),
// shapes as "[2, 3]", dtypes by name ("Float"), devices as "cuda:0".
inline std::string text(const char* s) {
  return s;
}
inline std::string text(const std::string& s) {
  return s;
}
template <typename T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool> && !std::is_same_v<T, char>,
                                       int> = 0>
std::string text(T v) {
  return std::to_string(v);
}
inline std::string text(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", v);
  return buf;
}
inline std::string text(at::IntArrayRef v) {
  std::string out = "[";
  for (size_t i = 0; i < v.size(); ++i) {
    if (i > 0) out += ", ";
    out += std::to_string(v[i]);
  }
  return out + "]";
}
inline std::string text(at::ScalarType t) {
  return c10::toString(t);
}
inline std::string text(const c10::Device& d) {
  return d.str();
}

template <typename... Parts>
std::string message(const Parts&... parts) {
  std::string out;
  (out.append(text(parts)), ...);
  return out;
}

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
  TORCH_CHECK(t.device().type() == device && t.device() == first.device(),
              message(op, ": ", name, ": expected a ", c10::DeviceTypeName(device),
                      " tensor on the device of the first tensor argument (", first.device(), "), got one on ",
                      t.device()));
}

inline void contiguous(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.is_contiguous(), message(op, ": ", name, ": expected a contiguous tensor, got strides ", t.strides()));
}

// A tensor every backend reads as given: on the device, contiguous.
inline void input(const char* op, const char* name, const at::Tensor& t, DeviceType device, const at::Tensor& first) {
  on_device(op, name, t, device, first);
  contiguous(op, name, t);
}

// `what` (+ `whose`): the expected value in words, e.g. "the accumulation dtype" or "the dtype of " "logits".
inline void dtype(const char* op, const char* name, const at::Tensor& t, at::ScalarType expected, const char* what,
                  const char* whose = "") {
  TORCH_CHECK(t.scalar_type() == expected,
              message(op, ": ", name, ": expected dtype ", expected, " (", what, whose, "), got ", t.scalar_type()));
}

inline void shape(const char* op, const char* name, const at::Tensor& t, at::IntArrayRef expected, const char* what,
                  const char* whose = "") {
  TORCH_CHECK(t.sizes() == expected,
              message(op, ": ", name, ": expected shape ", expected, " (", what, whose, "), got ", t.sizes()));
}

// `t` (argument `name`) read as given, of the shape and dtype of `ref` (argument `ref_name`, the op's first tensor).
inline void like(const char* op, const char* name, const at::Tensor& t, DeviceType device, const at::Tensor& ref,
                 const char* ref_name) {
  input(op, name, t, device, ref);
  shape(op, name, t, ref.sizes(), "the shape of ", ref_name);
  dtype(op, name, t, ref.scalar_type(), "the dtype of ", ref_name);
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
  TORCH_CHECK(t.dim() == 2, message(op, ": ", name, ": expected a 2-D tensor [B, C], got shape ", t.sizes()));
  TORCH_CHECK(t.size(1) >= 1 || t.size(0) == 0,
              message(op, ": ", name, ": expected at least one class (C >= 1), got shape ", t.sizes()));
  TORCH_CHECK(device == DeviceType::CPU || t.size(1) <= INT32_MAX,
              message(op, ": ", name, ": expected fewer than 2^31 classes, got ", t.size(1)));
}

// Labels int64 [rows] read as given (their values are checked by the kernels or the Python wrappers).
inline void class_labels(const char* op, const at::Tensor& t, int64_t rows, DeviceType device,
                         const at::Tensor& first) {
  input(op, "labels", t, device, first);
  dtype(op, "labels", t, at::kLong, "class indices");
  TORCH_CHECK(t.dim() == 1 && t.size(0) == rows,
              message(op, ": labels: expected shape [", rows, "] (one per row), got ", t.sizes()));
}

// The message of the CPU kernels' per-row label check (a label neither ignore_index nor in [0, C)).
inline std::string label_out_of_range(const char* op, int64_t y, int64_t C) {
  return message(op, ": label ", y, " out of [0, ", C, ")");
}

// `reduction` of a loss: 0 none, 1 mean, 2 sum.
inline void reduction_code(const char* op, int64_t value) {
  TORCH_CHECK(value >= 0 && value <= 2,
              message(op, ": reduction: expected 0 (none), 1 (mean) or 2 (sum), got ", value));
}

// The incoming gradient of a loss: [rows] for reduction none, [] otherwise; the CUDA kernels read it as given.
inline void loss_grad(const char* op, const at::Tensor& grad, int64_t rows, int64_t reduction, DeviceType device,
                      const at::Tensor& first) {
  acc_input(op, "grad", grad, device, first);
  TORCH_CHECK(reduction == 0 ? grad.numel() == rows : grad.numel() == 1,
              message(op, ": grad: expected shape [", rows, "] for reduction none, [] otherwise, got ", grad.sizes()));
}

}  // namespace checks
}  // namespace cat_fast
