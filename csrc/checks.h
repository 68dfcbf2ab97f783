// Validation of the arguments of every op, shared by all backends (defined in checks.cpp). Errors name the
// argument, what was expected and what came. What only one backend limits (the CUDA head dims, the CUDA
// convolution width) is checked beside that backend's code.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <string>
#include <vector>

namespace gated_delta {

struct DeltaRuleArgs;
struct DecodePoolArgs;

// ---- shared helpers ----

std::string shape_str(const at::Tensor& t);

inline bool is_float_dtype(at::ScalarType s) {
  return s == at::kFloat || s == at::kDouble || s == at::kBFloat16 || s == at::kHalf;
}

// The accumulation (and recurrent state) dtype of an input dtype: float64 for float64, float32 otherwise.
inline at::ScalarType acc_dtype(at::ScalarType s) { return s == at::kDouble ? at::kDouble : at::kFloat; }

// The dtype the gated delta rule computes in when q/k and v differ: the wider of the two (bf16 with fp16: fp32).
inline at::ScalarType compute_dtype(at::ScalarType qk, at::ScalarType v) { return c10::promoteTypes(qk, v); }

// Tensors of one call must share a device; ref_name names the reference argument in the message.
void check_device_as(const at::Tensor& ref, const char* ref_name, const at::Tensor& t, const char* name);

// A parameter (weight, bias) may have the dtype of the input or float32 (an fp32 master weight under autocast).
void check_param_dtype(const at::Tensor& p, const char* name, at::ScalarType input_dtype, const char* input_name);

// An index tensor (cu_seqlens, slot indices): int32 or int64.
void check_index_dtype(const at::Tensor& t, const char* name);

// cu_seqlens [N + 1] (int32 or int64, on the device of ref) of a packed batch of B rows: B must be 1. Returns N.
// The values are checked where they are read on the host (check_cu_seqlens_values).
int64_t check_cu_seqlens(const at::Tensor& cu, int64_t B, const at::Tensor& ref, const char* ref_name);

// The values of a host copy of cu_seqlens: starts at 0, never decreases, ends at T.
void check_cu_seqlens_values(const at::Tensor& cu_host, int64_t T, const char* name);

// cu_seqlens on the host as int64: the caller's host copy where it gave one (whose values the op layer checked),
// else one device->host copy of cu_seqlens, checked here against the packed length T.
at::Tensor host_cu_seqlens(const at::Tensor& cu_seqlens, const at::Tensor& cu_seqlens_cpu, int64_t T);

// ---- the gated delta rule (fwd, bwd) ----

struct Sizes {
  int64_t B, T, H, HV, K, V, N;
};

// The shape of a recurrent state: [N, HV, K, V], or [N, HV, V, K] when state_v_first.
inline std::vector<int64_t> state_shape(const Sizes& s, bool state_v_first) {
  return state_v_first ? std::vector<int64_t>{s.N, s.HV, s.V, s.K} : std::vector<int64_t>{s.N, s.HV, s.K, s.V};
}

Sizes check_delta_rule_args(const DeltaRuleArgs& a);
// The gradients given to bwd; returns d_final_state, or an undefined tensor when absent or empty.
at::Tensor check_delta_rule_grads(const DeltaRuleArgs& a, const Sizes& s, const at::Tensor& d_o,
                                  const c10::optional<at::Tensor>& d_final_state);

// ---- causal depthwise short convolution ----

struct ConvSizes {
  int64_t B, T, D, W, N;
};

ConvSizes check_short_conv_args(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                                const c10::optional<at::Tensor>& initial_state,
                                const c10::optional<at::Tensor>& cu_seqlens);
// The gradients given to short_conv_bwd; returns d_final_state, or an undefined tensor when absent or empty.
at::Tensor check_short_conv_grads(const at::Tensor& x, const ConvSizes& s, const at::Tensor& dy,
                                  const c10::optional<at::Tensor>& d_final_state);
ConvSizes check_short_conv_update_args(const at::Tensor& x, const at::Tensor& conv_state, const at::Tensor& weight,
                                       const c10::optional<at::Tensor>& bias);

// ---- gated RMSNorm ----

struct NormSizes {
  int64_t rows, D;
};

NormSizes check_gated_rmsnorm_args(const at::Tensor& x, const c10::optional<at::Tensor>& gate,
                                   const c10::optional<at::Tensor>& weight, double eps);
void check_gated_rmsnorm_grads(const at::Tensor& x, const NormSizes& s, const at::Tensor& dy, const at::Tensor& rstd);

// ---- L2 normalisation (l2norm_fwd, l2norm_bwd) ----

// x [..., D] (D >= 1) in a float dtype, out_dtype (absent: x's) a float dtype, eps finite and >= 0. Returns the
// dtype of the result.
at::ScalarType check_l2norm_args(const at::Tensor& x, double eps, const c10::optional<at::ScalarType>& out_dtype);
// dy: x's shape and device, a float dtype.
void check_l2norm_grad(const at::Tensor& x, const at::Tensor& dy);
// The dtype l2norm computes in: float64 where x or the result is float64, float32 otherwise.
inline at::ScalarType l2norm_compute_dtype(at::ScalarType x, at::ScalarType out) {
  return acc_dtype(c10::promoteTypes(x, out));
}

// ---- fused decode step ----

struct DecodeSizes {
  int64_t B, T, H, HV, K, V;
};

DecodeSizes check_decode_step_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& a,
                                   const at::Tensor& b, const at::Tensor& A_log, const at::Tensor& dt_bias,
                                   const at::Tensor& state, double scale);

// ---- decode against a state pool ----

// Rows n = 0..N-1 are the sequences of the call (N = B, or the number of sequences of cu_seqlens). Row n reads its
// state from pool slot r_n and writes it back:
//   state_indices [N]:     r_n = state_indices[n]; the state after the row's last token is written to slot r_n.
//   state_indices [N, S]:  r_n = state_indices[n, num_accepted_tokens[n] - 1] (column 0 without
//                          num_accepted_tokens); the state after token t of the row is written to slot
//                          state_indices[n, t] (t < S; a negative entry skips that write).
// A negative r_n marks a padded row: nothing is read or written and its outputs are zeros.
struct PoolSizes {
  int64_t B, T, H, HV, K, V;
  int64_t N;          // rows (sequences)
  int64_t num_slots;  // pool slots
  int64_t S;          // slot columns per row: 1 for 1-D state_indices, else state_indices.size(1)
  bool per_token;     // 2-D state_indices: the state after every token is written to its slot
};

PoolSizes check_decode_pool_args(const DecodePoolArgs& a);
// The values of the index arguments, on the host (int64, contiguous): the sequence bounds, the slot every row reads
// and writes, and that no slot belongs to two rows (two rows writing one slot would race). cu may be undefined
// (rows of T tokens), acc too (column 0).
void check_decode_pool_values(const PoolSizes& s, const at::Tensor& idx, const at::Tensor& acc, const at::Tensor& cu);

}  // namespace gated_delta
