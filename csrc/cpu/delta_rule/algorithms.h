// Internal interface of the CPU backend: the problem layout, the dense kernels the algorithms share, and the
// entry points of the three algorithms (recurrent.cpp, chunk.cpp, scan.cpp).
//
// Everything runs in the state dtype T (float, or double for float64 inputs) on contiguous copies of the inputs
// made once by cpu/delta_rule.cpp, laid out so that each (sequence, value head) unit reads contiguous rows:
//   q, k:        [B, H, T, K]      v, o, d_o:  [B, HV, T, V]      g, beta:  [B, HV, T]
//   states:      [N, HV, K, V]     (initial state, final state, their gradients)
//   gk, dgk:     [B, HV, T, K]     gv, dgv:  [B, HV, T, V]     (per-key / per-value decays, recurrent only)
//   dq, dk:      [B, HV, T, K]     per VALUE head; cpu/delta_rule.cpp sums each group in a fixed order afterwards.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <numeric>
#include <vector>

namespace gated_delta {
namespace cpu {

// ---------------------------------------------------------------------------------------------------------------
// Dense kernels (blas.cpp)

// Row-major C[m x n] = alpha * op(A) op(B) + beta * C, with op(X) = X^T when the flag is set; lda, ldb, ldc are
// row strides. beta == 0 overwrites C without reading it.
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
          const float* b, int64_t ldb, float beta, float* c, int64_t ldc);
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha, const double* a,
          int64_t lda, const double* b, int64_t ldb, double beta, double* c, int64_t ldc);
// Whether gemm runs on the BLAS library PyTorch carries (false: portable loops, or GATED_DELTA_CPU_BLAS=0).
bool gemm_uses_blas();

// ---------------------------------------------------------------------------------------------------------------
// Problem layout

// One (sequence, value head) pair: the unit of sequential work.
struct Unit {
  int64_t n;    // sequence
  int64_t b;    // batch row holding its tokens (0 with cu_seqlens)
  int64_t hv;   // value head
  int64_t hq;   // its query/key head, hv / (HV / H)
  int64_t t0;   // first token
  int64_t len;  // tokens (may be 0 with cu_seqlens)
};

struct Problem {
  int64_t B, T, H, HV, K, V, N, C;
  double scale;
  std::vector<Unit> units;  // N * HV units; unit n * HV + hv
  int64_t max_len = 0;

  int64_t qk_off(const Unit& u) const { return ((u.b * H + u.hq) * T + u.t0) * K; }
  int64_t dqk_off(const Unit& u) const { return ((u.b * HV + u.hv) * T + u.t0) * K; }
  int64_t v_off(const Unit& u) const { return ((u.b * HV + u.hv) * T + u.t0) * V; }
  int64_t gb_off(const Unit& u) const { return (u.b * HV + u.hv) * T + u.t0; }
  int64_t state_off(const Unit& u) const { return (u.n * HV + u.hv) * K * V; }
  int64_t num_chunks(const Unit& u) const { return (u.len + C - 1) / C; }
  // Rows of the chunk kernels' scratch space: a chunk, or the longest unit when shorter.
  int64_t chunk_rows() const { return std::max<int64_t>(1, std::min(C, max_len)); }

  // Unit indices, longest first (the order in which dynamic scheduling balances best).
  std::vector<int64_t> units_longest_first() const {
    std::vector<int64_t> order(units.size());
    std::iota(order.begin(), order.end(), int64_t{0});
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return units[a].len > units[b].len; });
    return order;
  }
};

template <typename T>
struct Inputs {
  const T *q, *k, *v, *g, *beta;
  const T* h0;  // [N, HV, K, V] or nullptr (zero initial state)
  // per-key / per-value log decays [B, HV, T, K] / [B, HV, T, V], or nullptr (recurrent algorithm only)
  const T* gk = nullptr;
  const T* gv = nullptr;
};

template <typename T>
struct Grads {
  T *dq, *dk;     // [B, HV, T, K]
  T* dv;          // [B, HV, T, V]
  T *dg, *dbeta;  // [B, HV, T]
  T* dh0;         // [N, HV, K, V] or nullptr (not wanted)
  T* dgk = nullptr;  // [B, HV, T, K] or nullptr (no gk)
  T* dgv = nullptr;  // [B, HV, T, V] or nullptr (no gv)
};

// ---------------------------------------------------------------------------------------------------------------
// Scheduling

// Runs fn(work, i) for every i in [0, n) on the ATen thread pool. Items are handed out one at a time from a shared
// counter (dynamic scheduling: units of different lengths balance), and each worker makes its scratch space once
// with make(). Which worker runs an item never changes its result, so the output is deterministic.
template <typename Make, typename Fn>
void parallel_items(int64_t n, const Make& make, const Fn& fn) {
  if (n <= 0) return;
  const int64_t workers = std::min<int64_t>(n, at::get_num_threads());
  if (workers <= 1 || at::in_parallel_region()) {
    auto work = make();
    for (int64_t i = 0; i < n; ++i) fn(work, i);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    auto work = make();
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(work, i);
  });
}

// ---------------------------------------------------------------------------------------------------------------
// One chunk (chunk_ops.cpp): the dense within-chunk work of docs/algorithms.md, shared by chunk.cpp and scan.cpp.

template <typename T>
struct ChunkIn {
  int64_t L;          // tokens in the chunk (1 <= L <= C)
  const T *q, *k;     // L x K, row stride K
  const T* v;         // L x V, row stride V
  const T *g, *beta;  // L
};

template <typename T>
ChunkIn<T> chunk_in(const Problem& p, const Inputs<T>& in, const Unit& u, int64_t t, int64_t L) {
  ChunkIn<T> c;
  c.L = L;
  c.q = in.q + p.qk_off(u) + t * p.K;
  c.k = in.k + p.qk_off(u) + t * p.K;
  c.v = in.v + p.v_off(u) + t * p.V;
  c.g = in.g + p.gb_off(u) + t;
  c.beta = in.beta + p.gb_off(u) + t;
  return c;
}

// Scratch space of the chunk kernels for chunks of up to C tokens (one per worker).
template <typename T>
struct ChunkWork {
  ChunkWork(int64_t C, int64_t K, int64_t V);
  int64_t C, K, V;
  T eL;                                  // e^{gamma_L}
  std::vector<double> gam, dgam, dbeta;  // cumulative log decay; gradient accumulators (L)
  std::vector<T> eg, eLg, bEg;           // e^{gamma_i}, e^{gamma_L - gamma_i}, beta_i e^{gamma_i}  (L)
  std::vector<T> E, KE, M, Tm, A;        // L x L: gate factors, (k_i.k_j) E_ij, M, (I + M)^{-1}, (q_i.k_j) E_ij
  std::vector<T> Xk, Qe, Kt, W;          // L x K: diag(beta e^gamma) K, diag(e^gamma) Q, K~, Tm Xk
  std::vector<T> Z, Vn;                  // L x V: diag(beta) V - Xk S, Tm Z
  std::vector<T> dVn, Ub;                // L x V
  std::vector<T> dA, dM, RR;             // L x L
  std::vector<T> dKt, Y;                 // L x K
};

// Forward of one chunk from the state S entering it (K x V): writes o (L x V, row stride V) unless o is null,
// and the state leaving it into S_next unless S_next is null (S_next may be S).
template <typename T>
void chunk_forward_step(const ChunkIn<T>& c, T scale, const T* S, T* S_next, T* o, ChunkWork<T>& w);

// Backward of one chunk, given the state S entering it, dS_next = dL/d(state leaving it) (null: zero) and dO
// (L x V). Writes dq, dk (L x K), dv (L x V), dg, dbeta (L), and dS = dL/dS unless null (dS may be dS_next).
template <typename T>
void chunk_backward_step(const ChunkIn<T>& c, T scale, const T* S, const T* dS_next, const T* dO, T* dS, T* dq,
                         T* dk, T* dv, T* dg, T* dbeta, ChunkWork<T>& w);

// The chunk as an affine map of the state, S' = Am S + Bm (Am: K x K, Bm: K x V; Bm skipped when null), and,
// when dO is given, the affine map of the backward, dS = Am^T dS' + bm with bm = dL/dS through this chunk's
// outputs (K x V).
template <typename T>
void chunk_maps(const ChunkIn<T>& c, T scale, const T* dO, T* Am, T* Bm, T* bm, ChunkWork<T>& w);

// ---------------------------------------------------------------------------------------------------------------
// The algorithms. Forward: o [B, HV, T, V]; ht [N, HV, K, V] or nullptr. Backward: dht may be nullptr (zero).

template <typename T>
void recurrent_forward(const Problem& p, const Inputs<T>& in, T* o, T* ht);
template <typename T>
void recurrent_backward(const Problem& p, const Inputs<T>& in, const T* d_o, const T* dht, const Grads<T>& gr);

template <typename T>
void chunk_forward(const Problem& p, const Inputs<T>& in, T* o, T* ht);
template <typename T>
void chunk_backward(const Problem& p, const Inputs<T>& in, const T* d_o, const T* dht, const Grads<T>& gr);

template <typename T>
void scan_forward(const Problem& p, const Inputs<T>& in, T* o, T* ht);
template <typename T>
void scan_backward(const Problem& p, const Inputs<T>& in, const T* d_o, const T* dht, const Grads<T>& gr);

// The explicit instantiations of algorithm ALGO (ALGO_forward, ALGO_backward) for the state dtype T, in its file.
#define GATED_DELTA_CPU_ALGORITHM_INSTANCES(ALGO, T)                                 \
  template void ALGO##_forward<T>(const Problem&, const Inputs<T>&, T*, T*);         \
  template void ALGO##_backward<T>(const Problem&, const Inputs<T>&, const T*, const T*, const Grads<T>&);

}  // namespace cpu
}  // namespace gated_delta
