// The state-pool decode (gated_delta::decode_pool) in C++: its arguments as one struct, and the unboxed kernel that
// every backend registers, so that the op's signature is written once. The schema is in ops.cpp, the checks and the slot rules in checks.h.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

namespace gated_delta {

// The arguments of one call, in the order of the schema (references to the dispatcher's arguments).
struct DecodePoolArgs {
  const at::Tensor& q;                                    // [B, T, H, K]
  const at::Tensor& k;                                    // [B, T, H, K]
  const at::Tensor& v;                                    // [B, T, HV, V]
  const at::Tensor& g;                                    // [B, T, HV]
  const at::Tensor& beta;                                 // [B, T, HV]
  at::Tensor& state_pool;                                 // [num_slots, HV, K, V], updated in place
  const at::Tensor& state_indices;                        // [N] or [N, S]
  const c10::optional<at::Tensor>& cu_seqlens;            // [N + 1]
  const c10::optional<at::Tensor>& num_accepted_tokens;   // [N]
  double scale;
  bool use_qk_l2norm_in_kernel;
  bool use_gate_in_kernel;
  const c10::optional<at::Tensor>& A_log;                 // [HV]
  const c10::optional<at::Tensor>& dt_bias;               // [HV]
  bool use_beta_sigmoid_in_kernel;
  bool allow_neg_eigval;
  bool check_slots;
};

namespace detail {

template <at::Tensor (*Fn)(const DecodePoolArgs&)>
at::Tensor unbox_decode_pool(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                             const at::Tensor& beta, at::Tensor& state_pool, const at::Tensor& state_indices,
                             const c10::optional<at::Tensor>& cu_seqlens,
                             const c10::optional<at::Tensor>& num_accepted_tokens, double scale,
                             bool use_qk_l2norm_in_kernel, bool use_gate_in_kernel,
                             const c10::optional<at::Tensor>& A_log, const c10::optional<at::Tensor>& dt_bias,
                             bool use_beta_sigmoid_in_kernel, bool allow_neg_eigval, bool check_slots) {
  return Fn(DecodePoolArgs{q, k, v, g, beta, state_pool, state_indices, cu_seqlens, num_accepted_tokens, scale,
                           use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel,
                           allow_neg_eigval, check_slots});
}

}  // namespace detail

// The unboxed kernel of gated_delta::decode_pool that calls Fn with the arguments as a DecodePoolArgs: what every
// dispatch key registers (m.impl("decode_pool", decode_pool_unboxed<my_impl>)).
template <at::Tensor (*Fn)(const DecodePoolArgs&)>
constexpr auto decode_pool_unboxed = &detail::unbox_decode_pool<Fn>;

}  // namespace gated_delta
