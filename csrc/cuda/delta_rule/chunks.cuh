// Where a kernel of the gated delta rule finds its work: the tokens of a chunk, the chunks of a work unit of the
// sequential state kernels, and the state tile such a pass starts from and leaves.
#pragma once

#include <stdint.h>

#include "../device_utils.cuh"
#include "params.h"

namespace gated_delta {
namespace cuda {

// ---- chunks and units ----
struct ChunkInfo { int64_t bos; int len; };
// Chunk c's first token and length; n: its sequence when the caller knows it (the sequential kernels walk the
// chunks of one unit), else -1 (then an equal-length batch divides by the chunks per sequence).
__device__ __forceinline__ ChunkInfo chunk_info(const Params& p, int c, int n = -1) {
  ChunkInfo ci;
  if (p.chunk_tok != nullptr) {
    ci.bos = p.chunk_tok[c];
    ci.len = p.chunk_len[c];
  } else {
    if (n < 0) n = c / p.CPS;
    const int i = c - n * p.CPS;
    ci.bos = static_cast<int64_t>(n) * p.T + static_cast<int64_t>(i) * C;
    ci.len = min(C, p.T - i * C);
  }
  // defensive clamps: never index outside [0, BT)
  ci.bos = ci.bos < 0 ? 0 : (ci.bos > p.BT ? p.BT : ci.bos);
  const int64_t room = p.BT - ci.bos;
  ci.len = max(0, min(ci.len, static_cast<int>(room < C ? room : C)));
  return ci;
}
// The bits of beta (load_bits: converted where they are used) of row i of chunk ci for value head hv; 0 past the
// chunk's length
__device__ __forceinline__ uint32_t chunk_beta_bits(const Params& p, const ChunkInfo& ci, int hv, int i) {
  return i < ci.len ? load_bits(p.beta, p.beta_dtype, (ci.bos + i) * p.HV + hv) : 0u;
}

struct Unit { int n, cb, ce; };
__device__ __forceinline__ Unit get_unit(const Params& p, int u) {
  Unit r;
  if (p.unit_tab != nullptr) {
    r.n = p.unit_tab[3 * u]; r.cb = p.unit_tab[3 * u + 1]; r.ce = p.unit_tab[3 * u + 2];
  } else {
    r.n = u / p.segs_per_seq;
    const int s = u % p.segs_per_seq;
    r.cb = r.n * p.CPS + s * p.seg;
    r.ce = min(r.cb + p.seg, (r.n + 1) * p.CPS);
  }
  r.cb = max(0, min(r.cb, p.NC));
  r.ce = max(r.cb, min(r.ce, p.NC));
  return r;
}

// The tile a sequential pass starts from, in the fragment layout of store_state_tile below: for a unit's map
// (to_map), tiles past the first V columns (homog) start from the identity and the others from zero; otherwise
// init (by unit or by sequence) when given, else zero.
template <int K, int KW, int TW>
__device__ __forceinline__ void load_state_tile(const Params& p, float (&S)[KW / 8][4], bool to_map, bool homog, int u,
                                                int n, int hv, int vt, int vr, int ks, int g8, int q) {
  const float* init = nullptr;
  int64_t sk = p.V, sv = 1;  // element (k, v) of init at init[k * sk + v * sv]
  if (!to_map && p.init != nullptr) {
    init = p.init + (static_cast<int64_t>(p.init_by_unit ? u : n) * p.HV + hv) * K * p.V;
    if (!p.init_by_unit && p.state_vk) { sk = 1; sv = K; }
  }
#pragma unroll
  for (int nt = 0; nt < KW / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int vloc = vr * 16 + g8 + 8 * (e >> 1), k = ks * KW + 8 * nt + 2 * q + (e & 1);
      float x = 0.f;
      if (to_map) {
        if (homog) x = (k == vt * TW + vloc - p.V) ? 1.f : 0.f;
      } else if (init != nullptr) {
        x = init[k * sk + (vt * TW + vloc) * sv];
      }
      S[nt][e] = x;
    }
}

// Where a sequential pass leaves its K x TW state tile, held as S^T fragments (S[nt][e] = S^T[v][k] with
// v = vr*16 + g8 + 8*(e>>1) inside the tile and k = ks*KW + 8*nt + 2q + (e&1)): into the unit's segment map
// ([units, HV, V + K, K], one K-contiguous row per tile column) when to_map, else into fin ([N, HV, K, V], or
// [N, HV, V, K] with state_vk) when the pass was asked for it.
template <int K, int KW, int TW>
__device__ __forceinline__ void store_state_tile(const Params& p, const float (&S)[KW / 8][4], bool to_map, int u,
                                                 int n, int hv, int vt, int vr, int ks, int g8, int q) {
  float* dst = nullptr;
  int64_t rstride = 0, cstride = 0;  // element (v, k) at dst[v * rstride + k * cstride]
  if (to_map) {
    dst = p.segmap + (static_cast<int64_t>(u) * p.HV + hv) * (p.V + K) * K + static_cast<int64_t>(vt) * TW * K;
    rstride = K;
    cstride = 1;
  } else if (p.fin != nullptr) {
    dst = p.fin + (static_cast<int64_t>(n) * p.HV + hv) * K * p.V;
    rstride = p.state_vk ? K : 1;
    cstride = p.state_vk ? 1 : p.V;
    dst += vt * TW * rstride;
  }
  if (dst == nullptr) return;
#pragma unroll
  for (int nt = 0; nt < KW / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int vloc = vr * 16 + g8 + 8 * (e >> 1), k = ks * KW + 8 * nt + 2 * q + (e & 1);
      dst[vloc * rstride + k * cstride] = S[nt][e];
    }
}

}  // namespace cuda
}  // namespace gated_delta
