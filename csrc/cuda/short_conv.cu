// CUDA kernels of the causal depthwise short convolution (+ SiLU), its backward and its decode update.
//   y[t, d] = act(bias[d] + sum_{j<W} w[d, j] x[t - (W-1) + j, d])      (per sequence; before its start: h0 or 0)
// A thread owns one channel and a run of consecutive tokens, with the last W-1 inputs in registers; the threads of
// a block cover consecutive channels, so every global access is coalesced across the warp.
#include "device_utils.cuh"

namespace gated_delta {
namespace layer_cuda {
namespace {

constexpr int kThreads = 128;       // channels per block
constexpr int kFwdTokens = 16;      // tokens per thread, forward and dx
constexpr int kBwdTokens = 128;     // tokens per thread in the dz / weight-gradient pass
constexpr int kMaxW1 = kMaxConvWidth - 1;

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
  if (pos >= s.start) return to_float(x[(b * p.T + pos) * p.D + d]);
  if (h0 == nullptr) return 0.f;
  return to_float(h0[(s.n * p.D + d) * (p.W - 1) + (p.W - 1) + (pos - s.start)]);
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
  for (int j = 0; j < kMaxConvWidth; ++j) w[j] = j < p.W - 1 ? to_float(wp[j]) : 0.f;
  w_last = to_float(wp[p.W - 1]);
  bias = p.bias != nullptr ? to_float(static_cast<const Wt*>(p.bias)[d]) : 0.f;
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

// grid (token tiles, channel blocks, B)
template <class T, class Wt>
__global__ void __launch_bounds__(kThreads) short_conv_fwd_kernel(ShortConvParams p) {
  const int64_t d = static_cast<int64_t>(blockIdx.y) * kThreads + threadIdx.x;
  const int64_t b = blockIdx.z;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kFwdTokens;
  if (d >= p.D || t0 >= p.T) return;
  const int64_t t1 = min(t0 + kFwdTokens, p.T);
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
    const float xt = to_float(x[(b * p.T + t) * p.D + d]);
    const float z = bias + window_dot(p.W, w, win) + w_last * xt;
    shift_window(p.W, win, xt);
    y[(b * p.T + t) * p.D + d] = from_float<T>(p.silu ? z * sigmoidf_(z) : z);
  }
}

// The last W-1 inputs of every sequence. grid (channel blocks, N)
template <class T>
__global__ void __launch_bounds__(kThreads) short_conv_final_state_kernel(ShortConvParams p) {
  const int64_t d = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t n = blockIdx.y;
  if (d >= p.D) return;
  SeqPos s{n, 0, p.T};
  int64_t b = n;
  if (p.cu != nullptr) {
    b = 0;
    s.start = clamp64(p.cu[n], 0, p.T);
    s.end = clamp64(p.cu[n + 1], s.start, p.T);
  }
  const T* x = static_cast<const T*>(p.x);
  const T* h0 = static_cast<const T*>(p.h0);
  T* fs = static_cast<T*>(p.final_state);
  for (int64_t j = 0; j < p.W - 1; ++j) {
    const int64_t pos = s.end - (p.W - 1) + j;
    fs[(n * p.D + d) * (p.W - 1) + j] = from_float<T>(conv_input(p, x, h0, b, s, pos, d));
  }
}

// Backward pass 1: dz = dy * act'(z) (z recomputed) and each token tile's partial weight / bias gradients
//   dw[j, d] = sum_t dz[t, d] x[t - (W-1) + j, d],  db[d] = sum_t dz[t, d]
// written to dw_partial[tile, 0..W, d] (summed on the host side in a fixed order: deterministic).
template <class T, class Wt>
__global__ void __launch_bounds__(kThreads) short_conv_dz_kernel(ShortConvParams p) {
  const int64_t d = static_cast<int64_t>(blockIdx.y) * kThreads + threadIdx.x;
  const int64_t b = blockIdx.z;
  const int64_t tile = static_cast<int64_t>(b) * gridDim.x + blockIdx.x;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kBwdTokens;
  if (d >= p.D) return;
  const int64_t t1 = min(t0 + kBwdTokens, p.T);
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
      const float xt = to_float(x[i]);
      const float z = bias + window_dot(p.W, w, win) + w_last * xt;
      float g = to_float(dy[i]);
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
  const int64_t d = static_cast<int64_t>(blockIdx.y) * kThreads + threadIdx.x;
  const int64_t b = blockIdx.z;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kFwdTokens;
  if (d >= p.D || t0 >= p.T) return;
  const int64_t t1 = min(t0 + kFwdTokens, p.T);
  float w[kMaxConvWidth], w_last, bias;
  load_weights<Wt>(p, d, w, w_last, bias);
  T* dx = static_cast<T*>(p.dx);
  SeqPos s = locate(p, b, t0);
  for (int64_t t = t0; t < t1; ++t) {
    advance(p, t, s);
    dx[(b * p.T + t) * p.D + d] = from_float<T>(input_grad<Wt>(p, w, w_last, b, s, t, d));
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
  SeqPos s{n, 0, p.T};
  int64_t b = n;
  if (p.cu != nullptr) {
    b = 0;
    s.start = clamp64(p.cu[n], 0, p.T);
    s.end = clamp64(p.cu[n + 1], s.start, p.T);
  }
  T* dh0 = static_cast<T*>(p.dh0);
  for (int64_t i = 0; i < p.W - 1; ++i) {
    const int64_t pos = s.start - (p.W - 1) + i;
    dh0[(n * p.D + d) * (p.W - 1) + i] = from_float<T>(input_grad<Wt>(p, w, w_last, b, s, pos, d));
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
  for (int j = 0; j < kMaxConvWidth; ++j) w[j] = j < W - 1 ? to_float(wp[j]) : 0.f;
  const float w_last = to_float(wp[W - 1]);
  const float bias = p.bias != nullptr ? to_float(static_cast<const Wt*>(p.bias)[d]) : 0.f;
  T* st = static_cast<T*>(p.state) + (b * p.D + d) * (p.W - 1);
  float win[kMaxW1 > 0 ? kMaxW1 : 1];
#pragma unroll
  for (int j = 0; j < kMaxW1; ++j) {
    if (j < W - 1) win[j] = to_float(st[j]);
  }
  const T* x = static_cast<const T*>(p.x);
  T* y = static_cast<T*>(p.y);
  for (int64_t t = 0; t < p.T; ++t) {
    const T xs = x[(b * p.T + t) * p.D + d];
    const float xt = to_float(xs);
    const float z = bias + window_dot(W, w, win) + w_last * xt;
    shift_window(W, win, xt);
    y[(b * p.T + t) * p.D + d] = from_float<T>(p.silu ? z * sigmoidf_(z) : z);
  }
  // The window holds values read from T storage, so writing them back is exact.
#pragma unroll
  for (int j = 0; j < kMaxW1; ++j) {
    if (j < W - 1) st[j] = from_float<T>(win[j]);
  }
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

int64_t short_conv_bwd_num_partials(int64_t B, int64_t T) { return B * ceil_div(T, kBwdTokens); }

cudaError_t short_conv_fwd(const ShortConvParams& p, cudaStream_t stream) {
  if (p.W < 1 || p.W > kMaxConvWidth) return cudaErrorInvalidValue;
  return LAYER_DTYPE_WTYPE_SWITCH(p.dtype, p.wdtype, T, Wt, [&] {
    const int64_t channel_blocks = ceil_div(p.D, kThreads);
    if (p.T > 0 && p.D > 0) {
      dim3 grid(static_cast<unsigned>(ceil_div(p.T, kFwdTokens)), static_cast<unsigned>(channel_blocks),
                static_cast<unsigned>(p.B));
      short_conv_fwd_kernel<T, Wt><<<grid, kThreads, 0, stream>>>(p);
      cudaError_t e = cudaGetLastError();
      if (e != cudaSuccess) return e;
    }
    if (p.final_state != nullptr && p.W > 1 && p.D > 0) {
      dim3 grid(static_cast<unsigned>(channel_blocks), static_cast<unsigned>(p.N));
      short_conv_final_state_kernel<T><<<grid, kThreads, 0, stream>>>(p);
    }
    return cudaGetLastError();
  });
}

cudaError_t short_conv_bwd(const ShortConvParams& p, cudaStream_t stream) {
  if (p.W < 1 || p.W > kMaxConvWidth) return cudaErrorInvalidValue;
  return LAYER_DTYPE_WTYPE_SWITCH(p.dtype, p.wdtype, T, Wt, [&] {
    const int64_t channel_blocks = ceil_div(p.D, kThreads);
    if (p.D == 0) return cudaSuccess;
    if (p.T > 0) {
      dim3 grid(static_cast<unsigned>(ceil_div(p.T, kBwdTokens)), static_cast<unsigned>(channel_blocks),
                static_cast<unsigned>(p.B));
      short_conv_dz_kernel<T, Wt><<<grid, kThreads, 0, stream>>>(p);
      cudaError_t e = cudaGetLastError();
      if (e != cudaSuccess) return e;
      dim3 grid_dx(static_cast<unsigned>(ceil_div(p.T, kFwdTokens)), static_cast<unsigned>(channel_blocks),
                   static_cast<unsigned>(p.B));
      short_conv_dx_kernel<T, Wt><<<grid_dx, kThreads, 0, stream>>>(p);
      e = cudaGetLastError();
      if (e != cudaSuccess) return e;
    }
    if (p.dh0 != nullptr && p.W > 1) {
      dim3 grid(static_cast<unsigned>(channel_blocks), static_cast<unsigned>(p.N));
      short_conv_dh0_kernel<T, Wt><<<grid, kThreads, 0, stream>>>(p);
    }
    return cudaGetLastError();
  });
}

cudaError_t short_conv_update(const ShortConvUpdateParams& p, cudaStream_t stream) {
  if (p.W < 1 || p.W > kMaxConvWidth) return cudaErrorInvalidValue;
  if (p.B == 0 || p.D == 0) return cudaSuccess;
  return LAYER_DTYPE_WTYPE_SWITCH(p.dtype, p.wdtype, T, Wt, [&] {
    dim3 grid(static_cast<unsigned>(ceil_div(p.D, kThreads)), static_cast<unsigned>(p.B));
    short_conv_update_kernel<T, Wt><<<grid, kThreads, 0, stream>>>(p);
    return cudaGetLastError();
  });
}

}  // namespace layer_cuda
}  // namespace gated_delta
