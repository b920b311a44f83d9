// The variants of the bias_loss kernel ops and their argument checks (docs/KERNELS.md "bias_loss"), shared by
// csrc/cpu/bias_loss.cpp and csrc/cuda/bias_loss.cu (csrc/checks/common.h says how). The numbers are those of
// `cat_fast.ops.BiasLoss` (tests/ops/test_bias_losses.py compares them).
#pragma once

#include "checks/common.h"

namespace cat_fast {
namespace checks {

// The loss a `kind` selects. `aux` is read by kLearnedMixin (the gate [B]) and kConfReg (the teacher's
// probabilities [B,C]) only; the other kinds take an empty tensor.
enum BiasLossKind : int64_t {
  kPoE = 0,                      // CE(log_softmax(z) + b, y)
  kReweightedOneMinus = 1,       // w = 1 - p_b(y), Σ w·CE / Σ w
  kReweightedInverse = 2,        // w = 1 / p_b(y), Σ w·CE / Σ w
  kReweightedOneMinusBatch = 3,  // w = 1 - p_b(y), Σ w·CE / N
  kReweightedInverseBatch = 4,   // w = 1 / p_b(y), Σ w·CE / N
  kLearnedMixin = 5,             // CE(log_softmax(z) + g·b, y) + entropy_weight · H(softmax(g·b)), g = softplus(gate)
  kConfReg = 6,                  // −Σ t̃ log softmax(z), t̃ ∝ t^(1 − p_b(y))
};

// logits [B,C]; bias [B,C] and aux (as `kind` says) of the accumulation dtype; labels int64 [B].
inline void bias_loss(const char* op, DeviceType device, const at::Tensor& logits, const at::Tensor& bias,
                      const at::Tensor& labels, const at::Tensor& aux, int64_t kind, int64_t reduction) {
  class_logits(op, "logits", logits, device, logits);
  const at::ScalarType acc = acc_of(logits.scalar_type());
  input(op, "bias", bias, device, logits);
  shape(op, "bias", bias, logits.sizes(), "the shape of logits");
  dtype(op, "bias", bias, acc, "the accumulation dtype");
  class_labels(op, labels, logits.size(0), device, logits);
  TORCH_CHECK(kind >= kPoE && kind <= kConfReg, message(op, ": kind: expected a variant in [0, 6], got ", kind));
  reduction_code(op, reduction);
  if (kind == kLearnedMixin) {
    input(op, "aux (the gate)", aux, device, logits);
    shape(op, "aux (the gate)", aux, {logits.size(0)}, "[B]: one gate value per row");
    dtype(op, "aux (the gate)", aux, acc, "the accumulation dtype");
  } else if (kind == kConfReg) {
    input(op, "aux (the teacher's probabilities)", aux, device, logits);
    shape(op, "aux (the teacher's probabilities)", aux, logits.sizes(), "the shape of logits");
    dtype(op, "aux (the teacher's probabilities)", aux, acc, "the accumulation dtype");
  }  // other kinds: aux is not read
}

// The backward's own inputs: grad ([B] or []) and, for the mean, the forward's denom [].
inline void bias_loss_grad(const char* op, DeviceType device, const at::Tensor& grad, const at::Tensor& denom,
                           const at::Tensor& logits, int64_t reduction) {
  loss_grad(op, grad, logits.size(0), reduction, device, logits);
  if (reduction != 1) return;  // other reductions do not read denom
  acc_input(op, "denom", denom, device, logits);
  TORCH_CHECK(denom.numel() == 1,
              message(op, ": denom: expected shape [] (the mean's denominator), got ", denom.sizes()));
}

}  // namespace checks
}  // namespace cat_fast
