// Chunk-parallel gradient kernels of the backward (docs/algorithms.md, "Backward of one chunk"), given the states
// entering each chunk (hT), the state gradients leaving it (dhT), Vn^T and dVn^T from the two sequential passes.
//
// grad_qk: per work item (chunk, q/k head, 64-wide block of K), 8 warps walk the value heads of the group (summing
// dq and the first part of dk in registers: deterministic) and 64-wide tiles of V as one pipeline of (head, V tile)
// steps, the tiles of the next two steps in flight across head boundaries (for 16-bit inputs, across items too: a
// persistent CTA per SM walks its items as one pipeline; fp32 runs one CTA per item):
//   dA = scale dO Vn^T (masked i >= j)      dQ = scale diag(e^gam) dO S^T + (dA o E) K
//   dK1 = (dA o E)^T Q + diag(e^{gam_L - gam}) Vn dS'^T            dW = -dVn S^T
//   and the partial gradient of gam (per block of K). For 16-bit inputs the products are warpgroup products
//   (grad_qk_wg_kernel: one warpgroup for dA and dQ, one for dW and dK1); fp32 keeps mma.sync's split products.
// grad_wy: one CTA (4 warps) per (chunk, q/k head), looping over the group (the next head's tiles load during this
// head's products): reads Tm (written by the backward's prep), then back through W = Tm diag(beta e^gam) K and
// U = Tm diag(beta) V with dU = dVn:
//   dTm = dW (diag(beta e^gam) K)^T + dU (diag(beta) V)^T,  dM = -Tm^T dTm Tm^T (strictly lower)
//   dK += diag(beta e^gam) Tm^T dW + R K + R^T K (R = dM o beta_i E),  dV = diag(beta) Tm^T dU,  dbeta, dg.
#include "../dispatch.cuh"
#include "chunks.cuh"
#include "mma.cuh"
#include "tile_load.cuh"
#include "wgmma.cuh"

namespace gated_delta {
namespace cuda {

// A head's partial gradient of gam for this CTA's K block, by threads 0..63 (row tid): the row sums of the q and k
// terms (over HALVES column halves), less the column sums of the A term (first K block only, over four row blocks),
// and on the last row the state terms: e^{gam_L} sum(hT o dhT) (the eight warps' sums) and the sum of the k terms
template <int HALVES>
__device__ __forceinline__ void qk_dgam_rows(const Params& p, int kb, int c, int hv, float gL, const float* rowA,
                                             const float* rowK, const float* colB, const float* sdots, int tid) {
  if (tid >= 64) return;
  const int i = tid, warp = tid >> 5, lane = tid & 31;
  auto row = [](const float* r, int x) { return HALVES == 2 ? r[x] + r[64 + x] : r[x]; };
  float v = row(rowA, i) - row(rowK, i);
  if (kb == 0) v -= (colB[i] + colB[64 + i]) + (colB[128 + i] + colB[192 + i]);
  if (warp == 1) {  // rows 32..63: the last row takes the state terms, by warp sums
    float kd = row(rowK, lane) + row(rowK, 32 + lane);
    float sd = lane < 8 ? sdots[lane] : 0.f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      kd += __shfl_xor_sync(0xffffffffu, kd, o);
      sd += __shfl_xor_sync(0xffffffffu, sd, o);
    }
    if (i == C - 1) v += __expf(gL) * sd + kd;
  }
  p.dgam1[((static_cast<int64_t>(kb) * p.NC + c) * p.HV + hv) * C + i] = v;
}

// Work item it of grad_qk: (chunk c, q/k head h, K block kb), the K blocks of a chunk adjacent (they read the same
// dO, Vn^T, dVn^T and A tiles, which the second finds in L2)
struct QkItem {
  int kb, c, h;
  ChunkInfo ci;
  int64_t chv0;  // c HV + the group's first value head
};
__device__ __forceinline__ QkItem qk_item(const Params& p, int it) {
  QkItem r;
  const int nkb = p.K / 64;
  r.kb = it % nkb;
  r.c = (it / nkb) % p.NC;
  r.h = it / (nkb * p.NC);
  r.ci = chunk_info(p, r.c);
  r.chv0 = static_cast<int64_t>(r.c) * p.HV + r.h * p.G;
  return r;
}
__host__ __device__ inline int qk_items(const Params& p) { return p.NC * p.H * (p.K / 64); }

// ---------------------------------------------------------------------------------------------------------------
template <class St>
struct QkCfg {
  static constexpr bool F32 = sizeof(St) == 4;
  // Tile sets of the (value head, V tile) steps in flight: two ahead of the one computed (one for fp32). The steps
  // run across the value heads of the group, so the next head's first tiles load during this head's element-wise
  // terms. A and gam are per head: NA slots, enough that a head's slot is not refilled before its terms are done.
  static constexpr int STAGES = F32 ? 1 : 3;
  static constexpr int NA = F32 ? 1 : 3;
  static constexpr int LDC = C + PadOf<St>::value;
  static constexpr int TILE = C * LDC;  // elements of one 64 x 64 tile
  static constexpr size_t STAGE_BYTES = sizeof(St) * 5 * TILE;
  static constexpr size_t bytes = STAGES * STAGE_BYTES + sizeof(St) * (3 + NA) * TILE +
                                  sizeof(float) * (NA * 64 + 2 * 64 + 2 * 64 + 4 * 64 + 8);
};

template <class St>
__global__ void __launch_bounds__(256) grad_qk_kernel(const Params p) {
  using F = QkCfg<St>;
  constexpr int LDC = F::LDC, TILE = F::TILE, STAGES = F::STAGES, NA = F::NA;
  extern __shared__ __align__(16) unsigned char smem[];
  St* qs = reinterpret_cast<St*>(smem + STAGES * F::STAGE_BYTES);
  St* ksm = qs + TILE;
  St* dAEs = ksm + TILE;
  St* Aslots = dAEs + TILE;  // [NA] tiles
  float* gslots = reinterpret_cast<float*>(Aslots + NA * TILE);  // [NA][64]
  float* rowA = gslots + NA * 64;  // [2][64]
  float* rowK = rowA + 128; // [2][64]
  float* colB = rowK + 128; // [4][64]
  float* sdots = colB + 256; // [8]

  const QkItem w = qk_item(p, blockIdx.x);  // (one CTA per item)
  const int kb = w.kb, c = w.c, h = w.h;
  const ChunkInfo ci = w.ci;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g8 = lane >> 2, q = lane & 3;
  const int rg = warp & 3, chf = warp >> 2;
  const int K = p.K, V = p.V;
  const int64_t HK = static_cast<int64_t>(p.H) * K;
  const int nvt = V / 64, nsteps = p.G * nvt;

  // Step s: value head gi = s / nvt of the group, V tile vt = s % nvt. Its five tiles go to stage s % STAGES; the
  // first step of a head also brings the head's gam (and A, which only the first K block reads) to slot gi % NA.
  auto issue = [&](int s) {
    const int gi = s / nvt, vt = s % nvt, hv = h * p.G + gi;
    const int64_t chv = static_cast<int64_t>(c) * p.HV + hv;
    St* base = reinterpret_cast<St*>(smem + (s % STAGES) * F::STAGE_BYTES);
    load_tile<St, C, C, 256>(base, LDC, static_cast<const St*>(p.d_o) + ci.bos * p.tok_do + hv * p.ld_do + vt * 64,
                             p.tok_do, ci.len, tid);
    load_tile<St, C, C, 256>(base + TILE, LDC, static_cast<const St*>(p.VnT) + (chv * V + vt * 64) * C, C, C, tid);
    load_tile<St, C, C, 256>(base + 2 * TILE, LDC, static_cast<const St*>(p.dVnT) + (chv * V + vt * 64) * C, C, C,
                             tid);
    load_tile<St, C, C, 256>(base + 3 * TILE, LDC,
                             static_cast<const St*>(p.hT) + (chv * V + vt * 64) * K + kb * 64, K, C, tid);
    load_tile<St, C, C, 256>(base + 4 * TILE, LDC,
                             static_cast<const St*>(p.dhT) + (chv * V + vt * 64) * K + kb * 64, K, C, tid);
    if (vt == 0) {
      if (kb == 0)
        load_tile<St, C, C, 256>(Aslots + (gi % NA) * TILE, LDC, static_cast<const St*>(p.A) + chv * C * C, C, C,
                                 tid);
      if (tid < 16) cp_async16(gslots + (gi % NA) * 64 + 4 * tid, p.gam + chv * C + 4 * tid, true);
    }
  };

  load_tile<St, C, C, 256>(qs, LDC, static_cast<const St*>(p.q) + ci.bos * HK + h * K + kb * 64, HK, ci.len, tid);
  load_tile<St, C, C, 256>(ksm, LDC, static_cast<const St*>(p.k) + ci.bos * HK + h * K + kb * 64, HK, ci.len, tid);
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {  // (q and k ride with step 0)
    if (s < nsteps) issue(s);
    cp_async_commit();
  }

  float dQ[4][4], dK1[4][4];
  zero_acc(dQ);
  zero_acc(dK1);
  float dA[4][4], dQs[4][4], dWn[4][4], dKt[4][4];
  float sdot = 0.f;

#pragma unroll 1
  for (int s = 0; s < nsteps; ++s) {
    const int gi = s / nvt, vt = s % nvt, hv = h * p.G + gi;
    const int64_t chv = static_cast<int64_t>(c) * p.HV + hv;
    if constexpr (STAGES == 1) {
      __syncthreads();  // every thread is done with step s - 1's tiles and the last head's terms
      issue(s);
      cp_async_commit();
    }
    cp_async_wait<STAGES == 1 ? 0 : STAGES - 2>();  // step s has landed (one group per step after it)
    __syncthreads();  // ... for every thread; and every thread is done with step s - 1's stage
    if constexpr (STAGES > 1) {
      if (s + STAGES - 1 < nsteps) issue(s + STAGES - 1);
      cp_async_commit();  // (an empty group past the last step keeps the count)
    }
    if (vt == 0) {
      zero_acc(dA);
      zero_acc(dQs);
      zero_acc(dWn);
      zero_acc(dKt);
      sdot = 0.f;
    }
    St* dOs = reinterpret_cast<St*>(smem + (s % STAGES) * F::STAGE_BYTES);
    St* VnTs = dOs + TILE;
    St* dVnTs = dOs + 2 * TILE;
    St* hTs = dOs + 3 * TILE;
    St* dhTs = dOs + 4 * TILE;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const FragA<St> a_dO = lda<St>(dOs, LDC, 16 * rg, 16 * kk);
      const FragA<St> a_dVn = lda_t<St>(dVnTs, LDC, 16 * rg, 16 * kk);
      const FragA<St> a_Vn = lda_t<St>(VnTs, LDC, 16 * rg, 16 * kk);
#pragma unroll
      for (int np = 0; np < 2; ++np) {
        const int n0 = 32 * chf + 16 * np;
        FragB<St> b[2];
        ldb_t<St>(b, VnTs, LDC, 16 * kk, n0);
        mma<St>(dA[2 * np], a_dO, b[0]);
        mma<St>(dA[2 * np + 1], a_dO, b[1]);
        FragB<St> bh[2];
        ldb_t<St>(bh, hTs, LDC, 16 * kk, n0);
        mma<St>(dQs[2 * np], a_dO, bh[0]);
        mma<St>(dQs[2 * np + 1], a_dO, bh[1]);
        mma<St>(dWn[2 * np], a_dVn, bh[0]);
        mma<St>(dWn[2 * np + 1], a_dVn, bh[1]);
        ldb_t<St>(b, dhTs, LDC, 16 * kk, n0);
        mma<St>(dKt[2 * np], a_Vn, b[0]);
        mma<St>(dKt[2 * np + 1], a_Vn, b[1]);
        // sum(hT o dhT) from the fragments both products just loaded (same positions): the row blocks kk are
        // loaded by every rg, so warp rg counts block kk == rg only
        if constexpr (sizeof(St) == 2) {
          if (kk == rg) {
#pragma unroll
            for (int t = 0; t < 2; ++t)
#pragma unroll
              for (int r = 0; r < 2; ++r) {
                const float2 x = unpack2<St>(bh[t].x[r]), y = unpack2<St>(b[t].x[r]);
                sdot += x.x * y.x + x.y * y.y;
              }
          }
        }
      }
    }
    if constexpr (sizeof(St) == 4) {
      for (int idx = tid; idx < C * C; idx += 256) {
        const int r = idx >> 6, cc = idx & 63;
        sdot += to_f<St>(hTs[r * LDC + cc]) * to_f<St>(dhTs[r * LDC + cc]);
      }
    }
    if (vt + 1 < nvt) continue;

    // the head's last V tile is in: its element-wise terms
    const St* As = Aslots + (gi % NA) * TILE;
    const float* gam = gslots + (gi % NA) * 64;
    float rA[2] = {0.f, 0.f}, rK[2] = {0.f, 0.f}, cB[4][2];
    const float gL = gam[C - 1];
    St* dWg = static_cast<St*>(p.dhT) + chv * V * K + kb * 64;  // (dW lives in dhT's tile, params.h)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      cB[nt][0] = cB[nt][1] = 0.f;
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int i = 16 * rg + g8 + 8 * hr;
        const float gi_ = gam[i];
        const float fq = p.scale * __expf(gi_), fk = __expf(gL - gi_);
        float dae[2];
#pragma unroll
        for (int e1 = 0; e1 < 2; ++e1) {
          const int e = 2 * hr + e1;
          const int col = 32 * chf + 8 * nt + 2 * q + e1;  // j for dA, k (in the block) otherwise
          const bool low = i >= col;
          const float dav = low ? p.scale * dA[nt][e] : 0.f;
          const float E = low ? __expf(gi_ - gam[col]) : 0.f;
          dae[e1] = dav * E;
          if (kb == 0) {
            const float t = dav * to_f<St>(As[i * LDC + col]);
            rA[hr] += t;
            cB[nt][e1] += t;
          }
          const float dqs = fq * dQs[nt][e];
          rA[hr] += to_f<St>(qs[i * LDC + col]) * dqs;
          dQ[nt][e] += dqs;
          const float dkt = fk * dKt[nt][e];
          rK[hr] += to_f<St>(ksm[i * LDC + col]) * dkt;
          dK1[nt][e] += dkt;
        }
        const int col0 = 32 * chf + 8 * nt + 2 * q;
        dAEs[i * LDC + col0] = from_f<St>(dae[0]);
        dAEs[i * LDC + col0 + 1] = from_f<St>(dae[1]);
        dWn[nt][2 * hr] = -dWn[nt][2 * hr];
        dWn[nt][2 * hr + 1] = -dWn[nt][2 * hr + 1];
      }
    }
    store_frag_rows<St, 4>(dWg + 16 * rg * K + 32 * chf, K, dWn, g8, q);
    // reductions: rows over the quad, columns over the 8 row-lanes
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      rA[hr] += __shfl_xor_sync(0xffffffffu, rA[hr], 1);
      rA[hr] += __shfl_xor_sync(0xffffffffu, rA[hr], 2);
      rK[hr] += __shfl_xor_sync(0xffffffffu, rK[hr], 1);
      rK[hr] += __shfl_xor_sync(0xffffffffu, rK[hr], 2);
      if (q == 0) {
        const int i = 16 * rg + g8 + 8 * hr;
        rowA[chf * 64 + i] = rA[hr];
        rowK[chf * 64 + i] = rK[hr];
      }
    }
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e1 = 0; e1 < 2; ++e1) {
        float x = cB[nt][e1];
        x += __shfl_xor_sync(0xffffffffu, x, 4);
        x += __shfl_xor_sync(0xffffffffu, x, 8);
        x += __shfl_xor_sync(0xffffffffu, x, 16);
        if (g8 == 0) colB[rg * 64 + 32 * chf + 8 * nt + 2 * q + e1] = x;
      }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sdot += __shfl_xor_sync(0xffffffffu, sdot, o);
    if (lane == 0) sdots[warp] = sdot;
    __syncthreads();

    // dQ += (dA o E) K,  dK1 += (dA o E)^T Q
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const FragA<St> a1 = lda<St>(dAEs, LDC, 16 * rg, 16 * kk);
      const FragA<St> a2 = lda_t<St>(dAEs, LDC, 16 * rg, 16 * kk);
#pragma unroll
      for (int np = 0; np < 2; ++np) {
        const int n0 = 32 * chf + 16 * np;
        FragB<St> b[2];
        ldb_t<St>(b, ksm, LDC, 16 * kk, n0);
        mma<St>(dQ[2 * np], a1, b[0]);
        mma<St>(dQ[2 * np + 1], a1, b[1]);
        ldb_t<St>(b, qs, LDC, 16 * kk, n0);
        mma<St>(dK1[2 * np], a2, b[0]);
        mma<St>(dK1[2 * np + 1], a2, b[1]);
      }
    }
    qk_dgam_rows<2>(p, kb, c, hv, gL, rowA, rowK, colB, sdots, tid);
    // (the next writes of dAEs and the row sums come after the next step's barrier)
  }

  // store dq (input dtype, or fp32 with grad_f32) and the first part of dk (fp32), valid rows only
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int i = 16 * rg + g8 + 8 * hr;
      if (i < ci.len) {
        const int64_t off = (ci.bos + i) * HK + h * K + kb * 64 + 32 * chf + 8 * nt + 2 * q;
        st2_grad<St>(p.dq, off, dQ[nt][2 * hr], dQ[nt][2 * hr + 1], p.grad_f32);
        st2<float>(p.dk1 + off, dK1[nt][2 * hr], dK1[nt][2 * hr + 1]);
      }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// 16-bit inputs: the same work items, walked by persistent CTAs (one per SM, items blockIdx.x + n gridDim.x), and
// one pipeline of (item, value head, V tile) steps across them: the next item's first tiles load during this item's
// last terms and its stores of dq and dk1. The products are warpgroup products (wgmma.cuh). Warpgroup 0 holds dA
// and scale dO S^T and then dQ; warpgroup 1 holds dW and Vn dS'^T and then dK1, each as full 64 x 64 accumulators.
// B operands (Vn^T, hT, dhT, q, k) are sw128 tiles; A operands come from registers: dO and dVn^T by ldmatrix from
// padded tiles, Vn^T by ldmatrix from its sw128 tile, dA o E from warpgroup 0's accumulator for dQ and from shared
// memory (transposed) for dK1.
template <class St>
struct QkWgCfg {
  // STAGES step tile sets (two in flight ahead of the one computed); NA slots of a head's A and gam and NQK of an
  // item's q and k, enough that a slot is not refilled before its head's (item's) terms are done: with two steps
  // ahead, the head (item) loading may be two past the one computed when a head (item) takes one step
  static constexpr int STAGES = 3, NA = 3, NQK = 3;
  static constexpr int LDC = C + PadOf<St>::value;
  static constexpr int PT = static_cast<int>(sizeof(St)) * C * LDC;  // bytes of a padded 64 x 64 tile (9 KB)
  static constexpr int ST = C * 128;                                 // bytes of a sw128 64 x 64 tile (8 KB)
  // a stage: Vn^T, hT, dhT (sw128), dO, dVn^T (padded); every offset below stays on a 1024-byte boundary
  static constexpr int STAGE_BYTES = 3 * ST + 2 * PT;
  static constexpr int QK_OFF = STAGES * STAGE_BYTES;  // [NQK] (q, k) pairs (sw128)
  static constexpr int DAE_OFF = QK_OFF + NQK * 2 * ST;  // dA o E (padded)
  static constexpr int A_OFF = DAE_OFF + PT;           // [NA] A tiles (padded)
  static constexpr int F_OFF = A_OFF + NA * PT;        // gam slots, row and column sums
  static_assert(STAGE_BYTES % 1024 == 0 && PT % 1024 == 0, "1024-byte boundaries of the sw128 tiles");
  static constexpr size_t bytes = F_OFF + sizeof(float) * (NA * 64 + 64 + 64 + 4 * 64 + 8) + 1024;
};

template <class St>
__global__ void __launch_bounds__(256, 1) grad_qk_wg_kernel(const Params p) {
  using F = QkWgCfg<St>;
  constexpr int LDC = F::LDC, STAGES = F::STAGES, NA = F::NA, NQK = F::NQK, ST = F::ST, PT = F::PT;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  St* dAEs = reinterpret_cast<St*>(smem + F::DAE_OFF);
  St* Aslots = reinterpret_cast<St*>(smem + F::A_OFF);
  float* gslots = reinterpret_cast<float*>(smem + F::F_OFF);  // [NA][64]
  float* rowA = gslots + NA * 64;  // [64]
  float* rowK = rowA + 64;         // [64]
  float* colB = rowK + 64;         // [4][64]
  float* sdots = colB + 256;       // [8]

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g8 = lane >> 2, q = lane & 3;
  const int wg = warp >> 2, rg = warp & 3;
  const int K = p.K, V = p.V;
  const int64_t HK = static_cast<int64_t>(p.H) * K;
  const int nvt = V / 64, nsteps = p.G * nvt;
  // this CTA's items: blockIdx.x + n gridDim.x, n < nitems; steps t = n nsteps + (gi nvt + vt)
  const int nitems = (qk_items(p) - 1 - static_cast<int>(blockIdx.x)) / static_cast<int>(gridDim.x) + 1;
  const int total = nitems * nsteps;

  // Issue side. Step s is V tile vt of value head gi of an item, in stage s % STAGES (counted, not divided). Within an
  // item a step's tiles follow the previous step's a constant stride in every tensor (a head's V tiles, then the next
  // head's), and each thread copies the same positions of every 64 x 64 tile: rows r0 and r0 + 32 (r0 = tid / 8) of
  // the 16-byte column cv = tid % 8. So its shared offsets are computed once and its sources (row r0) are set at an
  // item's first step and advance by constants. dO's rows past the chunk are zero-filled (their source address then
  // dO's tile, as in load_tile).
  const int r0 = tid >> 3, cv = tid & 7;
  const uint32_t s_sw = smem_u32(smem) + r0 * 128 + ((cv ^ (r0 & 7)) << 4);  // sw128 (row r0 + 32: same swizzle)
  const uint32_t s_pd = smem_u32(smem) + 3 * ST + (r0 * LDC + cv * 8) * static_cast<int>(sizeof(St));  // padded
  constexpr int PROW = 32 * LDC * static_cast<int>(sizeof(St));  // row r0 + 32 of a padded tile
  const St *vn = nullptr, *dvn = nullptr, *ht = nullptr, *dht = nullptr, *dO = nullptr;
  int64_t do_d1 = 0, ichv0 = 0;
  bool do_ok0 = false, do_ok1 = false, ikb0 = false;
  int iit = blockIdx.x, in_ = 0, igi = 0, ivt = 0, ist = 0, ihc = 0;  // (item, its local index n, gi, vt, stage, head)

  auto issue_next = [&]() {
    if (igi == 0 && ivt == 0) {  // an item's first step: its sources, and its q and k to slot n % NQK
      const QkItem w = qk_item(p, iit);
      const int64_t kcol = w.kb * 64 + r0 * K + cv * 8;
      vn = static_cast<const St*>(p.VnT) + w.chv0 * V * C + 8 * tid;  // (rows of C: r0 C + 8 cv = 8 tid)
      dvn = static_cast<const St*>(p.dVnT) + w.chv0 * V * C + 8 * tid;
      ht = static_cast<const St*>(p.hT) + w.chv0 * V * K + kcol;
      dht = static_cast<const St*>(p.dhT) + w.chv0 * V * K + kcol;
      do_ok0 = r0 < w.ci.len;
      do_ok1 = r0 + 32 < w.ci.len;
      const int64_t do_rs = p.tok_do;
      const int64_t do_off0 = do_ok0 ? r0 * do_rs + cv * 8 : 0;
      do_d1 = (do_ok1 ? (r0 + 32) * do_rs + cv * 8 : 0) - do_off0;  // row r0 + 32 from row r0
      dO = static_cast<const St*>(p.d_o) + w.ci.bos * p.tok_do + (w.h * p.G) * p.ld_do + do_off0;
      ichv0 = w.chv0;
      ikb0 = w.kb == 0;
      unsigned char* qk = smem + F::QK_OFF + (in_ % NQK) * 2 * ST;
      const int64_t qoff = w.ci.bos * HK + w.h * K + w.kb * 64;
      load_tile_sw128<St, C, C, C, 256>(qk, 0, static_cast<const St*>(p.q) + qoff, HK, w.ci.len, tid);
      load_tile_sw128<St, C, C, C, 256>(qk + ST, 0, static_cast<const St*>(p.k) + qoff, HK, w.ci.len, tid);
    }
    const uint32_t sw = s_sw + ist * F::STAGE_BYTES, pd = s_pd + ist * F::STAGE_BYTES;
    cp_async16(sw, vn, true);
    cp_async16(sw + 4096, vn + 32 * C, true);
    cp_async16(sw + ST, ht, true);
    cp_async16(sw + ST + 4096, ht + 32 * K, true);
    cp_async16(sw + 2 * ST, dht, true);
    cp_async16(sw + 2 * ST + 4096, dht + 32 * K, true);
    cp_async16(pd, dO, do_ok0);
    cp_async16(pd + PROW, dO + do_d1, do_ok1);
    cp_async16(pd + PT, dvn, true);
    cp_async16(pd + PT + PROW, dvn + 32 * C, true);
    if (ivt == 0) {  // the head's A (first K block only) and gam, to slot ihc % NA
      const int64_t chv = ichv0 + igi;
      const int slot = ihc % NA;
      if (ikb0) {
        const uint32_t sa = s_pd - 3 * ST + F::A_OFF + slot * PT;  // (padded, like dO's)
        const St* ag = static_cast<const St*>(p.A) + chv * C * C + 8 * tid;
        cp_async16(sa, ag, true);
        cp_async16(sa + PROW, ag + 32 * C, true);
      }
      if (tid < 16) cp_async16(gslots + slot * 64 + 4 * tid, p.gam + chv * C + 4 * tid, true);
    }
    vn += 64 * C;
    dvn += 64 * C;
    ht += 64 * K;
    dht += 64 * K;
    dO += 64;
    ist = ist == STAGES - 1 ? 0 : ist + 1;
    if (++ivt == nvt) {  // the next value head's dO row (from this one's end: ld_do - V further)
      ivt = 0;
      dO += p.ld_do - V;
      ++ihc;
      if (++igi == p.G) igi = 0, iit += gridDim.x, ++in_;
    }
  };

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {  // (an item's q and k ride with its first step)
    if (s < total) issue_next();
    cp_async_commit();
  }

  // warpgroup 0: acc0 = dA, acc1 = dO S^T, run = dQ;  warpgroup 1: acc0 = dVn S^T, acc1 = Vn dS'^T, run = dK1
  float acc0[8][4], acc1[8][4], run[8][4];
  zero_acc(run);
  float sdot = 0.f;

  // compute side: the item (w, its local index cn), and (gi, vt, stage, head) of the step computed next
  QkItem w = qk_item(p, blockIdx.x);
  int cit = blockIdx.x, cn = 0, cgi = 0, cvt = 0, cst = 0, chc = 0;
#pragma unroll 1
  for (int s = 0; s < total; ++s) {
    const int gi = cgi, vt = cvt, st = cst, hc = chc, hv = w.h * p.G + gi;
    cst = st == STAGES - 1 ? 0 : st + 1;
    if (++cvt == nvt) cvt = 0, ++cgi, ++chc;
    cp_async_wait<STAGES - 2>();  // step s has landed (one group per step after it)
    fence_async_smem();           // its tiles are read by wgmma next
    __syncthreads();              // ... for every thread; and every thread is done with step s - 1's stage
    if (vt == 0) sdot = 0.f;
    const unsigned char* b = smem + st * F::STAGE_BYTES;
    const unsigned char* VnTs = b;
    const unsigned char* hTs = b + ST;
    const unsigned char* dhTs = b + 2 * ST;
    const St* dOs = reinterpret_cast<const St*>(b + 3 * ST);
    const St* dVnTs = reinterpret_cast<const St*>(b + 3 * ST + PT);

    // this V tile's products, accumulated over the head's V tiles (the first one overwrites). Both warpgroups issue
    // the same products on operands chosen by warpgroup (a branch around them would serialize the products):
    // warpgroup 0: acc0 = dO Vn^T, acc1 = dO S^T;  warpgroup 1: acc0 = dVn S^T, acc1 = Vn dS'^T
    // B: d0 = hT (warpgroup 1) or Vn^T, d1 the tile after it (dhT or hT). The k16 steps add to the descriptors'
    // low words only (shared addresses stay below 256 KB: no carry into the high word, a constant).
    const uint32_t d0 = static_cast<uint32_t>(sw128_desc(VnTs + wg * ST, ST)), d1 = d0 + (ST >> 4);
    const uint64_t dhi = sw128_desc(VnTs, ST) & ~0xFFFFFFFFull;
    // A: loaded by warpgroup (only the loads branch, not the products)
    FragA<St> a0[4], a1[4];
    if (wg == 0) {
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) a0[kk] = a1[kk] = lda<St>(dOs, LDC, 16 * rg, 16 * kk);
    } else {
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        a0[kk] = lda_t<St>(dVnTs, LDC, 16 * rg, 16 * kk);
        a1[kk] = lda_t_sw128<St>(VnTs, 16 * rg, 16 * kk);
      }
    }
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      wgmma_rs<St, 1>(acc0, a0[kk], dhi | (d0 + kk * (2048 >> 4)), vt > 0 || kk > 0);
      wgmma_rs<St, 1>(acc1, a1[kk], dhi | (d1 + kk * (2048 >> 4)), vt > 0 || kk > 0);
    }
    wg_commit();
    // the copies of step s + STAGES - 1 while the products run (into the stage of step s - 1, which every thread is
    // done with: the barrier above)
    if (s + STAGES - 1 < total) issue_next();
    cp_async_commit();  // (an empty group past the last step keeps the count)
    // sum(hT o dhT) meanwhile: the two sw128 tiles share one layout, so equal byte offsets hold equal positions
    {
      const uint4* x = reinterpret_cast<const uint4*>(hTs) + 2 * tid;
      const uint4* y = reinterpret_cast<const uint4*>(dhTs) + 2 * tid;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const uint4 xv = x[j], yv = y[j];
        const uint32_t xs[4] = {xv.x, xv.y, xv.z, xv.w}, ys[4] = {yv.x, yv.y, yv.z, yv.w};
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          const float2 a = unpack2<St>(xs[t]), bb = unpack2<St>(ys[t]);
          sdot += a.x * bb.x + a.y * bb.y;
        }
      }
    }
    wg_wait<0>();
    wg_fence_acc(acc0);
    wg_fence_acc(acc1);
    if (vt + 1 < nvt) continue;

    // the head's last V tile is in: its element-wise terms (element [nt][e] at row i = 16 rg + g8 + 8 (e >> 1),
    // column 8 nt + 2q + (e & 1): j for dA, k in the block otherwise)
    const unsigned char* qs = smem + F::QK_OFF + (cn % NQK) * 2 * ST;
    const unsigned char* ksm = qs + ST;
    const St* As = Aslots + (hc % NA) * C * LDC;
    const float* gam = gslots + (hc % NA) * 64;
    const float gL = gam[C - 1];
    if (wg == 0) {
      float rA[2] = {0.f, 0.f}, cB[8][2];
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        cB[nt][0] = cB[nt][1] = 0.f;
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int i = 16 * rg + g8 + 8 * hr, col0 = 8 * nt + 2 * q;
          const float gi_ = gam[i];
          const float fq = p.scale * __expf(gi_);
          const float2 qv = sw128_get2<St>(qs, i, col0);
#pragma unroll
          for (int e1 = 0; e1 < 2; ++e1) {
            const int e = 2 * hr + e1, col = col0 + e1;
            const bool low = i >= col;
            const float dav = low ? p.scale * acc0[nt][e] : 0.f;
            const float E = low ? __expf(gi_ - gam[col]) : 0.f;
            if (w.kb == 0) {
              const float t = dav * to_f<St>(As[i * LDC + col]);
              rA[hr] += t;
              cB[nt][e1] += t;
            }
            acc0[nt][e] = dav * E;  // dA o E
            const float dqs = fq * acc1[nt][e];
            rA[hr] += (e1 ? qv.y : qv.x) * dqs;
            run[nt][e] += dqs;
          }
        }
      }
      store_frag_rows<St, 8>(dAEs + 16 * rg * LDC, LDC, acc0, g8, q);
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        rA[hr] += __shfl_xor_sync(0xffffffffu, rA[hr], 1);
        rA[hr] += __shfl_xor_sync(0xffffffffu, rA[hr], 2);
        if (q == 0) rowA[16 * rg + g8 + 8 * hr] = rA[hr];
      }
      if (w.kb == 0) {
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
          for (int e1 = 0; e1 < 2; ++e1) {
            float x = cB[nt][e1];
            x += __shfl_xor_sync(0xffffffffu, x, 4);
            x += __shfl_xor_sync(0xffffffffu, x, 8);
            x += __shfl_xor_sync(0xffffffffu, x, 16);
            if (g8 == 0) colB[rg * 64 + 8 * nt + 2 * q + e1] = x;
          }
      }
    } else {
      float rK[2] = {0.f, 0.f};
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int i = 16 * rg + g8 + 8 * hr;
          const float fk = __expf(gL - gam[i]);
          const float2 kv = sw128_get2<St>(ksm, i, 8 * nt + 2 * q);
#pragma unroll
          for (int e1 = 0; e1 < 2; ++e1) {
            const int e = 2 * hr + e1;
            const float dkt = fk * acc1[nt][e];
            rK[hr] += (e1 ? kv.y : kv.x) * dkt;
            run[nt][e] += dkt;
            acc0[nt][e] = -acc0[nt][e];  // dW = -dVn S^T
          }
        }
      store_frag_rows<St, 8>(static_cast<St*>(p.dhT) + ((w.chv0 + gi) * V + 16 * rg) * K + w.kb * 64, K, acc0, g8,
                             q);  // (dW lives in dhT's tile, params.h)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        rK[hr] += __shfl_xor_sync(0xffffffffu, rK[hr], 1);
        rK[hr] += __shfl_xor_sync(0xffffffffu, rK[hr], 2);
        if (q == 0) rowK[16 * rg + g8 + 8 * hr] = rK[hr];
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sdot += __shfl_xor_sync(0xffffffffu, sdot, o);
    if (lane == 0) sdots[warp] = sdot;
    __syncthreads();

    // dQ += (dA o E) K (warpgroup 0, dA o E from its accumulator) and dK1 += (dA o E)^T Q (warpgroup 1, from shared
    // memory), K and Q N-major; as above, one instruction stream for both
    {
      FragA<St> ea[4];
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const FragA<St> mine = frag_a_from_c<St>(acc0[2 * kk], acc0[2 * kk + 1]);
        const FragA<St> shared_t = lda_t<St>(dAEs, LDC, 16 * rg, 16 * kk);
        ea[kk] = wg ? shared_t : mine;
      }
      const uint64_t d2 = sw128_desc(wg ? qs : ksm, ST);
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) wgmma_rs<St, 1>(run, ea[kk], d2 + kk * (2048 >> 4), 1);
      wg_commit();
    }
    qk_dgam_rows<1>(p, w.kb, w.c, hv, gL, rowA, rowK, colB, sdots, tid);
    wg_wait<0>();
    wg_fence_acc(run);
    // (the next writes of dAEs and the sums come after the next step's barrier)
    if (gi + 1 < p.G) continue;

    // the item's last step: store dq (warpgroup 0: input dtype, or fp32 with grad_f32) and the first part of dk
    // (warpgroup 1: fp32), then move to the next item
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int i = 16 * rg + g8 + 8 * hr;
        if (i < w.ci.len) {
          const int64_t off = (w.ci.bos + i) * HK + w.h * K + w.kb * 64 + 8 * nt + 2 * q;
          if (wg == 0) st2_grad<St>(p.dq, off, run[nt][2 * hr], run[nt][2 * hr + 1], p.grad_f32);
          else st2<float>(p.dk1 + off, run[nt][2 * hr], run[nt][2 * hr + 1]);
        }
      }
    zero_acc(run);
    cgi = 0;
    ++cn;
    cit += gridDim.x;
    if (cn < nitems) w = qk_item(p, cit);
  }
}

// (a template, so that the kernel of the other branch is never named for this St)
template <class St>
void launch_grad_qk_t(const Params& p, void* stream) {
  auto go = [&](auto kern, size_t bytes, int ctas) {
    GD_CUDA_CHECK(set_max_smem(reinterpret_cast<const void*>(kern), bytes));
    kern<<<dim3(ctas), 256, bytes, static_cast<cudaStream_t>(stream)>>>(p);
    GD_CUDA_LAUNCH_CHECK();
  };
  const int items = qk_items(p);
  if constexpr (HasWgmma<St>::value) go(grad_qk_wg_kernel<St>, QkWgCfg<St>::bytes, std::min(items, p.sms));
  else go(grad_qk_kernel<St>, QkCfg<St>::bytes, items);
}

void launch_grad_qk(const Params& p, DType dtype, void* stream) {
  if (p.NC == 0) return;
  GD_DTYPE_SWITCH(dtype, St, [&] { launch_grad_qk_t<St>(p, stream); });
}

}  // namespace cuda
}  // namespace gated_delta
