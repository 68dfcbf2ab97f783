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
// in split bf16x3 (about fp32 accuracy):  [[A, 0], [C, B]]^-1 = [[A^-1, 0], [-B^-1 C A^-1, B^-1]]
// (16 -> 32 for the two diagonal 32-blocks, then 32 -> 64). Result in Tf (ld kLdF); Pf: kInvScratch floats.
// Reads M's lower 16 x 16 blocks only (the diagonal ones below their diagonal). Tf's six blocks above the diagonal
// blocks must hold zeros (zero_inverse_upper): no step writes them, so a caller that inverts several times into
// the same Tf zeros them once.
constexpr int kInvScratch = 32 * 33;

// Zeros the six 16 x 16 blocks of Tf above its diagonal blocks: 384 float4 stores, 3 per thread.
__device__ __forceinline__ void zero_inverse_upper(float* Tf, int tid) {
#pragma unroll
  for (int e = tid; e < 6 * 64; e += 128) {
    const int blk = e >> 6, bi = blk < 3 ? 0 : (blk < 5 ? 1 : 2), bj = blk + 1 - bi * (5 - bi) / 2;
    const int r = (e >> 2) & 15, c4 = e & 3;
    *reinterpret_cast<float4*>(Tf + (16 * bi + r) * kLdF + 16 * bj + 4 * c4) = make_float4(0.f, 0.f, 0.f, 0.f);
  }
}

__device__ __forceinline__ void block_inverse(const float* Mf, float* Tf, float* Pf, int tid) {
  constexpr int LD = kLdF;
  const int warp = tid >> 5, lane = tid & 31, g8 = lane >> 2, q = lane & 3;
  if (tid < 64) {
    const int b = tid >> 4, col = tid & 15, o = 16 * b;
    float x[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      float acc = (i == col) ? 1.f : 0.f;
#pragma unroll
      for (int j = 0; j < i; ++j) acc -= Mf[(o + i) * LD + o + j] * x[j];
      x[i] = acc;
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) Tf[(o + i) * LD + o + col] = x[i];
  }
  __syncthreads();
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
  __syncthreads();
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
  __syncthreads();
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
  __syncthreads();
}

}  // namespace cuda
}  // namespace gated_delta
