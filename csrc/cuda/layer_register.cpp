// CUDA entry points of the layer ops: argument checks (layer_checks.h, shared with the CPU), CUDA-specific limits,
// allocation, and the launches of layer_*.cu on the current stream under a device guard.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <tuple>

#include "../layer_checks.h"
#include "layer_kernels.h"

namespace gated_delta {
namespace {

using OptTensor = c10::optional<at::Tensor>;
namespace lc = layer_cuda;

int dtype_code(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kBFloat16: return lc::kBFloat16;
    case at::kHalf: return lc::kHalf;
    case at::kFloat: return lc::kFloat;
    default:
      TORCH_CHECK(false, name, " must be bfloat16, float16 or float32 on CUDA (float64 is supported on the CPU only), "
                  "got ", t.scalar_type());
  }
  return lc::kFloat;
}

void check_cuda_launch(cudaError_t e, const char* op) {
  TORCH_CHECK(e == cudaSuccess, "gated_delta::", op, ": CUDA launch failed: ", cudaGetErrorString(e));
}

// A parameter's dtype code: the input dtype's or float32's (check_param_dtype already allowed only these).
int param_code(const at::Tensor& t, int input_code) {
  return t.scalar_type() == at::kFloat ? lc::kFloat : input_code;
}

void check_conv_width(int64_t W) {
  TORCH_CHECK(W <= lc::kMaxConvWidth, "weight must have W <= ", lc::kMaxConvWidth,
              " on CUDA (the convolution window is kept in registers), got W = ", W);
}

at::Tensor offsets_long(const OptTensor& cu) {
  return cu.has_value() ? cu->to(at::kLong).contiguous() : at::Tensor();
}

void fill_conv_inputs(lc::ShortConvParams& p, const ConvSizes& s, const at::Tensor& x, const at::Tensor& weight,
                      const at::Tensor& bias, const at::Tensor& h0, const at::Tensor& cu, bool use_silu) {
  p.x = x.data_ptr();
  p.weight = weight.data_ptr();
  p.bias = bias.defined() ? bias.data_ptr() : nullptr;
  p.h0 = h0.defined() ? h0.data_ptr() : nullptr;
  p.cu = cu.defined() ? cu.data_ptr<int64_t>() : nullptr;
  p.B = s.B;
  p.T = s.T;
  p.D = s.D;
  p.W = s.W;
  p.N = s.N;
  p.dtype = dtype_code(x, "x");
  p.wdtype = param_code(weight, p.dtype);
  p.silu = use_silu;
}

// The bias must have the weight's dtype on CUDA (one parameter type per kernel).
at::Tensor bias_as_weight(const OptTensor& bias, const at::Tensor& weight) {
  if (!bias.has_value()) return at::Tensor();
  return bias->to(weight.scalar_type()).contiguous();
}

std::tuple<at::Tensor, at::Tensor> short_conv_fwd_cuda(const at::Tensor& x, const at::Tensor& weight,
                                                       const OptTensor& bias, const OptTensor& initial_state,
                                                       const OptTensor& cu_seqlens, bool output_final_state,
                                                       bool use_silu) {
  const ConvSizes s = check_short_conv_args(x, weight, bias, initial_state, cu_seqlens);
  check_conv_width(s.W);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous(), bc = bias_as_weight(bias, weight);
  const at::Tensor h0 = initial_state.has_value() ? initial_state->contiguous() : at::Tensor();
  const at::Tensor cu = offsets_long(cu_seqlens);
  at::Tensor y = at::empty({s.B, s.T, s.D}, x.options());
  at::Tensor fs = output_final_state ? at::empty({s.N, s.D, s.W - 1}, x.options()) : at::empty({0}, x.options());
  lc::ShortConvParams p;
  fill_conv_inputs(p, s, xc, wc, bc, h0, cu, use_silu);
  p.y = y.data_ptr();
  p.final_state = output_final_state ? fs.data_ptr() : nullptr;
  check_cuda_launch(lc::short_conv_fwd(p, at::cuda::getCurrentCUDAStream()), "short_conv_fwd");
  return {y, fs};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> short_conv_bwd_cuda(
    const at::Tensor& dy, const OptTensor& d_final_state, const at::Tensor& x, const at::Tensor& weight,
    const OptTensor& bias, const OptTensor& initial_state, const OptTensor& cu_seqlens, bool use_silu) {
  const ConvSizes s = check_short_conv_args(x, weight, bias, initial_state, cu_seqlens);
  check_conv_width(s.W);
  check_device_as(x, "x", dy, "dy");
  TORCH_CHECK(dy.sizes() == x.sizes(), "dy must have the shape of x ", shape_str(x), ", got ", shape_str(dy));
  at::Tensor dfs;
  if (d_final_state.has_value() && d_final_state->numel() > 0) {
    check_device_as(x, "x", *d_final_state, "d_final_state");
    TORCH_CHECK(d_final_state->dim() == 3 && d_final_state->size(0) == s.N && d_final_state->size(1) == s.D &&
                    d_final_state->size(2) == s.W - 1,
                "d_final_state must have shape [N, D, W - 1] = [", s.N, ", ", s.D, ", ", s.W - 1, "], got ",
                shape_str(*d_final_state));
    dfs = d_final_state->to(at::kFloat).contiguous();
  }
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous(), bc = bias_as_weight(bias, weight);
  const at::Tensor dyc = dy.to(x.scalar_type()).contiguous();
  const at::Tensor h0 = initial_state.has_value() ? initial_state->contiguous() : at::Tensor();
  const at::Tensor cu = offsets_long(cu_seqlens);
  const auto f32 = x.options().dtype(at::kFloat);
  at::Tensor dz = at::empty({s.B, s.T, s.D}, f32);
  at::Tensor part = at::empty({lc::short_conv_bwd_num_partials(s.B, s.T), s.W + 1, s.D}, f32);
  at::Tensor dx = at::empty({s.B, s.T, s.D}, x.options());
  at::Tensor dh0 = initial_state.has_value() ? at::empty({s.N, s.D, s.W - 1}, x.options()) : at::empty({0}, x.options());
  lc::ShortConvParams p;
  fill_conv_inputs(p, s, xc, wc, bc, h0, cu, use_silu);
  p.dy = dyc.data_ptr();
  p.dfs = dfs.defined() ? dfs.data_ptr<float>() : nullptr;
  p.dz = dz.data_ptr<float>();
  p.dw_partial = part.data_ptr<float>();
  p.dx = dx.data_ptr();
  p.dh0 = initial_state.has_value() ? dh0.data_ptr() : nullptr;
  check_cuda_launch(lc::short_conv_bwd(p, at::cuda::getCurrentCUDAStream()), "short_conv_bwd");
  const at::Tensor sums = part.sum(0);  // [W + 1, D]
  at::Tensor dweight = sums.narrow(0, 0, s.W).t().to(weight.scalar_type()).contiguous();
  at::Tensor dbias = bias.has_value() ? sums.select(0, s.W).to(bias->scalar_type(), false, /*copy=*/true)
                                      : at::empty({0}, weight.options());
  return {dx, dweight, dbias, dh0};
}

at::Tensor short_conv_update_cuda(const at::Tensor& x, at::Tensor& conv_state, const at::Tensor& weight,
                                  const OptTensor& bias, bool use_silu) {
  const ConvSizes s = check_short_conv_update_args(x, conv_state, weight, bias);
  check_conv_width(s.W);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous(), bc = bias_as_weight(bias, weight);
  at::Tensor y = at::empty({s.B, s.T, s.D}, x.options());
  lc::ShortConvUpdateParams p;
  p.x = xc.data_ptr();
  p.state = conv_state.data_ptr();
  p.weight = wc.data_ptr();
  p.bias = bc.defined() ? bc.data_ptr() : nullptr;
  p.y = y.data_ptr();
  p.B = s.B;
  p.T = s.T;
  p.D = s.D;
  p.W = s.W;
  p.dtype = dtype_code(x, "x");
  p.wdtype = param_code(wc, p.dtype);
  p.silu = use_silu;
  check_cuda_launch(lc::short_conv_update(p, at::cuda::getCurrentCUDAStream()), "short_conv_update");
  return y;
}

// The inputs shared by the gated RMSNorm's forward and backward, contiguous (held here while the kernel runs),
// and the parameters that point at them.
struct NormOperands {
  at::Tensor xc, gc, wc;
  lc::GatedRMSNormParams p;

  NormOperands(const at::Tensor& x, const OptTensor& gate, const OptTensor& weight, const NormSizes& s, double eps)
      : xc(x.contiguous()),
        gc(gate.has_value() ? gate->contiguous() : at::Tensor()),
        wc(weight.has_value() ? weight->contiguous() : at::Tensor()) {
    p.x = xc.data_ptr();
    p.gate = gc.defined() ? gc.data_ptr() : nullptr;
    p.weight = wc.defined() ? wc.data_ptr() : nullptr;
    p.R = s.rows;
    p.D = s.D;
    p.eps = static_cast<float>(eps);
    p.dtype = dtype_code(x, "x");
    p.wdtype = wc.defined() ? param_code(wc, p.dtype) : p.dtype;
  }
};

std::tuple<at::Tensor, at::Tensor> gated_rmsnorm_fwd_cuda(const at::Tensor& x, const OptTensor& gate,
                                                          const OptTensor& weight, double eps) {
  const NormSizes s = check_gated_rmsnorm_args(x, gate, weight, eps);
  const c10::cuda::CUDAGuard guard(x.device());
  NormOperands ops(x, gate, weight, s, eps);
  lc::GatedRMSNormParams& p = ops.p;
  at::Tensor y = at::empty(x.sizes(), x.options());
  at::Tensor rstd = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kFloat));
  p.y = y.data_ptr();
  p.rstd = rstd.data_ptr<float>();
  check_cuda_launch(lc::gated_rmsnorm_fwd(p, at::cuda::getCurrentCUDAStream()), "gated_rmsnorm_fwd");
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> gated_rmsnorm_bwd_cuda(const at::Tensor& dy, const at::Tensor& x,
                                                                      const OptTensor& gate, const OptTensor& weight,
                                                                      const at::Tensor& rstd, double eps) {
  const NormSizes s = check_gated_rmsnorm_args(x, gate, weight, eps);
  check_device_as(x, "x", dy, "dy");
  check_device_as(x, "x", rstd, "rstd");
  TORCH_CHECK(dy.sizes() == x.sizes(), "dy must have the shape of x ", shape_str(x), ", got ", shape_str(dy));
  TORCH_CHECK(rstd.numel() == s.rows && rstd.scalar_type() == at::kFloat, "rstd must be a float32 tensor of ",
              s.rows, " elements (one per row of x), got ", rstd.scalar_type(), " ", shape_str(rstd));
  TORCH_CHECK(!weight.has_value() || s.D <= lc::kMaxNormDim, "x must have D <= ", lc::kMaxNormDim,
              " for the CUDA gated RMSNorm backward with a weight, got D = ", s.D);
  const c10::cuda::CUDAGuard guard(x.device());
  NormOperands ops(x, gate, weight, s, eps);
  lc::GatedRMSNormParams& p = ops.p;
  const at::Tensor dyc = dy.to(x.scalar_type()).contiguous(), rc = rstd.contiguous();
  at::Tensor dx = at::empty(x.sizes(), x.options());
  at::Tensor dgate = gate.has_value() ? at::empty(x.sizes(), x.options()) : at::empty({0}, x.options());
  at::Tensor part = weight.has_value()
                        ? at::empty({lc::gated_rmsnorm_bwd_num_partials(s.rows), s.D}, x.options().dtype(at::kFloat))
                        : at::Tensor();
  p.dy = dyc.data_ptr();
  p.rstd_in = rc.data_ptr<float>();
  p.dx = dx.data_ptr();
  p.dgate = gate.has_value() ? dgate.data_ptr() : nullptr;
  p.dw_partial = part.defined() ? part.data_ptr<float>() : nullptr;
  check_cuda_launch(lc::gated_rmsnorm_bwd(p, at::cuda::getCurrentCUDAStream()), "gated_rmsnorm_bwd");
  at::Tensor dweight = weight.has_value() ? part.sum(0).to(weight->scalar_type()) : at::empty({0}, x.options());
  return {dx, dgate, dweight};
}

at::Tensor decode_step_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& a,
                            const at::Tensor& b, const at::Tensor& A_log, const at::Tensor& dt_bias,
                            at::Tensor& state, double scale, bool allow_neg_eigval) {
  const DecodeSizes s = check_decode_step_args(q, k, v, a, b, A_log, dt_bias, state, scale);
  TORCH_CHECK(lc::decode_supports_head_k(s.K), "q must have K in {16, 32, 64, 128, 256} for the CUDA decode step, got K = ",
              s.K);
  TORCH_CHECK(s.V % lc::kDecodeVMultiple == 0, "v must have V a multiple of ", lc::kDecodeVMultiple,
              " for the CUDA decode step, got V = ", s.V);
  TORCH_CHECK(s.B <= 65535 && s.HV <= 65535, "the CUDA decode step supports B, HV <= 65535, got B = ", s.B,
              ", HV = ", s.HV);
  TORCH_CHECK(reinterpret_cast<uintptr_t>(state.data_ptr()) % 16 == 0,
              "state must be 16-byte aligned for the CUDA decode step (it is read as float4)");
  const c10::cuda::CUDAGuard guard(q.device());
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  const at::Tensor ac = a.contiguous(), bc = b.contiguous();
  const at::Tensor Ac = A_log.contiguous(), dc = dt_bias.contiguous();
  at::Tensor o = at::empty({s.B, s.T, s.HV, s.V}, v.options());
  lc::DecodeParams p;
  p.q = qc.data_ptr();
  p.k = kc.data_ptr();
  p.v = vc.data_ptr();
  p.a = ac.data_ptr();
  p.b = bc.data_ptr();
  p.A_log = Ac.data_ptr();
  p.dt_bias = dc.data_ptr();
  p.state = state.data_ptr<float>();
  p.o = o.data_ptr();
  p.B = s.B;
  p.T = s.T;
  p.H = s.H;
  p.HV = s.HV;
  p.K = s.K;
  p.V = s.V;
  p.dtype = dtype_code(q, "q");
  p.a_dtype = dtype_code(a, "a");
  p.b_dtype = dtype_code(b, "b");
  p.A_dtype = dtype_code(A_log, "A_log");
  p.dt_dtype = dtype_code(dt_bias, "dt_bias");
  p.scale = static_cast<float>(scale);
  p.allow_neg_eigval = allow_neg_eigval;
  check_cuda_launch(lc::decode_step(p, at::cuda::getCurrentCUDAStream()), "decode_step");
  return o;
}

}  // namespace

TORCH_LIBRARY_IMPL(gated_delta, CUDA, m) {
  m.impl("short_conv_fwd", &short_conv_fwd_cuda);
  m.impl("short_conv_bwd", &short_conv_bwd_cuda);
  m.impl("short_conv_update", &short_conv_update_cuda);
  m.impl("gated_rmsnorm_fwd", &gated_rmsnorm_fwd_cuda);
  m.impl("gated_rmsnorm_bwd", &gated_rmsnorm_bwd_cuda);
  m.impl("decode_step", &decode_step_cuda);
}

}  // namespace gated_delta
