// Dtype dispatch of the sequential state kernels (state_fwd.cuh, state_rev.cuh), whose launcher templates are
// instantiated one dtype per translation unit in inst/ (they compile in parallel).
#include "../dispatch.cuh"
#include "params.h"

namespace gated_delta {
namespace cuda {

template <class St>
void launch_state_fwd_t(const Params& p, int mode, void* stream);
template <class St>
void launch_state_rev_t(const Params& p, int mode, void* stream);

void launch_state_fwd(const Params& p, DType dtype, int mode, void* stream) {
  if (p.num_units == 0) return;
  GD_DTYPE_SWITCH(dtype, St, [&] { launch_state_fwd_t<St>(p, mode, stream); });
}

void launch_state_rev(const Params& p, DType dtype, int mode, void* stream) {
  if (p.num_units == 0) return;
  GD_DTYPE_SWITCH(dtype, St, [&] { launch_state_rev_t<St>(p, mode, stream); });
}

}  // namespace cuda
}  // namespace gated_delta
