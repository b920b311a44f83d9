// CMIX forward / backward (docs/KERNELS.md "cmix"): the ops (argument checks: csrc/checks/cmix.h), their outputs
// and registration. The kernels and their launch: cmix_forward.cu, cmix_backward.cu (+ cmix_backward_tile.cuh);
// the tile plan's tuning overrides: cmix_plan.cu; shared helpers: cmix_common.cuh.
//
// Two kernel families.
//
// Tile kernels (the main path: B <= kTileMaxRows, D a multiple of the 16-byte pack width, 16-byte
// aligned pointers). A tile is one token position t and one chunk of W packs (W * 16 bytes) of the
// feature dimension, for ALL B rows of the batch: the block loads h[:, t, chunk] (and grad[:, t, chunk]
// in the backward) once into shared memory, so the partner rows h[partner[i], t, chunk] and the
// grad rows of the matches of a row come from shared memory instead of a second global read. DRAM
// traffic is the minimum: forward reads h and writes out (2N bytes, N = size of h); backward reads
// grad and h and writes grad_h (3N) plus the [B,T] grad_lam. Blocks are persistent (grid <= resident
// blocks) and software-pipelined: the 16-byte loads of the block's next tile are issued into
// registers before the current tile is computed from shared memory (optional, CAT_FAST_CMIX_PLAN
// fwd_async / bwd_async, sm_80+: issued as cp.async copies into a second shared-memory stage instead, so
// no registers hold prefetched data; same arithmetic, same results). Each thread owns a fixed pack
// column j of the chunk and the rows b = r, r + R, r + 2R, ... (r = thread / W, R = threads / W).
//   forward:  tile sequence u = (t, c), c fastest, grid-strided over blocks.
//   backward: a unit is (t, split s): the chunks [c0(s), c1(s)) of token t, walked in order by one
//             block, so grad_lam[b,t] (a dot product over d) is reduced inside the block: per thread
//             over its packs in chunk order, then over the W lanes of the row by a fixed xor
//             butterfly. One launch when T is large enough to fill the GPU (S = 1 split). For small T
//             the d chunks are split over S blocks, each writing its partial dot products to a
//             [S,B,T] workspace that a second tiny kernel sums in split order (2 launches).
//   The matches {i : partner[i] == k} of every row k are built once per block, in increasing i
//   (the summation order of grad_h), as a CSR list in shared memory. When every row has exactly one
//   match (a permutation, CAT's default) a block-uniform flag selects the same arithmetic without the
//   match loop, so the loads and math of a thread's rows are straight-line code.
//
// Row kernels (fallback: B > kTileMaxRows, D not a multiple of the pack width, misaligned pointers).
// Both walk the B*T rows in (t, b) order (b fastest): the blocks in flight at any moment cover a few
// token positions for the whole batch, so the partner rows h[partner[i], t, :] and grad[i, t, :]
// they re-read are mostly L2 hits.
//
// Numerics are the same in both families: every output element is computed in the accumulation
// type from the same products in the same order (grad_h: (1 - lam_k) g_k, then + lam_i g_i over the
// matches i in increasing order), except the order of the d-sum of grad_lam. Everything is
// deterministic (no float atomics, fixed reduction orders).
#include "checks/cmix.h"
#include "cmix_common.cuh"

namespace cat_fast {
namespace cuda {
namespace {

at::Tensor cmix_forward(const at::Tensor& h, const at::Tensor& lam, const at::Tensor& partner) {
  checks::cmix("cmix_forward", at::kCUDA, h, lam, partner);
  const c10::cuda::CUDAGuard guard(h.device());
  auto out = at::empty(h.sizes(), h.options());
  if (out.numel() == 0) return out;
  const bool per_token = lam.dim() == 2;
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  cmix_impl::forward(h, lam, partner, out, per_token, stream);
  return out;
}

std::tuple<at::Tensor, at::Tensor> cmix_backward(const at::Tensor& grad, const at::Tensor& h, const at::Tensor& lam,
                                                 const at::Tensor& partner) {
  checks::cmix("cmix_backward", at::kCUDA, h, lam, partner);
  checks::cmix_grad("cmix_backward", at::kCUDA, grad, h);
  const c10::cuda::CUDAGuard guard(h.device());
  const int64_t B = h.size(0), T = h.size(1);
  auto grad_h = at::empty(h.sizes(), h.options());
  auto grad_lam = at::empty({B, T}, h.options().dtype(acc_scalar_type(h.scalar_type())));
  if (B * T == 0) return {grad_h, grad_lam};
  const bool per_token = lam.dim() == 2;
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  cmix_impl::backward(grad, h, lam, partner, grad_h, grad_lam, per_token, stream);
  return {grad_h, grad_lam};
}

}  // namespace
}  // namespace cuda
}  // namespace cat_fast

TORCH_LIBRARY_IMPL(cat_fast, CUDA, m) {
  m.impl("cmix_forward", &cat_fast::cuda::cmix_forward);
  m.impl("cmix_backward", &cat_fast::cuda::cmix_backward);
}
