// Host side of the CUDA backend of the gated delta rule: core_forward_cuda / core_backward_cuda (../delta_rule.h)
// and their registration. Validates what only the CUDA kernels limit (head dims, dtypes), lays out the chunks and
// work units (equal-length batches need no host data, so no device->host sync and the calls are CUDA-graph
// capturable; varlen batches build small tables on the host), allocates the intermediates and launches the kernels
// (delta_rule/) on the current stream.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include <torch/library.h>

#include "../checks.h"
#include "../delta_rule.h"
#include "delta_rule/params.h"
#include "gate_beta.h"

namespace gated_delta {

// The token-loop kernels, for per-key / per-value decays (delta_rule/recurrent_host.cpp).
CoreForward recurrent_forward_cuda(const CoreArgs& a, bool output_final_state);
CoreGrads recurrent_backward_cuda(const CoreArgs& a, const at::Tensor& d_o, const at::Tensor& d_final_state);
// (this file's core functions: a V above the kernels' head dims runs as slices, each a call of its own)
CoreForward core_forward_cuda(const CoreArgs& a, bool output_final_state, bool keep_residual);
CoreGrads core_backward_cuda(const CoreArgs& a, const at::Tensor& d_o, const at::Tensor& d_final_state);

namespace {

using cuda::Params;
constexpr int kC = cuda::kChunk;

// core_forward_cuda / core_backward_cuda, writing o (dv) into the given view where the call runs unpadded on the
// chunk kernels (o_into / dv_into: undefined, or as row_strides allows: a V slice's columns of the whole call's
// output); elsewhere the result is a tensor of its own, which the caller copies
CoreForward forward_cuda(const CoreArgs& a, bool output_final_state, bool keep_residual, const at::Tensor& o_into);
CoreGrads backward_cuda(const CoreArgs& a, const at::Tensor& d_o, const at::Tensor& d_final_state,
                        const at::Tensor& dv_into);

// The storage types the kernels take (dispatch.cuh) for q, k, v and, read in place, beta.
bool is_kernel_dtype(at::ScalarType st) { return st == at::kBFloat16 || st == at::kHalf || st == at::kFloat; }

// K up to the kernels' largest head dim; V any (larger V runs in slices, below)
void check_head_k(const CoreArgs& a) {
  // (the message is formatted with std::to_string: streaming integers into c10::str crashed in one toolchain mix)
  TORCH_CHECK(cuda::padded_head_dim(a.head_k()) != 0,
              std::string("gated_delta CUDA kernels support head dim K up to ") + std::to_string(cuda::max_head_dim()) +
                  " (V any), got K = " + std::to_string(a.head_k()) + ", V = " + std::to_string(a.head_v()));
}

void check_cuda_limits(const CoreArgs& a) {
  check_head_k(a);
  TORCH_CHECK(cuda::padded_head_dim(a.head_v()) != 0, "gated_delta CUDA: V = ", a.head_v(),
              " reached the kernels unsliced (largest head dim ", cuda::max_head_dim(), ")");
  const auto st = a.q.scalar_type();
  TORCH_CHECK(is_kernel_dtype(st),
              std::string("gated_delta CUDA kernels support bfloat16, float16 and float32 inputs, got ") +
                  c10::toString(st));
  TORCH_CHECK(a.seqlen() * std::max(a.num_qk_heads(), a.num_v_heads()) < (int64_t(1) << 31) &&
                  a.batch() * a.seqlen() < (int64_t(1) << 31),
              "gated_delta CUDA kernels: B * T * heads must stay below 2^31");
}

// contiguous, 16-byte aligned (cp.async moves 16-byte vectors)
at::Tensor dense(const at::Tensor& x) {
  at::Tensor y = x.contiguous();
  if (reinterpret_cast<uintptr_t>(y.data_ptr()) % 16 != 0) y = y.clone();
  return y;
}

// The strides (Params::ld_*, tok_*) by which the kernels address a [B, T, HV, V] tensor (v, o, d_o, dv) in place:
// each head's V elements contiguous, the heads of a token ld >= V elements apart, the tokens tok >= HV ld apart
// and the batch's sequences T tok, every head's row 16-byte aligned (cp.async and TMA move 16-byte vectors). A
// contiguous tensor has ld = V, tok = HV V; a slice of v's columns, or v split from the output of a fused q | k | v
// projection (tokens D elements apart), has larger ones. {0, 0} for any other layout.
struct RowStrides {
  int64_t ld = 0, tok = 0;
};
RowStrides row_strides(const at::Tensor& x) {
  const int64_t B = x.size(0), T = x.size(1), HV = x.size(2), V = x.size(3);
  const int64_t ld = HV > 1 ? x.stride(2) : V;
  const int64_t tok = T > 1 ? x.stride(1) : B > 1 ? x.stride(0) : HV * ld;
  const bool rows = ld >= V && tok >= HV * ld && (V == 1 || x.stride(3) == 1) && (B == 1 || x.stride(0) == T * tok);
  const int64_t es = x.element_size();
  const bool aligned =
      (ld * es) % 16 == 0 && (tok * es) % 16 == 0 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0;
  return rows && aligned ? RowStrides{ld, tok} : RowStrides{};
}

// An input (v, d_o) as the kernels read it: in place where row_strides allows, else a dense copy.
struct Rows {
  at::Tensor t;
  RowStrides s;
};
Rows rows_of(const at::Tensor& x) {
  const RowStrides s = row_strides(x);
  if (s.ld > 0) return {x, s};
  const at::Tensor d = dense(x);
  return {d, RowStrides{d.size(3), d.size(2) * d.size(3)}};
}

// An output (o, dv) the caller passed to be written in place: what row_strides allows, of the expected sizes and
// dtype (an internal invariant: the callers are the V slices below)
RowStrides output_strides(const at::Tensor& x, at::IntArrayRef sizes, std::initializer_list<at::ScalarType> dtypes,
                          const char* name) {
  const RowStrides s = row_strides(x);
  bool dtype_ok = false;
  for (at::ScalarType d : dtypes) dtype_ok = dtype_ok || x.scalar_type() == d;
  TORCH_CHECK(s.ld > 0 && x.sizes() == sizes && dtype_ok, "gated_delta CUDA: ", name, " to write in place must have ",
              sizes, " rows of 16-byte aligned heads in a kernel dtype, got sizes ", x.sizes(), ", strides ",
              x.strides(), ", ", x.scalar_type());
  return s;
}

int num_sms(const at::Tensor& x) {
  return at::cuda::getDeviceProperties(x.device().index())->multiProcessorCount;
}

// Chunks, work units and (varlen) their device tables.
struct Layout {
  bool scan = false;
  bool warm = false;  // segments with a proven warm-up (warmup.cuh)
  int warm_max = 0;
  int N = 0, NC = 0, CPS = 0;
  int num_units = 0, seg = 1, segs_per_seq = 1;
  at::Tensor table;  // device int32: chunk_tok | chunk_len | unit_tab | unit_off
  const int* chunk_tok = nullptr;
  const int* chunk_len = nullptr;
  const int* unit_tab = nullptr;
  const int* unit_off = nullptr;
  at::Tensor cu_host;  // varlen: the host copy of cu_seqlens the layout was made from (int64)
};

// tiles_per_sm: 64-column state tiles of the state kernels that share an SM (one per CTA, or two per CTA of two
// warpgroups). tables = false: the counts only (varlen: no device tables).
Layout make_layout(const CoreArgs& a, int tiles_per_sm, bool tables = true) {
  Layout L;
  const int64_t T = a.seqlen();
  const int64_t units_per_head = a.head_v() / 64;
  const int sms = num_sms(a.q), slots = sms * tiles_per_sm;
  const int64_t lanes = a.num_v_heads() * units_per_head;  // CTAs of the state kernels per work unit
  // Auto: when one CTA per (sequence, value head, 64 columns) would fill fewer than half of the SMs' slots, cut the
  // sequences into segments run at once after a proven warm-up (warmup.cuh); the scan only when asked for;
  // chunk (and recurrent, which runs the chunk kernels on CUDA) walk each sequence whole
  constexpr int kMinSegment = 8;  // chunks: a warm-up takes about 6 at typical gates
  auto want_scan = [&](int64_t, int64_t) { return a.algorithm == Algorithm::Scan; };
  auto want_warm = [&](int64_t n_seqs, int64_t max_chunks) {
    return a.algorithm == Algorithm::Auto && n_seqs * lanes * 2 <= slots && max_chunks >= 2 * kMinSegment;
  };
  // the longest warm-up: as long as the segment (so a segment costs at most twice its chunks), and at least 16
  // chunks (1024 tokens); past it the exact fallback runs
  auto warm_cap = [&](int seg) { return std::max(seg, 16); };
  // units per sequence for the scan: about two waves of the state kernels over the whole batch
  auto scan_seg = [&](int64_t n_seqs, int64_t total_chunks) {
    const int64_t target = std::max<int64_t>(1, (2 * sms + lanes - 1) / lanes);
    return static_cast<int>(std::max<int64_t>(1, (total_chunks + target - 1) / target));
  };

  if (!a.cu_seqlens.defined()) {
    L.N = static_cast<int>(a.batch());
    L.CPS = static_cast<int>((T + kC - 1) / kC);
    L.NC = L.N * L.CPS;
    L.scan = want_scan(L.N, L.CPS);
    L.warm = !L.scan && want_warm(L.N, L.CPS);
    if (L.scan) {
      const int seg = scan_seg(L.N, L.NC);
      L.seg = std::max(1, std::min(seg, L.CPS));
      L.segs_per_seq = (L.CPS + L.seg - 1) / L.seg;
    } else if (L.warm) {
      // one wave: segments per sequence so that all CTAs fit on the SMs at once
      const int64_t segs = std::max<int64_t>(1, slots / (L.N * lanes));
      L.seg = static_cast<int>(std::max<int64_t>(kMinSegment, (L.CPS + segs - 1) / segs));
      L.seg = std::min(L.seg, L.CPS);
      L.segs_per_seq = (L.CPS + L.seg - 1) / L.seg;
      L.warm_max = warm_cap(L.seg);
    } else {
      L.seg = std::max(1, L.CPS);
      L.segs_per_seq = 1;
    }
    L.num_units = L.N * L.segs_per_seq;
    return L;
  }

  const at::Tensor cu_host = host_cu_seqlens(a.cu_seqlens, a.cu_seqlens_cpu, a.seqlen());
  L.cu_host = cu_host;
  const int64_t* cu = cu_host.data_ptr<int64_t>();
  L.N = static_cast<int>(cu_host.size(0) - 1);
  std::vector<int> nch(L.N);
  int64_t total = 0, mx = 0;
  for (int n = 0; n < L.N; ++n) {
    const int64_t len = std::max<int64_t>(0, cu[n + 1] - cu[n]);
    nch[n] = static_cast<int>((len + kC - 1) / kC);
    total += nch[n];
    mx = std::max<int64_t>(mx, nch[n]);
  }
  L.NC = static_cast<int>(total);
  L.scan = want_scan(L.N, mx);
  L.warm = !L.scan && want_warm(L.N, mx);
  if (L.scan) L.seg = scan_seg(L.N, total);
  else if (L.warm) L.seg = static_cast<int>(std::max<int64_t>(kMinSegment, (total * lanes + slots - 1) / slots));
  else L.seg = static_cast<int>(std::max<int64_t>(1, mx));
  if (L.warm) L.warm_max = warm_cap(L.seg);
  std::vector<int> tok, len, units, uoff;
  tok.reserve(L.NC);
  len.reserve(L.NC);
  uoff.push_back(0);
  int c0 = 0;
  for (int n = 0; n < L.N; ++n) {
    for (int i = 0; i < nch[n]; ++i) {
      tok.push_back(static_cast<int>(cu[n] + int64_t(i) * kC));
      len.push_back(static_cast<int>(std::min<int64_t>(kC, cu[n + 1] - cu[n] - int64_t(i) * kC)));
    }
    if (L.scan || L.warm) {
      if (L.warm && nch[n] == 0) {  // an empty sequence keeps its unit: it passes the initial state on
        units.push_back(n);
        units.push_back(c0);
        units.push_back(c0);
      }
      for (int s = 0; s < nch[n]; s += L.seg) {
        units.push_back(n);
        units.push_back(c0 + s);
        units.push_back(c0 + std::min(s + L.seg, nch[n]));
      }
    } else {
      units.push_back(n);
      units.push_back(c0);
      units.push_back(c0 + nch[n]);
    }
    uoff.push_back(static_cast<int>(units.size() / 3));
    c0 += nch[n];
  }
  L.num_units = static_cast<int>(units.size() / 3);
  if (!tables) return L;
  std::vector<int> all;
  all.reserve(tok.size() + len.size() + units.size() + uoff.size());
  all.insert(all.end(), tok.begin(), tok.end());
  all.insert(all.end(), len.begin(), len.end());
  all.insert(all.end(), units.begin(), units.end());
  all.insert(all.end(), uoff.begin(), uoff.end());
  at::Tensor host = at::empty({static_cast<int64_t>(all.size())}, at::TensorOptions().dtype(at::kInt).pinned_memory(true));
  std::copy(all.begin(), all.end(), host.data_ptr<int>());
  L.table = host.to(a.q.device(), /*non_blocking=*/true);
  const int* base = L.table.data_ptr<int>();
  L.chunk_tok = base;
  L.chunk_len = base + tok.size();
  L.unit_tab = base + tok.size() + len.size();
  L.unit_off = base + tok.size() + len.size() + units.size();
  return L;
}

// 32-column state tiles when 64-column ones would leave most multiprocessors idle in the sequential kernels:
// doubling the CTAs sped up the backward's state passes, doubling again slowed the reverse pass, so only below
// half the SM count (benchmarks/RESULTS.md, "CUDA design measurements")
int tile32_of(const CoreArgs& a, const Layout& L) {
  const int64_t ctas64 = static_cast<int64_t>(L.num_units) * a.num_v_heads() * (a.head_v() / 64);
  return 2 * ctas64 <= num_sms(a.q) ? 1 : 0;
}

Params base_params(const CoreArgs& a, const Layout& L) {
  Params p{};
  p.B = static_cast<int>(a.batch());
  p.T = static_cast<int>(a.seqlen());
  p.H = static_cast<int>(a.num_qk_heads());
  p.HV = static_cast<int>(a.num_v_heads());
  p.K = static_cast<int>(a.head_k());
  p.V = static_cast<int>(a.head_v());
  p.ld_v = p.ld_o = p.ld_do = p.ld_dv = p.V;  // (contiguous; the call sets those it addresses in place)
  p.tok_v = p.tok_o = p.tok_do = p.tok_dv = static_cast<int64_t>(p.HV) * p.V;
  p.N = L.N;
  p.G = p.HV / p.H;
  p.BT = a.batch() * a.seqlen();
  p.NC = L.NC;
  p.CPS = std::max(1, L.CPS);
  p.scale = static_cast<float>(a.scale);
  p.state_vk = a.state_v_first ? 1 : 0;
  p.chunk_tok = L.chunk_tok;
  p.chunk_len = L.chunk_len;
  p.unit_tab = L.unit_tab;
  p.unit_off = L.unit_off;
  p.num_units = L.num_units;
  p.seg = L.seg;
  p.segs_per_seq = L.segs_per_seq;
  p.warm_max = L.warm_max;
  p.tile32 = tile32_of(a, L);
  const int sms = num_sms(a.q);
  p.sms = sms;
  // The preparation computes K K^T and Q K^T once for the value heads it walks: all G heads of a group per CTA,
  // unless that leaves fewer than two CTAs per SM; then the largest divisor of G that does not
  int heads = p.G;
  while (heads > 1 && static_cast<int64_t>(p.NC) * p.H * (p.G / heads) < 2 * sms) {
    do --heads; while (p.G % heads != 0);
  }
  p.prep_heads = heads;
  return p;
}

struct Inputs {
  at::Tensor q, k, v, g, beta, h0;
  RowStrides v_strides;  // (row_strides)
};
Inputs dense_inputs(const CoreArgs& a) {
  Inputs in;
  in.q = dense(a.q);
  in.k = dense(a.k);
  Rows v = rows_of(a.v);  // (read in place where its strides allow)
  in.v = v.t;
  in.v_strides = v.s;
  in.g = dense(a.g.to(at::kFloat));
  // beta is read in place in a 16-bit dtype or fp32 (load_as_float), any other float dtype as fp32
  in.beta = dense(is_kernel_dtype(a.beta.scalar_type()) ? a.beta : a.beta.to(at::kFloat));
  if (a.initial_state.defined()) in.h0 = dense(a.initial_state.to(at::kFloat));
  return in;
}

// What both directions start from: dense inputs, the chunk layout, and the parameters with the input pointers.
struct Call {
  Inputs in;
  Layout L;
  Params p;
  cuda::DType dt;
  at::TensorOptions opts, fopts;  // input dtype, fp32
  void* stream;
};

Call begin_call(const CoreArgs& a, bool backward) {
  check_cuda_limits(a);
  Call c;
  c.stream = at::cuda::getCurrentCUDAStream().stream();
  c.in = dense_inputs(a);
  c.dt = cuda::dtype_of(a.q.scalar_type(), "q");
  // The warpgroup state passes run two 64-column tiles per SM (one for the backward's where V holds one tile).
  // tile32 (which takes K = 128 off those passes) comes later, from this layout (base_params), so the slots are
  // counted as if it stayed 0; that shapes only the segments. Which pass runs, and what the workspace holds for it,
  // follow the real tile32 (plan_workspace).
  c.L = make_layout(a, cuda::wg_tiles_per_sm(c.dt, static_cast<int>(a.head_k()), static_cast<int>(a.head_v()),
                                             backward));
  c.p = base_params(a, c.L);
  c.opts = c.in.q.options();
  c.fopts = c.opts.dtype(at::kFloat);
  c.p.q = c.in.q.data_ptr();
  c.p.k = c.in.k.data_ptr();
  c.p.v = c.in.v.data_ptr();
  c.p.ld_v = c.in.v_strides.ld;
  c.p.tok_v = c.in.v_strides.tok;
  c.p.g = c.in.g.data_ptr<float>();
  c.p.beta = c.in.beta.data_ptr();
  c.p.beta_dtype = cuda::dtype_of(c.in.beta.scalar_type(), "beta");
  return c;
}

// The shape of the caller's states (initial, final and their gradients) in their layout.
std::vector<int64_t> state_dims(const Call& c, bool v_first) {
  const int64_t N = c.L.N, HV = c.p.HV, K = c.p.K, V = c.p.V;
  return v_first ? std::vector<int64_t>{N, HV, V, K} : std::vector<int64_t>{N, HV, K, V};
}

// ---- one workspace per call ----
// A call's intermediates live in one allocation (one trip to the caching allocator instead of one per buffer):
// regions are reserved first (256-byte aligned), the buffer is allocated once, and the kernels get pointers into it.
// Two buffers whose lifetimes do not overlap share a region (Workspace::Union), so the footprint is what the
// separate buffers had at their peak.
class Workspace {
 public:
  static constexpr int64_t kNone = -1;
  int64_t take(int64_t bytes) {
    const int64_t off = size_;
    size_ += (bytes + 255) / 256 * 256;
    return off;
  }
  // Regions laid out in alternatives over the same bytes: each alternative starts where the union starts.
  struct Union {
    Workspace& ws;
    int64_t start, end;
    explicit Union(Workspace& w) : ws(w), start(w.size_), end(w.size_) {}
    void next() {  // begin the next alternative
      end = std::max(end, ws.size_);
      ws.size_ = start;
    }
    ~Union() { ws.size_ = std::max(end, ws.size_); }
  };
  int64_t size() const { return size_; }
  void allocate(const at::TensorOptions& like) { buf_ = at::empty({std::max<int64_t>(size_, 1)}, like.dtype(at::kByte)); }
  // Gives the bytes back to the caching allocator once the kernels launched so far are done with them (stream order):
  // what is allocated next on the stream may reuse them.
  void release() { buf_.reset(); }
  template <class T = void> T* ptr(int64_t off) const {
    return off == kNone ? nullptr : reinterpret_cast<T*>(static_cast<unsigned char*>(buf_.data_ptr()) + off);
  }

 private:
  int64_t size_ = 0;
  at::Tensor buf_;
};

// Where each intermediate of a call lives in its workspace (Workspace::kNone: not used by this call).
struct Regions {
  static constexpr int64_t n = Workspace::kNone;
  int64_t W = n, U = n, A = n, gam = n, Tm = n, TmB = n, lnorm = n, seg_ok = n, segmap = n, segstate = n, hT = n,
          VnT = n, dhT = n, dVnT = n, dgam1 = n, dk1 = n;
};

// The layout of the workspace. Forward: the preparation's A, gam, and W, U or Tm diag(beta) (where the state passes
// form W and U themselves, forms_wu; the scan's maps still read W and U); the warm-up's per-chunk norm bounds and
// per-segment proofs; the scan's maps and unit states. The backward adds Tm, the states and gradients stored per
// chunk, and the chunk-parallel kernels' partial sums. Regions with disjoint lifetimes share bytes: U (first state
// pass) with dVn^T (written by the reverse pass), and the scan's scratch (state passes) with dgam1 and dk1
// (chunk-parallel kernels). dW has no region: it lives in dhT's tiles (params.h). dk1 has a region of its own only
// when dk itself is not fp32 (grad_f32 without dk_l2norm).
// The backward's hT and Vn^T go to states instead, a workspace of their own: grad_qk reads them last, so the
// backward releases it before it allocates the gradients that grad_wy writes, which can then take its bytes.
// in_residual: A, gam and (backward) Tm live in the residual instead (residual_regions), and the backward's state
// passes apply diag(beta) to Tm themselves (Params::fold_beta): no Tm diag(beta).
Regions plan_workspace(Workspace& ws, Workspace* states, const Call& c, bool backward, bool dk1_own,
                       bool in_residual = false) {
  const int64_t NC = c.L.NC, HV = c.p.HV, K = c.p.K, V = c.p.V, units = c.L.num_units;
  const int64_t es = c.in.q.element_size(), fs = sizeof(float);
  Regions r;
  const bool form_wu = cuda::forms_wu(c.dt, c.p.K, c.p.tile32, backward);
  const bool wu = !form_wu || c.L.scan;  // (the scan's maps read W and U, its second pass Tm diag(beta))
  if (wu) r.W = ws.take(NC * HV * kC * K * es);
  if (form_wu && !wu && !(backward && in_residual)) r.TmB = ws.take(NC * HV * kC * kC * es);
  if (form_wu && wu) r.TmB = ws.take(NC * HV * kC * kC * es);
  if (!in_residual) {
    r.A = ws.take(NC * HV * kC * kC * es);
    r.gam = ws.take(NC * HV * kC * fs);
  }
  if (c.L.warm) {
    r.lnorm = ws.take(NC * HV * fs);
    r.seg_ok = ws.take(units * HV * static_cast<int64_t>(sizeof(int)));
  }
  if (backward) {
    if (!in_residual) r.Tm = ws.take(NC * HV * kC * kC * es);
    r.hT = states->take(NC * HV * V * K * es);
    r.VnT = states->take(NC * HV * V * kC * es);
    r.dhT = ws.take(NC * HV * V * K * es);
  }
  {
    Workspace::Union u(ws);
    if (wu) r.U = ws.take(NC * HV * kC * V * es);
    if (backward) {
      u.next();
      r.dVnT = ws.take(NC * HV * V * kC * es);
    }
  }
  {
    Workspace::Union u(ws);
    if (c.L.scan) {
      r.segmap = ws.take(units * HV * (V + K) * K * fs);
      r.segstate = ws.take(units * HV * K * V * fs);
    }
    if (backward) {
      u.next();
      r.dgam1 = ws.take((K / 64) * NC * HV * kC * fs);
      if (dk1_own) r.dk1 = ws.take(c.in.k.numel() * fs);
    }
  }
  return r;
}

// Points the kernels' parameters at the workspace's regions (the backward's hT and Vn^T: at states').
void bind(Params& p, const Workspace& ws, const Regions& r) {
  p.W = ws.ptr(r.W);
  p.U = ws.ptr(r.U);
  p.A = ws.ptr(r.A);
  p.gam = ws.ptr<float>(r.gam);
  p.Tm = ws.ptr(r.Tm);
  p.TmB = ws.ptr(r.TmB);
  p.lnorm = ws.ptr<float>(r.lnorm);
  p.seg_ok = ws.ptr<int>(r.seg_ok);
  p.segmap = ws.ptr<float>(r.segmap);
  p.segstate = ws.ptr<float>(r.segstate);
}

// ---- the residual a forward keeps for its backward (fwd_with_residual) ----
// Each chunk's A, gam and Tm: what the backward's preparation would otherwise recompute (K K^T, Q K^T, M and the
// inverse). Kept where the backward's state passes form W and U themselves (forms_wu: 16-bit inputs, K <= 128,
// 64-column tiles) and the scan is not asked for; the backward then runs no preparation: its state passes read Tm
// and apply diag(beta) themselves (Params::fold_beta), and with segments launch_prep_residual forms the warm-up
// bounds. The forward decides it as the backward will (its layout's counts, without device tables); the backward
// checks the residual's size against its own layout.
struct ResidualRegions {
  int64_t A = 0, gam = 0, Tm = 0, bytes = 0;
};

ResidualRegions residual_regions(const Call& c) {
  const int64_t NC = c.L.NC, HV = c.p.HV, es = c.in.q.element_size();
  Workspace w;
  ResidualRegions r;
  r.A = w.take(NC * HV * kC * kC * es);
  r.gam = w.take(NC * HV * kC * static_cast<int64_t>(sizeof(float)));
  r.Tm = w.take(NC * HV * kC * kC * es);
  r.bytes = w.size();
  return r;
}

// The rule both directions apply: the backward's layout walks chunks (no scan) and its state passes form W and U
// themselves (forms_wu: 16-bit inputs, K <= 128, 64-column tiles).
bool residual_applies(const Layout& Lb, cuda::DType dt, int K, int tile32) {
  return !Lb.scan && cuda::forms_wu(dt, K, tile32, /*backward=*/true);
}

// (c: the forward's call, whose layout the backward's is where both count the same tiles per SM; otherwise the
// backward's counts are made here, from the host copy of cu_seqlens the forward's layout holds)
bool backward_takes_residual(const CoreArgs& a, const Call& c) {
  const int K = c.p.K, V = c.p.V;
  const int tiles = cuda::wg_tiles_per_sm(c.dt, K, V, /*backward=*/true);
  if (tiles == cuda::wg_tiles_per_sm(c.dt, K, V, /*backward=*/false)) {
    return residual_applies(c.L, c.dt, K, c.p.tile32);
  }
  CoreArgs ab = a;
  if (c.L.cu_host.defined()) ab.cu_seqlens_cpu = c.L.cu_host;
  const Layout Lb = make_layout(ab, tiles, /*tables=*/false);
  return residual_applies(Lb, c.dt, K, tile32_of(a, Lb));
}

void bind_residual(Params& p, const at::Tensor& res, const ResidualRegions& r) {
  unsigned char* b = static_cast<unsigned char*>(res.data_ptr());
  p.A = b + r.A;
  p.gam = reinterpret_cast<float*>(b + r.gam);
  p.Tm = b + r.Tm;
}

// One sequential pass over the chunks, forward (state_fwd, mode 0: output, 1: states for the backward) or reverse
// (state_rev, mode 0), from init (by sequence; null: zero) to fin (by sequence; null: not stored). With the scan
// the units first compute their maps, the combine kernel composes them (writing fin) and the pass runs again from
// each unit's entering state. With segments and warm-ups the pass runs once, then once more for the exact
// fallback (CTAs that exit at once where every segment was proven).
void run_state_pass(Call& c, bool reverse, int mode, const float* init, float* fin) {
  Params& p = c.p;
  auto launch = [&](int m) {
    if (reverse) cuda::launch_state_rev(p, c.dt, m, c.stream);
    else cuda::launch_state_fwd(p, c.dt, m, c.stream);
  };
  if (c.L.warm) {
    p.init = init;
    p.init_by_unit = 0;
    p.fin = fin;
    p.warm = 1;
    launch(mode);
    p.warm = 2;
    launch(mode);
    p.warm = 0;
    return;
  }
  if (!c.L.scan) {
    p.init = init;
    p.init_by_unit = 0;
    p.fin = fin;
    launch(mode);
    return;
  }
  p.init = nullptr;
  p.fin = nullptr;
  launch(reverse ? 1 : 2);  // segment maps
  p.init = init;
  p.init_by_unit = 0;
  p.fin = fin;
  cuda::launch_combine(p, reverse ? 1 : 0, c.stream);
  p.init = p.segstate;
  p.init_by_unit = 1;
  p.fin = nullptr;
  launch(mode);
}

// Whether this forward runs as one kernel (fwd_fused.cu: the preparation inside the state pass, warp-specialised)
// rather than prep + state_fwd: wherever it applies, except for segments shorter than 16 chunks. Its CTAs prepare
// every chunk they walk, so a segment's warm-up chunks (up to 16) are prepared again by each segment that walks
// them, where prep prepares each chunk once; with 8-chunk segments that made it 12% slower than the two kernels on
// an H200, with 32 from 5% faster to 2% slower, faster on every other benchmark row (benchmarks/RESULTS.md, "The
// one-kernel forward by default"). GATED_DELTA_FUSED_FWD=1 in the environment takes it wherever it applies, =0
// never; the variable is read per call (a scan of the environment, well below a microsecond), so that a benchmark
// or a test can compare both forwards in one process.
bool fused_forward(const Call& c) {
  if (!cuda::fwd_fused_applies(c.dt, c.p.K, c.p.V, c.p.tile32, c.L.scan)) return false;
  const char* e = std::getenv("GATED_DELTA_FUSED_FWD");
  if (e != nullptr && std::string(e) == "0") return false;
  if (e != nullptr && std::string(e) == "1") return true;
  return !c.L.warm || c.L.seg >= 16;
}

// ---- head dims between the kernels' sizes ----
// K and V that are not one of the kernels' head dims (dispatch.cuh) are zero-padded to the next one. Exact: the
// padded columns of q and k (after the op layer's L2 norm) and the padded rows of the initial state are zero, so
// the state's padded rows stay zero; the padded columns of v, of d_o and of the state give zero outputs and
// gradients, which are cut off. The sizes the kernels take run unpadded.

bool needs_padding(const CoreArgs& a) { return !cuda::is_head_dim(a.head_k()) || !cuda::is_head_dim(a.head_v()); }

at::Tensor pad_last(const at::Tensor& x, int64_t to) { return at::constant_pad_nd(x, {0, to - x.size(-1)}); }

// a state [N, HV, K, V] ([N, HV, V, K] when v_first) padded (cut back: the same with smaller sizes) to K x V
at::Tensor resize_state(const at::Tensor& s, bool v_first, int64_t K, int64_t V) {
  if (!s.defined()) return s;
  const int64_t d2 = v_first ? V : K, d3 = v_first ? K : V;
  return at::constant_pad_nd(s, {0, d3 - s.size(3), 0, d2 - s.size(2)});
}

CoreArgs padded_args(const CoreArgs& a) {
  const int64_t Kp = cuda::padded_head_dim(a.head_k()), Vp = cuda::padded_head_dim(a.head_v());
  CoreArgs p = a;
  p.q = pad_last(a.q, Kp);
  p.k = pad_last(a.k, Kp);
  p.v = pad_last(a.v, Vp);
  p.initial_state = resize_state(a.initial_state, a.state_v_first, Kp, Vp);
  p.l2norm_k = p.l2norm_q = at::Tensor();  // (the chain rule of dk and dq after the cut, in the op layer)
  return p;
}

at::Tensor cut_last(const at::Tensor& x, int64_t to) { return x.narrow(-1, 0, to).contiguous(); }

// ---- V over the kernels' largest head dim ----
// The recurrence separates over the state's columns: column j of S, and of o, depends on column j of v (and of the
// initial state, and gv) and on nothing else of v. A V above the kernels' largest head dim (256) therefore runs as
// slices of v's columns, each a call of its own with the same q, k, g and beta:
// - o, the final state, dv, gv's and the initial state's gradients are the slices' side by side;
// - the gradients of the inputs every slice reads (q, k, g, beta, gk) are the sums of the slices' gradients, which
//   the slices return in fp32 and which are added in slice order (deterministic; the kernels of one call sum over
//   their V tiles in fp32 the same way), the last addition rounding to the dtype the gradient is returned in;
// - the slices have one width w, a head dim of the kernels: the largest of 256, 128, 64 that divides V rounded up to
//   64, so that every slice (the last one zero-padded to w where V is not a multiple of 64) lays out its chunks,
//   work units and residual alike (with gk / gv, whose token-loop kernels take any V up to 256 and keep no
//   residual: the fewest slices of equal width);
// - the residual the forward keeps (A, the cumulative gates, Tm) does not depend on v: the first slice's serves
//   every slice's backward. The work that does not depend on v (K K^T, the inverse) is done per slice.
struct VSlices {
  int64_t n = 1, w = 0;  // slices, and columns per slice (the last one may hold fewer)
};

VSlices v_slices(const CoreArgs& a) {
  const int64_t V = a.head_v(), most = cuda::max_head_dim();
  VSlices s;
  if (a.has_kv_gates()) {  // the token-loop kernels take any V up to 256 unpadded: the fewest equal slices
    s.n = (V + most - 1) / most;
    s.w = (V + s.n - 1) / s.n;
    return s;
  }
  const int64_t V64 = (V + 63) / 64 * 64;
  s.w = V64 % 256 == 0 ? 256 : V64 % 128 == 0 ? 128 : 64;
  s.n = V64 / s.w;
  return s;
}

bool needs_v_slices(const CoreArgs& a) { return a.head_v() > cuda::max_head_dim(); }

int state_v_dim(const CoreArgs& a) { return a.state_v_first ? 2 : 3; }

// columns of slice i of x along dim (an undefined x passes through)
at::Tensor slice_cols(const at::Tensor& x, int dim, const VSlices& s, int64_t i) {
  if (!x.defined()) return x;
  const int64_t off = i * s.w;
  return x.narrow(dim, off, std::min(s.w, x.size(dim) - off));
}

// args of slice i: v, and gv and the initial state where given, cut to the slice's columns
CoreArgs v_slice_args(const CoreArgs& a, const VSlices& s, int64_t i) {
  CoreArgs r = a;
  r.v = slice_cols(a.v, 3, s, i);
  r.gv = slice_cols(a.gv, 3, s, i);
  r.initial_state = slice_cols(a.initial_state, state_v_dim(a), s, i);
  r.l2norm_k = r.l2norm_q = at::Tensor();  // (the chain rule of dk and dq after the slices' sum, in the op layer)
  return r;
}

// The slices run on two streams, the caller's and a side stream from the pool: even slices on the first, odd ones on
// the second, forked from and joined back into the caller's stream by events (CUDA-graph capturable). So two slices'
// kernels share the GPU where one slice's grid would leave SMs idle (with K = 256 and few heads every sequential
// pass does). What a side slice allocates and the caller's stream reads afterwards is marked used there
// (record_stream), so that the caching allocator does not hand its memory to the side stream again too early.
// run_slices calls slice_call(i) for every slice on its stream and returns the results, every tensor of them
// (tensors(r)) usable on the caller's stream.
template <class R, class Call, class Tensors>
std::vector<R> run_slices(int64_t n, Call&& slice_call, Tensors&& tensors) {
  std::vector<R> out(n);
  const at::cuda::CUDAStream main = at::cuda::getCurrentCUDAStream();
  const at::cuda::CUDAStream side = at::cuda::getStreamFromPool(/*isHighPriority=*/false, main.device_index());
  at::cuda::CUDAEvent fork, done;
  fork.record(main);
  fork.block(side);
  for (int64_t i = 0; i < n; ++i) {
    if (i % 2 == 0) {
      out[i] = slice_call(i);
      continue;
    }
    c10::cuda::CUDAStreamGuard guard(side);
    out[i] = slice_call(i);
    for (const at::Tensor& t : tensors(out[i]))
      if (t.defined()) t.record_stream(main.unwrap());
  }
  done.record(side);  // the caller's stream waits for every side slice
  done.block(main);
  return out;
}

// (varlen: one host copy of cu_seqlens for all slices)
CoreArgs with_host_cu_seqlens(const CoreArgs& a) {
  CoreArgs r = a;
  if (a.cu_seqlens.defined()) r.cu_seqlens_cpu = host_cu_seqlens(a.cu_seqlens, a.cu_seqlens_cpu, a.seqlen());
  return r;
}

CoreForward forward_v_slices(const CoreArgs& a0, bool output_final_state, bool keep_residual) {
  const CoreArgs a = with_host_cu_seqlens(a0);
  const VSlices s = v_slices(a);
  // each slice reads its columns of v and writes its columns of o in place (row_strides), except where it is padded or
  // runs the token loop: then its o is copied in (copy_ returns at once where source and destination are the same
  // view of the same memory, as for the slices written in place)
  at::Tensor o = at::empty(a.v.sizes(), a.v.options());
  const std::vector<CoreForward> f = run_slices<CoreForward>(
      s.n,
      [&](int64_t i) {
        return forward_cuda(v_slice_args(a, s, i), output_final_state, keep_residual && i == 0, slice_cols(o, 3, s, i));
      },
      [](const CoreForward& x) { return std::vector<at::Tensor>{x.o, x.final_state, x.residual}; });
  std::vector<at::Tensor> fin;
  for (int64_t i = 0; i < s.n; ++i) {
    slice_cols(o, 3, s, i).copy_(f[i].o);
    if (output_final_state) fin.push_back(f[i].final_state);
  }
  CoreForward r;
  r.o = o;
  if (output_final_state) r.final_state = at::cat(fin, state_v_dim(a));
  r.residual = f[0].residual;
  return r;
}

CoreGrads backward_v_slices(const CoreArgs& a0, const at::Tensor& d_o, const at::Tensor& d_final_state) {
  const CoreArgs a = with_host_cu_seqlens(a0);
  const VSlices s = v_slices(a);
  const int vdim = state_v_dim(a);
  const at::ScalarType f32 = at::kFloat;
  // each slice reads its columns of v and d_o and writes its columns of dv in place (row_strides), in the dtype dv is
  // returned in, except where it is padded or runs the token loop: then its dv (fp32) is copied in (as o, above)
  at::Tensor dv = at::empty(a.v.sizes(), a.v.options());
  std::vector<CoreGrads> g = run_slices<CoreGrads>(
      s.n,
      [&](int64_t i) {
        CoreArgs ai = v_slice_args(a, s, i);
        ai.grads_in_input_dtype = false;  // (dq, dk: fp32 parts, added below)
        ai.dbeta_in_beta_dtype = false;
        return backward_cuda(ai, slice_cols(d_o, 3, s, i), slice_cols(d_final_state, vdim, s, i),
                             slice_cols(dv, 3, s, i));
      },
      [](const CoreGrads& x) {
        return std::vector<at::Tensor>{x.dq, x.dk, x.dv, x.dg, x.dbeta, x.d_initial_state, x.dgk, x.dgv};
      });
  // the sums over the slices, in slice order: fp32 up to the last slice's part, whose addition writes the dtype the
  // gradient is returned in (the input's where the op layer allows it: one rounding, in the same kernel); the
  // first slice's fp32 parts, a buffer of this call's own, hold the running sum
  auto sum = [&](at::Tensor CoreGrads::*field, at::ScalarType out) {
    if (!(g[0].*field).defined()) return at::Tensor();
    at::Tensor& acc = g[0].*field;
    for (int64_t i = 1; i + 1 < s.n; ++i) acc.add_(g[i].*field);
    at::Tensor total = at::empty(acc.sizes(), acc.options().dtype(out));
    at::add_out(total, acc, g[s.n - 1].*field);
    return total;
  };
  CoreGrads r;
  r.dq = sum(&CoreGrads::dq, a.grads_in_input_dtype ? a.q.scalar_type() : f32);
  r.dk = sum(&CoreGrads::dk, a.grads_in_input_dtype ? a.k.scalar_type() : f32);
  r.dg = sum(&CoreGrads::dg, f32);
  r.dbeta = sum(&CoreGrads::dbeta, a.dbeta_in_beta_dtype ? a.beta.scalar_type() : f32);
  r.dgk = sum(&CoreGrads::dgk, f32);
  r.dv = dv;
  std::vector<at::Tensor> dh0, dgv;
  for (int64_t i = 0; i < s.n; ++i) {
    slice_cols(dv, 3, s, i).copy_(g[i].dv);  // (rounded once where dv is 16-bit)
    if (g[i].d_initial_state.defined()) dh0.push_back(g[i].d_initial_state);
    if (g[i].dgv.defined()) dgv.push_back(g[i].dgv);
  }
  if (!dh0.empty()) r.d_initial_state = at::cat(dh0, vdim);
  if (!dgv.empty()) r.dgv = at::cat(dgv, 3);
  return r;
}

CoreForward forward_cuda(const CoreArgs& a, bool output_final_state, bool keep_residual, const at::Tensor& o_into) {
  if (needs_v_slices(a)) {
    check_head_k(a);
    c10::cuda::CUDAGuard guard(a.q.device());  // (the streams are the inputs' device's)
    return forward_v_slices(a, output_final_state, keep_residual);
  }
  if (a.has_kv_gates()) {  // the token-loop kernels take any K, V up to 256 unpadded (no residual)
    c10::cuda::CUDAGuard guard(a.q.device());
    return recurrent_forward_cuda(a, output_final_state);
  }
  if (needs_padding(a)) {  // (the residual is the padded call's, which the backward pads the same way)
    check_cuda_limits(a);
    CoreForward r = forward_cuda(padded_args(a), output_final_state, keep_residual, at::Tensor());
    r.o = cut_last(r.o, a.head_v());
    r.final_state = resize_state(r.final_state, a.state_v_first, a.head_k(), a.head_v());
    return r;
  }
  c10::cuda::CUDAGuard guard(a.q.device());
  Call c = begin_call(a, /*backward=*/false);
  const at::Tensor o = o_into.defined() ? o_into : at::empty(c.in.v.sizes(), c.in.v.options());
  if (o_into.defined()) {
    const RowStrides s = output_strides(o_into, c.in.v.sizes(), {c.in.v.scalar_type()}, "o");
    c.p.ld_o = s.ld;
    c.p.tok_o = s.tok;
  }
  at::Tensor ht;
  if (output_final_state) ht = at::empty(state_dims(c, a.state_v_first), c.fopts);
  c.p.o = o.data_ptr();
  CoreForward out;
  out.o = o;
  out.final_state = ht;
  ResidualRegions rr;
  if (keep_residual && backward_takes_residual(a, c)) {
    rr = residual_regions(c);
    out.residual = at::empty({rr.bytes}, c.opts.dtype(at::kByte));
  }
  if (fused_forward(c)) {  // one kernel, no intermediates in memory (segments: their proofs; the residual)
    if (out.residual.defined()) bind_residual(c.p, out.residual, rr);
    c.p.init = c.in.h0.defined() ? c.in.h0.data_ptr<float>() : nullptr;
    c.p.init_by_unit = 0;
    c.p.fin = ht.defined() ? ht.data_ptr<float>() : nullptr;
    if (!c.L.warm) {
      cuda::launch_fwd_fused(c.p, c.dt, c.stream);
      return out;
    }
    Workspace ws;
    Regions r;
    r.seg_ok = ws.take(c.L.num_units * c.p.HV * static_cast<int64_t>(sizeof(int)));
    ws.allocate(c.opts);
    c.p.seg_ok = ws.ptr<int>(r.seg_ok);
    c.p.warm = 1;  // the segments (each CTA forms the bounds its warm-up walks), then the exact fallback
    cuda::launch_fwd_fused(c.p, c.dt, c.stream);
    c.p.warm = 2;
    cuda::launch_fwd_fused(c.p, c.dt, c.stream);
    return out;
  }
  Workspace ws;
  const Regions r = plan_workspace(ws, nullptr, c, /*backward=*/false, /*dk1_own=*/false, out.residual.defined());
  ws.allocate(c.opts);
  bind(c.p, ws, r);
  if (out.residual.defined()) bind_residual(c.p, out.residual, rr);  // (prep writes A, gam and Tm there)
  cuda::launch_prep(c.p, c.dt, c.stream);
  run_state_pass(c, /*reverse=*/false, /*mode=*/0, c.in.h0.defined() ? c.in.h0.data_ptr<float>() : nullptr,
                 ht.defined() ? ht.data_ptr<float>() : nullptr);
  return out;
}

CoreGrads backward_cuda(const CoreArgs& a, const at::Tensor& d_o, const at::Tensor& d_final_state,
                        const at::Tensor& dv_into) {
  if (needs_v_slices(a)) {
    check_head_k(a);
    c10::cuda::CUDAGuard guard(a.q.device());  // (the streams are the inputs' device's)
    return backward_v_slices(a, d_o, d_final_state);
  }
  if (a.has_kv_gates()) {
    TORCH_CHECK(!a.residual.defined(), "residual: a call with gk / gv keeps none (fwd_with_residual returns an "
                "empty tensor for it), got ", a.residual.numel(), " bytes");
    c10::cuda::CUDAGuard guard(a.q.device());
    return recurrent_backward_cuda(a, d_o, d_final_state);
  }
  if (needs_padding(a)) {
    check_cuda_limits(a);
    const CoreArgs pa = padded_args(a);
    CoreGrads g = backward_cuda(pa, pad_last(d_o, pa.head_v()),
                                resize_state(d_final_state, a.state_v_first, pa.head_k(), pa.head_v()), at::Tensor());
    g.dq = cut_last(g.dq, a.head_k());
    g.dk = cut_last(g.dk, a.head_k());
    g.dv = cut_last(g.dv, a.head_v());
    g.d_initial_state = resize_state(g.d_initial_state, a.state_v_first, a.head_k(), a.head_v());
    return g;
  }
  c10::cuda::CUDAGuard guard(a.q.device());
  Call c = begin_call(a, /*backward=*/true);
  Params& p = c.p;
  const Rows dO = rows_of(d_o.to(a.v.scalar_type()));  // (read in place where its strides allow)
  at::Tensor dht;
  if (d_final_state.defined()) dht = dense(d_final_state.to(at::kFloat));
  p.d_o = dO.t.data_ptr();
  p.ld_do = dO.s.ld;
  p.tok_do = dO.s.tok;
  // dq, dk, dv in the input dtype when the op layer allows it; dk's partial sums stay fp32 in dk1. With
  // use_qk_l2norm_in_kernel and K <= 128 grad_wy, which holds a CTA's rows of dk in registers, applies the L2
  // norm's chain rule to them and stores dk in the input dtype; so does grad_qk with dq where it holds its rows
  // whole (grad_qk_whole_rows; the caller's q is then in the input dtype, as 16-bit inputs are not promoted).
  p.grad_f32 = (a.grads_in_input_dtype && a.q.scalar_type() != at::kFloat) ? 0 : 1;
  Rows k_raw;
  if (a.l2norm_k.defined() && p.K <= 128) {
    k_raw = rows_of(a.l2norm_k);
    p.dk_l2norm = 1;
    p.k_raw = k_raw.t.data_ptr();
    p.k_raw_dtype = cuda::dtype_of(k_raw.t.scalar_type(), "k");
    p.ld_kr = k_raw.s.ld;
    p.tok_kr = k_raw.s.tok;
    p.l2norm_eps = static_cast<float>(kL2NormEps);
  }
  Rows q_raw;
  if (a.l2norm_q.defined() && cuda::grad_qk_whole_rows(c.dt, p.K) && a.l2norm_q.scalar_type() == a.q.scalar_type()) {
    q_raw = rows_of(a.l2norm_q);
    p.dq_l2norm = 1;
    p.q_raw = q_raw.t.data_ptr();
    p.ld_qr = q_raw.s.ld;
    p.tok_qr = q_raw.s.tok;
    p.l2norm_eps = static_cast<float>(kL2NormEps);
  }
  const bool dk_f32 = p.grad_f32 && !p.dk_l2norm;
  const bool from_residual = a.residual.defined();
  ResidualRegions rr;
  if (from_residual) {
    TORCH_CHECK(residual_applies(c.L, c.dt, p.K, p.tile32),
                "residual: these inputs take none on CUDA (fwd_with_residual returns an empty tensor for them), got ",
                a.residual.numel(), " bytes");
    rr = residual_regions(c);
    TORCH_CHECK(a.residual.numel() == rr.bytes, "residual must be what fwd_with_residual returned for these inputs: "
                "expected ", rr.bytes, " bytes, got ", a.residual.numel());
  }
  Workspace ws, states;
  const Regions r = plan_workspace(ws, &states, c, /*backward=*/true, /*dk1_own=*/!dk_f32, from_residual);
  ws.allocate(c.opts);
  states.allocate(c.opts);
  bind(p, ws, r);
  p.hT = states.ptr(r.hT);
  p.VnT = states.ptr(r.VnT);
  if (from_residual) {  // A, gam and Tm from the forward; the state passes apply diag(beta) to Tm themselves
    bind_residual(p, a.residual, rr);
    p.fold_beta = 1;
    if (p.lnorm != nullptr) cuda::launch_prep_residual(p, c.dt, c.stream);  // (segments: the warm-up bounds)
  } else {
    cuda::launch_prep(p, c.dt, c.stream);  // (also writes Tm)
  }

  // states entering each chunk, and Vn
  run_state_pass(c, /*reverse=*/false, /*mode=*/1, c.in.h0.defined() ? c.in.h0.data_ptr<float>() : nullptr,
                 nullptr);
  p.U = nullptr;  // (its region now holds dVn^T)

  // gradients of the states leaving each chunk, and dVn
  p.dhT = ws.ptr(r.dhT);
  p.dVnT = ws.ptr(r.dVnT);
  at::Tensor dh0;
  if (a.initial_state.defined()) dh0 = at::empty(state_dims(c, a.state_v_first), c.fopts);
  run_state_pass(c, /*reverse=*/true, /*mode=*/0, dht.defined() ? dht.data_ptr<float>() : nullptr,
                 dh0.defined() ? dh0.data_ptr<float>() : nullptr);
  p.segmap = p.segstate = nullptr;  // (their region now holds dgam1, dk1)

  // chunk-parallel gradients: grad_qk writes dq and dk1 (with grad_f32 dk itself) and dW into dhT's tiles, and
  // reads hT and Vn^T for the last time; the gradients only grad_wy writes are allocated after states' release
  p.dgam1 = ws.ptr<float>(r.dgam1);
  CoreGrads gr;
  gr.dq = at::empty(c.in.q.sizes(), p.grad_f32 && !p.dq_l2norm ? c.fopts : c.opts);
  gr.dq_l2norm = p.dq_l2norm != 0;
  if (dk_f32) gr.dk = at::empty(c.in.k.sizes(), c.fopts);
  p.dq = gr.dq.data_ptr();
  p.dk1 = dk_f32 ? gr.dk.data_ptr<float>() : ws.ptr<float>(r.dk1);
  cuda::launch_grad_qk(p, c.dt, c.stream);
  states.release();
  p.hT = p.VnT = nullptr;
  if (!dk_f32) gr.dk = at::empty(c.in.k.sizes(), c.opts);
  gr.dk_l2norm = p.dk_l2norm != 0;
  gr.dv = dv_into.defined() ? dv_into : at::empty(c.in.v.sizes(), c.opts);  // (no chain rule follows dv)
  if (dv_into.defined()) {
    const RowStrides s = output_strides(dv_into, c.in.v.sizes(), {c.in.v.scalar_type(), at::kFloat}, "dv");
    p.ld_dv = s.ld;
    p.tok_dv = s.tok;
  }
  p.dv_f32 = gr.dv.scalar_type() == at::kFloat ? 1 : 0;
  gr.dg = at::empty(c.in.g.sizes(), c.fopts);
  gr.dbeta = at::empty(c.in.beta.sizes(), a.dbeta_in_beta_dtype ? c.in.beta.options() : c.fopts);
  p.dk = gr.dk.data_ptr();
  p.dv = gr.dv.data_ptr();
  p.dg = gr.dg.data_ptr<float>();
  p.dbeta = gr.dbeta.data_ptr();
  p.dbeta_dtype = cuda::dtype_of(gr.dbeta.scalar_type(), "dbeta");
  cuda::launch_grad_wy(p, c.dt, c.stream);
  gr.d_initial_state = dh0;
  return gr;
}

}  // namespace

CoreForward core_forward_cuda(const CoreArgs& a, bool output_final_state, bool keep_residual) {
  return forward_cuda(a, output_final_state, keep_residual, at::Tensor());
}

// ---- use_gate_in_kernel, use_beta_sigmoid_in_kernel: one kernel forward, two backward (gate_beta.cu) ----
namespace {
bool gate_beta_kernels_apply(const DeltaRuleArgs& x, at::ScalarType cd) {
  // (the kernels read bf16, fp16 and fp32, and hold a block's terms of at most kGateBetaTile heads; ATen does the rest)
  auto ok = [](const at::Tensor& t) {
    const at::ScalarType s = t.scalar_type();
    return s == at::kBFloat16 || s == at::kHalf || s == at::kFloat;
  };
  return cd == at::kFloat && ok(x.g) && ok(x.beta) && (!x.A_log.has_value() || ok(*x.A_log)) &&
         (!x.dt_bias.has_value() || ok(*x.dt_bias)) && x.g.size(2) <= cuda::kGateBetaTile;
}

// A (g, beta) pair (the inputs, or their gradients) as the kernels read it: each made dense only where its option
// reads it (an input the option does not read passes through to the core, which takes it by its own layout rules);
// only its sizes are read otherwise
struct GateBetaPair {
  at::Tensor g, beta;
};
GateBetaPair dense_where_read(const DeltaRuleArgs& x, const at::Tensor& g, const at::Tensor& beta) {
  return {x.use_gate_in_kernel ? g.contiguous() : g, x.use_beta_sigmoid_in_kernel ? beta.contiguous() : beta};
}

cuda::GateBetaParams gate_beta_params(const DeltaRuleArgs& x, const at::Tensor& g, const at::Tensor& beta) {
  cuda::GateBetaParams p;
  p.n = g.numel();
  p.HV = static_cast<int>(g.size(2));
  p.gate = x.use_gate_in_kernel;
  p.sigmoid = x.use_beta_sigmoid_in_kernel;
  p.beta_mul = x.allow_neg_eigval ? 2.f : 1.f;
  p.g = g.data_ptr();
  p.g_dtype = cuda::dtype_of(g.scalar_type(), "g");
  p.beta = beta.data_ptr();
  p.beta_dtype = cuda::dtype_of(beta.scalar_type(), "beta");
  if (x.use_gate_in_kernel) {
    p.A_log = x.A_log->data_ptr();
    p.A_dtype = cuda::dtype_of(x.A_log->scalar_type(), "A_log");
    if (x.dt_bias.has_value()) {
      p.dt_bias = x.dt_bias->data_ptr();
      p.dt_dtype = cuda::dtype_of(x.dt_bias->scalar_type(), "dt_bias");
    }
  }
  return p;
}
}  // namespace

GateBeta gate_beta_fwd_cuda(const DeltaRuleArgs& x, at::ScalarType cd) {
  if (!gate_beta_kernels_apply(x, cd)) return gate_beta_fwd_aten(x, cd);
  c10::cuda::CUDAGuard guard(x.g.device());
  const auto [g, beta] = dense_where_read(x, x.g, x.beta);
  cuda::GateBetaParams p = gate_beta_params(x, g, beta);
  GateBeta r;
  const auto f32 = g.options().dtype(at::kFloat);
  if (p.gate) r.g = at::empty(g.sizes(), f32);
  if (p.sigmoid) r.beta = at::empty(beta.sizes(), f32);
  p.g_out = p.gate ? r.g.data_ptr<float>() : nullptr;
  p.beta_out = p.sigmoid ? r.beta.data_ptr<float>() : nullptr;
  cuda::launch_gate_beta_fwd(p, num_sms(x.g), at::cuda::getCurrentCUDAStream().stream());
  return r;
}

GateBetaGrads gate_beta_bwd_cuda(const DeltaRuleArgs& x, const at::Tensor& dg, const at::Tensor& dbeta) {
  if (!gate_beta_kernels_apply(x, dg.scalar_type())) return gate_beta_bwd_aten(x, dg, dbeta);
  c10::cuda::CUDAGuard guard(x.g.device());
  const auto [g, beta] = dense_where_read(x, x.g, x.beta);
  const auto [dgc, dbc] = dense_where_read(x, dg, dbeta);
  cuda::GateBetaParams p = gate_beta_params(x, g, beta);
  GateBetaGrads r;
  at::Tensor partial;
  p.tokens_per_block = std::max(1, cuda::kGateBetaTile / p.HV);
  p.blocks = static_cast<int>((g.size(0) * g.size(1) + p.tokens_per_block - 1) / p.tokens_per_block);
  if (p.sigmoid) {
    r.dbeta = at::empty(beta.sizes(), beta.options());
    p.dbeta = dbc.data_ptr();
    p.dbeta_dtype = cuda::dtype_of(dbc.scalar_type(), "dbeta");
    p.dbeta_raw = r.dbeta.data_ptr();
  }
  if (p.gate) {
    r.dg = at::empty(g.sizes(), g.options());
    r.dA_log = at::empty({p.HV}, x.A_log->options());
    if (x.dt_bias.has_value()) r.ddt_bias = at::empty({p.HV}, x.dt_bias->options());
    partial = at::empty({std::max(1, p.blocks), 2, p.HV}, g.options().dtype(at::kFloat));
    p.dg = dgc.data_ptr<float>();
    p.dg_raw = r.dg.data_ptr();
    p.partial = partial.data_ptr<float>();
    p.dA_log = r.dA_log.data_ptr();
    p.ddt_bias = x.dt_bias.has_value() ? r.ddt_bias.data_ptr() : nullptr;
  }
  cuda::launch_gate_beta_bwd(p, at::cuda::getCurrentCUDAStream().stream());
  return r;
}

CoreGrads core_backward_cuda(const CoreArgs& a, const at::Tensor& d_o, const at::Tensor& d_final_state) {
  return backward_cuda(a, d_o, d_final_state, at::Tensor());
}

TORCH_LIBRARY_IMPL(gated_delta, CUDA, m) {
  m.impl("fwd", fwd_kernel<fwd_impl<core_forward_cuda, gate_beta_fwd_cuda>>);
  m.impl("fwd_with_residual", fwd_residual_kernel<fwd_residual_impl<core_forward_cuda, gate_beta_fwd_cuda>>);
  m.impl("bwd", bwd_kernel<bwd_impl<core_backward_cuda, gate_beta_fwd_cuda, gate_beta_bwd_cuda>>);
}

}  // namespace gated_delta
