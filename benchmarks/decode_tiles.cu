// Microbenchmark of the library's decode-step kernel (csrc/cuda/layer_decode.cu, included) in several tile shapes:
// H=16, HV=32, K=V=128, bf16 inputs, random fp32 state, B in {1, 64, 256}; prints microseconds per step (median of
// 25 timings of 20 launches) and the ratio to one read and one write of the state at the measured copy bandwidth.
//   nvcc -O3 -arch=sm_90a -std=c++17 -o /tmp/decode_tiles benchmarks/decode_tiles.cu && /tmp/decode_tiles
// Labels: ctX rtY = X column threads (4 columns each) by Y row threads; "stream" = evict-first loads and stores.
#include "../csrc/cuda/layer_decode.cu"
#include <cstdio>
#include <vector>
#include <algorithm>
using namespace gated_delta::layer_cuda;
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)
__device__ float rnd(size_t i) { unsigned x = (unsigned)(i * 2654435761u) ^ (unsigned)(i >> 32); x ^= x >> 16; x *= 0x7feb352du; x ^= x >> 15; x *= 0x846ca68bu; x ^= x >> 16; return (x & 0xffffff) / 8388608.f - 1.f; }
__global__ void fill(float* x, size_t n, float s) { for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) x[i] = s * rnd(i); }
__global__ void fillh(__nv_bfloat16* x, size_t n) { for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) x[i] = __float2bfloat16(rnd(i + 12345)); }
template <class F> float timeit(F f, int reps = 25) {
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  for (int i = 0; i < 5; ++i) f();
  std::vector<float> t;
  for (int r = 0; r < reps; ++r) { cudaEventRecord(a); for (int i = 0; i < 20; ++i) f(); cudaEventRecord(b); cudaEventSynchronize(b); float ms; cudaEventElapsedTime(&ms, a, b); t.push_back(ms * 50.f); }
  std::sort(t.begin(), t.end()); CK(cudaGetLastError()); return t[t.size() / 2];
}
int main() {
  float *src, *dst; const size_t cn = 1ull << 28;
  CK(cudaMalloc(&src, cn * 4)); CK(cudaMalloc(&dst, cn * 4)); fill<<<1024, 256>>>(src, cn, 1.f);
  float cms = timeit([&] { cudaMemcpyAsync(dst, src, cn * 4, cudaMemcpyDeviceToDevice); }, 10);
  double bw = 2.0 * cn * 4 / (cms * 1e-6);
  cudaFree(src); cudaFree(dst);
  for (int B : {1, 64, 256}) {
    DecodeParams p; p.B = B; p.T = 1; p.H = 16; p.HV = 32; p.K = 128; p.V = 128; p.scale = 0.088f;
    p.dtype = p.a_dtype = p.b_dtype = kBFloat16; p.A_dtype = p.dt_dtype = kFloat;
    const size_t sn = (size_t)B * 32 * 128 * 128;
    float* S; CK(cudaMalloc(&S, sn * 4)); fill<<<1024, 256>>>(S, sn, 0.01f); p.state = S;
    __nv_bfloat16 *q, *k, *v, *a, *b, *o; float *Al, *dt;
    CK(cudaMalloc(&q, B * 16 * 128 * 2)); CK(cudaMalloc(&k, B * 16 * 128 * 2)); CK(cudaMalloc(&v, B * 32 * 128 * 2));
    CK(cudaMalloc(&a, B * 32 * 2)); CK(cudaMalloc(&b, B * 32 * 2)); CK(cudaMalloc(&o, B * 32 * 128 * 2));
    CK(cudaMalloc(&Al, 32 * 4)); CK(cudaMalloc(&dt, 32 * 4));
    fillh<<<64, 256>>>(q, B * 16 * 128); fillh<<<64, 256>>>(k, B * 16 * 128); fillh<<<64, 256>>>(v, B * 32 * 128);
    fillh<<<64, 256>>>(a, B * 32); fillh<<<64, 256>>>(b, B * 32); fill<<<1, 32>>>(Al, 32, 0.5f); fill<<<1, 32>>>(dt, 32, 0.5f);
    p.q = q; p.k = k; p.v = v; p.a = a; p.b = b; p.o = o; p.A_log = Al; p.dt_bias = dt;
    double floor_us = 2.0 * sn * 4 / bw * 1e6;
    printf("B=%d copy bw %.2f TB/s floor %.1f us\n", B, bw / 1e12, floor_us);
    auto row = [&](const char* n, float us) { printf("  %-28s %7.1f us %.3fx\n", n, us, us / floor_us); };
    row("decode_step (dispatch)", timeit([&] { decode_step(p, 0); }));
    row("ct8 rt16", timeit([&] { launch_config<__nv_bfloat16, 128, 8, 16, false>(p, 0); }));
    row("ct8 rt16 stream", timeit([&] { launch_config<__nv_bfloat16, 128, 8, 16, true>(p, 0); }));
    row("ct16 rt16", timeit([&] { launch_config<__nv_bfloat16, 128, 16, 16, false>(p, 0); }));
    row("ct16 rt16 stream", timeit([&] { launch_config<__nv_bfloat16, 128, 16, 16, true>(p, 0); }));
    row("ct32 rt8", timeit([&] { launch_config<__nv_bfloat16, 128, 32, 8, false>(p, 0); }));
    row("ct32 rt8 stream", timeit([&] { launch_config<__nv_bfloat16, 128, 32, 8, true>(p, 0); }));
    row("ct16 rt8", timeit([&] { launch_config<__nv_bfloat16, 128, 16, 8, false>(p, 0); }));
    row("ct16 rt8 stream", timeit([&] { launch_config<__nv_bfloat16, 128, 16, 8, true>(p, 0); }));
    row("ct32 rt4 stream", timeit([&] { launch_config<__nv_bfloat16, 128, 32, 4, true>(p, 0); }));
    cudaFree(S); cudaFree(q); cudaFree(k); cudaFree(v); cudaFree(a); cudaFree(b); cudaFree(o); cudaFree(Al); cudaFree(dt);
  }
}
