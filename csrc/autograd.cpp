// Every C++ autograd Function of the library, registered for the Autograd key (the torchvision pattern): the
// forward redispatches below autograd to the registered forward op, the backward calls the registered backward
// op, so eager PyTorch, torch.compile and LibTorch callers all differentiate through real ops. Each saves its
// inputs, and the gated delta rule also the residual its backend's forward keeps for the backward
// (fwd_with_residual: on CUDA the chunks' preparation; no per-token state is ever kept; none in a traced call or
// with GATED_DELTA_BACKWARD_RESIDUAL=0) and, with use_qk_l2norm_in_kernel, the normalised q and k (none with
// GATED_DELTA_BACKWARD_RESIDUAL=0). A call that records no graph (grad mode off, or no input requiring grad)
// and carries no forward-mode tangent goes straight to the op below autograd.
// short_conv_update and decode_step mutate a cache and are inference-only (no autograd kernel); the backward ops
// (bwd, short_conv_bwd, gated_rmsnorm_bwd, l2norm_bwd) are not differentiable themselves.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <array>
#include <cstdlib>
#include <string>
#include <tuple>

#include "delta_rule.h"

namespace gated_delta {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor or_undefined(const OptTensor& t) { return t.has_value() ? *t : at::Tensor(); }
OptTensor or_none(const at::Tensor& t) { return t.defined() ? OptTensor(t) : c10::nullopt; }

// Whether a call needs the autograd Function: grad mode on and an input that requires grad, or an input with a
// forward-mode tangent (which the Function handles as before, whatever the grad mode). Otherwise the Autograd
// kernels call the op below autograd at once: no graph node, nothing saved (a few microseconds of host time per
// inference call).
bool requires_grad(const at::Tensor& t) { return t.defined() && t.requires_grad(); }
bool requires_grad(const OptTensor& t) { return t.has_value() && t->requires_grad(); }
bool has_tangent(const at::Tensor& t) { return t.defined() && t._fw_grad(/*level=*/0).defined(); }
bool has_tangent(const OptTensor& t) { return t.has_value() && has_tangent(*t); }
template <class... T>
bool records_graph(const T&... inputs) {
  return (at::GradMode::is_enabled() && (requires_grad(inputs) || ...)) || (has_tangent(inputs) || ...);
}

// A tensor of a traced call (torch.compile's fake or functional tensors, or a Python tensor subclass).
bool traced(const at::Tensor& t) {
  return t.key_set().has_any(c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::Functionalize}));
}

// Whether a forward that records a graph asks its backend for the residual: yes, unless
// GATED_DELTA_BACKWARD_RESIDUAL=0 in the environment, which gives the backward's time back for the memory a model
// holds from each layer's forward to its backward (read per call, a scan of the environment).
bool keep_residual() {
  const char* e = std::getenv("GATED_DELTA_BACKWARD_RESIDUAL");
  return e == nullptr || std::string(e) != "0";
}

// ---- the gated delta rule ----

// Saving DeltaRuleArgs field by field: tensors (undefined for an absent optional) go to save_for_backward, the
// other fields to saved_data under their position.
void save_field(AutogradContext*, std::vector<at::Tensor>& tensors, size_t, const at::Tensor& t) {
  tensors.push_back(t);
}
void save_field(AutogradContext*, std::vector<at::Tensor>& tensors, size_t, const OptTensor& t) {
  tensors.push_back(or_undefined(t));
}
template <class T>
void save_field(AutogradContext* ctx, std::vector<at::Tensor>&, size_t i, const T& x) {
  ctx->saved_data[std::to_string(i)] = x;
}
void load_field(AutogradContext*, const variable_list& tensors, size_t& next, size_t, at::Tensor& t) {
  t = tensors[next++];
}
void load_field(AutogradContext*, const variable_list& tensors, size_t& next, size_t, OptTensor& t) {
  t = or_none(tensors[next++]);
}
template <class T>
void load_field(AutogradContext* ctx, const variable_list&, size_t&, size_t i, T& x) {
  x = ctx->saved_data[std::to_string(i)].to<T>();
}

// (after the fwd fields, what the forward kept for the backward: the residual and the normalised q and k, each
// undefined where none was kept)
void save_args(AutogradContext* ctx, const DeltaRuleArgs& args, const at::Tensor& residual, const at::Tensor& q_normed,
               const at::Tensor& k_normed) {
  std::vector<at::Tensor> tensors;
  size_t i = 0;
  std::apply([&](const auto&... f) { (save_field(ctx, tensors, i++, f), ...); }, args.fwd_fields());
  tensors.insert(tensors.end(), {residual, q_normed, k_normed});
  ctx->save_for_backward(tensors);
}

DeltaRuleArgs load_args(AutogradContext* ctx) {
  DeltaRuleArgs args;
  const variable_list tensors = ctx->get_saved_variables();
  size_t i = 0, next = 0;
  std::apply([&](auto&... f) { (load_field(ctx, tensors, next, i++, f), ...); }, args.fwd_fields());
  if (tensors[next].defined() && tensors[next].numel() > 0) args.residual = tensors[next];
  args.q_normed = or_none(tensors[next + 1]);
  args.k_normed = or_none(tensors[next + 2]);
  return args;
}

// The gradients of the bwd op (one per differentiable field) placed at their fields' positions in the fwd
// schema; the gradient of an absent optional input is undefined.
variable_list fwd_input_grads(const DeltaRuleArgs& args, const BwdResult& grads) {
  constexpr size_t kNumDiff = std::tuple_size_v<BwdResult>;
  std::array<const void*, kNumDiff> diff_fields;
  std::array<bool, kNumDiff> present;
  std::array<at::Tensor, kNumDiff> diff_grads;
  size_t j = 0;
  auto note = [&](const auto& f) {
    diff_fields[j] = &f;
    if constexpr (std::is_same_v<std::decay_t<decltype(f)>, OptTensor>) present[j] = f.has_value();
    else present[j] = true;
    ++j;
  };
  std::apply([&](const auto&... f) { (note(f), ...); }, args.differentiable_fields());
  std::apply([&](const auto&... g) { j = 0; ((diff_grads[j++] = g), ...); }, grads);
  variable_list out;
  std::apply(
      [&](const auto&... f) {
        auto place = [&](const void* field) {
          at::Tensor g;
          for (size_t d = 0; d < kNumDiff; ++d) {
            if (diff_fields[d] == field && present[d]) g = diff_grads[d];
          }
          out.push_back(g);
        };
        (place(&f), ...);
      },
      args.fwd_fields());
  return out;
}

class DeltaRuleFunction : public torch::autograd::Function<DeltaRuleFunction> {
 public:
  // The arguments come unpacked (in fwd schema order) so that autograd sees every tensor input.
  template <class... A>
  static variable_list forward(AutogradContext* ctx, const A&... a) {
    DeltaRuleArgs args;
    detail::assign_fields(args.fwd_fields(), a...);
    at::AutoDispatchBelowADInplaceOrView guard;
    // With use_qk_l2norm_in_kernel the forward normalises q and k here and keeps them beside the residual (neither
    // with GATED_DELTA_BACKWARD_RESIDUAL=0), so that the backward does not normalise them again; the forward op
    // then runs on them without the option, which computes what it computes from q and k with it.
    DeltaRuleArgs run = args;
    at::Tensor q_normed, k_normed;
    const bool keep = keep_residual();
    if (args.use_qk_l2norm_in_kernel && keep) {
      check_delta_rule_args(args);  // (its errors name q and k)
      std::tie(q_normed, k_normed) = l2norm_qk(args);
      run.q = q_normed;
      run.k = k_normed;
      run.use_qk_l2norm_in_kernel = false;
    }
    // A traced call keeps no residual: its size depends on cu_seqlens' values and on the backend's path, an
    // unbacked size that fwd, whose outputs do not include it, could not bind. Its backward prepares the chunks
    // itself, as a call of bwd without a residual does.
    at::Tensor o, ht, residual;
    if (traced(args.q) || !keep) std::tie(o, ht) = call_fwd(run);
    else std::tie(o, ht, residual) = call_fwd_with_residual(run);
    save_args(ctx, args, residual, q_normed, k_normed);
    ctx->set_materialize_grads(false);  // an unused output's gradient stays undefined (no zeros allocated)
    if (!args.output_final_state) ctx->mark_non_differentiable({ht});
    return {o, ht};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const DeltaRuleArgs args = load_args(ctx);
    at::Tensor d_o = grads[0].defined() ? grads[0] : at::zeros_like(args.v);
    // Decided by the flag, not by the gradient's size: sizes are symbolic under torch.compile.
    OptTensor dht = args.output_final_state && grads[1].defined() ? OptTensor(grads[1]) : c10::nullopt;
    return fwd_input_grads(args, call_bwd(d_o, dht, args));
  }
};

FwdResult delta_rule_fwd_autograd(const DeltaRuleArgs& args) {
  if (!std::apply([](const auto&... f) { return records_graph(f...); }, args.differentiable_fields())) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return call_fwd(args);
  }
  auto out = std::apply([](const auto&... f) { return DeltaRuleFunction::apply(f...); }, args.fwd_fields());
  return {out[0], out[1]};
}

// ---- short convolution ----

using ConvFwd = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const OptTensor&,
                                                   const OptTensor&, const OptTensor&, bool, bool);
using ConvBwd = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const OptTensor&, const at::Tensor&, const at::Tensor&, const OptTensor&, const OptTensor&,
    const OptTensor&, bool);

// short_conv_fwd below autograd (the Function's forward, and a call that records no graph)
std::tuple<at::Tensor, at::Tensor> call_short_conv_fwd(const at::Tensor& x, const at::Tensor& weight,
                                                       const OptTensor& bias, const OptTensor& h0,
                                                       const OptTensor& cu, bool output_final_state, bool use_silu) {
  static auto op = typed_op<ConvFwd>("gated_delta::short_conv_fwd");
  at::AutoDispatchBelowADInplaceOrView guard;
  return op.call(x, weight, bias, h0, cu, output_final_state, use_silu);
}

class ShortConvFunction : public torch::autograd::Function<ShortConvFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                               const OptTensor& bias, const OptTensor& h0, const OptTensor& cu,
                               bool output_final_state, bool use_silu) {
    auto [y, ht] = call_short_conv_fwd(x, weight, bias, h0, cu, output_final_state, use_silu);
    ctx->save_for_backward({x, weight, or_undefined(bias), or_undefined(h0), or_undefined(cu)});
    ctx->saved_data["use_silu"] = use_silu;
    ctx->saved_data["output_final_state"] = output_final_state;
    if (!output_final_state) ctx->mark_non_differentiable({ht});
    return {y, ht};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = typed_op<ConvBwd>("gated_delta::short_conv_bwd");
    auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1];
    const OptTensor bias = or_none(saved[2]), h0 = or_none(saved[3]), cu = or_none(saved[4]);
    const bool use_silu = ctx->saved_data["use_silu"].toBool();
    at::Tensor dy = grads[0].defined() ? grads[0] : at::zeros_like(x);
    // (decided by the flag, not by numel, so that tracing with symbolic shapes works)
    const bool has_final = ctx->saved_data["output_final_state"].toBool();
    OptTensor dht = has_final && grads[1].defined() ? OptTensor(grads[1]) : c10::nullopt;
    auto [dx, dweight, dbias, dh0] = op.call(dy, dht, x, weight, bias, h0, cu, use_silu);
    at::Tensor none;
    return {dx, dweight, bias.has_value() ? dbias : none, h0.has_value() ? dh0 : none, none, none, none};
  }
};

std::tuple<at::Tensor, at::Tensor> short_conv_fwd_autograd(const at::Tensor& x, const at::Tensor& weight,
                                                           const OptTensor& bias, const OptTensor& h0,
                                                           const OptTensor& cu, bool output_final_state,
                                                           bool use_silu) {
  if (!records_graph(x, weight, bias, h0)) {
    return call_short_conv_fwd(x, weight, bias, h0, cu, output_final_state, use_silu);
  }
  auto out = ShortConvFunction::apply(x, weight, bias, h0, cu, output_final_state, use_silu);
  return {out[0], out[1]};
}

// ---- gated RMSNorm ----

using NormFwd = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const OptTensor&, const OptTensor&, double);
using NormBwd = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                               const OptTensor&, const OptTensor&,
                                                               const at::Tensor&, double);

// gated_rmsnorm_fwd below autograd (the Function's forward, and a call that records no graph)
std::tuple<at::Tensor, at::Tensor> call_gated_rmsnorm_fwd(const at::Tensor& x, const OptTensor& gate,
                                                          const OptTensor& weight, double eps) {
  static auto op = typed_op<NormFwd>("gated_delta::gated_rmsnorm_fwd");
  at::AutoDispatchBelowADInplaceOrView guard;
  return op.call(x, gate, weight, eps);
}

class GatedRMSNormFunction : public torch::autograd::Function<GatedRMSNormFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const OptTensor& gate,
                               const OptTensor& weight, double eps) {
    auto [y, rstd] = call_gated_rmsnorm_fwd(x, gate, weight, eps);
    ctx->save_for_backward({x, or_undefined(gate), or_undefined(weight), rstd});
    ctx->saved_data["eps"] = eps;
    ctx->mark_non_differentiable({rstd});
    return {y, rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = typed_op<NormBwd>("gated_delta::gated_rmsnorm_bwd");
    auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &rstd = saved[3];
    const OptTensor gate = or_none(saved[1]), weight = or_none(saved[2]);
    const double eps = ctx->saved_data["eps"].toDouble();
    at::Tensor dy = grads[0].defined() ? grads[0] : at::zeros_like(x);
    auto [dx, dgate, dweight] = op.call(dy, x, gate, weight, rstd, eps);
    at::Tensor none;
    return {dx, gate.has_value() ? dgate : none, weight.has_value() ? dweight : none, none};
  }
};

std::tuple<at::Tensor, at::Tensor> gated_rmsnorm_fwd_autograd(const at::Tensor& x, const OptTensor& gate,
                                                              const OptTensor& weight, double eps) {
  if (!records_graph(x, gate, weight)) return call_gated_rmsnorm_fwd(x, gate, weight, eps);
  auto out = GatedRMSNormFunction::apply(x, gate, weight, eps);
  return {out[0], out[1]};
}

// ---- L2 normalisation ----

class L2NormFunction : public torch::autograd::Function<L2NormFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, double eps,
                               c10::optional<at::ScalarType> out_dtype) {
    ctx->save_for_backward({x});
    ctx->saved_data["eps"] = eps;
    return {call_l2norm_fwd(x, eps, out_dtype)};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor x = ctx->get_saved_variables()[0];
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    return {call_l2norm_bwd(grads[0], x, ctx->saved_data["eps"].toDouble(), x.scalar_type()), at::Tensor(),
            at::Tensor()};
  }
};

at::Tensor l2norm_fwd_autograd(const at::Tensor& x, double eps, c10::optional<at::ScalarType> out_dtype) {
  if (!records_graph(x)) return call_l2norm_fwd(x, eps, out_dtype);
  return L2NormFunction::apply(x, eps, out_dtype)[0];
}

}  // namespace

TORCH_LIBRARY_IMPL(gated_delta, Autograd, m) {
  m.impl("fwd", fwd_kernel<delta_rule_fwd_autograd>);
  m.impl("short_conv_fwd", &short_conv_fwd_autograd);
  m.impl("gated_rmsnorm_fwd", &gated_rmsnorm_fwd_autograd);
  m.impl("l2norm_fwd", &l2norm_fwd_autograd);
}

}  // namespace gated_delta
