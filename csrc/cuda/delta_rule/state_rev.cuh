// The sequential reverse kernel of the backward: one CTA per (work unit, 64-column tile, value head) walks the
// chunks of its unit backwards carrying dS'^T (the gradient of the state leaving the chunk, transposed) in fp32
// registers. Per chunk:
//   dVn^T = scale dO^T A + diag-scaled (dS'^T K^T) with columns times e^{gam_L - gam_j}
//   dS^T  = e^{gam_L} dS'^T + dO^T diag(scale e^gam) Q - dVn^T W          (becomes dS' of the previous chunk)
// Mode 0 stores dhT (= dS'^T of each chunk) and dVn^T; mode 1 computes a unit's reverse map (tiles of the first V
// columns from 0 give b, tiles of the next K columns from the identity with dO = 0 give the linear part).
// With Params::warm the CTA runs one segment of a sequence after a proven warm-up (warmup.cuh): the warm-up
// chunks, after the segment's end, store nothing.
// Mode 0 with 16-bit inputs, K <= 128 and 64-column tiles (RevCfg::WG) runs its products as wgmma (wgmma.cuh), as the
// forward pass does, and forms dVn^T W as ((dVn^T Tm diag(beta)) diag(e^gam)) K from the preparation's
// Tm diag(beta) instead of reading W (forms_wu in params.h); where V has an even number of 64-column tiles it runs
// two warpgroups per CTA, one per tile, sharing each chunk's K, Q, A and Tm diag(beta) tiles. Mirrored kernel
// staging: the stages, prefetch and chunk walk mirror state_fwd.cuh's (see there).
#pragma once

#include "../dispatch.cuh"
#include "chunks.cuh"
#include "mma.cuh"
#include "tile_load.cuh"
#include "warmup.cuh"
#include "wgmma.cuh"

namespace gated_delta {
namespace cuda {

// WGS: state tiles (warpgroups) per CTA, side by side over V; two only for the warpgroup pass (mode 0, RevCfg::WG).
template <class St, int K, int TW, int MODE, int WGS = 1>
struct RevCfg {
  static constexpr int NVR = TW / 16;  // warps over the rows of a state tile
  static constexpr int KS = (K == 256) ? 2 : 1, KW = K / KS, NT = 32 * NVR * KS * WGS;
  static constexpr bool F32 = sizeof(St) == 4;
  static constexpr int STAGES = (!F32 && K <= 128) ? 2 : 1;
  static constexpr bool Q_ALIAS = F32 && K == 256;  // Q reuses W's buffer after the W product
  // LDT: row stride of the dO tile, which holds the CTA's WGS state tiles' columns side by side
  static constexpr int PAD = PadOf<St>::value, LDK = K + PAD, LDC = C + PAD, LDT = TW * WGS + PAD;
  static constexpr int NKT = Q_ALIAS ? 2 : 3;  // W, K, [Q]
  // warpgroup products (wgmma.cuh): 16-bit inputs, K <= 128, one warpgroup per 64-column tile, mode 0. A stage
  // then holds K, Q, A and Tm diag(beta) (Tm itself with fold_beta) as sw128 tiles on 1024-byte boundaries, and dO,
  // gam as below.
  static constexpr bool WG = HasWgmma<St>::value && K <= 128 && TW == 64 && MODE == 0;
  // two warpgroups per CTA (one per tile) read each chunk's K, Q, A and Tm diag(beta) (or Tm) once for both tiles
  static_assert(WGS == 1 || WG, "two warpgroups per CTA: the warpgroup pass only");
  static constexpr size_t KT_BYTES = (size_t)K * 128, AT_BYTES = 8192, DT_BYTES = sizeof(St) * C * LDT;
  // gam, and on warpgroup products e^gam, e^{gam_L - gam} and the columns' beta factors after it (64 floats each)
  static constexpr size_t STAGE_BYTES = WG ? (2 * KT_BYTES + 2 * AT_BYTES + DT_BYTES + 4 * 256 + 1023) / 1024 * 1024
                                           : sizeof(St) * (size_t)(NKT * C * LDK + C * LDC + C * LDT) + 256;
  static constexpr size_t RED_BYTES = (KS == 2) ? sizeof(float) * (2 * NVR * 1024) : 0;
  static constexpr size_t ALIGN = WG ? 1024 : 0;  // room to move the stages onto a 1024-byte boundary
  static constexpr size_t bytes = STAGES * STAGE_BYTES + RED_BYTES + ALIGN;
};

template <class St, int K, int MODE, int TW, int WGS>
__global__ void __launch_bounds__(RevCfg<St, K, TW, MODE, WGS>::NT, 1) state_rev_kernel(const Params p) {
  using F = RevCfg<St, K, TW, MODE, WGS>;
  constexpr int KS = F::KS, KW = F::KW, NT = F::NT, LDK = F::LDK, LDC = F::LDC, LDT = F::LDT, NVR = F::NVR;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + (F::WG ? (1024 - (smem_u32(smem_raw) & 1023)) & 1023 : 0);
  float* red = reinterpret_cast<float*>(smem + F::STAGES * F::STAGE_BYTES);

  // the CTA's state tiles vt0 .. vt0 + WGS - 1; this warp's tile vt, at column cw of the dO tile
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g8 = lane >> 2, q = lane & 3;
  const int wg = warp / (NVR * KS), vr = warp % NVR, ks = (warp / NVR) % KS, cw = wg * TW;
  const int u = pass_unit(p), vt0 = blockIdx.y * WGS, vt = vt0 + wg, hv = blockIdx.z, h = hv / p.G;
  const Unit un = get_unit(p, u);
  Run run;
  if (!plan_run<true>(p, u, un, hv, vt0, run)) return;
  const bool homog = (MODE == 1) && (vt * TW >= p.V);
  const int64_t HK = static_cast<int64_t>(p.H) * K;

  auto stage_ptr = [&](int b, St*& Ws, St*& Ks, St*& Qs, St*& As, St*& Ts, St*& Ds, float*& gs) {
    unsigned char* base = smem + b * F::STAGE_BYTES;
    if constexpr (F::WG) {
      Ws = nullptr;
      Ks = reinterpret_cast<St*>(base);
      Qs = reinterpret_cast<St*>(base + F::KT_BYTES);
      As = reinterpret_cast<St*>(base + 2 * F::KT_BYTES);
      Ts = reinterpret_cast<St*>(base + 2 * F::KT_BYTES + F::AT_BYTES);
      Ds = reinterpret_cast<St*>(base + 2 * F::KT_BYTES + 2 * F::AT_BYTES);
      gs = reinterpret_cast<float*>(base + 2 * F::KT_BYTES + 2 * F::AT_BYTES + F::DT_BYTES);
      return;
    }
    Ts = nullptr;
    Ws = reinterpret_cast<St*>(base);
    Ks = Ws + C * LDK;
    Qs = F::Q_ALIAS ? Ws : Ks + C * LDK;
    As = Ks + (F::NKT - 1) * C * LDK;
    Ds = As + C * LDC;
    gs = reinterpret_cast<float*>(Ds + C * LDT);
  };
  // (fold_beta) the bits of this thread's token's beta in the chunk last issued (0 past its length), loaded with
  // its stage and converted at their use, a chunk later, so that no dtype branch waits for the load (tid < C)
  uint32_t bpre = 0;
  auto issue = [&](int c, int b) {
    St *Ws, *Ks, *Qs, *As, *Ts, *Ds;
    float* gs;
    stage_ptr(b, Ws, Ks, Qs, As, Ts, Ds, gs);
    const ChunkInfo ci = chunk_info(p, c, un.n);
    const int64_t chv = static_cast<int64_t>(c) * p.HV + hv;
    if constexpr (F::WG) {
      auto sw = [](St* t) { return reinterpret_cast<unsigned char*>(t); };
      load_tile_sw128<St, C, K, C, NT>(sw(Ks), 0, static_cast<const St*>(p.k) + ci.bos * HK + h * K, HK, ci.len, tid);
      load_tile_sw128<St, C, K, C, NT>(sw(Qs), 0, static_cast<const St*>(p.q) + ci.bos * HK + h * K, HK, ci.len, tid);
      load_tile_sw128<St, C, C, C, NT>(sw(As), 0, static_cast<const St*>(p.A) + chv * C * C, C, C, tid);
      load_tile_sw128<St, C, C, C, NT>(sw(Ts), 0, static_cast<const St*>(p.fold_beta ? p.Tm : p.TmB) + chv * C * C,
                                       C, C, tid);
      load_tile<St, C, TW * WGS, NT>(Ds, LDT,
                                     static_cast<const St*>(p.d_o) + ci.bos * p.tok_do + hv * p.ld_do + vt0 * TW,
                                     p.tok_do, ci.len, tid);
      if (tid < 16) cp_async16(gs + 4 * tid, p.gam + chv * C + 4 * tid, true);
      if (p.fold_beta && tid < C) bpre = chunk_beta_bits(p, ci, hv, tid);
      return;
    }
    load_tile<St, C, K, NT>(Ws, LDK, static_cast<const St*>(p.W) + chv * C * K, K, C, tid);
    load_tile<St, C, K, NT>(Ks, LDK, static_cast<const St*>(p.k) + ci.bos * HK + h * K, HK, ci.len, tid);
    if (!homog) {
      if constexpr (!F::Q_ALIAS)
        load_tile<St, C, K, NT>(Qs, LDK, static_cast<const St*>(p.q) + ci.bos * HK + h * K, HK, ci.len, tid);
      load_tile<St, C, C, NT>(As, LDC, static_cast<const St*>(p.A) + chv * C * C, C, C, tid);
      load_tile<St, C, TW, NT>(Ds, LDT, static_cast<const St*>(p.d_o) + ci.bos * p.tok_do + hv * p.ld_do + vt * TW,
                              p.tok_do, ci.len, tid);
    }
    if (tid < 16) cp_async16(gs + 4 * tid, p.gam + chv * C + 4 * tid, true);
  };

  // dS[nt][e] = dS'^T[v][k], v = vr*16 + g8 + 8*(e>>1) (in the tile), k = ks*KW + 8*nt + 2q + (e&1)
  float dS[KW / 8][4];
  if (run.zero) zero_acc(dS);
  else load_state_tile<K, KW, TW>(p, dS, MODE == 1, homog, u, un.n, hv, vt, vr, ks, g8, q);

#pragma unroll 1
  for (int c = run.re - 1; c >= run.rb; --c) {
    const int it = run.re - 1 - c;
    const bool out = c < run.oe;  // (warm-up chunks store nothing)
    const int buf = (F::STAGES == 2) ? (it & 1) : 0;
    if constexpr (F::STAGES == 2) {
      if (it == 0) { issue(c, 0); cp_async_commit(); }
      if constexpr (F::WG) {
        cp_async_wait<0>();  // (chunk c - 1's loads are issued once this chunk's first products are under way)
      } else {
        if (c - 1 >= run.rb) { issue(c - 1, buf ^ 1); cp_async_commit(); cp_async_wait<1>(); } else { cp_async_wait<0>(); }
      }
    } else {
      issue(c, 0);
      cp_async_commit();
      cp_async_wait<0>();
    }
    const uint32_t bcur = bpre;  // (this chunk's; the next issue overwrites bpre)
    if constexpr (F::WG) fence_async_smem();  // the tiles are read by wgmma next
    __syncthreads();
    St *Ws, *Ks, *Qs, *As, *Ts, *Ds;
    float* gs;
    stage_ptr(buf, Ws, Ks, Qs, As, Ts, Ds, gs);
    float* eg = gs + C;       // (warpgroup products) e^gam
    float* egl = gs + 2 * C;  // e^{gam_L - gam}
    float* bs = gs + 3 * C;   // beta of the chunk's tokens with fold_beta (0 past its length), else 1
    const int64_t chv = static_cast<int64_t>(c) * p.HV + hv;

    const int64_t row0 = chv * p.V + vt * TW + vr * 16;  // this warp's first row of dhT / dVn^T
    auto store_dht = [&] { store_frag_rows<St, KW / 8>(static_cast<St*>(p.dhT) + row0 * K + ks * KW, K, dS, g8, q); };
    // (on warpgroup products the stores go out while the products run, below)
    if (!F::WG && MODE == 0 && out) store_dht();

    // dS'^T K^T over this warp's half of K, and dO^T A
    float acc1[8][4], acc2[8][4];
    if constexpr (F::WG) {  // one group: K K-major, A N-major; dO^T by ldmatrix.trans
      FragA<St> sa[K / 16], da[4];
#pragma unroll
      for (int kk = 0; kk < K / 16; ++kk) sa[kk] = frag_a_from_c<St>(dS[2 * kk], dS[2 * kk + 1]);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) da[kk] = lda_t<St>(Ds, LDT, cw + vr * 16, 16 * kk);
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < K / 16; ++kk)
        wgmma_rs<St, 0>(acc2, sa[kk], sw128_desc(Ks + (kk >> 2) * 64 * 64 + (kk & 3) * 16, 16), kk > 0);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) wgmma_rs<St, 1>(acc1, da[kk], sw128_desc(As + 16 * kk * 64, 8192), kk > 0);
      wg_commit();
      // the next chunk's tiles into the other stage (free since this chunk's opening barrier, which every thread
      // reached with the last chunk's products complete), their address work overlapping the products
      if constexpr (F::STAGES == 2) {
        if (c - 1 >= run.rb) {
          issue(c - 1, buf ^ 1);
          cp_async_commit();
        }
      }
      if (out) store_dht();  // (dS'^T itself is not an operand: the products read its converted copy)
      // meanwhile e^gam and e^{gam_L - gam} of the chunk to shared memory, once per CTA instead of per thread and use
      if (tid < C) {
        eg[tid] = __expf(gs[tid]);
        egl[tid] = __expf(gs[C - 1] - gs[tid]);
        bs[tid] = p.fold_beta ? bits_as_float(bcur, p.beta_dtype) : 1.f;
      }
      __syncthreads();
      wg_wait<0>();
      wg_fence_acc(acc1);
      wg_fence_acc(acc2);
    } else {
      zero_acc(acc2);
#pragma unroll
      for (int kk = 0; kk < KW / 16; ++kk) {
        const FragA<St> a = frag_a_from_c<St>(dS[2 * kk], dS[2 * kk + 1]);
#pragma unroll
        for (int np = 0; np < 4; ++np) {
          FragB<St> b[2];
          ldb<St>(b, Ks, LDK, 16 * np, ks * KW + 16 * kk);
          mma<St>(acc2[2 * np], a, b[0]);
          mma<St>(acc2[2 * np + 1], a, b[1]);
        }
      }
      if constexpr (KS == 2) {
        float* mine = red + (ks * NVR + vr) * 1024 + lane;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) mine[(nt * 4 + e) * 32] = acc2[nt][e];
        __syncthreads();
        const float* p0 = red + vr * 1024 + lane;
        const float* p1 = red + (NVR + vr) * 1024 + lane;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc2[nt][e] = p0[(nt * 4 + e) * 32] + p1[(nt * 4 + e) * 32];
        __syncthreads();
      }
      // dO^T A (every warp computes its rows in full: cheap, and keeps the halves identical)
      zero_acc(acc1);
      if (!homog) {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          const FragA<St> a = lda_t<St>(Ds, LDT, vr * 16, 16 * kk);
#pragma unroll
          for (int np = 0; np < 4; ++np) {
            FragB<St> b[2];
            ldb_t<St>(b, As, LDC, 16 * kk, 16 * np);
            mma<St>(acc1[2 * np], a, b[0]);
            mma<St>(acc1[2 * np + 1], a, b[1]);
          }
        }
      }
    }
    const float gl = gs[C - 1];
    float dvn[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = 8 * nt + 2 * q + (e & 1);
        dvn[nt][e] = p.scale * acc1[nt][e] + (F::WG ? egl[j] : __expf(gl - gs[j])) * acc2[nt][e];
      }
    auto store_dvn = [&] { store_frag_rows<St, 8>(static_cast<St*>(p.dVnT) + row0 * C, C, dvn, g8, q); };
    if (!F::WG && MODE == 0 && ks == 0 && out) store_dvn();

    // dS^T <- e^{gam_L} dS'^T - dVn^T W + dO^T diag(scale e^gam) Q
    const float dl = __expf(gl);
#pragma unroll
    for (int nt = 0; nt < KW / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) dS[nt][e] *= dl;
    if constexpr (F::WG) {
      // dVn^T W = (Y diag(e^gam)) K with Y = dVn^T Tm diag(beta): Y's group first, then the Q part of dS (in flight
      // while Y is scaled), then the W part; Tm diag(beta), Q and K N-major
      FragA<St> ya[4], qa[4];
      float y[8][4];
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        ya[kk] = frag_a_from_c<St>(dvn[2 * kk], dvn[2 * kk + 1]);
        const int j0 = 16 * kk + 2 * q;
        qa[kk] = lda_t_cols<St>(Ds, LDT, cw + vr * 16, 16 * kk, p.scale * eg[j0], p.scale * eg[j0 + 1],
                                p.scale * eg[j0 + 8], p.scale * eg[j0 + 9]);
      }
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) wgmma_rs<St, 1>(y, ya[kk], sw128_desc(Ts + 16 * kk * 64, 8192), kk > 0);
      wg_commit();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) wgmma_rs<St, 1>(dS, qa[kk], sw128_desc(Qs + 16 * kk * 64, 64 * 128), 1);
      wg_commit();
      if (out) store_dvn();
      wg_wait<1>();
      wg_fence_acc(y);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const int j0 = 16 * kk + 2 * q;
        // (with fold_beta Ts holds Tm: the columns of y = dVn^T Tm take diag(beta) here, before y's rounding)
        const float fk[4] = {-eg[j0] * bs[j0], -eg[j0 + 1] * bs[j0 + 1], -eg[j0 + 8] * bs[j0 + 8],
                             -eg[j0 + 9] * bs[j0 + 9]};
        ya[kk] = frag_a_from_c_cols<St>(y[2 * kk], y[2 * kk + 1], fk);
      }
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) wgmma_rs<St, 1>(dS, ya[kk], sw128_desc(Ks + 16 * kk * 64, 64 * 128), 1);
      wg_commit();
      wg_wait<0>();
      wg_fence_acc(dS);
    } else {
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const FragA<St> a = frag_a_from_c<St>(dvn[2 * kk], dvn[2 * kk + 1], -1.f);
#pragma unroll
        for (int np = 0; np < KW / 16; ++np) {
          FragB<St> b[2];
          ldb_t<St>(b, Ws, LDK, 16 * kk, ks * KW + 16 * np);
          mma<St>(dS[2 * np], a, b[0]);
          mma<St>(dS[2 * np + 1], a, b[1]);
        }
      }
      if (!homog) {
        if constexpr (F::Q_ALIAS) {
          const ChunkInfo ci = chunk_info(p, c, un.n);
          __syncthreads();
          load_tile<St, C, K, NT>(Qs, LDK, static_cast<const St*>(p.q) + ci.bos * HK + h * K, HK, ci.len, tid);
          cp_async_commit();
          cp_async_wait<0>();
          __syncthreads();
        }
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          const FragA<St> a = lda_t_scaled<St>(Ds, LDT, vr * 16, 16 * kk, gs, p.scale);
#pragma unroll
          for (int np = 0; np < KW / 16; ++np) {
            FragB<St> b[2];
            ldb_t<St>(b, Qs, LDK, 16 * kk, ks * KW + 16 * np);
            mma<St>(dS[2 * np], a, b[0]);
            mma<St>(dS[2 * np + 1], a, b[1]);
          }
        }
      }
    }
    // (no closing barrier on the warpgroup pass: its next loads are issued after the next chunk's opening barrier,
    // which every thread reaches only once its products of this chunk are complete; see state_fwd.cuh)
    if constexpr (!(F::WG && F::STAGES == 2)) __syncthreads();
  }

  if (run.fin) store_state_tile<K, KW, TW>(p, dS, MODE == 1, u, un.n, hv, vt, vr, ks, g8, q);
}

template <class St>
void launch_state_rev_t(const Params& p, int mode, void* stream) {
  {
    GD_HEADK_SWITCH(p.K, KC, [&] {
      auto go = [&](auto mode_c, auto tw_c, auto wgs_c) {
        constexpr int M = decltype(mode_c)::value, TW = decltype(tw_c)::value, WGS = decltype(wgs_c)::value;
        using F = RevCfg<St, KC, TW, M, WGS>;
        auto kern = state_rev_kernel<St, KC, M, TW, WGS>;
        if constexpr (M == 0)
          TORCH_CHECK(F::WG == (p.fold_beta ? p.Tm != nullptr : p.TmB != nullptr),
                      "gated_delta CUDA: the reverse state pass ",
                      F::WG ? "forms W and needs" : "reads W and takes no", " Tm diag(beta) (or Tm)");
        GD_CUDA_CHECK(set_max_smem(reinterpret_cast<const void*>(kern), F::bytes));
        const int tiles = (M == 1) ? (p.V + KC) / TW : p.V / TW;
        kern<<<dim3(pass_grid_units(p), tiles / WGS, p.HV), F::NT, F::bytes, static_cast<cudaStream_t>(stream)>>>(p);
        GD_CUDA_LAUNCH_CHECK();
      };
      using I0 = std::integral_constant<int, 0>;
      using I1 = std::integral_constant<int, 1>;
      using I2 = std::integral_constant<int, 2>;
      using T32 = std::integral_constant<int, 32>;
      using T64 = std::integral_constant<int, 64>;
      if (mode == 1) go(I1(), T64(), I1());  // the scan's maps: enough CTAs already
      else if (p.tile32) go(I0(), T32(), I1());
      else {
        // warpgroup products: two state tiles per CTA where V holds an even number of them (bwd_wg_tiles_per_sm)
        if constexpr (RevCfg<St, KC, 64, 0>::WG) {
          if ((p.V / 64) % 2 == 0) return go(I0(), T64(), I2());
        }
        go(I0(), T64(), I1());
      }
    });
  }
}

}  // namespace cuda
}  // namespace gated_delta
