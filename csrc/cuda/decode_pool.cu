// CUDA kernel of the state-pool decode: new tokens of N sequences against their fp32 states in a shared pool
// [num_slots, HV, K, V], read and written in place at the slots that state_indices names (checks.h gives the slot
// rules), host side and registration.
//
// Block (v tile, hv, n) advances sequence n's head hv over its tokens with the decode step's register tile
// (decode_tile.cuh): it loads the tile from the row's start slot once, and stores it once at the end (state_indices
// [N]) or after every token to that token's slot (state_indices [N, S]). Every index read from device memory is
// guarded, so that no access leaves the pool even when the host did not validate the values (check_slots=false):
// a start slot >= num_slots, or num_accepted_tokens outside [1, S], skips the row with NaN outputs; a negative
// start slot is a padded row (zero outputs); write slots out of range are skipped; cu_seqlens is clamped to [0, T].
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <vector>

#include "../checks.h"
#include "../decode_pool.h"
#include "decode_tile.cuh"

namespace gated_delta {
namespace cuda {
namespace {

// Sizes (PoolSizes: B, T, H, HV, K, V, N, num_slots, S, per_token), inputs and outputs of the pool kernel.
struct PoolParams : PoolSizes {
  const void* q = nullptr;        // [B, T, H, K], dtype
  const void* k = nullptr;        // [B, T, H, K], dtype
  const void* v = nullptr;        // [B, T, HV, V], dtype
  const void* g = nullptr;        // [B, T, HV], g_dtype
  const void* beta = nullptr;     // [B, T, HV], beta_dtype
  const void* A_log = nullptr;    // [HV], A_dtype, or nullptr (no gate in the kernel)
  const void* dt_bias = nullptr;  // [HV], dt_dtype, or nullptr (zero)
  float* pool = nullptr;          // [num_slots, HV, K, V] fp32, slot stride slot_stride, 16-byte aligned
  const void* idx = nullptr;      // [N, S] (S = 1 for 1-D state_indices), idx64 ? int64 : int32
  const void* acc = nullptr;      // [N] num_accepted_tokens, or nullptr
  const void* cu = nullptr;       // [N + 1] sequence offsets, or nullptr (N = B rows of T tokens)
  void* o = nullptr;              // [B, T, HV, V], dtype
  int64_t slot_stride = 0;
  DType dtype = DType::kFloat, g_dtype = DType::kFloat, beta_dtype = DType::kFloat, A_dtype = DType::kFloat,
        dt_dtype = DType::kFloat;
  bool idx64 = true, acc64 = true, cu64 = true;
  float scale = 1.f;
  bool l2norm = false, beta_sigmoid = false, allow_neg_eigval = false;
};

__device__ __forceinline__ int64_t load_index(const void* p, bool is64, int64_t i) {
  return is64 ? static_cast<const int64_t*>(p)[i] : static_cast<int64_t>(static_cast<const int32_t*>(p)[i]);
}

template <class T, int K, int CT, int RT>
__global__ void __launch_bounds__(CT * RT) decode_pool_kernel(PoolParams p) {
  using Tile = DecodeTile<K, CT, RT>;
  __shared__ typename Tile::Shared sh;
  Tile tile;
  const int64_t hv = blockIdx.y, n = blockIdx.z;
  const int64_t h = hv / (p.HV / p.H);
  const int64_t c0 = tile.column(blockIdx.x);  // this thread's 4 columns
  const bool active = c0 < p.V;                 // V % 4 == 0: the 4 columns are in range together

  const int64_t total = p.B * p.T;
  int64_t bos = n * p.T, eos = bos + p.T;
  if (p.cu != nullptr) {
    bos = clamp64(load_index(p.cu, p.cu64, n), 0, total);
    eos = clamp64(load_index(p.cu, p.cu64, n + 1), bos, total);
  }
  if (bos == eos) return;  // the whole block: the bounds are uniform across it

  T* o = static_cast<T*>(p.o);
  const int64_t col = p.acc != nullptr ? load_index(p.acc, p.acc64, n) - 1 : 0;
  const int64_t slot = (col >= 0 && col < p.S) ? load_index(p.idx, p.idx64, n * p.S + col) : p.num_slots;
  if (slot < 0 || slot >= p.num_slots) {  // padded (zeros) or out of range (NaN): nothing read or written
    const float fill = slot < 0 ? 0.f : __int_as_float(0x7fc00000);
    for (int64_t tok = bos; tok < eos; ++tok) tile.fill_output(o + (tok * p.HV + hv) * p.V + c0, fill, active);
    return;
  }
  const int64_t head = hv * static_cast<int64_t>(K) * p.V;
  tile.template load<true>(p.pool + slot * p.slot_stride + head, p.V, c0, active);

  const float neg_A = p.A_log != nullptr ? -__expf(load_as_float(p.A_log, p.A_dtype, hv)) : 0.f;
  const float dt_bias = p.dt_bias != nullptr ? load_as_float(p.dt_bias, p.dt_dtype, hv) : 0.f;
  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  for (int64_t tok = bos; tok < eos; ++tok) {
    const float g = load_as_float(p.g, p.g_dtype, tok * p.HV + hv);
    const float alpha = p.A_log != nullptr ? gate_alpha(g, neg_A, dt_bias) : __expf(g);
    float beta = load_as_float(p.beta, p.beta_dtype, tok * p.HV + hv);
    if (p.beta_sigmoid) beta = sigmoidf_(beta) * (p.allow_neg_eigval ? 2.f : 1.f);
    tile.step(sh, q + (tok * p.H + h) * K, k + (tok * p.H + h) * K, v + (tok * p.HV + hv) * p.V + c0,
              o + (tok * p.HV + hv) * p.V + c0, alpha, beta, p.scale, p.l2norm, active);
    const int64_t t = tok - bos;
    if (p.per_token && active && t < p.S) {
      const int64_t w = load_index(p.idx, p.idx64, n * p.S + t);
      if (w >= 0 && w < p.num_slots) tile.template store<true>(p.pool + w * p.slot_stride + head, p.V, c0);
    }
  }
  if (!p.per_token && active) tile.template store<true>(p.pool + slot * p.slot_stride + head, p.V, c0);
}

void launch_decode_pool(const PoolParams& p, cudaStream_t stream) {
  if (p.B * p.T == 0) return;
  constexpr int CT = kDecodeColThreads, RT = kDecodeRowThreads;
  GD_DTYPE_SWITCH(p.dtype, T, [&] {
    GD_HEADK_SWITCH_IN(DecodeHeadDims, p.K, KC, [&] {
      decode_pool_kernel<T, KC, CT, RT><<<decode_grid(p.V, p.HV, p.N), CT * RT, 0, stream>>>(p);
      GD_CUDA_LAUNCH_CHECK();
    });
  });
}

// ---- host side ----

// One device-to-host copy of every index value, then the checks of their values (check_slots=True).
void check_slot_values(const PoolSizes& sz, const at::Tensor& idx, const at::Tensor& acc, const at::Tensor& cu) {
  TORCH_CHECK(c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None,
              "decode_pool with check_slots=True copies the indices to the host (a stream synchronisation), which "
              "CUDA-graph capture does not allow: pass check_slots=False under capture");
  std::vector<at::Tensor> parts{idx.flatten().to(at::kLong)};
  if (acc.defined()) parts.push_back(acc.to(at::kLong));
  if (cu.defined()) parts.push_back(cu.to(at::kLong));
  const at::Tensor host = at::cat(parts).cpu();
  int64_t off = idx.numel();
  const at::Tensor acc_h = acc.defined() ? host.narrow(0, off, sz.N).contiguous() : at::Tensor();
  off += acc.defined() ? sz.N : 0;
  const at::Tensor cu_h = cu.defined() ? host.narrow(0, off, sz.N + 1).contiguous() : at::Tensor();
  check_decode_pool_values(sz, host.narrow(0, 0, idx.numel()).contiguous(), acc_h, cu_h);
}

at::Tensor decode_pool_cuda(const DecodePoolArgs& a) {
  const PoolSizes sz = check_decode_pool_args(a);
  const at::Tensor& q = a.q;
  check_decode_tile_limits("decode_pool", sz.K, sz.V, sz.HV, sz.N, "N", a.state_pool.data_ptr(), "state_pool");
  TORCH_CHECK(a.state_pool.stride(0) % 4 == 0, "state_pool must have a slot stride that is a multiple of 4 for the "
              "CUDA decode_pool (it is read as float4), got slot stride ", a.state_pool.stride(0));
  const c10::cuda::CUDAGuard guard(q.device());
  const at::Tensor idx = a.state_indices.contiguous();
  const at::Tensor acc = a.num_accepted_tokens.has_value() ? a.num_accepted_tokens->contiguous() : at::Tensor();
  const at::Tensor cu = a.cu_seqlens.has_value() ? a.cu_seqlens->contiguous() : at::Tensor();
  if (a.check_slots) check_slot_values(sz, idx, acc, cu);
  const at::Tensor qc = q.contiguous(), kc = a.k.contiguous(), vc = a.v.contiguous();
  const at::Tensor gc = a.g.contiguous(), bc = a.beta.contiguous();
  const at::Tensor Ac = a.A_log.has_value() ? a.A_log->contiguous() : at::Tensor();
  const at::Tensor dc = a.dt_bias.has_value() ? a.dt_bias->contiguous() : at::Tensor();
  at::Tensor o = at::empty({sz.B, sz.T, sz.HV, sz.V}, a.v.options());

  PoolParams p;
  static_cast<PoolSizes&>(p) = sz;
  p.q = qc.data_ptr();
  p.k = kc.data_ptr();
  p.v = vc.data_ptr();
  p.g = gc.data_ptr();
  p.beta = bc.data_ptr();
  p.A_log = Ac.defined() ? Ac.data_ptr() : nullptr;
  p.dt_bias = dc.defined() ? dc.data_ptr() : nullptr;
  p.pool = a.state_pool.data_ptr<float>();
  p.idx = idx.data_ptr();
  p.acc = acc.defined() ? acc.data_ptr() : nullptr;
  p.cu = cu.defined() ? cu.data_ptr() : nullptr;
  p.o = o.data_ptr();
  p.slot_stride = a.state_pool.stride(0);
  p.dtype = dtype_of(q.scalar_type(), "q");
  p.g_dtype = dtype_of(a.g.scalar_type(), "g");
  p.beta_dtype = dtype_of(a.beta.scalar_type(), "beta");
  if (Ac.defined()) p.A_dtype = dtype_of(Ac.scalar_type(), "A_log");
  if (dc.defined()) p.dt_dtype = dtype_of(dc.scalar_type(), "dt_bias");
  p.idx64 = idx.scalar_type() == at::kLong;
  p.acc64 = !acc.defined() || acc.scalar_type() == at::kLong;
  p.cu64 = !cu.defined() || cu.scalar_type() == at::kLong;
  p.scale = static_cast<float>(a.scale);
  p.l2norm = a.use_qk_l2norm_in_kernel;
  p.beta_sigmoid = a.use_beta_sigmoid_in_kernel;
  p.allow_neg_eigval = a.allow_neg_eigval;
  launch_decode_pool(p, at::cuda::getCurrentCUDAStream());
  return o;
}

}  // namespace

TORCH_LIBRARY_IMPL(gated_delta, CUDA, m) { m.impl("decode_pool", decode_pool_unboxed<decode_pool_cuda>); }

}  // namespace cuda
}  // namespace gated_delta
