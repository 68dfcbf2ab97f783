// Validation of the arguments of every op (checks.h).
#include "checks.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <sstream>
#include <utility>
#include <vector>

#include "decode_pool.h"
#include "delta_rule.h"

namespace gated_delta {

std::string shape_str(const at::Tensor& t) {
  std::ostringstream os;
  os << t.sizes();
  return os.str();
}

void check_device_as(const at::Tensor& ref, const char* ref_name, const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device() == ref.device(), name, " must be on the same device as ", ref_name, " (", ref.device(),
              "), got ", t.device());
}

void check_param_dtype(const at::Tensor& p, const char* name, at::ScalarType input_dtype, const char* input_name) {
  TORCH_CHECK(p.scalar_type() == input_dtype || p.scalar_type() == at::kFloat, name, " must have the dtype of ",
              input_name, " (", input_dtype, ") or float32, got ", p.scalar_type());
}

void check_index_dtype(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kLong || t.scalar_type() == at::kInt, name, " must be int32 or int64, got ",
              t.scalar_type());
}

int64_t check_cu_seqlens(const at::Tensor& cu, int64_t B, const at::Tensor& ref, const char* ref_name) {
  check_device_as(ref, ref_name, cu, "cu_seqlens");
  TORCH_CHECK(cu.dim() == 1 && cu.size(0) >= 2, "cu_seqlens must be a 1-D tensor [N + 1] with N >= 1, got ",
              shape_str(cu));
  check_index_dtype(cu, "cu_seqlens");
  TORCH_CHECK(B == 1, "cu_seqlens requires a packed batch with B = 1, got B = ", B);
  return cu.size(0) - 1;
}

// (Messages built with std::to_string: streaming integers into c10::str crashed in one toolchain mix.)
void check_cu_seqlens_values(const at::Tensor& cu_host, int64_t T, const char* name) {
  const at::Tensor c = cu_host.to(at::kLong).contiguous();
  const int64_t* p = c.data_ptr<int64_t>();
  const int64_t n = c.size(0);
  const std::string nm(name);
  TORCH_CHECK(p[0] == 0, nm + " must start at 0, got " + std::to_string(p[0]));
  for (int64_t i = 1; i < n; ++i) {
    TORCH_CHECK(p[i] >= p[i - 1], nm + " must be non-decreasing, got " + nm + "[" + std::to_string(i) +
                                      "] = " + std::to_string(p[i]) + " < " + nm + "[" + std::to_string(i - 1) +
                                      "] = " + std::to_string(p[i - 1]));
  }
  TORCH_CHECK(p[n - 1] == T, nm + " must end at T = " + std::to_string(T) + " (the packed length), got " +
                                 std::to_string(p[n - 1]));
}

at::Tensor host_cu_seqlens(const at::Tensor& cu_seqlens, const at::Tensor& cu_seqlens_cpu, int64_t T) {
  if (cu_seqlens_cpu.defined()) return cu_seqlens_cpu.to(at::kLong).contiguous();
  at::Tensor cu = cu_seqlens.to(at::kCPU).to(at::kLong).contiguous();
  check_cu_seqlens_values(cu, T, "cu_seqlens");
  return cu;
}

namespace {

struct QKVSizes {
  int64_t B, T, H, K, HV, V;
};

// q, k [B, T, H, K] (one float dtype) and v [B, T, HV, V] (a float dtype) with HV a multiple of H, one device.
QKVSizes check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.dim() == 4, "q must have shape [B, T, H, K] (4 dimensions), got ", shape_str(q));
  TORCH_CHECK(is_float_dtype(q.scalar_type()), "q must be float64, float32, bfloat16 or float16, got ",
              q.scalar_type());
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), K = q.size(3);
  TORCH_CHECK(H >= 1 && K >= 1, "q must have H >= 1 and K >= 1, got ", shape_str(q));
  TORCH_CHECK(k.dim() == 4 && k.sizes() == q.sizes(), "k must have the shape of q [B, T, H, K] = ", shape_str(q),
              ", got ", shape_str(k));
  TORCH_CHECK(v.dim() == 4 && v.size(0) == B && v.size(1) == T, "v must have shape [B, T, HV, V] with B=", B,
              ", T=", T, ", got ", shape_str(v));
  const int64_t HV = v.size(2), V = v.size(3);
  TORCH_CHECK(HV >= 1 && HV % H == 0, "v must have shape [B, T, HV, V] with HV a multiple of H=", H, ", got ",
              shape_str(v));
  TORCH_CHECK(V >= 1, "v must have V >= 1, got ", shape_str(v));
  TORCH_CHECK(k.scalar_type() == q.scalar_type(), "k must have the dtype of q (", q.scalar_type(), "), got ",
              k.scalar_type());
  TORCH_CHECK(is_float_dtype(v.scalar_type()), "v must be float64, float32, bfloat16 or float16, got ",
              v.scalar_type());
  check_device_as(q, "q", k, "k");
  check_device_as(q, "q", v, "v");
  return QKVSizes{B, T, H, K, HV, V};
}

// A per-token scalar [B, T, HV] of any float dtype, on the device of q.
void check_token_scalar(const at::Tensor& q, const at::Tensor& x, const char* name, const QKVSizes& s) {
  check_device_as(q, "q", x, name);
  TORCH_CHECK(x.dim() == 3 && x.size(0) == s.B && x.size(1) == s.T && x.size(2) == s.HV, name,
              " must have shape [B, T, HV] = [", s.B, ", ", s.T, ", ", s.HV, "], got ", shape_str(x));
  TORCH_CHECK(is_float_dtype(x.scalar_type()), name, " must be a floating-point tensor, got ", x.scalar_type());
}

// A per-head parameter [HV] of any float dtype.
void check_head_param(const at::Tensor& q, const at::Tensor& x, const char* name, int64_t HV) {
  check_device_as(q, "q", x, name);
  TORCH_CHECK(x.dim() == 1 && x.size(0) == HV, name, " must have shape [HV] = [", HV, "], got ", shape_str(x));
  TORCH_CHECK(is_float_dtype(x.scalar_type()), name, " must be a floating-point tensor, got ", x.scalar_type());
}

// A recurrent state [N, HV, K, V] (with state_v_first [N, HV, V, K]; `shape` names the dims) on q's device.
void check_state_shape(const at::Tensor& q, const at::Tensor& h, const char* name, const char* shape,
                       const QKVSizes& s, int64_t N, bool state_v_first = false) {
  check_device_as(q, "q", h, name);
  const int64_t d2 = state_v_first ? s.V : s.K, d3 = state_v_first ? s.K : s.V;
  TORCH_CHECK(h.dim() == 4 && h.size(0) == N && h.size(1) == s.HV && h.size(2) == d2 && h.size(3) == d3, name,
              " must have shape ", shape, " = [", N, ", ", s.HV, ", ", d2, ", ", d3, "], got ", shape_str(h));
}

// A state read and written in place: exactly the state dtype of q.
void check_state_dtype(const at::Tensor& q, const at::Tensor& h, const char* name) {
  const at::ScalarType sd = acc_dtype(q.scalar_type());
  TORCH_CHECK(h.scalar_type() == sd, name, " must be ", sd, " (the state dtype for ", q.scalar_type(),
              " inputs), got ", h.scalar_type());
}

// A_log and dt_bias [HV] of the gate computed in the kernel: given only with use_gate_in_kernel, A_log then
// required, dt_bias too where dt_bias_required.
void check_gate_params(const at::Tensor& q, bool use_gate_in_kernel, const c10::optional<at::Tensor>& A_log,
                       const c10::optional<at::Tensor>& dt_bias, int64_t HV, bool dt_bias_required) {
  if (use_gate_in_kernel) {
    TORCH_CHECK(A_log.has_value(), "use_gate_in_kernel=True requires A_log, got None");
    TORCH_CHECK(dt_bias.has_value() || !dt_bias_required, "use_gate_in_kernel=True requires dt_bias, got None");
  }
  if (A_log.has_value()) {
    TORCH_CHECK(use_gate_in_kernel, "A_log is only used with use_gate_in_kernel=True");
    check_head_param(q, *A_log, "A_log", HV);
  }
  if (dt_bias.has_value()) {
    TORCH_CHECK(use_gate_in_kernel, "dt_bias is only used with use_gate_in_kernel=True");
    check_head_param(q, *dt_bias, "dt_bias", HV);
  }
}

// A per-key or per-value log decay [B, T, HV, D] (D = K or V) of any float dtype, optional.
void check_kv_gate(const at::Tensor& q, const c10::optional<at::Tensor>& x, const char* name, const char* shape,
                   const QKVSizes& s, int64_t D) {
  if (!x.has_value()) return;
  check_device_as(q, "q", *x, name);
  TORCH_CHECK(x->dim() == 4 && x->size(0) == s.B && x->size(1) == s.T && x->size(2) == s.HV && x->size(3) == D,
              name, " must have shape ", shape, " = [", s.B, ", ", s.T, ", ", s.HV, ", ", D, "], got ",
              shape_str(*x));
  TORCH_CHECK(is_float_dtype(x->scalar_type()), name, " must be a floating-point tensor, got ", x->scalar_type());
}

// A state that is only read (converted to the state dtype): any float dtype.
void check_state_float(const at::Tensor& h, const char* name) {
  TORCH_CHECK(is_float_dtype(h.scalar_type()), name, " must be a floating-point tensor, got ", h.scalar_type());
}

const char* state_dims(bool state_v_first) { return state_v_first ? "[N, HV, V, K]" : "[N, HV, K, V]"; }

}  // namespace

Sizes check_delta_rule_args(const DeltaRuleArgs& a) {
  const QKVSizes s = check_qkv(a.q, a.k, a.v);
  if (a.q.scalar_type() == at::kDouble || a.v.scalar_type() == at::kDouble) {
    TORCH_CHECK(a.q.device().is_cpu(), "float64 inputs are supported on the CPU only, got q (", a.q.scalar_type(),
                ") and v (", a.v.scalar_type(), ") on ", a.q.device());
  }
  check_token_scalar(a.q, a.g, "g", s);
  check_token_scalar(a.q, a.beta, "beta", s);
  TORCH_CHECK(std::isfinite(a.scale), "scale must be a finite number, got ", a.scale);
  TORCH_CHECK(a.chunk_size >= 1, "chunk_size must be >= 1, got ", a.chunk_size);

  int64_t N = s.B;
  if (a.cu_seqlens.has_value()) {
    const at::Tensor& cu = *a.cu_seqlens;
    N = check_cu_seqlens(cu, s.B, a.q, "q");
    if (a.cu_seqlens_cpu.has_value()) {
      const at::Tensor& hc = *a.cu_seqlens_cpu;
      TORCH_CHECK(hc.device().is_cpu(), "cu_seqlens_cpu must be on the CPU, got ", hc.device());
      TORCH_CHECK(hc.dim() == 1 && hc.size(0) == cu.size(0), "cu_seqlens_cpu must have the shape of cu_seqlens ",
                  shape_str(cu), ", got ", shape_str(hc));
      check_index_dtype(hc, "cu_seqlens_cpu");
    }
    // On CUDA without a host copy the backend copies the values to the host and checks them before any kernel
    // indexes with them.
  } else {
    TORCH_CHECK(!a.cu_seqlens_cpu.has_value(), "cu_seqlens_cpu was given without cu_seqlens");
  }
  if (a.initial_state.has_value()) {
    check_state_shape(a.q, *a.initial_state, "initial_state", state_dims(a.state_v_first), s, N, a.state_v_first);
    check_state_float(*a.initial_state, "initial_state");
  }
  // (dt_bias is optional: without it the gate is -exp(A_log) * softplus(g))
  check_gate_params(a.q, a.use_gate_in_kernel, a.A_log, a.dt_bias, s.HV, /*dt_bias_required=*/false);
  check_kv_gate(a.q, a.gk, "gk", "[B, T, HV, K]", s, s.K);
  check_kv_gate(a.q, a.gv, "gv", "[B, T, HV, V]", s, s.V);
  if (a.gk.has_value() || a.gv.has_value()) {
    const char* which = a.gk.has_value() && a.gv.has_value() ? "gk and gv" : a.gk.has_value() ? "gk" : "gv";
    TORCH_CHECK(a.algorithm == "auto" || a.algorithm == "recurrent", which,
                " (per-key / per-value decays) are supported by algorithm 'recurrent' (or 'auto') only, got "
                "algorithm '", a.algorithm, "'");
  }
  return Sizes{s.B, s.T, s.H, s.HV, s.K, s.V, N};
}

at::Tensor check_delta_rule_grads(const DeltaRuleArgs& a, const Sizes& s, const at::Tensor& d_o,
                                  const c10::optional<at::Tensor>& d_final_state) {
  TORCH_CHECK(d_o.sizes() == a.v.sizes(), "d_o must have the shape of the output [B, T, HV, V] = ", shape_str(a.v),
              ", got ", shape_str(d_o));
  check_device_as(a.q, "q", d_o, "d_o");
  if (a.residual.has_value() && a.residual->numel() > 0) {
    const at::Tensor& r = *a.residual;
    TORCH_CHECK(r.dim() == 1 && r.scalar_type() == at::kByte && r.is_contiguous(),
                "residual must be the contiguous 1-D uint8 tensor that fwd_with_residual returned, got ",
                r.scalar_type(), " of shape ", shape_str(r));
    check_device_as(a.q, "q", r, "residual");
  }
  TORCH_CHECK(a.q_normed.has_value() == a.k_normed.has_value(),
              "q_normed and k_normed must be given together (l2norm of q and k as the forward formed them), got ",
              a.q_normed.has_value() ? "q_normed only" : "k_normed only");
  if (a.q_normed.has_value()) {
    TORCH_CHECK(a.use_qk_l2norm_in_kernel,
                "q_normed and k_normed are the forward's L2-normalised q and k: given only with "
                "use_qk_l2norm_in_kernel=True, got them with use_qk_l2norm_in_kernel=False");
    const at::ScalarType xd = compute_dtype(a.q.scalar_type(), a.v.scalar_type());
    auto check_normed = [&](const at::Tensor& t, const char* name, const at::Tensor& of, const char* of_name) {
      TORCH_CHECK(t.sizes() == of.sizes() && t.scalar_type() == xd, name, " must have the shape of ", of_name, " ",
                  shape_str(of), " and the compute dtype ", xd, ", got ", t.scalar_type(), " of shape ",
                  shape_str(t));
      check_device_as(a.q, "q", t, name);
    };
    check_normed(*a.q_normed, "q_normed", a.q, "q");
    check_normed(*a.k_normed, "k_normed", a.k, "k");
  }
  if (!d_final_state.has_value() || d_final_state->numel() == 0) return at::Tensor();
  const at::Tensor& dht = *d_final_state;
  const QKVSizes qs{s.B, s.T, s.H, s.K, s.HV, s.V};
  check_state_shape(a.q, dht, "d_final_state", state_dims(a.state_v_first), qs, s.N, a.state_v_first);
  check_state_float(dht, "d_final_state");
  return dht;
}

ConvSizes check_short_conv_args(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                                const c10::optional<at::Tensor>& initial_state,
                                const c10::optional<at::Tensor>& cu_seqlens) {
  TORCH_CHECK(x.dim() == 3, "x must have shape [B, T, D] (3 dimensions), got ", shape_str(x));
  TORCH_CHECK(is_float_dtype(x.scalar_type()), "x must be float64, float32, bfloat16 or float16, got ",
              x.scalar_type());
  const int64_t B = x.size(0), T = x.size(1), D = x.size(2);
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == D && weight.size(1) >= 1, "weight must have shape [D, W] = [", D,
              ", W] with W >= 1, got ", shape_str(weight));
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
    N = check_cu_seqlens(*cu_seqlens, B, x, "x");
    // On the CPU the values are checked here; on CUDA reading them would synchronise the stream, so the kernels
    // clamp every index they derive from them instead.
    if (cu_seqlens->device().is_cpu()) check_cu_seqlens_values(*cu_seqlens, T, "cu_seqlens");
  }
  if (initial_state.has_value()) {
    const at::Tensor& h0 = *initial_state;
    check_device_as(x, "x", h0, "initial_state");
    TORCH_CHECK(h0.dim() == 3 && h0.size(0) == N && h0.size(1) == D && h0.size(2) == W - 1,
                "initial_state must have shape [N, D, W - 1] = [", N, ", ", D, ", ", W - 1, "], got ", shape_str(h0));
    TORCH_CHECK(h0.scalar_type() == x.scalar_type(), "initial_state must have the dtype of x (", x.scalar_type(),
                "), got ", h0.scalar_type());
  }
  return ConvSizes{B, T, D, W, N};
}

at::Tensor check_short_conv_grads(const at::Tensor& x, const ConvSizes& s, const at::Tensor& dy,
                                  const c10::optional<at::Tensor>& d_final_state) {
  check_device_as(x, "x", dy, "dy");
  TORCH_CHECK(dy.sizes() == x.sizes(), "dy must have the shape of x ", shape_str(x), ", got ", shape_str(dy));
  if (!d_final_state.has_value() || d_final_state->numel() == 0) return at::Tensor();
  const at::Tensor& dfs = *d_final_state;
  check_device_as(x, "x", dfs, "d_final_state");
  TORCH_CHECK(dfs.dim() == 3 && dfs.size(0) == s.N && dfs.size(1) == s.D && dfs.size(2) == s.W - 1,
              "d_final_state must have shape [N, D, W - 1] = [", s.N, ", ", s.D, ", ", s.W - 1, "], got ",
              shape_str(dfs));
  return dfs;
}

ConvSizes check_short_conv_update_args(const at::Tensor& x, const at::Tensor& conv_state, const at::Tensor& weight,
                                       const c10::optional<at::Tensor>& bias) {
  const ConvSizes s = check_short_conv_args(x, weight, bias, c10::nullopt, c10::nullopt);
  check_device_as(x, "x", conv_state, "conv_state");
  TORCH_CHECK(conv_state.dim() == 3 && conv_state.size(0) == s.B && conv_state.size(1) == s.D &&
                  conv_state.size(2) == s.W - 1,
              "conv_state must have shape [B, D, W - 1] = [", s.B, ", ", s.D, ", ", s.W - 1, "], got ",
              shape_str(conv_state));
  TORCH_CHECK(conv_state.scalar_type() == x.scalar_type(), "conv_state must have the dtype of x (", x.scalar_type(),
              "), got ", conv_state.scalar_type());
  TORCH_CHECK(conv_state.is_contiguous(), "conv_state must be contiguous (it is updated in place), got strides ",
              conv_state.strides());
  return s;
}

at::ScalarType check_l2norm_args(const at::Tensor& x, double eps, const c10::optional<at::ScalarType>& out_dtype) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) >= 1, "x must have shape [..., D] with D >= 1, got ", shape_str(x));
  TORCH_CHECK(is_float_dtype(x.scalar_type()), "x must be float64, float32, bfloat16 or float16, got ",
              x.scalar_type());
  const at::ScalarType out = out_dtype.value_or(x.scalar_type());
  TORCH_CHECK(is_float_dtype(out), "out_dtype must be float64, float32, bfloat16 or float16, got ", out);
  TORCH_CHECK(std::isfinite(eps) && eps >= 0, "eps must be a finite number >= 0, got ", eps);
  return out;
}

void check_l2norm_grad(const at::Tensor& x, const at::Tensor& dy) {
  check_device_as(x, "x", dy, "dy");
  TORCH_CHECK(dy.sizes() == x.sizes(), "dy must have the shape of x ", shape_str(x), ", got ", shape_str(dy));
  TORCH_CHECK(is_float_dtype(dy.scalar_type()), "dy must be float64, float32, bfloat16 or float16, got ",
              dy.scalar_type());
}

NormSizes check_gated_rmsnorm_args(const at::Tensor& x, const c10::optional<at::Tensor>& gate,
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

void check_gated_rmsnorm_grads(const at::Tensor& x, const NormSizes& s, const at::Tensor& dy,
                               const at::Tensor& rstd) {
  check_device_as(x, "x", dy, "dy");
  check_device_as(x, "x", rstd, "rstd");
  TORCH_CHECK(dy.sizes() == x.sizes(), "dy must have the shape of x ", shape_str(x), ", got ", shape_str(dy));
  const at::ScalarType acc = acc_dtype(x.scalar_type());
  TORCH_CHECK(rstd.numel() == s.rows && rstd.scalar_type() == acc, "rstd must be a ", acc, " tensor of ", s.rows,
              " elements (one per row of x), got ", rstd.scalar_type(), " ", shape_str(rstd));
}

DecodeSizes check_decode_step_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& a,
                                   const at::Tensor& b, const at::Tensor& A_log, const at::Tensor& dt_bias,
                                   const at::Tensor& state, double scale) {
  const QKVSizes s = check_qkv(q, k, v);
  check_token_scalar(q, a, "a", s);
  check_token_scalar(q, b, "b", s);
  check_head_param(q, A_log, "A_log", s.HV);
  check_head_param(q, dt_bias, "dt_bias", s.HV);
  TORCH_CHECK(v.scalar_type() == q.scalar_type(), "v must have the dtype of q (", q.scalar_type(), "), got ",
              v.scalar_type());
  check_state_shape(q, state, "state", "[B, HV, K, V]", s, s.B);
  check_state_dtype(q, state, "state");
  TORCH_CHECK(state.is_contiguous(), "state must be contiguous (it is updated in place), got strides ",
              state.strides());
  TORCH_CHECK(std::isfinite(scale), "scale must be a finite number, got ", scale);
  return DecodeSizes{s.B, s.T, s.H, s.HV, s.K, s.V};
}

PoolSizes check_decode_pool_args(const DecodePoolArgs& a) {
  const at::Tensor& q = a.q;
  const QKVSizes s = check_qkv(q, a.k, a.v);
  check_token_scalar(q, a.g, "g", s);
  check_token_scalar(q, a.beta, "beta", s);
  TORCH_CHECK(std::isfinite(a.scale), "scale must be a finite number, got ", a.scale);
  check_gate_params(q, a.use_gate_in_kernel, a.A_log, a.dt_bias, s.HV, /*dt_bias_required=*/false);

  // The pool: [num_slots, HV, K, V], each slot's [HV, K, V] block contiguous; slots may be strided (a view into a
  // larger cache).
  check_device_as(q, "q", a.state_pool, "state_pool");
  TORCH_CHECK(a.state_pool.dim() == 4 && a.state_pool.size(1) == s.HV && a.state_pool.size(2) == s.K &&
                  a.state_pool.size(3) == s.V,
              "state_pool must have shape [num_slots, HV, K, V] = [num_slots, ", s.HV, ", ", s.K, ", ", s.V, "], got ",
              shape_str(a.state_pool));
  check_state_dtype(q, a.state_pool, "state_pool");
  const int64_t num_slots = a.state_pool.size(0), slot_numel = s.HV * s.K * s.V;
  TORCH_CHECK(a.state_pool.stride(3) == 1 && a.state_pool.stride(2) == s.V && a.state_pool.stride(1) == s.K * s.V &&
                  (num_slots <= 1 || a.state_pool.stride(0) >= slot_numel),
              "state_pool must have each slot's [HV, K, V] block contiguous and slots apart (strides [>= ", slot_numel,
              ", ", s.K * s.V, ", ", s.V, ", 1]; it is updated in place), got strides ", a.state_pool.strides());

  const int64_t N = a.cu_seqlens.has_value() ? check_cu_seqlens(*a.cu_seqlens, s.B, q, "q") : s.B;
  check_device_as(q, "q", a.state_indices, "state_indices");
  check_index_dtype(a.state_indices, "state_indices");
  TORCH_CHECK((a.state_indices.dim() == 1 || a.state_indices.dim() == 2) && a.state_indices.size(0) == N,
              "state_indices must have shape [N] or [N, S] with N = ", N,
              a.cu_seqlens.has_value() ? " (the sequences of cu_seqlens)" : " (the batch size B)", ", got ",
              shape_str(a.state_indices));
  const bool per_token = a.state_indices.dim() == 2;
  const int64_t S = per_token ? a.state_indices.size(1) : 1;
  if (per_token) {
    TORCH_CHECK(S >= 1, "state_indices [N, S] must have S >= 1, got ", shape_str(a.state_indices));
    TORCH_CHECK(a.cu_seqlens.has_value() || s.T <= S, "state_indices [N, S] needs a slot for every token: S >= T = ",
                s.T, ", got ", shape_str(a.state_indices));
  }
  if (a.num_accepted_tokens.has_value()) {
    const at::Tensor& acc = *a.num_accepted_tokens;
    check_device_as(q, "q", acc, "num_accepted_tokens");
    check_index_dtype(acc, "num_accepted_tokens");
    TORCH_CHECK(per_token, "num_accepted_tokens needs state_indices of shape [N, S] (it picks the column of the slot "
                "to start from), got state_indices of shape ", shape_str(a.state_indices));
    TORCH_CHECK(acc.dim() == 1 && acc.size(0) == N, "num_accepted_tokens must have shape [N] = [", N, "], got ",
                shape_str(acc));
  }
  return PoolSizes{s.B, s.T, s.H, s.HV, s.K, s.V, N, num_slots, S, per_token};
}

void check_decode_pool_values(const PoolSizes& s, const at::Tensor& idx, const at::Tensor& acc, const at::Tensor& cu) {
  if (cu.defined()) check_cu_seqlens_values(cu, s.T, "cu_seqlens");
  const int64_t* ip = idx.data_ptr<int64_t>();
  const int64_t* ap = acc.defined() ? acc.data_ptr<int64_t>() : nullptr;
  const int64_t* cp = cu.defined() ? cu.data_ptr<int64_t>() : nullptr;
  std::vector<std::pair<int64_t, int64_t>> owned;  // (slot, row)
  for (int64_t n = 0; n < s.N; ++n) {
    const int64_t len = cp ? cp[n + 1] - cp[n] : s.T;
    int64_t col = 0;
    if (ap) {
      TORCH_CHECK(ap[n] >= 1 && ap[n] <= s.S, "num_accepted_tokens must be in [1, S = ", s.S,
                  "] (the column of the slot to start from, plus one), got num_accepted_tokens[", n, "] = ", ap[n]);
      col = ap[n] - 1;
    }
    const int64_t r = ip[n * s.S + col];
    if (r < 0) continue;  // a padded row
    TORCH_CHECK(r < s.num_slots, "state_indices must be < num_slots = ", s.num_slots,
                " (or negative for a padded row), got ", r, " for row ", n);
    owned.emplace_back(r, n);
    if (!s.per_token) continue;
    TORCH_CHECK(len <= s.S, "state_indices [N, S] needs a slot for every token: row ", n, " has ", len,
                " tokens but S = ", s.S);
    for (int64_t t = 0; t < len; ++t) {
      const int64_t w = ip[n * s.S + t];
      TORCH_CHECK(w < s.num_slots, "state_indices must be < num_slots = ", s.num_slots,
                  " (or negative to skip a write), got ", w, " at [", n, ", ", t, "]");
      if (w >= 0) owned.emplace_back(w, n);
    }
  }
  std::sort(owned.begin(), owned.end());
  for (size_t i = 1; i < owned.size(); ++i) {
    TORCH_CHECK(owned[i].first != owned[i - 1].first || owned[i].second == owned[i - 1].second,
                "state_indices must not share a slot between rows: slot ", owned[i].first, " is used by rows ",
                owned[i - 1].second, " and ", owned[i].second);
  }
}

}  // namespace gated_delta
