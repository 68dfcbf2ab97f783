// The scan algorithm: every chunk is an affine map of the state, S' = Am S + Bm, and maps compose associatively,
// (A2, B2) o (A1, B1) = (A2 A1, A2 B1 + B2). So:
//   1. build every chunk's maps, in parallel over ALL chunks of all units;
//   2. an associative prefix scan gives every chunk's entering state (two levels, below);
//   3. every chunk's outputs (forward) or gradients (backward) from its entering state, in parallel over all chunks.
// The backward runs the same scan in reverse over dS = Am^T dS' + bm, from the final state's gradient.
//
// The two-level scan (reduce, scan, re-apply) splits each unit's chunks into P segments, P chosen so that all
// units together give a few segments per thread:
//   a. in parallel over the segments (all units), compose each segment's maps into one segment map (the last
//      segment of a unit needs none);
//   b. per unit (units in parallel), the P segment maps carry the unit's initial value to every segment's start
//      (P short K x K x V products);
//   c. in parallel over the segments, apply the chunk maps from the segment's start, writing each chunk's
//      entering value.
#include <cmath>
#include <cstring>

#include "algorithms.h"

namespace gated_delta {
namespace cpu {
namespace {

struct ChunkList {
  std::vector<int64_t> unit, t, len;  // per chunk: its unit, first token within the unit, tokens
  std::vector<int64_t> off, cnt;      // per unit: index of its first chunk, number of chunks
  int64_t total = 0;
};

ChunkList list_chunks(const Problem& p) {
  ChunkList cl;
  const int64_t U = static_cast<int64_t>(p.units.size());
  cl.off.resize(U);
  cl.cnt.resize(U);
  for (int64_t u = 0; u < U; ++u) {
    const Unit& un = p.units[u];
    cl.off[u] = cl.total;
    cl.cnt[u] = p.num_chunks(un);
    for (int64_t c = 0; c < cl.cnt[u]; ++c) {
      cl.unit.push_back(u);
      cl.t.push_back(c * p.C);
      cl.len.push_back(std::min(p.C, un.len - c * p.C));
    }
    cl.total += cl.cnt[u];
  }
  return cl;
}

// The associative scan of x_{i+1} = op(A_i) x_i + B_i over each unit's chunks, with op(A) = A (forward, chunk order)
// or A^T (reverse: chunks from the last to the first). X[c] receives the value entering chunk c's map and
// fin[u] the value leaving the unit's last map (fin[u] = init[u] for a unit without chunks). init == nullptr
// means zero initial values. Am: [chunks, K, K], Bm, X: [chunks, K, V], init, fin: [units, K, V].
template <typename T>
void affine_scan(const ChunkList& cl, int64_t K, int64_t V, const T* Am, const T* Bm, bool reverse, const T* init,
                 T* X, T* fin) {
  const int64_t KK = K * K, KV = K * V;
  const int64_t U = static_cast<int64_t>(cl.cnt.size());
  // Segments: about 4 per thread over all units, in proportion to each unit's chunks.
  const int64_t target = 4 * static_cast<int64_t>(at::get_num_threads());
  std::vector<int64_t> seg_len(U), seg_first(U + 1, 0);
  for (int64_t u = 0; u < U; ++u) {
    const int64_t n = cl.cnt[u];
    int64_t P = 0;
    if (n > 0) {
      P = std::max<int64_t>(1, std::min<int64_t>(n, (target * n + cl.total - 1) / std::max<int64_t>(cl.total, 1)));
      seg_len[u] = (n + P - 1) / P;
      P = (n + seg_len[u] - 1) / seg_len[u];
    }
    seg_first[u + 1] = seg_first[u] + P;
  }
  const int64_t nseg = seg_first[U];
  std::vector<int64_t> seg_unit(nseg);
  for (int64_t u = 0; u < U; ++u) {
    for (int64_t s = seg_first[u]; s < seg_first[u + 1]; ++s) seg_unit[s] = u;
  }
  // The chunk at position i (in map order) of unit u.
  auto chunk_at = [&](int64_t u, int64_t i) { return cl.off[u] + (reverse ? cl.cnt[u] - 1 - i : i); };
  auto seg_range = [&](int64_t s, int64_t& u, int64_t& i0, int64_t& i1) {
    u = seg_unit[s];
    i0 = (s - seg_first[u]) * seg_len[u];
    i1 = std::min(cl.cnt[u], i0 + seg_len[u]);
  };

  // a. segment maps of every segment but each unit's last
  std::vector<T> segA(nseg * KK), segB(nseg * KV);
  parallel_items(
      nseg, [&] { return std::vector<T>(2 * (KK + KV)); },
      [&](std::vector<T>& ws, int64_t s) {
        int64_t u, i0, i1;
        seg_range(s, u, i0, i1);
        if (s + 1 == seg_first[u + 1]) return;
        T* a0 = ws.data();
        T* b0 = a0 + KK;
        T* a1 = b0 + KV;
        T* b1 = a1 + KK;
        {
          const int64_t c = chunk_at(u, i0);
          const T* A = Am + c * KK;
          if (reverse) {
            for (int64_t r = 0; r < K; ++r)
              for (int64_t col = 0; col < K; ++col) a0[r * K + col] = A[col * K + r];
          } else {
            std::memcpy(a0, A, sizeof(T) * KK);
          }
          std::memcpy(b0, Bm + c * KV, sizeof(T) * KV);
        }
        for (int64_t i = i0 + 1; i < i1; ++i) {
          const int64_t c = chunk_at(u, i);
          const T* A = Am + c * KK;
          gemm(reverse, false, K, K, K, T(1), A, K, a0, K, T(0), a1, K);
          std::memcpy(b1, Bm + c * KV, sizeof(T) * KV);
          gemm(reverse, false, K, V, K, T(1), A, K, b0, V, T(1), b1, V);
          std::swap(a0, a1);
          std::swap(b0, b1);
        }
        std::memcpy(segA.data() + s * KK, a0, sizeof(T) * KK);
        std::memcpy(segB.data() + s * KV, b0, sizeof(T) * KV);
      });

  // b. every segment's starting value, carried across the unit's segments
  std::vector<T> seg_start(nseg * KV);
  parallel_items(
      U, [] { return 0; },
      [&](int, int64_t u) {
        const int64_t s0 = seg_first[u], s1 = seg_first[u + 1];
        if (s0 == s1) {
          if (init != nullptr) {
            std::memcpy(fin + u * KV, init + u * KV, sizeof(T) * KV);
          } else {
            std::memset(fin + u * KV, 0, sizeof(T) * KV);
          }
          return;
        }
        T* x = seg_start.data() + s0 * KV;
        if (init != nullptr) {
          std::memcpy(x, init + u * KV, sizeof(T) * KV);
        } else {
          std::memset(x, 0, sizeof(T) * KV);
        }
        for (int64_t s = s0; s + 1 < s1; ++s) {
          T* next = seg_start.data() + (s + 1) * KV;
          std::memcpy(next, segB.data() + s * KV, sizeof(T) * KV);
          gemm(false, false, K, V, K, T(1), segA.data() + s * KK, K, seg_start.data() + s * KV, V, T(1), next, V);
        }
      });

  // c. re-apply the chunk maps within every segment from its start
  parallel_items(
      nseg, [&] { return std::vector<T>(KV); },
      [&](std::vector<T>& scratch, int64_t s) {
        int64_t u, i0, i1;
        seg_range(s, u, i0, i1);
        const bool last_segment = s + 1 == seg_first[u + 1];
        T* x = X + chunk_at(u, i0) * KV;
        std::memcpy(x, seg_start.data() + s * KV, sizeof(T) * KV);
        for (int64_t i = i0; i < i1; ++i) {
          const int64_t c = chunk_at(u, i);
          T* next = i + 1 < i1 ? X + chunk_at(u, i + 1) * KV : (last_segment ? fin + u * KV : scratch.data());
          std::memcpy(next, Bm + c * KV, sizeof(T) * KV);
          gemm(reverse, false, K, V, K, T(1), Am + c * KK, K, X + c * KV, V, T(1), next, V);
        }
      });
}

template <typename T>
ChunkIn<T> chunk_of(const Problem& p, const Inputs<T>& in, const ChunkList& cl, int64_t c) {
  return chunk_in(p, in, p.units[cl.unit[c]], cl.t[c], cl.len[c]);
}

}  // namespace

template <typename T>
void scan_forward(const Problem& p, const Inputs<T>& in, T* o, T* ht) {
  const int64_t K = p.K, V = p.V, KK = K * K, KV = K * V;
  const int64_t Cw = p.chunk_rows();
  const T scale = static_cast<T>(p.scale);
  const ChunkList cl = list_chunks(p);
  const int64_t U = static_cast<int64_t>(p.units.size());
  std::vector<T> Am(cl.total * KK), Bm(cl.total * KV);
  parallel_items(
      cl.total, [&] { return ChunkWork<T>(Cw, K, V); },
      [&](ChunkWork<T>& w, int64_t c) {
        chunk_maps<T>(chunk_of(p, in, cl, c), scale, nullptr, Am.data() + c * KK, Bm.data() + c * KV, nullptr, w);
      });
  std::vector<T> X(cl.total * KV), fin(U * KV);
  affine_scan<T>(cl, K, V, Am.data(), Bm.data(), /*reverse=*/false, in.h0, X.data(), fin.data());
  parallel_items(
      cl.total, [&] { return ChunkWork<T>(Cw, K, V); },
      [&](ChunkWork<T>& w, int64_t c) {
        const Unit& u = p.units[cl.unit[c]];
        chunk_forward_step<T>(chunk_of(p, in, cl, c), scale, X.data() + c * KV, nullptr,
                              o + p.v_off(u) + cl.t[c] * V, w);
      });
  if (ht != nullptr) std::memcpy(ht, fin.data(), sizeof(T) * U * KV);
}

template <typename T>
void scan_backward(const Problem& p, const Inputs<T>& in, const T* d_o, const T* dht, const Grads<T>& gr) {
  const int64_t K = p.K, V = p.V, KK = K * K, KV = K * V;
  const int64_t Cw = p.chunk_rows();
  const T scale = static_cast<T>(p.scale);
  const ChunkList cl = list_chunks(p);
  const int64_t U = static_cast<int64_t>(p.units.size());
  std::vector<T> Am(cl.total * KK), Bm(cl.total * KV), bm(cl.total * KV);
  parallel_items(
      cl.total, [&] { return ChunkWork<T>(Cw, K, V); },
      [&](ChunkWork<T>& w, int64_t c) {
        const Unit& u = p.units[cl.unit[c]];
        chunk_maps<T>(chunk_of(p, in, cl, c), scale, d_o + p.v_off(u) + cl.t[c] * V, Am.data() + c * KK,
                      Bm.data() + c * KV, bm.data() + c * KV, w);
      });
  // States entering every chunk, then the gradients leaving every chunk (the reverse scan; its end is dL/dS_0).
  std::vector<T> X(cl.total * KV), dX(cl.total * KV), fin(U * KV);
  affine_scan<T>(cl, K, V, Am.data(), Bm.data(), /*reverse=*/false, in.h0, X.data(), fin.data());
  affine_scan<T>(cl, K, V, Am.data(), bm.data(), /*reverse=*/true, dht, dX.data(), fin.data());
  parallel_items(
      cl.total, [&] { return ChunkWork<T>(Cw, K, V); },
      [&](ChunkWork<T>& w, int64_t c) {
        const Unit& u = p.units[cl.unit[c]];
        const int64_t t = cl.t[c];
        chunk_backward_step<T>(chunk_of(p, in, cl, c), scale, X.data() + c * KV, dX.data() + c * KV,
                               d_o + p.v_off(u) + t * V, nullptr, gr.dq + p.dqk_off(u) + t * K,
                               gr.dk + p.dqk_off(u) + t * K, gr.dv + p.v_off(u) + t * V, gr.dg + p.gb_off(u) + t,
                               gr.dbeta + p.gb_off(u) + t, w);
      });
  if (gr.dh0 != nullptr) std::memcpy(gr.dh0, fin.data(), sizeof(T) * U * KV);
}

GATED_DELTA_CPU_ALGORITHM_INSTANCES(scan, float)
GATED_DELTA_CPU_ALGORITHM_INSTANCES(scan, double)

}  // namespace cpu
}  // namespace gated_delta
