// Dtype dispatch of the state_rev launchers (the kernels live in state_rev.cuh, instantiated per dtype).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <stdexcept>
#include <string>

#include "params.h"

namespace gated_delta {
namespace cuda {

template <class St>
void launch_state_rev_t(const Params& p, int mode, void* stream);

void launch_state_rev(const Params& p, int dtype, int mode, void* stream) {
  if (p.num_units == 0) return;
  if (dtype == 0) return launch_state_rev_t<__nv_bfloat16>(p, mode, stream);
  if (dtype == 1) return launch_state_rev_t<__half>(p, mode, stream);
  if (dtype == 2) return launch_state_rev_t<float>(p, mode, stream);
  throw std::runtime_error("gated_delta CUDA: unsupported dtype code " + std::to_string(dtype));
}

}  // namespace cuda
}  // namespace gated_delta
