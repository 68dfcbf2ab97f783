// CPU kernel of the fused decode step: a few new tokens against a cached recurrent state, updated in place.
// Per batch row b, value head hv (query/key head hv / (HV / H)) and token t:
//   q <- q / sqrt(|q|^2 + 1e-6), k likewise;  g = -exp(A_log) softplus(a + dt_bias);  beta = sigmoid(b) (x2)
//   S <- exp(g) S;  u = beta (v - S^T k);  S <- S + k u^T;  o = scale S^T q
// The same function as the CUDA kernel; used for tests and CPU inference.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../checks.h"
#include "decode_token.h"

namespace gated_delta {
namespace {

at::Tensor decode_step_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& a,
                           const at::Tensor& b, const at::Tensor& A_log, const at::Tensor& dt_bias,
                           at::Tensor& state, double scale, bool allow_neg_eigval) {
  const DecodeSizes sz = check_decode_step_args(q, k, v, a, b, A_log, dt_bias, state, scale);
  const int64_t B = sz.B, T = sz.T, H = sz.H, HV = sz.HV, K = sz.K, V = sz.V;
  const at::ScalarType acc = acc_dtype(q.scalar_type());
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  const at::Tensor ac = a.to(acc).contiguous(), bc = b.to(acc).contiguous();
  const at::Tensor Ac = A_log.to(acc).contiguous(), dc = dt_bias.to(acc).contiguous();
  at::Tensor o = at::empty({B, T, HV, V}, v.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_step_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* qp = qc.data_ptr<scalar_t>();
    const scalar_t* kp = kc.data_ptr<scalar_t>();
    const scalar_t* vp = vc.data_ptr<scalar_t>();
    const acc_t* ap = ac.data_ptr<acc_t>();
    const acc_t* bp = bc.data_ptr<acc_t>();
    const acc_t* Ap = Ac.data_ptr<acc_t>();
    const acc_t* dp = dc.data_ptr<acc_t>();
    acc_t* sp = state.data_ptr<acc_t>();
    scalar_t* op = o.data_ptr<scalar_t>();
    const int64_t group = HV / H;
    at::parallel_for(0, B * HV, 1, [&](int64_t lo, int64_t hi) {
      DecodeScratch<acc_t> scratch(K, V);
      for (int64_t i = lo; i < hi; ++i) {
        const int64_t bb = i / HV, hv = i % HV, h = hv / group;
        acc_t* S = sp + i * K * V;  // [K, V]
        for (int64_t t = 0; t < T; ++t) {
          const int64_t tok = bb * T + t;
          const acc_t alpha = std::exp(-std::exp(Ap[hv]) * scalar_softplus(ap[tok * HV + hv] + dp[hv]));
          const acc_t beta = scalar_sigmoid(bp[tok * HV + hv]) * (allow_neg_eigval ? acc_t(2) : acc_t(1));
          decode_token(S, K, V, qp + (tok * H + h) * K, kp + (tok * H + h) * K, vp + (tok * HV + hv) * V,
                       op + (tok * HV + hv) * V, alpha, beta, acc_t(scale), /*l2norm=*/true, scratch);
        }
      }
    });
  });
  return o;
}

}  // namespace

TORCH_LIBRARY_IMPL(gated_delta, CPU, m) { m.impl("decode_step", &decode_step_cpu); }

}  // namespace gated_delta
