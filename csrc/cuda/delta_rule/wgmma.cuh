// Warpgroup matrix products (sm_90a wgmma) of the gated delta rule kernels, for 16-bit operands (bf16, fp16) with
// fp32 accumulation: A from registers, B from shared memory in the 128-byte swizzled layout, and the cp.async
// loader that writes that layout.
//
// A warpgroup is 4 consecutive warps; warp w holds rows 16w .. 16w + 15 of the 64-row tiles. Its register
// fragments are those of mma.m16n8k16 (mma.cuh) stacked over the warps:
//   A (64 x 16):  FragA, the same four packed pairs per lane as mma.sync's A
//   D (64 x N):   d[nt][e] at row 16w + g + 8 (e >> 1), column 8 nt + 2q + (e & 1)  (g = lane / 4, q = lane % 4)
// so an accumulator of two adjacent n-tiles is directly the A fragment of the next product (frag_a_from_c).
//
// Shared-memory tiles ("sw128"): a tile of R rows and 64 * NB columns of a 16-bit type is NB blocks of R rows of
// 128 bytes (64 columns); the 16-byte chunk c of row r sits at chunk c ^ (r % 8) of its row. Every tile starts on a
// 1024-byte boundary. The same tile serves both operand orders of B:
//   K-major (B[k][n] = tile[n][k], the contraction along a row):  16 contraction columns at a time, advancing
//     32 bytes inside a block (the swizzle is applied by the hardware on the address bits), 8-row groups 1024
//     bytes apart;
//   N-major (B[k][n] = tile[k][n], the contraction down the rows):  16 rows at a time (2048 bytes), 8-row groups
//     1024 bytes apart and the 64-column blocks R * 128 bytes apart.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "../device_utils.cuh"
#include "mma.cuh"
#include "tile_load.cuh"

namespace gated_delta {
namespace cuda {

// the operand types a warpgroup product takes from a storage type (fp32 keeps mma.sync's split products)
template <class St> struct HasWgmma { static constexpr bool value = sizeof(St) == 2; };

// ---- descriptors and ordering ----
// Descriptor of a sw128 operand starting at s: start address, leading byte offset (the 64-column block stride of
// an N-major operand; unused by K-major), stride byte offset (8-row groups: 1024 bytes), 128-byte swizzle.
__device__ __forceinline__ uint64_t sw128_desc(const void* s, uint32_t block_bytes) {
  const uint32_t a = smem_u32(s);
  uint64_t d = (a & 0x3FFFFu) >> 4;
  d |= static_cast<uint64_t>((block_bytes >> 4) & 0x3FFFu) << 16;
  d |= static_cast<uint64_t>(1024u >> 4) << 32;
  d |= static_cast<uint64_t>(1) << 62;
  return d;
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accesses of the accumulators across an asynchronous product.
template <int NT> __device__ __forceinline__ void wg_fence_acc(float (&d)[NT][4]) {
#pragma unroll
  for (int i = 0; i < NT; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[i][e])::"memory");
}
// Shared memory written by ordinary stores or cp.async and read next by wgmma: each writing thread, before the barrier.
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// ---- the products: d (+)= A B, A 64 x 16 from registers, B 16 x N from the descriptor; TB: B is N-major ----
#define GD_WG_F4(i) "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])
#define GD_WG_D64                                                                                          \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define GD_WG_D128                                                                                              \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "     \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, " \
  "%45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define GD_WG_N64(TY)                                                                                          \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                                   \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " " GD_WG_D64                          \
               ", {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"                                              \
               : GD_WG_F4(0), GD_WG_F4(1), GD_WG_F4(2), GD_WG_F4(3), GD_WG_F4(4), GD_WG_F4(5), GD_WG_F4(6),  \
                 GD_WG_F4(7)                                                                                   \
               : "r"(a.x[0]), "r"(a.x[1]), "r"(a.x[2]), "r"(a.x[3]), "l"(desc), "r"(acc), "n"(TB))
#define GD_WG_N128(TY)                                                                                          \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                                    \
               "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " " GD_WG_D128                         \
               ", {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"                                               \
               : GD_WG_F4(0), GD_WG_F4(1), GD_WG_F4(2), GD_WG_F4(3), GD_WG_F4(4), GD_WG_F4(5), GD_WG_F4(6),   \
                 GD_WG_F4(7), GD_WG_F4(8), GD_WG_F4(9), GD_WG_F4(10), GD_WG_F4(11), GD_WG_F4(12), GD_WG_F4(13), \
                 GD_WG_F4(14), GD_WG_F4(15)                                                                     \
               : "r"(a.x[0]), "r"(a.x[1]), "r"(a.x[2]), "r"(a.x[3]), "l"(desc), "r"(acc), "n"(TB))

// acc = 0: d = A B; acc = 1: d += A B. NT = N / 8 n-tiles (8: N = 64, 16: N = 128).
template <class St, int TB, int NT>
__device__ __forceinline__ void wgmma_rs(float (&d)[NT][4], const FragA<St>& a, uint64_t desc, int acc) {
  static_assert(HasWgmma<St>::value, "wgmma products take 16-bit operands");
  static_assert(NT == 8 || NT == 16, "N = 64 or 128");
  if constexpr (NT == 8) {
    if constexpr (std::is_same_v<St, __half>) GD_WG_N64("f16");
    else GD_WG_N64("bf16");
  } else {
    if constexpr (std::is_same_v<St, __half>) GD_WG_N128("f16");
    else GD_WG_N128("bf16");
  }
}


// acc = 0: d = A B; acc = 1: d += A B with both operands from shared memory, in either major order: A 64 x 16 by
// descriptor da (TA = 0: K-major, as B's K-major form; TA = 1: M-major, the tile's rows along the contraction, as
// B's N-major form), B 16 x N by db (TB as in wgmma_rs), NT = N / 8 (8 or 16). NEG: A enters negated (scale-a -1),
// exactly -(A B).
#define GD_WG_SST64(TY)                                                                                       \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                                  \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " " GD_WG_D64                         \
               ", %32, %33, p, %35, 1, %36, %37;\n}\n"                                                       \
               : GD_WG_F4(0), GD_WG_F4(1), GD_WG_F4(2), GD_WG_F4(3), GD_WG_F4(4), GD_WG_F4(5), GD_WG_F4(6), \
                 GD_WG_F4(7)                                                                                  \
               : "l"(da), "l"(db), "r"(acc), "n"(SA), "n"(TA), "n"(TB))
#define GD_WG_SST128(TY)                                                                                       \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                                   \
               "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " " GD_WG_D128                        \
               ", %64, %65, p, %67, 1, %68, %69;\n}\n"                                                        \
               : GD_WG_F4(0), GD_WG_F4(1), GD_WG_F4(2), GD_WG_F4(3), GD_WG_F4(4), GD_WG_F4(5), GD_WG_F4(6),  \
                 GD_WG_F4(7), GD_WG_F4(8), GD_WG_F4(9), GD_WG_F4(10), GD_WG_F4(11), GD_WG_F4(12), GD_WG_F4(13), \
                 GD_WG_F4(14), GD_WG_F4(15)                                                                    \
               : "l"(da), "l"(db), "r"(acc), "n"(SA), "n"(TA), "n"(TB))
template <class St, int TA, int TB, int NT, bool NEG = false>
__device__ __forceinline__ void wgmma_ss_t(float (&d)[NT][4], uint64_t da, uint64_t db, int acc) {
  static_assert(HasWgmma<St>::value, "wgmma products take 16-bit operands");
  static_assert(NT == 8 || NT == 16, "N = 64 or 128");
  constexpr int SA = NEG ? -1 : 1;
  if constexpr (NT == 8) {
    if constexpr (std::is_same_v<St, __half>) GD_WG_SST64("f16");
    else GD_WG_SST64("bf16");
  } else {
    if constexpr (std::is_same_v<St, __half>) GD_WG_SST128("f16");
    else GD_WG_SST128("bf16");
  }
}
#undef GD_WG_SST128
#undef GD_WG_SST64
#undef GD_WG_N128
#undef GD_WG_N64
#undef GD_WG_D128
#undef GD_WG_D64
#undef GD_WG_F4

// ---- warp-specialised CTAs ----
// (named barriers: bar_sync, bar_arrive in mma.cuh)
// The warpgroup's register budget per thread (a multiple of 8, 24..256): lowered by a warpgroup that needs few,
// raised by those that then take them
template <int R> __device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R));
}
template <int R> __device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R));
}

// ---- reads of a sw128 tile (16-bit) by ordinary shared-memory loads and ldmatrix ----
// byte offset of element (r, c), c < 64, in a tile of one 64-column block; c even: the pair (c, c + 1) shares one
// 4-byte word. Address pairs, with c even: for an odd c = 2q + 1 in an unrolled loop over column tiles, nvcc 13.0
// has been seen to compile the RT form below to the chunk (c ^ (r & 7)) instead of ((c >> 3) ^ (r & 7)) (a wrong
// address, no diagnostic), while even columns compile right (tests/test_sw128_codegen.py checks the even form).
__device__ __forceinline__ int sw128_off(int r, int c) { return r * 128 + ((((c >> 3) ^ (r & 7)) << 4) | ((c & 7) * 2)); }
// ... in a tile of RT rows per 64-column block, any column
template <int RT> __device__ __forceinline__ int sw128_off(int r, int c) {
  return (c >> 6) * (RT * 128) + sw128_off(r, c & 63);
}
template <class St> __device__ __forceinline__ float2 sw128_get2(const unsigned char* s, int off) {
  return unpack2<St>(*reinterpret_cast<const uint32_t*>(s + off));
}
template <class St> __device__ __forceinline__ float2 sw128_get2(const unsigned char* s, int r, int c) {
  return sw128_get2<St>(s, sw128_off(r, c));
}
// acc + sum of the elementwise products of N 16-byte chunks (from chunk c0 on) of two 16-bit tiles of one layout
// (equal byte offsets hold equal positions, as two sw128 tiles of the same shape), the pairs added in order
template <class St, int N>
__device__ __forceinline__ float dot_chunks(const unsigned char* a, const unsigned char* b, int c0, float acc) {
  const uint4* x = reinterpret_cast<const uint4*>(a) + c0;
  const uint4* y = reinterpret_cast<const uint4*>(b) + c0;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const uint4 xv = x[j], yv = y[j];
    const uint32_t xs[4] = {xv.x, xv.y, xv.z, xv.w}, ys[4] = {yv.x, yv.y, yv.z, yv.w};
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      const float2 u = unpack2<St>(xs[t]), v = unpack2<St>(ys[t]);
      acc += u.x * v.x + u.y * v.y;
    }
  }
  return acc;
}
// lda of a tile of RT rows per block: A[m][k] = tile[m][k], rows m0.., contraction k0..
template <class St, int RT = 64>
__device__ __forceinline__ FragA<St> lda_sw128(const unsigned char* s, int m0, int k0) {
  static_assert(sizeof(St) == 2, "sw128 tiles hold 16-bit operands");
  FragA<St> a;
  const int lane = threadIdx.x & 31, mi = lane >> 3;
  ldsm_x4(a.x, s + sw128_off<RT>(m0 + (lane & 7) + (mi & 1) * 8, k0 + (mi >> 1) * 8));
  return a;
}
// lda_t of such a tile: A[m][k] = tile[k][m], rows m0.., contraction k0.. (ldmatrix.trans at the swizzled rows)
template <class St, int RT = 64>
__device__ __forceinline__ FragA<St> lda_t_sw128(const unsigned char* s, int m0, int k0) {
  static_assert(sizeof(St) == 2, "sw128 tiles hold 16-bit operands");
  FragA<St> a;
  const int lane = threadIdx.x & 31, mi = lane >> 3;
  ldsm_x4_t(a.x, s + sw128_off<RT>(k0 + (lane & 7) + (mi >> 1) * 8, m0 + (mi & 1) * 8));
  return a;
}

// ---- a 64 x 64 product over a contraction of 64 (four k16 steps): d (+)= A B, A's four fragments in registers ----
// B's descriptor steps 16 contraction indices: 32 bytes inside a block (K-major, TB = 0) or 16 rows, 2048 bytes
// (N-major, TB = 1). acc = 0: the first step overwrites d. Issued and committed as one group; the caller waits.
template <class St, int TB>
__device__ __forceinline__ void wg_product(float (&d)[8][4], const FragA<St> (&a)[4], uint64_t desc, bool acc) {
  constexpr uint64_t step = TB ? (2048 >> 4) : (32 >> 4);
  wg_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) wgmma_rs<St, TB>(d, a[kk], desc + kk * step, acc || kk > 0);
  wg_commit();
}

// ---- loads ----
// Copies a ROWS x COLS tile (row r from g + r * gstride, rows >= rows_valid zero-filled) into rows row0 .. of a
// sw128 tile of RT rows per 64-column block, 16 bytes per cp.async. Each thread keeps one 16-byte column slot and
// walks rows a multiple of 8 apart, so its swizzled offset is the same for all of its rows. CHECK = false: a tile
// whose rows are all valid (rows_valid is not read), the same copies without the per-row test.
template <class St, int ROWS, int COLS, int RT, int NT, bool CHECK = true>
__device__ __forceinline__ void load_tile_sw128(unsigned char* s, int row0, const St* g, int64_t gstride, int rows_valid,
                                                int tid) {
  constexpr int EPV = 16 / sizeof(St), VPR = COLS / EPV, RS = NT / VPR;
  static_assert(COLS % 64 == 0 && NT % VPR == 0 && RS % 8 == 0 && ROWS % RS == 0, "sw128 tile shape");
  const int r0 = tid / VPR, cv = tid % VPR;
  const int off = (cv >> 3) * (RT * 128) + (row0 + r0) * 128 + (((cv & 7) ^ ((row0 + r0) & 7)) << 4);
  const St* src = g + static_cast<int64_t>(r0) * gstride + cv * EPV;
  const int64_t gstep = static_cast<int64_t>(RS) * gstride;
#pragma unroll
  for (int j = 0; j < ROWS / RS; ++j) {
    const bool ok = !CHECK || r0 + j * RS < rows_valid;
    cp_async16(s + off + j * RS * 128, ok ? src : g, ok);
    src += gstep;
  }
}

}  // namespace cuda
}  // namespace gated_delta
