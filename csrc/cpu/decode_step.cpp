// CPU kernel of the fused decode step: a few new tokens against a cached recurrent state, updated in place.
// Per batch row b, value head hv (query/key head hv / (HV / H)) and token t:
//   q <- q / sqrt(|q|^2 + 1e-6), k likewise;  g = -exp(A_log) softplus(a + dt_bias);  beta = sigmoid(b) (x2)
//   S <- exp(g) S;  u = beta (v - S^T k);  S <- S + k u^T;  o = scale S^T q
// The same function as the CUDA kernel; used for tests and CPU inference.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "../checks.h"

namespace gated_delta {
namespace {

template <typename acc_t>
acc_t softplus(acc_t x) {
  // log(1 + e^x) without overflow; matches torch's softplus (threshold 20) to rounding.
  return x > acc_t(20) ? x : std::log1p(std::exp(x));
}

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
      std::vector<acc_t> qn(K), kn(K), sk(V), u(V);
      for (int64_t i = lo; i < hi; ++i) {
        const int64_t bb = i / HV, hv = i % HV, h = hv / group;
        acc_t* S = sp + i * K * V;  // [K, V]
        for (int64_t t = 0; t < T; ++t) {
          const int64_t tok = bb * T + t;
          const scalar_t* qr = qp + (tok * H + h) * K;
          const scalar_t* kr = kp + (tok * H + h) * K;
          acc_t qq = 0, kk = 0;
          for (int64_t x = 0; x < K; ++x) {
            qn[x] = static_cast<acc_t>(qr[x]);
            kn[x] = static_cast<acc_t>(kr[x]);
            qq += qn[x] * qn[x];
            kk += kn[x] * kn[x];
          }
          const acc_t rq = acc_t(1) / std::sqrt(qq + acc_t(1e-6)), rk = acc_t(1) / std::sqrt(kk + acc_t(1e-6));
          for (int64_t x = 0; x < K; ++x) {
            qn[x] *= rq;
            kn[x] *= rk;
          }
          const acc_t g = -std::exp(Ap[hv]) * softplus(ap[tok * HV + hv] + dp[hv]);
          const acc_t alpha = std::exp(g);
          acc_t beta = acc_t(1) / (acc_t(1) + std::exp(-bp[tok * HV + hv]));
          if (allow_neg_eigval) beta *= acc_t(2);
          // S <- alpha S;  sk = S^T k
          for (int64_t y = 0; y < V; ++y) sk[y] = 0;
          for (int64_t x = 0; x < K; ++x) {
            acc_t* Sr = S + x * V;
            for (int64_t y = 0; y < V; ++y) {
              Sr[y] *= alpha;
              sk[y] += Sr[y] * kn[x];
            }
          }
          const scalar_t* vr = vp + (tok * HV + hv) * V;
          for (int64_t y = 0; y < V; ++y) u[y] = beta * (static_cast<acc_t>(vr[y]) - sk[y]);
          // S <- S + k u^T;  o = scale S^T q
          scalar_t* orow = op + (tok * HV + hv) * V;
          for (int64_t y = 0; y < V; ++y) sk[y] = 0;  // reused as the output accumulator
          for (int64_t x = 0; x < K; ++x) {
            acc_t* Sr = S + x * V;
            for (int64_t y = 0; y < V; ++y) {
              Sr[y] += kn[x] * u[y];
              sk[y] += Sr[y] * qn[x];
            }
          }
          for (int64_t y = 0; y < V; ++y) orow[y] = static_cast<scalar_t>(acc_t(scale) * sk[y]);
        }
      }
    });
  });
  return o;
}

}  // namespace

TORCH_LIBRARY_IMPL(gated_delta, CPU, m) { m.impl("decode_step", &decode_step_cpu); }

}  // namespace gated_delta
