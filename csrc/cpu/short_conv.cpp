// CPU kernels of the causal depthwise short convolution (+ SiLU):
//   y[t, d] = act(bias[d] + sum_{j<W} weight[d, j] * x[t - (W-1) + j, d])
// per sequence, where positions before the sequence's start read its initial conv state ([N, D, W-1], the last
// W-1 inputs before the sequence, oldest first) or zero. The final conv state holds the last W-1 inputs.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

#include "../checks.h"

namespace gated_delta {
namespace {

using OptTensor = c10::optional<at::Tensor>;

// One sequence of the (possibly packed) batch: batch row b, token range [start, end), sequence index n.
struct Seq {
  int64_t b, start, end, n;
};

std::vector<Seq> sequences(int64_t B, int64_t T, const OptTensor& cu_seqlens) {
  std::vector<Seq> seqs;
  if (cu_seqlens.has_value()) {
    const at::Tensor cu = cu_seqlens->to(at::kLong).contiguous();
    const int64_t* p = cu.data_ptr<int64_t>();
    for (int64_t n = 0; n + 1 < cu.size(0); ++n) seqs.push_back({0, p[n], p[n + 1], n});
  } else {
    for (int64_t b = 0; b < B; ++b) seqs.push_back({b, 0, T, b});
  }
  return seqs;
}

// Work items: token blocks of every sequence, so that parallel_for balances packed batches too.
struct Block {
  int64_t seq, t0, t1;
};

std::vector<Block> token_blocks(const std::vector<Seq>& seqs, int64_t block) {
  std::vector<Block> blocks;
  for (size_t i = 0; i < seqs.size(); ++i) {
    for (int64_t t = seqs[i].start; t < seqs[i].end; t += block) {
      blocks.push_back({static_cast<int64_t>(i), t, std::min(t + block, seqs[i].end)});
    }
  }
  return blocks;
}

constexpr int64_t kTokenBlock = 32;

// Read access to the inputs of one sequence extended to the left by its initial state.
template <typename scalar_t>
struct SeqInput {
  const scalar_t* x;   // [B, T, D] contiguous
  const scalar_t* h0;  // [N, D, W-1] contiguous, or nullptr (zeros)
  int64_t T, D, W;

  // Pointer to the row of inputs at position pos of sequence s (pos >= s.start), else nullptr.
  const scalar_t* row(const Seq& s, int64_t pos) const {
    return pos >= s.start ? x + (s.b * T + pos) * D : nullptr;
  }
  // The input at channel d, position pos < s.start (from the initial state).
  scalar_t before(const Seq& s, int64_t pos, int64_t d) const {
    return h0 != nullptr ? h0[(s.n * D + d) * (W - 1) + (W - 1) + (pos - s.start)] : scalar_t(0);
  }
};

// Pre-activation z = bias + conv, for the tokens [t0, t1) of sequence s, into z ([t1 - t0, D], acc_t).
template <typename scalar_t, typename acc_t>
void conv_rows(const SeqInput<scalar_t>& in, const acc_t* wt /* [W, D] */, const acc_t* bias, const Seq& s,
               int64_t t0, int64_t t1, acc_t* z) {
  const int64_t D = in.D, W = in.W;
  for (int64_t t = t0; t < t1; ++t) {
    acc_t* zr = z + (t - t0) * D;
    for (int64_t d = 0; d < D; ++d) zr[d] = bias != nullptr ? bias[d] : acc_t(0);
    for (int64_t j = 0; j < W; ++j) {
      const int64_t pos = t - (W - 1) + j;
      const acc_t* wj = wt + j * D;
      if (const scalar_t* xr = in.row(s, pos)) {
        for (int64_t d = 0; d < D; ++d) zr[d] += wj[d] * static_cast<acc_t>(xr[d]);
      } else if (in.h0 != nullptr) {
        for (int64_t d = 0; d < D; ++d) zr[d] += wj[d] * static_cast<acc_t>(in.before(s, pos, d));
      }
    }
  }
}

// What the forward and backward read: the inputs of every sequence, the weight as [W, D] rows in acc_t
// (channel-contiguous for the inner loops) and the bias in acc_t (owned here, so the pointers stay valid).
template <typename scalar_t>
struct ConvOperands {
  using acc_t = at::opmath_type<scalar_t>;
  at::Tensor wt, bc;
  SeqInput<scalar_t> in;
  const acc_t* wp;
  const acc_t* bp;

  ConvOperands(const at::Tensor& xc, const at::Tensor& h0, const at::Tensor& weight, const OptTensor& bias,
               at::ScalarType acc, int64_t T, int64_t D, int64_t W)
      : wt(weight.to(acc).t().contiguous()),
        bc(bias.has_value() ? bias->to(acc).contiguous() : at::Tensor()),
        in{xc.data_ptr<scalar_t>(), h0.defined() ? h0.data_ptr<scalar_t>() : nullptr, T, D, W},
        wp(wt.data_ptr<acc_t>()),
        bp(bc.defined() ? bc.data_ptr<acc_t>() : nullptr) {}

  // The pre-activation of every token of every sequence into out [B, T, D], block by block in parallel.
  void pre_activation(const std::vector<Seq>& seqs, const std::vector<Block>& blocks, acc_t* out) const {
    at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) {
        const Block& blk = blocks[i];
        const Seq& s = seqs[blk.seq];
        conv_rows(in, wp, bp, s, blk.t0, blk.t1, out + (s.b * in.T + blk.t0) * in.D);
      }
    });
  }
};

std::tuple<at::Tensor, at::Tensor> short_conv_fwd_cpu(const at::Tensor& x, const at::Tensor& weight,
                                                      const OptTensor& bias, const OptTensor& initial_state,
                                                      const OptTensor& cu_seqlens, bool output_final_state,
                                                      bool use_silu) {
  const ConvSizes sz = check_short_conv_args(x, weight, bias, initial_state, cu_seqlens);
  const int64_t B = sz.B, T = sz.T, D = sz.D, W = sz.W, N = sz.N;
  const at::Tensor xc = x.contiguous();
  const at::Tensor h0 = initial_state.has_value() ? initial_state->contiguous() : at::Tensor();
  const auto seqs = sequences(B, T, cu_seqlens);
  const auto blocks = token_blocks(seqs, kTokenBlock);
  const at::ScalarType acc = acc_dtype(x.scalar_type());
  at::Tensor z = at::empty({B, T, D}, x.options().dtype(acc));  // pre-activation, in the accumulation dtype
  at::Tensor final_state =
      output_final_state ? at::empty({N, D, W - 1}, x.options()) : at::empty({0}, x.options());

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "short_conv_fwd_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const ConvOperands<scalar_t> ops(xc, h0, weight, bias, acc, T, D, W);
    acc_t* zp = z.data_ptr<acc_t>();
    const SeqInput<scalar_t>& in = ops.in;
    ops.pre_activation(seqs, blocks, zp);
    if (output_final_state && W > 1) {
      scalar_t* fp = final_state.data_ptr<scalar_t>();
      for (const Seq& s : seqs) {
        for (int64_t j = 0; j < W - 1; ++j) {
          const int64_t pos = s.end - (W - 1) + j;
          const scalar_t* xr = in.row(s, pos);
          for (int64_t d = 0; d < D; ++d) {
            fp[(s.n * D + d) * (W - 1) + j] = xr != nullptr ? xr[d] : in.before(s, pos, d);
          }
        }
      }
    }
  });
  // The activation with ATen's vectorised kernel; the cast is a no-op for fp32 / fp64 inputs.
  if (use_silu) at::silu_(z);
  return {z.to(x.scalar_type()), final_state};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> short_conv_bwd_cpu(
    const at::Tensor& dy, const OptTensor& d_final_state, const at::Tensor& x, const at::Tensor& weight,
    const OptTensor& bias, const OptTensor& initial_state, const OptTensor& cu_seqlens, bool use_silu) {
  const ConvSizes sz = check_short_conv_args(x, weight, bias, initial_state, cu_seqlens);
  const int64_t B = sz.B, T = sz.T, D = sz.D, W = sz.W, N = sz.N;
  const at::Tensor dfs = check_short_conv_grads(x, sz, dy, d_final_state);
  const at::ScalarType acc = acc_dtype(x.scalar_type());
  const at::Tensor xc = x.contiguous();
  const at::Tensor dyc = dy.to(acc).contiguous();
  const at::Tensor dfc = dfs.defined() ? dfs.to(acc).contiguous() : at::Tensor();
  const at::Tensor h0 = initial_state.has_value() ? initial_state->contiguous() : at::Tensor();
  at::Tensor dz = at::empty({B, T, D}, x.options().dtype(acc));
  at::Tensor dx = at::empty({B, T, D}, x.options());
  at::Tensor dwt = at::zeros({W + 1, D}, x.options().dtype(acc));  // rows 0..W-1: weight taps, row W: bias
  at::Tensor dh0 = initial_state.has_value() ? at::empty({N, D, W - 1}, x.options()) : at::empty({0}, x.options());
  const auto seqs = sequences(B, T, cu_seqlens);
  const auto blocks = token_blocks(seqs, kTokenBlock);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "short_conv_bwd_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const ConvOperands<scalar_t> ops(xc, h0, weight, bias, acc, T, D, W);
    const SeqInput<scalar_t>& in = ops.in;
    const acc_t* wp = ops.wp;
    const acc_t* dfp = dfc.defined() ? dfc.data_ptr<acc_t>() : nullptr;
    acc_t* dzp = dz.data_ptr<acc_t>();

    // dz = dy * act'(z), z recomputed (into dz, then replaced by ATen's vectorised silu_backward).
    if (use_silu) {
      ops.pre_activation(seqs, blocks, dzp);
      dz.copy_(at::silu_backward(dyc, dz));
    } else {
      dz.copy_(dyc);
    }

    // Gradient of the input at position pos (in [start - (W-1), end)) of sequence s, channel range [0, D):
    //   sum_j w[j] dz[pos + (W-1) - j] over outputs inside the sequence, + d_final_state where pos is kept.
    auto input_grad = [&](const Seq& s, int64_t pos, acc_t* g) {
      for (int64_t d = 0; d < D; ++d) g[d] = acc_t(0);
      for (int64_t j = 0; j < W; ++j) {
        const int64_t t = pos + (W - 1) - j;
        if (t < s.start || t >= s.end) continue;
        const acc_t* wj = wp + j * D;
        const acc_t* dzr = dzp + (s.b * T + t) * D;
        for (int64_t d = 0; d < D; ++d) g[d] += wj[d] * dzr[d];
      }
      const int64_t keep = pos - (s.end - (W - 1));  // index into the final state, when >= 0
      if (dfp != nullptr && keep >= 0) {
        for (int64_t d = 0; d < D; ++d) g[d] += dfp[(s.n * D + d) * (W - 1) + keep];
      }
    };

    scalar_t* dxp = dx.data_ptr<scalar_t>();
    at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t lo, int64_t hi) {
      std::vector<acc_t> g(D);
      for (int64_t i = lo; i < hi; ++i) {
        const Block& blk = blocks[i];
        const Seq& s = seqs[blk.seq];
        for (int64_t t = blk.t0; t < blk.t1; ++t) {
          input_grad(s, t, g.data());
          scalar_t* r = dxp + (s.b * T + t) * D;
          for (int64_t d = 0; d < D; ++d) r[d] = static_cast<scalar_t>(g[d]);
        }
      }
    });
    if (h0.defined() && W > 1) {
      scalar_t* dhp = dh0.data_ptr<scalar_t>();
      std::vector<acc_t> g(D);
      for (const Seq& s : seqs) {
        for (int64_t i = 0; i < W - 1; ++i) {
          input_grad(s, s.start - (W - 1) + i, g.data());
          for (int64_t d = 0; d < D; ++d) dhp[(s.n * D + d) * (W - 1) + i] = static_cast<scalar_t>(g[d]);
        }
      }
    }

    // dweight[j, d] = sum_t dz[t, d] * x[t - (W-1) + j, d];  dbias[d] = sum_t dz[t, d]. Each task owns a channel
    // range, so the sums are race-free and deterministic.
    acc_t* dwp = dwt.data_ptr<acc_t>();
    at::parallel_for(0, D, 64, [&](int64_t d0, int64_t d1) {
      for (const Seq& s : seqs) {
        for (int64_t t = s.start; t < s.end; ++t) {
          const acc_t* dzr = dzp + (s.b * T + t) * D;
          for (int64_t j = 0; j < W; ++j) {
            const int64_t pos = t - (W - 1) + j;
            acc_t* dwj = dwp + j * D;
            if (const scalar_t* xr = in.row(s, pos)) {
              for (int64_t d = d0; d < d1; ++d) dwj[d] += dzr[d] * static_cast<acc_t>(xr[d]);
            } else if (in.h0 != nullptr) {
              for (int64_t d = d0; d < d1; ++d) dwj[d] += dzr[d] * static_cast<acc_t>(in.before(s, pos, d));
            }
          }
          acc_t* dbr = dwp + W * D;
          for (int64_t d = d0; d < d1; ++d) dbr[d] += dzr[d];
        }
      }
    });
  });
  at::Tensor dweight = dwt.narrow(0, 0, W).t().to(weight.scalar_type()).contiguous();
  at::Tensor dbias =
      bias.has_value() ? dwt.select(0, W).to(bias->scalar_type(), /*non_blocking=*/false, /*copy=*/true)
                                       : at::empty({0}, weight.options());
  return {dx, dweight, dbias, dh0};
}

at::Tensor short_conv_update_cpu(const at::Tensor& x, at::Tensor& conv_state, const at::Tensor& weight,
                                 const OptTensor& bias, bool use_silu) {
  const ConvSizes sz = check_short_conv_update_args(x, conv_state, weight, bias);
  const int64_t B = sz.B, T = sz.T, D = sz.D, W = sz.W;
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({B, T, D}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "short_conv_update_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const at::ScalarType acc = c10::CppTypeToScalarType<acc_t>::value;
    const at::Tensor wc = weight.to(acc).contiguous();
    const at::Tensor bc = bias.has_value() ? bias->to(acc).contiguous() : at::Tensor();
    const acc_t* wp = wc.data_ptr<acc_t>();
    const acc_t* bp = bc.defined() ? bc.data_ptr<acc_t>() : nullptr;
    const scalar_t* xp = xc.data_ptr<scalar_t>();
    scalar_t* sp = conv_state.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, B * D, 256, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) {
        const int64_t b = i / D, d = i % D;
        scalar_t* st = sp + i * (W - 1);  // the last W-1 inputs, oldest first
        const acc_t* w = wp + d * W;
        for (int64_t t = 0; t < T; ++t) {
          const scalar_t xt = xp[(b * T + t) * D + d];
          acc_t z = bp != nullptr ? bp[d] : acc_t(0);
          for (int64_t j = 0; j < W - 1; ++j) z += w[j] * static_cast<acc_t>(st[j]);
          z += w[W - 1] * static_cast<acc_t>(xt);
          for (int64_t j = 0; j + 1 < W - 1; ++j) st[j] = st[j + 1];
          if (W > 1) st[W - 2] = xt;
          yp[(b * T + t) * D + d] = static_cast<scalar_t>(use_silu ? z / (acc_t(1) + std::exp(-z)) : z);
        }
      }
    });
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(gated_delta, CPU, m) {
  m.impl("short_conv_fwd", &short_conv_fwd_cpu);
  m.impl("short_conv_bwd", &short_conv_bwd_cpu);
  m.impl("short_conv_update", &short_conv_update_cpu);
}

}  // namespace gated_delta
