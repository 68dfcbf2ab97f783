// CUDA kernels of the gated delta rule ops.
#include <torch/library.h>

#include "../op_impl.h"

namespace gated_delta {

TORCH_LIBRARY_IMPL(gated_delta, CUDA, m) {
  m.impl("fwd", &fwd_impl<core_forward_cuda>);
  m.impl("bwd", &bwd_impl<core_backward_cuda>);
}

}  // namespace gated_delta
