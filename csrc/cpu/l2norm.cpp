// CPU kernels of the L2 normalisation over the last dimension (l2norm_fwd, l2norm_bwd), in ATen's vectorised ops,
// computed in fp32 (fp64 where x or the result is fp64):
//   y = x r,  r = (sum(x^2) + eps)^(-1/2);   dx = r (dy - y (y . dy))
// The results are contiguous, as the CUDA kernels write them.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "../checks.h"

namespace gated_delta {
namespace {

// x in the compute dtype cd and r = (sum(x^2) + eps)^(-1/2) [..., 1]
std::pair<at::Tensor, at::Tensor> unit_parts(const at::Tensor& x, double eps, at::ScalarType cd) {
  at::Tensor xf = x.to(cd);
  at::Tensor r = at::rsqrt(xf.mul(xf).sum(-1, /*keepdim=*/true).add_(eps));
  return {xf, r};
}

at::Tensor l2norm_fwd_cpu(const at::Tensor& x, double eps, c10::optional<at::ScalarType> out_dtype) {
  const at::ScalarType out = check_l2norm_args(x, eps, out_dtype);
  auto [xf, r] = unit_parts(x, eps, l2norm_compute_dtype(x.scalar_type(), out));
  return (xf * r).to(out).contiguous();
}

at::Tensor l2norm_bwd_cpu(const at::Tensor& dy, const at::Tensor& x, double eps,
                          c10::optional<at::ScalarType> out_dtype) {
  const at::ScalarType out = check_l2norm_args(x, eps, out_dtype);
  check_l2norm_grad(x, dy);
  const at::ScalarType cd = l2norm_compute_dtype(x.scalar_type(), out);
  auto [xf, r] = unit_parts(x, eps, cd);
  const at::Tensor y = xf * r, g = dy.to(cd);
  return ((g - y * (y * g).sum(-1, /*keepdim=*/true)) * r).to(out).contiguous();
}

}  // namespace

TORCH_LIBRARY_IMPL(gated_delta, CPU, m) {
  m.impl("l2norm_fwd", &l2norm_fwd_cpu);
  m.impl("l2norm_bwd", &l2norm_bwd_cpu);
}

}  // namespace gated_delta
