// C++ autograd of the layer ops, registered for the Autograd key: the forward redispatches below autograd, the
// backward calls the registered backward op (short_conv_bwd, gated_rmsnorm_bwd), as in autograd.cpp.
// short_conv_update and decode_step mutate a cache and are inference-only (no autograd kernel).
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <tuple>

namespace gated_delta {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptTensor = c10::optional<at::Tensor>;

at::Tensor or_undefined(const OptTensor& t) { return t.has_value() ? *t : at::Tensor(); }
OptTensor or_none(const at::Tensor& t) { return t.defined() ? OptTensor(t) : c10::nullopt; }

// ---- short convolution ----

using ConvFwd = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const OptTensor&,
                                                   const OptTensor&, const OptTensor&, bool, bool);
using ConvBwd = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const OptTensor&, const at::Tensor&, const at::Tensor&, const OptTensor&, const OptTensor&,
    const OptTensor&, bool);

class ShortConvFunction : public torch::autograd::Function<ShortConvFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                               const OptTensor& bias, const OptTensor& h0, const OptTensor& cu,
                               bool output_final_state, bool use_silu) {
    static auto op =
        c10::Dispatcher::singleton().findSchemaOrThrow("gated_delta::short_conv_fwd", "").typed<ConvFwd>();
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [y, ht] = op.call(x, weight, bias, h0, cu, output_final_state, use_silu);
    ctx->save_for_backward({x, weight, or_undefined(bias), or_undefined(h0), or_undefined(cu)});
    ctx->saved_data["use_silu"] = use_silu;
    ctx->saved_data["output_final_state"] = output_final_state;
    if (!output_final_state) ctx->mark_non_differentiable({ht});
    return {y, ht};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op =
        c10::Dispatcher::singleton().findSchemaOrThrow("gated_delta::short_conv_bwd", "").typed<ConvBwd>();
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
  auto out = ShortConvFunction::apply(x, weight, bias, h0, cu, output_final_state, use_silu);
  return {out[0], out[1]};
}

// ---- gated RMSNorm ----

using NormFwd = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const OptTensor&, const OptTensor&, double);
using NormBwd = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                               const OptTensor&, const OptTensor&,
                                                               const at::Tensor&, double);

class GatedRMSNormFunction : public torch::autograd::Function<GatedRMSNormFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const OptTensor& gate,
                               const OptTensor& weight, double eps) {
    static auto op =
        c10::Dispatcher::singleton().findSchemaOrThrow("gated_delta::gated_rmsnorm_fwd", "").typed<NormFwd>();
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [y, rstd] = op.call(x, gate, weight, eps);
    ctx->save_for_backward({x, or_undefined(gate), or_undefined(weight), rstd});
    ctx->saved_data["eps"] = eps;
    ctx->mark_non_differentiable({rstd});
    return {y, rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op =
        c10::Dispatcher::singleton().findSchemaOrThrow("gated_delta::gated_rmsnorm_bwd", "").typed<NormBwd>();
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
  auto out = GatedRMSNormFunction::apply(x, gate, weight, eps);
  return {out[0], out[1]};
}

}  // namespace

TORCH_LIBRARY_IMPL(gated_delta, Autograd, m) {
  m.impl("short_conv_fwd", &short_conv_fwd_autograd);
  m.impl("gated_rmsnorm_fwd", &gated_rmsnorm_fwd_autograd);
}

}  // namespace gated_delta
