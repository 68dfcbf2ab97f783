// Validation of the arguments of the layer ops (short convolution, gated RMSNorm, decode step), shared by the
// CPU and CUDA backends. Errors name the argument, what was expected and what came.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>

#include "checks.h"

namespace gated_delta {

// Tensors of one call must share a device; `ref_name` names the reference argument in the message.
inline void check_device_as(const at::Tensor& ref, const char* ref_name, const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device() == ref.device(), name, " must be on the same device as ", ref_name, " (", ref.device(),
              "), got ", t.device());
}

// The accumulation dtype of an input dtype: float64 for float64, float32 otherwise.
inline at::ScalarType acc_dtype(at::ScalarType s) { return s == at::kDouble ? at::kDouble : at::kFloat; }

// A parameter (weight, bias) may have the dtype of the input or float32 (an fp32 master weight under autocast).
inline void check_param_dtype(const at::Tensor& p, const char* name, at::ScalarType input_dtype,
                              const char* input_name) {
  TORCH_CHECK(p.scalar_type() == input_dtype || p.scalar_type() == at::kFloat, name, " must have the dtype of ",
              input_name, " (", input_dtype, ") or float32, got ", p.scalar_type());
}

// ---- causal depthwise short convolution ----

struct ConvSizes {
  int64_t B, T, D, W, N;
};

inline ConvSizes check_short_conv_args(const at::Tensor& x, const at::Tensor& weight,
                                       const c10::optional<at::Tensor>& bias,
                                       const c10::optional<at::Tensor>& initial_state,
                                       const c10::optional<at::Tensor>& cu_seqlens) {
  TORCH_CHECK(x.dim() == 3, "x must have shape [B, T, D] (3 dimensions), got ", shape_str(x));
  TORCH_CHECK(is_float_dtype(x.scalar_type()), "x must be float64, float32, bfloat16 or float16, got ",
              x.scalar_type());
  const int64_t B = x.size(0), T = x.size(1), D = x.size(2);
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == D && weight.size(1) >= 1,
              "weight must have shape [D, W] = [", D, ", W] with W >= 1, got ", shape_str(weight));
  const int64_t W = weight.size(1);
  check_device_as(x, "x", weight, "weight");
  check_param_dtype(weight, "weight", x.scalar_type(), "x");
  if (bias.has_value()) {
    check_device_as(x, "x", *bias, "bias");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == D, "bias must have shape [D] = [", D, "], got ",
                shape_str(*bias));
    check_param_dtype(*bias, "bias", x.scalar_type(), "x");
  }
  int64_t N = B;
  if (cu_seqlens.has_value()) {
    const at::Tensor& cu = *cu_seqlens;
    check_device_as(x, "x", cu, "cu_seqlens");
    TORCH_CHECK(cu.dim() == 1 && cu.size(0) >= 2, "cu_seqlens must be a 1-D tensor [N + 1] with N >= 1, got ",
                shape_str(cu));
    TORCH_CHECK(cu.scalar_type() == at::kLong || cu.scalar_type() == at::kInt,
                "cu_seqlens must be int32 or int64, got ", cu.scalar_type());
    TORCH_CHECK(B == 1, "cu_seqlens requires a packed batch with B = 1, got x of shape ", shape_str(x));
    N = cu.size(0) - 1;
    // On the CPU the values are checked here; on CUDA reading them would synchronise the stream, so the kernels
    // clamp every index they derive from them instead.
    if (cu.device().is_cpu()) check_cu_seqlens_values(cu, T, "cu_seqlens");
  }
  if (initial_state.has_value()) {
    const at::Tensor& h0 = *initial_state;
    check_device_as(x, "x", h0, "initial_state");
    TORCH_CHECK(h0.dim() == 3 && h0.size(0) == N && h0.size(1) == D && h0.size(2) == W - 1,
                "initial_state must have shape [N, D, W - 1] = [", N, ", ", D, ", ", W - 1, "], got ",
                shape_str(h0));
    TORCH_CHECK(h0.scalar_type() == x.scalar_type(), "initial_state must have the dtype of x (", x.scalar_type(),
                "), got ", h0.scalar_type());
  }
  return ConvSizes{B, T, D, W, N};
}

inline ConvSizes check_short_conv_update_args(const at::Tensor& x, const at::Tensor& conv_state,
                                              const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  const ConvSizes s = check_short_conv_args(x, weight, bias, c10::nullopt, c10::nullopt);
  check_device_as(x, "x", conv_state, "conv_state");
  TORCH_CHECK(conv_state.dim() == 3 && conv_state.size(0) == s.B && conv_state.size(1) == s.D &&
                  conv_state.size(2) == s.W - 1,
              "conv_state must have shape [B, D, W - 1] = [", s.B, ", ", s.D, ", ", s.W - 1, "], got ",
              shape_str(conv_state));
  TORCH_CHECK(conv_state.scalar_type() == x.scalar_type(), "conv_state must have the dtype of x (",
              x.scalar_type(), "), got ", conv_state.scalar_type());
  TORCH_CHECK(conv_state.is_contiguous(), "conv_state must be contiguous (it is updated in place), got strides ",
              conv_state.strides());
  return s;
}

// ---- gated RMSNorm ----

struct NormSizes {
  int64_t rows, D;
};

inline NormSizes check_gated_rmsnorm_args(const at::Tensor& x, const c10::optional<at::Tensor>& gate,
                                          const c10::optional<at::Tensor>& weight, double eps) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) >= 1, "x must have shape [..., D] with D >= 1, got ", shape_str(x));
  TORCH_CHECK(is_float_dtype(x.scalar_type()), "x must be float64, float32, bfloat16 or float16, got ",
              x.scalar_type());
  const int64_t D = x.size(-1);
  if (gate.has_value()) {
    check_device_as(x, "x", *gate, "gate");
    TORCH_CHECK(gate->sizes() == x.sizes(), "gate must have the shape of x ", shape_str(x), ", got ",
                shape_str(*gate));
    TORCH_CHECK(gate->scalar_type() == x.scalar_type(), "gate must have the dtype of x (", x.scalar_type(),
                "), got ", gate->scalar_type());
  }
  if (weight.has_value()) {
    check_device_as(x, "x", *weight, "weight");
    TORCH_CHECK(weight->dim() == 1 && weight->size(0) == D, "weight must have shape [D] = [", D, "], got ",
                shape_str(*weight));
    check_param_dtype(*weight, "weight", x.scalar_type(), "x");
  }
  TORCH_CHECK(std::isfinite(eps) && eps >= 0, "eps must be a finite number >= 0, got ", eps);
  return NormSizes{D == 0 ? 0 : x.numel() / D, D};
}

// ---- fused decode step ----

struct DecodeSizes {
  int64_t B, T, H, HV, K, V;
};

inline DecodeSizes check_decode_step_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                          const at::Tensor& a, const at::Tensor& b, const at::Tensor& A_log,
                                          const at::Tensor& dt_bias, const at::Tensor& state, double scale) {
  TORCH_CHECK(q.dim() == 4, "q must have shape [B, T, H, K] (4 dimensions), got ", shape_str(q));
  TORCH_CHECK(is_float_dtype(q.scalar_type()), "q must be float64, float32, bfloat16 or float16, got ",
              q.scalar_type());
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), K = q.size(3);
  TORCH_CHECK(H >= 1 && K >= 1, "q must have H >= 1 and K >= 1, got ", shape_str(q));
  TORCH_CHECK(k.sizes() == q.sizes(), "k must have the shape of q [B, T, H, K] = ", shape_str(q), ", got ",
              shape_str(k));
  TORCH_CHECK(v.dim() == 4 && v.size(0) == B && v.size(1) == T, "v must have shape [B, T, HV, V] with B=", B,
              ", T=", T, ", got ", shape_str(v));
  const int64_t HV = v.size(2), V = v.size(3);
  TORCH_CHECK(HV >= 1 && HV % H == 0 && V >= 1, "v must have shape [B, T, HV, V] with HV a multiple of H=", H,
              " and V >= 1, got ", shape_str(v));
  TORCH_CHECK(k.scalar_type() == q.scalar_type(), "k must have the dtype of q (", q.scalar_type(), "), got ",
              k.scalar_type());
  TORCH_CHECK(v.scalar_type() == q.scalar_type(), "v must have the dtype of q (", q.scalar_type(), "), got ",
              v.scalar_type());
  check_same_device(q, k, "k");
  check_same_device(q, v, "v");
  check_same_device(q, a, "a");
  check_same_device(q, b, "b");
  check_same_device(q, A_log, "A_log");
  check_same_device(q, dt_bias, "dt_bias");
  check_same_device(q, state, "state");
  TORCH_CHECK(a.dim() == 3 && a.size(0) == B && a.size(1) == T && a.size(2) == HV, "a must have shape [B, T, HV] = [",
              B, ", ", T, ", ", HV, "], got ", shape_str(a));
  TORCH_CHECK(b.dim() == 3 && b.size(0) == B && b.size(1) == T && b.size(2) == HV, "b must have shape [B, T, HV] = [",
              B, ", ", T, ", ", HV, "], got ", shape_str(b));
  TORCH_CHECK(is_float_dtype(a.scalar_type()), "a must be a floating-point tensor, got ", a.scalar_type());
  TORCH_CHECK(is_float_dtype(b.scalar_type()), "b must be a floating-point tensor, got ", b.scalar_type());
  TORCH_CHECK(A_log.dim() == 1 && A_log.size(0) == HV, "A_log must have shape [HV] = [", HV, "], got ",
              shape_str(A_log));
  TORCH_CHECK(dt_bias.dim() == 1 && dt_bias.size(0) == HV, "dt_bias must have shape [HV] = [", HV, "], got ",
              shape_str(dt_bias));
  TORCH_CHECK(is_float_dtype(A_log.scalar_type()), "A_log must be a floating-point tensor, got ",
              A_log.scalar_type());
  TORCH_CHECK(is_float_dtype(dt_bias.scalar_type()), "dt_bias must be a floating-point tensor, got ",
              dt_bias.scalar_type());
  const at::ScalarType sd = acc_dtype(q.scalar_type());
  TORCH_CHECK(state.dim() == 4 && state.size(0) == B && state.size(1) == HV && state.size(2) == K &&
                  state.size(3) == V,
              "state must have shape [B, HV, K, V] = [", B, ", ", HV, ", ", K, ", ", V, "], got ", shape_str(state));
  TORCH_CHECK(state.scalar_type() == sd, "state must be ", sd, " (the state dtype for ", q.scalar_type(),
              " inputs), got ", state.scalar_type());
  TORCH_CHECK(state.is_contiguous(), "state must be contiguous (it is updated in place), got strides ",
              state.strides());
  TORCH_CHECK(std::isfinite(scale), "scale must be a finite number, got ", scale);
  return DecodeSizes{B, T, H, HV, K, V};
}

}  // namespace gated_delta
