// Host side of the recurrent CUDA kernels (recurrent.h), which run the gated delta rule with per-key / per-value
// decays (gk, gv): limits, layouts, scratch, launches on the current stream, and the deterministic sums of the
// per-tile partial gradients. Called by cuda/delta_rule.cpp under its device guard.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "../../checks.h"
#include "../../delta_rule.h"
#include "recurrent.h"

namespace gated_delta {

namespace {

using cuda::RecParams;

struct RecCall {
  at::Tensor q, k, v, g, beta, gk, gv, h0, cu;
  RecParams p{};
  int64_t max_len = 0;  // longest sequence
  void* stream = nullptr;
};

RecCall begin_recurrent(const CoreArgs& a) {
  const int64_t K = a.head_k(), V = a.head_v();
  TORCH_CHECK(K <= cuda::kRecMaxDim,
              std::string("gated_delta CUDA: with gk / gv the head dim K must be at most ") +
                  std::to_string(cuda::kRecMaxDim) + " (V any), got K = " + std::to_string(K) + ", V = " +
                  std::to_string(V));
  // (a larger V runs in slices of at most kRecMaxDim columns, core_forward_cuda / core_backward_cuda)
  TORCH_CHECK(V <= cuda::kRecMaxDim, "gated_delta CUDA: V = ", V, " reached the token-loop kernels unsliced");
  TORCH_CHECK(a.batch() * a.seqlen() * std::max(a.num_qk_heads(), a.num_v_heads()) * std::max(K, V) <
                  (int64_t(1) << 62),
              "gated_delta CUDA: the inputs are too large");
  RecCall c;
  c.stream = at::cuda::getCurrentCUDAStream().stream();
  c.q = a.q.contiguous();
  c.k = a.k.contiguous();
  c.v = a.v.contiguous();
  c.g = a.g.to(at::kFloat).contiguous();
  c.beta = a.beta.to(at::kFloat).contiguous();
  if (a.gk.defined()) c.gk = a.gk.to(at::kFloat).contiguous();
  if (a.gv.defined()) c.gv = a.gv.to(at::kFloat).contiguous();
  if (a.initial_state.defined()) c.h0 = a.initial_state.to(at::kFloat).contiguous();
  RecParams& p = c.p;
  p.B = static_cast<int>(a.batch());
  p.T = static_cast<int>(a.seqlen());
  p.H = static_cast<int>(a.num_qk_heads());
  p.HV = static_cast<int>(a.num_v_heads());
  p.K = static_cast<int>(K);
  p.V = static_cast<int>(V);
  p.N = static_cast<int>(a.num_seqs());
  p.G = p.HV / p.H;
  p.nvt = static_cast<int>((V + cuda::kRecCols - 1) / cuda::kRecCols);
  c.max_len = a.seqlen();
  if (a.cu_seqlens.defined()) {
    const at::Tensor host = host_cu_seqlens(a.cu_seqlens, a.cu_seqlens_cpu, a.seqlen());
    const int64_t* cu = host.data_ptr<int64_t>();
    c.max_len = 0;
    for (int64_t n = 0; n < host.size(0) - 1; ++n) c.max_len = std::max(c.max_len, cu[n + 1] - cu[n]);
    c.cu = a.cu_seqlens.to(at::kLong).contiguous();
    p.cu = c.cu.data_ptr<int64_t>();
  }
  p.q = c.q.data_ptr();
  p.k = c.k.data_ptr();
  p.v = c.v.data_ptr();
  p.qk_dtype = cuda::dtype_of(c.q.scalar_type(), "q");
  p.v_dtype = cuda::dtype_of(c.v.scalar_type(), "v");
  p.g = c.g.data_ptr<float>();
  p.beta = c.beta.data_ptr<float>();
  p.gk = c.gk.defined() ? c.gk.data_ptr<float>() : nullptr;
  p.gv = c.gv.defined() ? c.gv.data_ptr<float>() : nullptr;
  p.h0 = c.h0.defined() ? c.h0.data_ptr<float>() : nullptr;
  p.state_v_first = a.state_v_first;
  p.scale = static_cast<float>(a.scale);
  return c;
}

// Sum of per-tile (and per-value-head) partials [rows, P, E] -> [rows, E], fp32, in a fixed order.
at::Tensor sum_parts(const at::Tensor& parts, int64_t rows, int64_t P, int64_t E, void* stream) {
  at::Tensor out = at::empty({rows, E}, parts.options());
  cuda::launch_sum_parts(parts.data_ptr<float>(), out.data_ptr<float>(), rows, static_cast<int>(P),
                         static_cast<int>(E), stream);
  return out;
}

}  // namespace

CoreForward recurrent_forward_cuda(const CoreArgs& a, bool output_final_state) {
  RecCall c = begin_recurrent(a);
  RecParams& p = c.p;
  CoreForward r;
  r.o = at::empty(c.v.sizes(), c.v.options());
  p.o = r.o.data_ptr();
  if (output_final_state) {
    r.final_state = at::empty(p.state_v_first ? at::IntArrayRef{p.N, p.HV, p.V, p.K}
                                                    : at::IntArrayRef{p.N, p.HV, p.K, p.V},
                               c.q.options().dtype(at::kFloat));
    p.ht = r.final_state.data_ptr<float>();
  }
  cuda::launch_recurrent_fwd(p, c.stream);
  return r;
}

CoreGrads recurrent_backward_cuda(const CoreArgs& a, const at::Tensor& d_o, const at::Tensor& d_final_state) {
  RecCall c = begin_recurrent(a);
  RecParams& p = c.p;
  const auto f32 = c.q.options().dtype(at::kFloat);
  const int64_t BT = a.batch() * a.seqlen(), H = p.H, HV = p.HV, K = p.K, V = p.V, nvt = p.nvt;
  at::Tensor dO = (d_o.scalar_type() == at::kDouble ? d_o.to(at::kFloat) : d_o).contiguous();
  p.d_o = dO.data_ptr();
  p.do_dtype = cuda::dtype_of(dO.scalar_type(), "d_o");
  at::Tensor dht;
  if (d_final_state.defined()) {
    dht = d_final_state.to(at::kFloat).contiguous();
    p.dht = dht.data_ptr<float>();
  }
  // checkpoints (floor(BT / C) + N slots, recurrent.h) and the per-CTA states of one chunk
  const int64_t slots = BT / cuda::kRecChunk + p.N + 1;
  at::Tensor ckpt = at::empty({slots, HV, K, V}, f32);
  p.ckpt = ckpt.data_ptr<float>();
  p.scratch_slots = static_cast<int>(std::min<int64_t>(cuda::kRecChunk, std::max<int64_t>(c.max_len, 1)) + 1);
  const int64_t KP = int64_t(cuda::kRecWarps) * cuda::rec_rows_per_thread(K);
  at::Tensor scratch = at::empty({int64_t(p.N) * HV * nvt, p.scratch_slots, KP, cuda::kRecCols}, f32);
  p.scratch = scratch.data_ptr<float>();

  at::Tensor dq_part = at::empty({BT, H, p.G * nvt, K}, f32);
  at::Tensor dk_part = at::empty({BT, H, p.G * nvt, K}, f32);
  at::Tensor dg_part = at::empty({BT, HV, nvt}, f32);
  at::Tensor dbeta_part = at::empty({BT, HV, nvt}, f32);
  at::Tensor dgk_part;
  if (a.gk.defined()) dgk_part = at::empty({BT, HV, nvt, K}, f32);
  CoreGrads gr;
  gr.dv = at::empty(c.v.sizes(), f32);
  if (a.gv.defined()) gr.dgv = at::empty(c.v.sizes(), f32);
  if (a.initial_state.defined()) gr.d_initial_state = at::empty(a.initial_state.sizes(), f32);
  p.dq_part = dq_part.data_ptr<float>();
  p.dk_part = dk_part.data_ptr<float>();
  p.dg_part = dg_part.data_ptr<float>();
  p.dbeta_part = dbeta_part.data_ptr<float>();
  p.dgk_part = dgk_part.defined() ? dgk_part.data_ptr<float>() : nullptr;
  p.dv = gr.dv.data_ptr<float>();
  p.dgv = gr.dgv.defined() ? gr.dgv.data_ptr<float>() : nullptr;
  p.dh0 = gr.d_initial_state.defined() ? gr.d_initial_state.data_ptr<float>() : nullptr;
  cuda::launch_recurrent_bwd(p, c.stream);
  ckpt.reset();
  scratch.reset();

  gr.dq = sum_parts(dq_part, BT * H, p.G * nvt, K, c.stream).view(a.q.sizes());
  gr.dk = sum_parts(dk_part, BT * H, p.G * nvt, K, c.stream).view(a.k.sizes());
  gr.dg = sum_parts(dg_part, BT * HV, nvt, 1, c.stream).view(a.g.sizes());
  gr.dbeta = sum_parts(dbeta_part, BT * HV, nvt, 1, c.stream).view(a.beta.sizes());
  if (dgk_part.defined()) gr.dgk = sum_parts(dgk_part, BT * HV, nvt, K, c.stream).view(a.gk.sizes());
  return gr;
}

}  // namespace gated_delta
