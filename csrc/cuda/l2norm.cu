// CUDA kernels of the L2 normalisation over the last dimension (l2norm_fwd, l2norm_bwd), what the gated delta rule
// applies to q and k with use_qk_l2norm_in_kernel, in fp32:
//   y = x r,  r = (sum(x^2) + eps)^(-1/2);   dx = r (dy - y (y . dy)) = r (dy - x r^2 (x . dy))
// x is read once, in place where its last dim is dense (a q or k split from a fused projection's output included):
// its leading dims are walked by up to three (size, stride) pairs. The result is contiguous, in x's dtype or fp32
// (another dtype is one cast afterwards); dy is fp32 (the gated delta rule's core returns dq and dk unrounded for
// this chain rule). Deterministic: each row's sums in a fixed order.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "../checks.h"
#include "device_utils.cuh"

namespace gated_delta {
namespace cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;

struct L2NormParams {
  const void* x = nullptr;   // row r at x + off(r): r = (i0 n1 + i1) n2 + i2, off = i0 s0 + i1 s1 + i2 s2 (elements)
  const float* dy = nullptr;  // backward: [R, D] fp32, contiguous
  void* out = nullptr;        // [R, D], contiguous
  int64_t R = 0, D = 0, n1 = 1, n2 = 1, s0 = 0, s1 = 0, s2 = 0;
  float eps = 0.f;
};

// (32-bit division: the host keeps R below 2^31; one or two strides, the common layouts, take fewer)
__device__ __forceinline__ int64_t row_offset(const L2NormParams& p, int64_t r) {
  if (p.n2 == p.R) return r * p.s2;
  const uint32_t u = static_cast<uint32_t>(r), n2 = static_cast<uint32_t>(p.n2);
  const uint32_t i2 = u % n2, r1 = u / n2;
  if (p.n1 * p.n2 == p.R) return static_cast<int64_t>(r1) * p.s1 + static_cast<int64_t>(i2) * p.s2;
  const uint32_t n1 = static_cast<uint32_t>(p.n1);
  return static_cast<int64_t>(r1 / n1) * p.s0 + static_cast<int64_t>(r1 % n1) * p.s1 + static_cast<int64_t>(i2) * p.s2;
}

// N consecutive elements, loaded and stored as one access (the address aligned to the pack's size)
template <class T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// Rows of D <= 32 IT 4 elements whose rows start on multiples of four elements of an aligned base (q and k of every
// head dim of the gated delta rule): a warp takes kRows rows at once, each lane the packs of four elements at
// (32 it + lane) 4 of each row, held in registers from their one load to the result's store. The loads of the
// kRows rows are issued together, so that a warp keeps kRows rows in flight.
constexpr int kRows = 4;

template <class Tin, class Tout, int IT, bool BWD>
__global__ void __launch_bounds__(kThreads) l2norm_rows_kernel(const L2NormParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t r0 = (static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5)) * kRows;
  float x[kRows][IT][4], g[BWD ? kRows : 1][IT][4], ss[kRows], sd[kRows];
#pragma unroll
  for (int rr = 0; rr < kRows; ++rr) {
    const int64_t row = r0 + rr;
    const Tin* xr = static_cast<const Tin*>(p.x) + row_offset(p, row < p.R ? row : 0);
#pragma unroll
    for (int it = 0; it < IT; ++it) {
      const int64_t d = 4 * (32 * it + lane);
      const bool ok = row < p.R && d < p.D;
      Pack<Tin, 4> a;
      Pack<float, 4> b;
      if (ok) {
        a = *reinterpret_cast<const Pack<Tin, 4>*>(xr + d);
        if constexpr (BWD) b = *reinterpret_cast<const Pack<float, 4>*>(p.dy + row * p.D + d);
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        x[rr][it][i] = ok ? to_f(a.v[i]) : 0.f;
        if constexpr (BWD) g[rr][it][i] = ok ? b.v[i] : 0.f;
      }
    }
  }
#pragma unroll
  for (int rr = 0; rr < kRows; ++rr) {
    ss[rr] = sd[rr] = 0.f;
#pragma unroll
    for (int it = 0; it < IT; ++it)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        ss[rr] += x[rr][it][i] * x[rr][it][i];
        if constexpr (BWD) sd[rr] += x[rr][it][i] * g[rr][it][i];
      }
  }
#pragma unroll
  for (int rr = 0; rr < kRows; ++rr) {
    ss[rr] = warp_sum(ss[rr]);
    if constexpr (BWD) sd[rr] = warp_sum(sd[rr]);
  }
#pragma unroll
  for (int rr = 0; rr < kRows; ++rr) {
    const int64_t row = r0 + rr;
    const float r = rsqrtf(ss[rr] + p.eps);
    const float c = r * r * sd[rr];  // backward: r^2 (x . dy), so that y (y . dy) = x c
    Tout* out = static_cast<Tout*>(p.out) + row * p.D;
#pragma unroll
    for (int it = 0; it < IT; ++it) {
      const int64_t d = 4 * (32 * it + lane);
      if (row >= p.R || d >= p.D) continue;
      Pack<Tout, 4> o;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        o.v[i] = from_f<Tout>(BWD ? r * (g[rr][it][i] - x[rr][it][i] * c) : x[rr][it][i] * r);
      }
      *reinterpret_cast<Pack<Tout, 4>*>(out + d) = o;
    }
  }
}

// Any other row (any D, any alignment): one warp per row, element by element, a pass for the sums and one (from L1)
// for the result.
template <class Tin, class Tout, bool BWD>
__global__ void __launch_bounds__(kThreads) l2norm_any_kernel(const L2NormParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (row >= p.R) return;
  const Tin* x = static_cast<const Tin*>(p.x) + row_offset(p, row);
  const float* dy = BWD ? p.dy + row * p.D : nullptr;
  Tout* out = static_cast<Tout*>(p.out) + row * p.D;
  float ss = 0.f, sd = 0.f;
  for (int64_t d = lane; d < p.D; d += 32) {
    const float v = to_f(x[d]);
    ss += v * v;
    if constexpr (BWD) sd += v * dy[d];
  }
  const float r = rsqrtf(warp_sum(ss) + p.eps);
  const float c = BWD ? r * r * warp_sum(sd) : 0.f;
  for (int64_t d = lane; d < p.D; d += 32) {
    const float v = to_f(x[d]);
    out[d] = from_f<Tout>(BWD ? r * (dy[d] - v * c) : v * r);
  }
}

// ---- host side ----

// x's rows: the tensor read (x itself where its last dim is dense, else a contiguous copy) and the kernels' parameters
// for it, its leading dims as at most three (size, stride) pairs, adjacent dims merged where one steps densely through
// the next (the caller sets dy and out)
struct Rows {
  at::Tensor x;
  L2NormParams p;
};

Rows rows_of(const at::Tensor& x0, double eps) {
  Rows w;
  const int64_t D = x0.size(-1);
  w.x = (D > 1 && x0.stride(-1) != 1) ? x0.contiguous() : x0;
  std::vector<std::pair<int64_t, int64_t>> g;  // outermost first
  for (int64_t i = 0; i + 1 < w.x.dim(); ++i) {
    const int64_t n = w.x.size(i), s = w.x.stride(i);
    if (n == 1) continue;
    if (!g.empty() && g.back().second == s * n) {
      g.back() = {g.back().first * n, s};
    } else {
      g.push_back({n, s});
    }
  }
  if (g.size() > 3) {
    w.x = w.x.contiguous();
    g = {{w.x.numel() / D, D}};
  }
  while (g.size() < 3) g.insert(g.begin(), {1, 0});
  L2NormParams& p = w.p;
  p.R = g[0].first * g[1].first * g[2].first;
  TORCH_CHECK(p.R < (int64_t{1} << 31), "x must have fewer than 2^31 rows (the product of its leading dims) on CUDA, "
              "got ", p.R);
  p.x = w.x.data_ptr();
  p.D = D;
  p.n1 = g[1].first;
  p.n2 = g[2].first;
  p.s0 = g[0].second;
  p.s1 = g[1].second;
  p.s2 = g[2].second;
  p.eps = static_cast<float>(eps);
  return w;
}

// The packed kernel applies where every row of x (and of dy and the result) starts on a multiple of four elements
// of an aligned base and D <= 256
bool packed(const L2NormParams& p, size_t in_bytes, size_t out_bytes) {
  auto aligned = [](const void* ptr, size_t b) { return ptr == nullptr || reinterpret_cast<uintptr_t>(ptr) % b == 0; };
  return p.D % 4 == 0 && p.D <= 256 && p.s0 % 4 == 0 && p.s1 % 4 == 0 && p.s2 % 4 == 0 &&
         aligned(p.x, 4 * in_bytes) && aligned(p.dy, 4 * sizeof(float)) && aligned(p.out, 4 * out_bytes);
}

// One launch: the kernel for x's dtype and the result in x's dtype or fp32
void launch(const L2NormParams& p, DType in, bool out_f32, bool backward) {
  if (p.R == 0) return;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  GD_DTYPE_SWITCH(in, Tin, [&] {
    auto go = [&](auto out_tag, auto bwd_tag) {
      using Tout = decltype(out_tag);
      constexpr bool BWD = decltype(bwd_tag)::value;
      if (packed(p, sizeof(Tin), sizeof(Tout))) {
        const unsigned blocks = static_cast<unsigned>(ceil_div(p.R, kWarps * kRows));
        if (p.D <= 128) l2norm_rows_kernel<Tin, Tout, 1, BWD><<<blocks, kThreads, 0, stream>>>(p);
        else l2norm_rows_kernel<Tin, Tout, 2, BWD><<<blocks, kThreads, 0, stream>>>(p);
      } else {
        l2norm_any_kernel<Tin, Tout, BWD><<<static_cast<unsigned>(ceil_div(p.R, kWarps)), kThreads, 0, stream>>>(p);
      }
      GD_CUDA_LAUNCH_CHECK();
    };
    using Fwd = std::false_type;
    using Bwd = std::true_type;
    if (out_f32) backward ? go(float{}, Bwd{}) : go(float{}, Fwd{});
    else backward ? go(Tin{}, Bwd{}) : go(Tin{}, Fwd{});
  });
}

// The dtype the kernels write for a result in out: x's dtype where out is, else fp32 (cast to out afterwards)
at::ScalarType kernel_out(const at::Tensor& x, at::ScalarType out) {
  dtype_of(out, "out_dtype");
  return out == x.scalar_type() ? out : at::kFloat;
}

at::Tensor l2norm_fwd_cuda(const at::Tensor& x, double eps, c10::optional<at::ScalarType> out_dtype) {
  const at::ScalarType out = check_l2norm_args(x, eps, out_dtype);
  const DType in = dtype_of(x.scalar_type(), "x");
  const at::ScalarType kout = kernel_out(x, out);
  const c10::cuda::CUDAGuard guard(x.device());
  Rows w = rows_of(x, eps);
  at::Tensor y = at::empty(x.sizes(), x.options().dtype(kout));
  w.p.out = y.data_ptr();
  launch(w.p, in, kout == at::kFloat, /*backward=*/false);
  return kout == out ? y : y.to(out);
}

at::Tensor l2norm_bwd_cuda(const at::Tensor& dy, const at::Tensor& x, double eps,
                           c10::optional<at::ScalarType> out_dtype) {
  const at::ScalarType out = check_l2norm_args(x, eps, out_dtype);
  check_l2norm_grad(x, dy);
  const DType in = dtype_of(x.scalar_type(), "x");
  dtype_of(dy.scalar_type(), "dy");
  const at::ScalarType kout = kernel_out(x, out);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor g = dy.to(at::kFloat).contiguous();  // (the core's dq and dk are already)
  Rows w = rows_of(x, eps);
  at::Tensor dx = at::empty(x.sizes(), x.options().dtype(kout));
  w.p.dy = g.data_ptr<float>();
  w.p.out = dx.data_ptr();
  launch(w.p, in, kout == at::kFloat, /*backward=*/true);
  return kout == out ? dx : dx.to(out);
}

}  // namespace

TORCH_LIBRARY_IMPL(gated_delta, CUDA, m) {
  m.impl("l2norm_fwd", &l2norm_fwd_cuda);
  m.impl("l2norm_bwd", &l2norm_bwd_cuda);
}

}  // namespace cuda
}  // namespace gated_delta
