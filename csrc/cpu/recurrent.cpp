// The recurrent algorithm: the token loop of docs/algorithms.md, one (sequence, value head) unit per task, with
// the K x V state in a worker-local buffer and tight loops over its rows.
//
// Forward step:   S <- alpha S;  u = beta (v - S^T k);  S <- S + k u^T;  o = scale S^T q
// Backward step (D = dL/dS_t after adding scale q_t do_t^T, S0 = S_{t-1}, w = D^T k, p = S0^T k):
//   dq = scale S_t do     dv = beta w     dbeta = w . (v - alpha p)     dg = alpha (<D, S0> - beta w . p)
//   dk = D u - alpha beta S0 w     dS_{t-1} = alpha (D - beta k w^T)
// The backward keeps the state every kSegment tokens from a forward pass, then walks the segments in reverse,
// recomputing each segment's states (kSegment + 1 states, never one per token of the sequence).
#include <cmath>
#include <cstring>

#include "cpu_internal.h"

namespace gated_delta {
namespace cpu {
namespace {

constexpr int64_t kSegment = 64;

// sum_d x[d] y[d] with 8 independent partial sums (vectorisable without reassociation flags).
template <typename T>
inline T dot(const T* x, const T* y, int64_t n) {
  T part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t d = 0;
  for (; d + 8 <= n; d += 8) {
    for (int l = 0; l < 8; ++l) part[l] += x[d + l] * y[d + l];
  }
  T acc = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
  for (; d < n; ++d) acc += x[d] * y[d];
  return acc;
}

// One token: S_out = alpha S_in + k u^T with u = beta (v - alpha S_in^T k); o = scale S_out^T q (o may be null).
// S_out may be S_in. acc, u: V scratch.
template <typename T>
inline void step_forward(const T* S_in, T* S_out, int64_t K, int64_t V, const T* q, const T* k, const T* v,
                         T alpha, T beta, T scale, T* o, T* acc, T* u) {
  for (int64_t j = 0; j < V; ++j) acc[j] = T(0);
  for (int64_t i = 0; i < K; ++i) {
    const T ki = k[i];
    const T* row = S_in + i * V;
    for (int64_t j = 0; j < V; ++j) acc[j] += ki * row[j];
  }
  for (int64_t j = 0; j < V; ++j) u[j] = beta * (v[j] - alpha * acc[j]);
  if (o != nullptr) {
    for (int64_t j = 0; j < V; ++j) acc[j] = T(0);
    for (int64_t i = 0; i < K; ++i) {
      const T ki = k[i], qi = q[i];
      const T* in = S_in + i * V;
      T* out = S_out + i * V;
      for (int64_t j = 0; j < V; ++j) {
        const T s = alpha * in[j] + ki * u[j];
        out[j] = s;
        acc[j] += qi * s;
      }
    }
    for (int64_t j = 0; j < V; ++j) o[j] = scale * acc[j];
  } else {
    for (int64_t i = 0; i < K; ++i) {
      const T ki = k[i];
      const T* in = S_in + i * V;
      T* out = S_out + i * V;
      for (int64_t j = 0; j < V; ++j) out[j] = alpha * in[j] + ki * u[j];
    }
  }
}

template <typename T>
struct StepGrads {
  T *dq, *dk, *dv;  // K, K, V
  T dg, dbeta;
};

// Backward of one token. D (K x V) holds dL/dS_t on entry and dL/dS_{t-1} on exit.
// Scratch: w, p, dsum, u (V each).
template <typename T>
inline void step_backward(const T* S0, const T* S1, T* D, int64_t K, int64_t V, const T* q, const T* k,
                          const T* v, T alpha, T beta, T scale, const T* d_o, StepGrads<T>& out, T* w, T* p,
                          T* dsum, T* u) {
  for (int64_t j = 0; j < V; ++j) {
    w[j] = T(0);
    p[j] = T(0);
    dsum[j] = T(0);
  }
  for (int64_t i = 0; i < K; ++i) {
    const T* s1 = S1 + i * V;
    const T* s0 = S0 + i * V;
    T* di = D + i * V;
    out.dq[i] = scale * dot(s1, d_o, V);
    const T sq = scale * q[i], ki = k[i];
    for (int64_t j = 0; j < V; ++j) {
      const T dij = di[j] + sq * d_o[j];
      di[j] = dij;
      w[j] += ki * dij;
      p[j] += ki * s0[j];
      dsum[j] += dij * s0[j];
    }
  }
  T d_s0 = 0, w_p = 0, dbeta = 0;
  for (int64_t j = 0; j < V; ++j) {
    d_s0 += dsum[j];
    w_p += w[j] * p[j];
    const T r = v[j] - alpha * p[j];
    u[j] = beta * r;
    dbeta += w[j] * r;
    out.dv[j] = beta * w[j];
  }
  out.dbeta = dbeta;
  out.dg = alpha * (d_s0 - beta * w_p);
  // dk_i = D_i . u - alpha beta S0_i . w;  D_i <- alpha (D_i - beta k_i w)
  const T ab = alpha * beta;
  for (int64_t i = 0; i < K; ++i) {
    T* di = D + i * V;
    const T* s0 = S0 + i * V;
    out.dk[i] = dot(di, u, V) - ab * dot(s0, w, V);
    const T bk = beta * k[i];
    for (int64_t j = 0; j < V; ++j) di[j] = alpha * (di[j] - bk * w[j]);
  }
}

template <typename T>
void load_state(T* S, const T* src, int64_t n) {
  if (src != nullptr) {
    std::memcpy(S, src, sizeof(T) * n);
  } else {
    std::memset(S, 0, sizeof(T) * n);
  }
}

}  // namespace

template <typename T>
void recurrent_forward(const Problem& p, const Inputs<T>& in, T* o, T* ht) {
  const int64_t K = p.K, V = p.V, KV = K * V;
  const T scale = static_cast<T>(p.scale);
  const auto order = p.units_longest_first();
  parallel_items(
      static_cast<int64_t>(order.size()), [&] { return std::vector<T>(KV + 2 * V); },
      [&](std::vector<T>& ws, int64_t idx) {
        const Unit& u = p.units[order[idx]];
        T* S = ws.data();
        T* acc = S + KV;
        T* uu = acc + V;
        load_state(S, in.h0 ? in.h0 + p.state_off(u) : nullptr, KV);
        const T* q = in.q + p.qk_off(u);
        const T* k = in.k + p.qk_off(u);
        const T* v = in.v + p.v_off(u);
        const T* g = in.g + p.gb_off(u);
        const T* beta = in.beta + p.gb_off(u);
        T* ou = o + p.v_off(u);
        for (int64_t t = 0; t < u.len; ++t) {
          step_forward(S, S, K, V, q + t * K, k + t * K, v + t * V, std::exp(g[t]), beta[t], scale, ou + t * V,
                       acc, uu);
        }
        if (ht != nullptr) std::memcpy(ht + p.state_off(u), S, sizeof(T) * KV);
      });
}

template <typename T>
void recurrent_backward(const Problem& p, const Inputs<T>& in, const T* d_o, const T* dht, const Grads<T>& gr) {
  const int64_t K = p.K, V = p.V, KV = K * V;
  const T scale = static_cast<T>(p.scale);
  const auto order = p.units_longest_first();
  struct Work {
    std::vector<T> checkpoints, seg, D, scratch;
  };
  parallel_items(
      static_cast<int64_t>(order.size()),
      [&] {
        Work w;
        w.seg.resize((kSegment + 1) * KV);
        w.D.resize(KV);
        w.scratch.resize(4 * V);
        return w;
      },
      [&](Work& w, int64_t idx) {
        const Unit& u = p.units[order[idx]];
        const T* q = in.q + p.qk_off(u);
        const T* k = in.k + p.qk_off(u);
        const T* v = in.v + p.v_off(u);
        const T* g = in.g + p.gb_off(u);
        const T* beta = in.beta + p.gb_off(u);
        const T* dou = d_o + p.v_off(u);
        T* s0 = w.scratch.data();
        T* s1 = s0 + V;
        T* s2 = s1 + V;
        T* s3 = s2 + V;
        const int64_t nseg = (u.len + kSegment - 1) / kSegment;
        // Forward pass: the state entering every segment.
        if (static_cast<int64_t>(w.checkpoints.size()) < std::max<int64_t>(nseg, 1) * KV) {
          w.checkpoints.resize(std::max<int64_t>(nseg, 1) * KV);
        }
        T* S = w.seg.data();
        load_state(S, in.h0 ? in.h0 + p.state_off(u) : nullptr, KV);
        for (int64_t s = 0; s < nseg; ++s) {
          std::memcpy(w.checkpoints.data() + s * KV, S, sizeof(T) * KV);
          const int64_t t1 = std::min(u.len, (s + 1) * kSegment);
          for (int64_t t = s * kSegment; t < t1; ++t) {
            step_forward<T>(S, S, K, V, nullptr, k + t * K, v + t * V, std::exp(g[t]), beta[t], scale, nullptr, s0,
                            s1);
          }
        }
        // Backward, segment by segment from the end.
        T* D = w.D.data();
        load_state(D, dht ? dht + p.state_off(u) : nullptr, KV);
        for (int64_t s = nseg - 1; s >= 0; --s) {
          const int64_t t0 = s * kSegment, t1 = std::min(u.len, (s + 1) * kSegment);
          T* St = w.seg.data();
          std::memcpy(St, w.checkpoints.data() + s * KV, sizeof(T) * KV);
          for (int64_t t = t0; t < t1; ++t) {
            const int64_t l = t - t0;
            step_forward<T>(St + l * KV, St + (l + 1) * KV, K, V, nullptr, k + t * K, v + t * V, std::exp(g[t]),
                            beta[t], scale, nullptr, s0, s1);
          }
          for (int64_t t = t1 - 1; t >= t0; --t) {
            const int64_t l = t - t0;
            StepGrads<T> sg;
            sg.dq = gr.dq + p.dqk_off(u) + t * K;
            sg.dk = gr.dk + p.dqk_off(u) + t * K;
            sg.dv = gr.dv + p.v_off(u) + t * V;
            step_backward(St + l * KV, St + (l + 1) * KV, D, K, V, q + t * K, k + t * K, v + t * V, std::exp(g[t]),
                          beta[t], scale, dou + t * V, sg, s0, s1, s2, s3);
            gr.dg[p.gb_off(u) + t] = sg.dg;
            gr.dbeta[p.gb_off(u) + t] = sg.dbeta;
          }
        }
        if (gr.dh0 != nullptr) std::memcpy(gr.dh0 + p.state_off(u), D, sizeof(T) * KV);
      });
}

template void recurrent_forward<float>(const Problem&, const Inputs<float>&, float*, float*);
template void recurrent_forward<double>(const Problem&, const Inputs<double>&, double*, double*);
template void recurrent_backward<float>(const Problem&, const Inputs<float>&, const float*, const float*,
                                        const Grads<float>&);
template void recurrent_backward<double>(const Problem&, const Inputs<double>&, const double*, const double*,
                                         const Grads<double>&);

}  // namespace cpu
}  // namespace gated_delta
