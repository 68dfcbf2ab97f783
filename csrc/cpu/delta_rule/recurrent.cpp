// The recurrent algorithm: the token loop of docs/algorithms.md, one (sequence, value head) unit per task, with
// the K x V state in a worker-local buffer and tight loops over its rows (recurrent_kernels.inc).
//
// Those loops are all the work here, so on x86-64 with GCC they are compiled twice, for the baseline instruction
// set and for AVX2 + FMA, and the CPU picks at run time (GATED_DELTA_CPU_ISA=base forces the baseline). The two
// copies live in internal-linkage namespaces, so no code built for AVX2 can be shared with the rest.
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "algorithms.h"

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define GATED_DELTA_AVX2_DISPATCH 1
#else
#define GATED_DELTA_AVX2_DISPATCH 0
#endif

namespace gated_delta {
namespace cpu {
namespace {

// The backward keeps the state entering every segment of seg_len(len) tokens, then recomputes one segment's states
// at a time: 16 tokens keeps a segment's states in cache; longer sequences get longer segments so that no more than
// kMaxCheckpoints states are kept per sequence.
constexpr int64_t kMinSegment = 16;
constexpr int64_t kMaxCheckpoints = 256;
inline int64_t seg_len(int64_t len) { return std::max(kMinSegment, (len + kMaxCheckpoints - 1) / kMaxCheckpoints); }

template <typename T>
struct UnitArgs {
  int64_t len, K, V;
  const T *q, *k;     // len x K
  const T* v;         // len x V
  const T *g, *beta;  // len
  const T* h0;        // K x V or null
  T scale;
  const T* gk = nullptr;  // len x K or null
  const T* gv = nullptr;  // len x V or null
};

template <typename T>
struct UnitGrads {
  T *dq, *dk, *dv, *dg, *dbeta;
  T* dh0;  // or null
  T* dgk = nullptr;  // len x K, or null (no gk)
  T* dgv = nullptr;  // len x V, or null (no gv)
};

namespace base {
#include "recurrent_kernels.inc"
}  // namespace base

#if GATED_DELTA_AVX2_DISPATCH
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
#include "recurrent_kernels.inc"
}  // namespace avx2
#pragma GCC pop_options
#endif

bool use_avx2() {
#if GATED_DELTA_AVX2_DISPATCH
  static const bool yes = [] {
    const char* env = std::getenv("GATED_DELTA_CPU_ISA");
    if (env != nullptr && std::strcmp(env, "base") == 0) return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return yes;
#else
  return false;
#endif
}

template <typename T>
UnitArgs<T> unit_args(const Problem& p, const Inputs<T>& in, const Unit& u) {
  UnitArgs<T> a{u.len,
                     p.K,
                     p.V,
                     in.q + p.qk_off(u),
                     in.k + p.qk_off(u),
                     in.v + p.v_off(u),
                     in.g + p.gb_off(u),
                     in.beta + p.gb_off(u),
                     in.h0 ? in.h0 + p.state_off(u) : nullptr,
                     static_cast<T>(p.scale)};
  a.gk = in.gk ? in.gk + p.dqk_off(u) : nullptr;
  a.gv = in.gv ? in.gv + p.v_off(u) : nullptr;
  return a;
}

}  // namespace

template <typename T>
void recurrent_forward(const Problem& p, const Inputs<T>& in, T* o, T* ht) {
  const int64_t KV = p.K * p.V;
  const auto order = p.units_longest_first();
  const bool avx2 = use_avx2();
  parallel_items(
      static_cast<int64_t>(order.size()), [&] { return std::vector<T>(2 * KV + 3 * p.V + p.K); },
      [&](std::vector<T>& work, int64_t idx) {
        const Unit& u = p.units[order[idx]];
        const UnitArgs<T> a = unit_args(p, in, u);
        T* ou = o + p.v_off(u);
        T* hu = ht ? ht + p.state_off(u) : nullptr;
#if GATED_DELTA_AVX2_DISPATCH
        if (avx2) return avx2::unit_forward<T>(a, ou, hu, work.data());
#endif
        (void)avx2;
        base::unit_forward<T>(a, ou, hu, work.data());
      });
}

template <typename T>
void recurrent_backward(const Problem& p, const Inputs<T>& in, const T* d_o, const T* dht, const Grads<T>& gr) {
  const int64_t K = p.K, V = p.V, KV = K * V;
  const auto order = p.units_longest_first();
  const bool avx2 = use_avx2();
  struct Work {
    std::vector<T> checkpoints, seg, D, scratch;
  };
  parallel_items(
      static_cast<int64_t>(order.size()),
      [&] {
        Work w;
        w.D.resize(KV);
        w.scratch.resize(6 * V + K);
        return w;
      },
      [&](Work& w, int64_t idx) {
        const Unit& u = p.units[order[idx]];
        const int64_t L = seg_len(u.len), nseg = (u.len + L - 1) / L;
        if (static_cast<int64_t>(w.checkpoints.size()) < std::max<int64_t>(nseg, 1) * KV) {
          w.checkpoints.resize(std::max<int64_t>(nseg, 1) * KV);
        }
        if (static_cast<int64_t>(w.seg.size()) < (L + 1) * KV) w.seg.resize((L + 1) * KV);
        const UnitArgs<T> a = unit_args(p, in, u);
        UnitGrads<T> g{gr.dq + p.dqk_off(u), gr.dk + p.dqk_off(u), gr.dv + p.v_off(u),
                       gr.dg + p.gb_off(u),  gr.dbeta + p.gb_off(u), gr.dh0 ? gr.dh0 + p.state_off(u) : nullptr};
        g.dgk = gr.dgk ? gr.dgk + p.dqk_off(u) : nullptr;
        g.dgv = gr.dgv ? gr.dgv + p.v_off(u) : nullptr;
        const T* dou = d_o + p.v_off(u);
        const T* dhu = dht ? dht + p.state_off(u) : nullptr;
#if GATED_DELTA_AVX2_DISPATCH
        if (avx2) {
          return avx2::unit_backward<T>(a, L, dou, dhu, g, w.checkpoints.data(), w.seg.data(), w.D.data(),
                                        w.scratch.data());
        }
#endif
        (void)avx2;
        base::unit_backward<T>(a, L, dou, dhu, g, w.checkpoints.data(), w.seg.data(), w.D.data(),
                               w.scratch.data());
      });
}

GATED_DELTA_CPU_ALGORITHM_INSTANCES(recurrent, float)
GATED_DELTA_CPU_ALGORITHM_INSTANCES(recurrent, double)

}  // namespace cpu
}  // namespace gated_delta
