// CPU kernel of the state-pool decode: new tokens of N sequences against their states in a shared pool
// [num_slots, HV, K, V], read and written in place at the slots that state_indices names (checks.h gives the
// slot rules). Per row n, value head hv and token t, the decode step's update (decode_token.h), with the gate and
// beta either given (g, beta) or computed here (g = -exp(A_log) softplus(g + dt_bias), beta = sigmoid(beta)).
// Rows whose read slot is negative are padded (outputs zero); with check_slots=false, a row whose slot or
// num_accepted_tokens is out of range is skipped with NaN outputs, so that no access leaves the pool.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "../checks.h"
#include "../decode_pool.h"
#include "decode_token.h"

namespace gated_delta {
namespace {

at::Tensor decode_pool_cpu(const DecodePoolArgs& a) {
  const PoolSizes sz = check_decode_pool_args(a);
  const at::Tensor& q = a.q;
  const at::Tensor idx = a.state_indices.to(at::kLong).contiguous();
  const at::Tensor acc = a.num_accepted_tokens.has_value() ? a.num_accepted_tokens->to(at::kLong).contiguous()
                                                           : at::Tensor();
  const at::Tensor cu = a.cu_seqlens.has_value() ? a.cu_seqlens->to(at::kLong).contiguous() : at::Tensor();
  if (a.check_slots) check_decode_pool_values(sz, idx, acc, cu);

  const int64_t T = sz.T, H = sz.H, HV = sz.HV, K = sz.K, V = sz.V, N = sz.N, S = sz.S;
  const at::ScalarType ad = acc_dtype(q.scalar_type());
  const at::Tensor qc = q.contiguous(), kc = a.k.contiguous(), vc = a.v.contiguous();
  const at::Tensor gc = a.g.to(ad).contiguous(), bc = a.beta.to(ad).contiguous();
  const at::Tensor Ac = a.A_log.has_value() ? a.A_log->to(ad).contiguous() : at::Tensor();
  const at::Tensor dc = a.dt_bias.has_value() ? a.dt_bias->to(ad).contiguous() : at::Tensor();
  at::Tensor o = at::empty({sz.B, T, HV, V}, a.v.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_pool_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* qp = qc.data_ptr<scalar_t>();
    const scalar_t* kp = kc.data_ptr<scalar_t>();
    const scalar_t* vp = vc.data_ptr<scalar_t>();
    const acc_t* gp = gc.data_ptr<acc_t>();
    const acc_t* bp = bc.data_ptr<acc_t>();
    const acc_t* Ap = Ac.defined() ? Ac.data_ptr<acc_t>() : nullptr;
    const acc_t* dp = dc.defined() ? dc.data_ptr<acc_t>() : nullptr;
    const int64_t* ip = idx.data_ptr<int64_t>();
    const int64_t* accp = acc.defined() ? acc.data_ptr<int64_t>() : nullptr;
    const int64_t* cup = cu.defined() ? cu.data_ptr<int64_t>() : nullptr;
    acc_t* pool = a.state_pool.data_ptr<acc_t>();
    const int64_t slot_stride = a.state_pool.stride(0);
    scalar_t* op = o.data_ptr<scalar_t>();
    const int64_t group = HV / H;
    at::parallel_for(0, N * HV, 1, [&](int64_t lo, int64_t hi) {
      DecodeScratch<acc_t> scratch(K, V);
      for (int64_t i = lo; i < hi; ++i) {
        const int64_t n = i / HV, hv = i % HV, h = hv / group;
        // Token range of the row; unchecked cu_seqlens values are clamped into [0, T_total].
        const int64_t total = sz.B * T;
        const int64_t bos = cup ? std::min(std::max<int64_t>(cup[n], 0), total) : n * T;
        const int64_t eos = cup ? std::min(std::max<int64_t>(cup[n + 1], bos), total) : bos + T;
        if (eos == bos) continue;
        const int64_t col = accp ? accp[n] - 1 : 0;
        const int64_t r = (col >= 0 && col < S) ? ip[n * S + col] : sz.num_slots;  // out of range: invalid
        if (r < 0 || r >= sz.num_slots) {
          const scalar_t fill = r < 0 ? scalar_t(0) : std::numeric_limits<scalar_t>::quiet_NaN();
          for (int64_t tok = bos; tok < eos; ++tok) {
            scalar_t* orow = op + (tok * HV + hv) * V;
            for (int64_t y = 0; y < V; ++y) orow[y] = fill;
          }
          continue;
        }
        const int64_t slot_offset = hv * K * V;
        acc_t* S0 = pool + r * slot_stride + slot_offset;
        // The row works on a private copy when it writes per-token slots, so that its read slot is only changed
        // where a write names it.
        std::vector<acc_t> work;
        acc_t* St = S0;
        if (sz.per_token) {
          work.assign(S0, S0 + K * V);
          St = work.data();
        }
        const acc_t neg_A = Ap ? -std::exp(Ap[hv]) : acc_t(0);
        const acc_t dtb = dp ? dp[hv] : acc_t(0);
        for (int64_t tok = bos; tok < eos; ++tok) {
          const acc_t graw = gp[tok * HV + hv], braw = bp[tok * HV + hv];
          const acc_t alpha = std::exp(a.use_gate_in_kernel ? neg_A * scalar_softplus(graw + dtb) : graw);
          const acc_t b = a.use_beta_sigmoid_in_kernel
                              ? scalar_sigmoid(braw) * (a.allow_neg_eigval ? acc_t(2) : acc_t(1))
                              : braw;
          decode_token(St, K, V, qp + (tok * H + h) * K, kp + (tok * H + h) * K, vp + (tok * HV + hv) * V,
                       op + (tok * HV + hv) * V, alpha, b, acc_t(a.scale), a.use_qk_l2norm_in_kernel, scratch);
          const int64_t t = tok - bos;
          if (sz.per_token && t < S) {
            const int64_t w = ip[n * S + t];
            if (w >= 0 && w < sz.num_slots) std::copy(St, St + K * V, pool + w * slot_stride + slot_offset);
          }
        }
      }
    });
  });
  return o;
}

}  // namespace

TORCH_LIBRARY_IMPL(gated_delta, CPU, m) { m.impl("decode_pool", decode_pool_unboxed<decode_pool_cpu>); }

}  // namespace gated_delta
