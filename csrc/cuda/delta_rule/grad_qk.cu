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
    store_col_sums(cB, colB + rg * 64 + 32 * chf, g8, q);
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
    // sum(hT o dhT) meanwhile (the two sw128 tiles share one layout), 32 bytes of each per thread
    sdot = dot_chunks<St, 2>(hTs, dhTs, 2 * tid, sdot);
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
        rA[hr] = quad_sum(rA[hr]);
        if (q == 0) rowA[16 * rg + g8 + 8 * hr] = rA[hr];
      }
      if (w.kb == 0) store_col_sums(cB, colB + rg * 64, g8, q);
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

// ---------------------------------------------------------------------------------------------------------------
// 16-bit inputs with K = 128: one work item per (chunk, q/k head) holding both 64-column blocks of K, in a CTA of
// three warpgroups with roles of their own (register budgets by setmaxnreg), walked by persistent CTAs (at most one
// per SM) as one pipeline of (item, value head, V tile) steps, two stages of tiles:
//   warpgroup 0: dA = dO Vn^T and dW = -dVn S^T (64 x 128: all of K), accumulated over the head's V tiles; at the
//     head's end dA's terms (dA o E into shared memory for the other two, the A part of gam's gradient) and dW's
//     store into dhT's tile (params.h). It also copies each item's q and k and each head's A and gam.
//   warpgroups 1 and 2, block kb = wg - 1 of K: dO S_kb^T and Vn dS'_kb^T; at the head's end the q and k terms,
//     then dQ_kb += (dA o E) K_kb and dK1_kb += (dA o E)^T Q_kb, and the block's partial gradient of gam; at the
//     item's end the stores of dq and dk1. They copy every step's tiles (dO, Vn^T, dVn^T, hT, dhT).
// Every product takes both operands from shared memory (sw128 tiles, wgmma_ss_t): no warpgroup loads fragments. dA
// and its terms are formed once per (chunk, value head) and dO, Vn^T, dVn^T and A are read once, where one CTA per
// block of K formed and read them once per block. The results are those of grad_qk_wg_kernel (dq, dk1, dW, the same
// products in the same order), except the partial gradients of gam, whose row sums are added in another order.
template <class St>
struct QkWg3Cfg {
  static constexpr int NT = 384;
  static constexpr int NA = 2, NQK = 2;  // slots of a head's A and gam, of an item's q and k (one step ahead)
  static constexpr int ST = C * 128;     // bytes of a sw128 64 x 64 tile
  // a stage: hT and dhT (two 64-column blocks each: all of K), Vn^T, dVn^T, dO; all sw128, on 1024-byte boundaries
  static constexpr int HT = 0, DHT = 2 * ST, VN = 4 * ST, DVN = 5 * ST, DO = 6 * ST, STAGE_BYTES = 7 * ST;
  static constexpr int QK_OFF = 2 * STAGE_BYTES;        // [NQK] (q: two blocks, k: two blocks)
  static constexpr int A_OFF = QK_OFF + NQK * 4 * ST;   // [NA] A tiles
  static constexpr int DAE_OFF = A_OFF + NA * ST;       // dA o E
  static constexpr int QR_OFF = DAE_OFF + ST;           // the caller's q rows (Params::dq_l2norm): two blocks
  static constexpr int F_OFF = QR_OFF + 2 * ST;         // floats, below
  // gam slots [NA][64], rowA [64], colB [4][64] (warpgroup 0); rowQ, rowK [2][64], sdot [2][4], and the L2 norm's
  // row sums rowN [2][64][2] (warpgroups 1, 2)
  static constexpr int NF = NA * 64 + 64 + 256 + 2 * 64 + 2 * 64 + 8 + 256;
  static constexpr size_t bytes = F_OFF + sizeof(float) * NF + 1024;
  static_assert(bytes <= 227 * 1024, "shared memory of one CTA");
};
// named barriers (0 is __syncthreads): a step's tiles are in (every thread); dA o E and warpgroup 0's sums are in
// (warpgroup 0 arrives, 1 and 2 wait); warpgroup 1's and 2's own
// (3 and 4), and the two together (dq's L2 norm: its rows' sums over both blocks of K)
constexpr int kQkBarStep = 1, kQkBarDae = 2, kQkBarOwn = 3, kQkBarPair = 5;
// Registers per thread (168 per thread for 384 threads at launch: 152 + 2 x 176 = 3 x 168). Warpgroup 0 holds dA
// (32) and dW (64); warpgroups 1 and 2 the two step accumulators and dQ_kb, dK1_kb (4 x 32) and the copies' sources.
constexpr int kQkRegs0 = 152, kQkRegs12 = 176;
static_assert(kQkRegs0 + 2 * kQkRegs12 == 3 * 168, "the CTA's registers");

__host__ __device__ inline int qk3_items(const Params& p) { return p.NC * p.H; }
// work item it of grad_qk_wg3_kernel: chunk it % NC of q/k head it / NC (chv0: c HV + the group's first value head)
struct Qk3Item {
  int c, h;
  ChunkInfo ci;
  int64_t chv0;
};
__device__ __forceinline__ Qk3Item qk3_item(const Params& p, int it) {
  Qk3Item r;
  r.c = it % p.NC;
  r.h = it / p.NC;
  r.ci = chunk_info(p, r.c);
  r.chv0 = static_cast<int64_t>(r.c) * p.HV + static_cast<int64_t>(r.h) * p.G;
  return r;
}
// a step opens once its tiles are in: this thread's copies done and visible to wgmma, then every thread's
__device__ __forceinline__ void qk3_open_step() {
  cp_async_wait<0>();
  fence_async_smem();
  bar_sync(kQkBarStep, 384);
}

template <class St>
__global__ void __launch_bounds__(384, 1) grad_qk_wg3_kernel(const Params p) {
  using F = QkWg3Cfg<St>;
  constexpr int ST = F::ST, NA = F::NA, NQK = F::NQK, K = 128;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  float* gslots = reinterpret_cast<float*>(smem + F::F_OFF);  // [NA][64]
  float* rowA = gslots + NA * 64;                              // [64]
  float* colB = rowA + 64;                                     // [4][64]
  float* rowQ = colB + 256;                                    // [2][64]
  float* rowK = rowQ + 128;                                    // [2][64]
  float* sdots = rowK + 128;                                   // [2][4]
  float* rowN = sdots + 8;                                     // [2][64][2]

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g8 = lane >> 2, q = lane & 3;
  const int wg = warp >> 2, rg = warp & 3, lt = tid & 127;
  const int V = p.V, G = p.G, NC = p.NC;
  const int64_t HK = static_cast<int64_t>(p.H) * K;
  const int nvt = V / 64;
  const int step = static_cast<int>(gridDim.x);
  const int nitems = (qk3_items(p) - 1 - static_cast<int>(blockIdx.x)) / step + 1;
  const int total = nitems * G * nvt;
  // A walk over the CTA's steps: item it (its local index n), value head gi, V tile vt, head count hc. Step s's tiles
  // are in stage s % 2.
  struct Walk {
    int it, n, gi, vt, hc;
  };
  auto advance = [&](Walk& w) {
    if (++w.vt == nvt) {
      w.vt = 0;
      ++w.hc;
      if (++w.gi == G) w.gi = 0, w.it += step, ++w.n;
    }
  };
  Walk iw{static_cast<int>(blockIdx.x), 0, 0, 0, 0};  // the step whose copies are issued next
  Walk cw = iw;                                          // the step computed next
  const uint32_t sbase = smem_u32(smem);

  if (wg == 0) {
    // ---------------- dA, dW and dA's terms ----------------
    setmaxnreg_dec<kQkRegs0>();
    // copies: an item's q and k (rows past the chunk zero-filled), a head's A and gam
    auto issue = [&]() {
      if (iw.vt == 0) {
        const Qk3Item x = qk3_item(p, iw.it);
        if (iw.gi == 0) {
          unsigned char* qk = smem + F::QK_OFF + (iw.n % NQK) * 4 * ST;
          const int64_t qoff = x.ci.bos * HK + x.h * K;
          load_tile_sw128<St, C, K, C, 128>(qk, 0, static_cast<const St*>(p.q) + qoff, HK, x.ci.len, lt);
          load_tile_sw128<St, C, K, C, 128>(qk + 2 * ST, 0, static_cast<const St*>(p.k) + qoff, HK, x.ci.len, lt);
        }
        const int64_t chv = x.chv0 + iw.gi;
        const int slot = iw.hc % NA;
        load_tile_sw128<St, C, C, C, 128, false>(smem + F::A_OFF + slot * ST, 0,
                                                 static_cast<const St*>(p.A) + chv * C * C, C, C, lt);
        if (lt < 16) cp_async16(gslots + slot * 64 + 4 * lt, p.gam + chv * C + 4 * lt, true);
      }
      advance(iw);
    };
    issue();
    cp_async_commit();

    float dA[8][4], dW[16][4];
    int64_t chv0 = qk3_item(p, cw.it).chv0;
#pragma unroll 1
    for (int s = 0; s < total; ++s) {
      const Walk w = cw;
      advance(cw);
      qk3_open_step();
      const unsigned char* b = smem + (s & 1) * F::STAGE_BYTES;
      // dA += dO Vn^T (dO K-major, Vn^T N-major); dW -= dVn S^T (dVn^T's tile M-major, hT N-major, N = 128)
      {
        const uint64_t ddo = sw128_desc(b + F::DO, 16), dvn = sw128_desc(b + F::VN, ST);  // (K-major: no LBO)
        const uint64_t ddvn = sw128_desc(b + F::DVN, ST), dht = sw128_desc(b + F::HT, ST);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
          wgmma_ss_t<St, 0, 1, 8>(dA, ddo + 2 * kk, dvn + 128 * kk, w.vt > 0 || kk > 0);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
          wgmma_ss_t<St, 1, 1, 16, true>(dW, ddvn + 128 * kk, dht + 128 * kk, w.vt > 0 || kk > 0);
        wg_commit();
      }
      if (s + 1 < total) issue();
      cp_async_commit();  // (an empty group past the last step keeps the count)
      wg_wait<0>();
      wg_fence_acc(dA);
      wg_fence_acc(dW);
      if (w.vt + 1 < nvt) continue;

      // the head's last V tile is in: dW into dhT's tile (params.h) first, so that its registers are free for dA's
      // terms (element [nt][e] at row i = 16 rg + g8 + 8 (e >> 1), column j = 8 nt + 2q + (e & 1))
      store_frag_rows<St, 16>(static_cast<St*>(p.dhT) + ((chv0 + w.gi) * V + 16 * rg) * K, K, dW, g8, q);
      const float* gam = gslots + (w.hc % NA) * 64;
      const unsigned char* As = smem + F::A_OFF + (w.hc % NA) * ST;
      unsigned char* dAEs = smem + F::DAE_OFF;
      // Addresses from few registers: row i = i0 + 8 hr; the pair (j, j + 1), j = 8 nt + 2q, sits at byte
      // (pb ^ (nt << 4)) + 1024 hr of a sw128 tile (its chunk nt ^ (i & 7), i & 7 = g8), and i >= j + e1 is
      // i - 2q >= 8 nt + e1, a compare with a constant
      const int i0 = 16 * rg + g8, d0 = i0 - 2 * q;
      const int pb = i0 * 128 + (g8 << 4) + 4 * q;
      const float* gq = gam + 2 * q;
      const float gi[2] = {gam[i0], gam[i0 + 8]};
      float rA[2] = {0.f, 0.f}, cB[8][2];
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        cB[nt][0] = cB[nt][1] = 0.f;
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int off = (pb ^ (nt << 4)) + 1024 * hr;
          const float2 av = sw128_get2<St>(As, off);
          float x[2];
#pragma unroll
          for (int e1 = 0; e1 < 2; ++e1) {
            const int e = 2 * hr + e1;
            const bool low = d0 + 8 * hr >= 8 * nt + e1;
            const float dav = low ? p.scale * dA[nt][e] : 0.f;
            const float E = low ? __expf(gi[hr] - gq[8 * nt + e1]) : 0.f;
            const float t = dav * (e1 ? av.y : av.x);
            rA[hr] += t;
            cB[nt][e1] += t;
            x[e1] = dav * E;  // dA o E
          }
          uint32_t pk;
          Pack<St>::put(&pk, &pk, 0, x[0], x[1]);
          *reinterpret_cast<uint32_t*>(dAEs + off) = pk;
        }
      }
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        rA[hr] = quad_sum(rA[hr]);
        if (q == 0) rowA[16 * rg + g8 + 8 * hr] = rA[hr];
      }
      store_col_sums(cB, colB + rg * 64, g8, q);
      fence_async_smem();  // dA o E is read by wgmma
      bar_arrive(kQkBarDae, 384);
      if (w.gi + 1 == G && w.n + 1 < nitems) chv0 = qk3_item(p, cw.it).chv0;
    }
    return;
  }

  // ---------------- warpgroups 1 and 2: block kb of K ----------------
  setmaxnreg_inc<kQkRegs12>();
  const int kb = wg - 1;
  // copies of a step's tiles: thread t = tid - 128 copies rows r0 and r0 + 32 (r0 = t / 8) of the 16-byte column cv =
  // t % 8 of each 64 x 64 tile (hT and dhT: two each), so its shared offsets are the same in every tile and its
  // sources are set at an item's first step and advance by constants (a step's tiles follow the previous step's a
  // V tile further, across the heads of the group). dO's rows past the chunk are zero-filled.
  const int t = tid - 128, r0 = t >> 3, cv = t & 7;
  const uint32_t s_sw = sbase + r0 * 128 + ((cv ^ (r0 & 7)) << 4);  // (row r0 + 32: 4096 bytes on, same swizzle)
  const St *vn = nullptr, *dvn = nullptr, *ht = nullptr, *dht = nullptr, *dO = nullptr;  // (dO: its row r0)
  int do_len = 0;  // the item's chunk length: dO's rows r0 and r0 + 32 are copied below it
  auto issue = [&](int stage) {
    if (iw.gi == 0 && iw.vt == 0) {
      const Qk3Item x = qk3_item(p, iw.it);
      vn = static_cast<const St*>(p.VnT) + x.chv0 * V * C + 8 * t;  // (row r0 of C: r0 C + 8 cv = 8 t)
      dvn = static_cast<const St*>(p.dVnT) + x.chv0 * V * C + 8 * t;
      ht = static_cast<const St*>(p.hT) + x.chv0 * V * K + r0 * K + 8 * cv;
      dht = static_cast<const St*>(p.dhT) + x.chv0 * V * K + r0 * K + 8 * cv;
      do_len = x.ci.len;
      dO = static_cast<const St*>(p.d_o) + (x.ci.bos + r0) * p.tok_do + static_cast<int64_t>(x.h) * G * p.ld_do + 8 * cv;
    }
    const uint32_t sw = s_sw + stage * F::STAGE_BYTES;
#pragma unroll
    for (int bk = 0; bk < 2; ++bk) {
      cp_async16(sw + F::HT + bk * ST, ht + 64 * bk, true);
      cp_async16(sw + F::HT + bk * ST + 4096, ht + 32 * K + 64 * bk, true);
      cp_async16(sw + F::DHT + bk * ST, dht + 64 * bk, true);
      cp_async16(sw + F::DHT + bk * ST + 4096, dht + 32 * K + 64 * bk, true);
    }
    cp_async16(sw + F::VN, vn, true);
    cp_async16(sw + F::VN + 4096, vn + 32 * C, true);
    cp_async16(sw + F::DVN, dvn, true);
    cp_async16(sw + F::DVN + 4096, dvn + 32 * C, true);
    {  // (a row past the chunk is zero-filled, its source address then a valid one: row r0's, or dO's first)
      const bool ok0 = r0 < do_len, ok1 = r0 + 32 < do_len;
      cp_async16(sw + F::DO, ok0 ? dO : static_cast<const St*>(p.d_o), ok0);
      cp_async16(sw + F::DO + 4096, ok1 ? dO + 32 * p.tok_do : dO, ok1);
    }
    vn += 64 * C;
    dvn += 64 * C;
    ht += 64 * K;
    dht += 64 * K;
    dO += 64;
    if (iw.vt + 1 == nvt) dO += p.ld_do - V;  // the next value head's row (from this one's end)
    advance(iw);
  };
  issue(0);
  cp_async_commit();

  float a1[8][4], a2[8][4], rq[8][4], rk[8][4];  // dO S_kb^T, Vn dS'_kb^T; dQ_kb, dK1_kb
  zero_acc(rq);
  zero_acc(rk);
  float sdot = 0.f;
  Qk3Item cur = qk3_item(p, cw.it);  // the item computed
#pragma unroll 1
  for (int s = 0; s < total; ++s) {
    const Walk w = cw;
    advance(cw);
    qk3_open_step();
    if (w.vt == 0) sdot = 0.f;
    const unsigned char* b = smem + (s & 1) * F::STAGE_BYTES;
    const unsigned char* hTs = b + F::HT + kb * ST;
    const unsigned char* dhTs = b + F::DHT + kb * ST;
    // a1 += dO S_kb^T (dO K-major, hT's block N-major); a2 += Vn dS'_kb^T (Vn^T's tile M-major, dhT's block N-major)
    {
      const uint64_t ddo = sw128_desc(b + F::DO, 16), dh = sw128_desc(hTs, ST);
      const uint64_t dvn = sw128_desc(b + F::VN, ST), ddh = sw128_desc(dhTs, ST);
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) wgmma_ss_t<St, 0, 1, 8>(a1, ddo + 2 * kk, dh + 128 * kk, w.vt > 0 || kk > 0);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) wgmma_ss_t<St, 1, 1, 8>(a2, dvn + 128 * kk, ddh + 128 * kk, w.vt > 0 || kk > 0);
      wg_commit();
    }
    if (s + 1 < total) issue((s + 1) & 1);
    cp_async_commit();
    // sum(hT o dhT) over the block meanwhile (the two sw128 tiles share one layout), 64 bytes of each per thread
    sdot = dot_chunks<St, 4>(hTs, dhTs, 4 * lt, sdot);
    wg_wait<0>();
    wg_fence_acc(a1);
    wg_fence_acc(a2);
    if (w.vt + 1 < nvt) continue;

    // the head's last V tile is in: the q and k terms of the block
    const unsigned char* qs = smem + F::QK_OFF + (w.n % NQK) * 4 * ST + kb * ST;
    const unsigned char* ks = qs + 2 * ST;
    const float* gam = gslots + (w.hc % NA) * 64;
    const float gL = gam[C - 1];
    {
      float rQ[2] = {0.f, 0.f}, rK[2] = {0.f, 0.f};
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int i = 16 * rg + g8 + 8 * hr, col0 = 8 * nt + 2 * q;
          const float gi_ = gam[i];
          const float fq = p.scale * __expf(gi_), fk = __expf(gL - gi_);
          const float2 qv = sw128_get2<St>(qs, i, col0), kv = sw128_get2<St>(ks, i, col0);
#pragma unroll
          for (int e1 = 0; e1 < 2; ++e1) {
            const int e = 2 * hr + e1;
            const float dqs = fq * a1[nt][e];
            rQ[hr] += (e1 ? qv.y : qv.x) * dqs;
            rq[nt][e] += dqs;
            const float dkt = fk * a2[nt][e];
            rK[hr] += (e1 ? kv.y : kv.x) * dkt;
            rk[nt][e] += dkt;
          }
        }
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        rQ[hr] = quad_sum(rQ[hr]);
        rK[hr] = quad_sum(rK[hr]);
        if (q == 0) {
          rowQ[kb * 64 + 16 * rg + g8 + 8 * hr] = rQ[hr];
          rowK[kb * 64 + 16 * rg + g8 + 8 * hr] = rK[hr];
        }
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) sdot += __shfl_xor_sync(0xffffffffu, sdot, o);
      if (lane == 0) sdots[kb * 4 + rg] = sdot;
    }
    // With Params::dq_l2norm, at the item's last head: the block's columns of the caller's q rows (rows past the
    // chunk zero-filled) into shared memory, copied beside the products below
    if (p.dq_l2norm && w.gi + 1 == G) {
      load_tile_sw128<St, C, C, C, 128>(smem + F::QR_OFF + kb * ST, 0,
                                        static_cast<const St*>(p.q_raw) + cur.ci.bos * p.tok_qr +
                                            static_cast<int64_t>(cur.h) * p.ld_qr + kb * 64,
                                        p.tok_qr, cur.ci.len, lt);
      cp_async_commit();
    }
    // dQ_kb += (dA o E) K_kb (K-major A), dK1_kb += (dA o E)^T Q_kb (the same tile M-major); K and Q N-major
    bar_sync(kQkBarDae, 384);
    {
      const uint64_t daek = sw128_desc(smem + F::DAE_OFF, 16), daem = sw128_desc(smem + F::DAE_OFF, ST);
      const uint64_t dk = sw128_desc(ks, ST), dq = sw128_desc(qs, ST);
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) wgmma_ss_t<St, 0, 1, 8>(rq, daek + 2 * kk, dk + 128 * kk, 1);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) wgmma_ss_t<St, 1, 1, 8>(rk, daem + 128 * kk, dq + 128 * kk, 1);
      wg_commit();
    }
    // the block's partial gradient of gam, by the warpgroup's first 64 threads (row lt): the q and k terms' row
    // sums, for block 0 the A term's row sums less its column sums (warpgroup 0's), and on the last row the state
    // terms: e^{gam_L} sum(hT o dhT) (the four warps' sums) and the sum of the k terms
    bar_sync(kQkBarOwn + kb, 128);
    if (lt < 64) {
      const int i = lt;
      float v = rowQ[kb * 64 + i] - rowK[kb * 64 + i];
      if (kb == 0) v += rowA[i] - ((colB[i] + colB[64 + i]) + (colB[128 + i] + colB[192 + i]));
      if (lt >= 32) {  // (the warpgroup's warp 1: rows 32..63)
        float kd = rowK[kb * 64 + lane] + rowK[kb * 64 + 32 + lane];
        float sd = lane < 4 ? sdots[kb * 4 + lane] : 0.f;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
          kd += __shfl_xor_sync(0xffffffffu, kd, o);
          sd += __shfl_xor_sync(0xffffffffu, sd, o);
        }
        if (i == C - 1) v += __expf(gL) * sd + kd;
      }
      p.dgam1[((static_cast<int64_t>(kb) * NC + cur.c) * p.HV + cur.h * G + w.gi) * C + i] = v;
    }
    wg_wait<0>();
    wg_fence_acc(rq);
    wg_fence_acc(rk);
    if (w.gi + 1 < G) continue;

    // the item's last step. With Params::dq_l2norm the L2 norm's chain rule (l2norm_chain_2blocks) turns dq (of the
    // normalised q) into the gradient of the caller's q, whose rows the warpgroup copied into QR_OFF
    if (p.dq_l2norm) {
      cp_async_wait<0>();  // the q rows (and the next step's tiles, issued before them)
      bar_sync(kQkBarOwn + kb, 128);  // ... every thread's copies of the block
      float2 xq[2][8];
#pragma unroll
      for (int hr = 0; hr < 2; ++hr)
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
          xq[hr][nt] = sw128_get2<St>(smem + F::QR_OFF + kb * ST, 16 * rg + g8 + 8 * hr, 8 * nt + 2 * q);
      l2norm_chain_2blocks(rq, xq, kb, rg, g8, q, rowN, kQkBarPair, p.l2norm_eps);
    }
    // dq (input dtype; fp32 with grad_f32, unless the chain rule above applied) and the first part of dk (fp32),
    // valid rows
    const bool dq_f32 = p.grad_f32 && !p.dq_l2norm;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int i = 16 * rg + g8 + 8 * hr;
        if (i < cur.ci.len) {
          const int64_t off = (cur.ci.bos + i) * HK + static_cast<int64_t>(cur.h) * K + kb * 64 + 8 * nt + 2 * q;
          st2_grad<St>(p.dq, off, rq[nt][2 * hr], rq[nt][2 * hr + 1], dq_f32);
          st2<float>(p.dk1 + off, rk[nt][2 * hr], rk[nt][2 * hr + 1]);
        }
      }
    zero_acc(rq);
    zero_acc(rk);
    if (w.n + 1 < nitems) cur = qk3_item(p, cw.it);
  }
}

// (a template, so that the kernel of the other branch is never named for this St)
template <class St>
void launch_grad_qk_t(const Params& p, bool whole_rows, void* stream) {
  auto go = [&](auto kern, size_t bytes, int ctas, int threads) {
    GD_CUDA_CHECK(set_max_smem(reinterpret_cast<const void*>(kern), bytes));
    kern<<<dim3(ctas), threads, bytes, static_cast<cudaStream_t>(stream)>>>(p);
    GD_CUDA_LAUNCH_CHECK();
  };
  const int items = qk_items(p);
  if constexpr (HasWgmma<St>::value) {
    if (whole_rows) {
      go(grad_qk_wg3_kernel<St>, QkWg3Cfg<St>::bytes, std::min(qk3_items(p), p.sms), QkWg3Cfg<St>::NT);
    } else {
      TORCH_CHECK(!p.dq_l2norm, "gated_delta CUDA: dq's L2-norm chain rule needs grad_qk's rows whole (K = 128)");
      go(grad_qk_wg_kernel<St>, QkWgCfg<St>::bytes, std::min(items, p.sms), 256);
    }
  } else {
    TORCH_CHECK(!p.dq_l2norm, "gated_delta CUDA: dq's L2-norm chain rule needs grad_qk's rows whole (16-bit inputs)");
    go(grad_qk_kernel<St>, QkCfg<St>::bytes, items, 256);
  }
}

bool grad_qk_whole_rows(DType dtype, int K) { return dtype != DType::kFloat && K == 128; }

void launch_grad_qk(const Params& p, DType dtype, void* stream) {
  if (p.NC == 0) return;
  const bool whole_rows = grad_qk_whole_rows(dtype, p.K);
  GD_DTYPE_SWITCH(dtype, St, [&] { launch_grad_qk_t<St>(p, whole_rows, stream); });
}

}  // namespace cuda
}  // namespace gated_delta
