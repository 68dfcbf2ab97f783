// Standalone check of the warpgroup product wrappers of csrc/cuda/delta_rule/wgmma.cuh on an sm_90a GPU (run by
// tests/test_wgmma.py): D = A B for one warpgroup, A (64 x KD) from registers in the mma.sync fragment layout, B
// from a sw128 shared-memory tile written by load_tile_sw128, K-major (TB = 0) and N-major (TB = 1), N = 64 and 128,
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
template <int TB, int NT, int KD> int run() {
  constexpr int N = NT * 8;
  std::vector<bf> A(64 * KD), T(N * KD);
  std::vector<float> Af(64 * KD), Tf(N * KD), D(64 * N);
  for (int i = 0; i < 64 * KD; ++i) { A[i] = __float2bfloat16((rand() % 17 - 8) / 8.f); Af[i] = __bfloat162float(A[i]); }
  for (int i = 0; i < N * KD; ++i) { T[i] = __float2bfloat16((rand() % 17 - 8) / 8.f); Tf[i] = __bfloat162float(T[i]); }
  bf *dA, *dT; float* dD;
  cudaMalloc(&dA, A.size() * 2); cudaMalloc(&dT, T.size() * 2); cudaMalloc(&dD, D.size() * 4);
  cudaMemcpy(dA, A.data(), A.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dT, T.data(), T.size() * 2, cudaMemcpyHostToDevice);
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
int main() {
  int bad = 0;
  bad += run<0, 8, 64>(); bad += run<0, 16, 128>(); bad += run<1, 8, 64>(); bad += run<1, 16, 64>();
  printf(bad ? "WGTEST FAIL\n" : "WGTEST OK\n");
  return bad;
}
