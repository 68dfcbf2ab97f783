// The state-pool decode op (decode_pool): its argument checks, shared by the CPU and CUDA backends, and the host
// validation of the slot indices. Errors name the argument, what was expected and what came.
//
// Rows: n = 0..N-1 are the sequences of the call (N = B, or the number of sequences of cu_seqlens). Row n reads its
// state from pool slot r_n and writes it back:
//   state_indices [N]:     r_n = state_indices[n]; the state after the row's last token is written to slot r_n.
//   state_indices [N, S]:  r_n = state_indices[n, num_accepted_tokens[n] - 1] (column 0 without
//                          num_accepted_tokens); the state after token t of the row is written to slot
//                          state_indices[n, t] (t < S; a negative entry skips that write).
// A negative r_n marks a padded row: nothing is read or written and its outputs are zeros.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "checks.h"

namespace gated_delta {

using OptTensor = c10::optional<at::Tensor>;

struct PoolSizes {
  int64_t B, T, H, HV, K, V;
  int64_t N;          // rows (sequences)
  int64_t num_slots;  // pool slots
  int64_t S;          // slot columns per row: 1 for 1-D state_indices, else state_indices.size(1)
  bool per_token;     // 2-D state_indices: the state after every token is written to its slot
};

inline void check_index_dtype(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, name, " must be int32 or int64, got ",
              t.scalar_type());
}

inline PoolSizes check_decode_pool_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                        const at::Tensor& g, const at::Tensor& beta, const at::Tensor& state_pool,
                                        const at::Tensor& state_indices, const OptTensor& cu_seqlens,
                                        const OptTensor& num_accepted_tokens, double scale, bool use_gate_in_kernel,
                                        const OptTensor& A_log, const OptTensor& dt_bias) {
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
  for (const auto& [t, name] : {std::pair<const at::Tensor*, const char*>{&k, "k"}, {&v, "v"}, {&g, "g"},
                                {&beta, "beta"}, {&state_pool, "state_pool"}, {&state_indices, "state_indices"}}) {
    check_device_as(q, "q", *t, name);
  }
  TORCH_CHECK(g.dim() == 3 && g.size(0) == B && g.size(1) == T && g.size(2) == HV, "g must have shape [B, T, HV] = [",
              B, ", ", T, ", ", HV, "], got ", shape_str(g));
  TORCH_CHECK(beta.dim() == 3 && beta.size(0) == B && beta.size(1) == T && beta.size(2) == HV,
              "beta must have shape [B, T, HV] = [", B, ", ", T, ", ", HV, "], got ", shape_str(beta));
  TORCH_CHECK(is_float_dtype(g.scalar_type()), "g must be a floating-point tensor, got ", g.scalar_type());
  TORCH_CHECK(is_float_dtype(beta.scalar_type()), "beta must be a floating-point tensor, got ", beta.scalar_type());
  TORCH_CHECK(std::isfinite(scale), "scale must be a finite number, got ", scale);

  // The pool: [num_slots, HV, K, V], each slot's [HV, K, V] block contiguous; slots may be strided (a view into a
  // larger cache).
  const at::ScalarType sd = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  TORCH_CHECK(state_pool.dim() == 4 && state_pool.size(1) == HV && state_pool.size(2) == K && state_pool.size(3) == V,
              "state_pool must have shape [num_slots, HV, K, V] = [num_slots, ", HV, ", ", K, ", ", V, "], got ",
              shape_str(state_pool));
  TORCH_CHECK(state_pool.scalar_type() == sd, "state_pool must be ", sd, " (the state dtype for ", q.scalar_type(),
              " inputs), got ", state_pool.scalar_type());
  const int64_t num_slots = state_pool.size(0);
  TORCH_CHECK(state_pool.stride(3) == 1 && state_pool.stride(2) == V && state_pool.stride(1) == K * V &&
                  (num_slots <= 1 || state_pool.stride(0) >= HV * K * V),
              "state_pool must have each slot's [HV, K, V] block contiguous and slots apart (strides [>= ", HV * K * V,
              ", ", K * V, ", ", V, ", 1]; it is updated in place), got strides ", state_pool.strides());

  int64_t N = B;
  if (cu_seqlens.has_value()) {
    const at::Tensor& cu = *cu_seqlens;
    check_device_as(q, "q", cu, "cu_seqlens");
    TORCH_CHECK(cu.dim() == 1 && cu.size(0) >= 2, "cu_seqlens must be a 1-D tensor [N + 1] with N >= 1, got ",
                shape_str(cu));
    check_index_dtype(cu, "cu_seqlens");
    TORCH_CHECK(B == 1, "cu_seqlens requires a packed batch with B = 1, got q of shape ", shape_str(q));
    N = cu.size(0) - 1;
  }
  check_index_dtype(state_indices, "state_indices");
  TORCH_CHECK((state_indices.dim() == 1 || state_indices.dim() == 2) && state_indices.size(0) == N,
              "state_indices must have shape [N] or [N, S] with N = ", N,
              cu_seqlens.has_value() ? " (the sequences of cu_seqlens)" : " (the batch size B)", ", got ",
              shape_str(state_indices));
  const bool per_token = state_indices.dim() == 2;
  const int64_t S = per_token ? state_indices.size(1) : 1;
  if (per_token) {
    TORCH_CHECK(S >= 1, "state_indices [N, S] must have S >= 1, got ", shape_str(state_indices));
    TORCH_CHECK(cu_seqlens.has_value() || T <= S, "state_indices [N, S] needs a slot for every token: S >= T = ", T,
                ", got ", shape_str(state_indices));
  }
  if (num_accepted_tokens.has_value()) {
    const at::Tensor& acc = *num_accepted_tokens;
    check_device_as(q, "q", acc, "num_accepted_tokens");
    check_index_dtype(acc, "num_accepted_tokens");
    TORCH_CHECK(per_token, "num_accepted_tokens needs state_indices of shape [N, S] (it picks the column of the slot "
                "to start from), got state_indices of shape ", shape_str(state_indices));
    TORCH_CHECK(acc.dim() == 1 && acc.size(0) == N, "num_accepted_tokens must have shape [N] = [", N, "], got ",
                shape_str(acc));
  }

  if (use_gate_in_kernel) {
    TORCH_CHECK(A_log.has_value(), "use_gate_in_kernel=True requires A_log, got None");
  } else {
    TORCH_CHECK(!A_log.has_value(), "A_log is only used with use_gate_in_kernel=True");
    TORCH_CHECK(!dt_bias.has_value(), "dt_bias is only used with use_gate_in_kernel=True");
  }
  for (const auto& [t, name] : {std::pair<const OptTensor*, const char*>{&A_log, "A_log"}, {&dt_bias, "dt_bias"}}) {
    if (!t->has_value()) continue;
    const at::Tensor& p = **t;
    check_device_as(q, "q", p, name);
    TORCH_CHECK(p.dim() == 1 && p.size(0) == HV, name, " must have shape [HV] = [", HV, "], got ", shape_str(p));
    TORCH_CHECK(is_float_dtype(p.scalar_type()), name, " must be a floating-point tensor, got ", p.scalar_type());
  }
  return PoolSizes{B, T, H, HV, K, V, N, num_slots, S, per_token};
}

// The values of the index arguments, on the host (int64, contiguous): the sequence bounds, the slot every row reads
// and writes, and that no slot belongs to two rows (two rows writing one slot would race). cu may be undefined
// (rows of T tokens), acc too (column 0).
inline void check_decode_pool_values(const PoolSizes& s, const at::Tensor& idx, const at::Tensor& acc,
                                     const at::Tensor& cu) {
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
    TORCH_CHECK(r < s.num_slots, "state_indices must be < num_slots = ", s.num_slots, " (or negative for a padded row), ",
                "got ", r, " for row ", n);
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
