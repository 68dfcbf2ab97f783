// The chunk algorithm: per (sequence, value head) unit, chunks of C tokens processed in order, each one dense
// matrix work (chunk_ops.cpp). Units run in parallel.
//
// Backward: a forward pass over the unit's chunks keeps the state entering each chunk (one K x V state per chunk,
// held only while the unit is processed), then the chunks are walked in reverse, each recomputing its own
// within-chunk quantities and passing dL/dS back to the previous chunk.
#include <cstring>

#include "algorithms.h"

namespace gated_delta {
namespace cpu {
namespace {

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
void chunk_forward(const Problem& p, const Inputs<T>& in, T* o, T* ht) {
  const int64_t K = p.K, V = p.V, KV = K * V, C = p.C, Cw = p.chunk_rows();
  const T scale = static_cast<T>(p.scale);
  const auto order = p.units_longest_first();
  struct Work {
    ChunkWork<T> cw;
    std::vector<T> S;
  };
  parallel_items(
      static_cast<int64_t>(order.size()), [&] { return Work{ChunkWork<T>(Cw, K, V), std::vector<T>(KV)}; },
      [&](Work& w, int64_t idx) {
        const Unit& u = p.units[order[idx]];
        T* S = w.S.data();
        load_state(S, in.h0 ? in.h0 + p.state_off(u) : nullptr, KV);
        T* ou = o + p.v_off(u);
        for (int64_t t = 0; t < u.len; t += C) {
          const int64_t L = std::min(C, u.len - t);
          chunk_forward_step(chunk_in(p, in, u, t, L), scale, S, S, ou + t * V, w.cw);
        }
        if (ht != nullptr) std::memcpy(ht + p.state_off(u), S, sizeof(T) * KV);
      });
}

template <typename T>
void chunk_backward(const Problem& p, const Inputs<T>& in, const T* d_o, const T* dht, const Grads<T>& gr) {
  const int64_t K = p.K, V = p.V, KV = K * V, C = p.C, Cw = p.chunk_rows();
  const T scale = static_cast<T>(p.scale);
  const auto order = p.units_longest_first();
  struct Work {
    ChunkWork<T> cw;
    std::vector<T> states, dS;
  };
  parallel_items(
      static_cast<int64_t>(order.size()), [&] { return Work{ChunkWork<T>(Cw, K, V), {}, std::vector<T>(KV)}; },
      [&](Work& w, int64_t idx) {
        const Unit& u = p.units[order[idx]];
        const int64_t nc = p.num_chunks(u);
        if (static_cast<int64_t>(w.states.size()) < (nc + 1) * KV) w.states.resize((nc + 1) * KV);
        // states[c] = the state entering chunk c
        T* states = w.states.data();
        load_state(states, in.h0 ? in.h0 + p.state_off(u) : nullptr, KV);
        for (int64_t c = 0; c + 1 < nc; ++c) {
          const int64_t t = c * C, L = std::min(C, u.len - t);
          chunk_forward_step<T>(chunk_in(p, in, u, t, L), scale, states + c * KV, states + (c + 1) * KV, nullptr,
                                w.cw);
        }
        T* dS = w.dS.data();
        load_state(dS, dht ? dht + p.state_off(u) : nullptr, KV);
        const T* dou = d_o + p.v_off(u);
        for (int64_t c = nc - 1; c >= 0; --c) {
          const int64_t t = c * C, L = std::min(C, u.len - t);
          chunk_backward_step<T>(chunk_in(p, in, u, t, L), scale, states + c * KV, dS, dou + t * V, dS,
                                 gr.dq + p.dqk_off(u) + t * K, gr.dk + p.dqk_off(u) + t * K,
                                 gr.dv + p.v_off(u) + t * V, gr.dg + p.gb_off(u) + t, gr.dbeta + p.gb_off(u) + t,
                                 w.cw);
        }
        if (gr.dh0 != nullptr) std::memcpy(gr.dh0 + p.state_off(u), dS, sizeof(T) * KV);
      });
}

GATED_DELTA_CPU_ALGORITHM_INSTANCES(chunk, float)
GATED_DELTA_CPU_ALGORITHM_INSTANCES(chunk, double)

}  // namespace cpu
}  // namespace gated_delta
