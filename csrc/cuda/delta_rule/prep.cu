// Chunk-parallel preparation, one CTA of 4 warps per (chunk, p.prep_heads value heads of one q/k head):
//   gam = in-chunk cumsum of g;  M = strictly-lower(beta_i k_i.k_j e^{gam_i - gam_j});  Tm = (I + M)^-1
//   W = Tm diag(beta e^gam) K,   U = Tm diag(beta) V,   A = lower(q_i.k_j e^{gam_i - gam_j})   (incl. diagonal)
// Where the state passes form W and U themselves (forms_wu: p.W and p.U are null), it writes Tm diag(beta) instead.
// K K^T and Q K^T are the same for every value head of a group: a CTA computes them once, keeps them in registers
// and walks its value heads. KK^T and QK^T, W and U run on tensor cores (fp32 accumulation); the inverse is fp32
// (blockwise, 16 x 16 blocks; the merges' products in tf32 for 16-bit inputs, tri_inverse.cuh). When p.lnorm is
// set it also writes, per chunk and value head, the log of a bound on the chunk's transition norm,
// sum_t (g_t + log max(1, |1 - b_t |k_t|^2| + 2^-15 |b_t |k_t|^2|)) (warmup.cuh).
// Mirrored kernel staging: its tile loads and per-head loops follow the same pattern as the other chunk-parallel
// kernels (prep.cu, grad_qk.cu, grad_wy.cu), each written out so that its pipeline is tuned on its own.
#include <type_traits>

#include "../dispatch.cuh"
#include "chunks.cuh"
#include "mma.cuh"
#include "tile_load.cuh"
#include "tri_inverse.cuh"
#include "warmup.cuh"

namespace gated_delta {
namespace cuda {

template <class St, int K>
struct PrepSmem {
  static constexpr int PAD = PadOf<St>::value, LDK = K + PAD, LDC = C + PAD;
  static constexpr int R1 = (C * LDK > 2 * C * LDC) ? C * LDK : 2 * C * LDC;  // Q, later Tm diag(.) tiles
  // fp32 region: Mf, Tf (the V tile reuses it once the inverse is done), inverse scratch, gam, beta, beta e^gam,
  // |k|^2
  static constexpr size_t bytes = sizeof(St) * (size_t)(C * LDK + R1) + sizeof(float) * (2 * C * kLdF + kInvScratch + 4 * C);
  static_assert(sizeof(St) * C * LDC <= sizeof(float) * 2 * C * kLdF, "V tile must fit over Mf and Tf");
  // a V tile of up to 128 columns fits there too for 16-bit types
  static constexpr bool kWholeV = sizeof(St) * C * (128 + PAD) <= sizeof(float) * 2 * C * kLdF;
  // K K^T and Q K^T stay in registers across the value heads (64 per thread): three CTAs per SM still fit for
  // 16-bit inputs at K <= 128 (shared memory allows three there)
  static constexpr int kMinBlocks = (sizeof(St) == 2 && K <= 128) ? 3 : 2;
};

// one 16-byte store to global memory, written out: the compiler splits a uint4 store into words and does not
// always merge them back
__device__ __forceinline__ void st16_global(void* p, uint32_t x, uint32_t y, uint32_t z, uint32_t w) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(__cvta_generic_to_global(p)), "r"(x), "r"(y), "r"(z),
               "r"(w));
}
// st8 to global memory
template <class St> __device__ __forceinline__ void st8_global(St* p, const float (&x)[8]) {
  if constexpr (sizeof(St) == 4) {
#pragma unroll
    for (int h = 0; h < 2; ++h)
      st16_global(p + 4 * h, __float_as_uint(x[4 * h]), __float_as_uint(x[4 * h + 1]), __float_as_uint(x[4 * h + 2]),
                  __float_as_uint(x[4 * h + 3]));
  } else {
    uint32_t y[4];
#pragma unroll
    for (int t = 0; t < 4; ++t) Pack<St>::put(y, y, t, x[2 * t], x[2 * t + 1]);
    st16_global(p, y[0], y[1], y[2], y[3]);
  }
}

// f(std::true_type) or f(std::false_type), as b
template <class F> __device__ __forceinline__ void with_flag(bool b, F&& f) {
  if (b) f(std::true_type{});
  else f(std::false_type{});
}

template <class St, int K>
__global__ void __launch_bounds__(128, PrepSmem<St, K>::kMinBlocks) prep_kernel(const Params p) {
  using S = PrepSmem<St, K>;
  constexpr int LDK = S::LDK, LDC = S::LDC, LDF = kLdF;
  extern __shared__ __align__(16) unsigned char smem[];
  St* Ks = reinterpret_cast<St*>(smem);
  St* R1 = Ks + C * LDK;
  float* Mf = reinterpret_cast<float*>(R1 + S::R1);
  float* Tf = Mf + C * LDF;
  St* Vs = reinterpret_cast<St*>(Mf);  // after the inverse
  float* Pf = Tf + C * LDF;
  float* gam = Pf + kInvScratch;
  float* bet = gam + C;
  float* beg = bet + C;
  float* kn = beg + C;

  // a linear grid with the head blocks of a chunk adjacent (they share K and Q, which then come from L2)
  const int blocks = p.HV / p.prep_heads;
  const int hv0 = (blockIdx.x % blocks) * p.prep_heads, c = blockIdx.x / blocks, h = hv0 / p.G;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g8 = lane >> 2, q = lane & 3;
  const ChunkInfo ci = chunk_info(p, c);
  // V's tile: whole (one load) where it fits over M and Tm, else one 64-column block at a time
  const bool whole_v = S::kWholeV && p.V <= 128;
  const int LDV = whole_v ? p.V + S::PAD : LDC;

  const St* kg = static_cast<const St*>(p.k) + (ci.bos * p.H + h) * K;
  const St* qg = static_cast<const St*>(p.q) + (ci.bos * p.H + h) * K;
  load_tile<St, C, K, 128>(Ks, LDK, kg, static_cast<int64_t>(p.H) * K, ci.len, tid);
  load_tile<St, C, K, 128>(R1, LDK, qg, static_cast<int64_t>(p.H) * K, ci.len, tid);
  cp_async_commit();

  // warp 0 holds the gates and betas of rows 2 lane, 2 lane + 1 of the next value head
  const int i0 = 2 * lane, i1 = i0 + 1;
  float a0 = 0.f, a1 = 0.f, b0 = 0.f, b1 = 0.f;
  auto fetch_gates = [&](int hv) {
    a0 = a1 = b0 = b1 = 0.f;
    const int64_t t0 = (ci.bos + i0) * p.HV + hv, t1 = t0 + p.HV;
    if (i0 < ci.len) { a0 = p.g[t0]; b0 = load_as_float(p.beta, p.beta_dtype, t0); }
    if (i1 < ci.len) { a1 = p.g[t1]; b1 = load_as_float(p.beta, p.beta_dtype, t1); }
  };
  if (warp == 0) fetch_gates(hv0);

  // K K^T and Q K^T: each warp 16 rows x 64 columns
  cp_async_wait<0>();
  __syncthreads();
  if (p.lnorm != nullptr) {
    // |k_i|^2 in fp32, two threads per row (padded rows are zero), each summing its half in order; 16-byte loads,
    // the eight lanes of a load phase on eight rows (lanes l and l ^ 8 share a row) so that no two share a bank
    constexpr int E = 16 / sizeof(St);
    const int r = (tid & 7) | ((tid >> 4) << 3), j0 = ((tid >> 3) & 1) * (K / 2);
    const uint4* kr = reinterpret_cast<const uint4*>(Ks + r * LDK + j0);
    float s = 0.f;
#pragma unroll 4
    for (int v = 0; v < K / 2 / E; ++v) {
      const uint4 w = kr[v];
#pragma unroll
      for (int u = 0; u < E; ++u) {
        float x;
        if constexpr (std::is_same_v<St, __nv_bfloat16>) {  // the exact widening, one instruction per element
          const uint32_t b = (&w.x)[u / 2];
          x = __uint_as_float(u % 2 == 0 ? b << 16 : b & 0xffff0000u);
        } else {
          x = to_f<St>(reinterpret_cast<const St*>(&w)[u]);
        }
        s = fmaf(x, x, s);
      }
    }
    s += __shfl_xor_sync(0xffffffffu, s, 8);
    if (j0 == 0) kn[r] = s;
  }
  float kk[8][4], qk[8][4];
  zero_acc(kk);
  zero_acc(qk);
#pragma unroll 2
  for (int kt = 0; kt < K / 16; ++kt) {
    const FragA<St> ak = lda<St>(Ks, LDK, 16 * warp, 16 * kt);
    const FragA<St> aq = lda<St>(R1, LDK, 16 * warp, 16 * kt);
#pragma unroll
    for (int np = 0; np < 4; ++np) {
      FragB<St> b[2];
      ldb<St>(b, Ks, LDK, 16 * np, 16 * kt);
      mma<St>(kk[2 * np], ak, b[0]);
      mma<St>(kk[2 * np + 1], ak, b[1]);
      mma<St>(qk[2 * np], aq, b[0]);
      mma<St>(qk[2 * np + 1], aq, b[1]);
    }
  }

#pragma unroll 1
  for (int hv = hv0; hv < hv0 + p.prep_heads; ++hv) {
    const int64_t chv = static_cast<int64_t>(c) * p.HV + hv;
    if (warp == 0) {
      // (floored here, where they are used, so that the loads stay in flight until then)
      const float f0 = floored_gate(a0), f1 = floored_gate(a1);
      const float incl = warp_incl_scan(f0 + f1);
      float excl = __shfl_up_sync(0xffffffffu, incl, 1);
      if (lane == 0) excl = 0.f;
      const float y0 = excl + f0;
      gam[i0] = y0;
      gam[i1] = y0 + f1;
      bet[i0] = b0;
      bet[i1] = b1;
      beg[i0] = b0 * __expf(y0);
      beg[i1] = b1 * __expf(y0 + f1);
      if (hv + 1 < hv0 + p.prep_heads) fetch_gates(hv + 1);  // in flight during this head's work
    }
    // gates visible; the previous head's products are done with Q (first head) or with V and Tm (later heads)
    __syncthreads();
    if (p.lnorm != nullptr && warp == 0) {
      // the per-token factor max(1, |1 - m| + 2^-15 |m|) bounds |1 - b |k|^2| (m: b |k|^2 with its fp32 rounding)
      float pen = 0.f;
#pragma unroll
      for (int t = 0; t < 2; ++t) add_log_stretch(pen, bet[i0 + t] * kn[i0 + t]);
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) pen += __shfl_xor_sync(0xffffffffu, pen, o);
      if (lane == 0) p.lnorm[chv] = gam[C - 1] + pen;
    }

    // Tf's blocks above the diagonal stay zero from one head to the next, except where the V tile covered them
    if (hv == hv0 || p.W != nullptr) zero_inverse_upper(Tf, tid);
    {
      // M and A for the warp's 16 rows, two adjacent columns per step, specialised per warp (WR: its row block) so
      // that only the two column tiles that cross the diagonal test i >= j. M's blocks above the diagonal are never
      // read (block_inverse); A's are zero.
      auto terms = [&](auto wr) {
        constexpr int WR = decltype(wr)::value;
        float av[8][4];
        float gi[2], bi[2];
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          gi[hr] = gam[16 * WR + g8 + 8 * hr];
          bi[hr] = bet[16 * WR + g8 + 8 * hr];
        }
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
          if (nt > 2 * WR + 1) {
            av[nt][0] = av[nt][1] = av[nt][2] = av[nt][3] = 0.f;
            continue;
          }
          const int j = 8 * nt + 2 * q;
          const float2 gj = *reinterpret_cast<const float2*>(gam + j);  // (both row halves)
#pragma unroll
          for (int hr = 0; hr < 2; ++hr) {
            const int i = 16 * WR + g8 + 8 * hr;
            float E0 = __expf(gi[hr] - gj.x), E1 = __expf(gi[hr] - gj.y);
            float m0 = bi[hr] * kk[nt][2 * hr] * E0, m1 = bi[hr] * kk[nt][2 * hr + 1] * E1;
            if (nt >= 2 * WR) {  // the diagonal's column tiles
              E0 = i >= j ? E0 : 0.f;
              E1 = i > j ? E1 : 0.f;
              m0 = i > j ? m0 : 0.f;
              m1 = i > j + 1 ? m1 : 0.f;
            }
            *reinterpret_cast<float2*>(Mf + i * LDF + j) = make_float2(m0, m1);
            av[nt][2 * hr] = qk[nt][2 * hr] * E0;
            av[nt][2 * hr + 1] = qk[nt][2 * hr + 1] * E1;
          }
        }
        St* Ag = static_cast<St*>(p.A) + (chv * C + 16 * WR) * C;
        if constexpr (WR <= 1) {
          // columns 32..63 are all zero: stored as such, without the exchange of store_frag_rows
          float lo[4][4];
#pragma unroll
          for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) lo[nt][e] = av[nt][e];
          store_frag_rows<St, 4>(Ag, C, lo, g8, q);
          constexpr int EV = 16 / sizeof(St);  // elements per 16 bytes
#pragma unroll
          for (int hr = 0; hr < 2; ++hr)
#pragma unroll
            for (int t = 0; t < 32 / EV / 4; ++t)
              st16_global(Ag + (g8 + 8 * hr) * C + 32 + EV * (q + 4 * t), 0u, 0u, 0u, 0u);
        } else {
          store_frag_rows<St, 8>(Ag, C, av, g8, q);
        }
      };
      switch (warp) {
        case 0: terms(std::integral_constant<int, 0>{}); break;
        case 1: terms(std::integral_constant<int, 1>{}); break;
        case 2: terms(std::integral_constant<int, 2>{}); break;
        default: terms(std::integral_constant<int, 3>{});
      }
    }
    __syncthreads();
    block_inverse<sizeof(St) == 2>(Mf, Tf, Pf, tid);

    // Tm diag(beta) (and Tm) to memory, and for W and U Tm diag(beta) and Tm diag(beta e^gam) as operand tiles
    // (where Q was): eight columns, 16 bytes, per thread and step; a thread's columns, and so its beta factors, are
    // the same at every step. The outputs present are compile-time flags of one loop body chosen per kernel.
    St* TmB = R1;
    St* TmBG = R1 + C * LDC;
    auto store_tm = [&](auto tm, auto tmb, auto wu) {
      constexpr bool TM = decltype(tm)::value, TMB = decltype(tmb)::value, WU = decltype(wu)::value;
      // per-thread row pointers, advanced 16 rows a step (Tmg, TmBg: not formed where null)
      const int i0 = tid >> 3, j = 8 * (tid & 7);
      const float* tf = Tf + i0 * LDF + j;
      St* Tmg = TM ? static_cast<St*>(p.Tm) + chv * C * C + i0 * C + j : nullptr;
      St* TmBg = TMB ? static_cast<St*>(p.TmB) + chv * C * C + i0 * C + j : nullptr;
      St* tbs = TmB + i0 * LDC + j;
      St* tgs = TmBG + i0 * LDC + j;
      float bj[8], gj[8];
      ld8(bet + j, bj);
      if constexpr (WU) ld8(beg + j, gj);
#pragma unroll 2
      for (int s = 0; s < C * C / 8 / 128; ++s) {
        float t[8], tb[8];
        ld8(tf, t);
#pragma unroll
        for (int u = 0; u < 8; ++u) tb[u] = bj[u] * t[u];
        if constexpr (TM) st8_global<St>(Tmg, t);
        if constexpr (TMB) st8_global<St>(TmBg, tb);
        if constexpr (WU) {
          st8<St>(tbs, tb);
          float tg[8];
#pragma unroll
          for (int u = 0; u < 8; ++u) tg[u] = gj[u] * t[u];
          st8<St>(tgs, tg);
        }
        tf += 16 * LDF;
        if constexpr (TM) Tmg += 16 * C;
        if constexpr (TMB) TmBg += 16 * C;
        tbs += 16 * LDC;
        tgs += 16 * LDC;
      }
    };
    with_flag(p.Tm != nullptr, [&](auto tm) {
      with_flag(p.TmB != nullptr, [&](auto tmb) {
        with_flag(p.W != nullptr, [&](auto wu) { store_tm(tm, tmb, wu); });
      });
    });
    if (tid < C) p.gam[chv * C + tid] = gam[tid];
    __syncthreads();
    if (p.W == nullptr) continue;  // the state passes form W and U from TmB (forms_wu)
    // the V tile goes where M and Tm were: all of it at once where it fits (16-bit, V <= 128), else 64 columns
    // at a time
    const St* vg = static_cast<const St*>(p.v) + ci.bos * p.tok_v + hv * p.ld_v;
    const int64_t vstride = p.tok_v;
    if (whole_v && p.V == 128) load_tile<St, C, 128, 128>(Vs, LDV, vg, vstride, ci.len, tid);
    else load_tile<St, C, C, 128>(Vs, LDV, vg, vstride, ci.len, tid);  // (V = 64, or the first of several blocks)
    cp_async_commit();

    // W = (Tm diag(beta e^gam)) K, in 64-column blocks
    St* Wg = static_cast<St*>(p.W) + chv * C * K;
#pragma unroll 1
    for (int nb = 0; nb < K / 64; ++nb) {
      float acc[8][4];
      zero_acc(acc);
      warp_mma_16x64x64<St, false, true>(acc, TmBG, LDC, 16 * warp, Ks, LDK, nb * 64);
      store_frag_rows<St, 8>(Wg + 16 * warp * K + nb * 64, K, acc, g8, q);
    }

    // U = (Tm diag(beta)) V, one 64-column block of V at a time
    St* Ug = static_cast<St*>(p.U) + chv * C * p.V;
#pragma unroll 1
    for (int vb = 0; vb < p.V / 64; ++vb) {
      if (vb > 0 && !whole_v) {
        __syncthreads();
        load_tile<St, C, C, 128>(Vs, LDV, vg + vb * 64, vstride, ci.len, tid);
        cp_async_commit();
      }
      if (vb == 0 || !whole_v) {
        cp_async_wait<0>();
        __syncthreads();
      }
      float acc[8][4];
      zero_acc(acc);
      warp_mma_16x64x64<St, false, true>(acc, TmB, LDC, 16 * warp, Vs, LDV, whole_v ? vb * 64 : 0);
      store_frag_rows<St, 8>(Ug + static_cast<int64_t>(16 * warp) * p.V + vb * 64, p.V, acc, g8, q);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// The backward's warm-up bounds where the forward kept its residual (fwd_with_residual: A, gam and Tm, which the
// state passes read, applying diag(beta) to Tm themselves): chunk_lnorm of every chunk and value head into p.lnorm,
// launched with segments only. One CTA of 4 warps per (chunk, q/k head), which reads the chunk's keys once for the
// value heads of the group: thread t sums the squares of half of row t / 2 of k, the pair adds its halves (|k_t|^2
// keeps its rounding bound: a sum of non-negative fp32 terms in any order). Then for each value head the even thread
// of the pair adds its row's term, and the warps' sums meet in red (4 floats per value head).
template <class St, int K>
__global__ void __launch_bounds__(128) prep_residual_kernel(const Params p) {
  constexpr int E = 16 / sizeof(St), NV = K / E / 2;  // 16-byte loads per half row
  static_assert(NV >= 1, "a half row is at least one 16-byte load");
  extern __shared__ float red[];  // [G][4]
  const int h = blockIdx.x % p.H, c = blockIdx.x / p.H;
  const int tid = threadIdx.x, row = tid >> 1, warp = tid >> 5;
  const ChunkInfo ci = chunk_info(p, c);
  float kn = 0.f;
  if (row < ci.len) {
    const uint4* kr = reinterpret_cast<const uint4*>(static_cast<const St*>(p.k) + ((ci.bos + row) * p.H + h) * K);
    kn = sq_norm16<St, NV, NV>(kr + (tid & 1) * NV);
  }
  kn += __shfl_xor_sync(0xffffffffu, kn, 1);
  const bool mine = (tid & 1) == 0 && row < ci.len;
  const int64_t i0 = (ci.bos + row) * p.HV + h * p.G;  // (row, the group's first value head)
#pragma unroll 1
  for (int gi = 0; gi < p.G; ++gi) {
    float s = 0.f;
    if (mine) {
      s = floored_gate(p.g[i0 + gi]);
      add_log_stretch(s, load_as_float(p.beta, p.beta_dtype, i0 + gi) * kn);
    }
    s = warp_sum(s);
    if ((tid & 31) == 0) red[4 * gi + warp] = s;
  }
  __syncthreads();
  for (int gi = tid; gi < p.G; gi += 128)
    p.lnorm[static_cast<int64_t>(c) * p.HV + h * p.G + gi] = (red[4 * gi] + red[4 * gi + 1]) +
                                                            (red[4 * gi + 2] + red[4 * gi + 3]);
}

void launch_prep_residual(const Params& p, DType dtype, void* stream) {
  if (p.NC == 0) return;
  TORCH_CHECK(p.lnorm != nullptr, "gated_delta CUDA: prep_residual forms the warm-up bounds and needs lnorm");
  GD_DTYPE_SWITCH(dtype, St, [&] {
    if constexpr (sizeof(St) == 2) {  // (a residual is kept for 16-bit inputs only: forms_wu)
      GD_HEADK_SWITCH(p.K, KC, [&] {
        prep_residual_kernel<St, KC><<<dim3(p.NC * p.H), 128, 4 * p.G * sizeof(float),
                                       static_cast<cudaStream_t>(stream)>>>(p);
        GD_CUDA_LAUNCH_CHECK();
      });
    }
  });
}

void launch_prep(const Params& p, DType dtype, void* stream) {
  if (p.NC == 0) return;
  GD_DTYPE_SWITCH(dtype, St, [&] {
    GD_HEADK_SWITCH(p.K, KC, [&] {
      const size_t smem = PrepSmem<St, KC>::bytes;
      auto kern = prep_kernel<St, KC>;
      GD_CUDA_CHECK(set_max_smem(reinterpret_cast<const void*>(kern), smem));
      kern<<<dim3(p.NC * (p.HV / p.prep_heads)), 128, smem, static_cast<cudaStream_t>(stream)>>>(p);
      GD_CUDA_LAUNCH_CHECK();
    });
  });
}

}  // namespace cuda
}  // namespace gated_delta
