// The forward in one kernel, warp-specialised: one CTA of three warpgroups per (work unit, 128 value columns, value
// head). Warpgroups 0 and 1 carry the unit's state, one 64-column tile each, through its chunks exactly as
// state_fwd's warpgroup pass does (state_fwd.cuh: Vn^T = (V^T - (K S)^T diag(e^gam)) (Tm diag(beta))^T, the output,
// the state update). Warpgroup 2 is their producer: it loads each chunk's K | Q and V tiles and computes, one chunk
// ahead of them, what prep.cu writes to memory for the two-kernel forward: the in-chunk cumulative gate gam (and
// e^gam, e^{gam_L - gam}), K K^T and Q K^T (wgmma, both operands from the K | Q tile), M = strictly-lower(beta_i
// k_i.k_j e^{gam_i - gam_j}), Tm = (I + M)^-1 (tri_inverse.cuh, merges in tf32), A = lower(Q K^T o E) and
// Tm diag(beta), the last two straight into the sw128 tiles the state products read. Nothing of it goes through
// memory (except, for a forward that keeps a residual for its backward, each chunk's gam, A and Tm, which the
// backward's prep would otherwise recompute), and the products of the inverse run while the state warpgroups run
// the previous chunk.
//
// Shared memory: three K | Q slots with their chunk's gates (the producer loads chunk c + 1's while it works on
// chunk c and the state warpgroups read chunk c - 1's), two slots of the per-chunk tiles (A, Tm diag(beta), V),
// the output's staging tile, the producer's fp32 tiles (M, Tm, the inverse's scratch) and the copies' mbarriers.
// A full chunk's K, Q and V arrive by TMA (tma.cuh), a sequence's last, partial chunk by cp.async. Named barriers
// hand the slots over (FULL: the producer has filled the slot of chunk c; EMPTY: the state warpgroups are done with
// chunk c); the producer and the state warpgroups also have a barrier each of their own.
//
// Where it runs (fwd_fused_applies in params.h): 16-bit inputs, K = 128, V a multiple of 128, the state pass in
// 64-column tiles, no scan; the host takes it there by default, except for segments shorter than 16 chunks
// (fused_forward in delta_rule.cpp). With segments (Params::warm) it runs as state_fwd does, once for the segments,
// once more for the exact fallback; each CTA forms the bounds its warm-up walks itself (fused_warm_walk), and the
// producer prepares every chunk the CTA walks, warm-up chunks included (without their Q, whose copies and A terms
// are left out: nothing of a warm-up chunk is output). Bitwise deterministic: every value is computed by one thread
// in a fixed order.
// Mirrored kernel staging: the state warpgroups' per-chunk products follow state_fwd.cuh's warpgroup pass, and the
// producer's element-wise terms prep.cu's, written out here so that this kernel's registers (setmaxnreg budgets)
// and the order of its products are tuned on their own.
#include <type_traits>

#include "../dispatch.cuh"
#include "chunks.cuh"
#include "mma.cuh"
#include "tile_load.cuh"
#include "tma.cuh"
#include "tri_inverse.cuh"
#include "warmup.cuh"
#include "wgmma.cuh"

namespace gated_delta {
namespace cuda {

template <class St>
struct FusedFwdCfg {
  static constexpr int K = 128, TW = 64, NT = 384;
  static constexpr int LDT = 2 * TW + PadOf<St>::value;  // the output's staging tile: the CTA's 128 columns
  static constexpr size_t KQ_BYTES = 2 * 128 * 128;       // two 64-column blocks of 128 rows (K: 0..63, Q: 64..127)
  // A, Tm diag(beta) and V (the CTA's 128 columns: two 64-column blocks of 64 rows), all sw128
  static constexpr size_t A_OFF = 0, T_OFF = 8192, V_OFF = 16384, V_BYTES = 2 * 64 * 128;
  static constexpr size_t SLOT_BYTES = V_OFF + V_BYTES;
  // per K | Q slot, the chunk's gates: gam log2(e) (exponents in base 2 cost the terms a multiply each),
  // e^gam, e^{gam_L - gam} and beta, 64 floats each
  static constexpr size_t GATE_BYTES = 4 * C * sizeof(float);
  static constexpr size_t OS_BYTES = sizeof(St) * C * LDT;
  static constexpr size_t PREP_BYTES = sizeof(float) * (2 * C * kLdF + kInvScratch);  // Mf, Tf, Pf
  // the mbarriers of the copies (3 K | Q slots, 2 V slots) and, from byte 48, the run's bounds (run_sh)
  static constexpr size_t BAR_BYTES = 64;
  static_assert(5 * sizeof(uint64_t) <= 48 && 48 + 4 * sizeof(int) <= BAR_BYTES, "mbarriers and run bounds");
  static constexpr size_t bytes =
      3 * KQ_BYTES + 2 * SLOT_BYTES + 3 * GATE_BYTES + OS_BYTES + PREP_BYTES + BAR_BYTES + 1024;
  static_assert(bytes <= 227 * 1024, "shared memory of one CTA");
};

// named barriers (0 is __syncthreads)
constexpr int kBarFull = 1;   // + slot: the producer has filled it
constexpr int kBarEmpty = 3;  // + slot: the state warpgroups are done with it
constexpr int kBarState = 5;  // the two state warpgroups
constexpr int kBarPrep = 6;   // the producer warpgroup
// Registers per thread, moved between the warpgroups with setmaxnreg within what the CTA holds at launch (168 per
// thread for 384 threads: 2 x 128 x 192 + 128 x 120 = 64512; asking for more than that would wait forever). The
// state warpgroups hold the state (64), the products' accumulators and operands; the producer's largest part is
// one 64 x 64 accumulator.
constexpr int kRegsState = 192, kRegsProducer = 120;
static_assert(2 * 128 * kRegsState + 128 * kRegsProducer <= 168 * 384, "more registers than the CTA holds");

// warmup.cuh's forward walk (warm_walk) for this kernel, which forms the bounds it reads instead of reading lnorm
// from memory: the CTA's 12 warps form those of 12 chunks at a time (edge - 1, edge - 2, ...: warp w the w-th), and
// every thread adds them in that order until the sum proves a start from zero (<= kWarmLogBound). Only the chunks
// the walk reaches are read, a few per segment at typical gates, where a pass of their own read every chunk's keys.
// Called by every thread; scratch: 12 floats of shared memory.
template <class St>
__device__ __forceinline__ int fused_warm_walk(const Params& p, int h, int hv, int edge, int bound, float* scratch,
                                               int& state) {
  constexpr int W = FusedFwdCfg<St>::NT / 32;  // warps of the CTA
  static_assert(W == 12, "the walk's batch is one chunk per warp");
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int avail = edge - bound;
  if (avail <= 0) {
    state = 1;
    return edge;
  }
  const int lim = min(avail, p.warm_max);
  float sum = 0.f;
  for (int j0 = 0; j0 < lim; j0 += W) {
    if (j0 + warp < lim) {
      const float x = chunk_lnorm<St, 128>(p, edge - 1 - j0 - warp, h, hv);
      if (lane == 0) scratch[warp] = x;
    }
    __syncthreads();
    int hit = 0;  // chunks of this batch in the warm-up, once proven
    for (int w = 0; w < W && j0 + w < lim && hit == 0; ++w) {
      sum += scratch[w];
      if (sum <= kWarmLogBound) hit = w + 1;
    }
    __syncthreads();  // (scratch is written again)
    if (hit > 0) {
      state = 0;
      return edge - (j0 + hit);
    }
  }
  return walk_unproven(p, avail, edge, bound, state);
}

template <class St>
__global__ void __launch_bounds__(384, 1)
    fwd_fused_kernel(const Params p, const __grid_constant__ CUtensorMap tm_k, const __grid_constant__ CUtensorMap tm_q,
                     const __grid_constant__ CUtensorMap tm_v) {
  using F = FusedFwdCfg<St>;
  constexpr int K = F::K, LDT = F::LDT, LDF = kLdF;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  unsigned char* kq0 = smem;
  unsigned char* slot0 = smem + 3 * F::KQ_BYTES;
  St* Os = reinterpret_cast<St*>(slot0 + 2 * F::SLOT_BYTES);
  float* Mf = reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(Os) + F::OS_BYTES);
  float* Tf = Mf + C * LDF;
  float* Pf = Tf + C * LDF;
  float* gate0 = Pf + kInvScratch;
  uint64_t* kq_bar = reinterpret_cast<uint64_t*>(gate0 + 3 * 4 * C);  // completion of the copies into a K | Q slot
  uint64_t* v_bar = kq_bar + 3;                                        // ... and into a slot's V tile
  // the run's first chunk, its chunk count and sequence, which the producer reads back after its registers are
  // lowered (carried from before that point they were kept in local memory and reloaded every chunk)
  int* run_sh = reinterpret_cast<int*>(kq_bar + 6);

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g8 = lane >> 2, q = lane & 3;
  const int wg = warp >> 2, vr = warp & 3;
  const int u = pass_unit(p), vt0 = blockIdx.y * 2, hv = blockIdx.z, h = hv / p.G;
  const Unit un = get_unit(p, u);
  Run run;
  auto walk = [&](int edge, int bound, bool, int& state) {
    return fused_warm_walk<St>(p, h, hv, edge, bound, Pf, state);  // (Pf: the inverse's scratch, not yet used)
  };
  if (!plan_run<false>(p, u, un, hv, vt0, run, walk)) return;
  if (tid == 0) {
#pragma unroll
    for (int b = 0; b < 5; ++b) mbar_init(kq_bar + b, 1);
    mbar_init_fence();
    run_sh[0] = run.rb;
    run_sh[1] = run.re - run.rb;
    run_sh[2] = un.n;
    run_sh[3] = run.ob - run.rb;  // the run's first chunk of its own (after the warm-up's)
  }
  __syncthreads();
  const int n_it = run.re - run.rb;
  const int64_t HK = static_cast<int64_t>(p.H) * K;
  auto kq_slot = [&](int it) { return kq0 + (it % 3) * F::KQ_BYTES; };
  auto slot = [&](int it) { return slot0 + (it & 1) * F::SLOT_BYTES; };
  auto gates = [&](int it) { return gate0 + (it % 3) * (4 * C); };  // gam log2(e), e^gam, e^{gam_L - gam}, beta

  if (wg == 2) {
    // ---------------- producer ----------------
    setmaxnreg_dec<kRegsProducer>();
    const int pt = tid - 256, pw = warp - 8;
    const int rb = run_sh[0], n_chunks = run_sh[1], seq = run_sh[2], own0 = run_sh[3];
    // The residual for the backward (p.A, p.gam, p.Tm set: fwd_with_residual): each chunk of the run's own (not
    // the warm-up's) stores its gam, A and Tm as prep does, by the CTA of the first 128 value columns.
    const bool residual = p.A != nullptr && blockIdx.y == 0;
    auto keeps = [&](int it) { return residual && it >= own0; };
    // Full chunks arrive by TMA (one thread issues the boxes, the slot's mbarrier counts their bytes); a sequence's
    // last, partial chunk by cp.async with its rows past the end zero-filled (a box would read the next
    // sequence's). Bit s of kq_ph / v_ph: the parity of the slot's next phase. Each chunk's bounds are read once.
    uint32_t kq_ph = 0, v_ph = 0;
    // A warm-up chunk's Q is not read (nothing of it is output): its copies are left out.
    auto load_kq = [&](int it, const ChunkInfo& ci) {
      unsigned char* s = kq_slot(it);
      uint64_t* bar = kq_bar + it % 3;
      const bool with_q = it >= own0;
      if (ci.len == C) {
        if (pt == 0) {
          fence_async_smem();  // the slot's earlier reads and writes before the copy engine's writes
          mbar_expect_tx(bar, with_q ? F::KQ_BYTES : F::KQ_BYTES / 2);
#pragma unroll
          for (int b = 0; b < 2; ++b) {
            tma_load_2d(s + b * (128 * 128), &tm_k, bar, h * K + 64 * b, static_cast<int>(ci.bos));
            if (with_q)
              tma_load_2d(s + b * (128 * 128) + 64 * 128, &tm_q, bar, h * K + 64 * b, static_cast<int>(ci.bos));
          }
        }
      } else {
        const St* kg = static_cast<const St*>(p.k) + ci.bos * HK + h * K;
        const St* qg = static_cast<const St*>(p.q) + ci.bos * HK + h * K;
        load_tile_sw128<St, C, K, 128, 128>(s, 0, kg, HK, ci.len, pt);
        if (with_q) load_tile_sw128<St, C, K, 128, 128>(s, 64, qg, HK, ci.len, pt);
      }
    };
    auto load_v = [&](int it, const ChunkInfo& ci) {
      unsigned char* vs = slot(it) + F::V_OFF;
      uint64_t* bar = v_bar + (it & 1);
      if (ci.len == C) {
        if (pt == 0) {
          fence_async_smem();
          mbar_expect_tx(bar, F::V_BYTES);
#pragma unroll
          for (int b = 0; b < 2; ++b)
            tma_load_2d(vs + b * (64 * 128), &tm_v, bar, hv * p.ld_v + vt0 * F::TW + 64 * b, static_cast<int>(ci.bos));
        }
      } else {
        const St* vg = static_cast<const St*>(p.v) + ci.bos * p.tok_v + hv * p.ld_v + vt0 * F::TW;
        load_tile_sw128<St, C, 2 * F::TW, 64, 128>(vs, 0, vg, p.tok_v, ci.len, pt);
      }
    };
    // waits for a slot's copies when they are TMA's (cp.async's: cp_async_wait, as the caller counts its groups)
    auto wait_tma = [&](uint64_t* bars, uint32_t& ph, int sb) {
      mbar_wait(bars + sb, ph >> sb & 1u);
      ph ^= 1u << sb;
    };
    // The gates: warp 2 loads those of the next chunk when a chunk starts (lane l: rows 2l and 2l + 1; beta's bits,
    // converted when they are used, so that no branch on its dtype waits for the load) and forms them into the
    // next K | Q slot's gate tile while warps 0 and 1 form the inverse's diagonal blocks (warp 3 has the most
    // terms of A: 8 column tiles against warp 2's 6).
    const int i0 = 2 * lane;
    float a0 = 0.f, a1 = 0.f;
    uint32_t rb0 = 0u, rb1 = 0u;
    auto fetch_gates = [&](const ChunkInfo& ci) {
      a0 = a1 = 0.f;
      rb0 = rb1 = 0u;
      const int64_t t0 = (ci.bos + i0) * p.HV + hv, t1 = t0 + p.HV;
      if (i0 < ci.len) { a0 = p.g[t0]; rb0 = load_bits(p.beta, p.beta_dtype, t0); }
      if (i0 + 1 < ci.len) { a1 = p.g[t1]; rb1 = load_bits(p.beta, p.beta_dtype, t1); }
    };
    auto form_gates = [&](int it) {
      float* gt = gates(it);
      // (floored here, where they are used, so that the loads stay in flight until then)
      const float f0 = floored_gate(a0), f1 = floored_gate(a1);
      const float incl = warp_incl_scan(f0 + f1);
      float excl = __shfl_up_sync(0xffffffffu, incl, 1);
      if (lane == 0) excl = 0.f;
      const float n0 = excl + f0, n1 = n0 + f1;
      const float y0 = n0 * kLog2e, y1 = n1 * kLog2e, yl = __shfl_sync(0xffffffffu, y1, 31);
      *reinterpret_cast<float2*>(gt + i0) = make_float2(y0, y1);
      *reinterpret_cast<float2*>(gt + C + i0) = make_float2(exp2_approx(y0), exp2_approx(y1));
      *reinterpret_cast<float2*>(gt + 2 * C + i0) = make_float2(exp2_approx(yl - y0), exp2_approx(yl - y1));
      *reinterpret_cast<float2*>(gt + 3 * C + i0) =
          make_float2(bits_as_float(rb0, p.beta_dtype), bits_as_float(rb1, p.beta_dtype));
      if (keeps(it))
        *reinterpret_cast<float2*>(p.gam + (static_cast<int64_t>(rb + it) * p.HV + hv) * C + i0) = make_float2(n0, n1);
    };
    ChunkInfo ci_c{};  // this chunk's bounds
    if (n_chunks > 0) {
      ci_c = chunk_info(p, rb, seq);
      load_kq(0, ci_c);
      cp_async_commit();
      if (pw == 2) {
        fetch_gates(ci_c);
        form_gates(0);
      }
    }
    // A's tiles above the diagonal blocks and Tm's blocks above its diagonal blocks are never written below:
    // zero once
    for (int e = pt; e < 2 * 8192 / 16; e += 128) {
      unsigned char* a = slot(e >> 9) + F::A_OFF + (e & 511) * 16;
      *reinterpret_cast<uint4*>(a) = make_uint4(0u, 0u, 0u, 0u);
    }
    zero_inverse_upper(Tf, pt);

#pragma unroll 1
    for (int it = 0; it < n_chunks; ++it) {
      if (it >= 2) bar_sync(kBarEmpty + (it & 1), 384);  // chunk it - 2 is done: its slot and K | Q slot are free
      const bool next = it + 1 < n_chunks;
      const ChunkInfo ci_n = next ? chunk_info(p, rb + it + 1, seq) : ChunkInfo{};
      load_v(it, ci_c);
      cp_async_commit();
      if (next) load_kq(it + 1, ci_n);
      cp_async_commit();
      if (pw == 2 && next) fetch_gates(ci_n);  // in flight during this chunk's work
      unsigned char* sl = slot(it);
      unsigned char* kq = kq_slot(it);
      const float* gs = gates(it);
      const float* bet = gs + 3 * C;
      const bool outc = it >= own0;  // (a warm-up chunk's A is not read: its terms are not formed)
      cp_async_wait<2>();  // this chunk's K | Q (the two groups after it may be in flight)
      if (ci_c.len == C) wait_tma(kq_bar, kq_ph, it % 3);
      bar_sync(kBarPrep, 128);  // (and the gates, formed during the previous chunk)

      // K K^T, then M (to Mf, fp32); Q K^T, then A (to the slot's sw128 tile): this warp's 16 rows, two adjacent
      // columns per step. Column tiles past the diagonal's are skipped (M is not read there, A is zero there). One
      // 64 x 64 accumulator at a time: the producer runs on few registers. The gates and betas of rows and
      // columns come from the chunk's gate tile.
      {
        unsigned char* As = sl + F::A_OFF;
        float gi[2], bi[2];
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          gi[hr] = gs[16 * pw + g8 + 8 * hr];
          bi[hr] = bet[16 * pw + g8 + 8 * hr];
        }
        const uint64_t dkq = sw128_desc(kq, 16);  // the steps' descriptors: offsets (in 16 bytes) from it
        auto issue = [&](float (&x)[8][4], bool qk) {
          wg_fence();
#pragma unroll
          for (int s = 0; s < K / 16; ++s) {
            const uint64_t dk = dkq + (((s >> 2) * (128 * 128) + (s & 3) * 32) >> 4);
            wgmma_ss_t<St, 0, 0, 8>(x, qk ? dk + ((64 * 128) >> 4) : dk, dk, s > 0);
          }
          wg_commit();
        };
        // the exponentials e^{gam_i - gam_j} are formed twice (for M, then A) instead of held
        auto terms = [&](const float (&x)[8][4], auto is_a, auto pw_c) {
          constexpr bool IS_A = decltype(is_a)::value;
          constexpr int PW = decltype(pw_c)::value;
#pragma unroll
          for (int nt = 0; nt < 8; ++nt) {
            const int j = 8 * nt + 2 * q;
            const float2 gj = *reinterpret_cast<const float2*>(gs + j);
            const float gjx = gj.x, gjy = gj.y;
            if constexpr (!IS_A) {
              // M's blocks (2, 0), (3, 0) and (3, 1) from the transposed blocks of K K^T (symmetric) that warps 0
              // and 1 hold: 6, 6, 4, 4 column tiles per warp instead of 2, 4, 6, 8
              const float2 bj = *reinterpret_cast<const float2*>(bet + j);
              const float bjx = bj.x, bjy = bj.y;
              if ((PW == 0 && nt >= 4) || (PW == 1 && nt >= 6)) {
#pragma unroll
                for (int hr = 0; hr < 2; ++hr) {
                  const int r = 16 * PW + g8 + 8 * hr;  // M[j][r] and M[j + 1][r], j > r
                  Mf[j * LDF + r] = bjx * x[nt][2 * hr] * exp2_approx(gjx - gi[hr]);
                  Mf[(j + 1) * LDF + r] = bjy * x[nt][2 * hr + 1] * exp2_approx(gjy - gi[hr]);
                }
                continue;
              }
              if (nt > 2 * PW + 1 || (PW >= 2 && nt < 2 * (PW - 1))) continue;  // (those blocks: warps 0 and 1)
            } else {
              if (nt > 2 * PW + 1) continue;
            }
            const bool diag = nt >= 2 * PW;
#pragma unroll
            for (int hr = 0; hr < 2; ++hr) {
              const int i = 16 * PW + g8 + 8 * hr;
              float E0 = exp2_approx(gi[hr] - gjx), E1 = exp2_approx(gi[hr] - gjy);
              if constexpr (IS_A) {
                if (diag) {
                  E0 = i >= j ? E0 : 0.f;
                  E1 = i > j ? E1 : 0.f;
                }
                uint32_t av;
                Pack<St>::put(&av, &av, 0, x[nt][2 * hr] * E0, x[nt][2 * hr + 1] * E1);
                *reinterpret_cast<uint32_t*>(As + sw128_off(i, j)) = av;
              } else {
                float m0 = bi[hr] * x[nt][2 * hr] * E0, m1 = bi[hr] * x[nt][2 * hr + 1] * E1;
                if (diag) {
                  m0 = i > j ? m0 : 0.f;
                  m1 = i > j + 1 ? m1 : 0.f;
                }
                *reinterpret_cast<float2*>(Mf + i * LDF + j) = make_float2(m0, m1);
              }
            }
          }
        };
        // each warp's terms with its rows known at compile time: the tests on them fold away
        auto warp_terms = [&](const float (&x)[8][4], auto is_a) {
          switch (pw) {
            case 0: terms(x, is_a, std::integral_constant<int, 0>{}); break;
            case 1: terms(x, is_a, std::integral_constant<int, 1>{}); break;
            case 2: terms(x, is_a, std::integral_constant<int, 2>{}); break;
            default: terms(x, is_a, std::integral_constant<int, 3>{}); break;
          }
        };
        {
          float x[8][4];
          issue(x, false);
          wg_wait<0>();
          wg_fence_acc(x);
          warp_terms(x, std::false_type{});
        }
        // Q K^T runs while warps 0 and 1 form the inverse's diagonal blocks, then A
        float x[8][4];
        issue(x, true);
        bar_sync(kBarPrep, 128);  // M is complete
        inverse_diag_blocks(Mf, Tf, pt);
        if (pw == 2 && next) form_gates(it + 1);
        wg_wait<0>();
        wg_fence_acc(x);
        if (outc) warp_terms(x, std::true_type{});
      }
      bar_sync(kBarPrep, 128);  // the diagonal blocks are complete
      block_inverse_tf32<NamedBar<kBarPrep>, /*DIAG=*/false>(Mf, Tf, Pf, pt);

      // Tm diag(beta) into the slot's sw128 tile: eight columns (one 16-byte chunk) per thread and step
      {
        unsigned char* Ts = sl + F::T_OFF;
        const int r0 = pt >> 3, j = 8 * (pt & 7);
        float bj[8], t[4][8];
        ld8(bet + j, bj);
#pragma unroll
        for (int s = 0; s < 4; ++s) ld8(Tf + (r0 + 16 * s) * LDF + j, t[s]);  // (all loads before the stores)
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          uint32_t y[4];
#pragma unroll
          for (int e = 0; e < 4; ++e)
            Pack<St>::put(y, y, e, bj[2 * e] * t[s][2 * e], bj[2 * e + 1] * t[s][2 * e + 1]);
          *reinterpret_cast<uint4*>(Ts + sw128_off(r0 + 16 * s, j)) = make_uint4(y[0], y[1], y[2], y[3]);
        }
        if (keeps(it)) {  // Tm as it is, and A from its finished tile: 16 bytes per thread and row
          const int64_t chv = static_cast<int64_t>(rb + it) * p.HV + hv;
          St* tg = static_cast<St*>(p.Tm) + (chv * C + r0) * C + j;
          St* ag = static_cast<St*>(p.A) + (chv * C + r0) * C + j;
          const unsigned char* As = sl + F::A_OFF;
#pragma unroll
          for (int s = 0; s < 4; ++s) {
            uint32_t y[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) Pack<St>::put(y, y, e, t[s][2 * e], t[s][2 * e + 1]);
            *reinterpret_cast<uint4*>(tg + 16 * s * C) = make_uint4(y[0], y[1], y[2], y[3]);
            *reinterpret_cast<uint4*>(ag + 16 * s * C) =
                *reinterpret_cast<const uint4*>(As + sw128_off(r0 + 16 * s, j));
          }
        }
      }
      cp_async_wait<1>();  // this chunk's V tile
      if (ci_c.len == C) wait_tma(v_bar, v_ph, it & 1);
      fence_async_smem();  // the slot's tiles are read by wgmma next
      bar_arrive(kBarFull + (it & 1), 384);
      ci_c = ci_n;
    }
    return;
  }

  // ---------------- the state warpgroups ----------------
  setmaxnreg_inc<kRegsState>();
  const int vt = vt0 + wg, cw = wg * F::TW;
  float S[K / 8][4];
  if (run.zero) zero_acc(S);
  else load_state_tile<K, K, F::TW>(p, S, false, false, u, un.n, hv, vt, vr, 0, g8, q);

  // O's rows [0, len) from the staging tile Os to og (row stride tok_o), 16 bytes per lane
  auto copy_o = [&](St* og, int len) {
    constexpr int EPV = 16 / sizeof(St), VPR = 2 * F::TW / EPV;
    for (int idx = tid; idx < C * VPR; idx += 256) {
      const int r = idx / VPR, cv = idx % VPR;
      if (r < len)
        *reinterpret_cast<int4*>(og + static_cast<int64_t>(r) * p.tok_o + cv * EPV) =
            *reinterpret_cast<const int4*>(Os + r * LDT + cv * EPV);
    }
  };
  St* pend_og = nullptr;  // the last chunk's output, staged in Os, copied out during the next chunk's products
  int pend_len = 0;

#pragma unroll 1
  for (int it = 0; it < n_it; ++it) {
    const int c = run.rb + it;
    bar_sync(kBarFull + (it & 1), 384);
    const St* Ks = reinterpret_cast<const St*>(kq_slot(it));
    unsigned char* sl = slot(it);
    const St* As = reinterpret_cast<const St*>(sl + F::A_OFF);
    const St* Ts = reinterpret_cast<const St*>(sl + F::T_OFF);
    const unsigned char* Us = sl + F::V_OFF;
    const float* gs = gates(it);
    const float* eg = gs + C;
    const float* egl = gs + 2 * C;
    const ChunkInfo ci = chunk_info(p, c, un.n);
    // a warm-up chunk (before the run's own) only carries the state: its output is not formed. (Its products
    // run as any chunk's, on a slot whose Q and A the producer left unwritten: a product under a branch would be
    // serialized by ptxas, and the producer, not these warpgroups, bounds the kernel.)
    const bool out = c >= run.ob;

    // S^T [K | Q]^T as one 64 x 128 product (N-tiles 0..7: S^T K^T, 8..15: S^T Q^T): the state's fragments are
    // converted once and the accumulators of the two parts are not live beside a second copy of them
    float acc[16][4];
    {
      FragA<St> sa[K / 16];
#pragma unroll
      for (int kk = 0; kk < K / 16; ++kk) sa[kk] = frag_a_from_c<St>(S[2 * kk], S[2 * kk + 1]);
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < K / 16; ++kk)
        wgmma_rs<St, 0>(acc, sa[kk], sw128_desc(Ks + (kk >> 2) * 128 * 64 + (kk & 3) * 16, 16), kk > 0);
      wg_commit();
      if (pend_len > 0) copy_o(pend_og, pend_len);  // (staged before the barrier that opened this chunk)
      pend_len = 0;
      bar_sync(kBarState, 256);  // Os is written again below
      wg_wait<0>();
      wg_fence_acc(acc);
    }

    // X^T = V^T - (K S)^T diag(e^gam), then Vn^T = X^T (Tm diag(beta))^T
    float vn[8][4];
    {
      FragA<St> xa[4];
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const FragA<St> va = lda_t_sw128<St, 64>(Us, cw + vr * 16, 16 * kk);
        float x[2][4];
#pragma unroll
        for (int t = 0; t < 2; ++t) {
          const int nt = 2 * kk + t, j0 = 8 * nt + 2 * q;
          const float e0 = eg[j0], e1 = eg[j0 + 1];
          const float2 v0 = unpack2<St>(va.x[2 * t]), v1 = unpack2<St>(va.x[2 * t + 1]);
          x[t][0] = v0.x - acc[nt][0] * e0;
          x[t][1] = v0.y - acc[nt][1] * e1;
          x[t][2] = v1.x - acc[nt][2] * e0;
          x[t][3] = v1.y - acc[nt][3] * e1;
        }
        xa[kk] = frag_a_from_c<St>(x[0], x[1]);
      }
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) wgmma_rs<St, 0>(vn, xa[kk], sw128_desc(Ts + 16 * kk, 16), kk > 0);
      wg_commit();
      // the S^T Q^T part by scale e^gam while Vn's product runs
      if (out) {
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[8 + nt][e] *= p.scale * eg[8 * nt + 2 * q + (e & 1)];
      }
      wg_wait<0>();
      wg_fence_acc(vn);
    }

    // S^T <- e^{gam_L} S^T + (Vn^T diag(e^{gam_L - gam})) K, then the output's (scale Vn^T) A^T into a fresh
    // accumulator
    St* const og = static_cast<St*>(p.o) + ci.bos * p.tok_o + hv * p.ld_o + vt0 * F::TW;
    const float dl = exp2_approx(gs[C - 1]);
#pragma unroll
    for (int nt = 0; nt < K / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) S[nt][e] *= dl;
    FragA<St> ka[4];
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const int j0 = 16 * kk + 2 * q;
      const float fk[4] = {egl[j0], egl[j0 + 1], egl[j0 + 8], egl[j0 + 9]};
      ka[kk] = frag_a_from_c_cols<St>(vn[2 * kk], vn[2 * kk + 1], fk);
    }
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_rs<St, 1>(S, ka[kk], sw128_desc(Ks + 16 * kk * 64, F::KQ_BYTES / 2), 1);
    wg_commit();
    float o2[8][4];
    FragA<St> va[4];
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) va[kk] = frag_a_from_c<St>(vn[2 * kk], vn[2 * kk + 1], p.scale);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_rs<St, 0>(o2, va[kk], sw128_desc(As + 16 * kk, 16), kk > 0);
    wg_commit();
    wg_wait<0>();
    wg_fence_acc(S);
    wg_fence_acc(o2);
    // every read of this chunk's slots is done (the products are complete): the producer may refill them
    if (it + 2 < n_it) bar_arrive(kBarEmpty + (it & 1), 384);
    if (out) {
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = 8 * nt + 2 * q + (e & 1), vloc = vr * 16 + g8 + 8 * (e >> 1);
          Os[i * LDT + cw + vloc] = from_f<St>(acc[8 + nt][e] + o2[nt][e]);
        }
      pend_og = og;
      pend_len = ci.len;
    }
  }
  if (pend_len > 0) {
    bar_sync(kBarState, 256);
    copy_o(pend_og, pend_len);
  }
  if (run.fin) store_state_tile<K, K, F::TW>(p, S, false, u, un.n, hv, vt, vr, 0, g8, q);
}

void launch_fwd_fused(const Params& p, DType dtype, void* stream) {
  if (p.num_units == 0) return;
  TORCH_CHECK(fwd_fused_applies(dtype, p.K, p.V, p.tile32, /*scan=*/false),
              "gated_delta CUDA: the one-kernel forward takes 16-bit inputs with K = 128, V a multiple of 128 and "
              "the state pass in 64-column tiles");
  TORCH_CHECK(p.warm == 0 || p.seg_ok != nullptr, "gated_delta CUDA: the one-kernel forward's segments need seg_ok");
  TORCH_CHECK((p.A == nullptr) == (p.gam == nullptr) && (p.A == nullptr) == (p.Tm == nullptr),
              "gated_delta CUDA: the one-kernel forward stores A, gam and Tm together or none of them");
  auto go = [&](auto st) {
    using St = decltype(st);
    using F = FusedFwdCfg<St>;
    auto kern = fwd_fused_kernel<St>;
    GD_CUDA_CHECK(set_max_smem(reinterpret_cast<const void*>(kern), F::bytes));
    constexpr bool half = std::is_same_v<St, __half>;
    // (v's map: a token's HV heads, ld_v apart, in rows tok_v apart; the boxes read each head's first V columns)
    const int64_t HK = static_cast<int64_t>(p.H) * p.K, HVV = static_cast<int64_t>(p.HV) * p.ld_v;
    const CUtensorMap tk = tma_map_16bit(p.k, half, p.BT, HK, HK, C);
    const CUtensorMap tq = tma_map_16bit(p.q, half, p.BT, HK, HK, C);
    const CUtensorMap tv = tma_map_16bit(p.v, half, p.BT, HVV, p.tok_v, C);
    const dim3 grid(pass_grid_units(p), p.V / 128, p.HV);
    kern<<<grid, F::NT, F::bytes, static_cast<cudaStream_t>(stream)>>>(p, tk, tq, tv);
    GD_CUDA_LAUNCH_CHECK();
  };
  if (dtype == DType::kHalf) go(__half{});
  else go(__nv_bfloat16{});
}

}  // namespace cuda
}  // namespace gated_delta
