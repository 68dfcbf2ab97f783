// The one parameter struct of the gated delta rule's CUDA kernels: sizes, the varlen tables and every pointer,
// filled by the host code (cuda/delta_rule.cpp) and passed by value to each kernel. No ATen headers, so the .cu
// files compile quickly.
//
// Layouts (contiguous unless said, C = 64 tokens per chunk, NC chunks in total, padded rows of a short chunk are
// zero):
//   q, k   [BT, H, K]   v, o, d_o, dv  [BT, HV, V] (also strided: ld_* and tok_*, below)
//   g, beta, dg, dbeta  [BT, HV]  (BT = B * T flat tokens; g, dg fp32, beta, dbeta in a dtype of their own)
//   W      [NC, HV, C, K]      U     [NC, HV, C, V]     A (masked Q K^T o E)  [NC, HV, C, C]
//   Tm, TmB [NC, HV, C, C]     (I + M)^-1 and (I + M)^-1 diag(beta)
//   gam    [NC, HV, C] fp32    in-chunk cumulative log decay (padded rows repeat the last valid one)
//   hT     [NC, HV, V, K]      transposed state entering each chunk;   dhT: transposed gradient of the state
//                              leaving each chunk
//   VnT    [NC, HV, V, C]      transposed corrected values;            dVnT: their gradient
//   dW     [NC, HV, C, K]      gradient of W, at a (chunk, head) stride of V K: no buffer of its own, it lives in
//                              the first C rows of dhT's tiles (V >= C; grad_qk's work item for a 64-column block
//                              of K reads that block of dhT and no other, and writes the same block of dW once it
//                              has; grad_wy reads it there)
//   dgam1  [K / 64, NC, HV, C] fp32 partial gradients of gam (one slab per 64-wide block of K)
//   states [N or units, HV, K, V] fp32 (initial / final / segment start states)
//   segmap [units, HV, V + K, K] fp32: rows 0..V-1 hold B^T, rows V.. hold the linear part of a segment's map
//   lnorm  [NC, HV] fp32       log of a bound on each chunk's transition norm (warmup.cuh)
//   seg_ok [units, HV] int32   1 where a segment's start was proven (warmup.cuh)
#pragma once

#include <cstdint>

#include "../dispatch.cuh"

namespace gated_delta {
namespace cuda {

constexpr int kChunk = 64;
constexpr int C = kChunk;  // the kernels' name for it
// Every token's log decay g is read as max(g, -kGateFloor): e^-32 is below fp32 resolution, so the result is the same
// to fp32 rounding, and the in-chunk cumulative decay gam stays above -64 kGateFloor, where its fp32 ulp (2.4e-4)
// bounds the error of e^{gam_i - gam_j} after a reset inside a chunk (an unbounded g = -2e5 costs 1.5e-2 there).
// Applied where a gate is used, not where it is loaded: the compare would wait for the load there.
constexpr float kGateFloor = 32.f;
__host__ __device__ inline float floored_gate(float g) { return g < -kGateFloor ? -kGateFloor : g; }  // (NaN passes)

struct Params {
  // sizes
  int B, T, H, HV, K, V, N, G;  // G = HV / H
  int64_t BT;                   // B * T
  int NC;                       // total number of chunks
  int CPS;                      // chunks per sequence (equal-length batches)
  float scale;

  // varlen tables (device, int32), all null for an equal-length batch
  const int* chunk_tok;  // [NC] first token of each chunk
  const int* chunk_len;  // [NC] valid tokens of each chunk
  // work units of the sequential state kernels: (sequence, first chunk, end chunk) triples
  const int* unit_tab;   // [3 * units] or null: then units are computed from seg / segs_per_seq
  const int* unit_off;   // [N + 1] first unit of each sequence (varlen); null: n * segs_per_seq
  int num_units;
  int seg;               // chunks per unit (equal-length)
  int segs_per_seq;      // units per sequence (equal-length)
  int tile32;            // state kernels: 32-column tiles of the state (more CTAs) instead of 64
  int prep_heads;        // value heads per preparation CTA (a divisor of G; they share K K^T and Q K^T)
  int sms;               // the device's SMs (persistent kernels launch at most one CTA per SM)

  // inputs
  const void* q;
  const void* k;
  const void* v;
  const float* g;
  const void* beta;     // beta_dtype (bf16, fp16 or fp32)
  DType beta_dtype;
  const void* d_o;
  // Strides of v, o, d_o and dv, in elements: ld_* from one value head's V elements of a token to the next head's,
  // tok_* from one token to the next (V and HV V where the tensor is contiguous). A view of some columns of wider
  // rows (a slice of v's columns; v split from a fused projection's output) is read and written in place.
  int64_t ld_v, ld_o, ld_do, ld_dv;
  int64_t tok_v, tok_o, tok_do, tok_dv;

  // intermediates
  void* W;
  void* U;
  // A, gam and Tm: written by the preparation; the one-kernel forward writes them only where they are set (a
  // forward keeping its residual for the backward, which then reads them instead of running prep)
  void* A;
  void* Tm;               // [NC, HV, C, C] (I + M)^-1, written by the preparation when non-null (backward, residual)
  void* TmB;              // [NC, HV, C, C] Tm diag(beta), written by the preparation when non-null: the state
                          // passes that form W and U themselves read it (forms_wu), unless fold_beta
  int fold_beta;          // (forms_wu passes) read Tm instead of TmB and apply diag(beta) themselves, to the token
                          // columns of the operand it multiplies (the backward from a forward's residual)
  float* gam;
  void* hT;
  void* VnT;
  void* dhT;
  void* dVnT;
  float* dgam1;

  // state kernels: initial states (indexed by sequence or by unit), final states (by sequence), segment maps
  const float* init;
  int init_by_unit;
  float* fin;
  int state_vk;     // the caller's states (init by sequence, fin) are [N, HV, V, K] instead of [N, HV, K, V]
  float* segmap;
  float* segstate;  // combine kernel output: the state entering (fwd) / the gradient leaving (rev) each unit

  // segments with a proven warm-up (warmup.cuh): warm 0 off, 1 the segments, 2 the exact fallback
  int warm;
  int warm_max;  // longest warm-up, in chunks
  float* lnorm;  // written by the preparation when non-null
  int* seg_ok;

  // outputs
  void* o;
  // dq and dk in the input dtype St, or fp32 when grad_f32 is set; dv likewise by dv_f32. dk1: fp32 [BT, H, K]
  // partial sums of dk (grad_qk writes the first part, grad_wy adds over the value heads of a group, then stores
  // dk; with grad_f32 dk and dk1 may be the same buffer).
  int grad_f32;
  int dv_f32;
  void* dq;
  float* dk1;
  void* dk;
  void* dv;
  float* dg;
  void* dbeta;          // dbeta_dtype: beta's own dtype when the op layer allows it, else fp32
  DType dbeta_dtype;
  // use_qk_l2norm_in_kernel with K <= 128 (dk_l2norm): k holds the normalised keys, k_raw the caller's (k_raw_dtype;
  // head to head ld_kr, token to token tok_kr elements apart, each row contiguous), and grad_wy stores dk of k_raw,
  // r (dk_n - x r^2 (x . dk_n)) with x a row of k_raw and r = (sum(x^2) + l2norm_eps)^(-1/2), in St whatever
  // grad_f32 says (dq stays as grad_f32 says: the op layer applies its chain rule)
  int dk_l2norm;
  const void* k_raw;
  DType k_raw_dtype;
  int64_t ld_kr, tok_kr;
  float l2norm_eps;
  // likewise for dq where grad_qk holds its rows whole (grad_qk_whole_rows, dq_l2norm): q_raw the caller's q, in the
  // input dtype St (head to head ld_qr, token to token tok_qr elements apart); dq stored in St
  int dq_l2norm;
  const void* q_raw;
  int64_t ld_qr, tok_qr;
};

// Whether grad_qk holds each (chunk, q/k head)'s rows of dq whole in one CTA (its three-warpgroup kernel: 16-bit
// inputs, K = 128), so that it can apply the L2 norm's chain rule to dq itself (Params::dq_l2norm)
bool grad_qk_whole_rows(DType dtype, int K);

// CTAs along x of a sequential pass: one per unit, or with warm = 2 (the exact fallback, which runs in each
// sequence's first unit) one per sequence (warmup.cuh, pass_unit)
inline int pass_grid_units(const Params& p) { return p.warm == 2 ? p.N : p.num_units; }

// Whether the state passes form each chunk's W and U themselves, from Tm diag(beta), K and V (they then read TmB and
// never W or U): their warpgroup configurations, 16-bit inputs with K <= 128 in 64-column tiles. The forward's pass
// (state_fwd mode 0) takes 32-column tiles when tile32 is set for K = 128 only; the backward's (state_fwd mode 1,
// state_rev mode 0) whenever it is set. The scan's map passes always read W and U.
inline bool forms_wu(DType dtype, int K, int tile32, bool backward) {
  if (dtype == DType::kFloat || K > 128) return false;
  return !tile32 || (!backward && K == 64);
}

// 64-column state tiles of the warpgroup state passes (forms_wu with tile32 = 0) that share an SM, as make_layout
// counts them when it cuts sequences into segments. The forward's pass runs two: two CTAs of one warpgroup (one stage
// each) or one CTA of two (state_fwd.cuh), so that loads and products of the two overlap. The backward's passes
// (state_fwd mode 1, state_rev mode 0) run two where V holds an even number of tiles, as one CTA of two warpgroups;
// otherwise one (their two stages leave room for one CTA of state_rev).
inline int wg_tiles_per_sm(DType dtype, int K, int V, bool backward) {
  if (!forms_wu(dtype, K, /*tile32=*/0, backward)) return 1;
  return (!backward || (V / 64) % 2 == 0) ? 2 : 1;
}

// Whether the forward can run as one warp-specialised kernel (fwd_fused.cu) instead of prep + state_fwd: 16-bit
// inputs, K = 128, V a multiple of 128 (two 64-column state tiles per CTA), the forward's pass in 64-column tiles,
// no scan (whole sequences or segments).
inline bool fwd_fused_applies(DType dtype, int K, int V, int tile32, bool scan) {
  return dtype != DType::kFloat && K == 128 && V % 128 == 0 && V > 0 && !tile32 && !scan;
}

// Launchers (one per kernel family), defined in the .cu files; the storage type St is selected by dtype.
void launch_prep(const Params& p, DType dtype, void* stream);
// the backward's warm-up bounds from a forward's residual (16-bit inputs, segments): reads k, g, beta; writes lnorm
void launch_prep_residual(const Params& p, DType dtype, void* stream);
// the one-kernel forward (fwd_fused_applies): reads q, k, v, g, beta, init; writes o, fin
// (and with warm = 1, seg_ok)
void launch_fwd_fused(const Params& p, DType dtype, void* stream);
// mode: 0 forward with output, 1 forward storing hT / VnT, 2 segment maps
void launch_state_fwd(const Params& p, DType dtype, int mode, void* stream);
// mode: 0 reverse storing dhT / dVnT, 1 segment maps
void launch_state_rev(const Params& p, DType dtype, int mode, void* stream);
// reverse = 0: forward composition (start states, final state), 1: reverse (gradients)
void launch_combine(const Params& p, int reverse, void* stream);
void launch_grad_qk(const Params& p, DType dtype, void* stream);  // first, writes dq and the first part of dk
void launch_grad_wy(const Params& p, DType dtype, void* stream);  // then, adds into dk

}  // namespace cuda
}  // namespace gated_delta
