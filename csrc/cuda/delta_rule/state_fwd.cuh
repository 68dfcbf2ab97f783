// The sequential forward kernel: one CTA per (work unit, 64-column tile of the state, value head) walks the chunks
// of its unit, carrying its K x 64 tile of the state in fp32 registers (held transposed, S^T, so that the
// accumulators are directly the A operand of the next products). Per chunk (C = 64 tokens):
//   Vn^T = U^T - S^T W^T                                     (corrected values of this tile)
//   O^T  = scale (S^T Q^T diag(e^gam) + Vn^T A^T)            (mode 0: the output, fused)
//   S^T <- e^{gam_L} S^T + (Vn^T diag(e^{gam_L - gam})) K
// On warpgroup products (FwdCfg::WG, modes 0 and 1) Vn^T is formed from V, K and Tm diag(beta) instead of U and W:
//   Vn^T = (V^T - (K S)^T diag(e^gam)) (Tm diag(beta))^T     (= U^T - S^T W^T, W = Tm diag(beta e^gam) K)
// Mode 1 stores the state entering each chunk (hT) and Vn^T instead of O (for the backward). Mode 2 computes the
// affine map of a unit of chunks (the scan): tiles of the first V columns start from 0 (giving B), tiles of the
// next K columns start from the identity with U = 0 (giving the linear part A).
// Warps: one per 16 columns of the tile; K = 256 (and K = 128 in the forward's 32-column tiles) splits K over two
// warps, whose partial products over K are summed through shared memory in a fixed order (in mode 0 each warp of
// the pair then finishes O^T for half of the chunk's tokens). The next chunk's tiles are prefetched with cp.async
// (2 stages where they fit). For 16-bit inputs with K <= 128 and 64-column tiles (FwdCfg::WG) the four warps are one
// warpgroup and the products are wgmma (wgmma.cuh), their B tiles loaded in the sw128 layout; otherwise mma.sync
// (mma.cuh). The warpgroup passes (modes 0 and 1) run two warpgroups per CTA where V has an even number of
// 64-column tiles: one per tile, sharing each chunk's K, Q, A and Tm diag(beta) tiles (read once per CTA). With
// Params::warm the CTA runs one segment of a sequence after a proven warm-up (warmup.cuh): the warm-up chunks store
// nothing.
// Mirrored kernel staging: the shared-memory stages, the cp.async prefetch of the next chunk and the walk over a
// unit's chunks are written out here and again in state_rev.cuh (which walks the chunks backwards), and the
// products over the same tiles repeat within each kernel, so that each pass's pipeline is tuned on its own.
#pragma once

#include "../dispatch.cuh"
#include "chunks.cuh"
#include "mma.cuh"
#include "tile_load.cuh"
#include "warmup.cuh"
#include "wgmma.cuh"

namespace gated_delta {
namespace cuda {

// WGS: state tiles (warpgroups) per CTA, side by side over V; two only for the warpgroup passes (modes 0 and 1).
template <class St, int K, int MODE, int TW, int KSP, int WGS = 1>
struct FwdCfg {
  static constexpr int NVR = TW / 16;  // warps over the rows of a state tile
  static constexpr int KS = (K == 256) ? 2 : KSP, KW = K / KS, NT = 32 * NVR * KS * WGS;
  static constexpr bool F32 = sizeof(St) == 4;
  static constexpr bool WITH_Q = MODE == 0;
  static constexpr bool Q_ALIAS = WITH_Q && F32 && K == 256;  // Q reuses W's buffer after Vn is formed
  // LDT: row stride of the V^T (U^T) and O^T staging tiles, which hold the CTA's WGS state tiles side by side
  static constexpr int PAD = PadOf<St>::value, LDK = K + PAD, LDC = C + PAD, LDT = TW * WGS + PAD;
  static constexpr int NKT = 2 + ((WITH_Q && !Q_ALIAS) ? 1 : 0);  // K-wide tiles per stage: W, K, [Q]
  // warpgroup products (wgmma.cuh): 16-bit inputs, K <= 128, one warpgroup per 64-column tile, modes 0 and 1.
  // These passes form W and U themselves (forms_wu in params.h), Vn = Tm diag(beta) (V - diag(e^gam) K S), from
  // the preparation's Tm diag(beta), K and V, so that W and U never go through memory. A stage holds K (and Q below
  // it, rows 64..127: one B operand for S^T [K | Q]^T; K is also the B operand of the state update), A and
  // Tm diag(beta) as sw128 tiles on 1024-byte boundaries, and V^T (in U^T's place), gam as below.
  static constexpr bool WG = HasWgmma<St>::value && K <= 128 && TW == 64 && KSP == 1 && MODE != 2;
  static_assert(WGS == 1 || WG, "two warpgroups per CTA: the warpgroup passes only");
  // two stages where they fit. The forward's warpgroup pass runs two state tiles per SM (wg_tiles_per_sm): as CTAs
  // of one warpgroup with one stage each (they overlap each other's loads and products), or as one CTA of two
  // warpgroups, which read each chunk's K, Q, A and Tm diag(beta) tiles once for both, with two stages; the
  // backward's (mode 1) keeps two stages either way
  static constexpr int STAGES = (WG && MODE == 0) ? WGS : (!F32 && K <= 128) ? 2 : 1;
  static constexpr int NKQ = WITH_Q ? 2 : 1;                 // row blocks of 64 in the K (| Q) tile
  static constexpr size_t KQ_BYTES = (size_t)K * NKQ * 128;  // K / 64 blocks of 64 NKQ rows of 128 bytes
  static constexpr size_t AT_BYTES = (MODE == 0) ? 8192 : 0, TB_BYTES = 8192;
  static constexpr size_t UT_BYTES = sizeof(St) * C * LDT;
  // gam, and on warpgroup products e^gam, e^{gam_L - gam} and the columns' beta factors after it (64 floats each)
  static constexpr size_t STAGE_BYTES =
      WG ? (KQ_BYTES + AT_BYTES + TB_BYTES + UT_BYTES + 4 * 256 + 1023) / 1024 * 1024
         : sizeof(St) * (size_t)(NKT * C * LDK + C * LDT + C * LDC) + 256;
  static constexpr size_t RED_BYTES = (KS == 2) ? sizeof(float) * (2 * NVR * 1024 + NVR * 1024) : 0;
  static constexpr size_t OS_BYTES = (MODE == 0) ? sizeof(St) * C * LDT : 0;
  static constexpr size_t X_BYTES = RED_BYTES > OS_BYTES ? RED_BYTES : OS_BYTES;  // Os aliases the reduction space
  static constexpr size_t ALIGN = WG ? 1024 : 0;  // room to move the stages onto a 1024-byte boundary
  static constexpr size_t bytes = STAGES * STAGE_BYTES + X_BYTES + ALIGN;
};

template <class St, int K, int MODE, int TW, int KSP, int WGS>
__global__ void __launch_bounds__(FwdCfg<St, K, MODE, TW, KSP, WGS>::NT, 1) state_fwd_kernel(const Params p) {
  using F = FwdCfg<St, K, MODE, TW, KSP, WGS>;
  constexpr int KS = F::KS, KW = F::KW, NT = F::NT, LDK = F::LDK, LDC = F::LDC, LDT = F::LDT, NVR = F::NVR;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + (F::WG ? (1024 - (smem_u32(smem_raw) & 1023)) & 1023 : 0);
  unsigned char* xbuf = smem + F::STAGES * F::STAGE_BYTES;
  float* red = reinterpret_cast<float*>(xbuf);
  St* Os = reinterpret_cast<St*>(xbuf);

  // the CTA's state tiles vt0 .. vt0 + WGS - 1; this warp's tile vt, at column cw of the staging tiles
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g8 = lane >> 2, q = lane & 3;
  const int wg = warp / (NVR * KS), vr = warp % NVR, ks = (warp / NVR) % KS, cw = wg * TW;
  const int u = pass_unit(p), vt0 = blockIdx.y * WGS, vt = vt0 + wg, hv = blockIdx.z, h = hv / p.G;
  const Unit un = get_unit(p, u);
  Run run;
  if (!plan_run<false>(p, u, un, hv, vt0, run)) return;
  const bool homog = (MODE == 2) && (vt * TW >= p.V);
  const int64_t HK = static_cast<int64_t>(p.H) * K;

  auto stage_ptr = [&](int b, St*& Ws, St*& Ks, St*& Qs, St*& Us, St*& As, St*& Ts, float*& gs) {
    unsigned char* base = smem + b * F::STAGE_BYTES;
    if constexpr (F::WG) {
      Ws = nullptr;
      Ks = Qs = reinterpret_cast<St*>(base);  // (Q: rows 64.. of the K tile's blocks)
      As = reinterpret_cast<St*>(base + F::KQ_BYTES);
      Ts = reinterpret_cast<St*>(base + F::KQ_BYTES + F::AT_BYTES);
      Us = reinterpret_cast<St*>(base + F::KQ_BYTES + F::AT_BYTES + F::TB_BYTES);
      gs = reinterpret_cast<float*>(base + F::KQ_BYTES + F::AT_BYTES + F::TB_BYTES + F::UT_BYTES);
      return;
    }
    Ts = nullptr;
    Ws = reinterpret_cast<St*>(base);
    Ks = Ws + C * LDK;
    Qs = F::Q_ALIAS ? Ws : Ks + C * LDK;
    Us = Ks + (F::NKT - 1) * C * LDK;
    As = Us + C * LDT;
    gs = reinterpret_cast<float*>(As + C * LDC);
  };
  // (fold_beta) the bits of this thread's token's beta in the chunk last issued (0 past its length), loaded with
  // its stage and converted at their use, a chunk later, so that no dtype branch waits for the load (tid < C)
  uint32_t bpre = 0;
  auto issue = [&](int c, int b) {
    St *Ws, *Ks, *Qs, *Us, *As, *Ts;
    float* gs;
    stage_ptr(b, Ws, Ks, Qs, Us, As, Ts, gs);
    const ChunkInfo ci = chunk_info(p, c, un.n);
    const int64_t chv = static_cast<int64_t>(c) * p.HV + hv;
    if constexpr (F::WG) {
      constexpr int RT = 64 * F::NKQ;
      auto* kb = reinterpret_cast<unsigned char*>(Ks);
      load_tile_sw128<St, C, K, RT, NT>(kb, 0, static_cast<const St*>(p.k) + ci.bos * HK + h * K, HK, ci.len, tid);
      if constexpr (F::WITH_Q)
        load_tile_sw128<St, C, K, RT, NT>(kb, 64, static_cast<const St*>(p.q) + ci.bos * HK + h * K, HK, ci.len, tid);
      load_tile_sw128<St, C, C, C, NT>(reinterpret_cast<unsigned char*>(Ts), 0,
                                       static_cast<const St*>(p.fold_beta ? p.Tm : p.TmB) + chv * C * C, C, C, tid);
      load_tile<St, C, TW * WGS, NT>(Us, LDT, static_cast<const St*>(p.v) + ci.bos * p.tok_v + hv * p.ld_v + vt0 * TW,
                                     p.tok_v, ci.len, tid);
      if constexpr (MODE == 0)
        load_tile_sw128<St, C, C, C, NT>(reinterpret_cast<unsigned char*>(As), 0,
                                         static_cast<const St*>(p.A) + chv * C * C, C, C, tid);
      if (tid < 16) cp_async16(gs + 4 * tid, p.gam + chv * C + 4 * tid, true);
      if (p.fold_beta && tid < C) bpre = chunk_beta_bits(p, ci, hv, tid);
      return;
    }
    load_tile<St, C, K, NT>(Ws, LDK, static_cast<const St*>(p.W) + chv * C * K, K, C, tid);
    load_tile<St, C, K, NT>(Ks, LDK, static_cast<const St*>(p.k) + ci.bos * HK + h * K, HK, ci.len, tid);
    if constexpr (F::WITH_Q && !F::Q_ALIAS)
      load_tile<St, C, K, NT>(Qs, LDK, static_cast<const St*>(p.q) + ci.bos * HK + h * K, HK, ci.len, tid);
    if (!homog)
      load_tile<St, C, TW, NT>(Us, LDT, static_cast<const St*>(p.U) + chv * C * p.V + vt * TW, p.V, C, tid);
    if constexpr (MODE == 0) load_tile<St, C, C, NT>(As, LDC, static_cast<const St*>(p.A) + chv * C * C, C, C, tid);
    if (tid < 16) cp_async16(gs + 4 * tid, p.gam + chv * C + 4 * tid, true);
  };

  // the state tile: S[nt][e] = S^T[v][k], v = vr*16 + g8 + 8*(e>>1) (in the tile), k = ks*KW + 8*nt + 2q + (e&1)
  float S[KW / 8][4];
  if (run.zero) zero_acc(S);
  else load_state_tile<K, KW, TW>(p, S, MODE == 2, homog, u, un.n, hv, vt, vr, ks, g8, q);

  // O's rows [0, len) from the staging tile Os to og (row stride tok_o), 16 bytes per lane
  auto copy_o = [&](St* og, int len) {
    constexpr int EPV = 16 / sizeof(St), VPR = TW * WGS / EPV;
    for (int idx = tid; idx < C * VPR; idx += NT) {
      const int r = idx / VPR, cv = idx % VPR;
      if (r < len)
        *reinterpret_cast<int4*>(og + static_cast<int64_t>(r) * p.tok_o + cv * EPV) =
            *reinterpret_cast<const int4*>(Os + r * LDT + cv * EPV);
    }
  };
  // (forward on warpgroup products) the last chunk's output, staged in Os and copied out during the next chunk's
  // products: its destination and rows (0: none pending)
  constexpr bool DEFER_O = F::WG && MODE == 0;
  St* pend_og = nullptr;
  int pend_len = 0;

#pragma unroll 1
  for (int c = run.rb; c < run.re; ++c) {
    const int it = c - run.rb;
    const int buf = (F::STAGES == 2) ? (it & 1) : 0;
    if constexpr (F::STAGES == 2) {
      if (it == 0) { issue(c, 0); cp_async_commit(); }
      if constexpr (F::WG) {
        cp_async_wait<0>();  // (chunk c + 1's loads are issued once this chunk's first products are under way)
      } else {
        if (c + 1 < run.re) { issue(c + 1, buf ^ 1); cp_async_commit(); cp_async_wait<1>(); } else { cp_async_wait<0>(); }
      }
    } else {
      issue(c, 0);
      cp_async_commit();
      cp_async_wait<0>();
    }
    const uint32_t bcur = bpre;  // (this chunk's; the next issue overwrites bpre)
    if constexpr (F::WG) fence_async_smem();  // the tiles are read by wgmma next
    __syncthreads();
    St *Ws, *Ks, *Qs, *Us, *As, *Ts;
    float* gs;
    stage_ptr(buf, Ws, Ks, Qs, Us, As, Ts, gs);
    float* eg = gs + C;         // (warpgroup products) e^gam
    float* egl = gs + 2 * C;    // e^{gam_L - gam}
    float* bs = gs + 3 * C;     // beta of the chunk's tokens with fold_beta (0 past its length), else 1
    const ChunkInfo ci = chunk_info(p, c, un.n);
    const int64_t chv = static_cast<int64_t>(c) * p.HV + hv;
    const int64_t row0 = chv * p.V + vt * TW + vr * 16;  // (mode 1) this warp's first row of hT / Vn^T
    auto store_ht = [&] { store_frag_rows<St, KW / 8>(static_cast<St*>(p.hT) + row0 * K + ks * KW, K, S, g8, q); };

    // S^T W^T (and S^T Q^T) over this warp's half of K
    float acc[2][8][4];
    float(&acc_vn)[8][4] = acc[0];
    float(&acc_o)[8][4] = acc[1];
    if constexpr (F::WG) {
      // S^T K^T here; (mode 0) S^T Q^T, which only the output needs, goes out behind Vn's product below, so that the
      // products of the chain S^T K^T -> Vn -> S are not queued behind it. Meanwhile e^gam and e^{gam_L - gam} of
      // the chunk go to shared memory, once per CTA instead of once per thread and use.
      FragA<St> sa[K / 16];
#pragma unroll
      for (int kk = 0; kk < K / 16; ++kk) sa[kk] = frag_a_from_c<St>(S[2 * kk], S[2 * kk + 1]);
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < K / 16; ++kk)
        wgmma_rs<St, 0>(acc_vn, sa[kk], sw128_desc(Ks + (kk >> 2) * 64 * F::NKQ * 64 + (kk & 3) * 16, 16), kk > 0);
      wg_commit();
      // the next chunk's tiles into the other stage (free since this chunk's opening barrier, which every thread
      // reached with the last chunk's products complete): issued here, the copies' address work overlaps the products
      // instead of delaying them
      if constexpr (F::STAGES == 2) {
        if (c + 1 < run.re) {
          issue(c + 1, buf ^ 1);
          cp_async_commit();
        }
      }
      if constexpr (MODE == 1) {
        if (c >= run.ob) store_ht();  // (S^T itself is not an operand: the products read its converted copy)
      }
      if constexpr (DEFER_O) {
        // also while the products run: the last chunk's output, staged in Os before the barrier that opened this
        // chunk (Os is written again after the barrier below)
        if (pend_len > 0) copy_o(pend_og, pend_len);
        pend_len = 0;
      }
      if (tid < C) {
        eg[tid] = __expf(gs[tid]);
        egl[tid] = __expf(gs[C - 1] - gs[tid]);
        bs[tid] = p.fold_beta ? bits_as_float(bcur, p.beta_dtype) : 1.f;
      }
      __syncthreads();
      wg_wait<0>();
      wg_fence_acc(acc_vn);
    } else {
      zero_acc(acc_vn);
      zero_acc(acc_o);
#pragma unroll
      for (int kk = 0; kk < KW / 16; ++kk) {
        const FragA<St> a = frag_a_from_c<St>(S[2 * kk], S[2 * kk + 1]);
#pragma unroll
        for (int np = 0; np < 4; ++np) {
          FragB<St> b[2];
          ldb<St>(b, Ws, LDK, 16 * np, ks * KW + 16 * kk);
          mma<St>(acc_vn[2 * np], a, b[0]);
          mma<St>(acc_vn[2 * np + 1], a, b[1]);
          if constexpr (F::WITH_Q && !F::Q_ALIAS) {
            ldb<St>(b, Qs, LDK, 16 * np, ks * KW + 16 * kk);
            mma<St>(acc_o[2 * np], a, b[0]);
            mma<St>(acc_o[2 * np + 1], a, b[1]);
          }
        }
      }
      if constexpr (F::Q_ALIAS) {
        __syncthreads();
        load_tile<St, C, K, NT>(Qs, LDK, static_cast<const St*>(p.q) + ci.bos * HK + h * K, HK, ci.len, tid);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < KW / 16; ++kk) {
          const FragA<St> a = frag_a_from_c<St>(S[2 * kk], S[2 * kk + 1]);
#pragma unroll
          for (int np = 0; np < 4; ++np) {
            FragB<St> b[2];
            ldb<St>(b, Qs, LDK, 16 * np, ks * KW + 16 * kk);
            mma<St>(acc_o[2 * np], a, b[0]);
            mma<St>(acc_o[2 * np + 1], a, b[1]);
          }
        }
      }
      if constexpr (KS == 2) {
        // the partial products over K are summed through shared memory; in mode 0 each warp of a pair then
        // finishes half of the chunk's tokens of O^T (warp ks: n-tiles 4 ks .. 4 ks + 3), so it hands the other
        // half of its partial S^T Q^T to its partner
        float* mine = red + (ks * NVR + vr) * 1024 + lane;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) mine[(nt * 4 + e) * 32] = acc_vn[nt][e];
        if constexpr (MODE == 0) {
          float* give = red + 2 * NVR * 1024 + (ks * NVR + vr) * 512 + lane;
#pragma unroll
          for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) give[(j * 4 + e) * 32] = ks ? acc_o[j][e] : acc_o[j + 4][e];
        }
        __syncthreads();
        const float* p0 = red + vr * 1024 + lane;
        const float* p1 = red + (NVR + vr) * 1024 + lane;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc_vn[nt][e] = p0[(nt * 4 + e) * 32] + p1[(nt * 4 + e) * 32];
        if constexpr (MODE == 0) {
          // this warp's half, moved to n-tiles 0..3 (the partner's part added in a fixed order: ks 0 + ks 1)
          const float* take = red + 2 * NVR * 1024 + ((1 - ks) * NVR + vr) * 512 + lane;
#pragma unroll
          for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const float other = take[(j * 4 + e) * 32];
              acc_o[j][e] = ks ? other + acc_o[j + 4][e] : acc_o[j][e] + other;
            }
        }
        __syncthreads();
      }
    }

    // Vn^T = U^T - S^T W^T
    float vn[8][4];
    auto store_vnt = [&] { store_frag_rows<St, 8>(static_cast<St*>(p.VnT) + row0 * C, C, vn, g8, q); };
    if constexpr (F::WG) {
      // X^T = V^T - (K S)^T diag(e^gam) (V^T by ldmatrix.trans, as U^T below), then Vn^T = X^T (Tm diag(beta))^T;
      // with fold_beta X^T's token columns take beta before X^T's rounding, and Ts holds Tm
      FragA<St> xa[4];
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const FragA<St> va = lda_t<St>(Us, LDT, cw + vr * 16, 16 * kk);
        float x[2][4];
#pragma unroll
        for (int t = 0; t < 2; ++t) {
          const int nt = 2 * kk + t, j0 = 8 * nt + 2 * q;
          const float e0 = eg[j0], e1 = eg[j0 + 1], b0 = bs[j0], b1 = bs[j0 + 1];
          const float2 v0 = unpack2<St>(va.x[2 * t]), v1 = unpack2<St>(va.x[2 * t + 1]);
          x[t][0] = (v0.x - acc_vn[nt][0] * e0) * b0;
          x[t][1] = (v0.y - acc_vn[nt][1] * e1) * b1;
          x[t][2] = (v1.x - acc_vn[nt][2] * e0) * b0;
          x[t][3] = (v1.y - acc_vn[nt][3] * e1) * b1;
        }
        xa[kk] = frag_a_from_c<St>(x[0], x[1]);
      }
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) wgmma_rs<St, 0>(vn, xa[kk], sw128_desc(Ts + 16 * kk, 16), kk > 0);
      wg_commit();
      if constexpr (F::WITH_Q) {  // S^T Q^T (S unchanged until the update below; its fragments converted again)
        FragA<St> sq[K / 16];
#pragma unroll
        for (int kk = 0; kk < K / 16; ++kk) sq[kk] = frag_a_from_c<St>(S[2 * kk], S[2 * kk + 1]);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < K / 16; ++kk)
          wgmma_rs<St, 0>(acc_o, sq[kk], sw128_desc(Ks + (kk >> 2) * 128 * 64 + 64 * 64 + (kk & 3) * 16, 16),
                          kk > 0);
        wg_commit();
      }
      wg_wait<F::WITH_Q ? 1 : 0>();  // Vn's product (S^T Q^T may still run)
      wg_fence_acc(vn);
    } else if constexpr (sizeof(St) == 2) {
      // U^T by ldmatrix.trans: the A-fragment registers of a 16 x 16 block are the C fragments of two n-tiles
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        float2 u[4] = {};
        if (!homog) {
          const FragA<St> ua = lda_t<St>(Us, LDT, cw + vr * 16, 16 * kk);
#pragma unroll
          for (int i = 0; i < 4; ++i) u[i] = unpack2<St>(ua.x[i]);
        }
#pragma unroll
        for (int t = 0; t < 2; ++t) {
          vn[2 * kk + t][0] = u[2 * t].x - acc_vn[2 * kk + t][0];
          vn[2 * kk + t][1] = u[2 * t].y - acc_vn[2 * kk + t][1];
          vn[2 * kk + t][2] = u[2 * t + 1].x - acc_vn[2 * kk + t][2];
          vn[2 * kk + t][3] = u[2 * t + 1].y - acc_vn[2 * kk + t][3];
        }
      }
    } else {
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int j = 8 * nt + 2 * q + (e & 1), vloc = vr * 16 + g8 + 8 * (e >> 1);
          const float uu = homog ? 0.f : to_f<St>(Us[j * LDT + cw + vloc]);
          vn[nt][e] = uu - acc_vn[nt][e];
        }
    }

    if (!F::WG && MODE == 1 && c >= run.ob) {  // (on warpgroup products: while the products run, above and below)
      store_ht();
      if (ks == 0) store_vnt();
    }

    // O^T of this warp's tokens t0 .. t0 + 8 NO - 1 (all 64 unless K is split over a warp pair); warm-up chunks
    // skip the output
    const bool out = MODE == 0 && c >= run.ob;
    constexpr int NO = (KS == 2) ? 4 : 8;
    const int t0 = (KS == 2) ? 32 * ks : 0;
    St* const og = MODE == 0 ? static_cast<St*>(p.o) + ci.bos * p.tok_o + hv * p.ld_o + vt0 * TW : nullptr;
    auto stage_o = [&] {  // through shared memory, to leave 16 bytes per lane
#pragma unroll
      for (int nt = 0; nt < NO; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = t0 + 8 * nt + 2 * q + (e & 1), vloc = vr * 16 + g8 + 8 * (e >> 1);
          Os[i * LDT + cw + vloc] = from_f<St>(acc_o[nt][e]);
        }
    };
    auto scale_o = [&] {  // the S^T Q^T part by scale e^gam
#pragma unroll
      for (int nt = 0; nt < NO; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int j = t0 + 8 * nt + 2 * q + (e & 1);
          acc_o[nt][e] *= p.scale * (F::WG ? eg[j] : __expf(gs[j]));
        }
    };
    if constexpr (!F::WG) {
      if (out) {
        scale_o();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          const FragA<St> a = frag_a_from_c<St>(vn[2 * kk], vn[2 * kk + 1], p.scale);
#pragma unroll
          for (int np = 0; np < NO / 2; ++np) {
            FragB<St> b[2];
            ldb<St>(b, As, LDC, t0 + 16 * np, 16 * kk);
            mma<St>(acc_o[2 * np], a, b[0]);
            mma<St>(acc_o[2 * np + 1], a, b[1]);
          }
        }
        stage_o();
        __syncthreads();
        copy_o(og, ci.len);
      }
    }

    // S^T <- e^{gam_L} S^T + (Vn^T diag(e^{gam_L - gam})) K
    const float gl = gs[C - 1];
    const float dl = __expf(gl);
#pragma unroll
    for (int nt = 0; nt < KW / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) S[nt][e] *= dl;
    auto kfrag = [&](int kk) {  // tokens 16 kk .. 16 kk + 15 of Vn^T diag(e^{gam_L - gam})
      const int j0 = 16 * kk + 2 * q;
      auto f = [&](int j) { return F::WG ? egl[j] : __expf(gl - gs[j]); };
      const float fk[4] = {f(j0), f(j0 + 1), f(j0 + 8), f(j0 + 9)};
      return frag_a_from_c_cols<St>(vn[2 * kk], vn[2 * kk + 1], fk);
    };
    if constexpr (F::WG) {
      // S^T += (Vn^T diag(e^{gam_L - gam})) K (K N-major), then the output's part (scale Vn^T) A^T (A K-major)
      // into a fresh accumulator (accumulating into acc_o, a slice of the first product's accumulator, would
      // serialize the products)
      FragA<St> ka[4];
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) ka[kk] = kfrag(kk);
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) wgmma_rs<St, 1>(S, ka[kk], sw128_desc(Ks + 16 * kk * 64, F::KQ_BYTES / (K / 64)), 1);
      wg_commit();
      if constexpr (MODE == 1) {
        if (c >= run.ob) store_vnt();
      }
      float o2[8][4];
      if constexpr (MODE == 0) {  // (warm-up chunks too: no branch between the fence and the products)
        FragA<St> va[4];
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) va[kk] = frag_a_from_c<St>(vn[2 * kk], vn[2 * kk + 1], p.scale);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) wgmma_rs<St, 0>(o2, va[kk], sw128_desc(As + 16 * kk, 16), kk > 0);
        wg_commit();
        wg_wait<1>();  // S^T Q^T and the state update are in; the scaling runs while (scale Vn^T) A^T does
        wg_fence_acc(acc_o);
        if (out) scale_o();
      }
      wg_wait<0>();
      wg_fence_acc(S);
      if constexpr (MODE == 0) {
        wg_fence_acc(o2);
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc_o[nt][e] += o2[nt][e];
        if (out) {  // copied out during the next chunk (or after the last one), past the barriers between
          stage_o();
          pend_og = og;
          pend_len = ci.len;
        }
      }
    } else {
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const FragA<St> a = kfrag(kk);
#pragma unroll
        for (int np = 0; np < KW / 16; ++np) {
          FragB<St> b[2];
          ldb_t<St>(b, Ks, LDK, 16 * kk, ks * KW + 16 * np);
          mma<St>(S[2 * np], a, b[0]);
          mma<St>(S[2 * np + 1], a, b[1]);
        }
      }
    }
    // The chunk's closing barrier: the next chunk's loads must not overwrite a stage that a thread still reads. The
    // warpgroup passes with two stages issue those loads after the next chunk's opening barrier, which every thread
    // reaches only once its products of this chunk are complete, and Os and e^gam are ordered by the barriers
    // inside the chunk: they need no closing barrier.
    if constexpr (!(F::WG && F::STAGES == 2)) __syncthreads();
  }

  if constexpr (DEFER_O) {
    if (pend_len > 0) {  // (staged during the last chunk)
      if constexpr (F::STAGES == 2) __syncthreads();
      copy_o(pend_og, pend_len);
    }
  }
  if (run.fin) store_state_tile<K, KW, TW>(p, S, MODE == 2, u, un.n, hv, vt, vr, ks, g8, q);
}

template <class St>
void launch_state_fwd_t(const Params& p, int mode, void* stream) {
  {
    GD_HEADK_SWITCH(p.K, KC, [&] {
      auto go = [&](auto mode_c, auto tw_c, auto ks_c, auto wgs_c) {
        constexpr int M = decltype(mode_c)::value, TW = decltype(tw_c)::value, KSP = decltype(ks_c)::value;
        constexpr int WGS = decltype(wgs_c)::value;
        using F = FwdCfg<St, KC, M, TW, KSP, WGS>;
        auto kern = state_fwd_kernel<St, KC, M, TW, KSP, WGS>;
        if constexpr (M != 2)
          TORCH_CHECK(F::WG == (p.fold_beta ? p.Tm != nullptr : p.TmB != nullptr),
                      "gated_delta CUDA: the forward state pass ",
                      F::WG ? "forms W and U and needs" : "reads W and U and takes no", " Tm diag(beta) (or Tm)");
        GD_CUDA_CHECK(set_max_smem(reinterpret_cast<const void*>(kern), F::bytes));
        const int tiles = (M == 2) ? (p.V + KC) / TW : p.V / TW;
        kern<<<dim3(pass_grid_units(p), tiles / WGS, p.HV), F::NT, F::bytes, static_cast<cudaStream_t>(stream)>>>(p);
        GD_CUDA_LAUNCH_CHECK();
      };
      using I0 = std::integral_constant<int, 0>;
      using I1 = std::integral_constant<int, 1>;
      using I2 = std::integral_constant<int, 2>;
      using T32 = std::integral_constant<int, 32>;
      using T64 = std::integral_constant<int, 64>;
      if (mode == 2) go(I2(), T64(), I1(), I1());  // the scan's maps: enough CTAs already
      else if (mode == 1) {
        if (p.tile32) return go(I1(), T32(), I1(), I1());
        // warpgroup products: two state tiles per CTA where V holds an even number of them (wg_tiles_per_sm)
        if constexpr (FwdCfg<St, KC, 1, 64, 1>::WG) {
          if ((p.V / 64) % 2 == 0) return go(I1(), T64(), I1(), I2());
        }
        go(I1(), T64(), I1(), I1());
      } else {
        // few CTAs (K = 128): 32-column tiles with K split over two warps (4 warps per CTA), the fastest measured
        // (benchmarks/RESULTS.md, "CUDA design measurements")
        if constexpr (KC == 128) {
          if (p.tile32) return go(I0(), T32(), I2(), I1());
        }
        // warpgroup products: two state tiles per CTA where V holds an even number of them
        if constexpr (FwdCfg<St, KC, 0, 64, 1>::WG) {
          if ((p.V / 64) % 2 == 0) return go(I0(), T64(), I1(), I2());
        }
        go(I0(), T64(), I1(), I1());
      }
    });
  }
}

}  // namespace cuda
}  // namespace gated_delta
