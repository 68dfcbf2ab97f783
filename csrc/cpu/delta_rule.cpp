// The CPU backend of the gated delta rule: core_forward_cpu / core_backward_cpu (../delta_rule.h) and their
// registration. They convert the inputs once to the state dtype in the layout the algorithms (delta_rule/) read,
// pick the algorithm, run it, and put the results back into the op's layouts and dtypes.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../delta_rule.h"
#include "delta_rule/algorithms.h"

namespace gated_delta {
namespace {

using cpu::Problem;
using cpu::Unit;

Problem make_problem(const CoreArgs& a) {
  Problem p{.B = a.batch(), .T = a.seqlen(), .H = a.num_qk_heads(), .HV = a.num_v_heads(), .K = a.head_k(),
            .V = a.head_v(), .N = a.num_seqs(), .C = a.chunk_size, .scale = a.scale};
  TORCH_CHECK(p.C >= 1, "chunk_size must be >= 1, got ", p.C);
  const int64_t group = p.HV / p.H;
  const int64_t* cu = nullptr;
  at::Tensor cu_host;
  if (a.cu_seqlens.defined()) {
    TORCH_CHECK(a.cu_seqlens_cpu.defined(), "gated_delta CPU: cu_seqlens without its host copy");
    cu_host = a.cu_seqlens_cpu.to(at::kLong).contiguous();
    cu = cu_host.data_ptr<int64_t>();
  }
  p.units.reserve(p.N * p.HV);
  for (int64_t n = 0; n < p.N; ++n) {
    const int64_t b = cu ? 0 : n, t0 = cu ? cu[n] : 0, len = cu ? cu[n + 1] - cu[n] : p.T;
    p.max_len = std::max(p.max_len, len);
    for (int64_t hv = 0; hv < p.HV; ++hv) p.units.push_back(Unit{n, b, hv, hv / group, t0, len});
  }
  return p;
}

// Algorithm::Auto on the CPU:
//  - recurrent when no sequence is longer than 2 tokens (decode): the chunk set-up would dominate;
//  - scan when the (sequence, value head) units are too few to keep the threads busy (at most half as many units
//    as threads) and there is enough chunk work to spread (at least 4 chunks per thread): the scan does about
//    twice the work of the chunk algorithm but spreads one unit over every thread;
//  - chunk otherwise.
Algorithm resolve_algorithm(const Problem& p, const CoreArgs& a) {
  const Algorithm requested = a.algorithm;
  TORCH_CHECK(!a.has_kv_gates() || requested == Algorithm::Recurrent,
              "gated_delta CPU: gk / gv need the recurrent algorithm, got ", algorithm_name(requested));
  if (requested != Algorithm::Auto) return requested;
  if (p.max_len <= 2) return Algorithm::Recurrent;
  const int64_t threads = at::get_num_threads();
  int64_t units = 0, chunks = 0;
  for (const Unit& u : p.units) {
    if (u.len > 0) ++units;
    chunks += p.num_chunks(u);
  }
  if (threads >= 2 && 2 * units <= threads && chunks >= 4 * threads) return Algorithm::Scan;
  return Algorithm::Chunk;
}

// x [B, T, heads, D] (any dtype, any strides) -> contiguous [B, heads, T, D] in dtype sd.
at::Tensor heads_major(const at::Tensor& x, at::ScalarType sd) {
  return at::empty({x.size(0), x.size(2), x.size(1), x.size(3)}, x.options().dtype(sd))
      .copy_(x.permute({0, 2, 1, 3}));
}

// x [B, T, HV] -> contiguous [B, HV, T].
at::Tensor heads_major3(const at::Tensor& x, at::ScalarType sd) {
  return at::empty({x.size(0), x.size(2), x.size(1)}, x.options().dtype(sd)).copy_(x.permute({0, 2, 1}));
}

// d [B, HV, T, D] per value head -> [B, T, H, D], each group of HV / H value heads summed in a fixed order.
template <typename T>
at::Tensor sum_groups(const at::Tensor& d, int64_t H) {
  const int64_t B = d.size(0), HV = d.size(1), Tn = d.size(2), D = d.size(3), group = HV / H;
  if (group == 1) return d.permute({0, 2, 1, 3}).contiguous();
  at::Tensor out = at::empty({B, Tn, H, D}, d.options());
  const T* src = d.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  at::parallel_for(0, B * Tn, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / Tn, t = r % Tn;
      for (int64_t h = 0; h < H; ++h) {
        T* o = dst + ((b * Tn + t) * H + h) * D;
        const T* first = src + ((b * HV + h * group) * Tn + t) * D;
        for (int64_t e = 0; e < D; ++e) o[e] = first[e];
        for (int64_t gi = 1; gi < group; ++gi) {
          const T* s = src + ((b * HV + h * group + gi) * Tn + t) * D;
          for (int64_t e = 0; e < D; ++e) o[e] += s[e];
        }
      }
    }
  });
  return out;
}

struct Converted {
  at::Tensor q, k, v, g, beta, h0, gk, gv;
};

Converted convert(const CoreArgs& a) {
  const at::ScalarType sd = a.state_dtype();
  Converted c;
  c.q = heads_major(a.q, sd);
  c.k = heads_major(a.k, sd);
  c.v = heads_major(a.v, sd);
  c.g = heads_major3(a.g, sd);
  c.beta = heads_major3(a.beta, sd);
  // the kernels take [N, HV, K, V] states: a [V, K]-first state is transposed here (CPU only: CUDA reads it in place)
  if (a.initial_state.defined()) c.h0 = state_k_first(a.initial_state, a.state_v_first).to(sd).contiguous();
  if (a.gk.defined()) c.gk = heads_major(a.gk, sd);
  if (a.gv.defined()) c.gv = heads_major(a.gv, sd);
  return c;
}

template <typename T>
cpu::Inputs<T> inputs_of(const Converted& c) {
  auto ptr = [](const at::Tensor& t) -> const T* { return t.defined() ? t.data_ptr<T>() : nullptr; };
  return cpu::Inputs<T>{ptr(c.q), ptr(c.k), ptr(c.v), ptr(c.g), ptr(c.beta), ptr(c.h0), ptr(c.gk), ptr(c.gv)};
}

template <typename T>
CoreForward forward_impl(const CoreArgs& args, bool output_final_state) {
  const Problem p = make_problem(args);
  const Algorithm algo = resolve_algorithm(p, args);
  const Converted c = convert(args);
  const cpu::Inputs<T> in = inputs_of<T>(c);
  const auto opts = args.v.options().dtype(args.state_dtype());
  at::Tensor o_heads = at::empty({p.B, p.HV, p.T, p.V}, opts);
  at::Tensor ht;
  if (output_final_state) ht = at::empty({p.N, p.HV, p.K, p.V}, opts);
  T* o = o_heads.data_ptr<T>();
  T* htp = output_final_state ? ht.data_ptr<T>() : nullptr;
  switch (algo) {
    case Algorithm::Recurrent: cpu::recurrent_forward<T>(p, in, o, htp); break;
    case Algorithm::Scan: cpu::scan_forward<T>(p, in, o, htp); break;
    default: cpu::chunk_forward<T>(p, in, o, htp); break;
  }
  CoreForward r;
  r.o = at::empty(args.v.sizes(), args.v.options().memory_format(at::MemoryFormat::Contiguous));
  r.o.copy_(o_heads.permute({0, 2, 1, 3}));
  r.final_state = ht.defined() ? state_k_first(ht, args.state_v_first).contiguous() : ht;
  return r;
}

template <typename T>
CoreGrads backward_impl(const CoreArgs& args, const at::Tensor& d_o, const at::Tensor& d_final_state) {
  const Problem p = make_problem(args);
  const Algorithm algo = resolve_algorithm(p, args);
  const at::ScalarType sd = args.state_dtype();
  const Converted c = convert(args);
  const cpu::Inputs<T> in = inputs_of<T>(c);
  const auto opts = args.v.options().dtype(sd);
  const at::Tensor do_heads = heads_major(d_o, sd);
  at::Tensor dht;
  if (d_final_state.defined() && d_final_state.numel() > 0) {
    dht = state_k_first(d_final_state, args.state_v_first).to(sd).contiguous();
  }

  at::Tensor dq = at::empty({p.B, p.HV, p.T, p.K}, opts);
  at::Tensor dk = at::empty({p.B, p.HV, p.T, p.K}, opts);
  at::Tensor dv = at::empty({p.B, p.HV, p.T, p.V}, opts);
  at::Tensor dg = at::empty({p.B, p.HV, p.T}, opts);
  at::Tensor dbeta = at::empty({p.B, p.HV, p.T}, opts);
  at::Tensor dh0;
  if (args.initial_state.defined()) dh0 = at::empty({p.N, p.HV, p.K, p.V}, opts);
  at::Tensor dgk, dgv;
  if (args.gk.defined()) dgk = at::empty({p.B, p.HV, p.T, p.K}, opts);
  if (args.gv.defined()) dgv = at::empty({p.B, p.HV, p.T, p.V}, opts);
  auto ptr = [](const at::Tensor& t) -> T* { return t.defined() ? t.data_ptr<T>() : nullptr; };
  const cpu::Grads<T> gr{ptr(dq), ptr(dk), ptr(dv), ptr(dg), ptr(dbeta), ptr(dh0), ptr(dgk), ptr(dgv)};
  const T* dop = do_heads.data_ptr<T>();
  const T* dhtp = dht.defined() ? dht.data_ptr<T>() : nullptr;
  switch (algo) {
    case Algorithm::Recurrent: cpu::recurrent_backward<T>(p, in, dop, dhtp, gr); break;
    case Algorithm::Scan: cpu::scan_backward<T>(p, in, dop, dhtp, gr); break;
    default: cpu::chunk_backward<T>(p, in, dop, dhtp, gr); break;
  }
  CoreGrads r;
  r.dq = sum_groups<T>(dq, p.H);
  r.dk = sum_groups<T>(dk, p.H);
  r.dv = dv.permute({0, 2, 1, 3}).contiguous();
  r.dg = dg.permute({0, 2, 1}).contiguous();
  r.dbeta = dbeta.permute({0, 2, 1}).contiguous();
  r.d_initial_state = dh0.defined() ? state_k_first(dh0, args.state_v_first).contiguous() : dh0;
  if (dgk.defined()) r.dgk = dgk.permute({0, 2, 1, 3}).contiguous();
  if (dgv.defined()) r.dgv = dgv.permute({0, 2, 1, 3}).contiguous();
  return r;
}

}  // namespace

// The CPU backend keeps no residual: its backward recomputes everything (keep_residual is not used).
CoreForward core_forward_cpu(const CoreArgs& args, bool output_final_state, bool /*keep_residual*/) {
  if (args.state_dtype() == at::kDouble) return forward_impl<double>(args, output_final_state);
  return forward_impl<float>(args, output_final_state);
}

CoreGrads core_backward_cpu(const CoreArgs& args, const at::Tensor& d_o, const at::Tensor& d_final_state) {
  TORCH_CHECK(!args.residual.defined(), "residual: the CPU backend keeps none (fwd_with_residual returns an empty "
              "tensor on the CPU), got ", args.residual.numel(), " bytes");
  if (args.state_dtype() == at::kDouble) return backward_impl<double>(args, d_o, d_final_state);
  return backward_impl<float>(args, d_o, d_final_state);
}

TORCH_LIBRARY_IMPL(gated_delta, CPU, m) {
  m.impl("fwd", fwd_kernel<fwd_impl<core_forward_cpu>>);
  m.impl("fwd_with_residual", fwd_residual_kernel<fwd_residual_impl<core_forward_cpu>>);
  m.impl("bwd", bwd_kernel<bwd_impl<core_backward_cpu>>);
}

}  // namespace gated_delta
