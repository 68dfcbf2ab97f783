// Device-generic implementation of the fwd and bwd ops: validation, the in-kernel pre-processing options and
// their chain rule, around a backend's core kernels (core.h). Each backend instantiates these templates with its
// core functions and registers them beside its code.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

#include "checks.h"
#include "delta_rule.h"

namespace gated_delta {

using OptTensor = c10::optional<at::Tensor>;

// The pre-processed inputs plus what the backward chain rule needs of the pre-processing.
struct Prepared {
  CoreArgs core;
  at::Tensor q_rnorm, k_rnorm;  // 1/sqrt(|x|^2 + eps) [B, T, H, 1] when use_qk_l2norm_in_kernel
  at::Tensor q_unit, k_unit;    // normalised q, k in the compute dtype
  at::Tensor beta_sig;          // sigmoid(beta) when use_beta_sigmoid_in_kernel
  at::Tensor gate_arg;          // g_raw + dt_bias when use_gate_in_kernel
};

constexpr double kL2NormEps = 1e-6;

inline Prepared prepare(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                        const at::Tensor& beta, double scale, const OptTensor& initial_state,
                        const OptTensor& cu_seqlens, const OptTensor& cu_seqlens_cpu, bool use_qk_l2norm,
                        bool use_beta_sigmoid, bool allow_neg_eigval, bool use_gate, const OptTensor& A_log,
                        const OptTensor& dt_bias, Algorithm algorithm, int64_t chunk_size) {
  Prepared p;
  CoreArgs& a = p.core;
  const at::ScalarType cd = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  if (use_qk_l2norm) {
    auto unit = [&](const at::Tensor& x, at::Tensor& rnorm, at::Tensor& xu) {
      auto xf = x.to(cd);
      rnorm = at::rsqrt(xf.mul(xf).sum(-1, /*keepdim=*/true).add_(kL2NormEps));
      xu = xf * rnorm;
      return xu.to(x.scalar_type());
    };
    a.q = unit(q, p.q_rnorm, p.q_unit);
    a.k = unit(k, p.k_rnorm, p.k_unit);
  } else {
    a.q = q;
    a.k = k;
  }
  a.v = v;
  if (use_beta_sigmoid) {
    p.beta_sig = at::sigmoid(beta.to(cd));
    a.beta = allow_neg_eigval ? p.beta_sig * 2.0 : p.beta_sig;
  } else {
    a.beta = beta.to(cd);
  }
  if (use_gate) {
    p.gate_arg = g.to(cd) + dt_bias->to(cd);
    a.g = at::softplus(p.gate_arg).mul_(at::exp(A_log->to(cd)).neg_());
  } else {
    a.g = g.to(cd);
  }
  if (initial_state.has_value()) a.initial_state = *initial_state;
  if (cu_seqlens.has_value()) {
    a.cu_seqlens = cu_seqlens->to(at::kLong);
    if (cu_seqlens_cpu.has_value()) {
      a.cu_seqlens_cpu = cu_seqlens_cpu->to(at::kLong).contiguous();
    } else if (q.device().is_cpu()) {
      a.cu_seqlens_cpu = a.cu_seqlens.contiguous();
    }
    if (a.cu_seqlens_cpu.defined()) check_cu_seqlens_values(a.cu_seqlens_cpu, q.size(1), "cu_seqlens");
  }
  a.scale = scale;
  a.chunk_size = chunk_size;
  a.grads_in_input_dtype = !use_qk_l2norm;  // the L2-norm chain rule wants dq, dk unrounded
  a.algorithm = algorithm;
  return p;
}

inline at::Tensor empty_grad(const at::Tensor& like) {
  return at::empty({0}, like.options().dtype(like.scalar_type() == at::kDouble ? at::kDouble : at::kFloat));
}

template <CoreForward (*CoreFwd)(const CoreArgs&, bool)>
std::tuple<at::Tensor, at::Tensor> fwd_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                            const at::Tensor& g, const at::Tensor& beta, double scale,
                                            const OptTensor& initial_state, bool output_final_state,
                                            const OptTensor& cu_seqlens, const OptTensor& cu_seqlens_cpu,
                                            bool use_qk_l2norm, bool use_beta_sigmoid, bool allow_neg_eigval,
                                            bool use_gate, const OptTensor& A_log, const OptTensor& dt_bias,
                                            c10::string_view algorithm, int64_t chunk_size) {
  const Sizes s = check_fwd_args(q, k, v, g, beta, scale, initial_state, cu_seqlens, cu_seqlens_cpu, use_gate,
                                 A_log, dt_bias, chunk_size);
  const Algorithm algo = parse_algorithm(std::string(algorithm));
  Prepared p = prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens, cu_seqlens_cpu, use_qk_l2norm,
                       use_beta_sigmoid, allow_neg_eigval, use_gate, A_log, dt_bias, algo, chunk_size);
  const auto state_opts = q.options().dtype(p.core.state_dtype());
  if (s.T == 0) {
    at::Tensor ht;
    if (output_final_state) {
      ht = initial_state.has_value() ? initial_state->clone() : at::zeros({s.N, s.HV, s.K, s.V}, state_opts);
    } else {
      ht = at::empty({0}, state_opts);
    }
    return {at::empty({s.B, 0, s.HV, s.V}, v.options()), ht};
  }
  CoreForward r = CoreFwd(p.core, output_final_state);
  at::Tensor ht = output_final_state ? r.final_state : at::empty({0}, state_opts);
  return {r.o, ht};
}

template <CoreGrads (*CoreBwd)(const CoreArgs&, const at::Tensor&, const at::Tensor&)>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> bwd_impl(
    const at::Tensor& d_o, const OptTensor& d_final_state, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta, double scale, const OptTensor& initial_state,
    const OptTensor& cu_seqlens, const OptTensor& cu_seqlens_cpu, bool use_qk_l2norm, bool use_beta_sigmoid,
    bool allow_neg_eigval, bool use_gate, const OptTensor& A_log, const OptTensor& dt_bias,
    c10::string_view algorithm, int64_t chunk_size) {
  const Sizes s = check_fwd_args(q, k, v, g, beta, scale, initial_state, cu_seqlens, cu_seqlens_cpu, use_gate,
                                 A_log, dt_bias, chunk_size);
  TORCH_CHECK(d_o.sizes() == v.sizes(), "d_o must have the shape of the output [B, T, HV, V] = ", shape_str(v),
              ", got ", shape_str(d_o));
  check_same_device(q, d_o, "d_o");
  at::Tensor dht;
  if (d_final_state.has_value() && d_final_state->numel() > 0) {
    dht = *d_final_state;
    check_same_device(q, dht, "d_final_state");
    TORCH_CHECK(dht.dim() == 4 && dht.size(0) == s.N && dht.size(1) == s.HV && dht.size(2) == s.K &&
                    dht.size(3) == s.V,
                "d_final_state must have shape [N, HV, K, V] = [", s.N, ", ", s.HV, ", ", s.K, ", ", s.V, "], got ",
                shape_str(dht));
  }
  const Algorithm algo = parse_algorithm(std::string(algorithm));
  Prepared p = prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens, cu_seqlens_cpu, use_qk_l2norm,
                       use_beta_sigmoid, allow_neg_eigval, use_gate, A_log, dt_bias, algo, chunk_size);
  const at::ScalarType sd = p.core.state_dtype();
  if (dht.defined()) dht = dht.to(sd);

  CoreGrads gr;
  if (s.T == 0) {
    gr.dq = at::zeros(q.sizes(), q.options().dtype(sd));
    gr.dk = at::zeros(k.sizes(), k.options().dtype(sd));
    gr.dv = at::zeros(v.sizes(), v.options().dtype(sd));
    gr.dg = at::zeros(g.sizes(), g.options().dtype(sd));
    gr.dbeta = at::zeros(beta.sizes(), beta.options().dtype(sd));
    if (initial_state.has_value()) {
      gr.d_initial_state = dht.defined() ? dht.clone() : at::zeros_like(*initial_state);
    }
  } else {
    gr = CoreBwd(p.core, d_o, dht);
  }

  // Chain rule through the in-kernel pre-processing.
  at::Tensor dq = gr.dq, dk = gr.dk;
  if (use_qk_l2norm) {
    // y = x r, r = (|x|^2 + eps)^(-1/2):  dx = r (dy - y (y . dy))
    auto back = [](const at::Tensor& dy, const at::Tensor& y, const at::Tensor& r) {
      return (dy - y * (y * dy).sum(-1, /*keepdim=*/true)) * r;
    };
    dq = back(dq, p.q_unit, p.q_rnorm);
    dk = back(dk, p.k_unit, p.k_rnorm);
  }
  at::Tensor dbeta = gr.dbeta;
  if (use_beta_sigmoid) {
    dbeta = dbeta * p.beta_sig * (1.0 - p.beta_sig);
    if (allow_neg_eigval) dbeta = dbeta * 2.0;
  }
  at::Tensor dg = gr.dg, dA_log, ddt_bias;
  if (use_gate) {
    // g = -exp(A_log) softplus(g_raw + dt_bias)
    auto dgx = dg * at::sigmoid(p.gate_arg) * at::exp(A_log->to(sd)).neg();
    dA_log = (dg * p.core.g).sum(at::IntArrayRef{0, 1}).to(A_log->scalar_type());
    ddt_bias = dgx.sum(at::IntArrayRef{0, 1}).to(dt_bias->scalar_type());
    dg = dgx;
  } else {
    dA_log = empty_grad(q);
    ddt_bias = empty_grad(q);
  }
  at::Tensor dh0 = initial_state.has_value() ? gr.d_initial_state.to(initial_state->scalar_type()) : empty_grad(q);
  return {dq.to(q.scalar_type()),   dk.to(k.scalar_type()),       gr.dv.to(v.scalar_type()), dg.to(g.scalar_type()),
          dbeta.to(beta.scalar_type()), dh0, dA_log, ddt_bias};
}

}  // namespace gated_delta
