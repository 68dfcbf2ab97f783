// Chunk-parallel gradient kernels of the backward (docs/algorithms.md, "Backward of one chunk"), given the states
// entering each chunk (hT), the state gradients leaving it (dhT), Vn^T and dVn^T from the two sequential passes.
//
// grad_qk: one CTA (8 warps) per (chunk, q/k head, 64-wide block of K); it walks the value heads of the group
// (summing dq and the first part of dk in registers: deterministic) and 64-wide tiles of V as one pipeline of
// (head, V tile) steps, the tiles of the next two steps in flight across head boundaries:
//   dA = scale dO Vn^T (masked i >= j)      dQ = scale diag(e^gam) dO S^T + (dA o E) K
//   dK1 = (dA o E)^T Q + diag(e^{gam_L - gam}) Vn dS'^T            dW = -dVn S^T
//   and the partial gradient of gam (per block of K).
// grad_wy: one CTA (4 warps) per (chunk, q/k head), looping over the group (the next head's tiles load during this
// head's products): reads Tm (written by the backward's prep), then back through W = Tm diag(beta e^gam) K and
// U = Tm diag(beta) V with dU = dVn:
//   dTm = dW (diag(beta e^gam) K)^T + dU (diag(beta) V)^T,  dM = -Tm^T dTm Tm^T (strictly lower)
//   dK += diag(beta e^gam) Tm^T dW + R K + R^T K (R = dM o beta_i E),  dV = diag(beta) Tm^T dU,  dbeta, dg.
// For 16-bit inputs and K <= 128 its products are warpgroup products (grad_wy_wg_kernel); fp32 and K = 256 keep
// mma.sync.
#include <c10/util/Exception.h>

#include "../dispatch.cuh"
#include "chunks.cuh"
#include "mma.cuh"
#include "tile_load.cuh"
#include "tri_inverse.cuh"  // kLdF
#include "wgmma.cuh"

namespace gated_delta {
namespace cuda {

// dg = reverse cumsum of dgam (rowv, 64 rows) over the chunk's valid rows, by one warp: lane l holds rows 62 - 2l
// and 63 - 2l, a prefix scan over lanes sums the rows from the end
__device__ __forceinline__ void dg_of_chunk(const Params& p, const ChunkInfo& ci, int hv, const float* rowv, int lane) {
  const int r_lo = C - 2 - 2 * lane, r_hi = r_lo + 1;
  const float x_lo = rowv[r_lo], x_hi = rowv[r_hi];
  const float incl = warp_incl_scan(x_lo + x_hi);
  float excl = __shfl_up_sync(0xffffffffu, incl, 1);  // the rows after r_hi
  if (lane == 0) excl = 0.f;
  const float s_hi = excl + x_hi, s_lo = s_hi + x_lo;
  if (r_lo < ci.len) p.dg[(ci.bos + r_lo) * p.HV + hv] = s_lo;
  if (r_hi < ci.len) p.dg[(ci.bos + r_hi) * p.HV + hv] = s_hi;
}

// value head gi of the group of q/k head h in chunk c: its index, its (chunk, head) index and where its dW, dVn^T
// and V tiles start
template <class St>
struct WyHead {
  int hv;
  int64_t chv;
  const St *dW, *dVnT, *v;
  __device__ __forceinline__ WyHead(const Params& p, const ChunkInfo& ci, int c, int h, int gi) {
    hv = h * p.G + gi;
    chv = static_cast<int64_t>(c) * p.HV + hv;
    dW = static_cast<const St*>(p.dhT) + chv * p.V * p.K;  // (dW lives in dhT's tile, params.h)
    dVnT = static_cast<const St*>(p.dVnT) + chv * p.V * C;
    v = static_cast<const St*>(p.v) + ci.bos * p.tok_v + hv * p.ld_v;
  }
};

// A head's gam and beta rows into shared memory (threads 0..63); returns grad_qk's partial gradient of gam for row
// tid (summed over its K blocks), used at the end of the head
__device__ __forceinline__ float wy_head_rows(const Params& p, const ChunkInfo& ci, int c, int hv, int64_t chv, int tid,
                                              float* gam, float* bet) {
  float dgam_qk = 0.f;
  if (tid < 64) {
    gam[tid] = p.gam[chv * C + tid];
    const int64_t tok = (ci.bos + tid) * p.HV + hv;
    bet[tid] = tid < ci.len ? load_as_float(p.beta, p.beta_dtype, tok) : 0.f;
    for (int kb = 0; kb < p.K / 64; ++kb)
      dgam_qk += p.dgam1[((static_cast<int64_t>(kb) * p.NC + c) * p.HV + hv) * C + tid];
  }
  return dgam_qk;
}

// R = dM o beta_i E (strictly lower) and the beta and gam terms of M, from this warp's fragment of dM (rows
// 16 warp ..): put(nt, e, i, j, r) stores R (r = 0 on and above the diagonal); the column sums of the gam term go to
// colv[warp][j]. HOIST: the rows' gam and beta are read once (put's shared-memory stores would otherwise reload
// them); fp32 keeps the reloads (fewer registers live).
template <bool HOIST, class Put>
__device__ __forceinline__ void wy_r_terms(const float (&dM)[8][4], const float* gam, const float* bet, const float* KKf,
                                           int warp, int g8, int q, float (&rbeta)[2], float (&rgam)[2], float* colv,
                                           Put&& put) {
  float gr[2] = {0.f, 0.f}, br[2] = {0.f, 0.f};
  if constexpr (HOIST) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      gr[hr] = gam[16 * warp + g8 + 8 * hr];
      br[hr] = bet[16 * warp + g8 + 8 * hr];
    }
  }
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
    float cm[2] = {0.f, 0.f};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int hr = e >> 1, i = 16 * warp + g8 + 8 * hr, j = 8 * nt + 2 * q + (e & 1);
      float r = 0.f;
      if (i > j) {
        const float gmi = HOIST ? gr[hr] : gam[i], bti = HOIST ? br[hr] : bet[i];
        const float E = __expf(gmi - gam[j]);
        const float G = KKf[i * kLdF + j] * E;
        const float dm = dM[nt][e];
        const float dmm = dm * bti * G;
        rbeta[hr] += dm * G;
        rgam[hr] += dmm;
        cm[e & 1] += dmm;
        r = dm * bti * E;
      }
      put(nt, e, i, j, r);
    }
#pragma unroll
    for (int e1 = 0; e1 < 2; ++e1) {
      float x = cm[e1];
      x += __shfl_xor_sync(0xffffffffu, x, 4);
      x += __shfl_xor_sync(0xffffffffu, x, 8);
      x += __shfl_xor_sync(0xffffffffu, x, 16);
      if (g8 == 0) colv[warp * 64 + 8 * nt + 2 * q + e1] = x;
    }
  }
}

// A head's row terms, summed over the quad of each row: dbeta (stored) from the dk, dv and M parts, and the row part
// of dgam (rowv)
__device__ __forceinline__ void wy_row_terms(const Params& p, const ChunkInfo& ci, int hv, const float (&rx)[2],
                                             const float (&ry)[2], const float (&rbeta)[2], const float (&rgam)[2],
                                             const float* bet, float* rowv, int warp, int g8, int q) {
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    float x = rx[hr], y = ry[hr], b = rbeta[hr], gm = rgam[hr];
#pragma unroll
    for (int o = 1; o <= 2; o <<= 1) {
      x += __shfl_xor_sync(0xffffffffu, x, o);
      y += __shfl_xor_sync(0xffffffffu, y, o);
      b += __shfl_xor_sync(0xffffffffu, b, o);
      gm += __shfl_xor_sync(0xffffffffu, gm, o);
    }
    if (q == 0) {
      const int i = 16 * warp + g8 + 8 * hr;
      rowv[i] = bet[i] * x + gm;
      if (i < ci.len) store_as(p.dbeta, p.dbeta_dtype, (ci.bos + i) * p.HV + hv, x + y + b);
    }
  }
}

// This thread's fragment positions of a CTA's rows of dk (rows 16 warp + g8 + 8 hr, columns 8 nt + 2q in block
// kb), kept in registers over the value heads of the group (K <= 128): grad_qk's part read once (rows past the
// chunk's end zero), the sum stored once
template <int K>
__device__ __forceinline__ void wy_dk_load(float (&dka)[K / 64][8][4], const Params& p, const ChunkInfo& ci, int h,
                                           int warp, int g8, int q) {
  constexpr int NKB = K / 64;
  const int64_t HK = static_cast<int64_t>(p.H) * K;
#pragma unroll
  for (int kb = 0; kb < NKB; ++kb)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int i = 16 * warp + g8 + 8 * hr;
        float2 cur = make_float2(0.f, 0.f);
        if (i < ci.len)
          cur = *reinterpret_cast<const float2*>(p.dk1 + (ci.bos + i) * HK + h * K + kb * 64 + 8 * nt + 2 * q);
        dka[kb][nt][2 * hr] = cur.x;
        dka[kb][nt][2 * hr + 1] = cur.y;
      }
}
// A warp's 16 x 64 block of gradient fragments (F[nt][e] at row g8 + 8 hr, hr = e >> 1, column 8 nt + 2q + (e & 1))
// at g + off (off: row g8, column 0), row stride ld, rows with ok[hr] only, for 16-bit St: in St, 16 contiguous
// bytes per lane after the quad's exchange (quad_transpose; full 32-byte sectors), or in fp32 pairs when f32
// (Params::grad_f32, tested once per block rather than per pair)
template <class St>
__device__ __forceinline__ void wy_store_grad(void* g, int64_t off, int64_t ld, const float (&F)[8][4],
                                              const bool (&ok)[2], bool f32, int q) {
  if (f32) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      float* row = static_cast<float*>(g) + off + 8 * hr * ld + 2 * q;
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
        if (ok[hr]) st2<float>(row + 8 * nt, F[nt][2 * hr], F[nt][2 * hr + 1]);
    }
  } else {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      St* row = static_cast<St*>(g) + off + 8 * hr * ld + 8 * q;
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        uint32_t y[4];
#pragma unroll
        for (int t = 0; t < 4; ++t) Pack<St>::put(y, y, t, F[4 * m + t][2 * hr], F[4 * m + t][2 * hr + 1]);
        quad_transpose(y, q);  // (every lane: the rows' lanes exchange before the test)
        if (ok[hr]) *reinterpret_cast<uint4*>(row + 32 * m) = make_uint4(y[0], y[1], y[2], y[3]);
      }
    }
  }
}

// The L2 norm's chain rule (Params::dk_l2norm) on this thread's fragments of dk, in place: dk_n (the gradient of the
// normalised keys) becomes r (dk_n - x r^2 (x . dk_n)), x the caller's key row (Raw elements), r = (sum(x^2) +
// eps)^(-1/2), as l2norm_bwd computes it; each row's two sums over its quad. Every load of x (adjacent pairs, one
// row's 16-byte aligned head: Params::ld_kr) is issued before the first sum, so the rows' reads wait once.
template <class Raw, int K>
__device__ __forceinline__ void wy_dk_l2norm_as(float (&dka)[K / 64][8][4], const Params& p, const ChunkInfo& ci,
                                                int h, int warp, int g8, int q) {
  constexpr int NKB = K / 64;
  float2 x[2][NKB][8];
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int i = 16 * warp + g8 + 8 * hr;
    const bool ok = i < ci.len;
    const Raw* row = static_cast<const Raw*>(p.k_raw) + (ci.bos + (ok ? i : 0)) * p.tok_kr + h * p.ld_kr + 2 * q;
#pragma unroll
    for (int kb = 0; kb < NKB; ++kb)
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) x[hr][kb][nt] = ok ? ld2<Raw>(row + kb * 64 + 8 * nt) : make_float2(0.f, 0.f);
  }
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    float xx = 0.f, xd = 0.f;
#pragma unroll
    for (int kb = 0; kb < NKB; ++kb)
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const float2 v = x[hr][kb][nt];
        xx += v.x * v.x + v.y * v.y;
        xd += v.x * dka[kb][nt][2 * hr] + v.y * dka[kb][nt][2 * hr + 1];
      }
#pragma unroll
    for (int o = 1; o <= 2; o <<= 1) {
      xx += __shfl_xor_sync(0xffffffffu, xx, o);
      xd += __shfl_xor_sync(0xffffffffu, xd, o);
    }
    const float r = rsqrtf(xx + p.l2norm_eps), c = r * r * xd;
#pragma unroll
    for (int kb = 0; kb < NKB; ++kb)
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        dka[kb][nt][2 * hr] = r * (dka[kb][nt][2 * hr] - x[hr][kb][nt].x * c);
        dka[kb][nt][2 * hr + 1] = r * (dka[kb][nt][2 * hr + 1] - x[hr][kb][nt].y * c);
      }
  }
}
template <int K>
__device__ __forceinline__ void wy_dk_l2norm(float (&dka)[K / 64][8][4], const Params& p, const ChunkInfo& ci, int h,
                                             int warp, int g8, int q) {
  switch (p.k_raw_dtype) {
    case DType::kBFloat16: wy_dk_l2norm_as<__nv_bfloat16, K>(dka, p, ci, h, warp, g8, q); break;
    case DType::kHalf: wy_dk_l2norm_as<__half, K>(dka, p, ci, h, warp, g8, q); break;
    default: wy_dk_l2norm_as<float, K>(dka, p, ci, h, warp, g8, q); break;
  }
}

// dk of this CTA's rows (K <= 128), through the L2 norm's chain rule where Params::dk_l2norm asks for it
template <class St, int K>
__device__ __forceinline__ void wy_dk_store(float (&dka)[K / 64][8][4], const Params& p, const ChunkInfo& ci, int h,
                                            int warp, int g8, int q) {
  constexpr int NKB = K / 64;
  const int64_t HK = static_cast<int64_t>(p.H) * K;
  if (p.dk_l2norm) wy_dk_l2norm<K>(dka, p, ci, h, warp, g8, q);
  const bool f32 = p.grad_f32 && !p.dk_l2norm;
  if constexpr (sizeof(St) == 2) {
    const bool ok[2] = {16 * warp + g8 < ci.len, 16 * warp + g8 + 8 < ci.len};
    const int64_t off = (ci.bos + 16 * warp + g8) * HK + h * K;
#pragma unroll
    for (int kb = 0; kb < NKB; ++kb) wy_store_grad<St>(p.dk, off + kb * 64, HK, dka[kb], ok, f32, q);
  } else {
#pragma unroll
    for (int kb = 0; kb < NKB; ++kb)
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int i = 16 * warp + g8 + 8 * hr;
          if (i >= ci.len) continue;
          const int64_t off = (ci.bos + i) * HK + h * K + kb * 64 + 8 * nt + 2 * q;
          st2_grad<St>(p.dk, off, dka[kb][nt][2 * hr], dka[kb][nt][2 * hr + 1], f32);
        }
  }
}
// K K^T (a warp's 16 rows of fragments) into the fp32 tile KKf
__device__ __forceinline__ void wy_store_kk(float* KKf, const float (&kk)[8][4], int warp, int g8, int q) {
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) KKf[(16 * warp + g8 + 8 * (e >> 1)) * kLdF + 8 * nt + 2 * q + (e & 1)] = kk[nt][e];
}

// ---------------------------------------------------------------------------------------------------------------
template <class St, int K>
struct WyCfg {
  static constexpr int PAD = PadOf<St>::value, LDK = K + PAD, LDC = C + PAD, LDF = kLdF, TILE = C * LDC;
  static constexpr size_t base_bytes =
      sizeof(St) * (size_t)(C * LDK + 2 * TILE) + sizeof(float) * (C * LDF + 3 * 64 + 4 * 64);
  // RES: every 64-column block of dW, dVn^T and V of one value head stays resident; else two streamed buffers
  static size_t bytes(bool res, int V) {
    return base_bytes + sizeof(St) * TILE * (res ? (K / 64 + 2 * (V / 64)) : 2);
  }
};

template <class St, int K, bool RES>
__global__ void __launch_bounds__(128) grad_wy_kernel(const Params p) {
  // K <= 128: dk of this CTA's rows stays in registers over the value heads of the group (one read of grad_qk's
  // part, one store); K = 256 adds each head's part into dk1 in memory
  constexpr bool DKREG = K <= 128, F32 = sizeof(St) == 4;
  using F = WyCfg<St, K>;
  constexpr int LDK = F::LDK, LDC = F::LDC, LDF = F::LDF, TILE = F::TILE;
  extern __shared__ __align__(16) unsigned char smem[];
  const int V = p.V, NVB = V / 64;
  St* Ks = reinterpret_cast<St*>(smem);
  St* TmS = Ks + C * LDK;
  St* dTmS = TmS + TILE;  // later R
  St* RS = dTmS;
  float* KKf = reinterpret_cast<float*>(dTmS + TILE);
  float* gam = KKf + C * LDF;
  float* bet = gam + 64;
  float* rowv = bet + 64;
  float* colv = rowv + 64;  // [4][64]
  St* blk = reinterpret_cast<St*>(colv + 256);
  // RES: dW blocks [K/64], dVn^T blocks [V/64], V blocks [V/64];  streamed: blkA, blkB
  St* dWr = blk;
  St* dVr = blk + (K / 64) * TILE;
  St* Vr = dVr + NVB * TILE;

  const int c = blockIdx.x, h = blockIdx.y;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g8 = lane >> 2, q = lane & 3;
  const ChunkInfo ci = chunk_info(p, c);
  const int64_t HK = static_cast<int64_t>(p.H) * K;

  auto head = [&](int gi) { return WyHead<St>(p, ci, c, h, gi); };
  // RES: a head's resident tiles load in two groups, each issued as soon as the previous head is done with its
  // buffers: dVn^T and V after that head's dTm and dV, Tm and dW after its dK (fp32, which computes dV last, issues
  // both after its dK; the streamed variant prefetches Tm only).
  auto issue_tm_dw = [&](int gi) {
    const WyHead<St> hd = head(gi);
    load_tile<St, C, C, 128>(TmS, LDC, static_cast<const St*>(p.Tm) + hd.chv * C * C, C, C, tid);
    if constexpr (RES)
      for (int kb = 0; kb < K / 64; ++kb) load_tile<St, C, C, 128>(dWr + kb * TILE, LDC, hd.dW + kb * 64, K, C, tid);
    cp_async_commit();
  };
  auto issue_dvn_v = [&](int gi) {
    const WyHead<St> hd = head(gi);
    for (int vb = 0; vb < NVB; ++vb) {
      load_tile<St, C, C, 128>(dVr + vb * TILE, LDC, hd.dVnT + static_cast<int64_t>(vb) * 64 * C, C, C, tid);
      load_tile<St, C, C, 128>(Vr + vb * TILE, LDC, hd.v + vb * 64, p.tok_v, ci.len, tid);
    }
    cp_async_commit();
  };
  load_tile<St, C, K, 128>(Ks, LDK, static_cast<const St*>(p.k) + ci.bos * HK + h * K, HK, ci.len, tid);
  cp_async_commit();
  issue_tm_dw(0);  // (in flight during K K^T)
  if constexpr (RES) issue_dvn_v(0);
  // grad_qk's part of dk for this thread's fragment positions, in flight during the first head's work
  float dka[DKREG ? K / 64 : 1][8][4];
  if constexpr (DKREG) wy_dk_load<K>(dka, p, ci, h, warp, g8, q);
  cp_async_wait<RES ? 2 : 1>();  // K (the first head's groups may still be in flight)
  __syncthreads();
  {  // K K^T (independent of the value head)
    float kk[8][4];
    zero_acc(kk);
#pragma unroll 2
    for (int kt = 0; kt < K / 16; ++kt) {
      const FragA<St> a = lda<St>(Ks, LDK, 16 * warp, 16 * kt);
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        FragB<St> b[2];
        ldb<St>(b, Ks, LDK, 16 * np, 16 * kt);
        mma<St>(kk[2 * np], a, b[0]);
        mma<St>(kk[2 * np + 1], a, b[1]);
      }
    }
    wy_store_kk(KKf, kk, warp, g8, q);
  }

#pragma unroll 1
  for (int gi = 0; gi < p.G; ++gi) {
    const WyHead<St> hd = head(gi);
    const int hv = hd.hv;
    const int64_t chv = hd.chv;
    const float dgam_qk = wy_head_rows(p, ci, c, hv, chv, tid, gam, bet);
    cp_async_wait<0>();  // this head's tiles (issued before the loop or during the previous head)
    __syncthreads();
    auto get_dW = [&](int kb) -> const St* {
      if constexpr (RES) return dWr + kb * TILE;
      __syncthreads();
      load_tile<St, C, C, 128>(blk, LDC, hd.dW + kb * 64, K, C, tid);
      cp_async_commit();
      cp_async_wait<0>();
      __syncthreads();
      return blk;
    };
    auto get_dU_V = [&](int vb, const St*& dU, const St*& Vb, bool need_v) {
      if constexpr (RES) {
        dU = dVr + vb * TILE;
        Vb = Vr + vb * TILE;
        return;
      }
      __syncthreads();
      load_tile<St, C, C, 128>(blk, LDC, hd.dVnT + static_cast<int64_t>(vb) * 64 * C, C, C, tid);
      if (need_v)
        load_tile<St, C, C, 128>(blk + TILE, LDC, hd.v + vb * 64, p.tok_v, ci.len, tid);
      cp_async_commit();
      cp_async_wait<0>();
      __syncthreads();
      dU = blk;
      Vb = blk + TILE;
    };

    // dV = diag(beta) Tm^T dU, per 64-column block. 16-bit types: right after dTm, so that dVn^T and V are free
    // for the next head's tiles during the rest of this head; fp32 keeps it last (fewer registers live).
    float ry[2] = {0.f, 0.f};
    auto dv_phase = [&] {
#pragma unroll 1
      for (int vb = 0; vb < NVB; ++vb) {
        const St *dU, *Vb;
        get_dU_V(vb, dU, Vb, true);
        float Y[8][4];
        zero_acc(Y);
        warp_mma_16x64x64<St, true, false>(Y, TmS, LDC, 16 * warp, dU, LDC, 0);
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
          for (int hr = 0; hr < 2; ++hr) {
            const int i = 16 * warp + g8 + 8 * hr;
            const int vl = 8 * nt + 2 * q;
            const float y0 = Y[nt][2 * hr], y1 = Y[nt][2 * hr + 1];
            ry[hr] += to_f<St>(Vb[i * LDC + vl]) * y0 + to_f<St>(Vb[i * LDC + vl + 1]) * y1;
            if (i < ci.len) {
              const int64_t off = (ci.bos + i) * p.tok_dv + hv * p.ld_dv + vb * 64 + vl;
              st2_grad<St>(p.dv, off, bet[i] * y0, bet[i] * y1, p.dv_f32);
            }
          }
      }
    };

    // dTm = (dW K^T) diag(beta e^gam) + (dU V^T) diag(beta)
    float aW[8][4], aU[8][4];
    zero_acc(aW);
    zero_acc(aU);
#pragma unroll 1
    for (int kb = 0; kb < K / 64; ++kb) {
      const St* bA = get_dW(kb);
      warp_mma_16x64x64<St, false, false>(aW, bA, LDC, 16 * warp, Ks, LDK, kb * 64);
    }
#pragma unroll 1
    for (int vb = 0; vb < NVB; ++vb) {
      const St *dU, *Vb;
      get_dU_V(vb, dU, Vb, true);
      warp_mma_16x64x64<St, true, false>(aU, dU, LDC, 16 * warp, Vb, LDC, 0);
    }
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = 16 * warp + g8 + 8 * (e >> 1), j = 8 * nt + 2 * q + (e & 1);
        dTmS[i * LDC + j] = from_f<St>(bet[j] * (aW[nt][e] * __expf(gam[j]) + aU[nt][e]));
      }
    if constexpr (!F32) dv_phase();
    __syncthreads();
    if constexpr (RES && !F32) {
      if (gi + 1 < p.G) issue_dvn_v(gi + 1);  // (dVn^T and V are done with)
    }

    // dM = -Tm^T dTm Tm^T, strictly lower
    float P[8][4], dM[8][4];
    zero_acc(P);
    zero_acc(dM);
    warp_mma_16x64x64<St, true, true>(P, TmS, LDC, 16 * warp, dTmS, LDC, 0);
#pragma unroll
    for (int kt = 0; kt < 4; ++kt) {
      const FragA<St> a = frag_a_from_c<St>(P[2 * kt], P[2 * kt + 1], -1.f);
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        FragB<St> b[2];
        ldb<St>(b, TmS, LDC, 16 * np, 16 * kt);
        mma<St>(dM[2 * np], a, b[0]);
        mma<St>(dM[2 * np + 1], a, b[1]);
      }
    }
    __syncthreads();  // every warp is done with dTm: R takes its place
    // R = dM o beta_i E, the beta and gam terms of M
    float R[F32 ? 8 : 1][4];  // (fp32: R also stays in registers)
    float rbeta[2] = {0.f, 0.f}, rgam[2] = {0.f, 0.f};
    wy_r_terms<!F32>(dM, gam, bet, KKf, warp, g8, q, rbeta, rgam, colv, [&](int nt, int e, int i, int j, float r) {
      if constexpr (F32) R[nt][e] = r;
      RS[i * LDC + j] = from_f<St>(r);
    });
    __syncthreads();

    // dK2 = diag(beta e^gam) Tm^T dW + R K + R^T K  (added into dk), per 64-column block
    float rx[2] = {0.f, 0.f};
#pragma unroll(DKREG ? K / 64 : 1)  // (dka is indexed by kb: registers only when unrolled)
    for (int kb = 0; kb < K / 64; ++kb) {
      const St* bA = get_dW(kb);
      float X[8][4], RK[8][4];
      zero_acc(X);
      zero_acc(RK);
#pragma unroll
      for (int kt = 0; kt < 4; ++kt) {
        const FragA<St> at = lda_t<St>(TmS, LDC, 16 * warp, 16 * kt);
        FragA<St> ar;
        if constexpr (F32) ar = frag_a_from_c<St>(R[2 * kt], R[2 * kt + 1]);
        else ar = lda<St>(RS, LDC, 16 * warp, 16 * kt);
        const FragA<St> art = lda_t<St>(RS, LDC, 16 * warp, 16 * kt);
#pragma unroll
        for (int np = 0; np < 4; ++np) {
          FragB<St> b[2];
          ldb_t<St>(b, bA, LDC, 16 * kt, 16 * np);
          mma<St>(X[2 * np], at, b[0]);
          mma<St>(X[2 * np + 1], at, b[1]);
          ldb_t<St>(b, Ks, LDK, 16 * kt, kb * 64 + 16 * np);
          mma<St>(RK[2 * np], ar, b[0]);
          mma<St>(RK[2 * np + 1], ar, b[1]);
          mma<St>(RK[2 * np], art, b[0]);
          mma<St>(RK[2 * np + 1], art, b[1]);
        }
      }
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int i = 16 * warp + g8 + 8 * hr;
          const int k = kb * 64 + 8 * nt + 2 * q;
          const float eg = __expf(gam[i]);
          const float x0 = X[nt][2 * hr], x1 = X[nt][2 * hr + 1];
          rx[hr] += eg * (to_f<St>(Ks[i * LDK + k]) * x0 + to_f<St>(Ks[i * LDK + k + 1]) * x1);
          if constexpr (DKREG) {
            dka[kb][nt][2 * hr] += bet[i] * eg * x0 + RK[nt][2 * hr];
            dka[kb][nt][2 * hr + 1] += bet[i] * eg * x1 + RK[nt][2 * hr + 1];
          } else if (i < ci.len) {
            // dk sums over the value heads of the group in fp32 (dk1), stored in its dtype after the last one
            const int64_t off = (ci.bos + i) * HK + h * K + k;
            const float2 cur = *reinterpret_cast<const float2*>(p.dk1 + off);
            const float d0 = cur.x + bet[i] * eg * x0 + RK[nt][2 * hr];
            const float d1 = cur.y + bet[i] * eg * x1 + RK[nt][2 * hr + 1];
            if (gi + 1 < p.G || p.grad_f32)
              st2<float>((gi + 1 < p.G ? p.dk1 : static_cast<float*>(p.dk)) + off, d0, d1);
            else
              st2<St>(static_cast<St*>(p.dk) + off, d0, d1);
          }
        }
    }
    if constexpr (F32) dv_phase();
    wy_row_terms(p, ci, hv, rx, ry, rbeta, rgam, bet, rowv, warp, g8, q);
    __syncthreads();
    if (gi + 1 < p.G) {
      issue_tm_dw(gi + 1);  // (Tm and dW are done with)
      if constexpr (RES && F32) issue_dvn_v(gi + 1);
    }
    if (tid < 64) {
      const int i = tid;
      rowv[i] = rowv[i] - ((colv[i] + colv[64 + i]) + (colv[128 + i] + colv[192 + i])) + dgam_qk;
    }
    __syncthreads();
    if (warp == 0) dg_of_chunk(p, ci, hv, rowv, lane);
    __syncthreads();
  }
  if constexpr (DKREG) wy_dk_store<St, K>(dka, p, ci, h, warp, g8, q);
}

// ---------------------------------------------------------------------------------------------------------------
// 16-bit inputs, K <= 128: the same work per CTA, its products as warpgroup products (the CTA's four warps are one
// warpgroup, wgmma.cuh). The tiles read as B operands are sw128: K, Tm, dTm and the head's resident dW, dVn^T and V
// blocks; R, read only as A, stays padded (in dTm's place). Tm^T's A fragments are loaded once per head and serve
// dV, Tm^T dTm and Tm^T dW.
template <class St, int K>
struct WyWgCfg {
  static constexpr int LDC = C + PadOf<St>::value, LDF = kLdF;
  static constexpr int ST = C * 128;                                 // a sw128 64 x 64 tile (8 KB)
  static constexpr int PT = static_cast<int>(sizeof(St)) * C * LDC;  // a padded one (9 KB)
  static constexpr int KS_OFF = 0;                                   // K: K / 64 blocks
  static constexpr int TM_OFF = KS_OFF + (K / 64) * ST;
  static constexpr int DTM_OFF = TM_OFF + ST;            // dTm (sw128), then R (padded)
  static constexpr int DW_OFF = DTM_OFF + PT;            // dW: K / 64 blocks
  static constexpr int DV_OFF = DW_OFF + (K / 64) * ST;  // dVn^T: V / 64 blocks, then V: V / 64 blocks
  static_assert(PT % 1024 == 0, "1024-byte boundaries of the sw128 tiles");
  __host__ __device__ static int f_off(int V) { return DV_OFF + 2 * (V / 64) * ST; }
  // fp32: K K^T, then two slots each of a head's gam, beta and grad_qk's K-block parts of dgam, the row and column sums
  static size_t bytes(int V) {
    return f_off(V) + sizeof(float) * (C * LDF + 2 * (2 + K / 64) * 64 + 64 + 4 * 64) + 1024;
  }
};

template <class St, int K>
__global__ void __launch_bounds__(128) grad_wy_wg_kernel(const Params p) {
  static_assert(K <= 128 && sizeof(St) == 2, "warpgroup grad_wy: 16-bit inputs, K <= 128");
  using F = WyWgCfg<St, K>;
  constexpr int LDC = F::LDC, LDF = F::LDF, ST = F::ST, NKB = K / 64;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  const int V = p.V, NVB = V / 64;
  unsigned char* Ks = smem + F::KS_OFF;
  unsigned char* TmS = smem + F::TM_OFF;
  unsigned char* dTmS = smem + F::DTM_OFF;
  St* RS = reinterpret_cast<St*>(dTmS);
  unsigned char* dWr = smem + F::DW_OFF;
  unsigned char* dVr = smem + F::DV_OFF;
  unsigned char* Vr = dVr + NVB * ST;
  float* KKf = reinterpret_cast<float*>(smem + F::f_off(V));
  float* gamS = KKf + C * LDF;     // [2][64]: slot gi % 2 holds value head gi's rows
  float* betS = gamS + 2 * 64;     // [2][64]
  float* dgqS = betS + 2 * 64;     // [2][K / 64][64]
  float* rowv = dgqS + 2 * NKB * 64;
  float* colv = rowv + 64;  // [4][64]

  const int c = blockIdx.x, h = blockIdx.y;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g8 = lane >> 2, q = lane & 3;
  const ChunkInfo ci = chunk_info(p, c);
  const int64_t HK = static_cast<int64_t>(p.H) * K;

  auto head = [&](int gi) { return WyHead<St>(p, ci, c, h, gi); };
  // a head's tiles load in two groups, each issued once the previous head is done with their buffers: dVn^T and V
  // after its dTm and dV, Tm and dW (with the head's gam and grad_qk's parts of dgam, to slot gi % 2) after its dK.
  // Its beta (strided over the heads, in beta's dtype) is read into a register when dVn^T and V are issued and
  // stored to its slot at the end of the previous head: no row of a head waits on memory when the head starts.
  auto issue_tm_dw = [&](int gi) {
    const WyHead<St> hd = head(gi);
    load_tile_sw128<St, C, C, C, 128, false>(TmS, 0, static_cast<const St*>(p.Tm) + hd.chv * C * C, C, C, tid);
    for (int kb = 0; kb < NKB; ++kb)
      load_tile_sw128<St, C, C, C, 128, false>(dWr + kb * ST, 0, hd.dW + kb * 64, K, C, tid);
    if (tid < 16) {
      cp_async16(gamS + (gi & 1) * 64 + 4 * tid, p.gam + hd.chv * C + 4 * tid, true);
    } else if (tid < 16 * (1 + NKB)) {
      const int kb = (tid - 16) >> 4, j = (tid - 16) & 15;
      cp_async16(dgqS + ((gi & 1) * NKB + kb) * 64 + 4 * j,
                 p.dgam1 + ((static_cast<int64_t>(kb) * p.NC + c) * p.HV + hd.hv) * C + 4 * j, true);
    }
    cp_async_commit();
  };
  auto beta_row = [&](int gi) {  // (threads 0..63: row tid)
    return tid < ci.len ? load_as_float(p.beta, p.beta_dtype, (ci.bos + tid) * p.HV + h * p.G + gi) : 0.f;
  };
  auto issue_dvn_v = [&](int gi) {
    const WyHead<St> hd = head(gi);
#pragma unroll 1
    for (int vb = 0; vb < NVB; ++vb) {
      load_tile_sw128<St, C, C, C, 128, false>(dVr + vb * ST, 0, hd.dVnT + static_cast<int64_t>(vb) * 64 * C, C, C,
                                                tid);
      load_tile_sw128<St, C, C, C, 128>(Vr + vb * ST, 0, hd.v + vb * 64, p.tok_v, ci.len, tid);
    }
    cp_async_commit();
  };
  load_tile_sw128<St, C, K, C, 128>(Ks, 0, static_cast<const St*>(p.k) + ci.bos * HK + h * K, HK, ci.len, tid);
  cp_async_commit();
  issue_tm_dw(0);
  issue_dvn_v(0);
  float dka[NKB][8][4];  // grad_qk's part of dk for this thread's fragment positions
  wy_dk_load<K>(dka, p, ci, h, warp, g8, q);
  if (tid < 64) betS[tid] = beta_row(0);
  float beta_next = 0.f;  // (threads 0..63: the next head's beta of row tid)
  cp_async_wait<2>();  // K (the first head's groups may still be in flight)
  fence_async_smem();
  __syncthreads();
  {  // K K^T (independent of the value head), K K-major
    float kk[8][4];
#pragma unroll
    for (int kb = 0; kb < NKB; ++kb) {
      FragA<St> a[4];
#pragma unroll
      for (int t = 0; t < 4; ++t) a[t] = lda_sw128<St>(Ks + kb * ST, 16 * warp, 16 * t);
      wg_product<St, 0>(kk, a, sw128_desc(Ks + kb * ST, 16), kb > 0);
    }
    wg_wait<0>();
    wg_fence_acc(kk);
    wy_store_kk(KKf, kk, warp, g8, q);
  }

#pragma unroll 1
  for (int gi = 0; gi < p.G; ++gi) {
    const WyHead<St> hd = head(gi);
    const int hv = hd.hv;
    const float* gam = gamS + (gi & 1) * 64;
    const float* bet = betS + (gi & 1) * 64;
    cp_async_wait<0>();  // this head's tiles and rows (issued before the loop or during the previous head)
    fence_async_smem();
    __syncthreads();

    // dTm = (dW K^T) diag(beta e^gam) + (dU V^T) diag(beta), K and V K-major
    float aW[8][4], aU[8][4];
#pragma unroll
    for (int kb = 0; kb < NKB; ++kb) {
      FragA<St> a[4];
#pragma unroll
      for (int t = 0; t < 4; ++t) a[t] = lda_sw128<St>(dWr + kb * ST, 16 * warp, 16 * t);
      wg_product<St, 0>(aW, a, sw128_desc(Ks + kb * ST, 16), kb > 0);
    }
    wg_wait<0>();  // (no group in flight across the loop below)
    wg_fence_acc(aW);
    // (a rolled loop reloads the same A registers: each block's group is waited for before the next load)
#pragma unroll 1
    for (int vb = 0; vb < NVB; ++vb) {
      FragA<St> a[4];
#pragma unroll
      for (int t = 0; t < 4; ++t) a[t] = lda_t_sw128<St>(dVr + vb * ST, 16 * warp, 16 * t);
      wg_product<St, 0>(aU, a, sw128_desc(Vr + vb * ST, 16), vb > 0);
      wg_wait<0>();
      wg_fence_acc(aU);
    }
    wg_fence_acc(aW);
    wg_fence_acc(aU);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int i = 16 * warp + g8 + 8 * hr, j = 8 * nt + 2 * q;
        uint32_t w[1];
        Pack<St>::put(w, w, 0, bet[j] * (aW[nt][2 * hr] * __expf(gam[j]) + aU[nt][2 * hr]),
                      bet[j + 1] * (aW[nt][2 * hr + 1] * __expf(gam[j + 1]) + aU[nt][2 * hr + 1]));
        *reinterpret_cast<uint32_t*>(dTmS + sw128_off(i, j)) = w[0];
      }
    fence_async_smem();  // dTm is read by wgmma after the barrier below
    // Tm^T as A (rows i, contraction j), for dV, Tm^T dTm and Tm^T dW
    FragA<St> at[4];
#pragma unroll
    for (int t = 0; t < 4; ++t) at[t] = lda_t_sw128<St>(TmS, 16 * warp, 16 * t);

    // dV = diag(beta) Tm^T dU per 64-column block (dU = dVn, from dVn^T K-major), stored by wy_store_grad
    float ry[2] = {0.f, 0.f};
    {  // (this thread's rows i0 and i0 + 8: their beta, validity and offset in dv, read once per head)
      const int i0 = 16 * warp + g8;
      const float bi[2] = {bet[i0], bet[i0 + 8]};
      const bool ok[2] = {i0 < ci.len, i0 + 8 < ci.len};
      const int64_t tok = p.tok_dv, off = (ci.bos + i0) * tok + hv * p.ld_dv;
#pragma unroll 1
      for (int vb = 0; vb < NVB; ++vb) {
        float Y[8][4];
        wg_product<St, 0>(Y, at, sw128_desc(dVr + vb * ST, 16), false);
        wg_wait<0>();
        wg_fence_acc(Y);
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
          for (int hr = 0; hr < 2; ++hr) {
            const float y0 = Y[nt][2 * hr], y1 = Y[nt][2 * hr + 1];
            const float2 vv = sw128_get2<St>(Vr + vb * ST, i0 + 8 * hr, 8 * nt + 2 * q);
            ry[hr] += vv.x * y0 + vv.y * y1;
            Y[nt][2 * hr] = bi[hr] * y0;
            Y[nt][2 * hr + 1] = bi[hr] * y1;
          }
        wy_store_grad<St>(p.dv, off + vb * 64, tok, Y, ok, p.dv_f32, q);
      }
    }
    __syncthreads();
    if (gi + 1 < p.G) {
      issue_dvn_v(gi + 1);  // (dVn^T and V are done with)
      if (tid < 64) beta_next = beta_row(gi + 1);
    }

    // dM = -Tm^T dTm Tm^T, strictly lower (dTm N-major, then Tm K-major)
    float P[8][4], dM[8][4];
    wg_product<St, 1>(P, at, sw128_desc(dTmS, ST), false);
    wg_wait<0>();
    wg_fence_acc(P);
    {
      FragA<St> pa[4];
#pragma unroll
      for (int t = 0; t < 4; ++t) pa[t] = frag_a_from_c<St>(P[2 * t], P[2 * t + 1], -1.f);
      wg_product<St, 0>(dM, pa, sw128_desc(TmS, 16), false);
      wg_wait<0>();
      wg_fence_acc(dM);
    }
    __syncthreads();  // every warp is done with dTm: R takes its place
    // R = dM o beta_i E, the beta and gam terms of M. R + R^T is stored (R is strictly lower, so every entry is one
    // of the two and the sum is exact): R K + R^T K is then one product
    float rbeta[2] = {0.f, 0.f}, rgam[2] = {0.f, 0.f};
    wy_r_terms<true>(dM, gam, bet, KKf, warp, g8, q, rbeta, rgam, colv, [&](int, int, int i, int j, float r) {
      if (i > j) RS[j * LDC + i] = from_f<St>(r);
      if (i >= j) RS[i * LDC + j] = from_f<St>(r);
    });
    __syncthreads();

    // dK2 = diag(beta e^gam) Tm^T dW + (R + R^T) K (added into dk), per 64-column block; dW and K N-major
    float rx[2] = {0.f, 0.f};
    FragA<St> ar[4];
#pragma unroll
    for (int t = 0; t < 4; ++t) ar[t] = lda<St>(RS, LDC, 16 * warp, 16 * t);
#pragma unroll
    for (int kb = 0; kb < NKB; ++kb) {
      float X[8][4], RK[8][4];
      wg_product<St, 1>(X, at, sw128_desc(dWr + kb * ST, ST), false);
      wg_product<St, 1>(RK, ar, sw128_desc(Ks + kb * ST, ST), false);
      wg_wait<0>();
      wg_fence_acc(X);
      wg_fence_acc(RK);
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int i = 16 * warp + g8 + 8 * hr;
          const float eg = __expf(gam[i]);
          const float x0 = X[nt][2 * hr], x1 = X[nt][2 * hr + 1];
          const float2 kv = sw128_get2<St>(Ks + kb * ST, i, 8 * nt + 2 * q);
          rx[hr] += eg * (kv.x * x0 + kv.y * x1);
          dka[kb][nt][2 * hr] += bet[i] * eg * x0 + RK[nt][2 * hr];
          dka[kb][nt][2 * hr + 1] += bet[i] * eg * x1 + RK[nt][2 * hr + 1];
        }
    }
    wy_row_terms(p, ci, hv, rx, ry, rbeta, rgam, bet, rowv, warp, g8, q);
    __syncthreads();
    if (gi + 1 < p.G) issue_tm_dw(gi + 1);  // (Tm and dW are done with; the rows go to the other slot)
    if (tid < 64) {
      const int i = tid;
      float dgam_qk = 0.f;  // grad_qk's partial gradient of gam, summed over its K blocks
#pragma unroll
      for (int kb = 0; kb < NKB; ++kb) dgam_qk += dgqS[((gi & 1) * NKB + kb) * 64 + i];
      rowv[i] = rowv[i] - ((colv[i] + colv[64 + i]) + (colv[128 + i] + colv[192 + i])) + dgam_qk;
      if (gi + 1 < p.G) betS[((gi + 1) & 1) * 64 + i] = beta_next;
    }
    __syncthreads();
    if (warp == 0) dg_of_chunk(p, ci, hv, rowv, lane);
    __syncthreads();
  }
  wy_dk_store<St, K>(dka, p, ci, h, warp, g8, q);
}

void launch_grad_wy(const Params& p, DType dtype, void* stream) {
  if (p.NC == 0) return;
  GD_DTYPE_SWITCH(dtype, St, [&] {
    GD_HEADK_SWITCH(p.K, KC, [&] {
      if constexpr (HasWgmma<St>::value && KC <= 128) {
        using F = WyWgCfg<St, KC>;
        auto kern = grad_wy_wg_kernel<St, KC>;
        GD_CUDA_CHECK(set_max_smem(reinterpret_cast<const void*>(kern), F::bytes(p.V)));
        kern<<<dim3(p.NC, p.H), 128, F::bytes(p.V), static_cast<cudaStream_t>(stream)>>>(p);
      } else {
        using F = WyCfg<St, KC>;
        int dev = 0, optin = 0;
        GD_CUDA_CHECK(cudaGetDevice(&dev));
        GD_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
        const bool res = F::bytes(true, p.V) <= static_cast<size_t>(optin);
        // 16-bit types (K = 256 here) always fit (K = V = 256 needs 181 KB); only fp32 has a streamed variant
        void (*kern)(const Params) = grad_wy_kernel<St, KC, true>;
        if constexpr (sizeof(St) == 4) {
          if (!res) kern = grad_wy_kernel<St, KC, false>;
        } else {
          TORCH_CHECK(res, "gated_delta CUDA: grad_wy needs more shared memory than the device offers");
        }
        const size_t bytes = F::bytes(sizeof(St) == 4 ? res : true, p.V);
        GD_CUDA_CHECK(set_max_smem(reinterpret_cast<const void*>(kern), bytes));
        kern<<<dim3(p.NC, p.H), 128, bytes, static_cast<cudaStream_t>(stream)>>>(p);
      }
      GD_CUDA_LAUNCH_CHECK();
    });
  });
}

}  // namespace cuda
}  // namespace gated_delta
