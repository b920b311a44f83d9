// Shared helpers of the CPU kernels (csrc/cpu/<op>.cpp, one file per op with its schema). Helpers
// used by one op only stay in that op's file. Semantics of every op: docs/KERNELS.md.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace cat_fast {
namespace cpu {

// Accumulation type: float for float32/float16/bfloat16, double for float64.
template <typename scalar_t>
using acc_type = at::opmath_type<scalar_t>;

inline at::ScalarType acc_dtype(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

// Elements per parallel chunk (the value of at::internal::GRAIN_SIZE, which lives in the heavy TensorIterator.h).
constexpr int64_t kGrainSize = 32768;

// Number of rows per parallel chunk so that a chunk holds about GRAIN_SIZE elements.
inline int64_t row_grain(int64_t row_len) {
  return std::max<int64_t>(1, kGrainSize / std::max<int64_t>(1, row_len));
}

#define CAT_FAST_DISPATCH_FLOATING(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, TYPE, NAME, __VA_ARGS__)

// Argument checks: csrc/checks/<op>.h (shared with the CUDA kernels).

// Returns the tensor in dtype `dt`, contiguous (a no-op when it already is).
inline at::Tensor as_contig(const at::Tensor& t, at::ScalarType dt) {
  return t.to(dt).contiguous();
}

// Softmax statistics of one row: max value m, index of its first occurrence, s = sum_c exp(z_c - m).
// p_c = exp(z_c - m) / s, logsumexp = m + log(s), max_c p_c = 1 / s.
template <typename acc_t>
struct RowSoftmax {
  acc_t m;
  acc_t s;
  int64_t argmax;
};

template <typename scalar_t, typename acc_t = acc_type<scalar_t>>
inline RowSoftmax<acc_t> row_softmax(const scalar_t* z, int64_t C) {
  acc_t m = static_cast<acc_t>(z[0]);
  int64_t am = 0;
  for (int64_t c = 1; c < C; ++c) {
    const acc_t v = static_cast<acc_t>(z[c]);
    if (v > m) {
      m = v;
      am = c;
    }
  }
  acc_t s = 0;
  for (int64_t c = 0; c < C; ++c) s += std::exp(static_cast<acc_t>(z[c]) - m);
  return {m, s, am};
}

}  // namespace cpu
}  // namespace cat_fast
