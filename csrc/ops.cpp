// Every schema of the library, defined once. Backends register their kernels beside their code
// (cpu/register.cpp, cuda/register.cu); autograd.cpp registers the Autograd kernel.
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
  // Forward of the gated delta rule. final_state is an empty tensor unless output_final_state.
  m.def(
      "fwd(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float scale, Tensor? initial_state, "
      "bool output_final_state, Tensor? cu_seqlens, Tensor? cu_seqlens_cpu, bool use_qk_l2norm_in_kernel, "
      "bool use_beta_sigmoid_in_kernel, bool allow_neg_eigval, bool use_gate_in_kernel, Tensor? A_log, "
      "Tensor? dt_bias, str algorithm, int chunk_size) -> (Tensor o, Tensor final_state)");
  // Backward: gradients of every differentiable input. Gradients of absent inputs (initial_state, A_log,
  // dt_bias) are empty tensors. When use_gate_in_kernel, dg is the gradient of g_raw.
  m.def(
      "bwd(Tensor d_o, Tensor? d_final_state, Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float scale, "
      "Tensor? initial_state, Tensor? cu_seqlens, Tensor? cu_seqlens_cpu, bool use_qk_l2norm_in_kernel, "
      "bool use_beta_sigmoid_in_kernel, bool allow_neg_eigval, bool use_gate_in_kernel, Tensor? A_log, "
      "Tensor? dt_bias, str algorithm, int chunk_size) -> (Tensor dq, Tensor dk, Tensor dv, Tensor dg, "
      "Tensor dbeta, Tensor d_initial_state, Tensor dA_log, Tensor ddt_bias)");
  // --- layer ops (short convolution, gated RMSNorm, decode) are defined below this line ---
}
