// Every schema of the library, defined once. Each backend registers its kernels beside their code, one file per op
// (cpu/short_conv.cpp, cuda/short_conv.cu, ...; the gated delta rule in cpu/delta_rule.cpp and cuda/delta_rule.cpp);
// autograd.cpp registers the Autograd kernels. The C++ side of fwd/bwd's arguments is DeltaRuleArgs (delta_rule.h).
#include <torch/library.h>

#ifdef GATED_DELTA_PYTHON_MODULE
#include <Python.h>
// `import gated_delta._C` loads this library, which runs the registrations below.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
#endif

TORCH_LIBRARY(gated_delta, m) {
  // Forward of the gated delta rule. final_state is an empty tensor unless output_final_state. state_v_first: the
  // states (initial, final and their gradients in bwd) are [N, HV, V, K] instead of [N, HV, K, V].
  m.def(
      "fwd(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float scale, Tensor? initial_state, "
      "bool output_final_state, Tensor? cu_seqlens, Tensor? cu_seqlens_cpu, bool use_qk_l2norm_in_kernel, "
      "bool use_beta_sigmoid_in_kernel, bool allow_neg_eigval, bool use_gate_in_kernel, Tensor? A_log, "
      "Tensor? dt_bias, str algorithm, int chunk_size, Tensor? gk=None, Tensor? gv=None, bool state_v_first=False) -> "
      "(Tensor o, Tensor final_state)");
  // The forward for a backward: fwd's outputs and the residual, opaque bytes of the backend that its backward reads
  // instead of recomputing them (bwd's residual); an empty uint8 tensor where the backend keeps none.
  m.def(
      "fwd_with_residual(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float scale, Tensor? initial_state, "
      "bool output_final_state, Tensor? cu_seqlens, Tensor? cu_seqlens_cpu, bool use_qk_l2norm_in_kernel, "
      "bool use_beta_sigmoid_in_kernel, bool allow_neg_eigval, bool use_gate_in_kernel, Tensor? A_log, "
      "Tensor? dt_bias, str algorithm, int chunk_size, Tensor? gk=None, Tensor? gv=None, bool state_v_first=False) -> "
      "(Tensor o, Tensor final_state, Tensor residual)");
  // gk [B, T, HV, K] / gv [B, T, HV, V]: per-key / per-value log decays (algorithm "recurrent" or "auto").
  // Arguments after chunk_size have defaults, so that calls written before them keep working.
  // Backward: gradients of every differentiable input. Gradients of absent inputs (initial_state, A_log,
  // dt_bias, gk, gv) are empty tensors. When use_gate_in_kernel, dg is the gradient of g_raw. residual: what
  // fwd_with_residual returned for these inputs, or absent (or empty): then recomputed. q_normed, k_normed (with
  // use_qk_l2norm_in_kernel, both or neither): l2norm_fwd of q and k in the compute dtype (q's and v's promoted),
  // as the forward formed them, or absent: then recomputed.
  m.def(
      "bwd(Tensor d_o, Tensor? d_final_state, Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float scale, "
      "Tensor? initial_state, Tensor? cu_seqlens, Tensor? cu_seqlens_cpu, bool use_qk_l2norm_in_kernel, "
      "bool use_beta_sigmoid_in_kernel, bool allow_neg_eigval, bool use_gate_in_kernel, Tensor? A_log, "
      "Tensor? dt_bias, str algorithm, int chunk_size, Tensor? gk=None, Tensor? gv=None, bool state_v_first=False, "
      "Tensor? residual=None, Tensor? q_normed=None, Tensor? k_normed=None) -> "
      "(Tensor dq, Tensor dk, Tensor dv, Tensor dg, Tensor dbeta, Tensor d_initial_state, Tensor dA_log, "
      "Tensor ddt_bias, Tensor dgk, Tensor dgv)");
  // L2 normalisation over the last dim, what fwd and bwd apply to q and k with use_qk_l2norm_in_kernel (FLA's
  // l2norm): y = x / sqrt(sum(x^2) + eps), computed in fp32 (fp64 where x or out_dtype is fp64) and returned in
  // out_dtype (x's dtype when None). x [..., D] may be strided (CUDA reads it in place where its last dim is dense).
  m.def("l2norm_fwd(Tensor x, float eps, ScalarType? out_dtype=None) -> Tensor y");
  // Its backward, the norm recomputed from x: dx = r (dy - y (y . dy)) with r = (sum(x^2) + eps)^(-1/2), y = x r,
  // in out_dtype (x's dtype when None).
  m.def("l2norm_bwd(Tensor dy, Tensor x, float eps, ScalarType? out_dtype=None) -> Tensor dx");
  // --- layer ops (short convolution, gated RMSNorm, decode) are defined below this line ---
  // Causal depthwise short convolution over time, + SiLU when use_silu: x [B, T, D], weight [D, W], bias [D],
  // initial_state [N, D, W-1] (the last W-1 inputs before each sequence, oldest first), cu_seqlens [N + 1].
  // final_state [N, D, W-1] holds the last W-1 inputs of each sequence; an empty tensor unless output_final_state.
  m.def(
      "short_conv_fwd(Tensor x, Tensor weight, Tensor? bias, Tensor? initial_state, Tensor? cu_seqlens, "
      "bool output_final_state, bool use_silu) -> (Tensor y, Tensor final_state)");
  // Backward of short_conv_fwd. dbias and d_initial_state are empty tensors when bias / initial_state are absent.
  m.def(
      "short_conv_bwd(Tensor dy, Tensor? d_final_state, Tensor x, Tensor weight, Tensor? bias, "
      "Tensor? initial_state, Tensor? cu_seqlens, bool use_silu) -> (Tensor dx, Tensor dweight, Tensor dbias, "
      "Tensor d_initial_state)");
  // Decode: T new tokens x [B, T, D] against the rolling conv state [B, D, W-1], which is updated in place.
  m.def(
      "short_conv_update(Tensor x, Tensor(a!) conv_state, Tensor weight, Tensor? bias, bool use_silu) -> Tensor y");
  // Gated RMSNorm over the last dim, in fp32: y = x / sqrt(mean(x^2) + eps) * weight * silu(gate).
  // rstd [...] (one per row, fp32; fp64 for fp64 x) is kept for the backward.
  m.def("gated_rmsnorm_fwd(Tensor x, Tensor? gate, Tensor? weight, float eps) -> (Tensor y, Tensor rstd)");
  // Backward of gated_rmsnorm_fwd. dgate and dweight are empty tensors when gate / weight are absent.
  m.def(
      "gated_rmsnorm_bwd(Tensor dy, Tensor x, Tensor? gate, Tensor? weight, Tensor rstd, float eps) -> "
      "(Tensor dx, Tensor dgate, Tensor dweight)");
  // One fused decode step of the gated delta rule for T (few) new tokens: q, k [B, T, H, K] (L2-normalised in the
  // kernel), v [B, T, HV, V], a, b [B, T, HV] (gate and beta logits), A_log, dt_bias [HV]; the recurrent state
  // [B, HV, K, V] (fp32; fp64 for fp64 inputs) is updated in place. Returns o [B, T, HV, V] in v's dtype.
  m.def(
      "decode_step(Tensor q, Tensor k, Tensor v, Tensor a, Tensor b, Tensor A_log, Tensor dt_bias, "
      "Tensor(a!) state, float scale, bool allow_neg_eigval) -> Tensor o");
  // Decode against a pool of states [num_slots, HV, K, V] read and written in place at the slots of state_indices
  // ([N], or [N, S] with the state after each token written to its own slot); the slot rules are in checks.h.
  m.def(
      "decode_pool(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) state_pool, Tensor state_indices, "
      "Tensor? cu_seqlens, Tensor? num_accepted_tokens, float scale, bool use_qk_l2norm_in_kernel, "
      "bool use_gate_in_kernel, Tensor? A_log, Tensor? dt_bias, bool use_beta_sigmoid_in_kernel, "
      "bool allow_neg_eigval, bool check_slots) -> Tensor o");
}
