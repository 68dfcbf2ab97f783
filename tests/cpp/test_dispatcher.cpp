// Calls the gated delta rule ops from C++ through the dispatcher (no Python): forward against a token-loop
// reference in float64 for every algorithm, gradients through the registered autograd kernel against autograd
// through the reference, and a bad argument's error message.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/torch.h>

#include <cstdio>
#include <string>
#include <tuple>
#include <vector>

#include "../../csrc/delta_rule.h"

namespace {

using gated_delta::OptTensor;

// The fwd op through the dispatcher, its arguments given as the library's DeltaRuleArgs.
std::tuple<at::Tensor, at::Tensor> gated_delta_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                   const at::Tensor& g, const at::Tensor& beta, double scale,
                                                   const OptTensor& h0, const OptTensor& cu_seqlens,
                                                   const std::string& algorithm) {
  gated_delta::DeltaRuleArgs args;
  args.q = q;
  args.k = k;
  args.v = v;
  args.g = g;
  args.beta = beta;
  args.scale = scale;
  args.initial_state = h0;
  args.output_final_state = true;
  args.cu_seqlens = cu_seqlens;
  args.algorithm = algorithm;
  args.chunk_size = 16;
  return gated_delta::call_fwd(args);
}

// S <- exp(g) S;  u = beta (v - S^T k);  S <- S + k u^T;  o = scale S^T q   (differentiable ATen ops)
std::tuple<at::Tensor, at::Tensor> reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                             const at::Tensor& g, const at::Tensor& beta, double scale,
                                             const at::Tensor& h0) {
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), HV = v.size(2);
  auto qe = q.repeat_interleave(HV / H, 2), ke = k.repeat_interleave(HV / H, 2);
  std::vector<at::Tensor> outs, finals;
  for (int64_t b = 0; b < B; ++b) {
    at::Tensor S = h0[b];
    std::vector<at::Tensor> ob;
    for (int64_t t = 0; t < T; ++t) {
      S = S * g[b][t].exp().view({HV, 1, 1});
      auto u = beta[b][t].view({HV, 1}) * (v[b][t] - at::einsum("hkv,hk->hv", {S, ke[b][t]}));
      S = S + ke[b][t].unsqueeze(2) * u.unsqueeze(1);
      ob.push_back(scale * at::einsum("hkv,hk->hv", {S, qe[b][t]}));
    }
    outs.push_back(at::stack(ob));
    finals.push_back(S);
  }
  return {at::stack(outs), at::stack(finals)};
}

double rel_err(const at::Tensor& a, const at::Tensor& b) {
  return ((a - b).norm() / b.norm().clamp_min(1e-300)).item<double>();
}

int failures = 0;

void expect(bool ok, const std::string& what) {
  std::printf("%s  %s\n", ok ? "ok  " : "FAIL", what.c_str());
  if (!ok) ++failures;
}

}  // namespace

int main() {
  torch::manual_seed(0);
  const int64_t B = 2, T = 37, H = 2, HV = 4, K = 8, V = 6;
  auto opts = torch::TensorOptions().dtype(torch::kFloat64);
  auto q = torch::randn({B, T, H, K}, opts), k = torch::nn::functional::normalize(
                                                 torch::randn({B, T, H, K}, opts),
                                                 torch::nn::functional::NormalizeFuncOptions().dim(-1));
  auto v = torch::randn({B, T, HV, V}, opts);
  auto g = -torch::rand({B, T, HV}, opts) * 0.5;
  auto beta = torch::rand({B, T, HV}, opts);
  auto h0 = torch::randn({B, HV, K, V}, opts);
  const double scale = 1.0 / std::sqrt(double(K));

  auto [o_ref, ht_ref] = reference(q, k, v, g, beta, scale, h0);
  for (const char* algo : {"recurrent", "chunk", "scan"}) {
    auto [o, ht] = gated_delta_fwd(q, k, v, g, beta, scale, h0, c10::nullopt, algo);
    expect(rel_err(o, o_ref) < 1e-10 && rel_err(ht, ht_ref) < 1e-10,
           std::string("forward (") + algo + ") matches the float64 token loop");
  }

  // Gradients through the registered autograd kernel against autograd through the reference.
  std::vector<at::Tensor> leaves = {q, k, v, g, beta, h0};
  for (auto& t : leaves) t = t.clone().requires_grad_(true);
  auto w_o = torch::randn({B, T, HV, V}, opts), w_h = torch::randn({B, HV, K, V}, opts);
  auto [o_r, h_r] = reference(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4], scale, leaves[5]);
  auto grads_ref = torch::autograd::grad({(o_r * w_o).sum() + (h_r * w_h).sum()}, leaves);
  for (const char* algo : {"recurrent", "chunk", "scan"}) {
    auto [o, ht] = gated_delta_fwd(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4], scale, leaves[5],
                                   c10::nullopt, algo);
    auto grads = torch::autograd::grad({(o * w_o).sum() + (ht * w_h).sum()}, leaves);
    double worst = 0;
    for (size_t i = 0; i < grads.size(); ++i) worst = std::max(worst, rel_err(grads[i], grads_ref[i]));
    expect(worst < 1e-9, std::string("gradients (") + algo + ") match autograd through the token loop, worst " +
                             std::to_string(worst));
  }

  // Packed variable-length batch: equals running the sequences separately.
  {
    auto cu = torch::tensor({0, 11, 11, 37}, torch::kInt64);
    auto q1 = q[0].unsqueeze(0), k1 = k[0].unsqueeze(0), v1 = v[0].unsqueeze(0);
    auto g1 = g[0].unsqueeze(0), b1 = beta[0].unsqueeze(0);
    auto h3 = torch::randn({3, HV, K, V}, opts);
    auto [o, ht] = gated_delta_fwd(q1, k1, v1, g1, b1, scale, h3, cu, "chunk");
    double worst = 0;
    for (int64_t n = 0; n < 3; ++n) {
      int64_t s = cu[n].item<int64_t>(), e = cu[n + 1].item<int64_t>();
      if (e == s) {
        worst = std::max(worst, rel_err(ht[n], h3[n]));
        continue;
      }
      auto sl = [&](const at::Tensor& x) { return x.slice(1, s, e); };
      auto [o_n, h_n] = reference(sl(q1), sl(k1), sl(v1), sl(g1), sl(b1), scale, h3[n].unsqueeze(0));
      worst = std::max({worst, rel_err(sl(o), o_n), rel_err(ht[n], h_n[0])});
    }
    expect(worst < 1e-10, "cu_seqlens batch equals separate sequences");
  }

  // A bad argument gives an error that names it.
  try {
    gated_delta_fwd(q, k, torch::randn({B, T, 3, V}, opts), g, beta, scale, c10::nullopt, c10::nullopt, "chunk");
    expect(false, "HV not a multiple of H raises");
  } catch (const c10::Error& e) {
    expect(std::string(e.what_without_backtrace()).find("HV a multiple of H=2") != std::string::npos,
           "HV not a multiple of H raises a clear error");
  }
  std::printf(failures ? "%d check(s) failed\n" : "all checks passed\n", failures);
  return failures ? 1 : 0;
}
