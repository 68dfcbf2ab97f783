// The gated delta rule in C++: the arguments of its ops as one struct, the contract between the device-generic op
// layer and each backend's core kernels, and the op layer itself (validation, the in-kernel pre-processing and its
// chain rule), which each backend instantiates with its core functions and registers beside its code
// (cpu/delta_rule.cpp, cuda/delta_rule.cpp).
//
// The core computes the gated delta rule proper on pre-processed inputs:
//   S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,   o_t = scale * S_t^T q_t.
//
// A new option of fwd/bwd is a field of DeltaRuleArgs (listed in fwd_fields / bwd_fields in schema order), its
// schema in ops.cpp and its keyword in the Python wrapper: the kernel signatures, the autograd kernel and the
// redispatching calls are all derived from DeltaRuleArgs.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "checks.h"

namespace gated_delta {

using OptTensor = c10::optional<at::Tensor>;

// ---- the arguments of gated_delta::fwd and gated_delta::bwd ----

struct DeltaRuleArgs {
  at::Tensor q, k, v, g, beta;     // [B, T, H, K] x2, [B, T, HV, V], [B, T, HV] x2
  double scale = 1.0;
  OptTensor initial_state;         // [N, HV, K, V] (or [N, HV, V, K]), any float dtype
  bool output_final_state = false;  // fwd only
  bool state_v_first = false;      // states (initial, final, their gradients) laid out [N, HV, V, K]
  OptTensor cu_seqlens;            // [N + 1] offsets of a packed batch (B = 1)
  OptTensor cu_seqlens_cpu;        // a host copy of cu_seqlens
  bool use_qk_l2norm_in_kernel = false;
  bool use_beta_sigmoid_in_kernel = false;
  bool allow_neg_eigval = false;
  bool use_gate_in_kernel = false;
  OptTensor A_log, dt_bias;        // [HV], with use_gate_in_kernel
  std::string algorithm = "auto";  // "auto" | "recurrent" | "chunk" | "scan"
  int64_t chunk_size = 64;
  // Per-key / per-value log decays [B, T, HV, K] / [B, T, HV, V] of the state's rows / columns (recurrent only).
  OptTensor gk, gv;
  // bwd only: what fwd_with_residual returned with the outputs for these inputs (opaque bytes of the backend), or
  // absent: the backward then recomputes it.
  OptTensor residual;
  // bwd only, with use_qk_l2norm_in_kernel: q and k normalised as the forward normalised them (l2norm_qk below;
  // the autograd Function keeps them from its forward), or absent: the backward normalises q and k again.
  OptTensor q_normed, k_normed;

  // The fields in the order of the fwd schema, and in the order of the bwd schema after its leading (d_o,
  // d_final_state): the two lists a new field joins. (One template each serves const and non-const access; they
  // come before their users, whose return types are deduced from them.)
  template <class Self>
  static auto fwd_fields_of(Self& a) {
    return std::tie(a.q, a.k, a.v, a.g, a.beta, a.scale, a.initial_state, a.output_final_state, a.cu_seqlens,
                    a.cu_seqlens_cpu, a.use_qk_l2norm_in_kernel, a.use_beta_sigmoid_in_kernel, a.allow_neg_eigval,
                    a.use_gate_in_kernel, a.A_log, a.dt_bias, a.algorithm, a.chunk_size, a.gk, a.gv,
                    a.state_v_first);
  }
  template <class Self>
  static auto bwd_fields_of(Self& a) {
    return std::tie(a.q, a.k, a.v, a.g, a.beta, a.scale, a.initial_state, a.cu_seqlens, a.cu_seqlens_cpu,
                    a.use_qk_l2norm_in_kernel, a.use_beta_sigmoid_in_kernel, a.allow_neg_eigval,
                    a.use_gate_in_kernel, a.A_log, a.dt_bias, a.algorithm, a.chunk_size, a.gk, a.gv,
                    a.state_v_first, a.residual, a.q_normed, a.k_normed);
  }
  auto fwd_fields() { return fwd_fields_of(*this); }
  auto fwd_fields() const { return fwd_fields_of(*this); }
  auto bwd_fields() { return bwd_fields_of(*this); }
  auto bwd_fields() const { return bwd_fields_of(*this); }
  // The differentiable inputs, in the order of the gradients the bwd op returns.
  auto differentiable_fields() const {
    return std::tie(q, k, v, g, beta, initial_state, A_log, dt_bias, gk, gv);
  }
};

using FwdResult = std::tuple<at::Tensor, at::Tensor>;  // o, final_state
using FwdResidualResult = std::tuple<at::Tensor, at::Tensor, at::Tensor>;  // o, final_state, residual
// dq, dk, dv, dg, dbeta, d_initial_state, dA_log, ddt_bias, dgk, dgv (one per differentiable field)
using BwdResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                             at::Tensor, at::Tensor, at::Tensor>;

namespace detail {

// How the dispatcher passes a field to an unboxed kernel.
template <class T> struct OpArg { using type = T; };
template <> struct OpArg<at::Tensor> { using type = const at::Tensor&; };
template <> struct OpArg<OptTensor> { using type = const OptTensor&; };
template <> struct OpArg<std::string> { using type = c10::string_view; };
template <class T> using op_arg_t = typename OpArg<std::remove_const_t<T>>::type;

template <class T, class A> void assign(T& field, const A& a) { field = a; }
inline void assign(std::string& field, c10::string_view a) { field.assign(a.data(), a.size()); }

// Sets the fields of a std::tie(...) from values in the same order.
template <class... F, class... A>
void assign_fields(std::tuple<F&...> fields, const A&... a) {
  std::apply([&](F&... f) { (assign(f, a), ...); }, fields);
}

template <class Tie> struct FieldTypes;
template <class... F> struct FieldTypes<std::tuple<F&...>> {
  // the unboxed kernel types of the fwd and bwd ops
  using fwd = FwdResult(op_arg_t<F>...);
  using fwd_residual = FwdResidualResult(op_arg_t<F>...);
  using bwd = BwdResult(const at::Tensor&, const OptTensor&, op_arg_t<F>...);

  template <FwdResult (*Fn)(const DeltaRuleArgs&)>
  static FwdResult fwd_kernel(op_arg_t<F>... a) {
    DeltaRuleArgs args;
    assign_fields(args.fwd_fields(), a...);
    return Fn(args);
  }
  template <FwdResidualResult (*Fn)(const DeltaRuleArgs&)>
  static FwdResidualResult fwd_residual_kernel(op_arg_t<F>... a) {
    DeltaRuleArgs args;
    assign_fields(args.fwd_fields(), a...);
    return Fn(args);
  }
  template <BwdResult (*Fn)(const at::Tensor&, const OptTensor&, const DeltaRuleArgs&)>
  static BwdResult bwd_kernel(const at::Tensor& d_o, const OptTensor& d_final_state, op_arg_t<F>... a) {
    DeltaRuleArgs args;
    assign_fields(args.bwd_fields(), a...);
    return Fn(d_o, d_final_state, args);
  }
};
using FwdFields = FieldTypes<decltype(std::declval<DeltaRuleArgs&>().fwd_fields())>;
using BwdFields = FieldTypes<decltype(std::declval<DeltaRuleArgs&>().bwd_fields())>;

}  // namespace detail

// The unboxed kernel of gated_delta::fwd (bwd) that calls Fn with the arguments as a DeltaRuleArgs: what every
// dispatch key registers (m.impl("fwd", fwd_kernel<my_fwd>)).
template <FwdResult (*Fn)(const DeltaRuleArgs&)>
constexpr auto fwd_kernel = &detail::FwdFields::fwd_kernel<Fn>;
template <FwdResidualResult (*Fn)(const DeltaRuleArgs&)>
constexpr auto fwd_residual_kernel = &detail::FwdFields::fwd_residual_kernel<Fn>;
template <BwdResult (*Fn)(const at::Tensor&, const OptTensor&, const DeltaRuleArgs&)>
constexpr auto bwd_kernel = &detail::BwdFields::bwd_kernel<Fn>;

// The typed handle of a registered op, for calls through the dispatcher.
template <class Signature>
c10::TypedOperatorHandle<Signature> typed_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// Calls the registered ops through the dispatcher (from the current dispatch key down).
inline FwdResult call_fwd(const DeltaRuleArgs& args) {
  static auto op = typed_op<detail::FwdFields::fwd>("gated_delta::fwd");
  return std::apply([&](const auto&... f) { return op.call(f...); }, args.fwd_fields());
}
inline FwdResidualResult call_fwd_with_residual(const DeltaRuleArgs& args) {
  static auto op = typed_op<detail::FwdFields::fwd_residual>("gated_delta::fwd_with_residual");
  return std::apply([&](const auto&... f) { return op.call(f...); }, args.fwd_fields());
}
inline BwdResult call_bwd(const at::Tensor& d_o, const OptTensor& d_final_state, const DeltaRuleArgs& args) {
  static auto op = typed_op<detail::BwdFields::bwd>("gated_delta::bwd");
  return std::apply([&](const auto&... f) { return op.call(d_o, d_final_state, f...); }, args.bwd_fields());
}

// ---- the contract between the op layer and each backend's core kernels ----

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
  // g (final log decay) and beta (final write strength): [B, T, HV]. g is float32 (float64 when v is float64);
  // beta is any floating dtype, which a backend reads as its state dtype (the CUDA chunk kernels read bf16, fp16
  // and fp32 in place, so a 16-bit beta needs no cast kernel).
  at::Tensor g, beta;
  // [N, HV, K, V] float32 (float64 for float64 inputs), or undefined for a zero initial state.
  at::Tensor initial_state;
  // Every state the core reads or writes (initial_state, final_state, d_final_state, d_initial_state) is laid out
  // [N, HV, V, K] instead: a backend reads and writes that layout in place or transposes (state_k_first).
  bool state_v_first = false;
  // [N + 1] int64 on the inputs' device, or undefined (then N = B and every sequence has length T).
  at::Tensor cu_seqlens;
  // Host copy of cu_seqlens ([N + 1] int64 on the CPU), or undefined. Always defined when cu_seqlens is defined
  // and the inputs are on the CPU; on CUDA it is defined only when the caller supplied it.
  at::Tensor cu_seqlens_cpu;
  // Per-key / per-value log decays [B, T, HV, K] / [B, T, HV, V] in the state dtype, or undefined; only with
  // Algorithm::Recurrent. Each step: S <- diag(exp(g + gk)) S diag(exp(gv)) before the delta update.
  at::Tensor gk, gv;
  double scale = 1.0;
  int64_t chunk_size = 64;
  Algorithm algorithm = Algorithm::Auto;  // the backend resolves Auto
  // Backward: a backend may return dq and dk in the dtype of q/k instead of the state dtype (saves a cast and half
  // of their memory traffic). The op layer clears it when a chain rule still has to be applied to them. (dv, which
  // no chain rule follows, a backend may always return in v's dtype.)
  bool grads_in_input_dtype = false;
  // Backward: a backend may return dbeta in beta's dtype instead of the state dtype; cleared by the op layer when
  // the sigmoid's chain rule still has to be applied to it.
  bool dbeta_in_beta_dtype = false;
  // Backward: the residual a backend's forward kept for it (CoreForward::residual), or undefined.
  at::Tensor residual;
  // Backward with use_qk_l2norm_in_kernel: the caller's k and q (q and k above are normalised), with which a backend
  // may apply the L2 norm's chain rule to dk and dq itself (CoreGrads::dk_l2norm, dq_l2norm); undefined otherwise.
  at::Tensor l2norm_k, l2norm_q;

  int64_t batch() const { return q.size(0); }
  int64_t seqlen() const { return q.size(1); }
  int64_t num_qk_heads() const { return q.size(2); }
  int64_t num_v_heads() const { return v.size(2); }
  int64_t head_k() const { return q.size(3); }
  int64_t head_v() const { return v.size(3); }
  bool has_kv_gates() const { return gk.defined() || gv.defined(); }
  int64_t num_seqs() const { return cu_seqlens.defined() ? cu_seqlens.size(0) - 1 : q.size(0); }
  at::ScalarType state_dtype() const { return acc_dtype(v.scalar_type()); }
};

// The [N, HV, K, V] view of a state in the layout given by state_v_first (a transpose is its own inverse: the same
// call turns a [K, V]-first result into the caller's layout).
inline at::Tensor state_k_first(const at::Tensor& state, bool state_v_first) {
  return state_v_first ? state.transpose(-1, -2) : state;
}

struct CoreForward {
  at::Tensor o;            // [B, T, HV, V], dtype of v
  at::Tensor final_state;  // [N, HV, K, V] state dtype, or undefined when not requested
  // When asked for (keep_residual): what the backward would otherwise recompute, as bytes the same backend's
  // backward reads (CoreArgs::residual); undefined where the backend keeps nothing.
  at::Tensor residual;
};

struct CoreGrads {
  // [B, T, H, K], grouped heads already summed; state dtype (fp32 / fp64), or the dtype of q when
  // args.grads_in_input_dtype is set and the backend supports it
  at::Tensor dq, dk;
  at::Tensor dv;           // [B, T, HV, V], state dtype or the dtype of v
  at::Tensor dg, dbeta;    // [B, T, HV], state dtype (dbeta: or beta's dtype, with args.dbeta_in_beta_dtype)
  at::Tensor d_initial_state;  // [N, HV, K, V] state dtype; undefined when args.initial_state is undefined
  at::Tensor dgk, dgv;     // [B, T, HV, K] / [B, T, HV, V] state dtype; undefined when args.gk / args.gv are
  // dk (dq) is the gradient of args.l2norm_k (l2norm_q): the chain rule of the L2 norm applied, in the dtype of q or
  // the state
  bool dk_l2norm = false, dq_l2norm = false;
};


// Each backend defines its core functions (d_final_state may be undefined: no gradient flows into the final state)
//   CoreForward core_forward_<backend>(const CoreArgs& args, bool output_final_state, bool keep_residual);
//   CoreGrads core_backward_<backend>(const CoreArgs& args, const at::Tensor& d_o, const at::Tensor& d_final_state);
// and registers fwd_kernel<fwd_impl<core_forward_<backend>>>,
// fwd_residual_kernel<fwd_residual_impl<core_forward_<backend>>> and bwd_kernel<bwd_impl<core_backward_<backend>>>,
// each with the backend's gate and beta functions (below) as further template arguments where it has its own.

// ---- the op layer: validation and the in-kernel pre-processing around a backend's core ----

// use_gate_in_kernel and use_beta_sigmoid_in_kernel, forward: g and beta as the core reads them from the caller's,
//   g = -exp(A_log) softplus(g_raw + dt_bias)   (softplus(x) = x above 20, as at::softplus)
//   beta = sigmoid(beta_raw), times 2 with allow_neg_eigval,
// both in the state dtype cd; undefined where the option is off. Backward: their chain rule from the core's dg (cd) and
// dbeta (cd), dg_raw in g's dtype, dbeta_raw in beta's, and the sums over batch and time dA_log = sum(dg g) and
// ddt_bias = sum(dg_raw) in A_log's and dt_bias's (undefined where the option, or dt_bias, is absent). Recomputed from
// the caller's inputs, nothing kept. The ATen expressions below are the reference; a backend may register kernels.
struct GateBeta {
  at::Tensor g, beta;
};
struct GateBetaGrads {
  at::Tensor dg, dbeta, dA_log, ddt_bias;
};
using GateBetaFwdFn = GateBeta (*)(const DeltaRuleArgs&, at::ScalarType);
using GateBetaBwdFn = GateBetaGrads (*)(const DeltaRuleArgs&, const at::Tensor&, const at::Tensor&);

// g_raw + dt_bias (g_raw without dt_bias) in cd: softplus's argument, forward and backward
inline at::Tensor gate_arg(const DeltaRuleArgs& x, at::ScalarType cd) {
  return x.dt_bias.has_value() ? x.g.to(cd) + x.dt_bias->to(cd) : x.g.to(cd);
}

inline GateBeta gate_beta_fwd_aten(const DeltaRuleArgs& x, at::ScalarType cd) {
  GateBeta r;
  if (x.use_beta_sigmoid_in_kernel) {
    r.beta = at::sigmoid(x.beta.to(cd));
    if (x.allow_neg_eigval) r.beta = r.beta * 2.0;
  }
  if (x.use_gate_in_kernel) {
    r.g = at::softplus(gate_arg(x, cd)).mul_(at::exp(x.A_log->to(cd)).neg_());
  }
  return r;
}

inline GateBetaGrads gate_beta_bwd_aten(const DeltaRuleArgs& x, const at::Tensor& dg, const at::Tensor& dbeta) {
  const at::ScalarType cd = dg.scalar_type();
  GateBetaGrads r;
  if (x.use_beta_sigmoid_in_kernel) {
    const at::Tensor s = at::sigmoid(x.beta.to(cd));
    r.dbeta = dbeta.to(cd) * s * (1.0 - s);
    if (x.allow_neg_eigval) r.dbeta = r.dbeta * 2.0;
    r.dbeta = r.dbeta.to(x.beta.scalar_type());
  }
  if (x.use_gate_in_kernel) {
    const at::Tensor arg = gate_arg(x, cd);
    const at::Tensor neg_a = at::exp(x.A_log->to(cd)).neg();
    const at::Tensor dgx = dg * at::sigmoid(arg) * neg_a;
    r.dA_log = (dg * (at::softplus(arg) * neg_a)).sum(at::IntArrayRef{0, 1}).to(x.A_log->scalar_type());
    if (x.dt_bias.has_value()) r.ddt_bias = dgx.sum(at::IntArrayRef{0, 1}).to(x.dt_bias->scalar_type());
    r.dg = dgx.to(x.g.scalar_type());
  }
  return r;
}

// The L2-norm ops below autograd (the op layer's use_qk_l2norm_in_kernel, and l2norm_fwd's autograd Function).
inline at::Tensor call_l2norm_fwd(const at::Tensor& x, double eps, c10::optional<at::ScalarType> out) {
  static auto op = typed_op<at::Tensor(const at::Tensor&, double, c10::optional<at::ScalarType>)>(
      "gated_delta::l2norm_fwd");
  at::AutoDispatchBelowADInplaceOrView guard;
  return op.call(x, eps, out);
}
inline at::Tensor call_l2norm_bwd(const at::Tensor& dy, const at::Tensor& x, double eps,
                                  c10::optional<at::ScalarType> out) {
  static auto op = typed_op<at::Tensor(const at::Tensor&, const at::Tensor&, double, c10::optional<at::ScalarType>)>(
      "gated_delta::l2norm_bwd");
  at::AutoDispatchBelowADInplaceOrView guard;
  return op.call(dy, x, eps, out);
}

// use_qk_l2norm_in_kernel: q and k through those ops (one kernel each way on CUDA), computed in the accumulation
// dtype and rounded to the compute dtype; the backward's chain rule recomputes the norms from q and k.
constexpr double kL2NormEps = 1e-6;

inline std::pair<at::Tensor, at::Tensor> l2norm_qk(const DeltaRuleArgs& x) {
  const at::ScalarType xd = compute_dtype(x.q.scalar_type(), x.v.scalar_type());
  return {call_l2norm_fwd(x.q, kL2NormEps, xd), call_l2norm_fwd(x.k, kL2NormEps, xd)};
}

// The core's arguments: the caller's inputs pre-processed as the in-kernel options ask.
inline CoreArgs preprocess(const DeltaRuleArgs& x, GateBetaFwdFn gate_beta) {
  CoreArgs a;
  a.algorithm = parse_algorithm(x.algorithm);
  // q, k and v may differ in dtype: the core computes in the wider one (the output and every gradient are cast
  // back to their input's dtype); g, A_log, dt_bias and the state are read in the state dtype cd, beta in its own
  // dtype unless the sigmoid is applied here (CoreArgs::beta).
  const at::ScalarType xd = compute_dtype(x.q.scalar_type(), x.v.scalar_type());
  const at::ScalarType cd = acc_dtype(xd);
  if (x.q_normed.has_value()) {  // (checked against q and k by check_delta_rule_grads)
    a.q = *x.q_normed;
    a.k = *x.k_normed;
  } else if (x.use_qk_l2norm_in_kernel) {
    std::tie(a.q, a.k) = l2norm_qk(x);
  } else {
    a.q = x.q.to(xd);
    a.k = x.k.to(xd);
  }
  a.v = x.v.to(xd);
  GateBeta gb;
  if (x.use_beta_sigmoid_in_kernel || x.use_gate_in_kernel) gb = gate_beta(x, cd);
  a.beta = x.use_beta_sigmoid_in_kernel ? gb.beta : x.beta;
  a.g = x.use_gate_in_kernel ? gb.g : x.g.to(cd);
  if (x.gk.has_value()) a.gk = x.gk->to(cd);
  if (x.gv.has_value()) a.gv = x.gv->to(cd);
  if (a.has_kv_gates()) a.algorithm = Algorithm::Recurrent;  // (checks allow only "auto" and "recurrent")
  if (x.initial_state.has_value()) a.initial_state = x.initial_state->to(cd);  // read in the state dtype
  a.state_v_first = x.state_v_first;
  if (x.cu_seqlens.has_value()) {
    a.cu_seqlens = x.cu_seqlens->to(at::kLong);
    if (x.cu_seqlens_cpu.has_value()) {
      a.cu_seqlens_cpu = x.cu_seqlens_cpu->to(at::kLong).contiguous();
    } else if (x.q.device().is_cpu()) {
      a.cu_seqlens_cpu = a.cu_seqlens.contiguous();
    }
    if (a.cu_seqlens_cpu.defined()) check_cu_seqlens_values(a.cu_seqlens_cpu, x.q.size(1), "cu_seqlens");
  }
  a.scale = x.scale;
  a.chunk_size = x.chunk_size;
  a.grads_in_input_dtype = !x.use_qk_l2norm_in_kernel;  // the L2-norm chain rule wants dq, dk unrounded
  if (x.use_qk_l2norm_in_kernel) {  // (the backward's: its core may apply the chain rule of dk and dq)
    a.l2norm_k = x.k;
    a.l2norm_q = x.q;
  }
  a.dbeta_in_beta_dtype = !x.use_beta_sigmoid_in_kernel;   // and the sigmoid's dbeta unrounded
  return a;
}

inline at::Tensor empty_grad(const at::Tensor& like) {
  return at::empty({0}, like.options().dtype(acc_dtype(like.scalar_type())));
}

using CoreFwdFn = CoreForward (*)(const CoreArgs&, bool, bool);

// The forward through a backend's core: o in v's dtype, the final state (an empty tensor unless asked for) and,
// with keep_residual, the core's residual (an empty byte tensor where it keeps none).
template <CoreFwdFn CoreFwd, GateBetaFwdFn GateBetaFwd>
CoreForward fwd_common(const DeltaRuleArgs& x, bool keep_residual) {
  const Sizes s = check_delta_rule_args(x);
  const CoreArgs core = preprocess(x, GateBetaFwd);
  const auto state_opts = x.q.options().dtype(core.state_dtype());
  CoreForward r;
  if (s.T == 0) {
    if (x.output_final_state) {
      r.final_state = core.initial_state.defined() ? core.initial_state.clone()
                                                     : at::zeros(state_shape(s, x.state_v_first), state_opts);
    }
    r.o = at::empty({s.B, 0, s.HV, s.V}, x.v.options());
  } else {
    r = CoreFwd(core, x.output_final_state, keep_residual);
    r.o = r.o.to(x.v.scalar_type());
  }
  if (!x.output_final_state) r.final_state = at::empty({0}, state_opts);
  if (keep_residual && !r.residual.defined()) r.residual = at::empty({0}, x.q.options().dtype(at::kByte));
  return r;
}

template <CoreFwdFn CoreFwd, GateBetaFwdFn GateBetaFwd = gate_beta_fwd_aten>
FwdResult fwd_impl(const DeltaRuleArgs& x) {
  CoreForward r = fwd_common<CoreFwd, GateBetaFwd>(x, /*keep_residual=*/false);
  return {r.o, r.final_state};
}

template <CoreFwdFn CoreFwd, GateBetaFwdFn GateBetaFwd = gate_beta_fwd_aten>
FwdResidualResult fwd_residual_impl(const DeltaRuleArgs& x) {
  CoreForward r = fwd_common<CoreFwd, GateBetaFwd>(x, /*keep_residual=*/true);
  return {r.o, r.final_state, r.residual};
}

template <CoreGrads (*CoreBwd)(const CoreArgs&, const at::Tensor&, const at::Tensor&),
          GateBetaFwdFn GateBetaFwd = gate_beta_fwd_aten, GateBetaBwdFn GateBetaBwd = gate_beta_bwd_aten>
BwdResult bwd_impl(const at::Tensor& d_o, const OptTensor& d_final_state, const DeltaRuleArgs& x) {
  const Sizes s = check_delta_rule_args(x);
  at::Tensor dht = check_delta_rule_grads(x, s, d_o, d_final_state);
  CoreArgs core = preprocess(x, GateBetaFwd);
  const at::ScalarType sd = core.state_dtype();
  if (dht.defined()) dht = dht.to(sd);
  if (x.residual.has_value() && x.residual->numel() > 0) core.residual = *x.residual;  // (checked above)

  CoreGrads gr;
  if (s.T == 0) {
    gr.dq = at::zeros(x.q.sizes(), x.q.options().dtype(sd));
    gr.dk = at::zeros(x.k.sizes(), x.k.options().dtype(sd));
    gr.dv = at::zeros(x.v.sizes(), x.v.options().dtype(sd));
    gr.dg = at::zeros(x.g.sizes(), x.g.options().dtype(sd));
    gr.dbeta = at::zeros(x.beta.sizes(), x.beta.options().dtype(sd));
    if (x.initial_state.has_value()) {
      gr.d_initial_state = dht.defined() ? dht.clone() : at::zeros_like(*x.initial_state);
    }
    if (x.gk.has_value()) gr.dgk = at::zeros(x.gk->sizes(), x.gk->options().dtype(sd));
    if (x.gv.has_value()) gr.dgv = at::zeros(x.gv->sizes(), x.gv->options().dtype(sd));
  } else {
    gr = CoreBwd(core, d_o, dht);
  }

  // Chain rule through the in-kernel pre-processing.
  at::Tensor dq = gr.dq, dk = gr.dk;
  if (x.use_qk_l2norm_in_kernel) {  // (from the core's unrounded dq, dk)
    if (!gr.dq_l2norm) dq = call_l2norm_bwd(dq, x.q, kL2NormEps, x.q.scalar_type());
    if (!gr.dk_l2norm) dk = call_l2norm_bwd(dk, x.k, kL2NormEps, x.k.scalar_type());
  }
  at::Tensor dbeta = gr.dbeta, dg = gr.dg, dA_log, ddt_bias;
  if (x.use_beta_sigmoid_in_kernel || x.use_gate_in_kernel) {
    GateBetaGrads gb = GateBetaBwd(x, gr.dg, gr.dbeta);
    if (x.use_beta_sigmoid_in_kernel) dbeta = gb.dbeta;
    if (x.use_gate_in_kernel) {
      dg = gb.dg;
      dA_log = gb.dA_log;
      ddt_bias = gb.ddt_bias;
    }
  }
  if (!dA_log.defined()) dA_log = empty_grad(x.q);
  if (!ddt_bias.defined()) ddt_bias = empty_grad(x.q);
  at::Tensor dh0 =
      x.initial_state.has_value() ? gr.d_initial_state.to(x.initial_state->scalar_type()) : empty_grad(x.q);
  at::Tensor dgk = x.gk.has_value() ? gr.dgk.to(x.gk->scalar_type()) : empty_grad(x.q);
  at::Tensor dgv = x.gv.has_value() ? gr.dgv.to(x.gv->scalar_type()) : empty_grad(x.q);
  return {dq.to(x.q.scalar_type()),       dk.to(x.k.scalar_type()), gr.dv.to(x.v.scalar_type()),
          dg.to(x.g.scalar_type()),       dbeta.to(x.beta.scalar_type()), dh0, dA_log, ddt_bias, dgk, dgv};
}

}  // namespace gated_delta
