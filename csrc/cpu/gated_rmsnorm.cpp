// CPU kernels of the gated RMSNorm over the last dimension, computed in fp32 (fp64 for fp64 inputs); the
// exp-heavy silu parts go through ATen's vectorised kernels:
//   y = x * rstd * weight * silu(gate),   rstd = 1 / sqrt(mean(x^2) + eps)
// weight and gate are optional (absent: 1).
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

#include "../checks.h"

namespace gated_delta {
namespace {

using OptTensor = c10::optional<at::Tensor>;

std::tuple<at::Tensor, at::Tensor> gated_rmsnorm_fwd_cpu(const at::Tensor& x, const OptTensor& gate,
                                                         const OptTensor& weight, double eps) {
  const NormSizes sz = check_gated_rmsnorm_args(x, gate, weight, eps);
  const int64_t R = sz.rows, D = sz.D;
  const at::ScalarType acc = acc_dtype(x.scalar_type());
  const at::Tensor xc = x.contiguous();
  // silu(gate) with ATen's vectorised kernel, in the accumulation dtype
  const at::Tensor gc = gate.has_value() ? at::silu(gate->to(acc)).contiguous() : at::Tensor();
  at::Tensor y = at::empty(x.sizes(), x.options());
  at::Tensor rstd = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(acc));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "gated_rmsnorm_fwd_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const at::Tensor wc = weight.has_value() ? weight->to(acc).contiguous() : at::Tensor();
    const scalar_t* xp = xc.data_ptr<scalar_t>();
    const acc_t* gp = gc.defined() ? gc.data_ptr<acc_t>() : nullptr;
    const acc_t* wp = wc.defined() ? wc.data_ptr<acc_t>() : nullptr;
    scalar_t* yp = y.data_ptr<scalar_t>();
    acc_t* rp = rstd.data_ptr<acc_t>();
    at::parallel_for(0, R, std::max<int64_t>(1, 16384 / D), [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) {
        const scalar_t* xr = xp + r * D;
        acc_t ss = 0;
        for (int64_t d = 0; d < D; ++d) ss += static_cast<acc_t>(xr[d]) * static_cast<acc_t>(xr[d]);
        const acc_t rs = acc_t(1) / std::sqrt(ss / acc_t(D) + acc_t(eps));
        rp[r] = rs;
        for (int64_t d = 0; d < D; ++d) {
          acc_t v = static_cast<acc_t>(xr[d]) * rs;
          if (wp != nullptr) v *= wp[d];
          if (gp != nullptr) v *= gp[r * D + d];
          yp[r * D + d] = static_cast<scalar_t>(v);
        }
      }
    });
  });
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> gated_rmsnorm_bwd_cpu(const at::Tensor& dy, const at::Tensor& x,
                                                                     const OptTensor& gate, const OptTensor& weight,
                                                                     const at::Tensor& rstd, double eps) {
  const NormSizes sz = check_gated_rmsnorm_args(x, gate, weight, eps);
  const int64_t R = sz.rows, D = sz.D;
  const at::ScalarType acc = acc_dtype(x.scalar_type());
  check_gated_rmsnorm_grads(x, sz, dy, rstd);
  const at::Tensor xc = x.contiguous(), dyc = dy.contiguous(), rc = rstd.contiguous();
  // With a gate: its silu (vectorised, ATen), and dy n w (per element, filled below) whose silu_backward is dgate.
  const at::Tensor gf = gate.has_value() ? gate->to(acc).contiguous() : at::Tensor();
  const at::Tensor gs = gate.has_value() ? at::silu(gf) : at::Tensor();
  at::Tensor dyn = gate.has_value() ? at::empty(x.sizes(), x.options().dtype(acc)) : at::Tensor();
  at::Tensor dx = at::empty(x.sizes(), x.options());
  // Row blocks with their own partial weight gradients, summed in a fixed order afterwards: deterministic.
  const int64_t block = std::max<int64_t>(1, std::min<int64_t>(256, (R + 63) / 64));
  const int64_t nblocks = (R + block - 1) / block;
  at::Tensor dw_part = weight.has_value() ? at::zeros({std::max<int64_t>(nblocks, 1), D}, x.options().dtype(acc))
                                          : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "gated_rmsnorm_bwd_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const at::Tensor wc = weight.has_value() ? weight->to(acc).contiguous() : at::Tensor();
    const scalar_t* xp = xc.data_ptr<scalar_t>();
    const scalar_t* dyp = dyc.data_ptr<scalar_t>();
    const acc_t* gsp = gs.defined() ? gs.data_ptr<acc_t>() : nullptr;
    const acc_t* wp = wc.defined() ? wc.data_ptr<acc_t>() : nullptr;
    const acc_t* rp = rc.data_ptr<acc_t>();
    scalar_t* dxp = dx.data_ptr<scalar_t>();
    acc_t* dynp = dyn.defined() ? dyn.data_ptr<acc_t>() : nullptr;
    acc_t* dwp = dw_part.defined() ? dw_part.data_ptr<acc_t>() : nullptr;
    at::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
      std::vector<acc_t> dn(D);
      for (int64_t blk = b0; blk < b1; ++blk) {
        acc_t* dwb = dwp != nullptr ? dwp + blk * D : nullptr;
        for (int64_t r = blk * block; r < std::min(R, (blk + 1) * block); ++r) {
          const acc_t rs = rp[r];
          // n = x rstd;  dn = dy * w * s(g);  dx = rstd (dn - n mean(n dn));  dg = dy n w s'(g);  dw += dy n s(g)
          acc_t dot = 0;
          for (int64_t d = 0; d < D; ++d) {
            const int64_t i = r * D + d;
            const acc_t n = static_cast<acc_t>(xp[i]) * rs;
            acc_t gy = static_cast<acc_t>(dyp[i]);
            if (gsp != nullptr) {
              dynp[i] = gy * n * (wp != nullptr ? wp[d] : acc_t(1));
              gy *= gsp[i];
            }
            if (dwb != nullptr) dwb[d] += gy * n;
            if (wp != nullptr) gy *= wp[d];
            dn[d] = gy;
            dot += n * gy;
          }
          dot /= acc_t(D);
          for (int64_t d = 0; d < D; ++d) {
            const int64_t i = r * D + d;
            const acc_t n = static_cast<acc_t>(xp[i]) * rs;
            dxp[i] = static_cast<scalar_t>(rs * (dn[d] - n * dot));
          }
        }
      }
    });
  });
  at::Tensor dgate = gate.has_value() ? at::silu_backward(dyn, gf).to(x.scalar_type()) : at::empty({0}, x.options());
  at::Tensor dweight = weight.has_value() ? dw_part.sum(0).to(weight->scalar_type()) : at::empty({0}, x.options());
  return {dx, dgate, dweight};
}

}  // namespace

TORCH_LIBRARY_IMPL(gated_delta, CPU, m) {
  m.impl("gated_rmsnorm_fwd", &gated_rmsnorm_fwd_cpu);
  m.impl("gated_rmsnorm_bwd", &gated_rmsnorm_bwd_cpu);
}

}  // namespace gated_delta
