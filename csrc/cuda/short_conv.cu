// CUDA kernels of the causal depthwise short convolution (+ SiLU), its backward and its decode update.
//   y[t, d] = act(bias[d] + sum_{j<W} w[d, j] x[t - (W-1) + j, d])      (per sequence; before its start: h0 or 0)
// A thread owns one channel and a run of consecutive tokens, with the last W-1 inputs in registers; the threads of
// a block cover consecutive channels, so every global access is coalesced across the warp.
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

constexpr int kMaxConvWidth = 8;    // W limit of the CUDA short convolution (its window lives in registers)

// Sizes (ConvSizes: B, T, D, W, N), inputs and outputs of the convolution's kernels.
struct ShortConvParams : ConvSizes {
  const void* x = nullptr;        // [B, T, D], dtype
  const void* weight = nullptr;   // [D, W], wdtype
  const void* bias = nullptr;     // [D], wdtype, or nullptr
  const void* h0 = nullptr;       // [N, D, W-1], dtype, or nullptr (zeros)
  const int64_t* cu = nullptr;    // [N + 1] sequence offsets, or nullptr (N = B sequences of length T)
  DType dtype = DType::kFloat, wdtype = DType::kFloat;
  bool silu = true;

  // forward
  void* y = nullptr;              // [B, T, D], dtype
  void* final_state = nullptr;    // [N, D, W-1], dtype, or nullptr

  // backward
  const void* dy = nullptr;         // [B, T, D], dtype
  const float* dfs = nullptr;       // [N, D, W-1] fp32, or nullptr
  float* dz = nullptr;              // [B, T, D] fp32 workspace: dy * act'(z)
  float* dw_partial = nullptr;      // [P, W + 1, D] fp32 workspace: per token tile, weight taps then bias
  void* dx = nullptr;               // [B, T, D], dtype
  void* dh0 = nullptr;              // [N, D, W-1], dtype, or nullptr
};

// The decode update's (N unused).
struct ShortConvUpdateParams : ConvSizes {
  const void* x = nullptr;       // [B, T, D], dtype
  void* state = nullptr;         // [B, D, W-1], dtype, updated in place
  const void* weight = nullptr;  // [D, W], wdtype
  const void* bias = nullptr;    // [D], wdtype, or nullptr
  void* y = nullptr;             // [B, T, D], dtype
  DType dtype = DType::kFloat, wdtype = DType::kFloat;
  bool silu = true;
};

constexpr int kThreads = 128;       // channels per block
constexpr int kFwdTokens = 16;      // tokens per thread, forward and dx
constexpr int kBwdTokens = 128;     // tokens per thread in the dz / weight-gradient pass
constexpr int kMaxW1 = kMaxConvWidth - 1;

// Index n of the sequence holding token t: the largest n in [0, N) with cu[n] <= t (binary search). Values are not
// trusted: callers clamp the bounds they derive from cu.
__device__ __forceinline__ int64_t find_sequence(const int64_t* cu, int64_t N, int64_t t) {
  int64_t lo = 0, hi = N - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (cu[mid] <= t) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Bounds of the sequence holding token t: [start, end) and its index n (clamped, whatever cu holds).
struct SeqPos {
  int64_t n, start, end;
};

__device__ __forceinline__ SeqPos locate(const ShortConvParams& p, int64_t b, int64_t t) {
  if (p.cu == nullptr) return {b, 0, p.T};
  const int64_t n = find_sequence(p.cu, p.N, t);
  const int64_t start = clamp64(p.cu[n], 0, t);
  const int64_t end = clamp64(p.cu[n + 1], t + 1, p.T);
  return {n, start, end};
}

// Advances s to the sequence holding token t (t moves forward one token at a time).
__device__ __forceinline__ bool advance(const ShortConvParams& p, int64_t t, SeqPos& s) {
  if (p.cu == nullptr || t < s.end) return false;
  s = locate(p, 0, t);
  return true;
}

// The input at position pos of the sequence s (pos >= s.start - (W-1)), channel d.
template <class T>
__device__ __forceinline__ float conv_input(const ShortConvParams& p, const T* x, const T* h0, int64_t b,
                                            const SeqPos& s, int64_t pos, int64_t d) {
  if (pos >= s.start) return to_f(x[(b * p.T + pos) * p.D + d]);
  if (h0 == nullptr) return 0.f;
  return to_f(h0[(s.n * p.D + d) * (p.W - 1) + (p.W - 1) + (pos - s.start)]);
}

// win[j] = input at t - (W-1) + j, j < W-1.
template <class T>
__device__ __forceinline__ void load_window(const ShortConvParams& p, const T* x, const T* h0, int64_t b,
                                            const SeqPos& s, int64_t t, int64_t d, float (&win)[kMaxW1 > 0 ? kMaxW1 : 1]) {
#pragma unroll
  for (int j = 0; j < kMaxW1; ++j) {
    if (j < p.W - 1) win[j] = conv_input(p, x, h0, b, s, t - (p.W - 1) + j, d);
  }
}

__device__ __forceinline__ void shift_window(int W, float (&win)[kMaxW1 > 0 ? kMaxW1 : 1], float xt) {
#pragma unroll
  for (int j = 0; j < kMaxW1; ++j) {
    if (j < W - 2) win[j] = win[j + 1];
    else if (j == W - 2) win[j] = xt;
  }
}

template <class Wt>
__device__ __forceinline__ void load_weights(const ShortConvParams& p, int64_t d, float (&w)[kMaxConvWidth],
                                             float& w_last, float& bias) {
  const Wt* wp = static_cast<const Wt*>(p.weight) + d * p.W;
#pragma unroll
  for (int j = 0; j < kMaxConvWidth; ++j) w[j] = j < p.W - 1 ? to_f(wp[j]) : 0.f;
  w_last = to_f(wp[p.W - 1]);
  bias = p.bias != nullptr ? to_f(static_cast<const Wt*>(p.bias)[d]) : 0.f;
}

__device__ __forceinline__ float window_dot(int W, const float (&w)[kMaxConvWidth],
                                            const float (&win)[kMaxW1 > 0 ? kMaxW1 : 1]) {
  float acc = 0.f;
#pragma unroll
  for (int j = 0; j < kMaxW1; ++j) {
    if (j < W - 1) acc += w[j] * win[j];
  }
  return acc;
}

// This thread's channel d, batch row b and tokens [t0, t1) in a grid (token tiles, channel blocks, B).
struct TokenTile {
  int64_t d, b, t0, t1;
};

template <int kTokens>
__device__ __forceinline__ TokenTile token_tile(const ShortConvParams& p) {
  TokenTile r;
  r.d = static_cast<int64_t>(blockIdx.y) * kThreads + threadIdx.x;
  r.b = blockIdx.z;
  r.t0 = static_cast<int64_t>(blockIdx.x) * kTokens;
  r.t1 = min(r.t0 + kTokens, p.T);
  return r;
}

// Sequence n (whole, clamped whatever cu holds) and the batch row b holding its tokens.
__device__ __forceinline__ SeqPos whole_sequence(const ShortConvParams& p, int64_t n, int64_t& b) {
  SeqPos s{n, 0, p.T};
  b = n;
  if (p.cu != nullptr) {
    b = 0;
    s.start = clamp64(p.cu[n], 0, p.T);
    s.end = clamp64(p.cu[n + 1], s.start, p.T);
  }
  return s;
}

// grid (token tiles, channel blocks, B)
template <class T, class Wt>
__global__ void __launch_bounds__(kThreads) short_conv_fwd_kernel(ShortConvParams p) {
  const auto [d, b, t0, t1] = token_tile<kFwdTokens>(p);
  if (d >= p.D || t0 >= p.T) return;
  const T* x = static_cast<const T*>(p.x);
  const T* h0 = static_cast<const T*>(p.h0);
  T* y = static_cast<T*>(p.y);
  float w[kMaxConvWidth], w_last, bias;
  load_weights<Wt>(p, d, w, w_last, bias);
  float win[kMaxW1 > 0 ? kMaxW1 : 1];
  SeqPos s = locate(p, b, t0);
  load_window(p, x, h0, b, s, t0, d, win);
  for (int64_t t = t0; t < t1; ++t) {
    if (advance(p, t, s)) load_window(p, x, h0, b, s, t, d, win);
    const float xt = to_f(x[(b * p.T + t) * p.D + d]);
    const float z = bias + window_dot(p.W, w, win) + w_last * xt;
    shift_window(p.W, win, xt);
    y[(b * p.T + t) * p.D + d] = from_f<T>(p.silu ? z * sigmoidf_(z) : z);
  }
}

// The last W-1 inputs of every sequence. grid (channel blocks, N)
template <class T>
__global__ void __launch_bounds__(kThreads) short_conv_final_state_kernel(ShortConvParams p) {
  const int64_t d = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t n = blockIdx.y;
  if (d >= p.D) return;
  int64_t b;
  const SeqPos s = whole_sequence(p, n, b);
  const T* x = static_cast<const T*>(p.x);
  const T* h0 = static_cast<const T*>(p.h0);
  T* fs = static_cast<T*>(p.final_state);
  for (int64_t j = 0; j < p.W - 1; ++j) {
    const int64_t pos = s.end - (p.W - 1) + j;
    fs[(n * p.D + d) * (p.W - 1) + j] = from_f<T>(conv_input(p, x, h0, b, s, pos, d));
  }
}

// Backward pass 1: dz = dy * act'(z) (z recomputed) and each token tile's partial weight / bias gradients
//   dw[j, d] = sum_t dz[t, d] x[t - (W-1) + j, d],  db[d] = sum_t dz[t, d]
// written to dw_partial[tile, 0..W, d] (summed on the host side in a fixed order: deterministic).
template <class T, class Wt>
__global__ void __launch_bounds__(kThreads) short_conv_dz_kernel(ShortConvParams p) {
  const auto [d, b, t0, t1] = token_tile<kBwdTokens>(p);
  const int64_t tile = static_cast<int64_t>(b) * gridDim.x + blockIdx.x;
  if (d >= p.D) return;
  const T* x = static_cast<const T*>(p.x);
  const T* h0 = static_cast<const T*>(p.h0);
  const T* dy = static_cast<const T*>(p.dy);
  float w[kMaxConvWidth], w_last, bias;
  load_weights<Wt>(p, d, w, w_last, bias);
  float dw[kMaxConvWidth], db = 0.f;
#pragma unroll
  for (int j = 0; j < kMaxConvWidth; ++j) dw[j] = 0.f;
  float win[kMaxW1 > 0 ? kMaxW1 : 1];
  if (t0 < p.T) {
    SeqPos s = locate(p, b, t0);
    load_window(p, x, h0, b, s, t0, d, win);
    for (int64_t t = t0; t < t1; ++t) {
      if (advance(p, t, s)) load_window(p, x, h0, b, s, t, d, win);
      const int64_t i = (b * p.T + t) * p.D + d;
      const float xt = to_f(x[i]);
      const float z = bias + window_dot(p.W, w, win) + w_last * xt;
      float g = to_f(dy[i]);
      if (p.silu) {
        const float sg = sigmoidf_(z);
        g *= sg * (1.f + z * (1.f - sg));
      }
      p.dz[i] = g;
#pragma unroll
      for (int j = 0; j < kMaxW1; ++j) {
        if (j < p.W - 1) dw[j] += g * win[j];
      }
#pragma unroll
      for (int j = 0; j < kMaxConvWidth; ++j) {
        if (j == p.W - 1) dw[j] += g * xt;
      }
      db += g;
      shift_window(p.W, win, xt);
    }
  }
  float* part = p.dw_partial + tile * (p.W + 1) * p.D;
#pragma unroll
  for (int j = 0; j < kMaxConvWidth; ++j) {
    if (j < p.W) part[j * p.D + d] = dw[j];
  }
  part[p.W * p.D + d] = db;
}

// Gradient of the input at position pos of sequence s (pos in [start - (W-1), end)):
//   sum_j w[j] dz[pos + (W-1) - j] over outputs inside the sequence, + d_final_state where pos is kept.
template <class Wt>
__device__ __forceinline__ float input_grad(const ShortConvParams& p, const float (&w)[kMaxConvWidth], float w_last,
                                            int64_t b, const SeqPos& s, int64_t pos, int64_t d) {
  float g = 0.f;
#pragma unroll
  for (int j = 0; j < kMaxConvWidth; ++j) {
    if (j < p.W) {
      const int64_t t = pos + (p.W - 1) - j;
      if (t >= s.start && t < s.end) g += (j == p.W - 1 ? w_last : w[j]) * p.dz[(b * p.T + t) * p.D + d];
    }
  }
  const int64_t keep = pos - (s.end - (p.W - 1));
  if (p.dfs != nullptr && keep >= 0) g += p.dfs[(s.n * p.D + d) * (p.W - 1) + keep];
  return g;
}

// Backward pass 2: dx. grid (token tiles, channel blocks, B)
template <class T, class Wt>
__global__ void __launch_bounds__(kThreads) short_conv_dx_kernel(ShortConvParams p) {
  const auto [d, b, t0, t1] = token_tile<kFwdTokens>(p);
  if (d >= p.D || t0 >= p.T) return;
  float w[kMaxConvWidth], w_last, bias;
  load_weights<Wt>(p, d, w, w_last, bias);
  T* dx = static_cast<T*>(p.dx);
  SeqPos s = locate(p, b, t0);
  for (int64_t t = t0; t < t1; ++t) {
    advance(p, t, s);
    dx[(b * p.T + t) * p.D + d] = from_f<T>(input_grad<Wt>(p, w, w_last, b, s, t, d));
  }
}

// Backward pass 3: the gradient of the initial state. grid (channel blocks, N)
template <class T, class Wt>
__global__ void __launch_bounds__(kThreads) short_conv_dh0_kernel(ShortConvParams p) {
  const int64_t d = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t n = blockIdx.y;
  if (d >= p.D) return;
  float w[kMaxConvWidth], w_last, bias;
  load_weights<Wt>(p, d, w, w_last, bias);
  int64_t b;
  const SeqPos s = whole_sequence(p, n, b);
  T* dh0 = static_cast<T*>(p.dh0);
  for (int64_t i = 0; i < p.W - 1; ++i) {
    const int64_t pos = s.start - (p.W - 1) + i;
    dh0[(n * p.D + d) * (p.W - 1) + i] = from_f<T>(input_grad<Wt>(p, w, w_last, b, s, pos, d));
  }
}

// Decode: thread per (b, d); the W-1 cached inputs in registers, T new tokens, state written back.
template <class T, class Wt>
__global__ void __launch_bounds__(kThreads) short_conv_update_kernel(ShortConvUpdateParams p) {
  const int64_t d = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t b = blockIdx.y;
  if (d >= p.D) return;
  const int W = static_cast<int>(p.W);
  const Wt* wp = static_cast<const Wt*>(p.weight) + d * p.W;
  float w[kMaxConvWidth];
#pragma unroll
  for (int j = 0; j < kMaxConvWidth; ++j) w[j] = j < W - 1 ? to_f(wp[j]) : 0.f;
  const float w_last = to_f(wp[W - 1]);
  const float bias = p.bias != nullptr ? to_f(static_cast<const Wt*>(p.bias)[d]) : 0.f;
  T* st = static_cast<T*>(p.state) + (b * p.D + d) * (p.W - 1);
  float win[kMaxW1 > 0 ? kMaxW1 : 1];
#pragma unroll
  for (int j = 0; j < kMaxW1; ++j) {
    if (j < W - 1) win[j] = to_f(st[j]);
  }
  const T* x = static_cast<const T*>(p.x);
  T* y = static_cast<T*>(p.y);
  for (int64_t t = 0; t < p.T; ++t) {
    const T xs = x[(b * p.T + t) * p.D + d];
    const float xt = to_f(xs);
    const float z = bias + window_dot(W, w, win) + w_last * xt;
    shift_window(W, win, xt);
    y[(b * p.T + t) * p.D + d] = from_f<T>(p.silu ? z * sigmoidf_(z) : z);
  }
  // The window holds values read from T storage, so writing them back is exact.
#pragma unroll
  for (int j = 0; j < kMaxW1; ++j) {
    if (j < W - 1) st[j] = from_f<T>(win[j]);
  }
}

int64_t short_conv_bwd_num_partials(int64_t B, int64_t T) { return B * ceil_div(T, kBwdTokens); }

void launch_short_conv_fwd(const ShortConvParams& p, cudaStream_t stream) {
  GD_DTYPE_WTYPE_SWITCH(p.dtype, p.wdtype, T, Wt, [&] {
    const int64_t channel_blocks = ceil_div(p.D, kThreads);
    if (p.T > 0 && p.D > 0) {
      dim3 grid(static_cast<unsigned>(ceil_div(p.T, kFwdTokens)), static_cast<unsigned>(channel_blocks),
                static_cast<unsigned>(p.B));
      short_conv_fwd_kernel<T, Wt><<<grid, kThreads, 0, stream>>>(p);
      GD_CUDA_LAUNCH_CHECK();
    }
    if (p.final_state != nullptr && p.W > 1 && p.D > 0) {
      dim3 grid(static_cast<unsigned>(channel_blocks), static_cast<unsigned>(p.N));
      short_conv_final_state_kernel<T><<<grid, kThreads, 0, stream>>>(p);
      GD_CUDA_LAUNCH_CHECK();
    }
  });
}

void launch_short_conv_bwd(const ShortConvParams& p, cudaStream_t stream) {
  GD_DTYPE_WTYPE_SWITCH(p.dtype, p.wdtype, T, Wt, [&] {
    const int64_t channel_blocks = ceil_div(p.D, kThreads);
    if (p.D == 0) return;
    if (p.T > 0) {
      dim3 grid(static_cast<unsigned>(ceil_div(p.T, kBwdTokens)), static_cast<unsigned>(channel_blocks),
                static_cast<unsigned>(p.B));
      short_conv_dz_kernel<T, Wt><<<grid, kThreads, 0, stream>>>(p);
      GD_CUDA_LAUNCH_CHECK();
      dim3 grid_dx(static_cast<unsigned>(ceil_div(p.T, kFwdTokens)), static_cast<unsigned>(channel_blocks),
                   static_cast<unsigned>(p.B));
      short_conv_dx_kernel<T, Wt><<<grid_dx, kThreads, 0, stream>>>(p);
      GD_CUDA_LAUNCH_CHECK();
    }
    if (p.dh0 != nullptr && p.W > 1) {
      dim3 grid(static_cast<unsigned>(channel_blocks), static_cast<unsigned>(p.N));
      short_conv_dh0_kernel<T, Wt><<<grid, kThreads, 0, stream>>>(p);
      GD_CUDA_LAUNCH_CHECK();
    }
  });
}

void launch_short_conv_update(const ShortConvUpdateParams& p, cudaStream_t stream) {
  if (p.B == 0 || p.D == 0) return;
  GD_DTYPE_WTYPE_SWITCH(p.dtype, p.wdtype, T, Wt, [&] {
    dim3 grid(static_cast<unsigned>(ceil_div(p.D, kThreads)), static_cast<unsigned>(p.B));
    short_conv_update_kernel<T, Wt><<<grid, kThreads, 0, stream>>>(p);
    GD_CUDA_LAUNCH_CHECK();
  });
}

// ---- host side ----

using OptTensor = c10::optional<at::Tensor>;

void check_conv_width(int64_t W) {
  TORCH_CHECK(W <= kMaxConvWidth, "weight must have W <= ", kMaxConvWidth,
              " on CUDA (the convolution window is kept in registers), got W = ", W);
}

at::Tensor offsets_long(const OptTensor& cu) {
  return cu.has_value() ? cu->to(at::kLong).contiguous() : at::Tensor();
}

void fill_conv_inputs(ShortConvParams& p, const ConvSizes& s, const at::Tensor& x, const at::Tensor& weight,
                      const at::Tensor& bias, const at::Tensor& h0, const at::Tensor& cu, bool use_silu) {
  p.x = x.data_ptr();
  p.weight = weight.data_ptr();
  p.bias = bias.defined() ? bias.data_ptr() : nullptr;
  p.h0 = h0.defined() ? h0.data_ptr() : nullptr;
  p.cu = cu.defined() ? cu.data_ptr<int64_t>() : nullptr;
  static_cast<ConvSizes&>(p) = s;
  p.dtype = dtype_of(x.scalar_type(), "x");
  p.wdtype = param_dtype_of(weight.scalar_type(), p.dtype);
  p.silu = use_silu;
}

// The bias must have the weight's dtype on CUDA (one parameter type per kernel).
at::Tensor bias_as_weight(const OptTensor& bias, const at::Tensor& weight) {
  if (!bias.has_value()) return at::Tensor();
  return bias->to(weight.scalar_type()).contiguous();
}

std::tuple<at::Tensor, at::Tensor> short_conv_fwd_cuda(const at::Tensor& x, const at::Tensor& weight,
                                                       const OptTensor& bias, const OptTensor& initial_state,
                                                       const OptTensor& cu_seqlens, bool output_final_state,
                                                       bool use_silu) {
  const ConvSizes s = check_short_conv_args(x, weight, bias, initial_state, cu_seqlens);
  check_conv_width(s.W);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous(), bc = bias_as_weight(bias, weight);
  const at::Tensor h0 = initial_state.has_value() ? initial_state->contiguous() : at::Tensor();
  const at::Tensor cu = offsets_long(cu_seqlens);
  at::Tensor y = at::empty({s.B, s.T, s.D}, x.options());
  at::Tensor fs = output_final_state ? at::empty({s.N, s.D, s.W - 1}, x.options()) : at::empty({0}, x.options());
  ShortConvParams p;
  fill_conv_inputs(p, s, xc, wc, bc, h0, cu, use_silu);
  p.y = y.data_ptr();
  p.final_state = output_final_state ? fs.data_ptr() : nullptr;
  launch_short_conv_fwd(p, at::cuda::getCurrentCUDAStream());
  return {y, fs};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> short_conv_bwd_cuda(
    const at::Tensor& dy, const OptTensor& d_final_state, const at::Tensor& x, const at::Tensor& weight,
    const OptTensor& bias, const OptTensor& initial_state, const OptTensor& cu_seqlens, bool use_silu) {
  const ConvSizes s = check_short_conv_args(x, weight, bias, initial_state, cu_seqlens);
  check_conv_width(s.W);
  at::Tensor dfs = check_short_conv_grads(x, s, dy, d_final_state);
  if (dfs.defined()) dfs = dfs.to(at::kFloat).contiguous();
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous(), bc = bias_as_weight(bias, weight);
  const at::Tensor dyc = dy.to(x.scalar_type()).contiguous();
  const at::Tensor h0 = initial_state.has_value() ? initial_state->contiguous() : at::Tensor();
  const at::Tensor cu = offsets_long(cu_seqlens);
  const auto f32 = x.options().dtype(at::kFloat);
  at::Tensor dz = at::empty({s.B, s.T, s.D}, f32);
  at::Tensor part = at::empty({short_conv_bwd_num_partials(s.B, s.T), s.W + 1, s.D}, f32);
  at::Tensor dx = at::empty({s.B, s.T, s.D}, x.options());
  at::Tensor dh0 = initial_state.has_value() ? at::empty({s.N, s.D, s.W - 1}, x.options()) : at::empty({0}, x.options());
  ShortConvParams p;
  fill_conv_inputs(p, s, xc, wc, bc, h0, cu, use_silu);
  p.dy = dyc.data_ptr();
  p.dfs = dfs.defined() ? dfs.data_ptr<float>() : nullptr;
  p.dz = dz.data_ptr<float>();
  p.dw_partial = part.data_ptr<float>();
  p.dx = dx.data_ptr();
  p.dh0 = initial_state.has_value() ? dh0.data_ptr() : nullptr;
  launch_short_conv_bwd(p, at::cuda::getCurrentCUDAStream());
  const at::Tensor sums = part.sum(0);  // [W + 1, D]
  at::Tensor dweight = sums.narrow(0, 0, s.W).t().to(weight.scalar_type()).contiguous();
  at::Tensor dbias = bias.has_value() ? sums.select(0, s.W).to(bias->scalar_type(), false, /*copy=*/true)
                                      : at::empty({0}, weight.options());
  return {dx, dweight, dbias, dh0};
}

at::Tensor short_conv_update_cuda(const at::Tensor& x, at::Tensor& conv_state, const at::Tensor& weight,
                                  const OptTensor& bias, bool use_silu) {
  const ConvSizes s = check_short_conv_update_args(x, conv_state, weight, bias);
  check_conv_width(s.W);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous(), bc = bias_as_weight(bias, weight);
  at::Tensor y = at::empty({s.B, s.T, s.D}, x.options());
  ShortConvUpdateParams p;
  p.x = xc.data_ptr();
  p.state = conv_state.data_ptr();
  p.weight = wc.data_ptr();
  p.bias = bc.defined() ? bc.data_ptr() : nullptr;
  p.y = y.data_ptr();
  static_cast<ConvSizes&>(p) = s;
  p.dtype = dtype_of(x.scalar_type(), "x");
  p.wdtype = param_dtype_of(wc.scalar_type(), p.dtype);
  p.silu = use_silu;
  launch_short_conv_update(p, at::cuda::getCurrentCUDAStream());
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(gated_delta, CUDA, m) {
  m.impl("short_conv_fwd", &short_conv_fwd_cuda);
  m.impl("short_conv_bwd", &short_conv_bwd_cuda);
  m.impl("short_conv_update", &short_conv_update_cuda);
}

}  // namespace cuda
}  // namespace gated_delta
