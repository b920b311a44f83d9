// Argument checks of cmix_forward / cmix_backward (docs/KERNELS.md "cmix"), shared by csrc/cpu/cmix.cpp and the
// CUDA sources csrc/cuda/cmix*.cu (csrc/checks/common.h says how).
#pragma once

#include "checks/common.h"

namespace cat_fast {
namespace checks {

// h [B,T,D]; lam [B] or [B,T] of the accumulation dtype; partner int64 [B] (values in [0, B): read on the CPU only;
// the CUDA kernels trust them, CAT_FAST_DEVICE_CHECKS asserts them on the device).
inline void cmix(const char* op, DeviceType device, const at::Tensor& h, const at::Tensor& lam,
                 const at::Tensor& partner) {
  input(op, "h", h, device, h);
  TORCH_CHECK(h.dim() == 3, message(op, ": h: expected a 3-D tensor [B, T, D], got shape ", h.sizes()));
  const int64_t B = h.size(0), T = h.size(1);
  acc_input(op, "lam", lam, device, h);
  TORCH_CHECK((lam.dim() == 1 && lam.size(0) == B) || (lam.dim() == 2 && lam.size(0) == B && lam.size(1) == T),
              message(op, ": lam: expected shape [B] or [B, T] = [", B, "] or [", B, ", ", T, "], got ", lam.sizes()));
  input(op, "partner", partner, device, h);
  dtype(op, "partner", partner, at::kLong, "row indices");
  TORCH_CHECK(partner.dim() == 1 && partner.size(0) == B,
              message(op, ": partner: expected shape [", B, "] (one partner row per row), got ", partner.sizes()));
  TORCH_CHECK(device == DeviceType::CPU || B <= INT32_MAX,
              message(op, ": h: expected fewer than 2^31 rows, got ", B));
  if (device != DeviceType::CPU) return;
  const int64_t* pp = partner.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < B; ++i) {
    TORCH_CHECK(pp[i] >= 0 && pp[i] < B,
                message(op, ": partner: expected values in [0, ", B, "), got partner[", i, "] = ", pp[i]));
  }
}

// cmix_backward's grad: like h (shape, dtype), contiguous.
inline void cmix_grad(const char* op, DeviceType device, const at::Tensor& grad, const at::Tensor& h) {
  like(op, "grad", grad, device, h, "h");
}

}  // namespace checks
}  // namespace cat_fast
