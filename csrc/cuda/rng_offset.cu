// rng_offset: the Philox offset at which a CUDA generator's next draw starts, also inside a CUDA-graph capture.
//
// Not a kernel, and defined here only (CUDA builds; `cat_fast.ops.fused.rng_offset` says None elsewhere). Outside a
// capture it is the generator's offset (`torch.Generator.get_offset()`). Inside a capture that records the generator,
// where `get_offset()` refuses, it is the offset within the graph that the capture's draws so far have reached: what
// a replay adds to the offset the generator has when it starts. So the difference of two readings is, in and out of
// a capture alike, the numbers drawn between them (`cat_fast.models.PassGenerators` measures its passes' leads so,
// inside the capture of a step, where it needed an eager step of the same rows before).
#include <torch/library.h>
#include <ATen/core/Generator.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>

#include <mutex>
#include <optional>

namespace cat_fast {
namespace cuda {

int64_t rng_offset(const std::optional<at::Generator>& generator) {
  TORCH_CHECK(generator.has_value() && generator->defined(), "rng_offset: generator: expected a CUDA generator, got None");
  TORCH_CHECK(generator->device().is_cuda(), "rng_offset: generator: expected a CUDA generator, got one of ",
              generator->device());
  auto* gen = at::check_generator<at::CUDAGeneratorImpl>(*generator);
  std::lock_guard<std::mutex> lock(gen->mutex_);
  // an increment of 0 reads the state and leaves it as it was
  const at::PhiloxCudaState state = gen->philox_cuda_state(0);
  return state.captured_ ? static_cast<int64_t>(state.offset_intragraph_) : static_cast<int64_t>(state.offset_.val);
}

}  // namespace cuda
}  // namespace cat_fast

TORCH_LIBRARY_FRAGMENT(cat_fast, m) {
  m.def("rng_offset(Generator? generator) -> int", &cat_fast::cuda::rng_offset);
}
