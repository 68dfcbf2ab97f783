// Tensor-core building blocks of the gated delta rule kernels: mma.sync m16n8k16 with fp32 accumulation, its
// fragments and their shared-memory (ldmatrix) loaders, warp-level products and a warp scan.
//
// Storage type St (inputs and intermediates) selects the matrix operand type:
//   __nv_bfloat16 -> bf16 operands, __half -> fp16 operands, float -> "split" operands: x = hi + lo with hi, lo bf16,
//   a product is hi*hi + hi*lo + lo*hi (three bf16 mma, about 16 bits of mantissa), so fp32 inputs keep ~1e-5.
//
// Fragment layouts (PTX ISA, mma.m16n8k16, g = lane / 4, q = lane % 4):
//   A (16x16, row-major):  x0 = A[g][2q..2q+1], x1 = A[g+8][2q..], x2 = A[g][2q+8..], x3 = A[g+8][2q+8..]
//   B (16x8):              x0 = B[2q..2q+1][g], x1 = B[2q+8..2q+9][g]
//   C (16x8, fp32):        c0,c1 = C[g][2q..2q+1], c2,c3 = C[g+8][2q..2q+1]
// Two adjacent C tiles (n = 0..7, 8..15) are exactly one A fragment of a product that contracts over n.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "../device_utils.cuh"

namespace gated_delta {
namespace cuda {

// ---- named barriers (IDs 1..15; 0 is __syncthreads) ----
// bar_sync waits until n threads (a multiple of 32) have arrived or synced on id, bar_arrive counts this thread's
// warp without waiting. Shared-memory writes before either are visible after the barrier to the threads that sync
// on it.
__device__ __forceinline__ void bar_sync(int id, int n) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void bar_arrive(int id, int n) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}

// ---- mma ----
// (mma_bf16 and mma_f16 differ only in the operand type of the instruction.)
__device__ __forceinline__ void mma_bf16(float c[4], const uint32_t a[4], const uint32_t b[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void mma_f16(float c[4], const uint32_t a[4], const uint32_t b[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ uint32_t pack_bf16(float a, float b) {
  __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&v);
}
__device__ __forceinline__ uint32_t pack_f16(float a, float b) {
  __half2 v = __floats2half2_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&v);
}
__device__ __forceinline__ float2 unpack_bf16(uint32_t u) {
  __nv_bfloat162 v = *reinterpret_cast<__nv_bfloat162*>(&u);
  return __bfloat1622float2(v);
}
__device__ __forceinline__ float2 unpack_f16(uint32_t u) {
  __half2 v = *reinterpret_cast<__half2*>(&u);
  return __half22float2(v);
}
// a packed pair of a 16-bit storage type (an operand register) as two floats
template <class St> __device__ __forceinline__ float2 unpack2(uint32_t u) {
  static_assert(sizeof(St) == 2, "packed pairs are 16-bit types");
  if constexpr (std::is_same_v<St, __half>) return unpack_f16(u);
  else return unpack_bf16(u);
}

template <class St> struct FragA { uint32_t x[4]; };
template <> struct FragA<float> { uint32_t hi[4], lo[4]; };
template <class St> struct FragB { uint32_t x[2]; };
template <> struct FragB<float> { uint32_t hi[2], lo[2]; };

// a pair of floats into one operand register (and its low part for the split type)
template <class St> struct Pack;
template <> struct Pack<__nv_bfloat16> {
  static __device__ __forceinline__ void put(uint32_t* x, uint32_t*, int i, float a, float b) { x[i] = pack_bf16(a, b); }
};
template <> struct Pack<__half> {
  static __device__ __forceinline__ void put(uint32_t* x, uint32_t*, int i, float a, float b) { x[i] = pack_f16(a, b); }
};
template <> struct Pack<float> {
  static __device__ __forceinline__ void put(uint32_t* hi, uint32_t* lo, int i, float a, float b) {
    const uint32_t h = pack_bf16(a, b);
    const float2 hf = unpack_bf16(h);
    hi[i] = h;
    lo[i] = pack_bf16(a - hf.x, b - hf.y);
  }
};

template <class St> __device__ __forceinline__ void mma(float c[4], const FragA<St>& a, const FragB<St>& b);
template <> __device__ __forceinline__ void mma<__nv_bfloat16>(float c[4], const FragA<__nv_bfloat16>& a,
                                                               const FragB<__nv_bfloat16>& b) {
  mma_bf16(c, a.x, b.x);
}
template <> __device__ __forceinline__ void mma<__half>(float c[4], const FragA<__half>& a, const FragB<__half>& b) {
  mma_f16(c, a.x, b.x);
}
template <> __device__ __forceinline__ void mma<float>(float c[4], const FragA<float>& a, const FragB<float>& b) {
  mma_bf16(c, a.lo, b.hi);
  mma_bf16(c, a.hi, b.lo);
  mma_bf16(c, a.hi, b.hi);
}

// A fragment from two adjacent fp32 C tiles c0 (n 0..7) and c1 (n 8..15), each entry times f
template <class St>
__device__ __forceinline__ FragA<St> frag_a_from_c(const float c0[4], const float c1[4], float f = 1.f) {
  FragA<St> a;
  uint32_t* x;
  uint32_t* y;
  if constexpr (sizeof(St) == 4) { x = a.hi; y = a.lo; } else { x = a.x; y = a.x; }
  Pack<St>::put(x, y, 0, c0[0] * f, c0[1] * f);
  Pack<St>::put(x, y, 1, c0[2] * f, c0[3] * f);
  Pack<St>::put(x, y, 2, c1[0] * f, c1[1] * f);
  Pack<St>::put(x, y, 3, c1[2] * f, c1[3] * f);
  return a;
}
// same with a per-column factor: fk[0], fk[1] for columns 2q, 2q+1 of c0; fk[2], fk[3] for c1
template <class St>
__device__ __forceinline__ FragA<St> frag_a_from_c_cols(const float c0[4], const float c1[4], const float fk[4]) {
  FragA<St> a;
  uint32_t* x;
  uint32_t* y;
  if constexpr (sizeof(St) == 4) { x = a.hi; y = a.lo; } else { x = a.x; y = a.x; }
  Pack<St>::put(x, y, 0, c0[0] * fk[0], c0[1] * fk[1]);
  Pack<St>::put(x, y, 1, c0[2] * fk[0], c0[3] * fk[1]);
  Pack<St>::put(x, y, 2, c1[0] * fk[2], c1[1] * fk[3]);
  Pack<St>::put(x, y, 3, c1[2] * fk[2], c1[3] * fk[3]);
  return a;
}

// ---- tf32 products (mma.m16n8k8, fp32 operands rounded to nearest tf32 on the way in) ----
// Fragment layouts (PTX ISA, mma.m16n8k8 .tf32): A (16x8): a0 = A[g][q], a1 = A[g+8][q], a2 = A[g][q+4],
// a3 = A[g+8][q+4]; B (8x8): b0 = B[q][g], b1 = B[q+4][g]; C as above. The loaders below feed the instruction's
// contraction positions q and q + 4 with k = 2q and 2q + 1 of the 8-slice (one permutation of k for A and B, so the
// product is the same): a lane's two k of a row of B^T are then adjacent in memory (one 8-byte load), and a
// product's accumulator pairs (columns 2q, 2q + 1) are directly the B fragments of a next product that contracts
// over those columns. At the inverse's row stride 68 (4 mod 32) lda_t_tf32 and ldb_tf32 are free of bank conflicts.
// A 16 x 16 x 16 product is two k-steps s of 8: A as a[s][4], B (two n-tiles t) as b[t][s][2].

// x rounded to the nearest tf32: ties to even on sm_90 (one instruction there), ties away from zero before it
__device__ __forceinline__ uint32_t to_tf32(float x) {
  uint32_t r;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm("cvt.rn.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
#else
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
#endif
  return r;
}
__device__ __forceinline__ void mma_tf32(float c[4], const uint32_t a[4], const uint32_t b[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// acc[t] += A B[t] over a contraction of 16
__device__ __forceinline__ void mma_tf32_16(float (&acc)[2][4], const uint32_t (&a)[2][4], const uint32_t (&b)[2][2][2]) {
#pragma unroll
  for (int s = 0; s < 2; ++s)
#pragma unroll
    for (int t = 0; t < 2; ++t) mma_tf32(acc[t], a[s], b[t][s]);
}
// one fp32 from shared memory as a single load (volatile: not merged with its neighbour into a pair)
__device__ __forceinline__ float lds_f32(const float* p) {
  float x;
  asm volatile("ld.volatile.shared.f32 %0, [%1];\n" : "=f"(x) : "r"(smem_u32(p)));
  return x;
}
// A (16 x 16) at rows m0.., cols k0.. of a row-major fp32 tile s[m * ld + k] in shared memory. Single loads: a
// row's pair would be a0 and a2, registers that are not adjacent, and the moves cost more than the loads' two-way
// bank conflict (rows g at stride 4 mod 32 banks, columns 2q).
__device__ __forceinline__ void lda_tf32(uint32_t (&a)[2][4], const float* s, int ld, int m0, int k0) {
  const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
#pragma unroll
  for (int st = 0; st < 2; ++st) {
    const float* p = s + (m0 + g) * ld + k0 + 8 * st + 2 * q;
    a[st][0] = to_tf32(lds_f32(p));
    a[st][1] = to_tf32(lds_f32(p + 8 * ld));
    a[st][2] = to_tf32(lds_f32(p + 1));
    a[st][3] = to_tf32(lds_f32(p + 8 * ld + 1));
  }
}
// A (16 x 16) with A[m][k] = s[k * ld + m]; rows m0.., contraction k0..
__device__ __forceinline__ void lda_t_tf32(uint32_t (&a)[2][4], const float* s, int ld, int m0, int k0) {
  const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
#pragma unroll
  for (int st = 0; st < 2; ++st) {
    const float* p = s + (k0 + 8 * st + 2 * q) * ld + m0 + g;
    a[st][0] = to_tf32(p[0]);
    a[st][1] = to_tf32(p[8]);
    a[st][2] = to_tf32(p[ld]);
    a[st][3] = to_tf32(p[ld + 8]);
  }
}
// two B n-tiles (n0..n0+7, n0+8..n0+15; contraction k0..k0+15) with B[k][n] = s[n * ld + k] (ld, k0 even)
__device__ __forceinline__ void ldb_tf32(uint32_t (&b)[2][2][2], const float* s, int ld, int n0, int k0) {
  const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
#pragma unroll
  for (int t = 0; t < 2; ++t)
#pragma unroll
    for (int st = 0; st < 2; ++st) {
      const float2 u = *reinterpret_cast<const float2*>(s + (n0 + 8 * t + g) * ld + k0 + 8 * st + 2 * q);
      b[t][st][0] = to_tf32(u.x);
      b[t][st][1] = to_tf32(u.y);
    }
}
// B = Y^T as two n-tiles, from the accumulator tiles y[0] (columns 0..7 of Y) and y[1] (8..15) of a 16 x 16 Y:
// B[k][n] = Y[n][k], a lane's pair (columns 2q, 2q + 1) of Y's row n being its B pair for k = 2q, 2q + 1
__device__ __forceinline__ void frag_b_tf32_from_ct(uint32_t (&b)[2][2][2], const float (&y)[2][4]) {
#pragma unroll
  for (int t = 0; t < 2; ++t)
#pragma unroll
    for (int st = 0; st < 2; ++st) {
      b[t][st][0] = to_tf32(y[st][2 * t]);
      b[t][st][1] = to_tf32(y[st][2 * t + 1]);
    }
}

// ---- shared-memory fragment loaders ----
__device__ __forceinline__ void ldsm_x4(uint32_t r[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t r[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}

// A (16 x 16) at rows m0.., cols k0.. of a row-major tile s[m * ld + k]
template <class St> __device__ __forceinline__ FragA<St> lda(const St* s, int ld, int m0, int k0) {
  FragA<St> a;
  const int lane = threadIdx.x & 31;
  if constexpr (sizeof(St) == 2) {
    const int mi = lane >> 3, r = lane & 7;
    ldsm_x4(a.x, s + (m0 + r + (mi & 1) * 8) * ld + k0 + (mi >> 1) * 8);
  } else {
    const int g = lane >> 2, q = lane & 3;
    const float* p0 = s + (m0 + g) * ld + k0 + 2 * q;
    const float* p1 = p0 + 8 * ld;
    Pack<St>::put(a.hi, a.lo, 0, p0[0], p0[1]);
    Pack<St>::put(a.hi, a.lo, 1, p1[0], p1[1]);
    Pack<St>::put(a.hi, a.lo, 2, p0[8], p0[9]);
    Pack<St>::put(a.hi, a.lo, 3, p1[8], p1[9]);
  }
  return a;
}
// A (16 x 16) with A[m][k] = s[k * ld + m] (the tile holds A transposed); rows m0.., contraction k0..
template <class St> __device__ __forceinline__ FragA<St> lda_t(const St* s, int ld, int m0, int k0) {
  FragA<St> a;
  const int lane = threadIdx.x & 31;
  if constexpr (sizeof(St) == 2) {
    const int mi = lane >> 3, r = lane & 7;
    ldsm_x4_t(a.x, s + (k0 + r + (mi >> 1) * 8) * ld + m0 + (mi & 1) * 8);
  } else {
    const int g = lane >> 2, q = lane & 3;
    const float* p = s + (k0 + 2 * q) * ld + m0 + g;
    Pack<St>::put(a.hi, a.lo, 0, p[0], p[ld]);
    Pack<St>::put(a.hi, a.lo, 1, p[8], p[ld + 8]);
    Pack<St>::put(a.hi, a.lo, 2, p[8 * ld], p[9 * ld]);
    Pack<St>::put(a.hi, a.lo, 3, p[8 * ld + 8], p[9 * ld + 8]);
  }
  return a;
}
// lda_t with the contraction index k scaled (a scaled copy of the operand): this lane's k0 + 2q, + 1, + 8, + 9 by
// f0, f1, f8, f9
template <class St>
__device__ __forceinline__ FragA<St> lda_t_cols(const St* s, int ld, int m0, int k0, float f0, float f1, float f8,
                                                float f9) {
  const int lane = threadIdx.x & 31;
  FragA<St> a;
  if constexpr (sizeof(St) == 2) {
    FragA<St> r = lda_t<St>(s, ld, m0, k0);
    const float fa[4][2] = {{f0, f1}, {f0, f1}, {f8, f9}, {f8, f9}};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 v = unpack2<St>(r.x[i]);
      Pack<St>::put(a.x, a.x, i, v.x * fa[i][0], v.y * fa[i][1]);
    }
  } else {
    const int g = lane >> 2, q = lane & 3;
    const float* p = s + (k0 + 2 * q) * ld + m0 + g;
    Pack<St>::put(a.hi, a.lo, 0, p[0] * f0, p[ld] * f1);
    Pack<St>::put(a.hi, a.lo, 1, p[8] * f0, p[ld + 8] * f1);
    Pack<St>::put(a.hi, a.lo, 2, p[8 * ld] * f8, p[9 * ld] * f9);
    Pack<St>::put(a.hi, a.lo, 3, p[8 * ld + 8] * f8, p[9 * ld + 8] * f9);
  }
  return a;
}

// lda_t with the contraction index k scaled by f(k) = sc * exp(gam[k])
template <class St>
__device__ __forceinline__ FragA<St> lda_t_scaled(const St* s, int ld, int m0, int k0, const float* gam, float sc) {
  const int q = threadIdx.x & 3;
  const float f0 = sc * __expf(gam[k0 + 2 * q]), f1 = sc * __expf(gam[k0 + 2 * q + 1]);
  const float f8 = sc * __expf(gam[k0 + 2 * q + 8]), f9 = sc * __expf(gam[k0 + 2 * q + 9]);
  return lda_t_cols<St>(s, ld, m0, k0, f0, f1, f8, f9);
}
// two B fragments (n0..n0+7 and n0+8..n0+15, contraction k0..k0+15) with B[k][n] = s[n * ld + k]
template <class St> __device__ __forceinline__ void ldb(FragB<St> b[2], const St* s, int ld, int n0, int k0) {
  const int lane = threadIdx.x & 31;
  if constexpr (sizeof(St) == 2) {
    const int mi = lane >> 3, r = lane & 7;
    uint32_t x[4];
    ldsm_x4(x, s + (n0 + r + (mi >> 1) * 8) * ld + k0 + (mi & 1) * 8);
    b[0].x[0] = x[0]; b[0].x[1] = x[1]; b[1].x[0] = x[2]; b[1].x[1] = x[3];
  } else {
    const int g = lane >> 2, q = lane & 3;
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      const float* p = s + (n0 + 8 * t + g) * ld + k0 + 2 * q;
      Pack<St>::put(b[t].hi, b[t].lo, 0, p[0], p[1]);
      Pack<St>::put(b[t].hi, b[t].lo, 1, p[8], p[9]);
    }
  }
}
// two B fragments with B[k][n] = s[k * ld + n]
template <class St> __device__ __forceinline__ void ldb_t(FragB<St> b[2], const St* s, int ld, int k0, int n0) {
  const int lane = threadIdx.x & 31;
  if constexpr (sizeof(St) == 2) {
    const int mi = lane >> 3, r = lane & 7;
    uint32_t x[4];
    ldsm_x4_t(x, s + (k0 + r + (mi & 1) * 8) * ld + n0 + (mi >> 1) * 8);
    b[0].x[0] = x[0]; b[0].x[1] = x[1]; b[1].x[0] = x[2]; b[1].x[1] = x[3];
  } else {
    const int g = lane >> 2, q = lane & 3;
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      const float* p = s + (k0 + 2 * q) * ld + n0 + 8 * t + g;
      Pack<St>::put(b[t].hi, b[t].lo, 0, p[0], p[ld]);
      Pack<St>::put(b[t].hi, b[t].lo, 1, p[8 * ld], p[9 * ld]);
    }
  }
}

// The four lanes q of a row exchange packed pairs (a 4 x 4 transpose by two butterfly steps): y[t] holds the lane's
// pair of n-tile 4m + t of a row of accumulator fragments; afterwards y holds its columns 8 * (4m + q) .. + 7
__device__ __forceinline__ void quad_transpose(uint32_t (&y)[4], int q) {
#pragma unroll
  for (int b = 1; b <= 2; b <<= 1)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (j & b) continue;
      const bool hi = (q & b) != 0;
      const uint32_t r = __shfl_xor_sync(0xffffffffu, hi ? y[j] : y[j | b], b);
      if (hi) y[j] = r; else y[j | b] = r;
    }
}

// Stores a warp's block of accumulator fragments, F[nt][e] at row g8 + 8 * (e >> 1) and column 8 * nt + 2q + (e & 1)
// of g (row stride ld). 16-bit types: the four lanes of a row exchange packed pairs (quad_transpose) so that each
// lane stores 16 contiguous bytes; fp32 stores the pairs as they are.
template <class St, int NT8>
__device__ __forceinline__ void store_frag_rows(St* g, int64_t ld, const float (&F)[NT8][4], int g8, int q) {
  if constexpr (sizeof(St) == 2 && NT8 % 4 == 0) {
#pragma unroll
    for (int m = 0; m < NT8 / 4; ++m)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        uint32_t y[4];
#pragma unroll
        for (int t = 0; t < 4; ++t) Pack<St>::put(y, y, t, F[4 * m + t][2 * hr], F[4 * m + t][2 * hr + 1]);
        quad_transpose(y, q);
        *reinterpret_cast<uint4*>(g + (g8 + 8 * hr) * ld + 8 * (4 * m + q)) = make_uint4(y[0], y[1], y[2], y[3]);
      }
  } else {
#pragma unroll
    for (int nt = 0; nt < NT8; ++nt) {
      st2<St>(g + g8 * ld + 8 * nt + 2 * q, F[nt][0], F[nt][1]);
      st2<St>(g + (g8 + 8) * ld + 8 * nt + 2 * q, F[nt][2], F[nt][3]);
    }
  }
}

// acc += A B for a warp's 16 x 64 block (8 n-tiles of acc) over a contraction of 64, both operands in shared
// memory. A (rows m0..) is a[m * la + k], or a[k * la + m] when AT (lda / lda_t); B is b[n * lb + b0 + k], or
// b[k * lb + b0 + n] when BT (ldb / ldb_t): b0 offsets the contiguous index.
template <class St, bool AT, bool BT>
__device__ __forceinline__ void warp_mma_16x64x64(float (&acc)[8][4], const St* a, int la, int m0, const St* b, int lb,
                                                  int b0) {
#pragma unroll
  for (int kt = 0; kt < 4; ++kt) {
    FragA<St> fa;
    if constexpr (AT) fa = lda_t<St>(a, la, m0, 16 * kt);
    else fa = lda<St>(a, la, m0, 16 * kt);
#pragma unroll
    for (int np = 0; np < 4; ++np) {
      FragB<St> fb[2];
      if constexpr (BT) ldb_t<St>(fb, b, lb, 16 * kt, b0 + 16 * np);
      else ldb<St>(fb, b, lb, 16 * np, b0 + 16 * kt);
      mma<St>(acc[2 * np], fa, fb[0]);
      mma<St>(acc[2 * np + 1], fa, fb[1]);
    }
  }
}

template <int N> __device__ __forceinline__ void zero_acc(float (&acc)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
}

// The L2 norm's chain rule dx = r (dy - x r^2 (x . dy)), r = (sum(x^2) + eps)^(-1/2) (l2norm_bwd's), in place on a
// warpgroup's fragments F of the 64-column block kb (0 or 1) of 64 rows of 128 columns (F[nt][e] at row
// 16 rg + g8 + 8 (e >> 1), column 8 nt + 2q + (e & 1) of the block), x the caller's elements at those positions:
// each row's two sums over its quad, then over the two blocks through rowN ([2][64][2] floats) after the named
// barrier `bar` of the two warpgroups (256 threads), block 0's part first in both.
__device__ __forceinline__ void l2norm_chain_2blocks(float (&F)[8][4], const float2 (&x)[2][8], int kb, int rg, int g8,
                                                     int q, float* rowN, int bar, float eps) {
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    float xx = 0.f, xd = 0.f;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      const float2 v = x[hr][nt];
      xx += v.x * v.x + v.y * v.y;
      xd += v.x * F[nt][2 * hr] + v.y * F[nt][2 * hr + 1];
    }
#pragma unroll
    for (int o = 1; o <= 2; o <<= 1) {
      xx += __shfl_xor_sync(0xffffffffu, xx, o);
      xd += __shfl_xor_sync(0xffffffffu, xd, o);
    }
    if (q == 0) *reinterpret_cast<float2*>(rowN + 2 * (kb * 64 + 16 * rg + g8 + 8 * hr)) = make_float2(xx, xd);
  }
  bar_sync(bar, 256);
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int i = 16 * rg + g8 + 8 * hr;
    const float2 s0 = *reinterpret_cast<const float2*>(rowN + 2 * i);
    const float2 s1 = *reinterpret_cast<const float2*>(rowN + 2 * (64 + i));
    const float r = rsqrtf((s0.x + s1.x) + eps), c = r * r * (s0.y + s1.y);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      F[nt][2 * hr] = r * (F[nt][2 * hr] - x[hr][nt].x * c);
      F[nt][2 * hr + 1] = r * (F[nt][2 * hr + 1] - x[hr][nt].y * c);
    }
  }
}

// Sums over a warp's fragment lanes: a row's (the four lanes of a quad), and the column sums of a warp's 16 x 8 NT
// block whose lanes hold partial sums c[nt][e1] of column 8 nt + 2q + e1, over its eight row lanes, stored by lanes
// g8 = 0 to col[8 nt + 2q + e1]
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  x += __shfl_xor_sync(0xffffffffu, x, 2);
  return x;
}
template <int NT>
__device__ __forceinline__ void store_col_sums(const float (&c)[NT][2], float* col, int g8, int q) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e1 = 0; e1 < 2; ++e1) {
      float x = c[nt][e1];
      x += __shfl_xor_sync(0xffffffffu, x, 4);
      x += __shfl_xor_sync(0xffffffffu, x, 8);
      x += __shfl_xor_sync(0xffffffffu, x, 16);
      if (g8 == 0) col[8 * nt + 2 * q + e1] = x;
    }
}

// warp-wide inclusive prefix sum
__device__ __forceinline__ float warp_incl_scan(float x) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const float y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  return x;
}

}  // namespace cuda
}  // namespace gated_delta
