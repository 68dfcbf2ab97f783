// CUDA kernel of the fused decode step of the gated delta rule: for T (few) new tokens against a cached fp32
// state S [B, HV, K, V], updated in place, with q, k L2-normalised, g = -exp(A_log) softplus(a + dt_bias),
// alpha = exp(g), beta = sigmoid(b) (x2 with allow_neg_eigval). The per-token update and the thread layout are
// the register tile of decode_tile.cuh.
//
// Decode is memory-bound (each (b, hv) state is K*V*4 bytes, 64 KB at K = V = 128, against ~1 KB of inputs), so
// the grid splits V into column tiles: block (v tile, hv, b). The state tile stays in registers across the T
// tokens; the state is loaded and stored with streaming (evict-first) hints: it is touched once per step
// (benchmarks/RESULTS.md, "CUDA design measurements").
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../checks.h"
#include "decode_tile.cuh"

namespace gated_delta {
namespace cuda {
namespace {

// Sizes (DecodeSizes: B, T, H, HV, K, V), inputs and outputs of the decode kernel.
struct DecodeParams : DecodeSizes {
  const void* q = nullptr;        // [B, T, H, K], dtype
  const void* k = nullptr;        // [B, T, H, K], dtype
  const void* v = nullptr;        // [B, T, HV, V], dtype
  const void* a = nullptr;        // [B, T, HV], a_dtype
  const void* b = nullptr;        // [B, T, HV], b_dtype
  const void* A_log = nullptr;    // [HV], A_dtype
  const void* dt_bias = nullptr;  // [HV], dt_dtype
  float* state = nullptr;         // [B, HV, K, V] fp32, 16-byte aligned, updated in place
  void* o = nullptr;              // [B, T, HV, V], dtype
  DType dtype = DType::kFloat, a_dtype = DType::kFloat, b_dtype = DType::kFloat, A_dtype = DType::kFloat,
        dt_dtype = DType::kFloat;
  float scale = 1.f;
  bool allow_neg_eigval = false;
};

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
void launch_config(const DecodeParams& p, cudaStream_t stream) {
  decode_step_kernel<T, K, CT, RT, STREAM><<<decode_grid(p.V, p.HV, p.B, CT), CT * RT, 0, stream>>>(p);
  GD_CUDA_LAUNCH_CHECK();
}

void launch_decode_step(const DecodeParams& p, cudaStream_t stream) {
  if (p.B == 0 || p.T == 0) return;
  GD_DTYPE_SWITCH(p.dtype, T, [&] {
    GD_HEADK_SWITCH_IN(DecodeHeadDims, p.K, KC, [&] {
      launch_config<T, KC, kDecodeColThreads, kDecodeRowThreads, /*STREAM=*/true>(p, stream);
    });
  });
}

// ---- host side ----

at::Tensor decode_step_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& a,
                            const at::Tensor& b, const at::Tensor& A_log, const at::Tensor& dt_bias,
                            at::Tensor& state, double scale, bool allow_neg_eigval) {
  const DecodeSizes s = check_decode_step_args(q, k, v, a, b, A_log, dt_bias, state, scale);
  check_decode_tile_limits("decode step", s.K, s.V, s.HV, s.B, "B", state.data_ptr(), "state");
  const c10::cuda::CUDAGuard guard(q.device());
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  const at::Tensor ac = a.contiguous(), bc = b.contiguous();
  const at::Tensor Ac = A_log.contiguous(), dc = dt_bias.contiguous();
  at::Tensor o = at::empty({s.B, s.T, s.HV, s.V}, v.options());
  DecodeParams p;
  p.q = qc.data_ptr();
  p.k = kc.data_ptr();
  p.v = vc.data_ptr();
  p.a = ac.data_ptr();
  p.b = bc.data_ptr();
  p.A_log = Ac.data_ptr();
  p.dt_bias = dc.data_ptr();
  p.state = state.data_ptr<float>();
  p.o = o.data_ptr();
  static_cast<DecodeSizes&>(p) = s;
  p.dtype = dtype_of(q.scalar_type(), "q");
  p.a_dtype = dtype_of(a.scalar_type(), "a");
  p.b_dtype = dtype_of(b.scalar_type(), "b");
  p.A_dtype = dtype_of(A_log.scalar_type(), "A_log");
  p.dt_dtype = dtype_of(dt_bias.scalar_type(), "dt_bias");
  p.scale = static_cast<float>(scale);
  p.allow_neg_eigval = allow_neg_eigval;
  launch_decode_step(p, at::cuda::getCurrentCUDAStream());
  return o;
}

}  // namespace

TORCH_LIBRARY_IMPL(gated_delta, CUDA, m) { m.impl("decode_step", &decode_step_cuda); }

}  // namespace cuda
}  // namespace gated_delta
