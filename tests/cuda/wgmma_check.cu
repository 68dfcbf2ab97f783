// Standalone check of the warpgroup product wrappers of csrc/cuda/delta_rule/wgmma.cuh on an sm_90a GPU (run by
// tests/test_wgmma.py): D = A B for one warpgroup, B from a sw128 shared-memory tile written by load_tile_sw128,
// K-major (TB = 0) and N-major (TB = 1), N = 64 and 128, and A (64 x KD) from registers in the mma.sync fragment
// layout (wgmma_rs) or from a sw128 tile too (wgmma_ss_t: K-major, TA = 0, or M-major, TA = 1; negated with NEG),
// against the product on the host. The inputs are multiples of 1/8 in [-1, 1], so every product is exact in fp32.
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cmath>
#include "../../csrc/cuda/delta_rule/wgmma.cuh"
using namespace gated_delta::cuda;
using bf = __nv_bfloat16;
// A [64][KD] row-major; the tile is [N][KD] for TB = 0 (B[k][n] = tile[n][k]) and [KD][N] for TB = 1 (B[k][n] = tile[k][n])
template <int TB, int NT, int KD>
__global__ void kern(const bf* A, const bf* tile, float* D) {
  extern __shared__ __align__(16) unsigned char raw[];
  unsigned char* sm = raw + ((1024 - (smem_u32(raw) & 1023)) & 1023);
  constexpr int N = NT * 8;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, q = lane % 4;
  constexpr int ROWS = TB ? KD : N, COLS = TB ? N : KD;
  load_tile_sw128<bf, ROWS, COLS, ROWS, 128>(sm, 0, tile, COLS, ROWS, tid);
  cp_async_commit(); cp_async_wait<0>(); fence_async_smem(); __syncthreads();
  float d[NT][4];
  wg_fence();
  for (int kk = 0; kk < KD / 16; ++kk) {
    FragA<bf> a;
    auto at = [&](int r, int c) { return A[(16 * warp + r) * KD + 16 * kk + c]; };
    auto pk = [&](bf x, bf y) { __nv_bfloat162 v; v.x = x; v.y = y; return *reinterpret_cast<uint32_t*>(&v); };
    a.x[0] = pk(at(g, 2 * q), at(g, 2 * q + 1));
    a.x[1] = pk(at(g + 8, 2 * q), at(g + 8, 2 * q + 1));
    a.x[2] = pk(at(g, 2 * q + 8), at(g, 2 * q + 9));
    a.x[3] = pk(at(g + 8, 2 * q + 8), at(g + 8, 2 * q + 9));
    const bf* t = reinterpret_cast<const bf*>(sm);
    uint64_t desc = TB ? sw128_desc(t + 16 * kk * 64, ROWS * 128) : sw128_desc(t + (kk >> 2) * ROWS * 64 + (kk & 3) * 16, 16);
    wgmma_rs<bf, TB>(d, a, desc, kk > 0);
  }
  wg_commit(); wg_wait<0>(); wg_fence_acc(d);
  for (int nt = 0; nt < NT; ++nt)
    for (int e = 0; e < 4; ++e) D[(16 * warp + g + 8 * (e >> 1)) * N + 8 * nt + 2 * q + (e & 1)] = d[nt][e];
}
// n multiples of 1/8 in [-1, 1] as bf16 on the device, their values in f (host)
bf* random_operand(int n, std::vector<float>& f) {
  std::vector<bf> h(n);
  f.resize(n);
  for (int i = 0; i < n; ++i) { h[i] = __float2bfloat16((rand() % 17 - 8) / 8.f); f[i] = __bfloat162float(h[i]); }
  bf* d;
  cudaMalloc(&d, n * 2);
  cudaMemcpy(d, h.data(), n * 2, cudaMemcpyHostToDevice);
  return d;
}
template <int TB, int NT, int KD> int run() {
  constexpr int N = NT * 8;
  std::vector<float> Af, Tf, D(64 * N);
  bf* dA = random_operand(64 * KD, Af);
  bf* dT = random_operand(N * KD, Tf);
  float* dD;
  cudaMalloc(&dD, D.size() * 4);
  cudaFuncSetAttribute(kern<TB, NT, KD>, cudaFuncAttributeMaxDynamicSharedMemorySize, 80000);
  kern<TB, NT, KD><<<1, 128, 80000>>>(dA, dT, dD);
  cudaError_t e = cudaDeviceSynchronize();
  cudaMemcpy(D.data(), dD, D.size() * 4, cudaMemcpyDeviceToHost);
  double err = 0;
  for (int m = 0; m < 64; ++m)
    for (int n = 0; n < N; ++n) {
      double ref = 0;
      for (int k = 0; k < KD; ++k) ref += Af[m * KD + k] * (TB ? Tf[k * N + n] : Tf[n * KD + k]);
      err = fmax(err, fabs(ref - D[m * N + n]));
    }
  printf("wgtest TB=%d N=%d KD=%d: %s max abs err %g\n", TB, N, KD, cudaGetErrorString(e), err);
  return err < 1e-3 ? 0 : 1;
}
// wgmma_ss_t: A's tile is [64][KD] for TA = 0 (A[m][k] = tile[m][k]) and [KD][64] for TA = 1 (A[m][k] = tile[k][m])
template <int TA, int TB, int NT, int KD, bool NEG>
__global__ void kern_ss(const bf* atile, const bf* tile, float* D) {
  extern __shared__ __align__(16) unsigned char raw[];
  unsigned char* sm = raw + ((1024 - (smem_u32(raw) & 1023)) & 1023);
  constexpr int N = NT * 8;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, q = lane % 4;
  constexpr int ROWS = TB ? KD : N, COLS = TB ? N : KD;
  constexpr int AROWS = TA ? KD : 64, ACOLS = TA ? 64 : KD;
  constexpr int BBYTES = ROWS * COLS * 2;  // (a multiple of 1024)
  load_tile_sw128<bf, ROWS, COLS, ROWS, 128>(sm, 0, tile, COLS, ROWS, tid);
  load_tile_sw128<bf, AROWS, ACOLS, AROWS, 128>(sm + BBYTES, 0, atile, ACOLS, AROWS, tid);
  cp_async_commit(); cp_async_wait<0>(); fence_async_smem(); __syncthreads();
  float d[NT][4];
  const bf* t = reinterpret_cast<const bf*>(sm);
  const bf* ta = reinterpret_cast<const bf*>(sm + BBYTES);
  wg_fence();
  for (int kk = 0; kk < KD / 16; ++kk) {
    const uint64_t db = TB ? sw128_desc(t + 16 * kk * 64, ROWS * 128) : sw128_desc(t + (kk >> 2) * ROWS * 64 + (kk & 3) * 16, 16);
    const uint64_t da = TA ? sw128_desc(ta + 16 * kk * 64, AROWS * 128) : sw128_desc(ta + (kk >> 2) * AROWS * 64 + (kk & 3) * 16, 16);
    wgmma_ss_t<bf, TA, TB, NT, NEG>(d, da, db, kk > 0);
  }
  wg_commit(); wg_wait<0>(); wg_fence_acc(d);
  for (int nt = 0; nt < NT; ++nt)
    for (int e = 0; e < 4; ++e) D[(16 * warp + g + 8 * (e >> 1)) * N + 8 * nt + 2 * q + (e & 1)] = d[nt][e];
}
template <int TA, int TB, int NT, int KD, bool NEG> int run_ss() {
  constexpr int N = NT * 8;
  std::vector<float> Af, Tf, D(64 * N);
  bf* dA = random_operand(64 * KD, Af);
  bf* dT = random_operand(N * KD, Tf);
  float* dD;
  cudaMalloc(&dD, D.size() * 4);
  cudaFuncSetAttribute(kern_ss<TA, TB, NT, KD, NEG>, cudaFuncAttributeMaxDynamicSharedMemorySize, 80000);
  kern_ss<TA, TB, NT, KD, NEG><<<1, 128, 80000>>>(dA, dT, dD);
  cudaError_t e = cudaDeviceSynchronize();
  cudaMemcpy(D.data(), dD, D.size() * 4, cudaMemcpyDeviceToHost);
  double err = 0;
  for (int m = 0; m < 64; ++m)
    for (int n = 0; n < N; ++n) {
      double ref = 0;
      for (int k = 0; k < KD; ++k)
        ref += (TA ? Af[k * 64 + m] : Af[m * KD + k]) * (TB ? Tf[k * N + n] : Tf[n * KD + k]);
      err = fmax(err, fabs((NEG ? -ref : ref) - D[m * N + n]));
    }
  printf("wgtest ss TA=%d TB=%d N=%d KD=%d NEG=%d: %s max abs err %g\n", TA, TB, N, KD, int(NEG), cudaGetErrorString(e),
         err);
  return err < 1e-3 ? 0 : 1;
}
int main() {
  int bad = 0;
  bad += run<0, 8, 64>(); bad += run<0, 16, 128>(); bad += run<1, 8, 64>(); bad += run<1, 16, 64>();
  // the both-operands-in-shared-memory forms grad_qk's and grad_wy's warpgroup kernels use
  bad += run_ss<0, 0, 8, 128, false>(); bad += run_ss<0, 1, 8, 64, false>(); bad += run_ss<1, 0, 8, 64, false>();
  bad += run_ss<1, 1, 8, 64, false>(); bad += run_ss<1, 1, 16, 64, true>(); bad += run_ss<0, 1, 16, 64, true>();
  printf(bad ? "WGTEST FAIL\n" : "WGTEST OK\n");
  return bad;
}
