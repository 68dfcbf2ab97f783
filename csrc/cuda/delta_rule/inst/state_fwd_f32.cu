// state_fwd kernels for float inputs (one translation unit per dtype: they compile in parallel).
#include "../state_fwd.cuh"

namespace gated_delta {
namespace cuda {
template void launch_state_fwd_t<float>(const Params& p, int mode, void* stream);
}  // namespace cuda
}  // namespace gated_delta
