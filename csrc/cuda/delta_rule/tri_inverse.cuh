// The inverse of the unit lower-triangular (I + M) of a chunk (the WY representation's Tm), on tensor cores.
#pragma once

#include "mma.cuh"
#include "params.h"

namespace gated_delta {
namespace cuda {

// Row stride of the 64 x 64 fp32 tiles in shared memory (M, Tm, K K^T): even, so that pairs load and store as 8 bytes,
// and 4 mod 32, so that the accumulator-fragment pattern (rows g, columns 2q) and the substitution's two blocks per
// warp hit distinct banks or at most two ways
constexpr int kLdF = C + 4;

// ---- (I + M)^-1 for a strictly lower-triangular 64 x 64 fp32 M in shared memory (ld kLdF), 128 threads ----
// Diagonal 16 x 16 blocks by forward substitution (one column per thread), then two merge levels on tensor cores
// in split bf16x3 (about fp32 accuracy), or tf32 for 16-bit inputs (block_inverse<true>, below):
//   [[A, 0], [C, B]]^-1 = [[A^-1, 0], [-B^-1 C A^-1, B^-1]]
// (16 -> 32 for the two diagonal 32-blocks, then 32 -> 64). Result in Tf (ld kLdF); Pf: kInvScratch floats.
// Reads M's lower 16 x 16 blocks only (the diagonal ones below their diagonal). Tf's six blocks above the diagonal
// blocks must hold zeros (zero_inverse_upper): no step writes them, so a caller that inverts several times into
// the same Tf zeros them once.
constexpr int kInvScratch = 32 * 33;

// The barrier that closes each phase of the inverse among its 128 threads: the CTA's (__syncthreads), or a named
// barrier when the 128 threads are one warpgroup of a larger CTA (NamedBar<ID>: bar.sync ID, 128).
struct CtaBar {
  __device__ __forceinline__ void operator()() const { __syncthreads(); }
};
template <int ID> struct NamedBar {
  __device__ __forceinline__ void operator()() const { bar_sync(ID, 128); }
};

// Zeros the six 16 x 16 blocks of Tf above its diagonal blocks: 384 float4 stores, 3 per thread.
__device__ __forceinline__ void zero_inverse_upper(float* Tf, int tid) {
#pragma unroll
  for (int e = tid; e < 6 * 64; e += 128) {
    const int blk = e >> 6, bi = blk < 3 ? 0 : (blk < 5 ? 1 : 2), bj = blk + 1 - bi * (5 - bi) / 2;
    const int r = (e >> 2) & 15, c4 = e & 3;
    *reinterpret_cast<float4*>(Tf + (16 * bi + r) * kLdF + 16 * bj + 4 * c4) = make_float4(0.f, 0.f, 0.f, 0.f);
  }
}

// The four diagonal 16 x 16 blocks of Tf, by forward substitution (threads 0..63, one column each). Column-wise:
// once x[j] is final it updates every later row, so each step is up to 15 independent multiply-adds rather than
// one chain of 120; each row still takes its products in the order j = 0, 1, ..., as row by row, so the rounding
// is the same.
__device__ __forceinline__ void inverse_diag_blocks(const float* Mf, float* Tf, int tid) {
  constexpr int LD = kLdF;
  if (tid < 64) {
    const int b = tid >> 4, col = tid & 15, o = 16 * b;
    float x[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) x[i] = (i == col) ? 1.f : 0.f;
#pragma unroll
    for (int j = 0; j < 15; ++j)
#pragma unroll
      for (int i = j + 1; i < 16; ++i) x[i] -= Mf[(o + i) * LD + o + j] * x[j];
#pragma unroll
    for (int i = 0; i < 16; ++i) Tf[(o + i) * LD + o + col] = x[i];
  }
}

// The merges in tf32 (TF32 = true): for 16-bit inputs. Tm leaves prep in the input type right after the inverse
// (Tm, Tm diag(beta)), rounded to 8 (bf16) or 11 (fp16) significant bits, and the state passes use it as such; a
// tf32 operand keeps 11 (10 stored), rounded to nearest, so the merges' rounding lies below (bf16) or at (fp16) the
// storage rounding that follows. fp32 inputs keep Tm in fp32 and their results are compared at ~1e-5: the split
// products (about 16 bits) stay for them.
// A merge's intermediate P = C A^-1 stays in registers: a warp forms P^T = (A^-1)^T C^T, whose accumulator pairs
// are directly the B fragments of B^-1 P (mma.cuh). Only the 32 -> 64 level passes blocks between warps: P[0][nh]
// from warp (0, nh) to warp (1, nh) through Pf (32 bytes per lane). Blocks of A^-1 and B^-1 above the diagonal
// (zero) are skipped.
// DIAG = false: the caller has formed the diagonal blocks (inverse_diag_blocks) and passed a barrier since.
template <class Bar = CtaBar, bool DIAG = true>
__device__ __forceinline__ void block_inverse_tf32(const float* Mf, float* Tf, float* Pf, int tid) {
  const Bar sync_threads;
  constexpr int LD = kLdF;
  const int warp = tid >> 5, lane = tid & 31, g8 = lane >> 2, q = lane & 3;
  // -X's accumulator tiles to the 16 x 16 block of Tf at (r, c)
  auto store_neg = [&](const float (&x)[2][4], int r, int c) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr)
        *reinterpret_cast<float2*>(Tf + (r + g8 + 8 * hr) * LD + c + 8 * nt + 2 * q) =
            make_float2(-x[nt][2 * hr], -x[nt][2 * hr + 1]);
  };
  if constexpr (DIAG) {
    inverse_diag_blocks(Mf, Tf, tid);
    sync_threads();
  }
  if (warp < 2) {  // 16 -> 32: rows r1 = r0 + 16 against columns r0 of the diagonal 32-block r0
    const int r0 = 32 * warp, r1 = r0 + 16;
    uint32_t pb[2][2][2];  // P = M[r1][r0] A^-1 as a B operand, from P^T
    {
      float y[2][4];
      zero_acc(y);
      uint32_t a[2][4], b[2][2][2];
      lda_t_tf32(a, Tf, LD, r0, r0);
      ldb_tf32(b, Mf, LD, r1, r0);
      mma_tf32_16(y, a, b);
      frag_b_tf32_from_ct(pb, y);
    }
    float x[2][4];
    zero_acc(x);
    {
      uint32_t a[2][4];
      lda_tf32(a, Tf, LD, r1, r1);
      mma_tf32_16(x, a, pb);
    }
    store_neg(x, r1, r0);
  }
  sync_threads();
  // 32 -> 64: warp w forms P[mt][nh] (16 x 16 blocks of P = M[32:, :32] A^-1; mt = w / 2, nh = w % 2) from P^T,
  // then X[mt][nh] = -sum_{k <= mt} B^-1[mt][k] P[k][nh]
  const int mt = warp >> 1, nh = warp & 1;
  uint32_t pb[2][2][2];
  {
    float y[2][4];
    zero_acc(y);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      if (j < nh) continue;  // A^-1[0][1] = 0
      uint32_t a[2][4], b[2][2][2];
      lda_t_tf32(a, Tf, LD, 16 * nh, 16 * j);
      ldb_tf32(b, Mf, LD, 32 + 16 * mt, 16 * j);
      mma_tf32_16(y, a, b);
    }
    frag_b_tf32_from_ct(pb, y);
  }
  uint4* slot = reinterpret_cast<uint4*>(Pf) + nh * 64 + lane;  // P[0][nh] in tf32: 2 x uint4 per lane
  auto merge_out = [&](const uint32_t (&p0)[2][2][2]) {  // X[mt][nh] to Tf; p0: P[0][nh] for mt = 1
    float x[2][4];
    zero_acc(x);
    uint32_t a[2][4];
    lda_tf32(a, Tf, LD, 32 + 16 * mt, 32 + 16 * mt);
    mma_tf32_16(x, a, pb);
    if (mt == 1) {
      lda_tf32(a, Tf, LD, 48, 32);
      mma_tf32_16(x, a, p0);
    }
    store_neg(x, 32 + 16 * mt, 16 * nh);
  };
  // warps mt = 0 read and write Tf blocks that warps mt = 1 do not touch before the barrier: they finish first
  if (mt == 0) {
    slot[0] = make_uint4(pb[0][0][0], pb[0][0][1], pb[0][1][0], pb[0][1][1]);
    slot[32] = make_uint4(pb[1][0][0], pb[1][0][1], pb[1][1][0], pb[1][1][1]);
    merge_out(pb);
  }
  sync_threads();
  if (mt == 1) {
    const uint4 u = slot[0], v = slot[32];
    const uint32_t p0[2][2][2] = {{{u.x, u.y}, {u.z, u.w}}, {{v.x, v.y}, {v.z, v.w}}};
    merge_out(p0);
  }
  sync_threads();
}

// The merges in split bf16x3 (TF32 = false)
template <class Bar = CtaBar>
__device__ __forceinline__ void block_inverse_split(const float* Mf, float* Tf, float* Pf, int tid) {
  const Bar sync_threads;
  constexpr int LD = kLdF;
  const int warp = tid >> 5, lane = tid & 31, g8 = lane >> 2, q = lane & 3;
  inverse_diag_blocks(Mf, Tf, tid);
  sync_threads();
  if (warp < 2) {  // 16 -> 32: rows r1 = r0 + 16 against columns r0 of the diagonal 32-block r0
    const int r0 = 32 * warp, r1 = r0 + 16;
    float* Pw = Pf + warp * (16 * 17);
    float acc[2][4];
    zero_acc(acc);
    {
      const FragA<float> a = lda<float>(Mf, LD, r1, r0);
      FragB<float> b[2];
      ldb_t<float>(b, Tf, LD, r0, r0);
      mma<float>(acc[0], a, b[0]);
      mma<float>(acc[1], a, b[1]);
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) Pw[(g8 + 8 * (e >> 1)) * 17 + 8 * nt + 2 * q + (e & 1)] = acc[nt][e];
    __syncwarp();
    zero_acc(acc);
    {
      const FragA<float> a = lda<float>(Tf, LD, r1, r1);
      FragB<float> b[2];
      ldb_t<float>(b, Pw, 17, 0, 0);
      mma<float>(acc[0], a, b[0]);
      mma<float>(acc[1], a, b[1]);
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) Tf[(r1 + g8 + 8 * (e >> 1)) * LD + r0 + 8 * nt + 2 * q + (e & 1)] = -acc[nt][e];
  }
  sync_threads();
  // 32 -> 64: P = M[32:, :32] A^-1, then X = -B^-1 P; warp w owns the 16 x 16 block (mt = w / 2, nh = w % 2)
  const int mt = warp >> 1, nh = warp & 1;
  float acc[2][4];
  zero_acc(acc);
#pragma unroll
  for (int kt = 0; kt < 2; ++kt) {
    const FragA<float> a = lda<float>(Mf, LD, 32 + 16 * mt, 16 * kt);
    FragB<float> b[2];
    ldb_t<float>(b, Tf, LD, 16 * kt, 16 * nh);
    mma<float>(acc[0], a, b[0]);
    mma<float>(acc[1], a, b[1]);
  }
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) Pf[(16 * mt + g8 + 8 * (e >> 1)) * 33 + 16 * nh + 8 * nt + 2 * q + (e & 1)] = acc[nt][e];
  sync_threads();
  zero_acc(acc);
#pragma unroll
  for (int kt = 0; kt < 2; ++kt) {
    const FragA<float> a = lda<float>(Tf, LD, 32 + 16 * mt, 32 + 16 * kt);
    FragB<float> b[2];
    ldb_t<float>(b, Pf, 33, 16 * kt, 16 * nh);
    mma<float>(acc[0], a, b[0]);
    mma<float>(acc[1], a, b[1]);
  }
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      Tf[(32 + 16 * mt + g8 + 8 * (e >> 1)) * LD + 16 * nh + 8 * nt + 2 * q + (e & 1)] = -acc[nt][e];
  sync_threads();
}

// (I + M)^-1 with the merges' products in split bf16x3 (TF32 = false) or tf32 (TF32 = true: 16-bit inputs only)
// Bar: the barrier of its phases (CtaBar: a CTA of 128 threads; NamedBar: one warpgroup of a larger CTA, tid
// counted from its first thread).
template <bool TF32 = false, class Bar = CtaBar>
__device__ __forceinline__ void block_inverse(const float* Mf, float* Tf, float* Pf, int tid) {
  if constexpr (TF32) block_inverse_tf32<Bar>(Mf, Tf, Pf, tid);
  else block_inverse_split<Bar>(Mf, Tf, Pf, tid);
}

}  // namespace cuda
}  // namespace gated_delta
