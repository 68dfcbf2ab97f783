// One token of the gated delta rule against a state held in memory, on the CPU: the shared body of the decode step
// (decode_step.cpp) and of the state-pool decode (decode_pool.cpp).
//   q, k <- L2-normalised (when l2norm);  S <- alpha S;  u = beta (v - S^T k);  S <- S + k u^T;  o = scale S^T q
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

namespace gated_delta {

template <typename acc_t>
acc_t scalar_softplus(acc_t x) {
  // log(1 + e^x) without overflow; matches torch's softplus (threshold 20) to rounding.
  return x > acc_t(20) ? x : std::log1p(std::exp(x));
}

template <typename acc_t>
acc_t scalar_sigmoid(acc_t x) {
  return acc_t(1) / (acc_t(1) + std::exp(-x));
}

// Per-thread scratch of decode_token: the normalised q and k, and two rows of V.
template <typename acc_t>
struct DecodeScratch {
  std::vector<acc_t> qn, kn, sk, u;
  DecodeScratch(int64_t K, int64_t V) : qn(K), kn(K), sk(V), u(V) {}
};

// S [K, V] (row-major, updated in place); qr, kr [K]; vr, orow [V].
template <typename scalar_t, typename acc_t>
void decode_token(acc_t* S, int64_t K, int64_t V, const scalar_t* qr, const scalar_t* kr, const scalar_t* vr,
                  scalar_t* orow, acc_t alpha, acc_t beta, acc_t scale, bool l2norm, DecodeScratch<acc_t>& w) {
  acc_t qq = 0, kk = 0;
  for (int64_t x = 0; x < K; ++x) {
    w.qn[x] = static_cast<acc_t>(qr[x]);
    w.kn[x] = static_cast<acc_t>(kr[x]);
    qq += w.qn[x] * w.qn[x];
    kk += w.kn[x] * w.kn[x];
  }
  if (l2norm) {
    const acc_t rq = acc_t(1) / std::sqrt(qq + acc_t(1e-6)), rk = acc_t(1) / std::sqrt(kk + acc_t(1e-6));
    for (int64_t x = 0; x < K; ++x) {
      w.qn[x] *= rq;
      w.kn[x] *= rk;
    }
  }
  // S <- alpha S;  sk = S^T k
  for (int64_t y = 0; y < V; ++y) w.sk[y] = 0;
  for (int64_t x = 0; x < K; ++x) {
    acc_t* Sr = S + x * V;
    for (int64_t y = 0; y < V; ++y) {
      Sr[y] *= alpha;
      w.sk[y] += Sr[y] * w.kn[x];
    }
  }
  for (int64_t y = 0; y < V; ++y) w.u[y] = beta * (static_cast<acc_t>(vr[y]) - w.sk[y]);
  // S <- S + k u^T;  o = scale S^T q
  for (int64_t y = 0; y < V; ++y) w.sk[y] = 0;  // reused as the output accumulator
  for (int64_t x = 0; x < K; ++x) {
    acc_t* Sr = S + x * V;
    for (int64_t y = 0; y < V; ++y) {
      Sr[y] += w.kn[x] * w.u[y];
      w.sk[y] += Sr[y] * w.qn[x];
    }
  }
  for (int64_t y = 0; y < V; ++y) orow[y] = static_cast<scalar_t>(scale * w.sk[y]);
}

}  // namespace gated_delta
