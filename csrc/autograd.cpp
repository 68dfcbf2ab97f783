// The C++ autograd Function of the gated delta rule, registered for the Autograd key of gated_delta::fwd.
// Its forward redispatches below autograd; its backward calls the registered gated_delta::bwd op, so eager
// PyTorch, torch.compile and LibTorch callers all differentiate through real ops. It saves the inputs only:
// the backward recomputes everything else (no per-token state is ever kept).
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <string>
#include <tuple>

namespace gated_delta {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptTensor = c10::optional<at::Tensor>;

at::Tensor or_undefined(const OptTensor& t) { return t.has_value() ? *t : at::Tensor(); }
OptTensor or_none(const at::Tensor& t) { return t.defined() ? OptTensor(t) : c10::nullopt; }

std::tuple<at::Tensor, at::Tensor> call_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                            const at::Tensor& g, const at::Tensor& beta, double scale,
                                            const OptTensor& h0, bool output_final_state, const OptTensor& cu,
                                            const OptTensor& cu_cpu, bool l2norm, bool sig, bool neg, bool gate,
                                            const OptTensor& A_log, const OptTensor& dt_bias,
                                            c10::string_view algorithm, int64_t chunk_size) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("gated_delta::fwd", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(
                           const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           const at::Tensor&, double, const OptTensor&, bool, const OptTensor&, const OptTensor&,
                           bool, bool, bool, bool, const OptTensor&, const OptTensor&, c10::string_view, int64_t)>();
  return op.call(q, k, v, g, beta, scale, h0, output_final_state, cu, cu_cpu, l2norm, sig, neg, gate, A_log,
                 dt_bias, algorithm, chunk_size);
}

using Grads8 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                          at::Tensor>;

Grads8 call_bwd(const at::Tensor& d_o, const OptTensor& dht, const at::Tensor& q, const at::Tensor& k,
                const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta, double scale, const OptTensor& h0,
                const OptTensor& cu, const OptTensor& cu_cpu, bool l2norm, bool sig, bool neg, bool gate,
                const OptTensor& A_log, const OptTensor& dt_bias, c10::string_view algorithm, int64_t chunk_size) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("gated_delta::bwd", "")
                       .typed<Grads8(const at::Tensor&, const OptTensor&, const at::Tensor&, const at::Tensor&,
                                     const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                                     const OptTensor&, const OptTensor&, const OptTensor&, bool, bool, bool, bool,
                                     const OptTensor&, const OptTensor&, c10::string_view, int64_t)>();
  return op.call(d_o, dht, q, k, v, g, beta, scale, h0, cu, cu_cpu, l2norm, sig, neg, gate, A_log, dt_bias,
                 algorithm, chunk_size);
}

class GatedDeltaRuleFunction : public torch::autograd::Function<GatedDeltaRuleFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& g, const at::Tensor& beta, double scale, const OptTensor& h0,
                               bool output_final_state, const OptTensor& cu, const OptTensor& cu_cpu, bool l2norm,
                               bool sig, bool neg, bool gate, const OptTensor& A_log, const OptTensor& dt_bias,
                               c10::string_view algorithm, int64_t chunk_size) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [o, ht] = call_fwd(q, k, v, g, beta, scale, h0, output_final_state, cu, cu_cpu, l2norm, sig, neg, gate,
                            A_log, dt_bias, algorithm, chunk_size);
    ctx->save_for_backward({q, k, v, g, beta, or_undefined(h0), or_undefined(cu), or_undefined(cu_cpu),
                            or_undefined(A_log), or_undefined(dt_bias)});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["flags"] = std::vector<bool>{l2norm, sig, neg, gate};
    ctx->saved_data["algorithm"] = std::string(algorithm);
    ctx->saved_data["chunk_size"] = chunk_size;
    ctx->saved_data["output_final_state"] = output_final_state;
    if (!output_final_state) ctx->mark_non_differentiable({ht});
    return {o, ht};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &g = saved[3], &beta = saved[4];
    const OptTensor h0 = or_none(saved[5]), cu = or_none(saved[6]), cu_cpu = or_none(saved[7]);
    const OptTensor A_log = or_none(saved[8]), dt_bias = or_none(saved[9]);
    const auto flags = ctx->saved_data["flags"].toBoolList().vec();
    const double scale = ctx->saved_data["scale"].toDouble();
    const std::string algorithm = ctx->saved_data["algorithm"].toStringRef();
    const int64_t chunk_size = ctx->saved_data["chunk_size"].toInt();

    at::Tensor d_o = grads[0].defined() ? grads[0] : at::zeros_like(v);
    // Decided by the flag, not by the gradient's size: sizes are symbolic under torch.compile.
    const bool output_final_state = ctx->saved_data["output_final_state"].toBool();
    OptTensor dht = output_final_state && grads[1].defined() ? OptTensor(grads[1]) : c10::nullopt;
    auto [dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias] =
        call_bwd(d_o, dht, q, k, v, g, beta, scale, h0, cu, cu_cpu, flags[0], flags[1], flags[2], flags[3], A_log,
                 dt_bias, algorithm, chunk_size);
    at::Tensor none;
    return {dq,   dk,   dv,   dg,   dbeta, none,                          h0.has_value() ? dh0 : none,
            none, none, none, none, none,  none,                          none,
            A_log.has_value() ? dA_log : none, dt_bias.has_value() ? ddt_bias : none, none, none};
  }
};

std::tuple<at::Tensor, at::Tensor> fwd_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                const at::Tensor& g, const at::Tensor& beta, double scale,
                                                const OptTensor& h0, bool output_final_state, const OptTensor& cu,
                                                const OptTensor& cu_cpu, bool l2norm, bool sig, bool neg, bool gate,
                                                const OptTensor& A_log, const OptTensor& dt_bias,
                                                c10::string_view algorithm, int64_t chunk_size) {
  auto out = GatedDeltaRuleFunction::apply(q, k, v, g, beta, scale, h0, output_final_state, cu, cu_cpu, l2norm, sig,
                                           neg, gate, A_log, dt_bias, algorithm, chunk_size);
  return {out[0], out[1]};
}

}  // namespace

TORCH_LIBRARY_IMPL(gated_delta, Autograd, m) { m.impl("fwd", &fwd_autograd); }

}  // namespace gated_delta
