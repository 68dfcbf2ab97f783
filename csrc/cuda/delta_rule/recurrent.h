// The recurrent (token-loop) CUDA kernels of the gated delta rule, used when per-key / per-value decays (gk, gv)
// are given. No ATen headers here: the host side is cuda/delta_rule/recurrent_host.cpp.
//
// One CTA (8 warps) per (sequence, value head, tile of 32 state columns): lane = column, and thread (warp w,
// lane) holds the state rows i = w + 8 r, r < RK (RK = ceil(K / 8) rounded up to 4, 8, 16 or 32), in fp32
// registers. Column sums (S^T k, S^T q) go across the 8 warps through shared memory in a fixed order; row sums (dq,
// dk, dgk) are warp butterflies; sums over column tiles and over the value heads of a group are separate per-tile
// partials, added in a fixed order by a reduction kernel. No atomics: reruns are bitwise identical.
//
// Layouts (contiguous; BT = B * T flat tokens):
//   q, k [BT, H, K]   v, o, d_o [BT, HV, V]   g, beta [BT, HV] fp32   gk [BT, HV, K] fp32   gv [BT, HV, V] fp32
//   h0, ht, dht, dh0 [N, HV, K, V] fp32
//   ckpt [slots, HV, K, V] fp32: the state entering every kRecChunk-token chunk; sequence n's chunks take the slots
//        from bos_n / kRecChunk + n on (disjoint across sequences; floor(BT / kRecChunk) + N slots in all)
//   scratch [CTAs, scratch_slots, KP, 32] fp32: the states of one chunk (KP = 8 RK padded rows)
//   dq_part, dk_part [BT, H, G * nvt, K]   dgk_part [BT, HV, nvt, K]   dg_part, dbeta_part [BT, HV, nvt]
//   dv, dgv [BT, HV, V] fp32
#pragma once

#include <cstdint>

#include "../dispatch.cuh"

namespace gated_delta {
namespace cuda {

constexpr int kRecChunk = 64;   // tokens between checkpoints of the backward
constexpr int kRecWarps = 8;    // warps per CTA: rows of the state are spread over them
constexpr int kRecCols = 32;    // state columns per CTA (one per lane)
constexpr int kRecMaxDim = 256;  // K and V limit of these kernels

// Rows of the state per thread for head dim K (a supported template value).
inline int rec_rows_per_thread(int64_t K) { return K <= 32 ? 4 : K <= 64 ? 8 : K <= 128 ? 16 : 32; }

struct RecParams {
  int B, T, H, HV, K, V, N, G;  // G = HV / H
  int nvt;                      // column tiles, ceil(V / 32)
  const int64_t* cu = nullptr;  // [N + 1] or nullptr (N = B sequences of T tokens)
  const void *q = nullptr, *k = nullptr, *v = nullptr;
  DType qk_dtype = DType::kFloat, v_dtype = DType::kFloat, do_dtype = DType::kFloat;
  const float *g = nullptr, *beta = nullptr;
  const float *gk = nullptr, *gv = nullptr;  // or nullptr
  float scale = 1.f;
  const float* h0 = nullptr;  // or nullptr (zero)
  bool state_v_first = false;  // h0, ht, dht, dh0 laid out [N, HV, V, K] (read and written in place)

  // forward
  void* o = nullptr;     // v dtype
  float* ht = nullptr;   // or nullptr

  // backward
  const void* d_o = nullptr;    // do_dtype
  const float* dht = nullptr;   // or nullptr (zero)
  float* ckpt = nullptr;
  float* scratch = nullptr;
  int scratch_slots = 0;        // min(kRecChunk, longest sequence) + 1
  float *dq_part = nullptr, *dk_part = nullptr, *dgk_part = nullptr;  // dgk_part: nullptr without gk
  float *dg_part = nullptr, *dbeta_part = nullptr;
  float* dv = nullptr;
  float* dgv = nullptr;         // or nullptr without gv
  float* dh0 = nullptr;         // or nullptr
};

void launch_recurrent_fwd(const RecParams& p, void* stream);
void launch_recurrent_bwd(const RecParams& p, void* stream);
// out[r, e] = sum_{i < P} in[r, i, e] for r < rows, e < E, in the order of i.
void launch_sum_parts(const float* in, float* out, int64_t rows, int P, int E, void* stream);

}  // namespace cuda
}  // namespace gated_delta
