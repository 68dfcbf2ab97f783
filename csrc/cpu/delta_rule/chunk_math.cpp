// The dense work of one chunk (docs/algorithms.md, "Chunk" and "Scan"): forward from a given entering state,
// backward given the gradient of the leaving state, and the chunk's affine maps of the state.
//
// Rows i, j = 0..L-1 of a chunk, S the state entering it:
//   gamma_i = g_0 + ... + g_i (accumulated in double, restarted at every chunk), each g read as max(g, -40): e^-40
//          (4e-18) is below double resolution, so results are the same to rounding, and a hard reset g = -inf,
//          whose e^{gamma_i - gamma_j} would be e^{-inf + inf}, is the reset it means (NaN passes)
//   E_ij = e^{gamma_i - gamma_j} for i >= j only (masked entries are set to 0, never computed), so a reset
//          (g = -1e4) or no decay (g = 0) neither overflows nor produces inf * 0
//   M = strictly_lower(diag(beta) (K K^T) o E),  Tm = (I + M)^{-1} by forward substitution
//   Xk = diag(beta e^gamma) K,  Z = diag(beta) V - Xk S,  Vn = Tm Z
//   A = lower(Q K^T o E),  O = scale (diag(e^gamma) Q S + A Vn),  S' = e^{gamma_L} S + K~^T Vn
#include <cmath>
#include <cstring>

#include "algorithms.h"

namespace gated_delta {
namespace cpu {

template <typename T>
ChunkWork<T>::ChunkWork(int64_t C_, int64_t K_, int64_t V_) : C(C_), K(K_), V(V_), eL(0) {
  const int64_t CC = C * C, CK = C * K, CV = C * V;
  gam.resize(C);
  dgam.resize(C);
  dbeta.resize(C);
  eg.resize(C);
  eLg.resize(C);
  bEg.resize(C);
  for (auto* m : {&E, &KE, &M, &Tm, &A, &dA, &dM, &RR}) m->resize(CC);
  for (auto* m : {&Xk, &Qe, &Kt, &W, &dKt, &Y}) m->resize(CK);
  for (auto* m : {&Z, &Vn, &dVn, &Ub}) m->resize(CV);
}

namespace {

// Gate factors, M, Tm, and (when need_A) A; the row-scaled copies Xk, Qe, Kt.
template <typename T>
void chunk_prepare(const ChunkIn<T>& c, ChunkWork<T>& w, bool need_A) {
  const int64_t L = c.L, K = w.K;
  constexpr double kGateFloor = 40.0;
  double acc = 0;
  for (int64_t i = 0; i < L; ++i) {
    const double g = static_cast<double>(c.g[i]);
    acc += g < -kGateFloor ? -kGateFloor : g;
    w.gam[i] = acc;
  }
  const double gL = w.gam[L - 1];
  w.eL = std::exp(static_cast<T>(gL));
  for (int64_t i = 0; i < L; ++i) {
    w.eg[i] = std::exp(static_cast<T>(w.gam[i]));
    w.eLg[i] = std::exp(static_cast<T>(gL - w.gam[i]));
    w.bEg[i] = c.beta[i] * w.eg[i];
  }
  T* E = w.E.data();
  for (int64_t i = 0; i < L; ++i) {
    T* Ei = E + i * L;
    for (int64_t j = 0; j <= i; ++j) Ei[j] = std::exp(static_cast<T>(w.gam[i] - w.gam[j]));
    for (int64_t j = i + 1; j < L; ++j) Ei[j] = T(0);
  }
  // KE = strictly_lower((K K^T) o E), M = diag(beta) KE
  T* KE = w.KE.data();
  T* M = w.M.data();
  gemm(false, true, L, L, K, T(1), c.k, K, c.k, K, T(0), KE, L);
  for (int64_t i = 0; i < L; ++i) {
    const T bi = c.beta[i];
    for (int64_t j = 0; j < i; ++j) {
      KE[i * L + j] *= E[i * L + j];
      M[i * L + j] = bi * KE[i * L + j];
    }
    for (int64_t j = i; j < L; ++j) {
      KE[i * L + j] = T(0);
      M[i * L + j] = T(0);
    }
  }
  // Tm = (I + M)^{-1}: row i of (I + M) Tm = I gives Tm_i = e_i - sum_{j<i} M_ij Tm_j, and row j of the unit
  // lower triangular Tm is zero right of column j.
  T* Tm = w.Tm.data();
  for (int64_t i = 0; i < L; ++i) {
    T* ti = Tm + i * L;
    for (int64_t col = 0; col < L; ++col) ti[col] = T(0);
    ti[i] = T(1);
    for (int64_t j = 0; j < i; ++j) {
      const T m = M[i * L + j];
      const T* tj = Tm + j * L;
      for (int64_t col = 0; col <= j; ++col) ti[col] -= m * tj[col];
    }
  }
  if (need_A) {
    T* A = w.A.data();
    gemm(false, true, L, L, K, T(1), c.q, K, c.k, K, T(0), A, L);
    for (int64_t i = 0; i < L; ++i) {
      for (int64_t j = 0; j <= i; ++j) A[i * L + j] *= E[i * L + j];
      for (int64_t j = i + 1; j < L; ++j) A[i * L + j] = T(0);
    }
  }
  for (int64_t i = 0; i < L; ++i) {
    const T* ki = c.k + i * K;
    const T* qi = c.q + i * K;
    T* xk = w.Xk.data() + i * K;
    T* qe = w.Qe.data() + i * K;
    T* kt = w.Kt.data() + i * K;
    const T b = w.bEg[i], e = w.eg[i], el = w.eLg[i];
    for (int64_t d = 0; d < K; ++d) {
      xk[d] = b * ki[d];
      qe[d] = e * qi[d];
      kt[d] = el * ki[d];
    }
  }
}

// Z = diag(beta) V (- Xk S when S is given), then Vn = Tm Z.
template <typename T>
void corrected_values(const ChunkIn<T>& c, const T* S, ChunkWork<T>& w) {
  const int64_t L = c.L, K = w.K, V = w.V;
  T* Z = w.Z.data();
  for (int64_t i = 0; i < L; ++i) {
    const T b = c.beta[i];
    const T* vi = c.v + i * V;
    T* zi = Z + i * V;
    for (int64_t d = 0; d < V; ++d) zi[d] = b * vi[d];
  }
  if (S != nullptr) gemm(false, false, L, V, K, T(-1), w.Xk.data(), K, S, V, T(1), Z, V);
  gemm(false, false, L, V, L, T(1), w.Tm.data(), L, Z, V, T(0), w.Vn.data(), V);
}

// dst = a * src (K x V); dst may be src. Multiplies rather than skips, so a NaN state stays NaN after a reset.
template <typename T>
void scale_state(T* dst, const T* src, T a, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = a * src[i];
}

}  // namespace

template <typename T>
void chunk_forward_step(const ChunkIn<T>& c, T scale, const T* S, T* S_next, T* o, ChunkWork<T>& w) {
  const int64_t L = c.L, K = w.K, V = w.V;
  chunk_prepare(c, w, /*need_A=*/o != nullptr);
  corrected_values(c, S, w);
  if (o != nullptr) {
    gemm(false, false, L, V, K, scale, w.Qe.data(), K, S, V, T(0), o, V);
    gemm(false, false, L, V, L, scale, w.A.data(), L, w.Vn.data(), V, T(1), o, V);
  }
  if (S_next != nullptr) {
    scale_state(S_next, S, w.eL, K * V);
    gemm(true, false, K, V, L, T(1), w.Kt.data(), K, w.Vn.data(), V, T(1), S_next, V);
  }
}

template <typename T>
void chunk_backward_step(const ChunkIn<T>& c, T scale, const T* S, const T* dSn, const T* dO, T* dS, T* dq, T* dk,
                         T* dv, T* dg, T* dbeta, ChunkWork<T>& w) {
  const int64_t L = c.L, K = w.K, V = w.V;
  chunk_prepare(c, w, /*need_A=*/true);
  corrected_values(c, S, w);
  const T* E = w.E.data();
  const T* A = w.A.data();
  const T* M = w.M.data();
  const T* KE = w.KE.data();
  T* dVn = w.dVn.data();
  T* dA = w.dA.data();
  T* dM = w.dM.data();
  T* RR = w.RR.data();
  T* dKt = w.dKt.data();
  T* Ub = w.Ub.data();
  T* Y = w.Y.data();
  double* dgam = w.dgam.data();
  double* dbacc = w.dbeta.data();

  // dVn = s A^T dO + K~ dS',  dK~ = Vn dS'^T
  gemm(true, false, L, V, L, scale, A, L, dO, V, T(0), dVn, V);
  if (dSn != nullptr) {
    gemm(false, false, L, V, K, T(1), w.Kt.data(), K, dSn, V, T(1), dVn, V);
    gemm(false, true, L, K, V, T(1), w.Vn.data(), V, dSn, V, T(0), dKt, K);
  } else {
    std::memset(dKt, 0, sizeof(T) * L * K);
  }
  // dA = s dO Vn^T (used for i >= j)
  gemm(false, true, L, L, V, scale, dO, V, w.Vn.data(), V, T(0), dA, L);
  // Ub = Tm^T dVn (the gradient of Z),  Y = -Ub S^T (of Xk),  dM = -Ub Vn^T (used for i > j)
  gemm(true, false, L, V, L, T(1), w.Tm.data(), L, dVn, V, T(0), Ub, V);
  gemm(false, true, L, K, V, T(-1), Ub, V, S, V, T(0), Y, K);
  gemm(false, true, L, L, V, T(-1), Ub, V, w.Vn.data(), V, T(0), dM, L);
  // dq = s diag(e^gamma) dO S^T + (dA o E) K; the first part also gives dgamma's output term q_i . dq_i
  gemm(false, true, L, K, V, scale, dO, V, S, V, T(0), dq, K);
  for (int64_t i = 0; i < L; ++i) {
    T* dqi = dq + i * K;
    const T* qi = c.q + i * K;
    const T e = w.eg[i];
    T acc = 0;
    for (int64_t d = 0; d < K; ++d) {
      dqi[d] *= e;
      acc += qi[d] * dqi[d];
    }
    dgam[i] = acc;
    dbacc[i] = 0;
  }
  // Elementwise L x L terms: dgamma from E inside A and M, dbeta from M; dA <- dA o E (masked), RR = R + R^T
  // with R_ij = dM_ij beta_i E_ij (strictly lower).
  for (int64_t i = 0; i < L; ++i) {
    const T bi = c.beta[i];
    for (int64_t j = 0; j < i; ++j) {
      const int64_t ij = i * L + j;
      const double pa = static_cast<double>(dA[ij]) * A[ij];
      const double pm = static_cast<double>(dM[ij]) * M[ij];
      dgam[i] += pa + pm;
      dgam[j] -= pa + pm;
      dbacc[i] += static_cast<double>(dM[ij]) * KE[ij];
      dA[ij] *= E[ij];
      const T r = dM[ij] * bi * E[ij];
      RR[ij] = r;
      RR[j * L + i] = r;
    }
    dA[i * L + i] *= E[i * L + i];
    RR[i * L + i] = T(0);
    for (int64_t j = i + 1; j < L; ++j) dA[i * L + j] = T(0);
  }
  gemm(false, false, L, K, L, T(1), dA, L, c.k, K, T(1), dq, K);
  // dk = (dA o E)^T Q + (R + R^T) K + diag(e^{gamma_L - gamma}) dK~ + diag(beta e^gamma) Y
  gemm(true, false, L, K, L, T(1), dA, L, c.q, K, T(0), dk, K);
  gemm(false, false, L, K, L, T(1), RR, L, c.k, K, T(1), dk, K);
  double kt_dkt_sum = 0;
  for (int64_t i = 0; i < L; ++i) {
    const T* ki = c.k + i * K;
    const T* kti = w.Kt.data() + i * K;
    const T* dkti = dKt + i * K;
    const T* yi = Y + i * K;
    T* dki = dk + i * K;
    const T el = w.eLg[i], be = w.bEg[i];
    T k_y = 0, kt_dkt = 0;
    for (int64_t d = 0; d < K; ++d) {
      dki[d] += el * dkti[d] + be * yi[d];
      k_y += ki[d] * yi[d];
      kt_dkt += kti[d] * dkti[d];
    }
    const T* vi = c.v + i * V;
    const T* ubi = Ub + i * V;
    T* dvi = dv + i * V;
    const T bi = c.beta[i];
    T v_ub = 0;
    for (int64_t d = 0; d < V; ++d) {
      dvi[d] = bi * ubi[d];
      v_ub += vi[d] * ubi[d];
    }
    dbeta[i] = static_cast<T>(static_cast<double>(v_ub) + static_cast<double>(w.eg[i]) * k_y + dbacc[i]);
    dgam[i] += static_cast<double>(be) * k_y - kt_dkt;
    kt_dkt_sum += kt_dkt;
  }
  double s_dsn = 0;
  if (dSn != nullptr) {
    for (int64_t i = 0; i < K * V; ++i) s_dsn += static_cast<double>(S[i]) * dSn[i];
  }
  dgam[L - 1] += static_cast<double>(w.eL) * s_dsn + kt_dkt_sum;
  double run = 0;
  for (int64_t i = L - 1; i >= 0; --i) {
    run += dgam[i];
    dg[i] = static_cast<T>(run);
  }
  // dS = e^{gamma_L} dS' + s Qe^T dO - Xk^T Ub  (last: dS may alias dS')
  if (dS != nullptr) {
    if (dSn != nullptr) {
      scale_state(dS, dSn, w.eL, K * V);
      gemm(true, false, K, V, L, scale, w.Qe.data(), K, dO, V, T(1), dS, V);
    } else {
      gemm(true, false, K, V, L, scale, w.Qe.data(), K, dO, V, T(0), dS, V);
    }
    gemm(true, false, K, V, L, T(-1), w.Xk.data(), K, Ub, V, T(1), dS, V);
  }
}

template <typename T>
void chunk_maps(const ChunkIn<T>& c, T scale, const T* dO, T* Am, T* Bm, T* bm, ChunkWork<T>& w) {
  const int64_t L = c.L, K = w.K, V = w.V;
  chunk_prepare(c, w, /*need_A=*/dO != nullptr);
  // W = Tm Xk;  Am = e^{gamma_L} I - K~^T W
  T* W = w.W.data();
  gemm(false, false, L, K, L, T(1), w.Tm.data(), L, w.Xk.data(), K, T(0), W, K);
  for (int64_t i = 0; i < K * K; ++i) Am[i] = T(0);
  for (int64_t i = 0; i < K; ++i) Am[i * K + i] = w.eL;
  gemm(true, false, K, K, L, T(-1), w.Kt.data(), K, W, K, T(1), Am, K);
  // Bm = K~^T U with U = Tm diag(beta) V
  if (Bm != nullptr) {
    corrected_values<T>(c, nullptr, w);
    gemm(true, false, K, V, L, T(1), w.Kt.data(), K, w.Vn.data(), V, T(0), Bm, V);
  }
  // bm = s Qe^T dO - W^T (s A^T dO)
  if (dO != nullptr && bm != nullptr) {
    T* dVn = w.dVn.data();
    gemm(true, false, L, V, L, scale, w.A.data(), L, dO, V, T(0), dVn, V);
    gemm(true, false, K, V, L, scale, w.Qe.data(), K, dO, V, T(0), bm, V);
    gemm(true, false, K, V, L, T(-1), W, K, dVn, V, T(1), bm, V);
  }
}

#define GATED_DELTA_INSTANTIATE(T)                                                                              \
  template struct ChunkWork<T>;                                                                                 \
  template void chunk_forward_step<T>(const ChunkIn<T>&, T, const T*, T*, T*, ChunkWork<T>&);                  \
  template void chunk_backward_step<T>(const ChunkIn<T>&, T, const T*, const T*, const T*, T*, T*, T*, T*, T*, \
                                       T*, ChunkWork<T>&);                                                      \
  template void chunk_maps<T>(const ChunkIn<T>&, T, const T*, T*, T*, T*, ChunkWork<T>&);
GATED_DELTA_INSTANTIATE(float)
GATED_DELTA_INSTANTIATE(double)
#undef GATED_DELTA_INSTANTIATE

}  // namespace cpu
}  // namespace gated_delta
