// CUDA kernels of the gated RMSNorm over the last dimension, in fp32:
//   y = x rstd w silu(g),  rstd = (mean(x^2) + eps)^(-1/2)
// One warp per row; the backward sums each block's weight gradient in shared memory and writes one partial row
// per block (summed afterwards in a fixed order: deterministic).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <tuple>

#include "../checks.h"
#include "device_utils.cuh"

namespace gated_delta {
namespace cuda {
namespace {

constexpr int kMaxNormDim = 8192;   // D limit of the CUDA gated RMSNorm backward with a weight (shared memory)

struct GatedRMSNormParams {
  const void* x = nullptr;       // [R, D], dtype
  const void* gate = nullptr;    // [R, D], dtype, or nullptr
  const void* weight = nullptr;  // [D], wdtype, or nullptr
  int64_t R = 0, D = 0;
  float eps = 1e-5f;
  DType dtype = DType::kFloat, wdtype = DType::kFloat;

  // forward
  void* y = nullptr;             // [R, D], dtype
  float* rstd = nullptr;         // [R]

  // backward
  const void* dy = nullptr;      // [R, D], dtype
  const float* rstd_in = nullptr;
  void* dx = nullptr;            // [R, D], dtype
  void* dgate = nullptr;         // [R, D], dtype, or nullptr
  float* dw_partial = nullptr;   // [P, D] fp32 workspace when weight is given
};

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int64_t kMaxBwdBlocks = 1024;

template <class T, class Wt>
__global__ void __launch_bounds__(kThreads) gated_rmsnorm_fwd_kernel(GatedRMSNormParams p) {
  const int lane = threadIdx.x % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (row >= p.R) return;
  const T* x = static_cast<const T*>(p.x) + row * p.D;
  const T* g = p.gate != nullptr ? static_cast<const T*>(p.gate) + row * p.D : nullptr;
  const Wt* w = static_cast<const Wt*>(p.weight);
  T* y = static_cast<T*>(p.y) + row * p.D;
  float ss = 0.f;
  for (int64_t d = lane; d < p.D; d += 32) {
    const float v = to_f(x[d]);
    ss += v * v;
  }
  const float rs = rsqrtf(warp_sum(ss) / static_cast<float>(p.D) + p.eps);
  if (lane == 0) p.rstd[row] = rs;
  for (int64_t d = lane; d < p.D; d += 32) {
    float v = to_f(x[d]) * rs;
    if (w != nullptr) v *= to_f(w[d]);
    if (g != nullptr) {
      const float gv = to_f(g[d]);
      v *= gv * sigmoidf_(gv);
    }
    y[d] = from_f<T>(v);
  }
}

// n = x rstd;  dn = dy w s(g);  dx = rstd (dn - n mean(n dn));  dg = dy n w s'(g);  dw += dy n s(g)
template <class T, class Wt>
__global__ void __launch_bounds__(kThreads) gated_rmsnorm_bwd_kernel(GatedRMSNormParams p) {
  extern __shared__ float dw_shared[];  // [D] when a weight is given
  const int lane = threadIdx.x % 32;
  const Wt* w = static_cast<const Wt*>(p.weight);
  if (w != nullptr) {
    for (int64_t d = threadIdx.x; d < p.D; d += kThreads) dw_shared[d] = 0.f;
    __syncthreads();
  }
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; row < p.R;
       row += static_cast<int64_t>(gridDim.x) * kWarps) {
    const T* x = static_cast<const T*>(p.x) + row * p.D;
    const T* dy = static_cast<const T*>(p.dy) + row * p.D;
    const T* g = p.gate != nullptr ? static_cast<const T*>(p.gate) + row * p.D : nullptr;
    const float rs = p.rstd_in[row];
    float dot = 0.f;
    for (int64_t d = lane; d < p.D; d += 32) {
      float gy = to_f(dy[d]);
      if (g != nullptr) gy *= to_f(g[d]) * sigmoidf_(to_f(g[d]));
      if (w != nullptr) gy *= to_f(w[d]);
      dot += to_f(x[d]) * rs * gy;
    }
    dot = warp_sum(dot) / static_cast<float>(p.D);
    T* dx = static_cast<T*>(p.dx) + row * p.D;
    T* dg = p.dgate != nullptr ? static_cast<T*>(p.dgate) + row * p.D : nullptr;
    for (int64_t d = lane; d < p.D; d += 32) {
      const float n = to_f(x[d]) * rs;
      const float wd = w != nullptr ? to_f(w[d]) : 1.f;
      float gy = to_f(dy[d]);
      if (g != nullptr) {
        const float gv = to_f(g[d]);
        const float sg = sigmoidf_(gv);
        dg[d] = from_f<T>(gy * n * wd * sg * (1.f + gv * (1.f - sg)));
        gy *= gv * sg;
      }
      if (w != nullptr) atomicAdd(&dw_shared[d], gy * n);
      dx[d] = from_f<T>(rs * (gy * wd - n * dot));
    }
  }
  if (w != nullptr) {
    __syncthreads();
    float* part = p.dw_partial + static_cast<int64_t>(blockIdx.x) * p.D;
    for (int64_t d = threadIdx.x; d < p.D; d += kThreads) part[d] = dw_shared[d];
  }
}

int64_t gated_rmsnorm_bwd_num_partials(int64_t R) {
  return R == 0 ? 0 : (ceil_div(R, kWarps) < kMaxBwdBlocks ? ceil_div(R, kWarps) : kMaxBwdBlocks);
}

void launch_gated_rmsnorm_fwd(const GatedRMSNormParams& p, cudaStream_t stream) {
  if (p.R == 0) return;
  GD_DTYPE_WTYPE_SWITCH(p.dtype, p.wdtype, T, Wt, [&] {
    gated_rmsnorm_fwd_kernel<T, Wt><<<static_cast<unsigned>(ceil_div(p.R, kWarps)), kThreads, 0, stream>>>(p);
    GD_CUDA_LAUNCH_CHECK();
  });
}

void launch_gated_rmsnorm_bwd(const GatedRMSNormParams& p, cudaStream_t stream) {
  if (p.R == 0) return;
  GD_DTYPE_WTYPE_SWITCH(p.dtype, p.wdtype, T, Wt, [&] {
    const size_t smem = p.weight != nullptr ? static_cast<size_t>(p.D) * sizeof(float) : 0;
    // kMaxNormDim floats fit the default 48 KB of dynamic shared memory.
    const unsigned blocks = static_cast<unsigned>(gated_rmsnorm_bwd_num_partials(p.R));
    gated_rmsnorm_bwd_kernel<T, Wt><<<blocks, kThreads, smem, stream>>>(p);
    GD_CUDA_LAUNCH_CHECK();
  });
}

// ---- host side ----

using OptTensor = c10::optional<at::Tensor>;

// The inputs shared by the gated RMSNorm's forward and backward, contiguous (held here while the kernel runs),
// and the parameters that point at them.
struct NormOperands {
  at::Tensor xc, gc, wc;
  GatedRMSNormParams p;

  NormOperands(const at::Tensor& x, const OptTensor& gate, const OptTensor& weight, const NormSizes& s, double eps)
      : xc(x.contiguous()),
        gc(gate.has_value() ? gate->contiguous() : at::Tensor()),
        wc(weight.has_value() ? weight->contiguous() : at::Tensor()) {
    p.x = xc.data_ptr();
    p.gate = gc.defined() ? gc.data_ptr() : nullptr;
    p.weight = wc.defined() ? wc.data_ptr() : nullptr;
    p.R = s.rows;
    p.D = s.D;
    p.eps = static_cast<float>(eps);
    p.dtype = dtype_of(x.scalar_type(), "x");
    p.wdtype = wc.defined() ? param_dtype_of(wc.scalar_type(), p.dtype) : p.dtype;
  }
};

std::tuple<at::Tensor, at::Tensor> gated_rmsnorm_fwd_cuda(const at::Tensor& x, const OptTensor& gate,
                                                          const OptTensor& weight, double eps) {
  const NormSizes s = check_gated_rmsnorm_args(x, gate, weight, eps);
  const c10::cuda::CUDAGuard guard(x.device());
  NormOperands ops(x, gate, weight, s, eps);
  GatedRMSNormParams& p = ops.p;
  at::Tensor y = at::empty(x.sizes(), x.options());
  at::Tensor rstd = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kFloat));
  p.y = y.data_ptr();
  p.rstd = rstd.data_ptr<float>();
  launch_gated_rmsnorm_fwd(p, at::cuda::getCurrentCUDAStream());
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> gated_rmsnorm_bwd_cuda(const at::Tensor& dy, const at::Tensor& x,
                                                                      const OptTensor& gate, const OptTensor& weight,
                                                                      const at::Tensor& rstd, double eps) {
  const NormSizes s = check_gated_rmsnorm_args(x, gate, weight, eps);
  check_gated_rmsnorm_grads(x, s, dy, rstd);
  TORCH_CHECK(!weight.has_value() || s.D <= kMaxNormDim, "x must have D <= ", kMaxNormDim,
              " for the CUDA gated RMSNorm backward with a weight, got D = ", s.D);
  const c10::cuda::CUDAGuard guard(x.device());
  NormOperands ops(x, gate, weight, s, eps);
  GatedRMSNormParams& p = ops.p;
  const at::Tensor dyc = dy.to(x.scalar_type()).contiguous(), rc = rstd.contiguous();
  at::Tensor dx = at::empty(x.sizes(), x.options());
  at::Tensor dgate = gate.has_value() ? at::empty(x.sizes(), x.options()) : at::empty({0}, x.options());
  at::Tensor part = weight.has_value()
                        ? at::empty({gated_rmsnorm_bwd_num_partials(s.rows), s.D}, x.options().dtype(at::kFloat))
                        : at::Tensor();
  p.dy = dyc.data_ptr();
  p.rstd_in = rc.data_ptr<float>();
  p.dx = dx.data_ptr();
  p.dgate = gate.has_value() ? dgate.data_ptr() : nullptr;
  p.dw_partial = part.defined() ? part.data_ptr<float>() : nullptr;
  launch_gated_rmsnorm_bwd(p, at::cuda::getCurrentCUDAStream());
  at::Tensor dweight = weight.has_value() ? part.sum(0).to(weight->scalar_type()) : at::empty({0}, x.options());
  return {dx, dgate, dweight};
}

}  // namespace

TORCH_LIBRARY_IMPL(gated_delta, CUDA, m) {
  m.impl("gated_rmsnorm_fwd", &gated_rmsnorm_fwd_cuda);
  m.impl("gated_rmsnorm_bwd", &gated_rmsnorm_bwd_cuda);
}

}  // namespace cuda
}  // namespace gated_delta
