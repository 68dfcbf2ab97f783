// CUDA kernel of the fused decode step of the gated delta rule: for T (few) new tokens against a cached fp32
// state S [B, HV, K, V], updated in place, with q, k L2-normalised, g = -exp(A_log) softplus(a + dt_bias),
// alpha = exp(g), beta = sigmoid(b) (x2 with allow_neg_eigval). The per-token update and the thread layout are
// the register tile of decode_tile.cuh.
//
// Decode is memory-bound (each (b, hv) state is K*V*4 bytes, 64 KB at K = V = 128, against ~1 KB of inputs), so
// the grid splits V into column tiles: block (v tile, hv, b). The state tile stays in registers across the T
// tokens. The streaming (evict-first) hints on the state measured 15-20% faster at B >= 64.
#include "decode_tile.cuh"

namespace gated_delta {
namespace layer_cuda {
namespace {

template <class T, int K, int CT, int RT, bool STREAM>
__global__ void __launch_bounds__(CT * RT) decode_step_kernel(DecodeParams p) {
  using Tile = DecodeTile<K, CT, RT>;
  __shared__ typename Tile::Shared sh;
  Tile tile;
  const int64_t hv = blockIdx.y, b = blockIdx.z;
  const int64_t h = hv / (p.HV / p.H);
  const int64_t c0 = tile.column(blockIdx.x);  // this thread's 4 columns
  const bool active = c0 < p.V;                 // V % 4 == 0: the 4 columns are in range together

  float* S = p.state + (b * p.HV + hv) * static_cast<int64_t>(K) * p.V;
  tile.template load<STREAM>(S, p.V, c0, active);

  const float neg_A = -__expf(load_as_float(p.A_log, p.A_dtype, hv));
  const float dt_bias = load_as_float(p.dt_bias, p.dt_dtype, hv);
  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  T* o = static_cast<T*>(p.o);

  for (int64_t t = 0; t < p.T; ++t) {
    const int64_t tok = b * p.T + t;
    const float alpha = gate_alpha(load_as_float(p.a, p.a_dtype, tok * p.HV + hv), neg_A, dt_bias);
    float beta = sigmoidf_(load_as_float(p.b, p.b_dtype, tok * p.HV + hv));
    if (p.allow_neg_eigval) beta *= 2.f;
    tile.step(sh, q + (tok * p.H + h) * K, k + (tok * p.H + h) * K, v + (tok * p.HV + hv) * p.V + c0,
              o + (tok * p.HV + hv) * p.V + c0, alpha, beta, p.scale, /*l2norm=*/true, active);
  }

  if (active) tile.template store<STREAM>(S, p.V, c0);
}

template <class T, int K, int CT, int RT, bool STREAM>
cudaError_t launch_config(const DecodeParams& p, cudaStream_t stream) {
  constexpr int kTileV = 4 * CT;
  dim3 grid(static_cast<unsigned>((p.V + kTileV - 1) / kTileV), static_cast<unsigned>(p.HV),
            static_cast<unsigned>(p.B));
  decode_step_kernel<T, K, CT, RT, STREAM><<<grid, CT * RT, 0, stream>>>(p);
  return cudaGetLastError();
}

// 64-column tiles of 16 x 8 threads (16 rows per thread) with streaming state loads and stores: on the H200
// (H=16, HV=32, K=V=128, random fp32 state) this shape measured best of nine at B = 1, 64 and 256, within 1.07x of
// the copy floor at B = 256 (benchmarks/RESULTS.md).
template <class T, int K>
cudaError_t launch(const DecodeParams& p, cudaStream_t stream) {
  return launch_config<T, K, 16, 8, true>(p, stream);
}

}  // namespace

bool decode_supports_head_k(int64_t K) { return K == 16 || K == 32 || K == 64 || K == 128 || K == 256; }

cudaError_t decode_step(const DecodeParams& p, cudaStream_t stream) {
  if (!decode_supports_head_k(p.K) || p.V % kDecodeVMultiple != 0) return cudaErrorInvalidValue;
  if (p.B == 0 || p.T == 0) return cudaSuccess;
  return LAYER_DTYPE_SWITCH(p.dtype, T, [&] {
    switch (p.K) {
      case 16: return launch<T, 16>(p, stream);
      case 32: return launch<T, 32>(p, stream);
      case 64: return launch<T, 64>(p, stream);
      case 128: return launch<T, 128>(p, stream);
      default: return launch<T, 256>(p, stream);
    }
  });
}

}  // namespace layer_cuda
}  // namespace gated_delta
