// The contract between the device-generic op layer (op_impl.h) and each backend's core kernels.
//
// The op layer validates arguments, applies the in-kernel pre-processing (q/k L2 norm, beta sigmoid, gate from
// g_raw) and hands the core the gated delta rule proper:
//   S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,   o_t = scale * S_t^T q_t.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <string>

namespace gated_delta {

enum class Algorithm { Auto, Recurrent, Chunk, Scan };

inline Algorithm parse_algorithm(const std::string& name) {
  if (name == "auto") return Algorithm::Auto;
  if (name == "recurrent") return Algorithm::Recurrent;
  if (name == "chunk") return Algorithm::Chunk;
  if (name == "scan") return Algorithm::Scan;
  TORCH_CHECK(false, "algorithm must be one of 'auto', 'recurrent', 'chunk', 'scan', got '", name, "'");
}

inline const char* algorithm_name(Algorithm a) {
  switch (a) {
    case Algorithm::Auto: return "auto";
    case Algorithm::Recurrent: return "recurrent";
    case Algorithm::Chunk: return "chunk";
    case Algorithm::Scan: return "scan";
  }
  return "?";
}


struct CoreArgs {
  // q, k: [B, T, H, K]; v: [B, T, HV, V]. q, k, v share one dtype (fp64, fp32, bf16, fp16); any strides.
  at::Tensor q, k, v;
  // g (final log decay) and beta (final write strength): [B, T, HV], float32 (float64 when v is float64).
  at::Tensor g, beta;
  // [N, HV, K, V] float32 (float64 for float64 inputs), or undefined for a zero initial state.
  at::Tensor initial_state;
  // [N + 1] int64 on the inputs' device, or undefined (then N = B and every sequence has length T).
  at::Tensor cu_seqlens;
  // Host copy of cu_seqlens ([N + 1] int64 on the CPU), or undefined. Always defined when cu_seqlens is defined
  // and the inputs are on the CPU; on CUDA it is defined only when the caller supplied it.
  at::Tensor cu_seqlens_cpu;
  double scale = 1.0;
  int64_t chunk_size = 64;
  Algorithm algorithm = Algorithm::Auto;  // the backend resolves Auto
  // Backward: a backend may return dq, dk, dv in the dtype of q/k/v instead of the state dtype (saves a cast
  // and half of their memory traffic). The op layer clears it when a chain rule still has to be applied to dq/dk.
  bool grads_in_input_dtype = false;

  int64_t batch() const { return q.size(0); }
  int64_t seqlen() const { return q.size(1); }
  int64_t num_qk_heads() const { return q.size(2); }
  int64_t num_v_heads() const { return v.size(2); }
  int64_t head_k() const { return q.size(3); }
  int64_t head_v() const { return v.size(3); }
  int64_t num_seqs() const { return cu_seqlens.defined() ? cu_seqlens.size(0) - 1 : q.size(0); }
  at::ScalarType state_dtype() const {
    return v.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  }
};

struct CoreForward {
  at::Tensor o;            // [B, T, HV, V], dtype of v
  at::Tensor final_state;  // [N, HV, K, V] state dtype, or undefined when not requested
};

struct CoreGrads {
  // [B, T, H, K], grouped heads already summed; state dtype (fp32 / fp64), or the dtype of q when
  // args.grads_in_input_dtype is set and the backend supports it
  at::Tensor dq, dk;
  at::Tensor dv;           // [B, T, HV, V], state dtype, or the dtype of v as dq
  at::Tensor dg, dbeta;    // [B, T, HV], state dtype
  at::Tensor d_initial_state;  // [N, HV, K, V] state dtype; undefined when args.initial_state is undefined
};

// d_final_state may be undefined (no gradient flows into the final state).
CoreForward core_forward_cpu(const CoreArgs& args, bool output_final_state);
CoreGrads core_backward_cpu(const CoreArgs& args, const at::Tensor& d_o, const at::Tensor& d_final_state);

#ifdef GATED_DELTA_WITH_CUDA
CoreForward core_forward_cuda(const CoreArgs& args, bool output_final_state);
CoreGrads core_backward_cuda(const CoreArgs& args, const at::Tensor& d_o, const at::Tensor& d_final_state);
#endif

}  // namespace gated_delta
