// Validation of every argument of the gated delta rule ops, shared by all backends.
// Errors name the argument, what was expected and what came.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <sstream>
#include <string>

namespace gated_delta {

inline std::string shape_str(const at::Tensor& t) {
  std::ostringstream os;
  os << t.sizes();
  return os.str();
}

inline bool is_float_dtype(at::ScalarType s) {
  return s == at::kFloat || s == at::kDouble || s == at::kBFloat16 || s == at::kHalf;
}

inline void check_same_device(const at::Tensor& ref, const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device() == ref.device(), name, " must be on the same device as q (", ref.device(), "), got ",
              t.device());
}

// Sizes of a validated call.
struct Sizes {
  int64_t B, T, H, HV, K, V, N;
};

inline Sizes check_fwd_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                            const at::Tensor& beta, double scale, const c10::optional<at::Tensor>& initial_state,
                            const c10::optional<at::Tensor>& cu_seqlens,
                            const c10::optional<at::Tensor>& cu_seqlens_cpu, bool use_gate_in_kernel,
                            const c10::optional<at::Tensor>& A_log, const c10::optional<at::Tensor>& dt_bias,
                            int64_t chunk_size) {
  TORCH_CHECK(q.dim() == 4, "q must have shape [B, T, H, K] (4 dimensions), got ", shape_str(q));
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), K = q.size(3);
  TORCH_CHECK(is_float_dtype(q.scalar_type()), "q must be float64, float32, bfloat16 or float16, got ",
              q.scalar_type());
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
  TORCH_CHECK(v.scalar_type() == q.scalar_type(), "v must have the dtype of q (", q.scalar_type(), "), got ",
              v.scalar_type());
  check_same_device(q, k, "k");
  check_same_device(q, v, "v");
  check_same_device(q, g, "g");
  check_same_device(q, beta, "beta");
  if (q.scalar_type() == at::kDouble) {
    TORCH_CHECK(q.device().is_cpu(), "float64 inputs are supported on the CPU only, got q on ", q.device());
  }
  TORCH_CHECK(g.dim() == 3 && g.size(0) == B && g.size(1) == T && g.size(2) == HV,
              "g must have shape [B, T, HV] = [", B, ", ", T, ", ", HV, "], got ", shape_str(g));
  TORCH_CHECK(is_float_dtype(g.scalar_type()), "g must be a floating-point tensor, got ", g.scalar_type());
  TORCH_CHECK(beta.dim() == 3 && beta.size(0) == B && beta.size(1) == T && beta.size(2) == HV,
              "beta must have shape [B, T, HV] = [", B, ", ", T, ", ", HV, "], got ", shape_str(beta));
  TORCH_CHECK(is_float_dtype(beta.scalar_type()), "beta must be a floating-point tensor, got ",
              beta.scalar_type());
  TORCH_CHECK(std::isfinite(scale), "scale must be a finite number, got ", scale);
  TORCH_CHECK(chunk_size >= 1, "chunk_size must be >= 1, got ", chunk_size);

  int64_t N = B;
  if (cu_seqlens.has_value()) {
    const at::Tensor& cu = *cu_seqlens;
    check_same_device(q, cu, "cu_seqlens");
    TORCH_CHECK(cu.dim() == 1 && cu.size(0) >= 2, "cu_seqlens must be a 1-D tensor [N + 1] with N >= 1, got ",
                shape_str(cu));
    TORCH_CHECK(cu.scalar_type() == at::kLong || cu.scalar_type() == at::kInt,
                "cu_seqlens must be int32 or int64, got ", cu.scalar_type());
    TORCH_CHECK(B == 1, "cu_seqlens requires a packed batch with B = 1, got B = ", B);
    N = cu.size(0) - 1;
    if (cu_seqlens_cpu.has_value()) {
      const at::Tensor& hc = *cu_seqlens_cpu;
      TORCH_CHECK(hc.device().is_cpu(), "cu_seqlens_cpu must be on the CPU, got ", hc.device());
      TORCH_CHECK(hc.dim() == 1 && hc.size(0) == cu.size(0), "cu_seqlens_cpu must have the shape of cu_seqlens ",
                  shape_str(cu), ", got ", shape_str(hc));
      TORCH_CHECK(hc.scalar_type() == at::kLong || hc.scalar_type() == at::kInt,
                  "cu_seqlens_cpu must be int32 or int64, got ", hc.scalar_type());
    }
    // The values are checked where they are read on the host (check_cu_seqlens_values); on CUDA without a host
    // copy the backend validates them on the device before any kernel indexes with them.
  } else {
    TORCH_CHECK(!cu_seqlens_cpu.has_value(), "cu_seqlens_cpu was given without cu_seqlens");
  }
  if (initial_state.has_value()) {
    const at::Tensor& h0 = *initial_state;
    check_same_device(q, h0, "initial_state");
    TORCH_CHECK(h0.dim() == 4 && h0.size(0) == N && h0.size(1) == HV && h0.size(2) == K && h0.size(3) == V,
                "initial_state must have shape [N, HV, K, V] = [", N, ", ", HV, ", ", K, ", ", V, "], got ",
                shape_str(h0));
    const at::ScalarType state_dtype = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    TORCH_CHECK(h0.scalar_type() == state_dtype, "initial_state must be ", state_dtype,
                " (the state dtype for ", q.scalar_type(), " inputs), got ", h0.scalar_type());
  }
  if (use_gate_in_kernel) {
    TORCH_CHECK(A_log.has_value(), "use_gate_in_kernel=True requires A_log, got None");
    TORCH_CHECK(dt_bias.has_value(), "use_gate_in_kernel=True requires dt_bias, got None");
  }
  if (A_log.has_value()) {
    TORCH_CHECK(use_gate_in_kernel, "A_log is only used with use_gate_in_kernel=True");
    check_same_device(q, *A_log, "A_log");
    TORCH_CHECK(A_log->dim() == 1 && A_log->size(0) == HV, "A_log must have shape [HV] = [", HV, "], got ",
                shape_str(*A_log));
    TORCH_CHECK(is_float_dtype(A_log->scalar_type()), "A_log must be a floating-point tensor, got ",
                A_log->scalar_type());
  }
  if (dt_bias.has_value()) {
    TORCH_CHECK(use_gate_in_kernel, "dt_bias is only used with use_gate_in_kernel=True");
    check_same_device(q, *dt_bias, "dt_bias");
    TORCH_CHECK(dt_bias->dim() == 1 && dt_bias->size(0) == HV, "dt_bias must have shape [HV] = [", HV, "], got ",
                shape_str(*dt_bias));
    TORCH_CHECK(is_float_dtype(dt_bias->scalar_type()), "dt_bias must be a floating-point tensor, got ",
                dt_bias->scalar_type());
  }
  return Sizes{B, T, H, HV, K, V, N};
}

// Checks the values of a host copy of cu_seqlens: starts at 0, never decreases, ends at T.
inline void check_cu_seqlens_values(const at::Tensor& cu_host, int64_t T, const char* name) {
  auto c = cu_host.to(at::kLong).contiguous();
  const int64_t* p = c.data_ptr<int64_t>();
  const int64_t n = c.size(0);
  TORCH_CHECK(p[0] == 0, name, " must start at 0, got ", p[0]);
  for (int64_t i = 1; i < n; ++i) {
    TORCH_CHECK(p[i] >= p[i - 1], name, " must be non-decreasing, got ", name, "[", i, "] = ", p[i], " < ", name,
                "[", i - 1, "] = ", p[i - 1]);
  }
  TORCH_CHECK(p[n - 1] == T, name, " must end at T = ", T, " (the packed length), got ", p[n - 1]);
}

}  // namespace gated_delta
